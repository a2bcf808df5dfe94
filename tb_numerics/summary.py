"""The summary API: ``log_numerics``, ``log_gradients`` and ``write_stats``.

They follow ``tf.summary`` conventions: they write to the default writer, at
``step`` or the default step, return whether anything was written (a bool
tensor inside ``tf.function``, as ``tf.summary.write`` does), honour an outer
``tf.summary.record_if``, and work eagerly and inside ``tf.function`` with the
same records. As with every ``tf.summary`` op, a ``tf.function`` captures the
default writer when it is traced: create the writer before the first call.

Per writer and tag, small state lives in TensorFlow variables (created under
``tf.init_scope``, so a traced step can update them on every call):

* whether the tag's metadata was written yet. TensorBoard reads metadata from
  the first event of a series only, and TensorFlow's writer stores whatever
  metadata it is given in every event, so only the first record of each tag
  carries it (a later record takes 133 bytes on disk plus the tag's length:
  the 88 bytes of the float64 vector, the event's wall time, step and
  framing);
* for ``every_n_steps``: the previous step and its statistics, and whether
  this tag already had a non-finite record, so that the first non-finite step
  and the last step before it are written whatever N is.

The position of a tag in the step's execution order is the order in which
tags are first seen by a writer, at trace time inside ``tf.function``
(forward calls come before the gradient calls of the same step).

Under ``tf.distribute`` (inside ``strategy.run`` with more than one replica)
the replicas' statistics are combined with ``all_reduce`` before the write,
so the one record that is written (TensorFlow writes from the first replica
only) describes the values of every replica.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Sequence

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import smart_cond
from tensorflow.python.ops import summary_ops_v2

from tb_numerics import _tf_internal, metadata, stats

F = metadata.FIELD_INDEX
_NONFINITE = [F["nan"], F["posinf"], F["neginf"]]


class _TagState:
    """What one writer remembers about one tag."""

    def __init__(self, tag: str, info: metadata.TensorInfo):
        self.tag = tag
        self.serialized_metadata = metadata.create_summary_metadata(info).SerializeToString()
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


class _WriterState:
    def __init__(self):
        self.tags: dict[str, _TagState] = {}


_lock = threading.Lock()
_writers: "weakref.WeakKeyDictionary[object, _WriterState]" = weakref.WeakKeyDictionary()


def _default_writer():
    # tf.summary has no public getter for the default writer; the per-writer
    # state (first-record metadata, execution order) needs its identity.
    return summary_ops_v2._summary_state.writer  # pylint: disable=protected-access


def _tag_state(writer, tag: str, make_info) -> _TagState:
    with _lock:
        ws = _writers.get(writer)
        if ws is None:
            ws = _writers[writer] = _WriterState()
        st = ws.tags.get(tag)
        if st is None:
            st = ws.tags[tag] = _TagState(tag, make_info(len(ws.tags)))
        return st


def _resolve_step(step) -> tf.Tensor:
    if step is None:
        step = tf.summary.experimental.get_step()
        if step is None:
            raise ValueError(
                "No step set. Pass step= or call tf.summary.experimental.set_step()"
            )
    return tf.cast(step, tf.int64)


def default_role(name: str) -> str:
    """"loss" if the last path component of ``name`` mentions loss, else "activation"."""
    return "loss" if "loss" in name.rsplit("/", 1)[-1].lower() else "activation"


def _check_role(role: str) -> str:
    if role not in metadata.ROLES:
        raise ValueError("role must be one of %s, got %r" % (", ".join(metadata.ROLES), role))
    return role


def _check_every_n(every_n_steps: int | None) -> int | None:
    if every_n_steps is None:
        return None
    if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, (int, np.integer)) or every_n_steps < 1:
        raise ValueError("every_n_steps must be a positive integer, got %r" % (every_n_steps,))
    return int(every_n_steps)


def _info_for(x: tf.Tensor, role: str, description: str | None, dtype: str):
    shape = None if x.shape.rank is None else tuple(x.shape.as_list())

    def make(order: int) -> metadata.TensorInfo:
        return metadata.TensorInfo(
            dtype=dtype, shape=shape, role=role, order=order, op_type="",
            description=description or "",
        )

    return make


def _write(st: _TagState, stats_vec: tf.Tensor, step: tf.Tensor) -> tf.Tensor:
    """One record of ``st.tag``; metadata with the tag's first record only."""
    pending = st.var("metadata_pending", True)
    meta = tf.where(pending, st.serialized_metadata, b"")
    written = tf.summary.write(st.tag, stats_vec, step=step, metadata=meta)
    with tf.control_dependencies([written]):
        # Only a record that was actually written clears the flag.
        update = pending.assign(tf.logical_and(pending, tf.logical_not(written)))
    with tf.control_dependencies([update]):
        return tf.identity(written)


