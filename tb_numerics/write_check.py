"""Says when TensorFlow's summary writer lost ``log_numerics`` records (a full disk).

TensorFlow's summary writer ignores a failed append: its ``EventsWriter``
drops the record writer's error (``WriteRecord(...).IgnoreError()``), and a
later flush succeeds once the C library's buffer holds nothing left to
write. Measured on a full 64 KiB tmpfs with TensorFlow 2.21: a ``tf.function``
step logging 40 tensors went on for 400 steps, its NaN step among the
records lost, with nothing raised and nothing on stderr; the event file
ended in a record cut at the filesystem's end. (Where the writer's queue
still holds the events when the disk fills, its flush fails instead and the
step raises TensorFlow's ``ResourceExhaustedError``, which names the file,
as ``tf.summary.scalar`` does.)

``GrowthCheck`` is a step buffer's check after each of its packed writes:
the writer's event file must have grown by at least the bytes of the rows
written since it was last looked at. Where it did not, ``record_writer.warn_lost_records`` says
so once on stderr, naming the file's directory (the logdir). It runs on the
host, as a ``tf.numpy_function`` in the write's branch, only where a packed
event is written (every ``packed.STEPS_PER_EVENT`` steps, after
``packed.MAX_DELAY_S``, or at a NaN): never on a step that only buffers.

TensorFlow keeps no logdir on its writer object, so the writer's file is
found among this process's open files (``/proc/self/fd``, Linux): the event
file whose last bytes hold the buffer's block tag; where none does (the
first write was lost too), the only event file this process has open. On a
system without ``/proc`` nothing is checked.
"""

from __future__ import annotations

import os
import threading
from typing import Callable

import numpy as np

from tb_numerics import record_writer

__all__ = ["GrowthCheck", "open_event_files"]

_FD_DIR = "/proc/self/fd"
_EVENT_FILE = "events.out.tfevents."
# How far from a file's end its last write's tag is looked for, beyond the bytes written.
_TAIL_SLACK = 1 << 20


class GrowthCheck:
    """Whether one writer's event file grows by what its step buffer writes.

    Args:
      tag_prefix: the step buffer's block tag prefix (unique to its writer),
        which names the writer's file by its content.
      open_files: the event files this process holds open (default: read
        from ``/proc/self/fd``).
    """

    def __init__(self, tag_prefix: str, open_files: Callable[[], list[str]] | None = None):
        self._tag = tag_prefix.encode()
        self._open_files = open_files or open_event_files
        self._lock = threading.Lock()
        self._path: str | None = None
        self._size = 0  # the file's size when last looked at

    @property
    def logdir(self) -> str | None:
        """The writer's directory, once its file was found."""
        return os.path.dirname(self._path) if self._path else None

    def __call__(self, rows: np.ndarray) -> np.bool_:
        """Checks the file after ``rows`` were written, at least 4 bytes a
        value (a ``tf.numpy_function``: never raises into the step).

        (The rows themselves, not a count made in the graph: there
        ``tf.size`` of a buffer of 30 rows gave 0, seen with TensorFlow
        2.21.)"""
        try:
            with self._lock:
                self._check(4 * rows.size)
        except OSError:
            pass  # the file is gone or unreadable: nothing to say about its growth
        return np.bool_(True)

    def _check(self, written: int) -> None:
        if self._path is None:
            self._find(written)
            return
        size = os.stat(self._path).st_size
        grown, self._size = size - self._size, size
        if grown < written:
            self._warn("its event file %s grew by %d bytes where %d bytes of records were written"
                       % (os.path.basename(self._path), max(grown, 0), written))

    def _find(self, written: int) -> None:
        """Finds the writer's file: the event file this process has open
        whose end holds what was just written, else the only one (which then
        lacks it). Nothing is found where neither is (tried at the next write)."""
        files = self._open_files()
        found = next((p for p in files if self._holds_tag(p, written)), None)
        if found is None and len(files) != 1:
            return
        self._path = found or files[0]
        self._size = os.stat(self._path).st_size
        if found is None:
            self._warn("%d bytes of records written are not in its event file %s"
                       % (written, os.path.basename(self._path)))

    def _warn(self, what: str) -> None:
        record_writer.warn_lost_records(os.path.dirname(self._path), OSError(what + ": is the disk full?"))

    def _holds_tag(self, path: str, written: int) -> bool:
        try:
            with open(path, "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - written - _TAIL_SLACK))
                return self._tag in f.read()
        except OSError:
            return False


def open_event_files() -> list[str]:
    """The event files this process has open, sorted (Linux; elsewhere none)."""
    try:
        fds = os.listdir(_FD_DIR)
    except OSError:
        return []
    out = set()
    for fd in fds:
        try:
            target = os.readlink(os.path.join(_FD_DIR, fd))
        except OSError:
            continue
        if os.path.basename(target).startswith(_EVENT_FILE) and os.path.isfile(target):
            out.add(target)
    return sorted(out)
