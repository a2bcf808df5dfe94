"""The step guard (issue 25, items 2 and 4) and the update check of the
callback, through real training and ``tb-numerics report --json``.

* A hand-written loop in the README's quick-start pattern, with a loss
  ``-sum(y * log(p))`` whose ``p`` meets an exact 0 at one injected batch:
  ``tbn.guard(optimizer)`` makes ``first_anomaly.op`` the ``Log`` at this
  file's line, eagerly and in a ``tf.function`` step. Truth: the injected
  batch's step as a ``tf.summary.scalar`` beside it writes it, the op and
  line as ``tf.debugging.enable_check_numerics`` names them, and, eagerly,
  the state (weights, BatchNorm's moving statistics, the dropout seed) that
  the bad step's own run left, which the replay must not change.
* Adam with one loss scaled by 1e25 (a finite gradient whose square is
  not): the anomaly is that step, phase ``update``, naming a velocity
  slot, in a custom loop and in ``model.fit`` with the callback, with the
  square-overflow warning on the gradients; the step's truth is the
  ``tf.summary.scalar`` of the scale beside it.
"""

from __future__ import annotations

import contextlib
import io
import json
import pathlib
import re
import traceback

import keras
import numpy as np
import pytest
import tensorflow as tf

import tb_numerics as tbn
import two_replicas
from op_records import line_of
from tb_numerics import cli, event_reader
from tb_numerics.keras import NumericsCallback

pytestmark = pytest.mark.e2e

BAD = 2  # the injected batch
STEPS = BAD + 1  # the bad step is found and written at once


def _report(logdir) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli.main(["report", "--json", str(logdir)])
    (run,) = json.loads(out.getvalue())["runs"]
    return run


def _oracle_steps(logdir, tag: str, above: float) -> list[int]:
    """The steps at which ``tf.summary.scalar(tag)`` wrote a value above ``above``."""
    steps = []
    for path in sorted(pathlib.Path(logdir).glob("events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for v in event.summary.value:
                # Inside a loop of a tf.function, the loop's name scope comes before the tag.
                if (v.tag == tag or v.tag.endswith("/" + tag)) and float(tf.make_ndarray(v.tensor)) > above:
                    steps.append(int(event.step))
    return steps


def _classifier(stateful: bool):
    """Dense and a softmax head; ``stateful``: with dropout, and a BatchNorm
    beside them whose moving statistics a replay must not move (it does not
    normalise the injected scale away)."""
    keras.utils.set_random_seed(1)
    inp = keras.Input((4,))
    h = keras.layers.Dense(8)(inp)
    if stateful:
        h = keras.layers.Dropout(0.2)(h)
        h = keras.layers.Concatenate()([h, keras.layers.BatchNormalization()(h)])
    return keras.Model(inp, keras.layers.Dense(3, activation="softmax")(h))


def _quick_start(logdir, compiled: bool):
    """The README's quick start, its step a function under the guard; batch
    BAD scaled by 1e4, so that the softmax meets exact zeros."""
    model = _classifier(stateful=not compiled)  # the state is checked eagerly
    optimizer = keras.optimizers.Adam(1e-3)
    writer = tf.summary.create_file_writer(str(logdir))
    body_ends = []  # eagerly: the state at the end of each run of the step's body

    def step_fn(x, y):
        with tf.GradientTape() as tape:
            p = model(x, training=True)
            tbn.log_numerics("probs", p)
            tf.summary.scalar("oracle/input_max", tf.reduce_max(tf.abs(x)))
            loss = -tf.reduce_sum(y * tf.math.log(p))  # QUICK_START_LOG
            tbn.log_numerics("loss", loss)
        grads = tape.gradient(loss, model.trainable_variables)
        tbn.log_gradients(grads, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        if tf.executing_eagerly():
            body_ends.append([v.numpy().copy() for v in model.variables])
        return loss

    train_step = tbn.guard(optimizer)(tf.function(step_fn) if compiled else step_fn)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS, 16, 4)).astype(np.float32)
    x[BAD] *= 1e4
    y = np.eye(3, dtype=np.float32)[rng.integers(0, 3, size=(STEPS, 16))]
    # Eagerly the README's own loop; a traced step needs a variable step (TRAPS).
    step = tf.Variable(0, dtype=tf.int64) if compiled else 0
    after, verdicts, iterations = [], [], []
    with writer.as_default(step=step):
        for i in range(STEPS):
            step.assign(i) if compiled else tf.summary.experimental.set_step(i)
            train_step(tf.constant(x[i]), tf.constant(y[i]))
            after.append([v.numpy().copy() for v in model.variables])
            verdicts.append(train_step.verdict)
            iterations.append(int(optimizer.iterations.numpy()))
    writer.close()
    return dict(logdir=logdir, compiled=compiled, step_fn=step_fn, batch=(tf.constant(x[BAD]), tf.constant(y[BAD])), after=after,
                body_ends=body_ends, verdicts=verdicts, iterations=iterations)


def _check_numerics_names(step_fn, batch) -> tuple[str, list[int]]:
    """(op type, [line of this file]) of the first non-finite op, as TensorFlow's own check names them."""
    tf.debugging.enable_check_numerics()
    try:
        step_fn(*batch)
    except tf.errors.InvalidArgumentError as e:
        message = str(e)
        # Eagerly the check raises from the op's call: the traceback's frames in this file.
        frames = [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == __file__]
    else:
        raise AssertionError("check_numerics found no NaN or Inf")
    finally:
        tf.debugging.disable_check_numerics()
    op_type = re.search(r'op "(\w+)"', message).group(1)
    return op_type, frames[-1:]


@pytest.fixture(scope="module", params=["eager", "function"])
def quick_start(request, tmp_path_factory):
    logdir = tmp_path_factory.mktemp("quick_start_" + request.param)
    return _quick_start(logdir, compiled=request.param == "function")


def test_quick_start_names_the_log_and_this_line(quick_start):
    run = _report(quick_start["logdir"])
    a = run["first_anomaly"]
    assert a["step"] == BAD and _oracle_steps(quick_start["logdir"], "oracle/input_max", 1e3) == [BAD]
    # The op and line TensorFlow's own check names, on the same batch (state no longer matters).
    op_type, lines = _check_numerics_names(quick_start["step_fn"], quick_start["batch"])
    line = line_of(__file__, "# QUICK_START_LOG")
    assert op_type == "Log" and line in lines
    assert a["op"]["type"] == op_type and a["op"]["phase"] == "forward"
    assert a["op"]["source"].endswith("test_step_guard.py:%d (step_fn)" % line), a["op"]
    assert a["replay"]["reproduced"] is True
    # Quiet before it: every update applied, nothing escalated, no warning.
    assert quick_start["verdicts"][:BAD] == [None] * BAD and quick_start["verdicts"][BAD]["step"] == BAD
    assert quick_start["iterations"][:BAD + 1] == list(range(1, BAD + 1)) + [BAD]  # BAD's update held back
    assert run["first_warning"] is None or run["first_warning"]["step"] >= BAD


def test_the_replay_leaves_state_as_the_step_left_it(quick_start):
    """Eagerly, the state after the guarded bad step (weights, BatchNorm's
    moving statistics, the dropout seed) is the state its own run left; the
    replay's run, which moved them again, is undone."""
    if quick_start["compiled"]:
        pytest.skip("a traced step's body runs in Python only when traced")
    real, replayed = quick_start["body_ends"][BAD], quick_start["body_ends"][BAD + 1]
    for a, b in zip(quick_start["after"][BAD], real):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(real, replayed))


def _adam_regression():
    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
    rng = np.random.default_rng(0)
    return model, rng.normal(size=(16, 4)).astype(np.float32), rng.normal(size=(16, 1)).astype(np.float32)


