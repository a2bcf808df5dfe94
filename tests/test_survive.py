"""Skip, rewind or stop, each with its diagnosis (issue 31), through real ``model.fit``.

Each training is small and shared by the tests that read it (module-scoped
fixtures). The truth of "which step" is an oracle beside the callback: a
``tf.summary.scalar`` written by a plain Keras callback at the step ``fit``
trains the injected batch (the count of batches trained before it, which is
the step the records are written at); of "it diverges", the same training
without tb-numerics (its own loss goes non-finite); of "the loss scale was
put back", Keras' ``LossScaleOptimizer`` halving its scale at a skip.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import pathlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import backend_runs
import tb_numerics as tbn
import two_replicas
from tb_numerics import cli
from tb_numerics.keras import NumericsCallback

pytestmark = pytest.mark.e2e

BATCHES = 12  # per epoch
BAD = 4  # the corrupt batch


def _report(logdir) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = cli.main(["report", "--json", str(logdir)])
    (run,) = json.loads(out.getvalue())["runs"]
    return dict(run, status=status)


def _report_text(logdir) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli.main(["report", str(logdir)])
    return out.getvalue()


class _BatchOracle(keras.callbacks.Callback):
    """Writes ``oracle/bad`` = 1 at the step ``fit`` trains a batch for which
    ``is_bad(epoch, batch)``: the number of batches trained before it."""

    def __init__(self, logdir, is_bad):
        super().__init__()
        self._writer = tf.summary.create_file_writer(str(logdir), filename_suffix=".oracle")
        self._is_bad, self._calls, self._epoch = is_bad, 0, 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self._is_bad(self._epoch, batch):
            with self._writer.as_default():
                tf.summary.scalar("oracle/bad", 1.0, step=self._calls)
        self._calls += 1

    def on_train_end(self, logs=None):
        self._writer.close()


def _oracle_steps(logdir) -> list[int]:
    steps = []
    for path in sorted(pathlib.Path(logdir).glob("events.out.tfevents.*.oracle")):
        steps += [int(e.step) for e in tf.compat.v1.train.summary_iterator(str(path))
                  for v in e.summary.value if v.tag == "oracle/bad"]
    return steps


def _data(seed: int = 0, scale: float = 1.0):
    rs = np.random.RandomState(seed)
    x = (rs.randn(16 * BATCHES, 8) * scale).astype("float32")
    return x, np.tanh(x[:, :2].sum(1, keepdims=True)).astype("float32")


def _mlp(width: int = 16, out_dtype: str | None = None):
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(width, activation="tanh", name="hidden"),
                             keras.layers.Dense(1, name="out", dtype=out_dtype)], name="mlp")


def _finite(model) -> bool:
    return all(bool(np.isfinite(np.asarray(w)).all()) for w in model.weights)


# ---------------------------------------------------------------- skip


@pytest.fixture(scope="module")
def skipped(tmp_path_factory):
    """One corrupt batch (a NaN in one feature), met in each of two epochs."""
    logdir = tmp_path_factory.mktemp("skip")
    x, y = _data()
    x[16 * BAD + 5, 3] = np.nan
    model = _mlp()
    model.compile(keras.optimizers.Adam(1e-2), "mse")
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=[
        _BatchOracle(logdir, lambda e, b: b == BAD), NumericsCallback(str(logdir), on_anomaly="skip")])
    return dict(logdir=logdir, model=model, history=history.history)


def test_one_corrupt_batch_is_skipped_and_the_report_names_it(skipped):
    truth = _oracle_steps(skipped["logdir"])
    assert truth == [BAD, BATCHES + BAD]
    model = skipped["model"]
    # Training finished, finite, every batch but the corrupt one applied.
    assert _finite(model) and int(model.optimizer.iterations) == 2 * (BATCHES - 1)
    assert np.isfinite(skipped["history"]["loss"]).all()  # the held step's NaN left the epoch's mean
    run = _report(skipped["logdir"])
    actions = run["actions"]
    events = actions["events"]
    assert [(e["step"], e["epoch"], e["batch"]) for e in events] == [(truth[0], 0, BAD), (truth[1], 1, BAD)]
    assert all((e["action"], e["trigger"], e["tensor"]) == ("skip", "nonfinite", "input") for e in events)
    assert actions["failed_batches"] == [{"step": truth[0], "epoch": 0, "batch": BAD},
                                         {"step": truth[1], "epoch": 1, "batch": BAD}]
    assert actions["words"] == "survived 2 non-finite steps (skipped)" and not actions["stopped"]
    # The diagnosis is the first anomaly's: the batch as it arrived.
    assert run["first_anomaly"]["step"] == truth[0] and run["first_anomaly"]["phase"] == "input"
    assert events[0]["hint"] == run["first_anomaly"]["hint"] and "feature 3" in events[0]["hint"]
    assert run["status"] == 1  # a NaN was met: survived, not healthy
    text = _report_text(skipped["logdir"])
    assert "actions: survived 2 non-finite steps (skipped)" in text
    assert "step %d (epoch 1, batch %d): skip (input: 1 NaN of 128 values)" % (truth[1], BAD) in text


def test_a_run_trained_again_skips_the_batches_that_failed(skipped, tmp_path):
    listed = tbn.survive.failed_batches(str(skipped["logdir"]))
    assert listed == [(0, BAD), (1, BAD)]
    x, y = _data()
    x[16 * BAD + 5, 3] = np.nan
    model = _mlp()
    model.compile(keras.optimizers.Adam(1e-2), "mse")
    # on_anomaly="stop" would stop at the NaN batch: listed, it is skipped instead.
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=[
        NumericsCallback(str(tmp_path), on_anomaly="stop", skip_batches=listed, replay=False)])
    actions = _report(tmp_path)["actions"]
    assert [(e["epoch"], e["batch"], e["action"], e["trigger"]) for e in actions["events"]] == [
        (0, BAD, "skip", "listed"), (1, BAD, "skip", "listed")]
    assert not actions["stopped"] and actions["words"] == "survived 2 listed batches (skipped)"
    assert _finite(model) and int(model.optimizer.iterations) == 2 * (BATCHES - 1)
    # The same weights as the run that skipped them when they failed.
    for a, b in zip(model.weights, skipped["model"].weights):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


def test_skip_batches_is_refused_where_it_cannot_hold_one_batch_back(tmp_path):
    with pytest.raises(ValueError, match="skip_batches needs an on_anomaly policy"):
        NumericsCallback(str(tmp_path), skip_batches=[(0, 1)])
    x, y = _data()
    model = _mlp()
    model.compile(keras.optimizers.SGD(1e-2), "mse", steps_per_execution=2)
    with pytest.raises(ValueError, match="steps_per_execution=2 runs several batches per call"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[
            NumericsCallback(str(tmp_path), on_anomaly="skip", skip_batches=[(0, 1)])])
    assert int(model.optimizer.iterations) == 0


# ---------------------------------------------------------------- the state a forward pass updates


def _bn_fit(x, y, callbacks=()) -> keras.Model:
    """backend_runs' BatchNormalization model, one epoch of ``x`` in order."""
    model = backend_runs.bn_model()
    model.fit(x, y, batch_size=backend_runs.BATCH, epochs=1, shuffle=False, verbose=0, callbacks=list(callbacks))
    return model


