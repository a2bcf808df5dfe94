"""The plugin's server reads a local logdir's files as ``tb-numerics report`` does.

Each test writes a run that the server once read differently from the CLI
(records lost, damage not said, one damage said twice), then compares the
server's summary, through the real ``file_provider.FileProvider`` and
``run_store.RunStore`` as the plugin builds them, with the CLI's
(``cli.report``): the CLI is the reference. A corrupt or truncated file is
skipped for what cannot be read, reported, and everything readable shown.
"""

from __future__ import annotations

import os
import struct
import time

import numpy as np
import pytest
from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, types_pb2
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
from tensorboard.context import RequestContext

from tb_numerics import analysis, cli, file_provider, metadata, run_store
from tb_numerics.record_writer import NumericsRecordWriter, stats_tensor_proto
from tb_numerics.records import numpy_stats

pytestmark = pytest.mark.unit

CTX = RequestContext()
SR = analysis.SafeRange()
INFO = metadata.TensorInfo(dtype="float32", role="activation", order=0)
CONTENT = metadata.create_summary_metadata(INFO).plugin_data.content
LONG_AGO = time.time() - 3600  # a file finished long ago


def stats(step: int, nan: bool = False) -> np.ndarray:
    v = np.linspace(-1, 1, 64, dtype=np.float32) * (1 + step)
    if nan:
        v[:2] = np.nan
    return numpy_stats(v)


def frame(data: bytes) -> bytes:
    """One TFRecord: length, its masked CRC, the data, the data's masked CRC."""
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", masked_crc32c(header)) + data + struct.pack("<I", masked_crc32c(data))


def event(tag: str, step: int, tensor: tensor_pb2.TensorProto, content: bytes | None = None) -> bytes:
    """A serialized event of one value; with ``content``, the plugin's metadata."""
    value = summary_pb2.Summary.Value(tag=tag, tensor=tensor)
    if content is not None:
        value.metadata.CopyFrom(metadata.create_summary_metadata(INFO))
        value.metadata.plugin_data.content = content
    return event_pb2.Event(wall_time=1.0 + step, step=step, summary=summary_pb2.Summary(value=[value])).SerializeToString()


def write_events(run_dir: str, events: list[bytes]) -> str:
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "events.out.tfevents.0000000001.host")
    with open(path, "wb") as f:
        f.write(frame(event_pb2.Event(wall_time=1.0, file_version="brain.Event:2").SerializeToString()))
        for e in events:
            f.write(frame(e))
    return path


def good_run(run_dir: str, steps: int = 10, nan_step: int | None = None) -> str:
    with NumericsRecordWriter(run_dir) as w:
        for step in range(steps):
            w.write("t", step, stats(step, step == nan_step), INFO)
    return w.path


def served(logdir: str) -> tuple[file_provider.FileProvider, run_store.RunStore]:
    """The server's reader as the plugin builds it over a local logdir."""
    fp = file_provider.FileProvider(logdir)
    return fp, run_store.RunStore(fp, reload_interval=0, background=False, run_problems=fp.problems)


def server_summary(store: run_store.RunStore, run: str) -> dict:
    """What ``/summary`` says of the records (``plugin.summary_impl``)."""
    answer = store.answer(CTX, "", run, SR)
    return dict(analysis.run_summary(answer.analysis), restarts=answer.restarts)


def cli_summary(logdir: str, run: str) -> dict:
    summaries, _ = cli.report(logdir, SR)
    return next(s for s in summaries if s["run"] == run)


def assert_as_cli(server: dict, reference: dict) -> None:
    for key in ("first_anomaly", "records", "tensors", "first_step", "last_step", "restarts"):
        assert server[key] == reference[key], (key, server[key], reference[key])
    assert sorted(server["problems"]) == sorted(reference["problems"])


def test_a_restarted_jobs_per_tensor_records_are_all_kept(tmp_path):
    """Issue 6: a second writer re-logs steps 5..14 after a restart, NaN at 12."""
    run = str(tmp_path / "run1")
    with NumericsRecordWriter(run, filename_suffix=".1") as w:
        for step in range(10):
            w.write("loss", step, stats(step), INFO, wall_time=1000.0 + step)
    with NumericsRecordWriter(run, filename_suffix=".2") as w:
        for step in range(5, 15):
            w.write("loss", step, stats(step, step == 12), INFO, wall_time=2000.0 + step)
    reference = cli_summary(str(tmp_path), "run1")
    assert (reference["first_anomaly"]["step"], reference["records"]) == (12, 15)
    _, store = served(str(tmp_path))
    assert_as_cli(server_summary(store, "run1"), reference)


