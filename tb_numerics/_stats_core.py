"""The pieces every TensorFlow statistic shares, and the one TensorFlow rule of "non-finite".

The layer record (``stats``), the op record (``_stats_op``), replica
combining (``_stats_replicas``) and batched segments (``_stats_segments``)
all read a float tensor through the same accumulation dtypes, bit views,
exact extrema and counts, defined here once.

"Non-finite" has one definition per backend: ``records.nonfinite_count`` on
the host (numpy) and ``nonfinite_count`` here (TensorFlow, inside a traced
or compiled step): NaN + +Inf + -Inf, the -Inf left out where it is intended
(an allowlisted tag). ``tests/test_nonfinite_twins.py`` cross-checks the
two; ``tests/test_nonfinite_homes.py`` scans the package for other
definitions. A cheap check that decides on a sum (``sums_finite``: a sum of
values is finite only where each is) may pass a healthy tensor; what fails
it is decided by the rule (``all_finite``): a sum of finite values can
overflow.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from tb_numerics import _requires

tf = _requires.tensorflow(__name__)

from tb_numerics import metadata  # noqa: E402
from tb_numerics.records import F  # noqa: E402

__all__ = [
    "ACC_DTYPE",
    "VIEWS",
    "all_finite",
    "batch_finite",
    "bits_to_float64",
    "check_dtype",
    "count_nonfinite",
    "count_true",
    "exact_min_max",
    "finite_min_max",
    "flatten",
    "float_bits",
    "global_norm_record",
    "in_order",
    "make_record",
    "noinline_function",
    "nonfinite_count",
    "nonfinite_fields",
    "overflow_count",
    "scalar_record",
    "shared_constant",
    "sq_norm",
    "sums_finite",
]

ACC_DTYPE = {
    "float16": tf.float32,
    "bfloat16": tf.float32,
    "float32": tf.float32,
    "float64": tf.float64,
}
# Signed and unsigned integer views of each accumulation dtype, and its sign bit.
VIEWS = {
    tf.float32: (tf.int32, tf.uint32, 1 << 31),
    tf.float64: (tf.int64, tf.uint64, 1 << 63),
}


def float_bits(value: float, acc: tf.DType) -> int:
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
    if dtype not in ACC_DTYPE:
        raise TypeError(
            "tb_numerics: cannot record numerics of %r: its dtype is %s; only "
            "float16, bfloat16, float32 and float64 tensors are supported"
            % (name, dtype)
        )
    return dtype


# The shapes and axes that every record repeats (a flat shape, a reduction
# axis), one constant per graph instead of one per tensor: ResNet-50's step
# with the callback held some 1,400 constants more than without it, each a
# node to trace and then to optimise before the first step.
_SHARED: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def shared_constant(value: Any, dtype: tf.DType = tf.int32) -> tf.Tensor:
    """A constant ``value`` of ``dtype``, made once per graph being traced (eagerly, a fresh one).

    Made outside any control dependency of the caller's context, so that it
    can serve every later use in the graph."""
    if tf.executing_eagerly():
        return tf.constant(value, dtype)
    graph = tf.compat.v1.get_default_graph()
    cache = _SHARED.setdefault(graph, {})
    key = (dtype.name, repr(np.asarray(value).tolist()))
    if key not in cache:
        with graph.control_dependencies(None), graph.name_scope(None):
            cache[key] = tf.constant(value, dtype, name="tb_numerics_shared")
    return cache[key]


def flatten(x: tf.Tensor) -> tf.Tensor:
    """``x`` as a flat vector (its shape constant shared: ``shared_constant``)."""
    return tf.reshape(x, shared_constant([-1]))


def in_order(parts: list[tf.Tensor], order: list[int]) -> tf.Tensor:
    """Per-tensor results made in groups (``parts``, rows along axis 0),
    concatenated and put back in the tensors' own order: ``order`` holds
    each row's tensor position, as the groups made them."""
    out = tf.concat(parts, 0) if len(parts) > 1 else parts[0]
    return out if order == sorted(order) else tf.gather(out, np.argsort(order))


# The statistics functions, each traced once per process (functools.cache):
# one per (dtype, count dtype) for tensor_stats, one per dtype for op_stats.
# Tracing them inline, once per tensor, cost a model of a few dozen layers
# tens of seconds before its first step (Python tracing of each branch,
# then graph optimisation of the whole step); called as one function, not
# inlined ("_noinline"), the body is traced and optimised once, and a call
# costs no more per step than the inlined ops did.


def noinline_function(body: Callable[..., Any], *signature: tf.TensorSpec, jit_compile: bool = False) -> Callable[..., Any]:
    """``body`` as a ``tf.function`` of ``signature``, called (not inlined)
    from the graph that calls it; with ``jit_compile``, as one XLA computation."""
    return tf.function(
        body,
        input_signature=signature,
        autograph=False,
        jit_compile=jit_compile or None,
        experimental_attributes={"_noinline": True},
    )


