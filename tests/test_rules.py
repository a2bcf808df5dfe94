"""The rules core (``tb_numerics.rules``): every warning kind by name, the
health codes, the number format and the one JSON rule.

Each kind has a case below that raises it through the whole analysis
(``analyze_run`` and ``run_summary``, as the report and the HTTP API do), so
that adding a kind without its case fails here, and a kind whose mask or
detail reads a safe-range field it does not declare fails too (a kind is
handed its declared fields only).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re

import numpy as np
import pytest

from tb_numerics import analysis, cli, metadata, records, rules, safe_range
from tb_numerics.record_writer import NumericsRecordWriter
from tb_numerics.records import numpy_stats

pytestmark = pytest.mark.unit

RNG = np.random.default_rng(3)


def _series(tag, arrays, dtype="float32", **info):
    i = metadata.TensorInfo(dtype=dtype, **{"role": "activation", **info})
    return records.make_series(tag, i, range(len(arrays)), [numpy_stats(np.asarray(a, dtype), dtype) for a in arrays])


def _noise(n=64, scale=1.0):
    return RNG.normal(size=n) * scale


def _norms(values):
    return _series("gradients/global_norm", [[v] for v in values], role="global_norm", order=99)


def _depth(first_scale, last_scale):
    """Two layers' kernel gradients, the last layer's first (backward order)."""
    last = _series("gradients/dense_2/kernel", [_noise(16, last_scale) for _ in range(8)], role="gradient", order=1,
                   shape=(4, 4))
    first = _series("gradients/dense_1/kernel", [_noise(16, first_scale) for _ in range(8)], role="gradient",
                    order=2, shape=(4, 4))
    return [last, first]


def _skipped():
    bad = np.r_[np.inf, _noise(15)]
    grads = _series("gradients/w", [bad if s in (2, 3) else _noise(16) for s in range(8)], role="gradient")
    scale = _series("loss_scale", [[2.0**15]] * 3 + [[2.0**14]] * 5, role="loss_scale", order=9)
    return [grads, scale]


def _sr(**kw):
    return analysis.SafeRange(**kw)


# kind -> (the run's series, the safe range) that raises it.
CASES = {
    "overflow_risk": lambda: ([_series("x", [_noise(), _noise(scale=100)])], _sr(max_abs=50)),
    "exploding_gradient": lambda: ([_norms([1.0, 2.0, 5.0])], _sr(grad_norm_limit=3.0)),
    "gradient_spike": lambda: ([_norms([1.0, 1.1, 0.9, 1.0, 1.2, 1.0, 30.0, 1.0])], _sr()),
    "square_overflow": lambda: ([_series("gradients/w", [_noise(), _noise(scale=1e20)], role="gradient",
                                         squared_by="Adam")], _sr()),
    "fast_growth": lambda: ([_series("x", [_noise(), _noise(scale=1e4)])], _sr()),
    "headroom": lambda: ([_series("x", [np.full(8, 100.0 * 10.0**k) for k in range(12)])], _sr()),
    "growth": lambda: ([_series("x", [np.full(8, 100.0 * 2.0**k) for k in range(12)])], _sr()),
    "exploding_by_depth": lambda: (_depth(1e3, 1.0), _sr()),
    "vanishing_gradient": lambda: ([_norms([1.0, 1e-3, 1e-12])], _sr()),
    "vanishing_by_depth": lambda: (_depth(1e-6, 1.0), _sr()),
    "underflow": lambda: ([_series("x", [_noise(), np.r_[np.ones(5), np.full(5, 1e-40)]])], _sr()),
    "dead_units": lambda: ([_series("dense/output", [np.r_[np.zeros(56), np.ones(8)]] * 6, activation="relu")],
                           _sr()),
    "saturation": lambda: ([_series("dense/output", [np.ones(64)] * 6, activation="sigmoid")], _sr()),
    "update_ratio": lambda: ([_series("update_ratio/dense", [[0.01], [3.0]], role="other")], _sr()),
    "loss_not_decreasing": lambda: ([_series("loss", [[1.0 + 0.01 * (s % 3)] for s in range(60)], role="loss")],
                                    _sr()),
    "loss_oscillating": lambda: ([_series("loss", [[1.0 if s % 2 else 20.0] for s in range(60)], role="loss")],
                                 _sr()),
    "skipped_step": lambda: (_skipped(), _sr()),
}


def test_every_kind_has_a_case_here():
    assert sorted(CASES) == sorted(rules.KIND_NAMES)


@pytest.mark.parametrize("name", rules.KIND_NAMES)
def test_each_kind_is_raised_with_its_detail_and_hint(name):
    series, sr = CASES[name]()
    summary = analysis.run_summary(analysis.analyze_run("r", series, sr))
    found = [w for w in summary["warnings"] + summary["info"] if w["kind"] == name]
    assert found, (name, summary["warnings"], summary["info"])
    k = rules.kind(name)
    assert found[0]["hint"] == k.hint and found[0]["detail"], found[0]
    assert (name in [i["kind"] for i in summary["info"]]) == k.info
    # Switched off, it is gone.
    off = analysis.run_summary(analysis.analyze_run("r", series, dataclasses.replace(sr, off=(name,))))
    assert name not in [w["kind"] for w in off["warnings"] + off["info"]]


def test_each_kind_declares_what_it_reads_and_has_one_mask():
    fields = {f.name for f in dataclasses.fields(safe_range.SafeRange)}
    read = set()
    for k in rules.KINDS:
        assert k.words and k.hint and (k.mask is None) != (k.marks is None), k.name
        assert set(k.params) <= fields, k.name
        read |= set(k.params)
        assert set(vars(k.parameters(safe_range.SafeRange()))) == set(k.params)
    # Every field is some rule's: the kinds', the non-finite rule's, or the switch.
    assert fields - read == {"allow_neginf", "off"}
    assert len(set(rules.KIND_NAMES)) == len(rules.KINDS)
    assert len({k.words for k in rules.KINDS}) == len(rules.KINDS)


def test_published_rules_are_the_cores_own():
    pub = json.loads(rules.dumps(rules.published()))
    assert [k["name"] for k in pub["kinds"]] == list(rules.KIND_NAMES)
    assert [(k["code"], k["words"], k["early"], k["info"]) for k in pub["kinds"]] == [
        (rules.kind_code(k.name), k.words, k.early, k.info) for k in rules.KINDS]
    assert {h["name"]: h["code"] for h in pub["health"]} == {
        "healthy": rules.HEALTHY, "warning": rules.WARNING, "nonfinite": rules.NONFINITE, "nodata": rules.NO_DATA}
    # Codes are ordered by severity: a bucket's worst health is its maximum.
    assert rules.NO_DATA < rules.HEALTHY < rules.WARNING < rules.NONFINITE
    assert pub["number"] == rules.NUMBER_FORMAT


@pytest.mark.parametrize("x, words", [
    (4217953385713646.0, "4.22e15"), (4000.0, "4000"), (0.0123, "0.0123"), (2.5e-7, "2.5e-7"),
    (12345, "1.23e4"), (-12345, "-1.23e4"), (1234.5, "1235"), (10.125, "10.13"), (12250, "1.23e4"),
    (9999.4, "9999"), (9999.6, "1e4"), (0.00099996, "0.001"), (0.00012345, "1.23e-4"), (0.0, "0"), (-0.0, "0"),
    (5e-324, "4.94e-324"), (float("nan"), "NaN"), (float("inf"), "+Inf"), (float("-inf"), "-Inf"),
])
def test_one_number_format(x, words):
    """Ties round half away from zero (10.125 is exact in binary), as the
    browser's toPrecision does; the range of plain notation is decided on
    the rounded value (9999.6 is "1e4")."""
    assert rules.number(x) == words
    assert rules.number(np.float32(x)) == rules.number(float(np.float32(x)))


def test_non_finite_counts_in_words():
    v = numpy_stats(np.array([np.nan, np.nan, np.inf, 1.0] + [0.0] * 4092, np.float32))
    assert rules.describe_nonfinite(v) == "2 NaN, 1 +Inf of 4,096 values"
    assert rules.describe_nonfinite(numpy_stats(np.ones(1, np.float32))) == "no non-finite values of 1 value"


def _strict(text):
    def refuse(name):
        raise ValueError("not JSON: %s" % name)
    return json.loads(text, parse_constant=refuse)


def test_json_writes_non_finite_numbers_as_tensorboard_does():
    body = {"a": [np.float32("nan"), math.inf, -math.inf, np.int64(7), (1.5, np.bool_(True))], "b": np.arange(2.0)}
    assert _strict(rules.dumps(body)) == {"a": ["NaN", "Infinity", "-Infinity", 7, [1.5, True]], "b": [0.0, 1.0]}
    with pytest.raises(TypeError):
        rules.dumps({"x": object()})


def test_the_reports_json_follows_the_same_rule(tmp_path, capsys):
    """A replay's op inputs hold an infinite max (untrusted JSON written by
    Python's json, "Infinity"): the report's --json is valid JSON with the
    HTTP API's "Infinity", not a literal, not a null."""
    with NumericsRecordWriter(str(tmp_path / "run")) as w:
        for step in range(4):
            x = np.r_[np.nan, _noise(15)] if step == 3 else _noise(16)
            w.write("dense/output", step, numpy_stats(x.astype(np.float32)), metadata.TensorInfo(role="activation"))
        verdict = {"step": 3, "reproduced": True, "op": {"name": "dense/Log", "type": "Log", "source": "m.py:3 (f)",
                                                         "phase": "forward", "inputs": [{"min": 0.0, "max": math.inf}]}}
        w.write(metadata.REPLAY_TAG, 3, numpy_stats(np.zeros(0, np.float32)),
                metadata.TensorInfo(role="other", description=json.dumps(verdict)))
    assert cli.main(["report", str(tmp_path), "--json"]) == cli.EXIT_ANOMALY
    run = _strict(capsys.readouterr().out)["runs"][0]
    assert run["first_anomaly"]["op"]["inputs"] == [{"min": 0.0, "max": "Infinity"}]
    assert cli.main(["report", str(tmp_path)]) == cli.EXIT_ANOMALY
    assert "input 1: min 0, max +Inf" in capsys.readouterr().out


