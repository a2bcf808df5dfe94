"""One tag's records, written from a traced step or eagerly: the summary API's write path.

Per writer and tag, small state lives in TensorFlow variables (created under
``tf.init_scope``, so a traced step can update them on every call):
whether the tag's metadata was written yet (the first record carries the
whole ``TensorInfo``, every later one a compact copy: ``_compact_metadata``);
the step and count of the records written, and the last one, so that a tag
logged again in a step is written as a repeat (``_write_repeat``); and for
``every_n_steps`` the previous record and the kinds of non-finite values
seen (``latch.decide``). See ``summary``'s docstring for why.
"""

from __future__ import annotations

import json

import numpy as np
from tensorboard.compat.proto import summary_pb2

from tb_numerics import _requires

tf = _requires.tensorflow(__name__)

from tb_numerics import _tf_internal, latch, metadata, packed  # noqa: E402
from tb_numerics.records import F  # noqa: E402

__all__ = ["TagState", "record"]


def _compact_metadata(info: metadata.TensorInfo) -> bytes:
    """The metadata of a tag's later records: enough to read them without
    the first (dtype, role, order, intended -Inf), in today's format, so any
    reader that meets it first parses it as it parses the full one."""
    content = {"version": metadata.RECORD_VERSION, "dtype": info.dtype, "role": info.role, "order": int(info.order)}
    if info.neginf_ok:
        content["neginf_ok"] = True
    if info.compute_dtype and info.compute_dtype != info.dtype:
        content["compute_dtype"] = info.compute_dtype
    return summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(
            plugin_name=metadata.PLUGIN_NAME,
            content=json.dumps(content, separators=(",", ":")).encode("utf-8"),
        ),
        data_class=summary_pb2.DATA_CLASS_TENSOR,
    ).SerializeToString()


class TagState:
    """What one writer remembers about one tag."""

    def __init__(self, tag: str, info: metadata.TensorInfo, writer_id: str):
        self.tag = tag
        self.info = info
        self.serialized_metadata = metadata.create_summary_metadata(info).SerializeToString()
        self.later_metadata = _compact_metadata(info)
        # Records beyond the first of a step (see _write_repeat).
        self.repeat_tag = packed.repeat_tag(writer_id, info.order)
        self.repeat_metadata = metadata.create_block_metadata([(tag, info)]).SerializeToString()
        self._vars: dict[str, tf.Variable] = {}

    def var(self, key: str, initial: bool | np.ndarray | np.generic) -> tf.Variable:
        """A state variable, created outside any function graph on first use.

        ``initial`` is a Python or numpy value: a tensor made in a function
        graph could not be used under ``init_scope``.
        """
        v = self._vars.get(key)
        if v is None:
            # Not a tf.Variable seen by tf.function's creator scope: a retrace
            # may meet new tags (an optimizer that builds its own variables on
            # the first call makes tf.function trace again, with new ops for
            # op_numerics), and tf.function refuses variables created on any
            # trace but the first. The state is written once, outside the
            # replicas (see _emit), so it needs no distributed variable either.
            v = _tf_internal.untracked_variable(initial, "tb_numerics_%s" % key)
            self._vars[key] = v
        return v


def _kinds(vec: tf.Tensor, neginf_ok: bool) -> tf.Tensor:
    """The int64 mask (``latch.KIND_BITS``) of the kinds of non-finite
    values a record holds that are not intended: the TensorFlow twin of
    ``latch.kinds``."""
    bits = {k: b for k, b in latch.KIND_BITS.items() if not (neginf_ok and k == "neginf")}
    present = tf.cast(tf.gather(vec, [F[k] for k in bits]) > 0, tf.int64)
    return tf.reduce_sum(present * tf.constant(list(bits.values()), tf.int64))


