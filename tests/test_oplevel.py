"""Op-level mode on real TensorFlow: the first bad op, its type and source line.

Each test runs a few real training steps, eagerly and as a tf.function, writes
with ``tbn.op_numerics`` and reads the logdir back through the same code as
``tb-numerics report`` (event_reader + analysis).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import tensorflow as tf

import tb_numerics as tbn
from op_records import line_of
from tb_numerics import analysis, cli, event_reader, records

pytestmark = pytest.mark.e2e

MODES = ["eager", "function"]




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
    where = "test_oplevel.py:%d (_sqrt_loss)" % line_of(__file__, "# SQRT")
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
    assert "test_oplevel.py:%d" % line_of(__file__, marker) in a["tensor_description"]
    assert _healthy_before(ra, a)  # the Mul/Abs before it, healthy
    assert a["hint"]


def test_report_cli_json_names_the_op(tmp_path, capsys):
    logdir = str(tmp_path / "run1")
    _run(logdir, _sqrt_loss, [[4.0, 4.0, 4.0], [0.0, 4.0, 4.0]], "function", tbn.op_numerics())
    assert cli.main(["report", str(tmp_path), "--json"]) == cli.EXIT_ANOMALY
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    a = run["first_anomaly"]
    assert (a["step"], a["op_type"], a["phase"]) == (1, "SqrtGrad", "backward")
    assert "test_oplevel.py:%d" % line_of(__file__, "# SQRT") in a["tensor_description"]


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
    assert "test_oplevel.py:%d" % line_of(__file__, "# SQRT") in a["tensor_description"]


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


def test_eager_op_repeated_in_a_step_keeps_one_record_per_execution(tmp_path):
    # Every execution counts: the same eager op twice in a step is two
    # occurrences of its tag at that step, in execution order.
    _run(str(tmp_path), _two_sqrts, [[1.0, 4.0], [0.5, 4.0]], "eager", tbn.op_numerics())
    ra = _analysis(str(tmp_path))
    (h,) = [h for h in ra.health if h.series.info.op_type == "Sqrt"]
    assert h.series.steps.tolist() == [0, 0, 1, 1]
    assert h.series.values[:, 0].tolist() == [2.0] * 4
    assert h.series.values[:, 1].tolist() == [0.0, 0.0, 0.0, 1.0]  # sqrt(0.5 - 1) in step 1
    assert h.series.occurrence(3) == (2, 2)
    assert "test_oplevel.py:%d" % line_of(__file__, "# LOOP") in h.series.info.description


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
    assert h.series.info.description.endswith("test_oplevel.py:%d (body)" % line_of(__file__, "# KERAS"))


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


# ---------------------------------------------------------------- op_stats
#
# The lighter record op_numerics writes: tensor_stats' fields and values
# except the sum and sum of squares (always NaN) and zeros and underflow
# (always 0).

from tb_numerics import metadata, oplevel, stats  # noqa: E402
from tb_numerics.records import numpy_stats  # noqa: E402

F = metadata.FIELD_INDEX
KEPT_COUNTS = ["count", "nan", "posinf", "neginf", "overflow"]
_op_stats_fn = tf.function(stats.op_stats, reduce_retracing=True)


def _as_tf(values, dtype: str) -> tf.Tensor:
    # Converted in numpy: TensorFlow's casts on a CPU flush subnormals to zero.
    values = np.asarray(values, np.float64)
    if dtype == "bfloat16":
        return tf.cast(tf.constant(values.astype(np.float32)), tf.bfloat16)
    return tf.constant(values.astype(dtype))


def _assert_op_record(got: np.ndarray, t: tf.Tensor, dtype: str) -> None:
    """``got`` agrees with numpy_stats on every field op_stats keeps."""
    with np.errstate(over="ignore"):  # the reference's own sum of squares may overflow
        want = numpy_stats(np.asarray(t.numpy()).astype(np.float64), dtype)
    assert got.dtype == np.float64 and got.shape == (metadata.NUM_FIELDS,)
    for f in KEPT_COUNTS:
        assert got[F[f]] == want[F[f]], (f, got, want)
    assert got[F["zeros"]] == 0 and got[F["underflow"]] == 0
    for f in ("min", "max"):
        np.testing.assert_equal(got[F[f]], want[F[f]], err_msg=f)
    assert np.isnan(got[F["sum"]]) and np.isnan(got[F["sum_sq"]])  # not computed
    # Always a record the analysis accepts, with no underflow warning.
    assert records.valid_records(got[None]).all()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize(
    "inject",
    [[], [(0.0, 40)], [(np.nan, 3), (np.inf, 2), (-np.inf, 1), (0.0, 5)], [(np.nan, 1)], [(-np.inf, 7)]],
    ids=["healthy", "zeros", "nan_inf_zeros", "one_nan", "neginf"],
)
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "function"])
def test_op_stats_matches_numpy_on_the_fields_it_keeps(dtype, inject, graph):
    rng = np.random.default_rng(len(inject) * 7 + len(dtype))
    x = rng.standard_normal((37, 129)) * 3
    flat = x.reshape(-1)
    idx, k = rng.permutation(flat.size), 0
    for value, count in inject:
        flat[idx[k:k + count]] = value
        k += count
    t = _as_tf(x, dtype)
    got = (_op_stats_fn if graph else stats.op_stats)(t, "x").numpy()
    _assert_op_record(got, t, dtype)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "function"])
def test_op_stats_relu_output_at_benchmark_size(graph):
    rng = np.random.default_rng(1)
    t = tf.constant(np.maximum(rng.standard_normal((512, 1024)), 0).astype(np.float32))
    got = (_op_stats_fn if graph else stats.op_stats)(t, "relu").numpy()
    _assert_op_record(got, t, "float32")
    assert got[F["min"]] == 0.0


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
@pytest.mark.parametrize(
    "values",
    [
        [1.0, 2.0, 1e-300, 3.0],  # a subnormal min (scaled to the dtype below)
        [1e-300, 2e-300, 0.5e-300],  # all subnormal: min and max subnormal
        [-1e-300, -2e-300],  # all negative subnormal
        [0.0, -1e-300, 3.0],
        [-0.0, 1.0],
        [-5.0, -1e-300, -2.0],  # a normal min and a subnormal max
        [-5.0, 1e-300, np.nan],
    ],
    ids=["sub_min", "all_sub", "neg_sub", "zero_neg_sub", "neg_zero", "sub_max", "sub_nan"],
)
def test_op_stats_subnormal_extremes_are_exact(dtype, values):
    # CPUs run TensorFlow with denormals-are-zero: a float min or max would
    # read a subnormal extreme as 0; op_stats redoes it from the bits.
    tiny = metadata.smallest_normal(dtype)
    values = [v * tiny / 1e-300 * 0.25 if abs(v) <= 2e-300 else v for v in values]
    t = _as_tf(values, dtype)
    for fn in (stats.op_stats, _op_stats_fn):
        _assert_op_record(fn(t, "sub").numpy(), t, dtype)


def test_op_stats_float16_overflow_margin():
    values = np.array([1e-6, -3e-5, 0.0, 1.0, 2000.0, -60000.0, 6.2e-5], np.float16)
    got = stats.op_stats(tf.constant(values), "h").numpy()
    assert got[F["overflow"]] == 2
    _assert_op_record(got, tf.constant(values), "float16")
    big = tf.constant(np.full((64, 64), 60000.0, np.float16))
    got = stats.op_stats(big, "big").numpy()
    assert got[F["overflow"]] == 4096
    _assert_op_record(got, big, "float16")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_op_stats_huge_finite_values(dtype):
    big = 1e30 if dtype == "float32" else 1e200
    t = _as_tf([big, -big, 1.0, np.nan], dtype)
    got = stats.op_stats(t, "huge").numpy()
    _assert_op_record(got, t, dtype)
    assert got[F["max"]] == np.float64(np.array(big, dtype)) and got[F["nan"]] == 1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_op_stats_beyond_the_overflow_margin(dtype):
    big = metadata.DTYPE_LIMITS[dtype][0] * 0.75
    for values in ([big, big, -1.0, 2.0], [big, 1.0], [-big, -1.0]):
        t = _as_tf(values, dtype)
        got = stats.op_stats(t, "big").numpy()
        assert got[F["overflow"]] == values.count(big) + values.count(-big)
        _assert_op_record(got, t, dtype)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_op_stats_nan_with_the_sign_bit_set(dtype):
    values = np.array([1.0, -2.0, 3.0], dtype)
    values[1] = -np.abs(np.array(np.nan, dtype))  # a NaN pattern with the sign bit set
    assert np.signbit(values[1]) and np.isnan(values[1])
    t = tf.constant(values)
    for fn in (stats.op_stats, _op_stats_fn):
        got = fn(t, "negnan").numpy()
        assert got[F["nan"]] == 1 and (got[F["min"]], got[F["max"]]) == (1.0, 3.0)
        _assert_op_record(got, t, dtype)


@pytest.mark.parametrize("values", [[np.nan, np.nan], [np.inf, -np.inf], []], ids=["all_nan", "all_inf", "empty"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_op_stats_no_finite_values(values, dtype):
    t = _as_tf(values, dtype)
    for fn in (stats.op_stats, _op_stats_fn):
        got = fn(t, "none").numpy()
        assert np.isnan(got[F["min"]]) and np.isnan(got[F["max"]])
        _assert_op_record(got, t, dtype)


def test_op_stats_scalar_empty_of_any_shape_and_non_float():
    _assert_op_record(stats.op_stats(tf.constant(-2.5), "s").numpy(), tf.constant(-2.5), "float32")
    got = stats.op_stats(tf.zeros([3, 0, 2]), "empty").numpy()
    assert got[F["count"]] == 0 and np.isnan(got[F["min"]]) and np.isnan(got[F["max"]])
    with pytest.raises(TypeError, match="'my/op'.*int32"):
        stats.op_stats(tf.constant([1, 2]), "my/op")


@pytest.mark.parametrize("mode", MODES)
def test_op_records_leave_zeros_and_underflow_at_zero(tmp_path, mode):
    # A ReLU output full of zeros and a float32 underflow: the op-level
    # records count neither, and the analysis warns about neither.
    def body(x):
        return tf.nn.relu(x) * 1e-30  # RELU

    recorder = tbn.op_numerics(skip_op_types=oplevel.DEFAULT_SKIP_OP_TYPES - {"Relu"})
    _run(str(tmp_path), body, [[1.0, -2.0, 0.0, 3e-10]], mode, recorder)
    ra = _analysis(str(tmp_path))
    assert {h.series.info.op_type for h in ra.health} >= {"Relu", "Mul"}
    for h in ra.health:
        v = h.series.values[0]
        assert v[F["zeros"]] == 0 and v[F["underflow"]] == 0
        assert h.codes.tolist() == [analysis.HEALTHY]
    (relu,) = [h for h in ra.health if h.series.info.op_type == "Relu"]
    assert relu.series.values[0, F["min"]] == 0 and relu.series.values[0, F["max"]] == 1


def _relu_mlp(x):
    w = tf.constant([[1.0, -1.0], [2.0, 0.5], [0.5, 1.0]])
    with tf.GradientTape() as tape:
        tape.watch(w)
        h = tf.nn.relu(tf.matmul(x[None, :], w))
        loss = tf.reduce_sum(tf.abs(-h) * 1e30)  # BIG
    return tape.gradient(loss, w)


@pytest.mark.parametrize("mode", MODES)
def test_relu_neg_abs_are_skipped_and_the_op_that_made_the_value_is_named(tmp_path, mode):
    # Their outputs are finite and no larger wherever their inputs are, so by
    # default they are not recorded: the op that made a bad value is.
    _run(str(tmp_path), _relu_mlp, [[1.0, 1.0, 1.0], [1e10, 1.0, 1.0]], mode, tbn.op_numerics())
    ra = _analysis(str(tmp_path))
    ops = {h.series.info.op_type for h in ra.health}
    assert "MatMul" in ops and ops.isdisjoint({"Relu", "ReluGrad", "Neg", "Abs"})
    a = analysis.first_anomaly(ra)
    assert a["step"] == 1 and a["op_type"] == "Mul" and a["posinf"] > 0
    assert "test_oplevel.py:%d" % line_of(__file__, "# BIG") in a["tensor_description"]


def test_a_replay_stopped_by_the_programs_own_check_returns_the_op_it_found(tmp_path):
    """``replay_step`` of a step whose ``tf.debugging.check_numerics`` fires
    on the NaN returns the op that made it (as TensorFlow's
    enable_check_numerics names it on the unchecked step), not the check's
    error; an error of another kind still reaches the caller."""
    w = tf.Variable([1.0, -2.0])

    def step(checked=True):
        y = tf.math.log(w)  # THE_LOG
        return tf.debugging.check_numerics(y, "checked") if checked else y

    tf.debugging.enable_check_numerics()
    try:
        with pytest.raises(tf.errors.InvalidArgumentError, match=r'op "(\w+)"') as oracle:
            step(checked=False)
    finally:
        tf.debugging.disable_check_numerics()
    found = oplevel.replay_step(step, step=0, writer=tf.summary.create_file_writer(str(tmp_path)))
    assert found is not None and 'op "%s"' % found.op_type in str(oracle.value)
    assert found.source.endswith("test_oplevel.py:%d (step)" % line_of(__file__, "# THE_LOG"))

    def broken():
        tf.math.log(w)
        raise tf.errors.InvalidArgumentError(None, None, "a shape mismatch")

    with pytest.raises(tf.errors.InvalidArgumentError, match="a shape mismatch"):
        oplevel.replay_step(broken, step=0)
