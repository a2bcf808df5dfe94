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
   normal (a gradient with zeros): its zeros and subnormals counted.

The zeros and subnormals are counted as float arithmetic, not compares:
min(|x| / tiny, 1), whose ceil and floor summed count the nonzero and the
normal values (``_small``). On a CPU a compare's bool result summed costs
a conversion to int64 of the whole tensor: for a ReLU output's two counts
the compares and sums took 0.75 ms, the arithmetic 0.25 ms (one thread,
512x1024 float32, medians of 30; ``histc``, ``count_nonzero`` and
``vector_norm(ord=-inf)``, tried before, were slower still).

All of it runs on one intra-op thread (``one_thread``): on this 2-core
machine, under the load of other processes, a step's records took 7 to 10
ms on one thread and 15 to 135 ms on two, whose every op waits at a
barrier for a thread the scheduler may have taken away. No round trip per
tensor. Accumulation is in float32 for float16, bfloat16 and
float32 tensors and in float64 for float64 ones. ``records.numpy_stats`` is
the reference: counts and extrema exactly, sums to the accumulation
precision.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from tb_numerics import metadata
from tb_numerics.records import F

__all__ = ["FLOAT_DTYPES", "check_dtype", "one_thread", "records", "sq_norm"]

_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float64: "float64"}
FLOAT_DTYPES = frozenset(_DTYPES)
# A float32 sum of 0 and 1 is exact up to 2**24 elements.
_EXACT_FLOAT_COUNT = 2**24


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


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Runs the block's CPU ops on one intra-op thread, then restores the caller's setting.

    The records' reductions read each tensor once and write a few numbers:
    memory-bound, they gain little from a second thread, while every op
    split over threads waits at a barrier for all of them, and on a loaded
    machine a descheduled thread stalls that op for a scheduler slice.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


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
        """Asks for ``values`` of ``row``: 0-d float tensors (a count is a float sum that is exact)."""
        self._parts.append((row, what, values))

    def results(self) -> list[tuple[int, str, np.ndarray]]:
        """(row, what, its values in float64) of each part, in one copy to the host."""
        if not self._parts:
            return []
        # Every value is 0-d: one stack (promoting to the widest float, exactly), one cast, one copy.
        host = torch.stack([v for _, _, values in self._parts for v in values]).to(torch.float64).cpu().numpy()
        out, at = [], 0
        for row, what, values in self._parts:
            out.append((row, what, host[at:at + len(values)]))
            at += len(values)
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
    with one_thread():
        return _records([x.detach().reshape(-1) for x in tensors], dtypes)


def _records(flats: list[torch.Tensor], dtypes: list[str]) -> np.ndarray:
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
    elif what == "small":  # the nonzero values, and the normal ones
        rec[F["zeros"]], rec[F["underflow"]] = rec[F["count"]] - values[0], values[0] - values[1]
    elif what == "min_abs":
        if values[0] < metadata.smallest_normal(dtype):
            more("small", _small(x, dtype, signed=True))
    else:
        _settle_first(rec, x, dtype, values, more)


def _settle_first(rec: np.ndarray, x: torch.Tensor, dtype: str, first: np.ndarray,
                  more: Callable[[str, list[torch.Tensor]], None]) -> None:
    """A record from round 1's sum, sum of squares, min and max, and what round 2 counts for it."""
    total, sq, lo, hi = first
    if not (np.isfinite(total) and np.isfinite(sq) and np.isfinite(lo) and np.isfinite(hi)):
        more("exact", _exact(x, dtype))
        return
    rec[[F["min"], F["max"], F["sum"], F["sum_sq"]]] = lo, hi, total, sq
    margin = metadata.overflow_margin(dtype)
    if max(abs(lo), abs(hi)) > margin:
        more("overflow", [(x.abs() > margin).sum(dtype=torch.float64)])
    if lo >= 0 or hi <= 0:  # one sign: the smallest magnitude is min, or -max
        if min(abs(lo), abs(hi)) < metadata.smallest_normal(dtype):
            more("small", _small(x, dtype, signed=lo < 0))
    else:
        more("min_abs", [x.abs().amin()])


def _small(x: torch.Tensor, dtype: str, signed: bool) -> list[torch.Tensor]:
    """The nonzero values of a flat tensor, and its normal ones, as float
    arithmetic: min(|x| / tiny, 1) is 1 for a normal value, in (0, 1) for a
    subnormal one (exactly: a power-of-two scale) and 0 for a zero, so its
    ceil and its floor summed count them (see the module's docstring for why
    not compares). ``signed``: whether ``x`` has negative values."""
    scaled = torch.mul(x, 1 / metadata.smallest_normal(dtype))
    if signed:
        scaled.abs_()
    scaled.clamp_(max=1)
    acc = torch.float32 if x.numel() <= _EXACT_FLOAT_COUNT else torch.float64
    return [torch.ceil(scaled).sum(dtype=acc), scaled.floor_().sum(dtype=acc)]


def _exact(x: torch.Tensor, dtype: str) -> list[torch.Tensor]:
    """The whole record (``NUM_FIELDS`` 0-d float64 tensors, on the device) of a tensor
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
    return [fields[name].to(torch.float64) for name in metadata.FIELDS]
