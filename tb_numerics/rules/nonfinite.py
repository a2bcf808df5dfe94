"""The non-finite rule: any NaN, +Inf or -Inf is an anomaly, always.

Except a -Inf where it is intended (an attention mask): its writer said so
(``TensorInfo.neginf_ok``) or the user's ``allow_neginf`` patterns match the
tag; a NaN there still counts. The count itself is
``records.nonfinite_count``, its one numpy home; this module decides what
it is counted over.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import numpy as np

from tb_numerics import metadata
from tb_numerics.records import TensorSeries, nonfinite_count
from tb_numerics.rules.kinds import skip_handled

__all__ = ["neginf_intended", "nonfinite_mask", "nonfinite_count", "record_is_anomaly"]


def neginf_intended(tag: str, info: metadata.TensorInfo, sr: Any) -> bool:
    """Whether -Inf is intended in a tensor: its writer said so
    (``TensorInfo.neginf_ok``) or the user's patterns match its tag.

    Args:
      tag: the tensor's tag.
      info: its metadata.
      sr: the safe range (``safe_range.SafeRange``), for ``allow_neginf``.
    """
    return info.neginf_ok or any(fnmatch.fnmatchcase(tag, p) for p in sr.allow_neginf)


def nonfinite_mask(series: TensorSeries, sr: Any, values: np.ndarray | None = None) -> np.ndarray:
    """Which records of a series are non-finite under the safe range ``sr``.

    Args:
      series: one tensor's records.
      sr: the safe range, for ``allow_neginf``.
      values: the series' ``mask_values()``, where the caller has them.
    """
    v = series.mask_values() if values is None else values
    return nonfinite_count(v, neginf_intended(series.tag, series.info, sr)) > 0


def record_is_anomaly(
    tag: str, v: np.ndarray, info: metadata.TensorInfo, sr: Any, loss_scale: float | None = None
) -> bool:
    """Whether one record is non-finite by the rules the analysis applies
    (for a training loop that must decide at once, e.g. to stop; a skip it
    lets pass becomes an anomaly later if no applied step follows it).

    Args:
      tag, v, info: the record's tag, values (``metadata.FIELDS``) and metadata.
      sr: the safe range.
      loss_scale: the loss scale of the record's step; None without loss scaling.
    """
    bad = nonfinite_count(v, neginf_intended(tag, info, sr)) > 0
    return bool(bad) and not skip_handled(info, loss_scale)
