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
   normal (a ReLU's output, with its zeros), its nonzero and its normal
   values counted; one of both signs, its smallest magnitude (one more
   pass), or, where its last record held zeros or subnormals (a gradient
   with zeros), its nonzero and normal values at once;
3. a tensor of both signs whose smallest magnitude is below the smallest
   normal: its nonzero and its normal values counted.

The nonzero and the normal values are each counted as the sum of
|sign(x)|, the normal ones with the CPU flushing subnormals to zero
(``_flushing``: an op then reads a subnormal as a zero). That holds on a
CPU for float32, bfloat16 and float64 (float16 is computed through float32,
where its subnormals are normal), and is checked once per dtype on a probe
tensor (``_flush_works``). Elsewhere, and on other devices, the counts are
float arithmetic: min(|x| / tiny, 1), whose ceil and floor summed count
the nonzero and the normal values (``_small``). For a 1024x1024 gradient
with zeros (one thread, in cache) the smallest magnitude then that
arithmetic took 2.4 ms, the two sums of signs 1.2 ms; ``count_nonzero``
takes 4.2 ms where zeros and nonzeros alternate at random (it branches),
and a compare's bool result summed costs a conversion to int64 of the
whole tensor. The caller's own flushing is put back when the records are
done (``_subnormals_kept``).

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
    with one_thread(), _subnormals_kept():
        return _records([x.detach().reshape(-1) for x in tensors], dtypes, list(names))


@contextlib.contextmanager
def _subnormals_kept() -> Iterator[None]:
    """Runs the block with the CPU keeping subnormals (the records count
    them, and min and max are exact), then puts back the caller's flushing
    (``torch.set_flush_denormal``), which PyTorch cannot be asked for: a
    subnormal doubled reads as 0 where it is on."""
    subnormal = torch.tensor([1 << 20], dtype=torch.int32).view(torch.float32)  # 2**-129, from its bits
    was_on = torch.mul(subnormal, 2.0).item() == 0.0
    if was_on:
        torch.set_flush_denormal(False)
    try:
        yield
    finally:
        if was_on:
            torch.set_flush_denormal(True)


@contextlib.contextmanager
def _flushing() -> Iterator[None]:
    """Runs the block with the CPU reading subnormals as zeros (inside
    ``_subnormals_kept``)."""
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def _nonzero(x: torch.Tensor, signed: bool = True) -> torch.Tensor:
    """How many values of ``x`` are not zero, as a 0-d float64 tensor: the
    sum of |sign(x)|, exact in float32 up to 2**24 values. ``signed=False``:
    ``x`` holds no negative value (a ReLU's output), so sign(x) is summed as
    it is."""
    acc = torch.float32 if x.numel() <= _EXACT_FLOAT_COUNT else torch.float64
    sign = torch.sign(x)
    return (sign.abs_() if signed else sign).sum(dtype=acc).to(torch.float64)


def _normal(x: torch.Tensor, signed: bool = True) -> torch.Tensor:
    """How many values of ``x`` are neither zero nor subnormal, as a 0-d
    float64 tensor: ``_nonzero`` with the CPU reading subnormals as zeros,
    where ``_flush_counts(x)``."""
    with _flushing():
        return _nonzero(x, signed)


def _flush_counts(x: torch.Tensor) -> bool:
    """Whether ``_normal`` counts the normal values of ``x`` (see the module's docstring)."""
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16, torch.float64) and _flush_works(x.dtype)


@functools.cache
def _flush_works(dtype: torch.dtype) -> bool:
    """Whether this CPU and PyTorch count a probe's nonzero and normal values
    of ``dtype`` as ``_nonzero`` and ``_normal`` (flushing may be
    unsupported, or an op may not read the values as floats)."""
    tiny = torch.finfo(dtype).tiny
    probe = torch.tensor([0.0, -0.0, tiny / 4, -tiny / 2, tiny, -tiny, 1.0], dtype=torch.float64).to(dtype)
    return _nonzero(probe).item() == 5 and _normal(probe).item() == 3


# Tensor name -> whether its last record held zeros or subnormals: a tensor
# of both signs that did is counted at once, one that did not has its
# smallest magnitude looked at first (cheaper where there are none). Only
# the order of the passes rests on it, never a count.
_HELD_SMALL: dict[str, bool] = {}
_HELD_SMALL_MAX = 100_000


def _records(flats: list[torch.Tensor], dtypes: list[str], names: list[str]) -> np.ndarray:
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
            _settle(out[i], flats[i], dtypes[i], what, values, functools.partial(later.add, i),
                    _HELD_SMALL.get(names[i], False))
        todo = later
    if len(_HELD_SMALL) > _HELD_SMALL_MAX:
        _HELD_SMALL.clear()
    _HELD_SMALL.update(zip(names, (out[:, F["zeros"]] + out[:, F["underflow"]] > 0).tolist()))
    return out


def _settle(rec: np.ndarray, x: torch.Tensor, dtype: str, what: str, values: np.ndarray,
            more: Callable[[str, list[torch.Tensor]], None], held_small: bool) -> None:
    """Puts a round's numbers into a record; ``more(what, tensors)`` asks the
    next round for more; ``held_small``: whether the tensor's last record
    held zeros or subnormals."""
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
        _settle_first(rec, x, dtype, values, more, held_small)


def _settle_first(rec: np.ndarray, x: torch.Tensor, dtype: str, first: np.ndarray,
                  more: Callable[[str, list[torch.Tensor]], None], held_small: bool) -> None:
    """A record from round 1's sum, sum of squares, min and max, and what
    round 2 counts for it (``held_small``: as ``_settle``'s)."""
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
    elif held_small:
        more("small", _small(x, dtype, signed=True))
    else:
        more("min_abs", [x.abs().amin()])


def _small(x: torch.Tensor, dtype: str, signed: bool) -> list[torch.Tensor]:
    """The nonzero values of a flat tensor, and its normal ones, as float
    arithmetic: min(|x| / tiny, 1) is 1 for a normal value, in (0, 1) for a
    subnormal one (exactly: a power-of-two scale) and 0 for a zero, so its
    ceil and its floor summed count them (see the module's docstring for why
    not compares); by sums of sign(x) where ``_flush_counts(x)``.
    ``signed``: whether ``x`` has negative values."""
    if _flush_counts(x):
        return [_nonzero(x, signed), _normal(x, signed)]
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
