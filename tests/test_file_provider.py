"""The plugin's reader of a local logdir's own files, through its public surface.

``FileProvider`` answers as TensorBoard's data provider does, from the
event files: the truth is what was written (``NumericsRecordWriter``) and
what ``tb-numerics report``'s reader reads from the same files.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from tb_numerics import event_reader, file_provider, metadata
from tb_numerics.record_writer import NumericsRecordWriter
from tb_numerics.records import numpy_stats

pytestmark = pytest.mark.unit

INFO = metadata.TensorInfo(role="activation", order=0)


def _list(fp: file_provider.FileProvider, run: str) -> dict:
    return fp.list_tensors(experiment_id="", plugin_name=metadata.PLUGIN_NAME).get(run, {})


def _read(fp: file_provider.FileProvider, run: str, tag: str) -> list:
    return fp.read_tensors(experiment_id="", plugin_name=metadata.PLUGIN_NAME)[run][tag]


def test_records_are_indexed_as_they_are_appended_and_read_back(tmp_path):
    w = NumericsRecordWriter(str(tmp_path / "a"))
    for step in range(3):
        w.write("x", step, numpy_stats(np.float32([step, 1.0])), INFO)
    w.flush()
    fp = file_provider.FileProvider(str(tmp_path), on_listing=False)
    assert fp.list_plugins(experiment_id="") == []
    assert fp.index_round() and not fp.index_round()  # nothing new the second time
    assert fp.list_plugins(experiment_id="") == [metadata.PLUGIN_NAME]
    assert _list(fp, "a")["x"].max_step == 2
    for step in range(3, 5):
        w.write("x", step, numpy_stats(np.float32([step, 1.0])), INFO)
    w.write("x", 4, numpy_stats(np.float32([np.nan])), INFO)  # logged twice at one step: both kept
    w.close()
    assert fp.index_round()
    data = _read(fp, "a", "x")
    assert [d.step for d in data] == [0, 1, 2, 3, 4, 4]
    want = event_reader.read_run("a", event_reader.find_runs(str(tmp_path))["a"]).series[0]
    assert np.array_equal(np.stack([d.numpy for d in data]), want.values, equal_nan=True)
    assert fp.problems("a") == []


def test_a_record_still_being_written_is_read_next_round(tmp_path):
    w = NumericsRecordWriter(str(tmp_path))
    w.write("x", 0, numpy_stats(np.float32([1.0])), INFO)
    w.write("x", 1, numpy_stats(np.float32([2.0])), INFO)
    w.close()
    with open(w.path, "rb") as f:
        whole = f.read()
    with open(w.path, "wb") as f:
        f.write(whole[:-20])  # the last record half written
    fp = file_provider.FileProvider(str(tmp_path), on_listing=False)
    fp.index_round()
    assert [d.step for d in _read(fp, ".", "x")] == [0]
    with open(w.path, "ab") as f:
        f.write(whole[-20:])
    fp.index_round()
    assert [d.step for d in _read(fp, ".", "x")] == [0, 1]
    assert fp.problems(".") == []  # nothing was damaged


def test_a_damaged_record_is_skipped_and_named_and_the_rest_read(tmp_path):
    w = NumericsRecordWriter(str(tmp_path / "r"))
    for step in range(4):
        w.write("x", step, numpy_stats(np.float32([step])), INFO)
    w.close()
    data = bytearray(open(w.path, "rb").read())
    offsets, at = [], 0
    while at < len(data):
        offsets.append(at)
        at += 12 + int.from_bytes(data[at : at + 8], "little") + 4
    data[offsets[3] + 12 + 5] ^= 0xFF  # the record of step 2
    open(w.path, "wb").write(bytes(data))
    fp = file_provider.FileProvider(str(tmp_path), on_listing=False)
    fp.index_round()
    assert [d.step for d in _read(fp, "r", "x")] == [0, 1, 3]
    assert any("checksum" in p for p in fp.problems("r"))


def test_a_replaced_file_is_read_again_from_the_start_and_a_removed_run_forgotten(tmp_path):
    run = tmp_path / "b"
    w = NumericsRecordWriter(str(run))
    for step in range(5):
        w.write("x", step, numpy_stats(np.float32([1.0])), INFO)
    w.close()
    fp = file_provider.FileProvider(str(tmp_path), on_listing=False)
    fp.index_round()
    os.remove(w.path)
    w = NumericsRecordWriter(str(run))
    w.write("y", 7, numpy_stats(np.float32([1.0])), INFO)
    w.close()
    fp.index_round()
    assert sorted(_list(fp, "b")) == ["y"]
    os.remove(w.path)
    os.rmdir(run)
    fp.index_round()
    assert fp.list_tensors(experiment_id="", plugin_name=metadata.PLUGIN_NAME) == {}


def test_the_index_marks_where_each_tag_may_first_hold_a_nan_or_an_infinity(tmp_path):
    """``nonfinite_steps``, the first look's guide: per tag, the step of the
    first NaN or Inf written in it (packed blocks and per-tensor tags alike),
    a -Inf the tensor allows marked too (the index errs early, never late),
    finite tags unmarked; what is appended later is marked as it is indexed."""
    x = metadata.TensorInfo(role="activation", order=0)
    mask = metadata.TensorInfo(role="activation", order=1, neginf_ok=True)
    w = NumericsRecordWriter(str(tmp_path / "a"))

    def write(lo: int, hi: int) -> None:
        for step in range(lo, hi):
            w.write_many(step, [("x", numpy_stats(np.float32([np.nan if step in (1500, 2500) else 1.0])), x),
                                ("mask", numpy_stats(np.float32([-np.inf if step == 700 else 0.0])), mask)])
            w.write("z", step, numpy_stats(np.float32([np.inf if step == 2222 else 1.0])), INFO)
        w.flush()

    write(0, 2000)
    fp = file_provider.FileProvider(str(tmp_path), on_listing=False)
    fp.index_round()
    blocks = sorted(t for t in _list(fp, "a") if t.startswith("__numerics_block__/"))
    assert len(blocks) == 2  # steps 0-999 and 1000-1999
    assert fp.nonfinite_steps("a") == {blocks[0]: 700, blocks[1]: 1500}
    write(2000, 3000)
    w.close()
    fp.index_round()
    blocks = sorted(t for t in _list(fp, "a") if t.startswith("__numerics_block__/"))
    assert fp.nonfinite_steps("a") == {blocks[0]: 700, blocks[1]: 1500, blocks[2]: 2500, "z": 2222}
    assert fp.nonfinite_steps("no such run") == {}
