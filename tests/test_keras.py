"""NumericsCallback on real Keras 3 training: records, stop_on_anomaly, allowlist, tf.distribute."""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tb_numerics
from tb_numerics import analysis, cli, event_reader, record_kernel, rules, stats
from tb_numerics.keras import NumericsCallback

import two_replicas

pytestmark = pytest.mark.e2e


def _analysis(logdir, **params):
    (run,) = event_reader.read_logdir(str(logdir))
    return analysis.analyze_run(run.run, run.series, analysis.parse_safe_range(params))


def _tags(ra, role):
    return [h.series.tag for h in ra.health if h.series.info.role == role]


def _data(n=64, d=8, seed=0):
    rs = np.random.RandomState(seed)
    return rs.randn(n, d).astype("float32"), rs.randn(n, 4).astype("float32")


@pytest.mark.parametrize("kind", ["sequential", "functional"])
def test_per_layer_records_in_layer_order(tmp_path, kind):
    keras.utils.set_random_seed(0)
    if kind == "sequential":
        model = keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(16, activation="relu", name="a"),
             keras.layers.Dense(8, activation="tanh", name="b"), keras.layers.Dense(4, name="c")],
            name="net",
        )
    else:
        inp = keras.Input((8,), name="x")
        h = keras.layers.Dense(16, activation="relu", name="a")(inp)
        h = keras.layers.Dense(8, activation="tanh", name="b")(h)
        model = keras.Model(inp, keras.layers.Dense(4, name="c")(h), name="net")
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    x, y = _data()
    kernel0 = model.get_layer("a").kernel.numpy()
    cb = NumericsCallback(str(tmp_path), weights_every_n_steps=1)
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[cb])
    assert history.history["loss"][0] > 0  # the loss metric still works

    ra = _analysis(tmp_path)
    assert _tags(ra, "activation") == ["a/output", "b/output", "c/output"]
    # Variable paths: a Sequential model prefixes its name, a functional one does not.
    prefix = "net/" if kind == "sequential" else ""
    assert _tags(ra, "loss") == ["loss"]
    # Backward order, as backpropagation runs (and as log_gradients writes).
    assert _tags(ra, "gradient") == [
        "gradients/%s%s/%s" % (prefix, l, w) for l in "cba" for w in ("bias", "kernel")
    ]
    assert _tags(ra, "global_norm") == ["gradients/global_norm"]
    assert _tags(ra, "weight") == [
        "%s%s/%s" % (prefix, l, w) for l in "abc" for w in ("kernel", "bias")
    ] + ["update_ratio/%s" % l for l in "abc"]
    # Every step of optimizer.iterations (0..7) is recorded for every tensor.
    for h in ra.health:
        assert h.series.steps.tolist() == list(range(8)), h.series.tag
    # The first recorded weight is the initial kernel; the update ratio is ||dw|| / ||w||.
    a = ra.find(prefix + "a/kernel").series.values
    assert a[0, 0] == 8 * 16
    np.testing.assert_allclose(a[0, 4:8], [kernel0.min(), kernel0.max(), kernel0.sum(), np.square(kernel0).sum()],
                               rtol=1e-5)
    ratio = ra.find("update_ratio/a").series.values[:, 5]
    assert np.all((ratio > 0) & (ratio < 1))
    # With SGD, dw = -lr * g: the ratio is lr * ||g|| / ||w|| from the same step's records.
    sq = lambda tag: ra.find(prefix + tag).series.values[:, 7]  # noqa: E731  sum of squares
    g2 = ra.find("gradients/%sa/kernel" % prefix).series.values[:, 7] + ra.find("gradients/%sa/bias" % prefix).series.values[:, 7]
    np.testing.assert_allclose(ratio, 0.01 * np.sqrt(g2 / (sq("a/kernel") + sq("a/bias"))), rtol=1e-4)
    assert analysis.first_anomaly(ra) is None
    # The model is left as it was: no wrapper outlives fit.
    assert "call" not in vars(model.get_layer("a"))
    assert "apply" not in vars(model.optimizer) and "train_step" not in vars(model)


def test_callback_without_weights_or_update_ratios(tmp_path):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, name="a")])
    model.compile(optimizer="sgd", loss="mse")
    x, y = _data()
    cb = NumericsCallback(str(tmp_path), weights=False, update_ratios=False)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[cb])
    ra = _analysis(tmp_path)
    assert _tags(ra, "activation") == ["a/output"] and _tags(ra, "weight") == []
    assert len(_tags(ra, "gradient")) == 2 and ra.find("gradients/global_norm") is not None


