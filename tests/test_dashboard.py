"""The Numerics dashboard in real Chromium against a real TensorBoard.

One tensorboard process and one browser serve the whole module; each test
opens its own page. The logdir (tests/dashboard_logdir.py) has a known NaN at
step 150 of ``loss/Sqrt_grad``, a gradient spike at step 140, a tensor that
crosses max |x| = 5 at step 81, a tag named ``<img src=x onerror=alert(1)>``
and a very long tag name.
"""

from __future__ import annotations

import os
import re
import struct
import urllib.parse
import zlib

import pytest

playwright_api = pytest.importorskip("playwright.sync_api")

import chromium  # noqa: E402
import dashboard_logdir as data  # noqa: E402
import tb_process  # noqa: E402

pytestmark = pytest.mark.browser

# Assertions on the page retry until they hold (or this many ms pass): the
# dashboard updates asynchronously, and CI machines are slow.
expect = playwright_api.expect
expect.set_options(timeout=30_000)

ENTRY = "/data/plugin_entry.html?name=numerics"
TIMEOUT_MS = 20_000

chromium.require()


@pytest.fixture(scope="module")
def tb(tmp_path_factory):
    logdir = data.write(str(tmp_path_factory.mktemp("dash") / "logs"))
    with tb_process.tensorboard(logdir) as proc:
        # TensorBoard reads the logdir in the background: wait until the plugin sees both runs.
        proc.wait_for_runs(2)
        yield proc


@pytest.fixture(scope="module")
def tb_more(tmp_path_factory):
    """TensorBoard on dashboard_logdir.write_more's runs (masked, ops, repeated)."""
    logdir = data.write_more(str(tmp_path_factory.mktemp("dash_more") / "logs"))
    with tb_process.tensorboard(logdir) as proc:
        proc.wait_for_runs(3)
        yield proc


class Page:
    """A page with every dialog and page error recorded (and dialogs dismissed)."""

    def __init__(self, browser, color_scheme="light"):
        self.context = browser.new_context(viewport={"width": 1400, "height": 1000}, color_scheme=color_scheme)
        self.page = self.context.new_page()
        self.page.set_default_timeout(TIMEOUT_MS)
        self.dialogs: list[str] = []
        self.errors: list[str] = []
        self.page.on("dialog", lambda d: (self.dialogs.append(d.message), d.dismiss()))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))


@pytest.fixture
def open_page(browser):
    pages = []

    def opener(color_scheme="light"):
        pages.append(Page(browser, color_scheme))
        return pages[-1]

    yield opener
    for p in pages:
        assert not p.errors, "uncaught errors in the page: %s" % p.errors
        p.context.close()


def dashboard(open_page, tb, hash_="", color_scheme="light"):
    """The plugin's entry page alone (as TensorBoard's iframe loads it), banners drawn."""
    p = open_page(color_scheme)
    p.page.goto(tb.url + ENTRY + hash_)
    p.page.locator(".banner .headline").first.wait_for()
    p.page.locator(".timeline canvas").first.wait_for()
    return p


def open_safe_range(page):
    """Unfolds the safe-range form (folded behind its toggle on the first screen)."""
    toggle = page.locator(".safe-range-toggle")
    if toggle.get_attribute("aria-expanded") != "true":
        toggle.click()


def banner_row(page, run):
    return page.locator('.banner-row[data-run="%s"]' % run)


