"""Run against run: where a run's records first leave a reference run's band.

A user whose training went bad reruns it (a smaller learning rate, a fix)
and compares the two by eye. This module does it for every tensor the two
runs logged under the same tag: at each step both runs recorded, it asks
whether the run's record lies inside the *band* of the reference's records
at the steps around it, and answers with the first step, and within it the
first tensor in execution order, where it does not, and why.

The band of a step is the reference's records from ``window`` records
before it to ``window`` after it (runs are never equal record for record:
another seed, another batch order), widened by a tolerance:

* max |x| and the L2 norm: within ``factor`` times the window's highest and
  ``1/factor`` times its lowest (growth and collapse both leave it);
* the share of exact zeros: within ``zero_share`` of the window's lowest and
  highest share (units dying, a mask gone);
* non-finite values: any NaN or Inf where the window has none.

Op-level records (``ops/...``, written for one replayed step) and the
verdicts' tags are not compared. Numpy only: the HTTP route and
``tb-numerics report --against RUN`` call the same ``compare_runs``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np

from tb_numerics import metadata
from tb_numerics.records import F, TensorSeries, derived, nonfinite_count

__all__ = ["Band", "BandError", "compare_runs", "parse_band"]

_OP_PREFIX = "ops/"


class BandError(ValueError):
    """A band parameter that is not valid; the message names it."""


@dataclasses.dataclass(frozen=True)
class Band:
    """How far a run may stray from its reference before it has left it.

    Args:
      factor: max |x| and the L2 norm may be up to this many times the
        window's highest, and down to its lowest divided by it (> 1).
      zero_share: the share of exact zeros may differ by this much from the
        window's range (0 to 1).
      window: records of the reference on each side of a step (0 to 1000).
    """

    factor: float = 4.0
    zero_share: float = 0.25
    window: int = 5


# name: (type, help) of each band parameter; the route's query parameters
# and, with dashes, the CLI's flags.
BAND_PARAMS = {
    "factor": (float, "max |x| and the L2 norm leave the band beyond this factor of the reference's (default 4)"),
    "zero_share": (float, "the share of exact zeros leaves the band beyond this difference (default 0.25)"),
    "window": (int, "records of the reference on each side of a step that make its band (default 5)"),
}


def parse_band(params: Mapping[str, Any]) -> Band:
    """A Band from strings by name (absent or empty: the default).

    Raises:
      BandError: a value is not a number, or out of its range; the message
        starts with the parameter's name.
    """
    values = {}
    for name, (kind, _) in BAND_PARAMS.items():
        raw = params.get(name)
        if raw is None or raw == "":
            continue
        try:
            values[name] = kind(str(raw).strip())
        except ValueError:
            raise BandError("%s must be a %s, got %r" % (
                name, "whole number" if kind is int else "number", str(raw)[:100])) from None
    band = Band(**values)
    if not (band.factor > 1 and np.isfinite(band.factor)):
        raise BandError("factor must be a number above 1, got %r" % band.factor)
    if not 0 <= band.zero_share <= 1:
        raise BandError("zero_share must be in [0, 1], got %r" % band.zero_share)
    if not 0 <= band.window <= 1000:
        raise BandError("window must be a whole number from 0 to 1000, got %r" % band.window)
    return band


@dataclasses.dataclass
class _PerStep:
    """One tensor's records reduced to one row per step (the worst occurrence)."""

    steps: np.ndarray
    max_abs: np.ndarray
    l2: np.ndarray
    zero_share: np.ndarray
    bad: np.ndarray  # NaN + Inf count
    count: np.ndarray


def _per_step(s: TensorSeries) -> _PerStep:
    v = s.values.astype(np.float64, copy=False)
    d = derived(v)
    # Steps are sorted (TensorSeries): each step's first record, without a sort.
    first = np.flatnonzero(np.r_[True, s.steps[1:] != s.steps[:-1]]) if len(s.steps) else np.zeros(0, np.int64)
    steps = s.steps[first]
    with np.errstate(invalid="ignore", divide="ignore"):
        share = np.where(v[:, F["count"]] > 0, v[:, F["zeros"]] / np.maximum(v[:, F["count"]], 1), 0.0)
    bad = nonfinite_count(v, s.info.neginf_ok)
    reduce = lambda x, f: f.reduceat(x, first) if len(first) else x[:0]  # noqa: E731
    return _PerStep(steps, reduce(d["max_abs"], np.fmax), reduce(d["l2"], np.fmax), reduce(share, np.fmax),
                    reduce(bad, np.add), reduce(v[:, F["count"]], np.fmax))


def _window(x: np.ndarray, w: int, fn) -> np.ndarray:
    """fn (np.fmax or np.fmin: NaN ignored) of x over each index's ±w neighbours.

    2w passes of one vector operation: a sliding window's nanmax over 100,000
    records x 50 tensors took 16 s here, these passes a fraction of it.
    """
    n = len(x)
    pad = np.concatenate([np.full(w, np.nan), x.astype(np.float64, copy=False), np.full(w, np.nan)])
    out = pad[:n].copy()
    for k in range(1, 2 * w + 1):
        fn(out, pad[k : k + n], out=out)
    return out


