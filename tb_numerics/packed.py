"""Packed blocks: many numerics records in one event.

Why: TensorBoard stores and decodes each event of a tensor series on its
own, at a cost of about a kilobyte of memory and tens of microseconds per
event whatever its size, and moves every byte through gRPC on each read. One
event per tensor per step makes a run of 100,000 steps x 50 tensors five
million events: a minute to read and gigabytes of memory. Packed, each event
holds up to ``STEPS_PER_EVENT`` steps of every tensor.

Layout: a writer's records go to block tags ``__numerics_block__/<writer
id>/<sequence>``. Each event of a block is a ``[n, COLUMNS]`` tensor whose
rows are a tensor's index in the block's table, the step, then its record
(format version 3; version 2's events held one step, the event's, and no
step column). The table, (tag, ``TensorInfo``) per index, is the block's
summary metadata, which TensorBoard keeps from the block's first event; so a
writer starts a new block when a step brings a tensor the table lacks, and
every ``STEPS_PER_BLOCK`` steps, so that a growing run re-reads only its last
block and no read comes near gRPC's message cap. Every later event of a
block carries the table too, compressed (``create_block_metadata(...,
compact=True)``): a damaged first event then costs its own steps, not the
block's, as TensorBoard and the CLI take the table from the first event they
can read. Measured on a 50-tensor float32 run (``bench/backend._tensors``),
2,000 steps, 50 steps an event: 52.2 bytes a record on disk without the
copy, 52.3 with it (426 bytes of compressed table an event; the table in
full is 6,227). With one step an event (steps slower than ``MAX_DELAY_S``):
54.4 and 63.3 (uncompressed, the copy would make it 180).

An event is float32 when every value in it is exactly a float32 (the usual
case: the statistics of float16/bfloat16/float32 tensors are accumulated in
float32, and counts and steps below 2**24 are exact), else float64: half the
bytes to store, hold and read, and nothing rounded.

When an event is written: once it holds ``STEPS_PER_EVENT`` steps, at once
for a step with a NaN or an infinity (so the first bad step is on disk
before anything else can go wrong), when its oldest step has waited
``MAX_DELAY_S`` when the next one comes, and on the writer's flush and close.
A crash can lose the steps still waiting, as with TensorFlow's own summary
writer, never a written one.

Numpy and TensorBoard protos only, no TensorFlow: writers, the backend and
the CLI share it.
"""

from __future__ import annotations

import math
import os
import time
from typing import Callable, Iterable, NamedTuple, Sequence

import numpy as np
from tensorboard.compat.proto import summary_pb2, types_pb2
from tensorboard.util import tensor_util

from tb_numerics import metadata, records
from tb_numerics.records import nonfinite_count

TAG_PREFIX = "__numerics_block__/"
STEPS_PER_BLOCK = 1000
STEPS_PER_EVENT = 50
MAX_DELAY_S = 2.0
COLUMNS = 2 + metadata.NUM_FIELDS
# Version 2's events: no step column.
_V2_COLUMNS = 1 + metadata.NUM_FIELDS
# How many tensors a problem line names.
_MAX_TAGS_NAMED = 5


def is_block_tag(tag: str) -> bool:
    return tag.startswith(TAG_PREFIX)


def repeat_tag(writer_id: str, order: int) -> str:
    """The block of one tensor's records beyond the first of a step (a
    writer's ``_tag_writer``): its rows hold their steps, its events'
    steps count its events, so its last event's step is no training step."""
    return "%s%s/repeat/%06d" % (TAG_PREFIX, writer_id, order)


def is_repeat_tag(tag: str) -> bool:
    """Whether ``tag`` is a ``repeat_tag``."""
    parts = tag[len(TAG_PREFIX):].split("/") if is_block_tag(tag) else []
    return len(parts) == 3 and parts[1] == "repeat"


class PackedEvent(NamedTuple):
    """One event to write: its tag, step (its last row's), rows, wall time,
    and the block's metadata: the table, compressed unless the event is the
    block's first."""

    tag: str
    step: int
    rows: np.ndarray
    wall_time: float
    metadata: summary_pb2.SummaryMetadata


