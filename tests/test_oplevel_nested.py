"""op_numerics around an eager step that calls tf.functions (TensorFlow's own
debugging tutorials' structure), and ops inside nested graphs: called
functions and their gradients, tf.cond branches, tf.while_loop bodies and
Keras RNN loops, in the full and the flight-recorder modes.

Each test trains for real and reads the answer back through
``tb-numerics report --json``.
"""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

import tb_numerics as tbn
from op_records import line_of, marks
from tb_numerics import cli, event_reader, metadata, records

pytestmark = pytest.mark.e2e

HEALTHY = [1.0, 2.0, 3.0]
BAD = [1.0, 0.0, 3.0]  # log(0) = -Inf in the second element




def _report(logdir, capsys) -> tuple[int, dict]:
    code = cli.main(["report", str(logdir), "--json"])
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    return code, run


def _series(logdir) -> dict[str, records.TensorSeries]:
    """The op records of the one run (not the mark of a step's first bad op)."""
    (run,) = event_reader.read_logdir(str(logdir))
    return {s.tag: s for s in run.series if s.tag not in metadata.VERDICT_TAGS}


class _Model:
    """A step in the tutorials' shape: eager code calling tf.function helpers."""

    def __init__(self):
        self.w = tf.Variable([1.0, 1.0, 1.0])

        @tf.function
        def forward(h):
            return tf.math.log(h)  # NESTED_LOG

        @tf.function
        def loss_of(y):
            return tf.reduce_mean(y * y)

        self.forward, self.loss_of = forward, loss_of

    def train_step(self, x):
        with tf.GradientTape() as tape:
            h = x * self.w  # EAGER_MUL
            loss = self.loss_of(self.forward(h))
        grad = tape.gradient(loss, self.w)
        self.w.assign_sub(0.0 * grad)  # the update (no change: the data decides)
        return loss


def _train(logdir, inputs, step_kind: str, recorder, model: _Model | None = None) -> _Model:
    model = model or _Model()
    writer = tf.summary.create_file_writer(str(logdir))
    var = tf.Variable(0, dtype=tf.int64)
    for i, x in enumerate(inputs):
        var.assign(i)
        with writer.as_default(step=var if step_kind == "variable" else i), recorder:
            model.train_step(tf.constant(x))
    writer.close()
    return model


@pytest.mark.parametrize("step_kind", ["int", "variable"])
def test_eager_loop_records_nested_ops_at_each_calls_step(tmp_path, capsys, step_kind):
    _train(tmp_path, [HEALTHY] * 3 + [BAD], step_kind, tbn.op_numerics())
    code, run = _report(tmp_path, capsys)
    a = run["first_anomaly"]
    assert code == cli.EXIT_ANOMALY
    # The forward Log inside the called function, not an eager gradient op after it.
    assert (a["step"], a["op_type"], a["phase"], a["tensor"]) == (3, "Log", "forward", "ops/forward/Log")
    assert a["last_healthy_step"] == 2 and a["neginf"] == 1
    assert "test_oplevel_nested.py:%d (forward)" % line_of(__file__, "# NESTED_LOG") in a["tensor_description"]
    series = _series(tmp_path)
    # Every op, nested or eager, forward or backward, at the step of each call.
    assert all(sorted(set(s.steps.tolist())) == [0, 1, 2, 3] for s in series.values()), {
        t: s.steps.tolist() for t, s in series.items()}
    assert "test_oplevel_nested.py:%d" % line_of(__file__, "# EAGER_MUL") in series["ops/Mul"].info.description
    grads = [s for s in series.values() if s.info.phase == "backward"]
    # The gradient ops TensorFlow builds for the called functions run and are linked.
    assert any(s.tag == "ops/forward/gradients/Log_grad/Reciprocal"
               and "gradient of ops/forward/Log" in s.info.description for s in grads)


def test_an_evaluation_pass_outside_the_block_records_nothing(tmp_path, capsys):
    recorder = tbn.op_numerics()
    model = _train(tmp_path / "run", [HEALTHY] * 2, "int", recorder)
    writer = tf.summary.create_file_writer(str(tmp_path / "run"))
    with writer.as_default(step=50):  # evaluation: the traced functions run, outside the recorder
        model.loss_of(model.forward(tf.constant(BAD)))
    writer.close()
    code, run = _report(tmp_path, capsys)
    assert code == cli.EXIT_OK and run["first_anomaly"] is None
    assert all(sorted(set(s.steps.tolist())) == [0, 1] for s in _series(tmp_path / "run").values())


