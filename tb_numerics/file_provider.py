"""A local logdir's numerics events, indexed where they lie and read from there on demand.

Why: TensorBoard holds every event it keeps in memory, its Rust data server
and its Python loader alike. A long run with every layer logged at every
step (500 tensors x 100,000 steps: 50 M records, 2.6 GB of packed events)
then costs TensorBoard more memory than the 2 GB a whole TensorBoard may
take, before the plugin holds anything. So for a local logdir the plugin
has TensorBoard keep only a sample of its records (``plugin.NumericsLoader``)
and reads them itself, from the event files, through this provider:

- ``index_round`` reads what was appended to the logdir's event files since
  its last round and keeps, per run and numerics tag, the tag's metadata
  and where each of its events lies (file and byte offset): about 40 bytes
  an event, whatever it holds. ``list_plugins`` and ``list_tensors`` run a
  round first (the run store lists every reload interval, and every 0.5 s
  while a run is loading; a listing waits for a round under way), so a
  reload of TensorBoard and a listing see the same files;
- ``list_plugins``, ``list_tensors`` and ``read_tensors`` answer as
  TensorBoard's data provider does, from that index; ``read_tensors`` reads
  the tags' events again from the files, each checked against its checksum.

Every event is kept (a tag logged twice at one step keeps both records, as
``tb-numerics report`` does), a damaged record, a record that is not an
event and a file that cannot be opened are skipped and named in
``problems(run)`` as the CLI names them, and a record still being written
is read on a later round (one that stays incomplete is a truncation, see
``_SETTLED_S``). Import-light like the plugin: no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
import threading
import time
from typing import Any, Iterable, NamedTuple

import numpy as np

from google.protobuf.message import DecodeError
from tensorboard.compat.proto import event_pb2
from tensorboard.data import provider

from tb_numerics import event_files, loader_guard, metadata, packed, tfrecord

__all__ = ["FileProvider"]

logger = logging.getLogger(__name__)

# A round publishes what it indexed at least this often (records), so that
# listings see a long run grow while it is being read.
_PUBLISH_EVERY = 64
# A file not modified for this long is no longer being written: an
# incomplete last record there is a truncation (a writer that crashed, a
# full disk, a copy cut short), named as the CLI names it. A file modified
# more recently may end in a record still being written: writers flush every
# 120 s by default (tf.summary's writer, TensorBoard's EventFileWriter), and
# a record that a full write buffer split is completed by the next flush at
# the latest. A file is scanned again when it settles, and what ended its
# last scan is replaced at each scan: a truncation said of a file that then
# grows is withdrawn.
_SETTLED_S = 150.0


@dataclasses.dataclass
class _TagIndex:
    """Where one tag's events lie, and what its listing says."""

    content: bytes
    description: str
    steps: list[int] = dataclasses.field(default_factory=list)
    walls: list[float] = dataclasses.field(default_factory=list)
    where: list[tuple[str, int]] = dataclasses.field(default_factory=list)  # (path, byte offset)
    max_step: int = -1
    max_wall: float = 0.0
    # The earliest step at which an event may hold a NaN or an infinity
    # (``packed.nonfinite_step``); None: none may.
    nonfinite: int | None = None


class _FileState(NamedTuple):
    """An event file as it is now."""

    inode: int
    size: int
    settled: bool  # not modified for _SETTLED_S: no longer being written


@dataclasses.dataclass(frozen=True)
class _FileRead:
    """How far one event file was read, and what its scans found."""

    inode: int
    offset: int = 0  # the end of the last record read: where the next scan starts
    records: int = 0  # intact records before offset (problems count them, as the CLI does)
    not_events: int = 0  # intact records that are not events, skipped
    scanned: tuple[int, bool] = (-1, False)  # (size, settled) at the last scan
    end: str | None = None  # the problem that ended the last scan early


@dataclasses.dataclass
class _RunIndex:
    """One run's files as read so far, and its numerics tags."""

    files: dict[str, _FileRead] = dataclasses.field(default_factory=dict)
    tags: dict[str, _TagIndex] = dataclasses.field(default_factory=dict)
    other: set[str] = dataclasses.field(default_factory=set)  # tags of other plugins
    problems: list[str] = dataclasses.field(default_factory=list)
    unopenable: dict[str, str] = dataclasses.field(default_factory=dict)  # path -> why, as of the last round


