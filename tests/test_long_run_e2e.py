"""A long run in a real TensorBoard answers as ``tb-numerics report`` does.

The run (``long_run``: a gradient's jump and spike, an underflow, growth
and a NaN, all in its last 40 %) is big enough to be held compact (more records than
``run_store.Limits.compact_above_records``), and written once for the
module. The CLI reads every record from the files and is the oracle: the
plugin's first anomaly, first warning and warnings must be its own, with
the Rust data server and with the Python loader, and TensorBoard keeps
only a sample of the records (the plugin reads them from the files).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.parse

import pytest

import long_run
from tb_numerics import run_store
from tb_process import tensorboard, wait_for

pytestmark = pytest.mark.e2e

STEPS = 4000
WIDTH = 48  # 150 tensors: 600,000 records


@pytest.fixture(scope="module")
def logdir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("logs") / "logs")
    long_run.write(path, STEPS, WIDTH)
    return path


@pytest.fixture(scope="module")
def report(logdir) -> dict:
    """``tb-numerics report --json``, run as a user runs it."""
    out = subprocess.run([sys.executable, "-m", "tb_numerics.cli", "report", "--json", logdir],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr  # a run holds a NaN
    return json.loads(out.stdout)["runs"][0]


def test_the_run_is_long_enough_to_be_held_compact(report):
    assert report["records"] > run_store.Limits().compact_above_records
    f = long_run.faults(STEPS)
    assert (report["first_anomaly"]["step"], report["first_warning"]["step"]) == (f["nan_at"], f["jump_at"])


@pytest.mark.parametrize("load_fast", [True, False], ids=["rust", "python"])
def test_the_plugin_answers_as_the_cli_does(logdir, report, load_fast):
    q = urllib.parse.quote
    seen = []  # every answer, from TensorBoard's start: a first look may come before the whole run
    with tensorboard(logdir, load_fast=load_fast) as tb:
        summary = wait_for(lambda: seen.append(s := tb.get_json("/data/plugin/numerics/summary?run=%s" % q(
            long_run.RUN), timeout=120)) or s["records"] == report["records"] and not s["stale"] and s,
            timeout=240, interval=0.2)
        for key in ("first_anomaly", "first_warning", "warnings"):
            assert summary[key] == report[key], key
        runs = tb.get_json("/data/plugin/numerics/runs")["runs"]
        assert [(r["first_anomaly_step"], r["preliminary"]) for r in runs] == [(report["first_anomaly"]["step"], False)]
        # A first look names the CLI's first anomaly (what that step's records say of it), never "healthy".
        own = ("step", "tensor", "phase", "role", "nan", "posinf", "neginf", "size", "description")
        for s in seen:
            assert not s["preliminary"] or (s["stale"] and {k: s["first_anomaly"][k] for k in own} == {
                k: report["first_anomaly"][k] for k in own} and s["first_anomaly"]["hint"] is None)
        timeline = tb.get_json("/data/plugin/numerics/timeline?run=%s&width=1000" % q(long_run.RUN))
        row = next(r for r in timeline["rows"] if r["tensor"] == report["first_anomaly"]["tensor"])
        bucket = next(b for b, (lo, hi) in enumerate(zip(timeline["bucket_start"], timeline["bucket_end"]))
                      if lo <= report["first_anomaly"]["step"] <= hi)
        assert row["cells"][bucket] == 2  # the NaN's bucket is non-finite
        series = tb.get_json("/data/plugin/numerics/series?run=%s&tensor=%s" % (
            q(long_run.RUN), q(report["first_anomaly"]["tensor"])))
        assert series["downsampled"] and max(series["fields"]["nan"]) == 3


def test_a_run_that_appears_whole_is_named_at_once_by_a_first_look(logdir, report, tmp_path):
    """A finished long run copied into a logdir TensorBoard already serves:
    the first /runs and /summary that list it answer a first look, its
    first anomaly the CLI's (what that step's records say of it) before the
    run is read, then the whole answer. TensorBoard's refresher looks for new
    runs every 30 s here, so the request is first to find it."""
    served = tmp_path / "served"
    served.mkdir()
    q = urllib.parse.quote
    own = ("step", "tensor", "phase", "role", "nan", "posinf", "neginf", "size", "description")
    with tensorboard(str(served), reload_interval=30) as tb:
        staging = tmp_path / "staging"
        shutil.copytree(os.path.join(logdir, long_run.RUN), staging)
        os.rename(staging, served / long_run.RUN)  # whole at once
        runs = wait_for(lambda: tb.get_json("/data/plugin/numerics/runs")["runs"], timeout=60, interval=0.1)
        first = tb.get_json("/data/plugin/numerics/summary?run=%s" % q(long_run.RUN))
        assert [(r["first_anomaly_step"], r["preliminary"], r["records"]) for r in runs] in (
            [(report["first_anomaly"]["step"], True, None)], [(report["first_anomaly"]["step"], False, report["records"])])
        assert (first["preliminary"], first["stale"], first["as_of_step"]) == (True, True, None)
        assert {k: first["first_anomaly"][k] for k in own} == {k: report["first_anomaly"][k] for k in own}
        assert (first["first_anomaly"]["last_healthy_step"], first["first_warning"], first["warnings"]) == (
            None, None, [])
        whole = wait_for(lambda: not (s := tb.get_json("/data/plugin/numerics/summary?run=%s" % q(
            long_run.RUN)))["stale"] and s, timeout=240, interval=0.2)
        assert not whole["preliminary"]
        for key in ("first_anomaly", "first_warning", "warnings", "records"):
            assert whole[key] == report[key], key
