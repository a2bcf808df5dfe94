"""tensor_stats against the numpy reference, in every float dtype."""

import numpy as np
import pytest
import tensorflow as tf

from tb_numerics import metadata, record_kernel, stats
from tb_numerics.records import numpy_stats

pytestmark = pytest.mark.e2e

F = metadata.FIELD_INDEX
COUNTS = ["count", "nan", "posinf", "neginf", "zeros", "overflow", "underflow"]
# Relative tolerance of the sums by accumulation precision.
SUM_RTOL = {"float16": 1e-5, "bfloat16": 1e-5, "float32": 1e-5, "float64": 1e-12}

# Every test runs both ways: with the record kernel (one C++ op) and with
# TensorFlow's ops (where the kernel cannot be built). A traced function
# keeps the way it was traced with, so each way has its own.
_TRACED = {way: tf.function(stats.tensor_stats, reduce_retracing=True) for way in ("kernel", "ops")}
_way = "kernel"


@pytest.fixture(autouse=True, params=["kernel", "ops"])
def record_way(request):
    global _way
    if request.param == "kernel" and record_kernel.load() is None:
        pytest.skip("the record kernel is not built on this machine (test_record_kernel.py says why)")
    _way = request.param
    with record_kernel.use(request.param == "kernel"):
        yield request.param


def _stats_fn(x, name):
    return _TRACED[_way](x, name)


def _as_tf(values: np.ndarray, dtype: str) -> tf.Tensor:
    # Converted in numpy where it can: TensorFlow's casts on a CPU flush
    # subnormals to zero.
    if dtype == "bfloat16":
        return tf.cast(tf.constant(values.astype(np.float32)), tf.bfloat16)
    return tf.constant(values.astype(dtype))


def _reference(t: tf.Tensor, dtype: str) -> np.ndarray:
    # The values the tensor really holds, widened in numpy (bfloat16 via
    # ml_dtypes), never by a TensorFlow cast that flushes subnormals.
    return numpy_stats(np.asarray(t.numpy()).astype(np.float64), dtype)


def assert_matches(got: np.ndarray, want: np.ndarray, dtype: str) -> None:
    for f in COUNTS:
        assert got[F[f]] == want[F[f]], (f, got, want)
    for f in ("min", "max"):
        # + 0.0: -0.0 and 0.0 are the same min (numpy keeps whichever comes first).
        np.testing.assert_equal(got[F[f]] + 0.0, want[F[f]] + 0.0, err_msg=f)
    # Summation error grows with the size of the terms and their number.
    max_abs = np.nan_to_num(max(abs(want[F["min"]]), abs(want[F["max"]])))
    scale = max(1.0, float(max_abs * want[F["count"]]))
    np.testing.assert_allclose(got[F["sum"]], want[F["sum"]], rtol=SUM_RTOL[dtype], atol=SUM_RTOL[dtype] * scale)
    np.testing.assert_allclose(got[F["sum_sq"]], want[F["sum_sq"]], rtol=SUM_RTOL[dtype] * 10)


def _random(rng, shape, dtype, inject):
    x = rng.standard_normal(shape) * 3
    flat = x.reshape(-1)
    idx = rng.permutation(flat.size)
    k = 0
    for value, count in inject:
        flat[idx[k:k + count]] = value
        k += count
    return x


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize(
    "inject",
    [
        [],
        [(0.0, 40)],
        [(np.nan, 3), (np.inf, 2), (-np.inf, 1), (0.0, 5)],
        [(np.nan, 1)],
        [(-np.inf, 7)],
    ],
    ids=["healthy", "zeros", "nan_inf_zeros", "one_nan", "neginf"],
)
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "function"])
def test_matches_numpy(dtype, inject, graph):
    rng = np.random.default_rng(len(inject) * 7 + len(dtype))
    t = _as_tf(_random(rng, (37, 129), dtype, inject), dtype)
    fn = _stats_fn if graph else stats.tensor_stats
    got = fn(t, "x").numpy()
    assert got.dtype == np.float64 and got.shape == (metadata.NUM_FIELDS,)
    assert_matches(got, _reference(t, dtype), dtype)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "function"])
