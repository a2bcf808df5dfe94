"""On-device statistics of one tensor: the numerics record, in TensorFlow.

``tensor_stats(x, name)`` returns the float64 vector of ``metadata.FIELDS``
for a float tensor, computed with ordinary TensorFlow reductions (no
``py_function``, no host round trip), so it runs inside a traced or
``jit_compile``'d step and its result can be written there or outside.
Where a GPU is visible, each record is compiled with XLA (see ``_traced``).
``records.numpy_stats`` is the reference it agrees with: counts and
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

import dataclasses
import functools
from typing import Any, Callable, Mapping

import numpy as np

from tb_numerics import _requires

tf = _requires.tensorflow(__name__)

from tb_numerics import metadata  # noqa: E402
from tb_numerics.records import F

__all__ = [
    "all_reduce_many_stats",
    "all_reduce_stats",
    "check_dtype",
    "combine_replicas",
    "combine_stats",
    "gather_replicas",
    "merge_stats",
    "op_stats",
    "replica_context",
    "sq_norm",
    "tensor_stats",
    "tensor_stats_and_sum",
]

_ACC_DTYPE = {
    "float16": tf.float32,
    "bfloat16": tf.float32,
    "float32": tf.float32,
    "float64": tf.float64,
}
# Signed and unsigned integer views of each accumulation dtype, and its sign bit.
_VIEWS = {
    tf.float32: (tf.int32, tf.uint32, 1 << 31),
    tf.float64: (tf.int64, tf.uint64, 1 << 63),
}


def _bits(value: float, acc: tf.DType) -> int:
    """The bit pattern of a positive ``value`` in dtype ``acc``."""
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

    How: at most six reductions and no elementwise pass over the tensor in
    the healthy case (elementwise ops, which write a tensor-sized result, cost
    far more here than reductions): the sum; the sum of squares as a dot
    product (which is finite exactly when no element is NaN or Inf and no
    square overflows); and min and max of the tensor's bits viewed as signed
    and as unsigned integers (free views; a tensor with no sign bit set, such
    as a ReLU output, needs only two of them). They give the exact float
    min and max (also with subnormals, which float compares on a
    denormals-are-zero CPU do not see) and the smallest magnitude: only a
    tensor whose smallest magnitude is below the smallest normal (it holds a
    zero or an underflow) pays an exact count of both; only a float16 tensor
    beyond the overflow margin counts those; only a non-finite tensor (or one
    whose squares overflow) pays the masked float64 statistics.

    Raises:
      TypeError: ``x`` is not a float16, bfloat16, float32 or float64 tensor.
    """
    return tensor_stats_and_sum(x, name)[0]


def tensor_stats_and_sum(x: tf.Tensor, name: str) -> tuple[tf.Tensor, tf.Tensor]:
    """``tensor_stats(x)`` and the plain sum of ``x`` it computes first: finite
    exactly when no element is NaN or Inf (unless the sum itself overflows),
    so a caller can decide on it without waiting for the record.

    The statistics are one function call in the caller's graph (see
    ``_traced``); where the size is not known when tracing (a batch
    dimension of None), a branch picks the 32- or 64-bit counting variant.
    """
    x = tf.convert_to_tensor(x)
    dtype = check_dtype(x, name)
    acc = _ACC_DTYPE[dtype]
    with tf.name_scope("tensor_stats"):
        flat = tf.reshape(tf.stop_gradient(x), [-1])
        if flat.dtype != acc:
            flat = tf.cast(flat, acc)
        # Outside the function call, whose outputs all come when it ends: a
        # caller deciding on the sum (the replay's gate on the update) waits
        # for this one reduction, not for the whole record.
        total = tf.reduce_sum(flat)
        size = flat.shape.num_elements()
        compiled = _xla_gpu_visible()
        if acc == tf.float64 or (size is not None and size >= 2**31):
            return _traced(dtype, tf.int64, compiled)(flat, total), total
        if size is not None:
            return _traced(dtype, tf.int32, compiled)(flat, total), total
        record = tf.cond(
            tf.size(flat, out_type=tf.int64) < 2**31,
            lambda: _traced(dtype, tf.int32, compiled)(flat, total),
            lambda: _traced(dtype, tf.int64, compiled)(flat, total),
        )
        return record, total


