"""The training's actions (skip, rewind, stop; issue 31) in the dashboard, in
real Chromium against a real TensorBoard whose Python loader (``--load_fast
false``) keeps only 10 points of another plugin's tag unless told otherwise.

The run is written without training (``record_writer``): a loss that is
non-finite at the steps where the events say the training acted, and 12
events (more than the loader's default sample), one of them with a hostile
detail, which must show as text.
"""

from __future__ import annotations

import numpy as np
import pytest

playwright_api = pytest.importorskip("playwright.sync_api")

import chromium  # noqa: E402
import tb_process  # noqa: E402
from tb_numerics import metadata, record_writer, records  # noqa: E402

pytestmark = pytest.mark.browser

expect = playwright_api.expect
expect.set_options(timeout=30_000)
STEPS = 60
SKIPS = list(range(10, 21))  # 11 skips, then a rewind
REWIND = 30
HOSTILE = "<img src=x onerror=alert(1)>"

chromium.require()


def _write(logdir: str) -> None:
    info = metadata.TensorInfo(role="loss", dtype="float32", shape=())
    with record_writer.NumericsRecordWriter(logdir) as w:
        for step in range(STEPS):
            value = np.float32(np.nan) if step in SKIPS or step == REWIND else np.float32(1.0 / (step + 1))
            w.write_many(step, [("loss", records.numpy_stats(value), info)])
            if step in SKIPS:
                w.write_action(step, {"epoch": 0, "batch": step, "trigger": "nonfinite", "action": "skip",
                                      "tensor": "loss", "detail": "loss: 1 NaN of 1 value" if step > 10 else HOSTILE})
            elif step == REWIND:
                w.write_action(step, {"epoch": 0, "batch": step, "trigger": "loss_spike", "action": "rewind",
                                      "tensor": "loss", "detail": "loss spike", "to_step": 22, "lr_factor": 0.5,
                                      "lr": 0.005, "replay": {"reproduced": False, "reproducible": False}})


@pytest.fixture(scope="module")
def tb(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("acted") / "logs"
    _write(str(logdir / "run"))
    with tb_process.tensorboard(str(logdir), load_fast=False) as proc:
        tb_process.wait_for(lambda: proc.get_json("/data/plugin/numerics/runs")["runs"], timeout=60)
        yield proc


def test_every_action_reaches_the_summary_through_tensorboards_loader(tb):
    summary = tb_process.wait_for(
        lambda: (s := tb.get_json("/data/plugin/numerics/summary?run=run"))["actions"] and s, timeout=60)
    actions = summary["actions"]
    assert [e["step"] for e in actions["events"]] == SKIPS + [REWIND]  # all 12, not a sample of 10
    assert actions["words"] == "survived 11 non-finite steps (skipped), 1 rewind at step 30 with lr × 0.5"
    assert actions["failed_batches"][0] == {"step": 10, "epoch": 0, "batch": 10}


def test_the_banner_and_the_timeline_show_the_actions(tb):
    with playwright_api.sync_playwright() as p:
        browser = chromium.launch(p)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            dialogs, errors = [], []
            page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(tb.url + chromium.ENTRY)
            acted = page.locator(".banner .training-actions")
            expect(acted).to_contain_text("Training acted: survived 11 non-finite steps (skipped), 1 rewind at step 30")
            items = acted.locator("li")
            expect(items.first).to_have_text("Step 10 (epoch 0, batch 10): skip (%s)" % HOSTILE)
            expect(items).to_have_count(6)  # 5 events, then "and 7 more"
            expect(items.last).to_have_text("and 7 more")
            # One mark per action over its step's column, its words as its title.
            marks = page.locator(".timeline .action-mark")
            expect(marks).to_have_count(len(SKIPS) + 1)
            rewind = page.locator('.timeline .action-mark.rewind')
            expect(rewind).to_have_attribute("title", "Step 30: rewind (loss spike)")
            expect(rewind).to_have_text("R")
            expect(marks.first).to_have_text("S")
            assert page.locator("img").count() == 0 and not dialogs and not errors
        finally:
            browser.close()
