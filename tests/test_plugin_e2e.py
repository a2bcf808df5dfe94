"""The plugin in a real ``tensorboard`` process, with both data loaders.

Run as a user would: ``tensorboard --logdir`` on 127.0.0.1, no
``--samples_per_plugin``. TensorBoard would keep only 10 (Python loader) or
100 (Rust data server) records of each numerics tag by default; the plugin
must still see the NaN at step 7,777 of 10,000 and the healthy step before.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.parse

import numpy as np
import pytest

from tb_numerics import metadata
from tb_numerics.record_writer import NumericsRecordWriter
from tb_numerics.records import numpy_stats
from tb_process import tensorboard, wait_for

pytestmark = pytest.mark.e2e

P = "/data/plugin/numerics"
STEPS = 10_000
NAN_STEP = 7_777
# Keys a route adds to the CLI's summary: the parameters, and how current the answer is.
FRESHNESS = ("safe_range", "stale", "preliminary", "as_of_step", "latest_step")


# The same records, one event per tensor per step ("long", as log_numerics
# writes them) and packed, many steps per event ("packed", as the Keras
# callback and write_many write them).
RUNS = ("long", "packed")


@pytest.fixture(scope="module")
def logdir(tmp_path_factory) -> str:
    """Runs of 10,000 steps x 2 tensors, a NaN in the loss at step 7,777."""
    d = str(tmp_path_factory.mktemp("e2e") / "logs")
    act = metadata.TensorInfo(role="activation", order=0, shape=(3,))
    loss = metadata.TensorInfo(role="loss", order=1, shape=())
    healthy_act = numpy_stats(np.float32([0.5, -1.0, 2.0]))
    healthy_loss = numpy_stats(np.float32([0.25]))
    nan_loss = numpy_stats(np.float32([np.nan]))
    with NumericsRecordWriter(os.path.join(d, "long")) as w, NumericsRecordWriter(os.path.join(d, "packed")) as p:
        for step in range(STEPS):
            records = [("dense/output", healthy_act, act), ("loss", nan_loss if step == NAN_STEP else healthy_loss, loss)]
            for tag, stats, info in records:
                w.write(tag, step, stats, info)
            p.write_many(step, records)
    return d


@pytest.fixture(scope="module")
def cli_report(logdir) -> dict:
    """``tb-numerics report --json`` of the logdir, by run: what the plugin must match."""
    out = subprocess.run(
        [sys.executable, "-m", "tb_numerics.cli", "report", "--json", logdir],
        capture_output=True, text=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
    )
    assert out.returncode == 1, out.stderr
    return {r["run"]: r for r in json.loads(out.stdout)["runs"]}


@pytest.fixture(scope="module", params=[True, False], ids=["rust", "python"])
def served(request, logdir, tmp_path_factory):
    """(tensorboard, its logdir): one process per loader for the module,
    started on a copy of ``logdir``. The first test sees the runs ``long``
    and ``packed`` alone; the later ones add runs while it serves."""
    root = tmp_path_factory.mktemp("served") / "logs"
    shutil.copytree(logdir, root)
    with tensorboard(str(root), load_fast=request.param, reload_interval=1) as tb:
        yield tb, root


def test_first_anomaly_of_a_long_run_in_real_tensorboard(served, cli_report):
    tb, _ = served
    listing = tb.get_json("/data/plugins_listing")
    assert listing["numerics"]["tab_name"] == "Numerics"
    assert listing["numerics"]["loading_mechanism"]["module_path"] == P + "/index.js"

    for run in RUNS:
        # Loading takes a moment: wait until every record is in.
        summary = wait_for(
            lambda: (s := tb.get_json(P + "/summary?run=" + run))["records"] == 2 * STEPS
            and not s["stale"] and s,
            timeout=120,
        )
        a = summary["first_anomaly"]
        assert (a["step"], a["tensor"], a["last_healthy_step"]) == (NAN_STEP, "loss", NAN_STEP - 1)
        assert summary["problems"] == []
        assert {k: v for k, v in summary.items() if k not in FRESHNESS} == cli_report[run]

        t = tb.get_json(P + "/timeline?run=%s&width=100" % run)
        assert len(t["bucket_start"]) == 100
        assert [r["tensor"] for r in t["rows"]] == ["dense/output", "loss"]
        loss_cells = t["rows"][1]["cells"]
        assert loss_cells.count(2) == 1 and loss_cells[NAN_STEP * 100 // STEPS] == 2

        s = tb.get_json(P + "/series?run=%s&tensor=loss&start=7770&end=7780" % run)
        assert s["steps"] == list(range(7770, 7781))
        assert s["fields"]["nan"][7] == 1 and s["fields"]["min"][7] == "NaN"
    assert tb.get_json("/data/plugins_listing")["numerics"]["enabled"] is True
    assert cli_report["long"]["run"] == "long" and cli_report["packed"]["run"] == "packed"
    runs = tb.get_json(P + "/runs")["runs"]
    assert [(r["run"], r["first_anomaly_step"]) for r in runs] == [("long", NAN_STEP), ("packed", NAN_STEP)]

    status, body = tb.get(P + "/timeline?run=long&width=-1")
    assert status == 400 and "width" in json.loads(body)["error"]
    status, body = tb.get(P + "/summary?run=" + urllib.parse.quote("no such run"))
    assert status == 404 and "error" in json.loads(body)
    status, body = tb.get(P + "/index.js")
    assert status == 200 and b"render" in body


def test_run_written_while_tensorboard_runs_appears_on_reload(served):
    tb, logdir = served
    info = metadata.TensorInfo(role="loss")
    healthy = numpy_stats(np.float32([1.0]))
    # A training job appending to its event file while TensorBoard runs.
    w = NumericsRecordWriter(os.path.join(logdir, "a"))
    for step in range(5):
        w.write("loss", step, healthy, info)
    w.flush()
    wait_for(lambda: tb.get_json(P + "/summary?run=a")["last_step"] == 4)
    for step in range(5, 12):
        w.write("loss", step, numpy_stats(np.float32([np.inf if step == 9 else 1.0])), info)
    w.close()
    s = wait_for(lambda: (s := tb.get_json(P + "/summary?run=a"))["last_step"] == 11 and s)
    assert s["first_anomaly"]["step"] == 9 and s["first_anomaly"]["last_healthy_step"] == 8


def test_grown_run_is_served_stale_then_fresh(served):
    """A big run grows: while it is read again, answers come at once from the
    previous records, marked stale; then the complete answer, equal to the CLI's."""
    tb, logdir = served
    steps, tags = 40_000, 5  # 200,000 records: reading them takes seconds, not milliseconds
    infos = [(f"layer{i}/output", metadata.TensorInfo(role="activation", order=i)) for i in range(tags)]
    healthy = numpy_stats(np.float32([0.5, -1.0]))
    w = NumericsRecordWriter(os.path.join(logdir, "grow"))
    for step in range(steps):
        for tag, info in infos:
            w.write(tag, step, healthy, info)
    w.flush()
    # No cache yet: the first complete answer is read by the request (or waits for the refresher).
    # TensorBoard's Python loader may still be loading when it lists, so an answer
    # holding every record can be marked stale once; the next one is current.
    first = wait_for(
        lambda: (s := tb.get_json(P + "/summary?run=grow", timeout=300))["records"] == steps * tags
        and not s["stale"] and s,
        timeout=300,
    )
    assert (first["stale"], first["as_of_step"], first["first_anomaly"]) == (False, steps - 1, None)

    nan_step = steps + 2
    for step in range(steps, steps + 5):
        for tag, info in infos:
            x = [np.nan, 1.0] if (step, tag) == (nan_step, "layer3/output") else [0.5, -1.0]
            w.write(tag, step, numpy_stats(np.float32(x)), info)
    w.close()

    answers, timelines = [], []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        s = tb.get_json(P + "/summary?run=grow", timeout=300)
        answers.append(s)
        if s["stale"] and not timelines:
            timelines.append(tb.get_json(P + "/timeline?run=grow&width=10", timeout=300))
        if not s["stale"] and s["last_step"] == steps + 4:
            break
        time.sleep(0.05)
    stale = [a for a in answers if a["stale"]]
    assert stale, "no answer was served while the grown run was read again"
    for a in stale:
        # An earlier analysis, saying how far it goes. TensorBoard may see the
        # append over two reloads, so it may already hold some new records.
        assert steps - 1 <= a["as_of_step"] == a["last_step"] < a["latest_step"] <= steps + 4
        assert steps * tags <= a["records"] < (steps + 5) * tags
        assert a["first_anomaly"] is None or a["first_anomaly"]["step"] == nan_step
    t = timelines[0]
    assert t["bucket_end"][-1] < steps + 4 and (not t["stale"] or t["as_of_step"] == t["bucket_end"][-1])
    # Answers never go back in time, and the old records come first.
    records = [a["records"] for a in answers]
    assert records == sorted(records)
    assert answers[0]["last_step"] == steps - 1 or answers[0]["stale"]
    final = answers[-1]
    assert (final["stale"], final["as_of_step"], final["latest_step"]) == (False, steps + 4, steps + 4)
    assert final["first_anomaly"]["step"] == nan_step

    out = subprocess.run(
        [sys.executable, "-m", "tb_numerics.cli", "report", "--json", os.path.join(logdir, "grow")],
        capture_output=True, text=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
    )
    (cli_run,) = json.loads(out.stdout)["runs"]
    assert {k: v for k, v in final.items() if k not in FRESHNESS} == cli_run
