"""log_numerics / log_gradients / write_stats write what a user reads back."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from tensorboard.compat.proto import event_pb2, summary_pb2

import tb_numerics as tbn
from tb_numerics import cli, event_reader, metadata, records, stats, summary
from tb_numerics.records import numpy_stats

import step_oracle
import two_replicas

pytestmark = pytest.mark.e2e

F = metadata.FIELD_INDEX


def read(logdir):
    """tag -> (TensorInfo, steps, records) of the single run in ``logdir``."""
    runs = event_reader.read_logdir(logdir)
    assert len(runs) == 1, runs
    assert runs[0].problems == []
    return {s.tag: (s.info, s.steps.tolist(), s.values) for s in runs[0].series}


def report(logdir, problems_expected=False):
    summaries, problems = cli.report(str(logdir), cli.analysis.SafeRange())
    assert bool(problems) == problems_expected, problems
    return summaries[0]


def raw_events(logdir):
    out = []
    for name in sorted(os.listdir(logdir)):
        for rec in tf.data.TFRecordDataset(os.path.join(logdir, name)):
            out.append(rec.numpy())
    return out


def _activations(seed=0):
    rng = np.random.default_rng(seed)
    h = np.maximum(rng.standard_normal((8, 16)), 0).astype(np.float32)
    h[0, 0] = np.nan
    return h


def _step_body(h, loss, grads, variables):
    tbn.log_numerics("dense1/output", h)
    tbn.log_numerics("model/total_loss", loss)
    return tbn.log_gradients(grads, variables)


def _variables():
    return [tf.Variable(tf.zeros([16, 4]), name="dense1/kernel"), tf.Variable(tf.zeros([4]), name="dense1/bias")]


def test_eager_and_function_write_the_same_records_in_execution_order(tmp_path):
    h = tf.constant(_activations())
    loss = tf.constant(0.25)
    variables = _variables()
    grads = [tf.constant(np.linspace(-1, 1, 64, dtype=np.float32).reshape(16, 4)), tf.constant([1.0, np.inf, 0.0, 2.0])]

    fn = tf.function(_step_body)
    results = {}
    for mode in ("eager", "function"):
        writer = tf.summary.create_file_writer(str(tmp_path / mode))
        with writer.as_default(step=3):
            body = _step_body if mode == "eager" else fn
            assert bool(body(h, loss, grads, variables))
        writer.close()
        results[mode] = read(tmp_path / mode)

    eager, graph = results["eager"], results["function"]
    assert eager.keys() == graph.keys()
    for tag in eager:
        assert eager[tag][0] == graph[tag][0], tag
        assert eager[tag][1] == graph[tag][1] == [3]
        # Counts, min and max exactly; sums to the accumulation precision.
        exact = [F[f] for f in metadata.FIELDS if f not in ("sum", "sum_sq")]
        np.testing.assert_array_equal(eager[tag][2][:, exact], graph[tag][2][:, exact])
        np.testing.assert_allclose(eager[tag][2], graph[tag][2], rtol=1e-6, atol=1e-5)

    infos = {tag: v[0] for tag, v in graph.items()}
    # Forward calls first, then the gradients in backward order, then the norm.
    order = sorted(infos, key=lambda t: infos[t].order)
    assert order == [
        "dense1/output",
        "model/total_loss",
        "gradients/dense1/bias",
        "gradients/dense1/kernel",
        "gradients/global_norm",
    ]
    assert [infos[t].role for t in order] == ["activation", "loss", "gradient", "gradient", "global_norm"]
    assert infos["dense1/output"].shape == (8, 16) and infos["dense1/output"].dtype == "float32"
    assert infos["dense1/output"].op_type == ""
    rec = graph["dense1/output"][2][0]
    np.testing.assert_array_equal(rec[[F[f] for f in ("count", "nan", "zeros")]],
                                  numpy_stats(_activations())[[F[f] for f in ("count", "nan", "zeros")]])
    # The global norm is non-finite because one gradient element is +Inf.
    norm = graph["gradients/global_norm"][2][0]
    assert norm[F["posinf"]] == 1 and norm[F["count"]] == 1


def test_global_norm_matches_tf_linalg_global_norm(tmp_path):
    rng = np.random.default_rng(2)
    grads = [tf.constant(rng.standard_normal((5, 3)).astype(np.float32)), tf.constant(rng.standard_normal(3).astype(np.float32))]
    writer = tf.summary.create_file_writer(str(tmp_path))
    with writer.as_default(step=0):
        tbn.log_gradients(grads, _variables()[:1] + [tf.Variable(tf.zeros([3]), name="b")])
    writer.close()
    norm = read(tmp_path)["gradients/global_norm"][2][0]
    np.testing.assert_allclose(norm[F["max"]], tf.linalg.global_norm(grads).numpy(), rtol=1e-6)
    assert norm[F["min"]] == norm[F["max"]]


def test_none_and_indexed_slices_gradients(tmp_path):
    variables = [tf.Variable(tf.zeros([10, 3]), name="emb"), tf.Variable(tf.zeros([3]), name="unused")]
    values = np.array([[1.0, 0.0, -2.0], [np.nan, 3.0, 4.0]], np.float32)
    sliced = tf.IndexedSlices(tf.constant(values), tf.constant([1, 7]), tf.constant([10, 3]))

    @tf.function
    def step():
        return tbn.log_gradients([sliced, None], variables)

    writer = tf.summary.create_file_writer(str(tmp_path))
    with writer.as_default(step=5):
        assert bool(step())
    writer.close()
    recs = read(tmp_path)
    assert set(recs) == {"gradients/emb", "gradients/global_norm"}
    got = recs["gradients/emb"][2][0]
    np.testing.assert_array_equal(got[[F["count"], F["nan"], F["zeros"]]], [6, 1, 1])
    # A NaN in any gradient makes the global norm NaN, as tf.linalg.global_norm.
    assert recs["gradients/global_norm"][2][0][F["nan"]] == 1


def test_log_gradients_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="2 gradients for 1 variables"):
        tbn.log_gradients([tf.ones(2), tf.ones(2)], [tf.Variable(tf.ones(2))])


def test_keras_variable_path_names_the_gradient(tmp_path):
    import keras

    layer = keras.layers.Dense(2, name="head")
    layer.build((None, 3))
    writer = tf.summary.create_file_writer(str(tmp_path))
    with writer.as_default(step=0):
        tbn.log_gradients([tf.ones([3, 2]), tf.ones([2])], layer.trainable_variables)
    writer.close()
    assert {"gradients/head/kernel", "gradients/head/bias"} <= set(read(tmp_path))


def test_type_error_names_the_tensor_and_role_is_validated(tmp_path):
    writer = tf.summary.create_file_writer(str(tmp_path))
    with writer.as_default(step=0):
        with pytest.raises(TypeError, match="'labels'.*int32"):
            tbn.log_numerics("labels", tf.constant([1, 2]))
        with pytest.raises(ValueError, match="role must be one of"):
            tbn.log_numerics("x", tf.ones(2), role="bogus")
        assert bool(tbn.log_numerics("x", tf.ones(2), role="weight"))
    writer.close()
    assert read(tmp_path)["x"][0].role == "weight"


def test_without_writer_or_under_record_if_false_nothing_is_written(tmp_path):
    assert not bool(tbn.log_numerics("x", tf.ones(3), step=0))
    writer = tf.summary.create_file_writer(str(tmp_path))

    @tf.function
    def step(x, record):
        with tf.summary.record_if(record):
            return tbn.log_numerics("x", x)

    with writer.as_default(step=1):
        with tf.summary.record_if(False):
            assert not bool(tbn.log_numerics("x", tf.ones(3)))
        assert not bool(step(tf.ones(3), tf.constant(False)))
        assert bool(step(tf.ones(3), tf.constant(True)))
    writer.close()
    assert read(tmp_path)["x"][1] == [1]


def test_full_metadata_in_first_event_compact_in_later_ones_and_bytes_per_record(tmp_path):
    # every_n_steps writes a record per event (other calls are packed).
    writer = tf.summary.create_file_writer(str(tmp_path))
    x = tf.constant(np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32))
    counter = tf.Variable(0, dtype=tf.int64)
    with writer.as_default(step=counter):
        for s in range(20):
            tbn.log_numerics("dense3/output", x, allow_neginf=True, every_n_steps=1)
            counter.assign_add(1)
    writer.close()
    events = [event_pb2.Event.FromString(r) for r in raw_events(tmp_path)]
    values = [v for e in events for v in e.summary.value]
    assert len(values) == 20
    # Every record names the plugin and the tensor class, so each is
    # recognisable on its own; only the first has the whole TensorInfo.
    assert all(v.metadata.plugin_data.plugin_name == "numerics" for v in values)
    assert all(v.metadata.data_class == summary_pb2.DATA_CLASS_TENSOR for v in values)
    first = metadata.parse_plugin_metadata(values[0].metadata.plugin_data.content)
    assert first.shape == (64, 64) and first.neginf_ok and first.role == "activation"
    later = [metadata.parse_plugin_metadata(v.metadata.plugin_data.content) for v in values[1:]]
    assert {(i.dtype, i.role, i.order, i.neginf_ok, i.shape) for i in later} == {("float32", "activation", 0, True, None)}
    sizes = [len(r) + 16 for r in raw_events(tmp_path)]  # + TFRecord framing
    # 13-character tag: 146 bytes per record without metadata, 98 more for
    # the compact metadata (of which 17 for "neginf_ok").
    assert max(sizes[2:]) <= 244, sizes
    assert read(tmp_path)["dense3/output"][1] == list(range(20))


def test_records_after_a_damaged_first_event_are_still_read(tmp_path):
    writer = tf.summary.create_file_writer(str(tmp_path))
    counter = tf.Variable(0, dtype=tf.int64)
    with writer.as_default(step=counter):
        for s in range(10):  # every_n_steps: a record per event
            tbn.log_numerics("dense/output", tf.constant([1.0, np.nan if s == 7 else 2.0]), every_n_steps=1)
            tbn.log_numerics("model/loss", tf.constant(0.5), every_n_steps=1)
            counter.assign_add(1)
    writer.close()
    (path,) = [os.path.join(tmp_path, f) for f in os.listdir(tmp_path)]
    data = bytearray(open(path, "rb").read())
    # Past the file-version event, to the tag's first record.
    offset = 16 + int.from_bytes(data[:8], "little")
    data[offset + 40] ^= 0xFF  # inside the data: its checksum fails
    open(path, "wb").write(bytes(data))
    runs = event_reader.read_logdir(str(tmp_path))
    series = {s.tag: s for s in runs[0].series}
    assert series["dense/output"].steps.tolist() == list(range(1, 10))
    assert series["dense/output"].info.role == "activation"
    s = report(tmp_path, problems_expected=True)
    assert (s["first_anomaly"]["step"], s["first_anomaly"]["tensor"]) == (7, "dense/output")


def test_write_stats_writes_precomputed_stats(tmp_path):
    @tf.function(jit_compile=True)
    def compiled(x):
        return stats.tensor_stats(x * 2.0, "y")

    x = tf.constant([1.0, -3.0, 0.0])
    writer = tf.summary.create_file_writer(str(tmp_path))
    with writer.as_default(step=9):
        vec = compiled(x)
        info = metadata.TensorInfo(dtype="float32", shape=(3,), role="other", op_type="Mul")
        assert bool(summary.write_stats("y", vec, info=info))
    writer.close()
    got = read(tmp_path)["y"]
    assert got[0].op_type == "Mul" and got[0].role == "other" and got[1] == [9]
    np.testing.assert_array_equal(got[2][0], numpy_stats(np.array([2.0, -6.0, 0.0], np.float32)))


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "function"])
def test_every_n_steps_still_records_first_nonfinite_step_and_the_step_before(tmp_path, graph):
    w = tf.Variable(tf.ones([4]))
    bad = tf.Variable(False)

    def body(step):
        h = w * tf.where(bad, np.nan, 1.0)
        tbn.log_numerics("layer/output", h, step=step, every_n_steps=100)
        tbn.log_numerics("layer/healthy", w, step=step, every_n_steps=100)

    fn = tf.function(body) if graph else body
    writer = tf.summary.create_file_writer(str(tmp_path))
    steps = range(1000) if graph else list(range(700)[::100]) + list(range(700, 1000))
    with writer.as_default():
        for s in steps:
            bad.assign(s >= 777)
            fn(tf.constant(s, tf.int64))
    writer.close()
    recs = read(tmp_path)
    assert recs["layer/output"][1] == [0, 100, 200, 300, 400, 500, 600, 700, 776, 777, 800, 900]
    assert recs["layer/healthy"][1] == list(range(0, 1000, 100))
    s = report(tmp_path)
    assert s["first_anomaly"]["step"] == 777
    assert s["first_anomaly"]["tensor"] == "layer/output"
    assert s["first_anomaly"]["last_healthy_step"] == 776
    # The CLI says the same.
    out = subprocess.run(
        [sys.executable, "-m", "tb_numerics.cli", "report", str(tmp_path), "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 1, out.stderr
    anomaly = json.loads(out.stdout)["runs"][0]["first_anomaly"]
    assert (anomaly["step"], anomaly["last_healthy_step"], anomaly["tensor"]) == (777, 776, "layer/output")


_DISTRIBUTED = """
    import tb_numerics as tbn
    from tb_numerics import event_reader
    from tb_numerics.records import numpy_stats

    rng = np.random.default_rng(0)
    parts = [rng.standard_normal((4, 2)).astype(np.float32) for _ in range(2)]
    parts[1][2, 1] = np.nan       # only on replica 1
    parts[1][0, 0] = 0.0
    parts[0][1, 1] = 1e-40        # an underflow on replica 0
    with strategy.scope():
        v = tf.Variable(tf.ones([2]), name="v")
    writer = tf.summary.create_file_writer(sys.argv[1])

    def replica_fn():
        ctx = tf.distribute.get_replica_context()
        x = tf.where(tf.equal(ctx.replica_id_in_sync_group, 0), parts[0], parts[1])
        tbn.log_numerics("h", x)
        return tbn.log_gradients([x[0]], [v])

    @tf.function
    def step():
        return strategy.run(replica_fn)

    with writer.as_default(step=0):
        step()
    writer.close()
    runs = event_reader.read_logdir(sys.argv[1])
    got = {s.tag: (s.steps.tolist(), s.values.tolist()) for s in runs[0].series}
    want = {
        "h": numpy_stats(np.concatenate([p.reshape(-1) for p in parts])).tolist(),
        "gradients/v": numpy_stats(np.concatenate([p[0] for p in parts])).tolist(),
    }

    # A tf.Variable step incremented after strategy.run, with tf.summary's
    # own scalar beside the call as the oracle of the step (step_oracle).
    counter = tf.Variable(0, dtype=tf.int64)
    steps_writer = tf.summary.create_file_writer(sys.argv[1] + "/steps")

    def stepped(x):
        tbn.log_numerics("t", x, step=counter)
        tf.summary.scalar("oracle", tf.reduce_max(x), step=counter)

    @tf.function
    def counted_step(x):
        strategy.run(stepped, (x,))
        counter.assign_add(1)

    with steps_writer.as_default():
        for i in range(3):
            counted_step(strategy.experimental_distribute_values_from_function(
                lambda ctx: tf.constant([float(i), -1.0 - ctx.replica_id_in_sync_group])))
    steps_writer.close()
    print(json.dumps({"got": got, "want": want}))
    """


def test_mirrored_strategy_combines_replicas_into_one_record(tmp_path):
    res = two_replicas.run(_DISTRIBUTED, str(tmp_path))
    step_oracle.assert_steps_agree(str(tmp_path / "steps"))
    for tag in ("h", "gradients/v"):
        steps, values = res["got"][tag]
        assert steps == [0], (tag, steps)  # one record, not one per replica
        got, want = np.array(values[0]), np.array(res["want"][tag])
        counts = [F[f] for f in ("count", "nan", "posinf", "neginf", "zeros", "overflow", "underflow")]
        np.testing.assert_array_equal(got[counts], want[counts], err_msg=tag)
        np.testing.assert_array_equal(got[[F["min"], F["max"]]], want[[F["min"], F["max"]]], err_msg=tag)
        np.testing.assert_allclose(got[[F["sum"], F["sum_sq"]]], want[[F["sum"], F["sum_sq"]]], rtol=1e-5)
    assert np.array(res["got"]["h"][1][0])[F["nan"]] == 1
    assert np.array(res["got"]["h"][1][0])[F["count"]] == 16


def cli_json(logdir, *flags):
    """``tb-numerics report --json [FLAGS] LOGDIR``, run in-process: (exit status, runs)."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = cli.main(["report", "--json", *flags, str(logdir)])
    return status, json.loads(out.getvalue())["runs"]


