"""The one analysis core: safe-range rules, health, first anomaly and warning.

Numpy only, no TensorFlow: the plugin backend, the CLI and the tests all call
these functions, so "safe range" and "first anomaly" mean the same everywhere.

Health of one record (one tensor at one step):
  * NONFINITE: any NaN, +Inf or -Inf (an -Inf in an allowlisted tensor is
    intended and does not count; a NaN there still does).
  * WARNING: finite, but outside the safe range (see ``SafeRange``).
  * HEALTHY: otherwise.

"First" means the earliest step; within a step, the earliest tensor in
execution order: forward before backward before the update, then the order
the writer recorded, then the tag.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import math
import re
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from tb_numerics import metadata
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
    "growth",
    "vanishing_gradient",
    "underflow",
    # Non-finite gradients at a step a LossScaleOptimizer skipped: handled.
    "skipped_step",
)
_KIND_CODE = {k: i + 1 for i, k in enumerate(WARNING_KINDS)}


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
    # Tag patterns (fnmatch) where -Inf is intended, e.g. attention masks.
    allow_neginf: tuple[str, ...] = ()


# The parameters a user may set from the CLI (--max-abs) and the HTTP API
# (?max_abs=): name -> (kind, help).
SAFE_RANGE_PARAMS: dict[str, tuple[str, str]] = {
    "max_abs": ("positive", "warn when max |x| of any tensor exceeds this"),
    "grad_norm_limit": ("positive", "warn when the global gradient norm exceeds this"),
    "spike_factor": ("above_one", "warn when the global gradient norm exceeds this times its recent median"),
    "spike_window": ("count", "how many previous records the spike median looks at"),
    "vanishing_floor": ("nonnegative", "warn when the global gradient norm falls below this"),
    "underflow_share": ("share", "warn when this share of nonzero values is below the smallest normal"),
    "allow_neginf": ("patterns", "comma-separated tag patterns where -inf is intended"),
}


def _parse_param(name: str, kind: str, raw: Any) -> Any:
    if kind == "patterns":
        if isinstance(raw, str):
            raw = raw.split(",")
        pats = tuple(p.strip() for p in raw if p and p.strip())
        return pats
    if isinstance(raw, str):
        raw = raw.strip()
        if raw.lower() in ("", "none", "off"):
            if kind in ("positive",):
                return None
            raise SafeRangeError("%s needs a value" % name)
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise SafeRangeError("%s must be a number, got %r" % (name, raw)) from None
    if not math.isfinite(value):
        raise SafeRangeError("%s must be finite, got %r" % (name, raw))
    if kind == "positive" and value <= 0:
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


def _growth_flags(max_abs: np.ndarray, sr: SafeRange) -> np.ndarray:
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
    neginf = v[:, F["neginf"]]
    if _allowlisted(series.tag, sr.allow_neginf):
        neginf = np.zeros_like(neginf)
    nonfinite = (v[:, F["nan"]] + v[:, F["posinf"]] + neginf) > 0

    def flag(kind: str, mask: np.ndarray) -> None:
        # The first kind that applies to a record names its warning.
        new = mask & (kinds == 0)
        kinds[new] = _KIND_CODE[kind]

    max_abs = d["max_abs"]
    with np.errstate(invalid="ignore"):
        over = v[:, F["overflow"]] > 0
        if sr.max_abs is not None:
            over |= max_abs > sr.max_abs
        flag("overflow_risk", over)
        if series.info.role == "global_norm":
            norm = v[:, F["max"]]
            if sr.grad_norm_limit is not None:
                flag("exploding_gradient", norm > sr.grad_norm_limit)
            med = _rolling_median_before(norm, sr.spike_window)
            flag("gradient_spike", (med > 0) & (norm > sr.spike_factor * med))
            flag("vanishing_gradient", norm < sr.vanishing_floor)
        flag("growth", _growth_flags(max_abs, sr))
        nonzero = d["finite"] - v[:, F["zeros"]]
        share = np.where(nonzero > 0, v[:, F["underflow"]] / np.maximum(nonzero, 1), 0.0)
        flag("underflow", (v[:, F["underflow"]] > 0) & (share >= sr.underflow_share))
    codes[kinds > 0] = WARNING
    codes[nonfinite] = NONFINITE
    return SeriesHealth(series, codes, kinds)


# ---------------------------------------------------------------- run level


@dataclasses.dataclass
class RunAnalysis:
    """The health of every series of one run, in execution order."""

    run: str
    health: list[SeriesHealth]
    safe_range: SafeRange
    problems: list[str]

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
# are not finite and halves its loss scale. While the scale is at least 1
# that is the scaling overflowing float16, which the skip handles: the
# gradients' non-finite records of such a step are warnings ("skipped_step").
# Below 1 the gradients are non-finite even unscaled (a NaN in the backward
# pass, or gradients beyond float16's range), so they stay anomalies; so do
# non-finite forward values, which no loss scale changes.
LOSS_SCALE_HANDLED_MIN = 1.0


def skip_handled(info: metadata.TensorInfo, loss_scale: float | None) -> bool:
    """Whether a non-finite record of ``info`` at a step run with ``loss_scale``
    (None: no loss scaling) is a skipped step that loss scaling handled."""
    return loss_scale is not None and loss_scale >= LOSS_SCALE_HANDLED_MIN and info.phase == "backward"


def record_is_anomaly(
    tag: str, v: np.ndarray, info: metadata.TensorInfo, sr: SafeRange, loss_scale: float | None = None
) -> bool:
    """Whether one record is non-finite by the same rules as ``analyze_run``
    (for a training loop that must decide at once, e.g. to stop)."""
    neginf = 0.0 if _allowlisted(tag, sr.allow_neginf) else v[F["neginf"]]
    return v[F["nan"]] + v[F["posinf"]] + neginf > 0 and not skip_handled(info, loss_scale)


def _mark_skipped_steps(health: list[SeriesHealth]) -> None:
    """Turns the non-finite gradients of handled skipped steps into warnings."""
    scales = [h.series for h in health if h.series.info.role == "loss_scale" and len(h.series.steps)]
    if not scales:
        return
    sc = scales[0]
    for h in health:
        if not skip_handled(h.series.info, LOSS_SCALE_HANDLED_MIN):
            continue
        st = h.series.steps
        j = np.minimum(np.searchsorted(sc.steps, st), len(sc.steps) - 1)
        with np.errstate(invalid="ignore"):
            handled = (sc.steps[j] == st) & (sc.values[j, F["max"]].astype(np.float64) >= LOSS_SCALE_HANDLED_MIN)
        handled &= h.codes == NONFINITE
        h.codes[handled] = WARNING
        h.kinds[handled] = _KIND_CODE["skipped_step"]


def analyze_run(
    run: str,
    series: Iterable[TensorSeries],
    sr: SafeRange | None = None,
    problems: Sequence[str] = (),
) -> RunAnalysis:
    """Classifies every series of a run and orders them by execution order."""
    sr = sr or SafeRange()
    ordered = sorted(series, key=lambda s: s.sort_key)
    health = [series_health(s, sr) for s in ordered]
    _mark_skipped_steps(health)
    return RunAnalysis(run, health, sr, list(problems))


def skipped_steps(ra: RunAnalysis) -> list[int]:
    """The steps a LossScaleOptimizer skipped with the scale handling it."""
    code = _KIND_CODE["skipped_step"]
    steps = [h.series.steps[h.kinds == code] for h in ra.health]
    return np.unique(np.concatenate(steps)).astype(int).tolist() if steps else []


def _first_cell(ra: RunAnalysis, code: int, before: tuple[int, int] | None = None):
    """(step, row index, record index) of the first cell with ``code``."""
    best = None
    for row, h in enumerate(ra.health):
        idx = np.flatnonzero(h.codes == code)
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


_HINT_TOKENS = {
    "sqrt": "sqrt",
    "rsqrt": "sqrt",
    "log": "log",
    "log1p": "log",
    "logsoftmax": None,
    "xlogy": "log",
    "div": "div",
    "realdiv": "div",
    "truediv": "div",
    "floordiv": "div",
    "divnonan": "div",
    "reciprocal": "div",
    "inv": "div",
    "cosine": "div",
    "normalize": "div",
    "exp": "exp",
    "expm1": "exp",
    "softplus": "exp",
    "pow": "pow",
}

_HINTS = {
    ("sqrt", "backward"): "The gradient of sqrt is infinite at 0: sqrt of a value that reaches 0 "
    "(e.g. sqrt of a squared error) gives an infinite gradient. Drop the sqrt, or use sqrt(x + eps).",
    ("sqrt", "forward"): "sqrt of a negative value is NaN, and its gradient at 0 is infinite: "
    "keep the input positive, e.g. sqrt(maximum(x, eps)).",
    ("log", "forward"): "log(0) = -inf: the log of a value that reaches 0 (e.g. a saturated softmax "
    "probability). Use tf.nn.softmax_cross_entropy_with_logits / log_softmax, or clip the input away from 0.",
    ("log", "backward"): "The gradient of log is infinite at 0: the log's input reached 0. Use "
    "log_softmax or softmax_cross_entropy_with_logits, or add an epsilon.",
    ("div", "forward"): "Division by zero: 0/0 is NaN and x/0 is Inf (e.g. a norm of an all-zero "
    "vector in a denominator). Add an epsilon to the denominator, e.g. inside the norm.",
    ("div", "backward"): "Division by zero in the backward pass (e.g. the gradient of a norm or sqrt "
    "at 0). Add an epsilon inside the norm or to the denominator.",
    ("exp", "forward"): "exp overflows above ~88 in float32 (~11 in float16): its input grew too "
    "large. Use a numerically stable form (log-sum-exp, softmax with logits) or bound the input.",
    ("exp", "backward"): "exp overflowed in the backward pass: its input grew too large. Use a "
    "numerically stable form or bound the input.",
    ("pow", "forward"): "pow of a negative base with a fractional exponent is NaN, and 0 to a "
    "negative power is Inf: keep the base positive and away from 0.",
    ("pow", "backward"): "The gradient of pow is infinite at 0 for exponents below 1: keep the base "
    "away from 0.",
}
_GROWTH_HINT = (
    "Values grew steadily over the preceding steps until they overflowed: something keeps scaling "
    "them up, most often a too-large learning rate, also a loss that rewards growth or a layer "
    "that does not normalise. Lower the learning rate or clip gradients, and check the loss."
)
_SPIKE_HINT = (
    "The gradient norm spiked just before the first non-finite value: the learning rate is likely "
    "too large for this loss surface. Lower it, or clip gradients (clip_by_global_norm)."
)
_OVERFLOW_HINT = (
    "Values were already beyond the safe range before the first non-finite value: look at the "
    "likely cause below (a large input or a layer whose values overflow)."
)


def _op_family(tag: str, op_type: str) -> str | None:
    for token in [op_type] + re.split(r"[^A-Za-z0-9]+", tag)[::-1]:
        key = token.lower().removesuffix("grad").rstrip("_")
        if key in _HINT_TOKENS:
            return _HINT_TOKENS[key]
    return None


def cause_hint(tag: str, info: metadata.TensorInfo, warnings_before: set[str]) -> str:
    """A short plain-language hint for a first anomaly, or "" if none fits.

    The op type (or a token of the tag) decides first; otherwise the kinds of
    warning that came before the anomaly do.
    """
    family = _op_family(tag, info.op_type)
    if family is not None:
        phase = "backward" if info.phase == "backward" else "forward"
        return _HINTS[(family, phase)]
    if "growth" in warnings_before:
        return _GROWTH_HINT
    if warnings_before & {"gradient_spike", "exploding_gradient"}:
        return _SPIKE_HINT
    if "overflow_risk" in warnings_before:
        return _OVERFLOW_HINT
    return ""


def warning_detail(h: SeriesHealth, i: int, sr: SafeRange) -> str:
    """Words for the warning of record ``i`` of a series."""
    kind = WARNING_KINDS[h.kinds[i] - 1]
    v = h.series.values[i]
    if kind == "skipped_step":
        return "%s at a step the LossScaleOptimizer skipped (it lowered the loss scale)" % (
            describe_nonfinite(v))
    d = derived(v)
    max_abs = float(d["max_abs"][0])
    dtype = h.series.info.dtype
    if kind == "overflow_risk":
        if v[F["overflow"]] > 0:
            return "%d of %d values beyond the %s margin %.3g (max |x| = %.3g)" % (
                v[F["overflow"]], v[F["count"]], dtype, metadata.overflow_margin(dtype), max_abs,
            )
        return "max |x| = %.3g beyond the limit %.3g" % (max_abs, sr.max_abs)
    if kind == "exploding_gradient":
        return "global gradient norm %.3g beyond the limit %.3g" % (v[F["max"]], sr.grad_norm_limit)
    if kind == "gradient_spike":
        med = _rolling_median_before(h.series.values[: i + 1, F["max"]], sr.spike_window)[-1]
        return "global gradient norm %.3g is %.3gx the median %.3g of the previous %d records" % (
            v[F["max"]], v[F["max"]] / med, med, sr.spike_window,
        )
    if kind == "vanishing_gradient":
        return "global gradient norm %.3g below the floor %.3g" % (v[F["max"]], sr.vanishing_floor)
    if kind == "growth":
        prev = float(derived(h.series.values[i - sr.growth_window])["max_abs"][0])
        return "max |x| grew %.3gx over the last %d records, to %.3g" % (
            max_abs / prev, sr.growth_window, max_abs,
        )
    nonzero = v[F["count"]] - v[F["nan"]] - v[F["posinf"]] - v[F["neginf"]] - v[F["zeros"]]
    return "%d of %d nonzero values below the %s smallest normal %.3g" % (
        v[F["underflow"]], nonzero, dtype, metadata.smallest_normal(dtype),
    )


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
        "detail": warning_detail(h, i, ra.safe_range),
        "phase": h.series.info.phase,
        "role": h.series.info.role,
        "op_type": h.series.info.op_type or None,
        "row": row,
    }


def first_anomaly(ra: RunAnalysis) -> dict[str, Any] | None:
    """The first non-finite record of the run, in words and numbers."""
    cell = _first_cell(ra, NONFINITE)
    if cell is None:
        return None
    step, row, i = cell
    h = ra.health[row]
    v = h.series.values[i]
    healthy_before = np.flatnonzero(h.codes[:i] != NONFINITE)
    last_healthy = int(h.series.steps[healthy_before[-1]]) if healthy_before.size else None
    earlier_kinds = {WARNING_KINDS[k - 1] for k in np.unique(h.kinds[:i]) if k}
    cause = likely_cause(ra, cell)
    if cause is not None:
        earlier_kinds.add(cause["kind"])
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
        "last_healthy_step": last_healthy,
        "hint": cause_hint(h.series.tag, h.series.info, earlier_kinds),
        "likely_cause": cause,
        "row": row,
    }


def likely_cause(ra: RunAnalysis, anomaly_cell) -> dict[str, Any] | None:
    """The warning that most likely led to the anomaly at ``anomaly_cell``.

    A tensor earlier in the same step that is already out of the safe range
    (e.g. an input holding 1e38) comes first; otherwise a warning in the
    steps just before (growth, overflow risk, a gradient spike).
    """
    step, row, _ = anomaly_cell
    same_step = None
    for r in range(row):
        h = ra.health[r]
        j = np.searchsorted(h.series.steps, step)
        if j < len(h.series.steps) and h.series.steps[j] == step and h.codes[j] == WARNING:
            same_step = (step, r, int(j))
            break
    if same_step is not None:
        return _warning_json(ra, same_step)
    # The latest warning of any tensor in the records just before.
    best = None
    for r, h in enumerate(ra.health):
        idx = np.flatnonzero((h.codes == WARNING) & (h.series.steps < step))
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
    """The first warning of the run that comes before its first anomaly."""
    anomaly = _first_cell(ra, NONFINITE)
    before = None if anomaly is None else (anomaly[0], anomaly[1])
    cell = _first_cell(ra, WARNING, before=before)
    return None if cell is None else _warning_json(ra, cell)


def run_summary(ra: RunAnalysis) -> dict[str, Any]:
    """The per-run summary shared by the CLI's JSON and the HTTP API."""
    steps = ra.steps
    return {
        "run": ra.run,
        "first_anomaly": first_anomaly(ra),
        "first_warning": first_warning(ra),
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