class StepPacker:
    """Gathers each step's records into block events: the writer's side.

    ``add`` takes a step's records and returns the events now due (often
    none), ``flush`` the events of the steps still waiting.
    """

    def __init__(
        self,
        steps_per_block: int | None = None,
        steps_per_event: int | None = None,
        max_delay_s: float = MAX_DELAY_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._writer_id = os.urandom(4).hex()
        self._steps_per_block = steps_per_block or STEPS_PER_BLOCK
        self._steps_per_event = steps_per_event or STEPS_PER_EVENT
        self._max_delay_s = max_delay_s
        self._clock = clock
        self._table: list[tuple[str, metadata.TensorInfo]] = []
        self._index: dict[str, int] = {}
        self._seq = -1
        self._steps_in_block = self._steps_per_block  # so the first step starts block 0
        self._block_md: summary_pb2.SummaryMetadata | None = None
        self._compact_md: summary_pb2.SummaryMetadata | None = None
        self._waiting: list[np.ndarray] = []
        self._waiting_since = 0.0
        self._last: tuple[int, float] = (0, 0.0)

    def add(
        self,
        step: int,
        records: Sequence[tuple[str, np.ndarray, metadata.TensorInfo | None]],
        wall_time: float,
    ) -> list[PackedEvent]:
        """Adds one step's records; returns the events due now.

        Raises:
          ValueError: a record is not ``NUM_FIELDS`` long, or a tensor seen
            for the first time comes without its ``TensorInfo``; nothing of
            the step is kept then.
        """
        new: dict[str, metadata.TensorInfo] = {}
        for tag, _, info in records:
            if tag not in self._index and tag not in new:
                if info is None:
                    raise ValueError("the first record of tag %r needs its TensorInfo" % tag)
                new[tag] = info
        rows = np.empty((len(records), COLUMNS), dtype=np.float64)
        for i, (tag, stats, _) in enumerate(records):
            vec = np.asarray(stats, dtype=np.float64).reshape(-1)
            if vec.shape != (metadata.NUM_FIELDS,):
                raise ValueError(
                    "a numerics record has %d fields, got %d for %r" % (metadata.NUM_FIELDS, vec.size, tag)
                )
            rows[i, 2:] = vec
        due: list[PackedEvent] = []
        if new or self._steps_in_block >= self._steps_per_block:
            due += self.flush()
            # Checked: only now does the table grow.
            for tag, info in new.items():
                self._index[tag] = len(self._table)
                self._table.append((tag, info))
            self._seq += 1
            self._steps_in_block = 0
            self._block_md = metadata.create_block_metadata(self._table)
            self._compact_md = metadata.create_block_metadata(self._table, compact=True)
        rows[:, 0] = [self._index[tag] for tag, _, _ in records]
        neginf_ok = np.array([self._table[int(i)][1].neginf_ok for i in rows[:, 0]], bool)
        rows[:, 1] = step
        if not self._waiting:
            self._waiting_since = self._clock()
        self._waiting.append(rows)
        self._steps_in_block += 1
        self._last = (int(step), wall_time)
        if (
            len(self._waiting) >= self._steps_per_event
            or np.any(nonfinite_count(rows[:, 2:], neginf_ok) > 0)
            or self._clock() - self._waiting_since >= self._max_delay_s
        ):
            due += self.flush()
        return due

    def flush(self) -> list[PackedEvent]:
        """The event of the steps waiting, if any."""
        if not self._waiting:
            return []
        rows = np.concatenate(self._waiting) if len(self._waiting) > 1 else self._waiting[0]
        self._waiting = []
        step, wall_time = self._last
        md = self._block_md or self._compact_md
        event = PackedEvent("%s%s/%06d" % (TAG_PREFIX, self._writer_id, self._seq), step, rows, wall_time, md)
        self._block_md = None
        return [event]


def unpack_block(
    block: str,
    table: metadata.BlockTable,
    steps: np.ndarray,
    arrays: Sequence[np.ndarray],
    problems: list[str],
) -> list[records.TensorSeries]:
    """The parts, one per tensor, of one block's events: series whose
    values may be views of the events, for ``merge`` to make series of.

    ``arrays`` are the events' tensors and ``steps`` their steps (which
    version 2's rows, without a step column, take). An event of the wrong
    shape, or a row whose index is not in ``table`` or whose step is not a
    step, is skipped and described in ``problems``; records are checked as
    in ``make_series``.
    """
    rows = block_rows(block, table, steps, arrays, problems)
    if rows is None:
        return []
    fast = _split_regular(table, rows)
    if fast is not None:
        return fast
    return _split_by_tensor(table, _checked_rows(block, table, rows.astype(np.float64, copy=False), problems))


# The dtypes whose values ``tensor_values`` reads without a copy.
_FLOAT_CONTENT = {types_pb2.DT_FLOAT: np.dtype("<f4"), types_pb2.DT_DOUBLE: np.dtype("<f8")}


def tensor_values(tensor) -> np.ndarray:
    """An event's tensor proto as an array: float32 or float64 content (every
    packed block) as a read-only view of its bytes, where ``make_ndarray``
    copies them once more (0.5 s of a 2.6 GB run's read); anything else by it.

    Raises:
      ValueError, TypeError, KeyError: as ``make_ndarray`` does, for a
        tensor it cannot decode; ValueError for one whose shape claims far
        more elements than it holds (``metadata.check_tensor_size``), which
        ``make_ndarray`` would allocate.
    """
    dtype = _FLOAT_CONTENT.get(tensor.dtype)
    content = tensor.tensor_content  # a copy of the bytes (protobuf's): taken once
    shape = [d.size for d in tensor.tensor_shape.dim]
    if dtype is not None and content and min(shape, default=0) >= 0 and len(content) == dtype.itemsize * math.prod(shape):
        return np.frombuffer(content, dtype=dtype).reshape(shape)
    metadata.check_tensor_size(tensor)  # before make_ndarray allocates what the shape claims
    return tensor_util.make_ndarray(tensor)


def nonfinite_step(array: np.ndarray, step: int) -> int | None:
    """The earliest step at which one event's tensor (a packed block's rows,
    or a per-tensor tag's records, written at ``step``) may hold a NaN or an
    infinity; None where it cannot.

    What an index of the event files can tell at once, without decoding
    records: the rules' count (``records.nonfinite_count``) with every -Inf
    counted, even one the tensor allows, and a count that is itself not a
    number counted too. It errs only towards a step too early, never too
    late, so the first non-finite step of a run is never before the least
    of these.
    """
    a = np.asarray(array)
    width = a.shape[-1] if a.ndim else 0
    if a.dtype.kind not in "fiu" or width not in (COLUMNS, _V2_COLUMNS, metadata.NUM_FIELDS):
        return None
    rows = a.reshape(-1, width)
    bad = nonfinite_count(rows[:, width - metadata.NUM_FIELDS:]) != 0  # a count that is NaN too
    if not bad.any():
        return None
    if width != COLUMNS:  # one step an event
        return int(step)
    with np.errstate(invalid="ignore"):
        steps = rows[bad, 1]
        steps = steps[(steps >= 0) & (steps < 2.0**63)]
    return int(steps.min()) if steps.size else None


def block_rows(
    block: str, table: metadata.BlockTable, steps: np.ndarray, arrays: Sequence[np.ndarray], problems: list[str]
) -> np.ndarray | None:
    """The rows of one block's events together (``unpack_block``'s
    arguments), in their dtype, version 2's given a step column; None where
    there are none. Events of the wrong shape are skipped and described in
    ``problems``; the rows themselves are not checked."""
    v2 = table[0][1].version < 3
    width = _V2_COLUMNS if v2 else COLUMNS
    keep = [i for i, a in enumerate(arrays) if a.ndim == 2 and a.shape[1] == width and a.dtype.kind in "fiu"]
    if len(keep) < len(arrays):
        problems.append("%s: %d malformed packed event(s) skipped" % (block, len(arrays) - len(keep)))
    if not keep:
        return None
    # Rows keep the events' dtype, float32 or float64 (version 2 wrote float64).
    dtype = np.float64 if v2 else np.result_type(*[arrays[i].dtype for i in keep], np.float32)
    rows = np.concatenate([arrays[i] for i in keep], dtype=dtype)
    if not len(rows):
        return None
    if v2:
        rows = np.insert(rows, 1, np.repeat(np.asarray(steps, np.float64)[keep], [arrays[i].shape[0] for i in keep]), axis=1)
    return rows


def _checked_rows(block: str, table: metadata.BlockTable, rows: np.ndarray, problems: list[str]) -> np.ndarray:
    """The rows whose index is in ``table``, whose step is a step and whose
    record is possible; what was skipped is described in ``problems``."""
    index, row_steps = rows[:, 0], rows[:, 1]
    with np.errstate(invalid="ignore"):
        ok = (index >= 0) & (index < len(table)) & (index == np.floor(index))
        ok &= (row_steps >= 0) & (row_steps == np.floor(row_steps)) & (row_steps < 2.0**63)
    if not ok.all():
        problems.append(
            "%s: %d packed row(s) with no tensor in the block's table or no valid step skipped"
            % (block, int((~ok).sum()))
        )
    valid = records.valid_records(rows[:, 2:]) & ok
    if not (valid | ~ok).all():
        problems.append("%s: %d malformed record(s) skipped" % (block, int((ok & ~valid).sum())))
    return rows if valid.all() else rows[valid]


def _split_by_tensor(table: metadata.BlockTable, rows: np.ndarray) -> list[records.TensorSeries]:
    """One part per tensor of checked rows, in the order written."""
    ids = rows[:, 0].astype(np.int64)
    order = np.argsort(ids, kind="stable")
    rows, ids = rows[order], ids[order]
    row_steps = rows[:, 1].astype(np.int64)
    firsts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]]) if len(ids) else np.zeros(0, np.int64)
    ends = np.r_[firsts[1:], len(ids)]
    # Written by one writer, a tensor's steps rise through the block: its
    # rows are a series as they stand. Otherwise (a step logged twice, rows
    # out of order) make_series sorts them out, keeping each step's records.
    same = ids[1:] == ids[:-1]
    in_order = bool(np.all(row_steps[1:][same] > row_steps[:-1][same]))
    out = []
    for lo, hi in zip(firsts.tolist(), ends.tolist()):
        tag, info = table[int(ids[lo])]
        if in_order:
            out.append(records.TensorSeries(tag, info, row_steps[lo:hi], rows[lo:hi, 2:]))
        else:
            out.append(records.make_series(tag, info, row_steps[lo:hi], rows[lo:hi, 2:]))
    return out