class FileProvider:
    """The numerics plugin's data provider over a local logdir's own files.

    Args:
      logdir: the local logdir TensorBoard serves.
      on_listing: index what was appended before each listing. False: the
        caller runs ``index_round`` (tests, tools).
    """

    def __init__(self, logdir: str, *, on_listing: bool = True):
        self._logdir = logdir
        self._on_listing = on_listing
        self._lock = threading.Lock()  # guards _runs and every index in it
        self._rounds = threading.Lock()  # one round at a time; a listing waits for the one under way
        self._runs: dict[str, _RunIndex] = {}
        self._warned = False

    # ---------------------------------------------------------- indexing

    def index_round(self) -> bool:
        """Indexes what was appended to the logdir's event files since the
        last round; returns whether anything new was found."""
        with self._rounds:
            return self._round()

    def _round(self) -> bool:
        try:
            found = _named_runs(event_files.find_runs(self._logdir))
        except (event_files.LogdirError, OSError) as e:
            if not self._warned:  # a logdir not made yet: said once
                logger.warning("numerics: cannot list %s: %s", self._logdir, e)
                self._warned = True
            return False
        with self._lock:
            for run in [r for r in self._runs if r not in found]:
                del self._runs[run]
        grew = False
        for run, paths in sorted(found.items()):
            grew |= self._index_run(run, paths)
        return grew

    def _index_run(self, run: str, paths: list[str]) -> bool:
        with self._lock:
            held = self._runs.get(run)
            files = dict(held.files) if held is not None else {}
        states = {p: _file_state(p) for p in paths}
        # A file that shrank, was replaced or went away: read the whole run again.
        if held is not None and any(
            not isinstance(st := states.get(p), _FileState) or st.inode != read.inode or st.size < read.offset
            for p, read in files.items()
        ):
            held = None
        if held is None:
            held = _RunIndex()
            with self._lock:
                self._runs[run] = held
        with self._lock:
            held.unopenable = {p: st for p, st in states.items() if isinstance(st, str)}
        grew = False
        for path in paths:
            st = states[path]
            read = held.files.get(path)
            if isinstance(st, str) or (read is not None and _read_enough(read, st)):
                continue
            grew |= self._index_file(held, path, st, read or _FileRead(st.inode))
        return grew

    def _index_file(self, held: _RunIndex, path: str, st: _FileState, read: _FileRead) -> bool:
        """Indexes one file from where ``read`` left it; publishes as it goes."""
        problems: list[str] = []
        ends: list[str] = []
        pending: list[tuple[int, Any]] = []
        end, records, not_events = read.offset, read.records, read.not_events
        grew = False
        for offset, stop, record in tfrecord.scan_records(
            path, problems, start=read.offset, live=not st.settled, counted=read.records, ends=ends
        ):
            end = stop
            grew = True
            if record.intact:
                records += 1
                try:
                    pending.append((offset, _values_of(event_pb2.Event.FromString(record.data))))
                except DecodeError:  # named in problems, as the CLI names it
                    not_events += 1
            if len(pending) >= _PUBLISH_EVERY:
                self._publish(held, path, _FileRead(st.inode, end, records, not_events), pending)
                pending = []
        scanned = (st.size, st.settled)
        self._publish(held, path, _FileRead(st.inode, end, records, not_events, scanned, ends[0] if ends else None),
                      pending)
        with self._lock:  # a file's damage found again next round is said once
            held.problems.extend(p for p in problems if p not in held.problems)
        return grew

    def _publish(self, held: _RunIndex, path: str, read: _FileRead, pending: list) -> None:
        """Adds the events of ``pending`` to the run's index, and marks
        ``path`` read as ``read`` says."""
        with self._lock:
            for offset, (step, wall, values) in pending:
                for value in values:
                    _add_value(held, path, offset, step, wall, *value)
            held.files[path] = read

    # ---------------------------------------------------------- provider

    def problems(self, run: str) -> list[str]:
        """What could not be read in ``run``'s event files so far, and the
        damage ``loader_guard`` kept TensorBoard's Python loader from there."""
        with self._lock:
            held = self._runs.get(run)
            if held is None:
                return []
            found, paths = list(held.problems) + _file_problems(held), list(held.files)
        return found + (loader_guard.problems(os.path.dirname(paths[0])) if paths else [])

    def list_plugins(self, ctx=None, *, experiment_id, index: bool = True) -> list[str]:
        """[``metadata.PLUGIN_NAME``] where a run holds numerics records.

        Args:
          index: run a round first (where on listing); False: answer from
            the index as it stands, at once.
        """
        if self._on_listing and index:
            self.index_round()
        with self._lock:
            return [metadata.PLUGIN_NAME] if any(r.tags for r in self._runs.values()) else []

    def list_tensors(self, ctx=None, *, experiment_id, plugin_name, run_tag_filter=None) -> dict:
        if plugin_name != metadata.PLUGIN_NAME:
            return {}
        if self._on_listing:
            self.index_round()
        out = {}
        with self._lock:
            for run in _wanted_runs(self._runs, run_tag_filter):
                out[run] = {
                    tag: provider.TensorTimeSeries(
                        max_step=t.max_step, max_wall_time=t.max_wall, plugin_content=t.content,
                        description=t.description, display_name="",
                    )
                    for tag, t in self._runs[run].tags.items()
                    if t.steps and _tag_wanted(tag, run_tag_filter)
                }
        return out

    def nonfinite_steps(self, run: str) -> dict[str, int]:
        """Per numerics tag of ``run`` that may hold a NaN or an infinity, the
        earliest step at which it may, as the index found it: no record of
        the run is non-finite before the least of them (``packed.nonfinite_step``).
        What lets the run store name a long run's first anomaly before it has
        read the run (``ProviderReader.first_look``)."""
        with self._lock:
            held = self._runs.get(run)
            return {} if held is None else {
                tag: t.nonfinite for tag, t in held.tags.items() if t.steps and t.nonfinite is not None}

    def read_tensors(self, ctx=None, *, experiment_id, plugin_name, downsample=None, run_tag_filter=None) -> dict:
        """Every event of the tags asked for, read again from the files
        (``downsample`` is ignored: every record is returned).

        Raises:
          ValueError: an event that was intact when indexed no longer is
            (its file was replaced or damaged since).
        """
        if plugin_name != metadata.PLUGIN_NAME:
            return {}
        with self._lock:
            wanted = {
                run: {tag: (list(t.steps), list(t.walls), list(t.where))
                      for tag, t in self._runs[run].tags.items() if t.steps and _tag_wanted(tag, run_tag_filter)}
                for run in _wanted_runs(self._runs, run_tag_filter)
            }
        return {run: {tag: _read_tag(tag, *where) for tag, where in tags.items()} for run, tags in wanted.items()}


