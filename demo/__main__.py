"""Runs the demo's stories, prints their diagnoses, optionally serves them.

    python -m demo [--logdir DIR] [--serve] [--port N] [--host H] [--only NAME ...] [--backend jax|torch]

``--backend jax`` (or ``torch``) runs the stories written for every Keras
backend (``keras_fit``: ``model.fit`` with ``NumericsCallback``) on that
backend, without TensorFlow, into ``<logdir>/<backend>/``.
"""

import argparse
import multiprocessing
import os
import sys
import time
from concurrent import futures

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m demo", description=__doc__.splitlines()[0])
    p.add_argument("--logdir", default="demo_logs", help="where the runs are written (default: demo_logs)")
    p.add_argument("--serve", action="store_true", help="then start TensorBoard on the logdir")
    p.add_argument("--host", default="127.0.0.1", help="address TensorBoard binds to (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=6006, help="TensorBoard's port (default: 6006)")
    p.add_argument("--only", action="append", metavar="NAME", help="run only this story (repeatable)")
    p.add_argument("--backend", choices=("tensorflow", "jax", "torch"), default="tensorflow",
                   help="the Keras backend; jax and torch run the stories written for every backend, "
                   "into LOGDIR/BACKEND (default: tensorflow, every story)")
    return p


def run_stories(logdir: str, only: list[str] | None = None, backend: str = "tensorflow") -> float:
    """Runs the stories into ``logdir``, one process per core; the total seconds.

    Each story is single-threaded enough that running them side by side
    halves the wall time on two cores; each is seeded, so results do not
    depend on which process runs it. The worker processes inherit
    ``KERAS_BACKEND``, which picks Keras' backend.
    """
    from demo.stories import STORIES, run_story

    stories = [s for s in STORIES if backend in s.backends]
    names = [s.name for s in stories]
    unknown = sorted(set(only or ()) - set(names))
    if unknown:
        raise SystemExit("unknown story %s; the stories on %s are: %s" % (", ".join(unknown), backend, ", ".join(names)))
    chosen = [s for s in stories if not only or s.name in only]
    start = time.perf_counter()
    workers = max(1, min(len(chosen), os.cpu_count() or 1))
    with futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        jobs = [pool.submit(run_story, s.name, logdir) for s in chosen]
        for story, job in zip(chosen, jobs):
            # The cause and fix printed are the analysis' own, in the report below.
            print("%-18s %5.1fs" % (story.name, job.result()), flush=True)
    return time.perf_counter() - start


def serve(logdir: str, host: str, port: int) -> None:
    """Serves ``logdir`` with TensorBoard until interrupted."""
    from tensorboard import program

    tb = program.TensorBoard()
    tb.configure(argv=[None, "--logdir", logdir, "--host", host, "--port", str(port)])
    url = tb.launch()
    print("TensorBoard on %s (Numerics tab: %s#numerics); Ctrl-C stops it" % (url, url), flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    start = time.perf_counter()
    logdir = args.logdir
    if args.backend == "tensorflow":
        import tensorflow  # noqa: F401  (timed: most of the start-up)
    else:
        os.environ["KERAS_BACKEND"] = args.backend
        logdir = os.path.join(args.logdir, args.backend)

    from tb_numerics import cli

    stories_s = run_stories(logdir, args.only, args.backend)
    print()
    status = cli.main(["report", logdir])
    print("\nTOTAL %.1fs (stories %.1fs, logs in %s)" % (time.perf_counter() - start, stories_s, logdir))
    if args.serve:
        serve(args.logdir, args.host, args.port)
    # The stories are meant to fail: exit 0 unless the report itself failed.
    return 0 if status in (cli.EXIT_OK, cli.EXIT_ANOMALY) else status


if __name__ == "__main__":
    sys.exit(main())
