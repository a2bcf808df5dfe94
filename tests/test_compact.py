"""A long run held compact answers as every record read does.

The truth is ``tb-numerics report``'s (``cli.report``: every record read
from the event files and analysed whole); the plugin's side is a
``RunStore`` over the logdir's files (``file_provider``), made to hold the
run compact (``compact``). One run (``long_run``: a warning, a spike, an
underflow and a NaN late in it) is written once for the module.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import pytest
from tensorboard.context import RequestContext

import long_run
from tb_numerics import (analysis, cli, compact, compare, detectors, event_reader, health, metadata, plugin, rules,
                         run_store, views)
from tb_numerics.records import F, TensorSeries, numpy_stats

pytestmark = pytest.mark.unit

STEPS = 3000
SAFE_RANGES = ({}, {"max_abs": "50", "spike_factor": "3"}, {"off": "headroom,gradient_spike", "underflow_share": "0.05"})


@pytest.fixture(scope="module")
def logdir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("logs"))
    long_run.write(path, STEPS, width=8)
    return path


@pytest.fixture(scope="module")
def store(logdir) -> run_store.RunStore:
    return long_run.compact_store(logdir)


@pytest.fixture(scope="module")
def whole(logdir) -> event_reader.RunRecords:
    return event_reader.read_run(long_run.RUN, event_reader.find_runs(logdir)[long_run.RUN])


def _answer(store, params) -> analysis.RunAnalysis:
    return store.answer(RequestContext(), "", long_run.RUN, analysis.parse_safe_range(params)).analysis


@pytest.mark.parametrize("params", SAFE_RANGES)
def test_the_compact_run_reports_what_the_cli_reports(store, logdir, params, caplog):
    caplog.set_level(logging.INFO, logger="tb_numerics.compact")
    truth = cli.report(logdir, analysis.parse_safe_range(params))[0][0]
    got = analysis.run_summary(_answer(store, params))
    for key in ("first_anomaly", "first_warning", "warnings", "info", "records", "last_step"):
        assert rules.dumps(got[key]) == rules.dumps(truth[key]), key
    assert "reading all" not in caplog.text  # no tensor was read back whole


def test_the_faults_are_where_they_were_injected(store):
    """The oracle itself: the report finds the injected faults at their steps."""
    s = analysis.run_summary(_answer(store, {}))
    f = long_run.faults(STEPS)
    assert (s["first_anomaly"]["step"], s["first_anomaly"]["tensor"]) == (f["nan_at"], "dense03/kernel")
    assert s["first_warning"]["step"] == f["jump_at"]
    kinds = {(w["tensor"], w["kind"]): w["first_step"] for w in s["warnings"]}
    assert kinds[("dense01/kernel", "underflow")] == f["underflow_from"]
    assert kinds[("dense04/kernel", "square_overflow")] == f["jump_at"]
    assert kinds[("gradients/global_norm", "gradient_spike")] == f["jump_at"]
    assert f["growth_at"] < kinds[("dense02/output", "headroom")] < f["growth_at"] + 12
    # Dead units need ``sustain`` records of them.
    assert kinds[("relu/output", "dead_units")] == f["dead_from"] + analysis.SafeRange().sustain - 1


def test_usual_tensors_are_held_compact_and_the_rules_special_ones_whole(store):
    ra = _answer(store, {})
    held = {h.series.tag: isinstance(h.series, compact.CompactSeries) for h in ra.health}
    assert held["dense00/output"] and held["dense05/kernel"] and held["relu/output"]
    assert held["gate/output"] and held["probs/output"]
    for tag in ("input", "loss", "gradients/global_norm"):
        assert not held[tag], tag
    # Every activation, the gradients but the by-depth pair.
    assert sum(held.values()) == 8 + 3 + 2 * 8 - 2
    assert sum(not c for c in held.values()) == 5


@pytest.mark.parametrize("width", [1, 37, 1000, 5000])
def test_the_timeline_is_the_one_of_every_record(store, whole, width):
    full = analysis.analyze_run(long_run.RUN, whole.series, analysis.SafeRange(), whole.problems)
    got = analysis.timeline(_answer(store, {}), width, 10, STEPS - 3)
    assert got == analysis.timeline(full, width, 10, STEPS - 3)


def test_a_chart_of_few_records_reads_them_back(store, whole):
    full = analysis.analyze_run(long_run.RUN, whole.series, analysis.SafeRange(), whole.problems)
    f = long_run.faults(STEPS)
    for tag in ("dense03/kernel", "dense02/output", "loss"):
        got = analysis.series_points(_answer(store, {}).find(tag), 2000, f["nan_at"] - 50, f["nan_at"] + 50)
        assert rules.dumps(got) == rules.dumps(analysis.series_points(full.find(tag), 2000, f["nan_at"] - 50,
                                                                      f["nan_at"] + 50))
        assert len(got["steps"]) == 101


def test_a_wide_chart_is_made_of_whole_chunks_with_their_exact_statistics(store, whole, monkeypatch):
    ra = _answer(store, {})
    h = ra.find("dense03/kernel")
    monkeypatch.setattr(views, "READ_BACK_RECORDS", 1000)  # what reading back may cost: less than this chart
    got = analysis.series_points(h, 40, 333, STEPS - 1)
    values = next(s for s in whole.series if s.tag == "dense03/kernel").values.astype(np.float64)
    steps = h.series.steps
    assert got["downsampled"] and len(got["steps"]) == 40
    assert got["steps"][0] == 300 and got["step_end"][-1] == STEPS - 1  # whole chunks of 50 records
    for p, (a, b) in enumerate(zip(got["steps"], got["step_end"])):
        lo, hi = int(np.searchsorted(steps, a)), int(np.searchsorted(steps, b, side="right"))
        assert (hi - lo) % compact.CHUNK == 0
        v = values[lo:hi]
        assert got["fields"]["min"][p] == np.nanmin(v[:, F["min"]])
        assert got["fields"]["max"][p] == np.nanmax(v[:, F["max"]])
        assert got["fields"]["nan"][p] == v[:, F["nan"]].sum()
        assert got["fields"]["count"][p] == v[:, F["count"]].sum()
        assert got["health"][p] == h.codes[lo:hi].max()
    assert max(got["health"]) == rules.NONFINITE  # the NaN's chunk shows it


def test_a_restarted_job_over_a_compact_run_reads_as_the_cli_does(tmp_path, monkeypatch):
    """A job restarted from the middle of a block writes its steps again,
    without the NaN: the later records replace the earlier ones, as
    ``packed.merge`` has it, and the run stays compact."""
    logdir = str(tmp_path)
    long_run.write(logdir, 1200, width=3)
    # A restarted job starts in a later second: its file's name (which
    # begins with that second) sorts after the first's, as readers order
    # files. Within one second the names' random parts decide the order.
    time.sleep(1.1)
    long_run.write(logdir, 1200, width=3, start=700, nan=False)
    store = long_run.compact_store(logdir)
    truth = cli.report(logdir, analysis.SafeRange())[0][0]
    got = analysis.run_summary(_answer(store, {}))
    assert truth["first_anomaly"]["step"] == long_run.faults(1200)["neginf_at"]  # the NaN was written over
    for key in ("first_anomaly", "first_warning", "warnings", "records", "problems"):
        assert rules.dumps(got[key]) == rules.dumps(truth[key]), key
    answer = store.answer(RequestContext(), "", long_run.RUN, analysis.SafeRange())
    assert answer.restarts == truth["restarts"] and truth["restarts"][0]["first_step"] == 700  # said, as the CLI says it
    h = _answer(store, {}).find("dense00/output")
    assert isinstance(h.series, compact.CompactSeries) and len(h.series.pieces) == 2
    monkeypatch.setattr(views, "READ_BACK_RECORDS", 100)  # a chart of chunks across the restart
    got = analysis.series_points(h, 1000)
    whole = event_reader.read_run(long_run.RUN, event_reader.find_runs(logdir)[long_run.RUN])
    values = next(s for s in whole.series if s.tag == "dense00/output").values
    ends = np.searchsorted(h.series.steps, got["step_end"], side="right")
    starts = np.searchsorted(h.series.steps, got["steps"])
    assert [int(values[a:b, F["count"]].sum()) for a, b in zip(starts, ends)] == got["fields"]["count"]
    assert [float(np.min(values[a:b, F["min"]])) for a, b in zip(starts, ends)] == got["fields"]["min"]
    assert 700 in got["steps"]  # the restart's first step begins a chunk


def _fault_series(rng: np.random.Generator, info: metadata.TensorInfo, tag: str, n: int) -> TensorSeries:
    """Records of ``n`` steps of a 4,096-value float32 tensor with every
    fault a usual tensor can hold: NaN, +-Inf, overflow, underflow, steady
    growth, jumps and squares beyond float32."""
    rows = []
    scale = 1.0
    for step in range(n):
        x = rng.normal(0, scale, 4096).astype(np.float32)
        r = rng.random()
        if r < 0.03:
            x[:3] = rng.choice([np.nan, np.inf, -np.inf], 3)
        elif r < 0.06:
            x[: rng.integers(1, 2000)] = 1e-39  # subnormal: underflow
        elif r < 0.08:
            x[0] = 3e37  # beyond float32's overflow margin
        elif r < 0.10:
            x[0] = 1e20  # its square overflows
        scale = scale * 10 if 40 <= step % 97 < 52 else (1.0 if step % 97 == 0 else scale)
        if info.activation == "relu":  # ReLU's zeros, and spells of dead units (70 % and more)
            x = np.where(x < 0, np.float32(0), x)
            if 60 <= step % 89 < 75:
                x[: rng.integers(2860, 4096)] = 0
        with np.errstate(over="ignore", invalid="ignore"):  # the growth pins them at their bounds
            if info.activation == "sigmoid":
                x = (1 / (1 + np.exp(-x))).astype(np.float32)
            elif info.activation == "tanh":
                x = np.tanh(x)
            elif info.activation == "softmax":
                e = np.exp(x - np.nanmax(x[np.isfinite(x)], initial=0))
                x = (e / np.nansum(e[np.isfinite(e)])).astype(np.float32)
        rows.append(numpy_stats(x))
    return TensorSeries(tag, info, np.arange(n, dtype=np.int64), np.array(rows))


@pytest.mark.parametrize("role", ["activation", "relu", "sigmoid", "tanh", "softmax", "gradient"])
def test_every_series_mask_answers_on_compact_records_as_on_the_records(role, caplog):
    """What ``compact`` claims: the masks read nothing of a usual tensor
    but what a compact series holds. A new rule that reads more fails here."""
    caplog.set_level(logging.INFO, logger="tb_numerics.compact")
    rng = np.random.default_rng(7)
    fn = role if role not in ("activation", "gradient") else ""
    info = metadata.TensorInfo(role="gradient" if role == "gradient" else "activation", order=0, shape=(64, 64),
                               dtype="float32", squared_by="adam" if role == "gradient" else "", activation=fn)
    series = _fault_series(rng, info, "t/x", 600)
    assert not compact.keeps_records(series.tag, info)
    small = compact.compact_parts("block", [series], lambda tag, info: False, lambda block, tag: series)[0]
    for params in SAFE_RANGES + ({"max_abs": "1e3", "underflow_share": "0.001"}, {"dead_share": "0.8", "sustain": "3"}):
        sr = analysis.parse_safe_range(params)
        want, got = health.series_health(series, sr), health.series_health(small, sr)
        assert np.array_equal(want.codes, got.codes) and np.array_equal(want.kinds, got.kinds), params
    kinds = set(health.series_health(series, analysis.SafeRange()).kinds.tolist())
    assert len(kinds) >= (2 if fn in detectors.SATURATING else 4)
    assert (rules.kind_code("dead_units") in kinds) == (role == "relu")
    assert (rules.kind_code("saturation") in kinds) == (fn in detectors.SATURATING)
    assert "reading all" not in caplog.text
    assert np.array_equal(small.records(100, 110), series.values[100:110].astype(np.float64))


def test_dead_units_read_only_the_bias_records_they_confirm(caplog):
    """The bias gradient that confirms dead units is a usual, compact
    tensor: its zeros are read back around the marked steps only, and the
    answer is the one from every record."""
    caplog.set_level(logging.INFO, logger="tb_numerics.compact")
    n, steps = 400, np.arange(400, dtype=np.int64)
    info = metadata.TensorInfo(role="gradient", order=1, shape=(64,), dtype="float32")
    v = np.zeros((n, metadata.NUM_FIELDS))
    v[:, F["count"]], v[:, F["min"]], v[:, F["max"]] = 64, -1.0, 1.0
    v[150:260, F["zeros"]] = 40  # 62 % of the units dead from step 150 to 259
    v[200:203, F["zeros"]] = 0
    bias = TensorSeries("gradients/dense/bias", info, steps, v)
    small = compact.compact_parts("block", [bias], lambda tag, info: False, lambda block, tag: bias)[0]
    relu = TensorSeries("dense/output", metadata.TensorInfo(role="activation", order=0, shape=(64, 64),
                                                            activation="relu", dtype="float32"), steps, v)
    for lo, hi in ((120, 300), (140, 160), (255, 270), (0, n)):
        dead = np.zeros(n, dtype=bool)
        dead[lo:hi] = True
        want = detectors.dead_units_by_gradient(relu, dead, [bias], 0.5, 5)
        assert want.any() and not want.all()
        assert np.array_equal(detectors.dead_units_by_gradient(relu, dead, [small], 0.5, 5), want), (lo, hi)
    assert "reading all" not in caplog.text


def test_compare_refuses_a_compact_run_at_once_and_says_why(store):
    """The band reads every record's L2 norm and zeros: a compact run would
    read each block back once per tensor, so /compare answers 400 at once."""
    p = plugin.NumericsPlugin.__new__(plugin.NumericsPlugin)  # its store only: the one over the files, compact
    p._store = store
    with pytest.raises(plugin._BadRequest) as refused:
        p.compare_impl(RequestContext(), "", long_run.RUN, long_run.RUN, compare.Band())
    assert refused.value.code == 400 and "long run" in str(refused.value) and "--against" in str(refused.value)


def _compact_arrays(ra: analysis.RunAnalysis) -> dict[str, np.ndarray]:
    """Every array a compact run holds, by tensor and name."""
    out = {}
    for h in ra.health:
        if isinstance(h.series, compact.CompactSeries):
            for k, p in enumerate(h.series.pieces):
                out["%s/%d/max_abs" % (h.series.tag, k)], out["%s/%d/flags" % (h.series.tag, k)] = p.max_abs, p.flags
                out["%s/%d/underflow" % (h.series.tag, k)] = p.underflow
                for f in ("start", "lo", "hi", "max_abs", "moments", "counts", "unrecorded"):
                    out["%s/%d/chunks.%s" % (h.series.tag, k, f)] = getattr(p.chunks, f)
    return out


def test_a_block_made_compact_a_chunk_at_a_time_holds_what_one_slice_holds(logdir, store, monkeypatch):
    """``compact_rows`` reads a usual block a slice of steps at a time: one
    chunk a slice here, so each block of 1,000 steps is 20 slices and the
    underflow begins in a late one. The compact run holds what one slice a
    block makes and reports what the CLI reports."""
    monkeypatch.setattr(compact, "_WORK_RECORDS", 1)
    assert compact._steps_at_once(30) == compact.CHUNK
    sliced = long_run.compact_store(logdir)
    got, want = _compact_arrays(_answer(sliced, {})), _compact_arrays(_answer(store, {}))
    assert got.keys() == want.keys() and any(k.endswith("underflow") and v is not None for k, v in got.items())
    for key, a in want.items():
        b = got[key]
        if key.endswith("chunks.moments"):  # sums of 50 float64 values, added in another order
            np.testing.assert_allclose(b, a, rtol=1e-13, err_msg=key)
        else:
            assert (a is None and b is None) or (a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)), key
    truth = cli.report(logdir, analysis.SafeRange())[0][0]
    summary = analysis.run_summary(_answer(sliced, {}))
    for key in ("first_anomaly", "first_warning", "warnings", "records", "problems"):
        assert rules.dumps(summary[key]) == rules.dumps(truth[key]), key


def _usual_block_run(logdir: str, steps: list[int], impossible_at: int | None = None) -> None:
    """One writer's packed run of 6 linear activations at ``steps``, a NaN
    in one at the 900th step written; where ``impossible_at`` is given, a
    record no tensor can produce (a negative count) at that step."""
    from tb_numerics.record_writer import NumericsRecordWriter

    rng = np.random.default_rng(3)
    infos = [("a%d/output" % i, metadata.TensorInfo(role="activation", order=i, shape=(64, 64), dtype="float32"))
             for i in range(6)]
    values = [long_run.stats(rng, len(steps), 4096, np.full(len(steps), 1.0 + i)) for i in range(6)]
    values[2][900, F["nan"]] = 2
    with NumericsRecordWriter(os.path.join(logdir, long_run.RUN)) as w:
        for j, step in enumerate(steps):
            recs = [(tag, v[j].copy(), info) for (tag, info), v in zip(infos, values)]
            if step == impossible_at:
                recs[4][1][F["count"]] = -1
            w.write_many(step, recs)


@pytest.mark.parametrize("fault", ["impossible_record", "steps_go_back"])
def test_a_block_unusual_in_a_late_slice_is_read_as_the_cli_reads_it(tmp_path, monkeypatch, fault):
    """A block looks usual in its first slices and is not in a later one:
    a record no tensor can produce, or a loop that went back and wrote its
    steps again. The whole block is then decoded as any other, and the
    compact run reports what the CLI reports: the record skipped and said,
    every step written kept."""
    monkeypatch.setattr(compact, "_WORK_RECORDS", 1)
    logdir = str(tmp_path)
    if fault == "impossible_record":
        _usual_block_run(logdir, list(range(1000)), impossible_at=730)
    else:
        _usual_block_run(logdir, list(range(700)) + list(range(650, 950)))
    store = long_run.compact_store(logdir)
    truth = cli.report(logdir, analysis.SafeRange())[0][0]
    summary = analysis.run_summary(_answer(store, {}))
    assert truth["records"] == 6000 - (fault == "impossible_record")
    assert truth["first_anomaly"]["tensor"] == "a2/output"
    for key in ("first_anomaly", "first_warning", "warnings", "records", "problems", "last_step"):
        assert rules.dumps(summary[key]) == rules.dumps(truth[key]), key
    if fault == "impossible_record":
        assert any("malformed" in p for p in summary["problems"])
    whole = event_reader.read_run(long_run.RUN, event_reader.find_runs(logdir)[long_run.RUN])
    full = analysis.analyze_run(long_run.RUN, whole.series, analysis.SafeRange(), whole.problems)
    for width in (7, 1000):
        assert analysis.timeline(_answer(store, {}), width) == analysis.timeline(full, width), width


FAULT_STEP = 2500


def _forward_failure_run(logdir: str, fault: str) -> str:
    """A packed run of 3,000 steps (three blocks) whose first anomaly needs
    the evidence of a step's records of usual, compact tensors: the loss
    +Inf at ``FAULT_STEP`` with every layer's output finite (``"loss"``:
    the hints ask which layer output went bad first, and whether the
    model's output saturated), or an update that made a weight NaN while
    its gradient stayed finite (``"update"``: the hints read the gradient's
    and the weight's records of that step)."""
    from tb_numerics.record_writer import NumericsRecordWriter

    def info(role: str, order: int, shape: tuple, **kw) -> metadata.TensorInfo:
        return metadata.TensorInfo(role=role, order=order, shape=shape, dtype="float32", **kw)

    table = [("input", info("input", 0, (64, 32)))]
    table += [("dense%02d/output" % i, info("activation", 1 + i, (64, 64))) for i in range(4)]
    table += [("probs/output", info("activation", 5, (64, 10), activation="softmax")),
              ("loss", info("loss", 6, ()))]
    table += [("gradients/dense%02d/kernel" % i, info("gradient", 4 - i, (64, 64), squared_by="adam"))
              for i in reversed(range(4))]
    table += [("gradients/global_norm", info("global_norm", 0, ())), ("update/dense00/kernel", info("weight", 0, (64, 64)))]
    rng = np.random.default_rng(5)
    steps = 3000
    values = [long_run.stats(rng, steps, int(np.prod(i.shape)), np.full(steps, 1.0 + k))
              for k, (_, i) in enumerate(table)]
    for v, (tag, _) in zip(values, table):
        if tag == "probs/output":
            v[:, F["min"]], v[:, F["max"]], v[:, F["zeros"]] = 0.1, 0.9, 0
        if tag == "loss" and fault == "loss":
            v[FAULT_STEP] = 0
            v[FAULT_STEP, F["count"]] = v[FAULT_STEP, F["posinf"]] = 1
            v[FAULT_STEP, F["min"]] = v[FAULT_STEP, F["max"]] = np.nan
        if tag == "update/dense00/kernel" and fault == "update":
            v[FAULT_STEP, F["nan"]] = 3
    run_dir = os.path.join(logdir, long_run.RUN)
    with NumericsRecordWriter(run_dir) as w:
        for step in range(steps):
            w.write_many(step, [(tag, v[step], i) for (tag, i), v in zip(table, values)])
    return {"loss": "loss", "update": "update/dense00/kernel"}[fault]


@pytest.mark.parametrize("fault", ["loss", "update"])
def test_a_first_anomalys_evidence_reads_back_only_the_records_of_its_step(tmp_path, caplog, fault):
    """The hints' evidence of a step (which layer output went bad first, the
    output's largest value, the gradient and weight records of a bad update)
    reads usual, compact tensors' records of that step back, not every
    record of each: on a long run that is the event files read again once
    per layer. The answer is the CLI's, from every record read; the oracle
    of the step and tensor is the injected fault."""
    caplog.set_level(logging.INFO, logger="tb_numerics.compact")
    logdir = str(tmp_path)
    tensor = _forward_failure_run(logdir, fault)
    compact_store = long_run.compact_store(logdir)
    ra = _answer(compact_store, {})
    held = {h.series.tag: isinstance(h.series, compact.CompactSeries) for h in ra.health}
    assert held["dense00/output"] and held["gradients/dense01/kernel"] and held["update/dense00/kernel"]
    got = analysis.run_summary(ra)
    assert (got["first_anomaly"]["step"], got["first_anomaly"]["tensor"]) == (FAULT_STEP, tensor)
    truth = cli.report(logdir, analysis.SafeRange())[0][0]
    for key in ("first_anomaly", "first_warning", "warnings"):
        assert rules.dumps(got[key]) == rules.dumps(truth[key]), key
    assert "reading all" not in caplog.text
