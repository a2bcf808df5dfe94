"""The analysis core: safe-range rules, first anomaly / warning, timeline."""

import json

import numpy as np
import pytest

from tb_numerics import analysis, metadata, records
from tb_numerics.records import numpy_stats

pytestmark = pytest.mark.unit

RNG = np.random.default_rng(0)


def info(role="activation", order=0, dtype="float32", op_type=""):
    return metadata.TensorInfo(dtype=dtype, role=role, order=order, op_type=op_type)


def series(tag, arrays_by_step, **kw):
    i = info(**kw)
    steps = sorted(arrays_by_step)
    return records.make_series(tag, i, steps, [numpy_stats(arrays_by_step[s], i.dtype) for s in steps])


def healthy(n=16, scale=1.0):
    return (RNG.normal(size=n) * scale).astype(np.float32)


def with_values(x, **idx_values):
    x = x.copy()
    for i, v in enumerate(idx_values.values()):
        x[i] = v
    return x


def test_first_anomaly_is_earliest_step_then_forward_before_backward():
    steps = range(10)
    fwd = series("dense/output", {s: healthy() if s != 6 else with_values(healthy(), a=np.nan) for s in steps}, order=3)
    # The backward tensor goes bad one step earlier, but a later (step) record wins nothing:
    bwd = series("gradients/dense/kernel", {s: healthy() if s < 5 else with_values(healthy(), a=np.inf) for s in steps},
                 role="gradient", order=0)
    early_fwd_same_step = series("input", {s: healthy() if s != 5 else with_values(healthy(), a=-np.inf, b=np.nan) for s in steps}, order=9)
    ra = analysis.analyze_run("r", [bwd, fwd, early_fwd_same_step])
    a = analysis.first_anomaly(ra)
    # Step 5: both "input" (forward, order 9) and the gradient (backward, order 0) are bad;
    # forward comes first whatever the order numbers say.
    assert (a["step"], a["tensor"], a["phase"]) == (5, "input", "forward")
    assert (a["nan"], a["posinf"], a["neginf"], a["size"]) == (1, 0, 1, 16)
    assert a["description"] == "1 NaN, 1 -Inf of 16 values"
    assert a["last_healthy_step"] == 4


def test_within_a_phase_execution_order_decides():
    s1 = series("b_later", {0: with_values(healthy(), a=np.nan)}, order=2)
    s2 = series("a_earlier", {0: with_values(healthy(), a=np.nan)}, order=1)
    a = analysis.first_anomaly(analysis.analyze_run("r", [s1, s2]))
    assert a["tensor"] == "a_earlier"


def test_healthy_run_has_no_anomaly_and_no_warning():
    s = series("x", {i: healthy() for i in range(50)})
    ra = analysis.analyze_run("r", [s])
    assert analysis.first_anomaly(ra) is None
    assert analysis.first_warning(ra) is None


def test_overflow_risk_by_dtype_margin_and_by_user_limit():
    s = series("x", {0: healthy(), 1: with_values(healthy(), a=1e37), 2: healthy(scale=50.0)})
    w = analysis.first_warning(analysis.analyze_run("r", [s]))
    assert (w["step"], w["kind"]) == (1, "overflow_risk")
    assert "float32 margin" in w["detail"]
    # A user's max |x| moves the first warning earlier.
    w = analysis.first_warning(analysis.analyze_run("r", [s], analysis.SafeRange(max_abs=0.5)))
    assert (w["step"], w["kind"]) == (0, "overflow_risk")


def test_float16_margin_is_much_tighter():
    x = np.array([1.0, 2000.0, 3.0], dtype=np.float16)
    s = series("h", {0: x}, dtype="float16")
    w = analysis.first_warning(analysis.analyze_run("r", [s]))
    assert w["kind"] == "overflow_risk"


def norm_series(values):
    return records.make_series(
        "gradients/global_norm", info(role="global_norm", order=99), range(len(values)),
        [numpy_stats(np.array([v], np.float32)) for v in values])


def test_gradient_spike_against_recent_median():
    norms = [1.0, 1.1, 0.9, 1.0, 1.2, 1.0, 30.0, 1.0]
    ra = analysis.analyze_run("r", [norm_series(norms)])
    w = analysis.first_warning(ra)
    assert (w["step"], w["kind"]) == (6, "gradient_spike")
    # A bigger factor does not call it a spike.
    ra = analysis.analyze_run("r", [norm_series(norms)], analysis.SafeRange(spike_factor=50))
    assert analysis.first_warning(ra) is None