def png_pixels(png: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB(A) bytes) of an 8-bit PNG, unfiltered."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", 0
    while pos < len(png):
        (length,) = struct.unpack(">I", png[pos : pos + 4])
        kind, body = png[pos + 4 : pos + 8], png[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and colour in (2, 6), (depth, colour)
            bpp = 3 if colour == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = width * bpp
    rows, prev = [], bytearray(stride)
    for y in range(height):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                pa, pb, pc = abs(b - c), abs(a - c), abs(a + b - 2 * c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return width, height, rows


def colour_variety(png: bytes, step: int = 4) -> int:
    """How many distinct colours a sample of the image's pixels has."""
    width, _, rows = png_pixels(png)
    bpp = len(rows[0]) // width
    seen = set()
    for row in rows[::step]:
        for x in range(0, width, step):
            seen.add(row[x * bpp : x * bpp + 3])
    return len(seen)


# ---------------------------------------------------------------- tests


def test_numerics_tab_appears_in_tensorboard_and_loads_the_dashboard(open_page, tb):
    p = open_page()
    p.page.goto(tb.url + "/#numerics")
    p.page.get_by_text("Numerics", exact=True).first.wait_for()
    frame = p.page.frame_locator('iframe[src*="plugin_entry.html?name=numerics"]')
    headline = banner_row(frame, data.NAN_RUN).locator(".banner.anomaly .headline")
    assert headline.inner_text() == "First non-finite value at step %d" % data.NAN_STEP


def test_banner_says_where_the_first_nan_is_and_what_came_before(open_page, tb):
    page = dashboard(open_page, tb).page
    anomaly = banner_row(page, data.NAN_RUN).locator(".banner.anomaly")
    text = anomaly.inner_text()
    assert "First non-finite value at step 150" in text
    assert "%s (op Sqrt, backward pass): 2 NaN, 1 +Inf of 4,096 values." % data.NAN_TENSOR in text
    assert "Last healthy step of this tensor: 149 (inside the safe range, no NaN/Inf)." in text
    assert "gradient of sqrt is infinite at 0" in anomaly.locator(".hint").inner_text()
    assert "Likely cause: global_norm at step 140" in anomaly.locator(".cause").inner_text()
    warning = banner_row(page, data.NAN_RUN).locator(".banner.warning")
    assert "First warning at step %d" % data.SPIKE_STEP in warning.inner_text()
    assert "gradient spike" in warning.inner_text()
    # The first anomaly is what is selected, in the charts and in the link.
    assert page.locator(".selected-name .tensor-name").inner_text() == data.NAN_TENSOR
    assert "tensor=loss%2FSqrt_grad" in page.evaluate("location.hash")
    assert "step=150" in page.evaluate("location.hash")
    # One run at a time: the other run's banner is one pick away.
    expect(page.locator(".banner-row")).to_have_count(1)
    page.get_by_label("Run", exact=True).select_option(data.HEALTHY_RUN)
    expect(banner_row(page, data.HEALTHY_RUN).locator(".banner.healthy")).to_contain_text("Healthy: no NaN or Inf")


def cell_point(page, run, tensor, step, steps_in_run):
    """Viewport (x, y) of a tensor's cell at a step (one bucket per step here)."""
    block = page.locator('.timeline-run[data-run="%s"]' % run)
    label = block.locator(".label.row", has_text=tensor).first.bounding_box()
    canvas = block.locator("canvas").bounding_box()
    return canvas["x"] + (step + 0.5) / steps_in_run * canvas["width"], label["y"] + label["height"] / 2


def test_hovering_a_cell_shows_its_numbers_and_clicking_it_updates_the_charts(open_page, tb):
    page = dashboard(open_page, tb).page
    x, y = cell_point(page, data.NAN_RUN, data.NAN_TENSOR, data.NAN_STEP, 200)
    page.mouse.move(x, y)
    tip = page.locator('.timeline-run[data-run="%s"] .tooltip' % data.NAN_RUN)
    page.wait_for_function("t => t.innerText.includes('4,096')", arg=tip.element_handle())
    assert "Step 150 · non-finite" in tip.inner_text()
    assert "2 NaN, 1 +Inf of 4,096 values" in tip.inner_text()

    x, y = cell_point(page, data.NAN_RUN, data.GROWING_TENSOR, 100, 200)
    page.mouse.click(x, y)
    name = page.locator(".selected-name .tensor-name")
    page.wait_for_function("n => n.innerText === 'dense1/output'", arg=name.element_handle())
    assert re.search(r"step=(99|100|101)\b", page.evaluate("location.hash"))
    # The range chart now draws dense1/output: max |x| = 1 + 0.05 * step.
    chart = page.locator(".chart").first.locator("canvas")
    chart.scroll_into_view_if_needed()
    box = chart.bounding_box()
    page.mouse.move(box["x"] + box["width"] * 0.75, box["y"] + box["height"] / 2)
    readout = page.locator(".chart").first.locator(".readout")
    page.wait_for_function("r => r.innerText.startsWith('Step')", arg=readout.element_handle())
    readout = readout.inner_text()
    m = re.match(r"Step (\d+): min (\S+) · max (\S+) · max \|x\| (\S+)", readout)
    assert m, readout
    assert float(m.group(4)) == pytest.approx(1 + 0.05 * int(m.group(1)), rel=1e-3)


def test_keyboard_moves_the_selection_in_the_timeline(open_page, tb):
    page = dashboard(open_page, tb).page
    canvas = page.locator('.timeline-run[data-run="%s"] canvas' % data.NAN_RUN)
    # The keys move from the selection: wait until it is the first anomaly.
    expect(page.locator(".selected-name .tensor-name")).to_have_text(data.NAN_TENSOR)
    page.wait_for_function("() => location.hash.includes('step=%d')" % data.NAN_STEP)
    canvas.focus()
    # From the first anomaly (loss/Sqrt_grad, step 150): up one row, left two steps.
    for key in ("ArrowUp", "ArrowLeft", "ArrowLeft", "Enter"):
        page.keyboard.press(key)
    name = page.locator(".selected-name .tensor-name")
    page.wait_for_function(
        "t => document.querySelector('.selected-name .tensor-name').innerText === t", arg=data.LONG_TAG
    )
    page.wait_for_function("() => location.hash.includes('step=148')")
    assert name.inner_text() == data.LONG_TAG


def test_dragging_on_a_chart_zooms_timeline_and_charts_to_that_step_range(open_page, tb):
    page = dashboard(open_page, tb, "#run=diverging").page
    chart = page.locator(".chart").first.locator("canvas")
    chart.scroll_into_view_if_needed()
    page.locator(".chart .chart-legend span").first.wait_for()
    box = chart.bounding_box()
    y = box["y"] + box["height"] / 2
    page.mouse.move(box["x"] + box["width"] * 0.4, y)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * 0.6, y, steps=5)
    page.mouse.up()
    page.wait_for_function("() => /start=\\d+&end=\\d+/.test(location.hash)")
    # The link changes at once and the timeline follows when read: the loading line
    # ("Loading…" from the same task that set the link) empties once it has.
    expect(page.locator(".loading-line")).to_have_text("", timeout=30000)
    start, end = map(int, re.search(r"start=(\d+)&end=(\d+)", page.evaluate("location.hash")).groups())
    assert 40 < start < end < 160, (start, end)
    expect(page.get_by_label("First step")).to_have_value(str(start))
    expect(page.get_by_label("Last step")).to_have_value(str(end))
    # The timeline was asked again for that range: its first column is the range's first step.
    block = page.locator('.timeline-run[data-run="diverging"]')
    block.scroll_into_view_if_needed()
    label = block.locator(".label.row", has_text="input").first.bounding_box()
    canvas = block.locator("canvas").bounding_box()
    page.mouse.move(canvas["x"] + 1, label["y"] + label["height"] / 2)
    tip = block.locator(".tooltip")
    page.wait_for_function("t => !t.hidden", arg=tip.element_handle())
    assert tip.inner_text().split("\n")[1].startswith("Step %d ·" % start)
    page.get_by_role("button", name="All steps").click()
    page.wait_for_function("() => !location.hash.includes('start=')")


def test_lowering_max_abs_moves_the_first_warning_and_is_kept_in_the_link(open_page, tb):
    page = dashboard(open_page, tb).page
    warning = banner_row(page, data.NAN_RUN).locator(".banner.warning .headline")
    assert warning.inner_text().startswith("First warning at step 140")
    open_safe_range(page)
    page.get_by_label("Max |x|", exact=True).fill("5")
    page.get_by_label("Max |x|", exact=True).press("Enter")
    # The banners are rebuilt from the new /summary: wait on the selector, not the old node.
    page.wait_for_function(
        "() => document.querySelector('.banner-row[data-run=diverging] .banner.warning .headline')"
        "?.innerText.startsWith('First warning at step 81')"
    )
    assert data.GROWING_TENSOR in banner_row(page, data.NAN_RUN).locator(".banner.warning").inner_text()
    link = page.evaluate("location.hash")
    assert "max_abs=5" in link

    # The link reproduces the view in a fresh page.
    again = dashboard(open_page, tb, link).page
    expect(again.get_by_label("Max |x|", exact=True)).to_have_value("5")
    expect(banner_row(again, data.NAN_RUN).locator(".banner.warning .headline")).to_have_text(
        re.compile(r"^First warning at step 81")
    )


def test_a_link_restores_tensor_zoom_and_runs(open_page, tb):
    page = dashboard(open_page, tb, "#run=diverging&tensor=dense1%2Foutput&step=100&start=50&end=180&log=1").page
    expect(page.locator(".selected-name .tensor-name")).to_have_text(data.GROWING_TENSOR)
    expect(page.get_by_label("First step")).to_have_value("50")
    expect(page.get_by_label("Last step")).to_have_value("180")
    expect(page.locator(".log-toggle")).to_have_attribute("aria-pressed", "true")
    expect(page.locator(".banner-row")).to_have_count(1)
    expect(page.get_by_label("Run", exact=True)).to_have_value(data.NAN_RUN)
    expect(page.get_by_label("Compare with")).to_have_value("")


def test_two_runs_are_compared_in_the_charts(open_page, tb):
    page = dashboard(open_page, tb, "#run=diverging&compare=healthy&tensor=dense1%2Foutput").page
    expect(page.locator(".banner-row")).to_have_count(1)
    expect(page.locator(".timeline-run")).to_have_count(1)
    legend = page.locator(".chart").first.locator(".chart-legend")
    page.wait_for_function("l => l.innerText.includes('max |x| · healthy')", arg=legend.element_handle())


def test_a_malformed_parameter_is_marked_and_the_rest_is_kept(open_page, tb):
    """Issue 30 item 7: a bad value marks its field with the server's message;
    the dashboard still answers with the other parameters (max_abs=5 moves
    the first warning to step 81: the good parameter is used)."""
    p = open_page()
    p.page.goto(tb.url + ENTRY + "#max_abs=abc&grad_norm_limit=1e9&spike_factor=1e9")
    field = p.page.get_by_label("Max |x|", exact=True)
    expect(field).to_have_attribute("aria-invalid", "true")
    expect(p.page.locator(".safe-range .field-error:not([hidden])")).to_have_text(["Not used: max_abs must be a number, got 'abc'"])
    expect(p.page.locator(".safe-range-panel")).to_be_visible()
    expect(p.page.locator(".safe-range-toggle")).to_contain_text("1 refused")
    expect(banner_row(p.page, data.NAN_RUN).locator(".banner.anomaly .headline")).to_have_text("First non-finite value at step 150")
    # The spike factor of the link is applied: no spike warning at step 140 any more.
    expect(banner_row(p.page, data.NAN_RUN).locator(".banner.warning")).to_have_count(0)
    expect(p.page.locator(".status.error")).to_be_hidden()
    assert "max_abs=abc" in p.page.evaluate("location.hash")


# A valid value, not the default, of each safe-range parameter of http_api.md.
PARAM_VALUES = {
    "max_abs": "5",
    "grad_norm_limit": "1000",
    "spike_factor": "50",
    "spike_window": "7",
    "vanishing_floor": "0",
    "underflow_share": "0.5",
    "allow_neginf": "attention/*,*/mask",
}


def test_every_safe_range_parameter_has_a_field_and_lives_in_the_link(open_page, tb):
    published = tb.get_json("/data/plugin/numerics/safe_range")["params"]
    assert set(PARAM_VALUES) <= set(published)
    p = open_page()
    asked = []
    p.page.on("request", lambda r: asked.append(r.url) if "/summary?" in r.url else None)
    link = "#run=diverging&" + "&".join("%s=%s" % (k, urllib.parse.quote(v, safe="")) for k, v in PARAM_VALUES.items())
    p.page.goto(tb.url + ENTRY + link)
    for key, value in PARAM_VALUES.items():
        expect(p.page.locator('.safe-range input[name="%s"]' % key)).to_have_value(value)
    # A parameter the server adds gets its field too, its help text as the title.
    for key, help_text in published.items():
        expect(p.page.locator('.safe-range input[name="%s"]' % key)).to_have_attribute("title", "%s: %s" % (key, help_text))
    # The routes are asked with every one of them (max_abs=5 moves the first warning to step 81).
    expect(banner_row(p.page, data.NAN_RUN).locator(".banner.warning .headline")).to_have_text(
        re.compile(r"^First warning at step 81")
    )
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(asked[-1]).query)
    assert {k: query[k][0] for k in PARAM_VALUES} == PARAM_VALUES

    # A field changed in the form joins the others in the link, and the link reproduces the form.
    open_safe_range(p.page)
    field = p.page.locator('.safe-range input[name="spike_window"]')
    field.fill("9")
    field.press("Enter")
    p.page.wait_for_function("() => location.hash.includes('spike_window=9')")
    hash_ = p.page.evaluate("location.hash")
    kept = urllib.parse.parse_qs(hash_[1:])
    assert {k: kept[k][0] for k in PARAM_VALUES} == dict(PARAM_VALUES, spike_window="9")
    again = dashboard(open_page, tb, hash_).page
    for key, value in dict(PARAM_VALUES, spike_window="9").items():
        expect(again.locator('.safe-range input[name="%s"]' % key)).to_have_value(value)


