"""Issue 30: the Numerics tab inside TensorBoard's own page, at 1280x720.

One tensorboard process and one browser serve the module; the logdir is
``tests/dashboard_views.py``'s (a failing run and its reference with one
injected difference, a replayed run, a restarted run). Each test names the
issue's item it checks. Pages are TensorBoard's (``/#numerics``), so that the
first screen, TensorBoard's reload and TensorBoard's URL are the real ones;
the plugin's frame is reached through the iframe.
"""

from __future__ import annotations

import re
import urllib.parse

import pytest

playwright_api = pytest.importorskip("playwright.sync_api")

import chromium  # noqa: E402
import dashboard_views as data  # noqa: E402
import tb_process  # noqa: E402

pytestmark = pytest.mark.browser

expect = playwright_api.expect
expect.set_options(timeout=30_000)
chromium.require()

FRAME = 'iframe[src*="plugin_entry.html?name=numerics"]'
VIEWPORT = {"width": 1280, "height": 720}
# TensorBoard 2.21's default run colours (its settings' colorPalette, light theme).
TB_PALETTE = ["#425066", "#12b5cb", "#e52592", "#f9ab00", "#9334e6", "#7cb342", "#e8710a"]


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    return data.write(str(tmp_path_factory.mktemp("views") / "logs"))


@pytest.fixture(scope="module")
def tb(logdir):
    with tb_process.tensorboard(logdir, reload_interval=1) as proc:
        proc.wait_for_runs(4)
        yield proc


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport=VIEWPORT)
    pg = context.new_page()
    pg.set_default_timeout(20_000)
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    yield pg
    context.close()
    assert not errors, errors


def open_tab(page, tb, entries: dict[str, str] | None = None):
    """TensorBoard's page on the Numerics tab (with ``p.numerics.*`` entries); the plugin's frame."""
    hash_ = "numerics" + "".join("&p.numerics.%s=%s" % (k, urllib.parse.quote(v, safe="")) for k, v in (entries or {}).items())
    page.goto("%s/#%s" % (tb.url, hash_))
    frame = page.frame_locator(FRAME)
    frame.locator(".banner .headline").first.wait_for()
    frame.locator(".timeline .label.row").first.wait_for()
    return frame


def selected(frame):
    return frame.locator(".selected-name .tensor-name")


def inside_viewport(box) -> bool:
    return box is not None and box["y"] >= 0 and box["y"] + box["height"] <= VIEWPORT["height"]


def test_first_screen_shows_one_run_its_anomaly_row_and_its_charts(page, tb):
    """Item 1: one run, the one whose first anomaly is earliest; the
    safe-range form folded; the anomaly's row and the charts on the first screen."""
    frame = open_tab(page, tb)
    expect(frame.get_by_label("Run", exact=True)).to_have_value(data.FAILING)
    expect(frame.locator(".banner-row")).to_have_count(1)
    expect(frame.locator(".banner.anomaly .headline")).to_have_text("First non-finite value at step %d" % data.LOSS_INF_STEP)
    expect(frame.locator(".safe-range-panel")).to_be_hidden()
    expect(frame.locator(".safe-range-toggle")).to_have_text(re.compile(r"^Safe range: defaults"))
    expect(selected(frame)).to_have_text("loss")
    frame.locator(".chart .chart-legend span").first.wait_for()
    row = frame.locator(".timeline .label.row.selected")
    expect(row).to_have_text("loss")
    assert inside_viewport(row.bounding_box()), row.bounding_box()
    for chart in ("Range", "NaN / Inf counts"):
        canvas = frame.locator('.chart[aria-label^="%s"] canvas' % chart)
        assert inside_viewport(canvas.bounding_box()), (chart, canvas.bounding_box())
    # Unfolded, the form's values still live in the link.
    frame.locator(".safe-range-toggle").click()
    field = frame.get_by_label("Max |x|", exact=True)
    field.fill("1000")
    field.press("Enter")
    page.wait_for_function("() => location.hash.includes('p.numerics.max_abs=1000')")


def legend_of(frame, chart):
    return frame.locator('.chart[aria-label^="%s"] .chart-legend' % chart)


