"""Where the plugin's CPU goes on a long run: its three phases, in process, without TensorBoard.

``bench/backend.py`` times the plugin inside a real TensorBoard, where the
phases overlap and other processes share the cores. This reads one run of
a local logdir as the plugin does over it (``file_provider``, then
``provider_reads`` and the analysis, with TensorFlow imported as it is in
TensorBoard's process, so that its record reader checks the checksums) and
prints each phase's wall and CPU seconds (every thread's):

    nice .venv/bin/python bench/plugin_phases.py --logdir /tmp/bench-logs   # the logdir bench/backend.py wrote

- index: every record's offset, found by framing the files (``file_provider``);
- read: every numerics record read again and decoded, a long run made compact;
- analysis: the default safe range's analysis and the run's summary.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))


def _timed(name: str, fn):
    """Runs ``fn``, prints its wall and CPU seconds, returns its result."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    print("%-9s %6.1f s wall %6.1f CPU-s" % (name, time.perf_counter() - wall, time.process_time() - cpu), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--logdir", required=True)
    p.add_argument("--run", default="train")
    args = p.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow  # noqa: F401 - as in TensorBoard's process: TF's reader checks the records
    from tensorboard.context import RequestContext

    from tb_numerics import analysis, file_provider, provider_reads, run_store

    files = file_provider.FileProvider(args.logdir, on_listing=False)
    _timed("index", files.index_round)
    limits = run_store.Limits()
    listing = files.list_tensors(experiment_id="", plugin_name="numerics")[args.run]
    reader = provider_reads.ProviderReader(files, limits.records_per_read, limits.compact_above_records)
    tags = _timed("read", lambda: reader.read(RequestContext(), "", args.run, listing, []))
    summary = _timed("analysis", lambda: analysis.run_summary(
        provider_reads.Snapshot(tags, limits).analysis(args.run, analysis.SafeRange(), [])))
    first = summary["first_anomaly"]
    print("%d records; first anomaly %s" % (summary["records"], first and "step %d, %s" % (first["step"], first["tensor"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
