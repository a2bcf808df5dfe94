"""Runs every program of ``oplevel_programs`` under TensorFlow's own
``tf.debugging.enable_check_numerics`` and prints, as one JSON object, the op
type and the user's line (``file.py:LINE``) it names for each.

Run as a script in its own process (the check stays on once enabled). The
op type is the one its ``InvalidArgumentError`` names; the line is the
innermost frame of the programs' file in the op's creation stack that the
message prints (a graph op), or in the error's traceback (an eager op,
whose message has no stack: the op ran on that line).
"""

from __future__ import annotations

import json
import os
import re
import sys
import traceback

import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import oplevel_programs  # noqa: E402

_OP = re.compile(r'Detected Infinity or NaN in output \d+ of (graph|eagerly-executing) op "([^"]+)"')
_FRAME = re.compile(r"^    \+ (.+) \(L(\d+)\) ")


def _line(message: str, tb, programs_file: str) -> str | None:
    """``file.py:LINE`` of the innermost frame in the programs' file."""
    frames = [(m.group(1), int(m.group(2))) for m in map(_FRAME.match, message.splitlines()) if m]
    if not frames:  # an eager op: it ran where the traceback points
        frames = [(f.filename, f.lineno) for f in traceback.extract_tb(tb)]
    mine = [(f, n) for f, n in frames if os.path.realpath(f) == programs_file]
    return "%s:%d" % (os.path.basename(mine[-1][0]), mine[-1][1]) if mine else None


def _named(step, programs_file: str) -> dict | None:
    """Op type and line that check_numerics names in ``step``; None if it names none."""
    try:
        step()
    except tf.errors.InvalidArgumentError as e:
        m = _OP.search(e.message)
        return m and {"type": m.group(2), "line": _line(e.message, e.__traceback__, programs_file)}
    return None


def main() -> None:
    tf.debugging.enable_check_numerics(stack_height_limit=200, path_length_limit=10_000)
    programs_file = os.path.realpath(oplevel_programs.__file__.replace(".pyc", ".py"))
    out = {}
    for name, (make, how) in oplevel_programs.PROGRAMS.items():
        out[name] = _named(make(), programs_file)
        if out[name] is None and how == "replay":
            # A compiled step, where check_numerics lets NaN through (TensorFlow
            # issues 117319, 118075): what it names in the step run without XLA.
            tf.config.run_functions_eagerly(True)
            out[name] = _named(make(), programs_file)
            tf.config.run_functions_eagerly(False)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
