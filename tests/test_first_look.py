"""A long run not read yet: its first anomaly at once, a first look, never a wrong one.

The run store answers ``/runs`` and ``/summary`` for a long run whose
records it has not read with a first look (``RunStore.answer(...,
first_look=True)``): the records of the step where the index of the event
files says a NaN or an infinity may first be. The oracle is the CLI's
report, which reads every record (``tb-numerics report``), and the injected
faults: a first look names exactly the CLI's first anomaly, or there is none
and the request waits for the whole read. The store runs without its
background thread, so "not read yet" is certain; a real TensorBoard serves
one in ``test_long_run_e2e.py``.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
from tensorboard.context import RequestContext

import long_run
from tb_numerics import analysis, cli, file_provider, metadata, packed, run_store
from tb_numerics.record_writer import NumericsRecordWriter
from tb_numerics.records import numpy_stats

pytestmark = pytest.mark.unit

CTX = RequestContext()
# Runs of more records than this are long: read in the background, a first look meanwhile.
LONG = run_store.Limits(compact_above_records=5_000)
# What a first look says of its first anomaly; the rest needs the run's history.
OWN = ("step", "tensor", "op_type", "tensor_description", "phase", "role", "nan", "posinf", "neginf", "size",
       "description", "occurrence", "op", "replay")


class _Counting(file_provider.FileProvider):
    """The plugin's provider of a local logdir, counting the tags each read asks for."""

    def __init__(self, logdir: str):
        super().__init__(logdir, on_listing=False)
        self.read_tags: list[str] = []
        self.index_round()

    def read_tensors(self, ctx=None, *, run_tag_filter=None, **kw):
        self.read_tags.extend(run_tag_filter.tags or [])
        return super().read_tensors(ctx, run_tag_filter=run_tag_filter, **kw)


def _cli(logdir: str, run: str, sr: analysis.SafeRange = analysis.SafeRange()) -> dict:
    """The CLI's summary of ``run``: every record read."""
    return next(s for s in cli.report(logdir, sr)[0] if s["run"] == run)


def _store(logdir: str) -> tuple[run_store.RunStore, _Counting]:
    files = _Counting(logdir)
    return run_store.RunStore(files, reload_interval=0, background=False, limits=LONG), files


def _write(run_dir: str, steps: int, tensors: list[tuple[str, metadata.TensorInfo]],
           bad: dict[tuple[str, int], float], start: int = 0) -> None:
    """``steps`` steps of every tensor packed as the callback writes them, the
    value ``bad[(tag, step)]`` put into that record; op-level tags (``ops/``) per tensor."""
    with NumericsRecordWriter(run_dir) as w:
        for step in range(start, steps):
            packed_now, own = [], []
            for tag, info in tensors:
                values = np.float32([1.0 + 0.001 * step, -0.5, 0.25, bad.get((tag, step), 0.5)])
                (own if tag.startswith("ops/") else packed_now).append((tag, numpy_stats(values), info))
            w.write_many(step, packed_now)
            for tag, stats, info in own:
                w.write(tag, step, stats, info)


def _info(role: str, order: int, **kw) -> metadata.TensorInfo:
    return metadata.TensorInfo(role=role, order=order, shape=(4,), dtype="float32", **kw)


# Three forward outputs, the loss, two gradients: 6 tensors, 1,000 steps a block.
TENSORS = [("input", _info("input", 0)), ("a/output", _info("activation", 1)), ("b/output", _info("activation", 2)),
           ("loss", _info("loss", 3)), ("b/kernel", _info("gradient", 1)), ("a/kernel", _info("gradient", 2))]


