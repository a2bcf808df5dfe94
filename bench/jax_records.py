"""What JAX's records cost to compile and to run, healthy and on a step that holds a NaN.

    python bench/jax_records.py [--model cnn|transformer|resnet50|mlp] [--runs 3] [--baseline TREE]

``NumericsCallback`` on JAX computes the records inside the jitted step
(``jax_stats.many_stats``); its one ``lax.cond`` holds the exact records
(NaN, Inf and large values), which XLA compiles into every step though a
healthy step never runs it. This jits ``many_stats`` alone over tensors of
the shapes a step of ``bench/arch_models.py``'s model records (its layers'
outputs and its trainable weights, as stand-ins for their gradients) and
prints the seconds of its compilation, the milliseconds of a healthy call,
and of a call where one tensor holds a NaN (the exact branch taken), each
in a fresh process. With ``--baseline TREE`` (a checkout of another commit),
that tree and this one run alternately, ``--runs`` times each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def worker(model_name: str, calls: int) -> dict:
    """In a process whose KERAS_BACKEND is jax: compile seconds, healthy and exact-branch milliseconds."""
    sys.path.insert(0, HERE)
    import jax
    import jax.numpy as jnp
    import keras
    import numpy as np

    import arch_models
    from tb_numerics.backends import jax_stats

    model = arch_models.build(model_name)
    layers = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
    x, _ = arch_models.data(model_name)
    probe = keras.Model(model.inputs, [layer.output for layer in layers])
    rng = np.random.default_rng(0)
    shapes = [tuple(o.shape) for o in probe(x)] + [tuple(v.shape) for v in model.trainable_variables]
    tensors = [jnp.asarray(rng.normal(size=s).astype(np.float32)) for s in shapes]
    bad = list(tensors)
    bad[0] = bad[0].reshape(-1).at[0].set(jnp.nan).reshape(bad[0].shape)
    f = jax.jit(jax_stats.many_stats)
    t0 = time.perf_counter()
    compiled = f.lower(tensors).compile()
    compile_s = time.perf_counter() - t0

    def per_call(ts) -> float:
        jax.block_until_ready(compiled(ts))
        t = time.perf_counter()
        for _ in range(calls):
            out = compiled(ts)
        jax.block_until_ready(out)
        return (time.perf_counter() - t) / calls * 1e3

    import tb_numerics

    return {"tensors": len(tensors), "compile_s": compile_s, "healthy_ms": per_call(tensors),
            "exact_ms": per_call(bad), "tree": os.path.dirname(os.path.dirname(tb_numerics.__file__))}


def _run(tree: str, model: str, calls: int) -> dict:
    env = dict(os.environ, KERAS_BACKEND="jax", PYTHONPATH=os.pathsep.join(filter(None, [tree, os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", "--model", model, "--calls", str(calls)],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="cnn", choices=["mlp", "cnn", "transformer", "resnet50"])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--calls", type=int, default=10, help="timed calls per figure")
    p.add_argument("--baseline", help="another tree, run alternately with this one")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.model, args.calls)))
        return 0
    trees = [("this tree", os.path.dirname(HERE))] + ([("baseline", os.path.abspath(args.baseline))] if args.baseline else [])
    results: dict[str, list[dict]] = {label: [] for label, _ in trees}
    for _ in range(args.runs):
        for label, tree in trees:
            results[label].append(_run(tree, args.model, args.calls))
    print("bench/jax_records.py --model %s --runs %d: jax_stats.many_stats over %d tensors of the step's shapes; "
          "load %.1f" % (args.model, args.runs, results["this tree"][0]["tensors"], os.getloadavg()[0]))
    for label, rs in results.items():
        print("  %-9s compile %s s (median %.2f)   healthy call %s ms   with a NaN (the exact branch) %s ms   (%s)" % (
            label, ", ".join("%.2f" % r["compile_s"] for r in rs), statistics.median(r["compile_s"] for r in rs),
            ", ".join("%.1f" % r["healthy_ms"] for r in rs), ", ".join("%.1f" % r["exact_ms"] for r in rs),
            rs[0]["tree"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
