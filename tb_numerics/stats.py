"""On-device statistics of one tensor: the numerics record, in TensorFlow.

``tensor_stats(x, name)`` returns the float64 vector of ``metadata.FIELDS``
for a float tensor, computed with ordinary TensorFlow reductions (no
``py_function``, no host round trip), so it runs inside a traced or
``jit_compile``'d step and its result can be written there or outside.
Where a GPU is visible, each record is compiled with XLA (see ``_traced``).
``records.numpy_stats`` is the reference it agrees with: counts and
extrema exactly, sums to the accumulation precision.

Cost is the design constraint: every layer output and gradient may be logged
every step. On a CPU the record is one op, the record kernel
(``record_kernel``: C++ built once per machine, one vectorised pass over the
tensor, two for one holding zeros), where it is built; elsewhere, and inside
an XLA-compiled step, it is TensorFlow's ops, with the same record.
The healthy path is a handful of plain reductions whose results
double as the finite check (a sum of squares is finite only if no element is
NaN or Inf and no square overflows); only a tensor that fails it pays for the
exact NaN/+Inf/-Inf counts and the masked statistics, inside a ``tf.cond``.

Accumulation is in float32 for float16, bfloat16 and float32 tensors and in
float64 for float64 ones. Zero and underflow counts come from the bit
patterns, not from float compares: TensorFlow on x86 CPUs runs with
denormals-are-zero, so ``x == 0`` is true for a float32 subnormal there.

This module holds the layer record; the others are by job, re-exported
here: the op record (``_stats_op``), combining records and replicas
(``_stats_replicas``), batched segments of small tensors
(``_stats_segments``), and what they share with the one TensorFlow rule of
"non-finite" (``_stats_core``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

from tb_numerics import _requires

tf = _requires.tensorflow(__name__)

from tb_numerics import _tf_internal, metadata, record_kernel  # noqa: E402
from tb_numerics._stats_core import (  # noqa: E402
    ACC_DTYPE,
    VIEWS,
    all_finite,
    batch_finite,
    bits_to_float64,
    check_dtype,
    count_nonfinite,
    count_true,
    finite_min_max,
    flatten,
    in_order,
    float_bits,
    global_norm_record,
    make_record,
    noinline_function,
    nonfinite_count,
    nonfinite_fields,
    overflow_count,
    scalar_record,
    shared_constant,
    sq_norm,
    sums_finite,
)
# The other records, by job, under the names callers know them by.
from tb_numerics._stats_op import op_stats  # noqa: E402
from tb_numerics._stats_replicas import (  # noqa: E402
    all_reduce_many_stats,
    all_reduce_stats,
    combine_replicas,
    combine_stats,
    gather_replicas,
    merge_stats,
    replica_context,
)
from tb_numerics._stats_segments import SMALL_TENSOR, held_to_float32, is_small, many_stats, sq_norms  # noqa: E402

__all__ = [
    "SMALL_TENSOR",
    "all_finite",
    "all_reduce_many_stats",
    "batch_finite",
    "all_reduce_stats",
    "check_dtype",
    "combine_replicas",
    "combine_stats",
    "count_nonfinite",
    "flatten",
    "gather_replicas",
    "global_norm_record",
    "in_order",
    "is_small",
    "keep_if",
    "many_stats",
    "merge_stats",
    "moved_since",
    "nonfinite_count",
    "op_stats",
    "records_of",
    "replica_context",
    "scalar_record",
    "shared_constant",
    "sq_norm",
    "sq_norms",
    "sums_finite",
    "tensor_stats",
]


def tensor_stats(x: tf.Tensor, name: str) -> tf.Tensor:
    """The numerics record of float tensor ``x``: float64 ``[NUM_FIELDS]``.

    ``name`` only names the tensor in errors. Finite statistics (min, max,
    sum, sum of squares) are over the finite elements; min and max are NaN
    where there are none (an empty or all-NaN tensor).

    The record is the record kernel's op where it is built (not where XLA
    compiles the graph, or where a GPU is visible), else one function call
    in the caller's graph (see ``_traced``); where the size is not known
    when tracing (a batch dimension of None), a branch picks the 32- or
    64-bit counting variant.

    How TensorFlow's ops make it: at most six reductions and no elementwise
    pass over the tensor in the healthy case (elementwise ops, which write a
    tensor-sized result, cost far more here than reductions): the sum; the sum of squares as a dot
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
    x = tf.convert_to_tensor(x)
    dtype = check_dtype(x, name)
    acc = ACC_DTYPE[dtype]
    with tf.name_scope("tensor_stats"):
        compiled = _xla_gpu_visible()
        kernel = _kernel()
        if kernel is not None:
            # The kernel reads a tensor of any shape as flat and has no
            # gradient: no reshape, no stop_gradient (each a node a site).
            values = x if x.dtype == acc else tf.cast(x, acc)
            return kernel.tbn_record(values, _limits(dtype, acc))
        flat = flatten(tf.stop_gradient(x))
        if flat.dtype != acc:
            flat = tf.cast(flat, acc)
        size = flat.shape.num_elements()
        if acc == tf.float64 or (size is not None and size >= 2**31):
            return _traced(dtype, tf.int64, compiled)(flat)
        if size is not None:
            return _traced(dtype, tf.int32, compiled)(flat)
        return tf.cond(
            tf.size(flat, out_type=tf.int64) < 2**31,
            lambda: _traced(dtype, tf.int32, compiled)(flat),
            lambda: _traced(dtype, tf.int64, compiled)(flat),
        )