def _frontend_code() -> dict[str, str]:
    """Each frontend module's code with its comments left out."""
    folder = pathlib.Path(__file__).resolve().parent.parent / "frontend"
    comments = re.compile(r"/\*.*?\*/|(?<![:\"'\\])//[^\n]*", re.S)
    return {p.name: comments.sub("", p.read_text()) for p in sorted(folder.glob("*.js"))}


def test_the_frontend_holds_no_copy_of_the_rules():
    """Kinds, their words and the health words come from /rules
    (``test_rules_frontend.py`` checks what the page shows): a kind spelled
    in the frontend's code (a table of words, a comparison with a name) is a
    second definition that a kind added on one side only would escape."""
    spelled = [(k.name, "a warning kind") for k in rules.KINDS] + [(k.words, "a kind's words") for k in rules.KINDS]
    # A health's name is also its colour (a CSS class): its words are checked where they are more than that.
    spelled += [(h.words, "a health's words") for h in rules.HEALTH if h.words != h.name]
    code = _frontend_code()
    assert "rules.js" in code and "format.js" in code
    found = [(name, what, text) for name, js in code.items() for text, what in spelled
             if any(q + text + q in js for q in "\"'`") or re.search(r"[{,]\s*%s\s*:" % re.escape(text), js)]
    assert not found, found


