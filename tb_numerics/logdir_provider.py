"""The numerics records of a local logdir, served as TensorBoard's data provider serves them.

TensorBoard's Rust data server (``--load_fast``, its default) aborts on some
damaged event files (a record header with a valid checksum that claims a
terabyte) and does not come back: every data-provider call then fails, and
the tab would go dark for every run. ``FailoverProvider`` wraps TensorBoard's
provider and, once that provider stops answering, serves the numerics plugin
from ``LogdirProvider`` instead: the project's own reader (``event_reader``),
which checks every length header against the file's size and skips what it
cannot read. The run store above it decodes the same events either way.

``LogdirProvider`` keeps what TensorBoard's providers return for this plugin:
per run (a directory holding event files, "." for the logdir itself) and tag,
the tag's first plugin metadata and one tensor per step (the last written,
as the Rust data server keeps). A file is read again only when its size or
modification time changed; damage goes to ``problems(run)``.

Import-light like the plugin: no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Any, Iterable

import numpy as np
from google.protobuf.message import DecodeError
from tensorboard.compat.proto import event_pb2
from tensorboard.data import provider

from tb_numerics import event_reader, loader_guard, metadata, packed

__all__ = ["DataServerUnavailable", "FailoverProvider", "LogdirProvider"]

logger = logging.getLogger(__name__)


class DataServerUnavailable(RuntimeError):
    """TensorBoard's data provider stopped answering and no logdir can stand in."""


@dataclasses.dataclass
class _Tag:
    content: bytes
    description: str
    points: dict[int, tuple[float, np.ndarray]]  # step -> (wall time, tensor)
    plugin: str = metadata.PLUGIN_NAME  # or the action events' (``metadata.ACTIONS_PLUGIN``)


# The plugins whose records the failover serves.
_PLUGINS = (metadata.PLUGIN_NAME, metadata.ACTIONS_PLUGIN)


@dataclasses.dataclass
class _Run:
    files: tuple  # ((path, size, mtime_ns), ...) as last read
    tags: dict[str, _Tag]
    problems: list[str]


def _file_state(paths: Iterable[str]) -> tuple:
    out = []
    for p in paths:
        try:
            st = os.stat(p)
        except OSError:
            continue
        out.append((p, st.st_size, st.st_mtime_ns))
    return tuple(out)


def _read_run(files: tuple) -> _Run:
    """Every numerics tag of a run's event files, in file order."""
    tags: dict[str, _Tag] = {}
    other: set[str] = set()  # tags whose first metadata names another plugin
    problems: list[str] = []
    for path, _, _ in files:
        for data, intact in event_reader.read_records(path, problems):
            if not intact:
                continue
            try:
                event = event_pb2.Event.FromString(data)
            except DecodeError:
                continue
            for value in event.summary.value if event.HasField("summary") else ():
                _add_value(tags, other, event, value, problems)
    return _Run(files, tags, problems)


def _add_value(tags: dict[str, _Tag], other: set[str], event, value, problems: list[str]) -> None:
    tag = value.tag
    if tag in other or not value.HasField("tensor"):
        return
    entry = tags.get(tag)
    if entry is None:
        pd = value.metadata.plugin_data
        if pd.plugin_name not in _PLUGINS:
            other.add(tag)
            return
        entry = tags[tag] = _Tag(pd.content, value.metadata.summary_description, {}, pd.plugin_name)
    try:
        array = packed.tensor_values(value.tensor)  # refuses a shape claiming far more than it holds
    except (ValueError, TypeError, KeyError) as e:
        problems.append("%s: a record at step %d cannot be decoded (%s); it was skipped" % (tag, event.step, e))
        return
    entry.points[int(event.step)] = (float(event.wall_time), array)