def test_an_epochs_steps_are_on_disk_when_the_next_epoch_starts(tmp_path):
    """Packed steps wait in the writer (up to 50 per event); each epoch's end
    writes them, so TensorBoard shows a whole epoch during validation and
    the next one, not only when training ends."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, name="a")])
    model.compile(optimizer="sgd", loss="mse")
    x, y = _data()
    seen = {}

    class Probe(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            runs = event_reader.read_logdir(str(tmp_path))
            seen[epoch] = sorted({int(st) for r in runs for s in r.series for st in s.steps})

    model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[NumericsCallback(str(tmp_path)), Probe()])
    assert seen == {0: [], 1: [0, 1, 2, 3]}


_ENDED_AT_THE_NAN = """
import os, sys
import keras, numpy as np
from tb_numerics.keras import NumericsCallback
logdir, bad, how, args = sys.argv[1], int(sys.argv[2]), sys.argv[3], eval(sys.argv[4])


class Preempted(keras.callbacks.Callback):  # after NumericsCallback: the process ends there
    def on_train_batch_end(self, batch, logs=None):
        if batch == bad:
            os._exit(0)


class RaiseOnNan(keras.callbacks.Callback):  # before NumericsCallback: its batch end never runs
    def on_train_batch_end(self, batch, logs=None):
        if not np.isfinite(logs["loss"]):
            raise RuntimeError("NaN loss at batch %d" % batch)


keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, name="d")], name="net")
model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
rs = np.random.RandomState(0)
x, y = rs.randn(8 * 80, 8).astype("float32"), rs.randn(8 * 80, 4).astype("float32")
x[8 * bad + 2, 5] = np.nan
numerics = NumericsCallback(logdir, **args)
callbacks = [numerics, Preempted()] if how == "preempted" else [RaiseOnNan(), numerics]
model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=callbacks)
"""


def _first_anomaly_of_a_fit_ended_at_the_nan(logdir, bad: int, how: str, callback_args: dict,
                                             backend: str = "tensorflow") -> tuple:
    """(the child's stderr and exit code, the first anomaly on disk) of a fit
    whose batch ``bad`` holds a NaN and that ends there ``how``, on Keras' ``backend``."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND=backend)
    out = subprocess.run([sys.executable, "-c", _ENDED_AT_THE_NAN, str(logdir), str(bad), how, repr(callback_args)],
                         capture_output=True, text=True, env=env, timeout=300)
    runs = event_reader.read_logdir(str(logdir))
    assert len(runs) == 1, (runs, out.stderr[-2000:])
    return out, analysis.run_summary(analysis.analyze_run(runs[0].run, runs[0].series))["first_anomaly"]


@pytest.mark.parametrize("callback_args", [{"replay": False}, {"replay": False, "every_n_steps": 10}, {}],
                         ids=["no_replay", "no_replay_every_10", "defaults"])
def test_a_step_holding_a_nan_is_on_disk_before_the_next_callback_runs(tmp_path, callback_args):
    """A callback after NumericsCallback may end the process (a preemption, an
    os._exit) at the batch whose input holds the NaN (the injected fault):
    that step is on disk by then, whatever the replay setting."""
    out, first = _first_anomaly_of_a_fit_ended_at_the_nan(tmp_path, 61, "preempted", callback_args)
    assert out.returncode == 0, out.stderr[-2000:]
    assert first is not None and first["step"] == 61, first


@pytest.mark.parametrize("bad", [4, 61])
@pytest.mark.parametrize("callback_args", [{}, {"every_n_steps": 10}], ids=["defaults", "every_10"])
def test_a_fit_a_callback_before_it_ended_by_raising_keeps_the_nan_step(tmp_path, callback_args, bad):
    """A callback listed before NumericsCallback raises at the NaN loss (the
    fault injected in batch ``bad``): Keras runs no later callback and no
    on_train_end, and the process ends with the exception. The records of
    the steps run, that one included, are on disk."""
    out, first = _first_anomaly_of_a_fit_ended_at_the_nan(tmp_path, bad, "raised", callback_args)
    assert out.returncode == 1 and "NaN loss at batch %d" % bad in out.stderr, out.stderr[-2000:]
    assert first is not None and first["step"] == bad, first


def test_a_fit_a_callback_before_it_ended_by_raising_keeps_the_nan_step_on_jax(tmp_path):
    """The test above on Keras' JAX backend, whose step's records reach the
    callback beside the batch's logs (taken out before any callback sees them)."""
    pytest.importorskip("jax")
    out, first = _first_anomaly_of_a_fit_ended_at_the_nan(tmp_path, 4, "raised", {}, "jax")
    assert out.returncode == 1 and "NaN loss at batch 4" in out.stderr, out.stderr[-2000:]
    assert first is not None and first["step"] == 4, first


def _fit_with_nan_in_batch_5(logdir, **callback_args) -> analysis.RunAnalysis:
    """8 steps of a one-layer model whose batch 5 holds a NaN, with the callback; its records."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, activation="tanh", name="d")], name="net")
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    x, y = _data()
    x[5 * 8 + 3, 2] = np.nan  # batch 5 of 8
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
              callbacks=[NumericsCallback(str(logdir), **callback_args)])
    return _analysis(logdir)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_steps_per_execution_keeps_every_steps_records(tmp_path, jit_compile):
    """Several steps per call of the train function (one slot each): every
    step is written, the first bad one is still step 5, also under XLA,
    which wants a slice's bounds known when it compiles (the slot is not)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, activation="tanh", name="d")], name="net")
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", steps_per_execution=4, jit_compile=jit_compile)
    x, y = _data()
    x[5 * 8 + 3, 2] = np.nan  # batch 5 of 8
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[NumericsCallback(str(tmp_path))])
    ra = _analysis(tmp_path)
    assert ra.find("d/output").series.steps.tolist() == list(range(8))
    _assert_the_nan_batch_is_first(ra)