def test_first_bad_backward_op_is_the_eager_one_that_ran_first(tmp_path, capsys):
    # sqrt(h) eager after a called function: its gradient (eager, infinite at
    # 0) runs before the called function's backward graph, which the Inf then
    # reaches. That backward graph is traced with the forward call, before
    # the eager gradient op exists: execution order, not trace order, decides.
    w = tf.Variable([1.0, 1.0, 1.0])

    @tf.function
    def scale(x):
        return x * w

    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.sqrt(scale(x)))  # EAGER_SQRT
        return tape.gradient(loss, w)

    writer = tf.summary.create_file_writer(str(tmp_path))
    recorder = tbn.op_numerics()
    for i, x in enumerate([HEALTHY, BAD]):
        with writer.as_default(step=i), recorder:
            step(tf.constant(x))
    writer.close()
    code, run = _report(tmp_path, capsys)
    a = run["first_anomaly"]
    assert (a["step"], a["op_type"], a["phase"]) == (1, "SqrtGrad", "backward")
    assert "test_oplevel_nested.py:%d" % line_of(__file__, "# EAGER_SQRT") in a["tensor_description"]
    nested_grad = [s for s in _series(tmp_path).values()
                   if s.tag.startswith("ops/scale/gradients/") and records.nonfinite_count(s.values[-1]) > 0]
    assert nested_grad  # ran after the SqrtGrad, also non-finite, not blamed
    assert recorder.first_bad.op_type == "SqrtGrad"


# ---------------------------------------------------------------- control flow


def _loop_log(x):
    # s halves each iteration; log(s - 0.25) reaches log(0) where s reaches 0.25.
    def body(i, s, acc):
        y = tf.math.log(s - 0.25)  # LOOP_LOG
        return i + 1, s * 0.5, acc + y

    _, _, acc = tf.while_loop(lambda i, s, acc: i < 3, body, (0, x, tf.zeros_like(x)))
    return tf.cond(tf.reduce_min(x) > 0.0, lambda: tf.sqrt(acc * acc),  # COND_SQRT
                   lambda: acc)


# Step 3 on: s = 1, 0.5, 0.25 in the second element, so log(0) at the third iteration.
LOOP_INPUTS = [[2.0, 2.0]] * 3 + [[2.0, 1.0]] * 2


def _loop_log_anomaly(logdir, capsys) -> tuple[dict, dict[str, records.TensorSeries]]:
    """The report's first anomaly of a run of ``_loop_log`` on LOOP_INPUTS, checked, and its series."""
    _, run = _report(logdir, capsys)
    a = run["first_anomaly"]
    assert (a["step"], a["op_type"], a["phase"]) == (3, "Log", "forward")
    assert "test_oplevel_nested.py:%d" % line_of(__file__, "# LOOP_LOG") in a["tensor_description"]
    return a, _series(logdir)


@pytest.mark.parametrize("flight", [None, 3])
def test_while_and_cond_bodies_in_a_called_function(tmp_path, capsys, flight):
    fn = tf.function(_loop_log)
    writer = tf.summary.create_file_writer(str(tmp_path))
    recorder = tbn.op_numerics(flight_recorder=flight)
    for i, x in enumerate(LOOP_INPUTS):
        with writer.as_default(step=i), recorder:
            fn(tf.constant(x))
    writer.close()
    a, series = _loop_log_anomaly(tmp_path, capsys)
    log = series[a["tensor"]]
    at3 = np.flatnonzero(log.steps == 3)
    assert [log.occurrence(i) for i in at3] == [(1, 3), (2, 3), (3, 3)]  # one record per iteration
    assert log.values[at3, records.F["neginf"]].tolist() == [0.0, 0.0, 1.0]
    assert any(s.info.op_type == "Sqrt" for s in series.values())  # the cond branch
    assert sorted(set(log.steps.tolist())) == ([0, 1, 2, 3, 4] if flight is None else [1, 2, 3])
    assert recorder.first_bad is not None and recorder.first_bad.op_type == "Log"


@pytest.mark.parametrize("flight", [None, 2])
def test_while_and_cond_bodies_in_a_traced_step(tmp_path, capsys, flight):
    recorder = tbn.op_numerics(flight_recorder=flight)
    fn = tf.function(recorder(_loop_log))
    writer = tf.summary.create_file_writer(str(tmp_path))
    step = tf.Variable(0, dtype=tf.int64)
    with writer.as_default(step=step):
        for i, x in enumerate(LOOP_INPUTS):
            step.assign(i)
            fn(tf.constant(x))
    writer.close()
    a, series = _loop_log_anomaly(tmp_path, capsys)
    log = series[a["tensor"]]
    assert a["tensor"].startswith("ops/while/")
    if flight is None:  # every iteration's record, as occurrences
        assert log.steps.tolist() == [s for s in range(5) for _ in range(3)]
    else:  # the window's steps, each step's iterations merged in one record
        assert recorder.triggered and log.steps.tolist() == [2, 3]
        assert log.values[:, records.F["count"]].tolist() == [6.0, 6.0]


