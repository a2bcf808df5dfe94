"""Writing one eager step's op records: one call of a traced function, not one write per record.

An eager block holds its step's records until it closes. Written one by one
from Python, a record costs about 2.7 ms here (each ``write_stats`` runs a
dozen eager ops); written by a ``tf.function`` that takes them all as one
``[n, NUM_FIELDS]`` tensor with the index of each row's tag, about 10 µs,
plus one trace for each distinct list of tags (a step's tags repeat from
step to step, and a loop's records of one op share one tag whatever its trip
count: the trace writes each tag once, in a loop over the rows). A function is traced for the default
writer it writes to, so functions are kept per writer and list of tags, at
most ``MAX_FUNCTIONS`` of them; beyond, records are written one by one.
"""

from __future__ import annotations

import collections
import functools
from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from tb_numerics import _tf_internal, metadata, summary

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
        writer = _tf_internal.default_summary_writer()  # a trace writes to the writer it saw
        if not recs or writer is None or not bool(tf.summary.should_record_summaries()):
            return
        kinds = list(dict.fromkeys((tag, info) for tag, _, info in recs))  # in first-run order
        key = (id(writer), tuple(kinds))
        fn = None if step is None else self._fns.get(key)
        if fn is None:
            if step is None or len(self._fns) >= MAX_FUNCTIONS:
                for tag, vec, info in recs:  # one by one (no step: write_stats says so)
                    summary.write_stats(tag, vec, step=step, info=info)
                return
            fn = self._fns[key] = _writer_function(key[1], writer)
        which = {k: i for i, k in enumerate(kinds)}
        vecs = np.stack([np.asarray(vec, np.float64) for _, vec, _ in recs])
        rows = np.array([which[(tag, info)] for tag, _, info in recs], np.int32)
        fn(tf.constant(vecs), tf.constant(rows), tf.constant(step, tf.int64))


def _writer_function(tags_infos: tuple[tuple[str, metadata.TensorInfo], ...], writer: Any):
    """A traced function writing each row of its input to the (tag, info)
    its index names, in row order: one write per distinct tag in the trace,
    so a loop's thousand records of one op cost no bigger trace. It keeps
    ``writer`` alive as long as it may write there."""

    @tf.function(autograph=False)
    def write_all(vecs: tf.Tensor, which: tf.Tensor, step: tf.Tensor) -> tf.Tensor:
        branches = [functools.partial(_write_row, tag, info, vecs, step)
                    for tag, info in tags_infos]

        def body(i, wrote):
            branches_i = [functools.partial(b, i) for b in branches]
            return i + 1, tf.logical_or(wrote, tf.switch_case(which[i], branches_i))

        return tf.while_loop(lambda i, _: i < tf.shape(which)[0], body,
                             (tf.constant(0), tf.constant(False)))[1]

    write_all.writer = writer  # the id in the cache key must not be reused while this lives
    return write_all


def _write_row(tag: str, info: metadata.TensorInfo, vecs: tf.Tensor, step: tf.Tensor, i: tf.Tensor) -> tf.Tensor:
    return tf.convert_to_tensor(summary.write_stats(tag, vecs[i], step=step, info=info))