def _mask(step):
    """An attention mask: -Inf intended in every step; a NaN at step 3."""
    m = np.array([0.0, -np.inf, 0.5, -np.inf], np.float32)
    if step == 3:
        m[2] = np.nan
    return m


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "function"])
def test_intended_neginf_is_not_the_latchs_first_nonfinite_step(tmp_path, graph):
    def body(x, step):
        return tbn.log_numerics("attn/mask", x, step=step, every_n_steps=5, allow_neginf=True)

    fn = tf.function(body) if graph else body
    writer = tf.summary.create_file_writer(str(tmp_path))
    with writer.as_default():
        for s in range(12):
            fn(tf.constant(_mask(s)), tf.constant(s, tf.int64))
    writer.close()
    info, steps, values = read(tmp_path)["attn/mask"]
    assert info.neginf_ok  # in the run: every reader applies it
    # The NaN at step 3 is the latch's first non-finite step: written with
    # the step before it, whatever N is.
    assert steps == [0, 2, 3, 5, 10]
    bad = records.nonfinite_count(np.asarray(values), info.neginf_ok) > 0
    assert [s for s, b in zip(steps, bad) if b] == [3]


def test_a_new_kind_of_nonfinite_value_is_written_whatever_n(tmp_path):
    # -Inf that only the CLI is told about (--allow-neginf), a NaN at step 3, +Inf at step 7.
    @tf.function
    def body(x, step):
        return tbn.log_numerics("attn/mask", x, step=step, every_n_steps=5)

    writer = tf.summary.create_file_writer(str(tmp_path))
    with writer.as_default():
        for s in range(12):
            m = _mask(s)
            m[0] = np.inf if s == 7 else 0.0
            body(tf.constant(m), tf.constant(s, tf.int64))
    writer.close()
    _, steps, _ = read(tmp_path)["attn/mask"]
    assert steps == [0, 2, 3, 5, 6, 7, 10]  # each new kind with the step before it
    status, runs = cli_json(tmp_path, "--allow-neginf", "attn/*")
    a = runs[0]["first_anomaly"]
    assert status == 1 and (a["step"], a["nan"], a["last_healthy_step"]) == (3, 1, 2)