def test_relu_like_float32_at_benchmark_size(graph):
    rng = np.random.default_rng(1)
    t = tf.constant(np.maximum(rng.standard_normal((512, 1024)), 0).astype(np.float32))
    fn = _stats_fn if graph else stats.tensor_stats
    got = fn(t, "relu").numpy()
    want = _reference(t, "float32")
    assert got[F["zeros"]] > 200_000
    assert_matches(got, want, "float32")


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_subnormals_are_underflow_not_zeros(dtype):
    # CPUs run TensorFlow with denormals-are-zero: a float compare would call
    # these zeros. The record must agree with numpy.
    tiny = metadata.smallest_normal(dtype)
    values = np.array([tiny / 4, -tiny / 64, 0.0, -0.0, tiny, 1.0, -tiny / 2])
    t = _as_tf(values, dtype)
    for fn in (stats.tensor_stats, _stats_fn):
        got = fn(t, "sub").numpy()
        want = _reference(t, dtype)
        assert want[F["underflow"]] == 3 and want[F["zeros"]] == 2
        assert_matches(got, want, dtype)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "function"])
def test_nonnegative_tensor_with_zeros_and_subnormals(graph):
    # No sign bit set: the counts take the ReLU-output path.
    values = np.array([0.0, 1e-40, 3.0, 0.0, 1e-45, 2e-38], np.float32)
    fn = _stats_fn if graph else stats.tensor_stats
    got = fn(tf.constant(values), "relu").numpy()
    want = numpy_stats(values)
    assert want[F["zeros"]] == 2 and want[F["underflow"]] == 2
    assert_matches(got, want, "float32")


def test_float16_underflow_and_overflow_margin():
    values = np.array([1e-6, -3e-5, 0.0, 1.0, 2000.0, -60000.0, 6.2e-5], np.float16)
    got = stats.tensor_stats(tf.constant(values), "h").numpy()
    want = numpy_stats(values)
    assert want[F["overflow"]] == 2 and want[F["underflow"]] == 2
    assert_matches(got, want, "float16")


def test_float16_sums_do_not_overflow():
    values = np.full((64, 64), 60000.0, np.float16)
    got = stats.tensor_stats(tf.constant(values), "big").numpy()
    assert np.isfinite(got[F["sum_sq"]])
    assert got[F["overflow"]] == 4096
    assert_matches(got, numpy_stats(values), "float16")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_huge_finite_values_whose_squares_overflow(dtype):
    big = 1e30 if dtype == "float32" else 1e200
    values = np.array([big, -big, 1.0, np.nan])
    t = _as_tf(values, dtype)
    got = stats.tensor_stats(t, "huge").numpy()
    assert_matches(got, _reference(t, dtype), dtype)
    assert got[F["max"]] == np.float64(np.array(big, dtype))


@pytest.mark.parametrize("values", [[np.nan, np.nan], [np.inf, -np.inf], []], ids=["all_nan", "all_inf", "empty"])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_no_finite_values(values, dtype):
    t = _as_tf(np.array(values, np.float64), dtype)
    for fn in (stats.tensor_stats, _stats_fn):
        got = fn(t, "none").numpy()
        want = _reference(t, dtype)
        assert np.isnan(got[F["min"]]) and np.isnan(got[F["max"]])
        assert_matches(got, want, dtype)


def test_empty_tensor_of_any_shape():
    got = stats.tensor_stats(tf.zeros([3, 0, 2]), "empty").numpy()
    assert got[F["count"]] == 0 and got[F["zeros"]] == 0 and got[F["sum"]] == 0


def test_scalar():
    got = stats.tensor_stats(tf.constant(-2.5), "s").numpy()
    assert_matches(got, numpy_stats(np.float32(-2.5)), "float32")


