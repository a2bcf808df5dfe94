"""What PyTorch's records cost inside NumericsCallback's step, and what they counted.

    python bench/torch_records.py [--steps 20] [--runs 3] [--baseline TREE]

``bench/keras_backends.py`` times the whole step, with and without the
callback, on a 2-core machine whose plain step varies by more than the
records cost. This times only ``torch_stats.records`` (every call the
callback makes in ``--steps`` steps of bench/keras_backends.py's MLP, on
the PyTorch backend, after three untimed steps) and counts the passes each
round asked for, by kind and tensor size: a figure that moves with the
records' own work. With ``--baseline TREE`` (a checkout of another commit),
that tree and this one run alternately, each in a fresh process, ``--runs``
times each.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def worker(steps: int) -> dict:
    """In a process whose KERAS_BACKEND is torch: the records' seconds per step, and the rounds' asks."""
    sys.path.insert(0, HERE)
    import keras
    import numpy as np

    import keras_backends
    from tb_numerics.backends import torch_stats
    from tb_numerics.keras import NumericsCallback

    spent: list[float] = []
    asked: collections.Counter = collections.Counter()
    records, settle = torch_stats.records, torch_stats._settle  # noqa: SLF001

    def timed(tensors, names):
        start = time.perf_counter()
        try:
            return records(tensors, names)
        finally:
            spent.append(time.perf_counter() - start)

    def counted(rec, x, dtype, what, *rest):
        asked["%s %d" % (what, x.numel())] += 1
        return settle(rec, x, dtype, what, *rest)

    torch_stats.records, torch_stats._settle = timed, counted  # noqa: SLF001
    rng = np.random.default_rng(1)
    x, y = (rng.normal(size=(keras_backends.BATCH, keras_backends.WIDTH)).astype(np.float32) for _ in range(2))
    model = keras_backends._model(keras, np)  # noqa: SLF001
    step, settle_step = keras_backends._driver("torch", keras, model, [NumericsCallback(tempfile.mkdtemp())], x, y)  # noqa: SLF001
    for _ in range(3):
        step()
    settle_step()
    spent.clear()
    asked.clear()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    settle_step()
    return {"step_ms": 1e3 * (time.perf_counter() - start) / steps, "records_ms": 1e3 * sum(spent) / steps,
            "asked": {k: v / steps for k, v in sorted(asked.items())}}


def _run(tree: str, steps: int) -> dict:
    env = dict(os.environ, KERAS_BACKEND="torch", PYTHONPATH=os.pathsep.join(filter(None, [tree, os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", "--steps", str(steps)],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--baseline", help="another tree, run alternately with this one")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.steps)))
        return 0
    trees = [("this tree", os.path.dirname(HERE))] + ([("baseline", args.baseline)] if args.baseline else [])
    last = {}
    for _ in range(args.runs):
        for label, tree in trees:
            got = _run(tree, args.steps)
            last[label] = got
            print("%-9s records %5.1f ms a step of %6.1f ms (%s)" % (label, got["records_ms"], got["step_ms"], tree),
                  flush=True)
    for label, got in last.items():
        print("%s, passes asked a step, by round and tensor size: %s" % (
            label, ", ".join("%s: %.1f" % kv for kv in got["asked"].items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