def test_write_stats_latch_applies_the_infos_intended_neginf(tmp_path):
    info = metadata.TensorInfo(dtype="float32", shape=(4,), role="activation", neginf_ok=True)
    writer = tf.summary.create_file_writer(str(tmp_path))
    with writer.as_default():
        for s in range(8):
            summary.write_stats("mask", numpy_stats(_mask(s)), step=s, info=info, every_n_steps=4)
    writer.close()
    got_info, steps, _ = read(tmp_path)["mask"]
    assert got_info.neginf_ok and steps == [0, 2, 3, 4]


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "function"])
def test_every_record_of_a_tag_logged_twice_in_a_step_reaches_the_report(tmp_path, graph):
    # Two micro-batches per step under one tag; -Inf in the first of step 4.
    def body(a, b, step):
        tbn.log_numerics("accum/grad", a, step=step)
        tbn.log_numerics("accum/grad", b, step=step)
        return tbn.log_numerics("accum/grad", b * 2.0, step=step) if not graph else tf.constant(True)

    fn = tf.function(body) if graph else body
    writer = tf.summary.create_file_writer(str(tmp_path))
    with writer.as_default():
        for s in range(6):
            a = np.full(3, 1.0 + s, np.float32)
            if s == 4:
                a[1] = -np.inf
            fn(tf.constant(a), tf.constant(np.full(3, -1.0 - s, np.float32)), tf.constant(s, tf.int64))
    writer.close()
    per_step = 2 if graph else 3
    _, steps, values = read(tmp_path)["accum/grad"]
    assert steps == [s for s in range(6) for _ in range(per_step)]
    # The records of a step are in the order they were logged.
    np.testing.assert_array_equal(np.asarray(values)[::per_step, F["max"]], [1, 2, 3, 4, 5, 6])
    assert np.asarray(values)[4 * per_step, F["neginf"]] == 1
    status, runs = cli_json(tmp_path)
    assert status == 1
    assert (runs[0]["first_anomaly"]["step"], runs[0]["first_anomaly"]["neginf"]) == (4, 1)


