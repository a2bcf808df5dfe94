"""Trainings of one small model on one Keras backend, for the backend tier (``test_backends.py``).

    KERAS_BACKEND=jax python tests/backend_runs.py OUT.json LOGDIR

Keras picks its backend once per process, so each backend runs in a process
of its own, and every training a backend's tests need runs in that one
process. On JAX and PyTorch, TensorFlow is made impossible to import first
(as on a machine without it; Keras tolerates that), and the result says
whether anything imported it anyway.

Each fault is injected at a known step into a known place, the truth the
tests hold every backend to: ``log0`` (a log of an exact 0 in the layer
``fault``), ``div00`` (0/0 in the loss) and ``overflow`` (exp overflowing in
the layer ``fault``). The batch at ``BAD_STEP`` holds the trigger (its last
feature, 1 elsewhere, 0 there); the step is the same on every backend.
"""

from __future__ import annotations

import inspect
import re
import json
import os
import sys
from typing import Any

BACKEND = os.environ.get("KERAS_BACKEND", "tensorflow")


if __name__ == "__main__" and BACKEND != "tensorflow":
    # As if TensorFlow were not installed: ``import tensorflow`` raises
    # ModuleNotFoundError, ``importlib.util.find_spec`` finds nothing.
    sys.modules["tensorflow"] = None

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tb_numerics import analysis, event_reader, metadata, records, rules  # noqa: E402
from tb_numerics.keras import NumericsCallback  # noqa: E402

BATCH, STEPS, BAD_STEP = 8, 12, 7
FAULTS = ("log0", "div00", "overflow", "sqrt0", "norm00")


@keras.saving.register_keras_serializable("tbn_tests")
class Fault(keras.layers.Layer):
    """Passes its input on, with its last feature through a fault that fires where that feature is 0.

    ``calls`` counts the Python runs of ``call``: a traced step runs none."""

    calls = 0

    def __init__(self, kind: str, **kwargs):
        super().__init__(**kwargs)
        self.kind = kind
        if kind in ("sqrt0", "norm00"):
            self.scale = self.add_weight(shape=(), initializer="ones", name="scale")

    def call(self, x):
        Fault.calls += 1
        head, trigger = x[:, :-1], x[:, -1:]
        if self.kind == "sqrt0":  # finite forward (sqrt(0) = 0), NaN gradient (inf * 0) where the trigger is 0
            out = keras.ops.sqrt(keras.ops.square(self.scale * (1.0 - trigger)))  # FAULT_LINE sqrt0
        elif self.kind == "log0":
            out = keras.ops.log(trigger)  # FAULT_LINE log0
        elif self.kind == "overflow":
            out = keras.ops.exp(100.0 * (1.0 - trigger))  # FAULT_LINE overflow
        elif self.kind == "norm00":  # divided by its norm: 0/0 where the trigger is 0 (and the norm's slope is Inf)
            scaled = self.scale * trigger
            out = scaled / keras.ops.norm(scaled, axis=-1, keepdims=True)  # FAULT_LINE norm00
        else:
            out = trigger
        return keras.ops.concatenate([head, out], axis=-1)


def ratio_loss(y, p):
    """Mean squared error, times the target's second column over itself: 0/0 where it is 0."""
    y2 = y[:, 1:2]
    return keras.ops.mean(keras.ops.square(p - y[:, :1]) * (y2 / y2))  # FAULT_LINE div00


def fault_line(kind: str) -> int:
    """The line of this file that holds the fault ``kind``."""
    lines = inspect.getsource(sys.modules[__name__]).splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.rstrip().endswith("FAULT_LINE " + kind))


def data(kind: str) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    x = rng.uniform(0.5, 1.5, size=(STEPS * BATCH, 5)).astype(np.float32)
    x[:, -1] = 1.0
    y = np.ones((STEPS * BATCH, 2), np.float32)
    y[:, 0] = x[:, :4].sum(axis=1) * 0.1
    bad = slice(BAD_STEP * BATCH, BAD_STEP * BATCH + 2)
    if kind == "div00":
        y[bad, 1] = 0.0
    elif kind == "sqrt0":
        x[:, -1] = 0.0
        x[bad, -1] = 1.0
    else:
        x[bad, -1] = 0.0
    return x, y