class LogdirProvider:
    """The numerics plugin's data, read from a local logdir's event files."""

    def __init__(self, logdir: str):
        self._logdir = logdir
        self._lock = threading.Lock()
        self._runs: dict[str, _Run] = {}

    def problems(self, run: str) -> list[str]:
        """What could not be read in ``run``'s event files, as last read."""
        with self._lock:
            held = self._runs.get(run)
        return list(held.problems) if held is not None else []

    def _current(self, runs: Iterable[str] | None) -> dict[str, _Run]:
        """The runs asked for (all where None), read again where a file changed."""
        try:
            found = event_reader.find_runs(self._logdir)
        except event_reader.LogdirError as e:
            logger.warning("numerics: cannot list %s: %s", self._logdir, e)
            found = {}
        wanted = found if runs is None else {r: found[r] for r in runs if r in found}
        out = {}
        for run, paths in sorted(wanted.items()):
            state = _file_state(paths)
            with self._lock:
                held = self._runs.get(run)
            if held is None or held.files != state:
                held = _read_run(state)
                with self._lock:
                    self._runs[run] = held
            out[run] = held
        return out

    def list_plugins(self, ctx=None, *, experiment_id):
        return [metadata.PLUGIN_NAME] if any(r.tags for r in self._current(None).values()) else []

    def list_tensors(self, ctx=None, *, experiment_id, plugin_name, run_tag_filter=None):
        if plugin_name not in _PLUGINS:
            return {}
        out = {}
        for run, held in self._current(_runs_of(run_tag_filter)).items():
            out[run] = {
                tag: provider.TensorTimeSeries(
                    max_step=max(t.points),
                    max_wall_time=max(w for w, _ in t.points.values()),
                    plugin_content=t.content,
                    description=t.description,
                    display_name="",
                )
                for tag, t in held.tags.items()
                if t.points and t.plugin == plugin_name and _tag_wanted(tag, run_tag_filter)
            }
        return out

    def read_tensors(self, ctx=None, *, experiment_id, plugin_name, downsample=None, run_tag_filter=None):
        if plugin_name not in _PLUGINS:
            return {}
        out = {}
        for run, held in self._current(_runs_of(run_tag_filter)).items():
            out[run] = {
                tag: [provider.TensorDatum(step=s, wall_time=w, numpy=a) for s, (w, a) in sorted(t.points.items())]
                for tag, t in held.tags.items()
                if t.plugin == plugin_name and _tag_wanted(tag, run_tag_filter)
            }
        return out


def _runs_of(rtf: provider.RunTagFilter | None) -> list[str] | None:
    return None if rtf is None or rtf.runs is None else list(rtf.runs)


def _tag_wanted(tag: str, rtf: provider.RunTagFilter | None) -> bool:
    return rtf is None or rtf.tags is None or tag in rtf.tags


def _is_outage(e: Exception) -> bool:
    """Whether ``e`` says TensorBoard's data server is gone (not that one
    request was wrong): a gRPC call that found no server, or whose channel
    broke."""
    try:
        import grpc
    except ImportError:  # no gRPC: not the Rust data server
        return False
    return isinstance(e, grpc.RpcError) and e.code() in (
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
    )


class FailoverProvider:
    """TensorBoard's data provider until it stops answering, then the logdir's files.

    Args:
      primary: TensorBoard's ``context.data_provider``.
      logdir: the local logdir TensorBoard serves, or None where there is
        none to read (several logdirs, a remote filesystem): an outage is
        then ``DataServerUnavailable``.
      clock: wall-clock seconds, for the time named in the problem.
    """

    def __init__(self, primary: Any, logdir: str | None, clock=time.time):
        self._primary = primary
        self._logdir = logdir
        self._fallback = LogdirProvider(logdir) if logdir else None
        self._clock = clock
        self._lock = threading.Lock()
        self._outage: str | None = None  # why the primary was left, once it was

    def problems(self, run: str) -> list[str]:
        """What every answer for ``run`` should say about where its records came
        from, and the damage ``loader_guard`` kept TensorBoard's loader from."""
        with self._lock:
            outage = self._outage
        guarded = loader_guard.problems(os.path.join(self._logdir, run)) if self._logdir else []
        if outage is None:
            return guarded
        return [outage] + self._fallback.problems(run) + guarded

    def list_plugins(self, ctx=None, *, experiment_id):
        return self._call("list_plugins", ctx, experiment_id=experiment_id)

    def list_tensors(self, ctx=None, **kwargs):
        return self._call("list_tensors", ctx, **kwargs)

    def read_tensors(self, ctx=None, **kwargs):
        return self._call("read_tensors", ctx, **kwargs)

    def _call(self, name: str, ctx, **kwargs):
        with self._lock:
            failed = self._outage is not None
        if not failed:
            try:
                return getattr(self._primary, name)(ctx, **kwargs)
            except Exception as e:  # noqa: BLE001 - sorted by _is_outage, else re-raised
                if not _is_outage(e):
                    raise
                self._fail_over(e)
        return getattr(self._fallback, name)(ctx, **kwargs)

    def _fail_over(self, e: Exception) -> None:
        detail = "%s: %s" % (e.code().name, (e.details() or "").strip()[:200])
        if self._fallback is None:
            raise DataServerUnavailable(
                "TensorBoard's data server stopped answering (%s), and this logdir cannot be read "
                "without it: restart TensorBoard, or run it with --load_fast=false. A damaged event "
                "file can cause this: `tb-numerics report LOGDIR` names it." % detail
            ) from None
        with self._lock:
            if self._outage is not None:
                return
            self._outage = (
                "TensorBoard's data server stopped answering at %s (%s): the Numerics tab now reads "
                "the event files itself; TensorBoard's other tabs stay empty until it is restarted. "
                "A damaged event file can cause this: this run's other problems, or "
                "`tb-numerics report LOGDIR`, name any that are damaged; remove or repair it, "
                "then restart TensorBoard" % (time.strftime("%H:%M:%S", time.localtime(self._clock())), detail)
            )
        logger.error("numerics: %s", self._outage)
