"""Op level on the small programs of ``oplevel_programs`` (eager ops, an eager
loop, nested tf.functions, a 1,000-iteration tf.while_loop, a tf.data map, a
NaN constant, a custom layer, numpy arguments, XLA): the op type and the line
that the report names equal those ``tf.debugging.enable_check_numerics``
names, run in its own process (``check_numerics_oracle.py``, one process for
all programs).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import tensorflow as tf

import oplevel_programs
import tb_numerics as tbn
from tb_numerics import cli, oplevel

pytestmark = pytest.mark.e2e

HERE = os.path.dirname(os.path.abspath(__file__))

# Programs where the report does not yet name what check_numerics names.
KNOWN_GAPS = {
    "data_map": "a map function traced when the dataset was built is not recorded: IteratorGetNext is named",
    "custom_layer": "a tf.function traced before the recorder's block has no op records (a warning names "
                    "it): only its call's outputs are, so the call is named, not its Log",
}


@pytest.fixture(scope="module")
def oracle() -> dict:
    """What check_numerics names in each program: {"type", "line"}."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    res = subprocess.run([sys.executable, os.path.join(HERE, "check_numerics_oracle.py")],
                         capture_output=True, text=True, env=env, timeout=300, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def _line(source: str | None) -> str | None:
    """``file.py:LINE`` of a ``path/file.py:LINE (function)`` source."""
    m = re.match(r"^(.*):(\d+) \(", source or "")
    return m and "%s:%s" % (os.path.basename(m.group(1)), m.group(2))


def _named(name: str, logdir: str, capsys) -> dict | None:
    """Runs one program the way its kind is recorded; the op the report names."""
    make, how = oplevel_programs.PROGRAMS[name]
    step = make()
    writer = tf.summary.create_file_writer(logdir)
    if how == "block":
        with writer.as_default(step=0), tbn.op_numerics():
            step()
    else:
        oplevel.replay_step(step.fn, *step.args, step=0, writer=writer)
    writer.close()
    capsys.readouterr()
    assert cli.main(["report", logdir, "--json"]) == 1, name
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    op = run["first_anomaly"]["op"]
    return op and {"type": op["type"], "line": _line(op["source"])}


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.xfail(reason=KNOWN_GAPS[n], strict=True)) if n in KNOWN_GAPS else n
    for n in oplevel_programs.PROGRAMS
])
def test_the_report_names_the_op_and_line_check_numerics_names(name, oracle, tmp_path, capsys):
    truth = oracle[name]
    assert truth is not None and truth["line"] is not None, (name, truth)
    assert _named(name, str(tmp_path), capsys) == truth


def test_the_eager_loops_first_bad_op_is_the_one_check_numerics_names(oracle):
    """The recorder's own answer orders by execution, across loop iterations."""
    recorder = tbn.op_numerics(step=0)
    with recorder:
        oplevel_programs.eager_loop()()
    assert {"type": recorder.first_bad.op_type, "line": _line(recorder.first_bad.source)} == oracle["eager_loop"]


def test_nested_functions_ops_are_filed_under_the_inner_function():
    recorder = tbn.op_numerics(step=0)
    with recorder:
        oplevel_programs.nested_functions()()
    assert recorder.first_bad.tag == "ops/outer/inner/Log"


def test_a_function_traced_before_the_block_is_named_by_its_outputs(caplog):
    """Its ops have no records, but the value is pinned on the function that
    made it (not on the Dense after it), and a warning says why."""
    step = oplevel_programs.custom_layer()
    recorder = tbn.op_numerics(step=0)
    with caplog.at_level("WARNING", logger="tb_numerics.oplevel"), recorder:
        step()
    assert re.fullmatch(r"sequential(_\d+)?/log_layer(_\d+)?/call", recorder.first_bad.name)
    assert recorder.first_bad.op_type.startswith("__inference_call_")
    assert any("'call' was traced before the recorder" in r.getMessage() for r in caplog.records)