# The statistics functions, each traced once per process (functools.cache):
# one per (dtype, count dtype) for tensor_stats, one per dtype for op_stats.
# Tracing them inline, once per tensor, cost a model of a few dozen layers
# tens of seconds before its first step (Python tracing of each branch,
# then graph optimisation of the whole step); called as one function, not
# inlined ("_noinline"), the body is traced and optimised once, and a call
# costs no more per step than the inlined ops did.


def _function(body: Callable[..., Any], *signature: tf.TensorSpec, jit_compile: bool = False) -> Callable[..., Any]:
    """``body`` as a ``tf.function`` of ``signature``, called (not inlined)
    from the graph that calls it; with ``jit_compile``, as one XLA computation."""
    return tf.function(
        body,
        input_signature=signature,
        autograph=False,
        jit_compile=jit_compile or None,
        experimental_attributes={"_noinline": True},
    )


@functools.cache
def _xla_gpu_visible() -> bool:
    """Whether this process sees a CUDA or ROCm GPU, where the record is
    compiled (see ``_traced``). A pluggable device's GPU (Apple's Metal
    plugin) has no XLA backend."""
    built = tf.test.is_built_with_cuda() or tf.test.is_built_with_rocm()
    return built and bool(tf.config.list_logical_devices("GPU"))


@functools.cache
def _traced(dtype: str, count_t: tf.DType, compiled: bool = False) -> Callable[[tf.Tensor, tf.Tensor], tf.Tensor]:
    """The record of a tensor of ``dtype`` from its flat values in the
    accumulation dtype and their sum, counting in ``count_t`` (int32 only
    where the size is below 2**31).

    ``compiled``: as one XLA computation, where a GPU is visible. The record
    rests on integer reductions of the bits, and TensorFlow has no GPU
    kernel for the uint32 ones (``Min``, ``Max``, ``Sum``) and runs the int32
    ones in host memory, so uncompiled, each would copy the tensor to the
    host at every step. XLA reduces them on the device, fused. On a CPU,
    XLA's reductions cost about twice TensorFlow's, so not there. Inside a
    step that is itself compiled, the record is part of the step's
    computation either way.
    """

    def record(flat: tf.Tensor, total: tf.Tensor) -> tf.Tensor:
        bits = _Bits.of(flat, dtype, count_t)
        n = tf.cast(tf.size(flat, out_type=tf.int64), tf.float64)
        row = tf.expand_dims(flat, 0)
        total_sq = tf.reshape(tf.matmul(row, row, transpose_b=True), [])
        return tf.cond(
            tf.math.is_finite(total_sq),
            lambda: _healthy_record(bits, n, total, total_sq),
            lambda: _unhealthy_record(bits, n),
        )

    acc = _ACC_DTYPE[dtype]
    return _function(record, tf.TensorSpec([None], acc), tf.TensorSpec([], acc), jit_compile=compiled)


@functools.cache
def _traced_op(dtype: str) -> Callable[[tf.Tensor], tf.Tensor]:
    """``op_stats`` of a 1-D tensor of ``dtype``."""
    return _function(functools.partial(_op_stats_flat, dtype=dtype), tf.TensorSpec([None], tf.as_dtype(dtype)))


