"""What ``write_check`` (the host check after each packed write) costs a logging step.

Two identical ``tf.function`` steps log ``--tensors`` tensors of 1,024
floats with ``log_numerics`` into two writers; one was traced with the check
and one without it (``tf.numpy_function`` stubbed out while its write ops
are made). They run interleaved, ``--steps`` steps per block, each first in
turn, ``--reps`` blocks each; a packed event (and with it the check) is
written every ``packed.STEPS_PER_EVENT`` steps. Prints the median CPU time
per step of each and their ratio (noisy on a loaded machine), and the CPU
time of the check alone, per packed write. A step that only buffers runs no
op of the check at all: only the writes pay it.

    nice .venv/bin/python bench/write_check.py --tensors 10 --steps 500 --reps 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

import tb_numerics as tbn  # noqa: E402
from tb_numerics import packed  # noqa: E402


def make_step(logdir: str, tensors: int, checked: bool):
    """A step that logs ``tensors`` tensors into its own writer; returns (run a block of steps, writer)."""
    writer = tf.summary.create_file_writer(logdir)
    step = tf.Variable(0, dtype=tf.int64)
    x = tf.random.normal([1024])

    @tf.function
    def log(x):
        for i in range(tensors):
            tbn.log_numerics("t%d" % i, x * (i + 1))

    real = tf.numpy_function
    if not checked:  # the only numpy_function of the write path is the check
        tf.numpy_function = lambda *args, **kwargs: tf.constant(True)
    try:
        with writer.as_default(step=step):
            log(x)  # traced here: the write ops are made at the trace's end
    finally:
        tf.numpy_function = real

    def run(steps: int) -> None:
        # One block in one writer.as_default(): leaving it flushes (a packed write) as a training loop's end does.
        with writer.as_default(step=step):
            for _ in range(steps):
                step.assign_add(1)
                log(x)

    return run, writer


def check_alone(tensors: int, calls: int = 2000) -> tuple[float, float]:
    """CPU seconds of one call of a ``tf.function`` that only runs the check on
    a packed event's rows, and of the same function without it."""
    from tb_numerics import write_check

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "events.out.tfevents.0")
        with open(path, "wb") as f:
            f.write(b"__numerics_block__/bench/")
        check = write_check.GrowthCheck("__numerics_block__/bench/", lambda: [path])
        rows = tf.zeros([packed.STEPS_PER_EVENT * tensors, packed.COLUMNS], tf.float64)
        with_check = tf.function(lambda r: tf.numpy_function(check, [r], tf.bool, stateful=True))
        without = tf.function(lambda r: tf.reduce_any(tf.equal(r[:1, :1], 1.0)))
        out = []
        for fn in (with_check, without):
            fn(rows)
            t0 = time.process_time()
            for _ in range(calls):
                fn(rows)
            out.append((time.process_time() - t0) / calls)
        return out[0], out[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tensors", type=int, default=10)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--reps", type=int, default=8)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        steps = {name: make_step(os.path.join(d, name), args.tensors, name == "checked")
                 for name in ("checked", "unchecked")}
        cpu: dict[str, list[float]] = {name: [] for name in steps}
        for rep in range(args.reps):
            order = list(steps) if rep % 2 == 0 else list(steps)[::-1]
            for name in order:
                run = steps[name][0]
                t0 = time.process_time()
                run(args.steps)
                cpu[name].append((time.process_time() - t0) / args.steps)
        for _, writer in steps.values():
            writer.close()
    one, bare = check_alone(args.tensors)
    a, b = statistics.median(cpu["unchecked"]), statistics.median(cpu["checked"])
    print("%d tensors a step, %d steps a block, %d blocks each" % (args.tensors, args.steps, args.reps))
    print("CPU per step: without the check %.1f us, with it %.1f us: %.3fx (paired ratios %s)" % (
        a * 1e6, b * 1e6, b / a, ", ".join("%.3f" % (c / u) for u, c in zip(cpu["unchecked"], cpu["checked"]))))
    print("the check alone: %.1f us of CPU per packed write (a bare tf.function call: %.1f us), "
          "%.2f us a step at one write per %d steps"
          % (one * 1e6, bare * 1e6, (one - bare) * 1e6 / packed.STEPS_PER_EVENT, packed.STEPS_PER_EVENT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
