"""Hostile run and tag names: text everywhere, never markup or terminal codes.

Run directories named with HTML/JS, control characters, invalid UTF-8 bytes
and thousands of characters; tags of 10,000 characters, with markup, NUL,
escape sequences and bidi overrides. Each run holds a NaN in a hostile tag,
so the names reach the banners. Checked in the CLI's table and JSON, through
a real TensorBoard (both loaders), and in real Chromium: no dialog, no
injected element, layout within the viewport.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.parse

import numpy as np
import pytest

from tb_numerics import metadata
from tb_numerics.record_writer import NumericsRecordWriter
from tb_numerics.records import numpy_stats

import chromium
from tb_process import tensorboard

# The module's TensorBoard processes serve the e2e tests and the browser test:
# each test carries its own tier.

XSS_IMG = "<img src=x onerror=alert(1)>"
XSS_SCRIPT = "<script>alert(2)</script>"
LONG_TAG = ("<b onmouseover=alert(4)>" + "long/" * 2000)[:10_000]
TAGS = [
    XSS_IMG,
    XSS_SCRIPT,
    LONG_TAG,
    "ctl\x00nul\x1b[2J\x1b]0;pwned\x07\u202eevil\r\x7f",
    "\"quote'amp&lt;entity;`${x}`",
]
NAN_STEP = 3
# Run directory names: relative paths (a "/" makes a nested directory).
RUNS: list[bytes] = [
    XSS_IMG.encode(),
    XSS_SCRIPT.encode(),  # "</script>" nests a directory: the run is named with the slash
    b"ctl\x1b[31mred\x07\r\n\x7fend",
    b"bytes\xff\xfe\x80 not utf-8",
    b"/".join([b"L" * 240 + b"%d" % i for i in range(12)]),  # about 3,000 characters
    b"&amp;<!--\"'",
]
INFO = [metadata.TensorInfo(role="activation", order=i) for i in range(len(TAGS))]


def run_name(raw: bytes) -> str:
    """The run name the CLI and TensorBoard's Python loader give a directory."""
    return os.fsdecode(raw)


def write_logdir(root: str, runs: list[bytes] = RUNS) -> str:
    for raw in runs:
        r = RUNS.index(raw)
        # Written under a plain name, then renamed: TensorFlow's record writer
        # (used once TensorFlow is imported) cannot open a non-UTF-8 path.
        tmp = os.path.join(root, "tmp-run")
        with NumericsRecordWriter(tmp) as w:
            for step in range(6):
                for i, tag in enumerate(TAGS):
                    x = np.linspace(-1, 1, 32, dtype=np.float32)
                    if step == NAN_STEP and i == r % len(TAGS):
                        x[:3] = np.nan
                    w.write(tag, step, numpy_stats(x), INFO[i])
        path = os.path.join(os.fsencode(root), raw)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.rename(os.fsencode(tmp), path)
    return root


@pytest.fixture(scope="module")
def logdir(tmp_path_factory) -> str:
    return write_logdir(str(tmp_path_factory.mktemp("hostile") / "logs"))


def run_cli(*args: str) -> tuple[int, bytes, bytes]:
    p = subprocess.run(
        [sys.executable, "-m", "tb_numerics.cli", *args],
        capture_output=True, timeout=120, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
    )
    return p.returncode, p.stdout, p.stderr


@pytest.mark.e2e
def test_cli_table_escapes_every_name(logdir: str) -> None:
    code, out, err = run_cli("report", logdir)
    assert code == 1, err
    text = out.decode("utf-8")  # the table is valid UTF-8 whatever the names
    # No terminal control character reaches the terminal: only line breaks.
    assert not [c for c in text if c != "\n" and not c.isprintable()]
    assert text.count("first anomaly: step %d" % NAN_STEP) == len(RUNS)
    assert "run ctl\\x1b[31mred\\x07\\x0d\\x0a\\x7fend" in text
    assert "run bytes\\udcff\\udcfe\\udc80 not utf-8" in text
    assert "ctl\\x00nul\\x1b[2J\\x1b]0;pwned\\x07\\u202eevil\\x0d\\x7f" in text
    assert "run %s\n" % XSS_SCRIPT in text and "run %s\n" % XSS_IMG in text


@pytest.mark.e2e
def test_cli_json_keeps_every_name_exactly(logdir: str) -> None:
    code, out, _ = run_cli("report", logdir, "--json")
    assert code == 1
    runs = {r["run"]: r for r in json.loads(out)["runs"]}
    assert set(runs) == {run_name(raw) for raw in RUNS}
    for r, raw in enumerate(RUNS):
        a = runs[run_name(raw)]["first_anomaly"]
        assert (a["step"], a["tensor"]) == (NAN_STEP, TAGS[r % len(TAGS)])


