"""NumericsCallback over several ``fit`` calls of one model: the step traced once, as Keras does.

Keras keeps a model's train function from one ``fit`` to the next until the
model is compiled again; a user who calls ``fit(epochs=1)`` in a loop pays
the tracing once. The callback wraps the step for the duration of ``fit``;
it keeps the step it traced for the next ``fit`` of the same model, so that
the second call costs what Keras' own does. The oracle for "traced again" is
Python itself: a layer's ``call`` runs in Python only while the step is
traced (a traced step runs its graph).
"""

import keras
import numpy as np
import pytest

from tb_numerics import analysis, event_reader
from tb_numerics.records import F
from tb_numerics.keras import NumericsCallback

pytestmark = pytest.mark.e2e


class CountingDense(keras.layers.Dense):
    """A Dense layer that counts the Python runs of its ``call`` (traces, or eager calls)."""

    calls = 0

    def call(self, inputs):
        CountingDense.calls += 1
        return super().call(inputs)


def _model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), CountingDense(6, activation="relu", name="a"),
                              keras.layers.Dense(4, activation="tanh", name="d")], name="net")
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model


def _batches(n_batches, batch, seed, nan_batch=None):
    rs = np.random.RandomState(seed)
    x = rs.randn(n_batches * batch, 8).astype("float32")
    y = rs.randn(n_batches * batch, 4).astype("float32")
    if nan_batch is not None:
        x[nan_batch * batch + 1, 3] = np.nan
    return x, y


def _fit(model, data, batch, callbacks):
    x, y = data
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)


def _run(logdir):
    (run,) = event_reader.read_logdir(str(logdir))
    return run


def _series(run, tag):
    return next(s for s in run.series if s.tag == tag)


def _first_anomaly(logdir):
    run = _run(logdir)
    return analysis.first_anomaly(analysis.analyze_run(run.run, run.series, analysis.SafeRange()))


def test_plain_keras_traces_its_step_once_over_two_fits():
    """The behaviour the callback keeps (the oracle's own check: the counter
    sees a trace, and Keras does not trace again)."""
    model = _model()
    before = CountingDense.calls
    _fit(model, _batches(3, 8, seed=1), 8, [])
    traced = CountingDense.calls
    assert traced > before
    _fit(model, _batches(3, 8, seed=2), 8, [])
    assert CountingDense.calls == traced


def test_a_second_fit_runs_the_step_the_first_traced_and_records_its_own_steps(tmp_path):
    model = _model()
    cb = NumericsCallback(str(tmp_path))
    _fit(model, _batches(3, 8, seed=1), 8, [cb])
    assert _series(_run(tmp_path), "a/output").steps.tolist() == [0, 1, 2]  # fit 1's file is complete
    traced = CountingDense.calls

    second = _batches(3, 8, seed=2)
    _fit(model, second, 8, [cb])
    assert CountingDense.calls == traced  # not traced again
    inputs = _series(_run(tmp_path), "input")
    assert inputs.steps.tolist() == [0, 1, 2, 3, 4, 5]
    # Steps 3 and 5 hold the second fit's batches, not stale records.
    for step, b in ((3, 0), (5, 2)):
        row = inputs.values[inputs.steps.tolist().index(step)]
        assert row[F["max"]] == pytest.approx(float(second[0][b * 8:(b + 1) * 8].max()))

    # A third fit whose batch 1 holds a NaN: its step is the run's first anomaly.
    _fit(model, _batches(3, 8, seed=3, nan_batch=1), 8, [cb])
    a = _first_anomaly(tmp_path)
    assert (a["step"], a["tensor"], a["nan"]) == (6 + 1, "input", 1)
    assert cb.replay_verdict is not None  # the replay ran the step again (eagerly)

    # A plain fit afterwards runs Keras' own step: nothing more is recorded.
    _fit(model, _batches(2, 8, seed=4), 8, [])
    assert _series(_run(tmp_path), "input").steps.tolist() == list(range(9))


def test_a_fit_after_compile_builds_the_step_again(tmp_path):
    """compile() drops Keras' train function (a new optimizer here): the
    callback builds and traces its step again, and records the new one's."""
    model = _model()
    cb = NumericsCallback(str(tmp_path))
    _fit(model, _batches(3, 8, seed=1), 8, [cb])
    traced = CountingDense.calls
    model.compile(optimizer=keras.optimizers.SGD(0.001), loss="mse")
    second = _batches(3, 8, seed=2, nan_batch=1)
    _fit(model, second, 8, [cb])
    assert CountingDense.calls > traced
    # The new optimizer counts its steps from 0 again: as tf.summary's steps
    # of a restarted run, they stand for the earlier ones.
    inputs = _series(_run(tmp_path), "input")
    assert inputs.steps.tolist() == [0, 1, 2]
    assert inputs.values[0, F["max"]] == pytest.approx(float(second[0][:8].max()))
    a = _first_anomaly(tmp_path)
    assert (a["step"], a["tensor"]) == (1, "input")