def test_allow_neginf_control_moves_the_first_anomaly_and_is_kept_in_the_link(open_page, tb_more):
    page = dashboard(open_page, tb_more, "#run=%s" % data.MASKED_RUN).page
    headline = banner_row(page, data.MASKED_RUN).locator(".banner.anomaly .headline")
    expect(headline).to_have_text("First non-finite value at step 0")
    assert data.MASKED_TENSOR in banner_row(page, data.MASKED_RUN).locator(".banner.anomaly").inner_text()
    open_safe_range(page)
    field = page.get_by_label("Allow -Inf in (tag patterns)")
    field.fill("attention/*")
    field.press("Enter")
    page.wait_for_function(
        "() => document.querySelector('.banner-row[data-run=masked] .banner.anomaly .headline')"
        "?.innerText === 'First non-finite value at step %d'" % data.MASKED_NAN_STEP
    )
    link = page.evaluate("location.hash")
    assert "allow_neginf=attention%2F*" in link
    again = dashboard(open_page, tb_more, link).page
    expect(again.get_by_label("Allow -Inf in (tag patterns)")).to_have_value("attention/*")
    expect(banner_row(again, data.MASKED_RUN).locator(".banner.anomaly .headline")).to_have_text(
        "First non-finite value at step %d" % data.MASKED_NAN_STEP
    )