def test_exploding_and_vanishing_gradient_norms():
    ra = analysis.analyze_run("r", [norm_series([1.0, 2.0, 5.0])], analysis.SafeRange(grad_norm_limit=3.0))
    assert analysis.first_warning(ra)["kind"] == "exploding_gradient"
    assert analysis.first_warning(ra)["step"] == 2
    ra = analysis.analyze_run("r", [norm_series([1.0, 1e-3, 1e-12])])
    w = analysis.first_warning(ra)
    assert (w["step"], w["kind"]) == (2, "vanishing_gradient")


def test_underflow_share():
    x = np.full(10, 1e-40, dtype=np.float32)
    x[:5] = 1.0
    s = series("x", {0: healthy(), 1: x})
    w = analysis.first_warning(analysis.analyze_run("r", [s]))
    assert (w["step"], w["kind"]) == (1, "underflow")
    assert analysis.first_warning(analysis.analyze_run("r", [s], analysis.SafeRange(underflow_share=0.9))) is None


def test_geometric_growth_warns_well_before_overflow_and_hints_at_learning_rate():
    arrays = {}
    for step in range(40):
        arrays[step] = healthy() * (3.0 ** step) if step < 39 else with_values(healthy(), a=np.inf)
    ra = analysis.analyze_run("r", [series("dense3/output", arrays)])
    w = analysis.first_warning(ra)
    a = analysis.first_anomaly(ra)
    assert w["kind"] == "growth" and w["step"] < a["step"] - 20
    assert a["step"] == 39
    assert "learning rate" in a["hint"]


def test_allowlisted_neginf_is_not_an_anomaly_but_nan_still_is():
    mask = np.zeros(8, np.float32)
    mask[5:] = -np.inf
    s = series("attention/mask", {0: mask, 1: mask, 2: with_values(mask, a=np.nan)})
    sr = analysis.parse_safe_range({"allow_neginf": "attention/*"})
    a = analysis.first_anomaly(analysis.analyze_run("r", [s], sr))
    assert a["step"] == 2 and a["nan"] == 1
    assert analysis.first_anomaly(analysis.analyze_run("r", [s]))["step"] == 0


@pytest.mark.parametrize(
    "tag, op_type, role, expect",
    [
        ("loss/Sqrt_grad", "Sqrt", "gradient", "gradient of sqrt is infinite"),
        ("ops/gradients/SqrtGrad", "SqrtGrad", "gradient", "gradient of sqrt is infinite"),
        ("xent/log_probs", "", "activation", "log(0) = -inf"),
        ("cosine/truediv", "", "activation", "Division by zero"),
        ("ops/RealDiv", "RealDiv", "activation", "Division by zero"),
        ("logits/exp", "Exp", "activation", "exp overflows"),
        ("dense/output", "", "activation", ""),
    ],
)
def test_cause_hints_by_op_type_and_name(tag, op_type, role, expect):
    s = series(tag, {0: with_values(healthy(), a=np.nan)}, role=role, op_type=op_type)
    a = analysis.first_anomaly(analysis.analyze_run("r", [s]))
    if expect:
        assert expect in a["hint"]
    else:
        assert a["hint"].startswith("no hint: checked op type")


def test_likely_cause_points_at_a_finite_input_beyond_the_safe_range():
    # A batch holding 1e38 is finite; the NaN appears two ops later.
    inp = series("input", {0: healthy(), 1: with_values(healthy(), a=1e38)}, order=0)
    hidden = series("hidden", {0: healthy(), 1: healthy()}, order=1)
    loss = series("loss", {0: healthy(), 1: with_values(healthy(), a=np.nan)}, role="loss", order=2)
    ra = analysis.analyze_run("r", [loss, hidden, inp])
    a = analysis.first_anomaly(ra)
    assert (a["step"], a["tensor"]) == (1, "loss")
    assert a["likely_cause"]["tensor"] == "input" and a["likely_cause"]["step"] == 1
    assert a["likely_cause"]["kind"] == "overflow_risk"
    w = analysis.first_warning(ra)
    assert (w["step"], w["tensor"]) == (1, "input")


def test_timeline_keeps_a_single_bad_step_visible_when_downsampled():
    n = 10_000
    steps = np.arange(n)
    vals = np.tile(numpy_stats(healthy()), (n, 1))
    vals[7777] = numpy_stats(with_values(healthy(), a=np.nan))
    vals[1234] = numpy_stats(with_values(healthy(), a=1e37))
    s = records.make_series("x", info(), steps, vals)
    ra = analysis.analyze_run("r", [s])
    tl = analysis.timeline(ra, width=100)
    cells = tl["rows"][0]["cells"]
    assert len(cells) == 100
    bad = [i for i, c in enumerate(cells) if c == analysis.NONFINITE]
    warn = [i for i, c in enumerate(cells) if c == analysis.WARNING]
    assert len(bad) == 1 and tl["bucket_start"][bad[0]] <= 7777 <= tl["bucket_end"][bad[0]]
    assert len(warn) == 1 and tl["bucket_start"][warn[0]] <= 1234 <= tl["bucket_end"][warn[0]]
    # A narrowed range keeps full resolution.
    tl = analysis.timeline(ra, width=100, start=7770, end=7780)
    assert tl["bucket_start"] == list(range(7770, 7781))
    assert tl["rows"][0]["cells"][7] == analysis.NONFINITE


