"""Runs zoo cells under tb-numerics in one process and writes their reports.

    python tests/zoo_cells.py OUT.json WORKDIR ARCH:FAULT:VARIANT ...

Each run is ``bench/zoo.py``'s product run (the Keras callback with its
defaults, or ``log_numerics`` and a replay for the hand-written loop, then
``tb-numerics report --json``), in one process so that TensorFlow is
imported once; the settings are the zoo's own (op determinism, one thread).
"""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "bench"), ROOT]
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main(out: str, workdir: str, cells: list[str]) -> int:
    import tensorflow as tf

    import zoo

    tf.config.experimental.enable_op_determinism()
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    reports = {}
    for cell in cells:
        arch, fault, variant = cell.split(":")
        got = zoo.run_product(arch, fault, variant == "fixed", os.path.join(workdir, cell.replace(":", "-")))
        reports[cell] = got["runs"][0] if len(got["runs"]) == 1 else None
    with open(out, "w") as f:
        json.dump(reports, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3:]))
