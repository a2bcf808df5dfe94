"""The Numerics dashboard's backend: HTTP routes over TensorBoard's data.

Reads only through ``context.data_provider`` (so it works with the Rust data
server, ``--load_fast=true``, and the Python loader alike) and leaves every
health decision to ``tb_numerics.analysis``, so the dashboard, the HTTP API
and ``tb-numerics report`` agree. Routes are documented in ``http_api.md``.

Import-light on purpose: TensorBoard imports this module at start-up and
does not guard the import, so it imports no TensorFlow and nothing that can
fail on a healthy TensorBoard install.
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import dataclasses
import functools
import json
import logging
import math
import os
import re
import threading
import time
import weakref
from typing import Any, Callable, Mapping

import numpy as np
from werkzeug import wrappers

from tensorboard import context as tb_context
from tensorboard import errors, plugin_util
from tensorboard.backend import http_util
from tensorboard.data import provider
from tensorboard.plugins import base_plugin

from tb_numerics import analysis, metadata, packed, records

logger = logging.getLogger(__name__)

MAX_WIDTH = 10000
DEFAULT_WIDTH = 1000
MAX_POINTS = 100000
DEFAULT_MAX_POINTS = 2000
# Steps are int64 in event files.
_MAX_STEP = 2**63 - 1

# `read_tensors` must return every record, never a sample: ask for far more
# points than a series can hold (the providers return min(len, downsample)).
_READ_ALL = 2**31 - 1
# The Rust data server answers over gRPC, whose messages are capped at
# 256 MiB; read a run's tags in batches of about this many records.
_RECORDS_PER_READ = 200_000
# Analyses kept per run (one per distinct set of safe-range parameters).
_ANALYSES_PER_RUN = 8
# A request reads a grown run itself when that means at most this many
# records (about 0.1-0.5 s); beyond, it answers from the previous records
# ("stale") and leaves the read to the background refresher.
_INLINE_READ_RECORDS = 20_000
# A run whose background refresh failed is tried again after this long.
_RETRY_AFTER_FAILURE_S = 30.0
# The refresher's period while TensorBoard is loading a run that changed.
_SETTLING_PERIOD_S = 0.5

_STATIC_TYPES = {
    ".js": "text/javascript",
    ".mjs": "text/javascript",
    ".css": "text/css",
    ".html": "text/html",
    ".json": "application/json",
    ".svg": "image/svg+xml",
    ".map": "application/json",
}
_STATIC_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


# ------------------------------------------------------------------ errors


class _BadRequest(Exception):
    """A request the client got wrong; answered with ``code`` and a message."""

    def __init__(self, message: str, code: int = 400):
        super().__init__(message)
        self.code = code


def _not_found(message: str) -> _BadRequest:
    return _BadRequest(message, 404)


# ------------------------------------------------------------------ JSON


def _jsonable(obj: Any) -> Any:
    """``obj`` with numpy values made plain and NaN/±Inf made strings."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return _jsonable(obj.tolist())
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return "NaN" if obj != obj else ("Infinity" if obj > 0 else "-Infinity")
    return obj


def _respond_json(request: wrappers.Request, body: Any, code: int = 200) -> wrappers.Response:
    # allow_nan=False: a NaN that slipped past _jsonable fails here, loudly,
    # rather than reaching the browser as invalid JSON.
    data = json.dumps(_jsonable(body), allow_nan=False, separators=(",", ":"))
    return http_util.Respond(request, data.encode("utf-8"), "application/json", code=code)


# ------------------------------------------------------------------ params


def _int_param(
    args: Mapping[str, str], name: str, default: int | None, lo: int, hi: int
) -> int | None:
    """A whole-number query parameter in [lo, hi], or ``default`` if absent."""
    raw = args.get(name)
    if raw is None or raw == "":
        return default
    raw = raw.strip()
    if not re.fullmatch(r"[+-]?\d{1,20}", raw):
        raise _BadRequest("%s must be a whole number, got %r" % (name, raw[:100]))
    value = int(raw)
    if not lo <= value <= hi:
        raise _BadRequest("%s must be between %d and %d, got %d" % (name, lo, hi, value))
    return value


def _required(args: Mapping[str, str], name: str) -> str:
    value = args.get(name)
    if value is None:
        raise _BadRequest("the %s parameter is required" % name)
    return value


def _safe_range(args: Mapping[str, str]) -> analysis.SafeRange:
    try:
        return analysis.parse_safe_range(args)
    except analysis.SafeRangeError as e:
        raise _BadRequest(str(e)) from None


def _step_range(args: Mapping[str, str]) -> tuple[int | None, int | None]:
    start = _int_param(args, "start", None, 0, _MAX_STEP)
    end = _int_param(args, "end", None, 0, _MAX_STEP)
    if start is not None and end is not None and start > end:
        raise _BadRequest("start (%d) must not be after end (%d)" % (start, end))
    return start, end


