"""Corrupt and hostile event files: skipped for what cannot be read, reported
once, everything readable still served, no crash, no 500.

One logdir holds one run per kind of damage. Each is checked through the
offline CLI (``tb-numerics report``), through ``event_reader`` with both
record readers (TensorFlow's and the pure-Python one), and through a real
``tensorboard`` process with the Rust data server and with the Python loader.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import struct
import subprocess
import sys
from typing import Callable

import numpy as np
import pytest
from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

from tb_numerics import event_reader, metadata
from tb_numerics.record_writer import NumericsRecordWriter, stats_tensor_proto
from tb_numerics.records import numpy_stats

from tb_process import tensorboard, wait_for

pytestmark = pytest.mark.e2e

INFO = metadata.TensorInfo(dtype="float32", role="activation", order=0)
STEPS = 10
NAN_STEP = 7


def frame(data: bytes) -> bytes:
    """One TFRecord: length, its masked CRC, the data, the data's masked CRC."""
    header = struct.pack("<Q", len(data))
    return (
        header + struct.pack("<I", masked_crc32c(header)) + data + struct.pack("<I", masked_crc32c(data))
    )


def event_bytes(tag: str, step: int, tensor: tensor_pb2.TensorProto, content: bytes | None) -> bytes:
    """A serialized event of one numerics value; ``content`` is its plugin metadata."""
    value = summary_pb2.Summary.Value(tag=tag, tensor=tensor)
    if content is not None:
        value.metadata.CopyFrom(metadata.create_summary_metadata(INFO))
        value.metadata.plugin_data.content = content
    return event_pb2.Event(wall_time=1.0 + step, step=step, summary=summary_pb2.Summary(value=[value])).SerializeToString()


def stats(step: int) -> np.ndarray:
    """Statistics of a 64-value tensor; non-finite at NAN_STEP."""
    v = np.linspace(-1, 1, 64, dtype=np.float32) * (1 + step)
    if step == NAN_STEP:
        v[:2] = np.nan
    return numpy_stats(v)


def good_run(path: str) -> str:
    """Tag "t" over STEPS steps, non-finite at NAN_STEP; returns its file."""
    with NumericsRecordWriter(path) as w:
        for step in range(STEPS):
            w.write("t", step, stats(step), INFO)
    return w.path


def record_offsets(data: bytes) -> list[int]:
    """Byte offsets of every record of an intact file."""
    offsets, o = [], 0
    while o < len(data):
        offsets.append(o)
        o += 16 + struct.unpack_from("<Q", data, o)[0]
    return offsets


def flip_a_value(d: bytearray, offset: int) -> bytearray:
    """Flips a byte of the values of the record at ``offset``: its data no
    longer matches its checksum, and still decodes as an event."""
    (length,) = struct.unpack_from("<Q", d, offset)
    data = bytes(d[offset + 12 : offset + 12 + length])
    content = event_pb2.Event.FromString(data).summary.value[0].tensor.tensor_content
    d[offset + 12 + data.index(content) + len(content) - 1] ^= 0x01
    return d


def rewrite(path: str, fn: Callable[[bytearray, list[int]], bytearray]) -> None:
    """Replaces a file's bytes with ``fn(bytes, record offsets)``."""
    with open(path, "rb") as f:
        data = bytearray(f.read())
    with open(path, "wb") as f:
        f.write(bytes(fn(data, record_offsets(bytes(data)))))


@dataclasses.dataclass(frozen=True)
class Case:
    """One damaged run and what must still come out of it."""

    records: int  # readable numerics records of the run
    anomaly_step: int | None
    problems: tuple[str, ...]  # each matches exactly one reported problem
    tensors: int = 1


def _truncated(root: str) -> None:
    rewrite(good_run(root), lambda d, o: d[:-30])  # cut into the last record


def _bad_crc(root: str) -> None:
    def flip(d: bytearray, offs: list[int]) -> bytearray:
        d[offs[4] + 12 + 5] ^= 0xFF  # the data of the record of step 3 (after file_version)
        return d

    rewrite(good_run(root), flip)


def _bad_header_crc(root: str) -> None:
    def flip(d: bytearray, offs: list[int]) -> bytearray:
        d[offs[9] + 9] ^= 0xFF  # the length CRC of the record of step 8: nothing after can be found
        return d

    rewrite(good_run(root), flip)


