"""Evidence for a first anomaly's hint that lies in other tensors' records.

Part of the numpy-only analysis core: ``analysis`` gathers these for
``hints.choose``. Each function reads the run's series and answers one
question whose answer tells causes apart that a first anomaly alone does
not (issue 26):

* were the inputs unscaled: large at every batch, not one outlier;
* was the batch of a step an outlier, and did the gradient answer it far
  beyond what any polynomial path gives (an exp of an unbounded output);
* were a model's outputs beyond where a sigmoid or a softmax rounds to
  exactly 0 or 1 (a log of them is log(0));
* did an early update move the weights by more than their own size,
  while the inputs were in range (the learning rate);
* were the batch's targets or sample weights all 0 at the step, unlike
  the batches before (a mean over labelled samples divides 0 by 0);
* did the loss fall below 0 and on, to 10 times its first magnitude: a
  loss with no lower bound, which training lowers by growing the values;
* did an update make a variable non-finite from finite gradients: the
  optimizer's own arithmetic (a 0/0 where epsilon is 0), not the step's.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from tb_numerics import detectors, metadata
from tb_numerics.records import F, TensorSeries, derived, nonfinite_count

__all__ = ["Amplified", "DepthGrowth", "LargeUpdate", "Saturating", "Unbounded", "Unscaled", "UpdateMade",
           "amplified", "grew_by_depth", "large_update", "op_output", "saturating", "unbounded", "unscaled",
           "update_made", "zero_labels", "SATURATES_AT", "UNSCALED_RMS"]

# Inputs whose root mean square is at least this at every batch are in raw
# units: standardised data have an RMS of about 1, data in [0, 1] below 1.
UNSCALED_RMS = 10.0
# |x| beyond which float32's sigmoid rounds to exactly 1 (1 - 2**-24 is the
# largest float32 below 1, and exp(-17) is below 2**-24): log(1 - sigmoid(x))
# is then log(0). A softmax's largest probability rounds to 1 the same way.
SATURATES_AT = 17.0


@dataclasses.dataclass(frozen=True)
class Unscaled:
    """An input whose values were large at every batch up to the anomaly."""

    tag: str
    rms: float  # the smallest root mean square over those batches
    max_abs: float  # the largest max |x|
    batches: int


@dataclasses.dataclass(frozen=True)
class Amplified:
    """A batch far out of range at ``step``, and the gradient norm's jump there."""

    tag: str
    step: int
    input_factor: float  # max |x| against the median of the batches before it
    gradient_factor: float  # the global gradient norm against its median before
    exponential: bool  # the gradient grew beyond a polynomial of the input's growth


@dataclasses.dataclass(frozen=True)
class Saturating:
    """An output logged before the loss whose values a sigmoid or softmax rounds to 0 or 1."""

    tag: str
    step: int
    max_abs: float
    loss_function: str = ""  # the loss's function name, "" where unknown


@dataclasses.dataclass(frozen=True)
class DepthGrowth:
    """Layer-level tensors, consecutive in execution order, whose max |x| grew
    at each one at ``step``: a block that amplifies its input, repeated."""

    first: str
    last: str
    count: int
    first_max: float
    last_max: float


# A run of tensors that grew by depth: at least this many, each at least
# ``_DEPTH_STEP`` times the one before, ``_DEPTH_TOTAL`` times from the first
# to the last (a healthy network's activations keep their scale by design).
_DEPTH_RUN = 3
_DEPTH_STEP = 2.0
_DEPTH_TOTAL = 1e3


@dataclasses.dataclass(frozen=True)
class Unbounded:
    """A loss that fell below 0 and on, from ``first`` to ``last`` (its mean values)."""

    tag: str
    first_step: int
    first: float
    step: int
    last: float


@dataclasses.dataclass(frozen=True)
class LargeUpdate:
    """Layers whose update at ``step`` moved their weights by more than their own size."""

    step: int
    ratios: dict[str, float]  # layer -> ||w_new - w_old|| / ||w_old||


