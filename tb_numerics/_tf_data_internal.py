"""TensorFlow's private ``tf.data`` API that op-level recording uses, in one place.

A pipeline's functions (``map``, ``filter``, ``flat_map``, ``interleave``...)
are traced when the dataset is built, so an op callback registered later
never sees their ops (``tf.debugging.enable_check_numerics`` instruments
them only where it was enabled before the dataset was built). To record
them, a pipeline built earlier is rebuilt with its functions traced anew:

* it is serialized to a GraphDef (``DatasetToGraphV2``, as tf.data's service
  and ``tf.distribute`` do);
* each node that calls a function traced anew is pointed at the new trace,
  its other arguments are the new trace's captured inputs, and its input
  dataset is the live one below it (nothing below is re-created) unless a
  function below is traced anew too (then what is below is rebuilt);
* every other function node's captured inputs are the live tensors it
  captured (the serialized graph holds copies of variables);
* the graph is imported into a function that makes the new dataset's
  variant, as ``Dataset._trace_variant_creation`` does.

``rebuild`` raises ``UnsupportedPipeline`` where a node calls functions in a
way this cannot map (several functions, or no ``other_arguments``).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Iterator

__all__ = [
    "UnsupportedPipeline", "dataset_functions", "function_graph", "iterated_dataset", "python_function",
    "rebuild", "retrace", "transformation_name",
]


class UnsupportedPipeline(ValueError):
    """A pipeline that cannot be rebuilt with its functions traced anew."""


def _name(fn: Any) -> str:
    name = fn.name
    return name.decode() if isinstance(name, bytes) else name


def dataset_functions(ds: Any) -> Iterator[tuple[Any, Any]]:
    """(dataset node, its function wrapper) of every function in ``ds``'s pipeline."""
    stack, seen = [ds], set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        for wrapper in node._functions():
            yield node, wrapper
        stack.extend(node._inputs())


def function_graph(wrapper: Any) -> Any:
    """The FuncGraph of a pipeline function's trace; None for a legacy ``Defun``."""
    return getattr(wrapper.function, "graph", None)


def python_function(wrapper: Any) -> Callable[..., Any]:
    """The user's Python function a pipeline function wrapper traces."""
    return wrapper._func


def transformation_name(node: Any) -> str:
    """What made a dataset node, e.g. ``Dataset.map()``."""
    return node._transformation_name() if hasattr(node, "_transformation_name") else "Dataset()"


def retrace(node: Any, wrapper: Any) -> Any:
    """A new trace of the pipeline function ``wrapper`` of ``node``, made now
    (op callbacks see its ops), from the same Python function and input structure."""
    from tensorflow.python.data.ops import structured_function

    with warnings.catch_warnings():  # under replay_step: "run_functions_eagerly does not apply"
        warnings.filterwarnings("ignore", message="Even though the `tf.config.experimental_run_functions_eagerly`")
        return structured_function.StructuredFunctionWrapper(
            wrapper._func, transformation_name(node), input_structure=wrapper._input_structure)


def iterated_dataset() -> Any:
    """The dataset whose Python iterator is asking for its next element on
    this thread's stack (an ``IteratorGetNext`` being run), or None."""
    import sys

    from tensorflow.python.data.ops import iterator_ops

    frame = sys._getframe(1)
    for _ in range(64):
        if frame is None:
            return None
        me = frame.f_locals.get("self")
        if isinstance(me, iterator_ops.OwnedIterator):
            return getattr(me, "_dataset", None)
        frame = frame.f_back
    return None


def _arg_ranges(node_def: Any) -> dict[str, tuple[int, int]]:
    """Each input argument of ``node_def``: its [start, end) among the node's inputs."""
    from tensorflow.python.framework import op_def_registry

    ranges, i = {}, 0
    for arg in op_def_registry.get(node_def.op).input_arg:
        if arg.number_attr:
            n = node_def.attr[arg.number_attr].i
        elif arg.type_list_attr:
            n = len(node_def.attr[arg.type_list_attr].list.type)
        else:
            n = 1
        ranges[arg.name] = (i, i + n)
        i += n
    return ranges


