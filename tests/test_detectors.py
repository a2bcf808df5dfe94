"""Early warnings before the NaN (issue 18): each detector on a real training
that shows it, through ``tb-numerics report --json``; and none at all on
ordinary healthy trainings."""

import json
import os

import keras
import numpy as np
import pytest

from demo import healthy_keras
from tb_numerics import cli
from tb_numerics.keras import NumericsCallback

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _fit(logdir, name, layers, x, y, lr, epochs=2, loss="mse"):
    model = keras.Sequential([keras.Input(x.shape[1:])] + layers)
    model.compile(optimizer=keras.optimizers.SGD(lr), loss=loss)
    model.fit(x, y, batch_size=32, epochs=epochs, shuffle=False, verbose=0,
              callbacks=[NumericsCallback(os.path.join(logdir, name))])


def _data(n=256, scale=1.0, teacher=False):
    rs = np.random.RandomState(0)
    x = (rs.randn(n, 8) * scale).astype("float32")
    y = (x @ rs.randn(8, 1)).astype("float32") if teacher else rs.randn(n, 1).astype("float32")
    return x, y


def dead_relu(logdir):
    keras.utils.set_random_seed(0)
    _fit(logdir, "dead_relu", [keras.layers.Dense(64, activation="relu", name="hidden",
                                                   bias_initializer=keras.initializers.Constant(-4.0)),
                               keras.layers.Dense(1)], *_data(), lr=0.01)


def deep_sigmoid(logdir):
    keras.utils.set_random_seed(0)
    _fit(logdir, "deep_sigmoid", [keras.layers.Dense(32, activation="sigmoid", name="s%d" % i) for i in range(10)]
         + [keras.layers.Dense(1, name="head")], *_data(), lr=0.01)


def tanh_unnormalised(logdir):
    keras.utils.set_random_seed(0)
    _fit(logdir, "tanh_unnormalised", [keras.layers.Dense(32, activation="tanh", name="th"), keras.layers.Dense(1)],
         *_data(scale=100.0), lr=0.01)


def lr_far_too_high(logdir):
    keras.utils.set_random_seed(0)
    _fit(logdir, "lr_far_too_high", [keras.layers.Dense(32, activation="relu", name="h"),
                                     keras.layers.Dense(1, name="head")], *_data(), lr=3.0, epochs=1)


def gradient_ascent(logdir):
    """The sign bug: a negative learning rate climbs the loss."""
    keras.utils.set_random_seed(0)
    _fit(logdir, "gradient_ascent", [keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)],
         *_data(n=2048, teacher=True), lr=-0.001, epochs=1)


def large_gain_head(logdir):
    """A head initialised 200x too large behind a Rescaling(0.005): the forward
    pass is the usual one, nothing grows or overflows, but backpropagation
    multiplies by the large kernel. Through linear and ReLU layers the
    first layer's gradient norm over the last's is about the last kernel's
    scale over the first's, so a gain uniform over depth never trips it."""
    keras.utils.set_random_seed(0)
    _fit(logdir, "large_gain_head", [keras.layers.Dense(32, activation="relu", name="first"),
                                     keras.layers.Rescaling(0.005),
                                     keras.layers.Dense(1, name="head",
                                                        kernel_initializer=keras.initializers.RandomNormal(stddev=50.0))],
         *_data(), lr=0.01)


