"""On-device statistics of one tensor: the numerics record, in TensorFlow.

``tensor_stats(x, name)`` returns the float64 vector of ``metadata.FIELDS``
for a float tensor, computed with ordinary TensorFlow reductions (no
``py_function``, no host round trip), so it runs inside a traced or
``jit_compile``'d step and its result can be written there or outside.
``record_writer.numpy_stats`` is the reference it agrees with: counts and
extrema exactly, sums to the accumulation precision.

Cost is the design constraint: every layer output and gradient may be logged
every step. The healthy path is a handful of plain reductions whose results
double as the finite check (a sum of squares is finite only if no element is
NaN or Inf and no square overflows); only a tensor that fails it pays for the
exact NaN/+Inf/-Inf counts and the masked statistics, inside a ``tf.cond``.

Accumulation is in float32 for float16, bfloat16 and float32 tensors and in
float64 for float64 ones. Zero and underflow counts come from the bit
patterns, not from float compares: TensorFlow on x86 CPUs runs with
denormals-are-zero, so ``x == 0`` is true for a float32 subnormal there.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tb_numerics import metadata

F = metadata.FIELD_INDEX

# The bits of a float's magnitude (sign cleared), the integer type holding
# them, and the magnitude bits of the smallest normal of the tensor's own
# dtype, once the tensor is in its accumulation dtype.
_ACC_DTYPE = {
    "float16": tf.float32,
    "bfloat16": tf.float32,
    "float32": tf.float32,
    "float64": tf.float64,
}


def _magnitude_bits_of(value: float, acc: tf.DType) -> int:
    if acc == tf.float64:
        return int(np.array(value, np.float64).view(np.int64))
    return int(np.array(value, np.float32).view(np.int32))


def check_dtype(x: tf.Tensor, name: str) -> str:
    """The dtype name of ``x`` if numerics are defined for it.

    Raises:
      TypeError: naming the tensor, for integer, bool, string, complex and
        other non-float tensors.
    """
    dtype = x.dtype.base_dtype.name
    if dtype not in _ACC_DTYPE:
        raise TypeError(
            "tb_numerics: cannot record numerics of %r: its dtype is %s; only "
            "float16, bfloat16, float32 and float64 tensors are supported"
            % (name, dtype)
        )
    return dtype


def tensor_stats(x: tf.Tensor, name: str) -> tf.Tensor:
    """The numerics record of float tensor ``x``: float64 ``[NUM_FIELDS]``.

    ``name`` only names the tensor in errors. Finite statistics (min, max,
    sum, sum of squares) are over the finite elements; min and max are NaN
    where there are none (an empty or all-NaN tensor).

    Raises:
      TypeError: ``x`` is not a float16, bfloat16, float32 or float64 tensor.
    """
    x = tf.convert_to_tensor(x)
    dtype = check_dtype(x, name)
    acc = _ACC_DTYPE[dtype]
    int_t = tf.int64 if acc == tf.float64 else tf.int32
    sign_mask = 0x7FFFFFFFFFFFFFFF if acc == tf.float64 else 0x7FFFFFFF
    tiny_bits = _magnitude_bits_of(metadata.smallest_normal(dtype), acc)
    margin = metadata.overflow_margin(dtype)

    with tf.name_scope("tensor_stats"):
        flat = tf.reshape(tf.cast(x, acc) if x.dtype != acc else x, [-1])
        n = tf.cast(tf.size(flat, out_type=tf.int64), tf.float64)
        # Magnitude bits: 0 for +-0, below tiny_bits for subnormal
        # (underflow) values, whatever the CPU's denormal mode.
        mag = tf.bitwise.bitwise_and(tf.bitcast(flat, int_t), tf.constant(sign_mask, int_t))
        zeros = _count(tf.equal(mag, 0))
        small = _count(tf.less(mag, tiny_bits))
        underflow = small - zeros

        total = tf.reduce_sum(flat)
        total_sq = tf.reduce_sum(tf.square(flat))
        lo = tf.reduce_min(flat)
        hi = tf.reduce_max(flat)

        def healthy():
            # total_sq is finite: no NaN or Inf, and no |x| near the dtype's
            # largest value except for float16 (accumulated in float32).
            if dtype == "float16":
                max_abs = tf.maximum(-lo, hi)
                overflow = tf.cond(
                    max_abs > margin,
                    lambda: _count(tf.abs(flat) > margin),
                    lambda: tf.constant(0.0, tf.float64),
                )
            else:
                overflow = tf.constant(0.0, tf.float64)
            empty = tf.equal(n, 0.0)
            nan = tf.constant(np.nan, tf.float64)
            z = tf.constant(0.0, tf.float64)
            return tf.stack(
                [
                    n, z, z, z,
                    tf.where(empty, nan, tf.cast(lo, tf.float64)),
                    tf.where(empty, nan, tf.cast(hi, tf.float64)),
                    tf.cast(total, tf.float64),
                    tf.cast(total_sq, tf.float64),
                    zeros, overflow, underflow,
                ]
            )

        def unhealthy():
            # Some element is NaN or Inf, or a square overflowed: redo the
            # sums over the finite elements only, in float64.
            finite = tf.math.is_finite(flat)
            x64 = tf.cast(tf.where(finite, flat, tf.zeros_like(flat)), tf.float64)
            inf = tf.constant(np.inf, acc)
            lo_f = tf.reduce_min(tf.where(finite, flat, inf))
            hi_f = tf.reduce_max(tf.where(finite, flat, -inf))
            any_finite = tf.reduce_any(finite)
            nan = tf.constant(np.nan, tf.float64)
            return tf.stack(
                [
                    n,
                    _count(tf.math.is_nan(flat)),
                    _count(tf.equal(flat, inf)),
                    _count(tf.equal(flat, -inf)),
                    tf.where(any_finite, tf.cast(lo_f, tf.float64), nan),
                    tf.where(any_finite, tf.cast(hi_f, tf.float64), nan),
                    tf.reduce_sum(x64),
                    tf.reduce_sum(tf.square(x64)),
                    zeros,
                    _count(tf.logical_and(finite, tf.abs(flat) > margin)),
                    underflow,
                ]
            )

        return tf.cond(tf.math.is_finite(total_sq), healthy, unhealthy)


def _count(mask: tf.Tensor) -> tf.Tensor:
    """The number of true elements of ``mask``, exactly, as float64."""
    return tf.cast(tf.math.count_nonzero(mask, dtype=tf.int64), tf.float64)


def merge_stats(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    """The record of the concatenation of two tensors from their records.

    Counts and sums add; min and max are the min of the mins and the max of
    the maxes, where NaN (no finite value on that side) does not win.
    """
    a = tf.convert_to_tensor(a, tf.float64)
    b = tf.convert_to_tensor(b, tf.float64)
    is_min = np.zeros(metadata.NUM_FIELDS, bool)
    is_max = np.zeros(metadata.NUM_FIELDS, bool)
    is_min[F["min"]] = True
    is_max[F["max"]] = True
    lo = _nan_aware(tf.minimum, a, b)
    hi = _nan_aware(tf.maximum, a, b)
    return tf.where(is_min, lo, tf.where(is_max, hi, a + b))


def _nan_aware(op, a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    return tf.where(tf.math.is_nan(a), b, tf.where(tf.math.is_nan(b), a, op(a, b)))


_SUM_FIELDS = [i for i, f in enumerate(metadata.FIELDS) if f not in ("min", "max")]


def all_reduce_stats(stats: tf.Tensor, replica_context: tf.distribute.ReplicaContext) -> tf.Tensor:
    """Combines each replica's record into the record of all their values.

    Call in replica context (inside ``strategy.run``); every replica gets the
    combined record. Two all-reduces: SUM of the counts and sums, and MIN of
    (min, -max), with "no finite value" (NaN) taken as +Inf so that it never
    wins, and turned back into NaN afterwards.
    """
    sums = replica_context.all_reduce(
        tf.distribute.ReduceOp.SUM, tf.gather(stats, _SUM_FIELDS)
    )
    inf = tf.constant(np.inf, tf.float64)
    ext = tf.stack([stats[F["min"]], -stats[F["max"]]])
    ext = replica_context.all_reduce(
        tf.distribute.ReduceOp.MIN, tf.where(tf.math.is_nan(ext), inf, ext)
    )
    ext = tf.where(tf.math.is_inf(ext), tf.constant(np.nan, tf.float64), ext)
    parts = tf.unstack(sums)
    parts.insert(F["min"], ext[0])
    parts.insert(F["max"], -ext[1])
    return tf.stack(parts)
