"""Benchmark of the Numerics plugin backend on a long run, in a real TensorBoard.

Writes one run of 100,000 steps x 500 tensors (50 M records, a NaN at step
77,777; what the Keras callback's defaults write for ResNet-50), packed as
the Keras callback and ``write_many`` write it, starts ``tensorboard`` (the
Rust data server by default), waits until TensorBoard has loaded every
record, then times the routes a user's first look needs and reads
TensorBoard's resident memory, data server included. The plugin warms its
cache while TensorBoard loads, so the first /summary after loading may
answer at once from records read earlier ("stale"); the benchmark reports
that answer's time and completeness, and the time until a complete one:

    .venv/bin/python bench/backend.py --logdir /tmp/bench-logs   # full size, written once (5 min), then reused
    .venv/bin/python bench/backend.py --steps 10000 --tensors 50  # quick
    .venv/bin/python bench/backend.py --record-dtype float64      # a float64 model's records
    .venv/bin/python bench/backend.py --logdir /tmp/bench-live --append 1000   # a training still running

``--append`` times what a user who watches a long training waits for: the
run is written without its NaN; once the plugin has answered for all of it,
1,000 more steps (one packed block, the NaN in their middle) appear in a new
file, and the bench times, from TensorBoard showing their last step, the
plugin's complete answer naming the NaN.

``--relu-share 0.28`` makes the run as the callback writes it for
ResNet-50 in one more way: 28 % of its activations (49 of 176) are ReLU
outputs, whose compact records also hold what the dead-unit rule reads
(17 bytes a record where the others take 5).

To compare two trees, run each from its own folder (``cd TREE &&
PYTHONPATH=TREE python /path/to/bench/backend.py ...``): TensorBoard's
process imports the package of its working directory before
``PYTHONPATH``.

The records are those of float32 tensors by default (statistics accumulated
in float32, so packed rows are stored as float32); ``--record-dtype float64``
gives records no float32 holds exactly, stored as float64: twice the bytes.

Targets (issue 28): the first anomaly <= 2 s after TensorBoard has loaded
the run (the first /summary that names the NaN's step and tensor: a first
look, ``http_api.md``, or the whole run's answer; the whole run's answer,
with every warning and the hint, is timed beside it), a width-1,000
timeline <= 0.5 s, <= 2 GB resident in all (TensorBoard, its data server
and the plugin). Also shown: TensorBoard's
own memory on an empty logdir, each process's share, the ratios to the raw
record bytes (each record's 11 float64 numbers) and to the event files, and
the CPU seconds each process had used when TensorBoard had loaded the run
and when the answer was complete: the work done, whatever else the machine
runs (on a shared machine the wall times are mostly waiting).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
import urllib.parse
from typing import NamedTuple

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests"))
import long_run  # noqa: E402 - the tests' long run, whose records these are made as
import tb_process  # noqa: E402 - the tests' helper that runs a real tensorboard

RUN = "train"
MARKER_TAG = "bench/loaded"
NAN_STEP = 77_777
# The file ``--append`` writes while TensorBoard runs (after the parts, by name).
APPENDED_PART = 99
FIRST_ANOMALY_TARGET_S = 2.0
TIMELINE_TARGET_S = 0.5
MEMORY_TARGET_BYTES = 2e9


def _tensors(n: int, dtype: str = "float32", relu_share: float = 0.0) -> list[tuple[str, "object"]]:
    """``n`` tags with their TensorInfo: activations (``relu_share`` of them
    ReLU outputs, spread evenly), loss, gradients, global norm."""
    from tb_numerics import metadata

    half = (n - 2) // 2
    relu = set(np.floor(np.arange(round(half * relu_share)) / relu_share).astype(int)) if relu_share else set()
    out = []
    for i in range(half):
        kind = {"op_type": "Activation", "activation": "relu"} if i in relu else {}
        out.append(("dense%02d/output" % i, metadata.TensorInfo(
            role="activation", order=i, shape=(512, 1024), dtype=dtype, **kind)))
    out.append(("loss", metadata.TensorInfo(role="loss", order=half, shape=(), dtype=dtype)))
    for i in range(n - 2 - half):
        out.append(("dense%02d/kernel_grad" % i, metadata.TensorInfo(role="gradient", order=i, shape=(1024, 1024), dtype=dtype)))
    out.append(("global_norm", metadata.TensorInfo(role="global_norm", order=n, shape=(), dtype=dtype)))
    return out


def _records(tag_index: int, role: str, steps: np.ndarray, dtype: str) -> np.ndarray:
    """Plausible statistics of one tag of ``dtype`` over ``steps`` (vectorised,
    no tensors): for float32, what float32 accumulation gives."""
    rng = np.random.default_rng(tag_index)
    size = 1 if role in ("loss", "global_norm") else 4096
    scale = (1.0 + 0.1 * tag_index) * np.exp(rng.normal(0, 0.05, len(steps)))
    return long_run.stats(rng, len(steps), size, scale, dtype)


class RunShape(NamedTuple):
    """What the run holds: its tensors, their dtype, the NaN's step and where it is."""

    n_tensors: int
    dtype: str = "float32"
    nan_step: int = NAN_STEP
    relu_share: float = 0.0
    # "gradient": three NaN in a gradient (the backward pass); "loss": the
    # loss +Inf with every layer output finite (a saturated output), where
    # the hints read the step's records of every layer output.
    fault: str = "gradient"


