"""Every use of TensorFlow's private Python API by tb-numerics, in one place.

The op-level mode (``oplevel``) needs hooks that TensorFlow only exposes
privately, the same ones its own ``enable_check_numerics`` and
``enable_dump_debug_info`` use:

* op callbacks (``tensorflow.python.framework.op_callbacks``), which fire for
  every eagerly executed op and for every op created while a ``tf.function``
  is traced, including the gradient ops a ``GradientTape`` builds;
* the tape's gradient-function hook (``TFE_Py_RegisterGradientFunction``), to
  learn which forward op a gradient op differentiates;
* whether the graph being built is compiled by XLA (``jit_compile=True``);
* whether a graph adds automatic control dependencies (a called function's
  backward graph does not, and prunes stateful ops no output depends on),
  the forward op ``tf.gradients``' helper is differentiating, whether a
  graph is a ``tf.while_loop``'s gradient body, and the function graph an
  eager function call runs;
* the eager name scope; the variable class's ``assign`` methods, to put
  back what a replayed step wrote (``variable_writes_undone``); and variables that bypass ``tf.function``'s
  "variables only on the first trace" rule (ring buffers made per trace);
* ``tf.function``'s ``__call__`` and ``tf.data.Dataset.__iter__``, routed
  through a recorder on the thread of its block (``acquire_routes``), and a
  copy of a ``tf.function`` that traces anew (``retraceable_copy``), so that
  what a block calls that was traced before it is traced anew in it (the
  pipeline's own private API is in ``_tf_data_internal``);
* for the summary API and the writers around it: the default summary
  writer (``tf.summary`` has no public getter), ``smart_cond`` (a cond
  decided when tracing where its predicate is known then), whether an op
  is stateful, and a tensor's unique id.

``check_supported()`` verifies the TensorFlow version and that each hook is
present, and raises ``UnsupportedTensorFlowError`` saying what is missing.
"""

from __future__ import annotations

import contextlib
import re
import threading
from typing import Any, Callable

import tensorflow as tf

# TensorFlow versions whose private hooks were read and tested.
MIN_VERSION = (2, 16)
MAX_TESTED_VERSION = (2, 21)


class UnsupportedTensorFlowError(RuntimeError):
    """The installed TensorFlow lacks a hook the op-level mode needs."""


def _version() -> tuple[int, int]:
    parts = tf.__version__.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


_checked = False


def _local_names(fn: Callable[..., Any]) -> tuple[str, ...]:
    code = fn.__code__
    return code.co_varnames + code.co_cellvars