def test_invalid_parameters_are_each_marked_and_fixed_one_at_a_time(open_page, tb):
    p = open_page()
    p.page.goto(tb.url + ENTRY + "#spike_window=0&underflow_share=2")
    window = p.page.locator('.safe-range input[name="spike_window"]')
    share = p.page.locator('.safe-range input[name="underflow_share"]')
    expect(window).to_have_attribute("aria-invalid", "true")
    expect(share).to_have_attribute("aria-invalid", "true")
    expect(p.page.locator(".safe-range .field-error:not([hidden])")).to_have_text(
        [re.compile("^Not used: spike_window must be a whole number from 1 to 10000"), re.compile(r"^Not used: underflow_share must be in \(0, 1\]")]
    )
    anomaly = banner_row(p.page, data.NAN_RUN).locator(".banner.anomaly .headline")
    expect(anomaly).to_be_visible()
    window.fill("5")
    window.press("Enter")
    expect(window).to_have_attribute("aria-invalid", "false")
    expect(share).to_have_attribute("aria-invalid", "true")
    share.fill("0.5")
    share.press("Enter")
    expect(share).to_have_attribute("aria-invalid", "false")
    expect(p.page.locator(".safe-range-toggle")).to_contain_text("2 set")
    # A bad value later keeps the banners: they are those of the other values.
    floor = p.page.locator('.safe-range input[name="vanishing_floor"]')
    floor.fill("-1")
    floor.press("Enter")
    expect(p.page.locator(".safe-range .field-error:not([hidden])")).to_have_text([re.compile("^Not used: vanishing_floor must not be negative")])
    expect(banner_row(p.page, data.NAN_RUN).locator(".banner.anomaly .headline")).to_be_visible()
    assert "vanishing_floor=-1" in p.page.evaluate("location.hash")


