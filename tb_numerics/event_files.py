"""A logdir's files on any filesystem: local with Python's own functions, others with ``tf.io.gfile``.

A local path needs no TensorFlow (the CLI and the plugin never import it
for one); a path with a scheme (``gs://``, ``s3://``, ``hdfs://``,
``ram://``) is read through ``tf.io.gfile``, as TensorBoard reads it, and a
scheme TensorFlow does not provide is a ``LogdirError`` that names it.
Only regular files are opened: a FIFO named like an event file would block
forever.
"""

from __future__ import annotations

import functools
import os
import re
import stat
from typing import IO, Iterator

__all__ = ["LogdirError", "check_logdir", "files_for", "find_runs", "scheme"]


class LogdirError(Exception):
    """A logdir that cannot be read at all: missing, or on a filesystem that
    is not available here. The message says which and why."""

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def scheme(path: str | os.PathLike) -> str | None:
    """The scheme of a path ("gs" of "gs://b/logs"), or None for a local one."""
    m = _SCHEME.match(os.fspath(path))
    return m.group(1) if m else None


class _LocalFiles:
    """The local filesystem, with Python's own functions: no TensorFlow."""

    @staticmethod
    def isdir(path: str) -> bool:
        return os.path.isdir(path)

    @staticmethod
    def walk(top: str) -> Iterator[tuple[str, str, list[str]]]:
        """(run name, directory, file names) of every directory under
        ``top``, through links to directories as TensorBoard lists runs
        (``logs/exp1 -> /data/exp1``), but never into a directory it is
        already inside (a link loop)."""
        above: dict[str, frozenset[str]] = {}  # each directory's real path and those of the ones above it
        for dirpath, dirnames, filenames in os.walk(top, followlinks=True):
            chain = above.pop(dirpath, frozenset()) | {os.path.realpath(dirpath)}
            dirnames[:] = sorted(d for d in dirnames if os.path.realpath(os.path.join(dirpath, d)) not in chain)
            above.update((os.path.join(dirpath, d), chain) for d in dirnames)
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


def files_for(path: str) -> _LocalFiles | _GFiles:
    """The filesystem that holds ``path``.

    Raises:
      LogdirError: ``path`` has a scheme and TensorFlow is not installed, or
        TensorFlow (and tensorflow-io, where installed) has no filesystem
        for that scheme.
    """
    root = scheme(path)
    return _LocalFiles() if root is None else _gfiles(root)


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
        ok = files_for(logdir).isdir(logdir)
    except OSError as e:
        raise LogdirError("cannot read logdir %s: %s" % (logdir, e)) from None
    if not ok:
        if scheme(logdir) is None and os.path.exists(logdir):
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
    for run, dirpath, filenames in files_for(logdir).walk(logdir):
        files = sorted(f for f in filenames if _is_event_file(f))
        if files:
            runs[run] = [os.path.join(dirpath, f) for f in files]
    return runs