@pytest.mark.parametrize(
    "value",
    [tf.constant([1, 2]), tf.constant([True]), tf.constant(["a"]), tf.constant([1 + 2j]), tf.constant([1], tf.uint8)],
    ids=["int32", "bool", "string", "complex", "uint8"],
)
def test_non_float_tensors_raise_type_error_naming_them(value):
    with pytest.raises(TypeError, match="'my/tensor'.*(int32|bool|string|complex|uint8)"):
        stats.tensor_stats(value, "my/tensor")


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "function"])
def test_records_of_many_tensors_are_each_ones_record(graph):
    # What the callback records a step's weights, gradients and layer
    # outputs with: one row per tensor, in order, whatever their dtypes,
    # shapes and sizes (small ones, one over a shard, one of a single value),
    # each numpy's record of its own values.
    rng = np.random.default_rng(11)
    cases = [
        ("float32", _random(rng, (3, 5), "float32", [(np.nan, 1)])),
        ("float64", _random(rng, (70,), "float64", [(0.0, 4)])),
        ("float16", _random(rng, (40, 3), "float16", [(np.inf, 2)])),
        ("float32", _random(rng, (300, 301), "float32", [(0.0, 9), (-np.inf, 1)])),
        ("bfloat16", _random(rng, (17,), "bfloat16", [])),
        ("float32", np.array(2.5)),
        ("float32", _random(rng, (0, 4), "float32", [])),
        ("float32", _random(rng, (5000,), "float32", [])),
    ]
    tensors = [_as_tf(values, dtype) for dtype, values in cases]
    names = ["t%d" % i for i in range(len(cases))]
    fn = tf.function(lambda xs: stats.records_of(xs, names)) if graph else (lambda xs: stats.records_of(xs, names))
    got = fn(tensors).numpy()
    assert got.shape == (len(cases), metadata.NUM_FIELDS)
    for row, t, (dtype, _) in zip(got, tensors, cases):
        assert_matches(row, _reference(t, dtype), dtype)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "traced"])
def test_a_due_steps_weights_are_kept_and_how_far_they_moved_is_measured(graph):
    # A due step's weights before the update (records and a copy), and the
    # update ratios' ||now - before||^2 and ||before||^2 after it, with no
    # cond: at a step that is not due, zeros and empty copies. The truth is
    # numpy's, on float32 and float64 weights mixed, a NaN and an Inf, a
    # scalar, an empty weight, weights over the kernel's copy blocks and shards.
    rng = np.random.default_rng(5)
    cases = [("float32", (3, 4)), ("float64", (70000,)), ("float32", ()), ("float32", (0,)), ("float32", (64, 65)),
             ("float64", (5,)), ("float32", (140001,))]
    before = [rng.standard_normal(s).astype(d) for d, s in cases]
    before[4][1, 2], before[5][0] = np.inf, np.nan
    now = [b + rng.standard_normal(b.shape).astype(b.dtype) * 1e-3 for b in before]
    names = ["w%d" % i for i in range(len(cases))]

    def step(due):
        kept = stats.keep_if([tf.constant(b) for b in before], names, due, record=True, copy=True)
        if kept is None:
            return None
        rows, copies = kept
        return rows, copies, stats.moved_since([tf.constant(n) for n in now], copies, due)

    run = tf.function(step) if graph else step
    if _way == "ops":  # TensorFlow's ops serve this with a cond (the callback's _Snapshot)
        assert run(tf.constant(True)) is None
        return
    rows, copies, moved = run(tf.constant(True))
    for row, b, (dtype, _) in zip(rows.numpy(), before, cases):
        assert_matches(row, numpy_stats(b.astype(np.float64), dtype), dtype)
    for dtype, copy in zip(("float32", "float64"), copies):
        np.testing.assert_array_equal(copy.numpy(), np.concatenate(
            [b.reshape(-1) for b, (d, _) in zip(before, cases) if d == dtype]))
    with np.errstate(invalid="ignore"):  # inf - inf
        want = [[np.square(n.astype(np.float64) - b.astype(np.float64)).sum(), np.square(b.astype(np.float64)).sum()]
                for n, b in zip(now, before)]
    got = moved.numpy()
    assert got.shape == (len(cases), 2) and got[3].tolist() == [0, 0]
    assert np.isnan(got[4, 0]) and np.isinf(got[4, 1]) and np.isnan(got[5]).all()
    for i in (0, 1, 2, 6):
        np.testing.assert_allclose(got[i], want[i], rtol=1e-5 if cases[i][0] == "float32" else 1e-12)
    rows, copies, moved = run(tf.constant(False))
    assert not rows.numpy().any() and [c.shape[0] for c in copies] == [0, 0] and not moved.numpy().any()
    rows, copies = stats.keep_if([tf.constant(b) for b in before], names, tf.constant(True), record=False, copy=False)
    assert rows.shape == (0, metadata.NUM_FIELDS) and [c.shape[0] for c in copies] == [0, 0]


