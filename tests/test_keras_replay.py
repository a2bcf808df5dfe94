"""Replay (issue 14): model.fit with NumericsCallback's defaults names the
exact op and the line of this file that made the first NaN/Inf, through
``tb-numerics report --json``, with and without XLA."""

import contextlib
import io
import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from tb_numerics import cli
from tb_numerics.keras import NumericsCallback

import two_replicas

pytestmark = pytest.mark.e2e


def _line(marker: str) -> int:
    with open(__file__) as f:
        for i, line in enumerate(f, 1):
            if line.rstrip().endswith("# " + marker):
                return i
    raise AssertionError(marker)


def _report(logdir) -> dict:
    (run,) = json.loads(_report_text(logdir, "--json"))["runs"]
    return run


def _report_text(logdir, *flags) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = cli.main(["report", *flags, str(logdir)])
    assert status == 1
    return out.getvalue()


class LogRelu(keras.layers.Layer):
    def call(self, x):
        return tf.math.log(tf.nn.relu(x))  # LOG_OF_RELU


def sqrt_error(y_true, y_pred):
    """A per-example RMSE: sqrt of a mean squared error that reaches 0."""
    return tf.reduce_mean(tf.sqrt(tf.reduce_mean(tf.square(y_true - y_pred), axis=-1)))  # SQRT_LOSS


class Cosine(keras.layers.Layer):
    """A hand-written cosine of two halves: 0/0 where a half is all zeros."""

    def call(self, x):
        a, b = x[:, :4], x[:, 4:]
        dot = tf.reduce_sum(a * b, axis=1, keepdims=True)
        norms = tf.norm(a, axis=1, keepdims=True) * tf.norm(b, axis=1, keepdims=True)
        return dot / norms  # COSINE_DIV


def _log_relu_model():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, name="pre"), LogRelu(name="log_relu"),
                             keras.layers.Dense(1, name="head")]), "mse"


def _sqrt_model():
    # A linear head without bias: its output is exactly 0 for an all-zero input.
    # (Not a ReLU: XLA's ReluGrad selects 0 where the graph's multiplies, so
    # the NaN would stop there under XLA.)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, use_bias=False, name="head")]), sqrt_error


def _cosine_model():
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation="relu", name="tower"),
                             Cosine(name="cosine"), keras.layers.Dense(1, name="head")]), "mse"


def _data(kind):
    rs = np.random.RandomState(0)
    x = rs.randn(64, 8 if kind == "cosine" else 4).astype("float32")
    y = rs.randn(64, 2 if kind == "sqrt" else 1).astype("float32")
    if kind == "sqrt":
        x[32:48] = 0.0  # batch 2: inputs the head maps to exactly 0 ...
        y[32:48] = 0.0  # ... where the target is 0: sqrt(0), infinite gradient
    if kind == "cosine":
        x[32:48] = -np.abs(x[32:48]) * 0  # batch 2: all zeros: the ReLU tower outputs 0
    return x, y


CASES = {
    "log": (_log_relu_model, "LOG_OF_RELU", "Log", "forward"),
    "sqrt": (_sqrt_model, "SQRT_LOSS", "SqrtGrad", "backward"),
    "cosine": (_cosine_model, "COSINE_DIV", "RealDiv", "forward"),
}


def _fit(tmp_path, kind, jit):
    build = CASES[kind][0]
    keras.utils.set_random_seed(0)
    model, loss = build()
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss, jit_compile=jit)
    x, y = _data(kind)
    cb = NumericsCallback(str(tmp_path), stop_on_anomaly=True)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[cb])
    return cb


@pytest.mark.parametrize("jit", [False, True], ids=["graph", "xla"])
@pytest.mark.parametrize("kind", ["log", "cosine", "sqrt"])
def test_the_replay_names_the_op_and_the_line(tmp_path, kind, jit):
    _, marker, op_type, phase = CASES[kind]
    cb = _fit(tmp_path, kind, jit)
    a = _report(tmp_path)["first_anomaly"]
    assert a["replay"] == {"reproduced": True}, a
    op = a["op"]
    assert (op["type"], op["phase"]) == (op_type, phase), op
    assert op["source"].endswith("test_keras_replay.py:%d (%s)" % (_line(marker), "sqrt_error" if kind == "sqrt"
                                                                     else "call")), op
    assert cb.replay_verdict["reproduced"] and cb.anomaly["op"]["type"] == op_type
    # The text report names the op, its line and its inputs' ranges too.
    text = _report_text(tmp_path)
    assert "op: %s (%s, %s) at %s\n" % (op["name"], op_type, phase, op["source"]) in text, text
    # Each input named by the op that made it, as the JSON names it, with its shape.
    first = op["inputs"][0]
    assert "input 1 (%s, %s): min " % (first["name"], "x".join(map(str, first["shape"]))) in text, text


