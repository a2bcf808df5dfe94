"""oplevel.replay_step: one step run again eagerly under op-level recording
names its first non-finite op, its source line, phase and inputs' ranges.

Each op is created at a known line of this file; the step functions are
compiled (``tf.function``, with and without XLA) as a training loop would
have them, and the records are read back through ``tb-numerics report``.
"""

from __future__ import annotations

import json

import keras
import pytest
import tensorflow as tf

from op_records import line_of, marks
from tb_numerics import cli, oplevel, records

pytestmark = pytest.mark.unit




class LogRelu(keras.layers.Layer):
    """A custom layer: log of a ReLU output, -Inf where the ReLU gives an exact 0."""

    def call(self, x):
        return tf.math.log(tf.nn.relu(x))  # REPLAY_LOG


def _log_relu_step():
    model = keras.Sequential([keras.Input((3,)), LogRelu()])

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(model(x))
        return tape.gradient(loss, x)

    return step, (tf.constant([[1.0, -2.0, 3.0]]),)


def _sqrt_error_step():
    w = tf.Variable(tf.zeros([3, 1]))

    def step(x, y):
        with tf.GradientTape() as tape:
            err = tf.square(y - x @ w)
            loss = tf.reduce_mean(tf.sqrt(err))  # REPLAY_SQRT
        return tape.gradient(loss, w)

    return step, (tf.constant([[1.0, 2.0, 3.0]]), tf.constant([[0.0]]))


def _cosine_step():
    w = tf.Variable([[1.0, 2.0], [3.0, 4.0]])

    def cosine(a, b):
        return tf.reduce_sum(a * b, -1) / (tf.norm(a, axis=-1) * tf.norm(b, axis=-1))  # REPLAY_DIV

    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(cosine(x @ w, tf.ones_like(x)))
        return tape.gradient(loss, w)

    return step, (tf.constant([[1.0, 2.0], [0.0, 0.0]]),)


CASES = {
    "log_relu": (_log_relu_step, "Log", "forward", "# REPLAY_LOG", "call"),
    "sqrt_error": (_sqrt_error_step, "SqrtGrad", "backward", "# REPLAY_SQRT", "step"),
    "cosine": (_cosine_step, "RealDiv", "forward", "# REPLAY_DIV", "cosine"),
}


@pytest.mark.parametrize("compiled", ["eager", "function", "jit_compile"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_replay_names_the_first_bad_op_and_its_line(tmp_path, capsys, case, compiled):
    make, op_type, phase, marker, function = CASES[case]
    step, args = make()
    if compiled != "eager":
        step = tf.function(step, jit_compile=compiled == "jit_compile")
    writer = tf.summary.create_file_writer(str(tmp_path))
    got = oplevel.replay_step(step, *args, step=7, writer=writer)
    writer.close()
    source = "test_replay.py:%d (%s)" % (line_of(__file__, marker), function)
    assert (got.op_type, got.phase, got.step) == (op_type, phase, 7)
    assert got.source.endswith(source), got.source
    op = got.to_json()
    assert (op["type"], op["phase"], op["name"]) == (op_type, phase, got.tag[len("ops/"):])
    assert op["nan"] + op["posinf"] + op["neginf"] > 0
    # The records went to the writer at that step: the report names the same op.
    assert cli.main(["report", str(tmp_path), "--json"]) == cli.EXIT_ANOMALY
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    a = run["first_anomaly"]
    assert (a["step"], a["op_type"], a["phase"], a["tensor"]) == (7, op_type, phase, got.tag)
    assert source in a["tensor_description"]
    assert not tf.config.functions_run_eagerly()  # restored
    # Beside the records, the mark of that step's first non-finite op.
    (mark,) = marks(tmp_path)
    assert mark["step"] == 7 and (mark["tag"], mark["type"], mark["source"]) == (
        got.tag, op_type, got.source)



def test_replay_reports_the_inputs_ranges():
    step, args = _log_relu_step()
    got = oplevel.replay_step(step, *args, step=0)
    (inp,) = got.inputs  # the ReLU output the Log consumed: min exactly 0
    assert (inp["min"], inp["max"], inp["zeros"], inp["count"]) == (0.0, 3.0, 1, 3)
    # Named by the op that made it (tf.nn.relu, in the layer's scope), with its shape.
    assert inp["name"].endswith("Relu") and inp["shape"] == [1, 3], inp
    assert got.record[records.F["neginf"]] == 1
    step, args = _cosine_step()
    got = oplevel.replay_step(step, *args, step=0)
    num, den = got.inputs  # 0 / 0 in the second row
    assert num["zeros"] == 1 and den["zeros"] == 1 and den["min"] == 0.0
    # tf.reduce_sum(a * b, -1) / (tf.norm(a) * tf.norm(b)): a Sum over a Mul of two norms.
    assert num["name"].endswith("Sum") and den["name"].endswith("Mul") and num["shape"] == den["shape"] == [2], got.inputs


def test_replay_of_a_healthy_step_returns_none(tmp_path):
    step, _ = _sqrt_error_step()
    writer = tf.summary.create_file_writer(str(tmp_path))
    assert oplevel.replay_step(step, tf.constant([[1.0, 2.0, 3.0]]), tf.constant([[1.0]]),
                               step=3, writer=writer) is None
    writer.close()


def test_replay_refuses_a_flight_recorder():
    step, args = _sqrt_error_step()
    with pytest.raises(ValueError, match="flight_recorder"):
        oplevel.replay_step(step, *args, step=0, recorder=oplevel.op_numerics(flight_recorder=2))