def check_supported() -> None:
    """Raises UnsupportedTensorFlowError unless every hook is available."""
    global _checked
    if _checked:
        return
    version = _version()
    if version < MIN_VERSION or version[0] != MIN_VERSION[0]:
        raise UnsupportedTensorFlowError(
            "tb_numerics.op_numerics needs TensorFlow 2.%d or newer 2.x (tested up to 2.%d); "
            "found %s. The layer-level API (log_numerics) still works."
            % (MIN_VERSION[1], MAX_TESTED_VERSION[1], tf.__version__)
        )
    try:
        from tensorflow.python import pywrap_tfe
        from tensorflow.python.eager import backprop, context
        from tensorflow.python.framework import op_callbacks, smart_cond
        from tensorflow.python.data.ops import dataset_ops
        from tensorflow.python.eager.polymorphic_function import polymorphic_function
        from tensorflow.python.ops import control_flow_util, gradients_util, resource_variable_ops, summary_ops_v2

        missing = [
            name
            for name, ok in (
                ("op_callbacks.add_op_callback", hasattr(op_callbacks, "add_op_callback")),
                ("op_callbacks.remove_op_callback", hasattr(op_callbacks, "remove_op_callback")),
                ("backprop._gradient_function", hasattr(backprop, "_gradient_function")),
                ("GradientTape.gradient", hasattr(backprop.GradientTape, "gradient")),
                ("gradients_util._GradientsHelper", hasattr(gradients_util, "_GradientsHelper")),
                ("pywrap_tfe.TFE_Py_RegisterGradientFunction",
                 hasattr(pywrap_tfe, "TFE_Py_RegisterGradientFunction")),
                ("control_flow_util.GraphOrParentsInXlaContext",
                 hasattr(control_flow_util, "GraphOrParentsInXlaContext")),
                ("context.scope_name", hasattr(context.context(), "scope_name")),
                ("resource_variable_ops.ResourceVariable",
                 hasattr(resource_variable_ops, "ResourceVariable")),
                ("while_v2._WhileBodyGradFuncGraph", _while_grad_graph_class() is not None),
                ("Graph._add_control_dependencies",
                 hasattr(tf.Graph(), "_add_control_dependencies")),
                ("_GradientsHelper's local 'op'",
                 "op" in _local_names(gradients_util._GradientsHelper)),
                ("summary_ops_v2._summary_state", hasattr(summary_ops_v2, "_summary_state")),
                ("smart_cond.smart_cond", hasattr(smart_cond, "smart_cond")),
                ("polymorphic_function.Function.__call__", "__call__" in vars(polymorphic_function.Function)),
                ("dataset_ops.DatasetV2.__iter__", "__iter__" in vars(dataset_ops.DatasetV2)),
                ("dataset_ops.DatasetV2._variant_tensor",
                 isinstance(vars(dataset_ops.DatasetV2).get("_variant_tensor"), property)),
            )
            if not ok
        ]
    except ImportError as e:
        missing = [str(e)]
    if missing:
        raise UnsupportedTensorFlowError(
            "tb_numerics.op_numerics cannot hook TensorFlow %s: missing %s. "
            "The layer-level API (log_numerics) still works." % (tf.__version__, ", ".join(missing))
        )
    _checked = True


# ---------------------------------------------------------------- op callbacks


def add_op_callback(fn: Callable[..., Any]) -> None:
    """Registers ``fn(op_type, inputs, attrs, outputs, op_name, graph)`` on this thread."""
    from tensorflow.python.framework import op_callbacks

    op_callbacks.add_op_callback(fn)


def remove_op_callback(fn: Callable[..., Any]) -> None:
    from tensorflow.python.framework import op_callbacks

    op_callbacks.remove_op_callback(fn)


_FUNCTION_PREFIXES = ("__inference_", "__forward_", "__backward_")


def is_function_call(op_type: str) -> bool:
    """Whether an eager callback is the execution of a whole traced function."""
    return op_type.startswith(_FUNCTION_PREFIXES)


def outermost_function_graph(graph: Any) -> Any:
    """The outermost function graph ``graph`` is (or is nested in)."""
    while True:
        ref = getattr(graph, "_weak_outer_graph", None)
        outer = ref() if ref is not None else None
        if outer is None or not getattr(outer, "building_function", False):
            return graph
        graph = outer


def outermost_function_name(graph: Any) -> str:
    """The name of the outermost function graph ``graph`` is (or is nested in)."""
    return outermost_function_graph(graph).name


def function_graphs(graph: Any) -> list[Any]:
    """The function graphs ``graph`` is nested in, outermost first, ``graph``
    too where it is one: those of ``tf.function`` traces and their gradients,
    not the ``tf.cond`` branches and ``tf.while_loop`` bodies between them."""
    from tensorflow.python.ops import control_flow_v2_func_graphs as cf

    bodies = tuple(getattr(cf, c) for c in ("CondBranchFuncGraph", "WhileCondFuncGraph", "WhileBodyFuncGraph")
                   if hasattr(cf, c))
    out = []
    while graph is not None and getattr(graph, "building_function", False):
        if not isinstance(graph, bodies):
            out.append(graph)
        ref = getattr(graph, "_weak_outer_graph", None)
        graph = ref() if ref is not None else None
    return out[::-1]


