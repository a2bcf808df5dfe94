"""The op-level recorder: ``OpNumerics`` (``op_numerics``) and ``replay_step``.

The op callback here picks the op outputs to record and where each record
goes; the pieces it composes are the package's other modules (see
``tb_numerics.oplevel``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from typing import Any, Callable, Collection, TypeVar

import numpy as np

from tb_numerics import _requires

tf = _requires.tensorflow(__name__)

from tb_numerics import _tf_internal, metadata, stats, summary  # noqa: E402
from tb_numerics.oplevel.flight import EagerFlight, GraphFlight, Record  # noqa: E402
from tb_numerics.oplevel.nested import NestedRecords  # noqa: E402
from tb_numerics.oplevel.record import (  # noqa: E402
    OpRecord, float_inputs, input_records_of, mark_record, op_record, passes_mask)
from tb_numerics.oplevel.record import first_bad as first_bad_of  # noqa: E402
from tb_numerics.oplevel.retrace import RUNS_PIPELINE, Retracer  # noqa: E402
from tb_numerics.oplevel.source import ForwardOp, SourceLocator  # noqa: E402
from tb_numerics.oplevel.step import Op, Step, resolve_step  # noqa: E402
from tb_numerics.oplevel.tags import OpTags, eager_site, graph_site  # noqa: E402
from tb_numerics.oplevel.write import StepWriter  # noqa: E402
from tb_numerics.records import nonfinite_count  # noqa: E402

__all__ = ["DEFAULT_SKIP_OP_TYPES", "OpNumerics", "numerics_check_failed", "op_numerics", "replay_step"]

# Op types skipped by default: they move, copy or reshape values, create
# constants or call functions (whose own ops are recorded), so they cannot be
# where a non-finite value is born, and recording them would only cost time.
# So do the elementwise ops whose output is finite wherever their inputs are
# and no larger in magnitude (ReLU and its gradient, Neg, Abs): a NaN, Inf or
# overflow-risk value there is already in an input, recorded where it was
# made; an MLP has one ReLU and one ReLU gradient per layer. TbnRecord,
# TbnRecords, TbnKeep and TbnMoved are our own record kernel's ops: their
# records of a NaN input hold a NaN.
DEFAULT_SKIP_OP_TYPES = frozenset(
    """
    BroadcastTo Concat ConcatV2 Const DebugIdentityV2 DebugNumericSummaryV2 EnsureShape
    Enter Exit ExpandDims Fill Gather GatherNd GatherV2 Identity IdentityN If LoopCond
    Merge NextIteration NoOp OnesLike Pack PartitionedCall Placeholder PlaceholderWithDefault
    PreventGradient ReadVariableOp Reshape Shape ShapeN Size Slice Snapshot Split SplitV
    Squeeze StatefulPartitionedCall StatelessIf StatelessWhile StopGradient StridedSlice
    Switch TensorListFromTensor TensorListGetItem TensorListReserve TensorListSetItem
    TensorListStack TbnKeep TbnMoved TbnRecord TbnRecords Tile Transpose Unpack VarHandleOp While ZerosLike
    Abs Neg Relu Relu6 Relu6Grad ReluGrad
    """.split()
)

# Outputs that are legitimately NaN (FusedBatchNorm's batch statistics on an
# empty batch, its reserve space): only output 0 of these op types is recorded.
_FIRST_OUTPUT_ONLY = ("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3")

FnT = TypeVar("FnT", bound=Callable[..., Any])


class OpNumerics:
    """Records the numerics of every float op output of a step.

    Use it as a context manager around one eager step (``with recorder:``),
    or as a decorator of a step function under ``@tf.function`` (each call
    is one step). ``op_numerics(...)`` is the same as ``OpNumerics(...)``.

    It composes small pieces: the op callback here picks the outputs to
    record and where each record goes (an eager op's record is kept for the
    end of the block, a traced op's is added to its graph, an op of a graph
    nested in the step gets record ops from ``NestedRecords``);
    ``SourceLocator`` and ``ForwardIndex`` (``oplevel.source``) give each op its
    source line and each gradient op its forward op; ``OpTags`` names the
    tags; ``EagerFlight`` and ``GraphFlight`` (``oplevel.flight``) are the
    flight recorders; ``StepWriter`` (``oplevel.write``) writes an eager step's
    records in one traced call; ``OpRecord`` (``oplevel.record``) is the first
    non-finite record of a step and the mark written beside it.

    One step at a time per recorder: its blocks cannot nest, and the state
    that records of nested graphs share is the recorder's.

    Args:
      flight_recorder: None records every op at every step (to the default
        summary writer). An int K keeps each op's statistics of the last K
        steps in memory (on the device for a traced step) and writes them only
        at the first step where any op output is non-finite: the failing step
        and the K-1 steps before it, and nothing else, so the mode can be left on.
      op_types: only these op types (e.g. {"Sqrt", "SqrtGrad"}); None for all.
      skip_op_types: op types never recorded; the default skips ops that only
        move, copy or reshape values, and ReLU, its gradient, Neg and Abs,
        whose outputs are finite and no larger wherever their inputs are
        (see DEFAULT_SKIP_OP_TYPES).
      name_regex: only ops whose name (graph op name, or eager scope + type)
        matches this regular expression (``re.search``).
      dtypes: only outputs of these dtypes (names, e.g. "float32").
      step: the step to record at; None uses tf.summary's default step
        (an eager block reads its value when it is entered).

    Raises:
      ValueError: ``flight_recorder`` is not a whole number >= 1, or a dtype
        is not supported.
      UnsupportedTensorFlowError: this TensorFlow lacks a hook it needs.

    Attributes:
      flight_recorder: the window K, or None for the full mode.
      first_bad: the first non-finite ``OpRecord`` of the last eager step, in
        execution order; None where that step had none.
    """

    def __init__(
        self,
        *,
        flight_recorder: int | None = None,
        op_types: Collection[str] | None = None,
        skip_op_types: Collection[str] = DEFAULT_SKIP_OP_TYPES,
        name_regex: str | None = None,
        dtypes: Collection[str] = metadata.SUPPORTED_DTYPES,
        step: Any = None,
    ):
        _tf_internal.check_supported()
        _check_arguments(flight_recorder, dtypes)
        self.flight_recorder = flight_recorder
        self.first_bad: OpRecord | None = None
        self._op_types = None if op_types is None else frozenset(op_types)
        self._skip = frozenset(skip_op_types)
        self._dtypes = frozenset(dtypes)
        self._step_arg = step
        self._local = threading.local()
        self._source = SourceLocator()
        self._tags = OpTags(name_regex)
        self._infos: dict[str, metadata.TensorInfo] = {}
        self._nested = NestedRecords()
        self._nested_site: dict[str, int] = {}  # tag -> site id in NestedRecords
        self._eager_flight = EagerFlight(flight_recorder) if flight_recorder else None
        self._step_writer = StepWriter()
        self._graph_flight = GraphFlight(flight_recorder) if flight_recorder else None
        # Replay: find the first bad op as ops run, with its inputs.
        self._inspect_inputs = False
        # What a block calls that was traced outside one, traced anew in it.
        self._retracer = Retracer(self._local)

    # ------------------------------------------------------------ public

    @property
    def triggered(self) -> bool:
        """Whether the flight recorder has met a non-finite value and written its window."""
        return any(f is not None and f.fired for f in (self._eager_flight, self._graph_flight))

    def __call__(self, fn: FnT) -> FnT:
        """Decorates a step function: each call is one recorded step."""
        if isinstance(fn, tf.types.experimental.PolymorphicFunction):
            raise TypeError(
                "apply op_numerics under tf.function, not over it: "
                "@tf.function then @recorder, so the step is instrumented when it is traced"
            )

        @functools.wraps(fn)
        def step_fn(*args, **kwargs):
            with self:
                return fn(*args, **kwargs)

        return step_fn  # type: ignore[return-value]

    def __enter__(self) -> "OpNumerics":
        if getattr(self._local, "step", None) is not None:
            raise RuntimeError("op_numerics steps cannot be nested")
        graph = None
        if not tf.executing_eagerly():
            if _tf_internal.in_xla_context():
                raise _xla_error()
            graph = tf.compat.v1.get_default_graph()
        st = Step(graph, resolve_step(self._step_arg, graph, bool(self.flight_recorder)))
        if graph is None:
            self._nested.open_block()
        self._local.step = st
        self._local.busy = False
        self._local.neginf = summary.telling_intended_neginf(self._intended_neginf)
        self._local.neginf.__enter__()
        _tf_internal.acquire_gradient_hook()
        _tf_internal.acquire_routes(self._retracer.call, self._retracer.iterate, self._retracer.variant)
        _tf_internal.add_op_callback(self._callback)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        st = self._local.step
        self._local.step = None
        self._local.neginf.__exit__(None, None, None)
        _tf_internal.remove_op_callback(self._callback)
        _tf_internal.release_routes()
        _tf_internal.release_gradient_hook()
        if st.graph is None:
            self._nested.close_block()
        # An eager step that failed still writes what it saw before the error.
        if exc_type is None or st.graph is None:
            self._local.busy = True
            try:
                self._finish(st)
            finally:
                self._local.busy = False

    # ------------------------------------------------------------ ops

    def _callback(self, op_type, inputs, attrs, outputs, op_name=None, graph=None):
        """The op callback: picks the outputs to record and records them."""
        st = getattr(self._local, "step", None)
        if st is None or self._local.busy or not outputs:
            return None
        # Eager ops run through execute() report their type as bytes.
        op_type = op_type.decode() if isinstance(op_type, bytes) else op_type
        if graph is None and op_type in RUNS_PIPELINE:
            st.function_ran = True  # the pipeline's functions ran: their records come first
        if self._inspect_inputs and graph is None:  # a replay: name what each op makes
            made_by = _tf_internal.eager_scope_name() + op_type
            st.producers.update((id(t), (made_by, t)) for t in outputs if t is not None)
        if graph is None and _tf_internal.is_function_call(op_type):
            # A whole traced function ran: its ops were seen when it was traced,
            # unless that was outside any block; then its outputs are recorded.
            st.function_ran = True
            st.backward_seen |= op_type.startswith("__backward_")
            if self._retracer.ops_recorded(op_type):
                return None
        if graph is not None and st.graph is None:
            self._retracer.traced_here(graph)
        if op_type in self._skip or (self._op_types is not None and op_type not in self._op_types):
            return None
        picked = [
            (slot, t)
            for slot, t in enumerate(outputs)
            if t is not None and t.dtype.name in self._dtypes
            and (slot == 0 or op_type not in _FIRST_OUTPUT_ONLY)
        ]
        if not picked:
            return None
        self._local.busy = True
        try:
            # An eager op reports the ``name=`` its caller passed (Keras'
            # BatchNormalization names its moments so): it has no graph op name.
            name = op_name if graph is not None else None
            return self._record(st, Op(op_type, name, graph, inputs, outputs), picked)
        finally:
            self._local.busy = False

    def _record(self, st: Step, op: Op, picked) -> list | None:
        """Records the picked outputs of ``op``; returns the op's new outputs, if any."""
        own_graph = op.graph is None or op.graph is st.graph
        if op.graph is not None and _tf_internal.in_xla_context():
            raise _xla_error()
        if not own_graph and _tf_internal.in_loop_gradient(op.graph):
            return None  # not recordable there; the loop's forward ops are
        d = st.describe(op, own_graph, *self._source.locate())
        if op.type in RUNS_PIPELINE:  # an element of the input pipeline
            d = d._replace(role="input", where=self._retracer.pipeline_where(d.where))
        outputs, replaced = list(op.outputs), False
        for slot, tensor in picked:
            site = eager_site(d.base, d.where, slot) if op.graph is None else graph_site(
                op.graph, own_graph, op.name, slot)
            tag = self._tags.tag(site, d.base if slot == 0 else "%s:%d" % (d.base, slot))
            if not d.backward and slot == 0:
                st.forward.note(op.type, op.inputs, op.outputs, ForwardOp(tag or "", d.where))
            if tag is None:  # filtered out by name_regex
                continue
            info = self._info(tag, tensor, op.type, d.role, d.where)
            new = self._keep(st, op, own_graph, tag, tensor, info)
            if new is not None:
                outputs[slot], replaced = new, True
        return outputs if replaced else None

    def _info(self, tag: str, tensor, op_type: str, role: str, where: str) -> metadata.TensorInfo:
        info = self._infos.get(tag)
        if info is None:
            shape = tensor.shape
            info = metadata.TensorInfo(
                dtype=tensor.dtype.name,
                shape=None if shape.rank is None else tuple(shape.as_list()),
                role=role,
                order=len(self._infos),  # the writer's order replaces it
                op_type=op_type,
                description=where,
            )
            self._infos[tag] = info
        return info

    def _keep(self, st: Step, op: Op, own_graph: bool, tag: str, tensor, info) -> tf.Tensor | None:
        """Keeps one output's record where it belongs; returns its replacement, if any."""
        if op.graph is None:
            self._keep_eager(st, tag, tensor, info, op.inputs)
            return None
        if own_graph:
            st.records[tag] = (stats.op_stats(tensor, tag), info)
            return None
        if st.graph is None:  # a graph nested in an eager step: kept until the block closes
            site = self._nested_site.get(tag)
            if site is None:
                site = self._nested_site[tag] = len(self._nested.sites)
                self._nested.sites.append((tag, info))
            return self._nested.keep(op.graph, tensor, tag, site)
        if not self.flight_recorder:  # nested in a traced step: written where it runs
            def write() -> tf.Tensor:
                return summary.write_stats(tag, stats.op_stats(tensor, tag), step=st.step, info=info)

            return self._nested.attach(op.graph, tensor, write)
        row = self._nested.new_acc_row()
        st.acc_sites.append((tag, info, row))
        return self._nested.accumulate(op.graph, tensor, tag, row)

    def _keep_eager(self, st: Step, tag: str, tensor, info, inputs) -> None:
        if st.function_ran:  # nested records that ran so far come before this op
            st.nested_before, st.function_ran = self._nested.position(), False
        vec = stats.op_stats(tensor, tag)
        st.made[id(tensor)] = (tag, tensor)
        if self._inspect_inputs and st.first_bad is None and nonfinite_count(vec.numpy(), info.neginf_ok) > 0:
            names = [st.producers.get(id(t), (None,))[0] for t in inputs or ()]
            floats = float_inputs(inputs, names)
            masked = [_is_mask(st, t) for t, _ in floats]
            if passes_mask(vec.numpy(), input_records_of(floats), masked):
                st.masks[id(tensor)] = tensor  # an intended -Inf, passed on: no op of the step's making
                info = self._infos[tag] = dataclasses.replace(info, neginf_ok=True)
            else:
                st.first_bad = op_record(tag, vec, info, st.step, inputs, names, masked)
        st.eager.append(((st.nested_before, 0, len(st.eager)), tag, vec, info))

    def _intended_neginf(self, tensor) -> None:
        """``tensor`` was logged with ``allow_neginf``: the op output it is
        intends its -Inf (an attention mask added to the scores), as the
        user's tag does, so that op is not the step's first non-finite one."""
        st = getattr(self._local, "step", None)
        made = st.made.get(id(tensor)) if st is not None else None
        if made is None or made[1] is not tensor:
            return
        tag = made[0]
        info = dataclasses.replace(self._infos[tag], neginf_ok=True)
        self._infos[tag] = info
        st.eager = [(key, t, vec, info if t == tag else i) for key, t, vec, i in st.eager]
        if st.first_bad is not None and st.first_bad.tag == tag and not nonfinite_count(
                np.asarray(st.first_bad.record, np.float64), True) > 0:
            st.first_bad = None  # the next non-finite op is looked at, inputs and all

    # ------------------------------------------------------------ end of a step

    def _finish(self, st: Step) -> None:
        if st.graph is not None:
            self._finish_traced(st)
            return
        rows = list(st.eager)
        for pos, site, vec in self._nested.drain():
            tag, info = self._nested.sites[site]
            rows.append(((pos, 1, 0), tag, vec, info))
        rows.sort(key=lambda r: r[0])
        recs: list[Record] = [(tag, vec, info) for _, tag, vec, info in rows]
        self.first_bad = first_bad_of(recs, st.step, st.first_bad)
        if self._eager_flight is not None:
            written = self._eager_flight.add(st.step, recs)
        else:
            written = True
            self._step_writer.write(recs, st.step)
        if written and self.first_bad is not None and st.step is not None:
            # Which record ran first, where the tags' order cannot say (loops).
            vec, meta = mark_record(self.first_bad)
            tf.summary.write(metadata.OP_MARK_TAG, vec, step=st.step, metadata=meta)

    def _finish_traced(self, st: Step) -> None:
        recs: list[Record] = [(tag, vec, info) for tag, (vec, info) in st.records.items()]
        if st.acc_sites:
            merged = self._nested.take_acc_rows([row for _, _, row in st.acc_sites])
            recs += [(tag, merged[i], info) for i, (tag, info, _) in enumerate(st.acc_sites)]
        if not recs:
            return
        if self._graph_flight is not None:
            self._graph_flight.finish(st.step, recs)
            return
        for tag, vec, info in recs:
            summary.write_stats(tag, vec, step=st.step, info=info)