def test_merge_stats_is_the_record_of_the_concatenation():
    rng = np.random.default_rng(3)
    a = rng.standard_normal(100)
    a[[1, 5]] = [np.nan, np.inf]
    b = np.array([np.nan, -np.inf])  # no finite value: must not poison min/max
    c = rng.standard_normal(50) * 10
    merged = stats.merge_stats(numpy_stats(a, "float64"), numpy_stats(b, "float64"))
    merged = stats.merge_stats(merged, numpy_stats(c, "float64")).numpy()
    want = numpy_stats(np.concatenate([a, b, c]), "float64")
    assert_matches(merged, want, "float64")


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("offset, spread", [(1000.0, 0.01), (1.0, 1e-5), (-3e4, 0.3)])
def test_std_is_accurate_where_the_sums_of_squares_cancel(graph, offset, spread):
    """Issue 13 item 8: 1e6 values of 1000 +- 0.01 reported std 0 (true 0.0100):
    within 1 % whenever std/|mean| >= 1e-5."""
    from tb_numerics import records

    x = (offset + spread * np.random.default_rng(1).standard_normal(10**6)).astype(np.float32)
    fn = _stats_fn if graph else stats.tensor_stats
    d = records.derived(fn(tf.constant(x), "x").numpy())
    true = x.astype(np.float64)
    assert d["std"][0] == pytest.approx(true.std(), rel=0.01)
    assert d["mean"][0] == pytest.approx(true.mean(), rel=1e-7)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_squares_that_overflow_without_any_nonfinite_element(dtype):
    # The sum of squares alone sends the tensor down the non-finite path:
    # it must count no NaN or Inf there.
    big = 1e30 if dtype == "float32" else 1e200
    t = _as_tf(np.array([big, -big, 1.0, 0.0]), dtype)
    for fn in (stats.tensor_stats, _stats_fn):
        got = fn(t, "huge").numpy()
        assert got[F["nan"]] == got[F["posinf"]] == got[F["neginf"]] == 0
        assert_matches(got, _reference(t, dtype), dtype)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "function"])
def test_float16_overflow_counted_beside_nan(graph):
    values = np.array([np.nan, 60000.0, -2000.0, 1.0, np.inf, 1e-6, 0.0], np.float16)
    fn = _stats_fn if graph else stats.tensor_stats
    got = fn(tf.constant(values), "h").numpy()
    want = numpy_stats(values)
    assert want[F["overflow"]] == 2 and want[F["underflow"]] == 1
    assert_matches(got, want, "float16")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_unknown_static_size_counts_the_same(dtype):
    # No static size: counts are summed in int64 instead of int32.
    tiny = metadata.smallest_normal(dtype)
    values = np.array([tiny / 4, -tiny / 64, 0.0, -0.0, tiny, 1.0, -3.0])
    fn = tf.function(stats.tensor_stats, input_signature=[tf.TensorSpec([None], dtype), tf.TensorSpec([], tf.string)])
    t = _as_tf(values, dtype)
    got = fn(t, "x").numpy()
    assert_matches(got, _reference(t, dtype), dtype)


