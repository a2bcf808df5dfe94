"""Series health: each record's health code and warning kind under a safe range.

Applies the rules core (``rules``) to the records: the non-finite rule,
then each warning kind's series mask in order of precedence, then the run
masks that compare rows (gradients by depth, skipped steps). Numpy only.

Health of one record (one tensor at one step):
  * NONFINITE: any NaN, +Inf or -Inf (an -Inf in an allowlisted tensor is
    intended and does not count; a NaN there still does).
  * WARNING: finite, but outside the safe range (a kind says how).
  * HEALTHY: otherwise.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from tb_numerics import rules
from tb_numerics.records import TensorSeries
from tb_numerics.safe_range import SafeRange

__all__ = ["SeriesHealth", "mark_run", "series_health"]


@dataclasses.dataclass
class SeriesHealth:
    """Health code and warning kind of each record of one series."""

    series: TensorSeries
    codes: np.ndarray  # int8 [n]: rules.HEALTHY / WARNING / NONFINITE
    kinds: np.ndarray  # int8 [n]: 0 or rules.kind_code(kind)


def series_health(series: TensorSeries, sr: SafeRange) -> SeriesHealth:
    """Classifies every record of one series under the safe range ``sr``.

    Args:
      series: one tensor's records.
      sr: the safe range.
    """
    n = len(series.steps)
    codes = np.zeros(n, dtype=np.int8)
    kinds = np.zeros(n, dtype=np.int8)
    if n == 0:
        return SeriesHealth(series, codes, kinds)
    # float64 whatever the series holds, so that thresholds compare the same.
    v, d = series.mask_view()
    view = rules.SeriesView(series, v, d)
    with np.errstate(invalid="ignore"):
        for k in rules.KINDS:
            if k.mask is None or k.name in sr.off:
                continue
            mask = k.mask(view, k.parameters(sr))
            if mask is not None:
                kinds[mask & (kinds == 0)] = rules.kind_code(k.name)
    codes[kinds > 0] = rules.WARNING
    codes[rules.nonfinite_mask(series, sr, v)] = rules.NONFINITE
    return SeriesHealth(series, codes, kinds)


def mark_run(health: list[SeriesHealth], sr: SafeRange, unscaled_bad: Sequence[int] = ()) -> None:
    """Applies the run masks (kinds that compare a run's rows) to ``health``, in place,
    after taking back the warnings the run does not confirm.

    Args:
      health: every row of one run, in execution order.
      sr: the safe range.
      unscaled_bad: the steps a replay found non-finite with the loss scale
        at 1: no skip that loss scaling handles (``rules.kinds``).
    """
    unscaled = np.asarray(sorted(unscaled_bad), np.int64)
    for k in rules.KINDS:
        if k.unconfirmed is None or k.name in sr.off:
            continue
        for row, mask in k.unconfirmed(health, k.parameters(sr)):
            h = health[row]
            h.kinds[mask] = 0
            h.codes[mask & (h.codes == rules.WARNING)] = rules.HEALTHY
    for k in rules.KINDS:
        if k.marks is None or k.name in sr.off:
            continue
        p = k.parameters(sr)
        p.unscaled_bad = unscaled
        for row, mask in k.marks(health, p):
            health[row].kinds[mask] = rules.kind_code(k.name)
            health[row].codes[mask] = k.health