def _assert_the_nan_batch_is_first(ra: analysis.RunAnalysis) -> dict:
    """Batch 5's NaN is the input's (the batch as it arrived), then the layer's (4 units)."""
    a = analysis.first_anomaly(ra)
    assert (a["step"], a["tensor"], a["phase"], a["nan"]) == (5, "input", "input", 1)
    d = ra.find("d/output")
    assert d.series.values[d.series.steps.tolist().index(5), 1] == 4
    return a


def test_a_replay_holds_back_the_update_of_a_nonfinite_step(tmp_path):
    """Issue 14: the NaN batch's update is not applied (the weights the
    replay needs), so the steps after it train on finite weights."""
    ra = _fit_with_nan_in_batch_5(tmp_path, weights_every_n_steps=3)
    assert ra.find("d/output").series.steps.tolist() == list(range(8))
    for tag in ("net/d/kernel", "net/d/bias"):
        assert ra.find(tag).series.steps.tolist() == [0, 3, 5, 6], tag
        assert not ra.find(tag).codes.any()  # finite at step 6, after the bad step
    assert analysis.first_anomaly(ra)["step"] == 5


def test_records_compiled_for_a_gpu_are_the_uncompiled_ones(tmp_path, monkeypatch):
    """Where a GPU is visible, each record is one XLA computation inside the
    uncompiled step (stats._traced). No GPU here: the device check is
    stubbed and XLA runs the records on the CPU. Same records, same answer."""
    plain = _fit_with_nan_in_batch_5(tmp_path / "plain")
    traced = []
    real_traced = stats._traced
    monkeypatch.setattr(stats, "_xla_gpu_visible", lambda: True)
    monkeypatch.setattr(stats, "_traced", lambda *key: traced.append(key) or real_traced(*key))
    compiled = _fit_with_nan_in_batch_5(tmp_path / "compiled")
    assert traced and all(key[2] for key in traced)
    assert [h.series.tag for h in compiled.health] == [h.series.tag for h in plain.health]
    for h in plain.health:
        got = compiled.find(h.series.tag).series
        np.testing.assert_array_equal(got.steps, h.series.steps)
        # Sums to float32's accumulation precision (tests/test_stats.py's):
        # XLA's float32 reductions and the record kernel's sum in other orders.
        np.testing.assert_allclose(got.values, h.series.values, rtol=1e-5, equal_nan=True, err_msg=h.series.tag)
    want, got = _assert_the_nan_batch_is_first(plain), _assert_the_nan_batch_is_first(compiled)
    assert (got["step"], got["tensor"], got["nan"]) == (want["step"], want["tensor"], want["nan"])


