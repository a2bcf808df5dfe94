"""Op level on the small programs of ``oplevel_programs`` (eager ops, an eager
loop, nested tf.functions, a 1,000-iteration tf.while_loop, a tf.data map and
a pipeline around one, a NaN constant, a custom layer, numpy arguments, XLA):
the op type and the line that the report names equal those
``tf.debugging.enable_check_numerics`` names, run in its own process
(``check_numerics_oracle.py``, one process for all programs). The pipelines
and the custom layer were traced before the recorder's block: the block
traces them anew. Where it cannot, the report says so (a function's
outputs; the input pipeline, with its functions' lines).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import oplevel_programs
import tb_numerics as tbn
from op_records import line_of
from tb_numerics import cli, oplevel

pytestmark = pytest.mark.e2e

HERE = os.path.dirname(os.path.abspath(__file__))


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


def _first_anomaly(logdir: str, capsys) -> dict:
    capsys.readouterr()
    assert cli.main(["report", logdir, "--json"]) == 1
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    return run["first_anomaly"]


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
    op = _first_anomaly(logdir, capsys)["op"]
    return op and {"type": op["type"], "line": _line(op["source"])}


@pytest.mark.parametrize("name", list(oplevel_programs.PROGRAMS))
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


def test_a_traced_step_traces_anew_the_functions_it_calls(oracle, tmp_path, capsys):
    """``@tf.function`` over ``@recorder``: the custom layer's call, traced
    when the model was built, is traced anew inside the step's trace."""
    step = tf.function(tbn.op_numerics(step=0)(oplevel_programs.custom_layer()))
    writer = tf.summary.create_file_writer(str(tmp_path))
    with writer.as_default():
        step()
    writer.close()
    op = _first_anomaly(str(tmp_path), capsys)["op"]
    assert {"type": op["type"], "line": _line(op["source"])} == oracle["custom_layer"]


def test_a_signature_traced_outside_between_blocks_is_traced_anew():
    """A function first traced in a block, then for new inputs outside any
    block: the next block traces those anew too, and names its Log."""
    @tf.function
    def log_of(x):
        return tf.math.log(x)  # LOG_OF

    recorder = tbn.op_numerics(step=0)
    with recorder:
        log_of(tf.constant([1.0, 2.0, 3.0]))
    log_of(tf.constant([1.0, 0.0]))  # a new shape, traced outside any block
    with recorder:
        log_of(tf.constant([1.0, 0.0])) * 2.0
    assert recorder.first_bad.op_type == "Log"
    assert _line(recorder.first_bad.source) == "%s:%d" % (os.path.basename(__file__), line_of(__file__, "# LOG_OF"))


class _MakesItsVariable(tf.Module):
    """A tf.function whose first trace made a variable (a new trace would make another)."""

    def __init__(self):
        super().__init__()
        self.w = None

    @tf.function
    def __call__(self, x):
        if self.w is None:
            self.w = tf.Variable(tf.ones([3]))
        return tf.math.log(x * self.w)


def _traced_before(kind: str):
    """(a function traced before any block that cannot be traced anew, its name)."""
    if kind == "concrete":
        @tf.function
        def log_of(x):
            return tf.math.log(x)

        return log_of.get_concrete_function(tf.TensorSpec([3])), "log_of"
    module = _MakesItsVariable()
    module(tf.ones([3]))
    return module, "__call__"


@pytest.mark.parametrize("kind", ["concrete", "made_variables"])
def test_a_function_that_cannot_be_traced_anew_is_named_by_its_outputs(kind, caplog):
    """Traced before the block, a concrete function (or a tf.function whose
    first trace made variables) is not traced anew: its ops have no records,
    but the value is pinned on the function (not on the op after it), and a
    warning says why. (A plain tf.function is traced anew: ``custom_layer``.)"""
    fn, name = _traced_before(kind)
    recorder = tbn.op_numerics(step=0)
    with caplog.at_level("WARNING", logger="tb_numerics.oplevel"), recorder:
        fn(tf.constant([1.0, 0.0, 2.0])) * 2.0
    assert recorder.first_bad.name == name
    assert recorder.first_bad.op_type.startswith("__inference_%s_" % name)
    assert any("%r was traced before the recorder" % name in r.getMessage() for r in caplog.records)


def test_a_pipeline_iterated_in_a_block_gives_the_elements_it_gives_outside():
    """The block iterates the pipeline rebuilt with its functions traced
    anew: the same elements, the variable a map reads as it is now."""
    step = oplevel_programs.data_pipeline()
    outside = [b.numpy() for b in step()]
    with tbn.op_numerics(step=0):
        inside = [b.numpy() for b in step()]
    assert len(outside) == 4 and np.isnan(outside[2]).all()  # the fault is there
    assert len(inside) == len(outside)
    for a, b in zip(inside, outside):
        np.testing.assert_array_equal(a, b)


def _log_map() -> tf.data.Dataset:
    ds = tf.data.Dataset.from_tensor_slices(np.array([[1.0, 2.0], [3.0, -4.0]], np.float32))
    return ds.map(lambda v: tf.math.log(v))  # PIPELINE_MAP


@pytest.mark.parametrize("kind", ["iterator_made_before", "not_rebuildable"])
def test_an_element_made_unrecorded_is_the_input_pipelines(kind, tmp_path, capsys, caplog):
    """Where the map could not be traced anew (the iterator was made before
    the block; a pipeline node calls several functions), the report does not
    pin the value on IteratorGetNext's consumer or call it an op's: it came
    with the input, from the pipeline whose functions it names."""
    ds = _log_map()
    if kind == "iterator_made_before":
        it = iter(ds)

        def step():
            return [next(it) * 2.0 for _ in range(2)]
    else:
        ds = ds.group_by_window(lambda v: tf.constant(0, tf.int64), lambda key, window: window, window_size=1)

        def step():
            return [v * 2.0 for v in ds]
    writer = tf.summary.create_file_writer(str(tmp_path))
    with caplog.at_level("WARNING", logger="tb_numerics.oplevel"), writer.as_default(step=0), tbn.op_numerics():
        step()
    writer.close()
    a = _first_anomaly(str(tmp_path), capsys)
    assert (a["tensor"], a["phase"], a["op"], a["nan"]) == ("ops/IteratorGetNext", "input", None, 1)
    where = "from the input pipeline (Dataset.map(<lambda>) at %s:%d" % (
        os.path.relpath(__file__), line_of(__file__, "# PIPELINE_MAP"))
    assert where in a["tensor_description"]
    assert (kind == "not_rebuildable") == any("cannot be traced anew" in r.getMessage() for r in caplog.records)