@dataclasses.dataclass(frozen=True)
class UpdateMade:
    """A variable the update of ``step`` made non-finite while its gradients there were finite."""

    step: int  # the step whose update it was
    nan: int  # the anomaly's own counts
    inf: int
    zeros: int  # exact zeros in the variable's gradients at ``step``
    count: int  # their values (0: no gradient of it recorded)
    optimizer: str  # its class where it squares the gradients (``TensorInfo.squared_by``), else ""
    # The largest |gradient| at ``step`` where its square is beyond its dtype's largest value, else 0.
    square_overflow: float = 0.0
    dtype: str = ""  # the gradients' dtype


def _inputs(series: Sequence[TensorSeries]) -> list[TensorSeries]:
    """The batch's float inputs and targets (the Keras callback's ``input``/``target``)."""
    return [s for s in series if s.info.role == "input" and not s.tag.startswith("sample_weight")]


def unscaled(series: Sequence[TensorSeries], step: int) -> Unscaled | None:
    """The input whose root mean square was at least ``UNSCALED_RMS`` at every
    batch up to ``step`` (at least one): data in raw units, not an outlier.
    Targets are left out: a regression's targets in their own units are usual."""
    for s in _inputs(series):
        if not s.tag.startswith("input"):
            continue
        at = s.steps <= step
        if not at.any():
            continue
        v = s.values[at].astype(np.float64)
        d = derived(v)
        with np.errstate(invalid="ignore", divide="ignore"):
            rms = np.sqrt(v[:, F["sum_sq"]] / np.maximum(d["finite"], 1))
        if np.all(rms >= UNSCALED_RMS):
            return Unscaled(s.tag, float(np.min(rms)), float(np.nanmax(d["max_abs"])), int(at.sum()))
    return None


def _factor_at(x: np.ndarray, i: int) -> float:
    """x[i] against the median of the finite values before it (NaN with fewer than 3)."""
    before = x[:i][np.isfinite(x[:i])]
    if len(before) < 3 or not np.isfinite(x[i]):
        return math.nan
    med = float(np.median(before))
    return float(x[i] / med) if med > 0 else math.nan


# A gradient that grew by more than the input's growth to this power grew
# faster than any path of products, squares and ReLUs gives (a squared error
# on a linear model gives the 2nd power): an exponential amplified the batch.
_POLYNOMIAL_DEGREE = 4.0
# A batch is an outlier when its max |x| is this many times the median of the
# batches before it.
_OUTLIER_FACTOR = 10.0


def amplified(series: Sequence[TensorSeries], step: int) -> Amplified | None:
    """The latest step at or before ``step`` whose input batch was an outlier (max |x|
    ``_OUTLIER_FACTOR`` × the median of the batches before), with the gradient's answer."""
    norms = [s for s in series if s.info.role == "global_norm"]
    for s in _inputs(series):
        mx = derived(s.values.astype(np.float64))["max_abs"]
        for i in np.flatnonzero(s.steps <= step)[::-1]:
            f = _factor_at(mx, int(i))
            if not f >= _OUTLIER_FACTOR:
                continue
            at = int(s.steps[i])
            g = math.nan
            if norms:
                j = np.flatnonzero(norms[0].steps == at)
                if j.size:
                    g = _factor_at(norms[0].values[:, F["max"]].astype(np.float64), int(j[0]))
            exponential = g > 1 and math.log(g) > _POLYNOMIAL_DEGREE * math.log(f)
            return Amplified(s.tag, at, f, g, bool(exponential))
    return None


def saturating(series: Sequence[TensorSeries], step: int) -> Saturating | None:
    """The model's output (the layer-level activation logged last before a loss)
    where that loss is not finite at ``step``, no layer-level tensor up to the
    output is (an output that overflowed made the loss's Inf itself), and the
    output held finite values beyond ``SATURATES_AT``: where
    it is a logit, its sigmoid or softmax is exactly 0 or 1 in float32, and a
    log of that is log(0). ``series`` in execution order."""
    layer = [s for s in series if not s.tag.startswith("ops/")]
    for k, loss in enumerate(layer):
        if loss.info.role != "loss" or not _nonfinite_at(loss, step):
            continue
        out = next((i for i in range(k - 1, -1, -1) if layer[i].info.role == "activation"), None)
        if out is None or any(_nonfinite_at(s, step) for s in layer[:out + 1]):
            return None
        v = layer[out].at_step(step)
        mx = derived(v)["max_abs"] if len(v) else np.zeros(0)
        if mx.size and np.max(mx) >= SATURATES_AT:
            return Saturating(layer[out].tag, step, float(np.max(mx)), loss.info.activation)
        return None
    return None


