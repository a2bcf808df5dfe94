"""The damage storm: a real TensorBoard under clients while files are appended and damaged.

Issue 27's storm: one writer appends records to a run (``load.LiveWriter``,
its NaN at ``load.LIVE_NAN_STEP``) while, every second, damage is appended
to a second run, and clients poll every route of both. Each tick appends one
damage kind, in turn, to the damaged run's first event file, and writes a new
event file in that run (two healthy steps, then the same damage), so that
every kind is at some point where TensorBoard's loader stops and waits
(TensorBoard's Python loader never reads a file past a damaged record, and
moves on to a newer file). The kinds:

- ``random``: random bytes;
- ``giant``: a record header with a valid checksum that claims 1 TiB;
- ``bad_crc``: a whole numerics record whose data fails its checksum;
- ``cut``: a numerics record cut inside its data.

The damaged run also holds a FIFO named like its first event file.

Afterwards: no 5xx and no answer that is not 200 + JSON, the server still
running, every record of the live run served, and each run's first anomaly
at the step its NaN was injected. Prints those and the server's memory
(resident set before and after the storm, and its peak).

    .venv/bin/python bench/storm.py                       # 10 clients, 30 s, --load-fast false
    .venv/bin/python bench/storm.py --kinds giant --seconds 10
    .venv/bin/python bench/storm.py --load-fast true

Exits 1 where anything above failed. ``tests/test_storm.py`` runs it smaller.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import itertools
import os
import random
import struct
import sys
import tempfile
import threading
import time
import urllib.parse

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import load  # noqa: E402 - bench/load.py
from load import P, tb_process  # noqa: E402

from tensorboard.compat.proto import event_pb2, summary_pb2  # noqa: E402
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c  # noqa: E402

from tb_numerics import metadata  # noqa: E402
from tb_numerics.record_writer import NumericsRecordWriter, stats_tensor_proto  # noqa: E402

KINDS = ("random", "giant", "bad_crc", "cut")
DAMAGED_RUN = "damaged"
DAMAGED_TAG = "dense/output"
DAMAGED_INFO = metadata.TensorInfo(role="activation", order=0, op_type="MatMul")
DAMAGED_STEPS = 30
DAMAGED_NAN_STEP = 12
FIFO_NAME = "events.out.tfevents.0000000000.fifo"


def frame(data: bytes) -> bytes:
    """``data`` as one TFRecord: length, its checksum, data, the data's checksum."""
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", masked_crc32c(header)) + data + struct.pack("<I", masked_crc32c(data))


def _record_event(step: int) -> bytes:
    """A healthy numerics record of DAMAGED_TAG at ``step``, serialized."""
    value = summary_pb2.Summary.Value(tag=DAMAGED_TAG, tensor=stats_tensor_proto(load.stats_row(1.0)))
    value.metadata.CopyFrom(metadata.create_later_metadata())
    event = event_pb2.Event(wall_time=time.time(), step=step, summary=summary_pb2.Summary(value=[value]))
    return event.SerializeToString()


def damage(kind: str, rng: random.Random, step: int) -> bytes:
    """The bytes of one damage ``kind`` (see KINDS)."""
    if kind == "random":
        return rng.randbytes(rng.randint(1, 200))
    if kind == "giant":
        header = struct.pack("<Q", 2**40)
        return header + struct.pack("<I", masked_crc32c(header)) + b"x" * 64
    framed = bytearray(frame(_record_event(step)))
    if kind == "bad_crc":
        framed[20] ^= 0xFF  # inside the data: its checksum fails, the header's holds
        return bytes(framed)
    if kind == "cut":
        return bytes(framed[: rng.randint(13, len(framed) - 5)])
    raise ValueError("unknown damage kind %r (known: %s)" % (kind, ", ".join(KINDS)))


def write_damaged_run(run_dir: str) -> str:
    """The damaged run before the storm: one tag, NaN at DAMAGED_NAN_STEP; its file's path.

    Beside it, where the system has them, a FIFO named like the run's first
    event file (TensorBoard's Python loader would wait on it forever)."""
    with NumericsRecordWriter(run_dir) as w:
        for step in range(DAMAGED_STEPS):
            nan = 2.0 if step == DAMAGED_NAN_STEP else 0.0
            w.write(DAMAGED_TAG, step, load.stats_row(1.0, nan=nan), DAMAGED_INFO)
    if hasattr(os, "mkfifo"):
        os.mkfifo(os.path.join(run_dir, FIFO_NAME))
    return w.path


