"""What ``tb-numerics report`` prints for a run, in words: one home for the text.

The CLI parses arguments, reads the logdir and prints ``table``; the Keras
callback prints ``anomaly_lines`` when it stops training at the first
anomaly. Both say the same thing the same way. Every name read from a log is
escaped for a terminal (``safe_text``). No TensorFlow.
"""

from __future__ import annotations

from tb_numerics import hints

__all__ = ["action_lines", "anomaly_lines", "nothing_found", "safe_text", "table"]


def safe_text(s: str) -> str:
    """A name from a log, with control characters escaped for a terminal.

    Args:
      s: any text read from a log (a run, a tag, an op type, an error).
    """
    return "".join(
        c if c.isprintable() else "\\x%02x" % ord(c) if ord(c) < 256 else "\\u%04x" % ord(c)
        for c in s
    )


# A phase in words where its name alone reads oddly ("step 2, input, input").
_PHASE_WORDS = {"input": "input batch"}


def anomaly_lines(a: dict, head: str = "first anomaly: ") -> list[str]:
    """A first anomaly (``analysis.first_anomaly``) in words, names escaped
    for a terminal: the report's lines, and the Keras callback's stop message.

    Args:
      a: the first anomaly, as ``analysis.first_anomaly`` returns it.
      head: what the first line starts with.
    """
    op = " (%s)" % safe_text(a["op_type"]) if a["op_type"] else ""
    occurrence = ""
    if a.get("occurrence"):
        occurrence = " (record %d of %d in that step)" % (a["occurrence"]["index"], a["occurrence"]["of"])
    phase = ", %s" % _PHASE_WORDS.get(a["phase"], a["phase"]) if a["phase"] else " (%s)" % a.get("source", "")
    lines = ["%sstep %d, %s%s%s: %s%s" % (
        head, a["step"], safe_text(a["tensor"]), op, phase, a["description"], occurrence)]
    if a.get("tensor_description"):
        lines.append("  tensor: %s" % safe_text(a["tensor_description"]))
    lines.extend(_op_lines(a))
    lines.append(_last_steps_line(a))
    if a["hint"]:
        lines.append("  hint: %s" % a["hint"])
    c = a["likely_cause"]
    if c is not None:
        lines.append("  likely cause: step %d, %s: %s (%s)" % (
            c["step"], safe_text(c["tensor"]), c["kind"], c["detail"]))
    return lines


def _last_steps_line(a: dict) -> str:
    """The last healthy step and, where it differs, the last finite one, each
    saying what it is (a warning is finite but not healthy)."""
    healthy, finite = a["last_healthy_step"], a.get("last_finite_step")
    if healthy is None:
        line = "  last healthy step: none (this tensor has no healthy record before it)"
    else:
        line = "  last healthy step: %d" % healthy
    if finite is not None and finite != healthy:
        line += "%s; last finite step: %d (a warning, but no NaN/Inf)" % (
            "" if healthy is None else " (no warning and no NaN/Inf in this tensor)", finite)
    return line


def _op_lines(a: dict) -> list[str]:
    """The exact op (from op-level records or a replay) and its inputs' ranges,
    or why a replay did not reproduce the failure."""
    op, replay = a.get("op"), a.get("replay")
    if isinstance(op, dict):
        kind = ", ".join(safe_text(str(op[k])) for k in ("type", "phase") if op.get(k))
        line = "  op: %s%s" % (safe_text(str(op.get("name", ""))), " (%s)" % kind if kind else "")
        if op.get("source"):
            line += " at %s" % safe_text(str(op["source"]))
        inputs = op.get("inputs") if isinstance(op.get("inputs"), list) else []
        return [line] + ["    input %d%s: %s" % (k, _input_name(i), hints.input_range(i))
                         for k, i in enumerate(inputs, 1) if isinstance(i, dict)]
    if isinstance(replay, dict) and replay.get("reproduced") is False:
        why = safe_text(str(replay.get("why", "")))
        if a.get("phase") == "update":  # the optimizer made it: a replay of the step has no op to find
            return ["  replay: no op to name (%s)" % why]
        return ["  replay: did not reproduce the failure (%s)" % why]
    return []


