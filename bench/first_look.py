"""Is a first look the whole run's first anomaly? Checked on real runs.

A first look (``run_store``, ``http_api.md``) names a long run's first
anomaly from one step's records before the run is read. For every run of
the logdirs given, held as a long run however short, this asks the plugin's
store for one and compares it with ``tb-numerics report``'s first anomaly
(every record read):

    nice .venv/bin/python bench/first_look.py LOGDIR [LOGDIR ...]
    nice .venv/bin/python bench/first_look.py /tmp/zoo/*-product   # bench/zoo.py --workdir /tmp/zoo

Each run is ``look`` (every field the first look gives is the report's),
``none`` (no first look: the answer is the whole run's, and its first
anomaly the report's) or ``WRONG``; the totals follow. Exit status 1 on any
``WRONG``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests"))
import long_run  # noqa: E402 - the tests' store that holds every run as a long run


def check(logdir: str) -> list[tuple[str, str, str]]:
    """(run, verdict, what the answer named) for each run of ``logdir``."""
    from tensorboard.context import RequestContext

    from tb_numerics import analysis, cli, rules

    truth, _ = cli.report(logdir, analysis.SafeRange())
    store = long_run.compact_store(logdir)
    out = []
    for want in truth:
        run = "." if want["run"] == os.path.basename(os.path.normpath(logdir)) else want["run"]
        answer = store.answer(RequestContext(), "", run, analysis.SafeRange(), first_look=True)
        expected = want["first_anomaly"]
        if answer.preliminary:
            got = analysis.first_look_summary(answer.analysis)["first_anomaly"]
            same = expected is not None and all(
                rules.dumps(v) == rules.dumps(expected.get(k)) for k, v in got.items() if v is not None)
            verdict = "look" if same else "WRONG"
        else:
            got = analysis.run_summary(answer.analysis)["first_anomaly"]
            verdict = "none" if rules.dumps(got) == rules.dumps(expected) else "WRONG"
        out.append((want["run"], verdict, "step %s, %s" % (got["step"], got["tensor"]) if got else "no anomaly"))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("logdirs", nargs="+")
    args = p.parse_args(argv)
    totals: dict[str, int] = {"look": 0, "none": 0, "WRONG": 0}
    for logdir in args.logdirs:
        for run, verdict, named in check(logdir):
            totals[verdict] += 1
            print("%-5s  %s  %s: %s" % (verdict, os.path.basename(os.path.normpath(logdir)), run, named), flush=True)
    print("runs %d: a first look %d (each the report's), none %d (the whole answer), wrong %d" % (
        sum(totals.values()), totals["look"], totals["none"], totals["WRONG"]))
    return 1 if totals["WRONG"] else 0


if __name__ == "__main__":
    sys.exit(main())
