"""Load and scale limits of the Numerics plugin in a real TensorBoard.

Live appends: a writer appends to a run while 50 clients poll every route
for 60 s (bounded loops on 127.0.0.1). Every answer must be 200 with a JSON
body; after the writer stops and one reload passes, /summary must count
every record written and its first anomaly must equal ``tb-numerics report
--json``'s.

Scale: a run of 1,000 tensors and a run of 1,000,000 steps of one tensor
holding a single non-finite step; prints the routes' response times and
checks that the timeline still shows the bad step in its bucket.

    .venv/bin/python bench/load.py                  # both, full size
    .venv/bin/python bench/load.py --live --seconds 10 --clients 20   # or TBN_LOAD_SECONDS=10
    .venv/bin/python bench/load.py --scale --steps 100000 --tensors 200
    .venv/bin/python bench/load.py --load-fast false

Prints the counts of the closing-note table (requests, 5xx, invalid answers,
records lost, anomalies missed) and exits 1 when any of them is not 0.
``tests/test_live_append.py`` and ``tests/test_scale.py`` run the same code,
smaller.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import http.client
import io
import json
import os
import random
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests"))
import tb_process  # noqa: E402 - the tests' helper that runs a real tensorboard

from tb_numerics import analysis, cli, metadata  # noqa: E402
from tb_numerics.metadata import FIELD_INDEX as F  # noqa: E402
from tb_numerics.record_writer import NumericsRecordWriter  # noqa: E402

P = "/data/plugin/numerics"
LIVE_RUN = "live"
LIVE_TAGS = [
    ("input", metadata.TensorInfo(role="activation", order=0)),
    ("dense/output", metadata.TensorInfo(role="activation", order=1, op_type="MatMul")),
    ("loss", metadata.TensorInfo(role="loss", order=2)),
    ("dense/kernel_grad", metadata.TensorInfo(role="gradient", order=0)),
    ("global_norm", metadata.TensorInfo(role="global_norm", order=1)),
]
# The live run's first anomaly (a NaN in the gradient) and later ones that
# must not displace it.
LIVE_NAN_STEP = 40
LIVE_LATER_NAN_STEP = 90


def stats_row(scale: float, size: float = 64.0, nan: float = 0.0) -> np.ndarray:
    """A plausible record of ``size`` values within ±scale, ``nan`` of them NaN."""
    v = np.zeros(metadata.NUM_FIELDS)
    v[F["count"]] = size
    v[F["nan"]] = nan
    v[F["min"]], v[F["max"]] = -scale, scale
    v[F["sum"]] = 0.1 * scale
    v[F["sum_sq"]] = (size - nan) * scale * scale / 3
    return v


# ---------------------------------------------------------------- live appends


@dataclasses.dataclass
class LoadResult:
    """What the clients saw and what the server ended up with."""

    requests: int
    statuses: dict[str, int]
    invalid: list[str]  # answers that were not 200 + JSON
    latency_ms: dict[str, float]
    route_p95_ms: dict[str, float]
    records_written: int
    last_step: int
    records_served: int
    last_step_served: int | None
    first_anomaly_server: dict | None
    first_anomaly_cli: dict | None

    @property
    def server_errors(self) -> int:
        return sum(n for code, n in self.statuses.items() if code.startswith("5"))

    @property
    def records_lost(self) -> int:
        return self.records_written - self.records_served

    @property
    def anomalies_missed(self) -> int:
        """1 where the server's first anomaly is missing or differs from the CLI's."""
        keys = ("step", "tensor", "nan", "posinf", "neginf", "size", "last_healthy_step")
        s, c = self.first_anomaly_server, self.first_anomaly_cli
        if c is None or s is None:
            return int(c is not s)
        return int(any(s[k] != c[k] for k in keys))


class LiveWriter(threading.Thread):
    """Appends one step of every LIVE_TAGS record every ``interval`` seconds."""

    def __init__(self, run_dir: str, interval: float = 0.02):
        super().__init__(daemon=True)
        self.writer = NumericsRecordWriter(run_dir)
        self.interval = interval
        self.stop = threading.Event()
        self.steps = 0
        self.error: BaseException | None = None

    def write_step(self, step: int) -> None:
        for i, (tag, info) in enumerate(LIVE_TAGS):
            nan = 0.0
            if tag == "dense/kernel_grad" and step == LIVE_NAN_STEP:
                nan = 3.0
            if tag == "dense/output" and step >= LIVE_LATER_NAN_STEP and step % 7 == 0:
                nan = 1.0
            self.writer.write(tag, step, stats_row(1.0 + i + 0.001 * step, nan=nan), info)
        self.writer.flush()
        self.steps = step + 1

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                self.write_step(self.steps)
                time.sleep(self.interval)
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            self.error = e
        finally:
            self.writer.close()


def _get(url: str, timeout: float = 60) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _client(base: str, urls: list[str], stop: threading.Event, seed: int, out: list) -> None:
    """Polls random routes until ``stop``; appends (url, status, json ok, seconds)."""
    rng = random.Random(seed)
    while not stop.is_set():
        url = rng.choice(urls)
        t0 = time.perf_counter()
        status, ok = 0, False  # 0: no answer at all (refused, reset, timed out)
        try:
            status, body = _get(base + url)
            json.loads(body)
            ok = True
        except (OSError, ValueError, http.client.HTTPException):  # a server that died mid-answer too
            pass
        out.append((url, status, ok, time.perf_counter() - t0))


def cli_report(logdir: str) -> dict:
    """``tb-numerics report --json``, run by run (in this process: no second TensorFlow import)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["report", logdir, "--json"])
    if code not in (cli.EXIT_OK, cli.EXIT_ANOMALY):
        raise RuntimeError("tb-numerics report exited with %d" % code)
    return {r["run"]: r for r in json.loads(out.getvalue())["runs"]}