def _tensor(values: np.ndarray, shape: list[int]) -> tensor_pb2.TensorProto:
    return tensor_pb2.TensorProto(
        dtype=types_pb2.DT_DOUBLE,
        tensor_shape=tensor_shape_pb2.TensorShapeProto(dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=n) for n in shape]),
        tensor_content=np.asarray(values, "<f8").tobytes(),
    )


def _wrong_length(root: str) -> None:
    path = good_run(root)
    with open(path, "ab") as f:
        f.write(frame(event_bytes("t", 20, _tensor(np.zeros(7), [7]), None)))
        f.write(frame(event_bytes("t", 21, _tensor(np.zeros(22), [2, 11]), None)))


def _undecodable_tensor(root: str) -> None:
    path = good_run(root)
    bad = tensor_pb2.TensorProto(dtype=types_pb2.DT_DOUBLE, tensor_content=b"\x00" * 13)  # shape () but 13 bytes
    with open(path, "ab") as f:
        f.write(frame(event_bytes("u", 1, stats_tensor_proto(stats(0)), metadata.create_summary_metadata(INFO).plugin_data.content)))
        f.write(frame(event_bytes("u", 2, bad, None)))


def _metadata_case(content: bytes) -> Callable[[str], None]:
    """A run whose second tag "other" has ``content`` as its plugin metadata."""

    def make(root: str) -> None:
        path = good_run(root)
        with open(path, "ab") as f:
            for step in range(3):
                f.write(frame(event_bytes("other", step, stats_tensor_proto(stats(0)), content if step == 0 else None)))

    return make


def _garbage_file(root: str) -> None:
    good_run(root)
    rng = np.random.default_rng(0)
    with open(os.path.join(root, "events.out.tfevents.0000000001.garbage"), "wb") as f:
        f.write(rng.bytes(5000))
    with open(os.path.join(root, "events.out.tfevents.0000000002.notevents"), "wb") as f:
        f.write(frame(b"\xff\xfe this is not an event proto") + frame(b"\x08"))


def _nan_in_stats(root: str) -> None:
    with NumericsRecordWriter(root) as w:
        for step in range(STEPS + 2):
            s = stats(step)
            if step == 4:
                s[metadata.FIELD_INDEX["count"]] = np.nan
            if step == 5:
                s[metadata.FIELD_INDEX["nan"]] = 1e9  # more NaN than elements
            w.write("t", step, s, INFO)


def good_packed_run(path: str) -> tuple[str, str]:
    """``good_run``'s records written packed; returns the file and its block tag."""
    with NumericsRecordWriter(path) as w:
        for step in range(STEPS):
            w.write_many(step, [("t", stats(step), INFO)])
    with open(w.path, "rb") as f:
        data = f.read()
    second = record_offsets(data)[1]  # the first step's event, after file_version
    (length,) = struct.unpack_from("<Q", data, second)
    event = event_pb2.Event.FromString(data[second + 12 : second + 12 + length])
    return w.path, event.summary.value[0].tag


def _packed_truncated(root: str) -> None:
    rewrite(good_packed_run(root)[0], lambda d, o: d[:-30])


def _packed_bad_rows(root: str) -> None:
    path, block = good_packed_run(root)
    row = np.r_[5.0, STEPS, stats(0)]  # index 5: the block's table has one tensor
    with open(path, "ab") as f:
        f.write(frame(event_bytes(block, STEPS, _tensor(row, [1, 13]), None)))
        f.write(frame(event_bytes(block, STEPS + 1, _tensor(np.zeros(5), [1, 5]), None)))


def _first_record_bad_crc(root: str) -> None:
    """One byte flipped in the tag's first event, the one with its metadata."""

    rewrite(good_run(root), lambda d, offs: flip_a_value(d, offs[1]))  # after file_version: step 0


def _packed_first_event_bad_crc(root: str) -> None:
    """The same in a packed block's first event (steps 0-2), which held the
    table in full; the NaN of step 7 is in a later event."""
    with NumericsRecordWriter(root) as w:
        for step in range(STEPS):
            w.write_many(step, [("t", stats(step), INFO)])
            if step == 2:
                w.flush()

    rewrite(w.path, lambda d, offs: flip_a_value(d, offs[1]))


def _first_record_lost_old_format(root: str) -> None:
    """Logs written before later records said they were numerics ones: with
    the first record lost, the rest cannot be told from another plugin's."""
    os.makedirs(root)
    with open(os.path.join(root, "events.out.tfevents.0000000001.old"), "wb") as f:
        for step in range(STEPS):
            content = metadata.create_summary_metadata(INFO).plugin_data.content if step == 0 else None
            data = bytearray(frame(event_bytes("t", step, stats_tensor_proto(stats(step)), content)))
            f.write(bytes(flip_a_value(data, 0) if step == 0 else data))


