"""The one analysis core: safe-range rules, health, first anomaly and warning.

Numpy only, no TensorFlow: the plugin backend, the CLI and the tests all call
these functions, so "safe range" and "first anomaly" mean the same everywhere.

Health of one record (one tensor at one step):
  * NONFINITE: any NaN, +Inf or -Inf (an -Inf in an allowlisted tensor is
    intended and does not count; a NaN there still does).
  * WARNING: finite, but outside the safe range (see ``SafeRange``).
  * HEALTHY: otherwise.

"First" means the earliest step; within a step, the earliest tensor in
execution order: the input batch before forward before backward before the
update, then the order the writer recorded, then the tag.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import functools
import math
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from tb_numerics import detectors, evidence, hints, metadata
from tb_numerics.hints import number, percent
from tb_numerics import records
from tb_numerics.records import F, TensorSeries, derived

HEALTHY = 0
WARNING = 1
NONFINITE = 2
HEALTH_NAMES = ("healthy", "warning", "nonfinite")
NO_DATA = -1  # a timeline cell with no record

# Warning kinds, in the order they are checked; the code stored per record is
# the index + 1 (0 means no warning).
WARNING_KINDS = (
    "overflow_risk",
    "exploding_gradient",
    "gradient_spike",
    # A gradient whose square, which the optimizer computes, overflows.
    "square_overflow",
    # max |x| many times its previous record's in one step: fast divergence,
    # before the spike and growth rules have enough history.
    "fast_growth",
    "headroom",
    "growth",
    "exploding_by_depth",
    "vanishing_gradient",
    "vanishing_by_depth",
    "underflow",
    "dead_units",
    "saturation",
    "update_ratio",
    "loss_not_decreasing",
    "loss_oscillating",
    # Non-finite gradients at a step a LossScaleOptimizer skipped: handled.
    "skipped_step",
)
_KIND_CODE = {k: i + 1 for i, k in enumerate(WARNING_KINDS)}
# The kinds the early-warning detectors (``detectors``) raise.
_EARLY_KINDS = frozenset({
    "headroom", "exploding_by_depth", "vanishing_by_depth", "dead_units", "saturation", "update_ratio",
    "loss_not_decreasing", "loss_oscillating", "square_overflow",
})


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
    if kind in ("patterns", "kinds"):
        if isinstance(raw, str):
            raw = raw.split(",")
        items = tuple(p.strip() for p in raw if p and p.strip())
        unknown = [k for k in items if kind == "kinds" and k not in WARNING_KINDS]
        if unknown:
            raise SafeRangeError("%s names unknown warning kinds %s; the kinds are: %s" % (
                name, ", ".join(unknown), ", ".join(WARNING_KINDS)))
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
    d = dataclasses.asdict(sr)
    d["allow_neginf"] = list(sr.allow_neginf)
    d["off"] = list(sr.off)
    return d


# ---------------------------------------------------------------- health


@dataclasses.dataclass
class SeriesHealth:
    """Health code and warning kind of each record of one series."""

    series: TensorSeries
    codes: np.ndarray  # int8 [n]: HEALTHY / WARNING / NONFINITE
    kinds: np.ndarray  # int8 [n]: 0 or index+1 into WARNING_KINDS


def _allowlisted(tag: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(tag, p) for p in patterns)


def _rolling_median_before(x: np.ndarray, window: int) -> np.ndarray:
    """Median of the previous ``window`` values (NaN-ignoring); NaN if < 3."""
    n = len(x)
    out = np.full(n, np.nan)
    if n < 2:
        return out
    padded = np.concatenate([np.full(window, np.nan), x[:-1]])
    windows = np.lib.stride_tricks.sliding_window_view(padded, window)[:n]
    # Full windows of finite values (most of a healthy run) take the plain
    # median, several times faster than nanmedian.
    full = np.zeros(n, dtype=bool)
    full[window:] = True
    finite = np.isfinite(x[:-1])
    if n > window and not finite.all():
        bad_before = np.concatenate([[0], np.cumsum(~finite)])  # non-finite among x[:i]
        full[window:] = bad_before[window:n] == bad_before[: n - window]
    if full.any():
        out[full] = np.median(windows[full], axis=1)
    rest = ~full
    partial = windows[rest]
    clean = np.where(np.isfinite(partial), partial, np.nan)
    enough = np.sum(np.isfinite(clean), axis=1) >= 3
    if np.any(enough):
        with np.errstate(all="ignore"):
            idx = np.flatnonzero(rest)[enough]
            out[idx] = np.nanmedian(clean[enough], axis=1)
    return out


def growth_flags(max_abs: np.ndarray, sr: SafeRange) -> np.ndarray:
    """Which records end ``growth_window`` records of steady growth: max |x|
    rising at each, by ``growth_factor`` in all, above ``growth_floor``."""
    w = sr.growth_window
    n = len(max_abs)
    flags = np.zeros(n, dtype=bool)
    if n <= w:
        return flags
    with np.errstate(invalid="ignore"):
        rising = np.zeros(n, dtype=bool)
        rising[1:] = max_abs[1:] > max_abs[:-1]
    # rising at every one of the last w records: w rises in the window
    # ending at each index (a difference of running counts, one pass)
    rises = np.concatenate([[0], np.cumsum(rising, dtype=np.int64)])
    all_rising = np.zeros(n, dtype=bool)
    all_rising[w - 1 :] = rises[w:] - rises[:-w] == w
    prev = np.full(n, np.nan)
    prev[w:] = max_abs[:-w]
    with np.errstate(invalid="ignore", divide="ignore"):
        flags = (
            all_rising
            & (max_abs >= sr.growth_floor)
            & (prev > 0)
            & (max_abs >= sr.growth_factor * prev)
        )
    return flags


def _jump_flags(max_abs: np.ndarray, sr: SafeRange) -> np.ndarray:
    """max |x| at least ``jump_factor`` x the previous record's, above the floor."""
    flags = np.zeros(len(max_abs), dtype=bool)
    with np.errstate(invalid="ignore", divide="ignore"):
        flags[1:] = (max_abs[1:] >= sr.growth_floor) & (max_abs[:-1] > 0) & (
            max_abs[1:] >= sr.jump_factor * max_abs[:-1])
    return flags


