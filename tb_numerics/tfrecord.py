"""The records of one event file (TFRecord framing), each checked, none trusted.

Event files are untrusted input. A record whose data fails its checksum is
skipped and reading goes on at the next record (its length header says
where that is); a damaged length header or a truncated tail ends that file.
Each problem is reported once per file, and everything readable is still
read. A length header is checked against the file's size before any reader
trusts it: TensorFlow's reader crashes the process on a checksummed header
claiming terabytes. A file is streamed once from start to end in chunks
(``_Window``): never held whole, never downloaded twice; a record longer
than ``LARGE_RECORD_BYTES`` is checked a chunk at a time and read again only
where its checksum holds, so a damaged one is never held.
"""

from __future__ import annotations

import os
import struct
import sys
from typing import IO, Callable, Iterator, NamedTuple

import numpy as np

from tb_numerics import _crc32c
from tb_numerics.event_files import LogdirError, files_for, scheme

__all__ = ["CHUNK_BYTES", "LARGE_RECORD_BYTES", "Record", "RecordFile", "RecordReader", "py_record_reader",
           "read_records", "scan_records", "tf_record_reader"]

# TFRecord framing: uint64 length, masked CRC32C of the length, the data,
# masked CRC32C of the data (all little-endian).
_HEADER = 12
_FOOTER = 4
# How many offsets of skipped records one problem line names.
_MAX_OFFSETS_SHOWN = 5
# How much of a file is read at a time.
CHUNK_BYTES = 4 << 20
# A record longer than this is checked a chunk at a time, never held, and
# read again only where its checksum holds: a damaged 1 GiB record once
# took 2.6 GB to check. (A packed event of 10,000 tensors is about 30 MB.)
LARGE_RECORD_BYTES = 64 << 20
# An incomplete record claiming more than this is damage, not a record
# still being written (a packed event of 10,000 tensors is about 30 MB).
LIVE_RECORD_BYTES = 1 << 30
# How much of a damaged large record is kept, to name its tags.
_NAME_BYTES = 64 << 10


class _Damaged(Exception):
    """The record at an offset fails a checksum; ``data``: its bytes where
    the reader holds them (to name what was lost), else None."""

    def __init__(self, data: bytes | None = None):
        super().__init__()
        self.data = data


class _Short(Exception):
    """The file ended before the size it had when it was opened."""