def _giant_length(root: str) -> None:
    path = good_run(root)
    header = struct.pack("<Q", 2**40)  # a checksummed header claiming a terabyte
    with open(path, "ab") as f:
        f.write(header + struct.pack("<I", masked_crc32c(header)) + b"x" * 64)


# name -> (how to make the run, what must still come out of it)
CASES: dict[str, tuple] = {
    "truncated": (_truncated, Case(STEPS - 1, NAN_STEP, ("truncated",))),
    "bad_crc": (_bad_crc, Case(STEPS - 1, NAN_STEP, ("checksum", "t: 1 damaged record(s) skipped"))),
    # The tag's metadata is lost with its first record: the later ones are
    # still read (they say they are numerics records), the loss reported.
    "first_record_bad_crc": (
        _first_record_bad_crc,
        Case(STEPS - 1, NAN_STEP, ("checksum", "t: 1 damaged record(s) skipped", "t: its metadata was lost")),
    ),
    # Nothing can be read, but the problems say what was lost.
    "first_record_lost_old_format": (
        _first_record_lost_old_format,
        Case(0, None, ("checksum", "t: 1 damaged record(s) skipped, and 9 later record(s) that cannot be read"), 0),
    ),
    # The block's later events carry its table: only steps 0-2 are lost.
    "packed_first_event_bad_crc": (
        _packed_first_event_bad_crc,
        Case(STEPS - 3, NAN_STEP, ("checksum", "(a packed block of t): 1 damaged record(s) skipped")),
    ),
    "bad_header_crc": (_bad_header_crc, Case(8, NAN_STEP, ("damaged record header",))),
    "wrong_length": (_wrong_length, Case(STEPS, NAN_STEP, ("t: 2 malformed",))),
    "undecodable_tensor": (_undecodable_tensor, Case(STEPS + 1, NAN_STEP, ("u: ",), tensors=2)),
    "newer_version": (_metadata_case(b'{"version":99,"dtype":"float32"}'), Case(STEPS, NAN_STEP, ("newer",))),
    "bad_json": (_metadata_case(b"{not json"), Case(STEPS, NAN_STEP, ("not valid JSON",))),
    "garbage_files": (_garbage_file, Case(STEPS, NAN_STEP, ("not an event file", "not events"))),
    "nan_in_stats": (_nan_in_stats, Case(STEPS, NAN_STEP, ("t: 2 malformed",))),
    "giant_length": (_giant_length, Case(STEPS, NAN_STEP, ("truncated",))),
    # The last event, steps 8 and 9 (written on close), loses its end.
    "packed_truncated": (_packed_truncated, Case(STEPS - 2, NAN_STEP, ("truncated",))),
    "packed_bad_rows": (_packed_bad_rows, Case(STEPS, NAN_STEP, ("malformed packed", "with no tensor in the block"))),
}


@pytest.fixture(scope="module")
def logdir(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("corrupt") / "logs")
    for name, (make, _) in CASES.items():
        make(os.path.join(root, name))
    return root


def run_cli(*args: str) -> tuple[int, str, str]:
    p = subprocess.run(
        [sys.executable, "-m", "tb_numerics.cli", *args],
        capture_output=True, text=True, timeout=120,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
    )
    return p.returncode, p.stdout, p.stderr


def test_cli_reads_everything_readable_and_reports_each_problem_once(logdir: str) -> None:
    code, out, err = run_cli("report", logdir, "--json")
    assert code == 1, err
    assert "Traceback" not in err
    runs = {r["run"]: r for r in json.loads(out)["runs"]}
    assert set(runs) == set(CASES)
    warnings = [line for line in err.splitlines() if line.startswith("tb-numerics:")]
    for name, (_, case) in CASES.items():
        r = runs[name]
        assert (r["tensors"], r["records"]) == (case.tensors, case.records), name
        assert (r["first_anomaly"] or {}).get("step") == case.anomaly_step, name
        assert len(r["problems"]) == len(case.problems), (name, r["problems"])
        for word in case.problems:
            hits = [p for p in r["problems"] if word in p]
            assert len(hits) == 1, (name, word, r["problems"])
            # Each problem is printed once on stderr, naming its run.
            assert warnings.count("tb-numerics: warning: %s: %s" % (name, hits[0])) == 1, (name, err)
    assert len(warnings) == sum(len(r["problems"]) for r in runs.values())


