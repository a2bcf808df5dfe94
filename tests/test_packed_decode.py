"""``packed.decode_tag``: one decoding of a tag's events, per-tensor or packed."""

from __future__ import annotations

import numpy as np
import pytest

from tb_numerics import metadata, packed
from tb_numerics.records import numpy_stats

pytestmark = pytest.mark.unit

ACT = metadata.TensorInfo(role="activation", order=0, shape=(3,))
LOSS = metadata.TensorInfo(role="loss", order=1, shape=())
F = metadata.FIELD_INDEX


def test_a_per_tensor_tag_gives_one_float64_series_of_its_valid_records():
    arrays = [numpy_stats(np.float32([s, 1.0, 2.0])) for s in range(4)]
    arrays[1] = arrays[1].astype(np.float32)  # events may hold either float dtype
    arrays[2] = arrays[2][:5]  # a record of the wrong length
    problems: list[str] = []
    (s,) = packed.decode_tag("dense/output", ACT, np.array([0, 1, 2, 3]), arrays, problems)
    assert (s.tag, s.info, s.steps.tolist()) == ("dense/output", ACT, [0, 1, 3])
    assert s.values.dtype == np.float64 and s.values[:, F["max"]].tolist() == [2.0, 2.0, 3.0]
    assert problems == ["dense/output: 1 malformed record(s) skipped"]


def test_a_per_tensor_tag_takes_steps_as_a_list_and_records_of_any_shape():
    """The event-file reader's form: a list of steps, records as they come
    (a record that cannot be a float array is skipped, not an error)."""
    rows = [numpy_stats(np.float32([1.0])), numpy_stats(np.float32([2.0])).reshape(1, -1), np.array(["x"])]
    problems: list[str] = []
    (s,) = packed.decode_tag("loss", LOSS, [5, 6, 7], rows, problems)
    assert s.steps.tolist() == [5, 6] and s.values[:, F["max"]].tolist() == [1.0, 2.0]
    assert problems == ["loss: 1 malformed record(s) skipped"]
    (empty,) = packed.decode_tag("loss", LOSS, [], [], [])
    assert empty.steps.size == 0 and empty.values.shape == (0, metadata.NUM_FIELDS)


def test_a_packed_block_gives_one_part_per_tensor():
    packer = packed.StepPacker(steps_per_event=2)
    events = []
    for step in range(4):
        records = [("dense/output", numpy_stats(np.float32([step, 1.0, 0.0])), ACT),
                   ("loss", numpy_stats(np.float32([0.5])), LOSS)]
        events += packer.add(step, records, wall_time=0.0)
    events += packer.flush()
    table = metadata.parse_content(events[0].metadata.plugin_data.content)
    problems: list[str] = []
    parts = packed.decode_tag(events[0].tag, table, [e.step for e in events], [e.rows for e in events], problems)
    assert problems == []
    assert [(p.tag, p.info.role, p.steps.tolist()) for p in parts] == [
        ("dense/output", "activation", [0, 1, 2, 3]), ("loss", "loss", [0, 1, 2, 3])]
    assert parts[0].values[:, F["max"]].tolist() == [1.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("first_step", [np.nan, -1.0, 0.5])
def test_a_block_whose_first_row_has_no_valid_step_loses_only_that_row(first_step):
    """A damaged step column (a NaN step differs even from itself) is not
    the usual block: its other rows are read as any block's are."""
    packer = packed.StepPacker(steps_per_event=4)
    events = []
    for step in range(4):
        events += packer.add(step, [("dense/output", numpy_stats(np.float32([step, 1.0, 0.0])), ACT),
                                    ("loss", numpy_stats(np.float32([0.5])), LOSS)], wall_time=0.0)
    events += packer.flush()
    table = metadata.parse_content(events[0].metadata.plugin_data.content)
    rows = np.array(events[0].rows, dtype=np.float64)
    rows[0, 1] = first_step
    problems: list[str] = []
    parts = packed.decode_tag(events[0].tag, table, [events[0].step], [rows], problems)
    assert [(p.tag, p.steps.tolist()) for p in parts] == [("dense/output", [1, 2, 3]), ("loss", [0, 1, 2, 3])]
    assert problems == ["%s: 1 packed row(s) with no tensor in the block's table or no valid step skipped"
                        % events[0].tag]
