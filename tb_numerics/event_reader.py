"""Reads every numerics record of a logdir straight from its event files.

The CLI's reader: no sampling, every record. (The plugin reads through
TensorBoard's data provider instead.)

Filesystems: a local path is read with Python's own file functions, so the
CLI needs no TensorFlow for local logdirs; a path with a scheme (``gs://``,
``s3://``, ``hdfs://``, ``ram://``) is read through ``tf.io.gfile``, as
TensorBoard reads it, and a scheme TensorFlow does not provide is a
``LogdirError`` that names it. Either way a file is streamed once from start
to end in chunks (``_Window``): never held whole, never downloaded twice.

Damage: event files are untrusted input. A record whose data fails its
checksum is skipped and reading goes on at the next record (its length
header says where that is); a damaged length header or a truncated tail ends
that file. Each problem is reported once per file, and everything readable
is still read. A length header is checked against the file's size before any
reader trusts it: TensorFlow's reader crashes the process on a checksummed
header claiming terabytes. A skipped record's bytes are decoded once more,
for its tag name only (never its values), so that the problems say which
tensor lost records; and records of a tag whose first event (and with it
the tag's metadata) was lost are still read where they are recognisable as
numerics records: a packed block's later events carry its table, a
per-tensor record after a tag's first carries the plugin's name
(``metadata.create_later_metadata``), and what its metadata would have said
is then inferred and reported (``metadata.info_from_tag``). Only regular
files are opened (a FIFO named like an event file would block forever); a
record longer than ``LARGE_RECORD_BYTES`` is checked a chunk at a time and
read again only where its checksum holds, so a damaged one is never held.

Standard scalar summaries (``tf.summary.scalar``, TF1's ``simple_value``)
are kept beside the numerics records (``RunRecords.scalars``): the report
falls back to them where a run's numerics records hold no anomaly.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import stat
import struct
import sys
from typing import IO, Callable, Iterator, NamedTuple

import numpy as np
from google.protobuf.message import DecodeError
from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, types_pb2
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
from tensorboard.util import tensor_util

from tb_numerics import _crc32c, metadata, packed, records

__all__ = [
    "LogdirError",
    "Record",
    "RunRecords",
    "check_logdir",
    "find_runs",
    "py_record_reader",
    "read_logdir",
    "read_run",
    "tf_record_reader",
]

# TFRecord framing: uint64 length, masked CRC32C of the length, the data,
# masked CRC32C of the data (all little-endian).
_HEADER = 12
_FOOTER = 4
# How many offsets of skipped records one problem line names.
_MAX_OFFSETS_SHOWN = 5
# How much of a file is read at a time.
CHUNK_BYTES = 4 << 20
# How many tensors of a damaged packed block one problem line names.
_MAX_TAGS_SHOWN = 5
# A record longer than this is checked a chunk at a time, never held, and
# read again only where its checksum holds: a damaged 1 GiB record once
# took 2.6 GB to check. (A packed event of 10,000 tensors is about 30 MB.)
LARGE_RECORD_BYTES = 64 << 20
# How much of a damaged large record is kept, to name its tags.
_NAME_BYTES = 64 << 10


class LogdirError(Exception):
    """A logdir that cannot be read at all: missing, or on a filesystem that
    is not available here. The message says which and why."""


class _Damaged(Exception):
    """The record at an offset fails a checksum."""


class _Short(Exception):
    """The file ended before the size it had when it was opened."""


_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def _scheme(path: str | os.PathLike) -> str | None:
    m = _SCHEME.match(os.fspath(path))
    return m.group(1) if m else None


class _LocalFiles:
    """The local filesystem, with Python's own functions: no TensorFlow."""

    @staticmethod
    def isdir(path: str) -> bool:
        return os.path.isdir(path)

    @staticmethod
    def walk(top: str) -> Iterator[tuple[str, str, list[str]]]:
        """(run name, directory, file names) of every directory under ``top``."""
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames.sort()
            yield os.path.relpath(dirpath, top), dirpath, filenames

    @staticmethod
    def open(path: str) -> tuple[IO[bytes], int]:
        """The file and its size now (a writer may be appending to it).

        Opened without blocking and read only where it is a regular file: a
        FIFO named like an event file would block ``open`` forever.
        """
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise OSError("not a regular file: skipped")
        return os.fdopen(fd, "rb"), st.st_size


