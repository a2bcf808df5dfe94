"""The summary API: ``log_numerics``, ``log_gradients`` and ``write_stats``.

They follow ``tf.summary`` conventions: they write to the default writer, at
``step`` or the default step, return whether anything was written (a bool
tensor inside ``tf.function``, as ``tf.summary.write`` does), honour an outer
``tf.summary.record_if``, and work eagerly and inside ``tf.function`` with the
same records. As with every ``tf.summary`` op, a ``tf.function`` captures the
default writer when it is traced: create the writer before the first call.

Inside a ``tf.function``, calls at the function's top level (not under a
``tf.distribute`` replica context, without ``every_n_steps``) only note
their tensor: when the trace ends, the step's records are computed together
and written packed, many steps per event, by ``step_buffer`` (one write per
step, a few kernels for all small tensors; a step with a NaN or an Inf is
on disk at once). Calls in a ``tf.cond`` or loop body are packed too, each
committed where it is (``step_buffer.StepBuffer.add_in_body``). Such a call
returns whether summaries are recorded. The other calls write their record
at once, one event per record, as follows.

Per writer and tag, small state lives in TensorFlow variables
(``_tag_writer``, created under ``tf.init_scope``, so a traced step can
update them on every call):

* whether the tag's metadata was written yet. TensorBoard reads metadata from
  the first event of a series only, so the first record of each tag carries
  the whole ``TensorInfo``; every later one carries a compact copy (plugin
  name, tensor data class, and dtype, role, order and an intended -Inf in
  the same JSON format), so that a reader that lost the first event still
  reads the rest. A later record takes 214 bytes on disk plus the tag's
  length, 81 of them the compact metadata (``neginf_ok`` adds 17);
* the step and count of the records written, and the last one: a tag logged
  again in a step (micro-batches, a loop body) writes the step's further
  records as repeats (``_write_repeat``), since TensorBoard's Rust data
  server keeps one event per tag and step;
* for ``every_n_steps``: the previous step and its statistics, and the kinds
  of non-finite values (NaN, +Inf, -Inf) this tag's records held so far
  (``latch.decide``), so that the first step of each kind and the step
  before it are written whatever N is.

The position of a tag in the step's execution order is the order in which
tags are first seen by a writer, at trace time inside ``tf.function``
(forward calls come before the gradient calls of the same step). A tag first
logged after ``log_gradients`` in the same step (the same value of the step
eagerly, the same outermost trace in a ``tf.function``) is the update's.

Under ``tf.distribute`` (inside ``strategy.run`` with more than one replica)
the replicas' statistics are combined with ``all_reduce`` before the write,
so the one record that is written (TensorFlow writes from the first replica
only) describes the values of every replica.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import threading
import weakref
from typing import Callable, Sequence

import numpy as np

from tb_numerics import _requires

tf = _requires.tensorflow(__name__)

from tb_numerics import _tag_writer, _tf_internal, metadata, stats, step_buffer  # noqa: E402
from tb_numerics.stats import global_norm_record  # noqa: E402 - its spelling here, from before stats' split

__all__ = [
    "default_role",
    "global_norm_record",
    "gradient_tag",
    "gradients_squared_by",
    "log_gradients",
    "log_numerics",
    "read_step",
    "write_stats",
]

F = metadata.FIELD_INDEX
# Set by a step guard around the user's step (see ``step_guard``).
_squared_by: contextvars.ContextVar[str] = contextvars.ContextVar("tb_numerics_squared_by", default="")


# Set by an op-level recorder of an eager step (``oplevel``): told of each
# tensor logged with ``allow_neginf``, whose op then intends its -Inf.
_neginf_intended: contextvars.ContextVar[Callable[[tf.Tensor], None] | None] = contextvars.ContextVar(
    "tb_numerics_neginf_intended", default=None)


@contextlib.contextmanager
def telling_intended_neginf(listener: Callable[[tf.Tensor], None]):
    """Inside, ``listener`` is called with each eager tensor logged with
    ``allow_neginf=True``, even where nothing is written (a replay)."""
    token = _neginf_intended.set(listener)
    try:
        yield
    finally:
        _neginf_intended.reset(token)


# Set by a step guard around the user's step: each loss logged inside
# (role "loss"), which the guard's gate holds to be finite too.
_losses_logged: contextvars.ContextVar[list | None] = contextvars.ContextVar("tb_numerics_losses", default=None)


@contextlib.contextmanager
def watching_losses():
    """Inside, every tensor logged with role "loss" (and no intended -Inf) is
    appended to the list this yields, as it was given to ``log_numerics``."""
    losses: list = []
    token = _losses_logged.set(losses)
    try:
        yield losses
    finally:
        _losses_logged.reset(token)


@contextlib.contextmanager
def gradients_squared_by(optimizer_name: str):
    """Gradient tags first logged inside say that ``optimizer_name`` squares
    them (``TensorInfo.squared_by``, for the square-overflow warning)."""
    token = _squared_by.set(optimizer_name)
    try:
        yield
    finally:
        _squared_by.reset(token)


class _WriterState:
    def __init__(self):
        self.tags: dict[str, _tag_writer.TagState] = {}
        self.writer_id = os.urandom(4).hex()
        # Where log_gradients was last called (see _position): tags first
        # seen after it in the same step are in the update phase.
        self.gradients_at: tuple | None = None
        self.buffer: step_buffer.StepBuffer | None = None


_lock = threading.Lock()
_writers: "weakref.WeakKeyDictionary[object, _WriterState]" = weakref.WeakKeyDictionary()


def _writer_state(writer) -> _WriterState:
    with _lock:
        ws = _writers.get(writer)
        if ws is None:
            ws = _writers[writer] = _WriterState()
        return ws


def _tag_state(writer, tag: str, make_info: Callable[[int], metadata.TensorInfo]) -> _tag_writer.TagState:
    """The writer's state of ``tag``; ``make_info(order)`` makes the info of a new tag."""
    ws = _writer_state(writer)
    with _lock:
        st = ws.tags.get(tag)
        if st is None:
            st = ws.tags[tag] = _tag_writer.TagState(tag, make_info(len(ws.tags)), ws.writer_id)
        return st