# ------------------------------------------------------------------ cache


@dataclasses.dataclass
class _TagData:
    """One tag's records as last read, and the listing entry they match.

    A tensor's tag holds its ``series``; a packed block's holds ``parts``,
    the series of each tensor in the block (see ``_merge``). Neither: the
    tag cannot be read.
    """

    version: tuple  # (max_step, max_wall_time, plugin_content)
    series: records.TensorSeries | None
    problems: list[str]
    parts: dict[str, records.TensorSeries] | None = None


def _version(ts: Any) -> tuple:
    """What identifies a tag's records in TensorBoard's listing."""
    return (ts.max_step, ts.max_wall_time, ts.plugin_content)


class _Snapshot:
    """A run's decoded records as of one listing, and analyses of them by safe range.

    Never changed once built (a refresh builds a new one and shares the tags
    that did not change), so requests use it without holding the run's lock.
    """

    def __init__(self, tags: dict[str, _TagData]):
        self.tags = tags
        self.series = _merge(tags)
        # The last step actually read: TensorBoard may have loaded more records
        # between its listing and the read.
        self.as_of_step = max(
            [int(s.steps[-1]) for s in self.series if s.steps.size]
            + [int(t.version[0]) for t in tags.values() if t.series is None and t.parts is None],
            default=None,
        )
        self.records = sum(len(s.steps) for s in self.series)
        self._lock = threading.Lock()  # one analysis computed at a time
        self._analyses: collections.OrderedDict[analysis.SafeRange, analysis.RunAnalysis] = (
            collections.OrderedDict()
        )

    def matches(self, listing: Mapping[str, Any]) -> bool:
        """Whether these are the records TensorBoard lists now."""
        return len(listing) == len(self.tags) and all(
            (t := self.tags.get(tag)) is not None and t.version == _version(ts) for tag, ts in listing.items()
        )

    def analysis(self, run: str, sr: analysis.SafeRange, extra_problems: list[str]) -> analysis.RunAnalysis:
        """The analysis under ``sr``, computed once and kept (the last few)."""
        with self._lock:
            hit = self._analyses.get(sr)
            if hit is not None:
                self._analyses.move_to_end(sr)
                return hit
            problems = [p for t in self.tags.values() for p in t.problems] + extra_problems
            ra = analysis.analyze_run(run, self.series, sr, problems)
            if self.records > _INLINE_READ_RECORDS:
                _return_freed_memory()  # the analysis' float64 copies of float32 records
            self._analyses[sr] = ra
            while len(self._analyses) > _ANALYSES_PER_RUN:
                self._analyses.popitem(last=False)
            return ra


@dataclasses.dataclass
class _RunCache:
    """A run's current snapshot and its refresh state, guarded by ``lock``.

    At most one refresh of a run is in flight (``refreshing`` is set when it
    ends); the lock is only held to read or swap these fields.
    """

    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    snapshot: _Snapshot | None = None
    refreshing: threading.Event | None = None
    next_background: float = 0.0  # monotonic time before which the refresher leaves it
    listed: tuple | None = None  # the run's listing at the refresher's last round
    # Packed blocks read while TensorBoard was still loading the run (see
    # ``_prefetch_blocks``), for the next refresh to take instead of reading.
    prefetched: dict[str, _TagData] = dataclasses.field(default_factory=dict)
    # Safe ranges asked for lately, most recent last: computed after a refresh.
    recent: collections.OrderedDict[analysis.SafeRange, None] = dataclasses.field(
        default_factory=collections.OrderedDict
    )


@dataclasses.dataclass(frozen=True)
class _Answer:
    """An analysis and how current it is."""

    analysis: analysis.RunAnalysis
    stale: bool  # TensorBoard holds newer records; a refresh is under way
    as_of_step: int | None  # last step of the records analysed
    latest_step: int | None  # last step TensorBoard holds

    def freshness(self) -> dict[str, Any]:
        return {"stale": self.stale, "as_of_step": self.as_of_step, "latest_step": self.latest_step}


