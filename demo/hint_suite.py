"""Scores the analysis' hints on buggy trainings whose cause is known.

    python -m demo.hint_suite [--logdir DIR]

Runs the demo's stories and the small buggy Keras trainings of
``demo.buggy_keras``, analyses each run as ``tb-numerics report`` does, and
prints each first anomaly's hint as right (it holds the word the known
cause calls for), absent ("no hint: ..."), or wrong (anything else). A
healthy case is right when it has neither anomaly nor warning. Exit status 1
when any hint is wrong: a confident wrong answer is the worst thing the tool
can print.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tb_numerics import analysis, cli, hints  # noqa: E402


def score(run: dict, truth: str | None) -> str:
    """"right", "absent" or "wrong" for one run summary and its known cause."""
    anomaly = run["first_anomaly"]
    if truth is None:
        return "right" if anomaly is None and run["first_warning"] is None else "wrong"
    if anomaly is None:
        return "wrong"
    if anomaly["hint"].startswith(hints.NO_HINT_PREFIX):
        return "absent"
    return "right" if truth in anomaly["hint"] else "wrong"


def cases() -> list[tuple[str, object, str | None]]:
    """(run name, run(logdir), truth) of every scored training."""
    from demo import buggy_keras
    from demo.stories import STORIES

    return [(s.name, s.run, s.truth) for s in STORIES] + [(c.name, c.run, c.truth) for c in buggy_keras.CASES]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m demo.hint_suite", description=__doc__.splitlines()[0])
    p.add_argument("--logdir", default=None, help="where the runs are written (default: a temporary folder)")
    args = p.parse_args(argv)
    logdir = args.logdir or tempfile.mkdtemp(prefix="hint_suite_")
    chosen = cases()
    for _, run, _ in chosen:
        run(logdir)
    summaries, _ = cli.report(logdir, analysis.SafeRange())
    by_run = {s["run"]: s for s in summaries}
    counts = {"right": 0, "absent": 0, "wrong": 0}
    for name, _, truth in chosen:
        verdict = score(by_run[name], truth)
        counts[verdict] += 1
        a = by_run[name]["first_anomaly"]
        print("%-24s %-6s %s" % (name, verdict, a["hint"] if a else "(no anomaly)"))
    print("hints: %(right)d right, %(absent)d absent, %(wrong)d wrong" % counts)
    return 1 if counts["wrong"] else 0


if __name__ == "__main__":
    sys.exit(main())