class Damager(threading.Thread):
    """Every ``interval`` seconds, one damage kind (in turn) to the damaged run."""

    def __init__(self, run_dir: str, first_file: str, kinds: tuple[str, ...], interval: float = 1.0):
        super().__init__(daemon=True)
        self.run_dir, self.first_file, self.interval = run_dir, first_file, interval
        self.kinds = itertools.cycle(kinds)
        self.stop = threading.Event()
        self.rng = random.Random(27)
        self.step = DAMAGED_STEPS  # healthy steps written later continue the run
        self.done: list[str] = []
        self.error: BaseException | None = None

    def tick(self) -> None:
        kind = next(self.kinds)
        with open(self.first_file, "ab") as f:
            f.write(damage(kind, self.rng, self.step))
        name = "events.out.tfevents.%010d.storm.%d" % (time.time(), len(self.done))
        with open(os.path.join(self.run_dir, name), "ab") as f:
            f.write(frame(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2").SerializeToString()))
            for _ in range(2):
                f.write(frame(_record_event(self.step)))
                self.step += 1
            f.write(damage(kind, self.rng, self.step))
        self.done.append(kind)

    def run(self) -> None:
        try:
            while not self.stop.wait(self.interval):
                self.tick()
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            self.error = e


@dataclasses.dataclass
class StormResult:
    """What the clients saw, whether the server lived, and what it served afterwards."""

    load_fast: bool
    seconds: float
    clients: int
    damage: list[str]  # the kinds appended, in order
    requests: int
    statuses: dict[str, int]
    invalid: list[str]  # answers that were not 200 + JSON (0: no answer at all)
    exit_code: int | None  # the server's, where it died (-11: a segfault)
    fatal: str  # "Fatal Python error" and the lines after it in the server's log
    first_anomaly_step: dict[str, int | None]  # per run, served after the storm
    problems: dict[str, list[str]]  # per run, served after the storm
    truth_step: dict[str, int]  # per run, where its NaN was injected
    records_written: int  # the live run's
    records_served: int | None
    rss_mb: dict[str, float]  # the server's resident set: before, after, peak

    @property
    def server_errors(self) -> int:
        return sum(n for code, n in self.statuses.items() if code.startswith("5"))

    @property
    def failures(self) -> list[str]:
        """Everything that went wrong, in words; empty where nothing did."""
        out = []
        if self.exit_code is not None or self.fatal:
            out.append("the server died (exit %s)" % self.exit_code)
        if self.server_errors or self.invalid:
            out.append("%d 5xx, %d invalid answers" % (self.server_errors, len(self.invalid)))
        for run, step in self.truth_step.items():
            if self.first_anomaly_step.get(run) != step:
                out.append("%s: first anomaly at %s, injected at %d" % (run, self.first_anomaly_step.get(run), step))
        if self.records_served != self.records_written:
            out.append("live: %s records served of %d" % (self.records_served, self.records_written))
        return out


def _rss_mb(pid: int) -> dict[str, float]:
    """The process's resident set and its peak so far (Linux), in MB."""
    out = {}
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out[key] = int(value.split()[0]) / 1024
    except OSError:
        pass
    return out


def _urls() -> list[str]:
    urls = [P + "/runs", P + "/safe_range"]
    for run, tag in ((load.LIVE_RUN, "dense/kernel_grad"), (DAMAGED_RUN, DAMAGED_TAG)):
        q = "run=" + run
        urls += [P + "/summary?" + q, P + "/timeline?width=300&" + q, P + "/timeline?width=17&start=10&" + q,
                 P + "/series?max_points=200&tensor=%s&%s" % (urllib.parse.quote(tag, safe=""), q)]
    return urls


def _fatal(log: str) -> str:
    """The crash in the server's log: the error and the crashing thread's stack (TensorBoard turns faulthandler on)."""
    at = log.find("Fatal Python error")
    if at < 0:
        return ""
    current = log.find("Current thread", at)
    block = log[current:].split("\n\n", 1)[0] if current >= 0 else ""
    return log[at:log.find("\n", at)] + "\n" + block


def _served(tb: tb_process.TensorBoardProcess, written: int) -> tuple[dict, dict, int | None]:
    """After one reload past the writers: each run's first anomaly step and
    problems, and the live run's record count."""
    def summary(run: str) -> dict:
        return tb.get_json(P + "/summary?run=" + run)

    try:
        tb_process.wait_for(lambda: summary(load.LIVE_RUN)["records"] >= written, timeout=60)
    except AssertionError:
        pass
    out, problems, records = {}, {}, None
    for run in (load.LIVE_RUN, DAMAGED_RUN):
        try:
            s = summary(run)
        except (AssertionError, OSError, ValueError):
            continue
        out[run] = (s["first_anomaly"] or {}).get("step")
        problems[run] = s["problems"]
        if run == load.LIVE_RUN:
            records = s["records"]
    return out, problems, records


def storm(logdir: str, seconds: float, clients: int = 10, load_fast: bool = False,
          kinds: tuple[str, ...] = KINDS) -> StormResult:
    """Serves ``logdir`` while the live run grows and the damaged run is damaged; see the module doc."""
    writer = load.LiveWriter(os.path.join(logdir, load.LIVE_RUN))
    for _ in range(5):  # the runs exist before the first request
        writer.write_step(writer.steps)
    damaged_dir = os.path.join(logdir, DAMAGED_RUN)
    damager = Damager(damaged_dir, write_damaged_run(damaged_dir), kinds)
    with tb_process.tensorboard(logdir, load_fast=load_fast, reload_interval=1) as tb:
        tb_process.wait_for(lambda: all(tb.get_json(P + "/summary?run=" + r)["records"] > 0
                                        for r in (load.LIVE_RUN, DAMAGED_RUN)))
        before = _rss_mb(tb.proc.pid)
        stop = threading.Event()
        answers: list[list] = [[] for _ in range(clients)]
        threads = [threading.Thread(target=load._client, args=(tb.url, _urls(), stop, i, answers[i]), daemon=True)
                   for i in range(clients)]
        for t in [writer, damager, *threads]:
            t.start()
        time.sleep(seconds)
        writer.stop.set()
        damager.stop.set()
        writer.join()
        damager.join()
        stop.set()
        for t in threads:
            t.join(timeout=120)
        for e in (writer.error, damager.error):
            if e is not None:
                raise e
        written = writer.steps * len(load.LIVE_TAGS)
        first, problems, records = _served(tb, written) if tb.proc.poll() is None else ({}, {}, None)
        after = _rss_mb(tb.proc.pid)
        exit_code, fatal = tb.proc.poll(), _fatal(tb.log)
    flat = [a for per in answers for a in per]
    return StormResult(
        load_fast=load_fast, seconds=seconds, clients=clients, damage=damager.done,
        requests=len(flat),
        statuses=dict(collections.Counter(str(s) for _, s, _, _ in flat)),
        invalid=["%s -> %s" % (u, s) for u, s, ok, _ in flat if s != 200 or not ok],
        exit_code=exit_code, fatal=fatal,
        first_anomaly_step=first, problems=problems,
        truth_step={load.LIVE_RUN: load.LIVE_NAN_STEP, DAMAGED_RUN: DAMAGED_NAN_STEP},
        records_written=written, records_served=records,
        rss_mb={"before": before.get("VmRSS", 0.0), "after": after.get("VmRSS", 0.0), "peak": after.get("VmHWM", 0.0)},
    )


def print_storm(r: StormResult) -> None:
    print("storm: --load_fast=%s, %d clients for %.0f s, damage appended %d times (%s)" % (
        str(r.load_fast).lower(), r.clients, r.seconds, len(r.damage),
        ", ".join("%s %d" % (k, r.damage.count(k)) for k in KINDS if k in r.damage)))
    print("  %d requests; statuses %s; invalid answers %d" % (r.requests, r.statuses, len(r.invalid)))
    print("  server: %s" % ("running" if r.exit_code is None and not r.fatal else "DIED, exit %s" % r.exit_code))
    print("  first anomaly served after the storm: %s (injected: %s)" % (r.first_anomaly_step, r.truth_step))
    print("  live run: %s records served of %d written" % (r.records_served, r.records_written))
    print("  problems served for the damaged run: %d" % len(r.problems.get(DAMAGED_RUN, [])))
    for line in r.problems.get(DAMAGED_RUN, [])[:2]:
        print("    " + line)
    if r.rss_mb["after"]:
        print("  server memory (resident): %.0f MB before, %.0f MB after (%+.0f MB), peak %.0f MB" % (
            r.rss_mb["before"], r.rss_mb["after"], r.rss_mb["after"] - r.rss_mb["before"], r.rss_mb["peak"]))
    for line in r.invalid[:5]:
        print("    invalid:", line)
    if r.fatal:
        print("  the server's log:\n    " + "\n    ".join(r.fatal.splitlines()[:40]))
    print("  failures: %s" % ("; ".join(r.failures) or "none"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=30)
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--load-fast", choices=("true", "false"), default="false")
    p.add_argument("--kinds", default=",".join(KINDS),
                   help="damage kinds, in turn (default: all of %s)" % ", ".join(KINDS))
    args = p.parse_args()
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        p.error("--kinds: unknown %s (known: %s)" % (", ".join(unknown) or "(none given)", ", ".join(KINDS)))
    with tempfile.TemporaryDirectory() as d:
        r = storm(os.path.join(d, "logs"), args.seconds, args.clients, args.load_fast == "true", kinds)
    print_storm(r)
    return 1 if r.failures else 0


if __name__ == "__main__":
    sys.exit(main())