@pytest.mark.parametrize("chunk", [None, 7, 100], ids=["chunk_4MB", "chunk_7B", "chunk_100B"])
@pytest.mark.parametrize("fast", [True, False], ids=["google_crc32c", "numpy"])
def test_both_record_readers_skip_and_report_the_same(logdir: str, fast: bool, chunk: int | None, monkeypatch) -> None:
    """The Python reader (installs without TensorFlow, and every install
    where google-crc32c has its C extension) agrees with TensorFlow's, with
    either of its checksums, and with the file read in chunks smaller than
    a record's header or its data (records and damage across chunks)."""
    from tb_numerics import _crc32c, tfrecord

    if not fast:
        monkeypatch.setattr(_crc32c, "FAST", None)
    if chunk is not None:
        monkeypatch.setattr(tfrecord, "CHUNK_BYTES", chunk)
    files = [p for files in event_reader.find_runs(logdir).values() for p in files]
    assert len(files) >= len(CASES) + 2
    for path in files:
        tf_problems: list[str] = []
        py_problems: list[str] = []
        tf_records = list(event_reader.read_records(path, tf_problems, event_reader.tf_record_reader))
        py_records = list(event_reader.read_records(path, py_problems, event_reader.py_record_reader))
        assert tf_records == py_records, path
        assert tf_problems == py_problems, path


def test_a_damaged_record_larger_than_a_chunk_loses_only_itself(tmp_path) -> None:
    """Records of twice the reader's 4 MB chunk (a packed event of 10,000
    tensors is 30 MB), one of them damaged: every other record is read, as
    TensorFlow's reader reads them. (Naming what the damaged one held read
    its bytes again from a window that had moved past them: the file was
    reported truncated there, and the rest skipped.)"""
    from tb_numerics import _crc32c, tfrecord

    def framed(data: bytes) -> bytes:
        header = struct.pack("<Q", len(data))
        return (header + struct.pack("<I", _crc32c.masked_crc32c(header)) + data
                + struct.pack("<I", _crc32c.masked_crc32c(data)))

    rng = np.random.default_rng(0)
    records = [rng.bytes(2 * tfrecord.CHUNK_BYTES + 5) for _ in range(4)]
    blob = bytearray(b"".join(framed(r) for r in records))
    size = len(framed(records[0]))
    blob[size + 100] ^= 0xFF  # in the second record's data
    path = str(tmp_path / "events.out.tfevents.1.test")
    with open(path, "wb") as f:
        f.write(bytes(blob))
    py_problems: list[str] = []
    got = list(event_reader.read_records(path, py_problems, event_reader.py_record_reader))
    assert [r.intact for r in got] == [True, False, True, True], py_problems
    assert [r.data for r in got if r.intact] == [records[0], records[2], records[3]]
    assert py_problems == ["events.out.tfevents.1.test: 1 corrupt record(s) skipped (checksum mismatch) "
                           "at byte offset %d" % size]
    tf_problems: list[str] = []
    assert list(event_reader.read_records(path, tf_problems, event_reader.tf_record_reader)) == got
    assert tf_problems == py_problems


def test_a_record_after_a_bad_checksum_is_still_read(tmp_path) -> None:
    """Only the damaged record is lost, wherever it is; the anomaly after it is found.

    (The first record of a tag carries its metadata; the later ones say
    they are numerics records, so losing the first loses only itself.)
    """
    path = good_run(str(tmp_path / "r"))
    with open(path, "rb") as f:
        intact = f.read()
    offsets = record_offsets(intact)
    for k in range(1, len(offsets)):  # every record of the tag, its first too
        damaged = flip_a_value(bytearray(intact), offsets[k])
        with open(path, "wb") as f:
            f.write(damaged)
        rr = event_reader.read_run("r", [path])
        steps = rr.series[0].steps.tolist() if rr.series else []
        assert steps == [s for s in range(STEPS) if s != k - 1], k
        assert "at byte offset %d" % offsets[k] in rr.problems[0]
        assert rr.problems[-1] == "t: 1 damaged record(s) skipped"
        assert len(rr.problems) == (3 if k == 1 else 2), rr.problems