def model(kind: str, dtype_policy: str | None = None) -> keras.Model:
    keras.utils.set_random_seed(5)
    if dtype_policy:
        keras.mixed_precision.set_dtype_policy(dtype_policy)
    m = keras.Sequential([keras.Input((5,)), Fault(kind, name="fault"),
                          keras.layers.Dense(8, activation="relu", name="dense_0"),
                          keras.layers.Dense(1, name="head", dtype="float32")], name="faulty")
    keras.mixed_precision.set_dtype_policy("float32")
    m.compile(optimizer=keras.optimizers.SGD(0.01), loss=ratio_loss if kind == "div00" else "mse")
    return m


def report(logdir: str) -> dict:
    """The run's first anomaly as ``tb-numerics report --json`` gives it, and what the tests check beside it."""
    rr = event_reader.read_run(".", event_reader.find_runs(logdir).get(".", []))
    ra = analysis.analyze_run(logdir, rr.series, analysis.SafeRange(), rr.problems)
    first = analysis.first_anomaly(ra)
    tags = {h.series.tag: sorted({int(s) for s in h.series.steps}) for h in ra.health}
    infos = {h.series.tag: h.series.info.to_json() for h in ra.health}
    return {"first_anomaly": json.loads(rules.dumps(first)), "steps": tags, "infos": infos, "problems": rr.problems}


def run_fault(kind: str, root: str, **callback_args) -> dict:
    logdir = os.path.join(root, "%s_%s" % (kind, "_".join("%s%s" % kv for kv in sorted(callback_args.items()))))
    x, y = data(kind)
    cb = NumericsCallback(logdir, **callback_args)
    model(kind).fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[cb])
    return {"report": report(logdir), "line": fault_line(kind), "verdict": cb.replay_verdict}