def neginf_intended(tag: str, info: metadata.TensorInfo, sr: SafeRange) -> bool:
    """Whether -Inf is intended in a tensor: its writer said so
    (``TensorInfo.neginf_ok``) or the user's patterns match its tag."""
    return info.neginf_ok or _allowlisted(tag, sr.allow_neginf)


def _warning_masks(series: TensorSeries, v: np.ndarray, d: dict[str, np.ndarray], sr: SafeRange):
    """(kind, mask over the records) of each rule that applies to the series,
    in order of precedence: the first kind that holds names a record's warning."""
    max_abs = d["max_abs"]
    over = v[:, F["overflow"]] > 0
    compute = series.info.compute_dtype
    if compute and compute != series.info.dtype:  # held to the range it is computed in
        over |= max_abs > metadata.overflow_margin(compute)
    if sr.max_abs is not None:
        over |= max_abs > sr.max_abs
    yield "overflow_risk", over
    is_norm = series.info.role == "global_norm"
    norm = v[:, F["max"]]
    if is_norm and sr.grad_norm_limit is not None:
        yield "exploding_gradient", norm > sr.grad_norm_limit
    finite = records.nonfinite_count(v) == 0
    if is_norm:
        med = _rolling_median_before(norm, sr.spike_window)
        spike = (med > 0) & (norm > sr.spike_factor * med)
        yield "gradient_spike", spike & ~detectors.transient(spike, norm, med, finite)
    yield "square_overflow", detectors.square_overflow(series, d)
    jump = _jump_flags(max_abs, sr)
    yield "fast_growth", jump & ~detectors.transient(jump, max_abs, np.r_[np.nan, max_abs[:-1]], finite)
    if series.info.role != "input":  # data's range drifting over steps is no divergence of training
        yield "headroom", detectors.headroom(series, d, sr.growth_window, sr.headroom_steps, sr.growth_floor)
        yield "growth", growth_flags(max_abs, sr)
    if is_norm:
        yield "vanishing_gradient", detectors.vanishing(norm, sr.vanishing_floor)
    nonzero = d["finite"] - v[:, F["zeros"]]
    share = np.where(nonzero > 0, v[:, F["underflow"]] / np.maximum(nonzero, 1), 0.0)
    yield "underflow", (v[:, F["underflow"]] > 0) & (share >= sr.underflow_share)
    yield "dead_units", detectors.dead_units(series, d, sr.dead_share, sr.sustain)
    yield "saturation", detectors.saturation(series, d, sr.sustain)
    yield "update_ratio", detectors.update_ratio(series, sr.update_ratio_max)
    yield "loss_not_decreasing", detectors.loss_not_decreasing(series, d, sr.loss_window)
    yield "loss_oscillating", detectors.loss_oscillating(series, d, sr.loss_window)


def series_health(series: TensorSeries, sr: SafeRange) -> SeriesHealth:
    """Classifies every record of one series under the safe range ``sr``."""
    # float64 whatever the series holds, so that thresholds compare the same.
    v = series.values.astype(np.float64, copy=False)
    n = len(series.steps)
    codes = np.zeros(n, dtype=np.int8)
    kinds = np.zeros(n, dtype=np.int8)
    if n == 0:
        return SeriesHealth(series, codes, kinds)
    d = derived(v)
    with np.errstate(invalid="ignore"):
        for kind, mask in _warning_masks(series, v, d, sr):
            if kind not in sr.off:
                kinds[mask & (kinds == 0)] = _KIND_CODE[kind]
    codes[kinds > 0] = WARNING
    codes[records.nonfinite_count(v, neginf_intended(series.tag, series.info, sr)) > 0] = NONFINITE
    return SeriesHealth(series, codes, kinds)


def _confirm_by_run(health: list[SeriesHealth], sr: SafeRange) -> None:
    """Keeps the dead-units and update-ratio warnings that other series confirm:
    dead units where the layer's bias gradient says its units are dead, large
    updates where they span the layers or last (``detectors``)."""
    dead, ratio = _KIND_CODE["dead_units"], _KIND_CODE["update_ratio"]
    grads = [h.series for h in health if h.series.info.role == "gradient"]
    for h in health:
        if (h.kinds == dead).any():
            keep = detectors.dead_units_by_gradient(h.series, h.kinds == dead, grads, sr.dead_share, sr.sustain)
            _clear(h, (h.kinds == dead) & ~keep)
    ratios = [h for h in health if h.series.tag.startswith("update_ratio/")]
    kept = detectors.update_ratio_kept([h.series for h in ratios], [h.kinds == ratio for h in ratios])
    for h, keep in zip(ratios, kept):
        _clear(h, (h.kinds == ratio) & ~keep)


def _clear(h: SeriesHealth, mask: np.ndarray) -> None:
    """Takes back the warnings of ``mask`` (the record is healthy unless non-finite)."""
    h.kinds[mask] = 0
    h.codes[mask & (h.codes == WARNING)] = HEALTHY


