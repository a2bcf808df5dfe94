"""The op record: the lighter statistics ``op_numerics`` writes for every op output.

``op_stats`` (re-exported by ``stats``) keeps the layer record's layout
and its exact counts and extrema, and leaves out the sums, zeros and
underflow, each of which would cost every op output another pass.
"""

from __future__ import annotations

import functools
from typing import Callable

import numpy as np

from tb_numerics import _requires

tf = _requires.tensorflow(__name__)

from tb_numerics import metadata  # noqa: E402
from tb_numerics._stats_core import (  # noqa: E402
    ACC_DTYPE,
    VIEWS,
    bits_to_float64,
    check_dtype,
    count_true,
    finite_min_max,
    float_bits,
    make_record,
    noinline_function,
    nonfinite_fields,
    overflow_count,
)

__all__ = ["op_stats"]


@functools.cache
def _traced_op(dtype: str) -> Callable[[tf.Tensor], tf.Tensor]:
    """``op_stats`` of a 1-D tensor of ``dtype``."""
    return noinline_function(functools.partial(_op_stats_flat, dtype=dtype), tf.TensorSpec([None], tf.as_dtype(dtype)))


def op_stats(x: tf.Tensor, name: str) -> tf.Tensor:
    """The lighter record ``op_numerics`` writes for every op output.

    The same float64 ``[NUM_FIELDS]`` layout as ``tensor_stats``, and the
    same values for count, the NaN / +Inf / -Inf counts, min, max (exact,
    subnormals too) and the overflow count. Not computed: the sum and the
    sum of squares, always NaN (so the derived mean, std and L2 norm are
    NaN: "not recorded"), and the zero and underflow counts, always 0 (0,
    not NaN, keeps the counts valid for the analysis and raises no underflow
    warning). An op-level record is there to name the op where a value first
    goes non-finite or beyond the overflow margin, which needs none of them,
    and each costs every op output another pass over its values (zeros and
    underflow, elementwise ones, in every tensor that holds a zero, such as
    ReLU gradients).

    How: two plain reductions, a few scalar ops and one branch per tensor
    that is finite and has both signs (most op outputs): the max of the
    tensor's bits viewed as signed and as unsigned integers. As signed
    integers the non-negative floats order by value above all negative ones,
    so the signed max is the largest non-negative element (where there is
    one); as unsigned integers the negative floats order by magnitude above
    all non-negative ones, so the unsigned max is the most negative element
    (where there is one). The non-finite patterns are the largest of either
    order, so the same two maxima tell whether any element is NaN or Inf.
    Only the other tensors take the second branch: one of a single sign pays
    the unsigned min (its other extreme), a non-finite one the masked counts,
    one beyond the overflow margin its count.

    Raises:
      TypeError: ``x`` is not a float16, bfloat16, float32 or float64 tensor.
    """
    x = tf.convert_to_tensor(x)
    dtype = check_dtype(x, name)
    with tf.name_scope("op_stats"):
        return _traced_op(dtype)(tf.reshape(tf.stop_gradient(x), [-1]))


def _op_stats_flat(flat: tf.Tensor, dtype: str) -> tf.Tensor:
    """``op_stats`` of a 1-D tensor of ``dtype``."""
    acc = ACC_DTYPE[dtype]
    if flat.dtype != acc:
        flat = tf.cast(flat, acc)
    int_t, uint_t, sign_bit = VIEWS[acc]
    inf_bits = float_bits(np.inf, acc)
    margin = metadata.overflow_margin(dtype)
    n = tf.cast(tf.size(flat, out_type=tf.int64), tf.float64)  # int32 would refuse 2**31 elements
    unsigned = tf.bitcast(flat, uint_t)
    u_max = tf.reduce_max(unsigned)
    s_max = tf.reduce_max(tf.bitcast(flat, int_t))
    # Where both signs are present, min = u_max and max = s_max.
    lo_hi = bits_to_float64(tf.stack([u_max, tf.bitcast(s_max, uint_t)]), acc)
    common = tf.reduce_all(
        tf.stack([
            u_max >= tf.constant(sign_bit, uint_t),  # some sign bit set (-0 too)
            s_max >= 0,  # some sign bit clear
            s_max < tf.constant(inf_bits, int_t),  # no +Inf, no NaN with the sign bit clear
            u_max < tf.constant(sign_bit | inf_bits, uint_t),  # no -Inf, no NaN with it set
            tf.reduce_max(tf.abs(lo_hi)) <= margin,
        ])
    )
    fast = _op_record(n, lo_hi)
    return tf.cond(
        common,
        lambda: fast,
        lambda: _op_stats_other(flat, n, u_max, s_max, acc, margin),
    )