class _Refresher:
    """The plugin's background refresher: one daemon thread, woken by requests.

    Holds only a weak reference to the plugin, so the thread ends when the
    plugin is gone (and, being a daemon, with the process).
    """

    def __init__(self, plugin: "NumericsPlugin"):
        self._plugin = weakref.ref(plugin)
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._jobs: dict[tuple[str, str], Any] = {}  # (experiment, run) -> request context
        self._thread = threading.Thread(target=self._loop, name="numerics-refresher", daemon=True)
        self._thread.start()

    def request(self, ctx, experiment: str, run: str) -> None:
        """Asks for ``run`` to be refreshed soon (at most once per run)."""
        with self._lock:
            self._jobs[(experiment, run)] = ctx
        self._wake.set()

    def _take_jobs(self) -> dict[tuple[str, str], Any]:
        with self._lock:
            jobs, self._jobs = self._jobs, {}
        return jobs

    def _loop(self) -> None:
        while True:
            plugin = self._plugin()
            if plugin is None:
                return
            self._wake.clear()
            try:
                plugin._background_round(self._take_jobs())
            except Exception:  # noqa: BLE001 - the refresher must outlive any failure
                logger.exception("numerics: background refresh failed")
            period = plugin._refresh_period()
            del plugin
            self._wake.wait(period)


def _merge(tags: Mapping[str, _TagData]) -> list[records.TensorSeries]:
    """Every tensor's series: its own tag's, and its parts in packed blocks.

    Blocks are taken oldest first (by their last write), so a step written
    twice keeps the later record. Where a tensor's parts do not overlap in
    steps (the usual case, whichever writers wrote them), each block's part
    (a view of the block's events, maybe float32) is replaced by a slice of
    the merged series: the snapshot then holds each record once, and
    the next refresh, which re-reads only the blocks that grew, still has them.
    """
    out = [t.series for t in tags.values() if t.series is not None]
    blocks = sorted((t.version[1], tag) for tag, t in tags.items() if t.parts)
    by_tensor: dict[str, list[tuple[str, records.TensorSeries]]] = {}
    for _, tag in blocks:
        for name, part in tags[tag].parts.items():
            by_tensor.setdefault(name, []).append((tag, part))
    own = {s.tag: i for i, s in enumerate(out)}
    # Tensors logged at the same steps share one step array, merged and in
    # their parts (keys are ids of arrays all alive until the end).
    shared_steps: dict[tuple[int, ...], np.ndarray] = {}
    step_slices: dict[tuple[int, int, int], np.ndarray] = {}
    for name, placed in by_tensor.items():
        merged, offsets = packed.merge([p for _, p in placed], shared_steps)
        if offsets is not None:
            for (tag, part), at in zip(placed, offsets):
                n = len(part.steps)
                steps = step_slices.setdefault((id(merged.steps), at, n), merged.steps[at : at + n])
                tags[tag].parts[name] = records.TensorSeries(name, part.info, steps, merged.values[at : at + n])
        if name in own:  # also logged per tensor in the same run
            out[own[name]] = packed.merge([out[own[name]], merged])[0]
        else:
            out.append(merged)
    return out


def _return_freed_memory() -> None:
    """Hands memory freed after a big read or analysis back to the operating system.

    A read decodes each event into its own small array, and an analysis
    makes float64 copies of float32 records; once they are freed, glibc
    keeps them in its heap (hundreds of MB after a long run) for as long as
    TensorBoard runs. Where there is no ``malloc_trim`` (not glibc), nothing
    is done.
    """
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _decode_tags(
    run: str, batch: list[str], data: dict, unreadable: Mapping[str, str],
    to_read: Mapping[str, tuple[tuple, Any, _TagData | None]],
) -> dict[str, _TagData]:
    """The ``_TagData`` of each tag of a read ``batch``: a per-tensor tag's
    series, or a packed block's parts, with the problems found."""
    out: dict[str, _TagData] = {}
    for tag in batch:
        version, info, prev = to_read[tag]
        if tag in unreadable:
            out[tag] = _TagData(version, None, [unreadable[tag]])
            continue
        problems: list[str] = []
        points = data.pop(tag, [])
        steps = np.fromiter((d.step for d in points), dtype=np.int64, count=len(points))
        decoded = packed.decode_tag(tag, info, steps, [d.numpy for d in points], problems)
        if isinstance(info, metadata.TensorInfo):
            out[tag] = _TagData(version, decoded[0], problems)
        else:
            out[tag] = _TagData(version, None, problems, {p.tag: p for p in decoded})
        _log_new_problems(run, prev, problems)
    return out


def _log_new_problems(run: str, prev: "_TagData | None", problems: list[str]) -> None:
    """Logs a tag's problems to the server log once: those its previous read had not."""
    for p in problems:
        if prev is None or p not in prev.problems:
            logger.warning("numerics: run %r: %s", run, p)


