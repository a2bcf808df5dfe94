"""``tb-numerics report LOGDIR``: each run's first anomaly, without a browser.

LOGDIR is a local directory, or any path TensorFlow's filesystems read
(``gs://``, ``s3://`` and ``hdfs://`` with tensorflow-io, ``ram://``) when
TensorFlow is installed.

Exit status, so that a CI job or a training launcher can act on it:
  0  every record was read and no run has a non-finite value;
  1  a run has a non-finite value (whatever else went wrong), in a numerics
     record or in a standard scalar summary (tf.summary.scalar);
  2  usage error: bad arguments, no such logdir, or a filesystem that is not
     available here;
  3  no non-finite value among the records read, but some records could not
     be read (damaged or truncated event files, metadata that was lost or
     cannot be read): the run's problems say which tags and how many.
     An anomaly may hide in what was lost: not a clean bill of health.
  4  nothing was found: no numerics record and no scalar summary in any
     run (an empty logdir, run folders a training has not written to yet,
     a mistyped path in a CI job).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from tb_numerics import analysis, compare, event_reader, report_text, rules, scalars, survive

EXIT_OK = 0
EXIT_ANOMALY = 1
EXIT_USAGE = 2
EXIT_UNREADABLE = 3
EXIT_NOTHING_FOUND = 4


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse exits with 2 as SPEC wants
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, "tb-numerics: error: %s\n" % message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="tb-numerics",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__[__doc__.index("Exit status"):],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser(
        "report",
        help="print each run's first anomaly and first warning",
        epilog=__doc__[__doc__.index("Exit status"):],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    r.add_argument("logdir", help="a TensorBoard logdir: a local path, or gs://, s3://, hdfs://, ram:// with TensorFlow")
    r.add_argument("--json", action="store_true", help="print one JSON object")
    r.add_argument("--against", metavar="RUN", default=None,
                   help="compare every other run with RUN (a healthy rerun): the first step and tensor where "
                        "its records leave RUN's band (tb_numerics.compare)")
    for name, (kind, help_text) in analysis.SAFE_RANGE_PARAMS.items():
        r.add_argument(_flag(name), dest=name, default=None, help=help_text)
    return p


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _parse_flags(args: argparse.Namespace) -> analysis.SafeRange:
    """The safe range the flags give; errors name the flag (``--spike-factor``),
    not the HTTP API's parameter (``spike_factor``)."""
    try:
        return analysis.parse_safe_range(vars(args))
    except analysis.SafeRangeError as e:
        text = str(e)
        for name in analysis.SAFE_RANGE_PARAMS:
            if text.startswith(name + " "):
                raise analysis.SafeRangeError(_flag(name) + text[len(name):]) from None
        raise


def report(logdir: str, sr: analysis.SafeRange, against: str | None = None) -> tuple[list[dict], list[str]]:
    """The run summaries of a logdir and the problems met reading it.

    A logdir that is itself a run is named by its directory's name, not
    ".". A run with no numerics anomaly takes the first non-finite value of
    its scalar summaries (``scalars.first_anomaly``) as its first anomaly;
    ``scalars``, where it has any, counts its scalar tags. With ``against``,
    every other run's summary gets ``against``: ``compare.compare_runs``
    of it with that run, and its ``run``.

    Raises:
      event_reader.LogdirError: ``against`` names no run of the logdir.
    """
    summaries, problems, series = [], [], {}
    for rr in event_reader.read_logdir(logdir):
        run = rr.run if rr.run != "." else os.path.basename(os.path.normpath(logdir)) or logdir
        ra = analysis.analyze_run(run, rr.series, sr, rr.problems)
        problems.extend("%s: %s" % (run, p) for p in rr.problems)
        s = analysis.run_summary(ra)
        s["restarts"] = rr.restarts
        if s["first_anomaly"] is None:
            s["first_anomaly"] = scalars.first_anomaly(rr.scalars)
        s["actions"] = survive.summarize(rr.actions, s["first_anomaly"])
        if rr.scalars:
            s["scalars"] = len(rr.scalars)
        summaries.append(s)
        if against is not None:
            series[run] = rr.series
    if against is not None:
        if against not in series:
            raise event_reader.LogdirError("--against: no run named %r in %s (runs: %s)" % (
                against, logdir, ", ".join(sorted(series)) or "none"))
        for s in summaries:
            if s["run"] != against:
                s["against"] = {"run": against, **compare.compare_runs(series[s["run"]], series[against])}
    return summaries, problems


def main(argv: Sequence[str] | None = None) -> int:
    # The reader uses TensorFlow's record reader when present; keep its C++ logs quiet.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    args = _parser().parse_args(argv)
    # Warning texts hold "×": never fail on a terminal that cannot show it.
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    try:
        event_reader.check_logdir(args.logdir)
        sr = _parse_flags(args)
        summaries, problems = report(args.logdir, sr, args.against)
    except (event_reader.LogdirError, analysis.SafeRangeError, OSError) as e:
        print("tb-numerics: error: %s" % report_text.safe_text(str(e)), file=sys.stderr)
        return EXIT_USAGE
    for p in problems:
        print("tb-numerics: warning: %s" % report_text.safe_text(p), file=sys.stderr)
    if args.json:
        # One JSON rule with the HTTP API: NaN and +-Inf as the strings "NaN", "Infinity", "-Infinity".
        sys.stdout.write(rules.dumps({"runs": summaries}) + "\n")
    elif not summaries:
        print(report_text.nothing_found(args.logdir))
    else:
        print(report_text.table(summaries))
    return exit_status(summaries)


def exit_status(summaries: list[dict]) -> int:
    """1 where a run has an anomaly, else 3 where a run could not be read
    whole, else 4 where nothing was found, else 0 (see the module docstring)."""
    if any(s["first_anomaly"] is not None for s in summaries):
        return EXIT_ANOMALY
    if any(s["problems"] for s in summaries):
        return EXIT_UNREADABLE
    if not any(s["tensors"] or s.get("scalars") for s in summaries):
        return EXIT_NOTHING_FOUND
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