@contextlib.contextmanager
def _mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy("float32")


def _without_batch(x, y, batch: int):
    keep = np.r_[0 : batch * backend_runs.BATCH, (batch + 1) * backend_runs.BATCH : len(x)]
    return x[keep], y[keep]


def _assert_same_variables(model, reference) -> None:
    """Every variable, trainable or not (BatchNormalization's moving statistics), equal to the reference's."""
    assert [v.path for v in model.variables] == [v.path for v in reference.variables]
    for a, b in zip(model.variables, reference.variables):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7, err_msg=a.path)


@pytest.mark.parametrize("policy", ["skip", None], ids=["skip", "held_for_the_replay"])
def test_a_held_back_step_leaves_no_trace_in_the_moving_statistics(tmp_path, policy):
    """A batch of NaN inputs makes BatchNormalization's moving statistics NaN
    in the forward pass, before any update. A step held back (skipped, or
    held for the replay without a policy) leaves the model as the same
    training without that batch leaves it (plain Keras, the oracle): its
    predictions finite, not NaN for ever."""
    x, y = backend_runs.bn_data()
    bad = backend_runs.BAD_STEP
    x[bad * backend_runs.BATCH : (bad + 1) * backend_runs.BATCH] = np.nan
    model = _bn_fit(x, y, [NumericsCallback(str(tmp_path), on_anomaly=policy)])
    _assert_same_variables(model, _bn_fit(*_without_batch(x, y, bad)))
    assert np.isfinite(model.predict(x[:8], verbose=0)).all()
    run = _report(tmp_path)
    assert run["first_anomaly"]["step"] == bad and run["first_anomaly"]["tensor"] == "input"
    assert [e["step"] for e in (run["actions"] or {"events": []})["events"]] == ([bad] if policy else [])


def test_a_moving_statistic_gone_inf_is_skipped_with_its_step(tmp_path):
    """A finite batch of 3e19 makes the moving variance +Inf while the loss and
    the gradients stay finite (backend_runs.run_moving_variance). Under
    ``on_anomaly="skip"`` that step is held back whole, at the step after
    which plain Keras' own moving variance first went non-finite (a callback
    reading it, in a training without tb-numerics): the model is then as the
    training without that batch leaves it."""
    x, y = backend_runs.bn_data()
    oracle = backend_runs._MovingVarianceOracle()  # noqa: SLF001 - the tests' own oracle
    _bn_fit(x, y, [oracle])
    assert oracle.bad, "the fault did not make the moving variance non-finite"
    truth = oracle.bad[0]
    model = _bn_fit(x, y, [NumericsCallback(str(tmp_path), on_anomaly="skip")])
    _assert_same_variables(model, _bn_fit(*_without_batch(x, y, truth)))
    (event,) = _report(tmp_path)["actions"]["events"]
    assert (event["step"], event["action"], event["trigger"]) == (truth, "skip", "nonfinite")
    assert event["tensor"] == model.get_layer("bn").moving_variance.path


# ---------------------------------------------------------------- persistent NaN: K skips, then stop


@pytest.fixture(scope="module")
def persistent(tmp_path_factory):
    """Every batch from BAD on holds a NaN: two skips, then the stop."""
    logdir = tmp_path_factory.mktemp("persistent")
    x, y = _data()
    x[16 * BAD:, 0] = np.nan
    model = _mlp()
    model.compile(keras.optimizers.SGD(1e-2), "mse")
    cb = NumericsCallback(str(logdir), on_anomaly=tbn.OnAnomaly("skip", max_skips=2))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0,
                  callbacks=[_BatchOracle(logdir, lambda e, b: b >= BAD), cb])
    return dict(logdir=logdir, model=model, cb=cb, stderr=err.getvalue())