def _adam_loop(logdir, compiled: bool) -> None:
    """A custom loop whose loss is scaled by 1e25 at step BAD."""
    model, x, y = _adam_regression()
    optimizer = keras.optimizers.Adam(1e-3)

    def step_fn(x, y, scale):
        tf.summary.scalar("oracle/scale", scale)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y)) * scale
            tbn.log_numerics("loss", loss)
        grads = tape.gradient(loss, model.trainable_variables)
        tbn.log_gradients(grads, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    train_step = tbn.guard(optimizer)(tf.function(step_fn) if compiled else step_fn)
    writer = tf.summary.create_file_writer(str(logdir))
    step = tf.Variable(0, dtype=tf.int64)
    with writer.as_default(step=step):
        for i in range(STEPS):
            step.assign(i)
            train_step(x, y, tf.constant(1e25 if i == BAD else 1.0))
    writer.close()


class _ScaleProbe(keras.callbacks.Callback):
    """Writes each batch's largest sample weight at the step fit trains it at."""

    def __init__(self, logdir, weights, batch_size):
        super().__init__()
        self._writer = tf.summary.create_file_writer(str(logdir), filename_suffix=".oracle")
        self._weights, self._batch = weights, batch_size

    def on_train_batch_begin(self, batch, logs=None):
        w = self._weights[batch * self._batch : (batch + 1) * self._batch]
        with self._writer.as_default():
            tf.summary.scalar("oracle/scale", float(w.max()), step=int(self.model.optimizer.iterations.numpy()))

    def on_train_end(self, logs=None):
        self._writer.close()


def _adam_fit(logdir) -> None:
    """model.fit with the callback; batch BAD's sample weights 1e25."""
    model, x, y = _adam_regression()
    model.compile(keras.optimizers.Adam(1e-3), "mse")
    weights = np.ones(16 * STEPS, np.float32)
    weights[16 * BAD : 16 * (BAD + 1)] = 1e25
    model.fit(np.tile(x, (STEPS, 1)), np.tile(y, (STEPS, 1)), sample_weight=weights, batch_size=16,
              shuffle=False, verbose=0, callbacks=[_ScaleProbe(logdir, weights, 16), NumericsCallback(str(logdir))])


# (The traced gate is the quick start's "function" case; its overflow branch is the eager one's code.)
@pytest.mark.parametrize("where", ["eager_loop", "fit"])
def test_an_overflowing_square_is_the_anomaly_of_its_update(where, tmp_path):
    if where == "fit":
        _adam_fit(tmp_path)
    else:
        _adam_loop(tmp_path, compiled=where == "function_loop")
    logdir = tmp_path
    (truth,) = _oracle_steps(logdir, "oracle/scale", 1e20)
    run = _report(logdir)
    a = run["first_anomaly"]
    assert (a["step"], a["phase"], a["role"]) == (truth, "update", "update"), a
    assert re.fullmatch(r"update/adam\w*/\w+_velocity", a["tensor"]) and a["posinf"] + a["nan"] > 0
    # The warning before it: the gradients' squares overflow float32, at that step.
    squares = [w for w in run["warnings"] if w["kind"] == "square_overflow"]
    assert squares and all(w["tensor"].startswith("gradients/") and w["first_step"] == truth for w in squares)
    assert "Adam" in squares[0]["detail"]
    # The hint: the optimizer's running mean of the squares, not growth (one batch scaled by 1e25).
    assert "Adam keeps a running mean of each gradient's square" in a["hint"], a["hint"]
    assert "square beyond float32's largest value" in a["hint"]


def _zero_feature_adam(logdir, where: str, epsilon: float) -> list[int]:
    """An MLP whose first input feature is 0 in every batch (its kernel row
    never gets a gradient) trained by Adam with ``epsilon``, in ``fit`` with
    the callback or in a guarded loop. Returns the steps after whose update
    the model's weights held a NaN, read off the model between steps (the
    oracle: Keras alone, no record of tb-numerics)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    opt = keras.optimizers.Adam(1e-3, epsilon=epsilon)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(STEPS * 8, 4)).astype(np.float32), rng.normal(size=(STEPS * 8, 1)).astype(np.float32)
    x[:, 0] = 0.0
    bad = []

    def after(step):
        if not all(np.isfinite(np.asarray(w)).all() for w in model.weights):
            bad.append(step)

    if where == "fit":
        model.compile(opt, "mse")
        probe = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: after(b))
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[NumericsCallback(str(logdir)), probe])
        return bad

    @tbn.guard(opt)
    @tf.function
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb) - yb))
            tbn.log_numerics("loss", loss)
        grads = tape.gradient(loss, model.trainable_variables)
        tbn.log_gradients(grads, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    for i in _steps(logdir, STEPS):
        train_step(tf.constant(x[8 * i:8 * i + 8]), tf.constant(y[8 * i:8 * i + 8]))
        after(i)
    return bad


@pytest.mark.parametrize("where", ["fit", "loop"])
def test_an_adam_without_epsilon_that_divides_zero_by_zero_is_explained_as_the_optimizers(where, tmp_path):
    """Adam(epsilon=0) and a weight that has had no gradient: its update is
    0/0, a NaN born in the optimizer from finite gradients. The anomaly is
    the first step after whose update Keras' own weights held a NaN, in
    phase update, and the hint names the optimizer's 0/0 and its epsilon;
    with Keras' default epsilon the same training stays finite and healthy
    (the injected epsilon is the cause)."""
    truth = _zero_feature_adam(tmp_path / "eps0", where, 0.0)[0]
    a = _report(tmp_path / "eps0")["first_anomaly"]
    assert (a["step"], a["phase"]) == (truth, "update"), a
    assert "Adam divides" in a["hint"] and "0/0 unless epsilon is positive" in a["hint"], a["hint"]
    assert "at step %d, 8 of the " % truth in a["hint"]  # the zero feature's kernel row: 8 units
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli.main(["report", str(tmp_path / "eps0")])
    assert "did not reproduce" not in out.getvalue()  # no replay runs the update: nothing failed to reproduce
    assert _zero_feature_adam(tmp_path / "eps_default", where, 1e-7) == []
    assert _report(tmp_path / "eps_default")["first_anomaly"] is None


class TwoOptimizers(keras.Model):
    """A custom train_step that updates its head with an optimizer of its own
    (as a GAN's discriminator): the callback holds back only the model's."""

    def __init__(self):
        super().__init__()
        self.body, self.head = keras.layers.Dense(4), keras.layers.Dense(1)
        self.head_optimizer = keras.optimizers.SGD(0.01)

    def call(self, x):
        return self.head(self.body(x))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape(persistent=True) as tape:
            loss = tf.reduce_mean(tf.square(self(x, training=True) - y))
        head, body = self.head.trainable_variables, self.body.trainable_variables
        self.head_optimizer.apply(tape.gradient(loss, head), head)
        self.optimizer.apply(tape.gradient(loss, body), body)
        return {"loss": loss}


class _NanProbe(keras.callbacks.Callback):
    """Writes 1 at the step fit trains the batch holding the NaN, else 0."""

    def __init__(self, logdir, bad_batch):
        super().__init__()
        self._writer = tf.summary.create_file_writer(str(logdir), filename_suffix=".oracle")
        self._bad = bad_batch

    def on_train_batch_begin(self, batch, logs=None):
        with self._writer.as_default():
            tf.summary.scalar("oracle/nan_batch", float(batch == self._bad),
                              step=int(self.model.optimizer.iterations.numpy()))

    def on_train_end(self, logs=None):
        self._writer.close()


def test_an_update_the_callback_does_not_hold_back_is_not_blamed_on_the_step_before(tmp_path):
    """A NaN batch makes the head's own optimizer write NaN weights within the
    bad step: that is the step's anomaly, not "the previous update made them"."""
    keras.utils.set_random_seed(3)
    model = TwoOptimizers()
    model(np.zeros((1, 4), np.float32))
    model.head_optimizer.build(model.head.trainable_variables)
    model.compile(keras.optimizers.SGD(0.01), "mse")
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(16 * STEPS, 4)).astype(np.float32), rng.normal(size=(16 * STEPS, 1)).astype(np.float32)
    x[16 * BAD + 3, 1] = np.nan
    model.fit(x, y, batch_size=16, shuffle=False, verbose=0,
              callbacks=[_NanProbe(tmp_path, BAD), NumericsCallback(str(tmp_path))])
    (truth,) = _oracle_steps(tmp_path, "oracle/nan_batch", 0.5)
    a = _report(tmp_path)["first_anomaly"]
    assert a["step"] == truth and a["phase"] != "update" and not a["tensor"].startswith("update/"), a


def _scaled_quick_start(logdir, log_gradients: bool = False, steps: int = STEPS, bad: int = BAD,
                        initial_scale: float = 2.0**24):
    """The quick start under mixed_float16 with a LossScaleOptimizer whose first scale is too
    large (step 0's scaled gradients overflow float16: a skip the scale handles); batch BAD
    ``bad`` scaled by 1e4, so that the float16 softmax meets exact zeros (a skip no scale handles).
    ``log_gradients``: the step logs its (scaled) gradients too, the skipped steps' non-finite ones."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = _classifier(stateful=False)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-3), initial_scale=initial_scale)
    writer = tf.summary.create_file_writer(str(logdir))

    def step_fn(x, y):
        with tf.GradientTape() as tape:
            p = model(x, training=True)
            tbn.log_numerics("probs", p)
            tf.summary.scalar("oracle/input_max", tf.reduce_max(tf.abs(x)))
            loss = -tf.reduce_sum(y * tf.math.log(tf.cast(p, tf.float32)))  # SCALED_LOG
            scaled = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        if log_gradients:
            tbn.log_gradients(grads, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    train_step = tbn.guard(optimizer)(tf.function(step_fn))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps, 16, 4)).astype(np.float32)
    x[bad] *= 1e4
    y = np.eye(3, dtype=np.float32)[rng.integers(0, 3, size=(steps, 16))]
    step = tf.Variable(0, dtype=tf.int64)
    verdicts, iterations = [], []
    with writer.as_default(step=step):
        for i in range(steps):
            step.assign(i)
            train_step(tf.constant(x[i]), tf.constant(y[i]))
            verdicts.append(train_step.verdict)
            iterations.append(int(optimizer.iterations.numpy()))
    writer.close()
    return step_fn, (tf.constant(x[bad]), tf.constant(y[bad])), verdicts, iterations


def test_under_a_loss_scale_the_guard_replays_a_skip_whose_forward_went_bad(tmp_path):
    """A LossScaleOptimizer skips both a step whose scaled gradients overflow float16 (step 0:
    the scale's to handle, nothing replayed) and one whose forward pass made the non-finite
    value (BAD: its log(0)); the guard replays the second, so the report names the Log and
    this file's line, as check_numerics does."""
    step_fn, batch, verdicts, iterations = _scaled_quick_start(tmp_path)
    assert iterations[0] == 0 and iterations[BAD] == iterations[BAD - 1]  # both skipped
    assert verdicts[:BAD] == [None] * BAD and verdicts[BAD]["step"] == BAD
    assert _oracle_steps(tmp_path, "oracle/input_max", 1e3) == [BAD]
    op_type, lines = _check_numerics_names(step_fn, batch)
    a = _report(tmp_path)["first_anomaly"]
    assert a["step"] == BAD
    assert a["op"]["type"] == op_type and a["op"]["phase"] == "forward"
    assert a["op"]["source"].endswith("test_step_guard.py:%d (step_fn)" % line_of(__file__, "# SCALED_LOG"))
    assert line_of(__file__, "# SCALED_LOG") in lines


def test_under_a_loss_scale_skips_the_scale_handled_are_no_anomaly_where_gradients_are_logged(tmp_path):
    """The same loop logging its scaled gradients, with applied steps between the scale's
    first skips and the bad batch: the skipped steps' non-finite gradients are the skips
    the scale handled (the guard records the loss scale, as the callback does), and the
    first anomaly is still the bad batch's forward Log."""
    bad = 6
    _, _, verdicts, iterations = _scaled_quick_start(tmp_path, log_gradients=True, steps=bad + 1, bad=bad,
                                                     initial_scale=2.0**15)
    skipped = [i for i in range(bad) if iterations[i] == (iterations[i - 1] if i else 0)]
    assert skipped and skipped[-1] < bad - 1 and iterations[bad] == iterations[bad - 1]  # recovered, then BAD
    run = _report(tmp_path)
    a = run["first_anomaly"]
    assert a["step"] == bad and a["op"]["type"] == "Log" and a["op"]["phase"] == "forward"
    assert run["skipped_steps"] == skipped


def _unscaled_grads_finite(d1, d2, x, y) -> bool:
    """Whether the step's gradients are finite without any loss scale (the oracle)."""
    variables = d1.trainable_variables + d2.trainable_variables
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((d2(tf.cast(tf.sqrt(tf.abs(d1(x))), tf.float32)) - y) ** 2)
    return all(np.isfinite(np.asarray(g)).all() for g in tape.gradient(loss, variables))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "function"])
