"""How fast TensorBoard shows the first anomaly of a run written by ``log_numerics``.

    python bench/log_numerics_load.py [--steps 10000] [--tensors 50] [--load-fast true] [--loop]

Writes a run with ``log_numerics`` on ``--tensors`` tensors of 64 floats in
a ``tf.function`` step (a NaN in one at step 7,777 of 10,000, scaled to
``--steps``; with ``--loop`` the whole loop of steps in one ``tf.function``,
``tf.range`` around the step, as TPU-style loops do), and the same records again with ``NumericsRecordWriter.write_many``
(what the Keras callback writes). For each run alone, starts a real
``tensorboard`` and times how long after its start the plugin's /summary
holds every record and the first anomaly. Prints both and their ratio
(target <= 1.5).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests"))
import tb_process  # noqa: E402 - the tests' helper that runs a real tensorboard

import tb_numerics as tbn  # noqa: E402
from tb_numerics import event_reader  # noqa: E402
from tb_numerics.record_writer import NumericsRecordWriter  # noqa: E402

__all__ = ["main"]

TARGET = 1.5


def write_log_numerics(run_dir: str, steps: int, n: int, nan_step: int, loop: bool) -> None:
    rng = np.random.default_rng(0)
    ws = [tf.constant(rng.uniform(0.5, 1.5, 64).astype(np.float32)) for _ in range(n)]
    x = tf.constant(rng.standard_normal(64).astype(np.float32))
    writer = tf.summary.create_file_writer(run_dir)
    step = tf.Variable(0, dtype=tf.int64)

    def one_step():
        h = x
        for i, w in enumerate(ws):
            h = tf.tanh(h * w + 0.1)
            if i == n // 2:
                h = h * tf.where(tf.equal(step, nan_step), np.float32(np.nan), np.float32(1.0))
            tbn.log_numerics("layer_%02d/output" % i, h)
        step.assign_add(1)

    @tf.function
    def run_loop():
        for _ in tf.range(steps):
            one_step()

    with writer.as_default(step=step):
        if loop:
            run_loop()
        else:
            run = tf.function(one_step)
            for _ in range(steps):
                run()
    writer.close()


def rewrite_packed(src: str, run_dir: str) -> int:
    """The records of ``src`` written again by ``write_many``; their count."""
    (rr,) = event_reader.read_logdir(src)
    series = sorted(rr.series, key=lambda s: s.info.order)
    with NumericsRecordWriter(run_dir) as w:
        for j, step in enumerate(series[0].steps.tolist()):
            w.write_many(step, [(s.tag, s.values[j], s.info) for s in series])
    return sum(len(s.steps) for s in series)


def time_to_anomaly(logdir: str, run: str, records: int, load_fast: bool) -> tuple[float, int]:
    """Seconds from TensorBoard's start to a complete /summary of ``run``."""
    start = time.monotonic()
    with tb_process.tensorboard(logdir, load_fast=load_fast, reload_interval=1) as tb:
        summary = tb_process.wait_for(
            lambda: (s := tb.get_json("/data/plugin/numerics/summary?run=" + run, timeout=600))["records"] == records
            and not s["stale"] and s,
            timeout=900,
            interval=0.1,
        )
        return time.monotonic() - start, summary["first_anomaly"]["step"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--tensors", type=int, default=50)
    p.add_argument("--load-fast", choices=("true", "false"), default="true")
    p.add_argument("--loop", action="store_true", help="the whole loop of steps in one tf.function")
    args = p.parse_args(argv)
    nan_step = int(args.steps * 0.7777)
    root = tempfile.mkdtemp(prefix="tbn_load_")
    try:
        t = time.monotonic()
        write_log_numerics(os.path.join(root, "a", "log_numerics"), args.steps, args.tensors, nan_step, args.loop)
        print("wrote %d steps x %d tensors with log_numerics in %.1f s" % (args.steps, args.tensors, time.monotonic() - t))
        records = rewrite_packed(os.path.join(root, "a"), os.path.join(root, "b", "write_many"))
        out = {}
        for d, run in (("a", "log_numerics"), ("b", "write_many")):
            sizes = sum(os.path.getsize(os.path.join(root, d, run, f)) for f in os.listdir(os.path.join(root, d, run)))
            secs, step = time_to_anomaly(os.path.join(root, d), run, records, args.load_fast == "true")
            assert step == nan_step, step
            out[run] = secs
            print("  %-13s %8.1f MB on disk, complete first anomaly (step %d) %.2f s after TensorBoard's start"
                  % (run, sizes / 1e6, step, secs))
        ratio = out["log_numerics"] / out["write_many"]
        print("log_numerics / write_many = %.2f (target <= %.1f): %s" % (ratio, TARGET, "MET" if ratio <= TARGET else "NOT MET"))
        return 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
