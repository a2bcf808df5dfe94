"""Statistics of tensors in PyTorch: the numerics record, a copy of a few numbers to the host per step.

A step's tensors are summarised in two rounds. ``quick(x)`` runs on the
device as the step runs: five plain reductions (sum, sum of squares, min,
max and min |x|), which are also the finite check (a sum of squares is
finite only where no element is NaN or Inf). After the step, ``records``
copies every tensor's quick numbers to the host at once, and only where
they do not settle the record does it count more, on the device, in one
more round: the exact NaN, +Inf and -Inf counts and the masked statistics
of a tensor that is not finite (in float64), the zeros and subnormals of
one whose min |x| is below the smallest normal (a ReLU's output), the
values beyond the overflow margin of one whose max |x| passes it. No round
trip per tensor; no tensor-sized temporary on the healthy path (on a CPU
an op that writes one costs more than a reduction: its pages are new at
every step).

Accumulation is in float32 for float16, bfloat16 and float32 tensors and in
float64 for float64 ones. ``records.numpy_stats`` is the reference: counts
and extrema exactly, sums to the accumulation precision.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from tb_numerics import metadata
from tb_numerics.records import F

__all__ = ["FLOAT_DTYPES", "check_dtype", "quick", "records", "sq_norm"]

_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float64: "float64"}
FLOAT_DTYPES = frozenset(_DTYPES)


def check_dtype(x: torch.Tensor, name: str) -> str:
    """The dtype name of ``x`` if numerics are defined for it.

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
    """``sum(x**2)`` in the accumulation dtype."""
    flat = x.detach().reshape(-1)
    if flat.dtype in (torch.float32, torch.float64):
        return torch.dot(flat, flat)
    return torch.linalg.vector_norm(flat, dtype=torch.float32) ** 2


_MANTISSA_BITS = {"float16": 10, "bfloat16": 7, "float32": 23, "float64": 52}


def _below_smallest_normal(dtype: str) -> float:
    """The largest value of ``dtype`` below its smallest normal (its largest subnormal)."""
    tiny = metadata.smallest_normal(dtype)
    return tiny - tiny * 2.0 ** -_MANTISSA_BITS[dtype]


def quick(x: torch.Tensor, name: str = "tensor") -> torch.Tensor:
    """Float64 ``[6]`` on ``x``'s device: count, sum, sum of squares, min, max,
    and min |x| of ``x`` (min and max NaN where ``x`` is empty).

    Five reductions and no tensor-sized temporary (on a CPU an op that writes
    one costs more than a reduction: its pages are new at every step). Only a
    tensor whose min |x| is below the smallest normal (it holds a zero or a
    subnormal) has them counted, in ``records``' second round.

    Raises:
      TypeError: ``x`` is not a float16, bfloat16, float32 or float64 tensor.
    """
    check_dtype(x, name)
    flat = x.detach().reshape(-1)
    if not flat.numel():
        nan = torch.tensor(float("nan"), dtype=torch.float64, device=flat.device)
        zero = torch.zeros((), dtype=torch.float64, device=flat.device)
        return torch.stack([zero, zero, zero, nan, nan, nan])
    parts = [torch.tensor(float(flat.numel()), dtype=torch.float64, device=flat.device),
             flat.sum(dtype=_acc(flat)), sq_norm(flat), flat.min(), flat.max(),
             torch.linalg.vector_norm(flat, ord=float("-inf"))]
    return torch.stack([p.to(torch.float64) for p in parts])


def _exact(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """The whole record (float64 ``[NUM_FIELDS]``, on the device) of a tensor
    that holds NaN or Inf, or whose squares overflow: masked statistics in
    float64, every count exact."""
    flat = x.detach().reshape(-1)
    finite = torch.isfinite(flat)
    xf = torch.where(finite, flat, torch.zeros((), dtype=flat.dtype, device=flat.device)).to(torch.float64)
    absf = xf.abs()
    inf = torch.tensor(float("inf"), dtype=torch.float64, device=flat.device)
    lo = torch.where(finite, xf, inf).min()
    hi = torch.where(finite, xf, -inf).max()
    any_finite = finite.any()
    nan = torch.tensor(float("nan"), dtype=torch.float64, device=flat.device)
    margin, tiny = metadata.overflow_margin(dtype), metadata.smallest_normal(dtype)
    fields = {
        "count": torch.tensor(flat.numel(), device=flat.device), "nan": torch.isnan(flat).sum(),
        "posinf": (flat == float("inf")).sum(), "neginf": (flat == float("-inf")).sum(),
        "min": torch.where(any_finite, lo, nan), "max": torch.where(any_finite, hi, nan),
        "sum": xf.sum(), "sum_sq": torch.dot(xf, xf), "zeros": (flat == 0).sum(),
        "overflow": (finite & (absf > margin)).sum(), "underflow": ((absf > 0) & (absf < tiny)).sum(),
    }
    return torch.stack([fields[name].to(torch.float64) for name in metadata.FIELDS])


def records(tensors: Sequence[torch.Tensor | None], quicks: Sequence[torch.Tensor | None]) -> np.ndarray:
    """Float64 records ``[n, NUM_FIELDS]`` of ``tensors`` from their
    ``quick`` numbers (one copy to the host), counting more, on the device
    and copied in one more round, only where those do not settle a record.
    A None tensor gives a row of zeros."""
    out = np.zeros((len(tensors), metadata.NUM_FIELDS))
    have = [i for i, q in enumerate(quicks) if q is not None]
    if not have:
        return out
    q = torch.stack([quicks[i] for i in have]).cpu().numpy()
    more: list[tuple[int, int | None, torch.Tensor]] = []  # (row, field or None for all, tensor)
    for k, i in enumerate(have):
        x, (n, total, sq, lo, hi, min_abs) = tensors[i], q[k]
        dtype = _DTYPES[x.dtype]
        if not (np.isfinite(total) and np.isfinite(sq) and (n == 0 or (np.isfinite(lo) and np.isfinite(hi)))):
            more.append((i, None, _exact(x, dtype)))
            continue
        out[i, [F["count"], F["min"], F["max"], F["sum"], F["sum_sq"]]] = n, lo, hi, total, sq
        flat = x.detach().reshape(-1)
        if n and min_abs < metadata.smallest_normal(dtype):  # zeros or subnormals: count them
            more.append((i, F["zeros"], n - torch.count_nonzero(flat)))
            more.append((i, F["underflow"], torch.histc(flat, bins=1, min=-_below_smallest_normal(dtype),
                                                        max=_below_smallest_normal(dtype))[0]))
        margin = metadata.overflow_margin(dtype)
        if n and max(abs(lo), abs(hi)) > margin:
            more.append((i, F["overflow"], torch.count_nonzero(flat.abs() > margin)))
    if more:
        values = torch.cat([t.reshape(-1).to(torch.float64) for _, _, t in more]).cpu().numpy()
        at = 0
        for i, field, t in more:
            if field is None:
                out[i] = values[at:at + metadata.NUM_FIELDS]
                at += metadata.NUM_FIELDS
            else:  # the near-zero count holds the zeros, counted just before it
                out[i, field] = values[at] - (out[i, F["zeros"]] if field == F["underflow"] else 0)
                at += 1
    return out