def _packed(writer, step: tf.Tensor, every_n: int | None, items: list, norm=None) -> tf.Tensor | None:
    """Hands a call's records to the writer's ``step_buffer`` where it takes
    them: eagerly or at a traced step's top level, without ``every_n`` or a
    replica context. Returns whether summaries are recorded; None where the
    call must write its records itself.

    ``items`` are (tag state, tensor, dtype); ``norm`` (tag state, dtype)
    adds the global norm of their records.
    """
    if every_n is not None or stats.replica_context() is not None:
        return None
    graph = step_buffer.traced_step_graph()
    body = None if graph is not None else step_buffer.traced_body_graph()
    if graph is None and body is None and not tf.executing_eagerly():
        return None
    record = tf.summary.should_record_summaries()
    buf = _step_buffer(writer)
    index = [buf.index_of(st.tag, st.info) for st, _, _ in items]
    norm_index = None if norm is None else buf.index_of(norm[0].tag, norm[0].info)
    if graph is not None or body is not None:
        entries = [step_buffer.Entry(i, step, record, x=x, dtype=dt) for i, (_, x, dt) in zip(index, items)]
        if norm is not None:
            combine = lambda vecs: global_norm_record(vecs, norm[1])  # noqa: E731
            entries.append(step_buffer.Entry(norm_index, step, record, parts=tuple(range(len(items))), combine=combine))
        if graph is not None:
            buf.add(graph, entries)
        else:
            buf.add_in_body(entries)
        return record
    if not bool(record):
        return record
    vecs = [stats.tensor_stats(x, st.tag) for st, x, _ in items]
    if norm is not None:
        vecs.append(global_norm_record(tf.stack(vecs), norm[1]))
        index.append(norm_index)
    for i, v in zip(index, vecs):
        buf.add_eager(i, int(step), v.numpy())
    return record


def _step_buffer(writer) -> step_buffer.StepBuffer:
    ws = _writer_state(writer)
    with _lock:
        if ws.buffer is None:
            ws.buffer = step_buffer.StepBuffer(writer, ws.writer_id)
        return ws.buffer


def _position(step: tf.Tensor) -> tuple:
    """Which step a call belongs to, as far as the Python side can tell:
    the step's value when eager; inside ``tf.function``, the outermost
    function being traced (one trace is one step's code)."""
    if tf.executing_eagerly():
        return ("eager", int(step))
    graph = tf.compat.v1.get_default_graph()
    while isinstance(getattr(graph, "outer_graph", None), type(graph)):
        graph = graph.outer_graph
    return ("graph", weakref.ref(graph))


