"""How long a model waits for its first step with NumericsCallback.

    python bench/startup.py [--depth 30] [--width 64]

The statistics are built into the training step when ``fit`` first traces
it, so a deep model pays for them before its first step: Python tracing
and TensorFlow's graph optimisation of the step. This times ``fit`` for one
epoch of 4 batches (almost all of it the first step) of a Sequential model
of ``--depth`` Dense sigmoid layers, plain and with ``NumericsCallback``'s
defaults, each in a fresh process so that neither reuses the other's
traced functions, and prints both and their difference.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fit_seconds(depth: int, width: int, callback: bool) -> float:
    """In this process: the seconds of one ``fit`` epoch."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.path.insert(0, ROOT)
    import keras
    import numpy as np

    from tb_numerics.keras import NumericsCallback

    keras.utils.set_random_seed(0)
    x = np.random.RandomState(0).randn(128, width).astype("float32")
    y = np.random.RandomState(1).randn(128, 1).astype("float32")
    model = keras.Sequential(
        [keras.Input((width,))]
        + [keras.layers.Dense(width, activation="sigmoid") for _ in range(depth)]
        + [keras.layers.Dense(1)]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    callbacks = [NumericsCallback(tempfile.mkdtemp(prefix="tbn_startup_"))] if callback else []
    t0 = time.perf_counter()
    model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=callbacks)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--depth", type=int, default=30, help="Dense layers")
    p.add_argument("--width", type=int, default=64, help="units per layer")
    p.add_argument("--child", choices=["plain", "callback"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(_fit_seconds(args.depth, args.width, args.child == "callback")))
        return 0
    seconds = {}
    for mode in ("plain", "callback"):
        out = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--depth", str(args.depth), "--width", str(args.width),
             "--child", mode],
            check=True, capture_output=True, text=True,
        ).stdout
        seconds[mode] = json.loads(out.strip().splitlines()[-1])
    print("first epoch (4 batches) of a %d-layer Dense model, %d wide:" % (args.depth, args.width))
    print("  plain fit             %6.1f s" % seconds["plain"])
    print("  with NumericsCallback %6.1f s (+%.1f s before training runs at full speed)"
          % (seconds["callback"], seconds["callback"] - seconds["plain"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