@pytest.mark.parametrize("every_n", [None, 1], ids=["packed", "per-record"])
def test_repeated_records_of_a_step_survive_in_real_tensorboard(served_logdir, every_n):
    from tb_process import wait_for

    tb, logdir = served_logdir  # one tensorboard per loader for the module
    run = "packed" if every_n is None else "per-record"
    writer = tf.summary.create_file_writer(str(logdir / run))

    @tf.function
    def step(a, b):
        tbn.log_numerics("accum/grad", a, every_n_steps=every_n)
        tbn.log_numerics("accum/grad", b, every_n_steps=every_n)

    counter = tf.Variable(0, dtype=tf.int64)
    with writer.as_default(step=counter):
        for s in range(5):
            a = np.full(3, 1.0, np.float32)
            if s == 3:
                a[0] = -np.inf  # only in the first micro-batch
            step(tf.constant(a), tf.constant(np.full(3, 2.0, np.float32)))
            counter.assign_add(1)
    writer.close()
    got = wait_for(
        lambda: (s := tb.get_json("/data/plugin/numerics/summary?run=" + run))["records"] == 10
        and not s["stale"] and s,
        timeout=90,
    )
    assert got["first_anomaly"]["step"] == 3 and got["first_anomaly"]["neginf"] == 1
    series = tb.get_json("/data/plugin/numerics/series?run=%s&tensor=accum/grad" % run)
    assert series["steps"] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "function"])
