"""Op-level mode on real TensorFlow: the first bad op, its type and source line.

Each test runs a few real training steps, eagerly and as a tf.function, writes
with ``tbn.op_numerics`` and reads the logdir back through the same code as
``tb-numerics report`` (event_reader + analysis).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import tensorflow as tf

import tb_numerics as tbn
from tb_numerics import analysis, cli, event_reader

MODES = ["eager", "function"]


def _line_of(marker: str) -> int:
    with open(__file__) as f:
        for i, line in enumerate(f, 1):
            if line.rstrip().endswith(marker) and "def _line_of" not in line:
                return i
    raise AssertionError(marker)


def _run(logdir: str, body, inputs, mode: str, recorder) -> None:
    """Runs ``body(x)`` for each input as one recorded step, steps 0, 1, ..."""
    step = tf.Variable(0, dtype=tf.int64)
    fn = tf.function(recorder(body)) if mode == "function" else recorder(body)
    writer = tf.summary.create_file_writer(logdir)
    with writer.as_default(step=step):
        for s, x in enumerate(inputs):
            step.assign(s)
            fn(tf.constant(x, tf.float32))
    writer.close()


def _analysis(logdir: str) -> analysis.RunAnalysis:
    (run,) = event_reader.read_logdir(logdir)
    return analysis.analyze_run(run.run, run.series)


def _healthy_before(ra: analysis.RunAnalysis, anomaly: dict) -> list[str]:
    """Tags of the rows before the anomaly's row, each checked healthy at its step."""
    tags = []
    for h in ra.health[: anomaly["row"]]:
        (i,) = np.flatnonzero(h.series.steps == anomaly["step"])
        assert h.codes[i] != analysis.NONFINITE, h.series.tag
        tags.append(h.series.tag)
    return tags


W0 = [1.0, 2.0, 3.0]


def _sqrt_loss(x):
    # Grows a tape around an op whose gradient is infinite where x reaches 0.
    w = tf.constant(W0)
    with tf.GradientTape() as tape:
        tape.watch(w)
        h = x * w
        y = tf.sqrt(h)  # SQRT
        loss = tf.reduce_sum(y)
    return tape.gradient(loss, w)


@pytest.mark.parametrize("mode", MODES)
def test_sqrt_at_zero_names_the_sqrt_gradient_op_and_its_source_line(tmp_path, mode):
    logdir = str(tmp_path)
    _run(logdir, _sqrt_loss, [[1.0, 4.0, 9.0], [1.0, 0.0, 9.0]], mode, tbn.op_numerics())
    ra = _analysis(logdir)
    a = analysis.first_anomaly(ra)
    assert a["step"] == 1 and a["last_healthy_step"] == 0
    assert a["op_type"] == "SqrtGrad" and a["phase"] == "backward"
    assert a["tensor"].startswith("ops/") and a["tensor"].endswith("SqrtGrad")
    assert a["posinf"] == 1
    assert "gradient of sqrt" in a["hint"].lower()
    where = "test_oplevel.py:%d (_sqrt_loss)" % _line_of("# SQRT")
    assert where in a["tensor_description"]
    # The forward Mul and Sqrt of that step come first and are healthy.
    before = _healthy_before(ra, a)
    assert any(t.endswith("Sqrt") for t in before) and any(t.lower().endswith("mul") for t in before)
    sqrt_row = ra.find(next(t for t in before if t.endswith("Sqrt")))
    assert sqrt_row.series.info.op_type == "Sqrt" and sqrt_row.series.info.phase == "forward"
    assert sqrt_row.series.info.description.endswith(where)


def _log_loss(x):
    w = tf.constant(W0)
    with tf.GradientTape() as tape:
        tape.watch(w)
        h = tf.abs(x * w)
        y = tf.math.log(h)  # LOG
        loss = tf.reduce_mean(y)
    return tape.gradient(loss, w)


def _div_loss(x):
    w = tf.constant(W0)
    with tf.GradientTape() as tape:
        tape.watch(w)
        num = x * w
        den = tf.abs(x) + tf.reduce_min(tf.abs(x))
        y = num / den  # DIV
        loss = tf.reduce_sum(y)
    return tape.gradient(loss, w)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "body, marker, op_types",
    [(_log_loss, "# LOG", ("Log",)), (_div_loss, "# DIV", ("RealDiv", "Div"))],
    ids=["log0", "div00"],
)
def test_forward_non_finite_names_the_forward_op(tmp_path, mode, body, marker, op_types):
    logdir = str(tmp_path)
    _run(logdir, body, [[1.0, 2.0, 3.0], [1.0, 0.0, 3.0]], mode, tbn.op_numerics())
    ra = _analysis(logdir)
    a = analysis.first_anomaly(ra)
    assert a["step"] == 1 and a["phase"] == "forward"
    assert a["op_type"] in op_types
    assert "test_oplevel.py:%d" % _line_of(marker) in a["tensor_description"]
    assert _healthy_before(ra, a)  # the Mul/Abs before it, healthy
    assert a["hint"]


def test_report_cli_json_names_the_op(tmp_path, capsys):
    logdir = str(tmp_path / "run1")
    _run(logdir, _sqrt_loss, [[4.0, 4.0, 4.0], [0.0, 4.0, 4.0]], "function", tbn.op_numerics())
    assert cli.main(["report", str(tmp_path), "--json"]) == cli.EXIT_ANOMALY
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    a = run["first_anomaly"]
    assert (a["step"], a["op_type"], a["phase"]) == (1, "SqrtGrad", "backward")
    assert "test_oplevel.py:%d" % _line_of("# SQRT") in a["tensor_description"]