def run_refit(root: str) -> dict:
    """``log0``'s training as three ``fit`` calls with one callback (batches
    0-3, 4-6, 7-11: the bad one opens the third), and the Python runs of the
    fault layer's ``call`` in the second call, with the callback and
    without it (Keras runs its traced step: none)."""
    logdir = os.path.join(root, "refit")
    x, y = data("log0")
    cb = NumericsCallback(logdir)
    m = model("log0")
    calls = []
    for lo, hi in ((0, 4), (4, 7), (7, STEPS)):
        before = Fault.calls
        m.fit(x[lo * BATCH:hi * BATCH], y[lo * BATCH:hi * BATCH], batch_size=BATCH, epochs=1, shuffle=False,
              verbose=0, callbacks=[cb])
        calls.append(Fault.calls - before)
    plain = model("log0")
    plain.fit(x[:4 * BATCH], y[:4 * BATCH], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    before = Fault.calls
    plain.fit(x[4 * BATCH:7 * BATCH], y[4 * BATCH:7 * BATCH], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return {"report": report(logdir), "verdict": cb.replay_verdict, "second_fit_calls": calls[1],
            "plain_second_fit_calls": Fault.calls - before}


def run_mixed(policy: str, root: str) -> dict:
    """A healthy fit under a mixed-precision policy: the compute dtype recorded."""
    logdir = os.path.join(root, "mixed_" + policy)
    x, y = data("log0")
    x[:, -1] = 1.0
    m = model("log0", policy)
    m.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[NumericsCallback(logdir)])
    return {"report": report(logdir)}


class _WeightsOracle(keras.callbacks.Callback):
    """The trainable weights as Keras holds them after each batch (on JAX,
    the state its ``fit`` loop hands the callbacks): outside the product."""

    def __init__(self) -> None:
        super().__init__()
        self.after: list[list[np.ndarray]] = []

    def on_train_begin(self, logs=None) -> None:
        self.initial = [keras.ops.convert_to_numpy(v.value) for v in self.model.trainable_variables]
        self.paths = [v.path for v in self.model.trainable_variables]

    def on_train_batch_end(self, batch, logs=None) -> None:
        state = getattr(self.model, "_jax_state", None)
        values = state["trainable_variables"] if state else [v.value for v in self.model.trainable_variables]
        self.after.append([np.array(keras.ops.convert_to_numpy(w)) for w in values])


def run_weights(root: str) -> dict:
    """A healthy fit whose weights and update ratios are recorded at steps 0
    and 10 (``weights_every_n_steps``' default), and the weights Keras held
    around those steps: {step: {path: [its record (numpy), the weights' record]}}
    and {step: {layer: [the recorded ratio, numpy's]}}."""
    logdir = os.path.join(root, "weights")
    x, y = data("log0")
    x[:, -1] = 1.0
    oracle = _WeightsOracle()
    model("log0").fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                      callbacks=[NumericsCallback(logdir), oracle])
    rr = event_reader.read_run(".", event_reader.find_runs(logdir).get(".", []))
    series = {s.tag: s for s in rr.series}
    out: dict = {"weights": {}, "ratios": {}}
    for step in (0, 10):
        before = oracle.initial if step == 0 else oracle.after[step - 1]
        after = oracle.after[step]
        out["weights"][step] = {
            path: [series[path].values[list(series[path].steps).index(step)].tolist(),
                   records.numpy_stats(w).tolist()] for path, w in zip(oracle.paths, before)}
        for layer in ("fault", "dense_0", "head"):
            mine = [i for i, path in enumerate(oracle.paths) if path.split("/")[-2] == layer]
            dw = sum(float(np.sum((after[i].astype(np.float64) - before[i]) ** 2)) for i in mine)
            w = sum(float(np.sum(before[i].astype(np.float64) ** 2)) for i in mine)
            tag = "update_ratio/" + layer
            if tag in series:
                rec = series[tag].values[list(series[tag].steps).index(step)]
                out["ratios"].setdefault(step, {})[layer] = [float(rec[metadata.FIELD_INDEX["max"]]), (dw / w) ** 0.5]
    out["weight_steps"] = {path: sorted(int(s) for s in series[path].steps) for path in oracle.paths}
    return out


def _first_nonfinite_layer(x: np.ndarray, layers: list[tuple[str, Any]]) -> str | None:
    """The truth beside a run: the first of ``layers``, in the order the
    forward pass runs them, whose output Keras itself computes non-finite
    on the bad batch, each called on the one before's output."""
    h = x[BAD_STEP * BATCH:(BAD_STEP + 1) * BATCH]
    for name, layer in layers:
        h = layer(h)
        if not np.isfinite(keras.ops.convert_to_numpy(h)).all():
            return name
    return None


def run_nested(root: str) -> dict:
    """``log0``'s fault inside a nested model (a base in a ``Sequential``, as
    a pretrained one is used), and the truth beside it (``_first_nonfinite_layer``)."""
    logdir = os.path.join(root, "nested")
    x, y = data("log0")
    keras.utils.set_random_seed(5)
    base = keras.Sequential([keras.Input((5,)), Fault("log0", name="fault"),
                             keras.layers.Dense(8, activation="relu", name="dense_0")], name="base")
    m = keras.Sequential([keras.Input((5,)), base, keras.layers.Dense(1, name="head")], name="outer")
    m.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    m.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[NumericsCallback(logdir)])
    truth = _first_nonfinite_layer(x, [("base/" + layer.name, layer) for layer in base.layers]
                                   + [("head", m.get_layer("head"))])
    return {"report": report(logdir), "oracle_layer": truth}