def _write_part(args: tuple[str, int, int, int, RunShape]) -> str:
    """Writes steps [lo, hi) of every tag to one event file, the fault where
    its step falls in them; returns its path."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow  # noqa: F401 - makes NumericsRecordWriter use TF's C++ record writer

    from tb_numerics.metadata import FIELD_INDEX as F
    from tb_numerics.record_writer import NumericsRecordWriter

    run_dir, part, lo, hi, shape = args
    tensors = _tensors(shape.n_tensors, shape.dtype, shape.relu_share)
    steps = np.arange(lo, hi)
    values = [_records(i, info.role, steps, shape.dtype) for i, (_, info) in enumerate(tensors)]
    if lo <= shape.nan_step < hi:
        at = shape.nan_step - lo
        if shape.fault == "loss":
            loss = values[next(i for i, (_, info) in enumerate(tensors) if info.role == "loss")]
            loss[at] = 0.0
            loss[at, F["count"]] = loss[at, F["posinf"]] = 1
            loss[at, F["min"]] = loss[at, F["max"]] = np.nan
        else:  # a NaN in the backward pass of one gradient, three entries of 4,096
            values[len(tensors) // 2 + 3][at, F["nan"]] = 3
    with NumericsRecordWriter(run_dir, filename_suffix=".part%d" % part) as w:
        for j, step in enumerate(steps.tolist()):
            # Each step as the Keras callback writes it.
            w.write_many(step, [(tag, vals[j], info) for (tag, info), vals in zip(tensors, values)])
        path = w.path
    # Files of a run are read in name order; name the parts so they sort by step.
    final = os.path.join(run_dir, "events.out.tfevents.%010d.bench.part%d" % (1, part))
    os.rename(path, final)
    return final


def write_run(logdir: str, steps: int, n_tensors: int, processes: int, dtype: str = "float32", **shape) -> str:
    """Writes the benchmark run (in parallel parts) plus a "loaded" marker;
    ``shape``: the rest of ``RunShape``."""
    run_dir = os.path.join(logdir, RUN)
    os.makedirs(run_dir, exist_ok=True)
    bounds = np.linspace(0, steps, processes + 1).astype(int)
    made = RunShape(n_tensors, dtype, **shape)
    jobs = [(run_dir, p, int(bounds[p]), int(bounds[p + 1]), made) for p in range(processes)]
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        paths = pool.map(_write_part, jobs)
    _append_marker(paths[-1], steps - 1)
    return run_dir


def append_steps(run_dir: str, lo: int, hi: int, shape: RunShape) -> str:
    """Appends steps [lo, hi) to the run as a training still running writes
    them (a file of its own, named after the others), the marker after them;
    returns the file's path."""
    path = _write_part((run_dir, APPENDED_PART, lo, hi, shape))
    _append_marker(path, hi - 1)
    return path


def _append_marker(path: str, step: int) -> None:
    """A scalar at ``step`` after the last record of ``path``: when TensorBoard
    shows it, every record before it has been loaded."""
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.plugins.scalar import metadata as scalar_metadata
    from tensorboard.summary.writer.record_writer import RecordWriter

    marker = summary_pb2.Summary.Value(tag=MARKER_TAG, simple_value=1.0)
    marker.metadata.CopyFrom(scalar_metadata.create_summary_metadata(display_name="", description=""))
    event = event_pb2.Event(wall_time=time.time(), step=step, summary=summary_pb2.Summary(value=[marker]))
    with open(path, "ab") as f:
        RecordWriter(f).write(event.SerializeToString())


