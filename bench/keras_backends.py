"""What NumericsCallback costs a model.fit step on each Keras backend, side by side.

    python bench/keras_backends.py [--backends tensorflow,jax,torch] [--reps 9] [--steps 5] [--baseline TREE]

The model is bench/overhead.py's: 6 Dense layers of 1024 units with ReLU,
batch 512, SGD, mse. Each backend runs in a process of its own (Keras picks
its backend once per process), one after the other so that they do not
compete for the cores. In each, two models with the same initial weights,
plain and with ``NumericsCallback``'s defaults (outputs, loss, gradients
every step; weights and update ratios every 10th; replay on), are driven
through the loop ``fit`` runs for every batch (the backend's
``train_function``, then ``on_train_batch_end``), in blocks of ``--steps``
steps, the two interleaved in a new order each repetition; a block ends by
waiting for its last step's results (and the callback's writes), so work
left running is charged to it. Printed per backend: the median step time of
each, their ratio and the median of the ratios of the blocks run side by
side (target: <= 1.15), and the machine's load.

``--fits N``: first, on fresh models, the seconds of two ``model.fit``
calls of N batches each, plain and with one ``NumericsCallback`` (the first
call compiles the step; the second shows whether it is compiled again);
``--reps 0`` prints only those.

``--baseline TREE`` (a checkout of another commit, e.g. ``git worktree add
/tmp/base main``) measures that tree's callback too, per backend right
before this tree's, so that a change's before and after are printed side
by side in one run under the same load.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

WIDTH, DEPTH, BATCH = 1024, 6, 512
TARGET = 1.15


def _model(keras, np):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((WIDTH,))] + [
        keras.layers.Dense(WIDTH, activation="relu", name="dense%d" % i) for i in range(DEPTH)])
    rng = np.random.default_rng(0)  # the same weights on every backend
    model.set_weights([rng.uniform(-0.05, 0.05, w.shape).astype(np.float32) if w.ndim == 2 else np.zeros_like(w)
                       for w in model.get_weights()])
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=1e-4), loss="mse")
    return model


def _driver(backend: str, keras, model, callbacks, x, y):
    """A zero-argument step of fit's per-batch loop, and a settle() that waits for it."""
    cbs = keras.callbacks.CallbackList(callbacks, model=model)
    if not model.optimizer.built:  # fit builds it before the first step
        model.optimizer.build(model.trainable_variables)
    model.make_train_function()
    cbs.on_train_begin()
    batch = [0]
    if backend == "jax":
        import jax

        state = [model._get_jax_state(trainable_variables=True, non_trainable_variables=True,  # noqa: SLF001
                                      optimizer_variables=True, metrics_variables=True)]
        data = (jax.device_put(x), jax.device_put(y))

        def step():
            logs, state[0] = model.train_function(state[0], iter([data]))
            tv, ntv, ov, mv = state[0]
            model._jax_state = {"trainable_variables": tv, "non_trainable_variables": ntv,  # noqa: SLF001
                                "optimizer_variables": ov, "metrics_variables": mv}
            cbs.on_train_batch_end(batch[0], logs)
            batch[0] += 1

        def settle():
            jax.block_until_ready(state[0])
            cbs.on_epoch_end(0)
    elif backend == "torch":
        import torch

        data = (torch.as_tensor(x), torch.as_tensor(y))

        def step():
            logs = model.train_function([data])
            cbs.on_train_batch_end(batch[0], logs)
            batch[0] += 1

        def settle():
            cbs.on_epoch_end(0)
    else:
        import tensorflow as tf

        iterator = iter(tf.data.Dataset.from_tensors((x, y)).repeat())

        def step():
            logs = model.train_function(iterator)
            cbs.on_train_batch_end(batch[0], logs)
            batch[0] += 1

        def settle():
            cbs.on_epoch_end(0)
    return step, settle