class _GFiles:
    """Any filesystem ``tf.io.gfile`` reads: gs://, s3:// (with
    tensorflow-io), hdfs://, ram://. TensorFlow's errors become OSError."""

    def __init__(self, tf):
        self._gfile = tf.io.gfile
        self._error = tf.errors.OpError

    def isdir(self, path: str) -> bool:
        try:
            return self._gfile.isdir(path)
        except self._error as e:
            raise OSError(e.message) from None

    def walk(self, top: str) -> Iterator[tuple[str, str, list[str]]]:
        try:
            for dirpath, dirnames, filenames in self._gfile.walk(top):
                dirnames.sort()
                yield dirpath[len(top) :].strip("/") or ".", dirpath, filenames
        except self._error as e:
            raise OSError(e.message) from None

    def open(self, path: str) -> tuple[IO[bytes], int]:
        try:
            size = self._gfile.stat(path).length
            return _GFileReader(self._gfile.GFile(path, "rb"), self._error), size
        except self._error as e:
            raise OSError(e.message) from None


class _GFileReader:
    """A GFile whose reads raise OSError, as a Python file's do."""

    def __init__(self, f, error: type):
        self._f, self._error = f, error

    def read(self, n: int) -> bytes:
        try:
            return self._f.read(n)
        except self._error as e:
            raise OSError(e.message) from None

    def seek(self, offset: int) -> None:
        try:
            self._f.seek(offset)
        except self._error as e:
            raise OSError(e.message) from None

    def close(self) -> None:
        self._f.close()


def _files_for(path: str) -> _LocalFiles | _GFiles:
    """The filesystem that holds ``path``.

    Raises:
      LogdirError: ``path`` has a scheme and TensorFlow is not installed, or
        TensorFlow (and tensorflow-io, where installed) has no filesystem
        for that scheme.
    """
    scheme = _scheme(path)
    return _LocalFiles() if scheme is None else _gfiles(scheme)


@functools.lru_cache(maxsize=None)
def _gfiles(scheme: str) -> _GFiles:
    """TensorFlow's filesystem for ``scheme`` (checked once per scheme)."""
    try:
        import tensorflow as tf
    except ImportError:
        raise LogdirError(
            "%s:// paths are read through TensorFlow's filesystems: install tensorflow "
            "(local paths need no TensorFlow)" % scheme
        ) from None
    if not _scheme_available(tf, scheme + "://"):
        raise LogdirError(
            "the filesystem %s:// is not available: TensorFlow here has none for it "
            "(s3://, hdfs:// and az:// come with tensorflow-io: pip install tensorflow-io)" % scheme
        )
    return _GFiles(tf)


def _scheme_available(tf, root: str) -> bool:
    """Whether TensorFlow has a filesystem for ``root`` (``scheme://``);
    imports tensorflow-io, which registers more of them, where it is installed."""
    if _has_filesystem(tf, root):
        return True
    try:
        import tensorflow_io  # noqa: F401 - registers s3://, hdfs://, az://
    except ImportError:
        return False
    return _has_filesystem(tf, root)


def _has_filesystem(tf, path: str) -> bool:
    try:
        tf.io.gfile.exists(path)
    except tf.errors.UnimplementedError:
        return False
    except tf.errors.OpError:
        pass  # the filesystem is there; the path's own trouble shows later
    return True


def check_logdir(logdir: str) -> None:
    """Raises ``LogdirError`` where ``logdir`` cannot be read: no such
    directory, or a filesystem that is not available (named in the message)."""
    try:
        ok = _files_for(logdir).isdir(logdir)
    except OSError as e:
        raise LogdirError("cannot read logdir %s: %s" % (logdir, e)) from None
    if not ok:
        if _scheme(logdir) is None and os.path.exists(logdir):
            raise LogdirError(
                "%s is a file, not a logdir: pass the directory that holds the event files" % logdir
            )
        raise LogdirError("no such logdir: %s" % logdir)