def _mark_by_depth(health: list[SeriesHealth], sr: SafeRange) -> None:
    """Vanishing or exploding gradients by depth, on the first layer's gradient."""
    grads = [h for h in health if h.series.info.role == "gradient"]
    if len(grads) < 2:
        return
    steps = np.unique(np.concatenate([h.series.steps for h in grads]))
    depth = detectors.by_depth([h.series for h in grads], steps, sr.depth_vanishing, sr.depth_exploding, sr.sustain)
    if depth is None:
        return
    h = next(g for g in grads if g.series is depth["first"])
    for kind in ("exploding_by_depth", "vanishing_by_depth"):
        bad_steps = steps[depth[kind.split("_")[0]]]
        if kind in sr.off or not bad_steps.size:
            continue
        mask = np.isin(h.series.steps, bad_steps) & (h.codes == HEALTHY)
        h.kinds[mask] = _KIND_CODE[kind]
        h.codes[mask] = WARNING


# ---------------------------------------------------------------- run level


@dataclasses.dataclass
class RunAnalysis:
    """The health of every series of one run, in execution order."""

    run: str
    health: list[SeriesHealth]
    safe_range: SafeRange
    problems: list[str]
    # Replays' verdicts on a first non-finite step (``metadata.REPLAY_TAG``).
    replays: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    # Where a bad batch held its bad values, per feature (``metadata.BATCH_TAG``).
    batches: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    # The op that went bad first at a step, in execution order, as an op-level
    # block saw it (``metadata.OP_MARK_TAG``): {"step", "tag", "occurrence", ...}.
    op_marks: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def find(self, tag: str) -> SeriesHealth | None:
        for h in self.health:
            if h.series.tag == tag:
                return h
        return None

    @functools.cached_property
    def steps(self) -> np.ndarray:
        """Every step at which any tensor of the run was recorded (computed once)."""
        if not self.health:
            return np.zeros(0, np.int64)
        first = self.health[0].series.steps
        if all(np.array_equal(h.series.steps, first) for h in self.health[1:]):
            return first  # every tensor logged at the same steps: the usual run
        return np.unique(np.concatenate([h.series.steps for h in self.health]))


# Mixed precision: a LossScaleOptimizer skips a step whose (scaled) gradients
# are not finite and lowers its loss scale. While the scale is at least 1
# and a later step's update goes through, that is the scaling overflowing
# float16, which the skip handled: the gradients' non-finite records of such
# a step are "skipped_step" warnings (and listed as information, not as the
# run's first warning: a LossScaleOptimizer calibrating its scale skips a
# few steps in every healthy run). A run of skips that no applied step
# follows is a NaN that loss scaling cannot fix: an anomaly, at the first
# skip of that run. So are skips at a scale below 1, and non-finite forward
# values, which no loss scale changes.
LOSS_SCALE_HANDLED_MIN = 1.0
# Warning kinds that are information about handled events, never the run's
# first warning.
INFO_KINDS = frozenset({"skipped_step"})


def skip_handled(info: metadata.TensorInfo, loss_scale: float | None) -> bool:
    """Whether a non-finite record of ``info`` at a step run with ``loss_scale``
    (None: no loss scaling) may be a skipped step that loss scaling handles."""
    return loss_scale is not None and loss_scale >= LOSS_SCALE_HANDLED_MIN and info.phase == "backward"


def record_is_anomaly(
    tag: str, v: np.ndarray, info: metadata.TensorInfo, sr: SafeRange, loss_scale: float | None = None
) -> bool:
    """Whether one record is non-finite by the same rules as ``analyze_run``
    (for a training loop that must decide at once, e.g. to stop; a skip it
    lets pass becomes an anomaly later if no applied step follows it)."""
    bad = records.nonfinite_count(v, neginf_intended(tag, info, sr)) > 0
    return bool(bad) and not skip_handled(info, loss_scale)


def _mark_skipped_steps(health: list[SeriesHealth]) -> None:
    """Turns the non-finite gradients of handled skipped steps into warnings."""
    scales = [h.series for h in health if h.series.info.role == "loss_scale" and len(h.series.steps)]
    if not scales:
        return
    sc = scales[0]
    candidates = []
    for h in health:
        if not skip_handled(h.series.info, LOSS_SCALE_HANDLED_MIN):
            continue
        st = h.series.steps
        j = np.minimum(np.searchsorted(sc.steps, st), len(sc.steps) - 1)
        with np.errstate(invalid="ignore"):
            handled = (sc.steps[j] == st) & (sc.values[j, F["max"]].astype(np.float64) >= LOSS_SCALE_HANDLED_MIN)
        candidates.append((h, handled & (h.codes == NONFINITE)))
    skipped = np.unique(np.concatenate([h.series.steps[m] for h, m in candidates])) if candidates else []
    if not len(skipped):
        return
    # Steps with a loss-scale record that were not skipped: updates applied.
    applied = np.setdiff1d(sc.steps, skipped)
    recovered_before = applied[-1] if applied.size else -1
    for h, mask in candidates:
        mask &= h.series.steps < recovered_before
        h.codes[mask] = WARNING
        h.kinds[mask] = _KIND_CODE["skipped_step"]


