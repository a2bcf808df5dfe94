"""The demo's stories, run for real, diagnosed by ``tb-numerics report --json``.

Each expected diagnosis below was found while building the story by running
it eagerly with every logged tensor kept in numpy (which step, which tensor
first holds a NaN/Inf, and what the analysis rules make of the records), and
then confirmed on the logs the story writes from its ``tf.function`` step.
"""

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest

from tb_process import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")

# run -> the first anomaly's fields that a user relies on.
ANOMALIES = {
    # The ReLU head clips one label-0 prediction to exactly 0 at step 18:
    # sqrt(0) is finite, its gradient is +Inf, and every gradient is NaN.
    "gru_sqrt_loss": dict(step=18, tensor="loss/sqrt_grad", phase="backward",
                          nan=0, posinf=1, neginf=0, size=64, last_healthy_step=17),
    # One logit gap passes ~87 at step 16: softmax gives 0, log gives -Inf.
    "softmax_log": dict(step=16, tensor="log_probs", phase="forward",
                        nan=0, posinf=0, neginf=1, size=512, last_healthy_step=15),
    # The head's output grows ~1.6x a step (0.11 at step 0, 1.3e3 at 14,
    # 5.3e4 at 22) and passes the float16 maximum 65504 at step 23; its
    # headroom forecast warns from step 7 (max |x| 42, 2**-12 of 65504 is 16).
    "repeated_bn_fp16": dict(step=23, tensor="head/output", phase="forward",
                             nan=0, posinf=7, neginf=0, size=32, last_healthy_step=6),
    # tower_a's smallest norm shrinks 0.039, 0.024, 0.012, 0.0016, then 0
    # at step 23: one cosine is 0/0.
    "cosine_zero_tower": dict(step=23, tensor="cosine/similarity", phase="forward",
                              nan=1, posinf=0, neginf=0, size=64, last_healthy_step=22),
    # The overshoot blows up: the last ReLU layer passes the float32 max.
    # last_healthy_step: the last step with neither anomaly nor warning in
    # that tensor (its max |x| jumped 1e3x at step 4).
    "exploding_lr": dict(step=5, tensor="dense_4/output", phase="forward",
                         nan=0, neginf=0, last_healthy_step=3),
    # model.fit + NumericsCallback at lr 0.1: the gradients grow 685x and
    # their norm spikes at step 6, and the last hidden layer overflows at step 9 (the same on
    # JAX and PyTorch: the story draws its initial weights with numpy).
    "keras_fit": dict(step=9, tensor="dense_3/output", op_type="Dense", phase="forward",
                      nan=0, posinf=15, neginf=0, size=4096, last_healthy_step=7),
    # The record holding 1e38 is read at step 20; its squared error is +Inf.
    "bad_input": dict(step=20, tensor="loss", phase="forward",
                      nan=0, posinf=1, neginf=0, size=1, last_healthy_step=19),
}

