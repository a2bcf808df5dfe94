"""Combining records: of several tensors (a layer's repeated calls), and of
every replica's values under a ``tf.distribute`` strategy.

A record of the concatenation of tensors follows from theirs: counts and
sums add, min and max of the parts'. Under several replicas the records are
all-gathered (one collective) and combined, so the one record written
describes every replica's values.
"""

from __future__ import annotations

import numpy as np

from tb_numerics import _requires

tf = _requires.tensorflow(__name__)

from tb_numerics import metadata  # noqa: E402
from tb_numerics.records import F  # noqa: E402

__all__ = [
    "all_reduce_many_stats",
    "all_reduce_stats",
    "combine_replicas",
    "combine_stats",
    "gather_replicas",
    "merge_stats",
    "replica_context",
]


def merge_stats(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    """The record of the concatenation of two tensors, from their records."""
    return combine_stats(tf.stack([tf.convert_to_tensor(a, tf.float64), tf.convert_to_tensor(b, tf.float64)]))


def combine_stats(records: tf.Tensor) -> tf.Tensor:
    """The record of the concatenation of several tensors, from ``[k, F]`` records.

    Counts and sums add; min is the min of the mins and max the max of the
    maxes, where NaN (no finite value in that part) does not win.
    """
    records = tf.reshape(tf.convert_to_tensor(records, tf.float64), [-1, metadata.NUM_FIELDS])
    inf = tf.constant(np.inf, tf.float64)
    nan = tf.constant(np.nan, tf.float64)
    lo = tf.reduce_min(tf.where(tf.math.is_nan(records[:, F["min"]]), inf, records[:, F["min"]]))
    hi = tf.reduce_max(tf.where(tf.math.is_nan(records[:, F["max"]]), -inf, records[:, F["max"]]))
    parts = tf.unstack(tf.reduce_sum(records, axis=0), num=metadata.NUM_FIELDS)
    parts[F["min"]] = tf.where(tf.math.is_inf(lo), nan, lo)
    parts[F["max"]] = tf.where(tf.math.is_inf(hi), nan, hi)
    return tf.stack(parts)


def replica_context() -> tf.distribute.ReplicaContext | None:
    """The replica context when inside ``strategy.run`` with several replicas, else None."""
    ctx = tf.distribute.get_replica_context()
    if ctx is not None and ctx.num_replicas_in_sync > 1:
        return ctx
    return None


def all_reduce_stats(stats: tf.Tensor, replica_context: tf.distribute.ReplicaContext) -> tf.Tensor:
    """Combines each replica's record into the record of all their values.

    Call in replica context (inside ``strategy.run``); every replica gets the
    combined record. One collective: the records are all-gathered (the
    replica context's all-reduce has only SUM and MEAN, and min and max need
    their own rule) and combined by ``combine_stats``.
    """
    return all_reduce_many_stats(tf.expand_dims(stats, 0), replica_context)[0]


def all_reduce_many_stats(records: tf.Tensor, replica_context: tf.distribute.ReplicaContext) -> tf.Tensor:
    """``all_reduce_stats`` of each row of ``[k, F]`` records, in one collective."""
    return combine_replicas(gather_replicas(records, replica_context))


def gather_replicas(records: tf.Tensor, replica_context: tf.distribute.ReplicaContext) -> tf.Tensor:
    """Every replica's ``[k, F]`` records, ``[replicas, k, F]``, on every replica (one collective)."""
    gathered = replica_context.all_gather(tf.expand_dims(records, 0), axis=0)
    gathered.set_shape([replica_context.num_replicas_in_sync] + records.shape.as_list())  # all_gather drops it
    return gathered


def combine_replicas(gathered: tf.Tensor) -> tf.Tensor:
    """The ``[k, F]`` records of all replicas' values together, from ``gather_replicas``."""
    return tf.stack([combine_stats(gathered[:, i]) for i in range(gathered.shape[1])])