def analyze_run(
    run: str,
    series: Iterable[TensorSeries],
    sr: SafeRange | None = None,
    problems: Sequence[str] = (),
) -> RunAnalysis:
    """Classifies every series of a run and orders them by execution order."""
    sr = sr or SafeRange()
    series = list(series)
    replays = [_replay_verdict(s) for s in series if s.tag == metadata.REPLAY_TAG]
    batches = [_batch_verdict(s) for s in series if s.tag == metadata.BATCH_TAG]
    marks = [_op_mark(s) for s in series if s.tag == metadata.OP_MARK_TAG]
    ordered = sorted((s for s in series if s.tag not in metadata.VERDICT_TAGS), key=lambda s: s.sort_key)
    health = [series_health(s, sr) for s in ordered]
    _confirm_by_run(health, sr)
    _mark_by_depth(health, sr)
    _mark_skipped_steps(health)
    return RunAnalysis(run, health, sr, list(problems), [r for r in replays if r is not None],
                       [b for b in batches if b is not None], [m for m in marks if m is not None])


def _replay_verdict(s: TensorSeries) -> dict[str, Any] | None:
    """A replay's verdict, from its record's description (untrusted JSON)."""
    try:
        verdict = json.loads(s.info.description)
    except ValueError:
        return None
    if not isinstance(verdict, dict) or not isinstance(verdict.get("step"), int):
        return None
    if not isinstance(verdict.get("reproduced"), bool):
        return None
    return verdict


def _batch_verdict(s: TensorSeries) -> dict[str, Any] | None:
    """Where a bad batch held its bad values, from its record's description
    (untrusted JSON): {"step", "tensors": [{"tensor", ...}]}."""
    try:
        found = json.loads(s.info.description)
    except ValueError:
        return None
    if not isinstance(found, dict) or type(found.get("step")) is not int or not isinstance(found.get("tensors"), list):
        return None
    return found


def _op_mark(s: TensorSeries) -> dict[str, Any] | None:
    """The op an op-level block marked as the first to go bad, at the step
    of its record, from the record's description (untrusted JSON)."""
    try:
        mark = json.loads(s.info.description)
    except ValueError:
        return None
    if not isinstance(mark, dict) or not isinstance(mark.get("tag"), str) or not s.steps.size:
        return None
    occurrence = mark.get("occurrence")
    if not (isinstance(occurrence, list) and occurrence and type(occurrence[0]) is int):
        return None
    return {**mark, "step": int(s.steps[0])}


def _marked_cell(ra: RunAnalysis, cell: tuple[int, int, int]) -> tuple[int, int, int]:
    """The first anomaly's cell, moved to the op record its step's mark names
    where the anomaly is an op's: which of a step's op records went bad first
    is known there only (a loop's iterations), not from the tags' order."""
    step, row, _ = cell
    if not is_op_level(ra.health[row].series.tag):
        return cell
    for mark in ra.op_marks:
        if mark["step"] != step:
            continue
        for r, h in enumerate(ra.health):
            at = np.flatnonzero(h.series.steps == step) if h.series.tag == mark["tag"] else ()
            k = mark["occurrence"][0] - 1
            if 0 <= k < len(at) and h.codes[at[k]] == NONFINITE:
                return step, r, int(at[k])
    return cell