@pytest.mark.parametrize("jit", [False, True], ids=["graph", "xla"])
def test_under_steps_per_execution_the_replay_names_the_first_bad_steps_op(tmp_path, jit):
    """Four steps per call of the train function, batches 5 and 6 of 8 made
    to reach sqrt(0) (the injected fault: both in the second call, and a
    healthy step after them that moves the weights): the first anomaly is
    step 5, and its replay runs step 5's own batch (the call's first bad
    one, not its last) to the sqrt's gradient on this file's line."""
    keras.utils.set_random_seed(0)
    model, loss = _sqrt_model()
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss, jit_compile=jit, steps_per_execution=4)
    rs = np.random.RandomState(0)
    x, y = rs.randn(128, 4).astype("float32"), rs.randn(128, 2).astype("float32")
    x[80:112] = 0.0  # batches 5 and 6: inputs the head maps to exactly 0 ...
    y[80:112] = 0.0  # ... where the target is 0: sqrt(0), an infinite gradient
    cb = NumericsCallback(str(tmp_path), stop_on_anomaly=True)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[cb])
    a = _report(tmp_path)["first_anomaly"]
    assert a["step"] == 5 and a["replay"] == {"reproduced": True}, a
    assert (a["op"]["type"], a["op"]["phase"]) == ("SqrtGrad", "backward"), a["op"]
    assert a["op"]["source"].endswith("test_keras_replay.py:%d (sqrt_error)" % _line("SQRT_LOSS")), a["op"]


class ExpScale(keras.layers.Layer):
    """exp(w * x) of one scalar weight: overflows where w * x passes 88.7."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=(), initializer="ones", name="w")

    def call(self, x):
        return tf.exp(self.w * x)  # EXP_OVERFLOW


@pytest.mark.parametrize("steps_per_execution", [1, 4])
def test_a_replay_on_weights_a_later_step_of_its_call_moved_does_not_call_the_fault_unreproducible(
        tmp_path, steps_per_execution):
    """Step 1's exp(1 * 100) overflows (the injected fault, on its weight);
    step 2's batch drives the weight to about -53. One step per call: the
    replay runs on step 1's own weight and names the Exp. Four: the call's
    step 2 ran before the host could replay step 1, and the replay, finite
    on the moved weight, says so instead of blaming non-determinism."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1,)), ExpScale(name="exp")])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", steps_per_execution=steps_per_execution)
    x = np.array([[1.0], [100.0], [1.0], [1.0]], np.float32)
    y = np.array([[np.e], [0.0], [-1000.0], [0.0]], np.float32)
    cb = NumericsCallback(str(tmp_path))
    model.fit(x, y, batch_size=1, epochs=1, shuffle=False, verbose=0, callbacks=[cb])
    assert float(model.layers[0].w.numpy()) < -10  # the later step moved the weight
    a = _report(tmp_path)["first_anomaly"]
    assert a["step"] == 1, a
    if steps_per_execution == 1:
        assert a["replay"] == {"reproduced": True} and a["op"]["type"] == "Exp", a
        assert a["op"]["source"].endswith("test_keras_replay.py:%d (call)" % _line("EXP_OVERFLOW")), a["op"]
    else:
        replay = a["replay"]
        assert replay["reproduced"] is False and replay.get("reproducible") is not False, replay
        assert "steps_per_execution > 1: 2 later step(s)" in replay["why"], replay
        assert "not reproducible on replay" not in _report_text(tmp_path)


class DropoutScale(keras.layers.Layer):
    """Divides by the sum of a dropout mask of three units: x/0 when all are dropped."""

    def call(self, x, training=False):
        if not training:
            return x
        return x / tf.reduce_sum(tf.nn.dropout(tf.ones([3]), rate=0.5))


