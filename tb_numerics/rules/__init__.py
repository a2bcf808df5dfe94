"""The rules core: every rule of numerical health, each in one place, by name.

Numpy only, no TensorFlow. What it owns, and where:

  * ``codes``: the health codes (healthy, warning, non-finite, no data),
    their names and words;
  * ``nonfinite``: the non-finite rule (over ``records.nonfinite_count``,
    the count's one numpy home);
  * ``kinds``: every warning kind: parameters, mask, detail text, hint,
    display words, early or information;
  * ``numbers``: how numbers are written, in words and in JSON.

The analysis (``health``, ``run_analysis``, ``diagnosis``, ``views``), the
report and the HTTP API apply these rules; ``published`` is what the
dashboard receives from the ``/rules`` route, so that the frontend holds no
copy of kinds, words, codes or the number format.
"""

from __future__ import annotations

from typing import Any

from tb_numerics import metadata
from tb_numerics.rules.codes import HEALTH, HEALTHY, NO_DATA, NONFINITE, WARNING, Health, health_name
from tb_numerics.rules.kinds import (
    KINDS, LOSS_SCALE_HANDLED_MIN, SeriesView, WarningKind, growth_flags, kind, kind_code, skip_handled,
)
from tb_numerics.rules.nonfinite import neginf_intended, nonfinite_count, nonfinite_mask, record_is_anomaly
from tb_numerics.rules.numbers import (
    NONFINITE_WORDS, NUMBER_FORMAT, count, describe_nonfinite, dumps, number, percent,
)

__all__ = [
    "HEALTH", "HEALTHY", "Health", "INFO_KINDS", "KINDS", "KIND_NAMES", "LOSS_SCALE_HANDLED_MIN", "NONFINITE",
    "NONFINITE_WORDS", "NO_DATA", "NUMBER_FORMAT", "SeriesView", "WARNING", "WarningKind", "count",
    "describe_nonfinite", "dumps", "growth_flags", "health_name", "kind", "kind_code", "neginf_intended",
    "nonfinite_count", "nonfinite_mask", "number", "percent", "published", "record_is_anomaly", "skip_handled",
]

KIND_NAMES = tuple(k.name for k in KINDS)
# Kinds that are information about handled events, never a run's first warning.
INFO_KINDS = frozenset(k.name for k in KINDS if k.info)


def published() -> dict[str, Any]:
    """What the dashboard needs of the rules (the ``/rules`` route's answer):
    the health codes, every warning kind with its words, the number format,
    and the tag heads after which a tag names a layer or variable."""
    return {
        "health": [{"code": h.code, "name": h.name, "words": h.words} for h in HEALTH],
        "kinds": [
            {"name": k.name, "code": kind_code(k.name), "words": k.words, "hint": k.hint, "params": list(k.params),
             "early": k.early, "info": k.info, "health": k.health}
            for k in KINDS
        ],
        "number": dict(NUMBER_FORMAT),
        "scoped_tag_heads": list(metadata.SCOPED_TAG_HEADS),
    }