@dataclasses.dataclass(frozen=True)
class _Bits:
    """A float tensor flattened in its accumulation dtype, with its integer
    views and the constants of its dtype: what every piece of
    ``tensor_stats`` reads, built once so that the pieces share the views
    and the one reduction (``u_max``) the branch conditions need.
    """

    dtype: str  # the tensor's own dtype name, which sets the margin and the smallest normal
    acc: tf.DType
    flat: tf.Tensor
    signed: tf.Tensor
    unsigned: tf.Tensor
    u_max: tf.Tensor  # max of the unsigned view; < sign_bit where no sign bit is set
    # Counts are summed in int32 for float32 bits where the size is below
    # 2**31 (exact, and cheaper than int64), else int64.
    count_t: tf.DType

    @classmethod
    def of(cls, flat: tf.Tensor, dtype: str, count_t: tf.DType) -> _Bits:
        """The views of ``flat``, the values of a tensor of ``dtype`` in its
        accumulation dtype."""
        acc = flat.dtype
        unsigned = tf.bitcast(flat, _VIEWS[acc][1])
        return cls(
            dtype=dtype,
            acc=acc,
            flat=flat,
            signed=tf.bitcast(flat, _VIEWS[acc][0]),
            unsigned=unsigned,
            u_max=tf.reduce_max(unsigned),
            count_t=count_t,
        )

    @property
    def int_t(self) -> tf.DType:
        """The signed integer dtype of the bits."""
        return _VIEWS[self.acc][0]

    @property
    def uint_t(self) -> tf.DType:
        """The unsigned integer dtype of the bits."""
        return _VIEWS[self.acc][1]

    @property
    def sign_bit(self) -> int:
        """The sign bit; below it, the magnitude bits."""
        return _VIEWS[self.acc][2]

    @property
    def tiny_bits(self) -> int:
        """The bits of the smallest normal: magnitudes below are zeros or underflow."""
        return _bits(metadata.smallest_normal(self.dtype), self.acc)


def _record(fields: Mapping[str, tf.Tensor]) -> tf.Tensor:
    """The float64 record of scalars given by field name, in ``metadata.FIELDS`` order.

    By name, so no caller depends on the order of the slots; every field
    must be given once (a missing or unknown one is a bug here, raised at
    trace time).
    """
    if set(fields) != set(metadata.FIELDS):
        raise ValueError(
            "tb_numerics: record fields missing %s, unknown %s"
            % (sorted(set(metadata.FIELDS) - set(fields)), sorted(set(fields) - set(metadata.FIELDS)))
        )
    return tf.stack([fields[field] for field in metadata.FIELDS])


def _healthy_record(bits: _Bits, n: tf.Tensor, total: tf.Tensor, total_sq: tf.Tensor) -> tf.Tensor:
    """``tensor_stats`` of a tensor whose sum of squares is finite: no NaN, no
    Inf, so the plain sums serve and min, max and the smallest magnitude
    on each side of zero come from the bit views."""
    lo_hi, pos_small, neg_small = tf.cond(
        bits.u_max < bits.sign_bit,
        lambda: _extrema_nonnegative(bits),
        lambda: _extrema_mixed(bits),
    )
    lo_hi = _bits_to_float64(lo_hi, bits.acc)
    small = tf.cond(
        tf.logical_or(pos_small, neg_small),
        lambda: _zeros_and_underflow(bits, pos_small, neg_small),
        lambda: tf.zeros([2], tf.float64),
    )
    sums = _accurate_sums(bits.flat, n, total, total_sq)
    z = tf.constant(0.0, tf.float64)
    return _record({
        "count": n, "nan": z, "posinf": z, "neginf": z,
        "min": lo_hi[0], "max": lo_hi[1], "sum": sums[0], "sum_sq": sums[1],
        "zeros": small[0], "overflow": _float16_overflow(bits, lo_hi), "underflow": small[1],
    })


def _extrema_nonnegative(bits: _Bits) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """(``[min, max]`` bits, whether a magnitude is below the smallest
    normal among the non-negative values, among the negative ones) of a
    finite tensor with no sign bit set (e.g. a ReLU output): both integer
    orders are the float order, so one more reduction, the signed min, gives
    the min, which is also the smallest magnitude. An empty tensor has
    signed min = the largest int, a NaN pattern."""
    s_min = tf.reduce_min(bits.signed)
    lo_bits = tf.bitcast(s_min, bits.uint_t)
    hi_bits = tf.where(lo_bits <= bits.u_max, bits.u_max, lo_bits)
    return tf.stack([lo_bits, hi_bits]), s_min < bits.tiny_bits, tf.constant(False)


