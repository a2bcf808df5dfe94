"""Packed blocks: every numerics record of one step in one event.

Why: TensorBoard stores and decodes each event of a tensor series on its
own, at a cost of about a kilobyte of memory and tens of microseconds per
event whatever its size. One event per tensor per step makes a run of
100,000 steps x 50 tensors five million of them: a minute to read and gigabytes
of memory. Packed, the same run is 100,000 events, and records are still
written as soon as their step is over, so a crash loses nothing finished.

Layout (format version 2): a writer's records go to block tags
``__numerics_block__/<writer id>/<sequence>``. Each event of a block is one
step: a float64 ``[n, 1 + NUM_FIELDS]`` tensor whose rows are a tensor's
index in the block's table followed by its record. The table, (tag,
``TensorInfo``) per index, is the block's summary metadata, which TensorBoard
keeps from the block's first event; so a writer starts a new block when a
step brings a tensor the table lacks, and every ``STEPS_PER_BLOCK`` steps, so
that a growing run re-reads only its last block and no read comes near
gRPC's message cap.

Numpy and TensorBoard protos only, no TensorFlow: writers, the backend and
the CLI share it.
"""

from __future__ import annotations

import os
from typing import Iterable, Sequence

import numpy as np
from tensorboard.compat.proto import summary_pb2

from tb_numerics import analysis, metadata

TAG_PREFIX = "__numerics_block__/"
STEPS_PER_BLOCK = 1000
COLUMNS = 1 + metadata.NUM_FIELDS


def is_block_tag(tag: str) -> bool:
    return tag.startswith(TAG_PREFIX)