def grew_by_depth(series: Sequence[TensorSeries], step: int) -> DepthGrowth | None:
    """The longest run of layer-level activations, consecutive in execution
    order and all finite at ``step``, whose max |x| grew at least
    ``_DEPTH_STEP`` times at each and ``_DEPTH_TOTAL`` times in all; None
    where there is none. ``series`` in execution order."""
    acts = [s for s in series if s.info.role == "activation" and not s.tag.startswith("ops/")]
    tops: list[tuple[str, float]] = []
    for s in acts:
        v = s.at_step(step)  # a long run's compact series reads back that step's block alone
        d = derived(v)
        finite = len(v) and bool(np.all(d["finite"] == v[:, F["count"]]))
        tops.append((s.tag, float(np.max(d["max_abs"])) if finite else float("nan")))
    best: DepthGrowth | None = None
    start = 0
    for k in range(1, len(tops) + 1):
        if k < len(tops) and tops[k][1] >= _DEPTH_STEP * tops[k - 1][1] > 0:
            continue  # the run goes on (a NaN compares False and ends it)
        n = k - start
        if n >= _DEPTH_RUN and tops[k - 1][1] >= _DEPTH_TOTAL * tops[start][1]:
            if best is None or n > best.count:
                best = DepthGrowth(tops[start][0], tops[k - 1][0], n, tops[start][1], tops[k - 1][1])
        start = k
    return best


def _nonfinite_at(s: TensorSeries, step: int) -> bool:
    v = s.at_step(step)
    return bool(np.any(derived(v)["finite"] < v[:, F["count"]])) if len(v) else False


def large_update(series: Sequence[TensorSeries], step: int, ratio_max: float) -> LargeUpdate | None:
    """The first step at or before ``step`` where layers' update ratios
    (``update_ratio/<layer>``) were above ``ratio_max``, as the update-ratio
    warning keeps them (``detectors.update_ratio_kept``)."""
    ratios = [s for s in series if s.tag.startswith("update_ratio/")]
    with np.errstate(invalid="ignore"):
        marked = [s.values[:, F["max"]].astype(np.float64) > ratio_max for s in ratios]
    found: dict[int, dict[str, float]] = {}
    for s, keep in zip(ratios, detectors.update_ratio_kept(ratios, marked)):
        for i in np.flatnonzero(keep & (s.steps <= step)):
            found.setdefault(int(s.steps[i]), {})[s.tag.split("/", 1)[1]] = float(s.values[i, F["max"]])
    if not found:
        return None
    first = min(found)
    return LargeUpdate(first, found[first])


def op_output(series: Sequence[TensorSeries], op: dict | None, step: int) -> dict[str, int] | None:
    """The non-finite counts of an exact op's own record (``ops/<name>``) at
    ``step``: its first non-finite one where the op ran more than once in
    the step (a later run's NaN says nothing of what the first made)."""
    name = (op or {}).get("name")
    s = next((s for s in series if isinstance(name, str) and s.tag == "ops/" + name), None)
    v = s.at_step(step) if s is not None else []
    if not len(v):
        return None
    bad = np.flatnonzero(nonfinite_count(v) > 0)
    first = v[bad[0] if bad.size else 0]
    return {k: int(first[F[k]]) for k in ("nan", "posinf", "neginf", "count")}