@pytest.mark.parametrize("kernel", [True, False], ids=["record_kernel", "tf_ops"])
def test_weights_are_recorded_every_weights_every_n_steps_and_at_a_bad_step(tmp_path, kernel):
    # With the record kernel a due step's weights are kept with no cond
    # (stats.keep_if); with TensorFlow's ops, in a cond and a snapshot variable.
    if kernel and record_kernel.load() is None:
        pytest.skip("the record kernel is not built on this machine")
    with record_kernel.use(kernel):
        ra = _fit_with_nan_in_batch_5(tmp_path, weights_every_n_steps=3, replay=False)
    assert ra.find("d/output").series.steps.tolist() == list(range(8))
    # Without replay training is unchanged: every 3rd step, and the steps
    # whose loss is NaN: step 5's batch, then every step after it (its
    # update made the weights NaN).
    for tag in ("net/d/kernel", "net/d/bias"):
        assert ra.find(tag).series.steps.tolist() == [0, 3, 5, 6, 7], tag
    # An update ratio needs finite weights before the update.
    assert ra.find("update_ratio/d").series.steps.tolist() == [0, 3, 5]
    assert ra.find("net/d/kernel").series.values[:3, 1].tolist() == [0, 0, 0]
    assert ra.find("net/d/kernel").series.values[3, 1] == 8 * 4  # NaN weights at step 6
    # The update ratio of a recorded step is that step's ||dw|| / ||w||: with SGD, lr * ||g|| / ||w||.
    sq = lambda tag: ra.find(tag).series.values[:, 7]  # noqa: E731  sum of squares
    g2 = np.array([sq("gradients/net/d/kernel")[s] + sq("gradients/net/d/bias")[s] for s in (0, 3)])
    ratio = ra.find("update_ratio/d").series.values[:2, 5]
    np.testing.assert_allclose(ratio, 0.01 * np.sqrt(g2 / (sq("net/d/kernel")[:2] + sq("net/d/bias")[:2])), rtol=1e-4)


@pytest.mark.parametrize("every_n, weights_every_n", [(1, 0), (4, 6), (2, 2.0), (1, True)])
def test_weights_every_n_steps_must_be_a_multiple_of_every_n_steps(tmp_path, every_n, weights_every_n):
    with pytest.raises(ValueError, match="weights_every_n_steps must be a positive multiple of every_n_steps"):
        NumericsCallback(str(tmp_path), every_n_steps=every_n, weights_every_n_steps=weights_every_n)


def test_every_n_steps_keeps_first_bad_step_and_the_step_before(tmp_path):
    ra = _fit_with_nan_in_batch_5(tmp_path, every_n_steps=4)
    assert ra.find("d/output").series.steps.tolist() == [0, 4, 5]
    assert _assert_the_nan_batch_is_first(ra)["last_healthy_step"] == 4


