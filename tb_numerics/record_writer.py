"""A TensorFlow-free writer for numerics records computed elsewhere.

The ``*_pb`` counterpart of ``summary.py`` (as TensorBoard's scalar plugin has
``scalar_pb``): it takes statistics that are already numpy vectors and writes
them as event files that TensorBoard and ``tb-numerics report`` read exactly
like those written from a training step. Tests, benchmarks and tools that
convert other logs use it; training code uses ``tb_numerics.log_numerics``.
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import sys
import time
from typing import Sequence

import numpy as np
from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2

from tb_numerics import _crc32c, metadata, packed, survive

_FILE_VERSION = "brain.Event:2"
_LATER_METADATA = metadata.create_later_metadata()
# Where records were lost and it was said (once each).
_lost_in: set[str] = set()
# Each writer's number in this process, in its file's name: TensorBoard
# reads a run's files in name order, and a step written again by a later
# writer (fit after compile: the optimizer counts from 0 again) stands for
# the earlier one only if the later file sorts after the earlier one, also
# when both were made in the same second.
_writer_numbers = itertools.count()


def warn_lost_records(where: str, error: BaseException) -> None:
    """Says on stderr, once per ``where`` (a logdir), that numerics records
    could not be written there (a full disk) and are lost: training goes on,
    but the report will not hold those steps, maybe the first NaN's.

    A write that failed part way leaves a cut record, and no reader
    (TensorBoard's or the report's) reads a file past one: records written
    there after space came back are lost too (seen on a tmpfs that filled
    and was freed)."""
    if where in _lost_in:
        return
    _lost_in.add(where)
    print(
        "tb-numerics: warning: numerics records could not be written to %s (%s); the steps being written are "
        "lost, and a record cut by the failed write ends what can be read of that event file, so later records "
        "there are lost too, even once there is space again (training goes on; `tb-numerics report` names the "
        "cut file)" % (where, _first_line(error)),
        file=sys.stderr,
    )


def _first_line(error: BaseException) -> str:
    """The line of a (TensorFlow: many-line) error that says what failed."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    said = [line for line in lines if "No space left" in line or "quota" in line.lower() or "too large" in line]
    return (said or lines or [type(error).__name__])[0][:300]


class _RecordFile:
    """Appends TFRecord-framed byte strings to one file.

    Uses TensorFlow's C++ record writer when TensorFlow is already imported,
    and Python framing otherwise (on Keras' JAX and PyTorch backends), whose
    checksums are the CPU's CRC32C where ``google-crc32c`` has it
    (``_crc32c``), else TensorBoard's pure-Python CRC32C.
    """

    def __init__(self, path: str):
        self._tf_writer = None
        self._file = None
        self._logdir = os.path.dirname(path)
        self._errors: tuple[type, ...] = (OSError,)
        tf = sys.modules.get("tensorflow")
        if tf is not None and hasattr(tf, "io"):
            self._tf_writer = tf.io.TFRecordWriter(path)
            self._errors += (tf.errors.OpError,)
        else:
            self._file = open(path, "ab")

    def write(self, data: bytes) -> None:
        """Appends one record; where it cannot be written (a full disk) it
        is lost, said once (``warn_lost_records``), and training goes on."""
        try:
            if self._tf_writer is not None:
                self._tf_writer.write(data)
                return
            header = struct.pack("<Q", len(data))
            self._file.write(
                header
                + struct.pack("<I", _crc32c.masked_crc32c(header))
                + data
                + struct.pack("<I", _crc32c.masked_crc32c(data))
            )
        except self._errors as e:
            warn_lost_records(self._logdir, e)

    def flush(self) -> None:
        try:
            (self._tf_writer or self._file).flush()
        except self._errors as e:
            warn_lost_records(self._logdir, e)

    def close(self) -> None:
        try:
            (self._tf_writer or self._file).close()
        except self._errors as e:
            warn_lost_records(self._logdir, e)


def stats_tensor_proto(stats: np.ndarray) -> tensor_pb2.TensorProto:
    """The TensorProto of one record: a float64 vector of NUM_FIELDS."""
    vec = np.asarray(stats, dtype="<f8").reshape(-1)
    if vec.shape != (metadata.NUM_FIELDS,):
        raise ValueError(
            "a numerics record has %d fields, got %d" % (metadata.NUM_FIELDS, vec.size)
        )
    return _tensor_proto(vec)


def action_tensor_proto(event: dict) -> tensor_pb2.TensorProto:
    """The TensorProto of one action event: its JSON as a string scalar."""
    return tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING, tensor_shape=tensor_shape_pb2.TensorShapeProto(),
                                  string_val=[survive.encode_event(event)])


