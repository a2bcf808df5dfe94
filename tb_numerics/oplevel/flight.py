"""The op-level flight recorders: the last K steps kept, written at the first non-finite one.

``op_numerics(flight_recorder=K)`` keeps every op record of the last K steps
and writes them (the failing step and the K-1 before it) only at the first
step where any record is non-finite, so it can stay on. A step recorded
eagerly keeps its records in Python (``EagerFlight``); a traced step keeps
them on the device in a ring buffer per trace and decides in the graph
(``GraphFlight``), with no host round trip per step.
"""

from __future__ import annotations

import collections
from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from tb_numerics import _tf_internal, metadata, stats, summary
from tb_numerics.records import nonfinite_count

__all__ = ["EagerFlight", "GraphFlight", "Record"]

# (tag, record vector, info) of one op output at one step.
Record = tuple[str, Any, metadata.TensorInfo]


class EagerFlight:
    """Flight recorder of eagerly recorded steps: the window lives in Python."""

    def __init__(self, window: int) -> None:
        self._history: collections.deque = collections.deque(maxlen=window)
        self.fired = False

    def add(self, step: int, recs: Sequence[Record]) -> bool:
        """Keeps one step's records; writes the window at the first non-finite step
        and returns whether it did so now."""
        self._history.append((step, recs))
        if self.fired or not recs:
            return False
        vecs = np.stack([np.asarray(vec) for _, vec, _ in recs])
        if np.any(nonfinite_count(vecs, _neginf_ok(recs)) > 0):
            self.fired = True
            for s, window in self._history:
                for tag, vec, info in window:
                    summary.write_stats(tag, vec, step=s, info=info)
            self._history.clear()
        return self.fired


class GraphFlight:
    """Flight recorder of traced steps: one ring buffer per trace, on the device."""

    def __init__(self, window: int) -> None:
        self._k = window
        self._fired: tf.Variable | None = None

    @property
    def fired(self) -> bool:
        return self._fired is not None and bool(self._fired.numpy())

    def finish(self, step: Any, recs: Sequence[Record]) -> None:
        """Adds the ops that keep this trace's records and write its window."""
        k, n = self._k, len(recs)
        if self._fired is None:
            self._fired = _tf_internal.untracked_variable(False, "op_numerics_fired")
        # One ring buffer per trace: its shape is this trace's number of records.
        buf = _tf_internal.untracked_variable(
            np.zeros([k, n, metadata.NUM_FIELDS], np.float64), "op_numerics_window")
        steps = _tf_internal.untracked_variable(np.full([k], -1, np.int64), "op_numerics_steps")
        count = _tf_internal.untracked_variable(np.int64(0), "op_numerics_count")
        now = tf.stack([tf.convert_to_tensor(vec, tf.float64) for _, vec, _ in recs])
        slot = tf.reshape(count % k, [1, 1])
        buf.scatter_nd_update(slot, now[None])
        steps.scatter_nd_update(slot, tf.reshape(tf.cast(step, tf.int64), [1]))
        count.assign_add(1)
        fired = self._fired

        def write_window() -> tf.Tensor:
            _write_ring(recs, buf, steps, count, k)
            fired.assign(True)
            return tf.constant(True)

        bad = tf.reduce_any(stats.nonfinite_count(now, _neginf_ok(recs)) > 0)
        tf.cond(tf.logical_and(bad, tf.logical_not(fired.read_value())), write_window,
                lambda: tf.constant(False))


def _neginf_ok(recs: Sequence[Record]) -> np.ndarray:
    """Per record: whether -Inf is intended in its tensor."""
    return np.array([info.neginf_ok for _, _, info in recs], bool)


def _write_ring(recs: Sequence[Record], buf, steps, count, k: int) -> None:
    """Writes the ring's steps oldest first: the K-1 before the failing one, then it.

    A loop, not K unrolled copies, keeps the trace small.
    """
    def write_slot(j):
        s = (count - k + j) % k
        step_j, window = steps[s], buf[s]

        def write_all() -> tf.Tensor:
            for i, (tag, _, info) in enumerate(recs):
                summary.write_stats(tag, window[i], step=step_j, info=info)
            return tf.constant(True)

        tf.cond(step_j >= 0, write_all, lambda: tf.constant(False))
        return (j + 1,)

    tf.while_loop(lambda j: j < k, write_slot, (tf.constant(0, tf.int64),))
