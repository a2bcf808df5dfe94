"""Reads every numerics record of a logdir straight from its event files.

The CLI's reader: no sampling, every record. (The plugin reads through
TensorBoard's data provider instead.) Event files are untrusted input: a
record whose data fails its checksum is skipped and reading goes on at the
next record (its length header says where that is); a damaged length header
or a truncated tail ends that file. Each problem is reported once per file,
and everything readable is still read. A length header is checked against
the file's size before TensorFlow's reader sees it: that reader crashes the
process on a checksummed header claiming terabytes.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import struct
from typing import Callable, Iterator

import numpy as np
from google.protobuf.message import DecodeError
from tensorboard.compat.proto import event_pb2, tensor_pb2, types_pb2
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
from tensorboard.util import tensor_util

from tb_numerics import metadata, packed, records

# TFRecord framing: uint64 length, masked CRC32C of the length, the data,
# masked CRC32C of the data (all little-endian).
_HEADER = 12
_FOOTER = 4
# How many offsets of skipped records one problem line names.
_MAX_OFFSETS_SHOWN = 5

Buffer = mmap.mmap | bytes
# read(offset) -> the record's data, for a record known to lie inside the
# file; raises _Damaged where a checksum fails.
RecordReader = Callable[[int], bytes]


class _Damaged(Exception):
    """The record at an offset fails a checksum."""


@dataclasses.dataclass
class RunRecords:
    """The numerics series of one run read from disk, and what went wrong."""

    run: str
    series: list[records.TensorSeries]
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


def tf_record_reader(path: str, buf: Buffer) -> RecordReader:
    """TensorFlow's C++ reader (fast CRC32C); ImportError without TensorFlow."""
    from tensorflow.python.framework import errors
    from tensorflow.python.lib.io import _pywrap_record_io

    reader = _pywrap_record_io.RandomRecordReader(path)

    def read(offset: int) -> bytes:
        try:
            return reader.read(offset)[0]
        except errors.DataLossError:
            raise _Damaged() from None

    return read


def py_record_reader(path: str, buf: Buffer) -> RecordReader:
    """The same checks in pure Python: slow, for installs without TensorFlow."""

    def read(offset: int) -> bytes:
        if not _header_ok(buf, offset):
            raise _Damaged()
        (length,) = struct.unpack_from("<Q", buf, offset)
        start = offset + _HEADER
        data = bytes(buf[start : start + length])
        if masked_crc32c(data) != struct.unpack_from("<I", buf, start + length)[0]:
            raise _Damaged()
        return data

    return read


def _default_reader(path: str, buf: Buffer) -> RecordReader:
    try:
        return tf_record_reader(path, buf)
    except (ImportError, TypeError):
        # No TensorFlow, or a path it cannot take (a directory name that is
        # not UTF-8 reaches it as a str with surrogates).
        return py_record_reader(path, buf)


def _header_ok(buf: Buffer, offset: int) -> bool:
    return masked_crc32c(bytes(buf[offset : offset + 8])) == struct.unpack_from("<I", buf, offset + 8)[0]


def _offsets_text(offsets: list[int]) -> str:
    shown = ", ".join(str(o) for o in offsets[:_MAX_OFFSETS_SHOWN])
    more = len(offsets) - _MAX_OFFSETS_SHOWN
    return shown + (" and %d more" % more if more > 0 else "")