def read_step(step) -> tf.Tensor:
    """``step`` (an int, a tensor, a ``tf.Variable`` or a Keras variable) as
    an int64 tensor read here, where the call is, as ``tf.summary.write``
    reads it.

    A variable step is read at the call, ordered by automatic control
    dependencies before a later ``assign_add`` in the same step function;
    what is computed later from the returned tensor (a packed record made
    when the trace ends) keeps the value the call saw. ``tf.cast`` alone
    returns an int64 variable unchanged, to be read wherever it is used:
    one step late.
    """
    return tf.cast(tf.convert_to_tensor(step), tf.int64)


def _resolve_step(step) -> tf.Tensor:
    if step is None:
        step = tf.summary.experimental.get_step()
        if step is None:
            raise ValueError(
                "No step set. Pass step= or call tf.summary.experimental.set_step()"
            )
    return read_step(step)


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


# Graph ops whose output is a ReLU-like activation, by the function's name
# (the dead-units rule calls only such outputs dead).
_ACTIVATION_OPS = {"Relu": "relu", "Relu6": "relu6", "LeakyRelu": "leaky_relu", "Elu": "elu", "Selu": "selu"}
_NARROW_DTYPES = (tf.float16, tf.bfloat16)


def _producer(x: tf.Tensor):
    """The graph op that made ``x``, through identities; None eagerly (an
    eager tensor keeps no op)."""
    op = getattr(x, "op", None)
    for _ in range(4):
        if op is None or op.type not in ("Identity", "IdentityN") or not op.inputs:
            break
        op = op.inputs[0].op
    return op


def _graph_facts(x: tf.Tensor, dtype: str, compute_dtype: str | None) -> tuple[str, str]:
    """(activation, compute dtype) of ``x`` as the graph tells them: a
    ReLU-family op's function, and the dtype of a ``Cast`` from float16 or
    bfloat16 (a float16 MatMul's gradient cast to a float32 variable's
    dtype), unless the caller named ``compute_dtype``; "" where unknown or
    not narrower than ``dtype``."""
    op = _producer(x)
    activation = _ACTIVATION_OPS.get(op.type, "") if op is not None else ""
    if compute_dtype is None and op is not None and op.type == "Cast" and op.inputs[0].dtype in _NARROW_DTYPES:
        compute_dtype = op.inputs[0].dtype.name
    # Only a narrower range than the record's own holds the tensor tighter.
    narrower = compute_dtype and metadata.DTYPE_LIMITS[compute_dtype][0] < metadata.DTYPE_LIMITS[dtype][0]
    return activation, compute_dtype if narrower else ""


def _check_compute_dtype(compute_dtype: str | None) -> str | None:
    if compute_dtype is not None and compute_dtype not in metadata.DTYPE_LIMITS:
        raise ValueError("compute_dtype must be one of %s, got %r" % (", ".join(metadata.DTYPE_LIMITS), compute_dtype))
    return compute_dtype


def _info_for(x: tf.Tensor, role: str, description: str | None, dtype: str, neginf_ok: bool = False,
              compute_dtype: str | None = None, squared_by: str = ""):
    shape = None if x.shape.rank is None else tuple(x.shape.as_list())
    activation, compute = _graph_facts(x, dtype, compute_dtype)

    def make(order: int) -> metadata.TensorInfo:
        return metadata.TensorInfo(
            dtype=dtype, shape=shape, role=role, order=order, op_type="",
            description=description or "", neginf_ok=neginf_ok, activation=activation, compute_dtype=compute,
            squared_by=squared_by,
        )

    return make


def _combine(vec: tf.Tensor) -> tf.Tensor:
    """The record of all replicas' values inside ``strategy.run``; else ``vec``."""
    ctx = stats.replica_context()
    return vec if ctx is None else stats.all_reduce_stats(vec, ctx)


def _emit(records: list[tuple[_tag_writer.TagState, tf.Tensor]], step: tf.Tensor, every_n: int | None) -> tf.Tensor:
    """Writes records of one call where summaries are being recorded.

    Inside ``strategy.run`` with several replicas the records (already
    combined by ``_combine``) are written once, from cross-replica context.
    """
    def write_all(vecs) -> tf.Tensor:
        def run() -> tf.Tensor:
            wrote = [_tag_writer.record(st, v, step, every_n) for (st, _), v in zip(records, vecs)]
            return tf.reduce_any(tf.stack(wrote))

        return _tf_internal.smart_cond(
            tf.summary.should_record_summaries(), run, lambda: tf.constant(False)
        )

    ctx = stats.replica_context()
    if ctx is None:
        return write_all([v for _, v in records])

    def merged(strategy, *per_replica):
        # All replicas hold the same combined records: write the first's.
        return write_all([strategy.experimental_local_results(v)[0] for v in per_replica])

    return ctx.merge_call(merged, args=tuple(v for _, v in records))