def test_banner_names_the_ops_type_and_source_line_and_show_me_selects_its_row(open_page, tb_more):
    page = dashboard(open_page, tb_more, "#run=ops&tensor=logrelu%2Foutput&step=2").page
    anomaly = banner_row(page, data.OPS_RUN).locator(".banner.anomaly")
    expect(anomaly.locator(".headline")).to_have_text("First non-finite value at step %d" % data.OP_NAN_STEP)
    expect(anomaly.locator(".op")).to_have_text("Op: logrelu/Log (Log, forward pass), created at %s." % data.OP_SOURCE)
    expect(page.locator(".selected-name .tensor-name")).to_have_text("logrelu/output")
    anomaly.locator(".show-anomaly").click()
    expect(page.locator(".selected-name .tensor-name")).to_have_text(data.OP_TENSOR)
    page.wait_for_function("() => location.hash.includes('step=%d')" % data.OP_NAN_STEP)


def test_banner_says_which_record_of_the_step_and_the_last_finite_step(open_page, tb_more):
    page = dashboard(open_page, tb_more, "#run=%s" % data.REPEATED_RUN).page
    anomaly = banner_row(page, data.REPEATED_RUN).locator(".banner.anomaly")
    expect(anomaly.locator(".headline")).to_have_text("First non-finite value at step %d" % data.REPEATED_NAN_STEP)
    expect(anomaly.locator(".occurrence")).to_have_text("In record 1 of the 2 records of this tensor at this step.")
    expect(anomaly.locator(".last-healthy")).to_have_text(
        "Last healthy step of this tensor: %d (inside the safe range, no NaN/Inf). "
        "Last finite step: %d (no NaN/Inf, but out of the safe range from step %d)."
        % (data.REPEATED_WARN_STEP - 1, data.REPEATED_NAN_STEP - 1, data.REPEATED_WARN_STEP)
    )


def test_hovering_a_warning_cell_names_its_kind_first(open_page, tb):
    page = dashboard(open_page, tb).page
    x, y = cell_point(page, data.NAN_RUN, "global_norm", data.SPIKE_STEP, 200)
    page.mouse.move(x, y)
    numbers = page.locator('.timeline-run[data-run="%s"] .tooltip .numbers' % data.NAN_RUN)
    expect(numbers).to_contain_text("max |x|")
    assert numbers.inner_text().split("\n")[0] == "warning: gradient spike"


def _with_fields(extra):
    """A route handler: the real /summary of run ops, with ``extra(summary)`` applied."""

    def handle(route):
        response = route.fetch()
        body = response.json()
        extra(body)
        route.fulfill(response=response, json=body)

    return handle


def _replayed(summary):
    """The fields the analysis core adds for a replayed step, hostile names included."""
    a = summary["first_anomaly"]
    a.update(
        tensor="logrelu/output",
        op={
            "name": "logrelu/Log",
            "type": "<b>Log</b>",
            "source": "<img src=x onerror=alert(1)>.py:12 (call)",
            "phase": "forward",
            "inputs": [{"name": "<b>mlp</b>/Relu", "shape": [8, 8], "min": 0, "max": "Infinity", "zeros": 3, "size": 64},
                       "junk", {"min": "NaN", "shape": "<i>"}],
        },
        replay={"reproduced": False, "why": "dropout drew other masks"},
        occurrence={"index": "x", "of": None},
    )
    summary["first_warning"] = {
        "step": 3,
        "tensor": "ops/logrelu/Relu",
        "kind": "dead_units",
        "detail": "96% zeros",
        "hint": "<i>lower</i> the bias init",
    }
    summary["info"] = [{"step": s, "kind": "skipped_step", "tensor": "loss", "detail": "loss scale halved"} for s in range(5)] + [None]


