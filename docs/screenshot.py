"""Makes the README's pictures: the demo's logdir in TensorBoard's Numerics tab,
in TensorBoard's own page, 1280 wide (the tests hold the first screen to
1280x720; the pictures are 860 high to show the charts whole), in 256
colours (Pillow, which TensorBoard itself requires) to stay small.

* docs/dashboard.png: the banner of the demo's model.fit run (the op and the
  line the replay found), its timeline and charts, max |x| on a log scale;
* docs/compare.png: exploding_lr compared with the healthy run of the same
  model, "Show me both" pressed: where it first leaves the healthy run's band.

    .venv/bin/python -m demo --logdir demo_logs      # writes the demo's runs
    .venv/bin/python docs/screenshot.py demo_logs    # serves them, takes the pictures
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir, "tests"))
import chromium  # noqa: E402 - tests/chromium.py: Debian's Chromium
import tb_process  # noqa: E402

FRAME = 'iframe[src*="plugin_entry.html?name=numerics"]'
# name: (TensorBoard's URL entries of the view, the button pressed first, if any).
VIEWS = {
    "dashboard.png": ("p.numerics.run=keras_fit&p.numerics.log=1", None),
    "compare.png": ("p.numerics.run=exploding_lr&p.numerics.compare=healthy&p.numerics.log=1", ".show-departure"),
}


def shoot(browser, url: str, entries: str, button: str | None, out: str) -> None:
    page = browser.new_page(viewport={"width": 1280, "height": 860}, color_scheme="light")
    try:
        page.goto("%s/#numerics&%s" % (url, entries))
        frame = page.frame_locator(FRAME)
        frame.locator(".chart .chart-legend span").first.wait_for(timeout=60_000)
        if button:
            frame.locator(button).click()
            frame.locator('.chart[aria-label^="Range"] .chart-legend span', has_text="·").first.wait_for()
        page.wait_for_timeout(800)
        page.screenshot(path=out)
    finally:
        page.close()
    from PIL import Image  # a dependency of TensorBoard's

    with Image.open(out) as image:
        image.convert("RGB").quantize(256).save(out, optimize=True)


def main() -> int:
    from playwright.sync_api import sync_playwright

    logdir = sys.argv[1] if len(sys.argv) > 1 else "demo_logs"
    with tb_process.tensorboard(logdir) as tb, sync_playwright() as pw:
        tb_process.wait_for(lambda: len(tb.get_json("/data/plugin/numerics/runs")["runs"]) >= 8, timeout=120)
        browser = chromium.launch(pw)
        try:
            for name, (entries, button) in VIEWS.items():
                out = os.path.join(HERE, name)
                shoot(browser, tb.url, entries, button, out)
                print("wrote %s (%d KB)" % (out, os.path.getsize(out) // 1024))
        finally:
            browser.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
