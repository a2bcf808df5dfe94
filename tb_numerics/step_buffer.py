"""One packed write for the ``log_numerics`` records of a traced step.

Inside a ``tf.function``, each ``log_numerics`` / ``log_gradients`` call
made at the function's top level only notes its tensor. When the trace
ends, the noted tensors get one computation and one write path, run with
every call of the function:

* the records of the noted tensors (``stats.records_of``: the small ones
  together, the large ones' by ``stats.tensor_stats`` each);
* the step's rows (table index, step, record: ``packed``'s format 3)
  appended to a buffer in a variable;
* one conditional write of the buffer as one event under the writer's
  block tag ``__numerics_block__/<writer id>/<sequence>``, when it holds
  ``packed.STEPS_PER_EVENT`` steps, when its oldest step has waited
  ``packed.MAX_DELAY_S`` (checked at each step), or at once, flushed to
  disk, when a record holds a NaN or an Inf that is not intended. Every
  write is flushed, so that at most the steps of the last 2 s wait in
  memory; ``writer.flush()``, ``writer.close()`` and interpreter exit write
  them too.

The table (tag and ``TensorInfo`` of each row index) only grows: a tag's
index never changes, so rows buffered before a new tag came are valid
under the larger table. A new tag, or ``packed.STEPS_PER_BLOCK`` steps,
starts a new block; every event carries its block's table, so that each
event can be read on its own (a damaged first event loses only itself).
An event's step is its last row's step, or one more than the block's
previous event's where that is larger: TensorBoard's Rust data server keeps
one event per tag and step, and the rows hold the true steps.

Calls inside a ``tf.cond`` branch or a loop body of a traced step (a whole
training loop in one ``tf.function``, ``tf.range`` or ``tf.while_loop``
around the step) cannot wait for the trace's end, which runs once per call
of the function, not once per iteration: ``add_in_body`` computes and
commits their rows where the call is, each iteration's at the step it read,
and a buffered step is counted once however many commits hold its rows.
The trace's end commit is then ordered by hand after the function's
stateful ops, since it is made after their automatic control dependencies.

Eager calls go through ``add_eager``. Not taken here (the caller writes
those per call): calls under a ``tf.distribute`` replica context, with
``every_n_steps``, and in a loop's gradient body.
"""

from __future__ import annotations

import atexit
import dataclasses
import threading
import weakref
from typing import Callable

import numpy as np
import tensorflow as tf

from tb_numerics import _tf_internal, metadata, packed, record_writer, records, stats, write_check

__all__ = ["Entry", "StepBuffer", "traced_body_graph", "traced_step_graph"]

traced_step_graph = _tf_internal.traced_step_graph
traced_body_graph = _tf_internal.traced_body_graph


@dataclasses.dataclass
class Entry:
    """One call's record to compute at the end of the trace: of tensor
    ``x``, or ``combine`` of the records of the entries ``parts`` (a global
    norm from its gradients' records)."""

    index: int
    step: tf.Tensor
    record: tf.Tensor  # whether summaries were recorded at the call
    x: tf.Tensor | None = None
    dtype: str = ""
    parts: tuple[int, ...] = ()
    combine: Callable[[tf.Tensor], tf.Tensor] | None = None