@pytest.mark.parametrize("values", [[np.nan, np.nan], []], ids=["all_nan", "empty"])
def test_no_finite_values_bfloat16(values):
    t = _as_tf(np.array(values, np.float64), "bfloat16")
    for fn in (stats.tensor_stats, _stats_fn):
        got = fn(t, "none").numpy()
        assert np.isnan(got[F["min"]]) and np.isnan(got[F["max"]])
        assert_matches(got, _reference(t, "bfloat16"), "bfloat16")


_jit_stats_fn = tf.function(stats.tensor_stats, jit_compile=True, reduce_retracing=True)


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
@pytest.mark.parametrize("mode", ["eager", "function", "jit"])
def test_subnormal_extremes_beside_nonfinite_values(dtype, mode):
    # The non-finite path must find min and max as exactly as the finite
    # one: a float compare or cast on a denormals-are-zero CPU gives 0.
    tiny = metadata.smallest_normal(dtype)
    fn = {"eager": stats.tensor_stats, "function": _stats_fn, "jit": _jit_stats_fn}[mode]
    for values in ([np.nan, -tiny / 4, 3.0, 0.5], [np.inf, tiny / 8, 3.0], [-np.inf, -2.0, -tiny / 2]):
        t = _as_tf(np.array(values), dtype)
        got = fn(t, "sub").numpy()
        want = _reference(t, dtype)
        assert want[F["underflow"]] == 1
        assert_matches(got, want, dtype)


def _side_cases(dtype: str) -> dict[str, list[float]]:
    """Zeros and underflows on one side of zero, the other or both: each takes
    its own way through the zero count (see stats._zeros_and_underflow)."""
    tiny = metadata.smallest_normal(dtype)
    return {
        "pos_zeros_beside_negatives": [0.0, 0.0, 1.0, -1.0, -2.5, 3.0],
        "pos_underflow_beside_negatives": [0.0, tiny / 4, tiny / 2, -1.0, -tiny, 2.0],
        "neg_zeros_beside_positives": [-0.0, 1.0, -1.0, 2.0, -0.0],
        "neg_underflow_beside_positives": [-0.0, -tiny / 8, 1.0, -3.0, tiny],
        "both_sides": [0.0, -0.0, tiny / 2, -tiny / 2, 1.0, -1.0],
        "zeros_of_both_signs_only": [0.0, -0.0, -0.0],
        "negative_zeros_only": [-0.0, -0.0],
        "negatives_and_negative_zero": [-0.0, -1.0, -tiny / 4],
        "positive_subnormal_among_negatives": [tiny / 4, -1.0, -2.0],
        "no_small_values": [1.0, -1.0, tiny, -tiny],
        # Under XLA, every branch is compiled for it (an argmax over nothing was refused).
        "empty": [],
    }


def _assert_each_case(record, dtype: str, cases: dict[str, list[float]]) -> None:
    """``record(t, case)`` matches the reference for each case's values; a
    failure names the case."""
    for case, values in cases.items():
        t = _as_tf(np.array(values), dtype)
        try:
            assert_matches(np.asarray(record(t, case)), _reference(t, dtype), dtype)
        except AssertionError as e:
            raise AssertionError(case) from e


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("mode", ["eager", "function", "jit"])
def test_zeros_and_underflow_on_either_side_of_zero(dtype, mode):
    fn = {"eager": stats.tensor_stats, "function": _stats_fn, "jit": _jit_stats_fn}[mode]
    _assert_each_case(fn, dtype, _side_cases(dtype))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_int64_counting_variant(dtype):
    # Used where a float32 tensor may hold 2**31 elements or more: called
    # directly here on small ones, since no test can allocate that.
    record = stats._traced(dtype, tf.int64)
    _assert_each_case(lambda t, case: record(t), dtype, _side_cases(dtype))