def _op_record(n: tf.Tensor, lo_hi: tf.Tensor, **counts: tf.Tensor) -> tf.Tensor:
    """An ``op_stats`` record: count, float64 ``[min, max]`` and the given
    ``nan`` / ``posinf`` / ``neginf`` / ``overflow`` counts (0 where not
    given); sums NaN (not recorded), zeros and underflow 0 (not counted)."""
    z = tf.constant(0.0, tf.float64)
    nan = tf.constant(np.nan, tf.float64)
    fields = {"nan": z, "posinf": z, "neginf": z, "overflow": z, **counts}
    return make_record({
        "count": n, "min": lo_hi[0], "max": lo_hi[1], "sum": nan, "sum_sq": nan,
        "zeros": z, "underflow": z, **fields,
    })


def _op_stats_other(
    flat: tf.Tensor, n: tf.Tensor, u_max: tf.Tensor, s_max: tf.Tensor, acc: tf.DType, margin: float
) -> tf.Tensor:
    """``op_stats`` of a tensor that is not finite with both signs."""
    int_t, uint_t, sign_bit = VIEWS[acc]
    inf_bits = float_bits(np.inf, acc)
    finite = tf.logical_and(
        s_max < tf.constant(inf_bits, int_t),
        u_max < tf.constant(sign_bit | inf_bits, uint_t),
    )
    return tf.cond(
        finite,
        lambda: _op_stats_one_sign(flat, n, u_max, s_max, acc, margin),
        lambda: _op_stats_nonfinite(flat, n, acc, margin),
    )


def _op_stats_one_sign(
    flat: tf.Tensor, n: tf.Tensor, u_max: tf.Tensor, s_max: tf.Tensor, acc: tf.DType, margin: float
) -> tf.Tensor:
    """``op_stats`` of a finite tensor of one sign only (or none: empty), or
    beyond the overflow margin: the other extreme is the unsigned min. An
    empty tensor has both = the largest unsigned value, a NaN."""
    uint_t, sign_bit = VIEWS[acc][1:]
    u_min = tf.reduce_min(tf.bitcast(flat, uint_t))
    lo_hi = bits_to_float64(
        tf.stack([
            tf.where(u_max >= tf.constant(sign_bit, uint_t), u_max, u_min),
            tf.where(s_max >= 0, tf.bitcast(s_max, uint_t), u_min),
        ]),
        acc,
    )
    overflow = tf.cond(
        tf.reduce_max(tf.abs(lo_hi)) > margin,
        lambda: count_true(tf.abs(flat) > margin),
        lambda: tf.constant(0.0, tf.float64),
    )
    return _op_record(n, lo_hi, overflow=overflow)


def _op_stats_nonfinite(flat: tf.Tensor, n: tf.Tensor, acc: tf.DType, margin: float) -> tf.Tensor:
    """``op_stats`` of a tensor with a NaN or Inf: count them, and min and max
    over the finite ones."""
    is_finite = tf.math.is_finite(flat)
    return _op_record(
        n,
        finite_min_max(flat, is_finite, acc),
        overflow=overflow_count(flat, is_finite, margin),
        **nonfinite_fields(flat),
    )