def test_a_persistent_nan_escalates_after_k_skips_and_stops_with_the_diagnosis(persistent):
    truth = _oracle_steps(persistent["logdir"])
    model = persistent["model"]
    actions = _report(persistent["logdir"])["actions"]
    assert [(e["step"], e["action"]) for e in actions["events"]] == list(zip(truth[:3], ("skip", "skip", "stop")))
    assert actions["stopped"] and actions["stopped_at"] == truth[2]
    assert actions["events"][2]["reason"] == "3 anomalous steps in a row (at most 2 skipped)"
    assert actions["words"] == "survived 2 non-finite steps (skipped); stopped at step %d: %s" % (
        truth[2], actions["events"][2]["reason"])
    # Stopped there, with finite weights, and the diagnosis printed.
    assert int(model.optimizer.iterations) == BAD and _finite(model)
    assert persistent["cb"].anomaly["step"] == truth[0]
    assert "tb-numerics: stopping training at step %d, input" % truth[0] in persistent["stderr"]


# ---------------------------------------------------------------- rewind


def _diverging(logdir, policy, checkpoint: bool = False, replay: bool = False):
    """A linear regression at a learning rate 10x beyond its stable range:
    the weights grow by a factor at each step, the loss is +Inf at step 15.
    ``checkpoint``: a ModelCheckpoint writes the weights at each epoch's end,
    and the policy rewinds to its newest file. ``replay``: each event's step
    replayed at op level (seconds each; one run checks it)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(1.0), "mse")
    x, _ = _data(2, scale=3.0)
    y = x.sum(1, keepdims=True)
    callbacks = [] if policy is None else [NumericsCallback(str(logdir), on_anomaly=policy, weights=False,
                                                            replay=replay)]
    if checkpoint:
        saver = keras.callbacks.ModelCheckpoint(str(logdir / "ckpt-{epoch:02d}.weights.h5"), save_weights_only=True)
        callbacks = [saver, NumericsCallback(str(logdir), on_anomaly=dataclasses.replace(policy, checkpoint=saver),
                                             weights=False, replay=replay)]
    history = model.fit(x, y, batch_size=16, epochs=EPOCHS_DIVERGING, shuffle=False, verbose=0, callbacks=callbacks)
    return dict(logdir=logdir, model=model, loss=history.history["loss"])


EPOCHS_DIVERGING = 4  # room for three divergences of 15 steps


@pytest.fixture(scope="module")
def diverging(tmp_path_factory):
    base = tmp_path_factory.mktemp("diverging")
    return {
        "plain": _diverging(base / "plain", None),
        "same_lr": _diverging(base / "same_lr", tbn.OnAnomaly("rewind", max_rewinds=2)),
        "lr_factor": _diverging(base / "lr_factor", tbn.OnAnomaly("rewind", lr_factor=0.1), replay=True),
        "checkpoint": _diverging(base / "checkpoint", tbn.OnAnomaly("rewind", lr_factor=0.1), checkpoint=True),
    }


def test_a_run_that_diverges_at_the_same_learning_rate_rewinds_then_stops(diverging):
    # The truth: the same training without tb-numerics diverges.
    assert not np.isfinite(diverging["plain"]["loss"]).all() or not _finite(diverging["plain"]["model"])
    run = diverging["same_lr"]
    actions = _report(run["logdir"])["actions"]
    assert [e["action"] for e in actions["events"]] == ["rewind", "rewind", "stop"], actions["words"]
    assert all("lr_factor" not in e for e in actions["events"])
    assert _finite(run["model"])  # stopped on the state it rewound to


def test_a_learning_rate_factor_lets_the_rewound_run_finish(diverging):
    run = diverging["lr_factor"]
    model = run["model"]
    actions = _report(run["logdir"])["actions"]
    rewinds = [e for e in actions["events"] if e["action"] == "rewind"]
    assert rewinds and not actions["stopped"] and _finite(model) and np.isfinite(run["loss"][-1])
    assert float(model.optimizer.learning_rate) == pytest.approx(0.1 ** len(rewinds), rel=1e-5)
    first = rewinds[0]
    # Back to the state training started from (the only snapshot: one every 100 steps).
    assert first["to_step"] == 0
    assert first["lr_factor"] == 0.1 and first["lr"] == pytest.approx(0.1, rel=1e-5)
    assert actions["words"].startswith("survived %d rewind" % len(rewinds)) and "lr × 0.1" in actions["words"]
    # The replay named the op of the step that failed.
    assert first["replay"]["reproduced"] is True and first["op"]["type"]
    # The records' steps went on after the rewind: one per batch, none twice.
    steps = _report(run["logdir"])["last_step"]
    assert steps == EPOCHS_DIVERGING * BATCHES - 1


def test_a_rewind_to_the_newest_checkpoint_a_model_checkpoint_wrote(diverging):
    run = diverging["checkpoint"]
    actions = _report(run["logdir"])["actions"]
    first = actions["events"][0]
    # The first divergence (step 15) is in the second epoch: the first epoch's file is the newest.
    assert (first["action"], first["checkpoint"], first["epoch"]) == ("rewind", "ckpt-01.weights.h5", 1)
    assert not actions["stopped"] and _finite(run["model"])


# ---------------------------------------------------------------- mixed_float16


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """Under mixed_float16: batch 2's targets overflow float16 (the
    LossScaleOptimizer's own skip), batch BAD holds a NaN (an anomaly); and
    a second training where every batch from BAD on holds one (skip, then stop)."""
    logdir, persistent = tmp_path_factory.mktemp("mixed"), tmp_path_factory.mktemp("mixed_persistent")
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = _mlp(out_dtype="float32")  # a float32 loss: the targets overflow float16 gradients only
        model.compile(keras.optimizers.SGD(1e-3), "mse")
        scales = []
        probe = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda b, logs: scales.append(float(model.optimizer.dynamic_scale.numpy())))
        x, y = _data()
        y[16 * 2:16 * 3] = 3e3
        x[16 * BAD + 1, 2] = np.nan
        policy = tbn.OnAnomaly("rewind", snapshot_every=1, max_rewinds=1)
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0,
                  callbacks=[_BatchOracle(logdir, lambda e, b: b == BAD),
                             NumericsCallback(str(logdir), on_anomaly=policy), probe])
        stopped = _mlp(out_dtype="float32")
        stopped.compile(keras.optimizers.SGD(1e-3), "mse")
        x, y = _data()
        x[16 * BAD + 1::16, 2] = np.nan
        stopped.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[
            _BatchOracle(persistent, lambda e, b: b >= BAD),
            NumericsCallback(str(persistent), on_anomaly=tbn.OnAnomaly("skip", max_skips=1), replay=False)])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return dict(logdir=logdir, model=model, scales=scales, persistent=persistent, stopped=stopped)


def test_under_mixed_float16_the_loss_scale_skips_are_its_own_and_a_rewind_restores_the_scale(mixed):
    (truth,) = _oracle_steps(mixed["logdir"])
    run = _report(mixed["logdir"])
    (event,) = run["actions"]["events"]  # not the LossScaleOptimizer's own skip at batch 2
    assert (event["step"], event["action"], event["trigger"]) == (truth, "rewind", "nonfinite")
    assert 2 in run["skipped_steps"] and run["info"][0]["kind"] == "skipped_step"
    scales = mixed["scales"]
    # Keras halves its scale at each skip (batch 2, and the NaN batch); the
    # rewind put back the scale of its snapshot, taken before the NaN batch.
    assert scales[2] == scales[1] / 2
    # Snapshots after every step, the rewind to the older of the last two.
    assert event["to_step"] == BAD - 2 and scales[BAD] == scales[BAD - 3] != scales[BAD - 1] / 2
    assert _finite(mixed["model"])


def test_under_mixed_float16_a_persistent_nan_escalates_after_k_skips_and_stops(mixed):
    truth = _oracle_steps(mixed["persistent"])
    actions = _report(mixed["persistent"])["actions"]
    assert [(e["step"], e["action"], e["trigger"]) for e in actions["events"]] == [
        (truth[0], "skip", "nonfinite"), (truth[1], "stop", "nonfinite")]
    assert actions["stopped"] and actions["events"][1]["reason"] == "2 anomalous steps in a row (at most 1 skipped)"
    model = mixed["stopped"]
    assert int(model.optimizer.iterations) == BAD and _finite(model)


# ---------------------------------------------------------------- MirroredStrategy

_MIRRORED = """
    import keras
    import tb_numerics as tbn
    from tb_numerics.keras import NumericsCallback
    args = json.loads(sys.argv[1])

    def fit(logdir, policy, x, y, lr, epochs, replay=True):
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
            model.compile(keras.optimizers.SGD(lr), "mse")
        model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0,
                  callbacks=[NumericsCallback(logdir, on_anomaly=policy, replay=replay)])
        return {"finite": all(bool(np.isfinite(w.numpy()).all()) for w in model.weights),
                "iterations": int(model.optimizer.iterations.numpy()),
                "lr": float(model.optimizer.learning_rate.numpy())}

    x = (np.random.RandomState(2).randn(16 * 12, 8) * 3).astype("float32")
    y = x.sum(1, keepdims=True)
    bad = x.copy()
    bad[16 * 4 + 11, 0] = np.nan  # batch 4, in the half replica 1 gets
    bad[16 * 8 + 8::16, 0] = np.nan  # from batch 8 on, replica 1's half
    skip_stop = fit(args["logdir"] + "/skip_stop", tbn.OnAnomaly("skip", max_skips=1), bad, y, 1e-3, 1)
    # The linear regression at 10x its stable learning rate (diverging at step 15), rewound.
    rewind = fit(args["logdir"] + "/rewind", tbn.OnAnomaly("rewind", lr_factor=0.1), x, y, 1.0, 4, replay=False)
    # A strategy the gate cannot take one decision across: refused before the first step.
    central = tf.distribute.experimental.CentralStorageStrategy(["/cpu:0", "/cpu:1"])
    with central.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.1), "mse")
    try:
        model.fit(x, y, batch_size=16, epochs=1, verbose=0,
                  callbacks=[NumericsCallback(args["logdir"] + "/central", on_anomaly="skip")])
        refused = None
    except ValueError as e:
        refused = [str(e), int(model.optimizer.iterations.numpy())]
    # A BatchNormalization model and a batch of NaN inputs, skipped: every
    # replica's moving statistics as the training without that batch leaves them.
    def bn_fit(x, y, callbacks):
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4), keras.layers.BatchNormalization(),
                                      keras.layers.Dense(1)])
            model.compile(keras.optimizers.SGD(1e-3), "mse")
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
        return [[t.numpy() for t in v.value.values] for v in model.variables]

    nan_batch = x.copy()
    nan_batch[16 * 4 : 16 * 5, 0] = np.nan
    skipped = bn_fit(nan_batch, y, [NumericsCallback(args["logdir"] + "/bn", on_anomaly="skip")])
    keep = np.r_[0 : 16 * 4, 16 * 5 : len(x)]
    without = bn_fit(x[keep], y[keep], [])
    bn_diff = max(float(np.max(np.abs(a - b))) for va, vb in zip(skipped, without) for a, b in zip(va, vb))

    # The same model rewound: each replica's variables as they began the step
    # the rewind goes back to (read by a callback after the product's).
    class Begins(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.at = {}

        def on_train_batch_begin(self, batch, logs=None):
            self.at[batch] = [[t.numpy() for t in v.value.values] for v in self.model.variables]

    begins = Begins()
    apart = x.copy()
    apart[8::16] *= 5  # each replica normalises its own half: their moving statistics differ
    apart[16 * 6 : 16 * 7, 0] = np.nan
    bn_fit(apart, y, [NumericsCallback(args["logdir"] + "/bn_rewind", on_anomaly=tbn.OnAnomaly(
        "rewind", snapshot_every=2), replay=False), begins])
    replicas_apart = max(float(np.max(np.abs(v[0] - v[1]))) for v in begins.at[4])
    rewound_to = {b: max(float(np.max(np.abs(a - b_))) for va, vb in zip(begins.at[7], begins.at[b])
                         for a, b_ in zip(va, vb)) for b in begins.at}
    print(json.dumps([skip_stop, rewind, refused, bn_diff, replicas_apart, rewound_to]))
"""


def test_under_mirrored_strategy_one_decision_holds_for_every_replica(tmp_path):
    arg = json.dumps({"logdir": str(tmp_path)})
    skip_stop, rewind, refused, bn_diff, replicas_apart, rewound_to = two_replicas.run(_MIRRORED, arg)
    # A NaN on replica 1 alone: the update held back on both, training went on;
    # then a NaN in every batch: one more skip, and the stop. Finite throughout.
    actions = _report(tmp_path / "skip_stop")["actions"]
    assert [(e["step"], e["batch"], e["action"]) for e in actions["events"]] == [
        (BAD, BAD, "skip"), (8, 8, "skip"), (9, 9, "stop")], actions
    assert actions["events"][0]["tensor"] == "input" and actions["events"][0]["replay"]["replica"] == 1
    assert skip_stop["finite"] and skip_stop["iterations"] == 9 - 2, skip_stop
    # The rewind wrote every replica's variables (finite after) and the mirrored learning rate.
    actions = _report(tmp_path / "rewind")["actions"]
    rewinds = [e for e in actions["events"] if e["action"] == "rewind"]
    assert rewinds and not actions["stopped"] and rewind["finite"], (actions["words"], rewind)
    assert rewind["lr"] == pytest.approx(0.1 ** len(rewinds), rel=1e-5)
    # Another strategy with two replicas is refused, with the reason, before any update.
    assert refused == ["NumericsCallback: on_anomaly='skip' holds a bad step's update back, which it can under one "
                       "device or MirroredStrategy, not CentralStorageStrategy", 0]
    # A skipped batch of NaN inputs left no trace in any replica's moving statistics (NaN is not <= 1e-6).
    assert bn_diff <= 1e-6, bn_diff
    # A NaN batch at step 6, rewound to the snapshot taken as step 4 began:
    # step 7 begins with every replica's own variables as step 4 began them.
    bn_rewind = _report(tmp_path / "bn_rewind")["actions"]["events"]
    assert [(e["step"], e["action"], e.get("to_step")) for e in bn_rewind] == [(6, "rewind", 4)], bn_rewind
    assert replicas_apart > 1e-3 and rewound_to["4"] == 0.0, (replicas_apart, rewound_to)


# ---------------------------------------------------------------- two optimizers (issue 25, zoo)


class TwoOptimizers(keras.Model):
    """A GAN-like custom ``train_step``: the critic's update with an
    optimizer of its own first, then the generator's (``model.optimizer``),
    whose loss reads the critic after its update. The critic's loss, a mean
    over the examples it weights, is 0 / 0 in a batch that weights none: a
    NaN in its loss and its gradients, never in a layer's output."""

    def __init__(self):
        super().__init__()
        self.gen, self.critic = keras.layers.Dense(8, name="gen"), keras.layers.Dense(1, name="critic")
        self.critic_optimizer = keras.optimizers.SGD(0.01)

    def call(self, x):
        return self.critic(self.gen(x))

    def train_step(self, data):
        real, _ = data
        noise = tf.ones_like(real) * 0.5
        with tf.GradientTape() as tape:
            weights = tf.cast(real[:, 5] > -6.0, real.dtype)  # a batch with no weighted example: 0 / 0
            weighted = tf.reduce_sum(weights * tf.square(self.critic(real) - 1.0))
            c_loss = weighted / tf.reduce_sum(weights)  # DIV_BY_WEIGHTS
        c_vars = self.critic.trainable_variables
        self.critic_optimizer.apply(tape.gradient(c_loss, c_vars), c_vars)
        with tf.GradientTape() as tape:
            g_loss = tf.reduce_mean(tf.square(self.critic(self.gen(noise))))
            scaled = self.optimizer.scale_loss(g_loss)
        g_vars = self.gen.trainable_variables
        self.optimizer.apply(tape.gradient(scaled, g_vars), g_vars)
        return {"loss": c_loss + g_loss}


def _fit_two_optimizers(logdir, policy, replay: bool = True) -> dict:
    """TwoOptimizers for one epoch whose batch BAD weights no example."""
    keras.utils.set_random_seed(0)
    model = TwoOptimizers()
    model(np.zeros((1, 8), np.float32))
    model.critic_optimizer.build(model.critic.trainable_variables)
    model.compile(keras.optimizers.SGD(0.01), "mse")
    x, y = _data()
    x[16 * BAD:16 * BAD + 16, 5] = -7.0  # NaN in the critic's loss and gradients only: no layer's output
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[
        _BatchOracle(logdir, lambda e, b: b == BAD), NumericsCallback(str(logdir), on_anomaly=policy, replay=replay)])
    return dict(logdir=logdir, model=model, batch=(tf.constant(x[16 * BAD:16 * BAD + 16]), tf.constant(y[:16])))