def test_timeline_marks_missing_records_and_orders_rows():
    a = series("a", {0: healthy(), 5: healthy()}, order=1)
    g = series("g", {0: healthy(), 1: healthy()}, role="gradient", order=0)
    tl = analysis.timeline(analysis.analyze_run("r", [g, a]), width=10)
    assert [r["tensor"] for r in tl["rows"]] == ["a", "g"]
    assert tl["bucket_start"] == [0, 1, 5]
    assert tl["rows"][0]["cells"] == [0, -1, 0]
    assert tl["rows"][1]["cells"] == [0, 0, -1]


def test_timeline_of_a_tag_logged_twice_a_step_has_one_column_a_step():
    """Micro-batches: each step holds two records of each tag. Each column is
    one step, in order, and holds the worse of its records."""
    good, bad = numpy_stats(healthy()), numpy_stats(with_values(healthy(), a=np.nan))
    a = records.make_series("a", info(), [0, 0, 1, 1, 2, 2], [good, good, good, bad, good, good])
    g = records.make_series("g", info(role="gradient"), [0, 0, 1, 1, 2, 2], [good] * 6)
    ra = analysis.analyze_run("r", [a, g])
    for width in (3, 100):
        tl = analysis.timeline(ra, width=width)
        assert tl["bucket_start"] == tl["bucket_end"] == [0, 1, 2], width
        assert [r["cells"] for r in tl["rows"]] == [[0, analysis.NONFINITE, 0], [0, 0, 0]], width
    assert analysis.timeline(ra, width=2)["bucket_start"] == [0, 1]


def test_make_series_drops_malformed_records_and_keeps_every_occurrence():
    good = numpy_stats(healthy())
    later = numpy_stats(healthy(scale=5))
    bad_len = good[:5]
    nan_count = good.copy()
    nan_count[metadata.FIELD_INDEX["nan"]] = np.nan
    too_many = good.copy()
    too_many[metadata.FIELD_INDEX["zeros"]] = 1e9
    problems = []
    s = records.make_series("x", info(), [3, 1, 2, 2, 4, 5], [good, good, bad_len, later, nan_count, too_many], problems)
    # Both records of step 2 are kept, in the order written (micro-batches).
    assert s.steps.tolist() == [1, 2, 3]
    np.testing.assert_array_equal(s.values[1], later)
    s = records.make_series("x", info(), [3, 1, 2, 2], [good, good, good, later])
    assert s.steps.tolist() == [1, 2, 2, 3]
    np.testing.assert_array_equal(s.values[2], later)
    assert s.occurrence(1) == (1, 2) and s.occurrence(2) == (2, 2) and s.occurrence(3) == (1, 1)
    assert problems == ["x: 3 malformed record(s) skipped"]


def test_derived_statistics_match_numpy():
    x = RNG.normal(size=1000).astype(np.float64) * 3 + 1
    x[:3] = [np.nan, np.inf, -np.inf]
    d = records.derived(numpy_stats(x))
    f = x[np.isfinite(x)]
    assert d["mean"][0] == pytest.approx(f.mean())
    assert d["std"][0] == pytest.approx(f.std(), rel=1e-9)
    assert d["max_abs"][0] == pytest.approx(np.abs(f).max())
    assert d["l2"][0] == pytest.approx(np.linalg.norm(f))


@pytest.mark.parametrize(
    "params, match",
    [
        ({"max_abs": "abc"}, "max_abs must be a number"),
        ({"max_abs": "-1"}, "max_abs must be greater than 0"),
        ({"grad_norm_limit": "nan"}, "grad_norm_limit must be finite"),
        ({"spike_factor": "1"}, "spike_factor must be greater than 1"),
        ({"spike_window": "2.5"}, "spike_window must be a whole number"),
        ({"underflow_share": "2"}, "underflow_share must be in"),
    ],
)
def test_safe_range_parse_errors_name_the_parameter(params, match):
    with pytest.raises(analysis.SafeRangeError, match=match):
        analysis.parse_safe_range(params)


