"""Statistics of tensors in PyTorch: the numerics records of a step's tensors, a few copies to the host per step.

PyTorch runs eagerly: every reduction is a pass of its own over the
tensor (nothing fuses them), and on a CPU an op that writes a tensor-sized
result costs more than a reduction. So ``records(tensors)`` reads each
tensor as few times as its record allows, in rounds that each end with one
copy of a few numbers per tensor to the host, for all the tensors at once:

1. every tensor: its sum, its sum of squares (a dot product) and its min
   and max together (``aminmax``): three passes, which are also the finite
   check (a sum of squares is finite only where no element is NaN or Inf
   and no square overflows);
2. only where those leave the record open: a tensor that is not finite
   gets its exact record (NaN, +Inf and -Inf counts, masked statistics in
   float64); one beyond its dtype's overflow margin, that count; one of one
   sign whose smallest magnitude (its min, or -max) is below the smallest
   normal (a ReLU's output, with its zeros), its zeros and subnormals
   counted; one of both signs, its smallest magnitude (one more pass);
3. a tensor of both signs whose smallest magnitude is below the smallest
   normal: its zeros and subnormals counted.

So a ReLU's output costs five passes and a gradient four. The small
counts and the smallest magnitude are a compare or an ``abs`` and a
reduction: on a CPU these beat the one-pass ``histc``, ``count_nonzero``
and ``vector_norm(ord=-inf)`` they replaced by 5x to 10x (one thread,
512x1024 and 1024x1024 float32, medians of 60 alternated runs; a ReLU
output's two counts 12.3 ms before, 1.5 ms after). No round trip per
tensor. Accumulation is in float32 for float16, bfloat16 and
float32 tensors and in float64 for float64 ones. ``records.numpy_stats`` is
the reference: counts and extrema exactly, sums to the accumulation
precision.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import numpy as np
import torch

from tb_numerics import metadata
from tb_numerics.records import F

__all__ = ["FLOAT_DTYPES", "check_dtype", "records", "sq_norm"]

_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float64: "float64"}
FLOAT_DTYPES = frozenset(_DTYPES)


def check_dtype(x: torch.Tensor, name: str) -> str:
    """The dtype name of ``x`` if numerics are defined for it.

    Args:
      x: a tensor.
      name: its name, for the error.

    Raises:
      TypeError: naming the tensor, for a dtype other than float16,
        bfloat16, float32 and float64.
    """
    dtype = _DTYPES.get(x.dtype)
    if dtype is None:
        raise TypeError("tb_numerics: cannot record numerics of %r: its dtype is %s; only float16, bfloat16, "
                        "float32 and float64 tensors are supported" % (name, str(x.dtype).replace("torch.", "")))
    return dtype


def _acc(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def sq_norm(x: torch.Tensor) -> torch.Tensor:
    """``sum(x**2)`` in the accumulation dtype.

    Args:
      x: a float tensor.
    """
    flat = x.detach().reshape(-1)
    if flat.dtype in (torch.float32, torch.float64):
        return torch.dot(flat, flat)
    return torch.linalg.vector_norm(flat, dtype=torch.float32) ** 2


class _Round:
    """One round of work: per (row, what) a few 0-d results, copied to the host together."""

    def __init__(self) -> None:
        self._parts: list[tuple[int, str, list[torch.Tensor]]] = []

    def __bool__(self) -> bool:
        return bool(self._parts)

    def add(self, row: int, what: str, values: list[torch.Tensor]) -> None:
        self._parts.append((row, what, values))

    def results(self) -> list[tuple[int, str, np.ndarray]]:
        """(row, what, its values in float64) of each part, in one copy to the host."""
        if not self._parts:
            return []
        host = torch.cat([v.reshape(-1).to(torch.float64) for _, _, values in self._parts for v in values]).cpu().numpy()
        out, at = [], 0
        for row, what, values in self._parts:
            n = sum(v.numel() for v in values)
            out.append((row, what, host[at:at + n]))
            at += n
        return out


def records(tensors: Sequence[torch.Tensor], names: Sequence[str]) -> np.ndarray:
    """Float64 records ``[n, NUM_FIELDS]`` of ``tensors``, in at most three
    rounds of one copy to the host each (see the module's docstring).

    Args:
      tensors: float16, bfloat16, float32 or float64 tensors, on any device.
      names: their names, for errors.

    Raises:
      TypeError: naming the tensor, for a tensor of another dtype.
    """
    dtypes = [check_dtype(x, name) for x, name in zip(tensors, names)]
    flats = [x.detach().reshape(-1) for x in tensors]
    out = np.zeros((len(flats), metadata.NUM_FIELDS))
    first = _Round()
    for i, x in enumerate(flats):
        out[i, F["count"]] = x.numel()
        if x.numel():
            lo, hi = torch.aminmax(x)
            first.add(i, "first", [x.sum(dtype=_acc(x)), sq_norm(x), lo, hi])
        else:
            out[i, [F["min"], F["max"]]] = np.nan
    todo = first
    while todo:
        later = _Round()
        for i, what, values in todo.results():
            _settle(out[i], flats[i], dtypes[i], what, values, functools.partial(later.add, i))
        todo = later
    return out


def _settle(rec: np.ndarray, x: torch.Tensor, dtype: str, what: str, values: np.ndarray,
            more: Callable[[str, list[torch.Tensor]], None]) -> None:
    """Puts a round's numbers into a record; ``more(what, tensors)`` asks the next round for more."""
    if what == "exact":
        rec[:] = values
    elif what == "overflow":
        rec[F["overflow"]] = values[0]
    elif what == "small":  # the zeros, and the zeros and subnormals together
        rec[F["zeros"]], rec[F["underflow"]] = values[0], values[1] - values[0]
    elif what == "min_abs":
        if values[0] < metadata.smallest_normal(dtype):
            more("small", _small(x, dtype))
    else:
        _settle_first(rec, x, dtype, values, more)


def _settle_first(rec: np.ndarray, x: torch.Tensor, dtype: str, first: np.ndarray,
                  more: Callable[[str, list[torch.Tensor]], None]) -> None:
    """A record from round 1's sum, sum of squares, min and max, and what round 2 counts for it."""
    total, sq, lo, hi = first
    if not (np.isfinite(total) and np.isfinite(sq) and np.isfinite(lo) and np.isfinite(hi)):
        more("exact", [_exact(x, dtype)])
        return
    rec[[F["min"], F["max"], F["sum"], F["sum_sq"]]] = lo, hi, total, sq
    margin = metadata.overflow_margin(dtype)
    if max(abs(lo), abs(hi)) > margin:
        more("overflow", [torch.count_nonzero(x.abs() > margin)])
    if lo >= 0 or hi <= 0:  # one sign: the smallest magnitude is min, or -max
        if min(abs(lo), abs(hi)) < metadata.smallest_normal(dtype):
            more("small", _small(x, dtype))
    else:
        more("min_abs", [x.abs().amin()])


def _small(x: torch.Tensor, dtype: str) -> list[torch.Tensor]:
    """The zeros, and the zeros and subnormals together, of a flat tensor:
    a compare and a sum each (see the module's docstring for why not
    ``histc`` or ``count_nonzero``)."""
    return [(x == 0).sum(), (x.abs() < metadata.smallest_normal(dtype)).sum()]


def _exact(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """The whole record (float64 ``[NUM_FIELDS]``, on the device) of a tensor
    that holds NaN or Inf, or whose squares overflow: masked statistics in
    float64, every count exact."""
    finite = torch.isfinite(x)
    xf = torch.where(finite, x, torch.zeros((), dtype=x.dtype, device=x.device)).to(torch.float64)
    absf = xf.abs()
    inf = torch.tensor(float("inf"), dtype=torch.float64, device=x.device)
    lo = torch.where(finite, xf, inf).min()
    hi = torch.where(finite, xf, -inf).max()
    any_finite = finite.any()
    nan = torch.tensor(float("nan"), dtype=torch.float64, device=x.device)
    margin, tiny = metadata.overflow_margin(dtype), metadata.smallest_normal(dtype)
    fields = {
        "count": torch.tensor(x.numel(), device=x.device), "nan": torch.isnan(x).sum(),
        "posinf": (x == float("inf")).sum(), "neginf": (x == float("-inf")).sum(),
        "min": torch.where(any_finite, lo, nan), "max": torch.where(any_finite, hi, nan),
        "sum": xf.sum(), "sum_sq": torch.dot(xf, xf), "zeros": (x == 0).sum(),
        "overflow": (finite & (absf > margin)).sum(), "underflow": ((absf > 0) & (absf < tiny)).sum(),
    }
    return torch.stack([fields[name].to(torch.float64) for name in metadata.FIELDS])
