"""Helpers for the op-level tests: source lines of marked test code, and the
first-non-finite-op marks an eager block or a replay writes."""

from __future__ import annotations

import pathlib

import tensorflow as tf

from tb_numerics import metadata, oplevel

__all__ = ["line_of", "marks"]


def line_of(path: str, marker: str) -> int:
    """The line of ``path`` that ends with ``marker`` (a comment)."""
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if line.rstrip().endswith(marker) and "line_of(" not in line:
                return i
    raise AssertionError("no line of %s ends with %r" % (path, marker))


def marks(logdir) -> list[dict]:
    """The marks of a run directory, each with its event's step, in file order."""
    out = []
    for path in sorted(pathlib.Path(logdir).glob("events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                if value.tag == metadata.OP_MARK_TAG:
                    out.append(dict(oplevel.parse_mark(value.metadata.summary_description), step=event.step))
    return out