def action_lines(actions: dict | None) -> list[str]:
    """What the training did about its anomalies (the report's ``actions``):
    the words, then one line per event (the first few).

    Args:
      actions: ``survive.summarize``'s result, or None.
    """
    if not actions:
        return []
    lines = ["actions: %s" % safe_text(actions["words"])]
    for e in actions["events"][:_EVENTS_SHOWN]:
        where = ", ".join("%s %d" % (k, e[k]) for k in ("epoch", "batch") if e.get(k) is not None)
        line = "  step %d%s: %s (%s)" % (e["step"], " (%s)" % where if where else "", e["action"],
                                          safe_text(str(e.get("detail") or e["trigger"])))
        replay = e.get("replay") if isinstance(e.get("replay"), dict) else {}
        if replay.get("reproducible") is False:
            line += "; not reproducible on replay (non-determinism or hardware)"
        elif isinstance(e.get("op"), dict) and e["op"].get("type"):
            line += "; op %s" % safe_text(str(e["op"]["type"]))
        lines.append(line)
    if len(actions["events"]) > _EVENTS_SHOWN:
        lines.append("  and %d more (tb-numerics report --json lists them all)" % (len(actions["events"]) - _EVENTS_SHOWN))
    return lines


# How many action events the text report lists.
_EVENTS_SHOWN = 5


def _input_name(i: dict) -> str:
    """" (mlp/dense_2/Relu, 64x64)": the op that made an input and its shape, where known."""
    shape = i.get("shape")
    parts = [safe_text(str(i["name"]))] if i.get("name") else []
    if isinstance(shape, list):
        parts.append("x".join("?" if d is None else str(d) for d in shape) or "scalar")
    return " (%s)" % ", ".join(parts) if parts else ""


def table(summaries: list[dict]) -> str:
    """The report's text of run summaries (``analysis.run_summary``, as
    ``cli.report`` makes them): per run, its first anomaly and first warning."""
    lines = []
    for s in summaries:
        lines.append("run %s" % safe_text(s["run"]))
        a = s["first_anomaly"]
        if a is None:
            lines.append("  first anomaly: " + _none_text(s))
        else:
            lines.extend("  " + line for line in anomaly_lines(a))
        lines.extend("  " + line for line in action_lines(s.get("actions")))
        w = s["first_warning"]
        if w is None:
            lines.append("  first warning: none")
        else:
            lines.append("  first warning: step %d, %s: %s (%s)" % (
                w["step"], safe_text(w["tensor"]), w["kind"], w["detail"]))
        for r in s.get("restarts") or ():
            lines.append("  more than one training: steps %d-%d were written again by a later training "
                         "(its records are shown for them); give each training its own logdir"
                         % (r["first_step"], r["last_step"]))
        if s.get("against"):
            lines.append(_against_line(s["against"]))
    return "\n".join(lines)


def _against_line(c: dict) -> str:
    """A run against its reference (``compare.compare_runs``) in one line."""
    d, ref = c["first_departure"], safe_text(c["run"])
    if d is None:
        span = " over steps %d-%d" % tuple(c["steps_compared"]) if c["steps_compared"] else ""
        return "  against %s: within its band (%d tensors compared%s)" % (ref, c["tensors_compared"], span)
    return "  against %s: leaves its band at step %d, %s (%s): %s" % (
        ref, d["step"], safe_text(d["tensor"]), d["phase"], d["detail"])


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


def nothing_found(logdir: str) -> str:
    """The report of a logdir where no run holds a record or a scalar summary."""
    return "no numerics records and no scalar summaries in %s: log them with tb_numerics.log_numerics" % (
        safe_text(logdir))
