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
import json
import os
import sys
from typing import Sequence

from tb_numerics import analysis, compare, event_reader, hints, scalars

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


def _safe_text(s: str) -> str:
    """A name from a log, with control characters escaped for a terminal."""
    return "".join(
        c if c.isprintable() else "\\x%02x" % ord(c) if ord(c) < 256 else "\\u%04x" % ord(c)
        for c in s
    )


# A phase in words where its name alone reads oddly ("step 2, input, input").
_PHASE_WORDS = {"input": "input batch"}


def anomaly_lines(a: dict, head: str = "first anomaly: ") -> list[str]:
    """A first anomaly (``analysis.first_anomaly``) in words, names escaped
    for a terminal: the report's lines, and the Keras callback's stop message."""
    op = " (%s)" % _safe_text(a["op_type"]) if a["op_type"] else ""
    occurrence = ""
    if a.get("occurrence"):
        occurrence = " (record %d of %d in that step)" % (a["occurrence"]["index"], a["occurrence"]["of"])
    phase = ", %s" % _PHASE_WORDS.get(a["phase"], a["phase"]) if a["phase"] else " (%s)" % a.get("source", "")
    lines = ["%sstep %d, %s%s%s: %s%s" % (
        head, a["step"], _safe_text(a["tensor"]), op, phase, a["description"], occurrence)]
    if a.get("tensor_description"):
        lines.append("  tensor: %s" % _safe_text(a["tensor_description"]))
    lines.extend(_op_lines(a))
    lines.append(_last_steps_line(a))
    if a["hint"]:
        lines.append("  hint: %s" % a["hint"])
    c = a["likely_cause"]
    if c is not None:
        lines.append("  likely cause: step %d, %s: %s (%s)" % (
            c["step"], _safe_text(c["tensor"]), c["kind"], c["detail"]))
    return lines


def _last_steps_line(a: dict) -> str:
    """The last healthy step and, where it differs, the last finite one, each
    saying what it is (a warning is finite but not healthy)."""
    line = "  last healthy step: %s" % a["last_healthy_step"]
    finite = a.get("last_finite_step")
    if finite is not None and finite != a["last_healthy_step"]:
        line += " (no warning and no NaN/Inf in this tensor); last finite step: %d (a warning, but no NaN/Inf)" % finite
    return line


def _op_lines(a: dict) -> list[str]:
    """The exact op (from op-level records or a replay) and its inputs' ranges,
    or why a replay did not reproduce the failure."""
    op, replay = a.get("op"), a.get("replay")
    if isinstance(op, dict):
        kind = ", ".join(_safe_text(str(op[k])) for k in ("type", "phase") if op.get(k))
        line = "  op: %s%s" % (_safe_text(str(op.get("name", ""))), " (%s)" % kind if kind else "")
        if op.get("source"):
            line += " at %s" % _safe_text(str(op["source"]))
        inputs = op.get("inputs") if isinstance(op.get("inputs"), list) else []
        return [line] + ["    input %d%s: %s" % (k, _input_name(i), hints.input_range(i)) for k, i in enumerate(inputs, 1)
                         if isinstance(i, dict)]
    if isinstance(replay, dict) and replay.get("reproduced") is False:
        return ["  replay: did not reproduce the failure (%s)" % _safe_text(str(replay.get("why", "")))]
    return []


def _input_name(i: dict) -> str:
    """" (mlp/dense_2/Relu, 64x64)": the op that made an input and its shape, where known."""
    shape = i.get("shape")
    parts = [_safe_text(str(i["name"]))] if i.get("name") else []
    if isinstance(shape, list):
        parts.append("x".join("?" if d is None else str(d) for d in shape) or "scalar")
    return " (%s)" % ", ".join(parts) if parts else ""


def _table(summaries: list[dict]) -> str:
    lines = []
    for s in summaries:
        lines.append("run %s" % _safe_text(s["run"]))
        a = s["first_anomaly"]
        if a is None:
            lines.append("  first anomaly: " + _none_text(s))
        else:
            lines.extend("  " + line for line in anomaly_lines(a))
        w = s["first_warning"]
        if w is None:
            lines.append("  first warning: none")
        else:
            lines.append("  first warning: step %d, %s: %s (%s)" % (
                w["step"], _safe_text(w["tensor"]), w["kind"], w["detail"]))
        for r in s.get("restarts") or ():
            lines.append("  more than one training: steps %d-%d were written again by a later training "
                         "(its records are shown for them); give each training its own logdir"
                         % (r["first_step"], r["last_step"]))
        if s.get("against"):
            lines.append(_against_line(s["against"]))
    return "\n".join(lines)


def _against_line(c: dict) -> str:
    """A run against its reference (``compare.compare_runs``) in one line."""
    d, ref = c["first_departure"], _safe_text(c["run"])
    if d is None:
        span = " over steps %d-%d" % tuple(c["steps_compared"]) if c["steps_compared"] else ""
        return "  against %s: within its band (%d tensors compared%s)" % (ref, c["tensors_compared"], span)
    return "  against %s: leaves its band at step %d, %s (%s): %s" % (
        ref, d["step"], _safe_text(d["tensor"]), d["phase"], d["detail"])


def _none_text(s: dict) -> str:
    """A run with no anomaly: what was read, and whether all of it was."""
    read = "%d tensors, steps %s-%s" % (s["tensors"], s["first_step"], s["last_step"]) if s["tensors"] else ""
    if s.get("scalars"):
        read += "%s%d scalar summaries, all finite" % ("; " if read else "", s["scalars"])
        if not s["tensors"]:
            read += "; no numerics records: log them with tb_numerics.log_numerics to check every tensor"
    if not s["problems"]:
        return "none (%s)" % read
    return "none among the records read (%s), but %d problem(s) reading the run: see the warnings" % (
        read or "none could be read", len(s["problems"]))


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
        print("tb-numerics: error: %s" % _safe_text(str(e)), file=sys.stderr)
        return EXIT_USAGE
    for p in problems:
        print("tb-numerics: warning: %s" % _safe_text(p), file=sys.stderr)
    if args.json:
        json.dump({"runs": summaries}, sys.stdout, allow_nan=False, default=str)
        sys.stdout.write("\n")
    elif not summaries:
        print("no numerics records and no scalar summaries in %s: log them with tb_numerics.log_numerics"
              % _safe_text(args.logdir))
    else:
        print(_table(summaries))
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
