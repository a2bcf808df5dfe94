"""``tb-numerics report LOGDIR``: each run's first anomaly, without a browser.

Exit status: 1 where any run has a non-finite value, 0 where none, 2 on a
usage error (including a logdir that does not exist), so a CI job or a
training launcher can act on it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

from tb_numerics import analysis, event_reader

EXIT_OK = 0
EXIT_ANOMALY = 1
EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse exits with 2 as SPEC wants
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, "tb-numerics: error: %s\n" % message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="tb-numerics", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("report", help="print each run's first anomaly and first warning")
    r.add_argument("logdir", help="a TensorBoard logdir")
    r.add_argument("--json", action="store_true", help="print one JSON object")
    for name, (kind, help_text) in analysis.SAFE_RANGE_PARAMS.items():
        r.add_argument("--" + name.replace("_", "-"), dest=name, default=None, help=help_text)
    return p


def _safe_text(s: str) -> str:
    """A name from a log, with control characters escaped for a terminal."""
    return "".join(
        c if c.isprintable() else "\\x%02x" % ord(c) if ord(c) < 256 else "\\u%04x" % ord(c)
        for c in s
    )


def anomaly_lines(a: dict, head: str = "first anomaly: ") -> list[str]:
    """A first anomaly (``analysis.first_anomaly``) in words, names escaped
    for a terminal: the report's lines, and the Keras callback's stop message."""
    op = " (%s)" % _safe_text(a["op_type"]) if a["op_type"] else ""
    occurrence = ""
    if a.get("occurrence"):
        occurrence = " (record %d of %d in that step)" % (a["occurrence"]["index"], a["occurrence"]["of"])
    lines = ["%sstep %d, %s%s, %s: %s%s" % (
        head, a["step"], _safe_text(a["tensor"]), op, a["phase"], a["description"], occurrence)]
    if a.get("tensor_description"):
        lines.append("  tensor: %s" % _safe_text(a["tensor_description"]))
    lines.append("  last healthy step: %s" % a["last_healthy_step"])
    if a["hint"]:
        lines.append("  hint: %s" % a["hint"])
    c = a["likely_cause"]
    if c is not None:
        lines.append("  likely cause: step %d, %s: %s (%s)" % (
            c["step"], _safe_text(c["tensor"]), c["kind"], c["detail"]))
    return lines


def _table(summaries: list[dict]) -> str:
    lines = []
    for s in summaries:
        lines.append("run %s" % _safe_text(s["run"]))
        a = s["first_anomaly"]
        if a is None:
            lines.append("  first anomaly: none (%d tensors, steps %s-%s)" % (
                s["tensors"], s["first_step"], s["last_step"]))
        else:
            lines.extend("  " + line for line in anomaly_lines(a))
        w = s["first_warning"]
        if w is None:
            lines.append("  first warning: none")
        else:
            lines.append("  first warning: step %d, %s: %s (%s)" % (
                w["step"], _safe_text(w["tensor"]), w["kind"], w["detail"]))
    return "\n".join(lines)


def report(logdir: str, sr: analysis.SafeRange) -> tuple[list[dict], list[str]]:
    """The run summaries of a logdir and the problems met reading it."""
    summaries, problems = [], []
    for rr in event_reader.read_logdir(logdir):
        ra = analysis.analyze_run(rr.run, rr.series, sr, rr.problems)
        problems.extend("%s: %s" % (rr.run, p) for p in rr.problems)
        summaries.append(analysis.run_summary(ra))
    return summaries, problems


def main(argv: Sequence[str] | None = None) -> int:
    # The reader uses TensorFlow's record reader when present; keep its C++ logs quiet.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    args = _parser().parse_args(argv)
    if not os.path.isdir(args.logdir):
        print("tb-numerics: no such logdir: %s" % args.logdir, file=sys.stderr)
        return EXIT_USAGE
    try:
        sr = analysis.parse_safe_range(vars(args))
    except analysis.SafeRangeError as e:
        print("tb-numerics: error: %s" % e, file=sys.stderr)
        return EXIT_USAGE
    # Warning texts hold "×": never fail on a terminal that cannot show it.
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    summaries, problems = report(args.logdir, sr)
    for p in problems:
        print("tb-numerics: warning: %s" % _safe_text(p), file=sys.stderr)
    if args.json:
        json.dump({"runs": summaries}, sys.stdout, allow_nan=False, default=str)
        sys.stdout.write("\n")
    elif not summaries:
        print("no numerics records in %s: log them with tb_numerics.log_numerics" % args.logdir)
    else:
        print(_table(summaries))
    anomalous = any(s["first_anomaly"] is not None for s in summaries)
    return EXIT_ANOMALY if anomalous else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
