"""Reads every numerics record of a logdir straight from its event files.

The CLI's reader: no sampling, every record. (The plugin reads through
TensorBoard's data provider instead.) A logdir's files are found and
opened by ``event_files`` (local paths without TensorFlow, others through
``tf.io.gfile``), and each file's records are framed and checked by
``tfrecord`` (damaged records skipped and reported, everything readable
read); this module decodes the records into each run's series.

A skipped record's bytes are decoded once more, for its tag name only
(never its values), so that the problems say which tensor lost records; and
records of a tag whose first event (and with it the tag's metadata) was
lost are still read where they are recognisable as numerics records: a
packed block's later events carry its table, a per-tensor record after a
tag's first carries the plugin's name (``metadata.create_later_metadata``),
and what its metadata would have said is then inferred and reported
(``metadata.info_from_tag``).

Standard scalar summaries (``tf.summary.scalar``, TF1's ``simple_value``)
are kept beside the numerics records (``RunRecords.scalars``): the report
falls back to them where a run's numerics records hold no anomaly.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
from google.protobuf.message import DecodeError
from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, types_pb2

from tb_numerics import metadata, packed, records, survive
from tb_numerics.event_files import LogdirError, check_logdir, find_runs
from tb_numerics.tfrecord import Record, py_record_reader, read_records, tf_record_reader

__all__ = [
    "LogdirError",
    "Record",
    "RunRecords",
    "check_logdir",
    "find_runs",
    "py_record_reader",
    "read_logdir",
    "read_records",
    "read_run",
    "tf_record_reader",
]

# How many tensors of a damaged packed block one problem line names.
_MAX_TAGS_SHOWN = 5


def _vector(t: tensor_pb2.TensorProto) -> np.ndarray:
    """A record's values as float64; empty (so counted malformed) if unreadable."""
    if t.dtype == types_pb2.DT_DOUBLE and t.tensor_content and len(t.tensor_content) % 8 == 0:
        return np.frombuffer(t.tensor_content, dtype="<f8")
    try:
        return np.asarray(packed.tensor_values(t), dtype=np.float64).reshape(-1)
    except (ValueError, TypeError, KeyError):
        return np.zeros(0)


def _scalar(t: tensor_pb2.TensorProto) -> float:
    """A scalar summary's value.

    Raises:
      ValueError, TypeError, KeyError: the tensor does not decode to one value.
    """
    v = np.asarray(packed.tensor_values(t), dtype=np.float64).reshape(-1)
    if v.size != 1:
        raise ValueError("it holds %d values, not one" % v.size)
    return float(v[0])


def _matrix(t: tensor_pb2.TensorProto) -> np.ndarray:
    """A packed event's rows in their own dtype (``unpack_block`` checks it);
    empty (so counted malformed) if unreadable."""
    try:
        return np.asarray(packed.tensor_values(t))
    except (ValueError, TypeError, KeyError):
        return np.zeros(0)


@dataclasses.dataclass
class RunRecords:
    """The numerics series and scalar summaries of one run read from disk,
    and what went wrong."""

    run: str
    series: list[records.TensorSeries]
    problems: list[str]
    # Standard scalar summaries: tag -> (steps, values), in file order.
    scalars: dict[str, tuple[np.ndarray, np.ndarray]] = dataclasses.field(default_factory=dict)
    # What the training did about its anomalies (``survive.parse_event``), in file order.
    actions: list[dict] = dataclasses.field(default_factory=list)
    # Steps a later training wrote again (packed.restart_summary).
    restarts: list[dict[str, int]] = dataclasses.field(default_factory=list)