def _record(st: _TagState, stats_vec: tf.Tensor, step: tf.Tensor, every_n: int | None) -> tf.Tensor:
    if every_n is None:
        return _write(st, stats_vec, step)
    prev_step = st.var("prev_step", np.int64(-1))
    prev_stats = st.var("prev_stats", np.zeros(metadata.NUM_FIELDS, np.float64))
    latched = st.var("latched", False)
    nonfinite = tf.reduce_sum(tf.gather(stats_vec, _NONFINITE)) > 0
    first_bad = tf.logical_and(nonfinite, tf.logical_not(latched))
    regular = tf.equal(step % every_n, 0)
    p_step = prev_step.read_value()
    # The last step before the first bad one, unless it was written already.
    write_prev = tf.logical_and(
        first_bad,
        tf.logical_and(p_step >= 0, tf.logical_and(tf.not_equal(p_step % every_n, 0), p_step < step)),
    )
    no = lambda: tf.constant(False)  # noqa: E731
    wrote_prev = tf.cond(write_prev, lambda: _write(st, prev_stats.read_value(), p_step), no)
    with tf.control_dependencies([wrote_prev]):
        wrote_now = tf.cond(tf.logical_or(regular, first_bad), lambda: _write(st, stats_vec, step), no)
    with tf.control_dependencies([wrote_now]):
        updates = [
            prev_step.assign(step),
            prev_stats.assign(stats_vec),
            latched.assign(tf.logical_or(latched, nonfinite)),
        ]
    with tf.control_dependencies(updates):
        return tf.logical_or(wrote_prev, wrote_now)


def _combine(vec: tf.Tensor) -> tf.Tensor:
    """The record of all replicas' values inside ``strategy.run``; else ``vec``."""
    ctx = stats.replica_context()
    return vec if ctx is None else stats.all_reduce_stats(vec, ctx)


def _emit(records: list[tuple[_TagState, tf.Tensor]], step: tf.Tensor, every_n: int | None) -> tf.Tensor:
    """Writes records of one call where summaries are being recorded.

    Inside ``strategy.run`` with several replicas the records (already
    combined by ``_combine``) are written once, from cross-replica context.
    """
    def write_all(vecs) -> tf.Tensor:
        def run() -> tf.Tensor:
            wrote = [_record(st, v, step, every_n) for (st, _), v in zip(records, vecs)]
            return tf.reduce_any(tf.stack(wrote))

        return smart_cond.smart_cond(
            tf.summary.should_record_summaries(), run, lambda: tf.constant(False)
        )

    ctx = stats.replica_context()
    if ctx is None:
        return write_all([v for _, v in records])

    def merged(strategy, *per_replica):
        # All replicas hold the same combined records: write the first's.
        return write_all([strategy.experimental_local_results(v)[0] for v in per_replica])

    return ctx.merge_call(merged, args=tuple(v for _, v in records))


def write_stats(
    name: str,
    stats_vec,
    step=None,
    *,
    info: metadata.TensorInfo,
    every_n_steps: int | None = None,
) -> bool | tf.Tensor:
    """Writes an already-computed record (from ``stats.tensor_stats``).

    For statistics computed elsewhere, e.g. inside a ``jit_compile``'d step
    where summary ops cannot run. The writer keeps the first ``info`` it sees
    for a tag, with ``order`` replaced by the tag's position in the writer's
    execution order. Inside ``strategy.run`` the replicas' records are
    combined before the one write. Returns whether a record was written.
    """
    every_n = _check_every_n(every_n_steps)
    _check_role(info.role)
    writer = _default_writer()
    if writer is None:
        return tf.constant(False)
    step = _resolve_step(step)
    st = _tag_state(writer, name, lambda order: dataclasses.replace(info, order=order))
    vec = _combine(tf.cast(tf.convert_to_tensor(stats_vec), tf.float64))
    return _emit([(st, vec)], step, every_n)


