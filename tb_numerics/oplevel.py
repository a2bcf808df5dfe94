"""Op-level numerics: the exact op, its type and source line, where values go bad.

The layer-level API records the tensors a user names. ``op_numerics`` records
every floating-point op output of a training step without the user naming
anything, forward ops and the gradient ops the tape builds alike::

    recorder = tbn.op_numerics()              # or op_numerics(flight_recorder=8)

    @tf.function                              # optional: works eagerly too
    @recorder                                 # each call is one step
    def train_step(x, y):
        ...

    # or, around an eager step:
    with recorder:
        train_step_eager(x, y)

Each op output becomes an ordinary numerics record under the tag
``ops/<op name>`` (the graph op name in a ``tf.function``, ``<name
scope><OpType>`` eagerly), with ``TensorInfo.op_type`` the op type,
``TensorInfo.order`` its position in the step and ``TensorInfo.description``
the user's source line that created it (``file:line (function)``; for a
gradient op, the line of the forward op it differentiates). Ops built inside
the gradient computation have role "gradient" (backward phase); ops created
after it, such as the optimizer's, role "weight" (update phase); all others
role "activation" (forward phase). So the analysis core's "first anomaly"
names the first op, in execution order, whose output left the safe range.

The record is ``stats.op_stats``, lighter than the layer-level
``tensor_stats`` because it runs on every op output. Count, NaN / +Inf /
-Inf counts, min, max and the overflow count are the same (exact); **sum and
sum of squares are not computed and are always NaN** (so mean, std and L2
norm read as NaN, "not recorded"), and **the zero and underflow counts are
not computed and are always 0** (0 keeps the counts valid; no underflow
warning is ever raised from an op-level record). Naming the op where a
value first goes NaN/Inf or beyond the overflow margin needs none of them,
and each cost every op output another pass over its values (zeros and
underflow, elementwise ones, in every tensor holding a zero); left out, a
typical op output costs two reductions. For those statistics of a tensor,
use ``log_numerics`` on it.

Like TensorFlow's ``enable_check_numerics``, it hooks op creation with op
callbacks: inside a ``tf.function`` the statistics ops are added to the graph
when it is traced, so only traces made while the recorder is active are
instrumented (put ``@recorder`` under ``@tf.function``). Under
``jit_compile=True`` it raises ``ValueError`` at trace time: summary ops
cannot run inside XLA, and XLA fuses ops so their outputs do not exist.
"""

from __future__ import annotations

import collections
import functools
import importlib.util
import logging
import os
import re
import sysconfig
import threading
from typing import Any, Callable, Collection, Iterable, TypeVar

import numpy as np
import tensorflow as tf

from tb_numerics import _tf_internal, metadata, stats, summary

_log = logging.getLogger(__name__)

TAG_PREFIX = "ops/"

# Op types skipped by default: they move, copy or reshape values, create
# constants or call functions (whose own ops are recorded), so they cannot be
# where a non-finite value is born, and recording them would only cost time.
# So do the elementwise ops whose output is finite wherever their inputs are
# and no larger in magnitude (ReLU and its gradient, Neg, Abs): a NaN, Inf or
# overflow-risk value there is already in an input, recorded where it was
# made; an MLP has one ReLU and one ReLU gradient per layer.
DEFAULT_SKIP_OP_TYPES = frozenset(
    """
    BroadcastTo Concat ConcatV2 Const DebugIdentityV2 DebugNumericSummaryV2 EnsureShape
    Enter Exit ExpandDims Fill Gather GatherNd GatherV2 Identity IdentityN If LoopCond
    Merge NextIteration NoOp OnesLike Pack PartitionedCall Placeholder PlaceholderWithDefault
    PreventGradient ReadVariableOp Reshape Shape ShapeN Size Slice Snapshot Split SplitV
    Squeeze StatefulPartitionedCall StatelessIf StatelessWhile StopGradient StridedSlice
    Switch Tile Transpose Unpack VarHandleOp While ZerosLike
    Abs Neg Relu Relu6 Relu6Grad ReluGrad
    """.split()
)