def records_of(tensors: list[tf.Tensor], names: list[str]) -> tf.Tensor:
    """The records ``[k, NUM_FIELDS]`` of float ``tensors`` (any shapes;
    ``names`` name them in errors), in order: ``tensor_stats`` of each.

    The small ones (``is_small``: biases, norms' scales) are made together,
    in a fixed number of nodes whatever their number: with the record
    kernel one op per accumulation dtype (``TbnRecords``), else by segment
    (``many_stats``); ResNet-50's 161 small gradients were 161 sites to
    trace and instantiate. The others take ``tensor_stats`` each, so that
    each record starts as soon as its tensor is made (a gradient's, while
    backpropagation goes on).
    """
    xs = [tf.convert_to_tensor(x) for x in tensors]
    dtypes = [check_dtype(x, name) for x, name in zip(xs, names)]
    small = [i for i, x in enumerate(xs) if is_small(x)]
    if len(small) < 2:
        small = []
    large = [i for i in range(len(xs)) if i not in set(small)]
    kernel = _kernel()
    parts: list[tf.Tensor] = []
    order: list[int] = []
    if small and kernel is not None:
        for acc in (tf.float32, tf.float64):
            group = [i for i in small if ACC_DTYPE[dtypes[i]] == acc]
            if group:
                limits = shared_constant([_limit_row(dtypes[i]) for i in group], acc)
                values = [xs[i] if xs[i].dtype == acc else tf.cast(xs[i], acc) for i in group]
                made = kernel.tbn_records(values, limits)
                parts.append(held_to_float32(made) if acc == tf.float32 else made)
                order += group
    elif small:
        parts.append(many_stats([xs[i] for i in small], [dtypes[i] for i in small]))
        order += small
    if large:
        parts.append(tf.stack([tensor_stats(xs[i], names[i]) for i in large]))
        order += large
    if not parts:
        return tf.zeros([0, metadata.NUM_FIELDS], tf.float64)
    return in_order(parts, order)


