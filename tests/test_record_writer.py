"""NumericsRecordWriter's event files, as TensorBoard itself reads them."""

import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.util import tensor_util

from tb_numerics import event_reader, metadata
from tb_numerics.record_writer import NumericsRecordWriter
from tb_numerics.records import F, numpy_stats

pytestmark = pytest.mark.unit

INFO = metadata.TensorInfo(role="activation", order=0, shape=(4,))


def test_a_step_written_again_by_a_later_writer_stands_for_the_earlier_one(tmp_path):
    """A run whose step counter starts again (``fit`` after ``compile``: a new
    optimizer counts from 0) writes its steps again from a new writer, often
    within the same second as the first. TensorBoard reads a run's files in
    name order and keeps a step's latest write (the oracle: its own
    ``EventAccumulator``); the product's reader must show the same, so each
    writer's file sorts after the files of the writers made before it."""
    paths = []
    for k in range(20):
        with NumericsRecordWriter(str(tmp_path)) as w:
            for step in range(3 if k == 0 else 1):
                w.write("x", step, numpy_stats(np.array([0.0, 1.0, 2.0, float(k)]), "float32"), INFO)
        paths.append(w.path)
    assert sorted(paths) == paths

    acc = event_accumulator.EventAccumulator(str(tmp_path), size_guidance={event_accumulator.TENSORS: 0})
    acc.Reload()
    # Each step's latest write, in the order TensorBoard read them.
    tensorboard_max = {e.step: tensor_util.make_ndarray(e.tensor_proto)[F["max"]] for e in acc.Tensors("x")}
    assert tensorboard_max[0] == 19.0

    (run,) = event_reader.read_logdir(str(tmp_path))
    (series,) = [s for s in run.series if s.tag == "x"]
    assert dict(zip(series.steps.tolist(), series.values[:, F["max"]].tolist())) == tensorboard_max