def test_op_input_ranges_replay_and_new_kinds_render_as_text(open_page, tb_more):
    """The banner's contract for the fields the analysis core adds
    (first_anomaly.op, replay, occurrence; info; new warning kinds): the real
    /summary of run ``ops`` with those fields added, odd shapes and hostile
    names included."""
    p = open_page()
    p.page.route("**/summary?*", _with_fields(_replayed))
    p.page.goto(tb_more.url + ENTRY + "#run=ops&tensor=ops%2Flogrelu%2FMatMul&step=1")
    anomaly = banner_row(p.page, data.OPS_RUN).locator(".banner.anomaly")
    expect(anomaly.locator(".op")).to_contain_text(
        "Op: logrelu/Log (<b>Log</b>, forward pass), created at <img src=x onerror=alert(1)>.py:12 (call)."
    )
    expect(anomaly.locator(".inputs li")).to_have_text(
        ["input 1 (<b>mlp</b>/Relu, 8×8): min 0 · max +Inf · 3 exact zeros of 64", "input 3: min NaN"]
    )
    expect(anomaly.locator(".replay")).to_have_text(
        "Replay: replaying this step at op level did not reproduce the failure (dropout drew other masks); "
        "the answer above is from the layer-level records."
    )
    expect(anomaly.locator(".occurrence")).to_have_count(0)
    expect(anomaly.locator(".info li")).to_have_text(
        ["Step %d: skipped step in loss (loss scale halved)" % s for s in range(3)] + ["and 2 more"]
    )
    warning = banner_row(p.page, data.OPS_RUN).locator(".banner.warning")
    expect(warning.locator(".kind")).to_have_text("dead units")
    expect(warning.locator(".kind")).to_have_attribute("title", "dead_units")
    expect(warning.locator(".hint")).to_have_text("Hint: <i>lower</i> the bias init")
    assert p.page.locator(".numerics img, .banners b, .banners i").count() == 0
    # "Show me" selects the op's own row, not the layer the anomaly names.
    expect(p.page.locator(".selected-name .tensor-name")).to_have_text("ops/logrelu/MatMul")
    anomaly.locator(".show-anomaly").click()
    expect(p.page.locator(".selected-name .tensor-name")).to_have_text(data.OP_TENSOR)
    assert p.dialogs == []


def _made_by_the_update(summary):
    """A first anomaly the optimizer's update made: no replay ran."""
    summary["first_anomaly"].update(phase="update", op=None, replay={
        "reproduced": False, "why": "its layer outputs, loss and gradients were finite: it went bad in the update"})


def test_an_anomaly_the_update_made_says_no_op_is_to_name_not_that_the_replay_did_not_reproduce(open_page, tb_more):
    p = open_page()
    p.page.route("**/summary?*", _with_fields(_made_by_the_update))
    p.page.goto(tb_more.url + ENTRY + "#run=ops")
    anomaly = banner_row(p.page, data.OPS_RUN).locator(".banner.anomaly")
    expect(anomaly.locator(".replay")).to_have_text(
        "Replay: no op of the step to name (its layer outputs, loss and gradients were finite: it went bad in the "
        "update); the answer above is from the records of the update."
    )
    assert p.dialogs == []


def _input_batch(summary):
    """A first anomaly in the batch as it arrived (phase input), with no op."""
    summary["first_anomaly"].update(tensor="input", phase="input", role="input", op_type=None, op=None, replay=None)


def test_an_anomaly_in_the_input_batch_says_so(open_page, tb_more):
    p = open_page()
    p.page.route("**/summary?*", _with_fields(_input_batch))
    p.page.goto(tb_more.url + ENTRY + "#run=ops")
    anomaly = banner_row(p.page, data.OPS_RUN).locator(".banner.anomaly")
    expect(anomaly).to_contain_text("input (input batch): ")
    expect(anomaly.locator(".op")).to_have_count(0)


def _malformed(summary):
    summary["first_anomaly"].update(op="Log", replay=[1], occurrence=7, likely_cause="x", last_finite_step={})
    summary.update(info="none", problems=None)


def test_fields_of_an_unexpected_shape_render_nothing(open_page, tb_more):
    p = open_page()
    p.page.route("**/summary?*", _with_fields(_malformed))
    p.page.goto(tb_more.url + ENTRY + "#run=ops")
    anomaly = banner_row(p.page, data.OPS_RUN).locator(".banner.anomaly")
    expect(anomaly.locator(".headline")).to_have_text("First non-finite value at step %d" % data.OP_NAN_STEP)
    # The first anomaly is the layer's record (the op is its detail): a
    # malformed op renders nothing in its place.
    for part in (".op", ".replay", ".occurrence", ".cause", ".info", ".problems"):
        expect(anomaly.locator(part)).to_have_count(0)
    expect(anomaly.locator(".last-healthy")).to_have_text(
        "Last healthy step of this tensor: %d (inside the safe range, no NaN/Inf)." % (data.OP_NAN_STEP - 1)
    )


