"""The hints on small buggy Keras trainings of known cause: never wrong.

The demo's stories are scored by tests/test_demo.py on the demo's own run;
``python -m demo.hint_suite`` scores both and prints the README's figure.
"""

import json

import pytest

from demo import buggy_keras, hint_suite
from tb_numerics import analysis, cli

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    logdir = str(tmp_path_factory.mktemp("buggy"))
    for case in buggy_keras.CASES:
        case.run(logdir)
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