# TensorBoard's Python loader (tf.io.gfile.walk) dies on a directory name
# that is not UTF-8, and then serves no run at all: upstream, out of the
# plugin's reach. That loader gets the other runs.
UTF8_RUNS = [raw for raw in RUNS if b"\xff" not in raw]


@pytest.fixture(scope="module", params=[True, False], ids=["load_fast", "python_loader"])
def served(request, logdir: str, tmp_path_factory):
    root = logdir if request.param else write_logdir(str(tmp_path_factory.mktemp("hostile_py") / "logs"), UTF8_RUNS)
    n = len(RUNS) if request.param else len(UTF8_RUNS)
    with tensorboard(root, load_fast=request.param) as tb:
        tb.wait_for_runs(n)
        yield tb, request.param


def _q(name: str) -> str:
    return urllib.parse.quote(name.encode("utf-8", "surrogateescape"), safe="")


@pytest.mark.e2e
def test_tensorboard_serves_every_name_as_data(served) -> None:
    tb, load_fast = served
    runs = [r["run"] for r in tb.get_json("/data/plugin/numerics/runs")["runs"]]
    # The Rust data server names the non-UTF-8 directory with U+FFFD.
    expected = {run_name(raw) for raw in UTF8_RUNS} | ({"bytes\ufffd\ufffd\ufffd not utf-8"} if load_fast else set())
    assert set(runs) == expected
    for name in runs:
        s = tb.get_json("/data/plugin/numerics/summary?run=" + _q(name))
        assert s["run"] == name
        a = s["first_anomaly"]
        assert a["step"] == NAN_STEP and a["tensor"] in TAGS
        timeline = tb.get_json("/data/plugin/numerics/timeline?width=10&run=" + _q(name))
        assert sorted(r["tensor"] for r in timeline["rows"]) == sorted(TAGS)
        for tag in TAGS:
            series = tb.get_json("/data/plugin/numerics/series?run=%s&tensor=%s" % (_q(name), _q(tag)))
            assert series["tensor"] == tag and len(series["steps"]) == 6


ENTRY = "/data/plugin_entry.html?name=numerics"

# Elements or attributes that would mean a name was parsed as markup.
INJECTED = """() => {
  const all = [...document.querySelectorAll('*')];
  return {
    elements: document.querySelectorAll('img, iframe, object, embed, b, svg script, .numerics script').length,
    handlers: all.filter(e => [...e.attributes].some(a => a.name.startsWith('on'))).map(e => e.tagName),
    scripts: [...document.scripts].filter(s => s.textContent.includes('alert')).length,
    overflow: document.documentElement.scrollWidth - document.documentElement.clientWidth,
    banners: [...document.querySelectorAll('.banner')].map(b => b.getBoundingClientRect().right),
    viewport: window.innerWidth,
    text: document.body.innerText,
  };
}"""


@pytest.mark.browser
def test_dashboard_shows_hostile_names_as_inert_text(served) -> None:
    from playwright.sync_api import sync_playwright

    chromium.require()

    tb, _ = served
    runs = [r["run"] for r in tb.get_json("/data/plugin/numerics/runs")["runs"]]
    with sync_playwright() as p:
        browser = chromium.launch(p)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(20_000)
            dialogs: list[str] = []
            errors: list[str] = []
            page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
            page.on("pageerror", lambda e: errors.append(str(e)))
            seen = []
            # One run at a time, each compared with the next (the comparison names both).
            for k, run in enumerate(runs):
                other = runs[(k + 1) % len(runs)]
                hash_ = "#" + urllib.parse.urlencode([("run", run), ("compare", other), ("tensor", XSS_IMG)])
                page.goto(tb.url + ENTRY + hash_)
                page.wait_for_function("r => document.querySelector('.banner-row')?.dataset.run === r", arg=run)
                page.locator(".timeline canvas").first.wait_for()
                page.locator(".comparison .banner").wait_for()
                # Hover and click through the hostile names: the banners' buttons, the timeline.
                for button in page.locator("button.show-anomaly, button.show-departure").all():
                    button.click()
                box = page.locator(".timeline canvas").first.bounding_box()
                for fx in (0.3, 0.6, 0.9):
                    page.mouse.move(box["x"] + box["width"] * fx, box["y"] + box["height"] / 2)
                page.wait_for_timeout(300)
                seen.append(page.evaluate(INJECTED))
        finally:
            browser.close()
    assert dialogs == [] and errors == []
    for one in seen:
        assert (one["elements"], one["handlers"], one["scripts"]) == (0, [], 0)
        assert one["overflow"] <= 0 and max(one["banners"]) <= one["viewport"]
    text = "\n".join(one["text"] for one in seen)
    # The names are there, as the characters they are.
    for name in (XSS_IMG, XSS_SCRIPT, "&amp;<!--\"'"):
        assert name in text