@pytest.fixture(scope="module")
def two_optimizers(tmp_path_factory):
    return _fit_two_optimizers(tmp_path_factory.mktemp("two_optimizers"), "skip")


def _check_numerics_names(fn) -> tuple[str, int]:
    """(op type, line of this file) of the first non-finite op, as TensorFlow's own check names them."""
    import re
    import traceback

    tf.debugging.enable_check_numerics()
    try:
        fn()
    except tf.errors.InvalidArgumentError as e:
        message, frames = str(e), [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == __file__]
    else:
        raise AssertionError("check_numerics found no NaN or Inf")
    finally:
        tf.debugging.disable_check_numerics()
    return re.search(r'op "(\w+)"', message).group(1), frames[-1]


def test_every_optimizer_the_step_applies_is_held_back(two_optimizers):
    from op_records import line_of

    (truth,) = _oracle_steps(two_optimizers["logdir"])
    model = two_optimizers["model"]
    # Neither optimizer applied the bad step: every weight finite, each optimizer one step short.
    assert _finite(model)
    assert int(model.critic_optimizer.iterations) == int(model.optimizer.iterations) == BATCHES - 1
    run = _report(two_optimizers["logdir"])
    a = run["first_anomaly"]
    op_type, line = _check_numerics_names(lambda: model.train_step(two_optimizers["batch"]))
    assert (op_type, line) == ("RealDiv", line_of(__file__, "# DIV_BY_WEIGHTS"))
    assert a["step"] == truth and a["replay"] == {"reproduced": True}, a
    assert a["op"]["type"] == op_type and a["op"]["source"].endswith("test_survive.py:%d (train_step)" % line)
    (event,) = run["actions"]["events"]
    assert (event["step"], event["action"], event["op"]["type"]) == (truth, "skip", "RealDiv")