def _split_regular(table: metadata.BlockTable, rows: np.ndarray) -> list[records.TensorSeries] | None:
    """The usual block's series: each a strided view of ``rows``, with no
    per-tensor work (see ``regular_cube``). None for any other block."""
    got = regular_cube(table, rows)
    if got is None:
        return None
    steps, ids, cube = got
    return [records.TensorSeries(*table[int(i)], steps, cube[:, j, 2:]) for j, i in enumerate(ids.tolist())]


def regular_cube(table: metadata.BlockTable, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The usual block, where each step logs the same distinct tensors in
    the same order, with valid records and rising steps, as (steps ``[S]``,
    each tensor's index in ``table`` ``[T]``, rows ``[S, T, COLUMNS]``, a
    view of ``rows``); None for any other block."""
    ids = regular_ids(table, rows)
    if ids is None:
        return None
    steps = regular_steps(ids, rows[:, 0], rows[:, 1])
    if steps is None or not records.valid_records(rows[:, 2:]).all():
        return None
    return steps, ids, rows.reshape(len(steps), len(ids), COLUMNS)


def regular_ids(table: metadata.BlockTable, rows: np.ndarray) -> np.ndarray | None:
    """The tensors (indices in ``table``, int64 ``[T]``) each step of a
    usual block logs, read off its first step; None where that step's
    indices are not distinct tensors of ``table`` or the rows are not whole
    steps of as many. Only the first step is looked at: ``regular_steps``
    checks the others."""
    n = _first_step_rows(rows)
    if len(rows) % n:
        return None
    ids = rows[:n, 0]
    if not (np.all(ids == np.floor(ids)) and np.all((ids >= 0) & (ids < len(table))) and len(np.unique(ids)) == n):
        return None
    return ids.astype(np.int64)


def regular_steps(ids: np.ndarray, index: np.ndarray, step: np.ndarray) -> np.ndarray | None:
    """The steps (int64) of rows of a usual block whose index and step
    columns are ``index`` and ``step``: each step's rows name the tensors
    ``ids`` in order under one step, and the steps rise, whole and not
    negative; None where the rows are not so."""
    t = len(ids)
    by_step = step.reshape(-1, t)
    if not ((index.reshape(-1, t) == ids.astype(index.dtype)).all() and (by_step == by_step[:, :1]).all()):
        return None
    steps = by_step[:, 0]
    if not (np.all(np.diff(steps) > 0) and steps[0] >= 0 and np.all(steps == np.floor(steps)) and steps[-1] < 2.0**63):
        return None
    return steps.astype(np.int64)


def _first_step_rows(rows: np.ndarray) -> int:
    """How many rows the first step holds (all of them where there is one
    step), looked for in growing prefixes: a step holds one row a tensor."""
    at = 1024
    while True:
        head = rows[:at, 1]
        change = np.flatnonzero(head != head[0])
        if len(change):
            return int(change[0]) or len(rows)  # a NaN step differs from itself: one step of all
        if at >= len(rows):
            return len(rows)
        at *= 4


def merge(
    parts: Sequence[records.TensorSeries],
    shared_steps: dict[tuple[int, ...], np.ndarray] | None = None,
    overlaps: list[tuple[str, int, int]] | None = None,
    restarts: list[tuple[str, int, int]] | None = None,
) -> tuple[records.TensorSeries, list[int] | None]:
    """One tensor's series from its parts (valid series, in the order written).

    A step recorded in two parts keeps the later part's records (a
    restarted job's), unless the two were written at the same time (their
    ``written`` spans overlap: two writers in one run at once), when both
    parts' records are kept, as occurrences of the step, and the tensor and
    steps are added to ``overlaps`` as (tag, first step, last step); the
    records of a step within one part are all kept. Where the parts, ordered by
    their first step, lie end to end without overlap (the usual case, also
    for parts written side by side by several writers), the result is them
    laid end to end, and the second value gives each part's offset in it, so
    that parts can be replaced by slices of it; else it is None.

    The series' values are float32 where every part's are (events whose
    values are all exactly float32: half the memory, nothing rounded),
    float64 otherwise, and laid out field by field (Fortran order): the
    analysis reads them a field at a time, and copying a tensor's rows out
    of packed events is fastest so.

    ``shared_steps``, kept by the caller across the tensors of one read,
    lets tensors whose parts share their step arrays (every tensor of a
    usual block does) share one merged step array too.
    """
    last = parts[-1]
    dtype = np.float32 if all(p.values.dtype == np.float32 for p in parts) else np.float64
    if len(parts) == 1:
        return records.TensorSeries(last.tag, last.info, last.steps, np.asfortranarray(last.values, dtype)), [0]
    by_start = sorted(range(len(parts)), key=lambda i: (int(parts[i].steps[0]) if len(parts[i].steps) else 0, i))
    laid = [parts[i] for i in by_start if len(parts[i].steps)]
    if all(a.steps[-1] < b.steps[0] for a, b in zip(laid, laid[1:])):
        key = tuple(id(p.steps) for p in laid)
        steps = None if shared_steps is None else shared_steps.get(key)
        if steps is None:
            steps = np.concatenate([p.steps for p in laid]) if laid else np.zeros(0, np.int64)
            if shared_steps is not None:
                shared_steps[key] = steps
        values = np.empty((len(steps), metadata.NUM_FIELDS), dtype, order="F")
        offsets = [0] * len(parts)
        at = 0
        for i in by_start:
            n = len(parts[i].steps)
            values[at : at + n] = parts[i].values
            offsets[i] = at
            at += n
        return records.TensorSeries(last.tag, last.info, steps, values), offsets
    kept, shared, replaced = _kept_records(parts)
    if shared.size and overlaps is not None:
        overlaps.append((last.tag, int(shared.min()), int(shared.max())))
    if replaced.size and restarts is not None:
        restarts.append((last.tag, int(replaced.min()), int(replaced.max())))
    steps = np.concatenate([s for s, _ in reversed(kept)])
    values = np.concatenate([v for _, v in reversed(kept)], dtype=np.float64)
    return records.make_series(last.tag, last.info, steps, values), None


def _kept_records(
    parts: Sequence[records.TensorSeries],
) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray, np.ndarray]:
    """Each part's (steps, values) that ``merge`` keeps, last part first, the
    steps that parts written at the same time both hold, and the steps whose
    earlier records a later part replaced."""
    kept, later, shared = [], [], np.zeros(0, np.int64)
    replaced_steps = np.zeros(0, np.int64)
    for p in reversed(parts):
        at_once = [q.steps for q in later if written_at_once(p, q)]
        replaced = [q.steps for q in later if not written_at_once(p, q)]
        mine = ~np.isin(p.steps, np.concatenate(replaced)) if replaced else np.ones(len(p.steps), bool)
        # A restart only where both wall-time spans are known to follow each
        # other (a per-tensor part has none: the same writer may have written it).
        later_training = [q.steps for q in later if follows(p, q)]
        if later_training:
            replaced_steps = np.union1d(replaced_steps, p.steps[np.isin(p.steps, np.concatenate(later_training))])
        if at_once:
            shared = np.union1d(shared, p.steps[mine & np.isin(p.steps, np.concatenate(at_once))])
        kept.append((p.steps[mine], p.values[mine]))
        later.append(p)
    return kept, shared, replaced_steps


def follows(earlier: records.TensorSeries, later: records.TensorSeries) -> bool:
    """Whether ``later`` was known to start after ``earlier`` ended (a restart)."""
    return earlier.written is not None and later.written is not None and later.written[0] >= earlier.written[1]


def written_at_once(earlier: records.TensorSeries, later: records.TensorSeries) -> bool:
    """Whether ``later`` was being written before ``earlier`` ended: two
    writers at once, not a restart (unknown wall times count as a restart)."""
    if earlier.written is None or later.written is None:
        return False
    return later.written[0] < earlier.written[1] and earlier.written[0] < later.written[1]


def overlap_problem(overlaps: Sequence[tuple[str, int, int]]) -> str:
    """One problem line for the tensors that several writers wrote at once."""
    names = [tag for tag, _, _ in overlaps[:_MAX_TAGS_NAMED]]
    more = len(overlaps) - len(names)
    return (
        "%s%s: steps %d to %d were written by more than one writer at once (two processes in one run?); "
        "the records of each writer are kept, as separate records of each step (occurrences)"
        % (", ".join(names), " and %d more tensor(s)" % more if more > 0 else "",
           min(lo for _, lo, _ in overlaps), max(hi for _, _, hi in overlaps))
    )


def restart_summary(restarts: Sequence[tuple[str, int, int]]) -> list[dict[str, int]]:
    """The steps written again by a later training, for a run's summary:
    ``[{"first_step", "last_step", "tensors"}]`` (one entry: the span of all).
    Op-level records (``ops/...``) are left out: a replay writes a step's op
    records again by design."""
    restarts = [r for r in restarts if not r[0].startswith("ops/")]
    if not restarts:
        return []
    return [{"first_step": min(lo for _, lo, _ in restarts), "last_step": max(hi for _, _, hi in restarts),
             "tensors": len(restarts)}]


def merge_all(
    parts: Iterable[records.TensorSeries],
    problems: list[str] | None = None,
    restarts: list[tuple[str, int, int]] | None = None,
) -> list[records.TensorSeries]:
    """Series by tag from parts given in the order written (see ``merge``);
    tensors written by several writers at once are named in ``problems``,
    steps a later training wrote again go to ``restarts``."""
    by_tag: dict[str, list[records.TensorSeries]] = {}
    for p in parts:
        by_tag.setdefault(p.tag, []).append(p)
    overlaps: list[tuple[str, int, int]] = []
    out = [merge(ps, overlaps=overlaps, restarts=restarts)[0] for ps in by_tag.values()]
    if overlaps and problems is not None:
        problems.append(overlap_problem(overlaps))
    return out


def decode_tag(
    tag: str,
    info: metadata.TensorInfo | metadata.BlockTable,
    steps: Sequence[int] | np.ndarray,
    arrays: Sequence[np.ndarray],
    problems: list[str],
    wall_times: Sequence[float] | np.ndarray | None = None,
) -> list[records.TensorSeries]:
    """The series that one tag's events hold, whichever kind of tag it is.

    The one decoding step shared by the readers of event files and of
    TensorBoard's data provider. A per-tensor tag (``info`` a
    ``TensorInfo``) gives one series, its records checked as in
    ``records.make_series``; a packed block (``info`` its table) gives its
    parts, one per tensor (see ``unpack_block``), for ``merge`` to join
    with the same tensors' parts in other blocks.

    Args:
      tag: the tag, named in ``problems``.
      info: the tag's parsed metadata (``metadata.parse_content``).
      steps: each event's step.
      arrays: each event's tensor, in its own dtype.
      problems: where what was skipped as malformed is described.
      wall_times: each event's wall time, where known: a block's parts
        carry their span (``written``), so that ``merge`` tells two writers
        at once from a restarted job.

    Returns:
      The per-tensor tag's series (one, maybe empty), or the block's parts.
    """
    steps = np.asarray(steps, dtype=np.int64).reshape(-1)
    if not isinstance(info, metadata.TensorInfo):
        parts = unpack_block(tag, info, steps, [np.asarray(a) for a in arrays], problems)
        if wall_times is not None and len(wall_times):
            span = (float(np.min(wall_times)), float(np.max(wall_times)))
            for p in parts:
                p.written = span
        return parts
    return _trainings(tag, info, steps, arrays, problems, wall_times)


def _trainings(
    tag: str,
    info: metadata.TensorInfo,
    steps: np.ndarray,
    arrays: Sequence[np.ndarray],
    problems: list[str],
    wall_times: Sequence[float] | np.ndarray | None,
) -> list[records.TensorSeries]:
    """A per-tensor tag's series: one per run of rising (or equal) steps
    where its steps go back and each event's wall time is known (a later
    training, or a second writer, wrote the tag again), each with its span
    (``written``), so that ``merge`` tells a restart from two writers at
    once as it does for blocks; else one series."""
    walls = None if wall_times is None else np.asarray(wall_times, dtype=np.float64).reshape(-1)
    cuts = np.flatnonzero(np.diff(steps) < 0) + 1
    if walls is None or len(walls) != len(steps) or not cuts.size:
        return [records.make_series(tag, info, steps, _record_rows(arrays), problems)]
    out = []
    for idx in np.split(np.arange(len(steps)), cuts):
        part = records.make_series(tag, info, steps[idx], _record_rows([arrays[i] for i in idx]), problems)
        part.written = (float(walls[idx].min()), float(walls[idx].max()))
        out.append(part)
    return out


def _record_rows(arrays: Sequence[np.ndarray]) -> np.ndarray | list[np.ndarray]:
    """Per-tensor records as one ``[n, NUM_FIELDS]`` float64 array when every
    one has that shape (the usual case: no per-record work), else as a list
    of float64 arrays for ``make_series`` to check one by one."""
    try:
        values = np.stack(arrays) if len(arrays) else np.zeros((0, metadata.NUM_FIELDS))
        if values.ndim == 2 and values.shape[1] == metadata.NUM_FIELDS:
            return values.astype(np.float64, copy=False)
    except (ValueError, TypeError):
        pass
    rows = []
    for a in arrays:
        try:
            rows.append(np.asarray(a, dtype=np.float64))
        except (ValueError, TypeError):
            rows.append(np.full(0, np.nan))  # dropped as malformed by make_series
    return rows
