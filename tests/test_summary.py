"""log_numerics / log_gradients / write_stats write what a user reads back."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from tensorboard.compat.proto import event_pb2

import tb_numerics as tbn
from tb_numerics import cli, event_reader, metadata, stats, summary
from tb_numerics.records import numpy_stats

import two_replicas

F = metadata.FIELD_INDEX


def read(logdir):
    """tag -> (TensorInfo, steps, records) of the single run in ``logdir``."""
    runs = event_reader.read_logdir(logdir)
    assert len(runs) == 1, runs
    assert runs[0].problems == []
    return {s.tag: (s.info, s.steps.tolist(), s.values) for s in runs[0].series}


def report(logdir):
    summaries, problems = cli.report(str(logdir), cli.analysis.SafeRange())
    assert problems == []
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
        np.testing.assert_array_equal(eager[tag][2], graph[tag][2])

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


def test_metadata_only_in_first_event_and_bytes_per_record(tmp_path):
    writer = tf.summary.create_file_writer(str(tmp_path))

    @tf.function
    def step(x):
        return tbn.log_numerics("dense3/output", x)

    x = tf.constant(np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32))
    counter = tf.Variable(0, dtype=tf.int64)
    with writer.as_default(step=counter):
        for s in range(20):
            step(x) if s % 2 else tbn.log_numerics("dense3/output", x)
            counter.assign_add(1)
    writer.close()
    events = [event_pb2.Event.FromString(r) for r in raw_events(tmp_path)]
    values = [(e, e.summary.value[0]) for e in events if e.summary.value]
    assert len(values) == 20
    with_meta = [v.HasField("metadata") for _, v in values]
    assert with_meta == [True] + [False] * 19
    sizes = [len(r) + 16 for r in raw_events(tmp_path)]  # + TFRecord framing
    # 13-character tag: 146 bytes per record after the first.
    assert max(sizes[2:]) <= 150, sizes
    assert read(tmp_path)["dense3/output"][1] == list(range(20))


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
    print(json.dumps({"got": got, "want": want}))
    """


def test_mirrored_strategy_combines_replicas_into_one_record(tmp_path):
    res = two_replicas.run(_DISTRIBUTED, str(tmp_path))
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