def test_a_rewind_puts_back_every_optimizer_the_step_applies(tmp_path):
    run = _fit_two_optimizers(tmp_path, tbn.OnAnomaly("rewind", snapshot_every=1), replay=False)
    (truth,) = _oracle_steps(tmp_path)
    (event,) = _report(tmp_path)["actions"]["events"]
    # Snapshots after every healthy step, the rewind to the older of the last two
    # (the state after BAD - 1 batches), then the batches after BAD.
    assert (event["step"], event["action"], event["to_step"]) == (truth, "rewind", BAD - 1)
    model = run["model"]
    # Both optimizers' counters went back with the weights (without the critic's
    # own state in the snapshot, its counter would be BATCHES - 1).
    assert int(model.critic_optimizer.iterations) == int(model.optimizer.iterations) == BATCHES - 2
    assert _finite(model)


# ---------------------------------------------------------------- a custom loop under tbn.guard


def _guarded_loop(logdir, bad_from: int, policy, compiled: bool):
    """The two optimizers of a GAN-like loop under one guard; from batch
    ``bad_from`` on (only there without a policy that stops) a batch holds
    a value whose log is NaN."""
    keras.utils.set_random_seed(0)
    gen, critic = keras.layers.Dense(8), keras.layers.Dense(1)
    gen.build((None, 8))
    critic.build((None, 8))
    c_opt, g_opt = keras.optimizers.SGD(0.01), keras.optimizers.SGD(0.01)

    def step_fn(real):
        with tf.GradientTape() as tape:
            c_loss = tf.reduce_mean(tf.square(critic(tf.math.log(real + 6.0)) - 1.0))  # GUARD_LOG
            tbn.log_numerics("critic_loss", c_loss)
        c_opt.apply_gradients(zip(tape.gradient(c_loss, critic.trainable_variables), critic.trainable_variables))
        with tf.GradientTape() as tape:
            g_loss = tf.reduce_mean(tf.square(critic(gen(tf.ones_like(real)))))
        g_opt.apply_gradients(zip(tape.gradient(g_loss, gen.trainable_variables), gen.trainable_variables))

    train_step = tbn.guard(c_opt, g_opt, on_anomaly=policy)(tf.function(step_fn) if compiled else step_fn)
    x, _ = _data()
    writer = tf.summary.create_file_writer(str(logdir))
    step = tf.Variable(0, dtype=tf.int64)
    stopped = None
    with writer.as_default(step=step):
        for i in range(BATCHES):
            step.assign(i)
            batch = x[16 * i:16 * i + 16].copy()
            if i >= bad_from:
                batch[2, 1] = -7.0
            try:
                train_step(tf.constant(batch))
            except tbn.survive.TrainingStopped as e:
                stopped = e
                break
            if policy == "skip" and i >= bad_from:
                bad_from = BATCHES  # one corrupt batch only
    writer.close()
    weights = gen.weights + critic.weights
    return dict(logdir=logdir, finite=all(bool(np.isfinite(w.numpy()).all()) for w in weights), stopped=stopped,
                iterations=(int(c_opt.iterations), int(g_opt.iterations)))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "function"])