def _is_event_file(name: str) -> bool:
    return "tfevents" in name


def find_runs(logdir: str) -> dict[str, list[str]]:
    """Run name (relative directory, "." for logdir itself) -> event files.

    Raises:
      LogdirError: ``logdir``'s filesystem is not available.
    """
    runs: dict[str, list[str]] = {}
    for run, dirpath, filenames in _files_for(logdir).walk(logdir):
        files = sorted(f for f in filenames if _is_event_file(f))
        if files:
            runs[run] = [os.path.join(dirpath, f) for f in files]
    return runs


class _Window:
    """A forward-only window on a file read in chunks of ``CHUNK_BYTES`` bytes:
    at most a chunk and the record being read are in memory, and each byte
    is read from the file once."""

    def __init__(self, f: IO[bytes], size: int):
        self._f = f
        self.size = size
        self._buf = b""
        self._lo = 0  # the file offset of _buf[0]

    def at(self, offset: int, n: int) -> bytes:
        """Bytes [offset, offset + n) of the file; offsets never go back.

        Raises:
          _Short: the file ended before (it shrank since it was opened).
        """
        hi = self._lo + len(self._buf)
        if offset + n > hi:
            keep = self._buf[offset - self._lo :]
            if offset > hi:  # past a record no reader looked into
                self._drop(offset - hi)
                keep, hi = b"", offset
            self._buf = keep + self._read(min(max(offset + n - hi, CHUNK_BYTES), self.size - hi))
            self._lo = offset
        i = offset - self._lo
        out = self._buf[i : i + n]
        if len(out) < n:
            raise _Short()
        return out

    @property
    def held_to(self) -> int:
        """The file offset just past the bytes in memory."""
        return self._lo + len(self._buf)

    def chunks(self, offset: int, n: int) -> Iterator[bytes]:
        """Bytes [offset, offset + n) of the file a chunk at a time, none of
        them kept: how a record too large to hold is checked.

        Raises:
          _Short: the file ended before.
        """
        hi = self._lo + len(self._buf)
        if offset >= hi:
            self._drop(offset - hi)
            head, hi = b"", offset
        else:
            head = self._buf[offset - self._lo : offset - self._lo + n]
        end = offset + n
        if end <= hi:
            yield head
            return
        self._buf, self._lo = b"", end
        yield head
        while hi < end:
            part = self._f.read(min(CHUNK_BYTES, end - hi))
            if not part:
                raise _Short()
            hi += len(part)
            yield part

    def reread(self, offset: int, n: int) -> bytes:
        """Bytes [offset, offset + n) read again from the file (which must
        be able to seek); reading then goes on where it was."""
        self._f.seek(offset)
        data = self._read(n)
        self._f.seek(self._lo + len(self._buf))
        if len(data) < n:
            raise _Short()
        return data

    def _read(self, n: int) -> bytes:
        parts = []
        while n > 0:
            part = self._f.read(min(n, CHUNK_BYTES))
            if not part:
                break
            parts.append(part)
            n -= len(part)
        return b"".join(parts)

    def _drop(self, n: int) -> None:
        while n > 0:
            part = self._f.read(min(n, CHUNK_BYTES))
            if not part:
                raise _Short()
            n -= len(part)

    def close(self) -> None:
        self._f.close()


# read(offset) -> the record's data, for a record known to lie inside the
# file; raises _Damaged where a checksum fails.
RecordReader = Callable[[int], bytes]


def tf_record_reader(path: str, window: _Window) -> RecordReader:
    """TensorFlow's C++ reader (fast CRC32C), for local files; ImportError
    without TensorFlow. (On a remote filesystem it would download every
    record a second time: those are checked in Python.)"""
    from tensorflow.python.framework import errors
    from tensorflow.python.lib.io import _pywrap_record_io

    reader = _pywrap_record_io.RandomRecordReader(path)

    def read(offset: int) -> bytes:
        try:
            return reader.read(offset)[0]
        except errors.DataLossError:
            raise _Damaged() from None

    return read


