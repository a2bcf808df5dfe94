"""Batched segments: the records of many small tensors in a fixed number of kernels.

On a step with many small tensors (biases, norms' scales), what costs is
``tensor_stats``' kernels and branches per tensor, not the values:
``many_stats`` concatenates them and reduces by segment.
"""

from __future__ import annotations

import numpy as np

from tb_numerics import _requires

tf = _requires.tensorflow(__name__)

from tb_numerics import metadata  # noqa: E402
from tb_numerics._stats_core import ACC_DTYPE, VIEWS, bits_to_float64, flatten, float_bits, in_order, sq_norm  # noqa: E402

__all__ = ["SMALL_TENSOR", "held_to_float32", "is_small", "many_stats", "sq_norms"]


# Tensors of at most this many elements (statically known) are reduced
# together by ``many_stats``; larger ones by ``tensor_stats`` each, whose
# healthy path needs no elementwise pass over them.
SMALL_TENSOR = 4096
_INT_LIMITS = {tf.int32: (np.iinfo(np.int32).min, np.iinfo(np.int32).max),
               tf.int64: (np.iinfo(np.int64).min, np.iinfo(np.int64).max)}


def is_small(x: tf.Tensor) -> bool:
    """Whether ``many_stats`` should take ``x`` (a static size of at most ``SMALL_TENSOR``)."""
    n = x.shape.num_elements()
    return n is not None and n <= SMALL_TENSOR


def many_stats(tensors: list[tf.Tensor], dtypes: list[str]) -> tf.Tensor:
    """The records ``[k, NUM_FIELDS]`` of small float tensors, reduced together.

    The same values as ``tensor_stats`` of each (counts, min and max exactly,
    subnormals too; sums in float64), in a fixed number of kernels whatever
    ``k``: the tensors of each accumulation dtype are concatenated and
    reduced by segment (one segment sum of the counts and sums, one segment
    min and max of an integer key ordered as the floats). On many small
    tensors per step that is what costs: ``tensor_stats``' kernels and
    branches, not the values. ``dtypes`` are the tensors' dtype names
    (``check_dtype``), for their margins.
    """
    rows: list[tf.Tensor] = []
    where: list[int] = []
    for acc in (tf.float32, tf.float64):
        part = [i for i, d in enumerate(dtypes) if ACC_DTYPE[d] == acc]
        if part:
            rows.append(_segment_stats([tensors[i] for i in part], [dtypes[i] for i in part], acc))
            where += part
    return in_order(rows, where)


def sq_norms(tensors: list[tf.Tensor]) -> tf.Tensor:
    """||x||^2 of each of ``tensors``, a float64 vector in their order.

    The small ones (``is_small``) are squared and summed together, by
    segment, in float64, in a fixed number of kernels; the others take one
    dot product each (``sq_norm``). On ResNet-50's 214 variables, 161 of
    them small, the update ratios' norms were 428 dot products, each a
    handful of ops to trace before the first step.

    Args:
      tensors: float tensors.
    """
    small = [i for i, x in enumerate(tensors) if is_small(x)]
    large = [i for i, x in enumerate(tensors) if not is_small(x)]
    parts = []
    if small:
        flats = [flatten(tf.cast(tensors[i], tf.float64)) for i in small]
        seg = tf.constant(np.repeat(np.arange(len(small), dtype=np.int32), [f.shape.num_elements() for f in flats]))
        values = tf.concat(flats, 0) if len(flats) > 1 else flats[0]
        parts.append(tf.math.unsorted_segment_sum(values * values, seg, len(small)))
    if large:
        parts.append(tf.stack([sq_norm(tensors[i]) for i in large]))
    if not parts:
        return tf.zeros([0], tf.float64)
    return in_order(parts, small + large)