def _diverging_model() -> keras.Model:
    """Three Dense layers under SGD at a learning rate far too large, seeded the same each call."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(32, name="d1"), keras.layers.Dense(32, name="d2"),
         keras.layers.Dense(4, name="d3")],
        name="net",
    )
    model.compile(optimizer=keras.optimizers.SGD(50.0), loss="mse")
    return model


def test_stop_on_anomaly_stops_at_the_first_nonfinite_step_and_layer(tmp_path, capsys):
    # A learning rate far too large: the weights grow until a layer overflows.
    model = _diverging_model()
    x, y = _data(n=512)
    cb = NumericsCallback(str(tmp_path), stop_on_anomaly=True)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[cb])
    a = cb.anomaly
    assert a is not None
    step = a["step"]
    # Training stopped right after the bad step, not at the end of the epoch;
    # the bad step's update was held back for the replay.
    assert int(model.optimizer.iterations) == step < 32
    # It is the first non-finite record of the run, and the one the CLI reports.
    ra = _analysis(tmp_path)
    assert analysis.first_anomaly(ra)["tensor"] == a["tensor"]
    assert ra.steps.max() == step
    out = capsys.readouterr().err
    assert "step %d" % step in out and a["tensor"] in out and a["description"] in out

    # Independently: the same training without the callback, then the layers
    # run on the bad batch. The first non-finite layer output (or loss) is the one reported.
    ref = _diverging_model()
    for i in range(step):
        ref.train_on_batch(x[16 * i:16 * (i + 1)], y[16 * i:16 * (i + 1)])
    h = x[16 * step:16 * (step + 1)]
    first_bad = None
    for layer in ref.layers:
        h = layer(h)
        if first_bad is None and not np.all(np.isfinite(h)):
            first_bad = "%s/output" % layer.name
    loss = keras.losses.MeanSquaredError()(y[16 * step:16 * (step + 1)], h)
    if first_bad is None and not np.isfinite(loss):
        first_bad = "loss"  # the outputs were finite, their squares overflowed
    if a["phase"] == "forward":
        assert a["tensor"] == first_bad
    else:  # the forward pass was finite; the gradients overflowed first
        assert first_bad is None and a["role"] in ("gradient", "global_norm")


def _masked_model():
    mask = tf.constant([0.0, 0.0, -np.inf, -np.inf])
    inp = keras.Input((4,))
    h = keras.layers.Lambda(lambda t: t + mask, name="mask")(inp)
    h = keras.layers.Softmax(name="attn")(h)
    return keras.Model(inp, keras.layers.Dense(2, name="out")(h), name="net")


@pytest.mark.parametrize("every_n_steps", [1, 2])
def test_allowlisted_neginf_is_not_an_anomaly_but_nan_in_it_is(tmp_path, capsys, every_n_steps):
    """Issue 13 item 1: the allowlist is known where the every-N latch
    decides, and is written into the run: the CLI applies it unasked."""
    keras.utils.set_random_seed(0)
    model = _masked_model()
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    rs = np.random.RandomState(0)
    x, y = rs.randn(40, 4).astype("float32"), rs.randn(40, 2).astype("float32")
    x[3 * 8, 0] = np.nan  # batch 3: a NaN in the masked tensor itself
    cb = NumericsCallback(str(tmp_path), every_n_steps=every_n_steps, stop_on_anomaly=True,
                          allow_neginf=["mask/output"])
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[cb])
    # Steps 0-2 carried the intended -inf and went on; the NaN at step 3
    # stopped it, the batch's NaN (before the mask's, below).
    assert (cb.anomaly["step"], cb.anomaly["tensor"], cb.anomaly["nan"]) == (3, "input", 1)
    assert "stopping training at step 3, input" in capsys.readouterr().err
    mask = _analysis(tmp_path).find("mask/output")
    # The N-th steps, and the NaN step with the step before it: the -Inf did not latch.
    written = [0, 1, 2, 3] if every_n_steps == 1 else [0, 2, 3]
    assert mask.series.steps.tolist() == written
    assert mask.series.values[:-1, 3].tolist() == [16.0] * (len(written) - 1)  # 2 of 4 columns x 8 rows
    assert mask.codes.tolist() == [analysis.HEALTHY] * (len(written) - 1) + [analysis.NONFINITE]
    assert mask.series.info.neginf_ok

    # The same through the CLI, without repeating the allowlist: the NaN.
    capsys.readouterr()
    assert cli.main(["report", "--json", str(tmp_path)]) == 1
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    assert (run["first_anomaly"]["step"], run["first_anomaly"]["nan"]) == (3, 1)


def test_the_documented_spelling_works_after_a_plain_import():
    """Issue 13 item 12: ``import tb_numerics`` then ``tb_numerics.keras.NumericsCallback``."""
    assert tb_numerics.keras.NumericsCallback is NumericsCallback
    assert tb_numerics.xla.CompiledStats is not None


_MIRRORED_FIT = """
    import keras
    from tb_numerics import event_reader
    from tb_numerics.keras import NumericsCallback
    from tb_numerics.records import numpy_stats

    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, name="d")], name="net")
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    rs = np.random.RandomState(0)
    x, y = rs.randn(32, 8).astype("float32"), rs.randn(32, 4).astype("float32")
    x[16 + 11, 2] = np.nan  # batch 1, in the half replica 1 gets
    kernel, bias = (w.numpy() for w in model.get_layer("d").weights)
    first_batch = numpy_stats(x[:16] @ kernel + bias)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0,
              callbacks=[NumericsCallback(sys.argv[1], weights_every_n_steps=1)])
    (run,) = event_reader.read_logdir(sys.argv[1])
    got = {s.tag: (s.steps.tolist(), s.values.tolist()) for s in run.series}
    print(json.dumps({"got": got, "first_batch": first_batch.tolist(), "kernel": numpy_stats(kernel).tolist()}))
    """


def test_callback_under_mirrored_strategy_records_all_replicas_once(tmp_path):
    res = two_replicas.run(_MIRRORED_FIT, str(tmp_path))
    got = res["got"]
    steps, values = got["d/output"]
    assert steps == [0, 1]  # one record per step, not one per replica
    # Step 0: the layer's output over the whole batch of 16 (8 rows on each replica).
    np.testing.assert_allclose(values[0], res["first_batch"], rtol=1e-5)
    # Step 1: the NaN row lives on replica 1 only, and is seen.
    assert values[1][0] == 16 * 4 and values[1][1] == 4
    # The weights are the same on every replica: recorded once, not doubled.
    np.testing.assert_allclose(got["net/d/kernel"][1][0], res["kernel"], rtol=1e-6)
    assert got["gradients/net/d/kernel"][0] == [0, 1] and got["gradients/net/d/kernel"][1][0][0] == 8 * 4 * 2


def test_the_state_of_trainable_layers_is_recorded_and_a_frozen_layers_is_not(tmp_path):
    """The non-trainable variables a forward pass updates (a trainable
    BatchNormalization's moving statistics) are written with the weights;
    a frozen layer's, which never change (a frozen base of a fine-tuned
    model, millions of values), are not computed every step. The truth:
    which variables Keras changed over the fit."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, name="frozen_dense"),
                              keras.layers.BatchNormalization(name="frozen_bn"), keras.layers.Dense(16, name="dense"),
                              keras.layers.BatchNormalization(name="bn"), keras.layers.Dense(4, name="head")], name="net")
    for name in ("frozen_dense", "frozen_bn"):
        model.get_layer(name).trainable = False
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    before = {v.path: v.numpy().copy() for v in model.non_trainable_variables}
    x, y = _data(n=12 * 4)
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[NumericsCallback(str(tmp_path))])
    after = {v.path: v.numpy() for v in model.non_trainable_variables}
    changed = {p for p, v in before.items() if not np.array_equal(v, after[p])}
    assert changed == {"net/bn/moving_mean", "net/bn/moving_variance"}  # the oracle: what the forward passes updated
    ra = _analysis(tmp_path)
    steps = {h.series.tag: sorted(int(s) for s in h.series.steps) for h in ra.health}
    for path in changed:
        assert steps[path] == [0, 10], path  # with the weights (every 10 steps), none of them non-finite
        assert [h.series.info.description for h in ra.health if h.series.tag == path] == [
            "non-trainable variable of a BatchNormalization, updated by the forward pass"]
    assert not {p for p in steps if p.startswith(("net/frozen_dense/", "net/frozen_bn/"))}