def _route(impl: Callable) -> Callable:
    """Wraps a handler: JSON errors for bad requests, never a traceback."""

    @functools.wraps(impl)
    @wrappers.Request.application
    def handler(self, request: wrappers.Request) -> wrappers.Response:
        if request.method not in ("GET", "HEAD"):
            return _respond_json(request, {"error": "only GET is supported"}, 405)
        try:
            return _respond_json(request, impl(self, request))
        except _BadRequest as e:
            return _respond_json(request, {"error": str(e)}, e.code)
        except errors.PublicError as e:
            return _respond_json(request, {"error": str(e)}, e.http_code)
        except Exception:  # noqa: BLE001 - never a traceback to the client
            logger.exception("numerics: %s failed", request.full_path)
            return _respond_json(
                request, {"error": "internal error; see the TensorBoard log"}, 500
            )

    return handler


# ------------------------------------------------------------------ plugin


class NumericsPlugin(base_plugin.TBPlugin):
    """Serves the numerical health of every run: summary, timeline, series."""

    plugin_name = metadata.PLUGIN_NAME

    def __init__(self, context: base_plugin.TBContext):
        self._data_provider = context.data_provider
        hint = (context.sampling_hints or {}).get(self.plugin_name)
        # Set by the user despite NumericsLoader.fix_flags: records may be lost.
        self._sample_limit = hint if hint else None
        self._caches: dict[tuple[str, str], _RunCache] = {}
        self._listings: dict[tuple, tuple[float, dict]] = {}
        reload_interval = max(0.0, float(getattr(context.flags, "reload_interval", 5.0) or 0))
        # Half TensorBoard's reload interval, at most 1 s (0: always re-list).
        self._listing_ttl = min(1.0, reload_interval / 2)
        # The refresher looks for new records once per reload, at most once a second.
        self._reload_interval = max(1.0, reload_interval)
        self._listing_seconds = 0.0  # how long listing every run took last time
        # A run changed between the refresher's last two rounds. TensorBoard
        # has just started and is loading every run: look often from the start.
        self._settling = True
        self._caches_lock = threading.Lock()
        self._frontend_dir = _frontend_dir()
        # Started now so that caches are warm by the time the tab is opened.
        self._refresher = _Refresher(self) if self._data_provider is not None else None

    # ---------------------------------------------------------- TBPlugin

    def get_plugin_apps(self) -> dict[str, Callable]:
        return {
            "/index.js": self._serve_static,
            "/safe_range": self._serve_safe_range,
            "/runs": self._serve_runs,
            "/summary": self._serve_summary,
            "/timeline": self._serve_timeline,
            "/series": self._serve_series,
            # Everything else under the plugin: the frontend's other files.
            "/*": self._serve_static,
        }

    def is_active(self) -> bool:
        """Whether any run holds numerics records (TensorBoard's own index)."""
        if self._data_provider is None:
            return False
        try:
            plugins = self._data_provider.list_plugins(
                tb_context.RequestContext(), experiment_id=""
            )
        except Exception:  # noqa: BLE001 - an inactive tab beats a broken listing
            logger.warning("numerics: is_active could not list plugins", exc_info=True)
            return False
        return self.plugin_name in (plugins or ())

    def frontend_metadata(self) -> base_plugin.FrontendMetadata:
        return base_plugin.FrontendMetadata(es_module_path="/index.js", tab_name="Numerics")

    # ---------------------------------------------------------- data

    def _listing(self, ctx, experiment: str, runs: list[str] | None) -> dict:
        """TensorBoard's index of numerics series, re-asked at most every ``_listing_ttl`` s.

        Listing is not free (the Rust data server scans every record for the
        last step: 0.7 s for 5M records), and TensorBoard's data only changes
        on its reload, so the routes a dashboard fires together share one.
        A new listing drops those asked before it: once a route has seen
        records, no later route answers from an older view without them.
        """
        if self._data_provider is None:
            return {}
        key = (experiment, None if runs is None else tuple(runs))
        now = time.monotonic()
        with self._caches_lock:
            hit = self._listings.get(key)
        if hit is not None and now - hit[0] < self._listing_ttl:
            return hit[1]
        listing = self._data_provider.list_tensors(
            ctx,
            experiment_id=experiment,
            plugin_name=metadata.PLUGIN_NAME,
            run_tag_filter=provider.RunTagFilter(runs=runs),
        )
        with self._caches_lock:
            if runs is None:
                self._listing_seconds = time.monotonic() - now
            self._listings = {k: v for k, v in self._listings.items() if v[0] >= now}
            self._listings[key] = (now, listing)
        return listing

    def _cache(self, experiment: str, run: str) -> _RunCache:
        with self._caches_lock:
            return self._caches.setdefault((experiment, run), _RunCache())

    def _forget_missing(self, experiment: str, listing: Mapping[str, Any]) -> None:
        """Drops the caches of runs that left the logdir."""
        with self._caches_lock:
            for key in [k for k in self._caches if k[0] == experiment and k[1] not in listing]:
                del self._caches[key]

    def _refresh_period(self) -> float:
        """Seconds between the refresher's rounds: TensorBoard's reload
        interval (at most ``_SETTLING_PERIOD_S`` while a run is loading, to
        read its blocks as they come), and at least 4x the cost of listing
        (so that watching a huge logdir takes at most a fifth of a core)."""
        period = min(self._reload_interval, _SETTLING_PERIOD_S) if self._settling else self._reload_interval
        return max(period, 4 * self._listing_seconds)

    def _extra_problems(self) -> list[str]:
        if not self._sample_limit:
            return []
        return [
            "TensorBoard keeps only %d records per tensor (--samples_per_plugin "
            "numerics=%d): the first anomaly may be missing; restart TensorBoard "
            "without that setting to keep every record" % (self._sample_limit, self._sample_limit)
        ]

    def _run_refresh(
        self, ctx, experiment: str, run: str, cache: _RunCache, old: _Snapshot | None,
        listing: Mapping[str, Any], done: threading.Event,
    ) -> _Snapshot:
        """Reads what changed since ``old`` and makes it the run's snapshot.

        The caller has claimed the refresh (``cache.refreshing is done``);
        it is released here whatever happens.
        """
        try:
            with cache.lock:
                prefetched = cache.prefetched
            known = [old.tags if old is not None else {}, prefetched]
            big = _read_cost(listing, *known) > _INLINE_READ_RECORDS
            snap = _Snapshot(self._read_tags_data(ctx, experiment, run, listing, known))
            if big:
                _return_freed_memory()
            with cache.lock:
                cache.snapshot = snap
                cache.prefetched = {}
                cache.next_background = time.monotonic() + self._reload_interval
            return snap
        except Exception:
            with cache.lock:
                cache.next_background = time.monotonic() + _RETRY_AFTER_FAILURE_S
            raise
        finally:
            with cache.lock:
                cache.refreshing = None
            done.set()

    def _read_tags_data(
        self, ctx, experiment: str, run: str, listing: Mapping[str, Any],
        known: list[Mapping[str, _TagData]],
    ) -> dict[str, _TagData]:
        """The records of ``listing``'s tags: those ``known`` as of the listed
        version are shared, the others read again (whole: the data provider
        has no "steps after N")."""
        tags: dict[str, _TagData] = {}
        to_read: dict[str, tuple[tuple, metadata.TensorInfo | metadata.BlockTable, _TagData | None]] = {}
        for tag, ts in listing.items():
            version = _version(ts)
            seen = [k[tag] for k in known if tag in k]
            prev = next((t for t in seen if t.version == version), seen[0] if seen else None)
            if prev is not None and prev.version == version:
                tags[tag] = prev
                continue
            try:
                info = metadata.parse_content(ts.plugin_content, ts.description or "")
            except metadata.FormatError as e:
                tags[tag] = _TagData(version, None, ["%s: %s" % (tag, e)])
                _log_new_problems(run, prev, tags[tag].problems)
                continue
            to_read[tag] = (version, info, prev)
        # One read ahead: the data server prepares the next batch while this
        # thread decodes the last (a fifth less time on a long run).
        batches = _batches(to_read, listing)
        with concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="numerics-read") as pool:
            reads = [pool.submit(self._read_tags, ctx, experiment, run, b) for b in batches[:2]]
            for i, batch in enumerate(batches):
                data, unreadable = reads[i].result()
                if i + 2 < len(batches):
                    reads.append(pool.submit(self._read_tags, ctx, experiment, run, batches[i + 2]))
                tags.update(_decode_tags(run, batch, data, unreadable, to_read))
        return tags

    def _read_tags(self, ctx, experiment: str, run: str, tags: list[str]) -> tuple[dict, dict[str, str]]:
        """Every record of ``tags``, and a problem for each tag that cannot be read.

        TensorBoard's providers fail a whole read on one record they cannot
        decode (a tensor whose bytes do not fit its shape): read such a
        batch tag by tag so that only the damaged tag is lost.
        """

        def read(batch: list[str]) -> dict:
            return self._data_provider.read_tensors(
                ctx,
                experiment_id=experiment,
                plugin_name=metadata.PLUGIN_NAME,
                downsample=_READ_ALL,
                run_tag_filter=provider.RunTagFilter(runs=[run], tags=batch),
            ).get(run, {})

        try:
            return read(tags), {}
        except (ValueError, TypeError):
            pass
        data, unreadable = {}, {}
        for tag in tags:
            try:
                data.update(read([tag]))
            except (ValueError, TypeError) as e:
                unreadable[tag] = "%s: TensorBoard cannot decode its records (%s); the tensor was skipped" % (tag, e)
                logger.warning("numerics: run %r: %s", run, unreadable[tag])
        return data, unreadable

    def _answer(
        self, ctx, experiment: str, run: str, sr: analysis.SafeRange, listing: Mapping | None = None
    ) -> _Answer:
        """The run's analysis under ``sr``: current, or the previous one while a long refresh runs.

        - The snapshot matches TensorBoard's listing: its (cached) analysis.
        - It is out of date and refreshing would be quick, or there is none
          yet: this request reads (or waits for the refresh under way).
        - It is out of date and a refresh is under way or would be long: the
          previous analysis at once, marked stale; the refresher catches up.
        """
        if listing is None:
            listing = self._listing(ctx, experiment, [run]).get(run)
            if not listing:
                raise _not_found("no numerics data for run %r" % run)
        latest = max(int(ts.max_step) for ts in listing.values())
        cache = self._cache(experiment, run)
        while True:
            with cache.lock:
                cache.recent[sr] = None
                cache.recent.move_to_end(sr)
                while len(cache.recent) > _ANALYSES_PER_RUN:
                    cache.recent.popitem(last=False)
                snap, in_flight, claim = cache.snapshot, cache.refreshing, None
                fresh = snap is not None and snap.matches(listing)
                if not fresh and in_flight is None and (
                    snap is None or _read_cost(listing, snap.tags, cache.prefetched) <= _INLINE_READ_RECORDS
                ):
                    claim = cache.refreshing = threading.Event()
            if claim is not None:
                snap = self._run_refresh(ctx, experiment, run, cache, snap, listing, claim)
                fresh = True
            elif not fresh and snap is None:
                in_flight.wait()  # no records yet: the refresh under way reads them
                continue
            elif not fresh and in_flight is None:
                self._refresher.request(ctx, experiment, run)
            ra = snap.analysis(run, sr, self._extra_problems())
            return _Answer(ra, not fresh, snap.as_of_step, latest)

    def _background_round(self, jobs: Mapping[tuple[str, str], Any]) -> None:
        """One round of the refresher: the runs requests asked for, then every
        run of TensorBoard's experiment whose records changed."""
        for (experiment, run), ctx in jobs.items():
            listing = self._listing(ctx, experiment, [run]).get(run)
            if listing:
                self._refresh_in_background(ctx, experiment, run, listing, asked=True)
        ctx = tb_context.RequestContext()
        listing = self._listing(ctx, "", None)
        self._forget_missing("", listing)
        self._settling = False
        for run, tags in sorted(listing.items()):
            if tags:
                self._refresh_in_background(ctx, "", run, tags, asked=False)

    def _refresh_in_background(
        self, ctx, experiment: str, run: str, listing: Mapping[str, Any], asked: bool
    ) -> None:
        """Refreshes a run that changed, unless a refresh of it is under way or
        (when no request asked) it was refreshed less than a reload ago; then
        computes the analyses asked for lately so that the next request is instant.
        A failure is logged and retried later."""
        cache = self._cache(experiment, run)
        blocks = None
        with cache.lock:
            old = cache.snapshot
            if not asked:
                listed = tuple(sorted((tag, _version(ts)) for tag, ts in listing.items()))
                settling, cache.listed = listed != cache.listed, listed
                self._settling |= settling
            if cache.refreshing is not None or (old is not None and old.matches(listing)):
                return
            if not asked and time.monotonic() < cache.next_background:
                return
            known = [old.tags if old is not None else {}, cache.prefetched]
            if not asked and settling and _read_cost(listing, *known) > _INLINE_READ_RECORDS:
                # A big run TensorBoard is still loading: read it once its
                # listing holds still for a round (or when a request asks),
                # not now and again in full when loading ends. Its packed
                # blocks, though, are read as they load (a block is read
                # again only while it grows), so that little is left to read
                # when loading ends.
                blocks = {tag: ts for tag, ts in listing.items() if packed.is_block_tag(tag)}
                if not blocks:
                    return
            done = cache.refreshing = threading.Event()
            recent = list(cache.recent)[-1:]
        if blocks is not None:
            self._prefetch_blocks(ctx, experiment, run, cache, blocks, known, done)
            return
        try:
            snap = self._run_refresh(ctx, experiment, run, cache, old, listing, done)
            for sr in dict.fromkeys([analysis.SafeRange(), *recent]):
                snap.analysis(run, sr, self._extra_problems())
        except Exception:  # noqa: BLE001 - one bad run must not stop the others
            logger.exception("numerics: background refresh of run %r failed", run)

    def _prefetch_blocks(
        self, ctx, experiment: str, run: str, cache: _RunCache, blocks: Mapping[str, Any],
        known: list[Mapping[str, _TagData]], done: threading.Event,
    ) -> None:
        """Reads the packed blocks of a run being loaded into ``cache.prefetched``.

        The caller has claimed the refresh; it is released here.
        """
        try:
            got = self._read_tags_data(ctx, experiment, run, blocks, known)
            with cache.lock:
                cache.prefetched = got
            _return_freed_memory()
        except Exception:  # noqa: BLE001 - a later refresh reads them anyway
            logger.exception("numerics: reading run %r ahead of its loading failed", run)
        finally:
            with cache.lock:
                cache.refreshing = None
            done.set()

    # ---------------------------------------------------------- impls

    def safe_range_impl(self) -> dict[str, Any]:
        """The safe-range parameters the routes accept, with defaults and help."""
        defaults = analysis.safe_range_to_json(analysis.SafeRange())
        return {
            "defaults": {name: defaults[name] for name in analysis.SAFE_RANGE_PARAMS},
            "params": {name: help_text for name, (_, help_text) in analysis.SAFE_RANGE_PARAMS.items()},
        }

    def runs_impl(self, ctx, experiment: str, sr: analysis.SafeRange) -> dict[str, Any]:
        """Every run with numerics records and its headline health."""
        listing = self._listing(ctx, experiment, None)
        self._forget_missing(experiment, listing)
        runs = []
        for run in sorted(listing):
            if not listing[run]:
                continue
            answer = self._answer(ctx, experiment, run, sr, listing[run])
            s = analysis.run_summary(answer.analysis)
            runs.append(
                {
                    "run": run,
                    "tensors": s["tensors"],
                    "records": s["records"],
                    "first_step": s["first_step"],
                    "last_step": s["last_step"],
                    "first_anomaly_step": (s["first_anomaly"] or {}).get("step"),
                    "first_warning_step": (s["first_warning"] or {}).get("step"),
                    "problems": s["problems"],
                    **answer.freshness(),
                }
            )
        return {"runs": runs}

    def summary_impl(self, ctx, experiment: str, run: str, sr: analysis.SafeRange) -> dict[str, Any]:
        """The run's first anomaly and first warning (as ``report --json``)."""
        answer = self._answer(ctx, experiment, run, sr)
        summary = analysis.run_summary(answer.analysis)
        summary["safe_range"] = analysis.safe_range_to_json(sr)
        summary.update(answer.freshness())
        return summary

    def timeline_impl(
        self,
        ctx,
        experiment: str,
        run: str,
        sr: analysis.SafeRange,
        width: int,
        start: int | None,
        end: int | None,
    ) -> dict[str, Any]:
        """Worst health per tensor and step bucket, rows in execution order."""
        answer = self._answer(ctx, experiment, run, sr)
        out = analysis.timeline(answer.analysis, width, start, end)
        out["legend"] = {str(c): analysis.health_name(c) for c in (-1, 0, 1, 2)}
        out.update(answer.freshness())
        return out

    def series_impl(
        self,
        ctx,
        experiment: str,
        run: str,
        tag: str,
        sr: analysis.SafeRange,
        start: int | None,
        end: int | None,
        max_points: int,
    ) -> dict[str, Any]:
        """One tensor's statistics over a step range, bucketed to ``max_points``."""
        answer = self._answer(ctx, experiment, run, sr)
        h = answer.analysis.find(tag)
        if h is None:
            raise _not_found("no numerics data for tensor %r in run %r" % (tag, run))
        return {
            "run": run,
            "tensor": tag,
            "info": h.series.info.to_json(),
            **analysis.series_points(h, max_points, start, end),
            **answer.freshness(),
        }

    # ---------------------------------------------------------- routes

    @_route
    def _serve_safe_range(self, request: wrappers.Request) -> dict:
        return self.safe_range_impl()

    @_route
    def _serve_runs(self, request: wrappers.Request) -> dict:
        return self.runs_impl(*_ids(request), _safe_range(request.args))

    @_route
    def _serve_summary(self, request: wrappers.Request) -> dict:
        args = request.args
        return self.summary_impl(*_ids(request), _required(args, "run"), _safe_range(args))

    @_route
    def _serve_timeline(self, request: wrappers.Request) -> dict:
        args = request.args
        run = _required(args, "run")
        sr = _safe_range(args)
        width = _int_param(args, "width", DEFAULT_WIDTH, 1, MAX_WIDTH)
        start, end = _step_range(args)
        return self.timeline_impl(*_ids(request), run, sr, width, start, end)

    @_route
    def _serve_series(self, request: wrappers.Request) -> dict:
        args = request.args
        run = _required(args, "run")
        tag = _required(args, "tensor")
        sr = _safe_range(args)
        start, end = _step_range(args)
        max_points = _int_param(args, "max_points", DEFAULT_MAX_POINTS, 1, MAX_POINTS)
        return self.series_impl(*_ids(request), run, tag, sr, start, end, max_points)

    @wrappers.Request.application
    def _serve_static(self, request: wrappers.Request) -> wrappers.Response:
        """The frontend's files, from the installed ``tb_numerics.frontend``."""
        prefix = "/data/plugin/%s/" % self.plugin_name
        path = request.path
        name = path[path.find(prefix) + len(prefix):] if prefix in path else ""
        try:
            body, content_type = self.static_impl(name)
        except _BadRequest as e:
            return _respond_json(request, {"error": str(e)}, e.code)
        return http_util.Respond(request, body, content_type)

    def static_impl(self, name: str) -> tuple[bytes, str]:
        """The bytes and type of one frontend file, refusing anything else.

        Only a plain file directly in the frontend folder, with a web file's
        extension, is served: no separators, no "..", no hidden files, no
        symlinks.
        """
        ext = os.path.splitext(name)[1].lower()
        if (
            self._frontend_dir is None
            or not _STATIC_NAME.fullmatch(name)
            or ".." in name
            or ext not in _STATIC_TYPES
        ):
            raise _not_found("no such file: %r" % name[:200])
        path = os.path.join(self._frontend_dir, name)
        if os.path.islink(path) or not os.path.isfile(path):
            raise _not_found("no such file: %r" % name)
        with open(path, "rb") as f:
            return f.read(), _STATIC_TYPES[ext]