def keep_if(tensors: list[tf.Tensor], names: list[str], due: tf.Tensor, *, record: bool,
            copy: bool) -> tuple[tf.Tensor, list[tf.Tensor]] | None:
    """Where ``due`` (a bool tensor): the records ``[k, NUM_FIELDS]`` of
    ``tensors`` (if ``record``, else ``[0, NUM_FIELDS]``) and a copy of their
    values (if ``copy``), flat, one tensor per dtype (``moved_since``'s
    ``kept``); zero records and empty copies at other steps.

    A due step's weights before the update, with no cond around them: one
    record kernel op per dtype, which does nothing where the step is not
    due (a cond's branches each took an input per weight, 0.5 s of tracing
    for ResNet-50's 214, and read them again). Small float32 tensors'
    records are held to float32 as ``records_of`` holds them. None where
    the kernel does not serve or a tensor is neither float32 nor float64.
    """
    kernel = _kernel()
    xs = [tf.convert_to_tensor(x) for x in tensors]
    if kernel is None or any(x.dtype not in _KEPT_DTYPES for x in xs):
        return None
    parts, order, kept = [], [], []
    for dtype, where in _by_dtype(xs):
        limits = shared_constant([_limit_row(xs[i].dtype.name) for i in where], dtype)
        rows, flat = kernel.tbn_keep([xs[i] for i in where], limits, due, record=record, copy=copy)
        small = [dtype == tf.float32 and is_small(xs[i]) for i in where]
        if record and any(small):
            rows = tf.where(shared_constant(small, tf.bool)[:, None], held_to_float32(rows), rows)
        parts.append(rows)
        order += where
        kept.append(flat)
    records = in_order(parts, order) if record else tf.zeros([0, metadata.NUM_FIELDS], tf.float64)
    return records, kept


def moved_since(now: list[tf.Tensor], kept: list[tf.Tensor], due: tf.Tensor) -> tf.Tensor:
    """Where ``due``, ``[||now_i - before_i||^2, ||before_i||^2]`` of each
    tensor, float64 ``[k, 2]``: how far each weight moved (the update
    ratios' numerators and denominators), ``kept`` being ``keep_if``'s
    copies of the same tensors before; zeros at other steps. One record
    kernel op per dtype (``keep_if`` served, so the kernel does)."""
    kernel = _kernel()
    xs = [tf.convert_to_tensor(x) for x in now]
    parts, order = [], []
    for (_, where), before in zip(_by_dtype(xs), kept):
        parts.append(kernel.tbn_moved([xs[i] for i in where], before, due))
        order += where
    return in_order(parts, order)


_KEPT_DTYPES = (tf.float32, tf.float64)


def _by_dtype(xs: list[tf.Tensor]) -> list[tuple[tf.DType, list[int]]]:
    """(dtype, the positions of its tensors) of each of ``_KEPT_DTYPES`` present, in that order."""
    groups = [(d, [i for i, x in enumerate(xs) if x.dtype == d]) for d in _KEPT_DTYPES]
    return [(d, where) for d, where in groups if where]


def _kernel():
    """The record kernel's ops where they serve this graph (``record_kernel.load``):
    not where a GPU is visible or XLA compiles the graph (XLA has no kernel of ours)."""
    if _xla_gpu_visible() or _tf_internal.in_xla_context():
        return None
    return record_kernel.load()


def _limits(dtype: str, acc: tf.DType) -> tf.Tensor:
    """``_limit_row(dtype)`` in ``acc``: the record kernel's second input."""
    return shared_constant(_limit_row(dtype), acc)


def _limit_row(dtype: str) -> list[float]:
    """[smallest normal, overflow margin] of ``dtype`` and the cancellation
    share (``_accurate_sums``): the limits the record kernel reads for a
    tensor of ``dtype``."""
    return [metadata.smallest_normal(dtype), metadata.overflow_margin(dtype), _CANCELLATION_SHARE]


@functools.cache
def _xla_gpu_visible() -> bool:
    """Whether this process sees a CUDA or ROCm GPU, where the record is
    compiled (see ``_traced``). A pluggable device's GPU (Apple's Metal
    plugin) has no XLA backend."""
    built = tf.test.is_built_with_cuda() or tf.test.is_built_with_rocm()
    return built and bool(tf.config.list_logical_devices("GPU"))