@tf.autograph.experimental.do_not_convert  # explicit conds; autograph's conversion of this module cost seconds per trace
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
    execution order; its ``neginf_ok`` (an intended -Inf) is what the
    ``every_n_steps`` latch applies. Inside ``strategy.run`` the replicas'
    records are combined before the one write. Returns whether a record was
    written.
    """
    every_n = _check_every_n(every_n_steps)
    _check_role(info.role)
    writer = _tf_internal.default_summary_writer()
    if writer is None:
        return tf.constant(False)
    _refuse_compiled("write_stats(%r)" % name)
    step = _resolve_step(step)
    st = _tag_state(writer, name, lambda order: dataclasses.replace(info, order=order))
    vec = _combine(tf.cast(tf.convert_to_tensor(stats_vec), tf.float64))
    return _emit([(st, vec)], step, every_n)


@tf.autograph.experimental.do_not_convert  # explicit conds; autograph's conversion of this module cost seconds per trace
def log_numerics(
    name: str,
    tensor,
    step=None,
    *,
    role: str | None = None,
    description: str | None = None,
    every_n_steps: int | None = None,
    allow_neginf: bool = False,
    compute_dtype: str | None = None,
) -> bool | tf.Tensor:
    """Records the numerics of a float tensor under tag ``name``.

    Args:
      name: the tag.
      tensor: a float16, bfloat16, float32 or float64 tensor.
      step: the step; by default ``tf.summary.experimental.get_step()``.
      role: what the tensor is (``metadata.ROLES``). By default "update"
        where the tag is first logged after ``log_gradients`` in the same
        step (a clipped norm in the optimizer's update), else "loss" when
        the last component of ``name`` contains "loss", else "activation".
        "input" for the batch as it arrived (phase input, before every layer).
      description: shown with the tensor.
      every_n_steps: write a record at steps that are multiples of N, and
        also at the first step where the tensor is non-finite and the step
        logged before it (``latch.decide``).
      allow_neginf: -Inf is intended in this tensor (an attention mask): it
        is no anomaly, and not the latch's first non-finite step. Kept in the
        tag's metadata, so every reader applies it. A NaN or +Inf still counts.
      compute_dtype: the dtype the tensor was computed in, where it was cast
        before the call (a float16 output cast to float32): the safe range
        and headroom rules hold it to that dtype's range. By default the
        input's dtype of a ``Cast`` from float16 or bfloat16 inside a
        ``tf.function``, else the tensor's dtype.

    Returns:
      Whether a record was written; at the top level of a ``tf.function``
      (packed with the step's others, see the module's docstring), whether
      summaries are recorded.

    Raises:
      TypeError: ``tensor`` is not float16, bfloat16, float32 or float64.
      ValueError: ``compute_dtype`` is not one of those.
      RuntimeError: called, with a default writer, inside a ``jit_compile=True``
        function, where no summary can be written (``xla.CompiledStats``).
    """
    every_n = _check_every_n(every_n_steps)
    compute_dtype = _check_compute_dtype(compute_dtype)
    if role is not None:
        _check_role(role)
    x = tf.convert_to_tensor(tensor)
    dtype = stats.check_dtype(x, name)
    listener = _neginf_intended.get()
    if allow_neginf and listener is not None and tf.executing_eagerly():
        listener(x)
    writer = _tf_internal.default_summary_writer()
    if writer is None:
        return tf.constant(False)
    _refuse_compiled("log_numerics(%r)" % name)
    step = _resolve_step(step)
    if role is None:
        after_gradients = _writer_state(writer).gradients_at == _position(step)
        role = "update" if after_gradients else default_role(name)
    losses = _losses_logged.get()
    if losses is not None and role == "loss" and not allow_neginf:
        losses.append(x)
    st = _tag_state(writer, name, _info_for(x, role, description, dtype, bool(allow_neginf), compute_dtype))
    record = _packed(writer, step, every_n, [(st, x, dtype)])
    if record is not None:
        return record

    def compute_and_emit() -> tf.Tensor:
        return _emit([(st, _combine(stats.tensor_stats(x, name)))], step, every_n)

    return _gated_compute(compute_and_emit)


def _refuse_compiled(call: str) -> None:
    """Raises where the graph being traced is compiled by XLA (``jit_compile=True``):
    no summary op runs there, and TensorFlow's own error names an op of ours."""
    if _tf_internal.in_xla_context():
        raise RuntimeError(
            "tb_numerics.%s was called inside a tf.function with jit_compile=True, where XLA compiles no "
            "summary write. Compute the records inside and write them outside: tb_numerics.xla.CompiledStats "
            "(numerics.collect({...}) in the compiled step, returned; numerics.write(records, step=...) after it), "
            "or log from a step that is not compiled" % call)


def _gated_compute(fn) -> tf.Tensor:
    """Runs ``fn`` only when summaries are recorded, so that a disabled
    ``record_if`` costs nothing. Under several replicas every replica must
    join the all-reduce, so there the gate is left to the write itself."""
    if stats.replica_context() is not None:
        return fn()
    return _tf_internal.smart_cond(tf.summary.should_record_summaries(), fn, lambda: tf.constant(False))


def gradient_tag(variable) -> str:
    """The tag of a variable's gradient: ``gradients/<variable path>``."""
    path = getattr(variable, "path", None)  # Keras 3 variables
    if not path:
        path = variable.name
        if path.endswith(":0"):
            path = path[:-2]
    return "gradients/" + path


@tf.autograph.experimental.do_not_convert  # explicit conds; autograph's conversion of this module cost seconds per trace
def log_gradients(
    grads: Sequence, variables: Sequence, step=None, *, every_n_steps: int | None = None,
    compute_dtype: str | None = None,
) -> bool | tf.Tensor:
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

    A gradient computed in float16 or bfloat16 and cast to its float32
    variable's dtype (float16 compute without loss scaling) is held to the
    range it was computed in: ``compute_dtype``, or by default, inside a
    ``tf.function``, the input dtype of the ``Cast`` that made it.

    Raises:
      ValueError: ``grads`` and ``variables`` differ in length, or
        ``compute_dtype`` is not a supported float dtype.
      TypeError: a gradient is not a float tensor.
    """
    grads, variables = list(grads), list(variables)
    if len(grads) != len(variables):
        raise ValueError(
            "log_gradients got %d gradients for %d variables" % (len(grads), len(variables))
        )
    every_n = _check_every_n(every_n_steps)
    compute_dtype = _check_compute_dtype(compute_dtype)
    pairs = []
    for g, v in reversed(list(zip(grads, variables))):
        if g is None:
            continue
        if isinstance(g, tf.IndexedSlices):
            g = g.values
        tag = gradient_tag(v)
        g = tf.convert_to_tensor(g)
        pairs.append((tag, g, stats.check_dtype(g, tag)))
    writer = _tf_internal.default_summary_writer()
    if writer is None or not pairs:
        return tf.constant(False)
    _refuse_compiled("log_gradients")
    step = _resolve_step(step)
    squared_by = _squared_by.get()
    states = [_tag_state(writer, tag, _info_for(g, "gradient", None, dt, compute_dtype=compute_dtype, squared_by=squared_by))
              for tag, g, dt in pairs]
    norm_dtype = "float64" if any(dt == "float64" for _, _, dt in pairs) else "float32"
    norm_state = _tag_state(
        writer,
        "gradients/global_norm",
        lambda order: metadata.TensorInfo(dtype=norm_dtype, shape=(), role="global_norm", order=order),
    )

    # Tags first logged after this call, in the same step, are the update's.
    _writer_state(writer).gradients_at = _position(step)
    items = [(st, g, dt) for st, (_, g, dt) in zip(states, pairs)]
    record = _packed(writer, step, every_n, items, (norm_state, norm_dtype))
    if record is not None:
        return record

    def compute_and_emit() -> tf.Tensor:
        vecs = [_combine(stats.tensor_stats(g, tag)) for tag, g, _ in pairs]
        records = list(zip(states, vecs)) + [(norm_state, global_norm_record(tf.stack(vecs), norm_dtype))]
        return _emit(records, step, every_n)

    return _gated_compute(compute_and_emit)