HINT_WORDS = {
    "gru_sqrt_loss": "gradient of sqrt is infinite at 0",
    "softmax_log": "softmax_cross_entropy_with_logits",
    "cosine_zero_tower": "inside the norm",
    "bad_input": "The batch at step 20 was already far out of range in input",
}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """Runs ``python -m demo`` once; returns (logdir, its output, the report)."""
    logdir = str(tmp_path_factory.mktemp("demo_logs"))
    run = subprocess.run(
        [sys.executable, "-m", "demo", "--logdir", logdir],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    report = subprocess.run(
        [sys.executable, "-m", "tb_numerics.cli", "report", "--json", logdir],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120,
    )
    assert report.returncode == 1, report.stderr  # anomalies found
    runs = {r["run"]: r for r in json.loads(report.stdout)["runs"]}
    return logdir, run.stdout, runs


def test_every_story_writes_its_run(demo):
    _, _, runs = demo
    assert sorted(runs) == sorted(list(ANOMALIES) + ["healthy"])
    for r in runs.values():
        assert r["problems"] == []


@pytest.mark.parametrize("run", sorted(ANOMALIES))
def test_first_anomaly(demo, run):
    _, _, runs = demo
    anomaly = runs[run]["first_anomaly"]
    assert anomaly is not None
    assert {k: anomaly[k] for k in ANOMALIES[run]} == ANOMALIES[run]
    if run == "exploding_lr":
        assert anomaly["posinf"] > 0


@pytest.mark.parametrize("run", sorted(HINT_WORDS))
def test_hint_names_the_cause(demo, run):
    _, _, runs = demo
    assert HINT_WORDS[run] in runs[run]["first_anomaly"]["hint"]


def test_healthy_run_has_no_anomaly_and_no_warning(demo):
    _, _, runs = demo
    assert runs["healthy"]["first_anomaly"] is None
    assert runs["healthy"]["first_warning"] is None
    assert runs["healthy"]["last_step"] == 29


def test_exploding_lr_warns_before_the_anomaly(demo):
    _, _, runs = demo
    warning = runs["exploding_lr"]["first_warning"]
    assert warning["step"] == 3 < runs["exploding_lr"]["first_anomaly"]["step"]
    # The last layer's gradient jumps first (backward order), the global norm spikes with it.
    assert (warning["tensor"], warning["kind"]) == ("gradients/dense_3/kernel", "fast_growth")
    kinds = {(w["tensor"], w["kind"], w["first_step"]) for w in runs["exploding_lr"]["warnings"]}
    assert ("gradients/global_norm", "gradient_spike", 3) in kinds


def test_keras_fit_warns_before_the_anomaly_and_hints_at_the_learning_rate(demo):
    _, _, runs = demo
    run = runs["keras_fit"]
    # The global norm reads 8.4, 11, 15, 329, 43, 19, 1762, 4.4e5, 2.4e23, NaN:
    # the step-3 spike is undone within two steps (as one outlier batch's
    # is: no warning), the climb from step 6 is not.
    assert run["first_warning"]["step"] == 6 < run["first_anomaly"]["step"]
    assert run["first_warning"]["kind"] == "fast_growth"
    kinds = {(w["tensor"], w["kind"], w["first_step"]) for w in run["warnings"]}
    assert ("gradients/global_norm", "gradient_spike", 6) in kinds
    assert "learning rate" in run["first_anomaly"]["hint"]


def test_repeated_bn_fp16_warns_long_before_the_overflow(demo):
    """The block's passes grow about 1.5x a step in float16: the headroom
    forecast warns at step 7, the first step with 8 records, 16 steps before
    the +Inf, as the global gradient norm (2.3, 3.8, 7.4, 16, 29, 42, 92, 163)
    passes 10x its running median; by the anomaly, the middle passes are
    beyond float16's margin (1023.5) as well. The loss, an MAE without abs,
    falls below 0 and on: the hint names a loss that rewards growth."""
    _, _, runs = demo
    run = runs["repeated_bn_fp16"]
    warning = run["first_warning"]
    assert (warning["step"], warning["tensor"], warning["kind"]) == (7, "block/pass_6", "headroom")
    spike = [w for w in run["warnings"] if w["kind"] == "gradient_spike"]
    assert spike and spike[0]["first_step"] == 7
    # Issue 18: the first warning on this float16 story comes >= 10 steps before the NaN.
    assert run["first_anomaly"]["step"] - warning["step"] >= 10
    cause = run["first_anomaly"]["likely_cause"]
    assert (cause["step"], cause["tensor"], cause["kind"]) == (23, "block/pass_4", "headroom")
    assert "float16 overflow in about" in cause["detail"]
    assert "rewards growth" in run["first_anomaly"]["hint"] and "grew" in run["first_anomaly"]["hint"]
    # The headroom forecast warned on the head's output long before it overflowed.
    head = [w for w in run["warnings"] if w["tensor"] == "head/output"]
    assert head and head[0]["first_step"] <= 13


def test_bad_input_points_at_the_input(demo):
    _, _, runs = demo
    cause = runs["bad_input"]["first_anomaly"]["likely_cause"]
    assert (cause["step"], cause["tensor"], cause["kind"]) == (20, "input", "overflow_risk")
    assert "max |x| = 1e38" in cause["detail"]


def test_stories_without_a_trend_have_no_warning_before_the_anomaly(demo):
    _, _, runs = demo
    for run in ("gru_sqrt_loss", "cosine_zero_tower"):
        assert runs[run]["first_warning"] is None, run
    # The hidden ReLU's outputs are 82-87 % zeros from step 8 on, but at most 4 of its 32 units
    # have a 0 bias gradient (dead for the whole batch): sparse, not dead.
    assert runs["softmax_log"]["first_warning"] is None


def test_runner_prints_each_diagnosis_and_the_total_time(demo):
    _, out, _ = demo
    for run in ANOMALIES:
        assert "run %s" % run in out
    # Each story's cause and fix come from the analysis of its run.
    assert out.count("\n    hint: ") == len(ANOMALIES)
    assert "first anomaly: step 18, loss/sqrt_grad, backward" in out
    total = [line for line in out.splitlines() if line.startswith("TOTAL ")]
    assert len(total) == 1, out


def test_serve_prints_the_url_and_serves_the_numerics_plugin(demo, tmp_path):
    """Also: a rerun into the same logdir replaces the story's run, so every
    step is recorded once."""
    # The story's run as the module's demo wrote it: --serve reruns it there.
    shutil.copytree(os.path.join(demo[0], "softmax_log"), tmp_path / "softmax_log")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "demo", "--logdir", str(tmp_path), "--only", "softmax_log",
         "--serve", "--port", str(port)],
        cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + 300
        url = None
        for line in proc.stdout:
            if line.startswith("TensorBoard on "):
                url = line.split()[2]
                break
            assert time.monotonic() < deadline
        assert url == "http://127.0.0.1:%d/" % port
        with urllib.request.urlopen(url + "data/plugin/numerics/runs", timeout=60) as r:
            runs = json.load(r)["runs"]
        assert [(r["run"], r["first_anomaly_step"], r["records"]) for r in runs] == [
            # 30 steps x (5 tensors, 4 gradients and the global norm), once
            ("softmax_log", 16, 30 * 10)
        ]
        assert len(os.listdir(tmp_path / "softmax_log")) == 1
    finally:
        proc.terminate()
        proc.wait(timeout=30)