def test_a_long_run_not_read_yet_names_its_first_anomaly_at_once_then_everything(tmp_path):
    logdir = str(tmp_path / "logs")
    long_run.write(logdir, 2400, 10)  # 36 tensors, 86,400 records in 3 blocks; the NaN at step 2,160
    want = _cli(logdir, long_run.RUN)
    fault = long_run.faults(2400)["nan_at"]
    assert (want["first_anomaly"]["step"], want["first_anomaly"]["tensor"]) == (fault, "dense03/kernel")
    store, files = _store(logdir)
    blocks = [t for t in store.listing(CTX, "")[long_run.RUN] if packed.is_block_tag(t)]

    look = store.answer(CTX, "", long_run.RUN, analysis.SafeRange(), first_look=True)
    assert (look.preliminary, look.stale, look.as_of_step, look.latest_step) == (True, True, None, 2399)
    got = analysis.first_look_summary(look.analysis)
    assert {k: got["first_anomaly"][k] for k in OWN} == {k: want["first_anomaly"][k] for k in OWN}
    assert {k for k, v in got["first_anomaly"].items() if v is None} >= {
        "last_healthy_step", "last_finite_step", "hint", "likely_cause", "row"}
    assert (got["first_warning"], got["warnings"], got["records"], got["first_step"]) == (None, [], None, None)
    assert want["first_warning"] is not None  # the whole run's warnings are not "none found"
    assert len(files.read_tags) == 1 and len(blocks) == 3  # only the block of that step was read

    store.refresh_round()  # the refresher reads the run the first look asked it to
    whole = store.answer(CTX, "", long_run.RUN, analysis.SafeRange(), first_look=True)
    assert (whole.preliminary, whole.stale, whole.as_of_step) == (False, False, 2399)
    summary = analysis.run_summary(whole.analysis)
    for key in ("first_anomaly", "first_warning", "warnings", "records"):
        assert summary[key] == want[key], key


@pytest.mark.parametrize("bad, first", [
    # forward before backward, whatever the writing order
    ({("b/kernel", 1234): np.nan, ("a/output", 1234): np.inf}, "a/output"),
    # backward runs from the last layer: b's gradient before a's
    ({("a/kernel", 1234): np.nan, ("b/kernel", 1234): -np.inf}, "b/kernel"),
    ({("loss", 1234): np.inf, ("b/kernel", 1234): np.nan, ("a/kernel", 1500): np.nan}, "loss"),
], ids=["forward", "backward", "loss"])
def test_a_first_look_names_the_first_tensor_in_execution_order_at_its_step(tmp_path, bad, first):
    run_dir = str(tmp_path / "logs" / "r")
    _write(run_dir, 3000, list(reversed(TENSORS)), bad)
    want = _cli(str(tmp_path / "logs"), "r")["first_anomaly"]
    assert (want["step"], want["tensor"]) == (1234, first)  # the injected faults, in execution order
    look = _store(str(tmp_path / "logs"))[0].answer(CTX, "", "r", analysis.SafeRange(), first_look=True)
    assert look.preliminary
    got = analysis.first_look_summary(look.analysis)["first_anomaly"]
    assert {k: got[k] for k in OWN} == {k: want[k] for k in OWN}


def test_a_tensor_logged_twice_in_a_step_is_named_by_its_occurrence(tmp_path):
    """Records beyond the first of a step (micro-batches, a loop body) go to
    a repeat block of their tensor (``packed.repeat_tag``), whose events'
    steps count its events: the first look reads the one that may be
    non-finite and names the occurrence the CLI names."""
    run_dir = str(tmp_path / "logs" / "r")
    _write(run_dir, 3000, TENSORS, {("a/kernel", 2000): np.nan})
    info = dict(TENSORS)

    def repeat(tag: str, step: int, second: float, event_step: int) -> packed.PackedEvent:
        first = numpy_stats(np.float32([1.0 + 0.001 * step, -0.5, 0.25, 0.5]))
        rows = np.stack([np.r_[0.0, step, first], np.r_[0.0, step, numpy_stats(np.float32([second, 1.0]))]])
        return packed.PackedEvent(packed.repeat_tag("feedbeef", info[tag].order),
                                  event_step, rows, time.time(), metadata.create_block_metadata([(tag, info[tag])]))

    with NumericsRecordWriter(run_dir) as w:  # as TensorFlow's writer writes them (_tag_writer._write_repeat)
        w._write_packed([repeat("a/output", step, 1.0, n) for n, step in enumerate((100, 200, 300, 400))])
        w._write_packed([repeat("b/output", 1234, np.nan, 0)])
    want = _cli(str(tmp_path / "logs"), "r")["first_anomaly"]
    assert (want["step"], want["tensor"], want["occurrence"]) == (1234, "b/output", {"index": 2, "of": 2})
    look = _store(str(tmp_path / "logs"))[0].answer(CTX, "", "r", analysis.SafeRange(), first_look=True)
    assert look.preliminary
    got = analysis.first_look_summary(look.analysis)["first_anomaly"]
    assert {k: got[k] for k in OWN} == {k: want[k] for k in OWN}