class _Rewrite:
    """The GraphDef of one pipeline, being pointed at new traces and live tensors."""

    def __init__(self, graph_def: Any):
        self.graph_def = graph_def
        self.captures: dict[str, Any] = {}  # placeholder name -> live tensor
        self.functions: list[Any] = []  # new traces the graph calls
        self._placeholders: list[Any] = []

    def placeholder(self, node_def: Any, tensor: Any) -> str:
        """A placeholder, fed with the live ``tensor``, for an input of
        ``node_def``; one per tensor (a graph captures a tensor once)."""
        from tensorflow.core.framework import node_def_pb2

        for name, live in self.captures.items():
            if live is tensor:
                return name
        name = "tbn_live/%s/%d" % (node_def.name, sum(k.startswith("tbn_live/%s/" % node_def.name)
                                                       for k in self.captures))
        p = node_def_pb2.NodeDef(name=name, op="Placeholder")
        p.attr["dtype"].type = tensor.dtype.as_datatype_enum
        self._placeholders.append(p)
        self.captures[name] = tensor
        return name

    def point(self, node_def: Any, attr: str, node: Any, fn: Any, new: bool, live_input: bool) -> None:
        """Makes ``node_def`` call ``fn`` (its new trace where ``new``) on live
        tensors; on the live dataset below it where ``live_input``."""
        ranges = _arg_ranges(node_def)
        if "other_arguments" not in ranges or "Targuments" not in node_def.attr:
            raise UnsupportedPipeline("%s has no other_arguments" % node_def.op)
        inputs = [x for x in node_def.input if not x.startswith("^")]
        control = [x for x in node_def.input if x.startswith("^")]
        caps = list(fn.captured_inputs)
        a, b = ranges["other_arguments"]
        args = [self.placeholder(node_def, c) for c in caps]
        if new:
            node_def.attr[attr].func.name = _name(fn)
            self.functions.append(fn)
            if live_input and "input_dataset" in ranges and len(node._inputs()) == 1:  # the live pipeline below
                i, _ = ranges["input_dataset"]
                inputs[i] = self.placeholder(node_def, node._inputs()[0]._variant_tensor)
        node_def.attr["Targuments"].list.type[:] = [c.dtype.as_datatype_enum for c in caps]
        del node_def.input[:]
        node_def.input.extend(inputs[:a] + args + inputs[b:] + control)

    def variant(self) -> Any:
        """The new pipeline's variant: the GraphDef imported and run."""
        from tensorflow.python.eager import wrap_function
        from tensorflow.python.framework import importer, ops

        self.graph_def.node.extend(self._placeholders)
        (out,) = [n.input[0] for n in self.graph_def.node if n.op == "_Retval"]

        def make() -> None:
            graph = ops.get_default_graph()
            for fn in self.functions:
                fn.add_to_graph(graph)
            importer.import_graph_def(self.graph_def, name="")
            for name, tensor in self.captures.items():
                graph.add_capture(tensor, graph.get_tensor_by_name(name + ":0"))

        made = wrap_function.wrap_function(make, [])
        return made.prune([], made.graph.as_graph_element(out + ":0"))()


def rebuild(ds: Any, new_trace: Callable[[Any, Any], Any]) -> Any:
    """``ds`` rebuilt with each function for which ``new_trace(node, wrapper)``
    gives a new wrapper calling that one's trace; ``ds`` itself where none does.

    Raises:
      UnsupportedPipeline: a function node this cannot map.
    """
    from tensorflow.core.framework import graph_pb2
    from tensorflow.python.data.ops import dataset_ops
    from tensorflow.python.data.ops import options as options_lib

    by_name = {_name(w.function): (node, w) for node, w in dataset_functions(ds)}
    new = {name: new_trace(node, w) for name, (node, w) in by_name.items()}
    if not any(new.values()):
        return ds
    policy = options_lib.ExternalStatePolicy.IGNORE
    rewrite = _Rewrite(graph_pb2.GraphDef.FromString(ds._as_serialized_graph(external_state_policy=policy).numpy()))
    for node_def in rewrite.graph_def.node:
        attrs = [k for k, v in node_def.attr.items() if v.HasField("func")]
        if not attrs:
            continue
        name = node_def.attr[attrs[0]].func.name
        if len(attrs) != 1 or name not in by_name:
            raise UnsupportedPipeline("%s calls %s" % (node_def.op, ", ".join(sorted(attrs))))
        node, wrapper = by_name[name][0], new[name] or by_name[name][1]
        rewrite.point(node_def, attrs[0], node, wrapper.function, new[name] is not None,
                      live_input=not any(new[_name(w.function)] for below in node._inputs()
                                         for _, w in dataset_functions(below)))
    return dataset_ops._VariantDataset(rewrite.variant(), ds.element_spec)