class _Window:
    """A forward-only window on a file read in chunks of ``CHUNK_BYTES`` bytes:
    at most a chunk and the record being read are in memory, and each byte
    is read from the file once. The chunks are kept as read (a record's
    bytes are copied once, out of them), the file positioned after the last."""

    def __init__(self, f: IO[bytes], size: int, start: int = 0):
        self._f = f
        self.size = size
        self._chunks: list[bytes] = []  # consecutive, the first at file offset _lo
        self._lo = self._hi = start  # _hi: the file offset just past the chunks
        if start:
            f.seek(start)

    def at(self, offset: int, n: int) -> bytes:
        """Bytes [offset, offset + n) of the file; offsets never go back.

        Raises:
          _Short: the file ended before (it shrank since it was opened).
        """
        if offset + n > self._hi:
            if offset >= self._hi:  # past a record no reader looked into
                self._drop(offset - self._hi)
                self._chunks, self._lo = [], offset
            self._read_chunks(min(max(offset + n - self._hi, CHUNK_BYTES), self.size - self._hi))
        while self._chunks and self._lo + len(self._chunks[0]) <= offset:
            self._lo += len(self._chunks.pop(0))
        out = self._held(offset, n)
        if len(out) < n:
            raise _Short()
        return out

    @property
    def held_to(self) -> int:
        """The file offset just past the bytes in memory."""
        return self._hi

    def chunks(self, offset: int, n: int) -> Iterator[bytes]:
        """Bytes [offset, offset + n) of the file a chunk at a time, none of
        them kept: how a record too large to hold is checked.

        Raises:
          _Short: the file ended before.
        """
        if offset >= self._hi:
            self._drop(offset - self._hi)
            self._chunks, self._lo = [], offset
        end = offset + n
        head = self._held(offset, n)
        if end <= self._hi:
            yield head
            return
        hi = self._hi
        self._chunks, self._lo, self._hi = [], end, end
        yield head
        for part in self._parts(end - hi):
            hi += len(part)
            yield part
        if hi < end:
            raise _Short()

    def reread(self, offset: int, n: int) -> bytes:
        """Bytes [offset, offset + n) read again from the file (which must
        be able to seek); reading then goes on where it was."""
        self._f.seek(offset)
        data = b"".join(self._parts(n))
        self._f.seek(self._hi)
        if len(data) < n:
            raise _Short()
        return data

    def _held(self, offset: int, n: int) -> bytes:
        """What the chunks hold of [offset, offset + n), copied once."""
        i, pieces = offset - self._lo, []
        for chunk in self._chunks:
            if i < len(chunk) and n > 0:
                pieces.append(memoryview(chunk)[i : i + n])
                n -= len(pieces[-1])
            i = max(0, i - len(chunk))
        if len(pieces) == 1 and len(pieces[0]) == len(pieces[0].obj):
            return pieces[0].obj  # a whole chunk: itself
        return b"".join(pieces)

    def _read_chunks(self, n: int) -> None:
        for part in self._parts(n):
            self._chunks.append(part)
            self._hi += len(part)

    def _parts(self, n: int) -> Iterator[bytes]:
        """Up to ``n`` bytes from the file's position, a chunk at a time."""
        while n > 0:
            part = self._f.read(min(n, CHUNK_BYTES))
            if not part:
                return
            yield part
            n -= len(part)

    def _drop(self, n: int) -> None:
        for part in self._parts(n):
            n -= len(part)
            self._hi += len(part)
        if n > 0:
            raise _Short()

    def close(self) -> None:
        self._f.close()


# read(offset) -> the record's data, for a record known to lie inside the
# file; raises _Damaged where a checksum fails.
RecordReader = Callable[[int], bytes]


def tf_record_reader(path: str, window: _Window) -> RecordReader:
    """TensorFlow's C++ reader (fast CRC32C), for local files; ImportError
    without TensorFlow. (On a remote filesystem it would download every
    record a second time: those are checked in Python.)"""
    from tb_numerics import _tf_internal

    read_at, damaged = _tf_internal.record_reader(path)

    def read(offset: int) -> bytes:
        try:
            return read_at(offset)
        except damaged:
            raise _Damaged() from None

    return read


def py_record_reader(path: str, window: _Window) -> RecordReader:
    """The same checks in Python on the window's bytes, the records the
    window holds together (``_crc32c``): by the CPU's CRC32C where
    ``google-crc32c`` has it (4.3 GB/s here), else in numpy (50-80 MB/s,
    where the pure-Python CRC32C checks 3.5)."""
    checked: dict[int, tuple[bytes | None, bool]] = {}

    def read(offset: int) -> bytes:
        if offset not in checked:
            checked.clear()
            checked.update(_check_from(window, offset))
        data, intact = checked.pop(offset)
        if not intact:
            raise _Damaged(data)
        return data

    return read