def _tensor_proto(a: np.ndarray, exact_float32: bool = False) -> tensor_pb2.TensorProto:
    """``a`` as a float64 TensorProto, or float32 when ``exact_float32`` and
    every value of ``a`` is exactly a float32 (half the bytes, same values)."""
    if exact_float32:
        with np.errstate(over="ignore"):
            a32 = a.astype("<f4")
        if np.array_equal(a32, a, equal_nan=True):
            a = np.ascontiguousarray(a32)
    if a.dtype != np.float32:
        a = np.ascontiguousarray(a, dtype="<f8")
    return tensor_pb2.TensorProto(
        dtype=types_pb2.DT_FLOAT if a.dtype == np.float32 else types_pb2.DT_DOUBLE,
        tensor_shape=tensor_shape_pb2.TensorShapeProto(
            dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=d) for d in a.shape]
        ),
        tensor_content=a.tobytes(),
    )


class NumericsRecordWriter:
    """Writes numerics records to a new event file in ``logdir``.

    ``write_many`` packs steps' records into block events (see
    ``packed.py``; what long runs should use: a step may wait in memory until
    its event is due, ``flush`` writes it), ``write`` writes one record as
    its own event under its tag at once. Metadata is written whole with the
    first event of each series, as TensorBoard reads it from there; later
    events carry enough of it to be read without the first (see ``write``
    and ``packed.py``).
    """

    def __init__(self, logdir: str, filename_suffix: str = ""):
        os.makedirs(logdir, exist_ok=True)
        name = "events.out.tfevents.%010d.%s.%d.%06d%s" % (
            time.time(),
            socket.gethostname(),
            os.getpid(),
            next(_writer_numbers),
            filename_suffix,
        )
        self.path = os.path.join(logdir, name)
        self._records = _RecordFile(self.path)
        self._infos: dict[str, metadata.TensorInfo] = {}
        self._packer = packed.StepPacker()
        self._write_event(event_pb2.Event(wall_time=time.time(), file_version=_FILE_VERSION))

    def _write_event(self, event: event_pb2.Event) -> None:
        self._records.write(event.SerializeToString())

    def _write_value(self, step: int, value: summary_pb2.Summary.Value, wall_time: float | None) -> None:
        """Writes one summary value as the event of ``step``."""
        self._write_event(
            event_pb2.Event(
                wall_time=time.time() if wall_time is None else wall_time,
                step=int(step),
                summary=summary_pb2.Summary(value=[value]),
            )
        )

    def write(
        self,
        tag: str,
        step: int,
        stats: np.ndarray,
        info: metadata.TensorInfo | None = None,
        wall_time: float | None = None,
    ) -> None:
        """Writes one record of ``tag`` at ``step``.

        ``info`` is required the first time a tag is written and ignored
        afterwards. The tag's first event carries its metadata; later ones
        the plugin's name alone (``metadata.create_later_metadata``), so that
        readers still know them for numerics records if the first is lost.
        """
        value = summary_pb2.Summary.Value(tag=tag, tensor=stats_tensor_proto(stats))
        if tag not in self._infos:
            if info is None:
                raise ValueError("the first record of tag %r needs its TensorInfo" % tag)
            self._infos[tag] = info
            value.metadata.CopyFrom(metadata.create_summary_metadata(info))
        else:
            value.metadata.CopyFrom(_LATER_METADATA)
        self._write_value(step, value, wall_time)

    def write_many(
        self,
        step: int,
        records: Sequence[tuple[str, np.ndarray, metadata.TensorInfo | None]],
        wall_time: float | None = None,
    ) -> None:
        """Adds several tags' records of one step to the packed events.

        The step is written when its event is due (see ``packed.py``: at
        once if a record holds a NaN or an infinity), on ``flush`` and on
        ``close``. ``info`` is required the first time the writer sees a
        tag. Nothing is written for an empty ``records``.

        Raises:
          ValueError: a record is not ``NUM_FIELDS`` long, or a new tag has
            no ``TensorInfo``; nothing of the step is written then.
        """
        if not records:
            return
        self._write_packed(self._packer.add(step, records, time.time() if wall_time is None else wall_time))

    def write_action(self, step: int, event: dict) -> None:
        """Writes one action event (a skip, a rewind, a stop: see
        ``survive``) at ``step``, on disk at once.

        Args:
          step: the step that acted (one event per step).
          event: the event's fields (JSON-serialisable).
        """
        value = summary_pb2.Summary.Value(tag=metadata.ACTIONS_TAG, tensor=action_tensor_proto(event))
        value.metadata.CopyFrom(metadata.create_action_metadata())
        self._write_value(step, value, None)
        self._records.flush()

    def _write_packed(self, events: list[packed.PackedEvent]) -> None:
        for e in events:
            value = summary_pb2.Summary.Value(tag=e.tag, tensor=_tensor_proto(e.rows, exact_float32=True))
            value.metadata.CopyFrom(e.metadata)
            self._write_value(e.step, value, e.wall_time)
        if events:
            self._records.flush()

    def flush(self) -> None:
        """Writes the steps waiting in memory, and flushes the file."""
        self._write_packed(self._packer.flush())
        self._records.flush()

    def close(self) -> None:
        self.flush()
        self._records.close()

    def __enter__(self) -> "NumericsRecordWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