def test_under_a_loss_scale_a_gradient_non_finite_at_any_scale_is_the_anomaly(tmp_path, compiled):
    """sqrt(|h|) meets h = 0 at step SQRT_BAD: its gradient is inf at any loss scale (unscaled
    too, by the oracle), so the LossScaleOptimizer's skip there handles nothing; the scale's
    own first skips (a scale too large for float16) stay handled skips."""
    sqrt_bad, steps = 7, 10  # applied steps after it: not a run of skips that nothing follows
    keras.utils.set_random_seed(0)
    d1, d2 = keras.layers.Dense(3, use_bias=False, dtype="mixed_float16"), keras.layers.Dense(1)
    d1(tf.zeros([1, 4]))
    d2(tf.zeros([1, 3]))
    variables = d1.trainable_variables + d2.trainable_variables
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=2.0**19)
    optimizer.build(variables)

    def step_fn(x, y):
        with tf.GradientTape() as tape:
            h = tf.sqrt(tf.abs(d1(x)))  # SQRT_AT_ZERO
            tbn.log_numerics("sqrt/output", h)
            loss = tf.reduce_mean((d2(tf.cast(h, tf.float32)) - y) ** 2)
            scaled = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, variables)
        tbn.log_gradients(grads, variables)
        optimizer.apply_gradients(zip(grads, variables))

    train_step = tbn.guard(optimizer)(tf.function(step_fn) if compiled else step_fn)
    rng = np.random.default_rng(0)
    x = (rng.random((steps, 8, 4)) + 0.1).astype(np.float32)
    x[sqrt_bad, 0] = 0.0
    y = rng.random((steps, 8, 1)).astype(np.float32)
    writer, step, truth, iterations = tf.summary.create_file_writer(str(tmp_path)), tf.Variable(0, dtype=tf.int64), [], []
    with writer.as_default(step=step):
        for i in range(steps):
            step.assign(i)
            if not _unscaled_grads_finite(d1, d2, x[i], y[i]):
                truth.append(i)
            train_step(tf.constant(x[i]), tf.constant(y[i]))
            iterations.append(int(optimizer.iterations.numpy()))
    writer.close()
    skipped = [i for i in range(sqrt_bad) if iterations[i] == (iterations[i - 1] if i else 0)]
    assert truth == [sqrt_bad] and skipped and skipped[-1] < sqrt_bad - 1  # calibrated, then the sqrt at 0
    assert iterations[sqrt_bad] == iterations[sqrt_bad - 1]
    op_type, lines = _check_numerics_names(step_fn, (tf.constant(x[sqrt_bad]), tf.constant(y[sqrt_bad])))
    run = _report(tmp_path)
    a = run["first_anomaly"]
    assert a is not None and a["step"] == sqrt_bad, (iterations, run)
    assert a["op"]["type"] == op_type == "SqrtGrad" and a["op"]["phase"] == "backward"
    assert a["op"]["source"].endswith("test_step_guard.py:%d (step_fn)" % line_of(__file__, "# SQRT_AT_ZERO"))
    assert a["replay"]["unscaled"] is True
    assert run["skipped_steps"] == skipped


