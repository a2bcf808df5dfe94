"""One step of op-level recording: what it has recorded so far, and how each op is described in it.

A step is one eager block (``with recorder:``) or one trace of a decorated
step function. Each op the callback reports is described in its step: its
role (forward "activation", backward "gradient", update "weight"), the
user's source line (for a gradient op, its forward op's), and its name in
its tag (in a called function: which, ``outer/inner/Log``).
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

from tb_numerics import _requires

tf = _requires.tensorflow(__name__)

from tb_numerics import _tf_internal, metadata, summary  # noqa: E402
from tb_numerics.oplevel.record import GRADIENT_OF, OpRecord  # noqa: E402
from tb_numerics.oplevel.source import ForwardIndex  # noqa: E402
from tb_numerics.oplevel.tags import OpTags  # noqa: E402

__all__ = ["Described", "Op", "Step", "function_label", "resolve_step"]

_BACKWARD_NAME = re.compile(r"(^|/)(gradient_tape|gradients(_\d+)?)/|_grad/")


class Op(NamedTuple):
    """One op as the op callback reports it."""

    type: str
    name: str | None  # the graph op name; None for an eager op
    graph: Any  # the graph being built; None for an eager op
    inputs: Any
    outputs: Any


class Described(NamedTuple):
    """Where an op goes: its role (phase), source line, name in its tag, and whether it is a gradient op."""

    role: str
    where: str
    base: str  # the op's name in its tag
    backward: bool


class Step:
    """What one step (one block, or one trace of a decorated step) has recorded so far."""

    def __init__(self, graph: Any, step: Any):
        self.graph = graph  # None for an eager step, else the FuncGraph being traced
        self.step = step  # eager: an int or None; traced: the user's step
        self.backward_seen = False
        self.forward = ForwardIndex()
        # Traced step: tag -> (record, info) of its own graph's ops, in trace
        # order; (tag, info, acc row) of ops in graphs nested in it (flight recorder).
        self.records: dict[str, tuple[Any, metadata.TensorInfo]] = {}
        self.acc_sites: list[tuple[str, metadata.TensorInfo, int]] = []
        # Eager step: (order key, tag, record, info) of each eager op output.
        self.eager: list[tuple[tuple[int, int, int], str, Any, metadata.TensorInfo]] = []
        self.nested_before = 0  # nested records that ran before the next eager op
        self.function_ran = False  # a function ran since nested_before was read
        self.first_bad: OpRecord | None = None  # found as ops ran (inspect mode)
        # Inspect mode: id of each eager op output -> (its op's scoped name, the
        # tensor, kept so that the id is not reused), to name an op's inputs.
        self.producers: dict[int, tuple[str, Any]] = {}
        # Eager step: id of each recorded op output -> (its tag, the tensor, kept so that the id is not reused).
        self.made: dict[int, tuple[str, Any]] = {}
        # Inspect mode: id of each op output that passes a mask's -Inf on -> the tensor (``passes_mask``).
        self.masks: dict[int, Any] = {}

    def describe(self, op: Op, own_graph: bool, where: str, in_backward: bool) -> Described:
        """Role, source line and name of ``op``, made at ``where`` (the user's
        line; ``in_backward``: inside a gradient computation), in this step."""
        forward_op = _tf_internal.current_forward_op()
        if forward_op is None and op.name is not None and "_grad/" in op.name:
            forward_op = _tf_internal.graph_forward_op(op.name)
        backward = (
            in_backward or forward_op is not None
            or (op.name is not None and _BACKWARD_NAME.search(op.name) is not None)
        )
        fwd = self.forward.find(forward_op) if backward else None
        if backward:
            # A called function's backward graph is traced with its forward
            # call: only what runs in the step itself marks the update phase.
            self.backward_seen |= own_graph
            role = "gradient"
            if fwd is not None:
                where = "%s%s%s" % (fwd.where, GRADIENT_OF, fwd.tag)
        else:
            role = "weight" if self.backward_seen else "activation"
        if op.name is not None:  # a graph op: its name is unique in its graph
            # In a function the step calls: say which (and which it called).
            label = "" if own_graph else function_label(op.graph, self.graph)
            return Described(role, where, "%s/%s" % (label, op.name) if label else op.name, backward)
        scope = _tf_internal.eager_scope_name()
        kind = _tf_internal.called_function_name(op.type) or op.type  # a call: its function's name
        if fwd is not None:
            scope = "gradient_tape/%s/" % OpTags.op_name(fwd.tag)
        elif backward:
            scope = "gradient_tape/" + scope
        return Described(role, where, scope + kind, backward)


def resolve_step(step: Any, graph: Any, needed: bool) -> Any:
    """The step a block or a trace records at: ``step`` (the recorder's),
    else tf.summary's default step. An eager block's (``graph`` None) as an
    int, read where it is entered; a traced step's value where the step
    starts, not where its records are written.

    Raises:
      ValueError: there is no step and one is ``needed`` (a flight recorder).
    """
    if step is None:
        step = tf.summary.experimental.get_step()
    if step is None and needed:
        raise ValueError(
            "op_numerics needs a step: pass step=, or call tf.summary.experimental.set_step()"
        )
    if graph is None and step is not None:  # the block owns the value of this call's step
        return int(step.numpy()) if hasattr(step, "numpy") else int(step)
    return step if step is None else summary.read_step(step)


def function_label(graph: Any, step_graph: Any = None) -> str:
    """The names of the functions that ``graph`` belongs to, below ``step_graph``
    (the traced step; None for an eager step), outermost first: ``outer/inner``
    for a function that a called function calls. A backward graph
    (``__backward_<name>_<uid>``) is named for its function."""
    graphs = _tf_internal.function_graphs(graph)
    if step_graph is not None and step_graph in graphs:
        graphs = graphs[graphs.index(step_graph) + 1:]
    names = []
    for g in graphs:
        m = re.match(r"^__backward_(.+)_\d+$", g.name)
        names.append(m.group(1) if m else g.name)
    return "/".join(names)