_CALLED = re.compile(r"^__(?:inference|forward)_(.+)_\d+$")


def called_function_name(op_type: str) -> str | None:
    """The function graph's name in the op type of an eager call of its forward
    or inference function (``__inference_<name>_<uid>``), else None (a
    gradient's backward function, ``__inference___backward_<name>_...``)."""
    m = _CALLED.match(op_type)
    return m.group(1) if m and not m.group(1).startswith("__backward_") else None


def eager_scope_name() -> str:
    """The current eager name scope, e.g. "dense_1/" ("" at top level)."""
    from tensorflow.python.eager import context

    return context.context().scope_name or ""


def in_xla_context() -> bool:
    """Whether the graph being built will be compiled by XLA (jit_compile=True);
    never when executing eagerly (no graph is being built)."""
    from tensorflow.python.framework import ops
    from tensorflow.python.ops import control_flow_util

    if not ops.inside_function():
        return False
    return bool(control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph()))


def adds_control_dependencies(graph: Any) -> bool:
    """Whether ``graph`` runs its stateful ops without outputs depending on them.

    ``tf.function`` traces (and the branches and loop bodies inside them)
    add automatic control dependencies; the backward function TensorFlow
    builds for a called ``tf.function`` does not.
    """
    return bool(getattr(graph, "_add_control_dependencies", False))


def _while_grad_graph_class() -> type | None:
    from tensorflow.python.ops import while_v2

    return getattr(while_v2, "_WhileBodyGradFuncGraph", None)


def in_loop_gradient(graph: Any) -> bool:
    """Whether ``graph`` is (or is nested in) the gradient body of a ``tf.while_loop``.

    Such a body may only capture values of the forward loop: a variable read
    there (as op records need) makes ``tape.gradient`` fail.
    """
    cls = _while_grad_graph_class()
    while graph is not None:
        if cls is not None and isinstance(graph, cls):
            return True
        ref = getattr(graph, "_weak_outer_graph", None)
        graph = ref() if ref is not None else None
    return False


def graph_forward_op(op_name: str) -> tuple[str, Any, Any] | None:
    """(type, inputs, outputs) of the forward op whose gradient op ``op_name`` is being built
    by ``tf.gradients``' helper (a called function's backward graph), or None.

    The helper names a gradient op ``<forward op name>_grad/...``; its loop
    variable ``op`` is that forward op while the gradient function runs.
    """
    import sys

    from tensorflow.python.ops import gradients_util

    code = gradients_util._GradientsHelper.__code__
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not code:
        frame = frame.f_back
    op = None if frame is None else frame.f_locals.get("op")
    if op is None or "%s_grad/" % op.name not in op_name:
        return None
    return op.type, tuple(op.inputs), tuple(op.outputs)


def creation_stack() -> list[tuple[str, int, str]]:
    """The Python stack here, innermost frame first, as (file, line, function).

    Autograph-converted code is mapped back to the user's own file and line,
    as in TensorFlow's error messages.
    """
    from tensorflow.python.util import tf_stack

    return [(f.filename, f.lineno, f.name) for f in reversed(tf_stack.extract_stack())]


def backward_frames() -> frozenset[tuple[str, str]]:
    """(file, function) of the frames that mean "computing gradients".

    ``GradientTape.gradient`` and ``tf.gradients``' helper, which builds the
    backward function of a ``tf.function`` called under a tape: their own
    code, under any wrapper ``functools.wraps`` made (the Keras callback
    wraps ``GradientTape.gradient`` during ``fit``).
    """
    import inspect

    from tensorflow.python.eager import backprop
    from tensorflow.python.ops import gradients_util

    return frozenset(
        (fn.__code__.co_filename, fn.__code__.co_name)
        for fn in map(inspect.unwrap, (backprop.GradientTape.gradient, gradients_util._GradientsHelper))
    )


