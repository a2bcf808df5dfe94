"""Early warnings from the records: where values start to go wrong, before the NaN.

Part of the numpy-only analysis core (``analysis`` calls these; each returns
a boolean mask over a series' records, or per-step masks for a run). The
rules are those of the best-known training-problem detectors (AUTOTRAINER,
ICSE 2021; SageMaker Debugger's built-in rules), on statistics the records
already hold, with defaults chosen to stay quiet on healthy training (the
false-positive count is measured by ``bench/healthy.py``):

* dead units: the output of a function known to be ReLU-like whose share
  of exact zeros is at or above ``dead_share`` (AUTOTRAINER: 70 %) for
  ``sustain`` records, and, where the layer's bias gradient is recorded,
  whose units are dead too: AUTOTRAINER counts units that are 0 for the
  whole batch, and a share of zero *values* also holds for sparse but live
  units;
* saturation: a sigmoid or tanh output pinned at its bounds, or a softmax
  emitting exact 0 or 1 (the classic precursor of log(0)), for ``sustain``
  records;
* vanishing / exploding gradients by depth: the first layer's gradient norm
  against the last layer's (AUTOTRAINER: below 1e-3 with the first below
  1e-4; above 70), for ``sustain`` records;
* update ratio: ||w_new - w_old|| / ||w_old|| above ``update_ratio_max``
  (healthy training moves weights by about 1e-3 of their norm a step;
  an update larger than the weights themselves is divergence), in at least
  half the layers at once (a learning rate moves them all), or again at the
  layer's next record, or at its latest: one layer whose small initial
  weights (an embedding's ±0.05) its first update outgrew, and which then
  settles, is not divergence;
* headroom: max |x| still finite, but at its recent growth it reaches the
  largest value of the dtype it is computed in within ``headroom_steps``;
* square overflow: a finite gradient that an optimizer squares (Adam's
  second moment, RMSprop, Adagrad), beyond the square root of its dtype's
  largest value: its square is infinite, and the weights go NaN a step or
  two later with every gradient finite;
* a jump that does not last: a jump of max |x| or a gradient-norm spike
  after which the next ``TRANSIENT_RECORDS`` records are finite and back
  below the jump's geometric midpoint is one outlier batch that training
  absorbed (the batch stays an input's record, and a hint's evidence), not
  divergence;
* loss trouble: a loss that never went below its first value in its first
  ``loss_window`` records, or that changed direction at nearly every record
  of the last ``loss_window`` while spanning a factor of 10.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Sequence

import numpy as np

from tb_numerics import metadata
from tb_numerics.records import F, TensorSeries

__all__ = [
    "SATURATING",
    "by_depth",
    "dead_units",
    "dead_units_by_gradient",
    "depth_pair",
    "headroom",
    "headroom_forecast",
    "loss_not_decreasing",
    "loss_oscillating",
    "pinned",
    "relu_like",
    "saturating_function",
    "saturation",
    "square_limit",
    "square_overflow",
    "square_overflows",
    "sustained",
    "transient",
    "update_ratio",
    "update_ratio_kept",
    "vanishing",
]

# Layers whose exact zeros are by design: dropout masks, padding, softmax.
_ZEROS_BY_DESIGN = re.compile(r"dropout|embedding|softmax|attention|mask|pool|pad", re.I)
_RELU_LIKE = re.compile(r"^(relu|relu6|leaky_relu|elu|selu|gelu|silu|swish)$", re.I)
# Op types (graph ops, Keras layer classes) that are a ReLU-like function.
_RELU_LIKE_OPS = frozenset({"relu", "relu6", "leakyrelu", "elu", "selu", "prelu"})
# Functions whose outputs the saturation rule reads (by activation, else op type).
SATURATING = frozenset({"sigmoid", "hard_sigmoid", "tanh", "softmax"})


def sustained(mask: np.ndarray, k: int) -> np.ndarray:
    """True at record i where ``mask`` held at each of records i-k+1 .. i."""
    run = np.concatenate([[0], np.cumsum(mask, dtype=np.int64)])
    out = np.zeros(len(mask), dtype=bool)
    if k <= len(mask):
        out[k - 1 :] = run[k:] - run[:-k] == k
    return out


TRANSIENT_RECORDS = 2


def transient(flags: np.ndarray, x: np.ndarray, base: np.ndarray, finite: np.ndarray,
              k: int = TRANSIENT_RECORDS) -> np.ndarray:
    """Which ``flags`` (a jump of ``x`` above its ``base``: the record before,
    or a recent median) the next ``k`` records undo: each of them exists, is
    finite, and is back below sqrt(x * base), halfway down in log terms. A
    diverging training's values do not come back; one outlier batch's do."""
    n = len(x)
    out = np.zeros(n, dtype=bool)
    with np.errstate(invalid="ignore"):
        for i in np.flatnonzero(flags):
            nxt = slice(i + 1, i + 1 + k)
            if i + k < n and finite[nxt].all():
                out[i] = bool(np.all(x[nxt] <= np.sqrt(x[i] * base[i])))
    return out


def relu_like(info: metadata.TensorInfo) -> bool:
    """Whether the tensor is known to come from a ReLU-like function: its
    activation function, or else its op type (a ``ReLU`` layer, a ``Relu``
    op). A tensor of unknown origin is not: one-hot products, masks, padded
    sequences and sparse features are mostly exact zeros by design."""
    if info.activation:
        return bool(_RELU_LIKE.match(info.activation))
    return info.op_type.lower().replace("_", "") in _RELU_LIKE_OPS


def dead_units(series: TensorSeries, share: float, k: int) -> np.ndarray:
    """Activations whose share of exact zeros stays at or above ``share``."""
    no = np.zeros(len(series.steps), dtype=bool)
    info = series.info
    if info.role != "activation" or _ZEROS_BY_DESIGN.search(info.op_type + " " + series.tag):
        return no
    if not relu_like(info):
        return no
    zero_share, count = series.zero_shares()
    return sustained((count >= 32) & (zero_share >= share), k)


def _layer_bias(tag: str, gradients: Sequence[TensorSeries]) -> TensorSeries | None:
    """The bias gradient of the layer whose output is ``tag`` (``<layer>/output``), by its
    variable path ``.../<layer>/bias``; None where there is none (no bias, or not logged)."""
    layer, _, last = tag.rpartition("/")
    if last != "output" or not layer:
        return None
    ends = "/%s/bias" % layer
    found = [g for g in gradients if g.tag.endswith(ends)]
    return found[0] if len(found) == 1 else None


def dead_units_by_gradient(
    series: TensorSeries, dead: np.ndarray, gradients: Sequence[TensorSeries], share: float, k: int
) -> np.ndarray:
    """``dead`` (the zero-value rule's mask over ``series``), kept only where the
    layer's units are dead: a unit that is 0 for every example of the batch gets
    an exact 0 bias gradient, so the bias gradient's share of exact zeros is the
    share of dead units (or more, where no gradient reached a live unit). A
    ReLU layer fed only positive inputs is mostly zeros with every unit alive
    for some examples; its bias gradient says so. Records without a bias
    gradient at their step keep the zero-value rule."""
    bias = _layer_bias(series.tag, gradients)
    if bias is None or not dead.any():
        return dead
    j = np.minimum(np.searchsorted(bias.steps, series.steps), max(len(bias.steps) - 1, 0))
    known = (bias.steps[j] == series.steps) if len(bias.steps) else np.zeros(len(dead), dtype=bool)
    # Only the records that the marked ones' windows read (a long run's are read back from its files).
    marked = np.flatnonzero(dead)
    lo, hi = max(int(marked[0]) - k + 1, 0), int(marked[-1]) + 1
    units = np.zeros(len(dead), dtype=bool)
    if len(bias.steps):
        first = int(j[lo])
        b = bias.records(first, int(j[hi - 1]) + 1)
        with np.errstate(invalid="ignore", divide="ignore"):
            at = j[lo:hi] - first
            units[lo:hi] = b[at, F["zeros"]] / np.maximum(b[at, F["count"]], 1) >= share
    return dead & sustained(np.where(known, units, True), k)


def saturating_function(info: metadata.TensorInfo) -> str:
    """The function that made the tensor where it saturates (one of
    ``SATURATING``: its activation, else its op type), else ""."""
    fn = (info.activation or info.op_type).lower()
    return fn if fn in SATURATING else ""


def pinned(fn: str, v: np.ndarray, d: dict[str, np.ndarray]) -> np.ndarray:
    """Which records ``v`` (float64 ``[n, F]``, ``d`` their ``derived``) of
    an output of the saturating function ``fn`` are pinned at its bounds,
    finite values held: the saturation rule's measure of one record."""
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_sq = v[:, F["sum_sq"]] / np.maximum(d["finite"], 1)
        if fn in ("sigmoid", "hard_sigmoid"):
            # x(1 - x) is at most 1/4; near 0 only where every x is near 0 or 1.
            at_bounds = (d["mean"] - mean_sq) < 0.01
        elif fn == "tanh":
            at_bounds = mean_sq > 0.98  # |x| near 1 nearly everywhere
        else:  # softmax: exact 0 (underflowed exp) or exact 1: log(0) is one step away
            at_bounds = (v[:, F["zeros"]] > 0) | (v[:, F["max"]] >= 1.0)
    return at_bounds & (d["finite"] > 0)


def saturation(series: TensorSeries, k: int) -> np.ndarray:
    """Sigmoid, tanh or softmax outputs pinned at their bounds."""
    fn = saturating_function(series.info)
    if not fn:
        return np.zeros(len(series.steps), dtype=bool)
    return sustained(series.marked(functools.partial(pinned, fn)), k)


def headroom_forecast(series: TensorSeries, d: dict[str, np.ndarray], window: int,
                      at: np.ndarray | None = None) -> np.ndarray:
    """Steps until max |x| reaches the largest finite value of the dtype the
    tensor is computed in, at the growth of its last ``window`` records
    (a least-squares line through log2 max |x| against the step); inf where
    it is not growing steadily, and (``at``: a bool per record) where not
    asked for.

    The line is fitted only where the window rose steadily (``window - 2``
    of its steps up) and the forecast is asked for: usually a few records
    of a few tensors, each fitted on its own window, with the steps
    counted from the window's last.
    """
    dtype = series.info.compute_dtype or series.info.dtype
    limit = np.log2(metadata.DTYPE_LIMITS[dtype][0])
    n = len(series.steps)
    out = np.full(n, np.inf)
    if n < window:
        return out
    with np.errstate(divide="ignore", invalid="ignore"):
        y = np.log2(d["max_abs"])
    good = np.isfinite(y)
    y = np.where(good, y, 0.0)
    with np.errstate(invalid="ignore"):
        rising = np.r_[False, (np.diff(y) > 0) & good[1:] & good[:-1]]
    counts = np.concatenate([[0], np.cumsum(rising, dtype=np.int64)])
    rises = counts[window:] - counts[:-window] - rising[: n - window + 1]  # rises inside each window
    ends = np.flatnonzero(rises >= window - 2) + (window - 1)  # where a window rose steadily
    if at is not None:
        ends = ends[at[ends]]
    if not len(ends):
        return out  # growing steadily nowhere (most tensors): no line to fit
    cols = ends[:, None] + np.arange(1 - window, 1)  # [k, window]: each window's records
    x = (series.steps[cols] - series.steps[ends][:, None]).astype(np.float64)
    ys = y[cols]
    sx, sy, sxx, sxy = x.sum(axis=1), ys.sum(axis=1), (x * x).sum(axis=1), (x * ys).sum(axis=1)
    var = sxx - sx * sx / window
    with np.errstate(invalid="ignore", divide="ignore"):
        slope = np.where(var > 0, (sxy - sx * sy / window) / var, 0.0)
    ok = good[cols].all(axis=1) & (slope > 0)
    out[ends] = np.where(ok, (limit - y[ends]) / np.where(ok, slope, 1.0), np.inf)
    return out


# A growing tensor is worth a headroom warning from this many bits below its
# dtype's largest value, or from the safe range's growth floor if that is lower.
_HEADROOM_FLOOR_BITS = 12


def headroom(series: TensorSeries, d: dict[str, np.ndarray], window: int, steps: float, floor: float) -> np.ndarray:
    """Growing tensors that reach their dtype's largest value within ``steps``,
    once max |x| is at least ``floor`` or 2**-12 of that largest value, the
    lower: a floor of 100 is only 9.4 bits below float16's 65,504, too late
    for a warning ahead of a growth of 1.3x a step; 16 leaves 12 bits. Small
    values that rise as training starts stay below either floor."""
    dtype = series.info.compute_dtype or series.info.dtype
    floor = min(floor, metadata.DTYPE_LIMITS[dtype][0] * 2.0 ** -_HEADROOM_FLOOR_BITS)
    with np.errstate(invalid="ignore"):
        big = d["max_abs"] >= floor
        if not big.any():  # most tensors: no forecast to make
            return big
        return (headroom_forecast(series, d, window, at=big) <= steps) & big


def vanishing(norm: np.ndarray, floor: float) -> np.ndarray:
    """Global gradient norms below ``floor``, except an exact 0 that the next
    record recovers from: a step whose loss held no sample to learn from (a
    batch with no labelled sample under a masked mean) has no gradient at
    all, and the training is not losing its gradients; an exact 0 that stays
    (every unit dead) or is the latest record still warns."""
    norm = np.asarray(norm, np.float64)
    with np.errstate(invalid="ignore"):
        low = norm < floor
        recovered = np.zeros(len(norm), dtype=bool)
        recovered[:-1] = (norm[:-1] == 0) & (norm[1:] >= floor)
    return low & ~recovered


def update_ratio(series: TensorSeries, ratio_max: float) -> np.ndarray:
    """Update-ratio records (``update_ratio/<layer>``) above ``ratio_max``."""
    if not series.tag.startswith("update_ratio/"):
        return np.zeros(len(series.steps), dtype=bool)
    with np.errstate(invalid="ignore"):
        return series.values[:, F["max"]].astype(np.float64) > ratio_max


def update_ratio_kept(ratios: Sequence[TensorSeries], marked: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Of the update-ratio records ``marked`` above the limit (one mask per
    series of ``ratios``), those that say divergence: at a step where at least
    half the layers recorded are marked, or whose layer's next record is marked
    too or does not exist yet."""
    at_step: dict[int, list[bool]] = {}
    for s, m in zip(ratios, marked):
        for st, bad in zip(s.steps.tolist(), m.tolist()):
            at_step.setdefault(st, []).append(bad)
    kept = []
    for s, m in zip(ratios, marked):
        wide = np.array([2 * sum(at_step[st]) >= len(at_step[st]) for st in s.steps.tolist()], dtype=bool)
        again = np.r_[m[1:], True]  # the next record is marked, or there is none yet
        kept.append(m & (wide | again))
    return kept


def square_limit(dtype: str) -> float:
    """The largest |x| whose square ``dtype`` holds: sqrt of its largest value
    (about 1.8e19 for float32)."""
    return float(np.sqrt(metadata.DTYPE_LIMITS[dtype][0]))


def square_overflows(max_abs: np.ndarray, dtype: str) -> np.ndarray:
    """Where ``max_abs`` squared exceeds the largest value of ``dtype`` (the
    dtype the square is computed in)."""
    with np.errstate(invalid="ignore"):
        return np.abs(np.asarray(max_abs, np.float64)) > square_limit(dtype)


def square_overflow(series: TensorSeries, d: dict[str, np.ndarray]) -> np.ndarray:
    """Gradients whose optimizer squares them (``TensorInfo.squared_by``)
    with a square beyond their dtype's range."""
    info = series.info
    if info.role != "gradient" or not info.squared_by:
        return np.zeros(len(series.steps), dtype=bool)
    return square_overflows(d["max_abs"], info.dtype)


def _loss_values(series: TensorSeries, d: dict[str, np.ndarray]) -> np.ndarray | None:
    if series.info.role != "loss":
        return None
    return d["mean"]


def loss_not_decreasing(series: TensorSeries, d: dict[str, np.ndarray], window: int) -> np.ndarray:
    """Over the run's first ``window`` records, the mean loss of the last
    quarter is not below that of the first quarter (from the run's start
    only: a loss that learned and then plateaued is healthy; a learning-rate
    warm-up that starts near 0 can trip it)."""
    out = np.zeros(len(series.steps), dtype=bool)
    loss = _loss_values(series, d)
    if loss is None or len(loss) < window or not np.all(np.isfinite(loss[:window])):
        return out
    q = max(1, window // 4)
    if np.mean(loss[window - q : window]) >= np.mean(loss[:q]):
        out[window - 1] = True
    return out


def loss_oscillating(series: TensorSeries, d: dict[str, np.ndarray], window: int) -> np.ndarray:
    """The loss changed direction at 95 % of the last ``window`` records while
    spanning a factor of 10: a learning rate too large to settle, or batches
    that alternate between different data.

    95 %, not AUTOTRAINER's looser rule: a noisy minibatch loss changes
    direction at about 2/3 of its records by chance, and late in training
    its batches can span a factor of 10; 45 turns of 48 is about 4.5 standard
    deviations from that."""
    out = np.zeros(len(series.steps), dtype=bool)
    loss = _loss_values(series, d)
    if loss is None or len(loss) <= window:
        return out
    with np.errstate(invalid="ignore"):
        diff = np.diff(loss)
        turns = np.r_[0, 0, (np.sign(diff[1:]) * np.sign(diff[:-1]) < 0).astype(np.int64)]
        c = np.cumsum(turns)
        windows = np.lib.stride_tricks.sliding_window_view(loss, window)
        lo, hi = np.min(windows, axis=1), np.max(windows, axis=1)
        # turns inside the window ending at i: at records i-window+2 .. i
        inside = c[window - 1 :] - np.r_[0, c[: len(loss) - window]] - turns[: len(loss) - window + 1]
        wide = np.isfinite(lo) & np.isfinite(hi) & (lo > 0) & (hi >= 10 * lo)
        out[window - 1 :] = wide & (inside >= 0.95 * (window - 2))
    return out


def _layer(tag: str) -> str:
    """The layer of a gradient's tag: its variable path without the last name."""
    return tag.rsplit("/", 1)[0]


def depth_pair(grads: Sequence[tuple[str, metadata.TensorInfo]]) -> tuple[str, str] | None:
    """The tags of the two gradients ``by_depth`` compares: the last layer's
    first kernel (rank 2 and more) and the first layer's, where the layer is
    the variable's path without its last name; None where there are no two
    such layers.

    Args:
      grads: (tag, info) of the gradients in backward order (the last layer's first).
    """
    kernels = [tag for tag, info in grads if info.shape is not None and len(info.shape) >= 2]
    if not kernels:
        return None
    others = [tag for tag in kernels if _layer(tag) != _layer(kernels[0])]
    return (kernels[0], others[-1]) if others else None


def by_depth(
    grads: Sequence[TensorSeries], steps: np.ndarray, vanishing: float, exploding: float, k: int
) -> dict[str, Any] | None:
    """The first layer's gradient norm against the last layer's at each step.

    ``grads`` are the gradient series in backward order (the last layer's
    first). The kernels (rank 2 and more) of two different layers are
    compared: the last layer's first kernel and the first layer's, where the
    layer is the variable's path without its last name. Returns None where
    there are no two such layers, else the first layer's series, the ratio
    at ``steps`` and the vanishing and exploding masks over those steps.
    """
    pair = depth_pair([(g.tag, g.info) for g in grads])
    if pair is None:
        return None
    by_tag = {g.tag: g for g in grads}
    last, first = by_tag[pair[0]], by_tag[pair[1]]

    def norm_at(s: TensorSeries) -> np.ndarray:
        out = np.full(len(steps), np.nan)
        j = np.searchsorted(s.steps, steps)
        ok = j < len(s.steps)
        ok[ok] = s.steps[j[ok]] == steps[ok]
        out[ok] = np.sqrt(s.values[j[ok], F["sum_sq"]].astype(np.float64))
        return out

    f, l = norm_at(first), norm_at(last)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = f / l
        van = sustained((ratio < vanishing) & (f < 1e-4), k)
        exp = sustained(ratio > exploding, k)
    return {"first": first, "last": last, "ratio": ratio, "first_norm": f, "last_norm": l,
            "vanishing": van, "exploding": exp}
