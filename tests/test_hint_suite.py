"""The hints on small buggy Keras trainings of known cause: never wrong.

The demo's stories are scored by tests/test_demo.py on the demo's own run;
``python -m demo.hint_suite`` scores both and prints the README's figure.
"""

import json
import logging

import pytest
from tensorboard.context import RequestContext

import long_run
from demo import buggy_keras, hint_suite
from tb_numerics import analysis, cli, compact, rules

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def logdir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("buggy"))
    for case in buggy_keras.CASES:
        case.run(path)
    return path


@pytest.fixture(scope="module")
def runs(logdir):
    summaries, problems = cli.report(logdir, analysis.SafeRange())
    assert problems == []
    return {s["run"]: s for s in summaries}


@pytest.mark.parametrize("case", buggy_keras.CASES, ids=lambda c: c.name)
def test_no_hint_is_wrong(runs, case):
    assert hint_suite.score(runs[case.name], case.truth) in ("right", "absent"), json.dumps(
        runs[case.name]["first_anomaly"])


def test_the_evidence_based_hints_are_right(runs):
    verdicts = {c.name: hint_suite.score(runs[c.name], c.truth) for c in buggy_keras.CASES}
    assert verdicts["relu_output_cce"] == "right"
    assert verdicts["exponential_activation"] == "right"
    assert verdicts["sgd_divergence"] == "right"
    assert verdicts["healthy_mlp"] == "right"
    # The replay names the custom layer's Log, whose name says nothing.
    assert verdicts["custom_log_layer"] == "right"


def test_relu_output_hint_cites_the_output_and_not_the_learning_rate(runs):
    a = runs["relu_output_cce"]["first_anomaly"]
    assert a["tensor"] == "loss" and "out/output held exact zeros" in a["hint"]
    assert "learning rate" not in a["hint"]


def test_fast_divergence_warns_before_the_anomaly(runs):
    r = runs["sgd_divergence"]
    assert r["first_warning"]["step"] < r["first_anomaly"]["step"]
    # The loss grows orders of magnitude a step: warned from its second record.
    (loss,) = [w for w in r["warnings"] if w["kind"] == "fast_growth" and w["tensor"] == "loss"]
    assert loss["first_step"] == 1



def test_each_run_held_compact_reports_what_every_record_read_reports(logdir, runs, caplog):
    """TensorBoard holds a long run compact (``compact``): these trainings,
    held so however short, give the CLI's first anomaly, hint and warnings
    (its answer from every record read is the truth), and no tensor's
    records are read back whole to give them (on a long run each would be
    the event files read again)."""
    caplog.set_level(logging.INFO, logger="tb_numerics.compact")
    store = long_run.compact_store(logdir)
    for case in buggy_keras.CASES:
        ra = store.answer(RequestContext(), "", case.name, analysis.SafeRange()).analysis
        assert any(isinstance(h.series, compact.CompactSeries) for h in ra.health), case.name
        got = analysis.run_summary(ra)
        for key in ("first_anomaly", "first_warning", "warnings", "info"):
            assert rules.dumps(got[key]) == rules.dumps(runs[case.name][key]), (case.name, key)
    assert "reading all" not in caplog.text


def test_a_first_look_at_each_run_is_the_clis_first_anomaly_or_none(logdir, runs):
    """A first look (the answer before a long run is read), each training
    held as a long run however short: its first anomaly's own fields, the
    replay's op included, are the CLI's; where there is none, the answer is
    the whole run's; the healthy training never gets one."""
    own = ("step", "tensor", "op_type", "phase", "role", "nan", "posinf", "neginf", "size", "description",
           "occurrence", "op", "replay")
    store = long_run.compact_store(logdir)
    looks = []
    for case in buggy_keras.CASES:
        want = runs[case.name]["first_anomaly"]
        answer = store.answer(RequestContext(), "", case.name, analysis.SafeRange(), first_look=True)
        if answer.preliminary:
            looks.append(case.name)
            got = analysis.first_look_summary(answer.analysis)["first_anomaly"]
            assert want is not None and rules.dumps({k: got[k] for k in own}) == rules.dumps(
                {k: want[k] for k in own}), case.name
        else:
            assert rules.dumps(analysis.run_summary(answer.analysis)["first_anomaly"]) == rules.dumps(want), case.name
    assert "healthy_mlp" not in looks and "custom_log_layer" in looks, looks
