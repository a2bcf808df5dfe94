"""What ``log_numerics`` costs on many small tensors, against ``tf.summary.histogram``.

    python bench/small_tensors.py [--tensors 50] [--size 64] [--steps 50] [--reps 15]

A ``tf.function`` step makes ``--tensors`` tensors of ``--size`` floats (a
chain of small elementwise layers, as an RNN's steps or per-layer biases
give). Modes, run interleaved (``--steps`` steps each per repetition, so
that noise from other processes hits them alike); the figure per mode is the
median over repetitions of the mean step time:

* plain: no logging;
* numerics: ``log_numerics`` on each tensor, every step;
* histogram: ``tf.summary.histogram`` on each tensor, every step.

Printed: the step times, each mode's overhead over plain, and the ratio of
numerics' overhead to histogram's (target <= 0.5).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tb_numerics as tbn  # noqa: E402

__all__ = ["main"]

TARGET = 0.5


def make_step(mode: str, n: int, size: int, logdir: str):
    """The step of ``mode``, traced and warmed up, and its writer."""
    rng = np.random.default_rng(0)
    ws = [tf.constant(rng.uniform(0.5, 1.5, size).astype(np.float32)) for _ in range(n)]
    x = tf.constant(rng.standard_normal(size).astype(np.float32))
    writer = tf.summary.create_file_writer(logdir)
    step = tf.Variable(0, dtype=tf.int64)

    @tf.function
    def run():
        h = x
        for i, w in enumerate(ws):
            h = tf.tanh(h * w + 0.1)
            if mode == "numerics":
                tbn.log_numerics("layer_%02d/output" % i, h)
            elif mode == "histogram":
                tf.summary.histogram("layer_%02d/output" % i, h)
        step.assign_add(1)
        return h

    with writer.as_default(step=step):
        for _ in range(3):
            run().numpy()
    return run, writer


def timed(fn, writer, steps: int) -> float:
    """Mean seconds per step over ``steps`` steps, the writer's flush on
    leaving ``as_default`` included."""
    start = time.perf_counter()
    with writer.as_default():
        for _ in range(steps):
            out = fn()
    out.numpy()
    return (time.perf_counter() - start) / steps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tensors", type=int, default=50)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--reps", type=int, default=15)
    args = p.parse_args(argv)
    root = tempfile.mkdtemp(prefix="tbn_small_")
    try:
        modes = ("plain", "numerics", "histogram")
        steps = {m: make_step(m, args.tensors, args.size, os.path.join(root, m)) for m in modes}
        times: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(args.reps):
            for m in modes:
                times[m].append(timed(*steps[m], args.steps))
        for _, writer in steps.values():
            writer.close()
        med = {m: statistics.median(t) for m, t in times.items()}
        print("median step time over %d interleaved repetitions of %d steps, %d tensors of %d floats:"
              % (args.reps, args.steps, args.tensors, args.size))
        for m in modes:
            print("  %-10s %8.3f ms  overhead %+8.3f ms (%.1f us per tensor)"
                  % (m, med[m] * 1e3, (med[m] - med["plain"]) * 1e3, (med[m] - med["plain"]) * 1e6 / args.tensors))
        ratio = (med["numerics"] - med["plain"]) / max(med["histogram"] - med["plain"], 1e-12)
        print("numerics overhead / histogram overhead = %.2f (target <= %.1f): %s"
              % (ratio, TARGET, "MET" if ratio <= TARGET else "NOT MET"))
        return 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
