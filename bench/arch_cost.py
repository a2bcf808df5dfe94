"""What the Keras callback and the custom-loop path cost on real architectures, side by side.

    python bench/arch_cost.py --model mlp|cnn|transformer|resnet50 [--reps 10] [--steps 5]
                              [--modes fit,callback,loop,loop_numerics] [--first-epoch]

Models: ``bench/arch_models.py``'s (synthetic data, the sizes of issue 28's
table: an MLP, a BatchNorm CNN, a Transformer encoder, ResNet-50).

All are functional Keras models trained with SGD. Modes, each on its own
model built from the same seed (the same initial weights), run interleaved in
one process: ``--steps`` steps of each per repetition, in a new order each
repetition, so that the machine's other load hits them alike:

* ``fit``: ``model.fit``'s per-batch loop (``model.train_function`` on a
  dataset iterator, then the callbacks' batch hooks), no callback;
* ``callback``: the same with ``NumericsCallback``'s defaults (each epoch's
  end, here a repetition's, is charged to it: the callback waits for its
  writer thread there);
* ``loop``: a custom ``tf.function`` step (``GradientTape``, the model
  called for every layer's output, ``optimizer.apply``), no logging;
* ``loop_numerics``: the same with ``log_numerics`` on every layer's output
  and the loss, and ``log_gradients``, under a writer with a ``tf.Variable``
  step;
* ablations of the callback: ``cb_no_acts`` (``activations=False``),
  ``cb_no_grads`` (``gradients=False``), ``cb_no_replay``
  (``replay=False``), ``cb_bare`` (no records at all: the patched step alone);
* ``cb_ops`` and ``loop_numerics_ops``: ``callback`` and ``loop_numerics``
  with each record made of TensorFlow's ops, not the record kernel (what
  a machine where the kernel cannot be built runs; ``tb_numerics/record_kernel.py``).

Printed: each mode's median step time (wall and this process's CPU time),
each mode against its baseline (``callback`` and its ablations against
``fit``, ``loop_numerics`` against ``loop``) as the ratio of the medians
and the median of the paired ratios (the blocks of one repetition run side
by side), and the machine's load.

``--first-epoch``: first, the first epoch (``--epoch-steps`` batches, tracing
included) of ``model.fit`` with and without the callback, then a second
``fit`` call of each (the same callback: what a user calling ``fit`` in a
loop pays at each call), and the first
``--epoch-steps`` steps of the custom loop with and without logging, each in
a fresh process (so that none reuses what another traced), in the order
``fit, callback, loop, loop_numerics``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tb_numerics as tbn  # noqa: E402
from tb_numerics import record_kernel  # noqa: E402
from tb_numerics.keras import NumericsCallback  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from arch_models import BUILDERS, build, data as _data, loss as _loss  # noqa: E402
from overhead import fit_per_batch  # noqa: E402

# ------------------------------------------------------------------ modes


def _fit_loop(model_name: str, x, y, callbacks: list) -> Callable[[], Any]:
    """fit's per-batch loop on a fresh model (``bench/overhead.py``'s ``fit_per_batch``)."""
    return fit_per_batch(build(model_name), x, y, callbacks)


def _loop(model_name: str, x, y, logdir: str | None) -> Callable[[], Any]:
    """A custom tf.function step over every layer's output; logged where ``logdir``."""
    model = build(model_name)
    layers = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
    probe = keras.Model(model.inputs, [layer.output for layer in layers])
    loss_fn, opt = _loss(model_name), model.optimizer
    variables = model.trainable_variables
    opt.build(variables)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            outs = probe(xb, training=True) if logdir else [model(xb, training=True)]
            if logdir:
                for layer, out in zip(layers, outs):
                    tbn.log_numerics(layer.name + "/output", out)
            loss = loss_fn(yb, outs[-1])
            if logdir:
                tbn.log_numerics("loss", loss)
        grads = tape.gradient(loss, variables)
        if logdir:
            tbn.log_gradients(grads, variables)
        opt.apply(grads, variables)
        return loss

    xt, yt = tf.constant(x), tf.constant(y)
    if logdir is None:
        return lambda: step(xt, yt)
    writer = tf.summary.create_file_writer(logdir, max_queue=1000)
    counter = tf.Variable(0, dtype=tf.int64)

    def run():
        with writer.as_default(step=counter):
            out = step(xt, yt)
        counter.assign_add(1)
        return out

    run.settle = writer.flush
    return run