PER_CALL = 4  # training steps a call of the multi-step function runs


def test_a_function_that_runs_several_steps_a_call_has_its_op_at_the_step_that_failed(tmp_path):
    """A ``tf.function`` runs PER_CALL training steps a call in a ``tf.range`` loop, its step a
    variable it advances; a NaN arrives at the third step of the second call. The replay's op
    is filed at that step, where the step's own records are (the step ``tf.summary.scalar``
    writes beside them), not at the step the call began with; the op is the one
    check_numerics names."""
    keras.utils.set_random_seed(0)
    dense = keras.layers.Dense(1)
    dense.build((None, 8))
    optimizer = keras.optimizers.SGD(0.01)
    optimizer.build(dense.trainable_variables)
    x = np.random.default_rng(0).normal(size=(2 * PER_CALL, 4, 8)).astype(np.float32)
    bad = PER_CALL + 2
    x[bad, 1] = np.nan
    step = tf.Variable(0, dtype=tf.int64)

    def one_step(xs):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(dense(xs)))  # MULTI_STEP_DENSE
            tbn.log_numerics("loss", loss)
            tf.summary.scalar("oracle/loss_not_finite", tf.cast(tf.logical_not(tf.math.is_finite(loss)), tf.float32))
        grads = tape.gradient(loss, dense.trainable_variables)
        tbn.log_gradients(grads, dense.trainable_variables)
        optimizer.apply_gradients(zip(grads, dense.trainable_variables))

    @tbn.guard(optimizer)
    @tf.function
    def run_steps(xs):
        for i in tf.range(PER_CALL):
            one_step(xs[i])
            step.assign_add(1)

    with tf.summary.create_file_writer(str(tmp_path)).as_default(step=step):
        for call in range(2):
            run_steps(tf.constant(x[call * PER_CALL : (call + 1) * PER_CALL]))
    assert _oracle_steps(tmp_path, "oracle/loss_not_finite", 0.5)[0] == bad
    assert run_steps.verdict["step"] == bad
    op_type, _ = _check_numerics_names(tf.function(one_step), (tf.constant(x[bad]),))
    a = _report(tmp_path)["first_anomaly"]
    assert a["step"] == bad and a["tensor"] == "loss"
    assert a["op"]["type"] == op_type and a["op"]["phase"] == "forward"
    assert a["op"]["source"].endswith("test_step_guard.py:%d (one_step)" % line_of(__file__, "# MULTI_STEP_DENSE"))


def _masked_attention_step(mask_logged: bool):
    """A step of hand-written attention whose mask adds -Inf to the padding
    key at every step; at step 2 one query row is masked whole, so its
    softmax is NaN. ``mask_logged``: the scores are logged with
    ``allow_neginf=True`` (the -Inf is intended)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 3, 4)).astype(np.float32)
    mask = np.zeros((4, 3, 3), np.float32)
    mask[:, :, -1] = -np.inf
    mask[2, 1, :] = -np.inf
    w = tf.Variable(rng.normal(size=(4, 4)).astype(np.float32))

    def forward(xs, m, log=True):
        h = xs @ w
        scores = tf.matmul(h, h, transpose_b=True) + m
        if log and mask_logged:
            tbn.log_numerics("attn/scores", scores, allow_neginf=True)
        p = tf.nn.softmax(scores, axis=-1)  # MASKED_SOFTMAX
        if log:
            tbn.log_numerics("attn/probs", p)
        return tf.reduce_mean(tf.square(p @ h))

    return x, mask, w, forward


def _first_op_making_nan_or_posinf(forward, xs, m) -> str:
    """The oracle: the type of the first op whose output holds a NaN or a +Inf, as an eager op callback sees it."""
    from tensorflow.python.framework import op_callbacks

    first = []

    def callback(op_type, inputs, attrs, outputs, op_name=None, graph=None):
        for t in outputs or ():
            if not first and t.dtype.is_floating and (np.isnan(t.numpy()).any() or np.isposinf(t.numpy()).any()):
                first.append(op_type.decode() if isinstance(op_type, bytes) else op_type)

    op_callbacks.add_op_callback(callback)
    try:
        forward(xs, m, log=False)
    finally:
        op_callbacks.remove_op_callback(callback)
    return first[0]


def test_an_intended_neginf_mask_is_not_the_replays_op(tmp_path):
    """The guard's replay names the first op whose output holds a NaN or an
    Inf. The mask's add holds the -Inf the user declared intended (its
    output logged with ``allow_neginf=True``), at the bad step as at every
    healthy one: the op named is the Softmax that made the NaN, as an op
    callback's first NaN or +Inf says."""
    x, mask, w, forward = _masked_attention_step(mask_logged=True)
    optimizer = keras.optimizers.SGD(0.0)  # the weights stay: the oracle below runs on them
    optimizer.build([w])

    @tbn.guard(optimizer)
    @tf.function
    def train_step(xs, m):
        with tf.GradientTape() as tape:
            loss = forward(xs, m)
        grads = tape.gradient(loss, [w])
        optimizer.apply_gradients(zip(grads, [w]))

    step = tf.Variable(0, dtype=tf.int64)
    with tf.summary.create_file_writer(str(tmp_path)).as_default(step=step):
        for i in range(3):
            step.assign(i)
            train_step(tf.constant(x[i]), tf.constant(mask[i]))
    assert _first_op_making_nan_or_posinf(forward, tf.constant(x[2]), tf.constant(mask[2])) == "Softmax"
    a = _report(tmp_path)["first_anomaly"]
    assert a["step"] == 2 and a["tensor"] == "attn/probs"
    assert a["op"]["type"] == "Softmax"
    assert a["op"]["source"].endswith("test_step_guard.py:%d (forward)" % line_of(__file__, "# MASKED_SOFTMAX"))


def test_a_guard_inside_a_tf_function_says_to_wrap_it_from_outside():
    """``tf.function(tbn.guard(opt)(step))``: the guard's checks run in Python after each
    call, which a trace would run once. The error says so and how to write it, where
    it was an internal NotImplementedError from ``numpy()``."""
    keras.utils.set_random_seed(0)
    dense = keras.layers.Dense(1)
    dense.build((None, 2))
    opt = keras.optimizers.SGD(0.1)

    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(dense(x) ** 2)
        opt.apply_gradients(zip(tape.gradient(loss, dense.trainable_variables), dense.trainable_variables))
        return loss

    x = tf.ones((4, 2))
    with pytest.raises(RuntimeError, match=r"inside a tf\.function \(step\).*@tbn\.guard\(optimizer\) above "
                                           r"@tf\.function"):
        tf.function(tbn.guard(opt)(step))(x)
    before = [v.numpy() for v in dense.trainable_variables]
    tbn.guard(opt)(tf.function(step))(x)  # the order the error names runs and updates
    assert any((b != v.numpy()).any() for b, v in zip(before, dense.trainable_variables))