def test_a_failure_the_replay_cannot_reproduce_says_so(tmp_path):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), DropoutScale(name="noisy"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    rs = np.random.RandomState(0)
    cb = NumericsCallback(str(tmp_path), stop_on_anomaly=True)
    model.fit(rs.randn(640, 4).astype("float32"), rs.randn(640, 1).astype("float32"), batch_size=16, verbose=0,
              callbacks=[cb])
    a = _report(tmp_path)["first_anomaly"]
    assert a["tensor"] == "noisy/output" and a["op"] is None
    assert a["replay"]["reproduced"] is False and "dropout" in a["replay"]["why"]
    assert "replay: did not reproduce the failure (every op output was finite" in _report_text(tmp_path)


class SubclassedLogNet(keras.Model):
    def __init__(self):
        super().__init__(name="subclassed")
        self.pre = keras.layers.Dense(4, name="pre")
        self.log_relu = LogRelu(name="log_relu")
        self.head = keras.layers.Dense(1, name="head")

    def call(self, x):
        return self.head(self.log_relu(self.pre(x)))


class CustomStepNet(SubclassedLogNet):
    """A custom train_step that calls the loss and the tape the usual way."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


def _functional_log_net():
    inp = keras.Input((4,))
    return keras.Model(inp, keras.layers.Dense(1, name="head")(LogRelu(name="log_relu")(
        keras.layers.Dense(4, name="pre")(inp))))


def test_an_unbuilt_subclassed_model_gets_a_clear_error(tmp_path):
    model = SubclassedLogNet()
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    x, y = _data("log")
    with pytest.raises(ValueError, match="build it before fit"):
        model.fit(x, y, batch_size=16, verbose=0, callbacks=[NumericsCallback(str(tmp_path))])


@pytest.mark.parametrize("build", [_functional_log_net, SubclassedLogNet, CustomStepNet],
                         ids=["functional", "subclassed", "custom_train_step"])
def test_the_replay_works_for_every_kind_of_model(tmp_path, build):
    keras.utils.set_random_seed(0)
    model = build()
    x, y = _data("log")
    model(x[:1])  # a subclassed model's variables exist once it is called
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    cb = NumericsCallback(str(tmp_path), stop_on_anomaly=True)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[cb])
    a = _report(tmp_path)["first_anomaly"]
    assert a["replay"] == {"reproduced": True} and a["op"]["type"] == "Log", a
    assert a["op"]["source"].endswith("test_keras_replay.py:%d (call)" % _line("LOG_OF_RELU"))


def _xent(y, p):
    return -keras.ops.sum(y * keras.ops.log(p), axis=-1)  # XENT_LOG


class SoftmaxStepNet(keras.Model):
    """A classifier with the custom train_step of Keras' guide: ``compute_loss``, no ``scale_loss``."""

    def __init__(self):
        super().__init__(name="softmax_step")
        self.hidden = keras.layers.Dense(8, activation="relu", name="hidden")
        self.probs = keras.layers.Dense(3, activation="softmax", name="probs")

    def call(self, x):
        return self.probs(self.hidden(x))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        return {"loss": loss}


def test_a_custom_train_step_that_calls_compute_loss_has_its_loss_recorded(tmp_path):
    """Keras' guide's custom train_step calls ``compute_loss`` and never ``scale_loss``, where
    the callback took the loss from: the loss went unrecorded, and a log(0) in it was first
    seen in a gradient. Its loss is recorded at every step, equal to what the step returned
    to Keras (the truth: ``logs["loss"]``), and the injected batch's NaN is the loss's, forward."""
    keras.utils.set_random_seed(0)
    model = SoftmaxStepNet()
    model(np.zeros((1, 4), np.float32))
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss=_xent)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(96, 4)).astype(np.float32), np.eye(3, dtype=np.float32)[rng.integers(0, 3, 96)]
    bad = 4
    x[bad * 16 + 2] *= 1e4  # a saturated softmax: a probability of exactly 0 in the log
    returned = []

    class Logs(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            returned.append(float(logs["loss"]))

    model.fit(x, y, batch_size=16, shuffle=False, verbose=0, callbacks=[NumericsCallback(str(tmp_path)), Logs()])
    assert np.isfinite(returned[:bad]).all() and np.isnan(returned[bad])
    from tb_numerics import analysis, event_reader, records

    (run,) = event_reader.read_logdir(str(tmp_path))
    loss = analysis.analyze_run(run.run, run.series).find("loss").series
    assert loss.steps.tolist() == list(range(6))
    # The step returns its own loss to Keras' logs (no metric averages it).
    np.testing.assert_allclose(records.derived(loss.values)["mean"][:bad], returned[:bad], rtol=1e-6)
    a = _report(tmp_path)["first_anomaly"]
    assert (a["step"], a["tensor"], a["phase"]) == (bad, "loss", "forward")
    assert a["op"]["type"] == "Log" and a["op"]["source"].endswith("test_keras_replay.py:%d (_xent)" % _line("XENT_LOG"))


class PenaltyStepNet(SoftmaxStepNet):
    """A custom train_step as WGAN-GP's: a gradient with respect to the inputs (a gradient
    penalty) comes before the gradient of the loss, computed by hand, with respect to the weights."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            with tf.GradientTape() as inner:
                inner.watch(x)
                p = self(x, training=True)
            penalty = tf.reduce_mean(tf.square(inner.gradient(p, x)))
            loss = tf.reduce_mean(_xent(y, p)) + 1e-3 * penalty
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        return {"loss": loss}


def test_a_loss_computed_by_hand_is_the_target_of_the_gradient_with_respect_to_the_weights(tmp_path):
    """A custom train_step that computes its loss by hand has it recorded from the step's
    gradient with respect to the weights, not from a gradient penalty's with respect to the
    inputs taken before it (the critic's output is no loss). The truth: ``logs["loss"]``."""
    keras.utils.set_random_seed(0)
    model = PenaltyStepNet()
    model(np.zeros((1, 4), np.float32))
    model.compile(optimizer=keras.optimizers.SGD(0.01))
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(96, 4)).astype(np.float32), np.eye(3, dtype=np.float32)[rng.integers(0, 3, 96)]
    returned = []
    logs = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: returned.append(float(logs["loss"])))
    model.fit(x, y, batch_size=16, shuffle=False, verbose=0, callbacks=[NumericsCallback(str(tmp_path)), logs])
    from tb_numerics import analysis, event_reader, records

    (run,) = event_reader.read_logdir(str(tmp_path))
    loss = analysis.analyze_run(run.run, run.series).find("loss").series
    assert loss.info.shape == () and loss.steps.tolist() == list(range(6))
    np.testing.assert_allclose(records.derived(loss.values)["mean"], returned, rtol=1e-6)