def _allowed_neginf_first(run_dir: str) -> analysis.SafeRange:
    tensors = [(t, dataclasses.replace(i, neginf_ok=True) if t == "b/output" else i) for t, i in TENSORS]
    _write(run_dir, 3000, tensors, {("b/output", 300): -np.inf, ("a/kernel", 2100): np.nan})
    return analysis.SafeRange()


def _neginf_the_user_allows(run_dir: str) -> analysis.SafeRange:
    _write(run_dir, 3000, TENSORS, {("input", 300): -np.inf, ("a/kernel", 2100): np.nan})
    return analysis.SafeRange(allow_neginf=("input",))


def _loss_scale(run_dir: str) -> analysis.SafeRange:
    """A mixed-precision run: its gradients' first NaN may be a skip that
    loss scaling handles, which only later steps tell."""
    _write(run_dir, 3000, TENSORS + [("loss_scale", metadata.TensorInfo(role="loss_scale", order=0, shape=()))],
           {("a/kernel", 999): np.nan, ("b/kernel", 2100): np.nan})
    return analysis.SafeRange()


def _rewritten_by_a_later_training(run_dir: str) -> analysis.SafeRange:
    """A job that went NaN at step 1,500, restarted from step 1,200: the later training's records stand."""
    _write(run_dir, 1600, TENSORS, {("a/kernel", 1500): np.nan})
    _write(run_dir, 3000, TENSORS, {("b/kernel", 2500): np.inf}, start=1200)
    return analysis.SafeRange()


def _an_op_whose_layer_stayed_finite(run_dir: str) -> analysis.SafeRange:
    """An op's NaN that its layer's output did not show: the first anomaly is
    the first layer's to go bad, later."""
    op = metadata.TensorInfo(role="activation", order=1, shape=(4,), dtype="float32", op_type="Log")
    _write(run_dir, 3000, TENSORS + [("ops/a/Log", op)], {("ops/a/Log", 500): np.nan, ("b/output", 2100): np.nan})
    return analysis.SafeRange()


@pytest.mark.parametrize("make", [_allowed_neginf_first, _neginf_the_user_allows, _loss_scale,
                                  _rewritten_by_a_later_training, _an_op_whose_layer_stayed_finite],
                         ids=lambda f: f.__name__.strip("_"))
def test_no_first_look_where_the_first_nonfinite_step_is_not_the_first_anomaly(tmp_path, make):
    """Where the index's earliest step is no anomaly, or one that later steps
    may undo, the request waits for the whole run and answers what the CLI
    does: a first look is exact or absent."""
    logdir = str(tmp_path / "logs")
    sr = make(logdir + "/r")
    want = _cli(logdir, "r", sr)
    store, files = _store(logdir)
    assert files.nonfinite_steps("r")  # the index did see a NaN or an infinity
    answer = store.answer(CTX, "", "r", sr, first_look=True)
    assert (answer.preliminary, answer.stale) == (False, False)
    summary = analysis.run_summary(answer.analysis)
    for key in ("first_anomaly", "first_warning", "records"):
        assert summary[key] == want[key], key


def test_no_first_look_for_a_short_run_or_a_finite_one(tmp_path):
    """A short run is read at once, a finite one is read whole before any
    answer (a first look never says "healthy")."""
    _write(str(tmp_path / "short" / "r"), 300, TENSORS, {("a/kernel", 100): np.nan})
    _write(str(tmp_path / "finite" / "r"), 3000, TENSORS, {})
    for name in ("short", "finite"):
        store, files = _store(str(tmp_path / name))
        answer = store.answer(CTX, "", "r", analysis.SafeRange(), first_look=True)
        assert (answer.preliminary, answer.stale) == (False, False)
        assert analysis.run_summary(answer.analysis)["records"] == _cli(str(tmp_path / name), "r")["records"]