def test_a_loss_that_overflowed_with_finite_gradients_holds_its_update_back_and_names_the_op(tmp_path):
    """A mean squared error whose targets hold 1e20 at batch BAD (the injected fault): its Square
    overflows, so the loss is +Inf while its gradient, 2 * (p - y) / n, stays finite. The guard
    holds that update back (the loss logged before it is not finite) and names the op and line
    tf.debugging.enable_check_numerics names, at the step tf.summary writes the fault's scalar
    at; the hint is the overflow's, not a log(0) read off a ReLU output's usual zeros."""
    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD(0.01)

    def step_fn(x, y):
        with tf.GradientTape() as tape:
            h = model.layers[0](x)
            tbn.log_numerics("hidden/output", h)
            tf.summary.scalar("oracle/target_max", tf.reduce_max(tf.abs(y)))
            loss = tf.reduce_mean(tf.square(model.layers[1](h) - y))  # SQUARED_ERROR
            tbn.log_numerics("loss", loss)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    bad, steps = 3, 5
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(steps, 16, 4)).astype(np.float32), rng.normal(size=(steps, 16, 1)).astype(np.float32)
    y[bad] *= 1e20
    step = tf.Variable(0, dtype=tf.int64)
    train_step = tbn.guard(optimizer)(tf.function(step_fn))
    writer = tf.summary.create_file_writer(str(tmp_path))
    with writer.as_default(step=step):
        for i in range(steps):
            step.assign(i)
            before = [v.numpy().copy() for v in model.trainable_variables]
            if i == bad:  # the truth of "finite gradients": the step's own, on the weights it used
                finite_gradients = all(np.isfinite(g).all() for g in _mse_gradients(model, x[i], y[i]))
            train_step(tf.constant(x[i]), tf.constant(y[i]))
            if i == bad:
                held = all((b == v.numpy()).all() for b, v in zip(before, model.trainable_variables))
    writer.close()
    truth_step = _oracle_steps(tmp_path, "oracle/target_max", 1e10)
    op_type, lines = _check_numerics_names(step_fn, (tf.constant(x[bad]), tf.constant(y[bad])))
    assert truth_step == [bad] and op_type == "Square" and lines == [line_of(__file__, "# SQUARED_ERROR")]
    assert finite_gradients
    assert held, "the update of a step whose loss was +Inf ran"
    first = _report(tmp_path)["first_anomaly"]
    assert (first["step"], first["tensor"]) == (bad, "loss")
    assert (first["op"]["type"], first["op"]["phase"]) == (op_type, "forward")
    assert first["op"]["source"].split(" ")[0].endswith("%s:%d" % (pathlib.Path(__file__).name, lines[0]))
    assert first["hint"].startswith("Square (") and "made +Inf from finite values at step %d" % bad in first["hint"]
    assert "takes the log of its input" not in first["hint"]


def _mse_gradients(model, x, y) -> list[np.ndarray]:
    """The gradients of the mean squared error on one batch."""
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    return [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]


def _steps(logdir, n: int = STEPS):
    """Steps 0 .. n - 1, each under a writer to ``logdir`` whose step is a
    variable set to it (what ``tf.summary`` advises for a traced step)."""
    step = tf.Variable(0, dtype=tf.int64)
    with tf.summary.create_file_writer(str(logdir)).as_default(step=step):
        for i in range(n):
            step.assign(i)
            yield i


def _guarded_step(optimizer, variables, loss_of, log_gradients: bool = True):
    """A ``tf.function`` step under ``tbn.guard(optimizer)``: the gradient of
    ``loss_of(*batch)`` (logged, with ``log_gradients``) applied to ``variables``."""

    @tbn.guard(optimizer)
    @tf.function
    def train_step(*batch):
        with tf.GradientTape() as tape:
            loss = loss_of(*batch)
        grads = tape.gradient(loss, variables)
        if log_gradients:
            tbn.log_gradients(grads, variables)
        optimizer.apply_gradients(zip(grads, variables))

    return train_step


def _logged_relu_head():
    """(predict, variables) of a ReLU layer whose output is logged
    (``hidden/output``) and a linear head on it; ``variables()`` once built."""
    keras.utils.set_random_seed(0)
    dense, head = keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)

    def predict(x):
        h = dense(x)
        tbn.log_numerics("hidden/output", h)
        return head(h)

    return predict, lambda: dense.trainable_variables + head.trainable_variables


def test_a_hand_written_log_of_zeros_is_explained_by_the_ops_own_input(tmp_path):
    """A ReLU layer is logged, then a hand-written loss log(|p - y|) meets
    exact zeros at step BAD (the injected fault: targets set to the step's
    own predictions). The hint cites the Log's own input (8 exact zeros of
    8), which the replay recorded, not the ReLU layer's usual zeros, which
    never reach that log."""
    predict, trained = _logged_relu_head()
    optimizer = keras.optimizers.Adam(1e-2)

    @tbn.guard(optimizer)
    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.math.log(tf.abs(predict(x) - y)))  # LOG_OF_ABS
            tbn.log_numerics("loss", loss)
        variables = trained()
        grads = tape.gradient(loss, variables)
        tbn.log_gradients(grads, variables)
        optimizer.apply_gradients(zip(grads, variables))

    rng = np.random.default_rng(0)
    for i in _steps(tmp_path):
        x = rng.normal(size=(8, 4)).astype(np.float32)
        y = rng.normal(size=(8, 1)).astype(np.float32)
        if i == BAD:
            y = predict(tf.constant(x)).numpy()
        train_step(tf.constant(x), tf.constant(y))
    a = _report(tmp_path)["first_anomaly"]
    assert (a["step"], a["tensor"], a["op"]["type"]) == (BAD, "loss", "Log"), a
    assert a["op"]["source"].endswith("test_step_guard.py:%d (train_step)" % line_of(__file__, "# LOG_OF_ABS"))
    assert "its input 1 held 8 exact zeros of 8" in a["hint"], a["hint"]
    assert "hidden/output held exact zeros" not in a["hint"], a["hint"]


def test_a_hand_written_log_of_a_negative_value_is_not_called_log_of_zero(tmp_path):
    """A hand-written loss log(p - y + 4) whose argument goes below 0 at
    step BAD (the injected fault: targets 8 above the step's own
    predictions, so every value is -4 and none is 0): the log is NaN, not
    -Inf. The hint names the Log's negative input, which the replay
    recorded, not a log(0) its input never met."""
    predict, trained = _logged_relu_head()
    optimizer = keras.optimizers.SGD(1e-3)

    @tbn.guard(optimizer)
    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.math.log(predict(x) - y + 4.0))  # LOG_OF_NEGATIVE
            tbn.log_numerics("loss", loss)
        variables = trained()
        grads = tape.gradient(loss, variables)
        tbn.log_gradients(grads, variables)
        optimizer.apply_gradients(zip(grads, variables))

    rng = np.random.default_rng(0)
    for i in _steps(tmp_path):
        x = rng.normal(size=(8, 4)).astype(np.float32)
        p = predict(tf.constant(x)).numpy()
        y = (p + 8.0 if i == BAD else p - rng.uniform(0.5, 1.0, size=p.shape)).astype(np.float32)
        train_step(tf.constant(x), tf.constant(y))
    a = _report(tmp_path)["first_anomaly"]
    assert (a["step"], a["tensor"], a["op"]["type"]) == (BAD, "loss", "Log"), a
    assert a["op"]["source"].endswith("test_step_guard.py:%d (train_step)" % line_of(__file__, "# LOG_OF_NEGATIVE"))
    assert "log of a negative value" in a["hint"] and "log(0)" not in a["hint"], a["hint"]
    assert "its input 1 held negative values (min -4" in a["hint"], a["hint"]