def _json_safe(x: Any) -> Any:
    """Untrusted JSON with its non-finite numbers as None (the report's JSON has none)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_json_safe(v) for v in x]
    return x


def is_op_level(tag: str) -> bool:
    """Whether a tag is an op-level record (``op_numerics``, or a replay's)."""
    return tag.startswith(OP_TAG_PREFIX)


OP_TAG_PREFIX = "ops/"
# An op-level description: the op's source line, then, for a gradient op,
# which forward op it differentiates.
_GRADIENT_OF = ", gradient of "


def skipped_steps(ra: RunAnalysis) -> list[int]:
    """The steps a LossScaleOptimizer skipped with the scale handling it."""
    code = _KIND_CODE["skipped_step"]
    steps = [h.series.steps[h.kinds == code] for h in ra.health]
    return np.unique(np.concatenate(steps)).astype(int).tolist() if steps else []


def _first_cell(ra: RunAnalysis, code: int, before: tuple[int, int] | None = None, skip_kinds=frozenset(),
                rows: Iterable[int] | None = None):
    """(step, row index, record index) of the first cell with ``code`` among
    ``rows`` (all by default), leaving out warnings of ``skip_kinds``."""
    skip_codes = [_KIND_CODE[k] for k in skip_kinds]
    best = None
    for row in range(len(ra.health)) if rows is None else rows:
        h = ra.health[row]
        mask = h.codes == code
        if skip_codes:
            mask &= ~np.isin(h.kinds, skip_codes)
        idx = np.flatnonzero(mask)
        if idx.size == 0:
            continue
        i = int(idx[0])
        key = (int(h.series.steps[i]), row)
        if before is not None and key >= before:
            continue
        if best is None or key < best[0]:
            best = (key, i)
    if best is None:
        return None
    (step, row), i = best
    return step, row, i


def _spike_detail(h: SeriesHealth, i: int, sr: SafeRange) -> str:
    norms = h.series.values[: i + 1, F["max"]].astype(np.float64)
    med = _rolling_median_before(norms, sr.spike_window)[-1]
    used = int(np.isfinite(norms[max(0, i - sr.spike_window) : i]).sum())
    return "global gradient norm %s is %s× the median %s of the previous %d record%s" % (
        number(norms[i]), number(norms[i] / med), number(med), used, "" if used == 1 else "s",
    )


def _early_detail(kind: str, h: SeriesHealth, i: int, ra: "RunAnalysis") -> str:
    """Words for the early-warning detectors' kinds (see ``detectors``)."""
    sr, s = ra.safe_range, h.series
    v = s.values.astype(np.float64)
    d = derived(v)
    first = int(s.steps[max(0, i - sr.sustain + 1)])
    if kind == "dead_units":
        return "%s of the values exactly 0 for %d records (steps %d to %d)" % (
            percent(v[i, F["zeros"]] / max(d["finite"][i], 1)), sr.sustain, first, int(s.steps[i]))
    if kind == "saturation":
        fn = s.info.activation or s.info.op_type
        return "%s output pinned at its bounds for %d records (steps %d to %d): mean %s, max %s, %s exact zeros" % (
            fn, sr.sustain, first, int(s.steps[i]), number(d["mean"][i]), number(v[i, F["max"]]),
            format(int(v[i, F["zeros"]]), ","))
    if kind == "headroom":
        return _headroom_detail(s, d, i, sr.growth_window)
    if kind == "square_overflow":
        return "max |x| = %s: its square, which %s computes, is beyond the %s maximum %s" % (
            number(d["max_abs"][i]), s.info.squared_by, s.info.dtype, number(metadata.DTYPE_LIMITS[s.info.dtype][0]))
    if kind == "update_ratio":
        return "||w_new - w_old|| / ||w_old|| = %s, above %s: the update moved the weights by more than their size" % (
            number(v[i, F["max"]]), number(sr.update_ratio_max))
    if kind in ("exploding_by_depth", "vanishing_by_depth"):
        return _depth_detail(h, i, ra)
    loss = d["mean"]
    if kind == "loss_not_decreasing":
        q = max(1, sr.loss_window // 4)
        return "the loss's mean over records %d-%d (%s) is not below its mean over records 1-%d (%s): steps %d to %d" % (
            sr.loss_window - q + 1, sr.loss_window, number(np.mean(loss[i - q + 1 : i + 1])), q,
            number(np.mean(loss[:q])), int(s.steps[0]), int(s.steps[i]))
    lo = max(0, i - sr.loss_window + 1)
    return "the loss changed direction at most records of the last %d (steps %d to %d), between %s and %s" % (
        sr.loss_window, int(s.steps[lo]), int(s.steps[i]), number(np.min(loss[lo : i + 1])), number(np.max(loss[lo : i + 1])))


def _headroom_detail(s: TensorSeries, d: dict[str, np.ndarray], i: int, window: int) -> str:
    """The headroom forecast of record ``i`` in words that hold at its step:
    the growth it extrapolates (over which steps, how fast) and what of this
    tensor it forecasts, whatever other tensors did at that step."""
    dtype = s.info.compute_dtype or s.info.dtype
    left = float(detectors.headroom_forecast(s, d, window)[i])
    bits = float(np.log2(metadata.DTYPE_LIMITS[dtype][0] / d["max_abs"][i]))
    return ("max |x| = %s, %.1f bits below the %s maximum; at its growth over steps %d to %d (×%s a step), "
            "this tensor's %s overflow in about %d steps" % (
                number(d["max_abs"][i]), bits, dtype, int(s.steps[i - window + 1]), int(s.steps[i]),
                number(2.0 ** (bits / left)), dtype, max(1, int(round(left)))))


def _depth_detail(h: SeriesHealth, i: int, ra: "RunAnalysis") -> str:
    grads = [g.series for g in ra.health if g.series.info.role == "gradient"]
    step = h.series.steps[i : i + 1]
    sr = ra.safe_range
    depth = detectors.by_depth(grads, step, sr.depth_vanishing, sr.depth_exploding, 1)
    return "first layer's gradient norm %s is %s× the last layer's (%s, %s) at step %d" % (
        number(depth["first_norm"][0]), number(depth["ratio"][0]), depth["last"].tag,
        number(depth["last_norm"][0]), int(step[0]))


def warning_detail(h: SeriesHealth, i: int, ra: "RunAnalysis") -> str:
    """Words for the warning of record ``i`` of a series: what was computed, in readable numbers."""
    kind = WARNING_KINDS[h.kinds[i] - 1]
    sr = ra.safe_range
    if kind in _EARLY_KINDS:
        return _early_detail(kind, h, i, ra)
    v = h.series.values[i].astype(np.float64)
    if kind == "skipped_step":
        return "%s at a step the LossScaleOptimizer skipped (it lowered the loss scale)" % describe_nonfinite(v)
    max_abs = float(derived(v)["max_abs"][0])
    dtype = h.series.info.dtype
    if kind == "overflow_risk":
        return _overflow_detail(h.series.info, v, max_abs, sr)
    if kind == "exploding_gradient":
        return "global gradient norm %s beyond the limit %s" % (number(v[F["max"]]), number(sr.grad_norm_limit))
    if kind == "gradient_spike":
        return _spike_detail(h, i, sr)
    if kind == "vanishing_gradient":
        return "global gradient norm %s below the floor %s" % (number(v[F["max"]]), number(sr.vanishing_floor))
    if kind in ("growth", "fast_growth"):
        back = 1 if kind == "fast_growth" else sr.growth_window
        prev = float(derived(h.series.values[i - back])["max_abs"][0])
        return "max |x| grew %s× in %d record%s (steps %d to %d), to %s" % (
            number(max_abs / prev), back, "" if back == 1 else "s",
            int(h.series.steps[i - back]), int(h.series.steps[i]), number(max_abs),
        )
    nonzero = v[F["count"]] - records.nonfinite_count(v) - v[F["zeros"]]
    return "%s of %s nonzero values below the %s smallest normal %s" % (
        format(int(v[F["underflow"]]), ","), format(int(nonzero), ","), dtype, number(metadata.smallest_normal(dtype)),
    )


def _overflow_detail(info: metadata.TensorInfo, v: np.ndarray, max_abs: float, sr: SafeRange) -> str:
    """Words for an overflow risk, naming the rule that held: the recorded
    dtype's margin, the margin of the dtype it was computed in, or the
    user's limit."""
    dtype = info.dtype
    if v[F["overflow"]] > 0:
        return "%s of %s values beyond the %s margin %s (max |x| = %s)" % (
            format(int(v[F["overflow"]]), ","), format(int(v[F["count"]]), ","), dtype,
            number(metadata.overflow_margin(dtype)), number(max_abs),
        )
    compute = info.compute_dtype
    if compute and compute != dtype and max_abs > metadata.overflow_margin(compute):
        return "max |x| = %s beyond the %s margin %s: computed in %s (recorded as %s), whose largest value is %s" % (
            number(max_abs), compute, number(metadata.overflow_margin(compute)), compute, dtype,
            number(metadata.DTYPE_LIMITS[compute][0]))
    return "max |x| = %s beyond the limit %s" % (number(max_abs), number(sr.max_abs))


def describe_nonfinite(v: np.ndarray) -> str:
    """E.g. "2 NaN, 1 +Inf of 4,096 values"."""
    parts = []
    for field, label in (("nan", "NaN"), ("posinf", "+Inf"), ("neginf", "-Inf")):
        if v[F[field]] > 0:
            parts.append("%s %s" % (format(int(v[F[field]]), ","), label))
    count = int(v[F["count"]])
    return "%s of %s value%s" % (", ".join(parts), format(count, ","), "" if count == 1 else "s")


def _warning_json(ra: RunAnalysis, cell) -> dict[str, Any]:
    step, row, i = cell
    h = ra.health[row]
    return {
        "step": step,
        "tensor": h.series.tag,
        "kind": WARNING_KINDS[h.kinds[i] - 1],
        "detail": warning_detail(h, i, ra),
        "hint": hints.warning_hint(WARNING_KINDS[h.kinds[i] - 1]),
        "phase": h.series.info.phase,
        "role": h.series.info.role,
        "op_type": h.series.info.op_type or None,
        "row": row,
    }


def _last_step_where(h: SeriesHealth, i: int, mask: np.ndarray) -> int | None:
    """The last step before record ``i``'s step whose records all satisfy ``mask``."""
    steps = h.series.steps
    before = steps < steps[i]
    bad_steps = np.unique(steps[before & ~mask])
    ok = np.setdiff1d(steps[before & mask], bad_steps)
    return int(ok[-1]) if ok.size else None


def _layer_rows(ra: RunAnalysis) -> list[int] | None:
    """The rows of layer-level records where the run has op-level ones beside
    them (a replayed step): the first anomaly is a layer's, the op its detail."""
    layer = [r for r, h in enumerate(ra.health) if not is_op_level(h.series.tag)]
    return layer if layer and len(layer) < len(ra.health) else None


def _op_json(h: SeriesHealth) -> dict[str, Any]:
    info = h.series.info
    return {"name": h.series.tag[len(OP_TAG_PREFIX):], "type": info.op_type or None,
            "source": info.description.split(_GRADIENT_OF)[0] or None, "phase": info.phase}


def _op_of(ra: RunAnalysis, step: int, row: int) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(op, replay) for a first anomaly at ``step``: the exact op from a
    replay's verdict or the op-level records of that step, and the verdict
    of a replay that did not reproduce the failure."""
    if is_op_level(ra.health[row].series.tag):
        return _op_json(ra.health[row]), None
    for verdict in ra.replays:
        if verdict["step"] == step:
            # Under several replicas, the replica whose part of the batch was replayed.
            replica = verdict.get("replica")
            where = {"replica": replica} if type(replica) is int else {}
            if not verdict["reproduced"]:
                return None, {"reproduced": False, "why": str(verdict.get("why", "")), **where}
            op = verdict.get("op")
            if isinstance(op, dict):
                return {k: _json_safe(op.get(k)) for k in ("name", "type", "source", "phase", "inputs")}, {
                    "reproduced": True, **where}
    for h in ra.health:  # in execution order: the first op that went bad at that step
        if is_op_level(h.series.tag) and np.any((h.series.steps == step) & (h.codes == NONFINITE)):
            return _op_json(h), None
    return None, None


def first_anomaly(ra: RunAnalysis) -> dict[str, Any] | None:
    """The first non-finite record of the run, in words and numbers."""
    cell = _first_cell(ra, NONFINITE, rows=_layer_rows(ra))
    if cell is None:
        return None
    cell = _marked_cell(ra, cell)
    step, row, i = cell
    h = ra.health[row]
    v = h.series.values[i]
    index, of = h.series.occurrence(i)
    cause = likely_cause(ra, cell)
    # A batch that arrived broken: no op of the step made its NaN.
    op, replay = _op_of(ra, step, row) if h.series.info.phase != "input" else (None, None)
    return {
        "step": step,
        "tensor": h.series.tag,
        "op_type": h.series.info.op_type or None,
        # The writer's description; for op-level records, the source line.
        "tensor_description": h.series.info.description or None,
        "phase": h.series.info.phase,
        "role": h.series.info.role,
        "nan": int(v[F["nan"]]),
        "posinf": int(v[F["posinf"]]),
        "neginf": int(v[F["neginf"]]),
        "size": int(v[F["count"]]),
        "description": describe_nonfinite(v),
        # The tag was logged more than once in that step: which record it was.
        "occurrence": {"index": index, "of": of} if of > 1 else None,
        # The last step with neither an anomaly nor a warning in this tensor,
        # and the last step whose records were merely finite.
        "last_healthy_step": _last_step_where(h, i, h.codes == HEALTHY),
        "last_finite_step": _last_step_where(h, i, h.codes != NONFINITE),
        "hint": hints.choose(_evidence(ra, cell, cause, op)),
        # The exact op (op-level records, or a replay of this step), and a
        # replay's verdict where one ran.
        "op": op,
        "replay": replay,
        "likely_cause": cause,
        "row": row,
    }


def _evidence(ra: RunAnalysis, cell, cause: dict[str, Any] | None, op: dict[str, Any] | None) -> hints.Evidence:
    """What the records say about the anomaly at ``cell``, for its hint."""
    step, row, i = cell
    h = ra.health[row]
    before: dict[str, dict[str, Any]] = {}
    own = np.flatnonzero((h.codes[:i] == WARNING) & ~np.isin(h.kinds[:i], [_KIND_CODE[k] for k in INFO_KINDS]))
    for j in own[::-1]:  # the latest warning of each kind
        before.setdefault(WARNING_KINDS[h.kinds[j] - 1], _warning_json(ra, (int(h.series.steps[j]), row, int(j))))
    if cause is not None:
        before[cause["kind"]] = cause
    every = [g.series for g in ra.health]
    return hints.Evidence(h.series.tag, h.series.info, step, before, _loss_input(ra, row, step), op,
                          negative_loss=_negative_loss(ra, step), batch=_batch_fault(ra, cell, cause),
                          unscaled=evidence.unscaled(every, step), amplified=evidence.amplified(every, step),
                          saturating=evidence.saturating(every, step),
                          large_update=evidence.large_update(every, step, ra.safe_range.update_ratio_max),
                          op_output=evidence.op_output(every, op, step), zero_labels=evidence.zero_labels(every, step),
                          unbounded=evidence.unbounded(every, step))


def _negative_loss(ra: RunAnalysis, step: int) -> hints.NegativeLoss | None:
    """The earliest record, at or before ``step``, of a cross-entropy loss
    (by its function's name, or else its tag) whose value is below 0."""
    best = None
    for h in ra.health:
        s = h.series
        fn = s.info.activation
        if s.info.role != "loss" or not hints.is_cross_entropy(fn or s.tag):
            continue
        with np.errstate(invalid="ignore"):
            below = np.flatnonzero((s.steps <= step) & (derived(s.values)["mean"] < 0))
        if below.size and (best is None or s.steps[below[0]] < best.step):
            i = int(below[0])
            best = hints.NegativeLoss(s.tag, fn, int(s.steps[i]), float(derived(s.values[i])["mean"][0]))
    return best


def _batch_fault(ra: RunAnalysis, cell, cause: dict[str, Any] | None) -> hints.BatchFault | None:
    """The batch's record that the anomaly at ``cell`` is, or its likely
    cause is (an input out of its usual range), with where the batch held
    its bad values where the writer counted them."""
    step, row, i = cell
    h = ra.health[row]
    if h.series.info.role == "input":
        tag, at, what = h.series.tag, step, describe_nonfinite(h.series.values[i])
    elif cause is not None and cause.get("role") == "input":
        tag, at, what = cause["tensor"], cause["step"], cause["detail"]
    else:
        return None
    where = next((t for b in ra.batches if b["step"] == at for t in b["tensors"]
                  if isinstance(t, dict) and t.get("tensor") == tag), None)
    return hints.BatchFault(tag, at, what, nonfinite=h.series.info.role == "input", where=where,
                            kind="" if h.series.info.role == "input" else cause["kind"])


def _loss_input(ra: RunAnalysis, row: int, step: int) -> hints.LossInput | None:
    """The tensor logged just before a loss row (its input), at ``step``."""
    if ra.health[row].series.info.role != "loss":
        return None
    for r in range(row - 1, -1, -1):
        s = ra.health[r].series
        if s.info.role != "activation":
            continue
        at = np.flatnonzero(s.steps == step)
        if not at.size:
            return None
        v = s.values[at[-1]].astype(np.float64)
        first = s.values[0].astype(np.float64)
        with np.errstate(invalid="ignore"):
            return hints.LossInput(
                tag=s.tag,
                zeros=int(v[F["zeros"]]),
                negatives=bool(v[F["min"]] < 0),
                count=int(v[F["count"]]),
                first_zero_share=float(first[F["zeros"]] / max(first[F["count"]], 1)),
                first_step=int(s.steps[0]),
            )
    return None


def likely_cause(ra: RunAnalysis, anomaly_cell) -> dict[str, Any] | None:
    """The warning that most likely led to the anomaly at ``anomaly_cell``.

    A tensor earlier in the same step that is already out of the safe range
    (e.g. an input holding 1e38) comes first; otherwise a warning in the
    steps just before (growth, overflow risk, a gradient spike).
    """
    step, row, _ = anomaly_cell
    info_codes = [_KIND_CODE[k] for k in INFO_KINDS]
    for r in range(row):
        h = ra.health[r]
        at = np.flatnonzero((h.series.steps == step) & (h.codes == WARNING) & ~np.isin(h.kinds, info_codes))
        if at.size:
            return _warning_json(ra, (step, r, int(at[0])))
    # The latest warning of any tensor in the records just before.
    best = None
    for r, h in enumerate(ra.health):
        idx = np.flatnonzero((h.codes == WARNING) & (h.series.steps < step) & ~np.isin(h.kinds, info_codes))
        if idx.size == 0:
            continue
        i = int(idx[-1])
        key = (int(h.series.steps[i]), -r)
        if best is None or key > best[0]:
            best = (key, (int(h.series.steps[i]), r, i))
    if best is None:
        return None
    return _warning_json(ra, best[1])


def first_warning(ra: RunAnalysis) -> dict[str, Any] | None:
    """The first warning of the run that comes before its first anomaly
    (information about handled events, such as skipped steps, aside)."""
    anomaly = _first_cell(ra, NONFINITE)
    before = None if anomaly is None else (anomaly[0], anomaly[1])
    cell = _first_cell(ra, WARNING, before=before, skip_kinds=INFO_KINDS)
    return None if cell is None else _warning_json(ra, cell)


def info_events(ra: RunAnalysis) -> list[dict[str, Any]]:
    """Handled events worth knowing (each skipped step, first tensor of it)."""
    out = []
    for kind in sorted(INFO_KINDS):
        code = _KIND_CODE[kind]
        seen: set[int] = set()
        cells = []
        for row, h in enumerate(ra.health):
            for i in np.flatnonzero(h.kinds == code):
                cells.append((int(h.series.steps[i]), row, int(i)))
        for cell in sorted(cells):
            if cell[0] not in seen:
                seen.add(cell[0])
                out.append(_warning_json(ra, cell))
    return out


def warnings_by_tensor(ra: RunAnalysis) -> list[dict[str, Any]]:
    """Every (tensor, kind) of warning in the run: its first and last step,
    how many records, and the detail of its first record; in order of
    the first step, then execution order."""
    out = []
    info_codes = [_KIND_CODE[k] for k in INFO_KINDS]
    for row, h in enumerate(ra.health):
        for code in np.unique(h.kinds[(h.codes == WARNING) & ~np.isin(h.kinds, info_codes)]):
            idx = np.flatnonzero((h.kinds == code) & (h.codes == WARNING))
            entry = _warning_json(ra, (int(h.series.steps[idx[0]]), row, int(idx[0])))
            entry.update(first_step=entry["step"], last_step=int(h.series.steps[idx[-1]]), records=int(idx.size))
            out.append(entry)
    return sorted(out, key=lambda e: (e["first_step"], e["row"]))


def run_summary(ra: RunAnalysis) -> dict[str, Any]:
    """The per-run summary shared by the CLI's JSON and the HTTP API."""
    steps = ra.steps
    return {
        "run": ra.run,
        "first_anomaly": first_anomaly(ra),
        "first_warning": first_warning(ra),
        "info": info_events(ra),
        "warnings": warnings_by_tensor(ra),
        "tensors": len(ra.health),
        "records": int(sum(len(h.series.steps) for h in ra.health)),
        "first_step": int(steps[0]) if steps.size else None,
        "last_step": int(steps[-1]) if steps.size else None,
        "skipped_steps": skipped_steps(ra),
        "problems": list(ra.problems),
    }


# ---------------------------------------------------------------- timeline


def timeline(
    ra: RunAnalysis, width: int, start: int | None = None, end: int | None = None
) -> dict[str, Any]:
    """Health of every tensor over steps, in at most ``width`` buckets.

    Each bucket holds the worst health of the records in it, so a single
    non-finite step is never hidden by downsampling. Cells with no record are
    NO_DATA (-1). Rows are in execution order.
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
        cells = np.full(nb, NO_DATA, dtype=np.int8)
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
        rows.append(
            {
                "tensor": h.series.tag,
                "role": h.series.info.role,
                "phase": h.series.info.phase,
                "op_type": h.series.info.op_type or None,
                "dtype": h.series.info.dtype,
                "cells": cells.tolist(),
            }
        )
    bucket_end = (
        np.r_[edges[1:] - 1, steps[-1]].tolist() if nb else []
    )
    return {"run": ra.run, "bucket_start": edges.tolist(), "bucket_end": bucket_end, "rows": rows}


def health_name(code: int) -> str:
    return "nodata" if code == NO_DATA else HEALTH_NAMES[code]


# ---------------------------------------------------------------- charts

_CHART_COUNTS = ("count", "nan", "posinf", "neginf", "zeros", "overflow", "underflow")
_CHART_MOMENTS = ("mean", "std", "l2")


def series_points(
    h: SeriesHealth, max_points: int, start: int | None = None, end: int | None = None
) -> dict[str, Any]:
    """One tensor's statistics over a step range, for charts, in at most ``max_points`` points.

    Beyond ``max_points`` records, points are buckets of equal record
    counts: the min of mins, max of maxes and max of max |x|, the mean of
    the finite means, stds and L2 norms, the sum of counts, the worst health
    and the first warning kind, each bucket with its first and last step.

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
    steps, codes, kinds = steps[lo:hi], h.codes[lo:hi], h.kinds[lo:hi]
    # float64: bucket sums of float32 counts would round.
    columns, unrecorded = _chart_columns(h.series.values[lo:hi].astype(np.float64, copy=False))
    if len(steps) <= max_points:
        return {
            "steps": steps.tolist(),
            "step_end": steps.tolist(),
            "fields": _point_fields(columns, unrecorded),
            "health": codes.astype(int).tolist(),
            "kinds": [WARNING_KINDS[k - 1] if k else None for k in kinds.tolist()],
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
        WARNING_KINDS[int(kinds[warned[f]]) - 1] if f < len(warned) and warned[f] < ends[b] else None
        for b, f in enumerate(first)
    ]