def _run_name(run: str) -> str:
    """A run's name as TensorBoard's Rust data server gives it: its
    directory decoded as UTF-8, bytes that are not replaced by U+FFFD (a
    name a browser can send back; the CLI shows those bytes escaped)."""
    return run.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _named_runs(runs: dict[str, list[str]]) -> dict[str, list[str]]:
    """Each run's files by its name (``_run_name``); runs whose names differ
    only in bytes that are not UTF-8, which that name would make one, keep
    those bytes escaped (``r\\xfe``, ``r\\xff``), so that neither is lost."""
    names: dict[str, list[str]] = {}
    for run in runs:
        names.setdefault(_run_name(run), []).append(run)
    out = {}
    for name, same in names.items():
        for run in same:
            escaped = run.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
            out[name if len(same) == 1 else escaped] = runs[run]
    return out


def _file_state(path: str) -> _FileState | str:
    """A regular file's state; where it cannot be read (a dangling link, a
    link loop, a FIFO, a device), why, as the CLI says it (nothing opened:
    opening a FIFO would block)."""
    try:
        st = os.stat(path)
    except OSError as e:
        return "%s: cannot open (%s)" % (os.path.basename(path), e)
    if not stat.S_ISREG(st.st_mode):
        return "%s: cannot open (not a regular file: skipped)" % os.path.basename(path)
    return _FileState(st.st_ino, st.st_size, time.time() - st.st_mtime > _SETTLED_S)


def _read_enough(read: _FileRead, st: _FileState) -> bool:
    """Whether a scan of the file now would find nothing new: it was read to
    its end, or scanned as it is now (damage that ends it, or a record still
    being written, found again)."""
    return st.size <= read.offset or read.scanned == (st.size, st.settled)


def _file_problems(held: _RunIndex) -> list[str]:
    """What each file's scans found as of now, as the CLI says it: what
    ended its last scan, the records that are not events, and the files
    that cannot be opened."""
    out = []
    for path, read in sorted(held.files.items()):
        if read.end is not None:
            out.append(read.end)
        if read.not_events:
            out.append("%s: %d record(s) that are not events skipped" % (os.path.basename(path), read.not_events))
    return out + [why for _, why in sorted(held.unopenable.items())]