@pytest.mark.parametrize("check", ["check_numerics", "assert_all_finite"])
def test_a_step_that_its_own_numerics_check_stops_still_names_the_op(tmp_path, check):
    """The reports' users sprinkle tf.debugging.check_numerics: at the NaN it
    raises inside the guarded step, before any update. The guard still
    replays that step, so the report names the op that made the NaN (as
    TensorFlow's enable_check_numerics names it, without the program's
    check) and its line, and the error goes on to the caller, who asked to stop."""
    predict, trained = _logged_relu_head()
    optimizer = keras.optimizers.SGD(1e-3)

    def step_fn(x, y, checked=True):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.math.log(predict(x) - y + 4.0))  # CHECKED_LOG
            tbn.log_numerics("loss", loss)
            if checked:
                loss = getattr(tf.debugging, check)(loss, "the loss is not finite")
        variables = trained()
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))

    train_step = tbn.guard(optimizer)(tf.function(step_fn))
    rng = np.random.default_rng(0)
    raised, batch = None, None
    for i in _steps(tmp_path):
        x = rng.normal(size=(8, 4)).astype(np.float32)
        p = predict(tf.constant(x)).numpy()
        y = (p + 8.0 if i == BAD else p - rng.uniform(0.5, 1.0, size=p.shape)).astype(np.float32)
        try:
            train_step(tf.constant(x), tf.constant(y))
        except tf.errors.InvalidArgumentError as e:
            raised, batch = i, (tf.constant(x), tf.constant(y))
            break
    assert raised == BAD
    op_type, lines = _check_numerics_names(lambda x, y: step_fn(x, y, checked=False), batch)
    a = _report(tmp_path)["first_anomaly"]
    assert (a["step"], a["op"]["type"]) == (BAD, op_type), a
    assert a["op"]["source"].endswith("test_step_guard.py:%d (step_fn)" % line_of(__file__, "# CHECKED_LOG"))
    assert line_of(__file__, "# CHECKED_LOG") in lines


@pytest.mark.parametrize("check", ["check_numerics", "assert_all_finite"])
def test_a_fit_its_own_numerics_check_stops_is_no_healthy_run_and_names_the_op(tmp_path, check):
    """A layer of the user's with tf.debugging.check_numerics: at the batch
    whose log goes NaN the check raises inside fit's step, which ends before
    any record of it is stored. Before, the report then said "no numerics
    records" (and "first anomaly: none" once the process had ended). Now the
    callback keeps what the check found before it raises: the first anomaly
    is that step (as a callback beside it counts fit's steps), its op the one
    TensorFlow's enable_check_numerics names, at its line."""
    bad = 4

    class Checked(keras.layers.Layer):
        def call(self, x):
            y = tf.math.log(x + 3.0)  # FIT_CHECKED_LOG
            return getattr(tf.debugging, check)(y, message="log output")

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), Checked(name="checked"), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.01), "mse")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(80, 4)).astype(np.float32), rng.normal(size=(80, 1)).astype(np.float32)
    x[8 * bad + 2, 1] = -5.0
    probe = _NanProbe(tmp_path, bad)
    with pytest.raises(tf.errors.InvalidArgumentError):
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[probe, NumericsCallback(str(tmp_path))])
    probe.on_train_end()  # fit ends no callback when a step raises
    (truth,) = _oracle_steps(tmp_path, "oracle/nan_batch", 0.5)
    op_type, lines = _check_numerics_names(model, (tf.constant(x[8 * bad:8 * bad + 8]),))
    run = _report(tmp_path)  # while the process goes on: on disk already
    a = run["first_anomaly"]
    assert a is not None and a["step"] == truth == bad, a
    assert a["op"]["type"] == op_type and a["op"]["phase"] == "forward", a["op"]
    assert a["op"]["source"].endswith("test_step_guard.py:%d (call)" % line_of(__file__, "# FIT_CHECKED_LOG"))
    assert line_of(__file__, "# FIT_CHECKED_LOG") in lines
    # The steps before it, written though fit ended no callback.
    (read,) = event_reader.read_logdir(str(tmp_path))
    assert {se.tag: se.steps.tolist() for se in read.series}["checked/output"] == list(range(bad))


def _batch_oracle_step(x, y):
    """``tf.summary``'s own record of whether the step's batch holds a NaN or an Inf (the oracle of its step)."""
    finite = tf.reduce_all(tf.math.is_finite(x)) & tf.reduce_all(tf.math.is_finite(y))
    tf.summary.scalar("oracle/batch_not_finite", tf.cast(tf.logical_not(finite), tf.float32))


def _regression_step(model, optimizer):
    """A hand-written step of a regression under the guard, whose prediction,
    loss and gradients are logged; under a LossScaleOptimizer, the loss
    scaled for the tape and the gradients logged unscaled."""
    scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)

    @tbn.guard(optimizer)
    @tf.function
    def train_step(x, y):
        _batch_oracle_step(x, y)
        with tf.GradientTape() as tape:
            p = model(x, training=True)
            tbn.log_numerics("pred", p)
            loss = tf.reduce_mean(tf.square(p - y))
            tbn.log_numerics("loss", loss)
            target = optimizer.scale_loss(loss) if scaled else loss
        grads = tape.gradient(target, model.trainable_variables)
        if scaled:
            grads = [g / tf.cast(optimizer.dynamic_scale, g.dtype) for g in grads]
        tbn.log_gradients(grads, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    return train_step


@pytest.mark.parametrize("argument, example, feature, scaled", [("x", 3, 5, False), ("y", 7, 1, False),
                                                                 ("x", 3, 5, True)])
def test_a_batch_that_arrives_with_a_nan_is_the_anomaly_not_the_op_that_reads_it(tmp_path, argument, example,
                                                                                  feature, scaled):
    """A hand-written loop whose batch at step BAD holds one NaN (the
    injected fault: in the inputs, or in the targets, at a given example and
    feature). No op of the step made it: the first anomaly is the guarded
    step's argument, in phase ``input``, at the step ``tf.summary`` saw the
    NaN in the batch, and the hint says where in the batch it is; not the
    MatMul (or the Sub) that read it first, which the replay names. Under a
    LossScaleOptimizer (``scaled``), which skips the step itself, the same."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)])
    optimizer = keras.optimizers.SGD(0.01)
    if scaled:
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        optimizer.build(model.trainable_variables)  # its loss scale, read in the step
    train_step = _regression_step(model, optimizer)
    rng = np.random.default_rng(0)
    for i in _steps(tmp_path):
        batch = {"x": rng.normal(size=(32, 8)).astype(np.float32), "y": rng.normal(size=(32, 2)).astype(np.float32)}
        if i == BAD:
            batch[argument][example, feature] = np.nan
        train_step(tf.constant(batch["x"]), tf.constant(batch["y"]))
    (truth,) = _oracle_steps(tmp_path, "oracle/batch_not_finite", 0.5)
    a = _report(tmp_path)["first_anomaly"]
    assert (a["step"], a["tensor"], a["phase"], a["nan"]) == (truth, "input/" + argument, "input", 1), a
    assert a["op"] is None, a["op"]
    assert "all in feature %d (of %d)" % (feature, 8 if argument == "x" else 2) in a["hint"], a["hint"]
    assert "in 1 of its 32 examples (the first: %d)" % example in a["hint"], a["hint"]


def test_a_step_that_takes_its_batch_from_an_iterator_is_not_replayed(tmp_path):
    """A replay runs the held step again on its arguments; a step that takes
    its batch from an iterator it is given would take the next batch there:
    another batch than the one that failed, and one taken from training.
    The guard does not replay such a step and says why; training takes each
    batch once (the oracle: the iterator ends after as many steps as it has
    batches), and the first anomaly is at the step ``tf.summary`` saw the NaN."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)])
    optimizer = keras.optimizers.SGD(0.01)
    rng = np.random.default_rng(0)
    n = BAD + 3  # batches after the bad one, for a replay to take
    x, y = rng.normal(size=(32 * n, 8)).astype(np.float32), rng.normal(size=(32 * n, 2)).astype(np.float32)
    x[32 * BAD + 3, 5] = np.nan
    batches = iter(tf.data.Dataset.from_tensor_slices((x, y)).batch(32))

    @tbn.guard(optimizer)
    @tf.function
    def train_step(iterator):
        xb, yb = next(iterator)
        _batch_oracle_step(xb, yb)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
            tbn.log_numerics("loss", loss)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    for i in _steps(tmp_path, n):
        train_step(batches)
    with pytest.raises(StopIteration):
        next(batches)
    (truth,) = _oracle_steps(tmp_path, "oracle/batch_not_finite", 0.5)
    a = _report(tmp_path)["first_anomaly"]
    assert (a["step"], a["tensor"]) == (truth, "loss"), a
    assert a["replay"]["reproduced"] is False and "from an iterator" in a["replay"]["why"], a["replay"]


def test_a_hand_written_cosine_of_a_zero_tower_output_is_called_a_division_not_a_log(tmp_path):
    """Two ReLU towers feeding a hand-written cosine similarity (one of the
    reports we started from); at step BAD one example of the second tower's
    input is all zeros (the injected fault), so its output row is, its norm
    is 0 and the cosine divides 0 by 0. The towers' outputs and the loss
    are logged. The op is the division an eager op callback sees make the
    first NaN, and the hint is the division's, not a log's: the loss takes
    no log, though the tensor logged before it held exact zeros."""
    keras.utils.set_random_seed(0)

    def tower():
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(
            8, activation="relu", use_bias=False, kernel_initializer=keras.initializers.RandomUniform(0.1, 1.0))])

    left, right = tower(), tower()
    variables = left.trainable_variables + right.trainable_variables
    optimizer = keras.optimizers.SGD(1e-4)

    def forward(x1, x2, log=True):
        a, b = left(x1), right(x2)
        if log:
            tbn.log_numerics("left/output", a)
            tbn.log_numerics("right/output", b)
        cosine = tf.reduce_sum(a * b, -1) / (tf.norm(a, axis=-1) * tf.norm(b, axis=-1))  # COSINE
        loss = tf.reduce_mean(tf.square(1.0 - cosine))
        if log:
            tbn.log_numerics("loss", loss)
        return loss

    train_step = _guarded_step(optimizer, variables, forward)

    rng = np.random.default_rng(0)
    for i in _steps(tmp_path):
        x1, x2 = (rng.uniform(0.5, 1.0, size=(16, 4)).astype(np.float32) for _ in range(2))
        if i == BAD:
            x2[5] = 0.0
            oracle_op = _first_op_making_nan_or_posinf(forward, tf.constant(x1), tf.constant(x2))
        train_step(tf.constant(x1), tf.constant(x2))
    a = _report(tmp_path)["first_anomaly"]
    assert (a["step"], a["tensor"], a["op"]["type"]) == (BAD, "loss", oracle_op), a
    assert a["op"]["source"].endswith("test_step_guard.py:%d (forward)" % line_of(__file__, "# COSINE"))
    assert a["hint"].startswith("Division by zero: 0/0 is NaN") and "log" not in a["hint"], a["hint"]


