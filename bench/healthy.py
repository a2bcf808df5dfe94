"""False positives of the early warnings: warnings raised on healthy trainings.

    .venv/bin/python bench/healthy.py [--logdir DIR]

Trains the demo's healthy run and the ordinary healthy Keras trainings of
``demo.healthy_keras`` (an MLP, a CNN, a GRU, an autoencoder, a BatchNorm
model, masked self-attention under mixed_float16) and the custom loops of
``demo.healthy_loops`` (every intermediate logged with ``log_numerics``:
one-hot label products, an attention padding mask, padded sequences,
sparse features, a mixed_float16 loop), all with the default safe range,
and prints every warning and anomaly they raise: each one is a false
positive. Exit status 1 when there is any.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--logdir", default=None)
    args = p.parse_args()
    logdir = args.logdir or tempfile.mkdtemp(prefix="healthy_")

    from demo import healthy_keras, healthy_loops, stories
    from tb_numerics import analysis, cli

    stories.run_story("healthy", logdir)
    for _, train in healthy_keras.CASES + healthy_loops.CASES:
        train(logdir)
    summaries, _ = cli.report(logdir, analysis.SafeRange())
    false_positives = 0
    for s in summaries:
        found = s["warnings"] + ([s["first_anomaly"]] if s["first_anomaly"] else [])
        false_positives += len(found)
        print("%-24s %d records, %d warnings%s" % (s["run"], s["records"], len(found), "".join(
            "\n    %s %s steps %s-%s: %s" % (w.get("kind", "anomaly"), w["tensor"], w.get("first_step", w["step"]),
                                           w.get("last_step", w["step"]), w.get("detail", w.get("description")))
            for w in found)))
    print("healthy trainings: %d, false positives: %d" % (len(summaries), false_positives))
    return 1 if false_positives else 0


if __name__ == "__main__":
    sys.exit(main())
