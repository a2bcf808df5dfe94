"""Custom loops that log every intermediate with ``log_numerics`` (issue 26), and the model's state.

Healthy loops whose tensors are mostly exact zeros by design raise nothing;
a ReLU that the fault kills is still called dead; a log(0) beside a one-hot
label product is not blamed on dead units; a gradient computed in float16
and recorded in float32 is held to float16's range. Truth comes from the
injected faults and from ``tf.summary`` scalars written beside the calls.
"""

import contextlib
import io
import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tb_numerics as tbn
from demo import healthy_loops
from tb_numerics import cli

pytestmark = pytest.mark.e2e

FAULT_STEPS = 25


def dead_relu_loop(logdir):
    """The fault: a bias of -20 behind a ReLU fed standard-normal inputs kills every unit."""
    rs = np.random.RandomState(20)
    x = rs.randn(128, 8).astype("float32")
    y = x.sum(1, keepdims=True)
    hidden = healthy_loops.built(
        keras.layers.Dense(16, activation="relu", bias_initializer=keras.initializers.Constant(-20.0)), (None, 8))
    head = healthy_loops.built(keras.layers.Dense(1), (None, 16))

    def forward(x, y):
        h = hidden(x)
        tbn.log_numerics("hidden/output", h)
        return tf.reduce_mean(tf.square(head(h) - y))

    healthy_loops.train_loop(logdir, "dead_relu_loop", forward, [hidden, head], (x, y), steps=FAULT_STEPS)


def softmax_log_loop(logdir):
    """The fault: -sum(y * log(softmax)) at a learning rate that saturates
    the softmax: log(0). The product with the one-hot labels is 3/4 exact zeros."""
    rs = np.random.RandomState(21)
    x = rs.randn(128, 16).astype("float32")
    y = np.eye(4, dtype="float32")[np.argmax(x @ rs.randn(16, 4), 1)]
    head = healthy_loops.built(keras.layers.Dense(4), (None, 16))

    def forward(x, y):
        probs = tf.nn.softmax(head(x))
        tbn.log_numerics("probs", probs)
        terms = y * tf.math.log(probs)
        tbn.log_numerics("label_log_probs", terms)
        tf.summary.scalar("oracle/log_finite", tf.cast(tf.reduce_all(tf.math.is_finite(terms)), tf.float32))
        return -tf.reduce_mean(tf.reduce_sum(terms, 1))

    # A learning rate warmed up to 150: the softmax saturates and log(0) comes at step 13.
    schedule = keras.optimizers.schedules.CosineDecay(0.5, 1000, warmup_target=150.0, warmup_steps=25)
    healthy_loops.train_loop(logdir, "softmax_log_loop", forward, [head], (x, y),
                             optimizer=keras.optimizers.SGD(schedule), steps=FAULT_STEPS)


def float16_gradient_loop(logdir, eager=False):
    """The fault: float16 compute without loss scaling, float32 variables, at
    a learning rate that grows the gradient 3 % a step from 3.4e4 (its float32
    cast is far from float32's limit) until the float16 MatMul overflows."""
    rs = np.random.RandomState(0)
    x = rs.randn(512, 8).astype("float16")
    evals, evecs = np.linalg.eigh(x.astype(np.float64).T @ x.astype(np.float64))
    w_true = rs.randn(8, 1)
    y = tf.constant((x.astype(np.float64) @ w_true).astype("float32"))
    # Start off the optimum along the top eigenvector, where the gradient is 3.4e4.
    w = tf.Variable((w_true[:, 0] + 3.4e4 / (evals[-1] * np.abs(evecs[:, -1]).max()) * evecs[:, -1])[:, None],
                    dtype=tf.float32)
    lr = 2.03 / evals[-1]  # 1.03x a step along that direction

    def step_fn():
        with tf.GradientTape() as tape:
            h = tf.matmul(x, tf.cast(w, tf.float16))
            tbn.log_numerics("h", h)
            loss = 0.5 * tf.reduce_sum(tf.square(tf.cast(h, tf.float32) - y))
            tbn.log_numerics("loss", loss)
        (g,) = tape.gradient(loss, [w])
        # Eagerly the graph's Cast is not there to read: the user names the dtype.
        tbn.log_gradients([g], [w], compute_dtype="float16" if eager else None)
        tf.summary.scalar("oracle/gradient_finite", tf.cast(tf.reduce_all(tf.math.is_finite(g)), tf.float32))
        w.assign_sub(lr * g)

    name = "float16_gradient_eager" if eager else "float16_gradient"
    writer = tf.summary.create_file_writer(os.path.join(logdir, name))
    step = tf.Variable(0, dtype=tf.int64)
    fn = step_fn if eager else tf.function(step_fn)
    with writer.as_default(step=step):
        for _ in range(FAULT_STEPS + 5):
            fn()
            step.assign_add(1)
    writer.close()


