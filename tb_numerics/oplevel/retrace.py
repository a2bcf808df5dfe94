"""What a block calls that was traced before it: traced anew inside it, so its ops are recorded.

An op callback sees a graph's ops only while the graph is traced. Two kinds
of graph a step uses are usually traced before any recorder's block:

* a ``tf.function`` called in the block (a custom layer's ``@tf.function``
  ``call``, traced when the model was built; a helper warmed up before the
  loop): ``Retracer.call`` calls, instead, a copy of it (the same Python
  function and options) that is traced in the block, once per recorder.
  Not where it cannot be copied: a concrete function, a ``tf.function``
  whose first trace made variables (a copy would make others), or one
  compiled with XLA (whose ops the recorder refuses); there the recorder
  records its outputs and warns;
* a ``tf.data`` pipeline iterated in an eager block (its ``map`` and other
  functions were traced when the dataset was built): ``Retracer.iterate``
  gives the block the pipeline rebuilt with those functions traced anew
  (``_tf_data_internal.rebuild``), once per recorder and dataset; a graph
  traced in a block that uses such a dataset (a ``for`` loop over it in a
  ``tf.function``) captures the rebuilt one's (``Retracer.variant``).

What the step sees is unchanged: the same Python functions on the same
variables and inputs. The copies' record ops, like those of any nested
graph, record only while one of the recorder's blocks is open.

An iterator's output (``IteratorGetNext``) is the input pipeline's: its
records are described as such (``pipeline_where``: which functions, where
in the user's code), so that where a pipeline could not be traced anew, or
its source held the bad value, the report says it came with the input.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from typing import Any, Callable

from tb_numerics import _requires

tf = _requires.tensorflow(__name__)

from tb_numerics import _tf_data_internal, _tf_internal  # noqa: E402
from tb_numerics.oplevel.source import short_path  # noqa: E402

__all__ = ["RUNS_PIPELINE", "Retracer"]

_log = logging.getLogger(__name__)

# Ops that run a tf.data pipeline's functions and give its elements.
RUNS_PIPELINE = frozenset(("IteratorGetNext", "IteratorGetNextSync", "IteratorGetNextAsOptional"))


class Retracer:
    """One recorder's copies of what its blocks call that was traced outside them.

    Args:
      local: the recorder's thread-local state; ``local.busy`` is True while
        the recorder works itself (its op callback then records nothing).
    """

    def __init__(self, local: Any) -> None:
        self._local = local
        self._graphs_here: "weakref.WeakSet[Any]" = weakref.WeakSet()  # traced in a block
        # Names of the functions traced in a block, and of those called in
        # one that were not (warned about once).
        self._names_here: set[str] = set()
        self._warned: set[str] = set()
        # tf.functions: their tracing count after a call in a block (any
        # beyond were traced elsewhere), and their copies traced in one.
        self._counts: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()
        self._copies: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
        # Datasets iterated in a block: rebuilt (None: as they are), and the original of each rebuilt one.
        self._pipelines: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
        self._originals: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()

    def traced_here(self, graph: Any) -> None:
        """Notes that ops of ``graph`` were seen, in a block, while it was traced."""
        self._graphs_here.add(_tf_internal.outermost_function_graph(graph))
        self._names_here.add(_tf_internal.outermost_function_name(graph))

    def ops_recorded(self, op_type: str) -> bool:
        """Whether the ops of a function called in an eager block (op type
        ``op_type``) are recorded, its trace made in a block; warns once
        per function that was not (only its outputs are recorded)."""
        name = _tf_internal.called_function_name(op_type)
        if name is None or name in self._names_here:
            return True
        if name not in self._warned:
            self._warned.add(name)
            _log.warning(
                "op_numerics: tf.function %r was traced before the recorder was active and cannot be "
                "traced anew here (a concrete function, one whose first trace made variables, or one "
                "compiled with XLA), so its ops are not recorded, only its outputs (as op %s)",
                name, op_type)
        return False

    def call(self, call: Callable[..., Any], fn: Any, args: tuple, kwargs: dict) -> Any:
        """Calls the ``tf.function`` ``fn`` (``call(target, *args, **kwargs)``):
        through its copy where it has traces made outside this recorder's blocks."""
        if self._local.busy or tf.config.functions_run_eagerly() or _is_own(fn):
            return call(fn, *args, **kwargs)
        target = self._copies.get(fn)
        if target is None and fn.experimental_get_tracing_count() != self._counts.get(fn, 0):
            target = _tf_internal.retraceable_copy(fn)  # None: it made variables
            if target is not None:
                self._copies[fn] = target
        if target is not None:
            return call(target, *args, **kwargs)
        try:
            return call(fn, *args, **kwargs)
        finally:
            self._counts[fn] = fn.experimental_get_tracing_count()

    def iterate(self, ds: Any) -> Any:
        """The dataset an eager block iterates for ``ds``: rebuilt where its
        pipeline's functions were traced outside this recorder's blocks."""
        if self._local.busy or not tf.executing_eagerly():
            return ds
        return self._rebuilt(ds)

    def variant(self, ds: Any, variant: Any) -> Any:
        """The variant tensor a graph traced in an eager block captures for
        ``ds``: where ``ds`` was made eagerly, its rebuilt pipeline's (a
        ``for`` loop over a dataset in a ``tf.function``; ``iter`` there).
        Not in a traced step: the new traces' record ops would capture the
        step's tensors, which the pipeline, made outside it, cannot."""
        if (self._local.busy or tf.executing_eagerly() or tf.is_symbolic_tensor(variant)
                or ds in self._originals or self._local.step.graph is not None):
            return variant
        with tf.init_scope():
            rebuilt = self._rebuilt(ds)
        return variant if rebuilt is ds else rebuilt._variant_tensor

    def _rebuilt(self, ds: Any) -> Any:
        """``ds`` rebuilt with its functions traced anew, once per recorder; else ``ds``."""
        if ds not in self._pipelines:
            self._local.busy = True
            try:
                rebuilt = _tf_data_internal.rebuild(ds, self._new_trace)
            except Exception as e:  # noqa: BLE001 - any pipeline: iterate it as it is
                _log.warning("op_numerics: the input pipeline's functions cannot be traced anew (%s: %s); "
                             "a value they make is recorded as the pipeline's", type(e).__name__, e)
                rebuilt = ds
            finally:
                self._local.busy = False
            # None: as it is (a value would keep its key alive); the original, by a weak reference.
            self._pipelines[ds] = None if rebuilt is ds else rebuilt
            if rebuilt is not ds:
                self._originals[rebuilt] = weakref.ref(ds)
        return self._pipelines[ds] or ds

    def _new_trace(self, node: Any, wrapper: Any) -> Any:
        """A new trace, recorded, of a pipeline function traced outside any block; else None."""
        graph = _tf_data_internal.function_graph(wrapper)
        if graph is None or graph in self._graphs_here:
            return None
        self._local.busy = False
        try:
            return _tf_data_internal.retrace(node, wrapper)
        finally:
            self._local.busy = True

    def pipeline_where(self, where: str) -> str:
        """The description of an iterator's output read at ``where``: the input
        pipeline, with its functions and their lines."""
        ds = _tf_data_internal.iterated_dataset()
        original = self._originals.get(ds) if ds is not None else None
        ds = ds if original is None else original()
        fns = [] if ds is None else [_function_where(node, w) for node, w in _tf_data_internal.dataset_functions(ds)]
        return "%s, from the input pipeline%s" % (where, " (%s)" % "; ".join(fns[::-1]) if fns else "")


def _is_own(fn: Any) -> bool:
    """Whether ``fn`` is one of tb-numerics' own ``tf.function``s (its statistics, its writes)."""
    return (getattr(fn.python_function, "__module__", None) or "").startswith("tb_numerics.")


def _function_where(node: Any, wrapper: Any) -> str:
    """``Dataset.map(fn) at file.py:LINE``: a pipeline function and where it is defined."""
    func = inspect.unwrap(_tf_data_internal.python_function(wrapper))
    name = getattr(func, "__name__", type(func).__name__)
    code = getattr(func, "__code__", None)
    at = "" if code is None else " at %s:%d" % (short_path(code.co_filename), code.co_firstlineno)
    return "%s%s" % (_tf_data_internal.transformation_name(node).replace("()", "(%s)" % name), at)