def _extrema_mixed(bits: _Bits) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """(``[min, max]`` bits, whether a magnitude is below the smallest
    normal among the non-negative values, among the negative ones) of a
    finite tensor with some sign bit set. Unsigned order: +0 < positives <
    -0 < negatives by magnitude; signed order: negatives by decreasing
    magnitude < +0 < positives. So u_max is the min, the max is the signed
    max where it is non-negative (else the unsigned min), the unsigned min
    is the smallest non-negative magnitude and the signed min the smallest
    negative one (with its sign bit)."""
    mask = tf.constant(bits.sign_bit - 1, bits.int_t)
    s_min, s_max, u_min = tf.reduce_min(bits.signed), tf.reduce_max(bits.signed), tf.reduce_min(bits.unsigned)
    hi_bits = tf.where(s_max >= 0, tf.bitcast(s_max, bits.uint_t), u_min)
    pos_small = u_min < tf.constant(bits.tiny_bits, bits.uint_t)
    neg_small = tf.bitwise.bitwise_and(s_min, mask) < bits.tiny_bits
    return tf.stack([bits.u_max, hi_bits]), pos_small, neg_small


def _zeros_and_underflow(bits: _Bits, pos_small: tf.Tensor, neg_small: tf.Tensor) -> tf.Tensor:
    """float64 ``[zeros, underflow]`` of a tensor whose magnitudes below the
    smallest normal lie among its non-negative values (``pos_small``), its
    negative ones (``neg_small``) or both.

    From the bits because a float compare on a denormals-are-zero CPU calls
    a subnormal zero. One elementwise pass maps the bits to ``key``, in
    unsigned arithmetic: the magnitude less one on the side that holds the
    small values, so that a zero wraps to the largest value and a nonzero
    magnitude m to m - 1, with every value of the other side above them
    all. Where both sides hold small values, the magnitude bits (a second
    pass, written in place) come first. See ``_count_small``.
    """
    u = bits.unsigned
    all_ones = tf.constant(2 * bits.sign_bit - 1, bits.uint_t)  # adding it subtracts one
    half = tf.constant(bits.sign_bit - 1, bits.uint_t)  # adding it maps -m to m - 1, +m above
    return tf.cond(
        tf.logical_and(pos_small, neg_small),
        lambda: _count_small(bits, tf.bitwise.bitwise_and(u, half) + all_ones),
        lambda: _count_small(bits, u + tf.where(pos_small, all_ones, half)),
    )


def _count_small(bits: _Bits, key: tf.Tensor) -> tf.Tensor:
    """float64 ``[zeros, underflow]`` from ``key`` (see ``_zeros_and_underflow``):
    the zeros are its largest value, the underflows its values below the
    smallest normal less one.

    Its min is the smallest nonzero magnitude less one, which tells whether
    the exact underflow count is needed at all. ``max(key, largest - 1)`` is
    1 more than elsewhere exactly at the zeros, so its wrapping unsigned sum
    is ``zeros - 2 * size`` (exact below 2**32 zeros; beyond that count, in
    the int64 variant, a compare). It runs last, after every other reader
    of ``key``, so TensorFlow writes it over ``key`` in place: one
    tensor-sized allocation, where each fresh one costs page faults as much
    as the pass.
    """
    all_ones = tf.constant(2 * bits.sign_bit - 1, bits.uint_t)
    tiny_less_one = tf.constant(bits.tiny_bits - 1, bits.uint_t)
    has_underflow = tf.reduce_min(key) < tiny_less_one
    underflow = tf.cond(
        has_underflow,
        lambda: tf.reduce_sum(tf.cast(tf.less(key, tiny_less_one), bits.count_t)),
        lambda: tf.constant(0, bits.count_t),
    )
    with tf.control_dependencies([has_underflow, underflow]):
        if bits.count_t == tf.int64 and bits.acc == tf.float32:
            zeros = tf.reduce_sum(tf.cast(tf.equal(key, all_ones), tf.int64))
        else:
            twice_size = tf.cast(2 * tf.size(key, out_type=tf.int64), bits.uint_t)  # modulo 2**bits
            zeros = tf.reduce_sum(tf.maximum(key, all_ones - 1)) + twice_size
    return tf.stack([tf.cast(zeros, tf.float64), tf.cast(underflow, tf.float64)])