def _records(
    path: str,
    problems: list[str],
    make_reader: Callable[[str, Buffer], RecordReader] = _default_reader,
) -> Iterator[bytes]:
    """The readable records of one event file; its damage goes to ``problems``.

    Reads the file as it is when opened (a writer may be appending to it).
    """
    name = os.path.basename(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            buf: Buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        read = make_reader(path, buf)
    except (OSError, ValueError) as e:
        problems.append("%s: cannot open (%s)" % (name, e))
        return
    offset = count = 0
    skipped: list[int] = []

    def cut(what: str) -> str:
        return "%s: %s at byte offset %d of %d after %d record(s); the rest of the file was skipped" % (
            name, what, offset, size, count,
        )

    try:
        while offset < size:
            if size - offset < _HEADER:
                problems.append(cut("truncated"))
                return
            (length,) = struct.unpack_from("<Q", buf, offset)
            end = offset + _HEADER + length + _FOOTER
            if end > size:
                problems.append(cut("truncated" if _header_ok(buf, offset) else _bad_header(count)))
                return
            try:
                data = read(offset)
            except _Damaged:
                if not _header_ok(buf, offset):
                    problems.append(cut(_bad_header(count)))
                    return
                skipped.append(offset)
            else:
                count += 1
                yield data
            offset = end
    finally:
        if isinstance(buf, mmap.mmap):
            buf.close()
        if skipped:
            problems.append(
                "%s: %d corrupt record(s) skipped (checksum mismatch) at byte offset %s"
                % (name, len(skipped), _offsets_text(skipped))
            )


def _bad_header(count: int) -> str:
    return "not an event file (bad record header)" if count == 0 else "damaged record header"


def _vector(t: tensor_pb2.TensorProto) -> np.ndarray:
    """A record's values as float64; empty (so counted malformed) if unreadable."""
    if t.dtype == types_pb2.DT_DOUBLE and t.tensor_content and len(t.tensor_content) % 8 == 0:
        return np.frombuffer(t.tensor_content, dtype="<f8")
    try:
        return np.asarray(tensor_util.make_ndarray(t), dtype=np.float64).reshape(-1)
    except (ValueError, TypeError, KeyError):
        return np.zeros(0)


def _matrix(t: tensor_pb2.TensorProto) -> np.ndarray:
    """A packed event's rows in their own dtype (``unpack_block`` checks it);
    empty (so counted malformed) if unreadable."""
    try:
        return np.asarray(tensor_util.make_ndarray(t))
    except (ValueError, TypeError, KeyError):
        return np.zeros(0)


def read_run(run: str, files: list[str]) -> RunRecords:
    """Reads all numerics records of one run's event files, per-tensor and packed."""
    problems: list[str] = []
    infos: dict[str, metadata.TensorInfo | metadata.BlockTable] = {}
    rejected: set[str] = set()
    points: dict[str, tuple[list[int], list[np.ndarray]]] = {}
    for path in files:
        undecodable = 0
        for data in _records(path, problems):
            try:
                event = event_pb2.Event.FromString(data)
            except DecodeError:
                undecodable += 1
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
                        infos[tag] = metadata.parse_content(
                            pd.content, value.metadata.summary_description
                        )
                    except metadata.FormatError as e:
                        rejected.add(tag)
                        problems.append("%s: %s" % (tag, e))
                        continue
                if tag not in infos or not value.HasField("tensor"):
                    continue
                steps, rows = points.setdefault(tag, ([], []))
                steps.append(event.step)
                block = not isinstance(infos[tag], metadata.TensorInfo)
                rows.append(_matrix(value.tensor) if block else _vector(value.tensor))
        if undecodable:
            problems.append(
                "%s: %d record(s) that are not events skipped" % (os.path.basename(path), undecodable)
            )
    parts: list[records.TensorSeries] = []
    for tag, (steps, rows) in points.items():
        info = infos[tag]
        if isinstance(info, metadata.TensorInfo):
            parts.append(records.make_series(tag, info, steps, rows, problems))
        else:
            parts.extend(packed.unpack_block(tag, info, np.asarray(steps, np.int64), rows, problems))
    return RunRecords(run, packed.merge_all(parts), problems)


def read_logdir(logdir: str) -> list[RunRecords]:
    """Every run under ``logdir`` that holds numerics records, by run name."""
    out = []
    for run, files in sorted(find_runs(logdir).items()):
        rr = read_run(run, files)
        if rr.series or rr.problems:
            out.append(rr)
    return out
