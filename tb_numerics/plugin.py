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
import dataclasses
import functools
import json
import logging
import math
import os
import re
import threading
import time
from typing import Any, Callable, Mapping

import numpy as np
from werkzeug import wrappers

from tensorboard import context as tb_context
from tensorboard import errors, plugin_util
from tensorboard.backend import http_util
from tensorboard.data import provider
from tensorboard.plugins import base_plugin

from tb_numerics import analysis, metadata

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


def _float_list(a: np.ndarray) -> list:
    """A float array as a JSON list, NaN/±Inf spelled as strings."""
    a = np.asarray(a, dtype=np.float64)
    out = a.tolist()
    for i in np.flatnonzero(~np.isfinite(a)).tolist():
        x = out[i]
        out[i] = "NaN" if x != x else ("Infinity" if x > 0 else "-Infinity")
    return out


def _count_list(a: np.ndarray) -> list:
    """Counts (stored as float64) as JSON integers."""
    return np.asarray(a).astype(np.int64).tolist()


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
    """One tag's records as last read, and the listing entry they match."""

    version: tuple  # (max_step, max_wall_time, plugin_content)
    series: analysis.TensorSeries | None  # None: the tag cannot be read
    problems: list[str]


@dataclasses.dataclass
class _RunCache:
    """Decoded records of one run, and analyses of them by safe range.

    The analyses are dropped whenever any tag's records change, so one that
    is here is current (and old records are not kept alive by it).
    """

    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    tags: dict[str, _TagData] = dataclasses.field(default_factory=dict)
    analyses: "collections.OrderedDict[analysis.SafeRange, analysis.RunAnalysis]" = (
        dataclasses.field(default_factory=collections.OrderedDict)
    )