def test_a_hand_written_cross_entropy_of_a_softmax_that_rounded_to_zero_gets_the_logs_hint(tmp_path):
    """-sum(y * log(p)) on a softmax output (one of the reports we started
    from), the probabilities logged; at step BAD the batch is 1000x larger
    (the injected fault), the logits far apart, and labelled classes'
    probabilities round to exactly 0 in float32. The op is the Log
    TensorFlow's own check names, at this line; the hint is the log(0) of a
    saturated probability with the fix from the logits, not that an output
    that can be 0 does not fit a log loss: it is a softmax."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(5, activation="softmax")])
    optimizer = keras.optimizers.SGD(1e-3)

    def loss_of(x, y):
        p = model(x, training=True)
        tbn.log_numerics("probs", p)
        loss = -tf.reduce_mean(tf.reduce_sum(y * tf.math.log(p), axis=-1))  # CROSS_ENTROPY
        tbn.log_numerics("loss", loss)
        return loss

    train_step = _guarded_step(optimizer, model.trainable_variables, loss_of)

    rng = np.random.default_rng(0)
    for i in _steps(tmp_path):
        x = rng.normal(size=(32, 10)).astype(np.float32) * (1000.0 if i == BAD else 1.0)
        y = np.eye(5, dtype=np.float32)[rng.integers(0, 5, 32)]
        if i == BAD:
            truth = _check_numerics_names(loss_of, (tf.constant(x), tf.constant(y)))
        train_step(tf.constant(x), tf.constant(y))
    assert truth == ("Log", [line_of(__file__, "# CROSS_ENTROPY")])
    a = _report(tmp_path)["first_anomaly"]
    assert (a["step"], a["tensor"], a["op"]["type"]) == (BAD, "loss", "Log"), a
    assert a["op"]["source"].endswith("test_step_guard.py:%d (loss_of)" % truth[1][0]), a["op"]
    assert a["hint"].startswith("log(0) = -inf") and "does not fit a log loss" not in a["hint"], a["hint"]


def test_a_keras_cross_entropy_in_a_hand_written_loop_is_named_from_the_replayed_ops_scope(tmp_path):
    """A hand-written loop calling ``keras.losses.CategoricalCrossentropy``
    on a ReLU output (no softmax); at step BAD one example's input row is
    all zeros (the injected fault), so its output row is and the loss's
    normalisation divides 0 by 0. ``log_numerics`` cannot know the loss
    function; the op TensorFlow's check names is the division inside the
    Keras loss, and the hint names that loss from the op's scope and says a
    ReLU output does not fit it, not "add an epsilon to the denominator"."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(
        4, activation="relu", use_bias=False, kernel_initializer=keras.initializers.RandomUniform(0.1, 1.0))])
    optimizer = keras.optimizers.SGD(1e-4)
    cross_entropy = keras.losses.CategoricalCrossentropy()

    def loss_of(x, y):
        p = model(x, training=True)
        tbn.log_numerics("out", p)
        loss = cross_entropy(y, p)  # KERAS_CROSS_ENTROPY
        tbn.log_numerics("loss", loss)
        return loss

    train_step = _guarded_step(optimizer, model.trainable_variables, loss_of, log_gradients=False)

    rng = np.random.default_rng(0)
    for i in _steps(tmp_path):
        x = rng.uniform(0.5, 1.0, size=(16, 6)).astype(np.float32)
        y = np.eye(4, dtype=np.float32)[rng.integers(0, 4, 16)]
        if i == BAD:
            x[9] = 0.0
            truth = _check_numerics_names(loss_of, (tf.constant(x), tf.constant(y)))
        train_step(tf.constant(x), tf.constant(y))
    a = _report(tmp_path)["first_anomaly"]
    assert (a["step"], a["tensor"], a["op"]["type"]) == (BAD, "loss", truth[0]), (a, truth)
    assert "categorical_crossentropy" in a["op"]["name"], a["op"]
    assert a["hint"].startswith("The loss (categorical_crossentropy) takes the log of its input"), a["hint"]
    assert "use a softmax or sigmoid output" in a["hint"], a["hint"]