def _tree_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) ``pid`` and each descendant used so far,
    by name: the work done, whatever else the machine runs."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for name, p in _tree(pid).items():
        try:
            with open("/proc/%d/stat" % p) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[name] = round((int(fields[11]) + int(fields[12])) / tick, 1)
    return out


def _tree(pid: int) -> dict[str, int]:
    """``pid`` and each descendant, by "name[pid]"."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % entry) as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out: dict[str, int] = {}
    todo = [pid]
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, []))
        try:
            with open("/proc/%d/comm" % p) as f:
                out["%s[%d]" % (f.read().strip(), p)] = p
        except OSError:
            continue
    return out


def _tree_rss_bytes(pid: int) -> dict[str, int]:
    """VmRSS of ``pid`` and each descendant (TensorBoard + data server), by name."""
    rss: dict[str, int] = {}
    for name, p in _tree(pid).items():
        try:
            with open("/proc/%d/status" % p) as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        rss[name] = int(fields.get("VmRSS", "0 kB").split()[0]) * 1024
    return rss


def _live_append(tb, args: argparse.Namespace, run_dir: str, nan_step: int) -> dict[str, object]:
    """A training still running: once the plugin has answered for the whole
    run (no anomaly yet), appends ``args.append`` steps holding the NaN and
    times, from TensorBoard showing them, the plugin's complete answer
    naming it: what a user who watches a long training waits for."""
    q = urllib.parse.quote
    summary_url = "/data/plugin/numerics/summary?run=%s" % q(RUN)
    before = tb.get_json(summary_url, timeout=1800)
    if before["stale"] or before["first_anomaly"] is not None:
        raise SystemExit("--append needs a run without a NaN, shown whole before the append: got %s"
                         % {k: before[k] for k in ("stale", "records", "first_anomaly")})
    last = args.steps + args.append - 1
    # Written outside the logdir and moved in whole, as a flushed file appears.
    with tempfile.TemporaryDirectory(prefix="tbn-bench-append-") as scratch:
        shape = RunShape(args.tensors, args.record_dtype, nan_step, args.relu_share, args.fault)
        path = append_steps(scratch, args.steps, args.steps + args.append, shape)
        shutil.move(path, os.path.join(run_dir, os.path.basename(path)))
    t_written = time.perf_counter()
    marker = "/data/plugin/scalars/scalars?run=%s&tag=%s" % (q(RUN), q(MARKER_TAG))
    tb_process.wait_for(lambda: any(point[1] == last for point in tb.get_json(marker)), timeout=600, interval=0.1)
    t_loaded = time.perf_counter()
    expected = (args.steps + args.append) * args.tensors
    summary = tb_process.wait_for(
        lambda: (s := tb.get_json(summary_url, timeout=600))["records"] == expected and not s["stale"] and s,
        timeout=600, interval=0.1,
    )
    done = time.perf_counter()
    got = (summary["first_anomaly"] or {}).get("step")
    if got != nan_step:
        raise SystemExit("live: the first anomaly at step %s, the NaN was written at %d" % (got, nan_step))
    return {
        "appended_steps": args.append,
        "nan_step": nan_step,
        # From the file's appearance until TensorBoard showed its last step.
        "tensorboard_loaded_s": round(t_loaded - t_written, 2),
        # From then until /summary named the NaN with every record.
        "anomaly_after_load_s": round(done - t_loaded, 3),
    }


def _timed(tb, path: str) -> tuple[float, object]:
    t = time.perf_counter()
    body = tb.get_json(path, timeout=600)
    return time.perf_counter() - t, body


def _naming(tb, summary_url: str, first: dict, nan_step: int) -> dict:
    """The first /summary that names the NaN's step (a first look, or the
    whole run's answer): ``first`` where it does, else the next that does."""
    def names(s: dict) -> bool:
        return (s["first_anomaly"] or {}).get("step") == nan_step

    return first if names(first) else tb_process.wait_for(
        lambda: names(s := tb.get_json(summary_url, timeout=1800)) and s, timeout=3600, interval=0.05)


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The long run's size, where it is written and how TensorBoard loads it
    (shared with bench/dashboard.py, which times the same run in a browser)."""
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--tensors", type=int, default=500)
    p.add_argument("--logdir", help="reuse (or write once into) this logdir")
    p.add_argument("--load-fast", choices=("true", "false"), default="true")
    p.add_argument("--processes", type=int, default=max(1, min(4, os.cpu_count() or 1)))
    p.add_argument("--record-dtype", choices=("float32", "float64"), default="float32",
                   help="the dtype of the logged tensors (float32 records are stored as float32)")
    p.add_argument("--relu-share", type=float, default=0.0,
                   help="the share of activations that are ReLU outputs, whose compact records also hold their "
                        "zero shares (ResNet-50 under the callback: 49 of 176, 0.28)")
    p.add_argument("--fault", choices=("gradient", "loss"), default="gradient",
                   help="the NaN's kind: three NaN in a gradient, or the loss +Inf with every layer output "
                        "finite (the hints then read that step's records of every layer output)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(p)
    p.add_argument("--append", type=int, default=0, metavar="STEPS",
                   help="a training still running: the run is written without its NaN, and once TensorBoard "
                        "has shown it whole, STEPS more steps are appended with the NaN in their middle")
    args = p.parse_args()
    # With --append, the NaN comes with the appended steps.
    nan_step = args.steps + args.append // 2 if args.append else NAN_STEP
    if args.steps <= nan_step and not args.append:
        print("note: --steps %d <= %d: the run has no NaN" % (args.steps, nan_step))

    logdir = args.logdir or tempfile.mkdtemp(prefix="tbn-bench-")
    run_dir = os.path.join(logdir, RUN)
    try:
        if not os.path.isdir(run_dir):
            t = time.perf_counter()
            write_run(logdir, args.steps, args.tensors, args.processes, args.record_dtype, nan_step=nan_step,
                      relu_share=args.relu_share, fault=args.fault)
            print("wrote %d records in %.1f s" % (args.steps * args.tensors, time.perf_counter() - t))
        file_bytes = sum(os.path.getsize(os.path.join(run_dir, f)) for f in os.listdir(run_dir))
        q = urllib.parse.quote
        t_start = time.perf_counter()
        with tb_process.tensorboard(logdir, load_fast=args.load_fast == "true", reload_interval=5) as tb:
            marker = "/data/plugin/scalars/scalars?run=%s&tag=%s" % (q(RUN), q(MARKER_TAG))
            tb_process.wait_for(lambda: tb.get_json(marker), timeout=1800, interval=0.2)
            t_loaded = time.perf_counter()
            loaded = t_loaded - t_start
            cpu_loaded = _tree_cpu_seconds(tb.proc.pid)
            summary_url = "/data/plugin/numerics/summary?run=%s" % q(RUN)
            t_summary, first = _timed(tb, summary_url)
            # ``--append``, or fewer steps than the NaN's: no NaN to name yet.
            named = None if args.append or nan_step >= args.steps else _naming(tb, summary_url, first, nan_step)
            t_anomaly = time.perf_counter() - t_loaded
            expected = args.steps * args.tensors
            summary = tb_process.wait_for(
                lambda: (s := tb.get_json(summary_url, timeout=1800))["records"] == expected
                and not s["stale"] and s,
                timeout=3600, interval=0.5,
            )
            t_complete = time.perf_counter() - t_loaded
            cpu_complete = _tree_cpu_seconds(tb.proc.pid)
            t_summary2, _ = _timed(tb, summary_url)
            t_timeline, timeline = _timed(tb, "/data/plugin/numerics/timeline?run=%s&width=1000" % q(RUN))
            anomaly = summary["first_anomaly"] or {}
            tag = anomaly.get("tensor") or _tensors(args.tensors)[0][0]
            t_series, series = _timed(tb, "/data/plugin/numerics/series?run=%s&tensor=%s" % (q(RUN), q(tag)))
            t_series_zoom, _ = _timed(
                tb,
                "/data/plugin/numerics/series?run=%s&tensor=%s&start=%d&end=%d"
                % (q(RUN), q(tag), max(0, nan_step - 500), nan_step + 500),
            )
            live = _live_append(tb, args, run_dir, nan_step) if args.append else None
            rss_by_process = _tree_rss_bytes(tb.proc.pid)
            rss = sum(rss_by_process.values())
        # TensorBoard itself, on an empty logdir: what memory costs before any record.
        empty = tempfile.mkdtemp(prefix="tbn-bench-empty-")
        try:
            with tb_process.tensorboard(empty, load_fast=args.load_fast == "true") as tb:
                tb_process.wait_for(lambda: tb.get_json("/data/plugin/numerics/runs"), timeout=120)
                rss_empty = sum(_tree_rss_bytes(tb.proc.pid).values())
        finally:
            shutil.rmtree(empty, ignore_errors=True)
        from tb_numerics.metadata import NUM_FIELDS

        # The records' own bytes: NUM_FIELDS float64 numbers each, however
        # they are stored (packed float32 event files are about 60% of it).
        raw = summary["records"] * NUM_FIELDS * 8
        results = {
            "records": summary["records"],
            "raw_record_bytes": raw,
            "event_file_bytes": file_bytes,
            "load_fast": args.load_fast,
            "tensorboard_loaded_s": round(loaded, 2),
            # From TensorBoard's start until /summary answered with every record.
            "summary_complete_after_start_s": round(loaded + t_complete, 2),
            # CPU seconds each process had used by then (the work, whatever
            # the machine's load; TensorBoard's process runs the plugin).
            "cpu_s_when_loaded": cpu_loaded,
            "cpu_s_when_complete": cpu_complete,
            "first_anomaly": {k: anomaly.get(k) for k in ("step", "tensor", "last_healthy_step")},
            # From "loaded" until /summary named the NaN, and whether that was a first look.
            "first_anomaly_after_load_s": round(t_anomaly, 3),
            "first_anomaly_preliminary": named and named.get("preliminary"),
            # The first /summary asked once TensorBoard had loaded everything.
            "summary_first_s": round(t_summary, 3),
            "summary_first_stale": first["stale"],
            "summary_first_preliminary": first.get("preliminary"),
            "summary_first_records": first["records"],
            "summary_first_as_of_step": first["as_of_step"],
            "summary_first_anomaly_step": (first["first_anomaly"] or {}).get("step"),
            # From "loaded" until /summary answered with every record.
            "summary_complete_after_load_s": round(t_complete, 3),
            "summary_cached_s": round(t_summary2, 3),
            "timeline_w1000_s": round(t_timeline, 3),
            "timeline_columns": len(timeline["bucket_start"]),
            "series_s": round(t_series, 3),
            "series_points": len(series["steps"]),
            "series_zoom_s": round(t_series_zoom, 3),
            "rss_bytes": rss,
            "rss_bytes_by_process": rss_by_process,
            "rss_over_raw": round(rss / raw, 2),
            "rss_over_event_files": round(rss / file_bytes, 2),
            "rss_empty_logdir_bytes": rss_empty,
            # Memory the records cost, beyond TensorBoard's own.
            "rss_added_over_raw": round((rss - rss_empty) / raw, 2),
        }
        if live is not None:
            results["live"] = live
        print(json.dumps(results, indent=1))
        # The first-anomaly target: /summary names the NaN's step and tensor in time
        # (a first look, or the whole run's answer); the whole run's answer is shown beside.
        checks = []
        if named is not None:
            note = ("a first look: %s; the hint and the warnings come with the whole run" % named["first_anomaly"][
                "tensor"] if named.get("preliminary") else "the whole run's answer")
            right = named["first_anomaly"]["tensor"] == summary["first_anomaly"]["tensor"]
            checks.append(("first anomaly after load", t_anomaly, FIRST_ANOMALY_TARGET_S, "s", note, right))
        checks += [
            ("complete /summary after load", t_complete, None, "s", "(every warning, the hint, the timeline)", True),
            ("timeline width 1000", t_timeline, TIMELINE_TARGET_S, "s", "", True),
            ("resident memory in all", rss / 1e9, MEMORY_TARGET_BYTES / 1e9, " GB",
             "(%.2fx the raw records, %.2fx the event files; TensorBoard on an empty logdir: %.0f MB)"
             % (rss / raw, rss / file_bytes, rss_empty / 1e6), True),
        ]
        if live is not None:
            checks.append(("live: anomaly after load", live["anomaly_after_load_s"], FIRST_ANOMALY_TARGET_S, "s",
                           "(%d steps appended, the NaN at step %d)" % (args.append, nan_step), True))
        for name, value, target, unit, note, counts in checks:
            if target is None:
                print("%-30s %9.3f%s  %-20s %s" % (name, value, unit, "", note))
                continue
            verdict = "ok" if value <= target and counts else "MISSED"
            print("%-30s %9.3f%s  target <= %g%s  %-6s %s" % (name, value, unit, target, unit, verdict, note))
        return 0
    finally:
        if not args.logdir:
            shutil.rmtree(logdir, ignore_errors=True)
        elif args.append:  # the logdir stays as written, for the next run
            for name in os.listdir(run_dir):
                if name.endswith(".part%d" % APPENDED_PART):
                    os.remove(os.path.join(run_dir, name))


if __name__ == "__main__":
    sys.exit(main())