def _float16_overflow(bits: _Bits, lo_hi: tf.Tensor) -> tf.Tensor:
    """The overflow count of a finite tensor with float64 ``[min, max]`` ``lo_hi``.

    Counted only where the largest magnitude is beyond the margin, and
    only for float16: the only dtype whose margin lies below the largest
    value with a finite float32 square, so for the others a finite sum of
    squares already means none.
    """
    if bits.dtype != "float16":
        return tf.constant(0.0, tf.float64)
    margin = metadata.overflow_margin(bits.dtype)
    return tf.cond(
        tf.reduce_max(tf.abs(lo_hi)) > margin,
        lambda: _count(tf.abs(bits.flat) > margin),
        lambda: tf.constant(0.0, tf.float64),
    )


def _unhealthy_record(bits: _Bits, n: tf.Tensor) -> tf.Tensor:
    """``tensor_stats`` of a tensor with a NaN or Inf, or a square that
    overflowed: count the non-finite elements and redo the rest over the
    finite ones, in float64."""
    flat = bits.flat
    finite = tf.math.is_finite(flat)
    x64 = tf.cast(tf.where(finite, flat, tf.zeros_like(flat)), tf.float64)
    lo_hi = _finite_min_max(flat, finite, bits.acc)
    small = _zeros_and_underflow(bits, tf.constant(True), tf.constant(True))
    return _record({
        "count": n,
        **_nonfinite_counts(flat),
        "min": lo_hi[0],
        "max": lo_hi[1],
        "sum": tf.reduce_sum(x64),
        "sum_sq": tf.reduce_sum(tf.square(x64)),
        "zeros": small[0],
        "overflow": _overflow_count(flat, finite, metadata.overflow_margin(bits.dtype)),
        "underflow": small[1],
    })


def _nonfinite_counts(flat: tf.Tensor) -> dict[str, tf.Tensor]:
    """The ``nan``, ``posinf`` and ``neginf`` fields of a flat tensor: exact
    counts, three elementwise passes, so only for a tensor known to hold one."""
    inf = tf.constant(np.inf, flat.dtype)
    return {
        "nan": _count(tf.math.is_nan(flat)),
        "posinf": _count(tf.equal(flat, inf)),
        "neginf": _count(tf.equal(flat, -inf)),
    }


def _overflow_count(flat: tf.Tensor, finite: tf.Tensor, margin: float) -> tf.Tensor:
    """The finite elements beyond the overflow margin (Inf is counted as Inf, not here)."""
    return _count(tf.logical_and(finite, tf.abs(flat) > margin))


# Below this share of the mean square, the variance sum_sq/n - mean^2 of
# float32 sums has lost too many digits to trust (a float32 sum carries a
# relative error of about 1e-7 per level of its reduction tree).
_CANCELLATION_SHARE = 1e-3


def _accurate_sums(flat: tf.Tensor, n: tf.Tensor, total: tf.Tensor, total_sq: tf.Tensor) -> tf.Tensor:
    """float64 [sum, sum of squares] of finite ``flat`` whose derived
    variance (sum_sq/n - mean^2) is accurate.

    The plain sums (already computed) serve where the variance is a large
    share of the mean square, as in nearly every activation and gradient.
    Where it is not (values of 1000 +- 0.01: 1e-10 of it), a second pass
    sums the deviations from the plain mean, and the sums are rebuilt from
    the exact mean and variance in float64: std is then right to about 1e-6
    relative, instead of 0. Only such tensors pay the pass.
    """
    t64, sq64 = tf.cast(total, tf.float64), tf.cast(total_sq, tf.float64)
    safe_n = tf.maximum(n, 1.0)
    mean_sq = sq64 / safe_n
    naive_var = mean_sq - tf.square(t64 / safe_n)
    cancels = tf.logical_and(n > 1, naive_var < _CANCELLATION_SHARE * mean_sq)

    def centred() -> tf.Tensor:
        shift = total / tf.cast(safe_n, total.dtype)
        dev = tf.expand_dims(flat - shift, 0)
        d1 = tf.cast(tf.reduce_sum(dev), tf.float64) / safe_n
        d2 = tf.cast(tf.reshape(tf.matmul(dev, dev, transpose_b=True), []), tf.float64) / safe_n
        mean = tf.cast(shift, tf.float64) + d1
        var = tf.maximum(d2 - tf.square(d1), 0.0)
        return tf.stack([mean * n, (var + tf.square(mean)) * n])

    return tf.cond(cancels, centred, lambda: tf.stack([t64, sq64]))


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
    acc = _ACC_DTYPE[dtype]
    if flat.dtype != acc:
        flat = tf.cast(flat, acc)
    int_t, uint_t, sign_bit = _VIEWS[acc]
    inf_bits = _bits(np.inf, acc)
    margin = metadata.overflow_margin(dtype)
    n = tf.cast(tf.size(flat, out_type=tf.int64), tf.float64)  # int32 would refuse 2**31 elements
    unsigned = tf.bitcast(flat, uint_t)
    u_max = tf.reduce_max(unsigned)
    s_max = tf.reduce_max(tf.bitcast(flat, int_t))
    # Where both signs are present, min = u_max and max = s_max.
    lo_hi = _bits_to_float64(tf.stack([u_max, tf.bitcast(s_max, uint_t)]), acc)
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
    return _record({
        "count": n, "min": lo_hi[0], "max": lo_hi[1], "sum": nan, "sum_sq": nan,
        "zeros": z, "underflow": z, **fields,
    })