class Block(keras.layers.Layer):
    """A layer written as users write a Transformer block: layers it holds, called in its own ``call``."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.fault = Fault("log0", name="fault")
        self.dense = keras.layers.Dense(8, activation="relu", name="dense_0")

    def call(self, x):
        return self.dense(self.fault(x))


class Looped(keras.layers.Layer):
    """A layer that calls the fault it holds inside a loop of the graph (``keras.ops.fori_loop``)."""

    def __init__(self, kind: str, **kwargs):
        super().__init__(**kwargs)
        self.fault = Fault(kind, name="fault")

    def call(self, x):
        return keras.ops.fori_loop(0, 1, lambda i, h: self.fault(h), x)


class Masked(keras.layers.Layer):
    """Attention as users write it by hand: scores masked with -inf where a sample's trigger
    (its last feature) is 0, then a softmax; a sample with nothing to attend to (the injected
    batch's) has a row that is all -inf, whose softmax is NaN. The -inf itself is intended."""

    def __init__(self, looped: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.looped = looped  # the mask applied inside a loop of the graph, the softmax after it

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(), initializer="ones", name="scale")

    def call(self, x):
        scores = self.scale * x[:, :, None] * x[:, None, :]
        if self.looped:
            scores = keras.ops.fori_loop(0, 1, lambda i, s: keras.ops.where(x[:, None, -1:] > 0, s, -np.inf), scores)
            weights = keras.ops.softmax(scores, axis=-1)  # FAULT_LINE masked_looped
            return keras.ops.sum(weights * x[:, None, :], axis=-1)
        scores = keras.ops.where(x[:, None, -1:] > 0, scores, -np.inf)
        weights = keras.ops.softmax(scores, axis=-1)  # FAULT_LINE masked
        return keras.ops.sum(weights * x[:, None, :], axis=-1)


def run_masked(root: str, looped: bool = False) -> dict:
    """A -inf attention mask (applied inside a loop if ``looped``), and a row of it all
    masked at the injected step."""
    logdir = os.path.join(root, "masked_looped" if looped else "masked")
    x, y = data("log0")
    keras.utils.set_random_seed(5)
    masked = Masked(looped, name="masked")
    m = keras.Sequential([keras.Input((5,)), masked, keras.layers.Dense(1, name="head")], name="outer")
    m.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    cb = NumericsCallback(logdir)
    m.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[cb])
    truth = _first_nonfinite_layer(x, [("masked", masked), ("head", m.get_layer("head"))])
    return {"report": report(logdir), "oracle_layer": truth, "line": fault_line("masked_looped" if looped else "masked"),
            "verdict": cb.replay_verdict}


class GuideStep(keras.Model):
    """A model with the custom ``train_step`` of Keras' guide ("Customizing what happens in
    fit()") on each backend; its loss from ``compute_loss`` or, ``by_hand``, from a loss
    function it calls itself (``ratio_loss``: 0/0 at ``BAD_STEP``)."""

    def __init__(self, by_hand: bool):
        super().__init__(name="guide")
        self.by_hand = by_hand
        self.dense = keras.layers.Dense(8, activation="relu", name="dense_0")
        self.head = keras.layers.Dense(1, name="head")

    def call(self, x, training=False):
        return self.head(self.dense(x))

    def _loss(self, x, y, y_pred):
        return ratio_loss(y, y_pred) if self.by_hand else self.compute_loss(x=x, y=y, y_pred=y_pred)

    if BACKEND == "tensorflow":
        def train_step(self, data):
            import tensorflow as tf

            x, y = data
            with tf.GradientTape() as tape:
                loss = self._loss(x, y, self(x, training=True))
            self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
            return {"loss": loss}
    elif BACKEND == "torch":
        def train_step(self, data):
            import torch

            x, y = data
            self.zero_grad()
            loss = self._loss(x, y, self(x, training=True))
            loss.backward()
            with torch.no_grad():
                self.optimizer.apply([v.value.grad for v in self.trainable_weights], self.trainable_weights)
            return {"loss": loss}
    else:
        def compute_loss_and_updates(self, trainable_variables, non_trainable_variables, x, y, training=False):
            y_pred, non_trainable_variables = self.stateless_call(trainable_variables, non_trainable_variables, x,
                                                                  training=training)
            return self._loss(x, y, y_pred), (y_pred, non_trainable_variables)

        def train_step(self, state, data):
            import jax

            trainable_variables, non_trainable_variables, optimizer_variables, metrics_variables = state
            x, y = data
            grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
            (loss, (y_pred, non_trainable_variables)), grads = grad_fn(
                trainable_variables, non_trainable_variables, x, y, training=True)
            trainable_variables, optimizer_variables = self.optimizer.stateless_apply(
                optimizer_variables, grads, trainable_variables)
            return {"loss": loss}, (trainable_variables, non_trainable_variables, optimizer_variables,
                                    metrics_variables)


