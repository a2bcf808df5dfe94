"""What ``loader_guard`` costs TensorBoard's Python loader.

Writes one event file of small per-tensor numerics records (the most records
per byte, so the guard's per-record work weighs most), then reads it whole
with TensorBoard's own code, unguarded and guarded in turn, ``--reps`` times
each, interleaved (each first in turn): ``RawEventFileLoader`` (records
only: the guard's worst case) and TensorBoard's ``EventAccumulator``
reloading the run (the records parsed and kept, as the Python loader reloads
a run). Prints the median CPU seconds of each (less noisy than wall time on
a loaded machine) and the paired ratios.

    nice .venv/bin/python bench/loader_guard.py --records 200000 --reps 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow  # noqa: E402,F401 - the C++ record writer and reader, as TensorBoard uses them

from tensorboard.backend.event_processing import event_file_loader, plugin_event_accumulator  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import load  # noqa: E402 - bench/load.py: plausible records

from tb_numerics import loader_guard, metadata  # noqa: E402
from tb_numerics.record_writer import NumericsRecordWriter  # noqa: E402


def write_file(run_dir: str, records: int) -> str:
    info = metadata.TensorInfo(role="activation", order=0)
    with NumericsRecordWriter(run_dir) as w:
        for step in range(records):
            w.write("dense/output", step, load.stats_row(1.0 + step * 1e-6), info)
    return w.path


def read_records(path: str) -> int:
    return sum(1 for _ in event_file_loader.RawEventFileLoader(path).Load())


def reload_run(path: str) -> int:
    acc = plugin_event_accumulator.EventAccumulator(os.path.dirname(path), size_guidance={"tensors": 0})
    acc.Reload()
    return 1 + sum(len(acc.Tensors(t)) for t in acc.Tags()["tensors"])  # and the file_version event


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=int, default=200_000)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    unguarded = event_file_loader._make_tf_record_iterator
    loader_guard.install()
    guarded = event_file_loader._make_tf_record_iterator
    with tempfile.TemporaryDirectory() as d:
        path = write_file(os.path.join(d, "run"), args.records)
        print("one file of %d records, %.1f MB" % (args.records + 1, os.path.getsize(path) / 1e6))
        for read in (read_records, reload_run):
            times: dict[str, list[float]] = {"unguarded": [], "guarded": []}
            for rep in range(args.reps):
                pair = (("unguarded", unguarded), ("guarded", guarded))
                for name, make in pair if rep % 2 == 0 else pair[::-1]:  # neither always first
                    event_file_loader._make_tf_record_iterator = make
                    t0 = time.process_time()  # CPU seconds: less noise from a loaded machine than wall time
                    n = read(path)
                    times[name].append(time.process_time() - t0)
                    assert n == args.records + 1, n
            a, b = statistics.median(times["unguarded"]), statistics.median(times["guarded"])
            ratios = [g / u for u, g in zip(times["unguarded"], times["guarded"])]
            print("%-14s CPU: unguarded %.3f s, guarded %.3f s: %.3fx (paired ratios %s)" % (
                read.__name__, a, b, b / a, ", ".join("%.3f" % r for r in ratios)))
    event_file_loader._make_tf_record_iterator = guarded
    return 0


if __name__ == "__main__":
    sys.exit(main())