def _is_mask(st: Step, t: Any) -> bool:
    """Whether input ``t``'s -Inf is a mask's: an output that passed one on,
    or a -Inf constant the step did not compute (``where(m, s, -np.inf)``'s)."""
    if st.masks.get(id(t)) is t:
        return True
    if id(t) in st.producers or t.shape.num_elements() != 1:
        return False
    return bool(np.all(np.isneginf(t.numpy())))


def _check_arguments(flight_recorder: Any, dtypes: Collection[str]) -> None:
    if flight_recorder is not None and (
        isinstance(flight_recorder, bool) or not isinstance(flight_recorder, int) or flight_recorder < 1
    ):
        raise ValueError("flight_recorder must be a whole number of steps >= 1, got %r" % (flight_recorder,))
    bad = sorted(set(dtypes) - set(metadata.SUPPORTED_DTYPES))
    if bad:
        raise ValueError("unsupported dtypes %s; choose from %s" % (bad, list(metadata.SUPPORTED_DTYPES)))


def _xla_error() -> ValueError:
    return ValueError(
        "op_numerics cannot run inside tf.function(jit_compile=True): summary ops cannot run "
        "inside XLA, and XLA fuses ops, so per-op outputs do not exist there. Record the "
        "compiled step with log_numerics (or tb_numerics.xla.CompiledStats) and, at its first "
        "non-finite step, call tb_numerics.oplevel.replay_step(step_fn, *inputs): it runs that "
        "step once without XLA and names the op."
    )


