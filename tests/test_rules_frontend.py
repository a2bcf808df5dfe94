"""The dashboard shows the rules core's kinds, words, codes and number format.

A real ``tensorboard`` process serves the plugin; real Chromium runs its
modules. The frontend holds no copy of the rules (``test_rules.py`` greps
it): it reads them from ``/rules``, and here what the page then shows is
compared with what ``tb_numerics.rules`` defines, so that a kind added on
one side only, or a number formatted two ways, fails.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

playwright_api = pytest.importorskip("playwright.sync_api")

import chromium  # noqa: E402
import tb_process  # noqa: E402

from tb_numerics import metadata, records, rules  # noqa: E402
from tb_numerics.record_writer import NumericsRecordWriter  # noqa: E402

pytestmark = pytest.mark.browser

ENTRY = "/data/plugin_entry.html?name=numerics"
# The run's first warning is a sigmoid pinned at its bounds (a kind whose
# words are not its name), its first anomaly a NaN at step 9.
KIND = "saturation"
NAN_STEP = 9

chromium.require()


def _write(logdir: str) -> str:
    rng = np.random.default_rng(5)
    with NumericsRecordWriter(logdir + "/run") as w:
        for step in range(12):
            x = rng.normal(size=64) if step < 2 else np.ones(64)
            if step >= NAN_STEP:
                x[:3] = np.nan
            w.write("dense/output", step, records.numpy_stats(x.astype(np.float32)),
                    metadata.TensorInfo(role="activation", activation="sigmoid"))
    return logdir


@pytest.fixture(scope="module")
def tb(tmp_path_factory):
    logdir = _write(str(tmp_path_factory.mktemp("rules") / "logs"))
    with tb_process.tensorboard(logdir) as proc:
        tb_process.wait_for(lambda: proc.get_json("/data/plugin/numerics/runs")["runs"], timeout=60)
        yield proc


@pytest.fixture(scope="module")
def page(tb):
    with playwright_api.sync_playwright() as p:
        browser = chromium.launch(p)
        page = browser.new_page()
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(tb.url + ENTRY)
        page.locator(".banner .headline").first.wait_for(timeout=30_000)
        yield page
        assert not errors, errors
        browser.close()


def test_the_route_publishes_the_rules_core(tb):
    assert tb.get_json("/data/plugin/numerics/rules") == json.loads(rules.dumps(rules.published()))


def test_the_dashboard_shows_the_kinds_and_health_words_the_core_defines(page):
    shown = page.evaluate("""async () => {
        const rules = await import("./rules.js");
        const fmt = await import("./format.js");
        return {names: rules.kindNames(), words: rules.kindNames().map((k) => fmt.kind(k))};
    }""")
    assert shown == {"names": list(rules.KIND_NAMES), "words": [k.words for k in rules.KINDS]}
    # The banner's first warning, in the core's words, and the legend's health words.
    kind = page.locator(".banner .kind").first
    assert (kind.get_attribute("title"), kind.inner_text()) == (KIND, rules.kind(KIND).words)
    legend = page.locator(".legend > span").all_inner_texts()
    assert [t.strip() for t in legend] == [h.words for h in rules.HEALTH]


def _table() -> list[float]:
    """Numbers whose words could differ: exact ties (dyadic rationals), the
    edges of plain notation, the dtypes' limits, and random magnitudes."""
    rng = np.random.default_rng(11)
    edges = [0.0, 1.0, 0.5, 1 / 3, 2 / 3, 12345.0, 12250.0, 12350.0, 10.125, 1234.5, 9999.4, 9999.5, 9999.6,
             10000.0, 0.001, 0.00099996, 0.00099994, 0.0009995, 4217953385713646.0, 2.5e-7, 1e308,
             1.7976931348623157e308, 5e-324, 2.2250738585072014e-308, 65504.0, 3.4028234663852886e38, 1e-45,
             99999.5, 100000.0, 0.125, 0.0625, 1.0009765625, 99.995, 123456789.0]
    ties = [float(k) / 2.0 ** int(j) for k, j in zip(rng.integers(1, 1 << 20, 300), rng.integers(0, 24, 300))]
    scaled = (10.0 ** rng.uniform(-12, 40, 600)) * rng.choice([-1, 1], 600)
    f32 = [float(np.float32(x)) for x in rng.normal(size=100) * 10.0 ** rng.integers(-8, 8, 100)]
    return [float(x) for x in edges + [-x for x in edges] + ties + scaled.tolist() + f32]


def test_numbers_read_the_same_in_the_browser_as_in_python(page):
    xs = _table() + [math.nan, math.inf, -math.inf]
    # Shortest round-trip text: the browser parses it to the same double.
    texts = [repr(x) if math.isfinite(x) else {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}[repr(x)]
             for x in xs]
    words = page.evaluate("""async (texts) => {
        const fmt = await import("./format.js");
        return texts.map((t) => fmt.number(Number(t)));
    }""", texts)
    wrong = [(x, w, rules.number(x)) for x, w in zip(xs, words) if w != rules.number(x)]
    assert not wrong, wrong[:20]


def test_counts_and_non_finite_counts_read_the_same(page):
    cases = [(2, 1, 0, 4096), (0, 0, 7, 1), (1234567, 0, 3, 99999999), (0, 5, 0, 5)]
    shown = page.evaluate("""async (cases) => {
        const fmt = await import("./format.js");
        return cases.map(([nan, posinf, neginf, size]) => [fmt.nonfiniteCounts({nan, posinf, neginf, size}), fmt.count(size)]);
    }""", cases)
    want = []
    for nan, posinf, neginf, size in cases:
        v = np.zeros(metadata.NUM_FIELDS)
        for field, n in (("nan", nan), ("posinf", posinf), ("neginf", neginf), ("count", size)):
            v[records.F[field]] = n
        want.append([rules.describe_nonfinite(v), rules.count(size)])
    assert shown == want