def run_guide_step(root: str, by_hand: bool) -> dict:
    """``div00``'s fault in the loss of a custom ``train_step`` as Keras' guide writes it, and
    the loss each step returned to Keras (``logs["loss"]``: no metric averages it)."""
    logdir = os.path.join(root, "guide_hand" if by_hand else "guide_compute")
    x, y = data("div00")
    keras.utils.set_random_seed(5)
    m = GuideStep(by_hand)
    m(x[:1])
    m.compile(optimizer=keras.optimizers.SGD(0.01), loss=ratio_loss)
    returned: list[float] = []
    keep = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: returned.append(float(logs["loss"])))
    m.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[NumericsCallback(logdir), keep])
    rr = event_reader.read_run(".", event_reader.find_runs(logdir).get(".", []))
    loss = next((s for s in rr.series if s.tag == "loss"), None)
    recorded = None if loss is None else records.derived(loss.values)["mean"].tolist()
    return {"report": report(logdir), "returned": returned, "recorded": recorded}


def run_nan_batch(root: str) -> dict:
    """One NaN in the batch at ``BAD_STEP``, as it arrives from the data (the truth: where it
    was put), in a model with BatchNormalization."""
    logdir = os.path.join(root, "nan_batch")
    x, y = data("div00")
    x[BAD_STEP * BATCH + 3, 1] = np.nan
    keras.utils.set_random_seed(5)
    m = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, name="dense_0"),
                          keras.layers.BatchNormalization(name="bn"), keras.layers.Dense(1, name="head")], name="fed")
    m.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    cb = NumericsCallback(logdir)
    m.fit(x, y[:, :1], batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[cb])
    return {"report": report(logdir), "verdict": cb.replay_verdict}


def run_accumulated(root: str) -> dict:
    """``log0``'s fault under gradient accumulation (an update every 4 batches,
    where ``optimizer.iterations`` counts updates), and, on TensorFlow, the
    steps Keras' TensorBoard callback writes its batch losses at beside it."""
    logdir = os.path.join(root, "accumulated")
    x, y = data("log0")
    m = model("log0")
    m.compile(optimizer=keras.optimizers.SGD(0.01, gradient_accumulation_steps=4), loss="mse")
    callbacks = [NumericsCallback(logdir)]
    if BACKEND == "tensorflow":
        callbacks.append(keras.callbacks.TensorBoard(os.path.join(logdir, "keras_tb"), update_freq=1))
    m.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
    out = {"report": report(logdir), "updates": int(keras.ops.convert_to_numpy(m.optimizer.iterations))}
    if BACKEND == "tensorflow":
        import glob

        import tensorflow as tf

        out["keras_tb_steps"] = sorted(int(e.step) for path in glob.glob(os.path.join(logdir, "keras_tb", "train", "*"))
                                       for e in tf.compat.v1.train.summary_iterator(path)
                                       for v in e.summary.value if v.tag == "batch_loss")
    return out