def py_record_reader(path: str, window: _Window) -> RecordReader:
    """The same checks in numpy on the window's bytes, for installs without
    TensorFlow and for remote files: the records the window holds are
    checked together (``_crc32c``: about 50-80 MB/s here, where the
    pure-Python CRC32C checks 3.5)."""
    checked: dict[int, bytes | None] = {}

    def read(offset: int) -> bytes:
        if offset not in checked:
            checked.clear()
            checked.update(_check_from(window, offset))
        data = checked.pop(offset)
        if data is None:
            raise _Damaged()
        return data

    return read


def _check_from(window: _Window, offset: int) -> dict[int, bytes | None]:
    """Offset -> data (None where a checksum fails) of the record at
    ``offset``, which lies inside the file, and of those after it that the
    window holds, up to the first whose header fails its checksum.

    Only the first record's length is trusted with a read beyond the
    window's chunk, and only once its header's checksum holds."""
    header = window.at(offset, _HEADER)
    if not _header_ok(header):
        return {offset: None}
    frames: list[tuple[int, bytes, bytes]] = []  # offset, length bytes, data + footer
    at = offset
    while at + _HEADER <= window.size and (not frames or at + _HEADER <= window.held_to):
        header = window.at(at, _HEADER)
        (length,) = struct.unpack_from("<Q", header)
        end = at + _HEADER + length + _FOOTER
        if frames and (end > window.size or end > window.held_to):
            break
        frames.append((at, header, window.at(at + _HEADER, length + _FOOTER)))
        at = end
    headers_ok = _crc32c.masked_crc32c_many([h[:8] for _, h, _ in frames]) == [
        struct.unpack_from("<I", h, 8)[0] for _, h, _ in frames
    ]
    if not headers_ok.all():  # the rest was framed by a damaged length
        frames = frames[: int(np.argmin(headers_ok)) + 1]
    datas = [f[:-_FOOTER] for _, _, f in frames]
    data_ok = _crc32c.masked_crc32c_many(datas) == [struct.unpack_from("<I", f, len(f) - _FOOTER)[0] for _, _, f in frames]
    ok = data_ok & headers_ok[: len(frames)]
    return {o: d if good else None for (o, _, _), d, good in zip(frames, datas, ok.tolist())}


def _default_reader(path: str, window: _Window) -> RecordReader:
    # TensorFlow's reader only where TensorFlow is imported already: importing
    # it costs seconds and its log lines, and local logdirs need none.
    if _scheme(path) is None and "tensorflow" in sys.modules:
        try:
            return tf_record_reader(path, window)
        except (ImportError, TypeError):
            # No TensorFlow, or a path it cannot take (a directory name that
            # is not UTF-8 reaches it as a str with surrogates).
            pass
    return py_record_reader(path, window)


def _header_ok(header: bytes) -> bool:
    return masked_crc32c(header[:8]) == struct.unpack_from("<I", header, 8)[0]


def _offsets_text(offsets: list[int]) -> str:
    shown = ", ".join(str(o) for o in offsets[:_MAX_OFFSETS_SHOWN])
    more = len(offsets) - _MAX_OFFSETS_SHOWN
    return shown + (" and %d more" % more if more > 0 else "")


class Record(NamedTuple):
    """One record of an event file: its data, and whether its checksum
    held. A damaged record's data is for naming what was lost, never for
    its values."""

    data: bytes
    intact: bool


