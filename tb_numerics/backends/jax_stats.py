"""On-device statistics of one tensor in JAX: the numerics record, traceable under ``jax.jit``.

``tensor_stats(x)`` gives the record of ``metadata.FIELDS`` as two small
arrays, its counts (int32) and its values (min, max, sum, sum of squares and
a scale), computed with plain ``jax.numpy`` reductions that XLA fuses into
one or two passes over ``x``; ``to_records`` turns a step's stacked arrays
into float64 records on the host. ``records.numpy_stats`` is the reference
it agrees with: counts and extrema exactly, sums to the accumulation
precision (float32, or float64 for a float64 tensor under ``jax_enable_x64``).

Why bits and not float compares: XLA on CPU runs with denormals-are-zero, so
``x == 0`` holds for a subnormal there and ``min`` cannot order two of them.
Zeros, subnormals (underflow), infinities and NaN are told from the bit
pattern of the magnitude, and min and max are taken over an integer key that
orders floats as their values do (a free view), so every count and extremum
is exact whatever the CPU flushes.

Why a scale: JAX has no float64 without ``jax_enable_x64``, and the squares
of finite float32 values beyond about 1.8e19 overflow a float32 sum. Where
max |x| is that large, the sums are taken of ``x / 2**k`` (exact) and the
host multiplies them back in float64, so a finite tensor never reads as an
infinite norm. The branch (``lax.cond``) runs only for such a tensor.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tb_numerics import metadata

__all__ = ["COUNT_FIELDS", "VALUE_FIELDS", "check_dtype", "sq_norm", "tensor_stats", "to_records"]

COUNT_FIELDS = ("count", "nan", "posinf", "neginf", "zeros", "overflow", "underflow")
VALUE_FIELDS = ("min", "max", "sum", "sum_sq", "scale")

# Per dtype: the unsigned and signed integer views, and the number of bits.
_VIEWS = {
    "float16": (jnp.uint16, jnp.int16, 16),
    "bfloat16": (jnp.uint16, jnp.int16, 16),
    "float32": (jnp.uint32, jnp.int32, 32),
    "float64": (jnp.uint64, jnp.int64, 64),
}
# Beyond this max |x| the sums are taken of scaled values (its square is far
# below float32's largest, even summed over a billion elements).
_SCALE_ABOVE = 2.0**40


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


def _acc(dtype: str):
    return jnp.float64 if dtype == "float64" and x64() else jnp.float32


def x64() -> bool:
    """Whether JAX has 64-bit types here (``jax_enable_x64``, or its context manager)."""
    return jax.dtypes.canonicalize_dtype(jnp.float64) == jnp.float64


def _bits_of(value: float, dtype: str) -> int:
    """The bit pattern of a positive ``value`` rounded to ``dtype``."""
    return int(np.asarray(value, jnp.dtype(dtype)).view(jnp.dtype(_VIEWS[dtype][0])))


def _float_of_key(key, dtype: str, signed):
    """The float whose order key is ``key`` (the key is its own inverse)."""
    bits = _VIEWS[dtype][2]
    mask = jnp.asarray((1 << (bits - 1)) - 1, signed)
    raw = key ^ ((key >> (bits - 1)) & mask)
    return lax.bitcast_convert_type(raw, jnp.dtype(dtype))


def tensor_stats(x, name: str = "tensor"):
    """The record of float array ``x`` as (counts int32 ``[7]``, values ``[5]``).

    Counts follow ``COUNT_FIELDS``, values ``VALUE_FIELDS`` (min and max of
    the finite elements, NaN where there are none; the sums of the finite
    elements divided by ``scale`` and ``scale**2``). ``name`` names the
    tensor in errors.

    Raises:
      TypeError: ``x`` is not a float16, bfloat16, float32 or float64 array.
    """
    dtype = check_dtype(x, name)
    unsigned, signed, bits = _VIEWS[dtype]
    acc = _acc(dtype)
    x = lax.stop_gradient(jnp.ravel(x))
    raw = lax.bitcast_convert_type(x, unsigned)
    sign = (raw >> (bits - 1)).astype(bool)
    mag = raw & jnp.asarray((1 << (bits - 1)) - 1, unsigned)
    inf_bits = _bits_of(np.inf, dtype)
    finite = mag < inf_bits
    is_inf = mag == inf_bits
    count = lambda m: jnp.sum(m, dtype=jnp.int32)  # noqa: E731
    counts = jnp.stack([
        jnp.asarray(x.size, jnp.int32), count(mag > inf_bits), count(is_inf & ~sign), count(is_inf & sign),
        count(mag == 0), count(finite & (mag > _bits_of(metadata.overflow_margin(dtype), dtype))),
        count((mag > 0) & (mag < _bits_of(metadata.smallest_normal(dtype), dtype))),
    ])
    key = lax.bitcast_convert_type(raw, signed)
    key = key ^ ((key >> (bits - 1)) & jnp.asarray((1 << (bits - 1)) - 1, signed))
    lo_key = jnp.min(jnp.where(finite, key, jnp.iinfo(signed).max), initial=jnp.iinfo(signed).max)
    hi_key = jnp.max(jnp.where(finite, key, jnp.iinfo(signed).min), initial=jnp.iinfo(signed).min)
    any_finite = jnp.any(finite)
    lo = jnp.where(any_finite, _float_of_key(lo_key, dtype, signed).astype(acc), jnp.nan)
    hi = jnp.where(any_finite, _float_of_key(hi_key, dtype, signed).astype(acc), jnp.nan)
    xf = jnp.where(finite, x, 0).astype(acc)
    plain = (jnp.sum(xf), jnp.vdot(xf, xf), jnp.asarray(1.0, acc))
    biggest = jnp.maximum(jnp.abs(jnp.nan_to_num(lo)), jnp.abs(jnp.nan_to_num(hi)))

    def scaled(_):
        scale = jnp.exp2(jnp.floor(jnp.log2(biggest))).astype(acc)
        xs = xf / scale
        return jnp.sum(xs), jnp.vdot(xs, xs), scale

    sums = lax.cond(biggest > _SCALE_ABOVE, scaled, lambda _: plain, None)
    return counts, jnp.stack([lo, hi, *sums])


def sq_norm(x):
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
    scale = values[:, 4]
    out[:, metadata.FIELD_INDEX["min"]] = values[:, 0]
    out[:, metadata.FIELD_INDEX["max"]] = values[:, 1]
    with np.errstate(over="ignore"):
        out[:, metadata.FIELD_INDEX["sum"]] = values[:, 2] * scale
        out[:, metadata.FIELD_INDEX["sum_sq"]] = values[:, 3] * scale * scale
    return out
