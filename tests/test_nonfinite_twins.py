"""Issue 29: the TensorFlow twin of the non-finite rule agrees with the numpy one.

``records.nonfinite_count`` (numpy, on records) is the reference; the
TensorFlow side (``stats.nonfinite_count`` on records, ``count_nonfinite``
and ``all_finite`` on tensors) must count the same on every supported
dtype, with NaN, +Inf, -Inf and an allowlisted -Inf, eagerly, traced and
compiled. And a decision taken on a cheap sum must not mistake finite
values whose sum overflows for a NaN: the callback's gated update once held
back such a step's update.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from tb_numerics import records, stats
from tb_numerics.keras import NumericsCallback

pytestmark = pytest.mark.e2e

DTYPES = ["float16", "bfloat16", "float32", "float64"]


def _cases(dtype: str) -> dict[str, list[float]]:
    big = float(tf.as_dtype(dtype).max) / 2  # finite; four of them sum past the largest value
    return {
        "finite": [1.0, -2.0, 0.5, 0.0],
        "nan": [np.nan, 1.0],
        "every_kind": [np.inf, -np.inf, np.nan, 2.0, np.nan],
        "neginf_only": [-np.inf, -np.inf, 3.0],
        "all_nan": [np.nan, np.nan],
        "empty": [],
        "sum_overflows": [big, big, big, big],
    }


def _tensor(values: list[float], dtype: str) -> tf.Tensor:
    return tf.cast(tf.constant(np.asarray(values, np.float64).reshape(-1)), dtype)


def _reference(t: tf.Tensor, neginf_ok) -> np.ndarray:
    """The numpy rule on the numpy statistics of the tensor's own values."""
    return records.nonfinite_count(records.numpy_stats(np.asarray(t.numpy(), np.float64), t.dtype.name), neginf_ok)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neginf_ok", [False, True])
def test_each_tensorflow_form_counts_as_the_numpy_rule(dtype, neginf_ok):
    for name, values in _cases(dtype).items():
        t = _tensor(values, dtype)
        want = _reference(t, neginf_ok)
        assert stats.count_nonfinite(t, neginf_ok).numpy() == want, name
        for record in (stats.tensor_stats(t, name), stats.op_stats(t, name)):
            assert stats.nonfinite_count(record, neginf_ok).numpy() == want, name
        assert records.nonfinite_count(record.numpy(), neginf_ok) == want, name
        assert bool(stats.all_finite([t]).numpy()) == (_reference(t, False) == 0), name


@pytest.mark.parametrize("jit_compile", [False, True])
def test_per_record_allowlists_agree_inside_a_traced_or_compiled_step(jit_compile):
    tensors = [_tensor(v, d) for d in DTYPES for v in _cases(d).values()]
    recs = np.stack([stats.tensor_stats(t, "x").numpy() for t in tensors])
    neginf_ok = np.arange(len(tensors)) % 2 == 0
    want = records.nonfinite_count(recs, neginf_ok)
    assert want.shape == (len(tensors),) and (want > 0).any() and (want == 0).any()
    twin = tf.function(lambda r: stats.nonfinite_count(r, neginf_ok), jit_compile=jit_compile)
    np.testing.assert_array_equal(twin(tf.constant(recs)).numpy(), want)
    # One allowlist flag per record, the records stacked by replica.
    np.testing.assert_array_equal(twin(tf.constant(np.stack([recs, recs]))).numpy(), np.stack([want, want]))


def test_finite_values_whose_sum_overflows_are_finite_to_the_fast_decision():
    t = _tensor(_cases("float32")["sum_overflows"], "float32")
    total = tf.reduce_sum(t)
    assert not np.isfinite(total.numpy())  # the cheap check alone would call them bad
    assert not bool(stats.sums_finite([total]).numpy())
    assert bool(stats.all_finite([t]).numpy())


def test_the_gated_update_applies_a_finite_step_whose_gradient_sum_overflows(tmp_path):
    """Every gradient element is finite (1e38) but their float32 sum is +Inf:
    the callback must not hold the update back (it did: the weights stayed
    put and the optimizer's step did not advance). The oracle is the same fit
    without the callback."""

    def fit(callbacks):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
        model.compile(keras.optimizers.SGD(1e-37), "mse")
        x = np.full((1, 4), 1e38, np.float32)  # d(mse)/d(kernel) = x * 2 * (0 - y) = 1e38 each
        y = np.full((1, 1), -0.5, np.float32)
        model.fit(x, y, batch_size=1, epochs=1, callbacks=callbacks, verbose=0, shuffle=False)
        return model

    plain = fit([])
    cb = NumericsCallback(str(tmp_path / "run"))
    watched = fit([cb])
    want = plain.get_weights()[0]
    assert np.all(np.isfinite(want)) and np.all(want != 0)  # the update was applied, and finite
    np.testing.assert_array_equal(watched.get_weights()[0], want)
    assert int(watched.optimizer.iterations.numpy()) == int(plain.optimizer.iterations.numpy()) == 1
    assert cb.replay_verdict is None  # no anomaly: nothing to replay
