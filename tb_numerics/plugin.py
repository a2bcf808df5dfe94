"""The Numerics dashboard's backend: HTTP routes over TensorBoard's data.

The routes, their parameters, JSON, the frontend's files and the loader.
Records are read, cached and kept current by ``run_store.RunStore``: for a
local logdir, from its event files (``file_provider``: TensorBoard then
keeps only a sample of them, so that a long run does not cost its memory
twice); otherwise through ``context.data_provider`` (so the Rust data
server, ``--load_fast=true``, and the Python loader alike), or through the
logdir's own files once that provider stops answering
(``logdir_provider``); every health decision is
``tb_numerics.analysis``'s, so the dashboard, the HTTP API and
``tb-numerics report`` agree. Routes are documented in ``http_api.md``.

Import-light on purpose: TensorBoard imports this module at start-up and
does not guard the import, so it imports no TensorFlow and nothing that can
fail on a healthy TensorBoard install.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from typing import Any, Callable, Mapping

from werkzeug import wrappers

from tensorboard import context as tb_context
from tensorboard import errors, plugin_util
from tensorboard.backend import http_util
from tensorboard.data import provider
from tensorboard.plugins import base_plugin

from tb_numerics import (analysis, compact, compare, event_reader, file_provider, loader_guard, logdir_provider,
                         metadata, rules, run_store, survive)

__all__ = ["NumericsLoader", "NumericsPlugin", "frontend_dir"]

logger = logging.getLogger(__name__)

MAX_WIDTH = 10000
DEFAULT_WIDTH = 1000
MAX_POINTS = 100000
DEFAULT_MAX_POINTS = 2000
# Steps are int64 in event files.
_MAX_STEP = 2**63 - 1

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


def _respond_json(request: wrappers.Request, body: Any, code: int = 200) -> wrappers.Response:
    # rules.dumps: NaN and +-Inf as TensorBoard's own encoder writes them.
    return http_util.Respond(request, rules.dumps(body).encode("utf-8"), "application/json", code=code)


# ------------------------------------------------------------------ params


def _int_param(
    args: Mapping[str, str], name: str, default: int | None, lo: int, hi: int
) -> int | None:
    """A whole-number query parameter in [lo, hi], or ``default`` if absent."""
    raw = args.get(name)
    if raw is None or raw == "":
        return default
    raw = raw.strip()
    if not re.fullmatch(r"[+-]?[0-9]{1,20}", raw):  # decimal digits only (\d takes any script's)
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
        except run_store.RunNotFound as e:
            return _respond_json(request, {"error": str(e)}, 404)
        except logdir_provider.DataServerUnavailable as e:
            return _respond_json(request, {"error": str(e)}, 503)
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

    def __init__(self, context: base_plugin.TBContext, *, frontend: str | None = None):
        """Builds the plugin and its run store, whose refresher starts reading at once.

        Args:
          context: TensorBoard's; only its data provider, flags and sampling hints are used.
          frontend: the folder of the dashboard's files (default: ``frontend_dir()``).
        """
        reload_interval = getattr(context.flags, "reload_interval", 5.0)
        # Asked whether the tab is active: TensorBoard's own index, which it loads itself.
        self._tensorboard = context.data_provider
        logdir = local_logdir(context.flags) if context.data_provider is not None else None
        if logdir is not None:
            # The records come from the files: none is lost to TensorBoard's
            # sampling, and none depends on its data server staying up.
            self._data_provider: Any = file_provider.FileProvider(logdir)
            sample_limit = None
        else:
            self._data_provider = _failover(context)
            # Set by the user despite NumericsLoader.fix_flags: records may be lost.
            sample_limit = (context.sampling_hints or {}).get(self.plugin_name)
        # Started now so that runs are read by the time the tab is opened.
        self._store = run_store.RunStore(
            self._data_provider,
            reload_interval=reload_interval,
            sample_limit=sample_limit,
            run_problems=self._data_provider.problems if self._data_provider is not None else None,
        )
        self._frontend_dir = frontend if frontend is not None else frontend_dir()

    # ---------------------------------------------------------- TBPlugin

    def get_plugin_apps(self) -> dict[str, Callable]:
        return {
            "/index.js": self._serve_static,
            "/safe_range": self._serve_safe_range,
            "/rules": self._serve_rules,
            "/runs": self._serve_runs,
            "/summary": self._serve_summary,
            "/timeline": self._serve_timeline,
            "/series": self._serve_series,
            "/compare": self._serve_compare,
            # Everything else under the plugin: the frontend's other files.
            "/*": self._serve_static,
        }

    def is_active(self) -> bool:
        """Whether any run holds numerics records: TensorBoard's index says
        so at once (TensorBoard asks before its first page shows; indexing a
        long run's files would hold every tab back), else, for a local
        logdir, the plugin's index of its files as it stands."""
        if self._data_provider is None:
            return False
        ctx = tb_context.RequestContext()
        try:
            if self.plugin_name in (self._tensorboard.list_plugins(ctx, experiment_id="") or ()):
                return True
        except Exception:  # noqa: BLE001 - an inactive tab beats a broken listing
            logger.warning("numerics: is_active could not list plugins", exc_info=True)
        if isinstance(self._data_provider, file_provider.FileProvider):
            return self.plugin_name in self._data_provider.list_plugins(ctx, experiment_id="", index=False)
        return False

    def frontend_metadata(self) -> base_plugin.FrontendMetadata:
        return base_plugin.FrontendMetadata(es_module_path="/index.js", tab_name="Numerics")

    # ---------------------------------------------------------- impls

    def safe_range_impl(self) -> dict[str, Any]:
        """The safe-range parameters the routes accept, with defaults and help."""
        defaults = analysis.safe_range_to_json(analysis.SafeRange())
        return {
            "defaults": {name: defaults[name] for name in analysis.SAFE_RANGE_PARAMS},
            "params": {name: help_text for name, (_, help_text) in analysis.SAFE_RANGE_PARAMS.items()},
        }

    def rules_impl(self) -> dict[str, Any]:
        """What the dashboard shows of the rules: health codes, warning kinds, number format."""
        return rules.published()

    def runs_impl(self, ctx, experiment: str, safe_range: analysis.SafeRange) -> dict[str, Any]:
        """Every run with numerics records, or whose files could not be read
        (``RunStore.unread_problems``), and its headline health."""
        listing = self._store.listing(ctx, experiment)
        runs = []
        for run in sorted(listing):
            if not listing[run] and not self._store.unread_problems(run):
                continue
            answer = self._store.answer(ctx, experiment, run, safe_range, listing[run], first_look=True)
            summary = _summary(answer)
            runs.append(
                {
                    "run": run,
                    "tensors": summary["tensors"],
                    "records": summary["records"],
                    "first_step": summary["first_step"],
                    "last_step": summary["last_step"],
                    "first_anomaly_step": (summary["first_anomaly"] or {}).get("step"),
                    "first_warning_step": (summary["first_warning"] or {}).get("step"),
                    "problems": summary["problems"],
                    **answer.freshness(),
                }
            )
        return {"runs": runs}

    def summary_impl(self, ctx, experiment: str, run: str, safe_range: analysis.SafeRange) -> dict[str, Any]:
        """The run's first anomaly and first warning (as ``report --json``)."""
        answer = self._store.answer(ctx, experiment, run, safe_range, first_look=True)
        summary = _summary(answer)
        events = self._actions(ctx, experiment, run, summary["problems"])
        summary["actions"] = survive.summarize(events, summary["first_anomaly"])
        summary["safe_range"] = analysis.safe_range_to_json(safe_range)
        summary["restarts"] = answer.restarts
        summary.update(answer.freshness())
        return summary

    def _actions(self, ctx, experiment: str, run: str, problems: list[str]) -> list[dict]:
        """The run's action events (``survive``): a few records of a plugin of
        their own, read whole at each request; what cannot be read is said
        in ``problems``."""
        # TensorBoard's own provider where the plugin reads a local logdir's
        # files itself (``file_provider`` serves the numerics records only).
        source = self._tensorboard if isinstance(self._data_provider, file_provider.FileProvider) else (
            self._data_provider)
        if source is None:
            return []
        rtf = provider.RunTagFilter(runs=[run], tags=[metadata.ACTIONS_TAG])
        try:
            listed = source.list_tensors(
                ctx, experiment_id=experiment, plugin_name=metadata.ACTIONS_PLUGIN, run_tag_filter=rtf,
            ).get(run, {}).get(metadata.ACTIONS_TAG)
            if listed is None:
                return []
            data = source.read_tensors(
                ctx, experiment_id=experiment, plugin_name=metadata.ACTIONS_PLUGIN, downsample=_ALL_ACTIONS,
                run_tag_filter=rtf,
            ).get(run, {}).get(metadata.ACTIONS_TAG, [])
            # Decoded here too: an action of the log's that the reader fails
            # on must not fail the summary.
            events = [event_reader.action_of(listed.plugin_content, d.numpy, d.step, problems) for d in data]
        except Exception as e:  # noqa: BLE001 - any provider's error (a data server that died raises gRPC's)
            # The numerics records stay readable from the files: the summary
            # answers without the actions, and says why.
            problems.append("%s: the run's actions could not be read (%s: %s)" % (
                metadata.ACTIONS_TAG, type(e).__name__, e))
            return []
        return [e for e in events if e is not None]

    def timeline_impl(
        self, ctx, experiment: str, run: str, safe_range: analysis.SafeRange,
        width: int, start: int | None, end: int | None,
    ) -> dict[str, Any]:
        """Worst health per tensor and step bucket, rows in execution order."""
        answer = self._store.answer(ctx, experiment, run, safe_range)
        out = analysis.timeline(answer.analysis, width, start, end)
        out["legend"] = {str(h.code): h.name for h in rules.HEALTH}
        out.update(answer.freshness())
        return out

    def series_impl(
        self, ctx, experiment: str, run: str, tag: str, safe_range: analysis.SafeRange,
        start: int | None, end: int | None, max_points: int,
    ) -> dict[str, Any]:
        """One tensor's statistics over a step range, bucketed to ``max_points``."""
        answer = self._store.answer(ctx, experiment, run, safe_range)
        health = answer.analysis.find(tag)
        if health is None:
            raise _not_found("no numerics data for tensor %r in run %r" % (tag, run))
        return {
            "run": run,
            "tensor": tag,
            "info": health.series.info.to_json(),
            **analysis.series_points(health, max_points, start, end),
            **answer.freshness(),
        }

    def compare_impl(self, ctx, experiment: str, run: str, against: str, band: compare.Band) -> dict[str, Any]:
        """Where ``run`` first leaves ``against``'s band (``compare.compare_runs``)."""
        mine = self._store.answer(ctx, experiment, run, analysis.SafeRange())
        theirs = self._store.answer(ctx, experiment, against, analysis.SafeRange())
        for name, answer in ((run, mine), (against, theirs)):
            # The band reads every record's L2 norm and zeros, which a long
            # run holds in its files only: read back tensor by tensor, that
            # is every block once per tensor (hours for 500 tensors).
            if any(isinstance(h.series, compact.CompactSeries) for h in answer.analysis.health):
                raise _BadRequest(
                    "run %r is a long run (%d records), held compact: it is not compared record by "
                    "record here; tb-numerics report LOGDIR --against RUN compares it from its files"
                    % (name, sum(len(h.series.steps) for h in answer.analysis.health)))
        out = compare.compare_runs(
            [h.series for h in mine.analysis.health], [h.series for h in theirs.analysis.health], band
        )
        return {"run": run, "against": against, **out, **mine.freshness()}

    # ---------------------------------------------------------- routes

    @_route
    def _serve_safe_range(self, request: wrappers.Request) -> dict:
        return self.safe_range_impl()

    @_route
    def _serve_rules(self, request: wrappers.Request) -> dict:
        return self.rules_impl()

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
        safe_range = _safe_range(args)
        width = _int_param(args, "width", DEFAULT_WIDTH, 1, MAX_WIDTH)
        start, end = _step_range(args)
        return self.timeline_impl(*_ids(request), run, safe_range, width, start, end)

    @_route
    def _serve_series(self, request: wrappers.Request) -> dict:
        args = request.args
        run = _required(args, "run")
        tag = _required(args, "tensor")
        safe_range = _safe_range(args)
        start, end = _step_range(args)
        max_points = _int_param(args, "max_points", DEFAULT_MAX_POINTS, 1, MAX_POINTS)
        return self.series_impl(*_ids(request), run, tag, safe_range, start, end, max_points)

    @_route
    def _serve_compare(self, request: wrappers.Request) -> dict:
        args = request.args
        run, against = _required(args, "run"), _required(args, "against")
        try:
            band = compare.parse_band(args)
        except compare.BandError as e:
            raise _BadRequest(str(e)) from None
        return self.compare_impl(*_ids(request), run, against, band)

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


# Read whole: a run holds one action per step that acted, a handful.
_ALL_ACTIONS = 1 << 20


def _ids(request: wrappers.Request) -> tuple:
    """The request's TensorBoard context and experiment id."""
    return plugin_util.context(request.environ), plugin_util.experiment_id(request.environ)


def _failover(context: base_plugin.TBContext):
    """TensorBoard's data provider, wrapped so that the tab keeps answering
    from the event files where it stops (see ``logdir_provider``); None
    where there is none."""
    if context.data_provider is None:
        return None
    logdir = getattr(context, "logdir", None) or getattr(context.flags, "logdir", None) or None
    local = logdir if logdir and "://" not in logdir and os.path.isdir(logdir) else None
    return logdir_provider.FailoverProvider(context.data_provider, local)


def frontend_dir() -> str | None:
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


def local_logdir(flags: Any) -> str | None:
    """The logdir the plugin reads from its files: TensorBoard's one
    ``--logdir`` where it is a local path (not ``--logdir_spec``, not a
    remote filesystem); None otherwise."""
    logdir = getattr(flags, "logdir", None) or None
    if not logdir or getattr(flags, "logdir_spec", None) or "://" in logdir:
        return None
    return os.path.expanduser(logdir)


def _summary(answer: run_store.Answer) -> dict[str, Any]:
    """The run summary of an answer: a first look's where it is one."""
    return (analysis.first_look_summary if answer.preliminary else analysis.run_summary)(answer.analysis)


class NumericsLoader(base_plugin.TBLoader):
    """Loads the plugin and tells TensorBoard how many numerics records to keep.

    TensorBoard keeps only a sample of each tensor series (10 with the Python
    loader, 100 with the Rust data server) and may drop the first anomaly.
    ``fix_flags`` runs before the data ingester is built, so what it sets
    reaches both loaders. For a local logdir the plugin reads the records
    from the files (``file_provider``), and TensorBoard keeps the least it
    can (``numerics=1``, the latest record of each series: a long run's
    records are then held once, by the plugin, compactly); otherwise it
    keeps every one (``numerics=0``). A value the user set explicitly is
    respected. The training's action events (``survive``, a plugin of their
    own, a handful a run) are always kept whole (``numerics_actions=0``) and
    read through TensorBoard. It also installs ``loader_guard``, without
    which one damaged record header crashes TensorBoard's Python loader.
    """

    def fix_flags(self, flags: Any) -> None:
        # Before the loader reads a file: a damaged record header must not
        # crash TensorBoard's Python loader (see ``loader_guard``).
        loader_guard.install()
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
        spp.setdefault(metadata.PLUGIN_NAME, 1 if local_logdir(flags) is not None else 0)
        spp.setdefault(metadata.ACTIONS_PLUGIN, 0)  # the action events: a handful, each kept
        flags.samples_per_plugin = spp

    def load(self, context: base_plugin.TBContext) -> NumericsPlugin:
        return NumericsPlugin(context)
