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


def worker(reps: int, steps: int, callback_args: dict) -> dict:
    """Runs in a process whose KERAS_BACKEND is set; the per-block step times of each mode."""
    import keras
    import numpy as np

    from tb_numerics.keras import NumericsCallback

    backend = keras.backend.backend()
    rng = np.random.default_rng(1)
    x = rng.normal(size=(BATCH, WIDTH)).astype(np.float32)
    y = rng.normal(size=(BATCH, WIDTH)).astype(np.float32)
    root = tempfile.mkdtemp(prefix="tbn_bench_backends_")
    modes = {"fit": _driver(backend, keras, _model(keras, np), [], x, y),
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

    return {"backend": backend, "times": times, "tree": os.path.dirname(os.path.dirname(tb_numerics.__file__))}


def _report(result: dict, load: str, label: str = "") -> bool:
    t = result["times"]
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
                          "--steps", str(args.steps), "--callback-args", args.callback_args],
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
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.reps, args.steps, json.loads(args.callback_args))))
        return 0
    here = os.path.dirname(os.path.abspath(__file__))
    print("bench/keras_backends.py --backends %s --reps %d --steps %d --callback-args '%s'%s (6x1024 MLP, batch 512, SGD)"
          % (args.backends, args.reps, args.steps, args.callback_args,
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