# Outputs that are legitimately NaN (FusedBatchNorm's batch statistics on an
# empty batch, its reserve space): only output 0 of these op types is recorded.
_FIRST_OUTPUT_ONLY = ("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3")

_BACKWARD_NAME = re.compile(r"(^|/)(gradient_tape|gradients(_\d+)?)/|_grad/")

_F = metadata.FIELD_INDEX
_NONFINITE = slice(_F["nan"], _F["neginf"] + 1)

FnT = TypeVar("FnT", bound=Callable[..., Any])


def _library_dirs() -> tuple[str, ...]:
    """Directories whose frames are never "the user's source line"."""
    dirs = [os.path.dirname(os.path.abspath(__file__)), sysconfig.get_paths()["stdlib"]]
    for mod in ("tensorflow", "keras", "tf_keras", "absl"):
        spec = importlib.util.find_spec(mod)
        if spec is not None and spec.submodule_search_locations:
            dirs.extend(spec.submodule_search_locations)
    return tuple(os.path.join(os.path.realpath(d), "") for d in dirs)


@functools.lru_cache(maxsize=4096)
def _is_library_file(filename: str, dirs: tuple[str, ...]) -> bool:
    if filename.startswith("<frozen") or "__autograph_generated_file" in filename:
        return True
    return os.path.realpath(filename).startswith(dirs)


def _short_path(filename: str) -> str:
    try:
        rel = os.path.relpath(filename)
    except ValueError:  # another drive on Windows
        return filename
    return filename if rel.startswith(os.pardir) else rel


class _Step:
    """What one step has recorded so far."""

    def __init__(self, graph: Any, step: Any):
        self.graph = graph  # None for an eager step, else the FuncGraph being traced
        self.step = step
        self.order = 0
        self.backward_seen = False
        self.records: dict[str, list[Any]] = {}  # tag -> [stats, info], in first-seen order
        # Forward ops, by (op type, output ids) and (op type, input ids), so a
        # gradient op can name the forward op it differentiates.
        self.forward: dict[tuple[Any, ...], tuple[str, str]] = {}


