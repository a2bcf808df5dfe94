"""Where an op came from: the user's source line, and the forward op of a gradient op.

Two pieces ``OpNumerics`` composes, kept apart from the op callback (as
TensorFlow's ``check_numerics_callback`` keeps its source attribution apart):

* ``SourceLocator`` finds the innermost frame of the user's own code on the
  stack where an op is created (frames of tb-numerics, TensorFlow, Keras and
  what it calls through, and the standard library are skipped), and tells whether a gradient
  computation encloses it;
* ``ForwardIndex`` remembers the forward ops of one step by their tensors, so
  that a gradient op can name the forward op it differentiates and borrow
  its source line.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sysconfig
from typing import Any, Iterable, NamedTuple

from tb_numerics import _tf_internal
from tb_numerics.backends import _source

__all__ = ["ForwardIndex", "ForwardOp", "SourceLocator", "format_where", "short_path"]


def _library_dirs() -> tuple[str, ...]:
    """Directories whose frames are never "the user's source line"."""
    # tb_numerics itself (this file is in tb_numerics/oplevel/), the standard library, the frameworks.
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    dirs = [package, sysconfig.get_paths()["stdlib"]]
    # Keras 3 reaches TensorFlow through optree (its tree_map casts a layer's inputs).
    for mod in ("tensorflow", "tf_keras") + _source.LIBRARIES:
        spec = importlib.util.find_spec(mod)
        if spec is not None and spec.submodule_search_locations:
            dirs.extend(spec.submodule_search_locations)
    return tuple(os.path.join(os.path.realpath(d), "") for d in dirs)


@functools.lru_cache(maxsize=4096)
def _is_library_file(filename: str, dirs: tuple[str, ...]) -> bool:
    if filename.startswith("<frozen") or "__autograph_generated_file" in filename:
        return True
    return os.path.realpath(filename).startswith(dirs)


def short_path(filename: str) -> str:
    """``filename`` relative to the working directory where it lies below it."""
    try:
        rel = os.path.relpath(filename)
    except ValueError:  # another drive on Windows
        return filename
    return filename if rel.startswith(os.pardir) else rel


def format_where(frame: tuple[str, int, str] | None) -> str:
    """``file.py:LINE (function)`` of a (file, line, function) frame; "" for None."""
    if frame is None:
        return ""
    return "%s:%d (%s)" % (short_path(frame[0]), frame[1], frame[2])


class SourceLocator:
    """Finds the user's line on the stack where an op is being created."""

    def __init__(self) -> None:
        self._lib_dirs = _library_dirs()
        self._backward_frames = _tf_internal.backward_frames()

    def locate(self) -> tuple[str, bool]:
        """(``file.py:LINE (function)`` of the user's innermost frame or "",
        whether a gradient computation encloses the op)."""
        in_backward = False
        for filename, lineno, name in _tf_internal.creation_stack():
            if (filename, name) in self._backward_frames:
                in_backward = True
            if not _is_library_file(filename, self._lib_dirs):
                return format_where((filename, lineno, name)), in_backward
        return "", in_backward


class ForwardOp(NamedTuple):
    """A forward op as a gradient op's creation sees it."""

    tag: str  # its tag ("ops/...")
    where: str  # its source line


def _ids(tensors: Iterable[Any]) -> tuple[Any, ...]:
    return tuple(None if t is None else _tf_internal.tensor_id(t) for t in tensors)


class ForwardIndex:
    """The forward ops of one step, by (op type, output ids) and (op type, input ids)."""

    def __init__(self) -> None:
        self._ops: dict[tuple[Any, ...], ForwardOp] = {}

    def note(self, op_type: str, inputs, outputs, op: ForwardOp) -> None:
        self._ops[("out", op_type) + _ids(outputs)] = op
        if inputs:
            self._ops.setdefault(("in", op_type) + _ids(inputs), op)

    def find(self, forward_op: tuple[str, Any, Any] | None) -> ForwardOp | None:
        """The forward op that ``forward_op`` = (type, inputs, outputs) names, if noted.

        Inputs or outputs are None where the gradient does not need them.
        """
        if forward_op is None:
            return None
        op_type, inputs, outputs = forward_op
        if outputs is not None:
            hit = self._ops.get(("out", op_type) + _ids(outputs))
            if hit is not None:
                return hit
        if inputs is not None:
            return self._ops.get(("in", op_type) + _ids(inputs))
        return None
