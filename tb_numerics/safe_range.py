"""The safe range: the parameters of what counts as a warning, and their parsing.

One ``SafeRange`` drives the dashboard, the HTTP API (``?max_abs=``) and the
CLI (``--max-abs``), with the same defaults. Each warning kind
(``rules.kinds``) names the fields it reads; ``allow_neginf`` belongs to the
non-finite rule and ``off`` switches kinds off. Numpy only, no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from tb_numerics import rules

__all__ = ["SAFE_RANGE_PARAMS", "SafeRange", "SafeRangeError", "parse_safe_range", "safe_range_to_json"]


class SafeRangeError(ValueError):
    """A safe-range parameter was malformed; the message names it."""


@dataclasses.dataclass(frozen=True)
class SafeRange:
    """What counts as a warning. Same defaults for dashboard, HTTP and CLI."""

    # A user's limit on max |x| of any tensor; None: the dtype's margin only.
    max_abs: float | None = None
    # A user's limit on the global gradient norm; None: no fixed limit.
    grad_norm_limit: float | None = None
    # A global gradient norm above spike_factor x the median of the previous
    # spike_window records is a spike.
    spike_factor: float = 10.0
    spike_window: int = 20
    # A global gradient norm below this is vanishing.
    vanishing_floor: float = 1e-10
    # A tensor whose nonzero finite values are at least this share below the
    # dtype's smallest normal is underflowing.
    underflow_share: float = 0.1
    # max |x| rising at every one of growth_window records, by growth_factor
    # in all, and above growth_floor, is growth towards overflow.
    growth_window: int = 8
    growth_factor: float = 10.0
    growth_floor: float = 100.0
    # max |x| at least jump_factor x its previous record, and above
    # growth_floor, is fast growth.
    jump_factor: float = 100.0
    # Tag patterns (fnmatch) where -Inf is intended, e.g. attention masks.
    allow_neginf: tuple[str, ...] = ()
    # Early-warning detectors (see ``detectors``): an activation's share of
    # exact zeros that is dead units, held for ``sustain`` records (as are
    # saturation and the gradient ratio by depth).
    dead_share: float = 0.7
    sustain: int = 5
    # Warn when a growing tensor reaches its dtype's maximum within this many steps.
    headroom_steps: float = 30.0
    # ||w_new - w_old|| / ||w_old|| above this is an update larger than the weights.
    update_ratio_max: float = 1.0
    # First layer's gradient norm / last layer's: below (with the first
    # below 1e-4) vanishing, above exploding (AUTOTRAINER's thresholds).
    depth_vanishing: float = 1e-3
    depth_exploding: float = 70.0
    loss_window: int = 50
    # Warning kinds switched off.
    off: tuple[str, ...] = ()


# The parameters a user may set from the CLI (--max-abs) and the HTTP API
# (?max_abs=): name -> (kind, help).
SAFE_RANGE_PARAMS: dict[str, tuple[str, str]] = {
    "max_abs": ("limit", "warn when max |x| of any tensor exceeds this"),
    "grad_norm_limit": ("limit", "warn when the global gradient norm exceeds this"),
    "spike_factor": ("above_one", "warn when the global gradient norm exceeds this times its recent median"),
    "spike_window": ("count", "how many previous records the spike median looks at"),
    "vanishing_floor": ("nonnegative", "warn when the global gradient norm falls below this"),
    "underflow_share": ("share", "warn when this share of nonzero values is below the smallest normal"),
    "allow_neginf": ("patterns", "comma-separated tag patterns where -inf is intended"),
    "dead_share": ("share", "warn when this share of an activation's values are exactly 0 (dead units)"),
    "headroom_steps": ("positive", "warn when a growing tensor reaches its dtype's maximum within this many steps"),
    "update_ratio_max": ("positive", "warn when a layer's update is this many times its weights' norm"),
    "off": ("kinds", "comma-separated warning kinds to switch off"),
}


def _parse_param(name: str, kind: str, raw: Any) -> Any:
    """One parameter's value from a user's string or number, checked for its kind."""
    if kind in ("patterns", "kinds"):
        if isinstance(raw, str):
            raw = raw.split(",")
        items = tuple(p.strip() for p in raw if p and p.strip())
        unknown = [k for k in items if kind == "kinds" and k not in rules.KIND_NAMES]
        if unknown:
            raise SafeRangeError("%s names unknown warning kinds %s; the kinds are: %s" % (
                name, ", ".join(unknown), ", ".join(rules.KIND_NAMES)))
        return items
    if isinstance(raw, str):
        raw = raw.strip()
        if raw.lower() in ("", "none", "off"):
            if kind == "limit":  # a limit that may be switched off
                return None
            raise SafeRangeError("%s needs a value" % name)
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise SafeRangeError("%s must be a number, got %r" % (name, raw)) from None
    if not math.isfinite(value):
        raise SafeRangeError("%s must be finite, got %r" % (name, raw))
    if kind in ("limit", "positive") and value <= 0:
        raise SafeRangeError("%s must be greater than 0, got %r" % (name, raw))
    if kind == "above_one" and value <= 1:
        raise SafeRangeError("%s must be greater than 1, got %r" % (name, raw))
    if kind == "nonnegative" and value < 0:
        raise SafeRangeError("%s must not be negative, got %r" % (name, raw))
    if kind == "share" and not 0 < value <= 1:
        raise SafeRangeError("%s must be in (0, 1], got %r" % (name, raw))
    if kind == "count":
        if value != int(value) or not 1 <= value <= 10000:
            raise SafeRangeError("%s must be a whole number from 1 to 10000, got %r" % (name, raw))
        return int(value)
    return value


def parse_safe_range(params: Mapping[str, Any], base: SafeRange | None = None) -> SafeRange:
    """A SafeRange from user parameters (strings or numbers); others ignored.

    Args:
      params: parameter name -> value (a query's arguments, the CLI's flags).
      base: the values of the parameters not given (default: the defaults).

    Raises:
      SafeRangeError: naming the first malformed parameter.
    """
    base = base or SafeRange()
    updates = {}
    for name, (kind, _) in SAFE_RANGE_PARAMS.items():
        if name in params and params[name] is not None:
            updates[name] = _parse_param(name, kind, params[name])
    return dataclasses.replace(base, **updates)


def safe_range_to_json(sr: SafeRange) -> dict[str, Any]:
    """Every field of ``sr`` by name, as JSON values."""
    d = dataclasses.asdict(sr)
    d["allow_neginf"] = list(sr.allow_neginf)
    d["off"] = list(sr.off)
    return d