# The documented spelling, ``tbn.op_numerics(flight_recorder=8)``: the class itself.
op_numerics = OpNumerics


def _as_tensor(x: Any) -> Any:
    """A numpy array or scalar as the tensor a ``tf.function`` call makes of it."""
    return tf.convert_to_tensor(x) if isinstance(x, (np.ndarray, np.generic)) else x


# What TensorFlow's numerics checks say when they fire: check_numerics (and
# assert_all_finite, built on it) and enable_check_numerics.
_CHECK_FIRED = ("Tensor had NaN values", "Tensor had Inf values", "Tensor had Inf and NaN values",
                "Detected Infinity or NaN")


def numerics_check_failed(error: BaseException) -> bool:
    """Whether ``error`` is a TensorFlow numerics check that found a NaN or
    an Inf (``tf.debugging.check_numerics``, ``assert_all_finite``,
    ``enable_check_numerics``): a program's own stop at a non-finite value."""
    return isinstance(error, tf.errors.InvalidArgumentError) and any(m in str(error) for m in _CHECK_FIRED)


def replay_step(
    fn: Callable[..., Any],
    *args: Any,
    step: int | None = None,
    writer: Any = None,
    recorder: OpNumerics | None = None,
    **kwargs: Any,
) -> OpRecord | None:
    """Runs ``fn(*args, **kwargs)`` once, eagerly, under op-level recording, and
    returns its first non-finite op.

    Every ``tf.function`` it calls (``fn`` itself too) runs eagerly for this
    call (``tf.config.run_functions_eagerly``), so every op, inside XLA-compiled
    functions too, is an eager op: recorded in exact execution order, with its
    inputs at hand. The op records are written to ``writer`` (else the default
    writer, if any) at ``step``. The caller owns what the step changes (its
    variables' updates, an optimizer's iteration count): replay it on a copy
    or restore the state afterwards. Numpy arrays passed to a ``tf.function``
    ``fn`` become tensors, as its trace would make them (run eagerly, their
    arithmetic would happen in numpy, unrecorded).

    Args:
      fn: the step function, e.g. a forward pass and ``tape.gradient``.
      *args, **kwargs: its inputs.
      step: the step to record at; None uses tf.summary's default step.
      writer: a ``tf.summary`` writer for the records; None for the default.
      recorder: the OpNumerics to record with (its filters); None for
        ``op_numerics()``'s defaults. It must have no flight recorder.

    Returns:
      The first op, in execution order, whose output holds a NaN or an Inf,
      with its source line, phase and its inputs' ranges at that step; None
      where every recorded op output was finite.

    Raises:
      ValueError: ``recorder`` has a flight recorder.
      Whatever ``fn`` raises (the records made before it are still written),
      but a numerics check of the program's own (``tf.debugging.check_numerics``,
      ``assert_all_finite``) that fired after the first non-finite op was
      recorded: that op is returned, the check having found what it made.
    """
    recorder = recorder or OpNumerics(step=step)
    if recorder.flight_recorder:
        raise ValueError("replay_step records every op of the step: pass a recorder without flight_recorder")
    step_before = recorder._step_arg  # noqa: SLF001 - this call's step
    if step is not None:
        recorder._step_arg = step  # noqa: SLF001
    if isinstance(fn, tf.types.experimental.PolymorphicFunction):
        # As its trace would have: run eagerly, numpy arrays would stay numpy
        # and their arithmetic happen outside TensorFlow, unrecorded.
        args, kwargs = tf.nest.map_structure(_as_tensor, (args, kwargs))
    eager_before = tf.config.functions_run_eagerly()
    tf.config.run_functions_eagerly(True)
    recorder._inspect_inputs = True  # noqa: SLF001
    try:
        with writer.as_default() if writer is not None else contextlib.nullcontext(), recorder:
            fn(*args, **kwargs)
    except tf.errors.InvalidArgumentError as e:
        if recorder.first_bad is None or not numerics_check_failed(e):
            raise
    finally:
        recorder._inspect_inputs = False  # noqa: SLF001
        recorder._step_arg = step_before  # noqa: SLF001
        tf.config.run_functions_eagerly(eager_before)
    return recorder.first_bad