def _op_stats_other(
    flat: tf.Tensor, n: tf.Tensor, u_max: tf.Tensor, s_max: tf.Tensor, acc: tf.DType, margin: float
) -> tf.Tensor:
    """``op_stats`` of a tensor that is not finite with both signs."""
    int_t, uint_t, sign_bit = _VIEWS[acc]
    inf_bits = _bits(np.inf, acc)
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
    uint_t, sign_bit = _VIEWS[acc][1:]
    u_min = tf.reduce_min(tf.bitcast(flat, uint_t))
    lo_hi = _bits_to_float64(
        tf.stack([
            tf.where(u_max >= tf.constant(sign_bit, uint_t), u_max, u_min),
            tf.where(s_max >= 0, tf.bitcast(s_max, uint_t), u_min),
        ]),
        acc,
    )
    overflow = tf.cond(
        tf.reduce_max(tf.abs(lo_hi)) > margin,
        lambda: _count(tf.abs(flat) > margin),
        lambda: tf.constant(0.0, tf.float64),
    )
    return _op_record(n, lo_hi, overflow=overflow)


def _op_stats_nonfinite(flat: tf.Tensor, n: tf.Tensor, acc: tf.DType, margin: float) -> tf.Tensor:
    """``op_stats`` of a tensor with a NaN or Inf: count them, and min and max
    over the finite ones."""
    is_finite = tf.math.is_finite(flat)
    return _op_record(
        n,
        _finite_min_max(flat, is_finite, acc),
        overflow=_overflow_count(flat, is_finite, margin),
        **_nonfinite_counts(flat),
    )


def _finite_min_max(flat: tf.Tensor, finite: tf.Tensor, acc: tf.DType) -> tf.Tensor:
    """float64 ``[min, max]`` of the ``finite`` elements of ``flat``, NaN where
    there are none: exact, subnormals too, from the bits of the finite
    elements with the others replaced by a finite one (a masked float min
    and cast on a denormals-are-zero CPU give 0 for a subnormal). One 0
    goes after the elements, so that an empty tensor has an element to
    take: XLA compiles this branch for an empty tensor too, and refuses an
    argmax over nothing."""
    padded = tf.concat([flat, tf.zeros([1], flat.dtype)], 0)
    first = tf.argmax(tf.concat([tf.cast(finite, tf.int32), [1]], 0), output_type=tf.int32)
    some = tf.gather(padded, first)
    exact = _exact_min_max(tf.where(finite, flat, some), acc)
    return tf.where(tf.reduce_any(finite), exact, tf.constant(np.nan, tf.float64))


