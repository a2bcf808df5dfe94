"""Op-level recording of a 1,000-iteration ``tf.while_loop`` against TensorFlow's
``tf.debugging.enable_check_numerics``, side by side.

    python bench/oplevel_loop.py [--iterations 1000] [--repeat 3]

Each mode runs in a fresh process (so none reuses another's traces) that
builds a ``tf.function`` whose ``tf.while_loop`` body makes four float ops
per iteration, and times its first call (trace included) and a second call:

* ``plain``: no checking, for scale;
* ``check_numerics``: ``tf.debugging.enable_check_numerics()`` before the trace;
* ``block``: the call inside ``with writer.as_default(step=0), op_numerics():``
  (the loop's ops recorded through the nested graphs' record ops);
* ``traced``: ``@tf.function`` over ``@op_numerics()``, the step traced with
  the recorder in it;
* ``replay``: ``oplevel.replay_step`` of the function (the loop run eagerly).

It prints each mode's seconds (first call, second call, the whole process)
and each op-level mode's ratio to ``check_numerics``, first calls and whole
processes, the median of ``--repeat`` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("plain", "check_numerics", "block", "traced", "replay")


def _loop_function(tf, iterations: int, wrap=lambda f: f):
    @tf.function
    @wrap
    def run(x):
        def body(i, v):
            h = v * 0.5 + 0.25
            return i + 1, tf.math.sqrt(h * h + 1.0)
        return tf.while_loop(lambda i, v: i < iterations, body, (tf.constant(0), x))[1]
    return run


def _measure(mode: str, iterations: int) -> dict[str, float]:
    """In this process: the seconds of the first and the second call in ``mode``."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.path.insert(0, ROOT)
    import tensorflow as tf

    from tb_numerics import oplevel

    writer = tf.summary.create_file_writer(tempfile.mkdtemp())
    x = tf.ones([256])
    recorder = oplevel.op_numerics(step=0)
    if mode == "check_numerics":
        tf.debugging.enable_check_numerics()
    run = _loop_function(tf, iterations, recorder if mode == "traced" else (lambda f: f))

    def call() -> None:
        with writer.as_default(step=0):
            if mode == "block":
                with recorder:
                    run(x)
            elif mode == "replay":
                oplevel.replay_step(run, x, step=0)
            else:
                run(x)

    out = {}
    for key in ("first", "second"):
        t0 = time.perf_counter()
        call()
        out[key] = time.perf_counter() - t0
    writer.close()
    return out


def _in_fresh_process(mode: str, iterations: int) -> dict[str, float]:
    t0 = time.perf_counter()
    res = subprocess.run(
        [sys.executable, __file__, "--_child", mode, "--iterations", str(iterations)],
        check=True, capture_output=True, text=True,
    )
    got = json.loads(res.stdout.strip().splitlines()[-1])
    got["process"] = time.perf_counter() - t0
    return got


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iterations", type=int, default=1000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--_child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._child:
        print(json.dumps(_measure(args._child, args.iterations)))
        return
    modes = args.modes.split(",")
    runs = {m: [] for m in modes}
    for _ in range(args.repeat):
        for m in modes:
            runs[m].append(_in_fresh_process(m, args.iterations))
            print("  %s: %s" % (m, json.dumps({k: round(v, 2) for k, v in runs[m][-1].items()})), flush=True)
    med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in runs.items()}
    print("%d-iteration tf.while_loop, median of %d fresh processes (seconds)" % (args.iterations, args.repeat))
    print("%-15s %8s %8s %8s" % ("mode", "first", "second", "process"))
    for m in modes:
        print("%-15s %8.2f %8.2f %8.2f" % (m, med[m]["first"], med[m]["second"], med[m]["process"]))
    if "check_numerics" in med:
        ref = med["check_numerics"]
        for m in modes:
            if m not in ("plain", "check_numerics"):
                print("%s / check_numerics: first call %.2fx, process %.2fx" % (
                    m, med[m]["first"] / ref["first"], med[m]["process"] / ref["process"]))


if __name__ == "__main__":
    main()
