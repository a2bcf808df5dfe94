"""Packed blocks: a step's records in one event, read back as per-tensor series."""

from __future__ import annotations

import dataclasses
import json
import os
import zlib

import numpy as np
import pytest
from tensorboard.backend.event_processing import event_file_loader
from tensorboard.compat.proto import types_pb2

from tb_numerics import analysis, event_reader, metadata, packed, records
from tb_numerics.record_writer import NumericsRecordWriter
from tb_numerics.records import numpy_stats

pytestmark = pytest.mark.unit

ACT = metadata.TensorInfo(role="activation", order=0, shape=(3,), description="model.py:3")
LOSS = metadata.TensorInfo(role="loss", order=1, shape=())
WEIGHT = metadata.TensorInfo(role="weight", order=2, shape=(2,))


def _records(step: int) -> list:
    """What a callback writes: activations and loss every step, weights every 10th."""
    out = [
        ("dense/output", numpy_stats(np.float32([step, -1.0, 0.0])), ACT),
        ("loss", numpy_stats(np.float32([np.nan if step == 1234 else 0.5])), LOSS),
    ]
    if step % 10 == 0:
        out.append(("dense/kernel", numpy_stats(np.float32([1.0, step])), WEIGHT))
    return out


def _events(path: str) -> list:
    return [e for e in event_file_loader.EventFileLoader(path).Load() if e.HasField("summary")]