def test_safe_range_parse_accepts_strings_and_none():
    sr = analysis.parse_safe_range({"max_abs": "1e3", "spike_factor": 4, "grad_norm_limit": "none", "other": "x"})
    assert sr.max_abs == 1e3 and sr.spike_factor == 4 and sr.grad_norm_limit is None


def test_a_gradient_spike_before_the_anomaly_gives_the_learning_rate_hint():
    norms = norm_series([1.0, 1.2, 0.9, 1.1, 1.0, 4e3, 1.0])
    act = series("dense/output", {s: healthy() if s < 6 else with_values(healthy(), a=np.inf) for s in range(7)})
    a = analysis.first_anomaly(analysis.analyze_run("r", [act, norms]))
    assert a["step"] == 6 and a["likely_cause"]["kind"] == "gradient_spike"
    assert "learning rate" in a["hint"] and "clip" in a["hint"]
    # What was computed, in readable numbers: 5 earlier records, not "20".
    assert "4000× the median 1 of the previous 5 records" in a["likely_cause"]["detail"]


def _float32_sums(s: records.TensorSeries) -> records.TensorSeries:
    """``s`` with its sums rounded to float32, as TensorFlow accumulates them
    for float32 tensors (numpy_stats sums in float64)."""
    return records.TensorSeries(s.tag, s.info, s.steps, s.values.astype(np.float32).astype(np.float64))


def _as_float32(s: records.TensorSeries) -> records.TensorSeries:
    """The same series held as packed readers hold exact float32 records."""
    v32 = np.asfortranarray(s.values, np.float32)
    assert np.array_equal(v32, s.values, equal_nan=True)
    return records.TensorSeries(s.tag, s.info, s.steps, v32)


@pytest.mark.parametrize(
    "sr",
    [
        analysis.SafeRange(),
        # Limits at a value float32 rounds up: 1.1 as float32 is 1.10000002,
        # above the limit 1.1 in float64, equal to it in float32.
        analysis.SafeRange(max_abs=1.1, grad_norm_limit=1.1, vanishing_floor=0.3),
    ],
)
def test_series_held_as_float32_analyse_exactly_like_float64(sr):
    norm = np.float32(1.1)
    runs = {
        "act": {s: with_values(healthy(), a=norm if s == 5 else 0.5, b=np.nan if s == 9 else 0.0) for s in range(12)},
        "norm": {s: np.float32([norm if s in (3, 7) else 0.3 + 0.01 * s]) for s in range(12)},
    }
    f64 = [
        _float32_sums(series("act", runs["act"])),
        _float32_sums(series("gradients/global_norm", runs["norm"], role="global_norm", order=1)),
    ]
    f32 = [_as_float32(s) for s in f64]
    a64, a32 = analysis.analyze_run("r", f64, sr), analysis.analyze_run("r", f32, sr)
    for h64, h32 in zip(a64.health, a32.health):
        np.testing.assert_array_equal(h64.codes, h32.codes)
        np.testing.assert_array_equal(h64.kinds, h32.kinds)
    assert analysis.run_summary(a64) == analysis.run_summary(a32)
    if sr.grad_norm_limit is not None:
        assert analysis.first_warning(a32)["kind"] in ("overflow_risk", "exploding_gradient")


@pytest.mark.parametrize("seed", range(5))
def test_growth_flags_match_their_definition(seed):
    """Rising at each of the last ``growth_window`` records, above the floor,
    and ``growth_factor`` x the value ``growth_window`` records earlier."""
    rng = np.random.default_rng(seed)
    w = int(rng.integers(1, 6))
    sr = analysis.SafeRange(growth_window=w, growth_factor=1.5, growth_floor=0.5)
    x = np.cumprod(rng.choice([0.8, 1.3, 1.6], size=300))
    x[rng.integers(0, 300, 5)] = np.nan
    want = np.zeros(len(x), bool)
    for i in range(w, len(x)):
        rising = all(x[j] > x[j - 1] for j in range(i - w + 1, i + 1))
        want[i] = rising and x[i] >= sr.growth_floor and x[i - w] > 0 and x[i] >= sr.growth_factor * x[i - w]
    np.testing.assert_array_equal(analysis.growth_flags(x, sr), want)
    assert want.any()


def test_last_healthy_step_is_before_the_warnings_and_last_finite_step_before_the_anomaly():
    """Issue 13 item 9: warns from step 12 to 22, NaN at 23: last healthy 11, last finite 22."""
    arrays = {s: healthy() for s in range(12)}
    arrays.update({s: with_values(healthy(), a=1e37) for s in range(12, 23)})
    arrays[23] = with_values(healthy(), a=np.nan)
    a = analysis.first_anomaly(analysis.analyze_run("r", [series("x", arrays)]))
    assert (a["step"], a["last_healthy_step"], a["last_finite_step"]) == (23, 11, 22)