class StepBuffer:
    """One writer's packed records: its table, its buffered rows, its blocks."""

    def __init__(self, writer, writer_id: str):
        self._writer = weakref.ref(writer)
        self._prefix = "%s%s/" % (packed.TAG_PREFIX, writer_id)
        self._lock = threading.Lock()
        self.table: list[tuple[str, metadata.TensorInfo]] = []
        self._index: dict[str, int] = {}
        self._open: dict[int, list[Entry]] = {}
        # Traced steps (ids of their graphs) with calls in loop or cond bodies.
        self._bodies: set[int] = set()
        self._rows = _tf_internal.untracked_variable(
            np.zeros([0, packed.COLUMNS]), "tb_numerics_rows", shape=tf.TensorShape([None, packed.COLUMNS])
        )
        # steps buffered, step of the last event, block sequence, steps in the block
        self._counts = _tf_internal.untracked_variable(np.array([0, -1, -1, 0], np.int64), "tb_numerics_counts")
        self._since = _tf_internal.untracked_variable(np.float64(0), "tb_numerics_since")
        self._meta = _tf_internal.untracked_variable(b"", "tb_numerics_table")
        self._neginf_ok = np.zeros(0, bool)
        self._flushing = False
        self._commit_fn = None
        # Eager calls' rows of the step being logged, not yet in the buffer.
        self._eager: list[np.ndarray] = []
        self._eager_step: int | None = None
        # Whether the writer's file grows by what is written (see write_check).
        self.growth = write_check.GrowthCheck(self._prefix)
        _hook_flush(writer, self)

    def index_of(self, tag: str, info: metadata.TensorInfo) -> int:
        """The row index of ``tag``; a new tag starts a new block whose table has it."""
        with self._lock:
            i = self._index.get(tag)
            if i is None:
                i = self._index[tag] = len(self.table)
                self.table.append((tag, info))
                self._neginf_ok = np.array([inf.neginf_ok for _, inf in self.table])
                table = metadata.create_block_metadata(self.table).SerializeToString()
                with tf.init_scope():
                    self._meta.assign(table)
                    c = self._counts.numpy()
                    self._counts.assign([c[0], c[1], c[2] + 1, 0])
            return i

    def add(self, graph, entries: list[Entry]) -> None:
        """Notes ``entries`` of a call in ``graph``, to compute at its trace's end."""
        key = id(graph)
        with self._lock:
            first = key not in self._open
            noted = self._open.setdefault(key, [])
            # ``parts`` count from the call's first entry; now from the trace's.
            at = len(noted)
            noted.extend([dataclasses.replace(e, parts=tuple(p + at for p in e.parts)) for e in entries])
        if first:
            _tf_internal.at_trace_end(graph, lambda: self._finish(graph))

    def add_in_body(self, entries: list[Entry]) -> None:
        """Commits ``entries`` of a call in a loop or ``tf.cond`` body of a
        traced step where the call is: each loop iteration appends its own
        rows, at the step read in that iteration, and one holding a NaN or
        an Inf is written at once."""
        writer = self._writer()
        if writer is None:
            return
        with writer.as_default(), tf.summary.record_if(True):
            rows, bad = _rows_of(entries, self._neginf_ok)
            self._commit(writer, rows, bad, force=False)
        with self._lock:
            self._bodies.add(id(_tf_internal.enclosing_step_graph()))

    @tf.autograph.experimental.do_not_convert
    def _finish(self, graph) -> list:
        """The ops of one trace's records: computed, buffered, written when due."""
        with self._lock:
            entries = self._open.pop(id(graph))
            in_bodies = id(graph) in self._bodies
            self._bodies.discard(id(graph))
        writer = self._writer()
        if writer is None or not entries:
            return []
        # Made after the trace's automatic control dependencies: ordered by
        # hand after the loops and conds whose calls committed rows.
        after = _tf_internal.stateful_ops(graph) if in_bodies else []
        # Rows are kept where summaries were recorded at their call; once
        # kept, they are written whatever record_if says at the end.
        with writer.as_default(), tf.summary.record_if(True), tf.control_dependencies(after):
            rows, bad = _rows_of(entries, self._neginf_ok)
            written = self._commit(writer, rows, bad, force=False)
        return [written.op]

    def _commit(self, writer, rows: tf.Tensor, bad: tf.Tensor, force: bool) -> tf.Tensor:
        """Adds ``rows`` (one step's, maybe none) to the buffer; writes it when due."""
        old, c, since = self._rows.read_value(), self._counts.read_value(), self._since.read_value()
        rows_all = tf.concat([old, rows], 0)
        # A step counts once, however many commits hold its rows (a loop body's calls).
        last = tf.concat([tf.constant([np.nan], tf.float64), old[:, 1]], 0)[-1]
        first = tf.concat([rows[:, 1], tf.constant([np.nan], tf.float64)], 0)[0]
        adds = c[0] + tf.cast((tf.shape(rows)[0] > 0) & ~tf.equal(first, last), tf.int64)
        now = _tf_internal.wall_clock()
        since = tf.where(c[0] > 0, since, now)
        due = tf.shape(rows_all)[0] > 0
        if not force:
            due &= bad | (adds >= packed.STEPS_PER_EVENT) | (now - since >= packed.MAX_DELAY_S)
        return tf.cond(
            due,
            lambda: self._write(writer, rows_all, c, adds),
            lambda: self._keep(rows_all, c, adds, since),
        )

    def _keep(self, rows_all: tf.Tensor, c: tf.Tensor, adds: tf.Tensor, since: tf.Tensor) -> tf.Tensor:
        with tf.control_dependencies(
            [self._rows.assign(rows_all), self._counts.assign(tf.tensor_scatter_nd_update(c, [[0]], [adds])),
             self._since.assign(since)]
        ):
            return tf.constant(False)

    def _write(self, writer, rows_all: tf.Tensor, c: tf.Tensor, adds: tf.Tensor) -> tf.Tensor:
        """Writes the buffered rows as one event of the current block, flushed."""
        full = c[3] >= packed.STEPS_PER_BLOCK
        seq = c[2] + tf.cast(full, tf.int64)
        in_block = tf.where(full, tf.constant(0, tf.int64), c[3]) + adds
        tag = tf.strings.join([self._prefix, tf.strings.as_string(seq, width=6, fill="0")])
        step = tf.maximum(c[1] + 1, tf.cast(rows_all[-1, 1], tf.int64))
        meta = self._meta.read_value()
        as32 = tf.cast(rows_all, tf.float32)
        exact = tf.reduce_all(tf.equal(tf.cast(as32, tf.float64), rows_all) | tf.math.is_nan(rows_all))
        # float32 where every value is exactly one (as NumericsRecordWriter writes).
        written = tf.cond(
            exact,
            lambda: tf.summary.write(tag, as32, step=step, metadata=meta),
            lambda: tf.summary.write(tag, rows_all, step=step, metadata=meta),
        )
        with tf.control_dependencies([written]):
            flushed = type(writer).flush(writer)  # the writer's own flush, not _hook_flush's
        with tf.control_dependencies([] if flushed is None else [flushed]):
            # On the host, after the flush: TensorFlow's writer ignores a failed append.
            checked = tf.numpy_function(self.growth, [rows_all], tf.bool, stateful=True)
        with tf.control_dependencies([checked]):
            updates = [
                self._rows.assign(tf.zeros([0, packed.COLUMNS], tf.float64)),
                self._counts.assign(tf.stack([tf.constant(0, tf.int64), step, seq, in_block])),
            ]
        with tf.control_dependencies(updates):
            return tf.identity(written)

    def add_eager(self, index: int, step: int, record: np.ndarray) -> None:
        """Adds an eager call's record: the step's records go to the buffer
        together when the next step's first comes, at once (written) where
        one holds a NaN or an Inf that is not intended."""
        if self._eager and step != self._eager_step:
            self._push(force=False)
        self._eager_step = step
        self._eager.append(np.concatenate([[index, step], record]))
        if records.nonfinite_count(record, self._neginf_ok[index]) > 0:
            self._push(force=True)

    def flush(self) -> None:
        """Writes the rows waiting in the buffer (eagerly, outside any step)."""
        writer = self._writer()
        if writer is None or getattr(writer, "_closed", False) or self._flushing:
            return
        if self._eager or self._counts.numpy()[0]:
            self._push(force=True)

    def _push(self, force: bool) -> None:
        """Commits the eager rows (maybe none) to the buffer; ``force`` writes it."""
        writer = self._writer()
        if writer is None:
            return
        if self._commit_fn is None:
            # Traced once: a commit is one call, not dozens of eager ops.
            @tf.function(autograph=False)
            def commit_fn(rows, force):
                with writer.as_default(), tf.summary.record_if(True):
                    return self._commit(writer, rows, force, force=False)

            self._commit_fn = commit_fn
        rows = np.array(self._eager, np.float64).reshape(-1, packed.COLUMNS)
        self._eager = []
        # (Leaving writer.as_default() flushes the writer: that must not come back here.)
        self._flushing = True
        try:
            with tf.init_scope():
                self._commit_fn(tf.constant(rows), tf.constant(force))
        finally:
            self._flushing = False