def _without_kernel(make: Callable[..., Callable[[], Any]]) -> Callable[..., Callable[[], Any]]:
    """Mode ``make`` with its records traced from TensorFlow's ops, not the record kernel."""

    def mode(m, x, y, d):
        fn = make(m, x, y, d)

        def run():
            with record_kernel.use(False):
                return fn()

        for attr in ("settle", "end"):
            if hasattr(fn, attr):
                setattr(run, attr, getattr(fn, attr))
        return run

    return mode


MODES: dict[str, Callable[..., Callable[[], Any]]] = {
    "fit": lambda m, x, y, d: _fit_loop(m, x, y, []),
    "callback": lambda m, x, y, d: _fit_loop(m, x, y, [NumericsCallback(d)]),
    "cb_no_acts": lambda m, x, y, d: _fit_loop(m, x, y, [NumericsCallback(d, activations=False)]),
    "cb_no_grads": lambda m, x, y, d: _fit_loop(m, x, y, [NumericsCallback(d, gradients=False)]),
    "cb_no_replay": lambda m, x, y, d: _fit_loop(m, x, y, [NumericsCallback(d, replay=False)]),
    "cb_bare": lambda m, x, y, d: _fit_loop(m, x, y, [NumericsCallback(
        d, inputs=False, activations=False, gradients=False, weights=False, update_ratios=False, replay=False)]),
    "loop": lambda m, x, y, d: _loop(m, x, y, None),
    "loop_numerics": lambda m, x, y, d: _loop(m, x, y, d),
}
MODES["cb_ops"] = _without_kernel(MODES["callback"])
MODES["loop_numerics_ops"] = _without_kernel(MODES["loop_numerics"])
BASELINE = {"loop_numerics": "loop", "loop_numerics_ops": "loop", "loop": None, "fit": None}  # every other mode: against "fit"


def _sync(out) -> None:
    if isinstance(out, tf.Tensor):
        out.numpy()


def _timed(fn: Callable[[], Any], steps: int) -> tuple[float, float]:
    """Seconds of ``steps`` calls of ``fn``, its result awaited and its block
    settled (``fn.settle``, where it has one), in wall and CPU time."""
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        out = fn()
    _sync(out)
    if hasattr(fn, "settle"):
        fn.settle()
    return time.perf_counter() - t0, time.process_time() - c0


def _load() -> str:
    return "load average %.1f %.1f %.1f on %d cores" % (*os.getloadavg(), os.cpu_count() or 0)


def interleaved(model: str, names: list[str], reps: int, steps: int, warmup: int, root: str) -> dict:
    """Runs the modes interleaved; {mode: (wall ms per step, cpu ms per step) per repetition}."""
    x, y = _data(model)
    fns = {name: MODES[name](model, x, y, os.path.join(root, name)) for name in names}
    for fn in fns.values():
        for _ in range(warmup):
            _sync(fn())
        if hasattr(fn, "settle"):
            fn.settle()
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    order = list(fns.items())
    for rep in range(reps):
        random.Random(rep).shuffle(order)
        for name, fn in order:
            wall, cpu = _timed(fn, steps)
            times[name].append((wall / steps * 1e3, cpu / steps * 1e3))
    for fn in fns.values():
        if hasattr(fn, "end"):
            fn.end()
    return times


def report(model: str, times: dict, reps: int, steps: int) -> None:
    """Prints each mode's medians and its ratios against its baseline."""
    print("%s: median step time over %d interleaved repetitions of %d steps; %s"
          % (model, reps, steps, _load()))
    med = {n: statistics.median(w for w, _ in t) for n, t in times.items()}
    cpu = {n: statistics.median(c for _, c in t) for n, t in times.items()}
    for name in times:
        base = BASELINE.get(name, "fit")
        line = "  %-14s wall %8.1f ms   cpu %8.1f ms" % (name, med[name], cpu[name])
        if base in times:
            paired = statistics.median(a[0] / b[0] for a, b in zip(times[name], times[base]))
            ratio = med[name] / med[base]
            line += "   %.3fx %s (paired %.3fx, cpu %.3fx)" % (ratio, base, paired, cpu[name] / cpu[base])
            if name in ("callback", "loop_numerics"):
                line += " target <= 1.10: wall %s, cpu %s" % (
                    "met" if max(ratio, paired) <= 1.10 else "NOT MET", "met" if cpu[name] / cpu[base] <= 1.10 else "NOT MET")
        print(line)