# Both TensorBoard loaders (Rust data server, Python loader) die on a
# checksummed record header claiming a terabyte (an allocation abort, a
# segfault): that run is left to the CLI test here; the plugin's failover
# (test_data_server_outage.py) and loader guard (test_loader_guard.py,
# test_storm.py) keep the tab answering. Known TensorBoard limits that
# the plugin, reading through the data provider, cannot work around; strict,
# so a fix upstream or in the plugin turns them into a failure to update.
#
# A damaged first event: TensorBoard's Python loader stops at it, and the
# Rust data server serves it unchecked (see bad_crc below), so neither shows
# what the CLI does with the events after it; left to the CLI test too.
LOST_FIRST = ("first_record_bad_crc", "packed_first_event_bad_crc", "first_record_lost_old_format")
TB_CASES = [name for name in CASES if name != "giant_length" and name not in LOST_FIRST]
# The plugin reads a local logdir's files itself (file_provider), as the CLI
# does, whichever loader TensorBoard runs: none of its loaders' limits (the
# Python loader stopped at a bad checksum and dropped a run holding a
# non-event; the Rust data server served a record whose checksum fails) apply.
UPSTREAM: dict = {}
# Problems TensorBoard does not pass on to plugins (file damage): only the
# record-level ones can reach the summary.
FILE_LEVEL = ("truncated", "checksum", "record header", "event", "damaged record")


@pytest.fixture(scope="module", params=[True, False], ids=["load_fast", "python_loader"])
def served(request, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("corrupt_tb") / "logs")
    for name in TB_CASES:
        CASES[name][0](os.path.join(root, name))
    with tensorboard(root, load_fast=request.param) as tb:
        wait_for(lambda: len(tb.get_json("/data/plugin/numerics/runs")["runs"]) >= len(TB_CASES) - 1)
        yield tb, request.param


@pytest.mark.parametrize("name", TB_CASES)
def test_tensorboard_serves_what_is_readable(served, name: str) -> None:
    tb, load_fast = served
    if (name, load_fast) in UPSTREAM:
        pytest.xfail(UPSTREAM[(name, load_fast)])
    case = CASES[name][1]
    q = "run=" + name
    s = tb.get_json("/data/plugin/numerics/summary?" + q)
    assert (s["tensors"], s["records"]) == (case.tensors, case.records)  # one undecodable record costs only itself
    assert (s["first_anomaly"] or {}).get("step") == case.anomaly_step
    for word in case.problems:
        if not any(w in word for w in FILE_LEVEL):
            assert sum(word in p for p in s["problems"]) == 1, s["problems"]
    timeline = tb.get_json("/data/plugin/numerics/timeline?width=5&" + q)
    row = next(r for r in timeline["rows"] if r["tensor"] == "t")
    bucket = next(i for i, (a, b) in enumerate(zip(timeline["bucket_start"], timeline["bucket_end"])) if a <= NAN_STEP <= b)
    assert row["cells"][bucket] == 2
    series = tb.get_json("/data/plugin/numerics/series?tensor=t&" + q)
    assert NAN_STEP in series["steps"]
    # Asked again after a reload: still reported once, not accumulated.
    wait_for(lambda: tb.get_json("/data/plugin/numerics/summary?" + q)["problems"] == s["problems"], timeout=5)
    assert not re.search(r"numerics: \S+ failed", tb.log)  # no route failed


def test_a_tag_whose_first_record_was_lost_is_read_with_what_its_name_tells(tmp_path) -> None:
    """Role from the writers' tag names, dtype from the values, and it is said."""
    tags = {
        "gradients/dense/kernel": ("gradient", np.float32),
        "gradients/global_norm": ("global_norm", np.float32),
        "head/total_loss": ("loss", np.float32),
        "dense/output": ("activation", np.float64),  # 0.1 is no float32
    }
    with NumericsRecordWriter(str(tmp_path)) as w:
        for step in range(4):
            for tag, (role, dtype) in tags.items():
                w.write(tag, step, numpy_stats(np.array([0.1, step], dtype)), metadata.TensorInfo(role="other"))
    # Each tag's first record is one of the four after file_version.
    rewrite(w.path, lambda d, offs: functools.reduce(flip_a_value, offs[1:5], d))
    rr = event_reader.read_run(".", [w.path])
    got = {s.tag: (s.info.role, s.info.dtype, s.steps.tolist()) for s in rr.series}
    assert got == {tag: (role, np.dtype(dt).name, [1, 2, 3]) for tag, (role, dt) in tags.items()}
    for tag, (role, dt) in tags.items():
        assert "%s: its metadata was lost with its first record; 3 record(s) read as a %s %s" % (
            tag, np.dtype(dt).name, role) in "\n".join(rr.problems)
        assert "%s: 1 damaged record(s) skipped" % tag in rr.problems
