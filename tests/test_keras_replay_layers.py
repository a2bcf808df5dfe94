"""Replay through Keras' built-in layers (issue 25): ``model.fit`` with
NumericsCallback's defaults, with and without XLA, on a CNN with
BatchNormalization and preprocessing layers, a Transformer block followed by
an LSTM and a GRU, and Keras Dropout. The truth is the fault each model injects: its op type and
the line of this file that makes it; the replay must leave the model's state
as it found it, and say "not reproduced" rather than name a wrong op."""

import contextlib
import io
import json

import keras
import numpy as np
import pytest
import tensorflow as tf

from op_records import line_of
from tb_numerics import cli
from tb_numerics.keras import NumericsCallback

pytestmark = pytest.mark.e2e


def _line(marker: str) -> int:
    return line_of(__file__, "# " + marker)


def _report(logdir) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["report", "--json", str(logdir)]) == 1
    (run,) = json.loads(out.getvalue())["runs"]
    return run["first_anomaly"]


class LogRelu(keras.layers.Layer):
    def call(self, x):
        return tf.math.log(tf.nn.relu(x))  # LOG


class MaskDiv(keras.layers.Layer):
    """x / the sum of a Keras dropout mask of three units: x/0 at a step that drops all three."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dropout = keras.layers.Dropout(0.5)

    def call(self, x, training=False):
        return x / tf.reduce_sum(self.dropout(tf.ones([3]), training=training))  # MASK_DIV


def _cnn():
    return keras.Sequential([
        keras.Input((4, 4, 1)), keras.layers.Rescaling(0.5), keras.layers.Normalization(mean=0.0, variance=4.0),
        keras.layers.Conv2D(2, 2), keras.layers.BatchNormalization(), keras.layers.Flatten(), LogRelu(),
        keras.layers.Dense(1)])


def _sequence():
    """A Transformer block (Embedding, MultiHeadAttention, LayerNormalization), then an LSTM and a GRU."""
    tokens = keras.Input((2,), dtype="int32")
    h = keras.layers.Embedding(10, 4)(tokens)
    h = keras.layers.LayerNormalization()(h + keras.layers.MultiHeadAttention(2, 2)(h, h))
    h = keras.layers.GRU(3)(keras.layers.LSTM(3, return_sequences=True)(h))
    return keras.Model(tokens, keras.layers.Dense(1)(LogRelu()(h)))


def _strings():
    """String inputs through StringLookup and CategoryEncoding."""
    return keras.Sequential([
        keras.Input((3,), dtype="string"), keras.layers.StringLookup(vocabulary=["a", "b", "c"]),
        keras.layers.CategoryEncoding(5, output_mode="multi_hot"), keras.layers.Dense(3), LogRelu(),
        keras.layers.Dense(1)])


def _dropout():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), MaskDiv(), keras.layers.Dense(1)])


# build, input kind, the fault's marker and op type
MODELS = {
    "cnn": (_cnn, "image", "LOG", "Log"),
    "sequence": (_sequence, "tokens", "LOG", "Log"),
    "strings": (_strings, "strings", "LOG", "Log"),
    "dropout": (_dropout, "vector", "MASK_DIV", "RealDiv"),
}


def _inputs(kind: str, n: int):
    rs = np.random.RandomState(0)
    if kind == "strings":
        return tf.constant([["a", "b", "z"], ["c", "a", "a"]] * (n // 2))
    shape = {"image": (n, 4, 4, 1), "vector": (n, 4)}.get(kind)
    return rs.randint(0, 10, (n, 2)).astype("int32") if kind == "tokens" else rs.randn(*shape).astype("float32")


def _state(model) -> list[np.ndarray]:
    """What a step may change besides the weights: BatchNorm's moving
    statistics and the seed generators (non-trainable variables), the
    optimizer's iterations and slots, the metrics."""
    variables = list(model.non_trainable_variables) + list(model.optimizer.variables)
    for m in model.metrics:
        variables += list(m.variables)
    return [np.array(v.numpy()) for v in variables]


class _Snapshot(keras.callbacks.Callback):
    """The model's state at the end of each batch, as the callbacks before it left it."""

    def __init__(self):
        super().__init__()
        self.states = []

    def on_train_batch_end(self, batch, logs=None):
        self.states.append(_state(self.model))


_FITS: dict = {}


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """One tiny training per (model, XLA or not), shared by the tests."""

    def fit(name: str, jit: bool) -> dict:
        if (name, jit) not in _FITS:
            build, kind, _, _ = MODELS[name]
            keras.utils.set_random_seed(1)  # a seed whose dropout draws the replay cannot guess
            model = build()
            model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"], jit_compile=jit)
            logdir = tmp_path_factory.mktemp("%s_%s" % (name, "xla" if jit else "graph"))
            before, after = _Snapshot(), _Snapshot()
            cb = NumericsCallback(str(logdir), stop_on_anomaly=True)
            x = _inputs(kind, 64)
            model.fit(x, np.ones((64, 1), "float32"), batch_size=8, shuffle=False, verbose=0,
                      callbacks=[before, cb, after])
            _FITS[name, jit] = {"anomaly": _report(logdir), "before": before.states, "after": after.states, "cb": cb}
        return _FITS[name, jit]

    yield fit
    _FITS.clear()