# ---------------------------------------------------------------- Keras RNN


def _rnn_model():
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((4, 2)), keras.layers.SimpleRNN(3, name="rnn"),
                             keras.layers.Dense(1, name="head")])


def _rnn_inputs():
    x = np.ones((5, 2, 4, 2), np.float32)
    x[3, 1, 2, 0] = np.inf  # step 3, third time step: Inf * weight in the RNN cell
    return x


@pytest.mark.parametrize("flight", [None, 2])
@pytest.mark.parametrize("mode", ["eager_block", "traced_step"])
def test_keras_rnn_loop_ops_are_recorded(tmp_path, capsys, mode, flight):
    model = _rnn_model()
    recorder = tbn.op_numerics(flight_recorder=flight)

    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model(x) ** 2)
        return tape.gradient(loss, model.trainable_variables)

    writer = tf.summary.create_file_writer(str(tmp_path))
    counter = tf.Variable(0, dtype=tf.int64)
    if mode == "traced_step":
        fn = tf.function(recorder(step))
    else:
        inner = tf.function(step)

        def fn(x):
            with recorder:
                return inner(x)

    with writer.as_default(step=counter):
        for i, x in enumerate(_rnn_inputs()):
            counter.assign(i)
            fn(tf.constant(x))
    writer.close()
    code, run = _report(tmp_path, capsys)
    a = run["first_anomaly"]
    assert a["step"] == 3 and a["phase"] == "forward"
    assert a["op_type"] == "MatMul" and "while" in a["tensor"]
    series = _series(tmp_path)[a["tensor"]]
    at3 = np.flatnonzero(series.steps == 3)
    if flight is None:
        assert len(at3) == 4  # one record per time step of the RNN loop
    else:
        assert recorder.triggered and sorted(set(series.steps.tolist())) == [2, 3]


# ---------------------------------------------------------------- execution order in loops


def _feedback_loop(x):
    # The Log's output feeds the next iteration's Mul: log(0) = -Inf at
    # iteration 2, then the Mul of iteration 3 (first in the body) is -Inf too.
    def body(i, s):
        a = s * 2.0  # FEEDBACK_MUL
        return i + 1, tf.math.log(a)  # FEEDBACK_LOG

    return tf.while_loop(lambda i, s: i < 4, body, (0, x))[1]


@pytest.mark.parametrize("flight", [None, 2])
def test_first_bad_op_across_loop_iterations_is_marked_in_execution_order(tmp_path, flight):
    fn = tf.function(_feedback_loop)
    writer = tf.summary.create_file_writer(str(tmp_path))
    recorder = tbn.op_numerics(flight_recorder=flight)
    for i, x in enumerate([2.0, 2.0, 0.5]):
        with writer.as_default(step=i), recorder:
            fn(tf.constant([x]))
    writer.close()
    series = {s.info.op_type: s for s in _series(tmp_path).values()}
    mul, log = series["Mul"], series["Log"]
    bad = lambda s: [s.occurrence(i) for i in np.flatnonzero(  # noqa: E731
        (s.steps == 2) & (records.nonfinite_count(s.values) > 0))]
    # Both ops' records at step 2 hold non-finite values; the Mul's tag comes
    # first in the body, but its first bad record ran after the Log's.
    assert bad(log)[0] == (2, 4) and bad(mul)[0] == (3, 4)
    first = recorder.first_bad
    assert (first.op_type, first.occurrence, first.step) == ("Log", (2, 4), 2)
    mark = {m["step"]: m for m in marks(tmp_path)}
    assert list(mark) == [2]
    assert (mark[2]["type"], mark[2]["occurrence"], mark[2]["tag"]) == ("Log", [2, 4], log.tag)
    assert mark[2]["source"].endswith("test_oplevel_nested.py:%d (body)" % line_of(__file__, "# FEEDBACK_LOG"))


