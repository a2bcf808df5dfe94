"""Reads every numerics record of a logdir straight from its event files.

The CLI's reader: no sampling, every record. (The plugin reads through
TensorBoard's data provider instead.) A corrupt or truncated file is read up
to the damage, the damage is reported, and the rest of the logdir is still
read.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Iterator

import numpy as np
from google.protobuf.message import DecodeError
from tensorboard.compat.proto import event_pb2

from tb_numerics import analysis, metadata


@dataclasses.dataclass
class RunRecords:
    """The numerics series of one run read from disk, and what went wrong."""

    run: str
    series: list[analysis.TensorSeries]
    problems: list[str]


def _is_event_file(name: str) -> bool:
    return "tfevents" in name


def find_runs(logdir: str) -> dict[str, list[str]]:
    """Run name (relative directory, "." for logdir itself) -> event files."""
    runs: dict[str, list[str]] = {}
    for dirpath, dirnames, filenames in os.walk(logdir):
        dirnames.sort()
        files = sorted(f for f in filenames if _is_event_file(f))
        if files:
            rel = os.path.relpath(dirpath, logdir)
            runs[rel] = [os.path.join(dirpath, f) for f in files]
    return runs


def _records(path: str, problems: list[str]) -> Iterator[bytes]:
    """Serialized records of one TFRecord file, stopping at damage."""
    from tensorboard.backend.event_processing import event_file_loader
    from tensorboard.compat import tf

    try:
        it = event_file_loader._make_tf_record_iterator(path)  # C++ CRC checks when TF is present
    except Exception as e:  # noqa: BLE001 - unreadable file: report and go on
        problems.append("%s: cannot open (%s)" % (os.path.basename(path), e))
        return
    count = 0
    while True:
        try:
            data = next(it)
        except StopIteration:
            return
        except tf.errors.DataLossError as e:
            problems.append(
                "%s: corrupt or truncated after %d record(s); the rest of the file was skipped (%s)"
                % (os.path.basename(path), count, str(e).splitlines()[0] if str(e) else "data loss")
            )
            return
        count += 1
        yield data


def read_run(run: str, files: list[str]) -> RunRecords:
    """Reads all numerics records of one run's event files."""
    problems: list[str] = []
    infos: dict[str, metadata.TensorInfo] = {}
    rejected: set[str] = set()
    points: dict[str, tuple[list[int], list[np.ndarray]]] = {}
    for path in files:
        for data in _records(path, problems):
            try:
                event = event_pb2.Event.FromString(data)
            except DecodeError:
                problems.append("%s: an undecodable event was skipped" % os.path.basename(path))
                continue
            if not event.HasField("summary"):
                continue
            for value in event.summary.value:
                tag = value.tag
                if tag not in infos and tag not in rejected and value.HasField("metadata"):
                    pd = value.metadata.plugin_data
                    if pd.plugin_name != metadata.PLUGIN_NAME:
                        rejected.add(tag)
                        continue
                    try:
                        infos[tag] = metadata.parse_plugin_metadata(
                            pd.content, value.metadata.summary_description
                        )
                    except metadata.FormatError as e:
                        rejected.add(tag)
                        problems.append("%s: %s" % (tag, e))
                        continue
                if tag not in infos or not value.HasField("tensor"):
                    continue
                t = value.tensor
                vec = np.frombuffer(t.tensor_content, dtype="<f8") if t.tensor_content else np.asarray(
                    t.double_val, dtype=np.float64
                )
                steps, rows = points.setdefault(tag, ([], []))
                steps.append(event.step)
                rows.append(vec)
    series = [
        analysis.make_series(tag, infos[tag], steps, rows, problems)
        for tag, (steps, rows) in points.items()
    ]
    return RunRecords(run, series, problems)


def read_logdir(logdir: str) -> list[RunRecords]:
    """Every run under ``logdir`` that holds numerics records, by run name."""
    out = []
    for run, files in sorted(find_runs(logdir).items()):
        rr = read_run(run, files)
        if rr.series or rr.problems:
            out.append(rr)
    return out