def untracked_variable(initial_value: Any, name: str, shape: Any = None) -> tf.Variable:
    """A variable that tf.function's creator scope does not see, nor a
    distribution strategy's (a plain variable, not a mirrored one).

    ``tf.function`` refuses ``tf.Variable``s created on any trace but the
    first; a ring buffer is sized by the ops of its own trace, so each trace
    makes one, under ``tf.init_scope``. Constructing the concrete class
    directly bypasses the creator scopes; the graph captures it like any
    variable created outside. ``shape``: the shapes it may hold later, where
    they differ from the initial value's (``tf.TensorShape(None)``: any).
    """
    from tensorflow.python.ops import resource_variable_ops

    with tf.init_scope():
        return resource_variable_ops.ResourceVariable(initial_value, trainable=False, name=name, shape=shape)


def traced_step_graph() -> Any:
    """The graph of the ``tf.function`` being traced, where code called at
    its top level (not in a ``tf.cond`` or loop body) runs; else None.

    Such a graph runs callbacks when its trace ends (``at_trace_end``).
    """
    from tensorflow.python.framework import func_graph

    graph = tf.compat.v1.get_default_graph()
    return graph if type(graph) is func_graph.FuncGraph else None


def traced_body_graph() -> Any:
    """The graph of a ``tf.cond`` branch or a loop body being traced inside
    a ``tf.function``, where stateful ops run in program order (automatic
    control dependencies); else None. Not a loop's gradient body, and not a
    graph without those dependencies (a called function's backward graph)."""
    from tensorflow.python.framework import func_graph

    graph = tf.compat.v1.get_default_graph()
    if type(graph) is func_graph.FuncGraph or not isinstance(graph, func_graph.FuncGraph):
        return None
    if not adds_control_dependencies(graph) or in_loop_gradient(graph):
        return None
    return graph


def enclosing_step_graph() -> Any:
    """The ``tf.function`` graph (``traced_step_graph``'s kind) that the
    ``tf.cond`` branch or loop body being traced is nested in."""
    from tensorflow.python.framework import func_graph

    graph = tf.compat.v1.get_default_graph()
    while type(graph) is not func_graph.FuncGraph and isinstance(graph, func_graph.FuncGraph):
        graph = graph.outer_graph
    return graph


def wall_clock() -> tf.Tensor:
    """Seconds since the epoch, float64: ``tf.timestamp``, which TensorFlow
    refuses under ``enable_op_determinism``; there the host's clock."""
    import time

    import numpy as np
    from tensorflow.python.framework import config

    if config.is_op_determinism_enabled():
        return tf.reshape(tf.numpy_function(lambda: np.float64(time.time()), [], tf.float64, stateful=True), [])
    return tf.timestamp()


def at_trace_end(graph: Any, fn: Callable[[], list]) -> None:
    """Runs ``fn`` when the trace of ``graph`` ends (after the traced Python
    function returned), and makes the ops it returns run with every call.

    The ops are made after ``tf.function``'s automatic control dependencies
    were worked out, so they are added to the graph's control outputs here
    (else the runtime prunes them); they are ordered after what they read.
    """
    from tensorflow.python.framework import ops

    def run() -> None:
        graph.control_outputs.extend(fn())

    ops.add_exit_callback_to_default_func_graph(run)


# ------------------------------------------------------- summaries and graphs


def default_summary_writer() -> Any:
    """The default ``tf.summary`` writer, or None. ``tf.summary`` has no
    public getter; the summary API's per-writer state (first-record
    metadata, execution order, the packed buffer) needs its identity."""
    from tensorflow.python.ops import summary_ops_v2

    return summary_ops_v2._summary_state.writer