def _check_from(window: _Window, offset: int) -> dict[int, tuple[bytes | None, bool]]:
    """Offset -> (data, whether its checksums hold) of the record at
    ``offset``, which lies inside the file, and of those after it that the
    window holds, up to the first whose header fails its checksum (its
    data None: nothing after it can be framed).

    Only the first record's length is trusted with a read beyond the
    window's chunk, and only once its header's checksum holds."""
    header = window.at(offset, _HEADER)
    if not _header_ok(header):
        return {offset: (None, False)}
    frames: list[tuple[int, bytes, bytes, bytes]] = []  # offset, header, data, footer
    at = offset
    while at + _HEADER <= window.size and (not frames or at + _HEADER <= window.held_to):
        header = window.at(at, _HEADER)
        (length,) = struct.unpack_from("<Q", header)
        end = at + _HEADER + length + _FOOTER
        if frames and (end > window.size or end > window.held_to):
            break
        frames.append((at, header, window.at(at + _HEADER, length), window.at(at + _HEADER + length, _FOOTER)))
        at = end
    headers_ok = _crc32c.masked_crc32c_many([h[:8] for _, h, _, _ in frames]) == [
        struct.unpack_from("<I", h, 8)[0] for _, h, _, _ in frames
    ]
    if not headers_ok.all():  # the rest was framed by a damaged length
        frames = frames[: int(np.argmin(headers_ok)) + 1]
    datas = [d for _, _, d, _ in frames]
    data_ok = _crc32c.masked_crc32c_many(datas) == [struct.unpack("<I", f)[0] for _, _, _, f in frames]
    ok = data_ok & headers_ok[: len(frames)]
    return {o: (d, good) for (o, _, _, _), d, good in zip(frames, datas, ok.tolist())}


def _default_reader(path: str, window: _Window) -> RecordReader:
    # The records in Python where the CPU's CRC32C is at hand (``_crc32c.FAST``:
    # 2.6 GB of packed events framed and checked in 0.9 s, 3.4 s through
    # TensorFlow's reader). Else TensorFlow's reader, only where TensorFlow is
    # imported already: importing it costs seconds and its log lines.
    if _crc32c.FAST is None and scheme(path) is None and "tensorflow" in sys.modules:
        try:
            return tf_record_reader(path, window)
        except (ImportError, TypeError):
            # No TensorFlow, or a path it cannot take (a directory name that
            # is not UTF-8 reaches it as a str with surrogates).
            pass
    return py_record_reader(path, window)


def _header_ok(header: bytes) -> bool:
    return _crc32c.masked_crc32c(header[:8]) == struct.unpack_from("<I", header, 8)[0]


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
    for _, _, record in scan_records(path, problems, make_reader=make_reader):
        yield record


def scan_records(
    path: str,
    problems: list[str],
    start: int = 0,
    live: bool = False,
    make_reader: Callable[[str, _Window], RecordReader] = _default_reader,
    counted: int = 0,
    ends: list[str] | None = None,
) -> Iterator[tuple[int, int, Record]]:
    """(offset, end offset, record) of each record of one event file from
    byte ``start``, damaged ones marked; the file's damage goes to ``problems``.

    Args:
      path: the event file.
      problems: where the file's damage is described.
      start: where a record begins (0, or the end of one read before):
        reading a growing file again, only what was appended is read.
      live: an incomplete last record is one still being written: reading
        stops before it without a problem (read it next time from there),
        unless its header claims more than ``LIVE_RECORD_BYTES``.
      make_reader: how a record's checksums are checked.
      counted: the intact records before ``start``, read before: a problem
        counts records from the file's start, whatever ``start``.
      ends: where the problem that ends the scan early goes (the file cannot
        be opened, or nothing can be framed past a damaged or truncated
        record), for a caller that scans a file again to replace rather than
        repeat; None: to ``problems``.
    """
    name = os.path.basename(path)
    stop = problems if ends is None else ends
    try:
        f, size = files_for(path).open(path)
    except (OSError, ValueError, LogdirError) as e:
        stop.append("%s: cannot open (%s)" % (name, e))
        return
    window = _Window(f, size, start)
    offset, count = start, 0
    skipped: list[int] = []

    def cut(what: str) -> str:
        return "%s: %s at byte offset %d of %d after %d record(s); the rest of the file was skipped" % (
            name, what, offset, size, counted + count,
        )

    try:
        read = make_reader(path, window)
        while offset < size:
            if size - offset < _HEADER:
                if not live:
                    stop.append(cut("truncated"))
                return
            header = window.at(offset, _HEADER)
            (length,) = struct.unpack_from("<Q", header)
            end = offset + _HEADER + length + _FOOTER
            if end > size:
                if not (live and _header_ok(header) and length <= LIVE_RECORD_BYTES):
                    stop.append(cut("truncated" if _header_ok(header) else _bad_header(count + start)))
                return
            record = _record_at(window, read, offset, length, header)
            if record is None:
                stop.append(cut(_bad_header(count + start)))
                return
            if record.intact:
                count += 1
            else:
                skipped.append(offset)
            yield offset, end, record
            offset = end
    except (_Short, OSError) as e:
        stop.append(cut("truncated" if isinstance(e, _Short) else "unreadable (%s)" % e))
    finally:
        window.close()
        if skipped:
            problems.append("%s: %d corrupt record(s) skipped (checksum mismatch) at byte offset %s"
                            % (name, len(skipped), _offsets_text(skipped)))