def test_number_words_are_readable():
    """Issue 13 item 10: ratios as 4.2e15, not 4217953385713646.0."""
    assert analysis.number(4217953385713646.0) == "4.22e15"
    assert analysis.number(4000.0) == "4000"
    assert analysis.number(0.0123) == "0.0123"
    assert analysis.number(2.5e-7) == "2.5e-7"


def test_a_step_over_step_explosion_warns_from_the_second_record():
    """Issue 13 item 11: loss growing 1e8x per step for three steps, then Inf."""
    arrays = {0: np.float32([1.0, 2.0]), 1: np.float32([1e8, 2e8]), 2: np.float32([1e16, 2e16]),
              3: np.float32([np.inf, 1.0])}
    ra = analysis.analyze_run("r", [series("loss", arrays, role="loss")])
    w = analysis.first_warning(ra)
    assert (w["step"], w["kind"]) == (1, "fast_growth")
    assert "grew 1e8× in 1 record (steps 0 to 1), to 2e8" in w["detail"]
    a = analysis.first_anomaly(ra)
    assert "learning rate" in a["hint"] and "loss, step 2" in a["hint"]


def test_a_tag_logged_twice_in_a_step_finds_the_bad_occurrence():
    """Issue 13 item 3: -Inf in the first of two micro-batches of one step."""
    i = info()
    good, bad = numpy_stats(healthy()), numpy_stats(with_values(healthy(), a=-np.inf))
    s = records.make_series("grads/micro", i, [0, 0, 1, 1], [good, good, bad, good])
    a = analysis.first_anomaly(analysis.analyze_run("r", [s]))
    assert (a["step"], a["neginf"], a["occurrence"]) == (1, 1, {"index": 1, "of": 2})
    assert a["last_healthy_step"] == 0


def test_neginf_intended_by_the_writer_is_applied_without_the_users_flag():
    """Issue 13 item 1: TensorInfo.neginf_ok written into the run."""
    mask = np.zeros(8, np.float32)
    mask[5:] = -np.inf
    i = metadata.TensorInfo(neginf_ok=True)
    s = records.make_series("attn/mask", i, [0, 1, 2], [numpy_stats(mask), numpy_stats(mask),
                                                         numpy_stats(with_values(mask, a=np.nan))])
    a = analysis.first_anomaly(analysis.analyze_run("r", [s]))
    assert a["step"] == 2 and a["nan"] == 1


def _scale_series(scales):
    return records.make_series("loss_scale", metadata.TensorInfo(role="loss_scale", order=9), range(len(scales)),
                               [numpy_stats(np.float32([v])) for v in scales])


def test_a_skip_that_recovers_is_information_and_a_persistent_skip_is_the_anomaly():
    """Issue 13 item 5: skips followed by an applied step are handled; a run
    of skips with no applied step after it is an anomaly at its first skip."""
    bad = with_values(healthy(), a=np.inf)
    # Steps 2 and 3 skip, then training recovers; from step 6 every step skips.
    grads = series("gradients/w", {s: bad if s in (2, 3) or s >= 6 else healthy() for s in range(12)},
                   role="gradient")
    scales = [2.0**15] * 2 + [2.0**15, 2.0**14] + [2.0**13] * 2 + [2.0**(12 - k) for k in range(6)]
    ra = analysis.analyze_run("r", [grads, _scale_series(scales)])
    summary = analysis.run_summary(ra)
    assert summary["skipped_steps"] == [2, 3]
    assert summary["first_warning"] is None
    assert [e["step"] for e in summary["info"]] == [2, 3] and summary["info"][0]["kind"] == "skipped_step"
    a = summary["first_anomaly"]
    assert (a["step"], a["tensor"]) == (6, "gradients/w")


def test_a_skip_whose_forward_pass_went_bad_is_the_anomaly_not_a_handled_skip():
    """Issue 25: a step the LossScaleOptimizer skipped, whose forward pass made a non-finite
    value inside a layer (an op-level record of a look inside it, e.g. a float16 Square that
    overflowed while the layer's output stayed finite), is the run's anomaly, at that op; the
    same skip without that record is one the scale handles."""
    bad = with_values(healthy(), a=np.inf)
    grads = series("gradients/w", {s: bad if s == 3 else healthy() for s in range(8)}, role="gradient")
    scales = [2.0**8] * 4 + [2.0**7] * 4
    square = records.make_series("ops/net/norm/Square", metadata.TensorInfo(role="activation", order=0,
                                                                            op_type="Square"),
                                 [3], [numpy_stats(with_values(healthy(), a=np.inf))])
    handled = analysis.run_summary(analysis.analyze_run("r", [grads, _scale_series(scales)]))
    assert handled["first_anomaly"] is None and handled["skipped_steps"] == [3]
    summary = analysis.run_summary(analysis.analyze_run("r", [grads, _scale_series(scales), square]))
    assert summary["skipped_steps"] == []
    a = summary["first_anomaly"]
    assert a["step"] == 3 and a["tensor"] == "gradients/w"
    assert (a["op"]["type"], a["op"]["phase"]) == ("Square", "forward")


