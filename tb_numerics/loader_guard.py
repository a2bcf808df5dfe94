"""Keeps TensorBoard's Python loader alive on a record header that claims more than its file holds.

TensorBoard's Python loader (``--load_fast=false``, and where the Rust data
server cannot start) reads event files with TensorFlow's record iterator
(``tf.compat.v1.io.tf_record_iterator``). That iterator allocates a record's
claimed length before it reads the record, and TensorFlow's string does not
check the allocation: a header with a valid checksum that claims more than
the machine can allocate (a terabyte; here anything from 64 GiB) segfaults
the whole TensorBoard process, in ``TF_TString_Reserve`` under
``tsl::io::BufferedInputStream::ReadNBytes`` under
``tsl::io::RecordReader::ReadChecksummed`` (seen with gdb, TensorFlow 2.21).
It takes one such header in any event file of the logdir, appended by a
damaged disk or a hostile file; no load is needed. Without TensorFlow,
TensorBoard's stub reader raises ``MemoryError`` instead, which its reload
thread does not catch.

``install`` wraps TensorBoard's iterator factory (its private
``event_file_loader._make_tf_record_iterator``, looked up once at start-up by
``NumericsLoader.fix_flags``): before a record of a local file is read, the
guard reads its 12-byte header (and those of the records after it, a chunk
at a time), and where the record would end past the file's end it stops as TensorFlow
stops at a truncated record (``DataLossError``, which TensorBoard's loader
takes as "try again at the next reload", the iterator still at that record)
without asking TensorFlow to read it. A record still being written is that
same case, and is read once the file holds it; every record that fits in its
file is read by TensorFlow as before. A claimed length that no event can
have (2 GiB or more: protobuf refuses such messages) with a valid checksum
is damage: it is logged once, and ``problems`` names it for its run.

A FIFO named like an event file stopped that loader for good: TensorFlow's
reader opens it and waits for a writer, in TensorBoard's one reload thread,
so no run was read again (and runs not yet read never were). The guard
hands TensorBoard an empty iterator for a local path that is not a regular
file, and names it the same way.

Cost: one 64 KiB read per few hundred small records, and a few Python
operations per record (``bench/loader_guard.py``).
Remote files (a path with a scheme) are not guarded: a read per record
there would be a request per record.
"""

from __future__ import annotations

import logging
import math
import os
import stat
import struct
import threading
from typing import Any, Iterator

from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

__all__ = ["GuardedRecordIterator", "install", "problems"]

logger = logging.getLogger(__name__)

_HEADER = 12  # uint64 length, masked CRC32C of the length
_FOOTER = 4  # masked CRC32C of the data
# No event is this long: protobuf refuses messages of 2 GiB or more.
IMPOSSIBLE_LENGTH = 2**31
# How much of the file one read checks: the headers of a few hundred small records.
_CHUNK_BYTES = 64 << 10

_lock = threading.Lock()
_damaged: dict[str, str] = {}  # file path -> what is wrong with it


def install() -> bool:
    """Wraps TensorBoard's record-iterator factory with the guard, once.

    Returns:
      True where the guard is in place; False where this TensorBoard has no
      such factory (nothing is changed then, and it is logged).
    """
    from tensorboard.backend.event_processing import event_file_loader

    make = getattr(event_file_loader, "_make_tf_record_iterator", None)
    if make is None:
        logger.warning("numerics: this TensorBoard reads event files in a way the loader guard does not know; "
                       "a damaged record header may crash its Python loader")
        return False
    if getattr(make, "guarded", False):
        return True

    def guarded(file_path: str) -> Iterator[bytes]:
        if "://" not in file_path and not _is_regular(file_path):
            _note(os.path.abspath(file_path), "%s: not a regular file (a FIFO or a device named like an event "
                  "file); TensorBoard's Python loader would wait on it forever, and every run with it: skipped"
                  % os.path.basename(file_path))
            return iter(())
        return GuardedRecordIterator(make(file_path), file_path)

    guarded.guarded = True  # type: ignore[attr-defined]
    event_file_loader._make_tf_record_iterator = guarded
    return True


def problems(directory: str) -> list[str]:
    """What the guard found damaged or skipped among the event files directly
    in ``directory`` (those since removed no longer count).

    Args:
      directory: a run's directory, as the loader was given its files.
    """
    want = os.path.abspath(directory)
    with _lock:
        found = sorted(_damaged.items())
    return [text for path, text in found if os.path.dirname(path) == want and os.path.lexists(path)]


