"""Writing one eager step's op records: one call of a traced function, not one write per record.

An eager block holds its step's records until it closes. Written one by one
from Python, a record costs about 2.7 ms here (each ``write_stats`` runs a
dozen eager ops); written by a ``tf.function`` that takes them all as one
``[n, NUM_FIELDS]`` tensor, about 10 µs, plus one trace for each distinct
list of tags (a step's tags repeat from step to step; a loop whose trip
count changes makes a new list). A function is traced for the default
writer it writes to, so functions are kept per writer and list of tags, at
most ``MAX_FUNCTIONS`` of them; beyond, records are written one by one.
"""

from __future__ import annotations

import collections
from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from tb_numerics import metadata, summary

__all__ = ["StepWriter"]

MAX_FUNCTIONS = 16


class StepWriter:
    """Writes the records of eager steps to the default writer."""

    def __init__(self) -> None:
        self._fns: collections.OrderedDict = collections.OrderedDict()

    def write(self, recs: Sequence[tuple[str, Any, metadata.TensorInfo]], step: int | None) -> None:
        """Writes ``recs`` (tag, record, info) at ``step``, in their order.

        Raises:
          ValueError: ``step`` is None and there are records to write.
        """
        writer = summary._default_writer()  # noqa: SLF001 - a trace writes to the writer it saw
        if not recs or writer is None or not bool(tf.summary.should_record_summaries()):
            return
        key = (id(writer), tuple((tag, info) for tag, _, info in recs))
        fn = None if step is None else self._fns.get(key)
        if fn is None:
            if step is None or len(self._fns) >= MAX_FUNCTIONS:
                for tag, vec, info in recs:  # one by one (no step: write_stats says so)
                    summary.write_stats(tag, vec, step=step, info=info)
                return
            fn = self._fns[key] = _writer_function(key[1], writer)
        vecs = np.stack([np.asarray(vec, np.float64) for _, vec, _ in recs])
        fn(tf.constant(vecs), tf.constant(step, tf.int64))


def _writer_function(tags_infos: tuple[tuple[str, metadata.TensorInfo], ...], writer: Any):
    """A traced function writing one row of its input per (tag, info); it
    keeps ``writer`` alive as long as it may write there."""

    @tf.function(autograph=False)
    def write_all(vecs: tf.Tensor, step: tf.Tensor) -> tf.Tensor:
        wrote = [summary.write_stats(tag, vecs[i], step=step, info=info)
                 for i, (tag, info) in enumerate(tags_infos)]
        return tf.reduce_any(tf.stack(wrote))

    write_all.writer = writer  # the id in the cache key must not be reused while this lives
    return write_all
