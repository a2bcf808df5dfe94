"""The run store through its public surface, over TensorBoard's own data provider.

Each test loads a logdir with TensorBoard's Python loader (flags parsed by
``program.TensorBoard``, keeping every record as ``NumericsLoader.fix_flags``
has it do where the plugin reads through TensorBoard: a local logdir the
plugin reads itself, ``file_provider``), builds a ``RunStore`` over its data
provider with no refresher thread, and runs the refresher's rounds itself
(``refresh_round``), with a clock it moves by hand where time matters.
"""

from __future__ import annotations

import itertools
import logging
import math

import numpy as np
import pytest
from tensorboard import program
from tensorboard.backend.event_processing import data_ingester
from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, types_pb2
from tensorboard.context import RequestContext
from tensorboard.plugins.core import core_plugin
from tensorboard.summary.writer.event_file_writer import EventFileWriter

from tb_numerics import analysis, metadata, packed, plugin, run_store
from tb_numerics.record_writer import NumericsRecordWriter, stats_tensor_proto
from tb_numerics.records import numpy_stats

pytestmark = pytest.mark.unit

CTX = RequestContext()
SR = analysis.SafeRange()
# "Big": more than 30 records (or packed steps) to read.
SMALL_READS = run_store.Limits(inline_read_records=30)


class Logdir:
    """A logdir as TensorBoard's Python loader holds it, reloaded on demand."""

    def __init__(self, path: str):
        tb = program.TensorBoard(plugins=[core_plugin.CorePluginLoader(), plugin.NumericsLoader()])
        tb.configure(argv=["", "--logdir", path, "--load_fast", "false", "--reload_interval", "0",
                            "--reload_task", "blocking", "--samples_per_plugin", "numerics=0"])
        self.path = path
        self.ingester = data_ingester.LocalDataIngester(tb.flags)
        self.ingester.start()  # loads once, synchronously
        self.provider = self.ingester.data_provider

    def reload(self) -> None:
        """What TensorBoard's reload thread does every --reload_interval."""
        mux = self.ingester.deprecated_multiplexer
        mux.AddRunsFromDirectory(self.path)
        mux.Reload()