class StepPacker:
    """Turns each step's records into one block event: the writer's side.

    ``pack`` returns the block tag, the rows, and the block's metadata when
    the event is a block's first (it must be written with it).
    """

    def __init__(self, steps_per_block: int | None = None):
        self._writer_id = os.urandom(4).hex()
        self._steps_per_block = steps_per_block or STEPS_PER_BLOCK
        self._table: list[tuple[str, metadata.TensorInfo]] = []
        self._index: dict[str, int] = {}
        self._seq = -1
        self._events_in_block = self._steps_per_block  # so the first step starts block 0

    def pack(
        self, records: Sequence[tuple[str, np.ndarray, metadata.TensorInfo | None]]
    ) -> tuple[str, np.ndarray, summary_pb2.SummaryMetadata | None]:
        """The block tag, ``[len(records), COLUMNS]`` rows and, for a new
        block, its metadata.

        Raises:
          ValueError: a record is not ``NUM_FIELDS`` long, or a tensor seen
            for the first time comes without its ``TensorInfo``.
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
            rows[i, 1:] = vec
        # Checked: only now does the table grow.
        for tag, info in new.items():
            self._index[tag] = len(self._table)
            self._table.append((tag, info))
        rows[:, 0] = [self._index[tag] for tag, _, _ in records]
        md = None
        if new or self._events_in_block >= self._steps_per_block:
            self._seq += 1
            self._events_in_block = 0
            md = metadata.create_block_metadata(self._table)
        self._events_in_block += 1
        return "%s%s/%06d" % (TAG_PREFIX, self._writer_id, self._seq), rows, md


def unpack_block(
    block: str,
    table: metadata.BlockTable,
    steps: np.ndarray,
    arrays: Sequence[np.ndarray],
    problems: list[str],
) -> list[analysis.TensorSeries]:
    """The series, one per tensor, of one block's events.

    ``arrays`` are the events' tensors, one per step in ``steps``. An event
    of the wrong shape, or a row whose index is not in ``table``, is skipped
    and described in ``problems``; records are checked as in ``make_series``.
    """
    keep = [i for i, a in enumerate(arrays) if a.ndim == 2 and a.shape[1] == COLUMNS and a.dtype.kind in "fiu"]
    if len(keep) < len(arrays):
        problems.append("%s: %d malformed packed event(s) skipped" % (block, len(arrays) - len(keep)))
    if not keep:
        return []
    first = arrays[keep[0]]
    if len(keep) == len(arrays) and _same_rows(first, arrays, len(table)):
        # The usual block: each step logs the same tensors in the same order.
        # Each tensor's series is then a strided view of the stacked events.
        cube = np.stack(arrays).astype(np.float64, copy=False)
        valid = analysis.valid_records(cube.reshape(-1, COLUMNS)[:, 1:]).reshape(cube.shape[:2])
        if valid.all() and np.all(np.diff(steps) > 0):
            steps = np.asarray(steps, dtype=np.int64)
            return [
                analysis.TensorSeries(*table[int(i)], steps, cube[:, j, 1:])
                for j, i in enumerate(first[:, 0].tolist())
            ]
    rows = np.concatenate([arrays[i] for i in keep]).astype(np.float64, copy=False)
    row_steps = np.repeat(np.asarray(steps, dtype=np.int64)[keep], [arrays[i].shape[0] for i in keep])
    index = rows[:, 0]
    with np.errstate(invalid="ignore"):
        ok = (index >= 0) & (index < len(table)) & (index == np.floor(index))
    if not ok.all():
        problems.append("%s: %d packed row(s) with no tensor in the block's table skipped" % (block, int((~ok).sum())))
    valid = analysis.valid_records(rows[:, 1:]) & ok
    if not (valid | ~ok).all():
        problems.append("%s: %d malformed record(s) skipped" % (block, int((ok & ~valid).sum())))
    if not valid.all():
        rows, row_steps = rows[valid], row_steps[valid]
    ids = rows[:, 0].astype(np.int64)
    order = np.argsort(ids, kind="stable")
    ids, rows, row_steps = ids[order], rows[order], row_steps[order]
    firsts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]]) if len(ids) else np.zeros(0, np.int64)
    ends = np.r_[firsts[1:], len(ids)]
    # Written by one writer, a tensor's steps rise through the block: its
    # rows are a series as they stand. Otherwise make_series sorts them out.
    same = ids[1:] == ids[:-1]
    in_order = bool(np.all(row_steps[1:][same] > row_steps[:-1][same]))
    out = []
    for lo, hi in zip(firsts.tolist(), ends.tolist()):
        tag, info = table[int(ids[lo])]
        if in_order:
            out.append(analysis.TensorSeries(tag, info, row_steps[lo:hi], rows[lo:hi, 1:]))
        else:
            out.append(analysis.make_series(tag, info, row_steps[lo:hi], rows[lo:hi, 1:]))
    return out


def _same_rows(first: np.ndarray, arrays: Sequence[np.ndarray], size: int) -> bool:
    """Whether every event names the same distinct tensors of the table, in
    the same order, as ``first``."""
    ids = first[:, 0]
    if not (np.all(ids == np.floor(ids)) and np.all((ids >= 0) & (ids < size))):
        return False
    if len(np.unique(ids)) != len(ids):
        return False
    return all(a.shape == first.shape and np.array_equal(a[:, 0], ids) for a in arrays)


def merge(parts: Sequence[analysis.TensorSeries]) -> tuple[analysis.TensorSeries, list[int] | None]:
    """One tensor's series from its parts (valid series, in the order written).

    A step recorded in two parts keeps the later part's record, as
    ``make_series`` keeps a restarted job's. Where the parts, ordered by
    their first step, lie end to end without overlap (the usual case, also
    for parts written side by side by several writers), the result is them
    laid end to end, and the second value gives each part's offset in it, so
    that parts can be replaced by slices of it; else it is None.
    """
    last = parts[-1]
    if len(parts) == 1:
        return last, [0]
    by_start = sorted(range(len(parts)), key=lambda i: (int(parts[i].steps[0]) if len(parts[i].steps) else 0, i))
    laid = [parts[i] for i in by_start if len(parts[i].steps)]
    if all(a.steps[-1] < b.steps[0] for a, b in zip(laid, laid[1:])):
        steps = np.concatenate([p.steps for p in laid]) if laid else np.zeros(0, np.int64)
        values = np.concatenate([p.values for p in laid]) if laid else np.zeros((0, metadata.NUM_FIELDS))
        offsets = [0] * len(parts)
        at = 0
        for i in by_start:
            offsets[i] = at
            at += len(parts[i].steps)
        return analysis.TensorSeries(last.tag, last.info, steps, values), offsets
    steps = np.concatenate([p.steps for p in parts])
    values = np.concatenate([p.values for p in parts])
    return analysis.make_series(last.tag, last.info, steps, values), None


def merge_all(parts: Iterable[analysis.TensorSeries]) -> list[analysis.TensorSeries]:
    """Series by tag from parts given in the order written (see ``merge``)."""
    by_tag: dict[str, list[analysis.TensorSeries]] = {}
    for p in parts:
        by_tag.setdefault(p.tag, []).append(p)
    return [merge(ps)[0] for ps in by_tag.values()]