def zero_labels(series: Sequence[TensorSeries], step: int) -> str | None:
    """The target or sample-weight tag that was all exact zeros at ``step``
    and at no batch before it: a batch with nothing labelled."""
    for s in series:
        if s.info.role != "input" or not s.tag.startswith(("target", "sample_weight")):
            continue
        v = s.values.astype(np.float64)
        empty = (v[:, F["zeros"]] == v[:, F["count"]]) & (v[:, F["count"]] > 0)
        now, before = empty[s.steps == step], empty[s.steps < step]
        if now.size and now.all() and before.size and not before.any():
            return s.tag
    return None


def unbounded(series: Sequence[TensorSeries], step: int) -> Unbounded | None:
    """The loss whose lowest finite record before ``step`` was below 0 and at least 10
    times the magnitude of its first: training kept lowering a loss with no lower bound."""
    for s in series:
        v = s.values[s.steps < step].astype(np.float64) if s.info.role == "loss" else np.zeros((0, 1))
        if len(v) < 2:
            continue
        d = derived(v)
        mean = np.where(d["finite"] == v[:, F["count"]], d["mean"], np.nan)
        ok = np.flatnonzero(np.isfinite(mean))
        if len(ok) < 2:
            continue
        low = ok[np.argmin(mean[ok])]
        if mean[low] < 0 and abs(mean[low]) >= 10 * abs(mean[ok[0]]):
            return Unbounded(s.tag, int(s.steps[ok[0]]), float(mean[ok[0]]), int(s.steps[low]), float(mean[low]))
    return None


def update_made(series: Sequence[TensorSeries], anomaly: TensorSeries, step: int) -> UpdateMade | None:
    """Where the first anomaly (``anomaly`` at ``step``) is a variable an
    update made non-finite (phase ``update``: a variable as the update of
    ``step`` left it, ``update/<path>``; its layer's update ratio,
    ``update_ratio/<layer>``; or a weight as ``step`` began, made by the
    update of the step before), and that update's gradients of it were
    finite where recorded: the optimizer made the value, not the step."""
    if anomaly.info.phase != "update":
        return None
    tag = anomaly.tag
    if tag.startswith("update_ratio/"):
        layer = tag.split("/", 1)[1]
        grads = [s for s in series if s.info.role == "gradient" and layer in s.tag.split("/")[1:-1]]
    else:
        path = tag[len("update/"):] if tag.startswith("update/") else tag
        grads = [s for s in series if s.info.role == "gradient" and s.tag == "gradients/" + path]
        if not grads:  # an optimizer's slot of a variable: <optimizer>/<its path, "/" as "_">_<slot> in Keras
            slot = path.split("/", 1)[-1]
            of = [s for s in series if s.info.role == "gradient"
                  and slot.startswith(s.tag[len("gradients/"):].replace("/", "_") + "_")]
            grads = sorted(of, key=lambda s: -len(s.tag))[:1]
    at = step
    if anomaly.info.role == "weight" and not tag.startswith("update_ratio/"):  # as the step began
        before = [int(s.steps[s.steps < step].max()) for s in grads if (s.steps < step).any()]
        if not before:
            return None
        at = max(before)
    if any(_nonfinite_at(s, at) for s in grads):
        return None  # the gradients carried it in
    rows = [r for r in (s.at_step(at) for s in grads) if len(r)]
    own = anomaly.at_step(step)
    own = own[np.flatnonzero(nonfinite_count(own) > 0)[:1]] if len(own) else own
    if not len(own):
        return None
    zeros = int(sum(r[:, F["zeros"]].sum() for r in rows))
    count = int(sum(r[:, F["count"]].sum() for r in rows))
    optimizer = next((s.info.squared_by for s in grads if s.info.squared_by), "")
    dtype = next((s.info.dtype for s in grads if s.info.dtype in metadata.DTYPE_LIMITS), "")
    big = max((float(np.abs(r[:, [F["min"], F["max"]]]).max()) for r in rows), default=0.0)
    overflow = big if dtype and math.isfinite(big) and big * big > metadata.DTYPE_LIMITS[dtype][0] else 0.0
    return UpdateMade(at, int(own[0, F["nan"]]), int(own[0, F["posinf"]] + own[0, F["neginf"]]), zeros, count,
                      optimizer, overflow, dtype)