def live_load(logdir: str, seconds: float, clients: int = 50, load_fast: bool = True) -> LoadResult:
    """A writer appends to LIVE_RUN while ``clients`` threads poll every route."""
    writer = LiveWriter(os.path.join(logdir, LIVE_RUN))
    for _ in range(5):  # the run exists before the first request
        writer.write_step(writer.steps)
    with tb_process.tensorboard(logdir, load_fast=load_fast, reload_interval=1) as tb:
        tb_process.wait_for(lambda: tb.get_json(P + "/summary?run=" + LIVE_RUN)["records"] > 0)
        q = "run=" + LIVE_RUN
        urls = [P + "/runs", P + "/summary?" + q, P + "/timeline?width=300&" + q, P + "/safe_range",
                P + "/summary?max_abs=3&" + q, P + "/timeline?width=17&start=10&" + q]
        urls += [P + "/series?max_points=200&tensor=%s&%s" % (urllib.parse.quote(t, safe=""), q) for t, _ in LIVE_TAGS]
        stop = threading.Event()
        answers: list[list] = [[] for _ in range(clients)]
        threads = [threading.Thread(target=_client, args=(tb.url, urls, stop, i, answers[i]), daemon=True)
                   for i in range(clients)]
        writer.start()
        for t in threads:
            t.start()
        time.sleep(seconds)
        writer.stop.set()
        writer.join()
        stop.set()
        for t in threads:
            t.join(timeout=120)
        if writer.error is not None:
            raise writer.error
        written = writer.steps * len(LIVE_TAGS)
        # One reload after the writer stopped: the server sees every record.
        deadline = time.monotonic() + 60
        while True:
            summary = tb.get_json(P + "/summary?" + q)
            if summary["records"] >= written or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    flat = [a for per in answers for a in per]
    statuses = collections.Counter(str(s) for _, s, _, _ in flat)
    invalid = ["%s -> %s" % (u, s) for u, s, ok, _ in flat if s != 200 or not ok]
    lat = np.array([t for *_, t in flat]) * 1000
    by_route: dict[str, list[float]] = collections.defaultdict(list)
    for u, _, _, t in flat:
        by_route[urllib.parse.urlsplit(u).path.rsplit("/", 1)[1]].append(t * 1000)
    cli = cli_report(logdir)[LIVE_RUN]
    return LoadResult(
        requests=len(flat),
        statuses=dict(statuses),
        invalid=invalid,
        latency_ms={"p50": float(np.percentile(lat, 50)), "p95": float(np.percentile(lat, 95)), "max": float(lat.max())},
        route_p95_ms={k: float(np.percentile(v, 95)) for k, v in sorted(by_route.items())},
        records_written=written,
        last_step=writer.steps - 1,
        records_served=summary["records"],
        last_step_served=summary["last_step"],
        first_anomaly_server=summary["first_anomaly"],
        first_anomaly_cli=cli["first_anomaly"],
    )


