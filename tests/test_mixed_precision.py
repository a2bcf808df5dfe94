"""mixed_float16: loss scale and skipped steps recorded; skipped steps are warnings."""

import os
import re
import traceback

import keras
import numpy as np
import pytest
import tensorflow as tf

from op_records import line_of
from tb_numerics import analysis, event_reader
from tb_numerics.keras import NumericsCallback

pytestmark = pytest.mark.e2e


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


def test_skipped_step_and_loss_scale_drop_are_recorded_as_warnings(tmp_path, mixed_float16):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="tanh", name="d1"),
         keras.layers.Dense(4, dtype="float32", name="out")],
        name="net",
    )
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    rs = np.random.RandomState(0)
    x, y = rs.randn(64, 8).astype("float32"), rs.randn(64, 4).astype("float32")
    y[2 * 16:3 * 16] = 3e3  # batch 2: the scaled gradients overflow float16
    cb = NumericsCallback(str(tmp_path), stop_on_anomaly=True)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[cb])

    # The skipped step did not advance the optimizer (4 batches, 3 updates),
    # and a handled skip does not stop training.
    assert int(model.optimizer.iterations) == 3
    assert cb.anomaly is None
    (run,) = event_reader.read_logdir(str(tmp_path))
    ra = analysis.analyze_run(run.run, run.series)
    scale = ra.find("loss_scale").series
    assert scale.steps.tolist() == [0, 1, 2, 3]  # every batch has its own step
    assert scale.values[:, 5].tolist() == [2.0**15, 2.0**15, 2.0**15, 2.0**14]  # the drop
    # Forward finite, float16 activations with their headroom recorded.
    d1 = ra.find("d1/output")
    assert d1.series.info.dtype == "float16" and not d1.codes.any()
    summary = analysis.run_summary(ra)
    assert summary["skipped_steps"] == [2]
    assert summary["first_anomaly"] is None
    # A skip that later steps recover from is information, not the run's first
    # warning; the batch of 3e3 targets that caused it is (the targets, as
    # the batch arrived, jumped; so did the loss).
    (info,) = summary["info"]
    assert (info["step"], info["kind"], info["phase"]) == (2, "skipped_step", "backward")
    assert "LossScaleOptimizer skipped" in info["detail"]
    w = summary["first_warning"]
    assert (w["step"], w["tensor"], w["kind"], w["phase"]) == (2, "target", "fast_growth", "input")
    assert any((x["first_step"], x["tensor"], x["kind"]) == (2, "loss", "fast_growth") for x in summary["warnings"])