def test_charts_draw_the_run_alone_and_compared_runs_in_tensorboards_colours(page, tb):
    """Item 2: no other run's lines unless comparing; then a line per run,
    labelled with its name, in the colour TensorBoard gives the run."""
    frame = open_tab(page, tb, {"tensor": data.FAULT_TENSOR})
    legend = legend_of(frame, "Range")
    expect(legend).to_have_text(re.compile(r"^min.*max \|x\|"))
    assert "·" not in legend.inner_text()
    frame.get_by_label("Compare with").select_option(data.REFERENCE)
    expect(legend).to_contain_text("max |x| · %s" % data.FAILING)
    expect(legend).to_contain_text("max |x| · %s" % data.REFERENCE)
    # TensorBoard colours runs in the order of its run list.
    order = tb.get_json("/data/runs")
    for run in (data.FAILING, data.REFERENCE):
        swatch = legend.locator("span", has_text="· %s" % run).locator("i")
        colour = swatch.evaluate("e => getComputedStyle(e).backgroundColor")
        hex_ = TB_PALETTE[order.index(run) % len(TB_PALETTE)]
        assert colour == "rgb(%d, %d, %d)" % tuple(int(hex_[i : i + 2], 16) for i in (1, 3, 5)), (run, colour)


def cell_centre(frame, tensor, step):
    """The page coordinates of a timeline cell (one column per step here)."""
    label = frame.locator(".timeline .label.row", has_text=re.compile("^%s$" % re.escape(tensor))).first
    label.scroll_into_view_if_needed()
    lb = label.bounding_box()
    cb = frame.locator(".timeline canvas").bounding_box()
    return cb["x"] + (step + 0.5) / data.STEPS * cb["width"], lb["y"] + lb["height"] / 2


def hover_cell(page, frame, tensor, step):
    page.mouse.move(*cell_centre(frame, tensor, step))
    return frame.locator(".timeline .tooltip .numbers")


def test_numbers_say_what_is_known(page, tb):
    """Item 3: a +Inf loss has no finite values (not "NaN"), the norm of a
    tensor holding NaN is NaN (not its finite values'), a count of 1 in 512 shows."""
    frame = open_tab(page, tb, {"tensor": "loss", "step": str(data.LOSS_INF_STEP)})
    tip = hover_cell(page, frame, "loss", data.LOSS_INF_STEP)
    expect(tip).to_contain_text("1 +Inf of 1 value")
    expect(tip).to_contain_text("no finite values")
    assert "NaN" not in tip.inner_text()
    tip = hover_cell(page, frame, "dense/output", data.NAN_STEP)
    expect(tip).to_contain_text("2 NaN of 512 values")
    expect(tip).to_contain_text("L2 of the tensor NaN")
    # The count chart of the gradient: 1 -Inf of 512 is a visible bar (its colour in the canvas).
    frame.get_by_label("Run", exact=True).wait_for()
    page.goto("%s/#numerics&p.numerics.run=%s&p.numerics.tensor=%s" % (tb.url, data.FAILING, urllib.parse.quote(data.GRAD_TENSOR, safe="")))
    frame = page.frame_locator(FRAME)
    expect(selected(frame)).to_have_text(data.GRAD_TENSOR)
    canvas = frame.locator('.chart[aria-label^="NaN / Inf counts"] canvas')
    # The charts of the tensor shown before are redrawn once the gradient's
    # series arrives: wait for its -Inf bars (their colour in the canvas).
    iframe = next(f for f in page.frames if "plugin_entry.html" in f.url)
    count_minus_inf = """() => {
          const c = document.querySelector('.chart[aria-label^="NaN / Inf counts"] canvas');
          if (!c || !c.width) return 0;
          const want = getComputedStyle(document.documentElement).getPropertyValue('--series-4').trim();
          const rgb = [1, 3, 5].map(i => parseInt(want.slice(i, i + 2), 16));
          const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
          let n = 0;
          for (let i = 0; i < d.length; i += 4) if (Math.abs(d[i] - rgb[0]) + Math.abs(d[i + 1] - rgb[1]) + Math.abs(d[i + 2] - rgb[2]) < 12) n++;
          return n;
        }"""
    want = 3 * (data.STEPS - data.LOSS_INF_STEP)
    try:
        iframe.wait_for_function("(want) => (%s)() >= want" % count_minus_inf, arg=want, timeout=10000)
    except playwright_api.TimeoutError:
        pytest.fail("the -Inf bars of %s cover %d pixels, want >= %d" % (data.GRAD_TENSOR, iframe.evaluate(count_minus_inf), want))
    box = canvas.bounding_box()
    page.mouse.move(box["x"] + box["width"] * 0.95, box["y"] + box["height"] / 2)
    expect(frame.locator('.chart[aria-label^="NaN / Inf counts"] .readout')).to_contain_text("-Inf 1 of 512 values")
    # After the NaN, the L2 norm of dense/output is NaN (a marker), not its finite values' norm.
    page.mouse.click(*cell_centre(frame, "dense/output", data.NAN_STEP + 2))
    expect(selected(frame)).to_have_text("dense/output")
    l2 = frame.locator('.chart[aria-label^="L2 norm"] canvas')
    l2.scroll_into_view_if_needed()
    frame.locator('.chart[aria-label^="L2 norm"] .chart-legend span').first.wait_for()
    box = l2.bounding_box()
    page.mouse.move(box["x"] + box["width"] * 0.97, box["y"] + box["height"] / 2)
    expect(frame.locator('.chart[aria-label^="L2 norm"] .readout')).to_contain_text("L2 NaN")