def run_loss_overflow(root: str) -> dict:
    """A target of 1e20 at ``BAD_STEP``: the squared error overflows to +Inf
    while its gradients stay finite, and Adafactor's factored squares of
    those gradients would make the weights NaN. The truth: the step's
    update is held back on its loss, so the weights stay finite and the
    replay runs on the ones the step used."""
    logdir = os.path.join(root, "loss_overflow")
    x, y = data("div00")
    y = y[:, :1].copy()
    y[BAD_STEP * BATCH + 1] = 1e20
    keras.utils.set_random_seed(5)
    m = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu", name="dense_0"),
                          keras.layers.Dense(1, name="head")], name="overflowing")
    m.compile(optimizer=keras.optimizers.Adafactor(), loss="mse")
    cb = NumericsCallback(logdir)
    m.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[cb])
    finite = all(bool(np.all(np.abs(keras.ops.convert_to_numpy(w)) < np.inf)) for w in m.weights)
    return {"report": report(logdir), "verdict": cb.replay_verdict, "weights_finite": finite}


def run_adam_eps0(root: str) -> dict:
    """Adam with epsilon=0 and an input feature that is 0 in every batch: its
    kernel row never has a gradient, so its update is 0/0 from the first
    step, a NaN the optimizer makes from finite gradients. The truth: the
    batches after which Keras' own weights were not finite."""
    logdir = os.path.join(root, "adam_eps0")
    x, y = data("div00")
    x, y = x.copy(), y[:, :1].copy()
    x[:, 0] = 0.0
    keras.utils.set_random_seed(5)
    m = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh", name="dense_0"),
                          keras.layers.Dense(1, name="head")], name="eps0")
    m.compile(optimizer=keras.optimizers.Adam(1e-3, epsilon=0.0), loss="mse")
    oracle = _WeightsOracle()
    m.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[NumericsCallback(logdir), oracle])
    bad = [b for b, ws in enumerate(oracle.after) if not all(np.isfinite(w).all() for w in ws)]
    return {"report": report(logdir), "oracle_bad": bad}


def run_normed_dropout(root: str) -> dict:
    """``div00``'s fault in the loss of a model with BatchNormalization and Dropout."""
    logdir = os.path.join(root, "normed_dropout")
    x, y = data("div00")
    keras.utils.set_random_seed(5)
    m = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, name="dense_0"),
                          keras.layers.BatchNormalization(name="bn"), keras.layers.ReLU(name="relu"),
                          keras.layers.Dropout(0.2, name="drop"), keras.layers.Dense(1, name="head")], name="normed")
    m.compile(optimizer=keras.optimizers.SGD(0.01), loss=ratio_loss)
    cb = NumericsCallback(logdir)
    m.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[cb])
    return {"report": report(logdir), "verdict": cb.replay_verdict}


def run_block(root: str) -> dict:
    """``log0``'s fault inside a user-written layer, and the truth beside it."""
    logdir = os.path.join(root, "block")
    x, y = data("log0")
    keras.utils.set_random_seed(5)
    block = Block(name="block")
    m = keras.Sequential([keras.Input((5,)), block, keras.layers.Dense(1, name="head")], name="outer")
    m.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    m.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[NumericsCallback(logdir)])
    truth = _first_nonfinite_layer(x, [("block/fault", block.fault), ("block/dense_0", block.dense),
                                       ("head", m.get_layer("head"))])
    return {"report": report(logdir), "oracle_layer": truth}


def run_looped(root: str, kind: str) -> dict:
    """``kind``'s fault called inside a loop of a user-written layer's graph."""
    logdir = os.path.join(root, "looped_" + kind)
    x, y = data(kind)
    keras.utils.set_random_seed(5)
    looped = Looped(kind, name="looped")
    m = keras.Sequential([keras.Input((5,)), looped, keras.layers.Dense(1, name="head")], name="outer")
    m.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    m.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[NumericsCallback(logdir)])
    truth = _first_nonfinite_layer(x, [("looped/fault", looped.fault), ("head", m.get_layer("head"))])
    return {"report": report(logdir), "oracle_layer": truth}


HUGE = 3e19  # finite, but its square is beyond float32's range