def _decode(data: list) -> tuple[np.ndarray, np.ndarray | list]:
    """Steps and values of a list of ``provider.TensorDatum``.

    Values come back as one ``[n, NUM_FIELDS]`` array when every record has
    the right shape (the fast, usual case), else as a list of arrays for
    ``analysis.make_series`` to check one by one.
    """
    steps = np.fromiter((d.step for d in data), dtype=np.int64, count=len(data))
    arrays = [d.numpy for d in data]
    try:
        values = np.stack(arrays)
        if values.ndim == 2 and values.shape[1] == metadata.NUM_FIELDS:
            return steps, values.astype(np.float64, copy=False)
    except (ValueError, TypeError):
        pass
    rows = []
    for a in arrays:
        try:
            rows.append(np.asarray(a, dtype=np.float64))
        except (ValueError, TypeError):
            rows.append(np.full(0, np.nan))  # dropped as malformed by make_series
    return steps, rows


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
        # Half TensorBoard's reload interval, at most 1 s (0: always re-list).
        reload_interval = getattr(context.flags, "reload_interval", 5.0)
        self._listing_ttl = min(1.0, max(0.0, float(reload_interval or 0)) / 2)
        self._caches_lock = threading.Lock()
        self._frontend_dir = _frontend_dir()

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
            if len(self._listings) > 1000:
                self._listings.clear()
            self._listings[key] = (now, listing)
        return listing

    def _cache(self, experiment: str, run: str) -> _RunCache:
        with self._caches_lock:
            return self._caches.setdefault((experiment, run), _RunCache())

    def _refresh(self, ctx, experiment: str, run: str, listing: Mapping[str, Any]) -> _RunCache:
        """Brings a run's cached records up to date with the provider's listing.

        Only tags whose listing entry (last step, last wall time, metadata)
        changed are read again; a run that did not grow costs one listing.
        """
        cache = self._cache(experiment, run)
        with cache.lock:
            changed = False
            for tag in [t for t in cache.tags if t not in listing]:
                del cache.tags[tag]
                changed = True
            to_read: dict[str, tuple[tuple, metadata.TensorInfo]] = {}
            for tag, ts in listing.items():
                version = (ts.max_step, ts.max_wall_time, ts.plugin_content)
                old = cache.tags.get(tag)
                if old is not None and old.version == version:
                    continue
                changed = True
                try:
                    info = metadata.parse_plugin_metadata(ts.plugin_content, ts.description or "")
                except metadata.FormatError as e:
                    cache.tags[tag] = _TagData(version, None, ["%s: %s" % (tag, e)])
                    continue
                to_read[tag] = (version, info)
            for batch in _batches(to_read, listing):
                data, unreadable = self._read_tags(ctx, experiment, run, batch)
                for tag in batch:
                    version, info = to_read[tag]
                    if tag in unreadable:
                        cache.tags[tag] = _TagData(version, None, [unreadable[tag]])
                        continue
                    problems: list[str] = []
                    steps, values = _decode(data.get(tag, []))
                    series = analysis.make_series(tag, info, steps, values, problems)
                    cache.tags[tag] = _TagData(version, series, problems)
            if changed:
                cache.analyses.clear()
        return cache

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

    def _analysis(
        self, ctx, experiment: str, run: str, sr: analysis.SafeRange, listing: Mapping | None = None
    ) -> analysis.RunAnalysis:
        """The run's analysis under ``sr``, recomputed only when the run grew."""
        if listing is None:
            listing = self._listing(ctx, experiment, [run]).get(run)
            if not listing:
                raise _not_found("no numerics data for run %r" % run)
        cache = self._refresh(ctx, experiment, run, listing)
        with cache.lock:
            hit = cache.analyses.get(sr)
            if hit is not None:
                cache.analyses.move_to_end(sr)
                return hit
            problems = [p for t in cache.tags.values() for p in t.problems]
            if self._sample_limit:
                problems.append(
                    "TensorBoard keeps only %d records per tensor (--samples_per_plugin "
                    "numerics=%d): the first anomaly may be missing; restart TensorBoard "
                    "without that setting to keep every record" % (self._sample_limit, self._sample_limit)
                )
            series = [t.series for t in cache.tags.values() if t.series is not None]
            ra = analysis.analyze_run(run, series, sr, problems)
            cache.analyses[sr] = ra
            cache.analyses.move_to_end(sr)
            while len(cache.analyses) > _ANALYSES_PER_RUN:
                cache.analyses.popitem(last=False)
            return ra

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
        with self._caches_lock:  # forget runs that left the logdir
            for key in [k for k in self._caches if k[0] == experiment and k[1] not in listing]:
                del self._caches[key]
        runs = []
        for run in sorted(listing):
            if not listing[run]:
                continue
            s = analysis.run_summary(self._analysis(ctx, experiment, run, sr, listing[run]))
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
                }
            )
        return {"runs": runs}

    def summary_impl(self, ctx, experiment: str, run: str, sr: analysis.SafeRange) -> dict[str, Any]:
        """The run's first anomaly and first warning (as ``report --json``)."""
        summary = analysis.run_summary(self._analysis(ctx, experiment, run, sr))
        summary["safe_range"] = analysis.safe_range_to_json(sr)
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
        out = analysis.timeline(self._analysis(ctx, experiment, run, sr), width, start, end)
        out["legend"] = {str(c): analysis.health_name(c) for c in (-1, 0, 1, 2)}
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
        ra = self._analysis(ctx, experiment, run, sr)
        h = ra.find(tag)
        if h is None:
            raise _not_found("no numerics data for tensor %r in run %r" % (tag, run))
        st = h.series.steps
        lo = 0 if start is None else int(np.searchsorted(st, start, side="left"))
        hi = len(st) if end is None else int(np.searchsorted(st, end, side="right"))
        return {
            "run": run,
            "tensor": tag,
            "info": h.series.info.to_json(),
            **_series_points(st[lo:hi], h.series.values[lo:hi], h.codes[lo:hi], h.kinds[lo:hi], max_points),
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
    """The folder of the installed ``tb_numerics.frontend`` package."""
    try:
        from tb_numerics import frontend

        return os.path.realpath(list(frontend.__path__)[0])
    except Exception:  # noqa: BLE001 - no frontend: the routes still work
        logger.warning("numerics: the frontend package is missing", exc_info=True)
        return None


def _batches(to_read: Mapping[str, Any], listing: Mapping[str, Any]) -> list[list[str]]:
    """Tags grouped so that each read stays well under gRPC's message cap.

    A tag's size is estimated from its last step (records are usually one per
    step from 0).
    """
    batches: list[list[str]] = []
    size = 0
    for tag in to_read:
        est = max(1, int(listing[tag].max_step) + 1)
        if batches and size + est <= _RECORDS_PER_READ:
            batches[-1].append(tag)
            size += est
        else:
            batches.append([tag])
            size = est
    return batches


def _series_points(
    steps: np.ndarray, values: np.ndarray, codes: np.ndarray, kinds: np.ndarray, max_points: int
) -> dict[str, Any]:
    """Chart points of records, bucketed by equal counts beyond ``max_points``."""
    n = len(steps)
    d = analysis.derived(values) if n else {k: np.zeros(0) for k in ("mean", "std", "max_abs", "l2")}
    col = {name: values[:, i] if n else np.zeros(0) for i, name in enumerate(metadata.FIELDS)}
    counts = ("count", "nan", "posinf", "neginf", "zeros", "overflow", "underflow")
    downsampled = n > max_points
    if not downsampled:
        fields = {
            "min": _float_list(col["min"]),
            "max": _float_list(col["max"]),
            "max_abs": _float_list(d["max_abs"]),
            "mean": _float_list(d["mean"]),
            "std": _float_list(d["std"]),
            "l2": _float_list(d["l2"]),
            **{k: _count_list(col[k]) for k in counts},
        }
        return {
            "steps": steps.tolist(),
            "step_end": steps.tolist(),
            "fields": fields,
            "health": codes.astype(int).tolist(),
            "kinds": [analysis.WARNING_KINDS[k - 1] if k else None for k in kinds.tolist()],
            "downsampled": False,
        }
    bounds = np.unique((np.arange(max_points, dtype=np.int64) * n) // max_points)
    ends = np.r_[bounds[1:], n]

    def nanmean(x: np.ndarray) -> np.ndarray:
        ok = np.isfinite(x)
        total = np.add.reduceat(np.where(ok, x, 0.0), bounds)
        num = np.add.reduceat(ok.astype(np.int64), bounds)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(num > 0, total / np.maximum(num, 1), np.nan)

    fields = {
        "min": _float_list(np.fmin.reduceat(col["min"], bounds)),
        "max": _float_list(np.fmax.reduceat(col["max"], bounds)),
        "max_abs": _float_list(np.fmax.reduceat(d["max_abs"], bounds)),
        "mean": _float_list(nanmean(d["mean"])),
        "std": _float_list(nanmean(d["std"])),
        "l2": _float_list(nanmean(d["l2"])),
        **{k: _count_list(np.add.reduceat(col[k], bounds)) for k in counts},
    }
    # The first warning kind in each bucket names the bucket's warning.
    warned = np.flatnonzero(kinds > 0)
    first = np.searchsorted(warned, bounds)
    bucket_kinds = []
    for b, f in enumerate(first.tolist()):
        if f < len(warned) and warned[f] < ends[b]:
            bucket_kinds.append(analysis.WARNING_KINDS[int(kinds[warned[f]]) - 1])
        else:
            bucket_kinds.append(None)
    return {
        "steps": steps[bounds].tolist(),
        "step_end": steps[ends - 1].tolist(),
        "fields": fields,
        "health": np.maximum.reduceat(codes, bounds).astype(int).tolist(),
        "kinds": bucket_kinds,
        "downsampled": True,
    }


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