def _two_fits(keras, np, callbacks, x, y, batches: int) -> list[float]:
    """Seconds of two ``fit`` calls of ``batches`` batches each, on a fresh model."""
    model = _model(keras, np)
    xs, ys = np.concatenate([x] * batches), np.concatenate([y] * batches)
    out = []
    for _ in range(2):
        start = time.perf_counter()
        model.fit(xs, ys, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
        out.append(time.perf_counter() - start)
    return out


def worker(reps: int, steps: int, callback_args: dict, fits: int = 0) -> dict:
    """Runs in a process whose KERAS_BACKEND is set; the per-block step times of each mode."""
    import keras
    import numpy as np

    from tb_numerics.keras import NumericsCallback

    backend = keras.backend.backend()
    rng = np.random.default_rng(1)
    x = rng.normal(size=(BATCH, WIDTH)).astype(np.float32)
    y = rng.normal(size=(BATCH, WIDTH)).astype(np.float32)
    root = tempfile.mkdtemp(prefix="tbn_bench_backends_")
    two = {}
    if fits:
        two = {"fit": _two_fits(keras, np, [], x, y, fits),
               "fit_callback": _two_fits(keras, np, [NumericsCallback(os.path.join(root, "fits"), **callback_args)],
                                         x, y, fits)}
    modes = {} if not reps else {
        "fit": _driver(backend, keras, _model(keras, np), [], x, y),
        "fit_callback": _driver(backend, keras, _model(keras, np), [NumericsCallback(root, **callback_args)], x, y)}
    for step, settle in modes.values():  # compile, and the first weights step
        for _ in range(2):
            step()
        settle()
    times: dict[str, list[float]] = {m: [] for m in modes}
    order = list(modes)
    for _ in range(reps):
        random.shuffle(order)
        for m in order:
            step, settle = modes[m]
            start = time.perf_counter()
            for _ in range(steps):
                step()
            settle()
            times[m].append((time.perf_counter() - start) / steps)
    import tb_numerics

    return {"backend": backend, "times": times, "fits": two,
            "tree": os.path.dirname(os.path.dirname(tb_numerics.__file__))}


def _report(result: dict, load: str, label: str = "") -> bool:
    if result.get("fits"):
        (p1, p2), (c1, c2) = result["fits"]["fit"], result["fits"]["fit_callback"]
        print("%-10s first fit call: plain %.2f s, with the callback %.2f s (%+.2f s); second call: plain %.2f s, "
              "with the callback %.2f s (%+.2f s)%s" % (result["backend"], p1, c1, c1 - p1, p2, c2, c2 - p2, label),
              flush=True)
    t = result["times"]
    if not t or not all(t.values()):
        return True
    med = {m: statistics.median(v) for m, v in t.items()}
    ratio = med["fit_callback"] / med["fit"]
    paired = statistics.median(c / p for c, p in zip(t["fit_callback"], t["fit"]))
    met = max(ratio, paired) <= TARGET
    print("%-10s fit %7.1f ms   fit_callback %7.1f ms   ratio %.3f (median of paired ratios %.3f)   target <= %.2f: "
          "%s   load %s%s" % (result["backend"], 1e3 * med["fit"], 1e3 * med["fit_callback"], ratio, paired, TARGET,
                            "MET" if met else "NOT MET", load, label), flush=True)
    return met


def _run_worker(backend: str, tree: str, args: argparse.Namespace) -> dict | None:
    """Runs ``worker`` in a process of its own on ``backend``, importing tb_numerics from ``tree``."""
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join(filter(None, [tree, os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", "--reps", str(args.reps),
                          "--steps", str(args.steps), "--callback-args", args.callback_args,
                          "--fits", str(args.fits)],
                         env=env, capture_output=True, text=True)
    if out.returncode:
        print("%s failed:\n%s" % (backend, out.stderr[-3000:]))
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", default="tensorflow,jax,torch")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--callback-args", default="{}", help='NumericsCallback arguments as JSON, e.g. \'{"replay": false}\'')
    p.add_argument("--baseline", help="another source tree whose callback is measured too, side by side")
    p.add_argument("--fits", type=int, default=0, help="also time two fit calls of this many batches each")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.reps, args.steps, json.loads(args.callback_args), args.fits)))
        return 0
    here = os.path.dirname(os.path.abspath(__file__))
    print("bench/keras_backends.py --backends %s --reps %d --steps %d --fits %d --callback-args '%s'%s (6x1024 MLP, "
          "batch 512, SGD)" % (args.backends, args.reps, args.steps, args.fits, args.callback_args,
             " --baseline %s" % args.baseline if args.baseline else ""), flush=True)
    trees = ([("baseline", os.path.abspath(args.baseline))] if args.baseline else []) + [("", os.path.dirname(here))]
    for backend in args.backends.split(","):
        for label, tree in trees:
            result = _run_worker(backend, tree, args)
            if result is not None:
                _report(result, "%.1f" % os.getloadavg()[0],
                        "   (%s: %s)" % (label or "this tree", result["tree"]) if args.baseline else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
