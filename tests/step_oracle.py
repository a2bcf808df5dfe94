"""The step oracle: ``tf.summary`` says at which step a record must be.

A test writes a ``tf.summary.scalar`` whose tag ends in "oracle" beside
each logging call, with the same step argument, holding the call's id; the
logged tensor's finite max is that id too. ``assert_steps_agree`` reads
both back and asserts that each record sits at the step of its scalar.
"""

from __future__ import annotations

import os

import tensorflow as tf
from tensorboard.compat.proto import event_pb2

from tb_numerics import event_reader, metadata

MAX = metadata.FIELD_INDEX["max"]


def oracle_steps(logdir: str) -> dict[int, list[int]]:
    """id -> the steps ``tf.summary`` wrote its "oracle" scalars at."""
    out: dict[int, list[int]] = {}
    for name in sorted(os.listdir(logdir)):
        for rec in tf.data.TFRecordDataset(os.path.join(logdir, name)):
            event = event_pb2.Event.FromString(rec.numpy())
            for value in event.summary.value:
                if value.tag.endswith("oracle"):  # tf.cond and loops add a name scope
                    out.setdefault(round(float(tf.make_ndarray(value.tensor))), []).append(event.step)
    return out


def record_steps(logdir: str, prefix: str) -> dict[int, list[int]]:
    """id (a record's max) -> the steps of the records of tags starting with ``prefix``."""
    out: dict[int, list[int]] = {}
    (run,) = event_reader.read_logdir(logdir)
    assert run.problems == []
    for series in run.series:
        if series.tag.startswith(prefix):
            for step, values in zip(series.steps.tolist(), series.values):
                out.setdefault(round(float(values[MAX])), []).append(step)
    return out


def assert_steps_agree(logdir: str, prefix: str = "t") -> None:
    recorded, oracle = record_steps(logdir, prefix), oracle_steps(logdir)
    assert recorded, "nothing recorded"
    for key, steps in recorded.items():
        assert sorted(set(steps)) == sorted(set(oracle[key])), (key, recorded, oracle)
