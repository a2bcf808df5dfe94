"""Op records inside graphs nested in a step: called tf.functions, their
gradients, tf.cond branches and tf.while_loop bodies (Keras RNN loops).

A nested graph is traced once and then runs at every call, inside the
recorder's block or not, so its record ops must not bake in anything of the
step that traced it. ``NestedRecords`` holds the recorder's variables that
those record ops read and write at run time:

* ``active``: whether the recorder's block is open. An eagerly entered block
  sets it, leaves clear it, and every record op of a nested graph is gated
  on it: a function traced inside the block and called later outside it (an
  evaluation pass) records nothing.
* ``seq`` and ``buf``: each record op takes the next execution position of
  the step (``seq``, reset when a block opens) and stores its record, with
  its site, in that row of ``buf``. The block reads the rows back when it
  closes and writes them in execution order, at the step of that call.
* ``acc``: under a traced step with a flight recorder, each nested site's
  records of the step merged into one row (every loop iteration counts),
  read into the ring buffer at the end of the step.

Graphs that TensorFlow builds without automatic control dependencies (the
backward function of a called ``tf.function``) would prune record ops that
no output depends on: there the op's output is replaced by an identity that
depends on its record, and the records of one graph run one after another.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable

import numpy as np
import tensorflow as tf

from tb_numerics import _tf_internal, metadata, stats

__all__ = ["NestedRecords"]

_log = logging.getLogger(__name__)

F = metadata.FIELD_INDEX
# Rows of ``buf``: records of nested graphs one step may hold. A record is
# 96 bytes, so 16,384 rows are 1.5 MiB; rows beyond are counted, not kept.
CAPACITY = 1 << 14
# Rows of ``acc``: nested op sites a traced step with a flight recorder may hold.
ACC_CAPACITY = 1 << 12


def _empty_record() -> np.ndarray:
    """The record of no values: what merging starts from."""
    out = np.zeros(metadata.NUM_FIELDS, np.float64)
    out[[F["min"], F["max"]]] = np.nan
    return out


class NestedRecords:
    """The recorder's run-time state for records inside nested graphs."""

    def __init__(self) -> None:
        self.sites: list[tuple[str, metadata.TensorInfo]] = []  # site id -> (tag, info)
        self._vars: dict[str, tf.Variable] = {}
        self._acc_rows = 0
        self._last: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()

    def _var(self, name: str, initial: Any) -> tf.Variable:
        v = self._vars.get(name)
        if v is None:
            v = self._vars[name] = _tf_internal.untracked_variable(initial, "op_numerics_" + name)
        return v

    @property
    def in_use(self) -> bool:
        """Whether any nested graph has record ops that use this state."""
        return "seq" in self._vars

    # ------------------------------------------------------------ blocks

    def open_block(self) -> None:
        """An eager block opens: records count from 0 and are kept."""
        if self.in_use:
            self._vars["seq"].assign(0)
            self._vars["active"].assign(True)

    def close_block(self) -> None:
        if self.in_use:
            self._vars["active"].assign(False)

    def position(self) -> int:
        """How many nested records this block has taken so far."""
        return int(self._vars["seq"].numpy()) if self.in_use else 0

    def drain(self) -> list[tuple[int, int, np.ndarray]]:
        """(execution position, site id, record) of this block's nested records."""
        n = self.position()
        if n == 0:
            return []
        kept = min(n, CAPACITY)
        if n > kept:
            _log.warning("op_numerics: %d records of nested graphs in one step; the %d beyond %d "
                         "were not kept", n, n - kept, CAPACITY)
        rows = self._vars["buf"].sparse_read(tf.range(kept)).numpy()
        return [(i, int(row[-1]), row[:-1]) for i, row in enumerate(rows)]

    # ------------------------------------------------------------ record ops

    def keep(self, graph: Any, tensor: tf.Tensor, tag: str, site: int) -> tf.Tensor | None:
        """Record ops, in ``graph``, that store ``tensor``'s record while the block is open."""
        active = self._var("active", True)  # first made while tracing inside an open block
        seq = self._var("seq", np.int64(0))
        buf = self._var("buf", np.zeros([CAPACITY + 1, metadata.NUM_FIELDS + 1], np.float64))

        def store() -> tf.Tensor:
            vec = stats.op_stats(tensor, tag)
            i = tf.minimum(seq.assign_add(1, read_value=True) - 1, CAPACITY)
            row = tf.concat([vec, tf.constant([float(site)], tf.float64)], 0)
            return _done_after(tf.raw_ops.ResourceScatterNdUpdate(
                ref=buf.handle, indices=tf.reshape(i, [1, 1]), updates=row[None]))

        return self.attach(graph, tensor, lambda: tf.cond(active, store, lambda: tf.constant(False)))

    def accumulate(self, graph: Any, tensor: tf.Tensor, tag: str, row: int) -> tf.Tensor | None:
        """Record ops, in ``graph``, that merge ``tensor``'s record into row ``row`` of ``acc``."""
        acc = self._acc()

        def merge() -> tf.Tensor:
            vec = stats.merge_stats(acc.sparse_read([row])[0], stats.op_stats(tensor, tag))
            return _done_after(tf.raw_ops.ResourceScatterNdUpdate(
                ref=acc.handle, indices=tf.constant([[row]], tf.int64), updates=vec[None]))

        return self.attach(graph, tensor, merge)

    def new_acc_row(self) -> int:
        """A row of ``acc`` for one more nested site; raises when all are taken."""
        if self._acc_rows >= ACC_CAPACITY:
            raise RuntimeError("op_numerics: more than %d op outputs in nested graphs of one traced "
                               "step with a flight recorder; narrow it with op_types= or name_regex="
                               % ACC_CAPACITY)
        self._acc_rows += 1
        return self._acc_rows - 1

    def take_acc_rows(self, rows: list[int]) -> tf.Tensor:
        """Reads rows of ``acc`` (in the traced step's graph) and empties them for the next step."""
        acc = self._acc()
        got = acc.sparse_read(rows)
        with tf.control_dependencies([got]):
            idx = tf.constant([[r] for r in rows], tf.int64)
            acc.scatter_nd_update(idx, tf.constant(np.tile(_empty_record(), (len(rows), 1))))
        return got

    def _acc(self) -> tf.Variable:
        return self._var("acc", np.tile(_empty_record(), (ACC_CAPACITY, 1)))

    def attach(self, graph: Any, tensor: tf.Tensor, make_op: Callable[[], Any]) -> tf.Tensor | None:
        """Builds ``make_op()`` so that it runs; returns ``tensor``'s replacement or None."""
        if _tf_internal.adds_control_dependencies(graph):
            make_op()  # a stateful op: the graph runs it
            return None
        prev = self._last.get(graph)
        with tf.control_dependencies([] if prev is None else [prev]):
            op = make_op()
        self._last[graph] = op
        with tf.control_dependencies([op]):
            return tf.identity(tensor)


def _done_after(op: Any) -> tf.Tensor:
    """A True that depends on ``op``: what a graph without automatic control
    dependencies needs to run ``op``."""
    done = tf.constant(True)
    with tf.control_dependencies([op]):
        return tf.identity(done)