# ------------------------------------------------------------------ first epoch


def _first_epoch_child(model: str, mode: str, epoch_steps: int) -> list[tuple[float, float]]:
    """In a fresh process: seconds of the first epoch (tracing included), wall and CPU; for
    ``fit`` and ``callback``, then those of a second ``fit`` call (the same callback)."""
    x, y = _data(model)
    logdir = tempfile.mkdtemp(prefix="tbn_arch_first_")
    try:
        if mode in ("fit", "callback", "cb_ops"):
            m = build(model)
            data = tf.data.Dataset.from_tensors((x, y)).repeat(epoch_steps)
            cbs = [NumericsCallback(logdir)] if mode != "fit" else []
            fits = []
            for _ in range(2):
                t0, c0 = time.perf_counter(), time.process_time()
                m.fit(data, epochs=1, verbose=0, callbacks=cbs)
                fits.append((time.perf_counter() - t0, time.process_time() - c0))
            return fits
        return [_timed(_loop(model, x, y, logdir if mode == "loop_numerics" else None), epoch_steps)]
    finally:
        shutil.rmtree(logdir, ignore_errors=True)


def first_epochs(model: str, epoch_steps: int) -> None:
    """Prints the first epoch of each of fit, callback (with the record kernel and without),
    loop and loop_numerics, each in a fresh process."""
    seconds = {}
    for mode in ("fit", "callback", "cb_ops", "loop", "loop_numerics"):
        # cb_ops: the callback with TensorFlow's ops for its records (no record kernel).
        env = {**os.environ, "TB_NUMERICS_RECORD_KERNEL": "0"} if mode == "cb_ops" else None
        out = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--model", model, "--epoch-steps", str(epoch_steps),
             "--child", mode], check=True, capture_output=True, text=True, env=env).stdout
        seconds[mode] = json.loads(out.strip().splitlines()[-1])
    print("%s: first epoch of %d batches, tracing included, each in a fresh process; %s"
          % (model, epoch_steps, _load()))
    for base, name, what, i in (
            ("fit", "callback", "fit %s, with NumericsCallback %s: %s (target <= +3 s)", 0),
            ("fit", "callback", "then a second fit call %s, with the same NumericsCallback %s: %s", 1),
            ("fit", "cb_ops", "fit %s, with NumericsCallback, its records of TensorFlow's ops %s: %s", 0),
            ("loop", "loop_numerics", "custom loop %s, with log_numerics + log_gradients %s: %s", 0)):
        (w0, c0), (w1, c1) = seconds[base][i], seconds[name][i]
        print("  " + what % ("%.1f s (cpu %.1f s)" % (w0, c0), "%.1f s (cpu %.1f s)" % (w1, c1),
                              "%+.1f s (cpu %+.1f s)" % (w1 - w0, c1 - c0)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(BUILDERS), default="cnn")
    p.add_argument("--modes", default="fit,callback,loop,loop_numerics",
                   help="comma-separated, from: %s" % ", ".join(MODES))
    p.add_argument("--reps", type=int, default=10, help="interleaved repetitions")
    p.add_argument("--steps", type=int, default=5, help="steps per mode per repetition")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per mode first")
    p.add_argument("--first-epoch", action="store_true", help="also time the first epoch, in fresh processes")
    p.add_argument("--epoch-steps", type=int, default=8, help="batches of the first epoch")
    p.add_argument("--child", choices=sorted(MODES), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(_first_epoch_child(args.model, args.child, args.epoch_steps)))
        return 0
    names = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODES]
    if unknown:
        p.error("unknown mode(s) %s; known: %s" % (", ".join(unknown), ", ".join(MODES)))
    if args.first_epoch:
        first_epochs(args.model, args.epoch_steps)
    if args.reps > 0 and names:
        root = tempfile.mkdtemp(prefix="tbn_arch_")
        try:
            times = interleaved(args.model, names, args.reps, args.steps, args.warmup, root)
            report(args.model, times, args.reps, args.steps)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