@pytest.mark.parametrize("signs", ["positive_zeros", "negative_zeros", "both"])
def test_gradient_with_dead_units_at_benchmark_size(signs):
    # A ReLU network's weight gradient: normal values with whole rows and
    # columns of exact zeros (units dead across the batch), of either sign.
    rng = np.random.default_rng(3)
    g = rng.standard_normal((1024, 1024)).astype(np.float32)
    if signs in ("positive_zeros", "both"):
        g[:, rng.choice(1024, 40, replace=False)] = 0.0
    if signs in ("negative_zeros", "both"):
        g[rng.choice(1024, 25, replace=False), :] = -0.0
    t = tf.constant(g)
    want = numpy_stats(g)
    assert want[F["zeros"]] > 20_000
    for fn in (stats.tensor_stats, _stats_fn):
        assert_matches(fn(t, "grad").numpy(), want, "float32")


def _record_calls(graph: tf.Graph) -> list[bool]:
    """Whether each call of a statistics function in ``graph`` (and in the
    functions it calls, such as a branch) is compiled by XLA."""
    graph_def = graph.as_graph_def()
    nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
    return [
        n.attr["_XlaMustCompile"].b if "_XlaMustCompile" in n.attr else False
        for n in nodes
        if n.op in ("PartitionedCall", "StatefulPartitionedCall") and "record" in n.attr["f"].func.name
    ]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_record_is_compiled_where_a_gpu_is_visible(dtype, monkeypatch):
    # On a GPU, uncompiled, the record's uint32 and int32 reductions would
    # run on the host (TensorFlow has no GPU kernel for the one, and takes
    # the other's input in host memory): there it is one XLA computation.
    # This machine has no GPU: the device check is stubbed, and the compiled
    # record, here run by XLA on the CPU, must be the same record.
    monkeypatch.setattr(stats, "_xla_gpu_visible", lambda: True)
    static = tf.function(lambda v: stats.tensor_stats(v, "x"))
    dynamic = tf.function(lambda v: stats.tensor_stats(v, "x"), input_signature=[tf.TensorSpec([None], dtype)])
    # Inside a compiled step (Keras' default on a GPU) it is part of the step's computation.
    nested = tf.function(lambda v: stats.tensor_stats(v, "x"), jit_compile=True)
    tiny = metadata.smallest_normal(dtype)
    cases = {**_side_cases(dtype), "nonfinite": [np.nan, np.inf, -np.inf, 0.0, tiny / 4, 2.0]}
    for fn in (static, dynamic, nested):
        _assert_each_case(lambda t, case: fn(t), dtype, cases)
    t = _as_tf(np.array([1.0, 0.0]), dtype)
    assert set(_record_calls(static.get_concrete_function(t).graph)) == {True}
    # A size unknown when tracing (float32: both counting variants, in the branches of a cond).
    assert set(_record_calls(dynamic.get_concrete_function().graph)) == {True}


def _cuda_or_rocm_gpu_listed() -> bool:
    """What TensorFlow itself says: a GPU of a CUDA or ROCm build is visible."""
    built = tf.test.is_built_with_cuda() or tf.test.is_built_with_rocm()
    return built and bool(tf.config.list_physical_devices("GPU"))


def test_record_is_not_compiled_on_a_cpu(monkeypatch, record_way):
    # XLA's reductions cost a CPU about twice TensorFlow's. The device check
    # follows TensorFlow's device list (on this CPU machine: none), so the
    # test holds on a CUDA host too; there the CPU case is the stubbed one.
    assert stats._xla_gpu_visible() == _cuda_or_rocm_gpu_listed()
    monkeypatch.setattr(stats, "_xla_gpu_visible", lambda: False)
    fn = tf.function(lambda v: stats.tensor_stats(v, "x"))
    graph = fn.get_concrete_function(tf.zeros([3])).graph
    if record_way == "kernel":
        # One op, no function call to compile or to instantiate.
        assert _record_calls(graph) == [] and [op.type for op in graph.get_operations()].count("TbnRecord") == 1
    else:
        assert _record_calls(graph) == [False]