@pytest.mark.parametrize("flight", [None, 2])
def test_traced_step_records_the_gradient_ops_of_a_function_it_calls(tmp_path, capsys, flight):
    # The backward graph TensorFlow builds for the called function has no
    # automatic control dependencies: its record ops must still run.
    w = tf.Variable([1.0, 1.0, 1.0])

    @tf.function
    def root(x):
        return tf.sqrt(x * w)  # CALLED_SQRT

    recorder = tbn.op_numerics(flight_recorder=flight)

    @tf.function
    @recorder
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(root(x))
        return tape.gradient(loss, w)

    writer = tf.summary.create_file_writer(str(tmp_path))
    counter = tf.Variable(0, dtype=tf.int64)
    with writer.as_default(step=counter):
        for i, x in enumerate([HEALTHY, HEALTHY, BAD]):
            counter.assign(i)
            step(tf.constant(x))
    writer.close()
    code, run = _report(tmp_path, capsys)
    a = run["first_anomaly"]
    assert (a["step"], a["op_type"], a["phase"]) == (2, "SqrtGrad", "backward")
    assert "test_oplevel_nested.py:%d (root)" % line_of(__file__, "# CALLED_SQRT") in a["tensor_description"]
    assert "gradient of" in a["tensor_description"]


def test_a_function_traced_before_the_recorder_is_traced_anew_in_its_block(tmp_path, capsys, caplog):
    """A warm-up call traces both helpers outside any block: the block traces
    them anew, so their ops are recorded as where they were first called in
    it (the same tags, no warning), and the report names the helper's Log."""
    model = _Model()
    model.train_step(tf.constant(HEALTHY))  # a warm-up call traces both helpers, unrecorded
    with caplog.at_level("WARNING", logger="tb_numerics.oplevel"):
        _train(tmp_path / "warm", [HEALTHY, HEALTHY, BAD], "int", tbn.op_numerics(), model)
    assert not [r for r in caplog.records if "traced before" in r.getMessage()]
    _train(tmp_path / "fresh", [HEALTHY, HEALTHY, BAD], "int", tbn.op_numerics())
    assert sorted(_series(tmp_path / "warm")) == sorted(_series(tmp_path / "fresh"))
    code, run = _report(tmp_path / "warm", capsys)
    a = run["first_anomaly"]
    assert (code, a["step"], a["op_type"], a["tensor"]) == (cli.EXIT_ANOMALY, 2, "Log", "ops/forward/Log")
    assert "test_oplevel_nested.py:%d (forward)" % line_of(__file__, "# NESTED_LOG") in a["tensor_description"]


def test_eager_blocks_write_to_the_writer_of_each_block_and_any_number_of_iterations(tmp_path):
    # A loop whose trip count changes from step to step gives each step its
    # own list of records; two writers alternate. Every record reaches its own
    # writer, whatever the number of distinct lists.
    @tf.function
    def repeat(x, n):
        return tf.while_loop(lambda i, s: i < n, lambda i, s: (i + 1, tf.sqrt(s + 1.0)), (0, x))[1]

    writers = [tf.summary.create_file_writer(str(tmp_path / name)) for name in ("a", "b")]
    recorder = tbn.op_numerics(op_types={"Sqrt"})
    for i in range(20):
        with writers[i % 2].as_default(step=i), recorder:
            repeat(tf.constant([1.0]), tf.constant(i + 1))
    for w in writers:
        w.close()
    for name, parity in (("a", 0), ("b", 1)):
        (sqrt,) = _series(tmp_path / name).values()
        want = [i for i in range(20) if i % 2 == parity for _ in range(i + 1)]
        assert sqrt.steps.tolist() == want


def test_keras_model_and_optimizer_in_an_eager_block(tmp_path, capsys):
    # The tutorials' custom loop: an eager Keras model and optimizer, a loss
    # in a tf.function helper; logits of 1e4 saturate the softmax at step 3.
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
    opt = keras.optimizers.Adam(1e-3)

    @tf.function
    def loss_of(logits, y):
        p = tf.nn.softmax(logits)
        return -tf.reduce_mean(tf.math.log(tf.gather(p, y, batch_dims=1)))  # SOFTMAX_LOG

    writer = tf.summary.create_file_writer(str(tmp_path))
    recorder = tbn.op_numerics()
    rs = np.random.RandomState(0)
    for i in range(4):
        x, y = rs.randn(8, 4).astype("float32") * (1e4 if i == 3 else 1), rs.randint(0, 3, 8)
        with writer.as_default(step=i), recorder:
            with tf.GradientTape() as tape:
                loss = loss_of(model(x, training=True), tf.constant(y))
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    writer.close()
    _, run = _report(tmp_path, capsys)
    a = run["first_anomaly"]
    assert (a["step"], a["tensor"], a["op_type"], a["phase"]) == (3, "ops/loss_of/Log", "Log", "forward")
    assert "test_oplevel_nested.py:%d" % line_of(__file__, "# SOFTMAX_LOG") in a["tensor_description"]
    phases = {s.info.phase for s in _series(tmp_path).values()}
    assert phases == {"forward", "backward", "update"}  # the optimizer's ops after the gradients