@pytest.mark.parametrize("mode", MODES)
def test_flight_recorder_writes_only_the_window_ending_at_the_first_anomaly(tmp_path, mode):
    logdir = str(tmp_path)
    inputs = [[1.0, 4.0, 9.0]] * 4 + [[1.0, 0.0, 9.0]] * 3  # first bad step: 4
    recorder = tbn.op_numerics(flight_recorder=3)
    _run(logdir, _sqrt_loss, inputs, mode, recorder)
    assert recorder.triggered
    ra = _analysis(logdir)
    assert ra.steps.tolist() == [2, 3, 4]
    a = analysis.first_anomaly(ra)
    assert (a["step"], a["last_healthy_step"], a["op_type"]) == (4, 3, "SqrtGrad")
    assert "test_oplevel.py:%d" % _line_of("# SQRT") in a["tensor_description"]


@pytest.mark.parametrize("mode", MODES)
def test_flight_recorder_writes_nothing_while_healthy(tmp_path, mode):
    recorder = tbn.op_numerics(flight_recorder=2)
    _run(str(tmp_path), _sqrt_loss, [[1.0, 4.0, 9.0]] * 3, mode, recorder)
    assert not recorder.triggered
    assert all(not r.series for r in event_reader.read_logdir(str(tmp_path)))


def _two_sqrts(x):
    out = []
    for part in (x, x - 1.0):  # the same op, twice per step
        out.append(tf.sqrt(part))  # LOOP
    return out


def test_eager_op_repeated_in_a_step_is_aggregated_into_one_record(tmp_path):
    _run(str(tmp_path), _two_sqrts, [[1.0, 4.0], [0.5, 4.0]], "eager", tbn.op_numerics())
    ra = _analysis(str(tmp_path))
    (h,) = [h for h in ra.health if h.series.info.op_type == "Sqrt"]
    assert h.series.values[:, 0].tolist() == [4.0, 4.0]  # two calls x two values
    assert h.series.values[:, 1].tolist() == [0.0, 1.0]  # sqrt(-0.5) in step 1
    assert "test_oplevel.py:%d" % _line_of("# LOOP") in h.series.info.description


@pytest.mark.parametrize("mode", MODES)
def test_filters_choose_the_ops_recorded(tmp_path, mode):
    _run(str(tmp_path / "types"), _sqrt_loss, [[1.0, 4.0, 9.0]], mode,
         tbn.op_numerics(op_types={"Sqrt", "SqrtGrad"}))
    ops = {h.series.info.op_type for h in _analysis(str(tmp_path / "types")).health}
    assert ops == {"Sqrt", "SqrtGrad"}
    _run(str(tmp_path / "regex"), _sqrt_loss, [[1.0, 4.0, 9.0]], mode,
         tbn.op_numerics(name_regex=r"Sqrt$", dtypes=("float32",)))
    tags = [h.series.tag for h in _analysis(str(tmp_path / "regex")).health]
    assert tags and all(t.endswith("Sqrt") for t in tags)


def test_jit_compile_is_refused_with_a_clear_error():
    fn = tf.function(tbn.op_numerics()(_sqrt_loss), jit_compile=True)
    with pytest.raises(ValueError, match="jit_compile=True"):
        fn(tf.constant([1.0, 4.0, 9.0]))


def test_decorating_a_tf_function_is_refused():
    with pytest.raises(TypeError, match="under tf.function"):
        tbn.op_numerics()(tf.function(_sqrt_loss))


def test_eager_keras_layer_ops_are_recorded_at_the_user_line(tmp_path):
    import keras

    layer = keras.layers.Dense(3, name="d1")

    def body(x):
        return layer(x[None, :])  # KERAS

    _run(str(tmp_path), body, [[1.0, 2.0, 3.0]], "eager", tbn.op_numerics())
    (h,) = [h for h in _analysis(str(tmp_path)).health if h.series.info.op_type == "MatMul"]
    assert h.series.tag == "ops/d1/MatMul"
    assert h.series.info.description.endswith("test_oplevel.py:%d (body)" % _line_of("# KERAS"))


def test_traced_step_whose_optimizer_builds_on_the_first_call(tmp_path):
    """An optimizer that creates its variables on the first call makes
    tf.function trace the step twice; the second trace has new ops, and their
    records must not need tf.Variables created on a non-first trace."""
    w = tf.Variable(tf.ones([3, 2]))
    opt = tf.keras.optimizers.Adam(0.01)  # not built: its slots appear in the first call
    recorder = tbn.op_numerics()

    @tf.function
    @recorder
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.sqrt(tf.square(x @ w)))
        opt.apply_gradients([(tape.gradient(loss, w), w)])

    writer = tf.summary.create_file_writer(str(tmp_path))
    counter = tf.Variable(0, dtype=tf.int64)  # a traced step reads the step from a variable
    with writer.as_default(step=counter):
        for s in range(3):
            counter.assign(s)
            step(tf.constant([[1.0, 2.0, 3.0]]))
    writer.close()
    ra = _analysis(str(tmp_path))
    assert any(h.series.info.op_type == "SqrtGrad" for h in ra.health)
    assert all(h.series.steps.tolist() == [0, 1, 2] for h in ra.health if h.series.info.op_type == "Sqrt")