def test_op_rows_say_what_is_not_recorded_and_sit_under_their_layer(page, tb):
    """Items 4 and 6: an op row's charts say mean, std and L2 are not
    recorded and draw its one record; the replayed step's op rows follow
    their layer, in one group per phase."""
    frame = open_tab(page, tb, {"run": data.REPLAYED, "tensor": "ops/mlp/dense_0/MatMul", "step": str(data.REPLAY_STEP)})
    expect(selected(frame)).to_have_text("ops/mlp/dense_0/MatMul")
    for chart in ("Mean ± std", "L2 norm"):
        expect(frame.locator('.chart[aria-label^="%s"] .note' % chart)).to_contain_text("Not recorded for ops")
    # The range chart draws the op's one record: its colour is in the canvas.
    frame.locator('.chart[aria-label^="Range"] .chart-legend span').first.wait_for()
    drawn = frame.locator('.chart[aria-label^="Range"] canvas').evaluate(
        """c => {
          const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
          let n = 0;
          for (let i = 0; i < d.length; i += 4) if (d[i + 2] > 150 && d[i] < 60 && d[i + 1] > 80 && d[i + 1] < 140) n++;
          return n;
        }"""
    )
    assert drawn >= 12, drawn  # a dot of radius 3 in series-1's blue, not a 1-px point
    labels = frame.locator(".timeline .label").all_inner_texts()
    assert labels == [
        "FORWARD · ACTIVATION",
        "dense_0/output", "ops/mlp/dense_0/MatMul", "ops/mlp/dense_0/BiasAdd",
        "dense_1/output", "ops/mlp/dense_1/MatMul", "ops/mlp/dense_1/BiasAdd",
        "FORWARD · LOSS",
        "loss", "ops/compile_loss/mse/Sub", "ops/compile_loss/mse/Square", "ops/compile_loss/mse/Mean",
    ], labels


def test_a_restart_is_said_and_step_labels_never_overlap(page, tb):
    """Item 8: a run two trainings wrote says so; the step axis of a run
    with a gap (steps 0-10, then 100) draws no label over another."""
    page.add_init_script(
        """(() => {
          const fill = CanvasRenderingContext2D.prototype.fillText;
          window.__labels = [];
          CanvasRenderingContext2D.prototype.fillText = function (text, x, y) {
            if (this.canvas.closest && this.canvas.closest('.timeline'))
              window.__labels.push([String(text), x, this.measureText(String(text)).width]);
            return fill.apply(this, arguments);
          };
        })()"""
    )
    frame = open_tab(page, tb, {"run": data.RESTARTED})
    note = frame.locator(".banner .restart")
    expect(note).to_contain_text("More than one training in this run: steps %d–%d were written again by a later training" % data.RESTART_STEPS)
    iframe = next(f for f in page.frames if "plugin_entry.html" in f.url)
    iframe.wait_for_function("() => window.__labels.length > 0")
    labels = iframe.evaluate("window.__labels")
    last = {}
    for text, x, width in labels:
        # Each draw starts again from the left; within one draw, labels go left to right.
        if last and x < last["x"]:
            last = {}
        if last:
            assert x >= last["x"] + last["w"], (labels, text)
        last = {"x": x, "w": width}
    assert any(t == "100" for t, _, _ in labels), labels


def test_tensorboards_reload_button_reloads_the_tab(page, tb, logdir):
    """Item 9: TensorBoard's own reload (its button; auto-reload sends the
    same message) reloads the tab: a run written after the page opened appears."""
    frame = open_tab(page, tb)
    options = frame.get_by_label("Run", exact=True).locator("option")
    expect(options).to_have_count(4)
    expect(frame.get_by_role("button", name="Reload")).to_have_count(0)  # TensorBoard's own, not a second one
    data.write_late(logdir)
    tb.wait_for_runs(5)
    page.locator("app-header-reload button").click()
    expect(options).to_have_count(5)
    expect(frame.get_by_label("Run", exact=True).locator('option[value="late"]')).to_have_count(1)