class Clock:
    """A monotonic clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def write_steps(w: NumericsRecordWriter, steps: range, nan_step: int | None = None) -> None:
    """An activation and a loss per step (two records a step)."""
    act = metadata.TensorInfo(role="activation", order=0)
    loss = metadata.TensorInfo(role="loss", order=1)
    for step in steps:
        w.write("dense1/output", step, numpy_stats(np.float32([1.0, math.nan if step == nan_step else 2.0])), act)
        w.write("loss", step, numpy_stats(np.float32([0.5])), loss)
    w.flush()


def test_an_answer_is_kept_until_the_run_grows_and_a_small_growth_is_read_at_once(tmp_path):
    w = NumericsRecordWriter(str(tmp_path / "live"))
    write_steps(w, range(20))
    logs = Logdir(str(tmp_path))
    store = run_store.RunStore(logs.provider, reload_interval=0, background=False)
    first = store.answer(CTX, "", "live", SR)
    assert (first.stale, first.as_of_step, first.latest_step) == (False, 19, 19)
    assert store.answer(CTX, "", "live", SR).analysis is first.analysis  # nothing read again
    write_steps(w, range(20, 40), nan_step=33)
    w.close()
    logs.reload()
    grown = store.answer(CTX, "", "live", SR)
    assert (grown.stale, grown.as_of_step, grown.latest_step) == (False, 39, 39)
    assert analysis.first_anomaly(grown.analysis)["step"] == 33
    assert store.snapshot("", "live").records == 80


def test_a_big_growth_is_answered_stale_and_read_by_the_next_round(tmp_path):
    w = NumericsRecordWriter(str(tmp_path / "live"))
    write_steps(w, range(10))
    logs = Logdir(str(tmp_path))
    store = run_store.RunStore(logs.provider, reload_interval=0, limits=SMALL_READS, background=False)
    assert store.answer(CTX, "", "live", SR).as_of_step == 9  # nothing held yet: read whole, whatever its size
    write_steps(w, range(10, 40), nan_step=30)
    w.close()
    logs.reload()
    stale = store.answer(CTX, "", "live", SR)
    assert (stale.stale, stale.as_of_step, stale.latest_step) == (True, 9, 39)
    assert analysis.first_anomaly(stale.analysis) is None
    store.refresh_round()  # the round reads what the stale answer asked for
    fresh = store.answer(CTX, "", "live", SR)
    assert (fresh.stale, fresh.as_of_step) == (False, 39)
    assert analysis.first_anomaly(fresh.analysis)["step"] == 30


def test_an_unknown_run_is_not_found(tmp_path):
    write_steps(NumericsRecordWriter(str(tmp_path / "a")), range(3))
    store = run_store.RunStore(Logdir(str(tmp_path)).provider, background=False)
    with pytest.raises(run_store.RunNotFound, match="'nope'"):
        store.answer(CTX, "", "nope", SR)
    assert run_store.RunStore(None, background=False).listing(CTX, "") == {}


def test_no_answer_comes_from_a_listing_older_than_one_already_seen(tmp_path):
    """Callers share TensorBoard's listing for a moment (up to a second);
    a run one caller has seen must not vanish from the next."""
    write_steps(NumericsRecordWriter(str(tmp_path / "a")), range(20))
    logs = Logdir(str(tmp_path))
    ticks = itertools.count()
    store = run_store.RunStore(logs.provider, reload_interval=600, clock=lambda: next(ticks) * 1e-3, background=False)
    assert list(store.listing(CTX, "")) == ["a"]
    assert list(store.listing(CTX, "")) == ["a"]
    write_steps(NumericsRecordWriter(str(tmp_path / "b")), range(30), nan_step=25)
    logs.reload()
    assert list(store.listing(CTX, "")) == ["a"]  # shared, well within its second
    assert analysis.first_anomaly(store.answer(CTX, "", "b", SR).analysis)["step"] == 25
    assert sorted(store.listing(CTX, "")) == ["a", "b"]


def test_the_refresher_leaves_a_run_read_less_than_a_reload_ago(tmp_path):
    w = NumericsRecordWriter(str(tmp_path / "run"))
    write_steps(w, range(20))
    logs = Logdir(str(tmp_path))
    clock = Clock()
    store = run_store.RunStore(logs.provider, reload_interval=10, limits=SMALL_READS, clock=clock, background=False)
    store.answer(CTX, "", "run", SR)  # read at 0: the refresher leaves it until 10
    write_steps(w, range(20, 40))
    w.close()
    logs.reload()
    for clock.now in (2.0, 4.0, 9.0):  # each round lists anew (listings last 1 s)
        store.refresh_round()
        assert store.snapshot("", "run").as_of_step == 19
    clock.now = 11.0
    store.refresh_round()
    assert store.snapshot("", "run").as_of_step == 39


def test_the_refresher_waits_for_a_big_run_to_stop_loading(tmp_path):
    # While TensorBoard loads a big run, its listing changes every round: reading
    # it then would be thrown away and read again in full when loading ends.
    w = NumericsRecordWriter(str(tmp_path / "big"))
    write_steps(w, range(20))  # 40 records
    write_steps(NumericsRecordWriter(str(tmp_path / "small")), range(5))  # 10 records
    logs = Logdir(str(tmp_path))
    store = run_store.RunStore(logs.provider, reload_interval=0, limits=SMALL_READS, background=False)
    store.refresh_round()
    assert store.snapshot("", "big") is None  # first seen: maybe still loading
    assert store.snapshot("", "small").as_of_step == 4  # small: read at once
    write_steps(w, range(20, 30), nan_step=25)
    w.close()
    logs.reload()
    store.refresh_round()
    assert store.snapshot("", "big") is None  # it changed since the last round
    store.refresh_round()  # it held still for a round: read now, whole
    assert store.snapshot("", "big").as_of_step == 29
    answer = store.answer(CTX, "", "big", SR)
    assert (answer.stale, analysis.first_anomaly(answer.analysis)["step"]) == (False, 25)


def _write_packed(w: NumericsRecordWriter, steps: range, nan_step: int | None = None) -> None:
    for step in steps:
        x = [1.0, math.nan if step == nan_step else 2.0]
        w.write_many(step, [("dense1/output", numpy_stats(np.float32(x)), metadata.TensorInfo(role="activation")),
                            ("loss", numpy_stats(np.float32([0.5])), metadata.TensorInfo(role="loss", order=1))])
    w.flush()


def test_packed_blocks_are_read_as_they_load_and_then_only_when_they_grow(tmp_path, monkeypatch):
    monkeypatch.setattr(packed, "STEPS_PER_BLOCK", 10)
    w = NumericsRecordWriter(str(tmp_path / "big"))
    _write_packed(w, range(40))  # 4 blocks of 10 steps
    logs = Logdir(str(tmp_path))
    reads: list[list[str]] = []
    read_tensors = logs.provider.read_tensors

    def spy(ctx, **kwargs):
        reads.append(sorted(kwargs["run_tag_filter"].tags))
        return read_tensors(ctx, **kwargs)

    monkeypatch.setattr(logs.provider, "read_tensors", spy)
    store = run_store.RunStore(logs.provider, reload_interval=0, limits=SMALL_READS, background=False)
    blocks = sorted(store.listing(CTX, "")["big"])
    assert len(blocks) == 4 and all(packed.is_block_tag(b) for b in blocks)

    store.refresh_round()  # first seen, maybe still loading: too big to read whole now
    assert store.snapshot("", "big") is None and store.prefetched_tags("", "big") == blocks
    assert sorted(t for r in reads for t in r) == blocks
    reads.clear()
    answer = store.answer(CTX, "", "big", SR)
    assert (answer.stale, store.snapshot("", "big").records, analysis.first_anomaly(answer.analysis)) == (False, 80, None)
    assert reads == []  # the request took the blocks read ahead
    assert store.prefetched_tags("", "big") == []
    # Tensors logged at the same steps share one step array.
    output, loss = sorted(store.snapshot("", "big").series, key=lambda s: s.tag)
    assert output.steps is loss.steps and output.steps.tolist() == list(range(40))

    _write_packed(w, range(40, 45))  # a new block, still being written
    logs.reload()
    store.answer(CTX, "", "big", SR)
    _write_packed(w, range(45, 55), nan_step=47)  # it fills up, and a next one starts
    logs.reload()
    reads.clear()
    answer = store.answer(CTX, "", "big", SR)
    blocks = sorted(store.listing(CTX, "")["big"])
    assert len(blocks) == 6 and reads == [blocks[4:]]  # only the blocks that grew
    assert (answer.stale, answer.as_of_step, analysis.first_anomaly(answer.analysis)["step"]) == (False, 54, 47)
    output, loss = sorted(store.snapshot("", "big").series, key=lambda s: s.tag)
    assert output.steps is loss.steps and loss.steps.tolist() == list(range(55))  # merged again from kept parts


def test_a_user_sampling_limit_is_reported_with_every_run(tmp_path):
    write_steps(NumericsRecordWriter(str(tmp_path / "a")), range(3))
    logs = Logdir(str(tmp_path))
    limited = run_store.RunStore(logs.provider, sample_limit=10, background=False)
    assert any("--samples_per_plugin numerics=10" in p for p in limited.answer(CTX, "", "a", SR).analysis.problems)
    unlimited = run_store.RunStore(logs.provider, background=False)
    assert unlimited.answer(CTX, "", "a", SR).analysis.problems == []


def test_a_tag_tensorboard_cannot_decode_is_reported_and_logged_once_however_often_read(tmp_path, caplog):
    w = EventFileWriter(str(tmp_path / "run"))  # one file, so that TensorBoard's loader sees it grow

    def add(tag: str, step: int, tensor: tensor_pb2.TensorProto, first: bool = False) -> None:
        value = summary_pb2.Summary.Value(tag=tag, tensor=tensor)
        if first:
            value.metadata.CopyFrom(metadata.create_summary_metadata(metadata.TensorInfo()))
        w.add_event(event_pb2.Event(step=step, summary=summary_pb2.Summary(value=[value])))
        w.flush()

    for step in range(5):
        add("t", step, stats_tensor_proto(numpy_stats(np.float32([1.0, math.nan if step == 3 else 2.0]))), step == 0)
    add("u", 1, stats_tensor_proto(numpy_stats(np.float32([1.0]))), first=True)
    undecodable = tensor_pb2.TensorProto(dtype=types_pb2.DT_DOUBLE, tensor_content=b"\x00" * 13)  # 13 bytes of float64
    add("u", 2, undecodable)
    logs = Logdir(str(tmp_path))
    store = run_store.RunStore(logs.provider, reload_interval=0, background=False)
    with caplog.at_level(logging.WARNING, logger="tb_numerics.run_store"):
        first = store.answer(CTX, "", "run", SR)
        add("u", 5, undecodable)  # the tag grows: read again, still undecodable
        logs.reload()
        again = store.answer(CTX, "", "run", SR)
    assert (first.latest_step, again.latest_step) == (4, 5)
    assert analysis.first_anomaly(again.analysis)["step"] == 3  # the other tensor is all there
    for answer in (first, again):
        assert sum("u: TensorBoard cannot decode" in p for p in answer.analysis.problems) == 1
    assert sum("u: TensorBoard cannot decode" in r.getMessage() for r in caplog.records) == 1


def test_two_writers_at_once_and_impossible_records_hold_in_the_dashboard_too(tmp_path):
    """Issue 27, items 3 and 4, through TensorBoard's data provider: packed
    records of two writers whose events interleave in time are all kept, the
    NaN in the earlier file found, and a record no tensor can produce is a
    problem, never health."""
    info = metadata.TensorInfo(role="activation", order=0)
    first, second = (NumericsRecordWriter(str(tmp_path / "both"), filename_suffix=s) for s in (".a", ".b"))
    for step in range(60):
        for w, nan in ((first, step == 21), (second, False)):
            x = np.float32([1.0, math.nan if nan else 2.0])
            w.write_many(step, [("dense1/output", numpy_stats(x), info)], wall_time=1000.0 + step)
    first.close()
    second.close()
    bad = numpy_stats(np.float32([1.0, 2.0]))
    bad[metadata.FIELD_INDEX["min"]] = 5.0  # min above max
    with NumericsRecordWriter(str(tmp_path / "impossible")) as w:
        w.write("dense1/output", 0, bad, info)
        w.write("dense1/output", 1, numpy_stats(np.float32([1.0])), info)
    store = run_store.RunStore(Logdir(str(tmp_path)).provider, background=False)
    both = store.answer(CTX, "", "both", SR).analysis
    assert analysis.first_anomaly(both)["step"] == 21
    assert store.snapshot("", "both").records == 120
    assert any("more than one writer at once" in p for p in both.problems), both.problems
    impossible = store.answer(CTX, "", "impossible", SR).analysis
    assert analysis.first_anomaly(impossible) is None
    assert store.snapshot("", "impossible").records == 1
    assert "dense1/output: 1 malformed record(s) skipped" in impossible.problems