def test_a_custom_loop_under_the_guard_skips_and_stops(tmp_path, compiled):
    from op_records import line_of

    skip = _guarded_loop(tmp_path / "skip", BAD, "skip", compiled)
    assert skip["finite"] and skip["stopped"] is None and skip["iterations"] == (BATCHES - 1, BATCHES - 1)
    run = _report(tmp_path / "skip")
    (event,) = run["actions"]["events"]
    assert (event["step"], event["action"], event["trigger"]) == (BAD, "skip", "nonfinite")
    assert event["op"]["type"] == "Log" and event["op"]["source"].endswith(
        "test_survive.py:%d (step_fn)" % line_of(__file__, "# GUARD_LOG"))
    stop = _guarded_loop(tmp_path / "stop", BAD, tbn.OnAnomaly("skip", max_skips=1), compiled)
    assert stop["finite"] and stop["iterations"] == (BAD, BAD)
    assert isinstance(stop["stopped"], tbn.survive.TrainingStopped)
    assert "stopped at step %d" % (BAD + 1) in str(stop["stopped"])
    actions = _report(tmp_path / "stop")["actions"]
    assert [(e["step"], e["action"]) for e in actions["events"]] == [(BAD, "skip"), (BAD + 1, "stop")]


@pytest.mark.parametrize("scaled", [None, "loss_logged", "nothing_logged"],
                         ids=["sgd", "loss_scale_loss_logged", "loss_scale_nothing_logged"])