def _segment_stats(tensors: list[tf.Tensor], dtypes: list[str], acc: tf.DType) -> tf.Tensor:
    """``many_stats`` of tensors of one accumulation dtype."""
    int_t, _, sign_bit = VIEWS[acc]
    mask = sign_bit - 1
    lowest, highest = _INT_LIMITS[int_t]
    k = len(tensors)
    flats = [flatten(tf.cast(x, acc) if x.dtype != acc else x) for x in tensors]
    sizes = [f.shape.num_elements() for f in flats]
    seg = tf.constant(np.repeat(np.arange(k, dtype=np.int32), sizes))
    values = tf.concat(flats, 0) if k > 1 else flats[0]
    bits = tf.bitcast(values, int_t)
    mag = tf.bitwise.bitwise_and(bits, tf.constant(mask, int_t))
    inf_bits = float_bits(np.inf, acc)
    finite = mag < inf_bits
    inf = tf.equal(mag, inf_bits)
    tiny = np.repeat([float_bits(metadata.smallest_normal(d), acc) for d in dtypes], sizes).astype(int_t.as_numpy_dtype)
    margin = np.repeat([metadata.overflow_margin(d) for d in dtypes], sizes)
    x64 = tf.cast(tf.where(finite, values, tf.zeros_like(values)), tf.float64)
    flags = tf.cast(
        tf.stack([mag > inf_bits, inf & (bits >= 0), inf & (bits < 0), tf.equal(mag, 0),
                  finite & (tf.abs(x64) > margin), (mag > 0) & (mag < tiny)], axis=1),
        tf.float64,
    )
    sums = tf.math.unsorted_segment_sum(tf.concat([flags, tf.stack([x64, x64 * x64], axis=1)], 1), seg, k)
    # Floats order as these integers: negatives' magnitude bits flipped.
    key = tf.where(bits < 0, tf.bitwise.bitwise_xor(bits, tf.constant(mask, int_t)), bits)
    lo = tf.math.unsorted_segment_min(tf.where(finite, key, tf.constant(highest, int_t)), seg, k)
    hi = tf.math.unsorted_segment_max(tf.where(finite, key, tf.constant(lowest, int_t)), seg, k)
    lo_hi = tf.stack([lo, hi], axis=1)
    lo_hi_bits = tf.where(lo_hi < 0, tf.bitwise.bitwise_xor(lo_hi, tf.constant(mask, int_t)), lo_hi)
    _, uint_t, _ = VIEWS[acc]
    lo_hi = tf.reshape(bits_to_float64(tf.bitcast(tf.reshape(lo_hi_bits, [-1]), uint_t), acc), [k, 2])
    count = tf.constant(np.asarray(sizes, np.float64))
    any_finite = (count - sums[:, 0] - sums[:, 1] - sums[:, 2]) > 0
    lo_hi = tf.where(any_finite[:, None], lo_hi, tf.constant(np.nan, tf.float64))
    records = tf.stack(
        [count, sums[:, 0], sums[:, 1], sums[:, 2], lo_hi[:, 0], lo_hi[:, 1],
         sums[:, 6], sums[:, 7], sums[:, 3], sums[:, 4], sums[:, 5]],
        axis=1,
    )
    return held_to_float32(records) if acc == tf.float32 else records


def held_to_float32(records: tf.Tensor) -> tf.Tensor:
    """Small float32 tensors' records ``[k, NUM_FIELDS]`` with the sums of
    each finite one held to float32, as ``tensor_stats``' healthy path
    accumulates them, so that the packed events that hold them stay float32
    (half the bytes); float64 where float32 cannot hold them or a value is
    not finite. Counts (at most ``SMALL_TENSOR``) and extrema are float32
    values already."""
    as32 = tf.cast(tf.cast(records, tf.float32), tf.float64)
    f = metadata.FIELD_INDEX
    nonfinite = records[:, f["nan"]] + records[:, f["posinf"]] + records[:, f["neginf"]]
    healthy = tf.reduce_all(tf.math.is_finite(as32), axis=1, keepdims=True) & (nonfinite[:, None] == 0)
    return tf.where(healthy, as32, records)