def make_record(fields: Mapping[str, tf.Tensor]) -> tf.Tensor:
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


def nonfinite_fields(flat: tf.Tensor) -> dict[str, tf.Tensor]:
    """The ``nan``, ``posinf`` and ``neginf`` fields of a flat tensor: exact
    counts, three elementwise passes, so only for a tensor known to hold one."""
    inf = tf.constant(np.inf, flat.dtype)
    return {
        "nan": count_true(tf.math.is_nan(flat)),
        "posinf": count_true(tf.equal(flat, inf)),
        "neginf": count_true(tf.equal(flat, -inf)),
    }


def overflow_count(flat: tf.Tensor, finite: tf.Tensor, margin: float) -> tf.Tensor:
    """The finite elements beyond the overflow margin (Inf is counted as Inf, not here)."""
    return count_true(tf.logical_and(finite, tf.abs(flat) > margin))


def finite_min_max(flat: tf.Tensor, finite: tf.Tensor, acc: tf.DType) -> tf.Tensor:
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
    exact = exact_min_max(tf.where(finite, flat, some), acc)
    return tf.where(tf.reduce_any(finite), exact, tf.constant(np.nan, tf.float64))


def exact_min_max(flat: tf.Tensor, acc: tf.DType) -> tf.Tensor:
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
    int_t, uint_t, sign_bit = VIEWS[acc]
    unsigned = tf.bitcast(flat, uint_t)
    u_max, u_min = tf.reduce_max(unsigned), tf.reduce_min(unsigned)
    s_max = tf.bitcast(tf.reduce_max(tf.bitcast(flat, int_t)), uint_t)
    sign = tf.constant(sign_bit, uint_t)
    lo = tf.where(u_max >= sign, u_max, u_min)
    hi = tf.where(u_min >= sign, u_min, s_max)
    return bits_to_float64(tf.stack([lo, hi]), acc)


def bits_to_float64(bits: tf.Tensor, acc: tf.DType) -> tf.Tensor:
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


def count_true(mask: tf.Tensor) -> tf.Tensor:
    """The number of true elements of ``mask``, exactly, as float64."""
    return tf.cast(tf.math.count_nonzero(mask, dtype=tf.int64), tf.float64)


def sq_norm(x: tf.Tensor) -> tf.Tensor:
    """||x||^2 as float64, from one dot product (a single pass over x).

    Half-precision inputs are widened first so that the sum cannot overflow.
    """
    flat = tf.reshape(x, shared_constant([1, -1]))
    if flat.dtype in (tf.float16, tf.bfloat16):
        flat = tf.cast(flat, tf.float32)
    return tf.cast(tf.squeeze(tf.matmul(flat, flat, transpose_b=True)), tf.float64)



# ------------------------------------------------------------ the rule


def _rule(nan: tf.Tensor, posinf: tf.Tensor, neginf: tf.Tensor, neginf_ok: Any) -> tf.Tensor:
    """NaN + +Inf + -Inf, the -Inf left out where ``neginf_ok``: the one
    place the TensorFlow side combines the three counts."""
    ok = tf.convert_to_tensor(neginf_ok, tf.bool)
    return nan + posinf + tf.where(ok, tf.zeros_like(neginf), neginf)


def nonfinite_count(records: Any, neginf_ok: Any = False) -> tf.Tensor:
    """The TensorFlow twin of ``records.nonfinite_count``: the non-finite
    values of records ``[..., NUM_FIELDS]``, per record, as float64.

    Args:
      records: float records (``tensor_stats``, ``op_stats``), any leading shape.
      neginf_ok: whether -Inf is intended (not counted): a bool, or one per
        record (a numpy array or bool tensor broadcast against ``records[..., 0]``).
    """
    r = tf.convert_to_tensor(records, tf.float64)
    return _rule(r[..., F["nan"]], r[..., F["posinf"]], r[..., F["neginf"]], neginf_ok)


def count_nonfinite(x: Any, neginf_ok: Any = False) -> tf.Tensor:
    """The rule on a tensor's own elements: its float64 count of NaN, +Inf
    and (unless ``neginf_ok``) -Inf. Exact, three elementwise passes: for a
    slow path, once a cheap check said the tensor may hold one.

    Args:
      x: a float tensor (or ``tf.IndexedSlices``: its values).
      neginf_ok: whether -Inf is intended in it.
    """
    if isinstance(x, tf.IndexedSlices):
        x = x.values
    fields = nonfinite_fields(tf.reshape(tf.convert_to_tensor(x), [-1]))
    return _rule(fields["nan"], fields["posinf"], fields["neginf"], neginf_ok)


