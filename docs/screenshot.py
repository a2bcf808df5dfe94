"""Makes docs/dashboard.png: the demo's logdir in the Numerics dashboard.

    .venv/bin/python -m demo --logdir demo_logs      # writes the demo's runs
    .venv/bin/python docs/screenshot.py demo_logs    # serves them, takes the picture
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir, "tests"))
import chromium  # noqa: E402 - tests/chromium.py: Debian's Chromium
import tb_process  # noqa: E402

# model.fit with NumericsCallback's defaults: the banner names the op and the
# line the replay found; max |x| on a log scale.
VIEW = "#run=keras_fit&log=1"


def main() -> int:
    from playwright.sync_api import sync_playwright

    logdir = sys.argv[1] if len(sys.argv) > 1 else "demo_logs"
    out = os.path.join(HERE, "dashboard.png")
    with tb_process.tensorboard(logdir) as tb, sync_playwright() as pw:
        browser = chromium.launch(pw)
        page = browser.new_page(viewport={"width": 1400, "height": 1000}, color_scheme="light")
        page.goto(tb.url + "/data/plugin_entry.html?name=numerics" + VIEW)
        page.wait_for_function("() => document.querySelector('.chart .chart-legend span') !== null", timeout=60_000)
        page.wait_for_timeout(500)
        page.screenshot(path=out, full_page=True)
        browser.close()
    print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
