"""The dashboard's views of a run: the health timeline and the charts' points.

Both downsample without hiding anything: a timeline cell holds the worst
health of its bucket of steps, a chart point its bucket's min of mins, max
of maxes and sums of counts. Numpy only, no TensorFlow.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from tb_numerics import compact, rules
from tb_numerics.health import SeriesHealth
from tb_numerics.records import F, derived
from tb_numerics.run_analysis import RunAnalysis

__all__ = ["series_points", "timeline"]


def timeline(
    ra: RunAnalysis, width: int, start: int | None = None, end: int | None = None
) -> dict[str, Any]:
    """Health of every tensor over steps, in at most ``width`` buckets.

    Each bucket holds the worst health of the records in it, so a single
    non-finite step is never hidden by downsampling. Cells with no record are
    ``rules.NO_DATA``. Rows are in execution order.

    Args:
      ra: the run.
      width: the most buckets, at least 1.
      start, end: the steps to keep (inclusive); None: from the first, to the last.

    Raises:
      ValueError: ``width`` is below 1.
    """
    if width < 1:
        raise ValueError("width must be at least 1")
    steps = ra.steps
    if start is not None:
        steps = steps[steps >= start]
    if end is not None:
        steps = steps[steps <= end]
    rows = []
    if steps.size == 0:
        edges = np.zeros(0, np.int64)
    elif steps.size <= width:
        edges = steps
    else:
        lo, hi = int(steps[0]), int(steps[-1])
        n = min(width, hi - lo + 1)
        # Bucket b covers steps [edges[b], edges[b+1]).
        edges = np.unique(lo + (np.arange(n, dtype=np.int64) * (hi - lo + 1)) // n)
    nb = len(edges)
    for h in ra.health:
        cells = np.full(nb, rules.NO_DATA, dtype=np.int8)
        st = h.series.steps
        if nb:
            lo_i = np.searchsorted(st, edges[0])
            hi_i = np.searchsorted(st, steps[-1], side="right")
            st_sel, codes = st[lo_i:hi_i], h.codes[lo_i:hi_i]
            if st_sel.size:
                # Index of each bucket's first record: O(buckets x log n), not
                # O(n x log buckets) (a 100k-step row costs microseconds).
                first = np.searchsorted(st_sel, edges)
                full = np.r_[first[1:], st_sel.size] > first
                cells[full] = np.maximum.reduceat(codes, first[full])
        info = h.series.info
        rows.append({"tensor": h.series.tag, "role": info.role, "phase": info.phase, "op_type": info.op_type or None,
                     "dtype": info.dtype, "cells": cells.tolist()})
    bucket_end = np.r_[edges[1:] - 1, steps[-1]].tolist() if nb else []
    return {"run": ra.run, "bucket_start": edges.tolist(), "bucket_end": bucket_end, "rows": rows}



# ---------------------------------------------------------------- charts

_CHART_COUNTS = compact.CHART_COUNTS
_CHART_MOMENTS = compact.CHART_MOMENTS
# A compact series' records are read back for a chart where that decodes at
# most this many records (its blocks' other tensors' too: 2,000 steps of a
# 500-tensor run, about 0.3 s); a wider chart is made of its chunks'
# aggregates (``compact.ChunkStats``).
READ_BACK_RECORDS = 1_000_000


def series_points(
    h: SeriesHealth, max_points: int, start: int | None = None, end: int | None = None
) -> dict[str, Any]:
    """One tensor's statistics over a step range, for charts, in at most ``max_points`` points.

    Beyond ``max_points`` records, points are buckets of equal record
    counts: the min of mins, max of maxes and max of max |x|, the mean of
    the finite means, stds and L2 norms, the sum of counts, the worst health
    and the first warning kind, each bucket with its first and last step.
    A long run's (compact) series over more steps than can be read back
    quickly (``READ_BACK_RECORDS``) makes its buckets of whole chunks of
    ``compact.CHUNK`` records (the same statistics, exact), so its first and
    last points may reach past ``start`` and ``end``: their steps say so.

    Args:
      h: the tensor's series and health (``RunAnalysis.find``).
      max_points: the most points returned, at least 1.
      start, end: the steps to keep (inclusive); None: from the first, to the last.

    Returns:
      ``steps`` and ``step_end`` (each point's first and last step), ``fields``
      (each statistic by name: floats, NaN where a record had no finite
      value, None where it does not hold the sums a moment comes from, as
      op-level records; counts as ints), ``health``, ``kinds`` and
      ``downsampled``.

    Raises:
      ValueError: ``max_points`` is below 1.
    """
    if max_points < 1:
        raise ValueError("max_points must be at least 1")
    steps = h.series.steps
    lo = 0 if start is None else int(np.searchsorted(steps, start, side="left"))
    hi = len(steps) if end is None else int(np.searchsorted(steps, end, side="right"))
    if isinstance(h.series, compact.CompactSeries) and (hi - lo) * h.series.width > READ_BACK_RECORDS:
        return _chunk_points(h, max_points, lo, hi)
    steps, codes, kinds = steps[lo:hi], h.codes[lo:hi], h.kinds[lo:hi]
    # float64: bucket sums of float32 counts would round.
    columns, unrecorded = _chart_columns(h.series.records(lo, hi))
    if len(steps) <= max_points:
        return {
            "steps": steps.tolist(),
            "step_end": steps.tolist(),
            "fields": _point_fields(columns, unrecorded),
            "health": codes.astype(int).tolist(),
            "kinds": [rules.KIND_NAMES[k - 1] if k else None for k in kinds.tolist()],
            "downsampled": False,
        }
    n = len(steps)
    bounds = np.unique((np.arange(max_points, dtype=np.int64) * n) // max_points)
    ends = np.r_[bounds[1:], n]
    return {
        "steps": steps[bounds].tolist(),
        "step_end": steps[ends - 1].tolist(),
        "fields": _bucket_fields(columns, unrecorded, bounds),
        "health": np.maximum.reduceat(codes, bounds).astype(int).tolist(),
        "kinds": _bucket_kinds(kinds, bounds, ends),
        "downsampled": True,
    }


def _chunk_points(h: SeriesHealth, max_points: int, lo: int, hi: int) -> dict[str, Any]:
    """``series_points`` of records ``[lo, hi)`` of a compact series, in
    buckets of whole chunks (every chunk that holds one of those records)."""
    ch = h.series.chunks
    c0 = int(np.searchsorted(ch.start, lo, side="right")) - 1
    c1 = int(np.searchsorted(ch.start, hi, side="left"))
    m = c1 - c0
    rel = np.unique((np.arange(min(max_points, m), dtype=np.int64) * m) // min(max_points, m))
    first = ch.start[c0 + rel]
    ends = np.r_[first[1:], ch.start[c1] if c1 < len(ch.start) else len(h.series.steps)]
    moments = ch.moments[c0:c1]
    with np.errstate(invalid="ignore", divide="ignore"):
        means = np.add.reduceat(moments[:, 0::2], rel) / np.add.reduceat(moments[:, 1::2], rel)
    gaps = np.logical_and.reduceat(ch.unrecorded[c0:c1], rel)
    fields = {
        "min": np.fmin.reduceat(ch.lo[c0:c1], rel).astype(np.float64).tolist(),
        "max": np.fmax.reduceat(ch.hi[c0:c1], rel).astype(np.float64).tolist(),
        "max_abs": np.fmax.reduceat(ch.max_abs[c0:c1], rel).astype(np.float64).tolist(),
    }
    fields.update({k: _with_gaps(means[:, j].tolist(), gaps) for j, k in enumerate(_CHART_MOMENTS)})
    counts = np.add.reduceat(ch.counts[c0:c1], rel, axis=0).astype(np.int64)
    fields.update({k: counts[:, j].tolist() for j, k in enumerate(_CHART_COUNTS)})
    span = slice(int(first[0]), int(ends[-1]))
    return {
        "steps": h.series.steps[first].tolist(),
        "step_end": h.series.steps[ends - 1].tolist(),
        "fields": fields,
        "health": np.maximum.reduceat(h.codes[span], first - first[0]).astype(int).tolist(),
        "kinds": _bucket_kinds(h.kinds[span], first - first[0], ends - first[0]),
        "downsampled": True,
    }


def _chart_columns(values: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The charted statistics of records ``[n, F]`` by name, and which
    records hold no sums (op-level records: their mean, std and L2 norm are
    not recorded, not NaN; a recorded sum of squares of finite values is
    never NaN)."""
    d = derived(values)
    columns = {"min": values[:, F["min"]], "max": values[:, F["max"]], "max_abs": d["max_abs"]}
    columns.update({k: d[k] for k in _CHART_MOMENTS})
    columns.update({k: values[:, F[k]] for k in _CHART_COUNTS})
    return columns, np.isnan(values[:, F["sum_sq"]]) & (d["finite"] > 0)


def _with_gaps(values: list, gaps: np.ndarray) -> list:
    """``values`` with None where ``gaps`` is set."""
    return [None if g else v for v, g in zip(values, gaps.tolist())] if gaps.any() else values


def _point_fields(columns: Mapping[str, np.ndarray], unrecorded: np.ndarray) -> dict[str, list]:
    """Chart fields with one point per record."""
    out = {k: columns[k].tolist() for k in ("min", "max", "max_abs")}
    out.update({k: _with_gaps(columns[k].tolist(), unrecorded) for k in _CHART_MOMENTS})
    out.update({k: columns[k].astype(np.int64).tolist() for k in _CHART_COUNTS})
    return out


def _bucket_fields(
    columns: Mapping[str, np.ndarray], unrecorded: np.ndarray, bounds: np.ndarray
) -> dict[str, list]:
    """Chart fields with one point per bucket starting at each of ``bounds``."""
    out = {
        "min": np.fmin.reduceat(columns["min"], bounds).tolist(),
        "max": np.fmax.reduceat(columns["max"], bounds).tolist(),
        "max_abs": np.fmax.reduceat(columns["max_abs"], bounds).tolist(),
    }
    gaps = np.logical_and.reduceat(unrecorded, bounds)  # buckets with no sums recorded
    out.update({k: _with_gaps(_bucket_finite_mean(columns[k], bounds).tolist(), gaps) for k in _CHART_MOMENTS})
    out.update({k: np.add.reduceat(columns[k], bounds).astype(np.int64).tolist() for k in _CHART_COUNTS})
    return out


def _bucket_finite_mean(x: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """The mean of each bucket's finite values; NaN for a bucket with none."""
    ok = np.isfinite(x)
    total = np.add.reduceat(np.where(ok, x, 0.0), bounds)
    num = np.add.reduceat(ok.astype(np.int64), bounds)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(num > 0, total / np.maximum(num, 1), np.nan)


def _bucket_kinds(kinds: np.ndarray, bounds: np.ndarray, ends: np.ndarray) -> list[str | None]:
    """The first warning kind in each bucket, which names the bucket's warning."""
    warned = np.flatnonzero(kinds > 0)
    first = np.searchsorted(warned, bounds).tolist()
    return [
        rules.KIND_NAMES[int(kinds[warned[f]]) - 1] if f < len(warned) and warned[f] < ends[b] else None
        for b, f in enumerate(first)
    ]