def test_log_loss_fed_exact_zeros_gets_the_log_of_zero_hint_with_its_evidence():
    """Issue 13 item 11: a ReLU output's zero share climbs, then NaN in a cross-entropy."""
    out = {}
    for s in range(6):
        x = np.abs(healthy(n=100))
        x[: 10 * s] = 0.0  # 0%, 10%, ... 50% exact zeros
        out[s] = x
    loss = {s: np.float32([1.0]) if s < 5 else np.float32([np.nan]) for s in range(6)}
    li = records.make_series("out/output", info(order=0), range(6), [numpy_stats(out[s]) for s in range(6)])
    lo = records.make_series("loss", metadata.TensorInfo(role="loss", order=1, activation="categorical_crossentropy"),
                             range(6), [numpy_stats(loss[s]) for s in range(6)])
    a = analysis.first_anomaly(analysis.analyze_run("r", [li, lo]))
    assert a["step"] == 5 and a["tensor"] == "loss"
    assert "The loss (categorical_crossentropy) takes the log" in a["hint"]
    assert "out/output held exact zeros at step 5" in a["hint"]
    assert "50 of 100 values, 50%" in a["hint"] and "(0% at step 0)" in a["hint"]
    assert "softmax" in a["hint"] and "learning rate" not in a["hint"]
    # A loss that takes no log gets no such hint.
    lo_mse = records.make_series("loss", metadata.TensorInfo(role="loss", order=1, activation="mean_squared_error"),
                                 range(6), [numpy_stats(loss[s]) for s in range(6)])
    a = analysis.first_anomaly(analysis.analyze_run("r", [li, lo_mse]))
    assert a["hint"].startswith("no hint: ") and "mean_squared_error" in a["hint"]


@pytest.mark.parametrize("function", ["", "categorical_crossentropy"])
def test_zeros_the_loss_took_finite_before_are_no_log_of_zero_hint(function):
    """A ReLU output holds half zeros at every step, the loss finite for five steps, then +Inf
    with no more zeros than before: those zeros did not make it (a squared error that
    overflowed, a NaN from elsewhere), so no log(0) hint is drawn from them."""
    out = {}
    for s in range(6):
        x = np.abs(healthy(n=100))
        x[: 50 - (s % 2)] = 0.0  # 50% and 49% exact zeros, alternately
        out[s] = x
    loss = {s: np.float32([1.0]) if s < 5 else np.float32([np.inf]) for s in range(6)}
    li = records.make_series("out/output", info(order=0), range(6), [numpy_stats(out[s]) for s in range(6)])
    lo = records.make_series("loss", metadata.TensorInfo(role="loss", order=1, activation=function),
                             range(6), [numpy_stats(loss[s]) for s in range(6)])
    a = analysis.first_anomaly(analysis.analyze_run("r", [li, lo]))
    assert a["step"] == 5 and a["tensor"] == "loss"
    assert "the log of its input" not in a["hint"]
    assert a["hint"].startswith("no hint: ") and "exact zeros, 49%; the loss stayed finite with 50% before" in a["hint"]


def test_exponential_activation_gets_the_exp_hint():
    """Issue 13 item 11: the layer's activation function is the op."""
    i = metadata.TensorInfo(op_type="Dense", activation="exponential")
    s = records.make_series("dense/output", i, [0], [numpy_stats(with_values(healthy(), a=np.inf))])
    assert "exp overflows" in analysis.first_anomaly(analysis.analyze_run("r", [s]))["hint"]


def test_a_replayed_step_names_the_op_beside_the_layer_anomaly():
    """Issue 14: layer-level records stay the first anomaly; the op-level
    records of that step (a replay's) name the exact op and its source line."""
    layer = series("feature/output", {s: healthy() if s < 3 else with_values(healthy(), a=-np.inf) for s in range(4)})
    op_info = metadata.TensorInfo(role="activation", order=5, op_type="Log", description="model.py:12 (call)")
    op = records.make_series("ops/sequential/log_relu/Log", op_info, [3], [numpy_stats(with_values(healthy(), a=-np.inf))])
    healthy_op = records.make_series("ops/sequential/dense/MatMul", metadata.TensorInfo(role="activation", order=1,
                                     op_type="MatMul"), [3], [numpy_stats(healthy())])
    a = analysis.first_anomaly(analysis.analyze_run("r", [layer, op, healthy_op]))
    assert (a["step"], a["tensor"]) == (3, "feature/output")
    assert a["op"] == {"name": "sequential/log_relu/Log", "type": "Log", "source": "model.py:12 (call)",
                       "phase": "forward"}
    assert "log(0)" in a["hint"]


