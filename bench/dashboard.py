"""First paint of the Numerics dashboard in Chromium, on bench/backend.py's long run.

Writes (or reuses) the 100,000-step x 500-tensor run of ``bench/backend.py``
(``--tensors 50`` for the run this bench was first measured on),
starts ``tensorboard``, waits until TensorBoard has loaded every record, then
opens the dashboard's page in Debian's Chromium and times, from navigation:

* banner: the first anomaly's words are on screen (the first paint that matters);
* timeline: the health timeline of the run is drawn;
* charts: the selected tensor's charts are drawn.

"cold" is the first page after loading (the plugin reads and analyses the run
for it, and may answer from a partial read); "warm" is a page opened once the
plugin holds every record (its per-run cache answers).

    .venv/bin/python bench/dashboard.py                  # full size
    .venv/bin/python bench/dashboard.py --steps 10000 --tensors 50   # quick
    .venv/bin/python bench/dashboard.py --logdir /tmp/bench-logs   # reuse a written run
    .venv/bin/python bench/dashboard.py --existing demo_logs --reps 5   # the demo's logdir as it is

Target: banner <= 1.5 s after TensorBoard has loaded the data.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.parse

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir, "tests"))
sys.path.insert(0, HERE)
import backend  # noqa: E402 - bench/backend.py: the long run's writer
import chromium  # noqa: E402 - tests/chromium.py: Debian's Chromium
import tb_process  # noqa: E402

FIRST_PAINT_TARGET_S = 1.5

# Each waits for a part of the page to hold data, then reads the page's own clock
# (milliseconds since navigation started).
MILESTONES = {
    "banner": "() => (document.querySelector('.banner .headline')?.innerText || '') !== ''",
    "timeline": "() => document.querySelector('.timeline .label.row') !== null",
    "charts": "() => document.querySelector('.chart canvas:not([hidden])') !== null"
    " && document.querySelector('.chart .chart-legend span') !== null",
}


def first_paint(browser, url: str, timeout_s: float = 120) -> dict[str, float]:
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        page.goto(url, wait_until="commit")
        out = {}
        for name, predicate in MILESTONES.items():
            page.wait_for_function(predicate, timeout=timeout_s * 1000, polling=10)
            out[name] = round(page.evaluate("performance.now()") / 1000, 3)
        out["banner_text"] = page.locator(".banner .headline").first.inner_text()
        return out
    finally:
        page.close()


def existing(logdir: str, reps: int) -> int:
    """First paint on a logdir as it is (``python -m demo --logdir DIR``'s eight
    runs): TensorBoard started, every run listed by the plugin, then ``reps``
    pages, each timed from navigation (the first one reads the runs)."""
    from playwright.sync_api import sync_playwright

    with tb_process.tensorboard(logdir, reload_interval=5) as tb:
        n_runs = len([d for d in os.listdir(logdir) if os.path.isdir(os.path.join(logdir, d))])
        tb_process.wait_for(lambda: len(tb.get_json("/data/plugin/numerics/runs")["runs"]) >= n_runs, timeout=300)
        with sync_playwright() as pw:
            browser = chromium.launch(pw)
            try:
                pages = [first_paint(browser, tb.url + "/data/plugin_entry.html?name=numerics") for _ in range(reps)]
            finally:
                browser.close()
    for name in MILESTONES:
        values = sorted(p[name] for p in pages)
        print("%-9s median %.3f s  (min %.3f, max %.3f, %d pages)" % (
            name, values[len(values) // 2], values[0], values[-1], len(values)))
    print("banner:", pages[-1]["banner_text"])
    return 0


def main() -> int:
    from playwright.sync_api import sync_playwright

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    backend.add_run_arguments(p)
    p.add_argument("--existing", metavar="LOGDIR", help="time the dashboard on this logdir as it is, e.g. the demo's")
    p.add_argument("--reps", type=int, default=5, help="pages timed with --existing")
    args = p.parse_args()
    if args.existing:
        return existing(args.existing, args.reps)

    logdir = args.logdir or tempfile.mkdtemp(prefix="tbn-dash-bench-")
    run_dir = os.path.join(logdir, backend.RUN)
    try:
        if not os.path.isdir(run_dir):
            t = time.perf_counter()
            backend.write_run(logdir, args.steps, args.tensors, args.processes)
            print("wrote %d records in %.1f s" % (args.steps * args.tensors, time.perf_counter() - t))
        q = urllib.parse.quote
        t_start = time.perf_counter()
        with tb_process.tensorboard(logdir, load_fast=args.load_fast == "true", reload_interval=5) as tb:
            marker = "/data/plugin/scalars/scalars?run=%s&tag=%s" % (q(backend.RUN), q(backend.MARKER_TAG))
            tb_process.wait_for(lambda: tb.get_json(marker), timeout=1800, interval=0.2)
            loaded = time.perf_counter() - t_start
            url = tb.url + "/data/plugin_entry.html?name=numerics"
            with sync_playwright() as pw:
                browser = chromium.launch(pw)
                try:
                    # The plugin reads and analyses every record for the first page.
                    cold = first_paint(browser, url, timeout_s=1800)
                    # A big run may be answered from a partial read at first
                    # ("stale"); the warm page is timed once the plugin holds
                    # every record, not while it is still reading them.
                    summary = "/data/plugin/numerics/summary?run=%s" % q(backend.RUN)
                    tb_process.wait_for(
                        lambda: not tb.get_json(summary, timeout=1800).get("stale"), timeout=1800, interval=1
                    )
                    complete = time.perf_counter() - t_start - loaded
                    warm = first_paint(browser, url)
                finally:
                    browser.close()
        results = {
            "records": args.steps * args.tensors,
            "load_fast": args.load_fast,
            "tensorboard_loaded_s": round(loaded, 2),
            "cold_s": cold,
            "complete_after_load_s": round(complete, 2),
            "warm_s": warm,
        }
        print(json.dumps(results, indent=1))
        for name, value in (("first paint (cold)", cold["banner"]), ("first paint (warm)", warm["banner"])):
            verdict = "ok" if value <= FIRST_PAINT_TARGET_S else "MISSED"
            print("%-20s %7.3fs  target <= %gs  %s" % (name, value, FIRST_PAINT_TARGET_S, verdict))
        return 0
    finally:
        if not args.logdir:
            shutil.rmtree(logdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
