"""On-device statistics of one tensor in JAX: the numerics record, traceable under ``jax.jit``.

``tensor_stats(x)`` gives the record of ``metadata.FIELDS`` as two small
arrays, its counts (int32) and its values, computed with ``jax.numpy``
reductions inside the caller's jitted step; ``to_records`` turns a step's
stacked arrays into float64 records on the host. ``records.numpy_stats`` is
the reference it agrees with: counts and extrema exactly, sums to the
accumulation precision (float32, or float64 for a float64 tensor under
``jax_enable_x64``).

Cost is the design constraint. Measured here in the jitted step of a
6 x 1024 ReLU MLP (batch 512) on CPU: sum, sum of squares, min and max of
every layer output and gradient cost 1.07x the step (XLA fuses them into
one pass per tensor); a count of zeros 1.04x more; integer operations on
the bits, or arithmetic such as ``sign`` fused into a reduction, 1.2x to
1.5x. So the healthy path is those four reductions and the zero count (and,
where subnormals are not flushed, the count of values below the smallest
normal), and the rest runs in ``lax.cond`` branches taken only where
needed: the exact NaN/+Inf/-Inf counts and masked statistics where the sums
are not finite, the overflow count where max |x| passes the margin.

Subnormals: XLA on CPU runs float32 and float64 arithmetic with
denormals-are-zero and flush-to-zero, so the step itself computes with
their subnormals (and bfloat16's, which are float32's) as zeros. There the
record counts them as zeros, not as underflow, and min and max see them as
0: what the device computed with. float16's subnormals are normal float32
values, and on a GPU nothing is flushed: there they are counted as
underflow exactly. ``flushes(dtype)`` says which holds.

Why a scale: JAX has no float64 without ``jax_enable_x64``, and the squares
of finite float32 values beyond about 1.8e19 overflow a float32 sum. Where
max |x| is that large, the sums are taken of ``x / 2**k`` (exact) and the
host multiplies them back in float64, so a finite tensor never reads as an
infinite norm.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tb_numerics import metadata

__all__ = ["COUNT_FIELDS", "VALUE_FIELDS", "check_dtype", "flushes", "sq_norm", "tensor_stats", "to_records", "x64"]

COUNT_FIELDS = ("count", "nan", "posinf", "neginf", "zeros", "overflow", "underflow")
# min and max of the finite elements; the sums of x / scale; the scale.
VALUE_FIELDS = ("min", "max", "sum", "sum_sq", "scale")

# Beyond this max |x| the sums are taken of scaled values (its square is far
# below float32's largest, even summed over a billion elements).
_SCALE_ABOVE = 2.0**40
# A float32 sum of 0/1 values is exact up to 2**24 elements.
_EXACT_FLOAT_COUNT = 2**24


def check_dtype(x, name: str) -> str:
    """The dtype name of ``x`` if numerics are defined for it.

    Raises:
      TypeError: naming the tensor, for a dtype other than float16,
        bfloat16, float32 and float64.
    """
    dtype = jnp.dtype(x.dtype).name
    if dtype not in metadata.DTYPE_LIMITS:
        raise TypeError("tb_numerics: cannot record numerics of %r: its dtype is %s; only float16, bfloat16, "
                        "float32 and float64 tensors are supported" % (name, dtype))
    return dtype


def x64() -> bool:
    """Whether JAX has 64-bit types here (``jax_enable_x64``, or its context manager)."""
    return jax.dtypes.canonicalize_dtype(jnp.float64) == jnp.float64


@functools.lru_cache(maxsize=None)
def flushes(dtype: str, platform: str | None = None) -> bool:
    """Whether compiled arithmetic on ``platform`` (the default backend's)
    flushes ``dtype``'s subnormals to zero: XLA on CPU does for float32 and
    float64 (denormals-are-zero), and so for bfloat16, whose subnormals are
    float32's; float16's are normal float32 values, kept."""
    if dtype == "float16":
        return False
    wide = "float64" if dtype == "float64" and x64() else "float32"
    platform = platform or jax.default_backend()
    with jax.ensure_compile_time_eval():  # run now, also while a step is being traced
        sub = jax.device_put(np.asarray(metadata.smallest_normal(wide) / 2, jnp.dtype(wide)), jax.devices(platform)[0])
        return bool(jax.jit(lambda s: s * jnp.asarray(0.5, s.dtype) == 0)(sub))


def _acc(dtype: str):
    return jnp.float64 if dtype == "float64" and x64() else jnp.float32


def _count(mask) -> jax.Array:
    """The number of True in ``mask``, int32: a float sum where that is exact (fast on CPU)."""
    if mask.size <= _EXACT_FLOAT_COUNT:
        return jnp.sum(mask.astype(jnp.float32)).astype(jnp.int32)
    return jnp.sum(mask, dtype=jnp.int32)


def _small_counts(xa, tiny, flush: bool) -> tuple:
    """(zeros, underflow): where the device flushes subnormals, all values
    below the smallest normal are zeros (a compare that keeps or flushes
    them agrees on that), else they are split exactly."""
    small = _count(jnp.abs(xa) < tiny)
    if flush:
        return small, jnp.zeros((), jnp.int32)
    zeros = _count(xa == 0)
    return zeros, small - zeros


def _masked(xa, tiny, flush: bool) -> tuple:
    """Every statistic of a tensor that holds NaN or Inf (or whose squares
    overflow): counts exact, the rest over its finite elements."""
    finite = jnp.isfinite(xa)
    xf = jnp.where(finite, xa, 0)
    inf = jnp.asarray(jnp.inf, xa.dtype)
    zeros, underflow = _small_counts(xa, tiny, flush)
    return (_count(jnp.isnan(xa)), _count(xa == inf), _count(xa == -inf), zeros, underflow,
            jnp.min(jnp.where(finite, xa, inf), initial=inf), jnp.max(jnp.where(finite, xa, -inf), initial=-inf),
            jnp.sum(xf), jnp.vdot(xf, xf))


def tensor_stats(x, name: str = "tensor") -> tuple:
    """The record of float array ``x`` as (counts int32 ``[7]``, values ``[5]``).

    Counts follow ``COUNT_FIELDS``, values ``VALUE_FIELDS``; ``to_records``
    makes the record of them. ``name`` names the tensor in errors.

    Raises:
      TypeError: ``x`` is not a float16, bfloat16, float32 or float64 array.
    """
    dtype = check_dtype(x, name)
    acc = _acc(dtype)
    xa = lax.stop_gradient(jnp.ravel(x)).astype(acc)
    zero, inf = jnp.zeros((), jnp.int32), jnp.asarray(jnp.inf, acc)
    tiny = jnp.asarray(metadata.smallest_normal(dtype), acc)
    flush = flushes(dtype)
    total, total_sq = jnp.sum(xa), jnp.vdot(xa, xa)
    lo, hi = jnp.min(xa, initial=inf), jnp.max(xa, initial=-inf)
    zeros, underflow = _small_counts(xa, tiny, flush)

    nan, posinf, neginf, zeros, underflow, lo, hi, total, total_sq = lax.cond(
        jnp.isfinite(total) & jnp.isfinite(total_sq),
        lambda _: (zero, zero, zero, zeros, underflow, lo, hi, total, total_sq),
        lambda _: _masked(xa, tiny, flush), None)
    empty = jnp.asarray(x.size == 0)
    lo, hi = jnp.where(empty | ~jnp.isfinite(lo), jnp.nan, lo), jnp.where(empty | ~jnp.isfinite(hi), jnp.nan, hi)
    if flush:  # an extreme that is a subnormal is 0, as the device computes with it
        lo, hi = (jnp.where(jnp.abs(v) < tiny, jnp.zeros((), acc), v) for v in (lo, hi))
    biggest = jnp.nan_to_num(jnp.maximum(jnp.abs(lo), jnp.abs(hi)))
    margin = jnp.asarray(metadata.overflow_margin(dtype), acc)
    overflow = lax.cond(biggest > margin, lambda _: _count(jnp.isfinite(xa) & (jnp.abs(xa) > margin)),
                        lambda _: zero, None)

    def scaled(_):
        scale = jnp.exp2(jnp.floor(jnp.log2(biggest))).astype(acc)
        xs = jnp.where(jnp.isfinite(xa), xa, 0) / scale
        return jnp.sum(xs), jnp.vdot(xs, xs), scale

    total, total_sq, scale = lax.cond(biggest > _SCALE_ABOVE, scaled,
                                      lambda _: (total, total_sq, jnp.asarray(1.0, acc)), None)
    counts = jnp.stack([jnp.asarray(x.size, jnp.int32), nan, posinf, neginf, zeros, overflow, underflow])
    return counts, jnp.stack([lo, hi, total, total_sq, scale]).astype(acc)


def sq_norm(x) -> jax.Array:
    """``sum(x**2)`` in float32 (float64 under x64 for float64), for update ratios."""
    xf = jnp.ravel(x).astype(_acc(jnp.dtype(x.dtype).name))
    return jnp.vdot(xf, xf)


def to_records(counts: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Float64 records ``[n, NUM_FIELDS]`` of stacked ``tensor_stats`` results
    (``counts [n, 7]``, ``values [n, 5]``), on the host."""
    counts = np.asarray(counts, np.float64).reshape(-1, len(COUNT_FIELDS))
    values = np.asarray(values, np.float64).reshape(-1, len(VALUE_FIELDS))
    out = np.zeros((len(counts), metadata.NUM_FIELDS))
    for i, name in enumerate(COUNT_FIELDS):
        out[:, metadata.FIELD_INDEX[name]] = counts[:, i]
    lo, hi, total, total_sq, scale = values.T
    out[:, metadata.FIELD_INDEX["min"]] = lo
    out[:, metadata.FIELD_INDEX["max"]] = hi
    with np.errstate(over="ignore"):
        out[:, metadata.FIELD_INDEX["sum"]] = total * scale
        out[:, metadata.FIELD_INDEX["sum_sq"]] = total_sq * scale * scale
    return out
