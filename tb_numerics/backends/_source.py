"""The user's source line of an op on JAX and PyTorch: the innermost frame of the user's own code.

Frames of tb-numerics, Keras, JAX, PyTorch, numpy and the standard library
are never "the user's line" (as ``oplevel.source`` does for TensorFlow, without
importing it). A built-in Keras layer has no user frame of its own inside
the step; its line is then the one that started training (``model.fit``),
as on TensorFlow.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sysconfig
import traceback
from typing import Iterable

__all__ = ["LIBRARIES", "format_where", "python_stack", "user_frame"]

# Packages whose frames are never the user's line: the frameworks and what Keras calls through.
LIBRARIES = ("keras", "jax", "jaxlib", "torch", "numpy", "optree", "ml_dtypes", "absl")


@functools.lru_cache(maxsize=1)
def _library_dirs() -> tuple[str, ...]:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tb_numerics/
    dirs = [here, sysconfig.get_paths()["stdlib"]]
    for mod in LIBRARIES:
        spec = importlib.util.find_spec(mod)
        if spec is not None and spec.submodule_search_locations:
            dirs.extend(spec.submodule_search_locations)
    return tuple(os.path.join(os.path.realpath(d), "") for d in dirs)


@functools.lru_cache(maxsize=4096)
def _is_library_file(filename: str) -> bool:
    if filename.startswith("<"):  # <frozen ...>, <string>
        return True
    return os.path.realpath(filename).startswith(_library_dirs())


def user_frame(frames: Iterable[tuple[str, int, str]]) -> tuple[str, int, str] | None:
    """The first of ``frames`` (file, line, function; innermost first) in the user's code."""
    for frame in frames:
        if not _is_library_file(frame[0]):
            return frame
    return None


def python_stack() -> list[tuple[str, int, str]]:
    """The calling thread's Python stack, innermost first."""
    return [(f.filename, f.lineno or 0, f.name) for f in reversed(traceback.extract_stack())]


def format_where(frame: tuple[str, int, str] | None) -> str:
    """``file.py:LINE (function)`` of a frame, the file relative to the working directory below it."""
    if frame is None:
        return ""
    filename = frame[0]
    try:
        rel = os.path.relpath(filename)
        filename = filename if rel.startswith(os.pardir) else rel
    except ValueError:  # another drive on Windows
        pass
    # A function's own name, as TensorFlow's creation stacks give it (Python's qualified name is Class.method).
    return "%s:%d (%s)" % (filename, frame[1], frame[2].rsplit(".", 1)[-1])