class _RunReader:
    """Gathers one run's numerics records from its events, in file order.

    A tag's ``TensorInfo`` (or a packed block's table) comes from the first
    of its events that carries numerics metadata; a tag whose metadata names
    another plugin, or cannot be read, is left out. Where a tag's first
    event was lost, a later per-tensor event with the plugin's name but no
    content stands in for it: the info is inferred (``inferred``) until a
    full one comes.
    """

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.restarts: list[tuple[str, int, int]] = []
        self.infos: dict[str, metadata.TensorInfo | metadata.BlockTable] = {}
        self.inferred: set[str] = set()
        self.rejected: set[str] = set()
        # tag -> each event's step, tensor and wall time
        self.points: dict[str, tuple[list[int], list[np.ndarray], list[float]]] = {}
        # Records lost to damage, by tag ("" where the tag could not be read).
        self.damaged: dict[str, int] = {}
        # Records of tags never claimed by numerics metadata: readable only
        # with metadata that was lost, where a damaged record names the tag.
        self.unclaimed: dict[str, int] = {}
        # tf.summary.scalar values (what Keras' TensorBoard callback writes):
        # tag -> (steps, values).
        self.scalars: dict[str, tuple[list[int], list[float]]] = {}
        self.actions: list[dict] = []  # action events (``survive``)

    def add_file(self, path: str) -> None:
        undecodable = 0
        for data, intact in read_records(path, self.problems):
            if not intact:
                self._add_damaged(data)
                continue
            try:
                event = event_pb2.Event.FromString(data)
            except DecodeError:
                undecodable += 1
                continue
            if event.HasField("summary"):
                for value in event.summary.value:
                    self._add_value(event.step, value, event.wall_time)
        if undecodable:
            self.problems.append(
                "%s: %d record(s) that are not events skipped" % (os.path.basename(path), undecodable)
            )

    def _add_value(self, step: int, value: summary_pb2.Summary.Value, wall_time: float) -> None:
        tag = value.tag
        if self._add_scalar(step, value) or self._add_action(step, value):
            return
        if not self._claim(value):
            if tag not in self.rejected and value.HasField("tensor"):
                self.unclaimed[tag] = self.unclaimed.get(tag, 0) + 1
            return
        if not value.HasField("tensor"):
            return
        steps, rows, walls = self.points.setdefault(tag, ([], [], []))
        steps.append(step)
        walls.append(wall_time)
        block = not isinstance(self.infos[tag], metadata.TensorInfo)
        rows.append(_matrix(value.tensor) if block else _vector(value.tensor))

    def _add_scalar(self, step: int, value: summary_pb2.Summary.Value) -> bool:
        """Keeps a standard scalar summary's value (TF1's ``simple_value``,
        or a tensor of the scalars plugin); False for any other value."""
        tag = value.tag
        if value.WhichOneof("value") == "simple_value":
            x = value.simple_value
        elif tag in self.scalars or (
            value.HasField("metadata") and value.metadata.plugin_data.plugin_name == _SCALARS_PLUGIN
        ):
            try:
                x = _scalar(value.tensor)
            except (ValueError, TypeError, KeyError) as e:
                self.problems.append("%s: a scalar summary at step %d skipped: %s" % (tag, step, e))
                return True
        else:
            return False
        steps, values = self.scalars.setdefault(tag, ([], []))
        steps.append(step)
        values.append(x)
        return True

    def _add_action(self, step: int, value: summary_pb2.Summary.Value) -> bool:
        """Keeps an action event (each carries its metadata); False for any other value."""
        if value.metadata.plugin_data.plugin_name != metadata.ACTIONS_PLUGIN:
            return False
        event = action_of(value.metadata.plugin_data.content, value.tensor, step, self.problems)
        if event is not None:
            self.actions.append(event)
        return True

    def _claim(self, value: summary_pb2.Summary.Value) -> bool:
        """Whether ``value`` is a numerics record, learning its tag's info
        from its metadata where the tag's is not known yet."""
        tag = value.tag
        if tag in self.rejected or (tag in self.infos and tag not in self.inferred):
            return tag not in self.rejected
        if not value.HasField("metadata"):
            return tag in self.infos
        pd = value.metadata.plugin_data
        if pd.plugin_name != metadata.PLUGIN_NAME:
            if tag not in self.infos:
                self.rejected.add(tag)
            return tag in self.infos
        if not pd.content:  # a later record of a tag whose first was lost
            if tag not in self.infos:
                self.infos[tag] = metadata.info_from_tag(tag)
                self.inferred.add(tag)
            return True
        try:
            self.infos[tag] = metadata.parse_content(pd.content, value.metadata.summary_description)
        except metadata.FormatError as e:
            self.problems.append("%s: %s" % (tag, e))
            if tag not in self.infos:
                self.rejected.add(tag)
            return tag in self.infos
        self.inferred.discard(tag)
        return True

    def _add_damaged(self, data: bytes) -> None:
        """Counts a damaged record by its tag, read from its bytes where
        they still decode as an event (its values are never used)."""
        try:
            event = event_pb2.Event.FromString(data)
            tags = [v.tag for v in event.summary.value] if event.HasField("summary") else []
        except DecodeError:
            tags = [""]
        for tag in tags:
            self.damaged[tag] = self.damaged.get(tag, 0) + 1

    def damage_problems(self) -> list[str]:
        """One line per tag that lost records to damage."""
        out = []
        for tag, n in sorted(self.damaged.items()):
            if tag in self.rejected:
                continue  # not a numerics record: the file's problem line says it
            if not tag:
                out.append("%d damaged record(s) whose tag could not be read were skipped" % n)
                continue
            line = "%s%s: %d damaged record(s) skipped" % (tag, self._block_text(tag), n)
            lost = self.unclaimed.get(tag, 0)
            if lost:
                line += ", and %d later record(s) that cannot be read without the metadata they held" % lost
            out.append(line)
        return out

    def _block_text(self, tag: str) -> str:
        table = self.infos.get(tag)
        if not packed.is_block_tag(tag) or isinstance(table, metadata.TensorInfo):
            return ""
        if table is None:
            return " (a packed block)"
        names = [t for t, _ in table[:_MAX_TAGS_SHOWN]]
        more = len(table) - len(names)
        return " (a packed block of %s%s)" % (", ".join(names), " and %d more" % more if more > 0 else "")

    def series(self) -> list[records.TensorSeries]:
        """The tensors' series, merged across blocks and files (once: each
        tag's events are let go as it is decoded, so that a long run's
        events and its decoded blocks are not held whole at once)."""
        parts: list[records.TensorSeries] = []
        for tag in list(self.points):  # in the order first written
            steps, rows, walls = self.points.pop(tag)
            info = self.infos[tag]
            decoded = packed.decode_tag(tag, info, steps, rows, self.problems, walls)
            if tag in self.inferred:
                self._infer_dtype(tag, info, decoded)
            parts.extend(decoded)
        return packed.merge_all(parts, self.problems, self.restarts)

    def _infer_dtype(self, tag: str, info: metadata.TensorInfo, parts: list[records.TensorSeries]) -> None:
        """Gives a tag whose metadata was lost the dtype its records show, and says so."""
        values = np.concatenate([p.values for p in parts])
        info = dataclasses.replace(info, dtype=_dtype_of(values))
        for p in parts:
            p.info = info
        self.problems.append(
            "%s: its metadata was lost with its first record; %d record(s) read as a %s %s "
            "(inferred from the tag name), its order in the step unknown"
            % (tag, len(values), info.dtype, info.role)
        )