def _ids(request: wrappers.Request) -> tuple:
    """The request's TensorBoard context and experiment id."""
    return plugin_util.context(request.environ), plugin_util.experiment_id(request.environ)


def _frontend_dir() -> str | None:
    """The folder of the dashboard's files.

    Installed, that is the package ``tb_numerics.frontend``. When
    ``tb_numerics`` is imported from a source checkout instead (``python -m
    demo`` run from the repository's top shadows the installed package), the
    files are in ``frontend/`` beside it.
    """
    try:
        from tb_numerics import frontend

        return os.path.realpath(list(frontend.__path__)[0])
    except ImportError:
        pass
    checkout = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "frontend")
    if os.path.isfile(os.path.join(checkout, "index.js")):
        return os.path.realpath(checkout)
    logger.warning("numerics: the dashboard's files are missing: only the HTTP routes are served")
    return None


def _steps_held(tag: str, ts: Any) -> int:
    """The steps a tag may hold, estimated from its last step (records are
    usually one per step from 0; a packed block holds at most a block's, in
    a fiftieth as many events)."""
    n = max(1, int(ts.max_step) + 1)
    return min(n, packed.STEPS_PER_BLOCK) if packed.is_block_tag(tag) else n


def _batches(to_read: Mapping[str, Any], listing: Mapping[str, Any]) -> list[list[str]]:
    """Tags grouped so that each read stays well under gRPC's message cap,
    counting a packed block's step as one record per tensor of its table."""
    batches: list[list[str]] = []
    size = 0
    for tag, (_, info, _) in to_read.items():
        est = _steps_held(tag, listing[tag]) * (1 if isinstance(info, metadata.TensorInfo) else len(info))
        if batches and size + est <= _RECORDS_PER_READ:
            batches[-1].append(tag)
            size += est
        else:
            batches.append([tag])
            size = est
    return batches