def test_packed_run_reads_back_like_the_same_records_written_per_tensor(tmp_path):
    with NumericsRecordWriter(str(tmp_path / "packed")) as p, NumericsRecordWriter(str(tmp_path / "single")) as s:
        for step in range(2500):
            records = _records(step)
            p.write_many(step, records)
            for tag, stats, info in records:
                s.write(tag, step, stats, info)
    got = event_reader.read_run("packed", [p.path])
    want = event_reader.read_run("single", [s.path])
    assert got.problems == [] and want.problems == []
    by_tag = {x.tag: x for x in got.series}
    assert sorted(by_tag) == ["dense/kernel", "dense/output", "loss"]
    for w in want.series:
        g = by_tag[w.tag]
        assert dataclasses.replace(g.info, version=1) == w.info and g.info.version == 3
        np.testing.assert_array_equal(g.steps, w.steps)
        np.testing.assert_array_equal(g.values, w.values)
    assert len(by_tag["dense/kernel"].steps) == 250
    ra = analysis.analyze_run("packed", got.series, analysis.SafeRange(), [])
    first = analysis.first_anomaly(ra)
    assert (first["step"], first["tensor"], first["last_healthy_step"]) == (1234, "loss", 1233)
    # STEPS_PER_EVENT steps per event instead of one event per record; the
    # step with the NaN and each block's last end their events early.
    # Float32 records go as float32 rows.
    events = _events(p.path)
    k = packed.STEPS_PER_EVENT
    rows = [len(e.summary.value[0].tensor.tensor_content) // (4 * packed.COLUMNS) for e in events]
    assert 1234 in [e.step for e in events] and 2500 / k <= len(events) <= 2500 / k + 3
    assert max(rows) <= 3 * k and sum(rows) == sum(len(_records(s)) for s in range(2500))
    assert {e.summary.value[0].tensor.dtype for e in events} == {types_pb2.DT_FLOAT}
    assert os.path.getsize(p.path) < os.path.getsize(s.path) / 2


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_blocks_start_every_n_steps_and_when_a_tensor_first_appears():
    packer = packed.StepPacker(steps_per_block=3, steps_per_event=1)
    a, b = ("a", numpy_stats(np.float32([1.0])), ACT), ("b", numpy_stats(np.float32([2.0])), LOSS)
    out = [e for step, recs in enumerate([[a]] * 2 + [[a, b]] + [[b, a]] * 4) for e in packer.add(step, recs, 0.0)]
    tags = [e.tag for e in out]
    seqs = [int(t.rsplit("/", 1)[1]) for t in tags]
    assert all(packed.is_block_tag(t) for t in tags) and len({t.rsplit("/", 1)[0] for t in tags}) == 1
    # b appears in the 3rd step: a new block; then a new one every 3 steps.
    assert seqs == [0, 0, 1, 1, 1, 2, 2]
    # A block's first event holds its whole table as JSON; each later one a
    # compressed copy of the same table, so the block outlives its first event.
    contents = [e.metadata.plugin_data.content for e in out]
    assert [c.startswith(b"{") for c in contents] == [True, False, True, False, False, True, False]
    tables = [metadata.parse_content(c) for c in contents]
    assert tables[2:5] == [tables[2]] * 3 and tables[0] == tables[1] and tables[5] == tables[6]
    assert all(len(c) < len(contents[2]) for c in contents[3:5])
    table = tables[2]
    assert [tag for tag, _ in table] == ["a", "b"] and dataclasses.replace(table[1][1], version=1) == LOSS
    # Rows: the tensor's index in the table, the step, then its record.
    rows = out[3].rows
    assert rows.shape == (2, packed.COLUMNS) and rows[:, 0].tolist() == [1, 0] and rows[:, 1].tolist() == [3, 3]
    np.testing.assert_array_equal(rows[0, 2:], b[1])


def test_steps_wait_for_their_event_but_a_bad_step_or_a_slow_one_is_written_at_once():
    clock = _Clock()
    packer = packed.StepPacker(steps_per_event=4, clock=clock)
    ok = [("a", numpy_stats(np.float32([1.0])), ACT)]
    bad = [("a", numpy_stats(np.float32([np.inf])), ACT)]

    def add(step, recs=ok):
        return [(e.step, e.rows[:, 1].tolist()) for e in packer.add(step, recs, 100.0 + step)]

    assert [add(s) for s in range(3)] == [[], [], []]
    assert add(3) == [(3, [0, 1, 2, 3])]  # full
    assert add(4) == [] and add(5, bad) == [(5, [4, 5])]  # a non-finite value: at once
    assert add(6) == []
    clock.now += packed.MAX_DELAY_S  # the next step comes late: both are written
    assert add(7) == [(7, [6, 7])]
    assert add(8) == []
    flushed = packer.flush()
    assert [(e.step, e.rows[:, 1].tolist(), e.wall_time) for e in flushed] == [(8, [8], 108.0)]
    assert packer.flush() == []


def test_a_closed_writer_has_written_every_step(tmp_path):
    with NumericsRecordWriter(str(tmp_path)) as w:
        for step in range(13):
            w.write_many(step, _records(step))
        w.flush()
        assert sorted(s.steps[-1] for s in event_reader.read_run(".", [w.path]).series) == [10, 12, 12]
        w.write_many(13, _records(13))
    rr = event_reader.read_run(".", [w.path])
    assert {s.tag: s.steps.tolist() for s in rr.series} == {
        "dense/output": list(range(14)), "loss": list(range(14)), "dense/kernel": [0, 10]}


def test_rows_are_float64_where_float32_would_round_them(tmp_path):
    exact = numpy_stats(np.float32([1.5, -2.0]))
    fine = numpy_stats(np.float64([0.1, 3.0]))  # 0.1 is not a float32
    with NumericsRecordWriter(str(tmp_path)) as w:
        w.write_many(0, [("a", exact, ACT)])
        w.flush()
        w.write_many(1, [("a", fine, ACT)])
        w.write_many(2**24 + 1, [("a", exact, ACT)])  # a step float32 cannot hold
    dtypes = [e.summary.value[0].tensor.dtype for e in _events(w.path)]
    assert dtypes == [types_pb2.DT_FLOAT, types_pb2.DT_DOUBLE]
    (series,) = event_reader.read_run(".", [w.path]).series
    assert series.steps.tolist() == [0, 1, 2**24 + 1]
    np.testing.assert_array_equal(series.values, [exact, fine, exact])


def test_version_2_blocks_one_step_per_event_still_read():
    """Logs written in format 2, one step per event: no step column, the event's step."""
    table = (("a", dataclasses.replace(ACT, version=2)), ("b", dataclasses.replace(LOSS, version=2)))
    rec = numpy_stats(np.float32([1.0, 2.0]))
    arrays = [np.stack([np.r_[0.0, rec], np.r_[1.0, rec * 2]]) for _ in range(3)]
    parts = packed.unpack_block("blk", table, np.array([5, 6, 8]), arrays, [])
    assert {p.tag: p.steps.tolist() for p in parts} == {"a": [5, 6, 8], "b": [5, 6, 8]}
    np.testing.assert_array_equal(parts[1].values, np.tile(rec * 2, (3, 1)))
    # A version-3 event (a step column) in a version-2 block is malformed.
    problems: list[str] = []
    assert packed.unpack_block("blk", table, np.array([1]), [np.zeros((1, packed.COLUMNS))], problems) == []
    assert problems == ["blk: 1 malformed packed event(s) skipped"]


def test_a_bad_record_writes_nothing_and_the_writer_goes_on(tmp_path):
    with NumericsRecordWriter(str(tmp_path)) as w:
        w.write_many(0, _records(0))
        with pytest.raises(ValueError, match="11 fields, got 3"):
            w.write_many(1, [("new/tensor", numpy_stats(np.float32([1.0])), ACT), ("bad", np.zeros(3), ACT)])
        with pytest.raises(ValueError, match="needs its TensorInfo"):
            w.write_many(1, [("never/seen", numpy_stats(np.float32([1.0])), None)])
        w.write_many(1, [("new/tensor", numpy_stats(np.float32([3.0])), ACT)] + _records(1)[:1])
    rr = event_reader.read_run(".", [w.path])
    assert rr.problems == []
    steps = {s.tag: s.steps.tolist() for s in rr.series}
    assert steps == {"dense/output": [0, 1], "loss": [0], "dense/kernel": [0], "new/tensor": [1]}


def test_damaged_rows_are_skipped_and_reported_the_rest_kept():
    table = (("a", dataclasses.replace(ACT, version=3)), ("b", dataclasses.replace(LOSS, version=3)))
    good = numpy_stats(np.float32([1.0, 2.0, 3.0]))
    arrays = [
        np.stack([np.r_[0.0, 0, good], np.r_[1.0, 0, numpy_stats(np.float32([1.0]))], np.r_[0.0, 1, good]]),
        np.stack([np.r_[7.0, 1, good], np.r_[1.0, np.nan, good], np.r_[1.0, -3, good]]),  # no tensor 7, bad steps
        np.zeros((2, 5)),  # wrong width
        np.stack([np.r_[0.0, 3, good]]),
        np.full((1, packed.COLUMNS), "x"),  # strings
    ]
    arrays[3][0, 2 + metadata.FIELD_INDEX["nan"]] = -1  # a negative NaN count
    problems: list[str] = []
    parts = packed.unpack_block("blk", table, np.array([1, 1, 2, 3, 4]), arrays, problems)
    assert {p.tag: p.steps.tolist() for p in parts} == {"a": [0, 1], "b": [0]}
    assert len(problems) == 3
    assert any("2 malformed packed event" in p for p in problems)
    assert any("3 packed row(s) with no tensor in the block's table or no valid step" in p for p in problems)
    assert any("1 malformed record(s)" in p for p in problems)


def test_a_step_written_twice_keeps_the_later_record():
    """A restarted job writes steps again under a new writer: its records win."""
    old = records.TensorSeries("t", ACT, np.arange(0, 10), np.tile(numpy_stats(np.float32([1.0])), (10, 1)))
    new = records.TensorSeries("t", ACT, np.arange(5, 15), np.tile(numpy_stats(np.float32([2.0])), (10, 1)))
    merged, offsets = packed.merge([old, new])
    assert offsets is None
    assert merged.steps.tolist() == list(range(15))
    assert merged.values[:5, metadata.FIELD_INDEX["max"]].tolist() == [1.0] * 5
    assert merged.values[5:, metadata.FIELD_INDEX["max"]].tolist() == [2.0] * 10
    # Parts side by side (several writers, any order): laid end to end.
    head = records.TensorSeries("t", ACT, np.arange(0, 5), old.values[:5])
    merged, offsets = packed.merge([new, head])
    assert merged.steps.tolist() == list(range(15)) and offsets == [5, 0]


def test_steps_a_later_writer_wrote_again_are_named_as_a_restart():
    """Issue 30 item 8: the replaced steps are said (restarts), only where the
    wall times show one writer starting after the other ended."""
    one = numpy_stats(np.float32([1.0]))
    old = records.TensorSeries("t", ACT, np.arange(0, 10), np.tile(one, (10, 1)), written=(100.0, 110.0))
    new = records.TensorSeries("t", ACT, np.arange(5, 15), np.tile(one, (10, 1)), written=(200.0, 210.0))
    restarts: list = []
    packed.merge([old, new], restarts=restarts)
    assert restarts == [("t", 5, 9)]
    assert packed.restart_summary(restarts + [("ops/t/Log", 0, 20)]) == [{"first_step": 5, "last_step": 9, "tensors": 1}]
    # Two writers at once, or a part with no wall times: no restart is claimed.
    for written in ((105.0, 120.0), None):
        restarts = []
        packed.merge([old, dataclasses.replace(new, written=written)], restarts=restarts)
        assert restarts == []


def _per_tensor_trainings(run_dir: str, spans: list[tuple[range, float]]) -> None:
    """Each (steps, start wall time) a training writing "loss" one record an event, into its own file."""
    for k, (steps, start) in enumerate(spans):
        with NumericsRecordWriter(run_dir) as w:
            for i, step in enumerate(steps):
                w.write("loss", step, numpy_stats(np.float32([1.0 + k])), ACT, wall_time=start + i)
        # Named for its start, as a writer starting later names its file (two
        # files made in one second by one process sort in any order).
        rest = os.path.basename(w.path).split(".", 4)[4]
        os.rename(w.path, os.path.join(run_dir, "events.out.tfevents.%010d.%s" % (1_700_000_000 + k, rest)))


@pytest.mark.parametrize("second_start, restarted", [(1000.0, True), (5.0, False)])
def test_per_tensor_records_a_later_training_wrote_again_are_a_restart(tmp_path, second_start, restarted):
    """Issue 30 item 8, for records written one an event (``NumericsRecordWriter.write``):
    a second training that starts after the first ended replaces the steps it
    wrote again, and the run says so; two writers at once keep both and are named."""
    run = str(tmp_path / "run")
    _per_tensor_trainings(run, [(range(0, 20), 0.0), (range(10, 30), second_start)])
    rr = event_reader.read_run("run", event_reader.find_runs(str(tmp_path))["run"])
    (s,) = [s for s in rr.series if s.tag == "loss"]
    mx = s.values[:, metadata.FIELD_INDEX["max"]]
    if restarted:
        assert s.steps.tolist() == list(range(30))
        assert mx[:10].tolist() == [1.0] * 10 and mx[10:].tolist() == [2.0] * 20
        assert rr.restarts == [{"first_step": 10, "last_step": 19, "tensors": 1}]
    else:
        assert len(s.steps) == 40 and rr.restarts == []
        assert any("loss" in p and "at once" in p for p in rr.problems), rr.problems


def test_a_tag_logged_twice_in_one_step_keeps_both_occurrences():
    packer = packed.StepPacker()
    packer.add(3, [("a", numpy_stats(np.float32([1.0])), ACT), ("a", numpy_stats(np.float32([9.0])), ACT)], 0.0)
    (e,) = packer.flush()
    table = metadata.parse_content(e.metadata.plugin_data.content)
    parts = packed.unpack_block(e.tag, table, np.array([3]), [e.rows], [])
    assert len(parts) == 1 and parts[0].steps.tolist() == [3, 3]
    assert parts[0].values[:, metadata.FIELD_INDEX["max"]].tolist() == [1.0, 9.0]


def test_block_metadata_is_version_3_and_refused_by_the_per_tensor_parser():
    md = metadata.create_block_metadata([("a", ACT)])
    content = json.loads(md.plugin_data.content)
    assert content["version"] == 3 and content["tensors"][0]["tag"] == "a"
    assert content["tensors"][0]["description"] == "model.py:3"
    with pytest.raises(metadata.FormatError, match="packed block"):
        metadata.parse_plugin_metadata(md.plugin_data.content)
    # Per-tensor records stay version 1, which older readers read.
    assert json.loads(metadata.create_summary_metadata(ACT).plugin_data.content)["version"] == 1


@pytest.mark.parametrize(
    "tensors, error",
    [
        ([], "non-empty list"),
        ([{"dtype": "float32"}], "without a tag name"),
        ([{"tag": "a", "dtype": "float32"}, {"tag": "a", "dtype": "float32"}], "names 'a' twice"),
        ([{"tag": "a", "dtype": "int8"}], "a: numerics metadata names an unsupported dtype"),
    ],
)
def test_malformed_block_tables_are_refused_by_name(tensors, error):
    content = json.dumps({"version": 2, "tensors": tensors}).encode()
    with pytest.raises(metadata.FormatError, match=error):
        metadata.parse_content(content)


def test_a_compressed_table_reads_like_the_full_one_and_a_bad_one_is_refused():
    tensors = [("dense%02d/output" % i, dataclasses.replace(ACT, order=i)) for i in range(50)]
    full = metadata.create_block_metadata(tensors).plugin_data.content
    compact = metadata.create_block_metadata(tensors, compact=True).plugin_data.content
    assert metadata.parse_content(compact) == metadata.parse_content(full) and len(compact) < len(full) / 5
    with pytest.raises(metadata.FormatError, match="not valid compressed JSON"):
        metadata.parse_content(compact[:-3] + b"xyz")
    bomb = zlib.compress(b"{" + b" " * (65 << 20) + b"}")
    with pytest.raises(metadata.FormatError, match="inflates to more than"):
        metadata.parse_content(bomb)


def test_an_events_earliest_possibly_nonfinite_step_errs_early_never_late():
    """``nonfinite_step``, the index's guide to a first look: the least step
    whose record may hold a NaN or an infinity, in each layout an event's
    tensor has; a count that is itself not a number counts, a row whose step
    is not one does not, and anything that is no record is None."""
    rec = numpy_stats(np.float32([1.0, 2.0]))
    bad = numpy_stats(np.float32([np.nan, -np.inf]))

    def rows(*steps_and_records):
        return np.stack([np.r_[0.0, s, r] for s, r in steps_and_records]).astype(np.float32)

    assert packed.nonfinite_step(rows((10, rec), (11, rec)), 11) is None
    assert packed.nonfinite_step(rows((10, rec), (11, bad), (12, bad)), 12) == 11
    neginf_only = numpy_stats(np.float32([-np.inf]))
    assert packed.nonfinite_step(rows((10, neginf_only), (11, rec)), 11) == 10  # allowed or not: the readers decide
    nan_count = rec.copy()
    nan_count[metadata.FIELD_INDEX["posinf"]] = np.nan
    assert packed.nonfinite_step(rows((3, rec), (4, nan_count)), 4) == 4
    assert packed.nonfinite_step(rows((-1, bad), (7, bad)), 7) == 7  # a row of no step is skipped by the readers
    assert packed.nonfinite_step(rows((-1, bad)), 7) is None
    assert packed.nonfinite_step(np.stack([np.r_[0.0, bad], np.r_[1.0, rec]]), 5) == 5  # version 2: the event's step
    assert packed.nonfinite_step(bad, 9) == 9 and packed.nonfinite_step(rec, 9) is None  # a per-tensor record
    assert packed.nonfinite_step(np.array([b"x"]), 9) is None
    assert packed.nonfinite_step(np.zeros((2, 5)), 9) is None