def vae_loop(logdir, scale):
    """A small VAE with a binary cross-entropy on sparse pixels of 0..255;
    the fault: the ``/255`` dropped (``scale=1``)."""
    keras.utils.set_random_seed(0)
    rs = np.random.RandomState(0)
    x = (rs.rand(128, 64) < 0.3) * rs.randint(1, 256, size=(128, 64)).astype("float32") / scale
    built = healthy_loops.built
    enc = built(keras.layers.Dense(32, activation="relu", kernel_initializer=keras.initializers.RandomNormal(stddev=1e-3)),
                (None, 64))
    mean_l, log_var_l = built(keras.layers.Dense(4), (None, 32)), built(keras.layers.Dense(4), (None, 32))
    dec, out = built(keras.layers.Dense(32, activation="relu"), (None, 4)), built(keras.layers.Dense(64), (None, 32))

    def forward(x, _):
        h = enc(x)
        tbn.log_numerics("encoder/output", h)
        mean, log_var = mean_l(h), log_var_l(h)
        tbn.log_numerics("z_mean", mean)
        tbn.log_numerics("z_log_var", log_var)
        std = tf.exp(0.5 * log_var)
        tbn.log_numerics("z_std", std)
        logits = out(dec(mean + std * tf.random.normal(tf.shape(mean))))
        tbn.log_numerics("decoder/logits", logits)
        bce = tf.reduce_mean(tf.reduce_sum(tf.nn.sigmoid_cross_entropy_with_logits(x, logits), 1))
        tbn.log_numerics("bce_loss", bce)
        tf.summary.scalar("oracle/bce", bce)
        return bce - 0.5 * tf.reduce_mean(tf.reduce_sum(1 + log_var - mean ** 2 - tf.exp(log_var), 1))

    healthy_loops.train_loop(logdir, "vae_scale_%d" % scale, forward, [enc, mean_l, log_var_l, dec, out], (x, x),
                             optimizer=keras.optimizers.Adam(3e-2), steps=8)


MOVING_VARIANCE_BAD_STEP = 5


def moving_variance_loop(logdir):
    """A BatchNormalization model; the fault: the batch of step 5 scaled by
    3e19, finite, whose variance is +Inf. The output, the loss and the
    gradients stay finite (training normalises by the batch's own variance);
    the moving variance does not. The loop logs the model's non-trainable
    float variables after the forward pass, as the README says."""
    keras.utils.set_random_seed(0)
    rs = np.random.RandomState(0)
    x, y = rs.randn(10, 32, 8).astype("float32"), rs.randn(10, 32, 1).astype("float32")
    x[MOVING_VARIANCE_BAD_STEP] *= 3e19
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, name="dense"),
                              keras.layers.BatchNormalization(name="bn"), keras.layers.Dropout(0.1),
                              keras.layers.Dense(1, name="head")], name="normed")
    optimizer = keras.optimizers.SGD(0.01)
    step = tf.Variable(0, dtype=tf.int64, trainable=False)

    @tf.function
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            out = model(xb, training=True)
            loss = tf.reduce_mean(tf.square(out - yb))
        tbn.log_numerics("output", out)
        tbn.log_numerics("loss", loss)
        for v in model.non_trainable_variables:
            if "float" in v.dtype:
                tbn.log_numerics(v.path, v, role="weight")
        mv = model.get_layer("bn").moving_variance
        tf.summary.scalar("oracle/moving_variance_finite", tf.cast(tf.reduce_all(tf.math.is_finite(mv)), tf.float32))
        tf.summary.scalar("oracle/loss_finite", tf.cast(tf.math.is_finite(loss), tf.float32))
        grads = tape.gradient(loss, model.trainable_variables)
        tbn.log_gradients(grads, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)

    with tf.summary.create_file_writer(os.path.join(logdir, "moving_variance")).as_default(step=step):
        for i in range(len(x)):
            train_step(x[i], y[i])
            step.assign_add(1)


