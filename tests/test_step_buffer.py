"""A traced step's log_numerics records: packed, one write, nothing lost that matters."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf
from tensorboard.compat.proto import event_pb2

import tb_numerics as tbn
from tb_numerics import _tf_internal, event_reader, metadata, packed, stats
from tb_numerics.records import numpy_stats

pytestmark = pytest.mark.e2e

F = metadata.FIELD_INDEX
TAGS = ["layer_%d/output" % i for i in range(5)]


def read(logdir):
    """tag -> (steps, records) of the one run in ``logdir``, read as it is now."""
    runs = event_reader.read_logdir(str(logdir))
    if not runs:
        return {}
    assert runs[0].problems == []
    return {s.tag: (s.steps.tolist(), np.asarray(s.values, np.float64)) for s in runs[0].series}


def events(logdir):
    out = []
    for name in sorted(os.listdir(logdir)):
        for rec in tf.data.TFRecordDataset(os.path.join(logdir, name)):
            e = event_pb2.Event.FromString(rec.numpy())
            if e.summary.value:
                out.append(e)
    return out


def make_step(n_tags=len(TAGS)):
    """A traced step logging ``n_tags`` small tensors; NaN in the last where asked."""
    @tf.function
    def step(x, nan):
        h = x
        for tag in TAGS[:n_tags]:
            h = tf.tanh(h) + 0.5
            tbn.log_numerics(tag, h)
        tbn.log_numerics("loss", tf.reduce_sum(h) * tf.where(nan, np.nan, 1.0))

    return step


X = tf.constant(np.linspace(-1, 1, 64, dtype=np.float32))


def test_steps_are_packed_in_one_event_and_match_the_reference(tmp_path):
    writer = tf.summary.create_file_writer(str(tmp_path))
    step, counter = make_step(), tf.Variable(0, dtype=tf.int64)
    with writer.as_default(step=counter):
        for _ in range(10):
            step(X, tf.constant(False))
            counter.assign_add(1)
    writer.close()
    evs = events(tmp_path)
    assert len(evs) == 1 and packed.is_block_tag(evs[0].summary.value[0].tag)
    recs = read(tmp_path)
    assert list(recs) == TAGS + ["loss"]
    h = X
    for tag in TAGS:
        h = tf.tanh(h) + 0.5
        steps, values = recs[tag]
        assert steps == list(range(10))
        want = numpy_stats(h.numpy())
        exact = [F[f] for f in metadata.FIELDS if f not in ("sum", "sum_sq")]
        np.testing.assert_array_equal(values[3, exact], want[exact])
        np.testing.assert_allclose(values[3], want, rtol=1e-5)
    # float32 rows, 13 numbers each, and the table once per event.
    assert os.path.getsize(os.path.join(tmp_path, os.listdir(tmp_path)[0])) < 60 * 60 + 2000


def test_a_nan_step_is_on_disk_at_once_healthy_steps_wait_until_flush(tmp_path):
    writer = tf.summary.create_file_writer(str(tmp_path))
    step, counter = make_step(), tf.Variable(0, dtype=tf.int64)
    with writer.as_default(step=counter):
        for s in range(3):
            step(X, tf.constant(False))
            counter.assign_add(1)
        assert read(tmp_path) == {}  # waiting in memory
        step(X, tf.constant(True))
        counter.assign_add(1)
        assert read(tmp_path)["loss"][0] == [0, 1, 2, 3]  # the NaN step and those before it
        step(X, tf.constant(False))
        writer.flush()
        assert read(tmp_path)["loss"][0] == [0, 1, 2, 3, 4]
        step(X, tf.constant(False))
    writer.close()
    assert read(tmp_path)["loss"][0] == [0, 1, 2, 3, 4, 4]


def test_steps_wait_at_most_two_seconds(tmp_path, monkeypatch):
    # The buffer's clock, injected (a variable the traced step reads where it
    # would read tf.timestamp): the two seconds pass without a sleep.
    clock = tf.Variable(1_000.0, dtype=tf.float64)
    monkeypatch.setattr(_tf_internal, "wall_clock", clock.read_value)
    writer = tf.summary.create_file_writer(str(tmp_path))
    step, counter = make_step(), tf.Variable(0, dtype=tf.int64)
    with writer.as_default(step=counter):
        step(X, tf.constant(False))
        counter.assign_add(1)
        assert read(tmp_path) == {}  # waiting in memory
        clock.assign_add(packed.MAX_DELAY_S + 0.1)
        step(X, tf.constant(False))
        assert read(tmp_path)["loss"][0] == [0, 1]
        writer.close()


def test_fifty_steps_make_an_event(tmp_path):
    writer = tf.summary.create_file_writer(str(tmp_path))
    step, counter = make_step(1), tf.Variable(0, dtype=tf.int64)
    with writer.as_default(step=counter):
        for _ in range(packed.STEPS_PER_EVENT + 1):
            step(X, tf.constant(False))
            counter.assign_add(1)
        assert read(tmp_path)["loss"][0] == list(range(packed.STEPS_PER_EVENT))
    writer.close()
    assert [len(e.summary.value[0].tensor.tensor_shape.dim) for e in events(tmp_path)] == [2, 2]


_CHILD = """
import os, signal, sys
import numpy as np, tensorflow as tf
import tb_numerics as tbn
writer = tf.summary.create_file_writer(sys.argv[1])
counter = tf.Variable(0, dtype=tf.int64)

