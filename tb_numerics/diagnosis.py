"""Diagnosis: a run's first anomaly, first warning and likely cause, in words and numbers.

The JSON of ``tb-numerics report --json`` and the HTTP API's ``/summary``
(``run_summary``): each warning with its kind's detail and hint (from the
rules core, ``rules.kinds``), the first anomaly with the exact op where one
is known, the last healthy step, the likely cause and a hint chosen from
the evidence (``hints``). Numpy only, no TensorFlow.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tb_numerics import evidence, hints, rules
from tb_numerics.health import SeriesHealth
from tb_numerics.records import F, TensorSeries, derived
from tb_numerics.run_analysis import OP_TAG_PREFIX, RunAnalysis, first_cell, is_op_level, marked_cell, skipped_steps

__all__ = [
    "first_anomaly", "first_warning", "info_events", "likely_cause", "run_summary", "warnings_by_tensor",
]

# An op-level description: the op's source line, then, for a gradient op,
# which forward op it differentiates.
_GRADIENT_OF = ", gradient of "


def _warning_json(ra: RunAnalysis, cell) -> dict[str, Any]:
    """The warning at ``cell`` (step, row, record index): its kind, detail and hint."""
    step, row, i = cell
    h = ra.health[row]
    k = rules.KINDS[h.kinds[i] - 1]
    return {
        "step": step,
        "tensor": h.series.tag,
        "kind": k.name,
        "detail": k.detail(ra.health, row, i, k.parameters(ra.safe_range)),
        "hint": k.hint,
        "phase": h.series.info.phase,
        "role": h.series.info.role,
        "op_type": h.series.info.op_type or None,
        "row": row,
    }


def _info_codes() -> list[int]:
    """The codes of the kinds that are information, not warnings."""
    return [rules.kind_code(k) for k in rules.INFO_KINDS]


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
                # Ran on the same weights and batch and stayed finite: a transient fault.
                transient = {"reproducible": False} if verdict.get("reproducible") is False else {}
                return None, {"reproduced": False, "why": str(verdict.get("why", "")), **transient, **where}
            op = verdict.get("op")
            # Replayed with the loss scale at 1: no loss scale makes or handles it.
            unscaled = {"unscaled": True} if verdict.get("unscaled") is True else {}
            if isinstance(op, dict):
                return {k: op.get(k) for k in ("name", "type", "source", "phase", "inputs")}, {
                    "reproduced": True, **unscaled, **where}
    for h in ra.health:  # in execution order: the first op that went bad at that step
        if is_op_level(h.series.tag) and np.any((h.series.steps == step) & (h.codes == rules.NONFINITE)):
            return _op_json(h), None
    return None, None


def first_anomaly(ra: RunAnalysis) -> dict[str, Any] | None:
    """The first non-finite record of the run, in words and numbers."""
    layer = _layer_rows(ra)
    cell = first_cell(ra, rules.NONFINITE, rows=layer)
    if cell is None and layer is not None:
        # Only an op went bad (inside a layer whose records stayed finite): the op is the anomaly.
        cell = first_cell(ra, rules.NONFINITE)
    if cell is None:
        return None
    cell = marked_cell(ra, cell)
    step, row, i = cell
    h = ra.health[row]
    v = h.series.record(i)
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
        "description": rules.describe_nonfinite(v),
        # The tag was logged more than once in that step: which record it was.
        "occurrence": {"index": index, "of": of} if of > 1 else None,
        # The last step with neither an anomaly nor a warning in this tensor,
        # and the last step whose records were merely finite.
        "last_healthy_step": _last_step_where(h, i, h.codes == rules.HEALTHY),
        "last_finite_step": _last_step_where(h, i, h.codes != rules.NONFINITE),
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
    own = np.flatnonzero((h.codes[:i] == rules.WARNING) & ~np.isin(h.kinds[:i], _info_codes()))
    for j in own[::-1]:  # the latest warning of each kind
        before.setdefault(rules.KIND_NAMES[h.kinds[j] - 1], _warning_json(ra, (int(h.series.steps[j]), row, int(j))))
    if cause is not None:
        before[cause["kind"]] = cause
    every = [g.series for g in ra.health]
    return hints.Evidence(h.series.tag, h.series.info, step, before, _loss_input(ra, row, step), op,
                          negative_loss=_negative_loss(ra, step), batch=_batch_fault(ra, cell, cause),
                          unscaled=evidence.unscaled(every, step), amplified=evidence.amplified(every, step),
                          saturating=evidence.saturating(every, step),
                          large_update=evidence.large_update(every, step, ra.safe_range.update_ratio_max),
                          op_output=_verdict_output(ra, op, step) or evidence.op_output(every, op, step),
                          zero_labels=evidence.zero_labels(every, step),
                          unbounded=evidence.unbounded(every, step),
                          depth_growth=evidence.grew_by_depth(every, step),
                          update_made=evidence.update_made(every, h.series, step))


def _verdict_output(ra: RunAnalysis, op: dict[str, Any] | None, step: int) -> dict[str, Any] | None:
    """The non-finite counts of ``op`` (the first anomaly's) as the replay's
    verdict on ``step`` that named it gives them: those of the very run of
    the op that went bad first, where the op-level records hold each run of
    it in the step (a Cast of every layer's inputs), and the JAX and PyTorch
    replays write none; as ``evidence.op_output``, by the op's name."""
    name = (op or {}).get("name")
    for verdict in ra.replays:
        found = verdict.get("op")
        if (verdict["step"] == step and verdict["reproduced"] and isinstance(found, dict) and isinstance(name, str)
                and found.get("name") == name):
            return {k: found.get(k) for k in ("nan", "posinf", "neginf")} | {"count": found.get("size")}
    return None


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
        tag, at, what = h.series.tag, step, rules.describe_nonfinite(h.series.record(i))
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
        v = s.record(int(at[-1]))
        first = s.record(0)
        with np.errstate(invalid="ignore"):
            return hints.LossInput(
                tag=s.tag,
                zeros=int(v[F["zeros"]]),
                negatives=bool(v[F["min"]] < 0),
                count=int(v[F["count"]]),
                first_zero_share=float(first[F["zeros"]] / max(first[F["count"]], 1)),
                first_step=int(s.steps[0]),
                harmless_zero_share=_harmless_zero_share(ra.health[row], s, step),
            )
    return None


# Records before the anomaly that ``_harmless_zero_share`` reads (a long
# run's records are read back from its blocks).
_ZEROS_LOOKBACK = 256


def _harmless_zero_share(loss: SeriesHealth, source: TensorSeries, step: int) -> float:
    """The largest share of exact zeros ``source`` held at a step before
    ``step`` (its first and its last ``_ZEROS_LOOKBACK`` records) where every
    record of the loss was finite."""
    ls = loss.series
    fine = np.setdiff1d(ls.steps[ls.steps < step], ls.steps[loss.codes == rules.NONFINITE])
    hi = int(np.searchsorted(source.steps, step, side="left"))
    lo = max(0, hi - _ZEROS_LOOKBACK)
    v = np.concatenate([source.records(0, min(1, lo)), source.records(lo, hi)]).astype(np.float64)
    steps = np.concatenate([source.steps[:min(1, lo)], source.steps[lo:hi]])
    v = v[np.isin(steps, fine)]
    return float(np.max(v[:, F["zeros"]] / np.maximum(v[:, F["count"]], 1))) if len(v) else 0.0


def likely_cause(ra: RunAnalysis, anomaly_cell) -> dict[str, Any] | None:
    """The warning that most likely led to the anomaly at ``anomaly_cell``.

    A tensor earlier in the same step that is already out of the safe range
    (e.g. an input holding 1e38) comes first; otherwise a warning in the
    steps just before (growth, overflow risk, a gradient spike).
    """
    step, row, _ = anomaly_cell
    info_codes = _info_codes()
    for r in range(row):
        h = ra.health[r]
        at = np.flatnonzero((h.series.steps == step) & (h.codes == rules.WARNING) & ~np.isin(h.kinds, info_codes))
        if at.size:
            return _warning_json(ra, (step, r, int(at[0])))
    # The latest warning of any tensor in the records just before.
    best = None
    for r, h in enumerate(ra.health):
        idx = np.flatnonzero((h.codes == rules.WARNING) & (h.series.steps < step) & ~np.isin(h.kinds, info_codes))
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
    anomaly = first_cell(ra, rules.NONFINITE)
    before = None if anomaly is None else (anomaly[0], anomaly[1])
    cell = first_cell(ra, rules.WARNING, before=before, skip_kinds=rules.INFO_KINDS)
    return None if cell is None else _warning_json(ra, cell)


def info_events(ra: RunAnalysis) -> list[dict[str, Any]]:
    """Handled events worth knowing (each skipped step, first tensor of it)."""
    out = []
    for kind in sorted(rules.INFO_KINDS):
        code = rules.kind_code(kind)
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
    info_codes = _info_codes()
    for row, h in enumerate(ra.health):
        for code in np.unique(h.kinds[(h.codes == rules.WARNING) & ~np.isin(h.kinds, info_codes)]):
            idx = np.flatnonzero((h.kinds == code) & (h.codes == rules.WARNING))
            entry = _warning_json(ra, (int(h.series.steps[idx[0]]), row, int(idx[0])))
            entry.update(first_step=entry["step"], last_step=int(h.series.steps[idx[-1]]), records=int(idx.size))
            out.append(entry)
    return sorted(out, key=lambda e: (e["first_step"], e["row"]))


# What a first look (the records of one step, before the run is read whole)
# says of the first anomaly: what that step's records hold. The rest (the
# last healthy step, the likely cause, the hint, its timeline row) needs the
# run's history, and is null until the run has been read.
_FIRST_LOOK_FIELDS = ("step", "tensor", "op_type", "tensor_description", "phase", "role", "nan", "posinf",
                      "neginf", "size", "description", "occurrence", "op", "replay")


def first_look_summary(ra: RunAnalysis) -> dict[str, Any]:
    """``run_summary`` of a first look's analysis (``run_store``'s
    preliminary answer): its first anomaly's own fields, every field that
    needs the whole run null (its warnings none yet, not none found)."""
    summary = run_summary(ra)
    anomaly = summary["first_anomaly"]
    return {**summary,
            "first_anomaly": anomaly and {k: v if k in _FIRST_LOOK_FIELDS else None for k, v in anomaly.items()},
            "first_warning": None, "info": [], "warnings": [], "tensors": None, "records": None,
            "first_step": None, "last_step": None, "skipped_steps": []}


def run_summary(ra: RunAnalysis) -> dict[str, Any]:
    """The per-run summary shared by the CLI's JSON and the HTTP API
    (computed once per analysis: a long run's takes a second; a new dict
    each call, for the caller to add to)."""
    if "summary" not in ra.memo:
        ra.memo["summary"] = _run_summary(ra)
    return dict(ra.memo["summary"])


def _run_summary(ra: RunAnalysis) -> dict[str, Any]:
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