def _first_step_where(logdir, run, tag, holds):
    """The first step at which the oracle scalar ``tag`` satisfied ``holds``, from the event files (None: never)."""
    steps = []
    for name in os.listdir(os.path.join(logdir, run)):
        for event in tf.compat.v1.train.summary_iterator(os.path.join(logdir, run, name)):
            for v in event.summary.value:
                if v.tag == tag and holds(float(tf.make_ndarray(v.tensor))):
                    steps.append(event.step)
    return min(steps, default=None)


def _first_false_step(logdir, run, tag):
    """The first step at which the oracle scalar ``tag`` was 0."""
    return _first_step_where(logdir, run, tag, lambda v: v == 0.0)


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    logdir = str(tmp_path_factory.mktemp("loops"))
    for _, train in healthy_loops.CASES:
        train(logdir)
    dead_relu_loop(logdir)
    softmax_log_loop(logdir)
    float16_gradient_loop(logdir)
    float16_gradient_loop(logdir, eager=True)
    vae_loop(logdir, scale=1)
    vae_loop(logdir, scale=255)
    moving_variance_loop(logdir)
    return logdir


@pytest.fixture(scope="module")
def report(logdir):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli.main(["report", "--json", logdir])
    return {r["run"]: r for r in json.loads(out.getvalue())["runs"]}


@pytest.mark.parametrize("name", [n for n, _ in healthy_loops.CASES])
def test_custom_loops_with_zeros_by_design_raise_nothing(report, name):
    run = report[name]
    assert run["first_anomaly"] is None and run["warnings"] == [], run["warnings"]


def test_a_relu_the_fault_killed_is_still_dead_in_a_custom_loop(report):
    (w,) = report["dead_relu_loop"]["warnings"]
    assert (w["kind"], w["tensor"], w["first_step"]) == ("dead_units", "hidden/output", 4)


def test_log_of_zero_beside_a_one_hot_product_is_not_blamed_on_dead_units(logdir, report):
    a = report["softmax_log_loop"]["first_anomaly"]
    assert a["step"] == _first_false_step(logdir, "softmax_log_loop", "oracle/log_finite")
    assert a["tensor"] == "label_log_probs" and "log(0)" in a["hint"]
    kinds = {w["kind"] for w in report["softmax_log_loop"]["warnings"]}
    assert "dead_units" not in kinds
    assert a["likely_cause"] is None or a["likely_cause"]["kind"] != "dead_units"


@pytest.mark.parametrize("run", ["float16_gradient", "float16_gradient_eager"])
def test_a_float16_gradient_cast_to_float32_warns_ten_steps_before_it_overflows(logdir, report, run):
    bad = _first_false_step(logdir, run, "oracle/gradient_finite")
    a, w = report[run]["first_anomaly"], report[run]["first_warning"]
    assert (a["step"], a["tensor"]) == (bad, "gradients/Variable")
    assert w["tensor"] == "gradients/Variable" and w["step"] <= bad - 10
    assert "float16" in w["detail"] and "computed in float16" in w["detail"]


def test_raw_pixels_under_a_cross_entropy_are_named_not_the_learning_rate(logdir, report):
    """Issue 26 item 3: the VAE's targets leave [0, 1]; the hint says so with
    the numbers, and says the learning rate is not the cause."""
    a = report["vae_scale_1"]["first_anomaly"]
    assert a is not None
    negative = _first_step_where(logdir, "vae_scale_1", "oracle/bce", lambda v: v < 0)
    assert negative < a["step"]
    assert a["hint"].startswith("The loss bce_loss was negative at step %d" % negative)
    assert "targets are outside that domain" in a["hint"] and "the learning rate is not the cause" in a["hint"]
    # With the /255 the loss stays in its domain and the same training is healthy.
    assert report["vae_scale_255"]["first_anomaly"] is None


def test_compute_dtype_must_be_a_float_dtype():
    with pytest.raises(ValueError, match="compute_dtype must be one of"):
        tbn.log_gradients([tf.ones(2)], [tf.Variable(tf.ones(2))], compute_dtype="int8")


def test_a_loop_that_logs_the_models_state_finds_a_moving_variance_gone_inf_at_its_step(logdir, report):
    """The README's advice for a custom loop with BatchNormalization; the
    truth is tf.summary's: the first step whose moving variance was not finite."""
    oracle = _first_false_step(logdir, "moving_variance", "oracle/moving_variance_finite")
    assert oracle == MOVING_VARIANCE_BAD_STEP
    assert _first_step_where(logdir, "moving_variance", "oracle/loss_finite", lambda v: v == 0.0) is None
    first = report["moving_variance"]["first_anomaly"]
    assert (first["step"], first["tensor"], first["role"]) == (oracle, "normed/bn/moving_variance", "weight")