def test_a_second_fit_with_another_batch_size_records_the_new_shape(tmp_path):
    """A new batch shape makes Keras trace the step again: the callback's
    wrappers are in place for it, and the records count the new batch."""
    model = _model()
    cb = NumericsCallback(str(tmp_path))
    _fit(model, _batches(2, 8, seed=1), 8, [cb])
    traced = CountingDense.calls
    _fit(model, _batches(2, 4, seed=2), 4, [cb])
    assert CountingDense.calls > traced
    inputs = _series(_run(tmp_path), "input")
    assert inputs.steps.tolist() == [0, 1, 2, 3]
    counts = inputs.values[:, F["count"]].tolist()
    assert counts == [8 * 8, 8 * 8, 4 * 8, 4 * 8]
    out = _series(_run(tmp_path), "d/output")
    assert out.values[:, F["count"]].tolist() == [8 * 4, 8 * 4, 4 * 4, 4 * 4]


class Interrupt(keras.callbacks.Callback):
    """Raises KeyboardInterrupt (Ctrl-C) after batch ``at``: fit ends without on_train_end."""

    def __init__(self, at):
        super().__init__()
        self.at = at

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.at:
            raise KeyboardInterrupt


@pytest.mark.parametrize("again", ["same callback", "new callback"])
def test_a_fit_after_an_interrupted_one_ends_it_first(tmp_path, again):
    """Keras calls on_train_end only when fit returns: after Ctrl-C the wrappers
    stayed on the model (a later plain fit ran the instrumented step) and the
    interrupted steps' records stayed in the writer. The next fit with the
    callback ends that one first."""
    model = _model()
    cb = NumericsCallback(str(tmp_path))
    with pytest.raises(KeyboardInterrupt):
        _fit(model, _batches(6, 8, seed=1), 8, [cb, Interrupt(2)])
    assert int(model.optimizer.iterations.numpy()) == 3  # the oracle: steps 0, 1 and 2 ran

    _fit(model, _batches(3, 8, seed=2), 8, [cb if again == "same callback" else NumericsCallback(str(tmp_path))])
    assert _series(_run(tmp_path), "input").steps.tolist() == [0, 1, 2, 3, 4, 5]
    # Nothing of the callback is left on the model: a plain fit runs Keras' own step.
    assert not {"train_step", "_tb_numerics_fitting"} & set(vars(model))
    assert "call" not in vars(model.get_layer("a"))
    _fit(model, _batches(2, 8, seed=3), 8, [])
    assert _series(_run(tmp_path), "input").steps.tolist() == [0, 1, 2, 3, 4, 5]


def _bn_cnn(policy):
    keras.utils.set_random_seed(0)
    keras.mixed_precision.set_dtype_policy(policy)
    try:
        x = inp = keras.Input((12, 12, 3))
        for i in range(2):
            x = keras.layers.Conv2D(6, 3, padding="same", name="conv%d" % i)(x)
            x = keras.layers.BatchNormalization(name="bn%d" % i)(x)
            x = keras.layers.ReLU(name="relu%d" % i)(x)
        x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
        model = keras.Model(inp, keras.layers.Dense(4, name="head", dtype="float32")(x))
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    opt = keras.optimizers.Adam(1e-3)
    if policy == "mixed_float16":
        opt = keras.optimizers.LossScaleOptimizer(opt)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_two_fits_record_what_one_fit_of_the_same_batches_records(tmp_path, policy):
    """A BatchNorm CNN (moving statistics, Adam's slots, a loss scale): one fit
    of 6 batches and two of 3 (the second on the kept step) train alike, so
    every record, weights and update ratios included, is the same."""
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(48, 12, 12, 3)).astype("float32"), rng.integers(0, 4, 48)
    got = {}
    for name, parts in (("one", [(0, 48)]), ("two", [(0, 24), (24, 48)])):
        model, logdir = _bn_cnn(policy), str(tmp_path / name)
        cb = NumericsCallback(logdir, weights_every_n_steps=2)
        for lo, hi in parts:
            model.fit(x[lo:hi], y[lo:hi], batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[cb])
        got[name] = {s.tag: s for s in _run(logdir).series}
    one, two = got["one"], got["two"]
    assert sorted(one) == sorted(two) and "bn0/output" in one and any(t.startswith("update_ratio/") for t in one)
    for tag in one:
        assert one[tag].steps.tolist() == two[tag].steps.tolist(), tag
        np.testing.assert_allclose(two[tag].values, one[tag].values, rtol=1e-6, atol=0, equal_nan=True, err_msg=tag)
    assert one["loss"].steps.tolist() == list(range(6))