def two_sources_lr_too_high(logdir):
    """Readings of two sources offset by +1 and -1, stored in blocks of two
    batches and fit unshuffled with a learning rate that nearly refits each
    batch: the loss jumps at each source's first batch and drops at its
    second. (With lr 0.05 the model averages the sources and the loss
    settles.)"""
    keras.utils.set_random_seed(0)
    x, y = _data(n=1024, teacher=True)
    y += np.where(np.arange(len(y)) // 64 % 2 == 0, 1.0, -1.0).astype("float32")[:, None]
    _fit(logdir, "two_sources_lr_too_high", [keras.layers.Dense(1, name="head")], x, y, lr=0.45)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    logdir = str(tmp_path_factory.mktemp("detectors"))
    for train in (dead_relu, deep_sigmoid, tanh_unnormalised, lr_far_too_high, gradient_ascent, large_gain_head,
                  two_sources_lr_too_high):
        train(logdir)
    for _, train in healthy_keras.CASES:
        train(logdir)
    return _report_json(logdir)


def _report_json(logdir):
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli.main(["report", "--json", logdir])
    return {r["run"]: r for r in json.loads(out.getvalue())["runs"]}


def _warning(run, kind):
    found = [w for w in run["warnings"] if w["kind"] == kind]
    assert found, [(w["kind"], w["tensor"]) for w in run["warnings"]]
    return found[0]


def test_dying_relu_from_a_large_negative_bias(report):
    w = _warning(report["dead_relu"], "dead_units")
    assert (w["tensor"], w["first_step"]) == ("hidden/output", 4)  # 5 records of >= 70 % zeros
    assert "100% of the values exactly 0" in w["detail"] and "LeakyReLU" in w["hint"]
    assert report["dead_relu"]["first_warning"]["kind"] == "dead_units"


def test_vanishing_gradients_by_depth_in_a_deep_sigmoid_net(report):
    w = _warning(report["deep_sigmoid"], "vanishing_by_depth")
    assert w["tensor"].endswith("s0/kernel") and w["first_step"] == 4
    assert "the last layer's" in w["detail"] and "head/kernel" in w["detail"]


def test_exploding_gradients_by_depth_behind_a_large_gain_head(report):
    run = report["large_gain_head"]
    w = _warning(run, "exploding_by_depth")
    assert w["tensor"].endswith("first/kernel") and "head/kernel" in w["detail"]
    # Above 70 from the first record, sustained 5 records: steps 4 to 15, all 16 of the run after the first 4.
    assert (w["first_step"], w["last_step"], w["records"]) == (4, 15, 12)
    assert run["first_warning"]["kind"] == "exploding_by_depth" and run["first_anomaly"] is None
    assert [x["kind"] for x in run["warnings"]] == ["exploding_by_depth"]  # no growth, no overflow


def test_saturated_tanh_fed_unnormalised_inputs(report):
    w = _warning(report["tanh_unnormalised"], "saturation")
    assert (w["tensor"], w["first_step"]) == ("th/output", 4)
    assert w["detail"].startswith("tanh output pinned at its bounds")


def test_update_ratio_when_the_learning_rate_is_far_too_high(report):
    run = report["lr_far_too_high"]
    w = _warning(run, "update_ratio")
    assert w["tensor"].startswith("update_ratio/") and w["first_step"] == 0
    assert run["first_warning"]["step"] < run["first_anomaly"]["step"]


def test_loss_not_decreasing_under_gradient_ascent(report):
    w = _warning(report["gradient_ascent"], "loss_not_decreasing")
    assert (w["tensor"], w["first_step"]) == ("loss", 49)  # the first 50 records


def test_loss_oscillating_when_the_learning_rate_refits_each_batch(report):
    run = report["two_sources_lr_too_high"]
    w = _warning(run, "loss_oscillating")
    # The first 50 records already swing: from step 49 to the run's last (64 steps).
    assert (w["tensor"], w["first_step"], w["last_step"], w["records"]) == ("loss", 49, 63, 15)
    assert w["detail"].startswith("the loss changed direction at most records of the last 50 (steps 0 to 49)")
    assert "learning rate" in w["hint"]
    # The only other warning: the first update, larger than the weights (the same lr).
    assert {x["kind"] for x in run["warnings"]} == {"loss_oscillating", "update_ratio"}
    assert run["first_anomaly"] is None


@pytest.mark.parametrize("name", [n for n, _ in healthy_keras.CASES])
def test_healthy_trainings_raise_no_warning_at_all(report, name):
    run = report[name]
    assert run["first_anomaly"] is None and run["first_warning"] is None, run["warnings"]
    assert run["warnings"] == []