def sums_finite(sums: Sequence[tf.Tensor]) -> tf.Tensor:
    """The fast check: whether every one of ``sums`` (plain sums or sums of
    squares, already computed) is finite. True means no element of what was
    summed is NaN or Inf; False only that one may be (``all_finite`` decides)."""
    by_dtype: dict[Any, list[tf.Tensor]] = {}
    for s in sums:
        by_dtype.setdefault(s.dtype, []).append(tf.reshape(s, []) if s.shape.rank else s)
    # One test per dtype, not one per sum (ResNet-50's step decides on 214).
    return tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(tf.stack(group))) for group in by_dtype.values()]))


def all_finite(tensors: Sequence[Any]) -> tf.Tensor:
    """Whether no element of ``tensors`` (float tensors or
    ``tf.IndexedSlices``) is NaN or Inf (-Inf too: no allowlist), as a bool
    tensor."""
    values = [t.values if isinstance(t, tf.IndexedSlices) else t for t in tensors]
    if not values:
        return tf.constant(True)
    return _all_counted_finite(values)


def batch_finite(structure: Any) -> bool:
    """Whether every float tensor (or numpy float array) of a step's batch,
    any nested structure, is finite: what a replay that found an op reading
    a NaN or an Inf asks, eagerly, of the batch the step received."""
    leaves = [tf.convert_to_tensor(t) for t in tf.nest.flatten(structure, expand_composites=True)
              if tf.is_tensor(t) or isinstance(t, np.ndarray)]
    return bool(all_finite([t for t in leaves if t.dtype.is_floating]))


@functools.partial(tf.function, autograph=False, experimental_attributes={"_noinline": True})
def _all_counted_finite(tensors: list[tf.Tensor]) -> tf.Tensor:
    """Whether every element of every one of ``tensors`` is finite: the rule
    with no -Inf allowed (``count_nonfinite(t) == 0`` for each), decided
    without counting, one elementwise test and one reduction per tensor.

    One function call in the caller's graph, not inlined: in the branch a
    healthy step does not take, its ops would each still be visited as dead
    on every step. Two ops a tensor, not the count's dozen: ResNet-50's 214
    gradients made 5,594 nodes here with the counts, traced and optimised
    before the first step (``bench/arch_cost.py --first-epoch``).
    """
    return tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(flatten(t)), axis=shared_constant(0))
                                   for t in tensors]))


# ------------------------------------------------------------ one value


def global_norm_record(vecs: tf.Tensor, dtype: str) -> tf.Tensor:
    """The record of the global L2 norm of tensors from their records ``vecs`` [n, F].

    The TensorFlow twin of ``records.global_norm_record``: sqrt of the
    summed squares in float64 (NaN if any element is NaN, else Inf if any
    is Inf, as ``tf.linalg.global_norm``), with no extra pass over the data,
    recorded as one value of ``dtype`` as ``records.scalar_record`` does:
    not rounded to ``dtype``, so a norm of finite gradients beyond its range
    is a finite record that counts as an overflow, never a fake +Inf.
    """
    vecs = tf.reshape(tf.cast(vecs, tf.float64), [-1, metadata.NUM_FIELDS])
    nan = tf.reduce_sum(vecs[:, F["nan"]])
    inf = tf.reduce_sum(vecs[:, F["posinf"]] + vecs[:, F["neginf"]])
    norm = tf.sqrt(tf.reduce_sum(vecs[:, F["sum_sq"]]))
    norm = tf.where(nan > 0, tf.constant(np.nan, tf.float64), tf.where(inf > 0, tf.constant(np.inf, tf.float64), norm))
    return scalar_record(norm, dtype)


def scalar_record(value: tf.Tensor, dtype: str) -> tf.Tensor:
    """The record of one float64 value held to ``dtype``'s range: the
    TensorFlow twin of ``records.scalar_record``."""
    v = tf.reshape(tf.cast(value, tf.float64), [])
    finite = tf.math.is_finite(v)
    fin = tf.where(finite, v, tf.constant(0.0, tf.float64))
    extreme = tf.where(finite, v, tf.constant(np.nan, tf.float64))
    mag = tf.abs(fin)
    return make_record({
        "count": tf.constant(1.0, tf.float64), **nonfinite_fields(tf.reshape(v, [1])),
        "min": extreme, "max": extreme, "sum": fin, "sum_sq": fin * fin,
        "zeros": count_true(finite & tf.equal(v, 0.0)),
        "overflow": count_true(mag > metadata.overflow_margin(dtype)),
        "underflow": count_true((mag > 0) & (mag < metadata.smallest_normal(dtype))),
    })