# XLA on the CNN only: each compiled training costs 3-5 times a graph one here.
@pytest.mark.parametrize("name, jit", [("cnn", False), ("cnn", True), ("sequence", False), ("strings", False)],
                         ids=["cnn-graph", "cnn-xla", "sequence-graph", "strings-graph"])
def test_the_replay_names_the_op_and_line_through_builtin_layers(fitted, name, jit):
    _, _, marker, op_type = MODELS[name]
    a = fitted(name, jit)["anomaly"]
    assert a["replay"] == {"reproduced": True}, a
    assert (a["op"]["type"], a["op"]["phase"]) == (op_type, "forward"), a["op"]
    assert a["op"]["source"].endswith("test_keras_replay_layers.py:%d (call)" % _line(marker)), a["op"]


def test_the_replay_draws_the_steps_own_dropout_masks(fitted):
    """The fault needs the step's own mask (all three units dropped, 1 in 8):
    a replay drawing a fresh one would not meet it."""
    a = fitted("dropout", False)["anomaly"]
    assert a["step"] > 0 and a["replay"] == {"reproduced": True}, a
    assert a["op"]["type"] == "RealDiv"
    assert a["op"]["source"].endswith("test_keras_replay_layers.py:%d (call)" % _line("MASK_DIV")), a["op"]


def test_under_xla_masks_it_cannot_redraw_are_not_reproduced(fitted):
    a = fitted("dropout", True)["anomaly"]
    assert a["op"] is None and a["replay"]["reproduced"] is False, a
    assert "XLA" in a["replay"]["why"] and "dropout" in a["replay"]["why"], a["replay"]


@pytest.mark.parametrize("jit", [False, True], ids=["graph", "xla"])
@pytest.mark.parametrize("name", ["cnn", "dropout"])
def test_the_replay_leaves_the_training_state_as_it_was(fitted, name, jit):
    res = fitted(name, jit)
    assert res["cb"].replay_verdict is not None
    before, after = res["before"][-1], res["after"][-1]  # around the callback, at the step it replayed
    assert len(before) == len(after) and all(np.array_equal(b, c, equal_nan=True) for b, c in zip(before, after))


class TfDropoutDiv(keras.layers.Layer):
    """x / the sum of a mask tf.nn.dropout draws (TensorFlow's stateful RNG, not rewindable)."""

    def call(self, x, training=False):
        return x / tf.reduce_sum(tf.nn.dropout(tf.ones([3]), rate=0.8)) if training else x


class EagerFails(keras.layers.Layer):
    """Works where Keras traces the step; raises where the replay runs it eagerly."""

    def call(self, x):
        if tf.executing_eagerly():
            raise RuntimeError("this layer runs only inside tf.function")
        return x


def _fit_small(tmp_path, *layers, seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), *layers, keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    cb = NumericsCallback(str(tmp_path))
    history = model.fit(_inputs("vector", 32), np.ones((32, 1), "float32"), batch_size=8, shuffle=False,
                        verbose=0, callbacks=[cb])
    return history, _report(tmp_path)


def test_a_replay_that_draws_other_values_never_names_a_wrong_op(tmp_path):
    """At step 0 (seed 7) the step's mask dropped all three units (x/0 in "tf_dropout"),
    the replay's fresh mask did not; the log after it is -Inf either way.
    Naming that Log would name an op the step's first NaN/Inf was not born in."""
    _, a = _fit_small(tmp_path, TfDropoutDiv(name="tf_dropout"), LogRelu(name="log"), seed=7)
    assert (a["step"], a["tensor"]) == (0, "tf_dropout/output"), a
    assert a["op"] is None and a["replay"]["reproduced"] is False, a
    assert "tf_dropout/output" in a["replay"]["why"], a["replay"]


def test_a_replay_that_raises_never_stops_training(tmp_path):
    history, a = _fit_small(tmp_path, EagerFails(name="graph_only"), LogRelu(name="log"))
    assert len(history.history["loss"]) == 1  # the epoch ran to its end
    why = a["replay"]["why"]
    assert a["replay"]["reproduced"] is False and a["op"] is None, a
    assert why.startswith("the replay raised RuntimeError: ") and "runs only inside tf.function" in why, why
    assert "\x1b" not in why and "\n" not in why, why  # no terminal colour codes, one line
