"""Where the plugin's CPU goes on a long run: its three phases, in process, without TensorBoard.

``bench/backend.py`` times the plugin inside a real TensorBoard, where the
phases overlap and other processes share the cores. This reads one run of
a local logdir as the plugin does over it (``file_provider``, then
``provider_reads`` and the analysis, with TensorFlow imported as it is in
TensorBoard's process, so that its record reader checks the checksums) and
prints each phase's wall and CPU seconds (every thread's):

    nice .venv/bin/python bench/plugin_phases.py --logdir /tmp/bench-logs   # the logdir bench/backend.py wrote
    PYTHONPATH=/tmp/base nice .venv/bin/python bench/plugin_phases.py --logdir DIR   # another tree's package

- index: every record's offset, found by framing the files (``file_provider``);
- read: every numerics record read again and decoded, a long run made compact;
- analysis: the default safe range's analysis and the run's summary.

It measures the ``tb_numerics`` Python imports: this tree where the
README's test command installed it (editable), the tree on ``PYTHONPATH``
where one is given.

Each tensor whose records the analysis reads back whole from the files (a
compact series' slow fallback, ``CompactSeries.values``) is printed as it
happens, and counted: on a long run each costs seconds.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time



def _timed(name: str, fn):
    """Runs ``fn``, prints its wall and CPU seconds, returns its result."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    print("%-9s %6.1f s wall %6.1f CPU-s" % (name, time.perf_counter() - wall, time.process_time() - cpu), flush=True)
    return out


class _ReadBack(logging.Handler):
    """Prints and counts the compact series read back whole."""

    def __init__(self) -> None:
        super().__init__()
        self.count, self._start = 0, time.perf_counter()

    def emit(self, record: logging.LogRecord) -> None:
        if "reading all" in record.getMessage():
            self.count += 1
            print("%8.1f s  %s" % (time.perf_counter() - self._start, record.getMessage()), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--logdir", required=True)
    p.add_argument("--run", default="train")
    args = p.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow  # noqa: F401 - as in TensorBoard's process: TF's reader checks the records
    from tensorboard.context import RequestContext

    from tb_numerics import analysis, file_provider, provider_reads, run_store

    read_back = _ReadBack()
    logging.getLogger("tb_numerics.compact").addHandler(read_back)
    logging.getLogger("tb_numerics.compact").setLevel(logging.INFO)
    files = file_provider.FileProvider(args.logdir, on_listing=False)
    _timed("index", files.index_round)
    limits = run_store.Limits()
    listing = files.list_tensors(experiment_id="", plugin_name="numerics")[args.run]
    reader = provider_reads.ProviderReader(files, limits.records_per_read, limits.compact_above_records)
    tags = _timed("read", lambda: reader.read(RequestContext(), "", args.run, listing, []))
    summary = _timed("analysis", lambda: analysis.run_summary(
        provider_reads.Snapshot(tags, limits).analysis(args.run, analysis.SafeRange(), [])))
    first = summary["first_anomaly"]
    print("%d records; first anomaly %s; %d tensor(s) read back whole" % (
        summary["records"], first and "step %d, %s" % (first["step"], first["tensor"]), read_back.count))
    return 0


if __name__ == "__main__":
    sys.exit(main())