_SCALARS_PLUGIN = "scalars"


def action_of(content: bytes, tensor: tensor_pb2.TensorProto | np.ndarray, step: int,
              problems: list[str]) -> dict | None:
    """An action event from its metadata's content and its string tensor (a
    proto, or an array as TensorBoard's data provider returns it); None,
    with a problem said, where it cannot be read."""
    try:
        metadata.check_action_content(content)
        array = packed.tensor_values(tensor) if isinstance(tensor, tensor_pb2.TensorProto) else tensor
        data = np.asarray(array).reshape(-1)[0]
    except (metadata.FormatError, ValueError, TypeError, KeyError, IndexError) as e:
        problems.append("%s: an action at step %d cannot be read (%s)" % (metadata.ACTIONS_TAG, step, e))
        return None
    event = survive.parse_event(data if isinstance(data, bytes) else str(data).encode("utf-8"), step)
    if event is None:
        problems.append("%s: the action at step %d is not a valid event" % (metadata.ACTIONS_TAG, step))
    return event


def _dtype_of(values: np.ndarray) -> str:
    """float32 unless a record's min or max is not a float32 value (the
    statistics of a float32 tensor hold its own values there)."""
    ends = values[:, [metadata.FIELD_INDEX["min"], metadata.FIELD_INDEX["max"]]].astype(np.float64)
    with np.errstate(over="ignore"):
        exact = np.array_equal(ends.astype(np.float32).astype(np.float64), ends, equal_nan=True)
    return "float32" if exact else "float64"


def read_run(run: str, files: list[str]) -> RunRecords:
    """Reads all numerics records of one run's event files, per-tensor and packed."""
    reader = _RunReader()
    for path in files:
        reader.add_file(path)
    series = reader.series()
    scalars = {t: (np.asarray(st, np.int64), np.asarray(v, np.float64)) for t, (st, v) in reader.scalars.items()}
    return RunRecords(run, series, reader.problems + reader.damage_problems(), scalars,
                      actions=reader.actions, restarts=packed.restart_summary(reader.restarts))


def read_logdir(logdir: str) -> list[RunRecords]:
    """Every run under ``logdir`` that holds numerics records, scalar
    summaries or problems, by run name.

    Raises:
      LogdirError: ``logdir``'s filesystem is not available.
    """
    out = []
    for run, files in sorted(find_runs(logdir).items()):
        rr = read_run(run, files)
        if rr.series or rr.problems or rr.scalars or rr.actions:
            out.append(rr)
    return out