def test_a_replay_that_did_not_reproduce_says_so_and_names_no_op():
    layer = series("feature/output", {s: healthy() if s < 3 else with_values(healthy(), a=np.nan) for s in range(4)})
    verdict = json.dumps({"step": 3, "reproduced": False, "why": "dropout drew other masks"})
    replay = records.make_series(metadata.REPLAY_TAG, metadata.TensorInfo(role="other", description=verdict), [3],
                                 [numpy_stats(np.zeros(0, np.float32))])
    ra = analysis.analyze_run("r", [layer, replay])
    a = analysis.first_anomaly(ra)
    assert a["op"] is None and a["replay"] == {"reproduced": False, "why": "dropout drew other masks"}
    assert [h.series.tag for h in ra.health] == ["feature/output"]  # the verdict is not a tensor


# ---------------------------------------------------------------- chart points


def _health_of(tag, arrays_by_step, sr=None, **kw):
    ra = analysis.analyze_run("r", [series(tag, arrays_by_step, **kw)], sr or analysis.SafeRange())
    return ra.find(tag)


def test_chart_buckets_of_float32_records_sum_counts_exactly():
    """Packed float32 records hold counts below 2**24 exactly; their bucket
    sums go beyond, and must not be rounded to float32."""
    n = 100
    rec = numpy_stats(np.float32([1.0]))
    rec[records.F["count"]] = 5_000_001
    rec[records.F["zeros"]] = 3
    values = np.asfortranarray(np.tile(rec, (n, 1)), np.float32)
    h = analysis.SeriesHealth(
        records.TensorSeries("x", info(), np.arange(n), values), np.zeros(n, np.int8), np.zeros(n, np.int8)
    )
    got = analysis.series_points(h, max_points=10)
    assert got["downsampled"] and got["fields"]["count"] == [50_000_010] * 10
    assert got["fields"]["zeros"] == [30] * 10


def test_series_points_one_per_record_up_to_max_points_and_within_the_step_range():
    arrays = {s: np.float32([s, -1.0, np.nan if s == 7 else 0.5]) for s in range(10)}
    h = _health_of("x", arrays, analysis.SafeRange(max_abs=8.5))
    full = analysis.series_points(h, max_points=10)
    assert full["downsampled"] is False and full["steps"] == full["step_end"] == list(range(10))
    assert full["fields"]["max"] == [0.5] + [float(s) for s in range(1, 10)]
    assert full["fields"]["nan"] == [0] * 7 + [1, 0, 0]
    assert full["health"] == [0] * 7 + [analysis.NONFINITE, 0, analysis.WARNING]
    assert full["kinds"] == [None] * 9 + ["overflow_risk"]
    part = analysis.series_points(h, max_points=10, start=6, end=8)
    assert part["steps"] == [6, 7, 8] and part["fields"]["min"] == [-1.0, -1.0, -1.0]
    assert part["fields"]["mean"][1] == pytest.approx(3.0)  # of the finite values
    with pytest.raises(ValueError, match="max_points"):
        analysis.series_points(h, max_points=0)


def test_series_points_buckets_keep_extremes_worst_health_and_first_warning():
    arrays = {s: np.float32([1.0, 2.0]) for s in range(12)}
    arrays[4] = np.float32([np.inf, 2.0])
    arrays[9] = np.float32([1.0, 50.0])
    arrays[10] = np.float32([1.0, 90.0])
    h = _health_of("x", arrays, analysis.SafeRange(max_abs=40))
    got = analysis.series_points(h, max_points=3)
    assert got["downsampled"] is True
    assert (got["steps"], got["step_end"]) == ([0, 4, 8], [3, 7, 11])
    assert got["health"] == [analysis.HEALTHY, analysis.NONFINITE, analysis.WARNING]
    assert got["kinds"] == [None, None, "overflow_risk"]
    assert got["fields"]["max"] == [2.0, 2.0, 90.0]
    assert got["fields"]["posinf"] == [0, 1, 0] and got["fields"]["count"] == [8, 8, 8]
    # The mean of the bucket's finite means: the +Inf record's finite value counts.
    assert got["fields"]["mean"][1] == pytest.approx((1.5 * 3 + 2.0) / 4)