def log_numerics(
    name: str,
    tensor,
    step=None,
    *,
    role: str | None = None,
    description: str | None = None,
    every_n_steps: int | None = None,
) -> bool | tf.Tensor:
    """Records the numerics of a float tensor under tag ``name``.

    ``role`` defaults to "loss" when the last component of ``name`` contains
    "loss", else "activation". With ``every_n_steps=N`` a record is written
    at steps that are multiples of N, and also at the first step where the
    tensor is non-finite and at the step logged before it. Returns whether a
    record was written.

    Raises:
      TypeError: ``tensor`` is not float16, bfloat16, float32 or float64.
    """
    every_n = _check_every_n(every_n_steps)
    role = _check_role(default_role(name) if role is None else role)
    x = tf.convert_to_tensor(tensor)
    dtype = stats.check_dtype(x, name)
    writer = _default_writer()
    if writer is None:
        return tf.constant(False)
    step = _resolve_step(step)
    st = _tag_state(writer, name, _info_for(x, role, description, dtype))

    def compute_and_emit() -> tf.Tensor:
        return _emit([(st, _combine(stats.tensor_stats(x, name)))], step, every_n)

    return _gated_compute(compute_and_emit)


def _gated_compute(fn) -> tf.Tensor:
    """Runs ``fn`` only when summaries are recorded, so that a disabled
    ``record_if`` costs nothing. Under several replicas every replica must
    join the all-reduce, so there the gate is left to the write itself."""
    if stats.replica_context() is not None:
        return fn()
    return smart_cond.smart_cond(tf.summary.should_record_summaries(), fn, lambda: tf.constant(False))


def gradient_tag(variable) -> str:
    """The tag of a variable's gradient: ``gradients/<variable path>``."""
    path = getattr(variable, "path", None)  # Keras 3 variables
    if not path:
        path = variable.name
        if path.endswith(":0"):
            path = path[:-2]
    return "gradients/" + path


def log_gradients(grads: Sequence, variables: Sequence, step=None, *, every_n_steps: int | None = None) -> bool | tf.Tensor:
    """Records each gradient's numerics and the global gradient norm.

    One record per non-``None`` gradient, tagged ``gradients/<variable
    path>`` with role "gradient", in backward order (the reverse of
    ``variables``, as backpropagation computes the last layer's gradient
    first), then ``gradients/global_norm`` (role "global_norm"): the L2 norm
    of all gradients together, NaN or Inf where any element is (as
    ``tf.linalg.global_norm``), computed from the per-gradient sums. ``None``
    gradients are skipped; for a ``tf.IndexedSlices`` gradient the statistics
    are those of its ``values`` (the rows it touches). Returns whether a record
    was written.

    Raises:
      ValueError: ``grads`` and ``variables`` differ in length.
      TypeError: a gradient is not a float tensor.
    """
    grads, variables = list(grads), list(variables)
    if len(grads) != len(variables):
        raise ValueError(
            "log_gradients got %d gradients for %d variables" % (len(grads), len(variables))
        )
    every_n = _check_every_n(every_n_steps)
    pairs = []
    for g, v in reversed(list(zip(grads, variables))):
        if g is None:
            continue
        if isinstance(g, tf.IndexedSlices):
            g = g.values
        tag = gradient_tag(v)
        g = tf.convert_to_tensor(g)
        pairs.append((tag, g, stats.check_dtype(g, tag)))
    writer = _default_writer()
    if writer is None or not pairs:
        return tf.constant(False)
    step = _resolve_step(step)
    states = [_tag_state(writer, tag, _info_for(g, "gradient", None, dt)) for tag, g, dt in pairs]
    norm_dtype = "float64" if any(dt == "float64" for _, _, dt in pairs) else "float32"
    norm_state = _tag_state(
        writer,
        "gradients/global_norm",
        lambda order: metadata.TensorInfo(dtype=norm_dtype, shape=(), role="global_norm", order=order),
    )

    def compute_and_emit() -> tf.Tensor:
        vecs = [_combine(stats.tensor_stats(g, tag)) for tag, g, _ in pairs]
        norm = global_norm_of_stats(tf.stack(vecs), norm_dtype)
        records = list(zip(states, vecs)) + [(norm_state, stats.tensor_stats(norm, "global_norm"))]
        return _emit(records, step, every_n)

    return _gated_compute(compute_and_emit)


def global_norm_of_stats(vecs: tf.Tensor, dtype: str) -> tf.Tensor:
    """The global L2 norm of tensors from their records ``vecs`` [n, F].

    sqrt of the summed squares; NaN if any element is NaN, else Inf if any
    is Inf (as ``tf.linalg.global_norm``), with no extra pass over the data.
    """
    nan = tf.reduce_sum(vecs[:, F["nan"]])
    inf = tf.reduce_sum(vecs[:, F["posinf"]] + vecs[:, F["neginf"]])
    norm = tf.sqrt(tf.reduce_sum(vecs[:, F["sum_sq"]]))
    norm = tf.where(nan > 0, tf.constant(np.nan, tf.float64), tf.where(inf > 0, tf.constant(np.inf, tf.float64), norm))
    return tf.cast(norm, dtype)