@tf.function
def step(nan):
    tbn.log_numerics("dense/output", tf.ones([8]) * tf.where(nan, np.nan, 1.0))
    tbn.log_numerics("loss", tf.constant(0.5))

with writer.as_default(step=counter):
    for s in range(6):
        step(tf.constant(s == 4))
        counter.assign_add(1)
        if s == 4 and sys.argv[2] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)  # right after the NaN step
    if sys.argv[2] == "flush":
        writer.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    # "exit": leave without closing the writer
    os._exit(0) if sys.argv[2] == "hard-exit" else sys.exit(0)
"""


@pytest.mark.parametrize("how,steps", [("kill", [0, 1, 2, 3, 4]), ("flush", [0, 1, 2, 3, 4, 5]), ("exit", [0, 1, 2, 3, 4, 5])])
def test_process_end(tmp_path, how, steps):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(_CHILD), str(tmp_path), how],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == (-9 if how in ("kill", "flush") else 0), out.stderr[-2000:]
    recs = read(tmp_path)
    assert recs["dense/output"][0] == steps
    assert recs["dense/output"][1][4, F["nan"]] == 8


def test_a_retrace_that_adds_tags_starts_a_new_block(tmp_path):
    writer = tf.summary.create_file_writer(str(tmp_path))
    counter = tf.Variable(0, dtype=tf.int64)

    @tf.function
    def step(x):
        tbn.log_numerics("a", x)
        if x.shape[0] == 3:  # a retrace with another shape logs one more tensor
            tbn.log_numerics("b", x * 2)

    with writer.as_default(step=counter):
        for s in range(4):
            step(tf.ones([2 if s < 2 else 3]))
            counter.assign_add(1)
            if s == 1:
                writer.flush()  # block 0 is on disk, with a table of "a" alone
    writer.close()
    recs = read(tmp_path)
    assert recs["a"][0] == [0, 1, 2, 3] and recs["b"][0] == [2, 3]
    blocks = {e.summary.value[0].tag for e in events(tmp_path)}
    assert len(blocks) == 2


def test_many_stats_agrees_with_the_reference():
    rng = np.random.default_rng(0)
    arrays = [
        rng.standard_normal(64).astype(np.float32),
        np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, -1e-39, 3e38, -2.0], np.float32),
        np.array([], np.float32),
        np.array([np.nan, np.nan], np.float32),
        np.array([600.0, -65504.0, 1e-6, 0.0], np.float16),
        rng.standard_normal((3, 4)),
        np.array([1e-310, -np.inf, 5e300], np.float64),
        np.array([-1.0, -3.0], np.float32),
    ]
    tensors = [tf.constant(a) for a in arrays]
    dtypes = [stats.check_dtype(t, "x") for t in tensors]
    for got in (stats.many_stats(tensors, dtypes), tf.function(stats.many_stats)(tensors, dtypes)):
        for a, d, row in zip(arrays, dtypes, got.numpy()):
            with np.errstate(over="ignore"):
                want = numpy_stats(a, d)
            exact = [F[f] for f in metadata.FIELDS if f not in ("sum", "sum_sq")]
            np.testing.assert_array_equal(row[exact], want[exact], err_msg=str(a))
            np.testing.assert_allclose(row, want, rtol=1e-6, atol=1e-30, err_msg=str(a))


def test_sq_norms_agree_with_numpy():
    # The update ratios' squared norms: small tensors by segment, a large one
    # (over SMALL_TENSOR elements) by its own dot product, in the given order.
    rng = np.random.default_rng(1)
    arrays = [
        rng.standard_normal(5000).astype(np.float32),
        rng.standard_normal(64).astype(np.float32),
        np.array([], np.float32),
        np.array([600.0, -3.5], np.float16),
        rng.standard_normal((3, 4)),
    ]
    tensors = [tf.constant(a) for a in arrays]
    want = [np.square(a.astype(np.float64)).sum() for a in arrays]
    for fn in (stats.sq_norms, tf.function(stats.sq_norms)):
        np.testing.assert_allclose(fn(tensors).numpy(), want, rtol=1e-5)
    inf, nan = stats.sq_norms([tf.constant([1.0, np.inf]), tf.constant([np.nan])]).numpy()
    assert inf == np.inf and np.isnan(nan)


def test_events_after_a_damaged_first_event_are_still_read(tmp_path):
    writer = tf.summary.create_file_writer(str(tmp_path))
    step, counter = make_step(2), tf.Variable(0, dtype=tf.int64)
    with writer.as_default(step=counter):
        for s in range(6):
            step(X, tf.constant(s == 4))
            counter.assign_add(1)
            writer.flush()  # an event per step
    writer.close()
    (path,) = [os.path.join(tmp_path, f) for f in os.listdir(tmp_path)]
    data = bytearray(open(path, "rb").read())
    offset = 16 + int.from_bytes(data[:8], "little")  # past the file-version event
    data[offset + 40] ^= 0xFF  # the first packed event fails its checksum
    open(path, "wb").write(bytes(data))
    runs = event_reader.read_logdir(str(tmp_path))
    series = {s.tag: s for s in runs[0].series}
    assert series["loss"].steps.tolist() == [1, 2, 3, 4, 5]
    assert series["loss"].info.role == "loss"
    assert series["loss"].values[3, F["nan"]] == 1


def test_eager_steps_are_packed_and_a_nan_step_is_on_disk_at_once(tmp_path):
    writer = tf.summary.create_file_writer(str(tmp_path))
    counter = tf.Variable(0, dtype=tf.int64)
    with writer.as_default(step=counter):
        for s in range(5):
            tbn.log_numerics("dense/output", X * float(s))
            tbn.log_numerics("loss", tf.constant(np.nan if s == 2 else 0.5))
            counter.assign_add(1)
            if s == 2:
                assert read(tmp_path)["loss"][0] == [0, 1, 2]
    writer.close()
    recs = read(tmp_path)
    assert recs["dense/output"][0] == recs["loss"][0] == [0, 1, 2, 3, 4]
    assert recs["loss"][1][2, F["nan"]] == 1
    assert recs["dense/output"][1][4, F["max"]] == 4.0
    assert len(events(tmp_path)) == 2  # steps 0-2 at the NaN, 3-4 on close


def test_a_whole_loop_in_one_function_is_packed_and_a_nan_step_is_on_disk_at_once(tmp_path, monkeypatch):
    # The buffer's clock stands still: on a loaded machine the loop's first
    # six iterations took over packed.MAX_DELAY_S and were written by the
    # two-second rule, which is not what this test is about.
    monkeypatch.setattr(_tf_internal, "wall_clock", tf.Variable(1_000.0, dtype=tf.float64).read_value)
    on_disk = []  # (iteration, the loss steps on disk) as the loop runs

    def look(i):
        if int(i) in (6, 8):  # before the NaN step, and the iteration after it
            on_disk.append((int(i), read(tmp_path).get("loss", ([],))[0]))
        return np.int64(0)

    @tf.function
    def train(n):
        for i in tf.range(n, dtype=tf.int64):  # TPU-style: the steps' loop in one tf.function
            h = X
            for tag in TAGS:
                h = tf.tanh(h) + 0.5
                tbn.log_numerics(tag, h, step=i)
            tbn.log_numerics("loss", tf.reduce_sum(h) * tf.where(tf.equal(i, 7), np.nan, 1.0), step=i)
            tf.numpy_function(look, [i], tf.int64, stateful=True)

    writer = tf.summary.create_file_writer(str(tmp_path))
    with writer.as_default():
        train(tf.constant(12, tf.int64))
    writer.close()
    # The NaN step is on disk before the next iteration (whose inputs wait for it) starts.
    assert on_disk == [(6, []), (8, list(range(8)))]
    evs = events(tmp_path)  # steps 0-7, written at the NaN; 8-11 at close
    assert len(evs) == 2 and all(packed.is_block_tag(e.summary.value[0].tag) for e in evs)
    recs = read(tmp_path)
    h = X
    for tag in TAGS:
        h = tf.tanh(h) + 0.5
        steps, values = recs[tag]
        assert steps == list(range(12))
        np.testing.assert_allclose(values[3], numpy_stats(h.numpy()), rtol=1e-5)
    assert recs["loss"][1][7, F["nan"]] == 1 and recs["loss"][1][:, F["nan"]].sum() == 1