class RecordFile:
    """A local event file opened to read records again at offsets where
    ``scan_records`` found them intact; each record's length is checked
    against the file's size before anything trusts it, its checksums by the
    CPU's CRC32C (``_crc32c.FAST``), else by TensorFlow's reader where
    TensorFlow is imported already, else in numpy (many records at once).

    Raises (``read_many``):
      OSError: the file cannot be read there, or a record no longer passes
        its checksums (the file was replaced or damaged since).
    """

    def __init__(self, path: str):
        self.path = path
        self._f = open(path, "rb")
        self._size = os.fstat(self._f.fileno()).st_size
        self._tf: RecordReader | None = None
        if _crc32c.FAST is None and "tensorflow" in sys.modules:
            try:
                self._tf = tf_record_reader(path, _Window(self._f, self._size))
            except (ImportError, TypeError):
                pass

    def __enter__(self) -> "RecordFile":
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()

    def read_many(self, offsets: list[int]) -> list[bytes]:
        """The data of the records at ``offsets``, in that order."""
        name = os.path.basename(self.path)
        frames = []
        for offset in offsets:
            self._f.seek(offset)
            header = self._f.read(_HEADER)
            if len(header) < _HEADER or not _header_ok(header):
                raise OSError("%s: no intact record at byte offset %d" % (name, offset))
            (length,) = struct.unpack_from("<Q", header)
            if offset + _HEADER + length + _FOOTER > self._size:
                raise OSError("%s: the record at byte offset %d runs past the file's end" % (name, offset))
            if self._tf is not None:
                try:
                    frames.append((self._tf(offset), None))
                except _Damaged:
                    raise OSError("%s: the record at byte offset %d fails its checksum" % (name, offset)) from None
                continue
            body = self._f.read(length + _FOOTER)
            frames.append((body[:length], struct.unpack_from("<I", body, length)[0]))
        unchecked = [i for i, (_, crc) in enumerate(frames) if crc is not None]
        if unchecked:
            got = _crc32c.masked_crc32c_many([frames[i][0] for i in unchecked])
            bad = [offsets[i] for i, c in zip(unchecked, got.tolist()) if c != frames[i][1]]
            if bad:
                raise OSError("%s: the record at byte offset %s fails its checksum" % (name, _offsets_text(bad)))
        return [data for data, _ in frames]


def _record_at(window: _Window, read: RecordReader, offset: int, length: int, header: bytes) -> Record | None:
    """The record at ``offset`` of ``length`` bytes, checked; None where its
    header is damaged too (nothing after it can be framed)."""
    if length > LARGE_RECORD_BYTES and _header_ok(header):
        return _large_record(window, offset, length)
    try:
        return Record(read(offset), True)
    except _Damaged as e:
        if not _header_ok(header):
            return None
        # The bytes the check read (the window may have moved past them).
        return Record(e.data if e.data is not None else window.at(offset + _HEADER, length), False)


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