def _read_cost(listing: Mapping[str, Any], *known: Mapping[str, _TagData]) -> int:
    """Steps to read for ``listing`` beyond the tags ``known`` as listed, a
    packed block's counted once: a rough measure of the read's cost."""
    return sum(
        _steps_held(tag, ts)
        for tag, ts in listing.items()
        if not any((t := k.get(tag)) is not None and t.version == _version(ts) for k in known)
    )


class NumericsLoader(base_plugin.TBLoader):
    """Loads the plugin and makes TensorBoard keep every numerics record.

    TensorBoard keeps only a sample of each tensor series (10 with the Python
    loader, 100 with the Rust data server) and may drop the first anomaly.
    ``fix_flags`` runs before the data ingester is built, so setting
    ``numerics=0`` ("keep all") there reaches both loaders. A value the user
    set explicitly is respected.
    """

    def fix_flags(self, flags: Any) -> None:
        spp = getattr(flags, "samples_per_plugin", None)
        if spp is None:
            spp = {}
        elif isinstance(spp, str):  # set programmatically in flag syntax
            try:
                spp = {
                    k.strip(): int(v) for k, v in (t.split("=") for t in spp.split(",") if t.strip())
                }
            except ValueError:
                raise base_plugin.FlagsError("malformed --samples_per_plugin: %r" % spp) from None
        spp.setdefault(metadata.PLUGIN_NAME, 0)
        flags.samples_per_plugin = spp

    def load(self, context: base_plugin.TBContext) -> NumericsPlugin:
        return NumericsPlugin(context)