def _is_regular(path: str) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return True  # gone or unreadable: TensorFlow's reader says so itself


def _note(path: str, text: str) -> None:
    """Keeps ``text`` as the problem of the file at ``path``; logs it the first time."""
    with _lock:
        known = _damaged.get(path) == text
        _damaged[path] = text
    if not known:
        logger.warning("numerics: %s", text)


def _data_loss(message: str) -> Exception:
    from tensorboard.compat import tf  # TensorFlow or TensorBoard's stub: what the loader catches

    return tf.errors.DataLossError(None, None, message)


class GuardedRecordIterator:
    """A record iterator that never asks ``inner`` for a record its file cannot hold.

    Args:
      inner: TensorBoard's record iterator over ``path``, from its start.
      path: the event file's path.
    """

    def __init__(self, inner: Iterator[bytes], path: str):
        self._inner = inner
        local = "://" not in path
        self._path = os.path.abspath(path) if local else path
        self._offset = 0  # where the next record starts
        # Records starting before this offset fit in the file (all of a remote file's: unchecked).
        self._checked_to = 0 if local else math.inf
        self._stopped = False  # the guard stopped the last read

    def __iter__(self) -> GuardedRecordIterator:
        return self

    def __next__(self) -> bytes:
        if self._offset >= self._checked_to:  # else the record is known to fit
            if self._past_the_end():
                self._stopped = True
                raise _data_loss("%s: the record at byte offset %d ends past the file's end"
                                 % (self._path, self._offset))
            if self._stopped:
                self._resume()
        record = next(self._inner)
        self._offset += _HEADER + len(record) + _FOOTER
        return record

    def __getattr__(self, name: str) -> Any:
        # ``close`` and ``reopen`` (TensorFlow 2.9+) only where the inner
        # iterator has them: TensorBoard checks for ``reopen`` with hasattr.
        attr = getattr(self._inner, name)
        if name != "reopen":
            return attr

        def reopen() -> Any:
            # A file that was replaced: check its headers again from here.
            self._checked_to = min(self._checked_to, self._offset)
            return attr()

        return reopen

    def _resume(self) -> None:
        """Lets the inner iterator see what the file holds now.

        TensorFlow's reader keeps the end of file it met while buffering
        ahead, and asks the file again only after one of its own reads
        failed; the guard's stop was none, so it would stop once more at
        this record. It is reopened at its offset (which TensorFlow keeps),
        as TensorBoard reopens it when a file grows."""
        self._stopped = False
        reopen = getattr(self._inner, "reopen", None)
        if reopen is not None:
            self._inner.close()
            reopen()

    def _past_the_end(self) -> bool:
        """Whether the next record's header claims more than the file holds now.

        The headers are read a chunk at a time: one read checks the records
        that follow in it, and the records before ``_checked_to`` need no
        read at all. (The walk follows the length headers as TensorFlow
        does; past a header whose checksum fails it walks garbage, but
        TensorFlow never reads past that header either.)"""
        try:
            # Opened for each check, not held: TensorBoard already holds a
            # file per run, and a logdir of many runs would run out of them.
            with open(self._path, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                f.seek(self._offset)
                chunk = f.read(_CHUNK_BYTES)
        except OSError:
            return False  # what TensorFlow makes of it: an error, never a huge allocation
        if len(chunk) < _HEADER:
            return False  # TensorFlow stops at a short header itself
        at = 0
        while at + _HEADER <= len(chunk):
            end = at + _HEADER + struct.unpack_from("<Q", chunk, at)[0] + _FOOTER
            if self._offset + end > size:
                break
            at = end
        self._checked_to = self._offset + at
        if at > 0:
            return False
        (length,) = struct.unpack_from("<Q", chunk)
        if length >= IMPOSSIBLE_LENGTH and masked_crc32c(chunk[:8]) == struct.unpack_from("<I", chunk, 8)[0]:
            self._note_damage(length, size)
        return True

    def _note_damage(self, length: int, size: int) -> None:
        text = (
            "%s: a record header at byte offset %d claims %d bytes, more than any event holds and more than "
            "the file (%d bytes); TensorBoard's Python loader reads this file no further (TensorFlow's record "
            "reader would crash TensorBoard on it), so what was written after it is not shown: remove or repair "
            "the file" % (os.path.basename(self._path), self._offset, length, size)
        )
        _note(self._path, text)