def test_a_tensor_logged_after_the_gradients_is_in_the_update_phase(tmp_path, graph):
    variables = _variables()

    def body(h, grads, step):
        tbn.log_numerics("dense1/output", h, step=step)
        tbn.log_gradients(grads, variables, step=step)
        clipped = tf.linalg.global_norm(tf.clip_by_global_norm(grads, 1.0)[0])
        tbn.log_numerics("optimizer/clipped_norm", clipped, step=step)
        return tbn.log_numerics("optimizer/lr", tf.constant(0.1), step=step, role="other")

    fn = tf.function(body) if graph else body
    writer = tf.summary.create_file_writer(str(tmp_path))
    with writer.as_default():
        for s in range(3):
            g = np.ones([4], np.float32)
            if s == 2:
                g[0] = np.nan  # the gradient makes the clipped norm NaN
            grads = [tf.ones([16, 4]), tf.constant(g)]
            if s == 1:  # first logged in a later step, before its gradients: forward
                tbn.log_numerics("dense2/output", tf.ones(2), step=s)
            fn(tf.ones([2, 16]), grads, tf.constant(s, tf.int64))
    writer.close()
    infos = {tag: v[0] for tag, v in read(tmp_path).items()}
    assert infos["optimizer/clipped_norm"].role == "update"
    assert infos["optimizer/lr"].role == "other"  # a role passed is kept
    assert infos["dense1/output"].role == "activation"
    assert infos["dense2/output"].role == "activation"
    status, runs = cli_json(tmp_path)
    a = runs[0]["first_anomaly"]
    assert (status, a["step"], a["tensor"], a["phase"]) == (1, 2, "gradients/dense1/bias", "backward")