def test_a_custom_loop_skip_puts_back_the_variables_it_was_given(tmp_path, scaled):
    """A guarded ``tf.function`` loop over a BatchNormalization model, given
    ``variables=model.non_trainable_variables``, skips a batch of NaN inputs:
    the model is then as the same plain loop without that batch leaves it
    (no tb-numerics: the oracle), its moving statistics finite. Under
    ``mixed_float16`` with a LossScaleOptimizer (``scaled``) the scale skips
    that step by itself; a NaN batch is no scale's doing, so the policy acts
    there too, whether the loop logs its loss or nothing at all."""
    x, y = backend_runs.bn_data()
    bad = backend_runs.BAD_STEP
    x[bad * backend_runs.BATCH : (bad + 1) * backend_runs.BATCH] = np.nan

    def train(xs, ys, guarded: bool):
        with _mixed_float16() if scaled else contextlib.nullcontext():
            model = backend_runs.bn_model()
        opt = keras.optimizers.SGD(0.01)
        if scaled:  # a scale no healthy step's gradients overflow: every skip is the NaN batch's
            opt = keras.optimizers.LossScaleOptimizer(opt, initial_scale=2.0**8)

        def step_fn(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(tf.cast(model(xb, training=True), tf.float32) - yb))
                if guarded and scaled == "loss_logged":
                    tbn.log_numerics("loss", loss)
                if scaled:
                    loss = opt.scale_loss(loss)
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

        step_fn = tf.function(step_fn)
        if guarded:
            step_fn = tbn.guard(opt, on_anomaly="skip", variables=model.non_trainable_variables)(step_fn)
        writer = tf.summary.create_file_writer(str(tmp_path))
        step = tf.Variable(0, dtype=tf.int64)  # a traced step reads the variable (TensorFlow's advice)
        with writer.as_default(step=step):
            for i in range(0, len(xs), backend_runs.BATCH):
                step.assign(i // backend_runs.BATCH)
                step_fn(tf.constant(xs[i : i + backend_runs.BATCH]), tf.constant(ys[i : i + backend_runs.BATCH]))
        writer.close()
        return model

    model = train(x, y, guarded=True)
    _assert_same_variables(model, train(*_without_batch(x, y, bad), guarded=False))
    run = _report(tmp_path)
    (event,) = run["actions"]["events"]
    # The event names the batch, as the first anomaly does: not the op that first read it.
    assert (event["step"], event["action"], event["tensor"]) == (bad, "skip", "input/xb")
    assert event["detail"] == "input/xb: %d NaN of %d values" % (backend_runs.BATCH * 5, backend_runs.BATCH * 5)
    assert run["first_anomaly"]["step"] == bad and run["first_anomaly"]["tensor"] == "input/xb"


def test_under_a_loss_scale_a_custom_loop_skips_a_nan_loss_then_stops_where_it_persists(tmp_path):
    """A guarded loop under mixed_float16 with a LossScaleOptimizer, its loss
    logged; from batch BAD on every batch holds a finite value whose log is
    NaN (the injected fault). The scale skips those steps by itself, but no
    scale makes a NaN loss: the policy skips the first (its replay names the
    Log) and stops at the next, as without a loss scale. The scale's own
    skips before (its first scale overflows float16) are no event."""
    from op_records import line_of

    bad, steps = 12, 16
    with _mixed_float16():
        model = _mlp()
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=2.0**24)
    opt.build(model.trainable_variables)

    @tbn.guard(opt, on_anomaly=tbn.OnAnomaly("skip", max_skips=1))
    @tf.function
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            pred = tf.cast(model(tf.math.log(xb + 6.0)), tf.float32)  # SCALED_NAN_LOSS
            loss = tf.reduce_mean(tf.square(pred - yb))
            tbn.log_numerics("loss", loss)
            scaled = opt.scale_loss(loss)
        opt.apply_gradients(zip(tape.gradient(scaled, model.trainable_variables), model.trainable_variables))

    rs = np.random.RandomState(0)
    x = rs.randn(steps, 16, 8).astype("float32")
    x[bad:, 3, 1] = -7.0
    y = np.tanh(x[..., :2].sum(-1, keepdims=True)).astype("float32")
    writer, step, iterations, stopped = tf.summary.create_file_writer(str(tmp_path)), tf.Variable(0, tf.int64), [], None
    with writer.as_default(step=step):
        for i in range(steps):
            step.assign(i)
            try:
                train_step(tf.constant(x[i]), tf.constant(y[i]))
            except tbn.survive.TrainingStopped as e:
                stopped = e
                break
            iterations.append(int(opt.iterations))
    writer.close()
    own = [i for i in range(bad) if iterations[i] == (iterations[i - 1] if i else 0)]
    assert own and own[-1] < bad - 1  # the scale calibrated itself, then trained
    assert isinstance(stopped, tbn.survive.TrainingStopped) and "stopped at step %d" % (bad + 1) in str(stopped)
    assert _finite(model)
    events = _report(tmp_path)["actions"]["events"]
    assert [(e["step"], e["action"]) for e in events] == [(bad, "skip"), (bad + 1, "stop")]
    assert events[0]["op"]["type"] == "Log" and events[0]["op"]["source"].endswith(
        "test_survive.py:%d (train_step)" % line_of(__file__, "# SCALED_NAN_LOSS"))


