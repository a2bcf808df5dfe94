"""What NumericsCallback costs a model.fit step on each Keras backend, side by side.

    python bench/keras_backends.py [--backends tensorflow,jax,torch] [--reps 9] [--steps 5] [--baseline TREE]
                                   [--model mlp|cnn|transformer|resnet50]

The model is bench/overhead.py's: 6 Dense layers of 1024 units with ReLU,
batch 512, SGD, mse; with ``--model``, one of ``bench/arch_models.py``'s
(issue 28's architectures; ``mlp`` is the same MLP as a functional model,
SGD at 1e-3). On a GPU (JAX's or PyTorch's default device), the data is put
there once and each block waits for the device. Each backend runs in a process of its own (Keras picks
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
ARCH_TARGET = 1.10  # issue 28's, for bench/arch_models.py's architectures


def _model(keras, np):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((WIDTH,))] + [
        keras.layers.Dense(WIDTH, activation="relu", name="dense%d" % i) for i in range(DEPTH)])
    rng = np.random.default_rng(0)  # the same weights on every backend
    model.set_weights([rng.uniform(-0.05, 0.05, w.shape).astype(np.float32) if w.ndim == 2 else np.zeros_like(w)
                       for w in model.get_weights()])
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=1e-4), loss="mse")
    return model


def _arch():
    """bench/arch_models.py, imported from beside this file."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import arch_models

    return arch_models


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

        data = (keras.ops.convert_to_tensor(x), keras.ops.convert_to_tensor(y))  # on Keras' device

        def step():
            logs = model.train_function([data])
            cbs.on_train_batch_end(batch[0], logs)
            batch[0] += 1

        def settle():
            if torch.cuda.is_available():
                torch.cuda.synchronize()
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


def _two_fits(model, np, callbacks, x, y, batches: int) -> list[float]:
    """Seconds of two ``fit`` calls of ``batches`` batches each, on a fresh model."""
    xs, ys = np.concatenate([x] * batches), np.concatenate([y] * batches)
    out = []
    for _ in range(2):
        start = time.perf_counter()
        model.fit(xs, ys, batch_size=len(x), epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
        out.append(time.perf_counter() - start)
    return out


def worker(reps: int, steps: int, callback_args: dict, fits: int = 0, model_name: str = "") -> dict:
    """Runs in a process whose KERAS_BACKEND is set; the per-block step times of each mode."""
    import keras
    import numpy as np

    from tb_numerics.keras import NumericsCallback

    backend = keras.backend.backend()
    if model_name:
        arch = _arch()
        x, y = arch.data(model_name)

        def model():
            return arch.build(model_name)
    else:
        rng = np.random.default_rng(1)
        x = rng.normal(size=(BATCH, WIDTH)).astype(np.float32)
        y = rng.normal(size=(BATCH, WIDTH)).astype(np.float32)

        def model():
            return _model(keras, np)
    root = tempfile.mkdtemp(prefix="tbn_bench_backends_")
    two = {}
    if fits:
        two = {"fit": _two_fits(model(), np, [], x, y, fits),
               "fit_callback": _two_fits(model(), np, [NumericsCallback(os.path.join(root, "fits"), **callback_args)],
                                         x, y, fits)}
    modes = {} if not reps else {
        "fit": _driver(backend, keras, model(), [], x, y),
        "fit_callback": _driver(backend, keras, model(), [NumericsCallback(root, **callback_args)], x, y)}
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

    return {"backend": backend, "times": times, "fits": two, "device": _device(backend), "model": model_name,
            "tree": os.path.dirname(os.path.dirname(tb_numerics.__file__))}


def _device(backend: str) -> str:
    """Where the backend runs its steps: the accelerator's name, or "cpu"."""
    if backend == "jax":
        import jax

        return jax.devices()[0].device_kind
    if backend == "torch":
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    return gpus[0].name if gpus else "cpu"


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
    target = ARCH_TARGET if result.get("model") else TARGET
    met = max(ratio, paired) <= target
    print("%-10s fit %7.1f ms   fit_callback %7.1f ms   ratio %.3f (median of paired ratios %.3f)   target <= %.2f: "
          "%s   load %s   on %s%s" % (result["backend"], 1e3 * med["fit"], 1e3 * med["fit_callback"], ratio, paired,
                                     target, "MET" if met else "NOT MET", load, result.get("device", "?"), label),
          flush=True)
    return met


def _run_worker(backend: str, tree: str, args: argparse.Namespace) -> dict | None:
    """Runs ``worker`` in a process of its own on ``backend``, importing tb_numerics from ``tree``."""
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join(filter(None, [tree, os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", "--reps", str(args.reps),
                          "--steps", str(args.steps), "--callback-args", args.callback_args,
                          "--fits", str(args.fits), "--model", args.model],
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
    p.add_argument("--model", default="", choices=["", "mlp", "cnn", "transformer", "resnet50"],
                   help="one of bench/arch_models.py's architectures (default: the 6x1024 Sequential MLP)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.reps, args.steps, json.loads(args.callback_args), args.fits, args.model)))
        return 0
    here = os.path.dirname(os.path.abspath(__file__))
    print("bench/keras_backends.py --backends %s --reps %d --steps %d --fits %d --callback-args '%s'%s%s (%s)"
          % (args.backends, args.reps, args.steps, args.fits, args.callback_args,
             " --model %s" % args.model if args.model else "",
             " --baseline %s" % args.baseline if args.baseline else "",
             "bench/arch_models.py's %s" % args.model if args.model else "6x1024 MLP, batch 512, SGD"), flush=True)
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