def test_finite_gradients_beyond_float32_make_a_finite_global_norm(tmp_path):
    variables = [tf.Variable(tf.zeros([1]), name="w%d" % i) for i in range(16)]
    grads = [tf.constant([1e38], tf.float32)] * 16
    writer = tf.summary.create_file_writer(str(tmp_path))
    with writer.as_default(step=0):
        tbn.log_gradients(grads, variables)
    writer.close()
    norm = read(tmp_path)["gradients/global_norm"][2][0]
    # sqrt(16) * 1e38 = 4e38: beyond float32, kept in float64, an overflow risk.
    np.testing.assert_allclose(norm[F["max"]], 4e38, rtol=1e-6)
    assert norm[F["posinf"]] == 0 and norm[F["overflow"]] == 1
    status, runs = cli_json(tmp_path)
    assert status == 0 and runs[0]["first_anomaly"] is None
    assert runs[0]["first_warning"]["kind"] == "overflow_risk"


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
def test_global_norm_record_in_tensorflow_and_numpy_agree(dtype):
    rng = np.random.default_rng(0)
    cases = {
        "healthy": [rng.standard_normal(5), rng.standard_normal(3)],
        "huge": [np.full(4, 1e38), np.full(12, 1e38)],
        "float16 margin": [np.full(4, 600.0)],
        "zero": [np.zeros(3)],
        "tiny": [np.full(2, 1e-20)],
        "nan": [np.array([1.0, np.nan]), np.full(2, np.inf)],
        "inf": [np.array([1.0, -np.inf])],
    }
    for name, parts in cases.items():
        recs = np.stack([numpy_stats(p.astype(np.float64)) for p in parts])
        want = records.global_norm_record(recs, dtype)
        got = summary.global_norm_record(tf.constant(recs), dtype).numpy()
        np.testing.assert_array_equal(got, want, err_msg=name)