def _exact_min_max(flat: tf.Tensor, acc: tf.DType) -> tf.Tensor:
    """float64 ``[min, max]`` of a non-empty finite flat tensor, from its bits.

    Exact on a denormals-are-zero CPU too. Three integer reductions: as
    unsigned integers, non-negative floats (sign bit clear) order by value
    and below all negative ones, which order by magnitude; as signed
    integers, non-negative floats order by value and above all negative
    ones. So the largest unsigned value is the most negative element where
    there is one, and the smallest unsigned one the smallest non-negative
    element where there is one (else the negative element closest to 0, the
    max); the largest signed value is the largest non-negative element.
    """
    int_t, uint_t, sign_bit = _VIEWS[acc]
    unsigned = tf.bitcast(flat, uint_t)
    u_max, u_min = tf.reduce_max(unsigned), tf.reduce_min(unsigned)
    s_max = tf.bitcast(tf.reduce_max(tf.bitcast(flat, int_t)), uint_t)
    sign = tf.constant(sign_bit, uint_t)
    lo = tf.where(u_max >= sign, u_max, u_min)
    hi = tf.where(u_min >= sign, u_min, s_max)
    return _bits_to_float64(tf.stack([lo, hi]), acc)


def _bits_to_float64(bits: tf.Tensor, acc: tf.DType) -> tf.Tensor:
    """The float64 values of float bit patterns (unsigned), subnormals too.

    A float32 -> float64 cast on a denormals-are-zero CPU gives 0 for a
    subnormal; its value is rebuilt from the mantissa instead.
    """
    if acc == tf.float64:
        return tf.bitcast(bits, tf.float64)
    widened = tf.cast(tf.bitcast(bits, tf.float32), tf.float64)
    signed = tf.bitcast(bits, tf.int32)
    mantissa = tf.bitwise.bitwise_and(signed, 0x7FFFFFFF)
    subnormal = tf.cast(mantissa, tf.float64) * 2.0**-149
    subnormal = tf.where(signed < 0, -subnormal, subnormal)
    return tf.where(mantissa < 0x00800000, subnormal, widened)


def _count(mask: tf.Tensor) -> tf.Tensor:
    """The number of true elements of ``mask``, exactly, as float64."""
    return tf.cast(tf.math.count_nonzero(mask, dtype=tf.int64), tf.float64)