# The reading side: the numpy modules that read, analyse and serve records.
# (The writing side, with TensorFlow, keeps its twin of the rule beside
# stats.py; see the split of issue 29.)
_READING_SIDE = [
    "analysis.py", "cli.py", "detectors.py", "diagnosis.py", "event_files.py", "event_reader.py", "health.py",
    "file_provider.py", "hints.py", "logdir_provider.py", "packed.py", "plugin.py", "provider_reads.py", "run_analysis.py",
    "run_store.py", "safe_range.py", "scalars.py", "tfrecord.py", "views.py", "rules/codes.py", "rules/kinds.py",
    "rules/nonfinite.py", "rules/numbers.py", "rules/__init__.py",
]


def test_the_reading_side_counts_non_finite_values_one_way():
    """``records.nonfinite_count`` is the numpy rule's one home: no reading
    module adds up NaN and Inf counts (or tests them together) itself."""
    package = pathlib.Path(__file__).resolve().parent.parent / "tb_numerics"
    found = []
    for name in _READING_SIDE:
        for n, line in enumerate((package / name).read_text().splitlines(), 1):
            counts = re.findall(r'F\[\s*"(nan|posinf|neginf)"\s*\]', line)
            if len(counts) >= 2 or "NONFINITE_FIELDS" in line:
                found.append("%s:%d: %s" % (name, n, line.strip()))
    assert not found, found