def test_hostile_and_long_tag_names_render_as_text(open_page, tb):
    p = dashboard(open_page, tb)
    page = p.page
    label = page.locator(".label.row", has_text=data.HOSTILE_TAG).first
    assert label.inner_text() == data.HOSTILE_TAG
    assert page.locator(".numerics img").count() == 0
    # Select it so its name reaches the charts' heading too.
    x, y = cell_point(page, data.NAN_RUN, data.HOSTILE_TAG, 10, 200)
    page.mouse.click(x, y)
    page.wait_for_function("t => document.querySelector('.selected-name .tensor-name').innerText === t", arg=data.HOSTILE_TAG)
    page.mouse.move(x, y)
    page.wait_for_timeout(400)
    assert page.locator(".numerics img").count() == 0
    assert p.dialogs == []

    long_label = page.locator(".label.row", has_text="kernel_grad_with_a_very_long_name").first
    assert long_label.get_attribute("title") == data.LONG_TAG
    truncated = long_label.evaluate("e => e.scrollWidth > e.clientWidth && getComputedStyle(e).textOverflow === 'ellipsis'")
    assert truncated, "a long name must be cut with an ellipsis, not overflow"
    assert page.evaluate("document.documentElement.scrollWidth <= document.documentElement.clientWidth")


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_dashboard_renders_in_light_and_dark_themes(open_page, tb, tmp_path, scheme):
    page = dashboard(open_page, tb, color_scheme=scheme).page
    page.locator(".chart canvas").first.wait_for()
    page.wait_for_timeout(300)
    assert page.evaluate("document.documentElement.dataset.theme") == scheme
    background = page.evaluate("getComputedStyle(document.body).backgroundColor")
    channels = [int(c) for c in re.findall(r"\d+", background)[:3]]
    assert (sum(channels) < 200) == (scheme == "dark"), background
    path = tmp_path / ("dashboard-%s.png" % scheme)
    page.screenshot(path=str(path), full_page=True)
    png = path.read_bytes()
    # A blank or single-colour page has a handful of colours; the dashboard has hundreds.
    assert colour_variety(png) > 50


def test_dark_mode_follows_tensorboards_own_setting(open_page, tb):
    p = open_page("light")
    p.page.goto(tb.url + "/#numerics")
    frame = p.page.frame_locator('iframe[src*="plugin_entry.html?name=numerics"]')
    frame.locator(".banner .headline").first.wait_for()
    p.page.evaluate("document.body.classList.add('dark-mode')")
    iframe = p.page.frame_locator('iframe[src*="plugin_entry.html?name=numerics"]').locator("html")
    p.page.wait_for_function(
        "() => document.querySelector('iframe[src*=\"plugin_entry\"]').contentDocument.documentElement.dataset.theme === 'dark'"
    )
    assert iframe.get_attribute("data-theme") == "dark"


def test_empty_logdir_says_what_to_do(open_page, tmp_path):
    logdir = tmp_path / "empty"
    logdir.mkdir()
    with tb_process.tensorboard(str(logdir)) as empty_tb:
        p = open_page()
        p.page.goto(empty_tb.url + ENTRY)
        status = p.page.locator(".status.empty")
        status.wait_for()
        assert "No numerics in this logdir yet" in status.inner_text()
        assert "tb_numerics.log_numerics" in status.inner_text()


def test_op_level_charts_show_sums_as_not_recorded(open_page, tmp_path):
    """Op-level records hold no sums: mean, std and L2 say "not recorded for
    ops", never "NaN", which would say the tensor had no finite value."""
    import numpy as np

    from tb_numerics import metadata
    from tb_numerics.record_writer import NumericsRecordWriter
    from tb_numerics.records import numpy_stats

    logdir = str(tmp_path / "logs")
    info = metadata.TensorInfo(role="activation", op_type="MatMul", description="model.py:7 (call)")
    F = metadata.FIELD_INDEX
    with NumericsRecordWriter(os.path.join(logdir, "ops")) as w:
        for step in range(20):
            rec = numpy_stats(np.float32([1.0, -2.0, step]))
            rec[F["sum"]] = rec[F["sum_sq"]] = np.nan  # as stats.op_stats writes it
            w.write("ops/d1/MatMul", step, rec, info)
    with tb_process.tensorboard(logdir) as op_tb:
        tb_process.wait_for(lambda: op_tb.get_json("/data/plugin/numerics/runs")["runs"], timeout=60)
        page = dashboard(open_page, op_tb, "#run=ops&tensor=ops%2Fd1%2FMatMul").page
        expect(page.locator(".selected-name .tensor-name")).to_have_text("ops/d1/MatMul")
        for title in ("Mean ± std", "L2 norm"):
            expect(page.locator('.chart[aria-label^="%s"] .note' % title)).to_contain_text("Not recorded for ops")
        for title, words in (("Range", "max |x| 1"),):
            chart = page.locator('.chart[aria-label^="%s"]' % title)
            canvas = chart.locator("canvas")
            canvas.scroll_into_view_if_needed()
            box = canvas.bounding_box()
            page.mouse.move(box["x"] + box["width"] * 0.9, box["y"] + box["height"] / 2)
            expect(chart.locator(".readout")).to_contain_text(words)