_MIRRORED_GUARD = """
    import contextlib, io
    import keras
    import tb_numerics as tbn
    from tb_numerics import cli
    logdir, bad = sys.argv[1], 3
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
        optimizer = keras.optimizers.SGD(0.01)
        optimizer.build(model.trainable_variables)

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            p = model(x, training=True)
            tbn.log_numerics("pred", p)
            loss = tf.reduce_mean(tf.square(p - y)) / strategy.num_replicas_in_sync
            tbn.log_numerics("loss", loss)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    @tbn.guard(optimizer)
    @tf.function
    def train_step(x, y):
        strategy.run(replica_step, args=(x, y))

    rng, step, kernels = np.random.default_rng(0), tf.Variable(0, dtype=tf.int64), []
    with tf.summary.create_file_writer(logdir).as_default(step=step):
        for i in range(bad + 2):
            step.assign(i)
            x, y = rng.normal(size=(32, 8)).astype(np.float32), rng.normal(size=(32, 1)).astype(np.float32)
            if i == bad:
                x[20, 1] = np.nan  # in the second replica's half of the batch
            train_step(tf.constant(x), tf.constant(y))
            kernels.append(model.layers[0].kernel.numpy().tolist())
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli.main(["report", "--json", logdir])
    (run,) = json.loads(out.getvalue())["runs"]
    a = run["first_anomaly"]
    print(json.dumps({"kernels": kernels, "first_anomaly": [a["step"], a["tensor"], a["phase"]]}))
"""


def test_a_guarded_step_under_a_mirrored_strategy_holds_back_the_bad_update_and_trains_on(tmp_path):
    """A custom loop under ``tf.distribute.MirroredStrategy`` (two replicas),
    the step under ``tbn.guard``: the update merges across the replicas, so
    it cannot sit in a branch taken inside one (it raised "merge_call called
    while defining a new graph"). The batch of step 3 holds a NaN in one
    replica's half (the injected fault). Training runs on; the oracle is
    the model's own kernel: unchanged by the bad step on both replicas'
    shared copy, changed by every other; and the first anomaly is that
    batch at that step."""
    res = two_replicas.run(_MIRRORED_GUARD, str(tmp_path))
    kernels = [np.asarray(k) for k in res["kernels"]]
    bad = 3
    assert np.array_equal(kernels[bad], kernels[bad - 1])
    assert all(not np.array_equal(kernels[i], kernels[i - 1]) for i in range(1, len(kernels)) if i != bad)
    assert np.isfinite(kernels[-1]).all()
    assert res["first_anomaly"] == [bad, "input/x", "input"], res["first_anomaly"]


def test_a_learning_rate_that_grows_the_output_until_it_overflows_is_called_growth(tmp_path):
    """A hand-written loop whose learning rate grows tenfold every two steps
    (the injected fault) until the output's MatMul overflows; the loss, a
    squared error, is +Inf because the output is. The first anomaly is the
    output at the step a ``tf.summary.scalar`` beside it first sees a
    non-finite value, and the hint names the growth and the learning rate,
    not a saturating logit (the loss takes no log, and the output itself was
    not finite)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD(0.01)

    @tbn.guard(optimizer)
    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            p = model(x, training=True)
            tbn.log_numerics("pred", p)
            tf.summary.scalar("oracle/pred_not_finite", tf.cast(tf.logical_not(tf.reduce_all(tf.math.is_finite(p))),
                                                                tf.float32))
            loss = tf.reduce_mean(tf.square(p - y))
            tbn.log_numerics("loss", loss)
        grads = tape.gradient(loss, model.trainable_variables)
        tbn.log_gradients(grads, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    rng = np.random.default_rng(0)
    step = tf.Variable(0, dtype=tf.int64)
    with tf.summary.create_file_writer(str(tmp_path)).as_default(step=step):
        for i in range(20):
            step.assign(i)
            optimizer.learning_rate.assign(0.01 * 10.0 ** (i / 2))
            train_step(tf.constant(rng.normal(size=(16, 4)).astype(np.float32)),
                       tf.constant(rng.normal(size=(16, 1)).astype(np.float32)))
    truth = _oracle_steps(tmp_path, "oracle/pred_not_finite", 0.5)
    a = _report(tmp_path)["first_anomaly"]
    assert truth and (a["step"], a["tensor"]) == (truth[0], "pred"), (truth, a)
    assert "learning rate" in a["hint"] and "grew" in a["hint"], a["hint"]
    assert "sigmoid" not in a["hint"], a["hint"]


def test_a_block_applied_to_its_own_output_until_the_loss_overflows_is_not_called_a_log(tmp_path):
    """A ReLU block applied to its own output eight times, scaled up each
    time (the injected fault), until the squared error overflows at the
    first step. The op is the Square that TensorFlow's own check names, and
    the hint is the growth through the eight applications the fault made
    (iter0 to iter7): not the log(0) of the ReLU output's zeros, nor a
    saturating logit (the loss takes no log)."""
    keras.utils.set_random_seed(0)
    block = keras.Sequential([keras.Input((16,)), keras.layers.Dense(16), keras.layers.ReLU()])
    head = keras.layers.Dense(1)
    optimizer = keras.optimizers.Adam(1e-3)

    def one_step(x, y):
        with tf.GradientTape() as tape:
            h = x
            for k in range(8):
                h = block(h) * 1000.0
                tbn.log_numerics("iter%d" % k, h)
            loss = tf.reduce_mean(tf.square(head(h) - y))  # SELF_APPLIED_SQUARE
            tbn.log_numerics("loss", loss)
        variables = block.trainable_variables + head.trainable_variables
        grads = tape.gradient(loss, variables)
        tbn.log_gradients(grads, variables)
        optimizer.apply_gradients(zip(grads, variables))

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 16)).astype(np.float32) * 10, rng.normal(size=(16, 1)).astype(np.float32)
    op_type, _ = _check_numerics_names(tf.function(lambda a, b: tf.reduce_mean(
        tf.square(head(_apply_eight(block, a)) - b))), (tf.constant(x), tf.constant(y)))
    step = tf.Variable(0, dtype=tf.int64)
    with tf.summary.create_file_writer(str(tmp_path)).as_default(step=step):
        tbn.guard(optimizer)(tf.function(one_step))(tf.constant(x), tf.constant(y))
    a = _report(tmp_path)["first_anomaly"]
    assert (a["step"], a["tensor"], a["op"]["type"]) == (0, "loss", op_type) and op_type == "Square", a
    assert a["op"]["source"].endswith("test_step_guard.py:%d (one_step)" % line_of(__file__, "# SELF_APPLIED_SQUARE"))
    assert "grew from one logged tensor to the next, 8 in a row: iter0 max |x|" in a["hint"], a["hint"]
    assert "to iter7 max |x|" in a["hint"] and "log" not in a["hint"].replace("logged", ""), a["hint"]


def test_growth_by_depth_beside_a_nan_no_overflow_made_is_no_hint(tmp_path):
    """Six logged ReLU layers whose values grow about 4x at each, then an acos
    of values beyond [-1, 1] (the injected fault: NaN, no overflow anywhere).
    The growth explains nothing there, so the hint does not name it."""
    keras.utils.set_random_seed(0)
    layers = [keras.layers.Dense(32, activation="relu", kernel_initializer=keras.initializers.RandomNormal(stddev=1.0))
              for _ in range(6)]

    @tf.function
    def forward(x):
        h = x
        for k, layer in enumerate(layers):
            h = layer(h)
            tbn.log_numerics("layer%d" % k, h)
        tbn.log_numerics("angle", tf.math.acos(tf.tanh(h) * 1.5))

    step = tf.Variable(0, dtype=tf.int64)
    with tf.summary.create_file_writer(str(tmp_path)).as_default(step=step):
        forward(tf.constant(np.random.default_rng(0).normal(size=(16, 32)).astype(np.float32)))
    a = _report(tmp_path)["first_anomaly"]
    assert (a["step"], a["tensor"]) == (0, "angle") and a["nan"] > 0, a
    assert "grew from one logged tensor" not in a["hint"] and "overflow" not in a["hint"], a["hint"]


def _apply_eight(block, h):
    for _ in range(8):
        h = block(h) * 1000.0
    return h