def test_a_moving_statistic_that_absorbs_an_outlier_batch_is_no_divergence(tmp_path):
    """One sample 300x the others at step 12 (the zoo's trigger): a
    BatchNormalization's moving variance takes in its batch's variance and
    climbs 100x between two weights steps while training stays healthy. The
    moving statistics follow the data, as the input batch does: no growth
    warning names them. The truth: Keras' own layer (its moving variance
    read before steps 10 and 21) and Keras' losses (finite at every step)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, name="dense"),
                              keras.layers.BatchNormalization(name="bn"), keras.layers.Dense(4, name="head")], name="net")
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    x, y = _data(n=30 * 8)
    x[12 * 8] *= 300.0
    variance, losses = {}, []

    class Keras(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch in (10, 21):
                variance[batch] = float(np.max(model.get_layer("bn").moving_variance.numpy()))

        def on_train_batch_end(self, batch, logs=None):
            losses.append(logs["loss"])

    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
              callbacks=[NumericsCallback(str(tmp_path)), Keras()])
    assert variance[21] >= 100 * variance[10] and np.all(np.isfinite(losses)), (variance, losses)
    ra = _analysis(tmp_path)
    kind = {rules.kind_code(k.name): k.name for k in rules.KINDS}
    named = [(h.series.tag, sorted({kind[int(c)] for c in h.kinds if c})) for h in ra.health
             if "/moving_" in h.series.tag]
    assert len(named) == 2 and all(not kinds for _, kinds in named), named


def test_a_state_variable_a_user_made_trainable_is_recorded_once_as_a_weight(tmp_path):
    """BatchNorm's moving mean, created non-trainable, made trainable by the
    user: Keras lists it with the trainable variables (the truth), so its
    record is a weight's, once per weights step, not a state's beside it."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.BatchNormalization(name="bn"),
                              keras.layers.Dense(1)], name="net")
    model.get_layer("bn").moving_mean.trainable = True
    assert "net/bn/moving_mean" in [v.path for v in model.trainable_variables]
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    x, y = _data(n=64, d=4)
    model.fit(x, y[:, :1], batch_size=8, verbose=0, callbacks=[NumericsCallback(str(tmp_path))])
    ra = _analysis(tmp_path)
    steps = {h.series.tag: [int(s) for s in h.series.steps] for h in ra.health}
    assert steps["net/bn/moving_mean"] == [0] and steps["net/bn/moving_variance"] == [0]