@functools.cache
def _traced(dtype: str, count_t: tf.DType, compiled: bool = False) -> Callable[[tf.Tensor], tf.Tensor]:
    """The record of a tensor of ``dtype`` from its flat values in the
    accumulation dtype, counting in ``count_t`` (int32 only
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

    def record(flat: tf.Tensor) -> tf.Tensor:
        total = tf.reduce_sum(flat)
        bits = _Bits.of(flat, dtype, count_t)
        n = tf.cast(tf.size(flat, out_type=tf.int64), tf.float64)
        row = tf.expand_dims(flat, 0)
        total_sq = tf.reshape(tf.matmul(row, row, transpose_b=True), [])
        return tf.cond(
            tf.math.is_finite(total_sq),
            lambda: _healthy_record(bits, n, total, total_sq),
            lambda: _unhealthy_record(bits, n),
        )

    acc = ACC_DTYPE[dtype]
    return noinline_function(record, tf.TensorSpec([None], acc), jit_compile=compiled)


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
        unsigned = tf.bitcast(flat, VIEWS[acc][1])
        return cls(
            dtype=dtype,
            acc=acc,
            flat=flat,
            signed=tf.bitcast(flat, VIEWS[acc][0]),
            unsigned=unsigned,
            u_max=tf.reduce_max(unsigned),
            count_t=count_t,
        )

    @property
    def int_t(self) -> tf.DType:
        """The signed integer dtype of the bits."""
        return VIEWS[self.acc][0]

    @property
    def uint_t(self) -> tf.DType:
        """The unsigned integer dtype of the bits."""
        return VIEWS[self.acc][1]

    @property
    def sign_bit(self) -> int:
        """The sign bit; below it, the magnitude bits."""
        return VIEWS[self.acc][2]

    @property
    def tiny_bits(self) -> int:
        """The bits of the smallest normal: magnitudes below are zeros or underflow."""
        return float_bits(metadata.smallest_normal(self.dtype), self.acc)


def _healthy_record(bits: _Bits, n: tf.Tensor, total: tf.Tensor, total_sq: tf.Tensor) -> tf.Tensor:
    """``tensor_stats`` of a tensor whose sum of squares is finite: no NaN, no
    Inf, so the plain sums serve and min, max and the smallest magnitude
    on each side of zero come from the bit views."""
    lo_hi, pos_small, neg_small = tf.cond(
        bits.u_max < bits.sign_bit,
        lambda: _extrema_nonnegative(bits),
        lambda: _extrema_mixed(bits),
    )
    lo_hi = bits_to_float64(lo_hi, bits.acc)
    small = tf.cond(
        tf.logical_or(pos_small, neg_small),
        lambda: _zeros_and_underflow(bits, pos_small, neg_small),
        lambda: tf.zeros([2], tf.float64),
    )
    sums = _accurate_sums(bits.flat, n, total, total_sq)
    z = tf.constant(0.0, tf.float64)
    return make_record({
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
        lambda: count_true(tf.abs(bits.flat) > margin),
        lambda: tf.constant(0.0, tf.float64),
    )


def _unhealthy_record(bits: _Bits, n: tf.Tensor) -> tf.Tensor:
    """``tensor_stats`` of a tensor with a NaN or Inf, or a square that
    overflowed: count the non-finite elements and redo the rest over the
    finite ones, in float64."""
    flat = bits.flat
    finite = tf.math.is_finite(flat)
    x64 = tf.cast(tf.where(finite, flat, tf.zeros_like(flat)), tf.float64)
    lo_hi = finite_min_max(flat, finite, bits.acc)
    small = _zeros_and_underflow(bits, tf.constant(True), tf.constant(True))
    return make_record({
        "count": n,
        **nonfinite_fields(flat),
        "min": lo_hi[0],
        "max": lo_hi[1],
        "sum": tf.reduce_sum(x64),
        "sum_sq": tf.reduce_sum(tf.square(x64)),
        "zeros": small[0],
        "overflow": overflow_count(flat, finite, metadata.overflow_margin(bits.dtype)),
        "underflow": small[1],
    })


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