def bn_data() -> tuple[np.ndarray, np.ndarray]:
    """Standard-normal inputs; the batch at ``BAD_STEP`` scaled by ``HUGE``."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((STEPS * BATCH, 5)).astype(np.float32)
    y = rng.standard_normal((STEPS * BATCH, 1)).astype(np.float32)
    x[BAD_STEP * BATCH:(BAD_STEP + 1) * BATCH] *= HUGE
    return x, y


def bn_model() -> keras.Model:
    keras.utils.set_random_seed(5)
    m = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, name="dense_0"),
                          keras.layers.BatchNormalization(name="bn"), keras.layers.ReLU(name="relu"),
                          keras.layers.Dense(1, name="head")], name="normed")
    m.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return m


class _MovingVarianceOracle(keras.callbacks.Callback):
    """The batches after which BatchNormalization's moving variance, as
    Keras holds it, is not finite: outside the product."""

    def __init__(self) -> None:
        super().__init__()
        self.bad: list[int] = []

    def on_train_batch_end(self, batch, logs=None) -> None:
        state = getattr(self.model, "_jax_state", None)
        names = [v.path for v in self.model.non_trainable_variables]
        values = state["non_trainable_variables"] if state else [v.value for v in self.model.non_trainable_variables]
        mv = values[names.index(self.model.get_layer("bn").moving_variance.path)]
        if not np.isfinite(keras.ops.convert_to_numpy(mv)).all():
            self.bad.append(batch)


def run_moving_variance(root: str) -> dict:
    """A finite batch of 3e19 makes the moving variance +Inf while the loss
    and the gradients stay finite (training normalises by the batch's own
    variance): the run's first anomaly, and the batches the oracle saw."""
    logdir = os.path.join(root, "moving_variance")
    x, y = bn_data()
    oracle = _MovingVarianceOracle()
    m = bn_model()
    history = m.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                    callbacks=[NumericsCallback(logdir), oracle])
    return {"report": report(logdir), "oracle_bad": oracle.bad, "path": m.get_layer("bn").moving_variance.path,
            "losses_finite": bool(np.isfinite(history.history["loss"]).all())}


def jax_debug_oracle(kind: str) -> str:
    """JAX's own word on the bad batch: the forward pass and the loss, then
    their gradient, run un-jitted under ``jax_debug_nans`` and ``jax_debug_infs``,
    which raise at the first primitive whose output is NaN or Inf ("invalid
    value (nan) encountered in div")."""
    import jax

    m = model(kind)
    x, y = (jax.numpy.asarray(a[BAD_STEP * BATCH:(BAD_STEP + 1) * BATCH]) for a in data(kind))
    bad = slice(None)
    ntv = [v.value for v in m.non_trainable_variables]
    loss_fn = keras.losses.get(m.loss)

    def loss(tv):  # the forward pass and the loss, differentiated: the backward pass too
        y_pred, _ = m.stateless_call(tv, ntv, x[bad], training=True)
        return keras.ops.mean(loss_fn(y[bad], y_pred))

    tv = [v.value for v in m.trainable_variables]
    jax.config.update("jax_debug_nans", True)
    jax.config.update("jax_debug_infs", True)
    try:
        with jax.disable_jit():
            loss(tv)  # the forward pass first, as the step runs it
            jax.grad(loss)(tv)
    except FloatingPointError as e:  # Keras may wrap it: "Exception encountered when calling Fault.call()..."
        found = re.search(r"invalid value \((?:nan|inf)\) encountered in \w+", str(e))
        return found.group(0) if found else str(e)
    finally:
        jax.config.update("jax_debug_nans", False)
        jax.config.update("jax_debug_infs", False)
    return ""


