"""The analysis core, by its one name: safe range, health, first anomaly and warning, views.

Numpy only, no TensorFlow: the plugin backend, the CLI and the tests all call
these functions, so "safe range" and "first anomaly" mean the same everywhere.
The rules themselves (health codes, the non-finite rule, every warning
kind, the number format) are the rules core's, ``tb_numerics.rules``; this
module gathers the names its users spell as ``analysis.<name>`` from the
modules that apply them, each with one job:

  * ``safe_range``: ``SafeRange``, its parameters and their parsing;
  * ``health``: each record's health code and warning kind;
  * ``run_analysis``: ``analyze_run``, a run's rows in execution order and
    their first cells;
  * ``diagnosis``: the first anomaly, first warning and likely cause in
    words (``run_summary``, the report's and ``/summary``'s JSON);
  * ``views``: the dashboard's timeline and chart points.
"""

from __future__ import annotations

from tb_numerics.diagnosis import (
    first_anomaly, first_look_summary, first_warning, info_events, likely_cause, run_summary, warnings_by_tensor,
)
from tb_numerics.health import SeriesHealth, series_health
from tb_numerics.rules import (
    HEALTHY, INFO_KINDS, KIND_NAMES as WARNING_KINDS, LOSS_SCALE_HANDLED_MIN, NO_DATA, NONFINITE, WARNING,
    describe_nonfinite, growth_flags, health_name, neginf_intended, number, record_is_anomaly, skip_handled,
)
from tb_numerics.run_analysis import OP_TAG_PREFIX, RunAnalysis, analyze_run, is_op_level, skipped_steps
from tb_numerics.safe_range import SAFE_RANGE_PARAMS, SafeRange, SafeRangeError, parse_safe_range, safe_range_to_json
from tb_numerics.views import series_points, timeline

__all__ = [
    "HEALTHY", "INFO_KINDS", "LOSS_SCALE_HANDLED_MIN", "NONFINITE", "NO_DATA", "OP_TAG_PREFIX", "RunAnalysis",
    "SAFE_RANGE_PARAMS", "SafeRange", "SafeRangeError", "SeriesHealth", "WARNING", "WARNING_KINDS", "analyze_run",
    "describe_nonfinite", "first_anomaly", "first_look_summary", "first_warning", "growth_flags", "health_name", "info_events",
    "is_op_level", "likely_cause", "neginf_intended", "number", "parse_safe_range", "record_is_anomaly",
    "run_summary", "safe_range_to_json", "series_health", "series_points", "skip_handled", "skipped_steps",
    "timeline", "warnings_by_tensor",
]