# ---------------------------------------------------------------- scale


@dataclasses.dataclass
class ScaleResult:
    """Response times of one big run and whether its bad step is visible."""

    run: str
    records: int
    times_s: dict[str, float]
    bad_step: int
    bad_bucket_shown: bool
    anomaly_step: int | None


@dataclasses.dataclass
class Responsiveness:
    """A small run's /summary, timed all along while the big runs load."""

    requests: int
    p95_s: float
    max_s: float
    runs_s: float  # /runs over all three runs, warm


def write_many_tensors(run_dir: str, tensors: int, steps: int, bad_step: int) -> int:
    """``tensors`` tags (forward, then backward) over ``steps``; one NaN at ``bad_step``."""
    with NumericsRecordWriter(run_dir) as w:
        for step in range(steps):
            for i in range(tensors):
                info = metadata.TensorInfo(role="activation" if i < tensors // 2 else "gradient", order=i)
                nan = 2.0 if (i == tensors - 1 and step == bad_step) else 0.0
                w.write("layer%04d/t" % i, step, stats_row(1.0 + i % 7, nan=nan), info)
    return tensors * steps


def write_long_run(run_dir: str, steps: int, bad_step: int | None, tag: str = "long/t") -> int:
    """One tensor over ``steps`` steps, NaN at ``bad_step`` only (None: none)."""
    info = metadata.TensorInfo(role="activation", order=0)
    ok, bad = stats_row(1.0), stats_row(1.0, nan=1.0)
    with NumericsRecordWriter(run_dir) as w:
        for step in range(steps):
            w.write(tag, step, bad if step == bad_step else ok, info)
    return steps


def _timed(tb: tb_process.TensorBoardProcess, path: str) -> tuple[float, dict]:
    t0 = time.perf_counter()
    body = tb.get_json(path, timeout=600)
    return time.perf_counter() - t0, body


def probe_scale(tb: tb_process.TensorBoardProcess, run: str, records: int, bad_step: int, tag: str) -> ScaleResult:
    """Times the routes on a big run and checks the bad step's bucket.

    The first /summary that counts every record includes reading the run
    from TensorBoard (the plugin's cold start); the others are warm.
    """
    q = "run=" + urllib.parse.quote(run, safe="")
    times = {}
    t0 = time.perf_counter()
    tb_process.wait_for(lambda: tb.get_json(P + "/summary?" + q, timeout=600)["records"] >= records,
                        timeout=1800, interval=1)
    times["loaded and first /summary (cold)"] = time.perf_counter() - t0
    times["/summary (warm)"], summary = _timed(tb, P + "/summary?" + q)
    times["/summary max_abs=5 (new analysis)"], _ = _timed(tb, P + "/summary?max_abs=5&" + q)
    times["/timeline width=1000"], timeline = _timed(tb, P + "/timeline?width=1000&" + q)
    times["/series max_points=2000"], _ = _timed(tb, P + "/series?tensor=%s&%s" % (urllib.parse.quote(tag, safe=""), q))
    row = next(r for r in timeline["rows"] if r["tensor"] == tag)
    b = next(i for i, (lo, hi) in enumerate(zip(timeline["bucket_start"], timeline["bucket_end"])) if lo <= bad_step <= hi)
    shown = row["cells"][b] == analysis.NONFINITE and sum(c == analysis.NONFINITE for c in row["cells"]) == 1
    return ScaleResult(run, summary["records"], times, bad_step, shown, (summary["first_anomaly"] or {}).get("step"))


def scale(
    logdir: str, tensors: int, tensor_steps: int, steps: int, load_fast: bool = True
) -> tuple[list[ScaleResult], Responsiveness]:
    """Writes the two big runs and a small one, serves them, and probes each.

    All along, another client times the small run's /summary: the server
    must keep answering it while the big runs are read.
    """
    wide_bad, long_bad = tensor_steps // 2, (steps * 3) // 5 + 1
    wide = write_many_tensors(os.path.join(logdir, "wide"), tensors, tensor_steps, wide_bad)
    long = write_long_run(os.path.join(logdir, "long"), steps, long_bad)
    write_long_run(os.path.join(logdir, "small"), 50, None, "small/t")
    with tb_process.tensorboard(logdir, load_fast=load_fast, reload_interval=5) as tb:
        tb_process.wait_for(lambda: tb.get_json(P + "/summary?run=small")["records"] == 50)
        stop = threading.Event()
        small: list = []
        prober = threading.Thread(target=_client, args=(tb.url, [P + "/summary?run=small"], stop, 0, small), daemon=True)
        prober.start()
        try:
            results = [
                probe_scale(tb, "wide", wide, wide_bad, "layer%04d/t" % (tensors - 1)),
                probe_scale(tb, "long", long, long_bad, "long/t"),
            ]
            runs_s, _ = _timed(tb, P + "/runs")
        finally:
            stop.set()
            prober.join()
    if any(s != 200 or not ok for _, s, ok, _ in small):
        raise AssertionError("the small run's /summary failed while the big runs loaded")
    lat = np.array([t for *_, t in small])
    return results, Responsiveness(len(lat), float(np.percentile(lat, 95)), float(lat.max()), runs_s)


# ---------------------------------------------------------------- report


def print_live(r: LoadResult) -> None:
    print("live appends: %d requests by the clients; statuses %s" % (r.requests, r.statuses))
    print("  latency ms: p50 %.1f, p95 %.1f, max %.1f" % (r.latency_ms["p50"], r.latency_ms["p95"], r.latency_ms["max"]))
    print("  p95 ms by route: %s" % ", ".join("%s %.0f" % kv for kv in r.route_p95_ms.items()))
    print("  records written %d (steps 0-%d), served %d (last step %s)" % (
        r.records_written, r.last_step, r.records_served, r.last_step_served))
    print("  first anomaly: server %s, CLI %s" % (
        _anomaly_words(r.first_anomaly_server), _anomaly_words(r.first_anomaly_cli)))
    print("  5xx: %d, invalid answers: %d, records lost: %d, anomalies missed: %d" % (
        r.server_errors, len(r.invalid), r.records_lost, r.anomalies_missed))
    for line in r.invalid[:10]:
        print("    invalid:", line)


def print_scale(results: list[ScaleResult], resp: Responsiveness) -> None:
    for s in results:
        print("scale run %r: %d records; first anomaly step %s (bad step %d); bad step shown in its timeline bucket: %s" % (
            s.run, s.records, s.anomaly_step, s.bad_step, s.bad_bucket_shown))
        for route, t in s.times_s.items():
            print("  %-36s %.3f s" % (route, t))
    print("responsiveness: a small run's /summary, %d requests while the big runs loaded: p95 %.3f s, max %.3f s" % (
        resp.requests, resp.p95_s, resp.max_s))
    print("  /runs over all runs (warm)           %.3f s" % resp.runs_s)


def _anomaly_words(a: dict | None) -> str:
    return "none" if a is None else "step %d %s (%s)" % (a["step"], a["tensor"], a["description"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--live", action="store_true", help="only the live-append load")
    p.add_argument("--scale", action="store_true", help="only the scale limits")
    p.add_argument("--seconds", type=float, default=float(os.environ.get("TBN_LOAD_SECONDS", 60)))
    p.add_argument("--clients", type=int, default=50)
    p.add_argument("--tensors", type=int, default=1000)
    p.add_argument("--tensor-steps", type=int, default=20, help="steps of the many-tensors run")
    p.add_argument("--steps", type=int, default=1_000_000, help="steps of the one-tensor run")
    p.add_argument("--load-fast", choices=("true", "false"), default="true")
    args = p.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:  # TensorFlow's C++ record writer: writing a million records takes seconds, not minutes
        import tensorflow  # noqa: F401
    except ImportError:
        pass
    load_fast = args.load_fast == "true"
    both = not (args.live or args.scale)
    failures = 0
    if args.live or both:
        with tempfile.TemporaryDirectory() as d:
            r = live_load(os.path.join(d, "logs"), args.seconds, args.clients, load_fast)
        print_live(r)
        failures += r.server_errors + len(r.invalid) + r.records_lost + r.anomalies_missed
    if args.scale or both:
        with tempfile.TemporaryDirectory() as d:
            results, resp = scale(os.path.join(d, "logs"), args.tensors, args.tensor_steps, args.steps, load_fast)
        print_scale(results, resp)
        failures += sum(not s.bad_bucket_shown or s.anomaly_step != s.bad_step for s in results)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