class OpNumerics:
    """Records the numerics of every float op output of a step; see ``op_numerics``.

    Use it as a context manager around one step, or as a decorator of the step
    function (each call is one step).
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
        if flight_recorder is not None and (
            isinstance(flight_recorder, bool) or not isinstance(flight_recorder, int) or flight_recorder < 1
        ):
            raise ValueError("flight_recorder must be a whole number of steps >= 1, got %r" % (flight_recorder,))
        bad = sorted(set(dtypes) - set(metadata.SUPPORTED_DTYPES))
        if bad:
            raise ValueError("unsupported dtypes %s; choose from %s" % (bad, list(metadata.SUPPORTED_DTYPES)))
        self.flight_recorder = flight_recorder
        self._op_types = None if op_types is None else frozenset(op_types)
        self._skip = frozenset(skip_op_types)
        self._name_re = None if name_regex is None else re.compile(name_regex)
        self._dtypes = frozenset(dtypes)
        self._step_arg = step
        self._local = threading.local()
        self._lib_dirs = _library_dirs()
        self._backward_frames = _tf_internal.backward_frames()
        # tag per op site, and the TensorInfo first recorded for each tag
        self._tags: dict[tuple[Any, ...], str] = {}
        self._tag_owner: dict[str, tuple[Any, ...]] = {}
        self._infos: dict[str, metadata.TensorInfo] = {}
        # flight recorder state: eager history and the "already written" flag
        self._history: collections.deque = collections.deque(maxlen=flight_recorder or 1)
        self._fired_var: tf.Variable | None = None
        self._fired = False
        self._warned_nested = False

    # ------------------------------------------------------------ public

    @property
    def triggered(self) -> bool:
        """Whether the flight recorder has met a non-finite value and written its window."""
        if self._fired:
            return True
        return self._fired_var is not None and bool(self._fired_var.numpy())

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
        self._local.step = _Step(graph, self._resolve_step(graph))
        self._local.busy = False
        _tf_internal.acquire_gradient_hook()
        _tf_internal.add_op_callback(self._callback)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        st = self._local.step
        self._local.step = None
        _tf_internal.remove_op_callback(self._callback)
        _tf_internal.release_gradient_hook()
        # An eager step that failed still writes what it saw before the error.
        if exc_type is None or st.graph is None:
            self._local.busy = True
            try:
                self._finish(st)
            finally:
                self._local.busy = False

    # ------------------------------------------------------------ step

    def _resolve_step(self, graph: Any) -> Any:
        step = self._step_arg if self._step_arg is not None else tf.summary.experimental.get_step()
        if step is None and self.flight_recorder:
            raise ValueError(
                "op_numerics needs a step: pass step=, or call tf.summary.experimental.set_step()"
            )
        return step

    def _callback(self, op_type, inputs, attrs, outputs, op_name=None, graph=None):
        """The op callback: picks the outputs to record and records them."""
        st = getattr(self._local, "step", None)
        if st is None or self._local.busy or not outputs:
            return None
        # Eager ops run through execute() report their type as bytes.
        op_type = op_type.decode() if isinstance(op_type, bytes) else op_type
        if graph is None and _tf_internal.is_function_call(op_type):
            return None  # a whole traced function: its ops were seen when it was traced
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
            self._record(st, op_type, op_name, graph, inputs, outputs, picked)
        finally:
            self._local.busy = False
        return None

    def _record(self, st: _Step, op_type, op_name, graph, inputs, outputs, picked) -> None:
        own_graph = graph is None or graph is st.graph
        if graph is not None and _tf_internal.in_xla_context():
            raise _xla_error()
        if not own_graph and self.flight_recorder:
            if not self._warned_nested:
                self._warned_nested = True
                _log.warning(
                    "op_numerics flight recorder: ops of nested functions and control-flow "
                    "branches (e.g. %s in %s) are not recorded; use the full mode to see them",
                    op_name, getattr(graph, "name", graph),
                )
            return
        user, in_backward = self._inspect_stack()
        forward_op = _tf_internal.current_forward_op()
        backward = (
            in_backward or forward_op is not None
            or (op_name is not None and _BACKWARD_NAME.search(op_name) is not None)
        )
        where = "%s:%d (%s)" % (_short_path(user[0]), user[1], user[2]) if user else ""
        fwd = self._forward_of(st, forward_op) if backward else None
        if backward:
            st.backward_seen = True
            role = "gradient"
            if fwd is not None:
                where = "%s, gradient of %s" % (fwd[1], fwd[0])
        else:
            role = "weight" if st.backward_seen else "activation"
        if op_name is not None:  # a graph op: its name is unique in its graph
            base = op_name
            site: tuple[Any, ...] = ("graph", None if own_graph else graph.name, op_name)
        else:
            scope = _tf_internal.eager_scope_name()
            if fwd is not None:
                scope = "gradient_tape/%s/" % fwd[0][len(TAG_PREFIX):]
            elif backward:
                scope = "gradient_tape/" + scope
            base = scope + op_type
            site = ("eager", base, where)
        for slot, tensor in picked:
            tag = self._tag(site + (slot,), base if slot == 0 else "%s:%d" % (base, slot))
            if not backward and slot == 0:
                self._note_forward(st, op_type, inputs, outputs, tag, where)
            if not tag:  # filtered out by name_regex
                continue
            if own_graph:
                self._add(st, tag, tensor, op_type, role, where)
            else:  # full mode, op of a nested function or branch: write it there
                info = self._info(tag, tensor, op_type, role, where, st.order)
                st.order += 1
                # The default step, not this step's value: the trace outlives this step.
                summary.write_stats(tag, stats.op_stats(tensor, tag), step=self._step_arg, info=info)

    def _inspect_stack(self) -> tuple[tuple[str, int, str] | None, bool]:
        """The user's innermost frame, and whether a gradient computation encloses it."""
        in_backward = False
        for filename, lineno, name in _tf_internal.creation_stack():
            if (filename, name) in self._backward_frames:
                in_backward = True
            if not _is_library_file(filename, self._lib_dirs):
                return (filename, lineno, name), in_backward
        return None, in_backward

    def _note_forward(self, st: _Step, op_type, inputs, outputs, tag: str, where: str) -> None:
        entry = (tag, where)
        st.forward[("out", op_type) + _ids(outputs)] = entry
        if inputs:
            st.forward.setdefault(("in", op_type) + _ids(inputs), entry)

    def _forward_of(self, st: _Step, forward_op) -> tuple[str, str] | None:
        if forward_op is None:
            return None
        op_type, inputs, outputs = forward_op
        if outputs is not None:
            hit = st.forward.get(("out", op_type) + _ids(outputs))
            if hit is not None:
                return hit
        if inputs is not None:
            return st.forward.get(("in", op_type) + _ids(inputs))
        return None

    def _tag(self, site: tuple[Any, ...], base: str) -> str:
        """The tag of an op site: stable across steps, unique per site."""
        tag = self._tags.get(site)
        if tag is None:
            if self._name_re is not None and not self._name_re.search(base):
                tag = ""
            else:
                tag = TAG_PREFIX + base
                n = 0
                while tag in self._tag_owner:
                    n += 1
                    tag = "%s%s_%d" % (TAG_PREFIX, base, n)
                self._tag_owner[tag] = site
            self._tags[site] = tag
        return tag

    def _info(self, tag, tensor, op_type, role, where, order) -> metadata.TensorInfo:
        info = self._infos.get(tag)
        if info is None:
            shape = tensor.shape
            info = metadata.TensorInfo(
                dtype=tensor.dtype.name,
                shape=None if shape.rank is None else tuple(shape.as_list()),
                role=role,
                order=order,
                op_type=op_type,
                description=where,
            )
            self._infos[tag] = info
        return info

    def _add(self, st: _Step, tag: str, tensor, op_type, role, where) -> None:
        vec = stats.op_stats(tensor, tag)
        rec = st.records.get(tag)
        if rec is not None:  # the same op again in this step (eager): aggregate
            rec[0] = stats.merge_stats(rec[0], vec)
            return
        st.records[tag] = [vec, self._info(tag, tensor, op_type, role, where, st.order)]
        st.order += 1

    def _finish(self, st: _Step) -> None:
        recs = [(tag, vec, info) for tag, (vec, info) in st.records.items()]
        if not recs:
            return
        if not self.flight_recorder:
            for tag, vec, info in recs:
                summary.write_stats(tag, vec, step=st.step, info=info)
        elif st.graph is None:
            self._finish_eager_flight(st, recs)
        else:
            self._finish_graph_flight(st, recs)

    # ------------------------------------------------------------ flight recorder

    def _finish_eager_flight(self, st: _Step, recs) -> None:
        step = int(st.step.numpy() if hasattr(st.step, "numpy") else st.step)
        self._history.append((step, recs))
        if self._fired:
            return
        bad = tf.reduce_any(tf.stack([vec for _, vec, _ in recs])[:, _NONFINITE] > 0)
        if bool(bad.numpy()):
            self._fired = True
            for s, window in self._history:
                for tag, vec, info in window:
                    summary.write_stats(tag, vec, step=s, info=info)
            self._history.clear()

    def _finish_graph_flight(self, st: _Step, recs) -> None:
        k, n = self.flight_recorder, len(recs)
        if self._fired_var is None:
            self._fired_var = _tf_internal.untracked_variable(False, "op_numerics_fired")
        # One ring buffer per trace: its shape is this trace's number of records.
        buf = _tf_internal.untracked_variable(
            np.zeros([k, n, metadata.NUM_FIELDS], np.float64), "op_numerics_window")
        steps = _tf_internal.untracked_variable(np.full([k], -1, np.int64), "op_numerics_steps")
        count = _tf_internal.untracked_variable(np.int64(0), "op_numerics_count")
        now = tf.stack([vec for _, vec, _ in recs])
        slot = tf.reshape(count % k, [1, 1])
        buf.scatter_nd_update(slot, now[None])
        steps.scatter_nd_update(slot, tf.reshape(tf.cast(st.step, tf.int64), [1]))
        count.assign_add(1)
        fired = self._fired_var

        def write_window():
            # Oldest first: the K-1 steps before the failing one, then it. A
            # loop, not K unrolled copies, keeps the trace small.
            def write_slot(j):
                s = (count - k + j) % k
                step_j, window = steps[s], buf[s]

                def write_all():
                    for i, (tag, _, info) in enumerate(recs):
                        summary.write_stats(tag, window[i], step=step_j, info=info)
                    return tf.constant(True)

                tf.cond(step_j >= 0, write_all, lambda: tf.constant(False))
                return (j + 1,)

            tf.while_loop(lambda j: j < k, write_slot, (tf.constant(0, tf.int64),))
            fired.assign(True)
            return tf.constant(True)

        bad = tf.reduce_any(now[:, _NONFINITE] > 0)
        tf.cond(tf.logical_and(bad, tf.logical_not(fired.read_value())), write_window,
                lambda: tf.constant(False))