def smart_cond(pred: Any, true_fn: Callable[[], Any], false_fn: Callable[[], Any]) -> Any:
    """``tf.cond``, decided when tracing where ``pred`` is known then (a
    Python bool, or ``tf.summary.should_record_summaries()`` outside any
    ``record_if``): a disabled summary then costs no op at all."""
    from tensorflow.python.framework import smart_cond as sc

    return sc.smart_cond(pred, true_fn, false_fn)


def stateful_ops(graph: Any) -> list[Any]:
    """The stateful ops of ``graph`` (variable writes, summary writes, random ops)."""
    return [op for op in graph.get_operations() if op._is_stateful]


def tensor_id(t: Any) -> int:
    """A tensor's id, unique in the process (a symbolic or an eager tensor)."""
    return t._id


# ------------------------------------------------------- tape gradient hook

_hook_lock = threading.Lock()
_hook_users = 0
_forward = threading.local()


def _gradient_function(op_name, attr_tuple, num_inputs, inputs, outputs, out_grads,
                       skip_input_indices, forward_pass_name_scope):
    """The tape's gradient function, noting which forward op it differentiates."""
    from tensorflow.python.eager import backprop

    prev = getattr(_forward, "op", None)
    _forward.op = (op_name, inputs, outputs)
    try:
        return backprop._gradient_function(
            op_name, attr_tuple, num_inputs, inputs, outputs, out_grads,
            skip_input_indices, forward_pass_name_scope,
        )
    finally:
        _forward.op = prev


def acquire_gradient_hook() -> None:
    """Routes the tape's gradient calls through ``_gradient_function``.

    The registration is process-wide; it is reference-counted and
    ``release_gradient_hook`` restores TensorFlow's own function at zero.
    """
    global _hook_users
    from tensorflow.python import pywrap_tfe

    with _hook_lock:
        if _hook_users == 0:
            pywrap_tfe.TFE_Py_RegisterGradientFunction(_gradient_function)
        _hook_users += 1


def release_gradient_hook() -> None:
    global _hook_users
    from tensorflow.python import pywrap_tfe
    from tensorflow.python.eager import backprop

    with _hook_lock:
        _hook_users -= 1
        if _hook_users == 0:
            pywrap_tfe.TFE_Py_RegisterGradientFunction(backprop._gradient_function)


def current_forward_op() -> tuple[str, Any, Any] | None:
    """(forward op type, its inputs, its outputs) being differentiated, or None.

    Inputs or outputs are None where the op's gradient does not need them.
    """
    return getattr(_forward, "op", None)


_WRITES = ("assign", "assign_add", "assign_sub")


@contextlib.contextmanager
def variable_writes_undone():
    """Puts back, on exit, every variable an eager ``assign``,
    ``assign_add`` or ``assign_sub`` wrote inside (BatchNorm's moving
    statistics, a Keras seed generator's state, a step counter): a replayed
    step leaves state as it found it, whoever owns the variables.

    Every write goes through these methods of TensorFlow's resource variable
    classes (Keras 3 variables wrap one), so the values before a variable's
    first write are kept as they come. Eager writes only: a replay runs
    every function eagerly.
    """
    from tensorflow.python.ops import resource_variable_ops

    classes = (resource_variable_ops.BaseResourceVariable, resource_variable_ops.ResourceVariable)
    before: dict[int, tuple[Any, Any]] = {}
    originals = [(cls, name, vars(cls)[name]) for cls in classes for name in _WRITES if name in vars(cls)]

    def keeping(original):
        def write(self, *args, **kwargs):
            if tf.executing_eagerly() and id(self) not in before:
                before[id(self)] = (self, tf.identity(self.read_value()))
            return original(self, *args, **kwargs)

        return write

    for cls, name, original in originals:
        setattr(cls, name, keeping(original))
    try:
        yield
    finally:
        for cls, name, original in originals:
            setattr(cls, name, original)
        for var, value in before.values():
            var.assign(value)


# ------------------------------------------ calls of tf.functions, iterations of datasets

