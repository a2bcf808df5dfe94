"""Run analysis: every series of a run classified, in execution order, and its first cells.

``analyze_run`` applies the rules (``health``) to each series of a run and
reads the verdicts its writers left (replays, bad batches, op marks);
``first_cell`` finds the first record of a health. "First" means the
earliest step; within a step, the earliest tensor in execution order: the
input batch before forward before backward before the update, then the
order the writer recorded, then the tag. The words for what is found are
``diagnosis``'s. Numpy only, no TensorFlow.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from tb_numerics import metadata, rules
from tb_numerics.health import SeriesHealth, mark_run, series_health
from tb_numerics.records import TensorSeries, union_steps
from tb_numerics.safe_range import SafeRange

__all__ = ["OP_TAG_PREFIX", "RunAnalysis", "analyze_run", "first_cell", "is_op_level", "marked_cell", "skipped_steps"]

OP_TAG_PREFIX = "ops/"

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
    # What was derived from the analysis once (``diagnosis.run_summary``), by name.
    memo: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def find(self, tag: str) -> SeriesHealth | None:
        """The row of ``tag``, or None."""
        for h in self.health:
            if h.series.tag == tag:
                return h
        return None

    @functools.cached_property
    def steps(self) -> np.ndarray:
        """Every step at which any tensor of the run was recorded (computed once)."""
        return union_steps([h.series for h in self.health])


def analyze_run(
    run: str,
    series: Iterable[TensorSeries],
    sr: SafeRange | None = None,
    problems: Sequence[str] = (),
) -> RunAnalysis:
    """Classifies every series of a run and orders them by execution order.

    Args:
      run: the run's name.
      series: its records, one series per tag (verdict tags included).
      sr: the safe range (default: the defaults).
      problems: what went wrong reading the run, reported with it.
    """
    sr = sr or SafeRange()
    series = list(series)
    problems = list(problems)
    replays = _verdicts(series, metadata.REPLAY_TAG, _replay_verdict, problems)
    batches = _verdicts(series, metadata.BATCH_TAG, _batch_verdict, problems)
    marks = _verdicts(series, metadata.OP_MARK_TAG, _op_mark, problems)
    ordered = sorted((s for s in series if s.tag not in metadata.VERDICT_TAGS), key=lambda s: s.sort_key)
    health = _each_health(ordered, sr)
    # A step whose gradients a replay found non-finite with the loss scale
    # at 1 (a sqrt or a division at 0): no skip that loss scaling handles.
    mark_run(health, sr, [r["step"] for r in replays if r.get("unscaled") is True and r["reproduced"]])
    return RunAnalysis(run, health, sr, problems, replays, batches, marks)


def _verdicts(series: list[TensorSeries], tag: str, read: Callable[[TensorSeries, Any], dict[str, Any] | None],
              problems: list[str]) -> list[dict[str, Any]]:
    """The verdicts of ``tag``'s records, each read by ``read`` from its
    description's JSON (untrusted: ``metadata.parse_json`` refuses what
    would crash the code that reads it); one that cannot be read is said in
    ``problems`` and left out, and the run is analysed without it."""
    out = []
    for s in series:
        if s.tag != tag:
            continue
        try:
            verdict = read(s, metadata.parse_json(s.info.description, "its verdict"))
        except metadata.FormatError as e:
            problems.append("%s: %s; ignored" % (tag, e))
            continue
        if verdict is None:
            problems.append("%s: its verdict is not one this version reads; ignored" % tag)
        else:
            out.append(verdict)
    return out


# A run of more records than this is classified on two threads: numpy's
# passes over each series release the GIL, so a long run's analysis takes
# both cores (50 M records: 4.7 s on one thread).
_PARALLEL_RECORDS = 2_000_000


def _each_health(ordered: list[TensorSeries], sr: SafeRange) -> list[SeriesHealth]:
    """``series_health`` of each series, in order."""
    if sum(len(s.steps) for s in ordered) < _PARALLEL_RECORDS:
        return [series_health(s, sr) for s in ordered]
    with concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="numerics-rules") as pool:
        return list(pool.map(functools.partial(series_health, sr=sr), ordered))


def _replay_verdict(s: TensorSeries, verdict: Any) -> dict[str, Any] | None:
    """A replay's verdict, from its record's description's JSON."""
    if not isinstance(verdict, dict) or not isinstance(verdict.get("step"), int):
        return None
    if not isinstance(verdict.get("reproduced"), bool):
        return None
    return verdict


def _batch_verdict(s: TensorSeries, found: Any) -> dict[str, Any] | None:
    """Where a bad batch held its bad values, from its record's description's
    JSON: {"step", "tensors": [{"tensor", ...}]}."""
    if not isinstance(found, dict) or type(found.get("step")) is not int or not isinstance(found.get("tensors"), list):
        return None
    return found


def _op_mark(s: TensorSeries, mark: Any) -> dict[str, Any] | None:
    """The op an op-level block marked as the first to go bad, at the step
    of its record, from the record's description's JSON."""
    if not isinstance(mark, dict) or not isinstance(mark.get("tag"), str) or not s.steps.size:
        return None
    occurrence = mark.get("occurrence")
    if not (isinstance(occurrence, list) and occurrence and type(occurrence[0]) is int):
        return None
    return {**mark, "step": int(s.steps[0])}


def marked_cell(ra: RunAnalysis, cell: tuple[int, int, int]) -> tuple[int, int, int]:
    """The first anomaly's cell, moved to the op record its step's mark names
    where the anomaly is an op's: which of a step's op records went bad first
    is known there only (a loop's iterations), not from the tags' order.

    Args:
      ra: the run.
      cell: (step, row, record index) of its first non-finite record.
    """
    step, row, _ = cell
    if not is_op_level(ra.health[row].series.tag):
        return cell
    for mark in ra.op_marks:
        if mark["step"] != step:
            continue
        for r, h in enumerate(ra.health):
            at = np.flatnonzero(h.series.steps == step) if h.series.tag == mark["tag"] else ()
            k = mark["occurrence"][0] - 1
            if 0 <= k < len(at) and h.codes[at[k]] == rules.NONFINITE:
                return step, r, int(at[k])
    return cell


def is_op_level(tag: str) -> bool:
    """Whether a tag is an op-level record (``op_numerics``, or a replay's)."""
    return tag.startswith(OP_TAG_PREFIX)


def skipped_steps(ra: RunAnalysis) -> list[int]:
    """The steps a LossScaleOptimizer skipped with the scale handling it."""
    code = rules.kind_code("skipped_step")
    steps = [h.series.steps[h.kinds == code] for h in ra.health]
    return np.unique(np.concatenate(steps)).astype(int).tolist() if steps else []


def first_cell(ra: RunAnalysis, code: int, before: tuple[int, int] | None = None, skip_kinds=frozenset(),
               rows: Iterable[int] | None = None) -> tuple[int, int, int] | None:
    """(step, row index, record index) of the first record with health ``code``.

    Args:
      ra: the run.
      code: a health code (``rules.NONFINITE``, ``rules.WARNING``).
      before: (step, row): only records before it, in that order.
      skip_kinds: warning kinds left out.
      rows: the rows to look in (default: all).
    """
    skip_codes = [rules.kind_code(k) for k in skip_kinds]
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