def test_two_writers_logging_one_tensor_at_once_are_both_kept(tmp_path):
    """Issue 6: two writers at once, per tensor; the NaN in the second file."""
    run = str(tmp_path / "both")
    first, second = (NumericsRecordWriter(run, filename_suffix=s) for s in (".a", ".b"))
    for step in range(20):
        for i, w in enumerate((first, second)):
            w.write("loss", step, stats(step, i == 1 and step == 13), INFO, wall_time=1000.0 + step)
    first.close()
    second.close()
    reference = cli_summary(str(tmp_path), "both")
    assert (reference["first_anomaly"]["step"], reference["records"]) == (13, 40)
    _, store = served(str(tmp_path))
    assert_as_cli(server_summary(store, "both"), reference)


def test_one_undecodable_record_costs_that_record_only(tmp_path):
    """Issue 8: an empty DT_DOUBLE tensor at step 2; the NaN at step 4 is found."""
    empty = tensor_pb2.TensorProto(dtype=types_pb2.DT_DOUBLE)
    write_events(str(tmp_path / "run1"), [
        event("loss", s, empty if s == 2 else stats_tensor_proto(stats(s, s == 4)), CONTENT if s == 0 else None)
        for s in range(6)
    ])
    reference = cli_summary(str(tmp_path), "run1")
    assert (reference["first_anomaly"]["step"], reference["records"]) == (4, 5)
    _, store = served(str(tmp_path))
    assert_as_cli(server_summary(store, "run1"), reference)


def test_a_tag_whose_first_event_has_no_metadata_is_read_from_its_later_ones(tmp_path):
    """Issue 9: TensorBoard reads a series' metadata from its first event
    only; the records after it say they are numerics records."""
    events = [event("loss", 0, stats_tensor_proto(stats(0)))]  # no metadata at all
    events += [event("loss", s, stats_tensor_proto(stats(s, s == 4)), CONTENT if s == 1 else None) for s in range(1, 6)]
    events += [event("other", s, stats_tensor_proto(stats(s)), CONTENT if s == 0 else None) for s in range(6)]
    write_events(str(tmp_path / "run1"), events)
    reference = cli_summary(str(tmp_path), "run1")
    assert (reference["first_anomaly"]["step"], reference["first_anomaly"]["tensor"]) == (4, "loss")
    _, store = served(str(tmp_path))
    assert_as_cli(server_summary(store, "run1"), reference)


def test_a_truncated_last_record_of_a_finished_file_is_reported(tmp_path):
    """Issue 10: a file finished long ago whose last record is cut is
    truncated; a file written just now may end in a record being written."""
    path = good_run(str(tmp_path / "run1"), nan_step=9)  # the NaN only in the cut record
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[:-5])
    cut = good_run(str(tmp_path / "run2"), steps=3)
    with open(cut, "rb") as f:
        head = f.read(20)
    with open(cut, "wb") as f:
        f.write(head)  # cut inside its first record
    for p in (path, cut):
        os.utime(p, (LONG_AGO, LONG_AGO))
    reference = cli_summary(str(tmp_path), "run1")
    assert reference["first_anomaly"] is None and any("truncated" in p for p in reference["problems"])
    fp, store = served(str(tmp_path))
    assert_as_cli(server_summary(store, "run1"), reference)
    assert fp.problems("run2") == cli_summary(str(tmp_path), "run2")["problems"]


def test_a_file_being_written_is_not_truncated_and_a_truncation_withdrawn_once_it_grows(tmp_path):
    path = good_run(str(tmp_path / "run1"))
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[:-5])
    fp, store = served(str(tmp_path))
    assert server_summary(store, "run1")["problems"] == []  # modified just now: still being written
    os.utime(path, (LONG_AGO, LONG_AGO))
    fp.index_round()
    assert [p for p in fp.problems("run1") if "truncated" in p] == [
        p for p in cli_summary(str(tmp_path), "run1")["problems"] if "truncated" in p]
    with open(path, "ab") as f:
        f.write(data[-5:])  # the writer came back
    fp.index_round()
    assert fp.problems("run1") == []


