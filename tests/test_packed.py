"""Packed blocks: a step's records in one event, read back as per-tensor series."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
from tensorboard.backend.event_processing import event_file_loader

from tb_numerics import analysis, event_reader, metadata, packed
from tb_numerics.record_writer import NumericsRecordWriter, numpy_stats

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
        assert dataclasses.replace(g.info, version=1) == w.info and g.info.version == 2
        np.testing.assert_array_equal(g.steps, w.steps)
        np.testing.assert_array_equal(g.values, w.values)
    assert len(by_tag["dense/kernel"].steps) == 250
    ra = analysis.analyze_run("packed", got.series, analysis.SafeRange(), [])
    first = analysis.first_anomaly(ra)
    assert (first["step"], first["tensor"], first["last_healthy_step"]) == (1234, "loss", 1233)
    # One event per step instead of one per record, and no more bytes.
    assert len(_events(p.path)) == 2500
    assert os.path.getsize(p.path) < os.path.getsize(s.path)


def test_blocks_start_every_n_steps_and_when_a_tensor_first_appears():
    packer = packed.StepPacker(steps_per_block=3)
    a, b = ("a", numpy_stats(np.float32([1.0])), ACT), ("b", numpy_stats(np.float32([2.0])), LOSS)
    out = [packer.pack([a]) for _ in range(2)] + [packer.pack([a, b])] + [packer.pack([b, a]) for _ in range(4)]
    tags = [tag for tag, _, _ in out]
    seqs = [int(t.rsplit("/", 1)[1]) for t in tags]
    assert all(packed.is_block_tag(t) for t in tags) and len({t.rsplit("/", 1)[0] for t in tags}) == 1
    # b appears in the 3rd step: a new block; then a new one every 3 steps.
    assert seqs == [0, 0, 1, 1, 1, 2, 2]
    # Metadata only with a block's first event, holding the whole table.
    firsts = [md for _, _, md in out]
    assert [md is not None for md in firsts] == [True, False, True, False, False, True, False]
    table = metadata.parse_content(firsts[2].plugin_data.content)
    assert [tag for tag, _ in table] == ["a", "b"] and dataclasses.replace(table[1][1], version=1) == LOSS
    # Rows: the tensor's index in the table, then its record.
    rows = out[3][1]
    assert rows.shape == (2, packed.COLUMNS) and rows[:, 0].tolist() == [1, 0]
    np.testing.assert_array_equal(rows[0, 1:], b[1])


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
    table = (("a", ACT), ("b", LOSS))
    good = np.r_[0.0, numpy_stats(np.float32([1.0, 2.0, 3.0]))]
    arrays = [
        np.stack([good, np.r_[1.0, numpy_stats(np.float32([1.0]))]]),
        np.stack([good, np.r_[7.0, good[1:]]]),  # index 7: no such tensor
        np.zeros((2, 5)),  # wrong width
        np.stack([good]),
        np.full((1, packed.COLUMNS), "x"),  # strings
    ]
    arrays[3][0, 1 + metadata.FIELD_INDEX["nan"]] = -1  # a negative NaN count
    problems: list[str] = []
    parts = packed.unpack_block("blk", table, np.array([0, 1, 2, 3, 4]), arrays, problems)
    assert {p.tag: p.steps.tolist() for p in parts} == {"a": [0, 1], "b": [0]}
    assert len(problems) == 3
    assert any("2 malformed packed event" in p for p in problems)
    assert any("1 packed row(s) with no tensor" in p for p in problems)
    assert any("1 malformed record(s)" in p for p in problems)


def test_a_step_written_twice_keeps_the_later_record():
    """A restarted job writes steps again under a new writer: its records win."""
    old = analysis.TensorSeries("t", ACT, np.arange(0, 10), np.tile(numpy_stats(np.float32([1.0])), (10, 1)))
    new = analysis.TensorSeries("t", ACT, np.arange(5, 15), np.tile(numpy_stats(np.float32([2.0])), (10, 1)))
    merged, offsets = packed.merge([old, new])
    assert offsets is None
    assert merged.steps.tolist() == list(range(15))
    assert merged.values[:5, metadata.FIELD_INDEX["max"]].tolist() == [1.0] * 5
    assert merged.values[5:, metadata.FIELD_INDEX["max"]].tolist() == [2.0] * 10
    # Parts side by side (several writers, any order): laid end to end.
    head = analysis.TensorSeries("t", ACT, np.arange(0, 5), old.values[:5])
    merged, offsets = packed.merge([new, head])
    assert merged.steps.tolist() == list(range(15)) and offsets == [5, 0]


def test_duplicate_tags_in_one_step_keep_the_last():
    packer = packed.StepPacker()
    tag, rows, md = packer.pack([("a", numpy_stats(np.float32([1.0])), ACT), ("a", numpy_stats(np.float32([9.0])), ACT)])
    table = metadata.parse_content(md.plugin_data.content)
    parts = packed.unpack_block(tag, table, np.array([3]), [rows], [])
    assert len(parts) == 1 and parts[0].values[0, metadata.FIELD_INDEX["max"]] == 9.0


def test_block_metadata_is_version_2_and_refused_by_the_per_tensor_parser():
    md = metadata.create_block_metadata([("a", ACT)])
    content = json.loads(md.plugin_data.content)
    assert content["version"] == 2 and content["tensors"][0]["tag"] == "a"
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
