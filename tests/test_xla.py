"""jit_compile=True: statistics computed inside the compiled step, written outside, same records."""

import pytest
import keras
import numpy as np
import tensorflow as tf

import tb_numerics as tbn
from tb_numerics import event_reader, xla
from tb_numerics.keras import NumericsCallback

pytestmark = pytest.mark.e2e


def _series(logdir):
    (run,) = event_reader.read_logdir(str(logdir))
    return {s.tag: s for s in run.series}


def _assert_same_records(a, b):
    assert list(a) == list(b)
    for tag in a:
        assert a[tag].info.role == b[tag].info.role, tag
        assert a[tag].info.dtype == b[tag].info.dtype, tag
        np.testing.assert_array_equal(a[tag].steps, b[tag].steps)
        np.testing.assert_allclose(a[tag].values, b[tag].values, rtol=1e-5, atol=1e-6, err_msg=tag)


def _plain_api_run(logdir, jit):
    """Three steps of a small model logged with the plain API, compiled or not."""
    keras.utils.set_random_seed(3)
    dense, head = keras.layers.Dense(8, activation="tanh", name="dense"), keras.layers.Dense(2, name="head")
    dense.build((None, 4))
    head.build((None, 8))
    variables = dense.trainable_variables + head.trainable_variables
    opt = keras.optimizers.SGD(0.1)
    opt.build(variables)
    x = tf.constant(np.random.RandomState(0).randn(3, 16, 4), tf.float32)
    # A NaN at step 2. (tanh, not relu: oneDNN's fused MatMul+BiasAdd+Relu maps NaN
    # to 0 in an uncompiled tf.function on x86, see TRAPS.md.)
    x = tf.tensor_scatter_nd_update(x, [[2, 0, 1]], [np.nan])
    numerics = xla.CompiledStats()

    def forward_backward(xb):
        with tf.GradientTape() as tape:
            h = dense(xb)
            loss = tf.reduce_mean(tf.square(head(h)))
        grads = tape.gradient(loss, variables)
        opt.apply_gradients(zip(grads, variables))
        return h, loss, grads

    @tf.function(jit_compile=True)
    def compiled_step(xb):
        h, loss, grads = forward_backward(xb)
        records = numerics.collect({"dense/output": h, "loss": loss})
        records.update(numerics.collect_gradients(grads, variables))
        return records

    @tf.function
    def plain_step(xb):
        h, loss, grads = forward_backward(xb)
        tbn.log_numerics("dense/output", h)
        tbn.log_numerics("loss", loss)
        tbn.log_gradients(grads, variables)

    writer = tf.summary.create_file_writer(str(logdir))
    step_var = tf.Variable(0, dtype=tf.int64)
    with writer.as_default(step=step_var):
        for step in range(3):
            step_var.assign(step)
            if jit:
                assert numerics.write(compiled_step(x[step]), step=step)
            else:
                plain_step(x[step])
    writer.close()
    return _series(logdir)


def test_compiled_step_records_match_uncompiled_log_numerics(tmp_path):
    compiled = _plain_api_run(tmp_path / "jit", jit=True)
    plain = _plain_api_run(tmp_path / "plain", jit=False)
    _assert_same_records(compiled, plain)
    # The NaN injected at step 2 is there, not let through as check_numerics does under XLA.
    assert compiled["dense/output"].values[2, 1] > 0  # nan count
    assert compiled["gradients/global_norm"].info.role == "global_norm"


def _fit(logdir, jit):
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="relu", name="d1"), keras.layers.Dense(4, name="d2")],
        name="net",
    )
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", jit_compile=jit)
    x = np.random.RandomState(0).randn(64, 8).astype("float32")
    y = np.zeros((64, 4), "float32")
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[NumericsCallback(str(logdir))])
    return _series(logdir)


def test_callback_jit_compile_records_match(tmp_path):
    compiled = _fit(tmp_path / "jit", jit=True)
    plain = _fit(tmp_path / "plain", jit=False)
    _assert_same_records(compiled, plain)
    assert "d1/output" in compiled and "gradients/net/d1/kernel" in compiled


@pytest.mark.parametrize("call", ["log_numerics", "log_gradients"])
def test_logging_inside_a_compiled_step_says_what_to_do_and_keeps_what_was_logged(tmp_path, call):
    """``log_numerics`` in a ``jit_compile=True`` step raised TensorFlow's "No registered
    'Timestamp' OpKernel for XLA_CPU_JIT", naming an op of ours. It now says that XLA
    compiles no summary write and what to use; the records logged before stay readable."""
    w = tf.Variable(tf.ones([3]))

    @tf.function(jit_compile=True)
    def step(x):
        with tf.GradientTape() as tape:
            y = w * x
            loss = tf.reduce_sum(y)
        if call == "log_numerics":
            tbn.log_numerics("y", y)
        else:
            tbn.log_gradients(tape.gradient(loss, [w]), [w])
        return loss

    writer = tf.summary.create_file_writer(str(tmp_path))
    with writer.as_default(step=0):
        tbn.log_numerics("before", tf.constant([1.0, 2.0]))
        with pytest.raises(RuntimeError, match=r"tb_numerics\.%s.*jit_compile=True.*xla\.CompiledStats" % call):
            step(tf.ones([3]))
    writer.close()
    assert _series(tmp_path)["before"].steps.tolist() == [0]
    assert float(step(tf.ones([3]))) == 3.0  # compiled without a default writer: nothing to write, no error