_MIRRORED_REPLAY = """
    import keras
    args = json.loads(sys.argv[1])
    sys.path.insert(0, args["tests"])
    from test_keras_replay import LogRelu
    from tb_numerics.keras import NumericsCallback

    def fit(logdir, fit_in_scope):
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, kernel_initializer="ones", name="pre"),
                                      LogRelu(name="log_relu"), keras.layers.Dense(1, name="head")])
            model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        rs = np.random.RandomState(0)
        x = np.abs(rs.randn(48, 4)).astype("float32") + 0.5
        y = rs.randn(48, 1).astype("float32")
        # Batch 1, in the half replica 1 gets: "pre" outputs -4 there, the ReLU 0, the log -Inf.
        x[16 + 11] = -1.0
        cb = NumericsCallback(logdir)
        with strategy.scope() if fit_in_scope else contextlib.nullcontext():
            model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[cb])
        return {"verdict": cb.replay_verdict, "finite": all(bool(np.isfinite(w.numpy()).all()) for w in model.weights),
                "iterations": int(model.optimizer.iterations.numpy())}

    import contextlib
    print(json.dumps([fit(args["logdir"] + "/outside", False), fit(args["logdir"] + "/inside", True)]))
    """


def test_under_mirrored_strategy_the_replay_names_the_replica_the_op_and_the_line(tmp_path):
    """The NaN is on replica 1 only: the replay runs replica 1's part of the
    batch, on the weights the step used (its update held back), with ``fit``
    called outside and inside ``strategy.scope()``."""
    arg = json.dumps({"logdir": str(tmp_path), "tests": os.path.dirname(os.path.abspath(__file__))})
    outside, inside = two_replicas.run(_MIRRORED_REPLAY, arg)
    for run, res in (("outside", outside), ("inside", inside)):
        a = _report(tmp_path / run)["first_anomaly"]
        assert (a["step"], a["tensor"]) == (1, "log_relu/output"), a
        assert a["replay"] == {"reproduced": True, "replica": 1}, (run, a)
        assert a["op"]["type"] == "Log" and a["op"]["phase"] == "forward", a["op"]
        assert a["op"]["source"].endswith("test_keras_replay.py:%d (call)" % _line("LOG_OF_RELU")), a["op"]
        assert res["verdict"]["replica"] == 1 and res["verdict"]["reproduced"]
        # The bad step's update was held back on every replica: training went
        # on from finite weights, and only the two healthy steps were applied.
        assert res["finite"] and res["iterations"] == 2, res