def _first_departure(run: _PerStep, ref: _PerStep, band: Band, until: int | None) -> dict[str, Any] | None:
    """The first common step (up to ``until``) where ``run`` leaves ``ref``'s band, and why."""
    common, i_run, i_ref = np.intersect1d(run.steps, ref.steps, assume_unique=True, return_indices=True)
    if until is not None:  # a tensor earlier in execution order already left it at that step
        keep = common <= until
        common, i_run, i_ref = common[keep], i_run[keep], i_ref[keep]
    if not len(common):
        return None
    w = band.window
    ref_bad = _window(ref.bad, w, np.fmax)[i_ref]
    checks = []
    bad = run.bad[i_run]
    checks.append(("nonfinite", (bad > 0) & ~(ref_bad > 0), bad, np.zeros_like(bad), np.zeros_like(bad)))
    for name in ("max_abs", "l2"):
        hi = _window(getattr(ref, name), w, np.fmax)[i_ref]
        lo = _window(getattr(ref, name), w, np.fmin)[i_ref]
        x = getattr(run, name)[i_run]
        with np.errstate(invalid="ignore"):
            out = (bad == 0) & np.isfinite(hi) & ((x > hi * band.factor) | (x < lo / band.factor))
        checks.append((name, out, x, lo, hi))
    hi = _window(ref.zero_share, w, np.fmax)[i_ref]
    lo = _window(ref.zero_share, w, np.fmin)[i_ref]
    x = run.zero_share[i_run]
    with np.errstate(invalid="ignore"):
        out = (bad == 0) & ((x > hi + band.zero_share) | (x < lo - band.zero_share))
    checks.append(("zero_share", out, x, lo, hi))
    firsts = [(int(np.argmax(mask)), k) for k, (_, mask, *_rest) in enumerate(checks) if mask.any()]
    if not firsts:
        return None
    j, k = min(firsts)
    name, _, x, lo, hi = checks[k]
    step_lo = int(ref.steps[max(0, i_ref[j] - w)])
    step_hi = int(ref.steps[min(len(ref.steps) - 1, i_ref[j] + w)])
    return {"step": int(common[j]), "statistic": name, "value": float(x[j]),
            "band": [float(lo[j]), float(hi[j])], "reference_steps": [step_lo, step_hi],
            "count": int(run.count[i_run[j]])}


def _detail(d: dict[str, Any], band: Band) -> str:
    """A departure in words, with its numbers."""
    steps = "steps %d to %d" % tuple(d["reference_steps"])
    lo, hi = d["band"]
    if d["statistic"] == "nonfinite":
        return "%d NaN/Inf of %d values, where the reference has none in %s" % (d["value"], d["count"], steps)
    if d["statistic"] == "zero_share":
        return "%.0f%% of the values exactly 0, against %.0f%% to %.0f%% in the reference (%s; band ±%g)" % (
            100 * d["value"], 100 * lo, 100 * hi, 100 * band.zero_share, steps)
    word = "max |x|" if d["statistic"] == "max_abs" else "L2 norm"
    ratio = d["value"] / hi if d["value"] > hi else (lo / d["value"] if d["value"] > 0 else float("inf"))
    return "%s %.4g, %.3g× %s the reference's %.4g to %.4g in %s (band: ×%g)" % (
        word, d["value"], ratio, "above" if d["value"] > hi else "below", lo, hi, steps, band.factor)


def _comparable(series: Sequence[TensorSeries]) -> dict[str, TensorSeries]:
    return {s.tag: s for s in series
            if s.tag not in metadata.VERDICT_TAGS and not s.tag.startswith(_OP_PREFIX) and len(s.steps)}


def compare_runs(run: Sequence[TensorSeries], reference: Sequence[TensorSeries], band: Band | None = None) -> dict[str, Any]:
    """Where ``run`` first leaves ``reference``'s band (see the module's docstring).

    Args:
      run: the run's series.
      reference: the reference run's series.
      band: the tolerances (default ``Band()``).

    Returns:
      ``first_departure`` (``{"step", "tensor", "phase", "role", "statistic",
      "value", "band", "reference_steps", "detail"}``, or None where the run
      stays in the band at every step both hold), ``tensors_compared``,
      ``steps_compared`` ([first, last] common step, or None), ``only_in_run``
      and ``only_in_reference`` (tags), and ``band`` (the tolerances).
    """
    band = band or Band()
    mine, theirs = _comparable(run), _comparable(reference)
    shared = sorted(set(mine) & set(theirs), key=lambda t: mine[t].sort_key)
    best, lo, hi = None, None, None
    for order, tag in enumerate(shared):
        a, b = _per_step(mine[tag]), _per_step(theirs[tag])
        common = np.intersect1d(a.steps, b.steps, assume_unique=True)
        if len(common):
            lo = int(common[0]) if lo is None else min(lo, int(common[0]))
            hi = int(common[-1]) if hi is None else max(hi, int(common[-1]))
        d = _first_departure(a, b, band, None if best is None else best["step"])
        if d is not None and (best is None or (d["step"], order) < (best["step"], best["order"])):
            info = mine[tag].info
            best = dict(d, tensor=tag, phase=info.phase, role=info.role, order=order)
    if best is not None:
        best.pop("order")
        best["detail"] = _detail(best, band)
    return {
        "first_departure": best,
        "tensors_compared": len(shared),
        "steps_compared": None if lo is None else [lo, hi],
        "only_in_run": sorted(set(mine) - set(theirs)),
        "only_in_reference": sorted(set(theirs) - set(mine)),
        "band": dataclasses.asdict(band),
    }
