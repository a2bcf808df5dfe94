"""On-device statistics in JAX: the numerics records of a step's tensors, traceable under ``jax.jit``.

``many_stats(tensors)`` gives the records of ``metadata.FIELDS`` of several
tensors as two small arrays, their counts (int32) and their values,
computed with ``jax.numpy`` reductions inside the caller's jitted step;
``to_records`` turns a step's arrays into float64 records on the host.
``records.numpy_stats`` is the reference they agree with: counts and
extrema exactly, sums to the accumulation precision (float32, or float64
for a float64 tensor under ``jax_enable_x64``).

Cost is the design constraint. XLA on a CPU fuses plain arithmetic into a
reduction's one vectorized loop (``sum(x * x)`` costs about what ``sum(x)``
does), but a compare, a select or a cast of a mask in one makes the loop
scalar. Measured here, jitted, over twelve 512x1024 and 1024x1024 float32
tensors beside six of their matmuls (``python`` of the variants side by
side, load 14): sum, sum of squares, min and max cost 22 ms; adding a count
of ``|x| < tiny`` as a mask's sum 145 ms, the same count as arithmetic
(``floor(min(|x| / tiny, 1))`` summed: 1 for a normal value, 0 for a zero)
58 ms; a ``lax.cond`` per tensor about 1.5 ms each. So the healthy path is
those five arithmetic reductions per tensor (and, where subnormals are not
flushed, ``|sign(x)|`` summed for the zeros), and one ``lax.cond`` per call,
taken only where a tensor's sums are not finite or its max |x| is large,
computes that call's exact records: the NaN/+Inf/-Inf counts and masked
statistics, the overflow count, the scaled sums, as two variadic
reductions per tensor (XLA compiles the branch into every step: with a
reduction per statistic it was most of the records' compile time, and the
branch ran 5x slower; ``bench/jax_records.py``).

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

__all__ = ["COUNT_FIELDS", "VALUE_FIELDS", "check_dtype", "flushes", "many_stats", "sq_norm", "tensor_stats", "to_records",
           "value_dtype", "x64"]

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


def value_dtype():
    """The dtype of the records' values: float64 under ``jax_enable_x64``, else float32."""
    return jnp.float64 if x64() else jnp.float32


def _count_ones(ones) -> jax.Array:
    """The sum of an array of 0 and 1, int32: a float sum, fused and vectorized, where that is exact."""
    if ones.size <= _EXACT_FLOAT_COUNT or ones.dtype == jnp.float64:
        return jnp.sum(ones).astype(jnp.int32)
    return jnp.sum(ones.astype(jnp.int32))