def _rows_of(entries: list[Entry], neginf_ok: np.ndarray) -> tuple[tf.Tensor, tf.Tensor]:
    """The rows of ``entries`` (table index, step, record) where summaries
    were recorded at their call, and whether one holds a NaN or an Inf
    that is not intended."""
    vecs = _records(entries)
    index = np.array([e.index for e in entries])
    steps = tf.cast(tf.stack([e.step for e in entries]), tf.float64)
    rows = tf.concat([tf.constant(index, tf.float64)[:, None], steps[:, None], vecs], axis=1)
    bad = stats.nonfinite_count(vecs, neginf_ok[index]) > 0
    keep = tf.stack([e.record for e in entries])
    return tf.boolean_mask(rows, keep), tf.reduce_any(bad & keep)


def _records(entries: list[Entry]) -> tf.Tensor:
    """The records ``[k, NUM_FIELDS]`` of a trace's entries: of their
    tensors together (``stats.records_of``: the small ones in a fixed number
    of nodes), then the combined ones."""
    vecs: list[tf.Tensor | None] = [None] * len(entries)
    given = [i for i, e in enumerate(entries) if e.x is not None]
    if given:
        made = stats.records_of([entries[i].x for i in given], [""] * len(given))  # dtypes checked when noted
        for i, row in zip(given, tf.unstack(made, num=len(given))):
            vecs[i] = row
    for i, e in enumerate(entries):
        if e.combine is not None:
            vecs[i] = e.combine(tf.stack([vecs[j] for j in e.parts]))
    return tf.stack(vecs)


_buffers: "weakref.WeakSet[StepBuffer]" = weakref.WeakSet()


def _hook_flush(writer, buffer: StepBuffer) -> None:
    """Makes ``writer.flush()`` and ``writer.close()`` (which calls flush)
    write the buffered rows first, and interpreter exit too."""
    original = writer.flush

    def flush():
        if tf.executing_eagerly():  # not while tracing a step that flushes
            buffer.flush()
        return original()

    writer.flush = flush
    _buffers.add(buffer)


@atexit.register
def _flush_all() -> None:
    for buffer in list(_buffers):
        try:
            buffer.flush()
        except Exception as e:  # noqa: BLE001 - exiting: write what can be written, say what could not
            record_writer.warn_lost_records(buffer.growth.logdir or "the summary writer's logdir", e)