def read_records(
    path: str,
    problems: list[str],
    make_reader: Callable[[str, _Window], RecordReader] = _default_reader,
) -> Iterator[Record]:
    """The records of one event file, damaged ones marked; the file's damage
    goes to ``problems``.

    Reads the file as it is when opened (a writer may be appending to it).
    """
    name = os.path.basename(path)
    try:
        f, size = _files_for(path).open(path)
    except (OSError, ValueError, LogdirError) as e:
        problems.append("%s: cannot open (%s)" % (name, e))
        return
    window = _Window(f, size)
    offset = count = 0
    skipped: list[int] = []

    def cut(what: str) -> str:
        return "%s: %s at byte offset %d of %d after %d record(s); the rest of the file was skipped" % (
            name, what, offset, size, count,
        )

    try:
        read = make_reader(path, window)
        while offset < size:
            if size - offset < _HEADER:
                problems.append(cut("truncated"))
                return
            header = window.at(offset, _HEADER)
            (length,) = struct.unpack_from("<Q", header)
            end = offset + _HEADER + length + _FOOTER
            if end > size:
                problems.append(cut("truncated" if _header_ok(header) else _bad_header(count)))
                return
            if length > LARGE_RECORD_BYTES and _header_ok(header):
                record = _large_record(window, offset, length)
            else:
                try:
                    record = Record(read(offset), True)
                except _Damaged:
                    if not _header_ok(header):
                        problems.append(cut(_bad_header(count)))
                        return
                    record = Record(window.at(offset + _HEADER, length), False)
            if record.intact:
                count += 1
            else:
                skipped.append(offset)
            yield record
            offset = end
    except (_Short, OSError) as e:
        problems.append(cut("truncated" if isinstance(e, _Short) else "unreadable (%s)" % e))
    finally:
        window.close()
        if skipped:
            problems.append(
                "%s: %d corrupt record(s) skipped (checksum mismatch) at byte offset %s"
                % (name, len(skipped), _offsets_text(skipped))
            )


def _large_record(window: _Window, offset: int, length: int) -> Record:
    """The large record at ``offset`` (its header checked), its checksum
    checked a chunk at a time: its data read again where it holds, else
    only its first bytes, which name its tags where they decode."""
    head = window.at(offset + _HEADER, _NAME_BYTES)
    crc = _crc32c.masked_crc32c_chunks(window.chunks(offset + _HEADER, length))
    if crc != struct.unpack("<I", window.at(offset + _HEADER + length, _FOOTER))[0]:
        return Record(head, False)
    return Record(window.reread(offset + _HEADER, length), True)


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


@dataclasses.dataclass
class RunRecords:
    """The numerics series and scalar summaries of one run read from disk,
    and what went wrong."""

    run: str
    series: list[records.TensorSeries]
    problems: list[str]
    # Standard scalar summaries: tag -> (steps, values), in file order.
    scalars: dict[str, tuple[np.ndarray, np.ndarray]] = dataclasses.field(default_factory=dict)
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
        if self._add_scalar(step, value):
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
            v = _vector(value.tensor)
            if v.size != 1:
                self.problems.append("%s: a scalar summary that does not hold one value skipped" % tag)
                return True
            x = float(v[0])
        else:
            return False
        steps, values = self.scalars.setdefault(tag, ([], []))
        steps.append(step)
        values.append(x)
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
        """The tensors' series, merged across blocks and files."""
        parts: list[records.TensorSeries] = []
        for tag, (steps, rows, walls) in self.points.items():
            info = self.infos[tag]
            if tag in self.inferred:
                parts.append(self._inferred_series(tag, info, steps, rows))
            else:
                parts.extend(packed.decode_tag(tag, info, steps, rows, self.problems, walls))
        return packed.merge_all(parts, self.problems, self.restarts)

    def _inferred_series(self, tag: str, info: metadata.TensorInfo, steps, rows) -> records.TensorSeries:
        s = records.make_series(tag, info, steps, rows, self.problems)
        s.info = info = dataclasses.replace(info, dtype=_dtype_of(s.values))
        self.problems.append(
            "%s: its metadata was lost with its first record; %d record(s) read as a %s %s "
            "(inferred from the tag name), its order in the step unknown"
            % (tag, len(s.steps), info.dtype, info.role)
        )
        return s


_SCALARS_PLUGIN = "scalars"


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
                      packed.restart_summary(reader.restarts))


def read_logdir(logdir: str) -> list[RunRecords]:
    """Every run under ``logdir`` that holds numerics records, scalar
    summaries or problems, by run name.

    Raises:
      LogdirError: ``logdir``'s filesystem is not available.
    """
    out = []
    for run, files in sorted(find_runs(logdir).items()):
        rr = read_run(run, files)
        if rr.series or rr.problems or rr.scalars:
            out.append(rr)
    return out
