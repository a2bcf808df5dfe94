"""mixed_float16: loss scale and skipped steps recorded; skipped steps are warnings."""

import keras
import numpy as np
import pytest

from tb_numerics import analysis, event_reader
from tb_numerics.keras import NumericsCallback

pytestmark = pytest.mark.e2e


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


def test_skipped_step_and_loss_scale_drop_are_recorded_as_warnings(tmp_path, mixed_float16):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="tanh", name="d1"),
         keras.layers.Dense(4, dtype="float32", name="out")],
        name="net",
    )
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    rs = np.random.RandomState(0)
    x, y = rs.randn(64, 8).astype("float32"), rs.randn(64, 4).astype("float32")
    y[2 * 16:3 * 16] = 3e3  # batch 2: the scaled gradients overflow float16
    cb = NumericsCallback(str(tmp_path), stop_on_anomaly=True)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[cb])

    # The skipped step did not advance the optimizer (4 batches, 3 updates),
    # and a handled skip does not stop training.
    assert int(model.optimizer.iterations) == 3
    assert cb.anomaly is None
    (run,) = event_reader.read_logdir(str(tmp_path))
    ra = analysis.analyze_run(run.run, run.series)
    scale = ra.find("loss_scale").series
    assert scale.steps.tolist() == [0, 1, 2, 3]  # every batch has its own step
    assert scale.values[:, 5].tolist() == [2.0**15, 2.0**15, 2.0**15, 2.0**14]  # the drop
    # Forward finite, float16 activations with their headroom recorded.
    d1 = ra.find("d1/output")
    assert d1.series.info.dtype == "float16" and not d1.codes.any()
    summary = analysis.run_summary(ra)
    assert summary["skipped_steps"] == [2]
    assert summary["first_anomaly"] is None
    # A skip that later steps recover from is information, not the run's first
    # warning; the batch of 3e3 targets that caused it is (the targets, as
    # the batch arrived, jumped; so did the loss).
    (info,) = summary["info"]
    assert (info["step"], info["kind"], info["phase"]) == (2, "skipped_step", "backward")
    assert "LossScaleOptimizer skipped" in info["detail"]
    w = summary["first_warning"]
    assert (w["step"], w["tensor"], w["kind"], w["phase"]) == (2, "target", "fast_growth", "input")
    assert any((x["first_step"], x["tensor"], x["kind"]) == (2, "loss", "fast_growth") for x in summary["warnings"])


def test_gradients_of_float32_master_weights_are_held_to_float16s_range(tmp_path, mixed_float16):
    """Issue 18 item 5: the callback records each layer's compute dtype."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh", name="d1"),
                              keras.layers.Dense(4, dtype="float32", name="out")], name="net")
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
    rs = np.random.RandomState(0)
    model.fit(rs.randn(32, 8).astype("float32"), rs.randn(32, 4).astype("float32"), batch_size=16, verbose=0,
              callbacks=[NumericsCallback(str(tmp_path))])
    (run,) = event_reader.read_logdir(str(tmp_path))
    infos = {s.tag: s.info for s in run.series}
    kernel = infos["gradients/net/d1/kernel"]
    assert (kernel.dtype, kernel.compute_dtype) == ("float32", "float16")
    assert infos["gradients/net/out/kernel"].compute_dtype == ""  # computed in float32
    assert infos["d1/output"].dtype == "float16"