def _values_of(event) -> tuple[int, float, list[tuple]]:
    """What the index keeps of an event: its step, wall time, and each
    tensor value's (tag, plugin name or None, content, description, the
    step from which it may hold a NaN or an infinity)."""
    values = []
    step = int(event.step)
    for value in event.summary.value if event.HasField("summary") else ():
        if value.HasField("tensor"):
            md = value.metadata if value.HasField("metadata") else None
            plugin = md.plugin_data.plugin_name if md is not None else None
            values.append((value.tag, plugin, md.plugin_data.content if md is not None else b"",
                           md.summary_description if md is not None else "",
                           _nonfinite_step(value.tensor, step) if plugin in (None, metadata.PLUGIN_NAME) else None))
    return step, float(event.wall_time), values


def _nonfinite_step(tensor, step: int) -> int | None:
    """``packed.nonfinite_step`` of a value's tensor; None where it cannot
    be decoded (its read says why)."""
    try:
        return packed.nonfinite_step(packed.tensor_values(tensor), step)
    except (ValueError, TypeError, KeyError):
        return None


def _add_value(held: _RunIndex, path: str, offset: int, step: int, wall: float,
               tag: str, plugin: str | None, content: bytes, description: str, nonfinite: int | None) -> None:
    """Indexes one tensor value of an event, where it is a numerics record.

    A tag's metadata comes from its first event that carries the plugin's
    name; one that carries only the name (its first event was lost) stands
    in until one with the full metadata comes. Values of a tag before any
    carries metadata are skipped, and the tag left open (as the CLI does):
    TensorBoard reads a series' metadata from its first event only, so such
    a tag is never numerics to it, while its later events say they are.
    """
    if tag in held.other:
        return
    entry = held.tags.get(tag)
    if entry is None:
        if plugin is None:
            return
        if plugin != metadata.PLUGIN_NAME:
            held.other.add(tag)
            return
        entry = held.tags[tag] = _TagIndex(content, description)
    elif not entry.content and plugin == metadata.PLUGIN_NAME and content:
        entry.content, entry.description = content, description
    entry.steps.append(step)
    entry.walls.append(wall)
    entry.where.append((path, offset))
    entry.max_step = max(entry.max_step, step)
    entry.max_wall = max(entry.max_wall, wall)
    if nonfinite is not None and (entry.nonfinite is None or nonfinite < entry.nonfinite):
        entry.nonfinite = nonfinite


def _read_tag(tag: str, steps: list[int], walls: list[float], where: list[tuple[str, int]]) -> list:
    """The ``TensorDatum`` of each of a tag's events, read from the files
    (each file opened once)."""
    by_file: dict[str, list[int]] = {}
    for i, (path, _) in enumerate(where):
        by_file.setdefault(path, []).append(i)
    out: list = [None] * len(where)
    for path, idx in by_file.items():
        try:
            with tfrecord.RecordFile(path) as f:
                datas = f.read_many([where[i][1] for i in idx])
        except OSError as e:
            raise ValueError("%s: %s" % (tag, e)) from None
        for i, data in zip(idx, datas):
            try:
                event = event_pb2.Event.FromString(data)
            except DecodeError as e:
                raise ValueError("%s: %s" % (tag, e)) from None
            value = next((v for v in event.summary.value if v.tag == tag), None)
            if value is None:
                raise ValueError("%s: the event at byte offset %d of %s no longer holds it" % (
                    tag, where[i][1], os.path.basename(path)))
            out[i] = provider.TensorDatum(step=steps[i], wall_time=walls[i], numpy=_tensor_values(value.tensor))
    return out


def _tensor_values(tensor) -> np.ndarray:
    """A record's values; empty where its tensor cannot be decoded, so that
    decoding skips that record only, as malformed (the CLI's ``_vector``
    and ``_matrix`` do the same), rather than the whole tag."""
    try:
        return packed.tensor_values(tensor)
    except (ValueError, TypeError, KeyError):
        return np.zeros(0)


def _wanted_runs(runs: dict[str, _RunIndex], rtf: provider.RunTagFilter | None) -> Iterable[str]:
    if rtf is None or rtf.runs is None:
        return sorted(runs)
    return [r for r in rtf.runs if r in runs]


def _tag_wanted(tag: str, rtf: provider.RunTagFilter | None) -> bool:
    return rtf is None or rtf.tags is None or tag in rtf.tags