def test_gradients_of_float32_master_weights_are_held_to_float16s_range(tmp_path, mixed_float16):
    """Issue 18 item 5: the callback records each layer's compute dtype."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh", name="d1"),
                              keras.layers.Dense(4, dtype="float32", name="out")], name="net")
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
    rs = np.random.RandomState(0)
    model.fit(rs.randn(32, 8).astype("float32"), rs.randn(32, 4).astype("float32"), batch_size=16, verbose=0,
              callbacks=[NumericsCallback(str(tmp_path))])
    (run,) = event_reader.read_logdir(str(tmp_path))
    infos = {s.tag: s.info for s in run.series}
    kernel = infos["gradients/net/d1/kernel"]
    assert (kernel.dtype, kernel.compute_dtype) == ("float32", "float16")
    assert infos["gradients/net/out/kernel"].compute_dtype == ""  # computed in float32
    assert infos["d1/output"].dtype == "float16"


class _Norm(keras.layers.Layer):
    """A hand-written layer norm computed in float16: its Square overflows for values beyond
    256 while its output stays finite ((x - mean) / sqrt(inf) is 0)."""

    def call(self, x):
        mean = tf.reduce_mean(x, axis=-1, keepdims=True)
        var = tf.reduce_mean(tf.square(x - mean), axis=-1, keepdims=True)
        return (x - mean) / tf.sqrt(var + 1e-5)


def _norm_model(run_eagerly: bool = False, jit_compile: bool = False) -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, name="d1"), _Norm(name="norm"),
                              keras.layers.Dense(4, dtype="float32", name="out")], name="net")
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1e-2), initial_scale=256)
    model.compile(optimizer=opt, loss="mse", run_eagerly=run_eagerly, jit_compile=jit_compile)
    return model


def _norm_data() -> tuple[np.ndarray, np.ndarray]:
    """Six batches of 16; batch 3 arrives unscaled (x 3000, its targets x 3e4): its scaled
    float16 gradients overflow too, so the LossScaleOptimizer skips that step."""
    rs = np.random.RandomState(0)
    x, y = rs.randn(96, 8).astype("float32"), rs.randn(96, 4).astype("float32")
    x[48:64] *= 3000
    y[48:64] *= 3e4
    return x, y


def _check_numerics_truth(x: np.ndarray, y: np.ndarray) -> tuple[int, str, int]:
    """(step, op type, line of this file) where tf.debugging.enable_check_numerics stops the
    same training run eagerly (every op checked in program order)."""
    step = [-1]

    class Count(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            step[0] += 1

    tf.debugging.enable_check_numerics()
    try:
        _norm_model(run_eagerly=True).fit(x, y, batch_size=16, shuffle=False, verbose=0, callbacks=[Count()])
    except Exception as e:  # noqa: BLE001 - check_numerics' error is the truth
        op = re.search(r'op "(\w+)"', str(e)).group(1)
        lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == __file__]
        return step[0], op, lines[-1]
    finally:
        tf.debugging.disable_check_numerics()
    raise AssertionError("check_numerics found no NaN or Inf")


@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_skip_whose_forward_overflowed_inside_a_layer_is_the_anomaly(tmp_path, mixed_float16, jit_compile):
    """Issue 25: a float16 overflow inside a layer whose output stays finite, at a step the
    LossScaleOptimizer skips, is the run's first anomaly (not a handled skip), at the step and
    op check_numerics names, with the user's line; the skip that loss scaling handles (the
    first test) stays information."""
    x, y = _norm_data()
    model = _norm_model(jit_compile=jit_compile)
    model.fit(x, y, batch_size=16, shuffle=False, verbose=0, callbacks=[NumericsCallback(str(tmp_path))])
    assert int(model.optimizer.iterations) == 5  # the step was skipped, and training went on
    step, op_type, line = _check_numerics_truth(x, y)
    (run,) = event_reader.read_logdir(str(tmp_path))
    first = analysis.run_summary(analysis.analyze_run(run.run, run.series))["first_anomaly"]
    assert first is not None, "the skip read as handled: the overflow inside the norm was missed"
    assert first["step"] == step
    assert first["op"]["type"] == op_type
    assert first["op"]["phase"] == "forward"
    assert first["op"]["source"].split(" ")[0].endswith("%s:%d" % (os.path.basename(__file__), line))


def _sqrt_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, use_bias=False, name="d1"),
                              keras.layers.Lambda(lambda t: tf.sqrt(tf.abs(t)), name="root"),  # ROOT_AT_ZERO
                              keras.layers.Dense(1, dtype="float32", name="out")], name="net")
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1e-2), initial_scale=2.0**19)
    model.compile(optimizer=opt, loss="mse")
    return model


def test_a_skip_whose_gradients_are_non_finite_at_any_scale_is_the_anomaly(tmp_path, mixed_float16):
    """sqrt(|h|) meets h = 0 in batch SQRT_BAD: its gradient is inf at any loss scale, unscaled
    too (the oracle: the batch's gradients without a scale, and check_numerics over them), so
    the LossScaleOptimizer's skip there is the run's first anomaly, at that step and op, not a
    handled skip; the skips of its first steps (a scale too large for float16) stay handled."""
    sqrt_bad, batches = 7, 10  # applied steps after it: not a run of skips that nothing follows
    rs = np.random.RandomState(0)
    x, y = (rs.rand(8 * batches, 4) + 0.1).astype("float32"), rs.rand(8 * batches, 1).astype("float32")
    x[8 * sqrt_bad] = 0.0
    model = _sqrt_model()
    truth, ops, iterations = [], [], []

    class Oracle(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            xb, yb = x[8 * batch:8 * batch + 8], y[8 * batch:8 * batch + 8]
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((tf.cast(model(xb, training=True), tf.float32) - yb) ** 2)
            tf.debugging.enable_check_numerics()
            try:
                grads = tape.gradient(loss, model.trainable_variables)
            except tf.errors.InvalidArgumentError as e:
                truth.append(batch)
                ops.append(re.search(r'op "(\w+)"', str(e)).group(1))
            else:
                if not all(np.isfinite(np.asarray(g)).all() for g in grads):
                    truth.append(batch)
            finally:
                tf.debugging.disable_check_numerics()

        def on_train_batch_end(self, batch, logs=None):
            iterations.append(int(model.optimizer.iterations))

    model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[Oracle(), NumericsCallback(str(tmp_path))])
    skipped = [i for i in range(sqrt_bad) if iterations[i] == (iterations[i - 1] if i else 0)]
    assert truth == [sqrt_bad] and skipped and skipped[-1] < sqrt_bad - 1  # calibrated, then the sqrt at 0
    assert iterations[sqrt_bad] == iterations[sqrt_bad - 1]  # the LossScaleOptimizer skipped it too
    (run,) = event_reader.read_logdir(str(tmp_path))
    summary = analysis.run_summary(analysis.analyze_run(run.run, run.series))
    first = summary["first_anomaly"]
    assert first is not None, "the skip read as handled: a sqrt's infinite gradient was missed"
    assert first["step"] == sqrt_bad
    assert first["op"]["type"] == ops[0] == "SqrtGrad" and first["op"]["phase"] == "backward"
    assert first["op"]["source"].split(" ")[0].endswith("%s:%d" % (
        os.path.basename(__file__), line_of(__file__, "# ROOT_AT_ZERO")))
    assert first["replay"]["unscaled"] is True
    assert summary["skipped_steps"] == skipped


def _dense_model(run_eagerly: bool = False) -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu", name="d1"),
                              keras.layers.Dense(4, dtype="float32", name="out")], name="net")
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse", run_eagerly=run_eagerly)
    return model


def test_a_finite_value_beyond_float16s_range_is_named_as_the_cast_that_overflowed(tmp_path, mixed_float16):
    """One finite input value of 1e6 (the injected fault) under mixed_float16: Keras casts the
    batch to float16 in the first layer, where it is +Inf. The first anomaly is at the step and
    op check_numerics names, and the hint says what happened: a cast beyond float16's largest
    value from a finite batch, never that the batch already held a NaN (the Cast runs again in
    that step on a NaN, which a sum over its runs read as the first one's)."""
    bad, big = 3, 1e6
    rs = np.random.RandomState(0)
    x, y = rs.randn(96, 8).astype("float32"), rs.randn(96, 4).astype("float32")
    x[16 * bad + 2, 5] = big
    assert np.isfinite(x).all()
    step, ops = [-1], []

    class Count(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            step[0] = batch

    tf.debugging.enable_check_numerics()
    try:
        _dense_model(run_eagerly=True).fit(x, y, batch_size=16, shuffle=False, verbose=0, callbacks=[Count()])
    except tf.errors.InvalidArgumentError as e:
        ops.append(re.search(r'op "(\w+)"', str(e)).group(1))
    finally:
        tf.debugging.disable_check_numerics()
    assert (step[0], ops) == (bad, ["Cast"])  # the truth: the cast of the batch, at the bad batch

    model, cb = _dense_model(), NumericsCallback(str(tmp_path))
    model.fit(x, y, batch_size=16, shuffle=False, verbose=0, callbacks=[cb])  # FIT_LINE
    (run,) = event_reader.read_logdir(str(tmp_path))
    first = analysis.run_summary(analysis.analyze_run(run.run, run.series))["first_anomaly"]
    assert (first["step"], first["op"]["type"], first["op"]["phase"]) == (bad, ops[0], "forward")
    # Keras' own cast, through optree: the user's line is the one that started training.
    assert first["op"]["source"].split(" ")[0].endswith("%s:%d" % (
        os.path.basename(__file__), line_of(__file__, "# FIT_LINE"))), first["op"]["source"]
    hint = first["hint"]
    assert "already held NaN" not in hint
    assert hint.startswith("A cast (Cast) made +Inf from finite values at step %d" % bad), hint
    assert "max |x| 1e6" in hint and "65,504" in hint