def test_series_points_moments_an_op_level_record_leaves_out_are_none_not_nan():
    arrays = {s: np.float32([1.0, 2.0] if s != 4 else [np.nan, np.nan]) for s in range(6)}
    s = series("ops/MatMul", arrays, op_type="MatMul")
    s.values[2:, records.F["sum"]] = s.values[2:, records.F["sum_sq"]] = np.nan  # what op_stats writes
    h = analysis.analyze_run("r", [s]).find("ops/MatMul")
    full = analysis.series_points(h, max_points=100)
    for field in ("mean", "std", "l2"):
        assert full["fields"][field][2:4] == [None, None] and full["fields"][field][5] is None
        assert np.isnan(full["fields"][field][4])  # no finite value: NaN, not "not recorded"
    bucketed = analysis.series_points(h, max_points=3)
    assert bucketed["fields"]["mean"][:2] == [1.5, None] and np.isnan(bucketed["fields"]["mean"][2])


@pytest.mark.parametrize("name", ["headroom_steps", "update_ratio_max", "dead_share"])
def test_a_parameter_that_cannot_be_off_needs_a_value(name):
    """Found by the route fuzzer: ``?headroom_steps=`` answered 500."""
    with pytest.raises(analysis.SafeRangeError, match="%s needs a value" % name):
        analysis.parse_safe_range({name: ""})


def test_a_jump_that_the_next_records_undo_is_an_outlier_batch_not_divergence():
    """One outlier batch (x300) that training absorbs: the values come back at the next two
    records. A jump that stays, or that a non-finite record follows, still warns."""
    base = {s: healthy() for s in range(12)}
    absorbed = series("dense/output", {**base, 5: healthy(scale=300.0)})
    assert analysis.first_warning(analysis.analyze_run("r", [absorbed])) is None
    stays = series("dense/output", {**base, **{s: healthy(scale=300.0 * 2 ** (s - 5)) for s in range(5, 12)}})
    assert analysis.first_warning(analysis.analyze_run("r", [stays]))["step"] == 5
    spike = [1.0, 1.2, 0.9, 1.1, 1.0, 4e3, 1.0, 1.1, 0.9]
    assert analysis.first_warning(analysis.analyze_run("r", [norm_series(spike)])) is None
    spike[6] = np.nan  # the step after the spike is not finite: no absorbed outlier
    w = analysis.first_warning(analysis.analyze_run("r", [norm_series(spike)]))
    assert (w["step"], w["kind"]) == (5, "gradient_spike")


def test_an_exact_zero_gradient_norm_that_recovers_is_not_vanishing():
    """A batch with no labelled sample under a masked mean has no gradient at all; a norm of
    exactly 0 that stays (nothing reaches the weights any more) is vanishing."""
    ra = analysis.analyze_run("r", [norm_series([1.0, 1.2, 0.0, 1.1, 0.9])])
    assert analysis.first_warning(ra) is None
    w = analysis.first_warning(analysis.analyze_run("r", [norm_series([1.0, 1.2, 0.0, 0.0, 0.0])]))
    assert (w["step"], w["kind"]) == (2, "vanishing_gradient")


def test_a_long_run_classified_on_two_threads_reads_as_on_one(monkeypatch):
    """A run above ``_PARALLEL_RECORDS`` has its series classified on two
    threads: every row's health and kind, the first anomaly and the first
    warning come out as on one thread, in the same order."""
    from tb_numerics import run_analysis

    steps = range(60)
    base = healthy()  # one tensor scaled up step after step: rising at every record, whatever RNG's state
    grow = [base * 1.6**s for s in steps]
    rows = [
        series("dense%d/output" % i, {s: healthy() if s != 20 + i else with_values(healthy(), a=np.nan) for s in steps},
               order=i)
        for i in range(6)
    ] + [series("dense9/output", dict(zip(steps, grow)), order=9), norm_series(np.r_[np.ones(40), 1e4, np.ones(19)])]
    one = run_analysis.analyze_run("r", rows)
    monkeypatch.setattr(run_analysis, "_PARALLEL_RECORDS", 0)
    two = run_analysis.analyze_run("r", rows)
    assert [h.series.tag for h in two.health] == [h.series.tag for h in one.health]
    for a, b in zip(one.health, two.health):
        np.testing.assert_array_equal(a.codes, b.codes, err_msg=a.series.tag)
        np.testing.assert_array_equal(a.kinds, b.kinds, err_msg=a.series.tag)
    assert analysis.first_anomaly(two) == analysis.first_anomaly(one) and analysis.first_anomaly(one)["step"] == 20
    assert analysis.first_warning(two) == analysis.first_warning(one) is not None