def test_a_record_that_is_not_an_event_is_named(tmp_path):
    """Issue 11: an intact record that does not parse as an Event."""
    events = [event("loss", s, stats_tensor_proto(stats(s, s == 4)), CONTENT if s == 0 else None) for s in range(6)]
    events[4] = events[4].replace(b"loss", b"lo\xffs")  # invalid UTF-8 in the tag of the NaN step
    write_events(str(tmp_path / "run1"), events)
    reference = cli_summary(str(tmp_path), "run1")
    assert any("not events skipped" in p for p in reference["problems"])
    _, store = served(str(tmp_path))
    assert_as_cli(server_summary(store, "run1"), reference)


def test_files_that_cannot_be_opened_are_named_and_never_block(tmp_path):
    """Issue 12: a dangling link, a link loop, a FIFO, a device link."""
    run = tmp_path / "run1"
    good_run(str(run), nan_step=7)
    os.symlink("/nonexistent/x", run / "events.out.tfevents.2.dangling")
    os.symlink("events.out.tfevents.3.loop", run / "events.out.tfevents.3.loop")
    os.mkfifo(run / "events.out.tfevents.4.fifo")
    os.symlink("/dev/zero", run / "events.out.tfevents.5.dev")
    reference = cli_summary(str(tmp_path), "run1")
    assert sum("cannot open" in p for p in reference["problems"]) == 4
    _, store = served(str(tmp_path))
    assert_as_cli(server_summary(store, "run1"), reference)


def test_one_damage_is_named_once_however_often_the_file_is_read(tmp_path):
    """Issue 15: a damaged record header after 11 records, read every round."""
    path = good_run(str(tmp_path / "run1"), nan_step=7)
    header = struct.pack("<Q", 2**64 - 1)
    with open(path, "ab") as f:
        f.write(header + b"\0\0\0\0" + b"x" * 64)
    fp, store = served(str(tmp_path))
    for _ in range(3):
        fp.index_round()
    with open(path, "ab") as f:
        f.write(b"y" * 10)  # the file grows past its damage
    fp.index_round()
    reference = cli_summary(str(tmp_path), "run1")
    assert_as_cli(server_summary(store, "run1"), reference)


def test_a_run_directory_reached_through_a_link_is_read(tmp_path):
    """A run directory that is a link to one elsewhere (``logs/linked ->
    /data/exp1``) is a run, as TensorBoard lists it, and so is a second link
    to it; a link back up (a loop) is not entered. The server and the CLI
    both read the linked runs."""
    target = tmp_path / "data" / "exp1"
    good_run(str(target), nan_step=3)
    logdir = tmp_path / "logs"
    logdir.mkdir()
    os.symlink(target, logdir / "linked")
    os.symlink(logdir, logdir / "loop")
    os.symlink(target, logdir / "linked_again")
    summaries, _ = cli.report(str(logdir), SR)
    assert [s["run"] for s in summaries] == ["linked", "linked_again"]
    reference = cli_summary(str(logdir), "linked")
    assert reference["first_anomaly"]["step"] == 3
    fp, store = served(str(logdir))
    fp.index_round()
    assert list(fp.list_tensors(experiment_id="", plugin_name=metadata.PLUGIN_NAME)) == ["linked", "linked_again"]
    assert_as_cli(server_summary(store, "linked"), reference)


def test_runs_whose_names_differ_only_in_bytes_that_are_not_utf8_are_both_served(tmp_path):
    """Two run directories, ``r\\xfe`` (a NaN at step 3) and ``r\\xff``: the
    name TensorBoard gives each (U+FFFD for the byte) would make them one,
    so both keep the byte escaped, and neither's records are lost."""
    for raw, nan_step in ((b"r\xfe", 3), (b"r\xff", None)):
        # Framed here: TensorFlow's record writer, where it is imported, refuses such a path.
        write_events(os.fsdecode(os.path.join(os.fsencode(str(tmp_path)), raw)), [
            event("t", step, stats_tensor_proto(stats(step, step == nan_step)), CONTENT if step == 0 else None)
            for step in range(10)])
    summaries, _ = cli.report(str(tmp_path), SR)
    by_cli = {s["run"]: s for s in summaries}
    assert len(by_cli) == 2
    fp, store = served(str(tmp_path))
    fp.index_round()
    assert sorted(fp.list_tensors(experiment_id="", plugin_name=metadata.PLUGIN_NAME)) == ["r\\xfe", "r\\xff"]
    assert_as_cli(server_summary(store, "r\\xfe"), by_cli[os.fsdecode(b"r\xfe")])
    assert server_summary(store, "r\\xfe")["first_anomaly"]["step"] == 3
    assert_as_cli(server_summary(store, "r\\xff"), by_cli[os.fsdecode(b"r\xff")])