def bn_forward_oracle() -> str:
    """The backend's own word on the first op of the bad batch's forward pass
    (in training) to make a NaN or an Inf: the op type TensorFlow's
    ``enable_check_numerics`` names, or the primitive ``jax_debug_infs`` names;
    "" where it names none (PyTorch has no such check of a forward pass)."""
    m = bn_model()
    x, _ = bn_data()
    xb = x[BAD_STEP * BATCH:(BAD_STEP + 1) * BATCH]
    if BACKEND == "tensorflow":
        import tensorflow as tf

        tf.debugging.enable_check_numerics()
        try:
            m(xb, training=True)
        except tf.errors.InvalidArgumentError as e:
            found = re.search(r'Detected Infinity or NaN in output \d+ of \S+ op "([^"]+)"', e.message)
            return found.group(1) if found else e.message
        finally:
            tf.debugging.disable_check_numerics()
    elif BACKEND == "jax":
        import jax

        jax.config.update("jax_debug_infs", True)
        try:
            with jax.disable_jit():
                m(jax.numpy.asarray(xb), training=True)
        except FloatingPointError as e:
            found = re.search(r"invalid value \(inf\) encountered in (\w+)", str(e))
            return found.group(1) if found else str(e)
        finally:
            jax.config.update("jax_debug_infs", False)
    return ""


def torch_anomaly_oracle(kind: str) -> str:
    """PyTorch's own word on the bad batch: the step's forward and backward
    passes under ``torch.autograd.detect_anomaly()``, which raises at the
    first backward function that returned NaN ("Function 'SqrtBackward0'
    returned nan values in its 0th output"); "" where it raised nothing (it
    checks the backward pass only)."""
    import torch

    m = model(kind)
    x, y = data(kind)
    bad = slice(BAD_STEP * BATCH, (BAD_STEP + 1) * BATCH)
    loss_fn = keras.losses.get(m.loss)
    try:
        with torch.autograd.detect_anomaly():
            keras.ops.mean(loss_fn(torch.as_tensor(y[bad]), m(torch.as_tensor(x[bad]), training=True))).backward()
    except RuntimeError as e:
        found = re.search(r"Function '(\w+)' returned nan", str(e))
        return found.group(1) if found else str(e)
    return ""


def main(out: str, root: str) -> None:
    results = {"backend": keras.backend.backend()}
    for kind in FAULTS:
        results[kind] = run_fault(kind, root)
        if BACKEND == "jax":
            results[kind]["oracle"] = jax_debug_oracle(kind)
        elif BACKEND == "torch":
            results[kind]["oracle"] = torch_anomaly_oracle(kind)
    results["weights"] = run_weights(root)
    results["moving_variance"] = run_moving_variance(root)
    results["moving_variance"]["oracle_op"] = bn_forward_oracle()
    results["refit"] = run_refit(root)
    results["nested"] = run_nested(root)
    results["block"] = run_block(root)
    results["masked"] = run_masked(root)
    results["masked_looped"] = run_masked(root, looped=True)
    results["normed_dropout"] = run_normed_dropout(root)
    results["nan_batch"] = run_nan_batch(root)
    results["accumulated"] = run_accumulated(root)
    results["loss_overflow"] = run_loss_overflow(root)
    results["adam_eps0"] = run_adam_eps0(root)
    for by_hand in (False, True):
        results["guide_hand" if by_hand else "guide_compute"] = run_guide_step(root, by_hand)
    for kind in ("log0", "sqrt0"):
        results["looped_" + kind] = run_looped(root, kind)
    from demo.stories import keras_fit

    keras_fit.run(root)
    results["keras_fit"] = {"report": report(os.path.join(root, keras_fit.NAME))}
    if __name__ == "__main__" and BACKEND != "tensorflow":  # TensorFlow's own tests cover these there
        results["every_n"] = run_fault("log0", root, every_n_steps=5, stop_on_anomaly=True)
        for policy in ("mixed_float16", "mixed_bfloat16"):
            results[policy] = run_mixed(policy, root)
    results["tensorflow_imported"] = sorted(m for m, mod in sys.modules.items()
                                            if mod is not None and (m == "tensorflow" or m.startswith("tensorflow.")))
    with open(out, "w") as f:
        json.dump(results, f, default=str)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