# ------------------------------------------------ the spike trigger, and a fault that does not reproduce

_FLIP = tf.Variable(0.0, trainable=False)  # 1 while the fault is injected: no variable of the model


class _Flaky(keras.layers.Layer):
    """NaN where ``_FLIP`` is set: a fault of the step, gone when it runs again (a bit flip)."""

    def call(self, x):
        return x + tf.where(_FLIP > 0, tf.constant(np.nan, x.dtype), tf.constant(0.0, x.dtype))


class _Injector(keras.callbacks.Callback):
    """Sets ``_FLIP`` for the batches ``flaky(epoch, batch)`` says; resets it
    after the batch, before the callbacks after it (the replay) run."""

    def __init__(self, flaky):
        super().__init__()
        self._flaky, self._epoch = flaky, 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        _FLIP.assign(1.0 if self._flaky(self._epoch, batch) else 0.0)

    def on_train_batch_end(self, batch, logs=None):
        _FLIP.assign(0.0)


@pytest.fixture(scope="module")
def spiky(tmp_path_factory):
    """A loss spike at batch 8 (targets ×1000, finite), and a transient NaN at batch 10."""
    logdir = tmp_path_factory.mktemp("spiky")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), _Flaky(),
                              keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(1e-2), "mse")
    x, y = _data()
    y[16 * 8:16 * 9] *= 1000.0
    policy = tbn.OnAnomaly("skip", spike=tbn.Spike(z=6, window=8))
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[
        _BatchOracle(logdir, lambda e, b: b in (8, 10)), _Injector(lambda e, b: b == 10),
        NumericsCallback(str(logdir), on_anomaly=policy)])
    return dict(logdir=logdir, model=model)


def test_a_loss_spike_is_skipped_before_any_nan(spiky):
    spike_step, flaky_step = _oracle_steps(spiky["logdir"])
    run = _report(spiky["logdir"])
    spike = run["actions"]["events"][0]
    assert (spike["step"], spike["trigger"], spike["action"], spike["tensor"]) == (
        spike_step, "loss_spike", "skip", "loss")
    assert "σ above the mean" in spike["detail"] and spike["value"] > 1e4
    assert _finite(spiky["model"]) and int(spiky["model"].optimizer.iterations) == BATCHES - 2
    assert run["actions"]["words"] == "survived 1 non-finite step and 1 loss spike (skipped)"


def test_a_fault_that_does_not_reproduce_is_said_to_be_transient(spiky):
    spike_step, flaky_step = _oracle_steps(spiky["logdir"])
    run = _report(spiky["logdir"])
    event = run["actions"]["events"][1]
    assert (event["step"], event["trigger"], event["action"]) == (flaky_step, "nonfinite", "skip")
    assert event["replay"] == {"reproduced": False, "reproducible": False, "why": event["replay"]["why"]}
    assert "not reproducible" in event["replay"]["why"] and "hardware" in event["replay"]["why"]
    a = run["first_anomaly"]
    assert a["step"] == flaky_step and a["replay"]["reproducible"] is False
    assert "not reproducible on replay (non-determinism or hardware)" in _report_text(spiky["logdir"])


def test_a_custom_loop_under_the_guard_rewinds_with_a_learning_rate_factor(tmp_path):
    """The diverging linear regression in a hand-written loop: the guard
    rewinds to its first snapshot with the learning rate × 0.1 and finishes."""
    keras.utils.set_random_seed(0)
    dense = keras.layers.Dense(1)
    dense.build((None, 8))
    opt = keras.optimizers.SGD(1.0)
    x, _ = _data(2, scale=3.0)
    y = x.sum(1, keepdims=True)

    @tbn.guard(opt, on_anomaly=tbn.OnAnomaly("rewind", lr_factor=0.1))
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(dense(xb) - yb))
        opt.apply_gradients(zip(tape.gradient(loss, dense.trainable_variables), dense.trainable_variables))
        return loss

    writer = tf.summary.create_file_writer(str(tmp_path))
    with writer.as_default():
        for i in range(EPOCHS_DIVERGING * BATCHES):
            tf.summary.experimental.set_step(i)
            b = i % BATCHES
            train_step(tf.constant(x[16 * b:16 * b + 16]), tf.constant(y[16 * b:16 * b + 16]))
    writer.close()
    actions = _report(tmp_path)["actions"]
    rewinds = [e for e in actions["events"] if e["action"] == "rewind"]
    assert rewinds and not actions["stopped"] and rewinds[0]["to_applied_step"] == 0
    assert all(bool(np.isfinite(w.numpy()).all()) for w in dense.weights)
    assert float(opt.learning_rate) == pytest.approx(0.1 ** len(rewinds), rel=1e-5)