_route_lock = threading.Lock()
_route_users = 0
_routes = threading.local()
_originals: dict[str, Any] = {}


def _routed_call(self, *args, **kwargs):
    """``tf.function``'s ``__call__``, through this thread's router where one is set."""
    route = getattr(_routes, "current", None)
    if route is None:
        return _originals["call"](self, *args, **kwargs)
    return route[0](_originals["call"], self, args, kwargs)


def _routed_iter(self):
    """``tf.data.Dataset.__iter__``, of the dataset this thread's router gives."""
    route = getattr(_routes, "current", None)
    return _originals["iter"](self if route is None else route[1](self))


def _routed_variant(self):
    """``tf.data.Dataset._variant_tensor`` (what a graph captures of a
    dataset), as this thread's router gives it."""
    variant = _originals["variant"].fget(self)
    route = getattr(_routes, "current", None)
    return variant if route is None else route[2](self, variant)


def _route_targets() -> list[tuple[Any, str, str, Any]]:
    from tensorflow.python.data.ops import dataset_ops
    from tensorflow.python.eager.polymorphic_function import polymorphic_function

    return [(polymorphic_function.Function, "__call__", "call", _routed_call),
            (dataset_ops.DatasetV2, "__iter__", "iter", _routed_iter),
            (dataset_ops.DatasetV2, "_variant_tensor", "variant", property(_routed_variant))]


def acquire_routes(call: Callable[..., Any], iterate: Callable[[Any], Any],
                   variant: Callable[[Any, Any], Any]) -> None:
    """Routes this thread's calls of ``tf.function``s through ``call(original,
    function, args, kwargs)`` (which must return ``original(target, *args,
    **kwargs)`` for the function it picks), its iterations of ``tf.data``
    datasets over ``iterate(dataset)``, the dataset to iterate, and the
    variant tensor a dataset gives (what a graph captures of it) through
    ``variant(dataset, tensor)``.

    The two methods are patched process-wide, reference-counted
    (``release_routes`` puts them back at zero); a thread without routes
    calls through unchanged.
    """
    global _route_users
    with _route_lock:
        if _route_users == 0:
            for cls, attr, key, routed in _route_targets():
                _originals[key] = vars(cls)[attr]
                setattr(cls, attr, routed)
        _route_users += 1
    _routes.stack = getattr(_routes, "stack", []) + [getattr(_routes, "current", None)]
    _routes.current = (call, iterate, variant)


def release_routes() -> None:
    """Undoes this thread's last ``acquire_routes``."""
    global _route_users
    *_routes.stack, _routes.current = _routes.stack
    with _route_lock:
        _route_users -= 1
        if _route_users == 0:
            for cls, attr, key, _ in _route_targets():
                setattr(cls, attr, _originals.pop(key))


def retraceable_copy(fn: Any) -> Any:
    """A new ``tf.function`` of ``fn``'s Python function and options, with no
    traces yet: calling it traces anew. None where ``fn`` made variables on
    its first trace (a copy would make others), is compiled with XLA, or
    this TensorFlow cannot copy one."""
    clone = getattr(fn, "_clone", None)
    if clone is None or getattr(fn, "_created_variables", None) or getattr(fn, "_jit_compile", False):
        return None
    return clone(None)


# ---------------------------------------------------------------- event files


def record_reader(path: str) -> tuple[Callable[[int], bytes], type]:
    """TensorFlow's C++ random-access reader of the TFRecord file ``path``
    (fast CRC32C): ``read(offset)``, the data of the record at that offset,
    and the error it raises where a checksum fails.

    Raises:
      TypeError: a path TensorFlow cannot take (not UTF-8).
    """
    from tensorflow.python.framework import errors
    from tensorflow.python.lib.io import _pywrap_record_io

    reader = _pywrap_record_io.RandomRecordReader(path)
    return (lambda offset: reader.read(offset)[0]), errors.DataLossError