def _write(st: TagState, stats_vec: tf.Tensor, step: tf.Tensor) -> tf.Tensor:
    """One record of ``st.tag``: a step's first under the tag itself, a
    later one of the same step as a repeat (see ``_write_repeat``)."""
    # (step of the last record written, records written at that step)
    at = st.var("written_at", np.array([-1, 0], np.int64))
    last = st.var("last_record", np.zeros(metadata.NUM_FIELDS, np.float64))
    pos = at.read_value()
    prev = last.read_value()
    repeat = tf.equal(pos[0], step)
    written = tf.cond(
        repeat,
        lambda: _write_repeat(st, stats_vec, step, prev, pos[1]),
        lambda: _write_first(st, stats_vec, step),
    )
    with tf.control_dependencies([written]):
        count = tf.where(repeat, pos[1] + 1, tf.constant(1, tf.int64))
        updates = [
            at.assign(tf.where(written, tf.stack([step, count]), pos)),
            last.assign(tf.where(written, stats_vec, prev)),
        ]
    with tf.control_dependencies(updates):
        return tf.identity(written)


def _write_first(st: TagState, stats_vec: tf.Tensor, step: tf.Tensor) -> tf.Tensor:
    """A record under the tag; the full metadata with the tag's first record,
    the compact one (``_compact_metadata``) with every later one."""
    pending = st.var("metadata_pending", True)
    meta = tf.where(pending, st.serialized_metadata, st.later_metadata)
    written = tf.summary.write(st.tag, stats_vec, step=step, metadata=meta)
    with tf.control_dependencies([written]):
        # Only a record that was actually written clears the flag.
        update = pending.assign(tf.logical_and(pending, tf.logical_not(written)))
    with tf.control_dependencies([update]):
        return tf.identity(written)


def _write_repeat(
    st: TagState, stats_vec: tf.Tensor, step: tf.Tensor, prev: tf.Tensor, count: tf.Tensor
) -> tf.Tensor:
    """A record of a step that already has one under the tag (micro-batches,
    a loop body), as a packed event (format 3) under ``st.repeat_tag``.

    TensorBoard's Rust data server keeps one event per tag and step (a
    second one preempts the first), so the record cannot go under the tag
    itself. The event's rows hold the true step; its event step counts the
    repeat events, so that no repeat preempts another. The step's first
    repeat event also carries the step's first record: a reader that merges
    the tag's parts keeps a step's records from the part written last,
    which then holds them all, in order. Every repeat event carries the
    one-row table, so that each stands on its own.
    """
    events = st.var("repeat_events", np.int64(0))
    head = tf.stack([tf.constant(0.0, tf.float64), tf.cast(step, tf.float64)])
    rows = tf.stack([tf.concat([head, prev], 0), tf.concat([head, stats_vec], 0)])
    rows = rows[tf.cast(count > 1, tf.int32):]
    n = events.read_value()
    written = tf.summary.write(st.repeat_tag, rows, step=n, metadata=st.repeat_metadata)
    with tf.control_dependencies([written]):
        update = events.assign(tf.where(written, n + 1, n))
    with tf.control_dependencies([update]):
        return tf.identity(written)


def record(st: TagState, stats_vec: tf.Tensor, step: tf.Tensor, every_n: int | None) -> tf.Tensor:
    """Writes ``stats_vec`` as ``every_n`` says (``latch.decide``)."""
    if every_n is None:
        return _write(st, stats_vec, step)
    prev_step = st.var("prev_step", np.int64(latch.NO_PREVIOUS_STEP))
    prev_stats = st.var("prev_stats", np.zeros(metadata.NUM_FIELDS, np.float64))
    seen = st.var("kinds_seen", np.int64(latch.NO_KINDS))
    p_step, p_stats = prev_step.read_value(), prev_stats.read_value()
    d = latch.decide(step, p_step, _kinds(stats_vec, st.info.neginf_ok), seen.read_value(), every_n)
    no = lambda: tf.constant(False)  # noqa: E731
    wrote_prev = tf.cond(d.write_prev, lambda: _write(st, p_stats, p_step), no)
    with tf.control_dependencies([wrote_prev]):
        wrote_now = tf.cond(d.write_now, lambda: _write(st, stats_vec, step), no)
    with tf.control_dependencies([wrote_now]):
        updates = [prev_step.assign(step), prev_stats.assign(stats_vec), seen.assign(d.seen)]
    with tf.control_dependencies(updates):
        return tf.logical_or(wrote_prev, wrote_now)