class _Operand:
    """One tensor in its accumulation dtype, and the constants of its dtype."""

    def __init__(self, x, name: str):
        self.dtype = check_dtype(x, name)
        self.acc = _acc(self.dtype)
        # In its own shape: a reshaped one is another array to XLA, which
        # materializes it (a ReLU's output computed and written twice).
        self.x = lax.stop_gradient(jnp.asarray(x)).astype(self.acc)
        self.tiny = metadata.smallest_normal(self.dtype)
        self.flush = flushes(self.dtype)
        self.margin = metadata.overflow_margin(self.dtype)

    def extremes(self, lo, hi, empty) -> tuple:
        """min and max as recorded: NaN where there are none; a subnormal one 0 where the device flushes them."""
        nan = jnp.asarray(jnp.nan, self.acc)
        lo, hi = jnp.where(empty | ~jnp.isfinite(lo), nan, lo), jnp.where(empty | ~jnp.isfinite(hi), nan, hi)
        if self.flush:
            tiny = jnp.asarray(self.tiny, self.acc)
            lo, hi = (jnp.where(jnp.abs(v) < tiny, jnp.zeros((), self.acc), v) for v in (lo, hi))
        return lo, hi

    def healthy(self) -> tuple:
        """(counts, values, whether the exact path is needed): five or six fused
        arithmetic reductions, exact for a finite tensor of moderate values."""
        xa, zero, n = self.x, jnp.zeros((), jnp.int32), jnp.asarray(self.x.size, jnp.int32)
        inf = jnp.asarray(jnp.inf, self.acc)
        total, total_sq = jnp.sum(xa), jnp.sum(xa * xa)
        lo, hi = jnp.min(xa, initial=inf), jnp.max(xa, initial=-inf)
        # 1 for a nonzero value, 0 for a zero (or, flushed, a subnormal): no compare in the loop.
        nonzero = _count_ones(jnp.abs(jnp.sign(xa)))
        if self.flush:
            zeros, underflow = n - nonzero, zero
        else:
            # 1 for a normal value, 0 for a zero or a subnormal.
            normal = _count_ones(jnp.floor(jnp.minimum(jnp.abs(xa) * jnp.asarray(1 / self.tiny, self.acc), 1)))
            zeros, underflow = n - nonzero, nonzero - normal
        lo, hi = self.extremes(lo, hi, jnp.asarray(xa.size == 0))
        biggest = jnp.nan_to_num(jnp.maximum(jnp.abs(lo), jnp.abs(hi)))
        need = ~(jnp.isfinite(total) & jnp.isfinite(total_sq)) | (biggest > min(self.margin, _SCALE_ABOVE))
        counts = jnp.stack([n, zero, zero, zero, zeros, zero, underflow])
        return counts, jnp.stack([lo, hi, total, total_sq, jnp.ones((), self.acc)]), need

    def exact(self) -> tuple:
        """(counts, values) of a tensor that holds NaN or Inf, or large values:
        every count exact, the rest over its finite elements, the sums scaled.
        Two variadic reductions (``_reduce``): this branch is rare at run
        time, but XLA compiles it into every step, where a reduction apiece
        (ten) made it four fifths of the records' compile time."""
        xa, acc = self.x, self.acc
        finite = jnp.isfinite(xa)
        absx = jnp.abs(xa)
        inf, zero = jnp.asarray(jnp.inf, acc), jnp.zeros((), jnp.int32)

        def count(mask):
            return mask.astype(jnp.int32)

        lo, hi, nan, posinf, neginf, zeros, small, overflow = _reduce(
            (jnp.where(finite, xa, inf), jnp.where(finite, xa, -inf), count(jnp.isnan(xa)), count(xa == inf),
             count(xa == -inf), count(xa == 0), count(absx < jnp.asarray(self.tiny, acc)),
             count(finite & (absx > jnp.asarray(self.margin, acc)))),
            (inf, -inf) + (zero,) * 6,
            (jnp.minimum, jnp.maximum) + (jnp.add,) * 6)
        lo, hi = self.extremes(lo, hi, jnp.asarray(xa.size == 0))
        biggest = jnp.nan_to_num(jnp.maximum(jnp.abs(lo), jnp.abs(hi)))
        scale = jnp.where(biggest > _SCALE_ABOVE, jnp.exp2(jnp.floor(jnp.log2(jnp.maximum(biggest, 1)))), 1).astype(acc)
        xs = jnp.where(finite, xa, 0) / scale
        total, total_sq = _reduce((xs, xs * xs), (jnp.zeros((), acc),) * 2, (jnp.add, jnp.add))
        # Where the device flushes subnormals, every value below the smallest normal is a zero.
        zeros, underflow = (small, zero) if self.flush else (zeros, small - zeros)
        counts = jnp.stack([jnp.asarray(xa.size, jnp.int32), nan, posinf, neginf, zeros, overflow, underflow])
        return counts, jnp.stack([lo, hi, total, total_sq, scale])


def _reduce(operands: tuple, inits: tuple, ops: tuple) -> tuple:
    """Reductions of same-shaped arrays over all their axes, each with its
    own binary op and initial value, as one variadic reduction (one loop)."""
    return lax.reduce(operands, inits, lambda a, b: tuple(op(x, y) for op, x, y in zip(ops, a, b)),
                      tuple(range(operands[0].ndim)))


def many_stats(tensors: list, names: list[str] | None = None) -> tuple:
    """The records of float arrays ``tensors`` as (counts int32 ``[n, 7]``, values ``[n, 5]``).

    Counts follow ``COUNT_FIELDS``, values ``VALUE_FIELDS`` (in
    ``value_dtype()``); ``to_records`` makes the records of them. One
    ``lax.cond`` for all of them computes the exact records, taken only where
    one needs it (see the module's docstring).

    Args:
      tensors: float16, bfloat16, float32 or float64 arrays (traced ones too).
      names: their names, for errors; by default "tensor".

    Raises:
      TypeError: naming the tensor, for an array of another dtype.
    """
    flats = [_Operand(x, name) for x, name in zip(tensors, names or ["tensor"] * len(tensors))]
    if not flats:
        return jnp.zeros((0, len(COUNT_FIELDS)), jnp.int32), jnp.zeros((0, len(VALUE_FIELDS)), value_dtype())
    healthy = [f.healthy() for f in flats]
    counts = jnp.stack([h[0] for h in healthy])
    values = jnp.stack([h[1].astype(value_dtype()) for h in healthy])
    need = jnp.stack([h[2] for h in healthy])

    def exact(_):
        found = [f.exact() for f in flats]
        return (jnp.where(need[:, None], jnp.stack([e[0] for e in found]), counts),
                jnp.where(need[:, None], jnp.stack([e[1].astype(value_dtype()) for e in found]), values))

    return lax.cond(jnp.any(need), exact, lambda _: (counts, values), None)


def tensor_stats(x, name: str = "tensor") -> tuple:
    """The record of float array ``x`` as (counts int32 ``[7]``, values ``[5]``): ``many_stats`` of one.

    Args:
      x: a float16, bfloat16, float32 or float64 array.
      name: its name, for errors.

    Raises:
      TypeError: ``x`` is not a float16, bfloat16, float32 or float64 array.
    """
    counts, values = many_stats([x], [name])
    return counts[0], values[0]


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