def test_a_run_with_nothing_readable_names_its_damage(open_page, tmp_path):
    """A run whose only file is cut inside its first record (finished long
    ago) opens with what went wrong said, not an empty tab or a broken one;
    a readable run beside it is the one opened first; a run whose last
    record is cut is not called healthy (the record lost may hold the NaN)."""
    import time

    import numpy as np

    from tb_numerics import metadata
    from tb_numerics.record_writer import NumericsRecordWriter
    from tb_numerics.records import numpy_stats

    def write_run(run_dir, steps):
        with NumericsRecordWriter(run_dir) as w:
            for step in range(steps):
                w.write("dense/output", step, numpy_stats(np.float32([1.0, -2.0, step])),
                        metadata.TensorInfo(role="activation"))

    logdir = tmp_path / "logs"
    write_run(str(logdir / "a_cut"), 3)
    (cut,) = [str(f) for f in (logdir / "a_cut").iterdir()]
    with open(cut, "rb") as f:
        head = f.read(20)
    with open(cut, "wb") as f:
        f.write(head)
    os.utime(cut, (time.time() - 3600,) * 2)
    write_run(str(logdir / "b_good"), 10)
    write_run(str(logdir / "c_tail"), 10)  # its last record cut: read but for that one
    (tail,) = [str(f) for f in (logdir / "c_tail").iterdir()]
    with open(tail, "rb") as f:
        data = f.read()
    with open(tail, "wb") as f:
        f.write(data[:-5])
    os.utime(tail, (time.time() - 3600,) * 2)
    with tb_process.tensorboard(str(logdir)) as cut_tb:
        tb_process.wait_for(lambda: len(cut_tb.get_json("/data/plugin/numerics/runs")["runs"]) == 3, timeout=60)
        p = dashboard(open_page, cut_tb)
        run = p.page.locator('select[aria-label="Run"]')
        expect(run).to_have_value("b_good")
        expect(run.locator("option")).to_have_text(["a_cut (not all read)", "b_good (healthy)", "c_tail (not all read)"])
        run.select_option("a_cut")
        banner = p.page.locator(".banner-row").first
        expect(banner.locator(".problems")).to_contain_text("truncated at byte offset 0")
        expect(banner.locator(".headline")).to_have_text("Not all read: no NaN or Inf among the records read")
        expect(banner).to_contain_text("No record of this run could be read")
        expect(p.page.locator(".banner.healthy")).to_have_count(0)
        run.select_option("c_tail")
        expect(banner.locator(".headline")).to_have_text("Not all read: no NaN or Inf among the records read")
        expect(banner).to_contain_text("in steps 0–8 across 1 tensors (9 records). What could not be read")


def _first_look(summary):
    """/summary as a first look gives it (http_api.md): the first anomaly's
    own fields, what needs the whole run null, the answer preliminary."""
    history = ("last_healthy_step", "last_finite_step", "hint", "likely_cause", "row")
    summary["first_anomaly"].update({k: None for k in history})
    summary.update(preliminary=True, stale=True, as_of_step=None, first_warning=None, warnings=[], info=[],
                   tensors=None, records=None, first_step=None, last_step=None, skipped_steps=[])


def test_a_first_look_shows_the_first_anomaly_then_the_whole_run_replaces_it(open_page, tb):
    """A long run not read yet: its first anomaly at once, said to be found
    before the run was read; no last healthy step, warning or hint claimed;
    then, once the server answers for the whole run, its full banner."""
    p = open_page()
    p.page.route("**/summary?*", _with_fields(_first_look))
    p.page.goto(tb.url + ENTRY + "#run=" + data.NAN_RUN)
    row = banner_row(p.page, data.NAN_RUN)
    anomaly = row.locator(".banner.anomaly")
    expect(anomaly.locator(".headline")).to_have_text("First non-finite value at step %d" % data.NAN_STEP)
    expect(anomaly.locator(".tensor-name").first).to_have_text(data.NAN_TENSOR)
    expect(anomaly.locator(".preliminary")).to_contain_text("before the whole run is read")
    expect(anomaly.locator(".last-healthy, .hint, .cause")).to_have_count(0)
    expect(row.locator(".banner.warning")).to_have_count(0)
    expect(p.page.locator(".loading-line")).to_contain_text("Reading all of %s" % data.NAN_RUN)
    p.page.unroute("**/summary?*")  # the server now answers for the whole run: the page asks again by itself
    expect(anomaly.locator(".preliminary")).to_have_count(0)
    expect(row.locator(".banner.anomaly .last-healthy")).to_have_count(1)
    expect(row.locator(".banner.warning")).to_have_count(1)
    expect(p.page.locator(".loading-line")).to_have_text("")
    assert p.dialogs == []