def _ids(tensors: Iterable[Any]) -> tuple[Any, ...]:
    return tuple(None if t is None else t._id for t in tensors)  # noqa: SLF001 - unique per tensor


def _xla_error() -> ValueError:
    return ValueError(
        "op_numerics cannot run inside tf.function(jit_compile=True): summary ops cannot run "
        "inside XLA, and XLA fuses ops, so per-op outputs do not exist there. Run the step "
        "with jit_compile=False while looking for the op, or use log_numerics on the tensors "
        "you name, writing the statistics outside the compiled function."
    )


def op_numerics(
    *,
    flight_recorder: int | None = None,
    op_types: Collection[str] | None = None,
    skip_op_types: Collection[str] = DEFAULT_SKIP_OP_TYPES,
    name_regex: str | None = None,
    dtypes: Collection[str] = metadata.SUPPORTED_DTYPES,
    step: Any = None,
) -> OpNumerics:
    """Records the numerics of every floating-point op output of a training step.

    Args:
      flight_recorder: None records every op at every step (to the default
        summary writer). An int K keeps each op's statistics of the last K
        steps in memory on the device and writes them only at the first step
        where any op output is non-finite: the failing step and the K-1 steps
        before it, and nothing else, so the mode can be left on.
      op_types: only these op types (e.g. {"Sqrt", "SqrtGrad"}); None for all.
      skip_op_types: op types never recorded; the default skips ops that only
        move, copy or reshape values, and ReLU, its gradient, Neg and Abs,
        whose outputs are finite and no larger wherever their inputs are
        (see DEFAULT_SKIP_OP_TYPES).
      name_regex: only ops whose name (graph op name, or eager scope + type)
        matches this regular expression (``re.search``).
      dtypes: only outputs of these dtypes (names, e.g. "float32").
      step: the step to record at; None uses tf.summary's default step.

    Returns:
      An OpNumerics: a context manager around one step, or a decorator of the
      step function. Inside tf.function apply it under @tf.function.
    """
    return OpNumerics(
        flight_recorder=flight_recorder,
        op_types=op_types,
        skip_op_types=skip_op_types,
        name_regex=name_regex,
        dtypes=dtypes,
        step=step,
    )