def test_the_view_lives_in_tensorboards_url(page, browser, tb):
    """Item 10: the view is in TensorBoard's address bar (p.numerics.*), and
    that address reproduces it in a new page."""
    frame = open_tab(page, tb)
    page.wait_for_function("() => location.hash.includes('p.numerics.run=%s')" % data.FAILING)
    assert page.url.split("#")[1].startswith("numerics&")
    frame.get_by_label("Compare with").select_option(data.REFERENCE)
    frame.locator(".show-departure").click()
    expect(selected(frame)).to_have_text(data.FAULT_TENSOR)
    page.wait_for_function("() => location.hash.includes('p.numerics.step=%d')" % data.FAULT_STEP)
    url = page.url
    for key, value in (("tensor", data.FAULT_TENSOR), ("compare", data.REFERENCE), ("step", str(data.FAULT_STEP))):
        assert "p.numerics.%s=%s" % (key, urllib.parse.quote(value, safe="")) in url, url
    other = browser.new_context(viewport=VIEWPORT).new_page()
    try:
        other.goto(url)
        again = other.frame_locator(FRAME)
        expect(selected(again)).to_have_text(data.FAULT_TENSOR)
        expect(again.get_by_label("Compare with")).to_have_value(data.REFERENCE)
        expect(legend_of(again, "Range")).to_contain_text("· %s" % data.REFERENCE)
    finally:
        other.context.close()


def test_charts_work_from_the_keyboard(page, tb):
    """Item 11: a chart takes focus; the arrows read the steps out, Shift
    selects a range, Enter zooms to it, Escape shows every step again."""
    frame = open_tab(page, tb, {"tensor": data.FAULT_TENSOR, "step": str(data.FAULT_STEP)})
    canvas = frame.locator('.chart[aria-label^="Range"] canvas')
    frame.locator('.chart[aria-label^="Range"] .chart-legend span').first.wait_for()
    canvas.focus()
    readout = frame.locator('.chart[aria-label^="Range"] .readout')
    canvas.press("ArrowRight")
    expect(readout).to_have_text(re.compile(r"^Step \d+: min "))
    first = int(re.match(r"Step (\d+)", readout.inner_text()).group(1))
    canvas.press("ArrowRight")
    expect(readout).to_have_text(re.compile(r"^Step %d: " % (first + 1)))
    for _ in range(3):
        canvas.press("Shift+ArrowRight")
    canvas.press("Enter")
    page.wait_for_function("() => location.hash.includes('p.numerics.start=%d') && location.hash.includes('p.numerics.end=%d')" % (first + 1, first + 4))
    expect(frame.get_by_label("First step")).to_have_value(str(first + 1))
    canvas.focus()
    canvas.press("Escape")
    page.wait_for_function("() => !location.hash.includes('p.numerics.start=')")


def test_comparison_finds_the_injected_difference(page, tb):
    """Item 12: against its reference, the failing run leaves the band first
    at the injected step and tensor (not at its later NaN), and "Show me both"
    draws the two series of that tensor."""
    frame = open_tab(page, tb, {"compare": data.REFERENCE})
    banner = frame.locator(".comparison .banner")
    expect(banner.locator(".headline")).to_have_text(
        "Compared with %s: %s leaves its band at step %d" % (data.REFERENCE, data.FAILING, data.FAULT_STEP)
    )
    expect(banner).to_contain_text("First in execution order: %s (forward pass): max |x|" % data.FAULT_TENSOR)
    banner.locator(".show-departure").click()
    expect(selected(frame)).to_have_text(data.FAULT_TENSOR)
    expect(legend_of(frame, "Range")).to_contain_text("max |x| · %s" % data.REFERENCE)
    answer = tb.get_json("/data/plugin/numerics/compare?run=%s&against=%s" % (data.FAILING, data.REFERENCE))
    assert (answer["first_departure"]["step"], answer["first_departure"]["tensor"]) == (data.FAULT_STEP, data.FAULT_TENSOR)
    status, body = tb.get("/data/plugin/numerics/compare?run=%s&against=nope" % data.FAILING)
    assert status == 404 and b"nope" in body
    status, body = tb.get("/data/plugin/numerics/compare?run=%s&against=%s&factor=1" % (data.FAILING, data.REFERENCE))
    assert status == 400 and b"factor must be a number above 1" in body
