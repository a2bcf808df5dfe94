"""Every warning kind, by name: the one place that defines each.

A kind is one ``WarningKind`` in ``KINDS``: its name, the words the
dashboard shows, the hint with its usual fixes, the safe-range fields it
reads (``params``; its mask and detail are handed those fields and no
others), its mask over the records, the detail text of one record, whether
an early-warning detector (``detectors``) raises it, and whether it is
information about a handled event rather than a warning. ``KINDS`` is in
order of precedence: where several kinds hold for a record, the first
names its warning; a record stores the kind's position + 1 (0: none).

Adding a kind is one entry here and its test (``tests/test_rules.py``):
the analysis, the report, the HTTP API and the dashboard (through the
``/rules`` route) take it from here.

Masks come in two scopes. A series mask (``mask``) sees one series: a
``SeriesView`` and the kind's parameters, and answers a boolean per record,
or None where the kind does not apply to that series. A run mask
(``marks``) sees every row of a run (``health.SeriesHealth``: series,
codes, kinds) after the series masks, and answers (row, mask) pairs: the
records it turns into its warning (gradients by depth, which compare two
layers; skipped steps, which turn non-finite records into information).
A kind may also take back its own series-mask warnings that the run's other
rows do not confirm (``unconfirmed``: dead units without a dead bias
gradient), before any run mask.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from tb_numerics import detectors, metadata
from tb_numerics.records import F, TensorSeries, derived, nonfinite_count, union_steps, zero_share
from tb_numerics.rules.codes import HEALTHY, NONFINITE, WARNING
from tb_numerics.rules.numbers import count, describe_nonfinite, number, percent

__all__ = [
    "KINDS", "LOSS_SCALE_HANDLED_MIN", "SeriesView", "WarningKind", "growth_flags", "kind", "kind_code", "skip_handled",
]


@dataclasses.dataclass(frozen=True)
class SeriesView:
    """What a series mask reads: the series, its records in float64, their derived statistics."""

    series: TensorSeries
    v: np.ndarray
    d: dict[str, np.ndarray]


# The rows a run mask and a detail read: objects with ``series``, ``codes`` and ``kinds``.
Rows = Sequence[Any]


@dataclasses.dataclass(frozen=True)
class WarningKind:
    """One kind of warning, by name (see the module docstring)."""

    name: str
    words: str
    hint: str
    params: tuple[str, ...]
    # (rows, row, record index, parameters) -> the warning's evidence in words.
    detail: Callable[[Rows, int, int, Any], str]
    mask: Callable[[SeriesView, Any], np.ndarray | None] | None = None
    marks: Callable[[Rows, Any], Iterable[tuple[int, np.ndarray]]] | None = None
    # (rows, parameters) -> (row, mask) pairs of this kind's warnings that
    # the run's other rows do not confirm: taken back before the run masks.
    unconfirmed: Callable[[Rows, Any], Iterable[tuple[int, np.ndarray]]] | None = None
    early: bool = False
    info: bool = False
    health: int = WARNING

    def parameters(self, sr: Any) -> types.SimpleNamespace:
        """The fields of the safe range ``sr`` that this kind reads, and only those.

        Args:
          sr: a ``safe_range.SafeRange``.
        """
        return types.SimpleNamespace(**{p: getattr(sr, p) for p in self.params})


# ---------------------------------------------------------------- masks


def rolling_median_before(x: np.ndarray, window: int) -> np.ndarray:
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


def growth_flags(max_abs: np.ndarray, p: Any) -> np.ndarray:
    """Which records end ``growth_window`` records of steady growth: max |x|
    rising at each, by ``growth_factor`` in all, above ``growth_floor``.

    Args:
      max_abs: max |x| of each record.
      p: the safe range (or the growth kind's parameters).
    """
    w = p.growth_window
    n = len(max_abs)
    flags = np.zeros(n, dtype=bool)
    with np.errstate(invalid="ignore"):
        if n <= w or not np.any(max_abs >= p.growth_floor):  # nowhere above the floor: nothing to look at
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
        flags = all_rising & (max_abs >= p.growth_floor) & (prev > 0) & (max_abs >= p.growth_factor * prev)
    return flags


def _overflow_mask(s: SeriesView, p: Any) -> np.ndarray:
    over = s.v[:, F["overflow"]] > 0
    compute = s.series.info.compute_dtype
    if compute and compute != s.series.info.dtype:  # held to the range it is computed in
        over |= s.d["max_abs"] > metadata.overflow_margin(compute)
    if p.max_abs is not None:
        over |= s.d["max_abs"] > p.max_abs
    return over


def _is_norm(s: SeriesView) -> bool:
    return s.series.info.role == "global_norm"


def _spike_mask(s: SeriesView, p: Any) -> np.ndarray | None:
    if not _is_norm(s):
        return None
    norm = s.v[:, F["max"]]
    med = rolling_median_before(norm, p.spike_window)
    spike = (med > 0) & (norm > p.spike_factor * med)
    return spike & ~detectors.transient(spike, norm, med, nonfinite_count(s.v) == 0)


def _jump_mask(s: SeriesView, p: Any) -> np.ndarray:
    """max |x| at least ``jump_factor`` x the previous record's, above the floor."""
    max_abs = s.d["max_abs"]
    flags = np.zeros(len(max_abs), dtype=bool)
    with np.errstate(invalid="ignore", divide="ignore"):
        if not np.any(max_abs >= p.growth_floor):
            return flags
        flags[1:] = (max_abs[1:] >= p.growth_floor) & (max_abs[:-1] > 0) & (
            max_abs[1:] >= p.jump_factor * max_abs[:-1])
    return flags & ~detectors.transient(flags, max_abs, np.r_[np.nan, max_abs[:-1]], nonfinite_count(s.v) == 0)


def _not_on(skip: Callable[[metadata.TensorInfo], bool],
            mask: Callable[[SeriesView, Any], np.ndarray]) -> Callable[[SeriesView, Any], np.ndarray | None]:
    """``mask``, except on a series whose metadata ``skip`` names."""
    return lambda s, p: None if skip(s.series.info) else mask(s, p)


def _follows_data(info: metadata.TensorInfo) -> bool:
    """The input batch, and the statistics of the data a forward pass keeps
    (BatchNorm's moving variance taking in an outlier batch's): their range
    drifting over steps is no divergence of training."""
    return info.role == "input" or info.forward_state


def _underflow_mask(s: SeriesView, p: Any) -> np.ndarray:
    v = s.v
    if not np.any(v[:, F["underflow"]] > 0):
        return np.zeros(len(v), dtype=bool)
    nonzero = s.d["finite"] - v[:, F["zeros"]]
    share = np.where(nonzero > 0, v[:, F["underflow"]] / np.maximum(nonzero, 1), 0.0)
    return (v[:, F["underflow"]] > 0) & (share >= p.underflow_share)


def _depth_marks(which: str) -> Callable[[Rows, Any], list[tuple[int, np.ndarray]]]:
    """Gradients vanishing or exploding by depth (``which``), on the first
    layer's gradient, at records that are otherwise healthy."""

    def marks(rows: Rows, p: Any) -> list[tuple[int, np.ndarray]]:
        grads = [r for r, h in enumerate(rows) if h.series.info.role == "gradient"]
        if len(grads) < 2:
            return []
        steps = union_steps([rows[r].series for r in grads])
        depth = detectors.by_depth([rows[r].series for r in grads], steps, p.depth_vanishing,
                                   p.depth_exploding, p.sustain)
        if depth is None or not depth[which].any():
            return []
        r = next(r for r in grads if rows[r].series is depth["first"])
        return [(r, np.isin(rows[r].series.steps, steps[depth[which]]) & (rows[r].codes == HEALTHY))]

    return marks


# Mixed precision: a LossScaleOptimizer skips a step whose (scaled) gradients
# are not finite and lowers its loss scale. While the scale is at least 1
# and a later step's update goes through, that is the scaling overflowing
# float16, which the skip handled: the gradients' non-finite records of such
# a step are "skipped_step" information (not the run's first warning: a
# LossScaleOptimizer calibrating its scale skips a few steps in every
# healthy run). A run of skips that no applied step follows is a NaN that
# loss scaling cannot fix: an anomaly, at the first skip of that run. So are
# skips at a scale below 1, and non-finite forward values, which no loss
# scale changes.
LOSS_SCALE_HANDLED_MIN = 1.0


def skip_handled(info: metadata.TensorInfo, loss_scale: float | None) -> bool:
    """Whether a non-finite record of ``info`` at a step run with ``loss_scale``
    (None: no loss scaling) may be a skipped step that loss scaling handles.

    Args:
      info: the tensor's metadata.
      loss_scale: the loss scale of the record's step, or None.
    """
    return loss_scale is not None and loss_scale >= LOSS_SCALE_HANDLED_MIN and info.phase == "backward"


def _skipped_marks(rows: Rows, p: Any) -> list[tuple[int, np.ndarray]]:
    """The non-finite gradients of handled skipped steps."""
    scales = [h.series for h in rows if h.series.info.role == "loss_scale" and len(h.series.steps)]
    if not scales:
        return []
    sc = scales[0]
    candidates = []
    for r, h in enumerate(rows):
        if not skip_handled(h.series.info, LOSS_SCALE_HANDLED_MIN):
            continue
        st = h.series.steps
        j = np.minimum(np.searchsorted(sc.steps, st), len(sc.steps) - 1)
        with np.errstate(invalid="ignore"):
            handled = (sc.steps[j] == st) & (sc.values[j, F["max"]].astype(np.float64) >= LOSS_SCALE_HANDLED_MIN)
        candidates.append((r, handled & (h.codes == NONFINITE)))
    skipped = np.unique(np.concatenate([rows[r].series.steps[m] for r, m in candidates])) if candidates else []
    if not len(skipped):
        return []
    # Steps with a loss-scale record that were not skipped: updates applied.
    applied = np.setdiff1d(sc.steps, skipped)
    recovered_before = applied[-1] if applied.size else -1
    # A step whose forward pass (or batch) went non-finite is no skip that loss
    # scaling handles: its layer records say so, or the op-level records of a
    # look inside it (a float16 overflow inside a layer whose output stayed
    # finite, e.g. x / sqrt(inf)); nor is one whose gradients a replay found
    # non-finite with the loss scale at 1 (``p.unscaled_bad``: a sqrt's
    # gradient at 0 is inf at any scale).
    bad = [h.series.steps[h.codes == NONFINITE] for h in rows if h.series.info.phase != "backward"]
    bad.append(p.unscaled_bad)
    forward_bad = np.unique(np.concatenate(bad)) if bad else np.zeros(0, np.int64)
    return [(r, m & (rows[r].series.steps < recovered_before) & ~np.isin(rows[r].series.steps, forward_bad))
            for r, m in candidates]


def _dead_unconfirmed(rows: Rows, p: Any) -> Iterable[tuple[int, np.ndarray]]:
    """Dead units that the layer's bias gradient does not confirm (``detectors``)."""
    code = kind_code("dead_units")
    grads = [h.series for h in rows if h.series.info.role == "gradient"]
    for r, h in enumerate(rows):
        marked = h.kinds == code
        if marked.any():
            yield r, marked & ~detectors.dead_units_by_gradient(h.series, marked, grads, p.dead_share, p.sustain)


def _ratio_unconfirmed(rows: Rows, p: Any) -> Iterable[tuple[int, np.ndarray]]:
    """Large updates that neither span the layers nor last (``detectors``)."""
    code = kind_code("update_ratio")
    ratios = [r for r, h in enumerate(rows) if h.series.tag.startswith("update_ratio/")]
    marked = [rows[r].kinds == code for r in ratios]
    kept = detectors.update_ratio_kept([rows[r].series for r in ratios], marked)
    return [(r, m & ~keep) for r, m, keep in zip(ratios, marked, kept)]


# ---------------------------------------------------------------- details


def _record(rows: Rows, row: int, i: int) -> tuple[TensorSeries, np.ndarray, float]:
    """Record ``i`` of a row's series in float64, and its max |x|."""
    s = rows[row].series
    v = s.record(i)
    return s, v, float(derived(v)["max_abs"][0])


def _whole(rows: Rows, row: int) -> tuple[TensorSeries, np.ndarray, dict[str, np.ndarray]]:
    """A row's series, all its records in float64 and their derived statistics."""
    s = rows[row].series
    v = s.values.astype(np.float64)
    return s, v, derived(v)


def _overflow_detail(rows: Rows, row: int, i: int, p: Any) -> str:
    """Names the rule that held: the recorded dtype's margin, the margin of
    the dtype it was computed in, or the user's limit."""
    s, v, max_abs = _record(rows, row, i)
    dtype, compute = s.info.dtype, s.info.compute_dtype
    if v[F["overflow"]] > 0:
        return "%s of %s values beyond the %s margin %s (max |x| = %s)" % (
            count(v[F["overflow"]]), count(v[F["count"]]), dtype, number(metadata.overflow_margin(dtype)),
            number(max_abs))
    if compute and compute != dtype and max_abs > metadata.overflow_margin(compute):
        return "max |x| = %s beyond the %s margin %s: computed in %s (recorded as %s), whose largest value is %s" % (
            number(max_abs), compute, number(metadata.overflow_margin(compute)), compute, dtype,
            number(metadata.DTYPE_LIMITS[compute][0]))
    return "max |x| = %s beyond the limit %s" % (number(max_abs), number(p.max_abs))


def _norm(rows: Rows, row: int, i: int) -> float:
    return float(rows[row].series.values[i, F["max"]])


def _spike_detail(rows: Rows, row: int, i: int, p: Any) -> str:
    norms = rows[row].series.values[: i + 1, F["max"]].astype(np.float64)
    med = rolling_median_before(norms, p.spike_window)[-1]
    used = int(np.isfinite(norms[max(0, i - p.spike_window) : i]).sum())
    return "global gradient norm %s is %s× the median %s of the previous %d record%s" % (
        number(norms[i]), number(norms[i] / med), number(med), used, "" if used == 1 else "s")


def _square_detail(rows: Rows, row: int, i: int, p: Any) -> str:
    s, _, max_abs = _record(rows, row, i)
    return "max |x| = %s: its square, which %s computes, is beyond the %s maximum %s" % (
        number(max_abs), s.info.squared_by, s.info.dtype, number(metadata.DTYPE_LIMITS[s.info.dtype][0]))


def _growth_detail(back_param: str | None) -> Callable[[Rows, int, int, Any], str]:
    """Growth over ``p.<back_param>`` records (one where None)."""

    def detail(rows: Rows, row: int, i: int, p: Any) -> str:
        s, _, max_abs = _record(rows, row, i)
        back = 1 if back_param is None else getattr(p, back_param)
        prev = float(derived(s.record(i - back))["max_abs"][0])
        return "max |x| grew %s× in %d record%s (steps %d to %d), to %s" % (
            number(max_abs / prev), back, "" if back == 1 else "s", int(s.steps[i - back]), int(s.steps[i]),
            number(max_abs))

    return detail


def _headroom_detail(rows: Rows, row: int, i: int, p: Any) -> str:
    """The forecast of record ``i`` in words that hold at its step: the
    growth it extrapolates (over which steps, how fast) and what of this
    tensor it forecasts, whatever other tensors did at that step."""
    # max |x| alone, which a compact series holds (``TensorSeries.mask_values``).
    s = rows[row].series
    d = derived(s.mask_values())
    window = p.growth_window
    dtype = s.info.compute_dtype or s.info.dtype
    left = float(detectors.headroom_forecast(s, d, window, at=np.arange(len(s.steps)) == i)[i])
    bits = float(np.log2(metadata.DTYPE_LIMITS[dtype][0] / d["max_abs"][i]))
    return ("max |x| = %s, %.1f bits below the %s maximum; at its growth over steps %d to %d (×%s a step), "
            "this tensor's %s overflow in about %d steps" % (
                number(d["max_abs"][i]), bits, dtype, int(s.steps[i - window + 1]), int(s.steps[i]),
                number(2.0 ** (bits / left)), dtype, max(1, int(round(left)))))


def _depth_detail(rows: Rows, row: int, i: int, p: Any) -> str:
    grads = [h.series for h in rows if h.series.info.role == "gradient"]
    step = rows[row].series.steps[i : i + 1]
    depth = detectors.by_depth(grads, step, p.depth_vanishing, p.depth_exploding, 1)
    return "first layer's gradient norm %s is %s× the last layer's (%s, %s) at step %d" % (
        number(depth["first_norm"][0]), number(depth["ratio"][0]), depth["last"].tag,
        number(depth["last_norm"][0]), int(step[0]))


def _underflow_detail(rows: Rows, row: int, i: int, p: Any) -> str:
    s, v, _ = _record(rows, row, i)
    nonzero = v[F["count"]] - nonfinite_count(v) - v[F["zeros"]]
    return "%s of %s nonzero values below the %s smallest normal %s" % (
        count(v[F["underflow"]]), count(nonzero), s.info.dtype, number(metadata.smallest_normal(s.info.dtype)))


def _sustained_steps(rows: Rows, row: int, i: int, p: Any) -> str:
    s = rows[row].series
    return "for %d records (steps %d to %d)" % (p.sustain, int(s.steps[max(0, i - p.sustain + 1)]), int(s.steps[i]))


def _dead_detail(rows: Rows, row: int, i: int, p: Any) -> str:
    _, v, _ = _record(rows, row, i)
    return "%s of the values exactly 0 %s" % (
        percent(float(zero_share(v[F["zeros"]], derived(v)["finite"][0]))), _sustained_steps(rows, row, i, p))


def _saturation_detail(rows: Rows, row: int, i: int, p: Any) -> str:
    s, v, _ = _record(rows, row, i)
    return "%s output pinned at its bounds %s: mean %s, max %s, %s exact zeros" % (
        s.info.activation or s.info.op_type, _sustained_steps(rows, row, i, p), number(derived(v)["mean"][0]),
        number(v[F["max"]]), count(v[F["zeros"]]))


def _loss_flat_detail(rows: Rows, row: int, i: int, p: Any) -> str:
    s, _, d = _whole(rows, row)
    loss, q = d["mean"], max(1, p.loss_window // 4)
    return "the loss's mean over records %d-%d (%s) is not below its mean over records 1-%d (%s): steps %d to %d" % (
        p.loss_window - q + 1, p.loss_window, number(np.mean(loss[i - q + 1 : i + 1])), q,
        number(np.mean(loss[:q])), int(s.steps[0]), int(s.steps[i]))


def _loss_swing_detail(rows: Rows, row: int, i: int, p: Any) -> str:
    s, _, d = _whole(rows, row)
    loss, lo = d["mean"], max(0, i - p.loss_window + 1)
    return "the loss changed direction at most records of the last %d (steps %d to %d), between %s and %s" % (
        p.loss_window, int(s.steps[lo]), int(s.steps[i]), number(np.min(loss[lo : i + 1])),
        number(np.max(loss[lo : i + 1])))


# ---------------------------------------------------------------- the kinds


def _by_depth(name: str, words: str, hint: str) -> WarningKind:
    """A kind of gradients by depth ("exploding_by_depth"): the first layer's
    kernel gradient norm against the last layer's (AUTOTRAINER's rule), a run mask."""
    return WarningKind(name, words, hint, ("depth_vanishing", "depth_exploding", "sustain"), _depth_detail,
                       marks=_depth_marks(name.split("_")[0]), early=True)


def _norm_mask(test: Callable[[np.ndarray, Any], np.ndarray | None]) -> Callable[[SeriesView, Any], np.ndarray | None]:
    """A mask on the global gradient norm only."""
    return lambda s, p: test(s.v[:, F["max"]], p) if _is_norm(s) else None


KINDS: tuple[WarningKind, ...] = (
    WarningKind(
        "overflow_risk", "overflow risk",
        "Values are near the dtype's largest value: squaring, summing or exponentiating them "
        "overflows. Look at where they come from (inputs, a layer without normalisation, the learning rate).",
        ("max_abs",), _overflow_detail, mask=_overflow_mask),
    WarningKind(
        "exploding_gradient", "exploding gradient",
        "The gradient norm is beyond your limit: lower the learning rate or clip gradients.",
        ("grad_norm_limit",),
        lambda rows, row, i, p: "global gradient norm %s beyond the limit %s" % (
            number(_norm(rows, row, i)), number(p.grad_norm_limit)),
        mask=_norm_mask(lambda norm, p: None if p.grad_norm_limit is None else norm > p.grad_norm_limit)),
    WarningKind(
        "gradient_spike", "gradient spike",
        "The gradient norm jumped against its recent median: the learning rate is likely too "
        "large for this loss surface; lower it, or clip gradients (clip_by_global_norm).",
        ("spike_factor", "spike_window"), _spike_detail, mask=_spike_mask),
    # A gradient whose square, which the optimizer computes, overflows.
    WarningKind(
        "square_overflow", "gradient's square overflows",
        "The optimizer squares this gradient (a second moment) and the square overflows: "
        "its state becomes infinite and the weights NaN within a step or two. Clip gradients (clipnorm=), "
        "or find what made them this large (an unscaled loss, a bad batch).",
        (), _square_detail, mask=lambda s, p: detectors.square_overflow(s.series, s.d), early=True),
    # max |x| many times its previous record's in one step: fast divergence,
    # before the spike and growth rules have enough history.
    WarningKind(
        "fast_growth", "fast growth",
        "Values grew by orders of magnitude in one step: training is diverging; lower the "
        "learning rate or clip gradients.",
        ("jump_factor", "growth_floor"), _growth_detail(None),
        mask=_not_on(lambda info: info.forward_state, _jump_mask)),
    WarningKind(
        "headroom", "headroom running out",
        "At this growth the tensor overflows its dtype soon: lower the learning rate, normalise, "
        "or (under mixed precision) keep this computation in float32.",
        ("growth_window", "headroom_steps", "growth_floor"), _headroom_detail,
        mask=_not_on(_follows_data, lambda s, p: detectors.headroom(s.series, s.d, p.growth_window,
                                                                    p.headroom_steps, p.growth_floor)),
        early=True),
    WarningKind(
        "growth", "growth",
        "Values keep growing step after step: lower the learning rate, normalise the layer "
        "(BatchNorm/LayerNorm), and check that the loss does not reward growth.",
        ("growth_window", "growth_factor", "growth_floor"), _growth_detail("growth_window"),
        mask=_not_on(_follows_data, lambda s, p: growth_flags(s.d["max_abs"], p))),
    _by_depth(
        "exploding_by_depth", "exploding gradients by depth",
        "The first layer's gradients are far larger than the last layer's: gradients "
        "explode with depth. Lower the learning rate, clip gradients, use normalisation or residual connections."),
    WarningKind(
        "vanishing_gradient", "vanishing gradient",
        "The global gradient norm is vanishing: check the initialisation, the "
        "activation functions (saturating sigmoid/tanh) and the learning-rate schedule.",
        ("vanishing_floor",),
        lambda rows, row, i, p: "global gradient norm %s below the floor %s" % (
            number(_norm(rows, row, i)), number(p.vanishing_floor)),
        mask=_norm_mask(lambda norm, p: detectors.vanishing(norm, p.vanishing_floor))),
    _by_depth(
        "vanishing_by_depth", "vanishing gradients by depth",
        "The first layer's gradients are far smaller than the last layer's: gradients "
        "vanish with depth. Use ReLU-family activations, He/Glorot initialisation, normalisation or residual "
        "connections."),
    WarningKind(
        "underflow", "underflow",
        "Many values are below the dtype's smallest normal: they lose precision or flush to 0. "
        "Use loss scaling under float16, or rescale.",
        ("underflow_share",), _underflow_detail, mask=_underflow_mask),
    WarningKind(
        "dead_units", "dead units",
        "Most of the layer's outputs are exactly 0: ReLU units have died. Lower the learning "
        "rate, initialise biases at 0 (not negative), or use LeakyReLU/ELU.",
        ("dead_share", "sustain"), _dead_detail,
        mask=lambda s, p: detectors.dead_units(s.series, p.dead_share, p.sustain),
        unconfirmed=_dead_unconfirmed, early=True),
    WarningKind(
        "saturation", "saturated activations",
        "The activation is pinned at its bounds, where its gradient vanishes (and a softmax of "
        "exact 0 makes log(0)). Normalise the inputs, lower the learning rate, or compute the loss from logits.",
        ("sustain",), _saturation_detail, mask=lambda s, p: detectors.saturation(s.series, p.sustain),
        early=True),
    WarningKind(
        "update_ratio", "update ratio out of range",
        "One update moved the weights by more than their own size: the learning rate is far "
        "too large for this layer.",
        ("update_ratio_max",),
        lambda rows, row, i, p: "||w_new - w_old|| / ||w_old|| = %s, above %s: the update moved the weights by "
        "more than their size" % (number(_norm(rows, row, i)), number(p.update_ratio_max)),
        mask=lambda s, p: detectors.update_ratio(s.series, p.update_ratio_max),
        unconfirmed=_ratio_unconfirmed, early=True),
    WarningKind(
        "loss_not_decreasing", "loss not decreasing",
        "The loss is not going down: check the learning rate (too small or too large), "
        "the labels and the loss function, and that gradients reach the weights.",
        ("loss_window",), _loss_flat_detail,
        mask=lambda s, p: detectors.loss_not_decreasing(s.series, s.d, p.loss_window), early=True),
    WarningKind(
        "loss_oscillating", "loss oscillating",
        "The loss swings up and down by large factors: the learning rate is too large to "
        "settle (lower it or add a decay schedule), or the batches alternate between different kinds of data "
        "(shuffle them).",
        ("loss_window",), _loss_swing_detail,
        mask=lambda s, p: detectors.loss_oscillating(s.series, s.d, p.loss_window), early=True),
    # Non-finite gradients at a step a LossScaleOptimizer skipped: handled.
    WarningKind(
        "skipped_step", "skipped step",
        "The LossScaleOptimizer skipped the step and lowered its scale: normal while it "
        "calibrates; persistent skips mean a NaN that loss scaling cannot fix.",
        (), lambda rows, row, i, p: "%s at a step the LossScaleOptimizer skipped (it lowered the loss scale)"
        % describe_nonfinite(rows[row].series.record(i)),
        marks=_skipped_marks, info=True),
)

_BY_NAME = {k.name: k for k in KINDS}
_CODE = {k.name: i + 1 for i, k in enumerate(KINDS)}


def kind(name: str) -> WarningKind:
    """The warning kind called ``name``.

    Raises:
      KeyError: no kind has that name.
    """
    return _BY_NAME[name]


def kind_code(name: str) -> int:
    """The code a record stores for a warning of kind ``name`` (0 is no warning).

    Raises:
      KeyError: no kind has that name.
    """
    return _CODE[name]
