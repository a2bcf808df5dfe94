"""TensorFlow for the writing API, with an ImportError that says what to install.

Why: tb-numerics declares no TensorFlow of its own (``setup.py``), since
pip would install a second distribution (``tensorflow-cpu`` beside
``tensorflow`` or ``tensorflow[and-cuda]``) whose files overwrite the
first's. The TensorBoard plugin and the CLI need none; the modules that
record (``summary``, ``keras``, ``oplevel``, ``xla``, ``stats``) take it
from here.
"""

from __future__ import annotations

from types import ModuleType

__all__ = ["INSTALL", "tensorflow"]

INSTALL = (
    'pip install "tb-numerics[cpu]" (TensorFlow\'s CPU build, tensorflow-cpu) or "tb-numerics[gpu]" '
    "(tensorflow[and-cuda]), or install the TensorFlow build of your choice (2.16 or later)"
)


def tensorflow(needed_by: str) -> ModuleType:
    """The ``tensorflow`` module.

    Raises:
      ImportError: TensorFlow is not installed; the message names
        ``needed_by`` and what to pip install.
    """
    try:
        import tensorflow as tf
    except ImportError as e:
        raise ImportError(
            "%s records numerics with TensorFlow, which is not installed: %s. "
            "tb-numerics installs no TensorFlow itself, so that it never adds a second build beside yours; "
            "its TensorBoard plugin and its CLI need none." % (needed_by, INSTALL)
        ) from e
    return tf
