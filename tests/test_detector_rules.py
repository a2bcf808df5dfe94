"""The early warnings' rules on hand-made series (issue 18), in process: the
trainings that show each detector are in tests/test_detectors.py."""

import numpy as np
import pytest

from tb_numerics import analysis, metadata, records

pytestmark = pytest.mark.unit


def test_each_warning_kind_can_be_switched_off():
    sr = analysis.parse_safe_range({"off": "dead_units,saturation"})
    assert sr.off == ("dead_units", "saturation")
    with pytest.raises(analysis.SafeRangeError, match="off names unknown warning kinds bogus"):
        analysis.parse_safe_range({"off": "bogus"})


def _loss_series(values):
    info = metadata.TensorInfo(role="loss")
    return records.make_series("loss", info, range(len(values)), [records.numpy_stats(np.float32([v])) for v in values])


def test_an_oscillating_loss_warns_and_a_noisy_decreasing_one_does_not():
    swing = [1.0, 20.0] * 30
    ra = analysis.analyze_run("r", [_loss_series(swing)], analysis.SafeRange(off=("loss_not_decreasing",)))
    w = analysis.first_warning(ra)
    assert (w["kind"], w["step"]) == ("loss_oscillating", 49)
    assert "between 1 and 20" in w["detail"]
    noisy = list(np.exp(-np.arange(80) / 20) * (1 + 0.3 * np.random.default_rng(0).standard_normal(80) ** 2))
    assert analysis.first_warning(analysis.analyze_run("r", [_loss_series(noisy)])) is None


def test_headroom_forecasts_a_float16_overflow_before_it_happens():
    """A tensor computed in float16 but recorded in float32 is held to float16's range."""
    info = metadata.TensorInfo(dtype="float32", compute_dtype="float16")
    vals = [records.numpy_stats(np.float32([1.0, 1.3 ** s])) for s in range(40)]
    ra = analysis.analyze_run("r", [records.make_series("h", info, range(40), vals)])
    w = analysis.first_warning(ra)
    assert w["kind"] == "headroom" and "float16 overflow in about" in w["detail"]
    # 1.3**s passes 65504 at step 43: warned at least 10 steps before.
    assert w["step"] <= 33


def test_warning_details_say_what_held_at_their_step():
    """Issue 26 item 6: the headroom forecast names the growth it
    extrapolates; a float32 record of a float16 computation names the
    float16 margin it passed (not "the limit None")."""
    info = metadata.TensorInfo(dtype="float32", compute_dtype="float16")
    vals = [records.numpy_stats(np.float32([1.0, 1.3 ** s])) for s in range(40)]
    ra = analysis.analyze_run("r", [records.make_series("h", info, range(40), vals)])
    w = analysis.first_warning(ra)
    # 1.3**s reaches 65504 at s = log_1.3(65504) = 42.3.
    assert w["detail"].endswith("at its growth over steps %d to %d (×1.3 a step), this tensor's float16 overflow "
                                "in about %d steps" % (w["step"] - 7, w["step"], round(np.log(65504) / np.log(1.3) - w["step"])))
    over = [x for x in analysis.warnings_by_tensor(ra) if x["kind"] == "overflow_risk"]
    assert over and over[0]["first_step"] == 27  # 1.3**27 = 1193 > 1023.5
    assert over[0]["detail"] == ("max |x| = 1193 beyond the float16 margin 1024: computed in float16 (recorded as "
                                 "float32), whose largest value is 6.55e4")


def test_a_noisy_minibatch_loss_late_in_training_is_not_an_oscillation():
    """By chance a noisy loss turns at about 2/3 of its records, and late in
    training its batches can span a factor of 10 and more: no warning."""
    rng = np.random.default_rng(0)
    noisy = list(np.exp(rng.uniform(np.log(0.005), np.log(0.2), 2000)))
    ra = analysis.analyze_run("r", [_loss_series(noisy)], analysis.SafeRange(off=("loss_not_decreasing",)))
    assert analysis.first_warning(ra) is None


def _grad_series(tag, shape, norms, order):
    info = metadata.TensorInfo(role="gradient", shape=shape, order=order)
    return records.make_series(tag, info, range(len(norms)), [records.numpy_stats(np.float32([n])) for n in norms])


def test_gradients_by_depth_compare_two_different_layers():
    big, small = [1000.0] * 10, [1.0] * 10
    # Backward order: the last layer's gradients first.
    two_layers = [_grad_series("gradients/head/kernel", (8, 1), small, 0),
                  _grad_series("gradients/head/bias", (1,), small, 1),
                  _grad_series("gradients/first/kernel", (4, 8), big, 2)]
    w = analysis.first_warning(analysis.analyze_run("r", two_layers))
    assert (w["kind"], w["tensor"], w["step"]) == ("exploding_by_depth", "gradients/first/kernel", 4)
    # One layer's kernel against its own bias, or its two kernels (a GRU's), is no comparison by depth.
    one_layer = [_grad_series("gradients/dense/kernel", (4, 8), big, 0),
                 _grad_series("gradients/dense/bias", (8,), small, 1)]
    gru = [_grad_series("gradients/gru/cell/recurrent_kernel", (8, 24), small, 0),
           _grad_series("gradients/gru/cell/kernel", (4, 24), big, 1)]
    for series in (one_layer, gru):
        assert analysis.first_warning(analysis.analyze_run("r", series)) is None