def merge_stats(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    """The record of the concatenation of two tensors, from their records."""
    return combine_stats(tf.stack([tf.convert_to_tensor(a, tf.float64), tf.convert_to_tensor(b, tf.float64)]))


def combine_stats(records: tf.Tensor) -> tf.Tensor:
    """The record of the concatenation of several tensors, from ``[k, F]`` records.

    Counts and sums add; min is the min of the mins and max the max of the
    maxes, where NaN (no finite value in that part) does not win.
    """
    records = tf.reshape(tf.convert_to_tensor(records, tf.float64), [-1, metadata.NUM_FIELDS])
    inf = tf.constant(np.inf, tf.float64)
    nan = tf.constant(np.nan, tf.float64)
    lo = tf.reduce_min(tf.where(tf.math.is_nan(records[:, F["min"]]), inf, records[:, F["min"]]))
    hi = tf.reduce_max(tf.where(tf.math.is_nan(records[:, F["max"]]), -inf, records[:, F["max"]]))
    parts = tf.unstack(tf.reduce_sum(records, axis=0), num=metadata.NUM_FIELDS)
    parts[F["min"]] = tf.where(tf.math.is_inf(lo), nan, lo)
    parts[F["max"]] = tf.where(tf.math.is_inf(hi), nan, hi)
    return tf.stack(parts)


def replica_context() -> tf.distribute.ReplicaContext | None:
    """The replica context when inside ``strategy.run`` with several replicas, else None."""
    ctx = tf.distribute.get_replica_context()
    if ctx is not None and ctx.num_replicas_in_sync > 1:
        return ctx
    return None


def all_reduce_stats(stats: tf.Tensor, replica_context: tf.distribute.ReplicaContext) -> tf.Tensor:
    """Combines each replica's record into the record of all their values.

    Call in replica context (inside ``strategy.run``); every replica gets the
    combined record. One collective: the records are all-gathered (the
    replica context's all-reduce has only SUM and MEAN, and min and max need
    their own rule) and combined by ``combine_stats``.
    """
    return all_reduce_many_stats(tf.expand_dims(stats, 0), replica_context)[0]


def all_reduce_many_stats(records: tf.Tensor, replica_context: tf.distribute.ReplicaContext) -> tf.Tensor:
    """``all_reduce_stats`` of each row of ``[k, F]`` records, in one collective."""
    return combine_replicas(gather_replicas(records, replica_context))


def gather_replicas(records: tf.Tensor, replica_context: tf.distribute.ReplicaContext) -> tf.Tensor:
    """Every replica's ``[k, F]`` records, ``[replicas, k, F]``, on every replica (one collective)."""
    gathered = replica_context.all_gather(tf.expand_dims(records, 0), axis=0)
    gathered.set_shape([replica_context.num_replicas_in_sync] + records.shape.as_list())  # all_gather drops it
    return gathered


def combine_replicas(gathered: tf.Tensor) -> tf.Tensor:
    """The ``[k, F]`` records of all replicas' values together, from ``gather_replicas``."""
    return tf.stack([combine_stats(gathered[:, i]) for i in range(gathered.shape[1])])



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
        part = [i for i, d in enumerate(dtypes) if _ACC_DTYPE[d] == acc]
        if part:
            rows.append(_segment_stats([tensors[i] for i in part], [dtypes[i] for i in part], acc))
            where += part
    out = tf.concat(rows, 0) if len(rows) > 1 else rows[0]
    if where != sorted(where):
        out = tf.gather(out, np.argsort(where))
    return out


def _segment_stats(tensors: list[tf.Tensor], dtypes: list[str], acc: tf.DType) -> tf.Tensor:
    """``many_stats`` of tensors of one accumulation dtype."""
    int_t, _, sign_bit = _VIEWS[acc]
    mask = sign_bit - 1
    lowest, highest = _INT_LIMITS[int_t]
    k = len(tensors)
    flats = [tf.reshape(tf.cast(x, acc) if x.dtype != acc else x, [-1]) for x in tensors]
    sizes = [f.shape.num_elements() for f in flats]
    seg = tf.constant(np.repeat(np.arange(k, dtype=np.int32), sizes))
    values = tf.concat(flats, 0) if k > 1 else flats[0]
    bits = tf.bitcast(values, int_t)
    mag = tf.bitwise.bitwise_and(bits, tf.constant(mask, int_t))
    inf_bits = _bits(np.inf, acc)
    finite = mag < inf_bits
    inf = tf.equal(mag, inf_bits)
    tiny = np.repeat([_bits(metadata.smallest_normal(d), acc) for d in dtypes], sizes).astype(int_t.as_numpy_dtype)
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
    _, uint_t, _ = _VIEWS[acc]
    lo_hi = tf.reshape(_bits_to_float64(tf.bitcast(tf.reshape(lo_hi_bits, [-1]), uint_t), acc), [k, 2])
    if acc == tf.float32:
        # Sums of a finite tensor held to float32, as tensor_stats' healthy
        # path accumulates them (so packed events stay float32); float64
        # where float32 cannot hold them or a value is not finite, as its
        # other path.
        as32 = tf.cast(tf.cast(sums, tf.float32), tf.float64)
        healthy = tf.reduce_all(tf.math.is_finite(as32), axis=1, keepdims=True) & (
            tf.reduce_sum(sums[:, :3], axis=1, keepdims=True) == 0
        )
        sums = tf.where(healthy, as32, sums)
    count = tf.constant(np.asarray(sizes, np.float64))
    any_finite = (count - sums[:, 0] - sums[:, 1] - sums[:, 2]) > 0
    lo_hi = tf.where(any_finite[:, None], lo_hi, tf.constant(np.nan, tf.float64))
    return tf.stack(
        [count, sums[:, 0], sums[:, 1], sums[:, 2], lo_hi[:, 0], lo_hi[:, 1],
         sums[:, 6], sums[:, 7], sums[:, 3], sums[:, 4], sums[:, 5]],
        axis=1,
    )


def sq_norm(x: tf.Tensor) -> tf.Tensor:
    """||x||^2 as float64, from one dot product (a single pass over x).

    Half-precision inputs are widened first so that the sum cannot overflow.
    """
    flat = tf.reshape(x, [1, -1])
    if flat.dtype in (tf.float16, tf.bfloat16):
        flat = tf.cast(flat, tf.float32)
    return tf.cast(tf.matmul(flat, flat, transpose_b=True)[0, 0], tf.float64)
