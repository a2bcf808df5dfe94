"""The run store: every run's numerics records as TensorBoard holds them, read once and kept.

The plugin's routes (``plugin.py``) ask it for a run's analysis; it reads
through TensorBoard's data provider (so the Rust data server and the Python
loader alike), keeps each run's decoded records as an immutable snapshot
with its analyses per safe range, and keeps them current with a background
refresher. As TensorBoard's Debugger V2 keeps its routes in
``debugger_v2_plugin.py`` and its reading, caching and background thread in
``debug_data_multiplexer.py``.

Public surface:

- ``RunStore(data_provider, ...)``: ``listing`` (TensorBoard's index of
  numerics series), ``answer`` (a run's analysis and how current it is),
  ``refresh_round`` (one round of the refresher), ``snapshot`` and
  ``prefetched_tags`` (what is held for a run);
- ``Answer``, ``Snapshot``, ``Limits`` and ``RunNotFound``.

Why it works as it does: TensorBoard's data only changes on its reload, but
its provider has no "records after step N": a tag that grew is read again
whole, at 9-27 us a record. So a request reads a run itself only when that
is quick; otherwise it answers from the previous snapshot, marked stale, and
leaves the read to the refresher (see ``http_api.md``, "Freshness and cost").

Import-light like the plugin: no TensorFlow.
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import dataclasses
import enum
import logging
import threading
import time
import weakref
from typing import Any, Callable, Mapping

import numpy as np

from tensorboard import context as tb_context
from tensorboard.data import provider

from tb_numerics import analysis, metadata, packed, records

__all__ = ["Answer", "Limits", "RunNotFound", "RunStore", "Snapshot"]

logger = logging.getLogger(__name__)

# `read_tensors` must return every record, never a sample: ask for far more
# points than a series can hold (the providers return min(len, downsample)).
_READ_ALL = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class Limits:
    """The store's sizes and periods (the defaults are what TensorBoard gets)."""

    # A request reads a grown run itself when that means at most this many
    # records (about 0.1-0.5 s); beyond, it answers from the previous
    # records ("stale") and leaves the read to the refresher.
    inline_read_records: int = 20_000
    # The Rust data server answers over gRPC, whose messages are capped at
    # 256 MiB; a run's tags are read in batches of about this many records.
    records_per_read: int = 200_000
    # Analyses kept per run (one per distinct set of safe-range parameters).
    analyses_per_run: int = 8
    # A run whose background refresh failed is tried again after this long.
    retry_after_failure_s: float = 30.0
    # The refresher's period while TensorBoard is loading a run that changed.
    settling_period_s: float = 0.5


class RunNotFound(LookupError):
    """No numerics records for the run asked for; the message names it."""

    def __str__(self) -> str:  # LookupError would quote the message
        return str(self.args[0])


# ------------------------------------------------------------------ snapshots


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


class Snapshot:
    """A run's decoded records as of one listing, and analyses of them by safe range.

    Never changed once built (a refresh builds a new one and shares the tags
    that did not change), so requests use it without holding the run's lock.

    Attributes:
      series: every tensor's series.
      as_of_step: the last step actually read (TensorBoard may have loaded
        more between its listing and the read); None when nothing was.
      records: how many records the series hold.
    """

    def __init__(self, tags: dict[str, _TagData], limits: Limits):
        self.tags = tags
        overlaps: list[tuple[str, int, int]] = []
        restarts: list[tuple[str, int, int]] = []
        self.series = _merge(tags, overlaps, restarts)
        self._merge_problems = [packed.overlap_problem(overlaps)] if overlaps else []
        self.restarts = packed.restart_summary(restarts)
        self.as_of_step = max(
            [int(s.steps[-1]) for s in self.series if s.steps.size]
            + [int(t.version[0]) for t in tags.values() if t.series is None and t.parts is None],
            default=None,
        )
        self.records = sum(len(s.steps) for s in self.series)
        self._limits = limits
        self._lock = threading.Lock()  # one analysis computed at a time
        self._analyses: collections.OrderedDict[tuple, analysis.RunAnalysis] = (
            collections.OrderedDict()
        )

    def matches(self, listing: Mapping[str, Any]) -> bool:
        """Whether these are the records TensorBoard lists now."""
        return len(listing) == len(self.tags) and all(
            (t := self.tags.get(tag)) is not None and t.version == _version(ts) for tag, ts in listing.items()
        )

    def analysis(self, run: str, safe_range: analysis.SafeRange, extra_problems: list[str]) -> analysis.RunAnalysis:
        """The analysis under ``safe_range``, computed once and kept (the last few)."""
        with self._lock:
            # A problem that came later (the data server failed) is a new analysis.
            key = (safe_range, tuple(extra_problems))
            hit = self._analyses.get(key)
            if hit is not None:
                self._analyses.move_to_end(key)
                return hit
            problems = [p for t in self.tags.values() for p in t.problems] + self._merge_problems + extra_problems
            result = analysis.analyze_run(run, self.series, safe_range, problems)
            if self.records > self._limits.inline_read_records:
                _return_freed_memory()  # the analysis' float64 copies of float32 records
            self._analyses[key] = result
            while len(self._analyses) > self._limits.analyses_per_run:
                self._analyses.popitem(last=False)
            return result


def _merge(
    tags: Mapping[str, _TagData], overlaps: list[tuple[str, int, int]], restarts: list[tuple[str, int, int]]
) -> list[records.TensorSeries]:
    """Every tensor's series: its own tag's, and its parts in packed blocks.

    Blocks are taken oldest first (by their last write), so a step written
    twice keeps the later record. Where a tensor's parts do not overlap in
    steps (the usual case, whichever writers wrote them), each block's part
    (a view of the block's events, maybe float32) is replaced by a slice of
    the merged series: the snapshot then holds each record once, and
    the next refresh, which re-reads only the blocks that grew, still has them.
    Tensors that several writers wrote at once go to ``overlaps``, steps a
    later training wrote again to ``restarts`` (see ``packed.merge``).
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
        merged, offsets = packed.merge([part for _, part in placed], shared_steps, overlaps, restarts)
        if offsets is not None:
            for (tag, part), at in zip(placed, offsets):
                n = len(part.steps)
                steps = step_slices.setdefault((id(merged.steps), at, n), merged.steps[at : at + n])
                tags[tag].parts[name] = records.TensorSeries(
                    name, part.info, steps, merged.values[at : at + n], part.written
                )
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


# ------------------------------------------------------------------ reading


def _steps_held(tag: str, ts: Any) -> int:
    """The steps a tag may hold, estimated from its last step (records are
    usually one per step from 0; a packed block holds at most a block's, in
    a fiftieth as many events)."""
    n = max(1, int(ts.max_step) + 1)
    return min(n, packed.STEPS_PER_BLOCK) if packed.is_block_tag(tag) else n


def _read_cost(listing: Mapping[str, Any], *known: Mapping[str, _TagData]) -> int:
    """Steps to read for ``listing`` beyond the tags ``known`` as listed, a
    packed block's counted once: a rough measure of the read's cost."""
    return sum(
        _steps_held(tag, ts)
        for tag, ts in listing.items()
        if not any((t := k.get(tag)) is not None and t.version == _version(ts) for k in known)
    )


def _log_new_problems(run: str, prev: _TagData | None, problems: list[str]) -> None:
    """Logs a tag's problems to the server log once: those its previous read had not."""
    for p in problems:
        if prev is None or p not in prev.problems:
            logger.warning("numerics: run %r: %s", run, p)


# A tag to read: its listed version, parsed metadata, and its previous read.
_ToRead = tuple[tuple, "metadata.TensorInfo | metadata.BlockTable", "_TagData | None"]


class _ProviderReader:
    """Reads and decodes a run's tags through TensorBoard's data provider."""

    def __init__(self, data_provider: provider.DataProvider, records_per_read: int):
        self._provider = data_provider
        self._records_per_read = records_per_read

    def read(
        self, ctx, experiment: str, run: str, listing: Mapping[str, Any], known: list[Mapping[str, _TagData]]
    ) -> dict[str, _TagData]:
        """The records of ``listing``'s tags: those ``known`` as of the listed
        version are shared, the others read again (whole: the data provider
        has no "steps after N")."""
        tags, to_read = _unchanged_and_to_read(run, listing, known)
        # One read ahead: the data server prepares the next batch while this
        # thread decodes the last (a fifth less time on a long run).
        batches = self._batches(to_read, listing)
        with concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="numerics-read") as pool:
            reads = [pool.submit(self._read_tags, ctx, experiment, run, b) for b in batches[:2]]
            for i, batch in enumerate(batches):
                data, unreadable = reads[i].result()
                if i + 2 < len(batches):
                    reads.append(pool.submit(self._read_tags, ctx, experiment, run, batches[i + 2]))
                tags.update(_decode_tags(run, batch, data, unreadable, to_read))
        return tags

    def _batches(self, to_read: Mapping[str, _ToRead], listing: Mapping[str, Any]) -> list[list[str]]:
        """Tags grouped so that each read stays well under gRPC's message cap,
        counting a packed block's step as one record per tensor of its table."""
        batches: list[list[str]] = []
        size = 0
        for tag, (_, info, _) in to_read.items():
            estimate = _steps_held(tag, listing[tag]) * (1 if isinstance(info, metadata.TensorInfo) else len(info))
            if batches and size + estimate <= self._records_per_read:
                batches[-1].append(tag)
                size += estimate
            else:
                batches.append([tag])
                size = estimate
        return batches

    def _read_tags(self, ctx, experiment: str, run: str, tags: list[str]) -> tuple[dict, dict[str, str]]:
        """Every record of ``tags``, and a problem for each tag that cannot be read.

        TensorBoard's providers fail a whole read on one record they cannot
        decode (a tensor whose bytes do not fit its shape): read such a
        batch tag by tag so that only the damaged tag is lost.
        """
        try:
            return self._read(ctx, experiment, run, tags), {}
        except (ValueError, TypeError):
            pass
        data, unreadable = {}, {}
        for tag in tags:
            try:
                data.update(self._read(ctx, experiment, run, [tag]))
            except (ValueError, TypeError) as e:
                unreadable[tag] = "%s: TensorBoard cannot decode its records (%s); the tensor was skipped" % (tag, e)
        return data, unreadable

    def _read(self, ctx, experiment: str, run: str, tags: list[str]) -> dict:
        return self._provider.read_tensors(
            ctx,
            experiment_id=experiment,
            plugin_name=metadata.PLUGIN_NAME,
            downsample=_READ_ALL,
            run_tag_filter=provider.RunTagFilter(runs=[run], tags=tags),
        ).get(run, {})


def _unchanged_and_to_read(
    run: str, listing: Mapping[str, Any], known: list[Mapping[str, _TagData]]
) -> tuple[dict[str, _TagData], dict[str, _ToRead]]:
    """The tags ``known`` as listed (or whose metadata cannot be read), and
    the others with what reading them needs."""
    tags: dict[str, _TagData] = {}
    to_read: dict[str, _ToRead] = {}
    for tag, ts in listing.items():
        version = _version(ts)
        seen = [k[tag] for k in known if tag in k]
        prev = next((t for t in seen if t.version == version), seen[0] if seen else None)
        if prev is not None and prev.version == version:
            tags[tag] = prev
            continue
        try:
            if not ts.plugin_content:
                # The tag's first event (its full metadata) was lost: TensorBoard
                # read a later one, which names only the plugin.
                info = metadata.info_from_tag(tag)
                _log_new_problems(run, prev, ["%s: its metadata was lost with its first record; read as a %s "
                                              "(inferred from the tag name)" % (tag, info.role)])
            else:
                info = metadata.parse_content(ts.plugin_content, ts.description or "")
        except metadata.FormatError as e:
            tags[tag] = _TagData(version, None, ["%s: %s" % (tag, e)])
            _log_new_problems(run, prev, tags[tag].problems)
            continue
        to_read[tag] = (version, info, prev)
    return tags, to_read


def _decode_tags(
    run: str, batch: list[str], data: dict, unreadable: Mapping[str, str], to_read: Mapping[str, _ToRead]
) -> dict[str, _TagData]:
    """The ``_TagData`` of each tag of a read ``batch``: a per-tensor tag's
    series, or a packed block's parts, with the problems found."""
    out: dict[str, _TagData] = {}
    for tag in batch:
        version, info, prev = to_read[tag]
        if tag in unreadable:
            out[tag] = _TagData(version, None, [unreadable[tag]])
            _log_new_problems(run, prev, out[tag].problems)
            continue
        problems: list[str] = []
        points = data.pop(tag, [])
        steps = np.fromiter((d.step for d in points), dtype=np.int64, count=len(points))
        walls = [d.wall_time for d in points]
        decoded = packed.decode_tag(tag, info, steps, [d.numpy for d in points], problems, walls)
        if isinstance(info, metadata.TensorInfo):
            out[tag] = _TagData(version, decoded[0], problems)
        else:
            out[tag] = _TagData(version, None, problems, {p.tag: p for p in decoded})
        _log_new_problems(run, prev, problems)
    return out


# ------------------------------------------------------------------ per-run state


class _RunCache:
    """A run's current snapshot and its refresh state, guarded by ``lock``.

    At most one refresh of a run is in flight: whoever claims it
    (``claim``, under the lock) reads, and ``release`` ends it, waking
    those who wait for it. The lock is only held to read or swap fields.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.snapshot: Snapshot | None = None
        self.refreshing: threading.Event | None = None
        self.next_background = 0.0  # clock time before which the refresher leaves it
        self.listed: tuple | None = None  # the run's listing at the refresher's last round
        # Packed blocks read while TensorBoard was still loading the run (see
        # ``RunStore._prefetch_blocks``), for the next refresh to take instead of reading.
        self.prefetched: dict[str, _TagData] = {}
        # Safe ranges asked for lately, most recent last: computed after a refresh.
        self.recent: collections.OrderedDict[analysis.SafeRange, None] = collections.OrderedDict()

    def known(self) -> list[Mapping[str, _TagData]]:
        """The tags held already (under the lock): the snapshot's and those prefetched."""
        return [self.snapshot.tags if self.snapshot is not None else {}, self.prefetched]

    def claim(self) -> threading.Event:
        """Claims the run's refresh (under the lock, none in flight)."""
        self.refreshing = threading.Event()
        return self.refreshing

    def release(self, done: threading.Event) -> None:
        """Ends the refresh claimed as ``done`` and wakes those waiting for it."""
        with self.lock:
            self.refreshing = None
        done.set()

    def remember(self, safe_range: analysis.SafeRange, keep: int) -> None:
        """Notes a safe range asked for, keeping the last ``keep``."""
        with self.lock:
            self.recent[safe_range] = None
            self.recent.move_to_end(safe_range)
            while len(self.recent) > keep:
                self.recent.popitem(last=False)


@dataclasses.dataclass(frozen=True)
class Answer:
    """A run's analysis and how current it is."""

    analysis: analysis.RunAnalysis
    stale: bool  # TensorBoard holds newer records; a refresh is under way
    as_of_step: int | None  # last step of the records analysed
    latest_step: int | None  # last step TensorBoard holds
    restarts: list = dataclasses.field(default_factory=list)  # steps a later training wrote again

    def freshness(self) -> dict[str, Any]:
        """The routes' freshness fields (see ``http_api.md``)."""
        return {"stale": self.stale, "as_of_step": self.as_of_step, "latest_step": self.latest_step}


class _Next(enum.Enum):
    """What a request does with a run's cache (see ``RunStore.answer``)."""

    USE = "the snapshot is current"
    READ = "this request reads the run (it claimed the refresh)"
    WAIT = "nothing read yet; the refresh under way reads it"
    STALE = "answer from the previous snapshot; the refresher catches up"


@dataclasses.dataclass(frozen=True)
class _BackgroundWork:
    """A refresh the refresher claimed: of the whole run, or (``blocks``) of
    the packed blocks of a run TensorBoard is still loading."""

    done: threading.Event  # the claim, released when the work ends
    known: list[Mapping[str, _TagData]]  # the tags held when claimed
    blocks: Mapping[str, Any] | None  # the blocks to read ahead; None: refresh the run
    recent: list[analysis.SafeRange]  # the safe range asked for last, analysed after a refresh


# ------------------------------------------------------------------ the store


class RunStore:
    """Every run's records and analyses, read through TensorBoard's data provider.

    Args:
      data_provider: TensorBoard's ``context.data_provider``; None: no run.
      reload_interval: TensorBoard's ``--reload_interval`` in seconds: the
        listing is re-asked at most every min(1, half of it) s, and the
        refresher looks for changed runs once per interval (at least 1 s).
      sample_limit: records TensorBoard keeps per tensor, where the user
        limited it (``--samples_per_plugin``): every run then says records
        may be missing.
      limits: the store's sizes and periods.
      clock: monotonic seconds (injectable for tests).
      background: start the refresher's thread, which calls
        ``refresh_round`` every ``reload_interval`` (every
        ``limits.settling_period_s`` while a run is loading). False: the
        caller runs the rounds (tests, tools).
      run_problems: what a run's answers must also say about where its
        records came from (``logdir_provider.FailoverProvider.problems``).
    """

    def __init__(
        self,
        data_provider: provider.DataProvider | None,
        *,
        reload_interval: float = 5.0,
        sample_limit: int | None = None,
        limits: Limits = Limits(),
        clock: Callable[[], float] = time.monotonic,
        background: bool = True,
        run_problems: Callable[[str], list[str]] | None = None,
    ):
        self._provider = data_provider
        self._reader = _ProviderReader(data_provider, limits.records_per_read)
        self._sample_limit = sample_limit or None
        self._run_problems = run_problems
        self._limits = limits
        self._clock = clock
        reload_interval = max(0.0, float(reload_interval or 0))
        # Half TensorBoard's reload interval, at most 1 s (0: always re-list).
        self._listing_ttl = min(1.0, reload_interval / 2)
        # The refresher looks for new records once per reload, at most once a second.
        self._reload_interval = max(1.0, reload_interval)
        self._lock = threading.Lock()  # guards _caches, _listings, _listing_seconds
        self._caches: dict[tuple[str, str], _RunCache] = {}
        self._listings: dict[tuple, tuple[float, dict]] = {}
        self._listing_seconds = 0.0  # how long listing every run took last time
        # A run changed between the refresher's last two rounds. TensorBoard
        # has just started and is loading every run: look often from the start.
        self._settling = True
        self._asked = _AskedRuns()
        if background and data_provider is not None:
            _RefresherThread(self, self._asked.wake).start()

    # ---------------------------------------------------------- public

    def listing(self, ctx, experiment: str, runs: list[str] | None = None) -> dict:
        """TensorBoard's index of numerics series, ``{run: {tag: TensorTimeSeries}}``.

        Re-asked at most every min(1 s, reload interval / 2): listing is not
        free (the Rust data server scans every record for the last step:
        0.7 s for 5M records), and TensorBoard's data only changes on its
        reload, so the routes a dashboard fires together share one. A new
        listing drops those asked before it: once a caller has seen
        records, no later one answers from an older view without them.
        Listing every run (``runs`` None) also forgets the runs that left.
        """
        if self._provider is None:
            return {}
        key = (experiment, None if runs is None else tuple(runs))
        now = self._clock()
        with self._lock:
            hit = self._listings.get(key)
        listing = hit[1] if hit is not None and now - hit[0] < self._listing_ttl else self._list(ctx, key, now)
        if runs is None:
            self._forget_missing(experiment, listing)
        return listing

    def answer(
        self, ctx, experiment: str, run: str, safe_range: analysis.SafeRange, listing: Mapping | None = None
    ) -> Answer:
        """The run's analysis under ``safe_range``: current, or the previous one while a long refresh runs.

        - The snapshot matches TensorBoard's listing: its (cached) analysis.
        - It is out of date and refreshing would be quick, or there is none
          yet: this call reads (or waits for the refresh under way).
        - It is out of date and a refresh is under way or would be long: the
          previous analysis at once, marked stale; the refresher catches up.

        Args:
          ctx, experiment: the request's TensorBoard context and experiment.
          run: the run's name.
          safe_range: what counts as a warning.
          listing: the run's entry of ``listing`` where the caller has it.

        Raises:
          RunNotFound: TensorBoard lists no numerics records for ``run``.
        """
        if listing is None:
            listing = self.listing(ctx, experiment, [run]).get(run)
            if not listing:
                raise RunNotFound("no numerics data for run %r" % run)
        latest = max(int(ts.max_step) for ts in listing.values())
        cache = self._cache(experiment, run)
        cache.remember(safe_range, self._limits.analyses_per_run)
        snapshot, fresh = self._snapshot_to_answer_from(ctx, experiment, run, cache, listing)
        result = snapshot.analysis(run, safe_range, self._extra_problems(run))
        return Answer(result, not fresh, snapshot.as_of_step, latest, snapshot.restarts)

    def refresh_round(self) -> None:
        """One round of the refresher: the runs that ``answer`` left stale,
        then every run of TensorBoard's experiment whose records changed."""
        for (experiment, run), ctx in self._asked.take().items():
            listing = self.listing(ctx, experiment, [run]).get(run)
            if listing:
                self._refresh_in_background(ctx, experiment, run, listing, asked=True)
        ctx = tb_context.RequestContext()
        listing = self.listing(ctx, "", None)
        self._settling = False
        for run, tags in sorted(listing.items()):
            if tags:
                self._refresh_in_background(ctx, "", run, tags, asked=False)

    def snapshot(self, experiment: str, run: str) -> Snapshot | None:
        """The records held for ``run`` now; None before its first read."""
        cache = self._cache(experiment, run)
        with cache.lock:
            return cache.snapshot

    def prefetched_tags(self, experiment: str, run: str) -> list[str]:
        """The packed blocks read while TensorBoard was loading ``run``, for its next refresh."""
        cache = self._cache(experiment, run)
        with cache.lock:
            return sorted(cache.prefetched)

    # ---------------------------------------------------------- listing and caches

    def _list(self, ctx, key: tuple, now: float) -> dict:
        experiment, runs = key
        listing = self._provider.list_tensors(
            ctx,
            experiment_id=experiment,
            plugin_name=metadata.PLUGIN_NAME,
            run_tag_filter=provider.RunTagFilter(runs=None if runs is None else list(runs)),
        )
        with self._lock:
            if runs is None:
                self._listing_seconds = self._clock() - now
            self._listings = {k: v for k, v in self._listings.items() if v[0] >= now}
            self._listings[key] = (now, listing)
        return listing

    def _cache(self, experiment: str, run: str) -> _RunCache:
        with self._lock:
            return self._caches.setdefault((experiment, run), _RunCache())

    def _forget_missing(self, experiment: str, listing: Mapping[str, Any]) -> None:
        """Drops the caches of runs that left the logdir."""
        with self._lock:
            for key in [k for k in self._caches if k[0] == experiment and k[1] not in listing]:
                del self._caches[key]

    def _refresh_period(self) -> float:
        """Seconds between the refresher's rounds: TensorBoard's reload
        interval (at most ``settling_period_s`` while a run is loading, to
        read its blocks as they come), and at least 4x the cost of listing
        (so that watching a huge logdir takes at most a fifth of a core)."""
        period = self._reload_interval
        if self._settling:
            period = min(period, self._limits.settling_period_s)
        return max(period, 4 * self._listing_seconds)

    def _extra_problems(self, run: str) -> list[str]:
        out = self._run_problems(run) if self._run_problems is not None else []
        if not self._sample_limit:
            return out
        return out + [
            "TensorBoard keeps only %d records per tensor (--samples_per_plugin "
            "numerics=%d): the first anomaly may be missing; restart TensorBoard "
            "without that setting to keep every record" % (self._sample_limit, self._sample_limit)
        ]

    # ---------------------------------------------------------- requests

    def _snapshot_to_answer_from(
        self, ctx, experiment: str, run: str, cache: _RunCache, listing: Mapping[str, Any]
    ) -> tuple[Snapshot, bool]:
        """The snapshot ``answer`` uses and whether it is current (see there)."""
        while True:
            step, snapshot, refresh = self._next_step(cache, listing)
            if step is _Next.USE:
                return snapshot, True
            if step is _Next.READ:
                return self._refresh(ctx, experiment, run, cache, listing, refresh), True
            if step is _Next.STALE:
                if refresh is None:  # none under way: too long to read here
                    self._asked.add(ctx, experiment, run)
                return snapshot, False
            refresh.wait()  # _Next.WAIT, then look again

    def _next_step(
        self, cache: _RunCache, listing: Mapping[str, Any]
    ) -> tuple[_Next, Snapshot | None, threading.Event | None]:
        """What a request does now, with the snapshot and the refresh
        (claimed by it for READ, else the one under way, if any)."""
        with cache.lock:
            snapshot, in_flight = cache.snapshot, cache.refreshing
            if snapshot is not None and snapshot.matches(listing):
                return _Next.USE, snapshot, None
            if in_flight is None and (
                snapshot is None or _read_cost(listing, *cache.known()) <= self._limits.inline_read_records
            ):
                return _Next.READ, snapshot, cache.claim()
            if snapshot is None:
                return _Next.WAIT, None, in_flight
            return _Next.STALE, snapshot, in_flight

    def _refresh(
        self, ctx, experiment: str, run: str, cache: _RunCache, listing: Mapping[str, Any],
        done: threading.Event,
    ) -> Snapshot:
        """Reads what changed since the run's snapshot and makes it the new one.

        The caller has claimed the refresh as ``done``; it is released here
        whatever happens. A failure puts the refresher's next try off.
        """
        try:
            with cache.lock:
                known = cache.known()
            big = _read_cost(listing, *known) > self._limits.inline_read_records
            snapshot = Snapshot(self._reader.read(ctx, experiment, run, listing, known), self._limits)
            if big:
                _return_freed_memory()
            with cache.lock:
                cache.snapshot = snapshot
                cache.prefetched = {}
                cache.next_background = self._clock() + self._reload_interval
            return snapshot
        except Exception:
            with cache.lock:
                cache.next_background = self._clock() + self._limits.retry_after_failure_s
            raise
        finally:
            cache.release(done)

    # ---------------------------------------------------------- background

    def _refresh_in_background(
        self, ctx, experiment: str, run: str, listing: Mapping[str, Any], asked: bool
    ) -> None:
        """Refreshes a run that changed, then computes the analyses asked for
        lately so that the next request is instant; or reads ahead the packed
        blocks of a big run still loading. A failure is logged and retried later."""
        cache = self._cache(experiment, run)
        work = self._claim_background_work(cache, listing, asked)
        if work is None:
            return
        if work.blocks is not None:
            self._prefetch_blocks(ctx, experiment, run, cache, work)
            return
        try:
            snapshot = self._refresh(ctx, experiment, run, cache, listing, work.done)
            for safe_range in dict.fromkeys([analysis.SafeRange(), *work.recent]):
                snapshot.analysis(run, safe_range, self._extra_problems(run))
        except Exception:  # noqa: BLE001 - one bad run must not stop the others
            logger.exception("numerics: background refresh of run %r failed", run)

    def _claim_background_work(
        self, cache: _RunCache, listing: Mapping[str, Any], asked: bool
    ) -> _BackgroundWork | None:
        """Claims the refresh the refresher should do for a run now; None:
        nothing (current, a refresh under way, or, unless a request asked,
        refreshed less than a reload ago)."""
        with cache.lock:
            changed = not asked and self._note_listing(cache, listing)
            snapshot = cache.snapshot
            if cache.refreshing is not None or (snapshot is not None and snapshot.matches(listing)):
                return None
            if not asked and self._clock() < cache.next_background:
                return None
            known = cache.known()
            blocks = None
            if changed and _read_cost(listing, *known) > self._limits.inline_read_records:
                # A big run TensorBoard is still loading: read it once its
                # listing holds still for a round (or when a request asks),
                # not now and again in full when loading ends. Its packed
                # blocks, though, are read as they load (a block is read
                # again only while it grows), so that little is left to read
                # when loading ends.
                blocks = {tag: ts for tag, ts in listing.items() if packed.is_block_tag(tag)}
                if not blocks:
                    return None
            return _BackgroundWork(cache.claim(), known, blocks, list(cache.recent)[-1:])

    def _note_listing(self, cache: _RunCache, listing: Mapping[str, Any]) -> bool:
        """Whether a run's listing changed since the refresher's last round
        (TensorBoard is loading it): then the refresher looks again soon."""
        listed = tuple(sorted((tag, _version(ts)) for tag, ts in listing.items()))
        changed, cache.listed = listed != cache.listed, listed
        self._settling |= changed
        return changed

    def _prefetch_blocks(self, ctx, experiment: str, run: str, cache: _RunCache, work: _BackgroundWork) -> None:
        """Reads the packed blocks of a run being loaded into ``cache.prefetched``.

        The caller has claimed the refresh; it is released here.
        """
        try:
            got = self._reader.read(ctx, experiment, run, work.blocks, work.known)
            with cache.lock:
                cache.prefetched = got
            _return_freed_memory()
        except Exception:  # noqa: BLE001 - a later refresh reads them anyway
            logger.exception("numerics: reading run %r ahead of its loading failed", run)
        finally:
            cache.release(work.done)


class _AskedRuns:
    """Runs ``answer`` left stale, for the refresher's next round (at most once each)."""

    def __init__(self) -> None:
        self.wake = threading.Event()  # set when a run is asked for
        self._lock = threading.Lock()
        self._runs: dict[tuple[str, str], Any] = {}  # (experiment, run) -> request context

    def add(self, ctx, experiment: str, run: str) -> None:
        with self._lock:
            self._runs[(experiment, run)] = ctx
        self.wake.set()

    def take(self) -> dict[tuple[str, str], Any]:
        with self._lock:
            runs, self._runs = self._runs, {}
        return runs


class _RefresherThread(threading.Thread):
    """The store's refresher: one daemon thread running ``refresh_round``,
    every refresh period or sooner when a request asks.

    Holds only a weak reference to the store, so the thread ends when the
    store is gone (and, being a daemon, with the process).
    """

    def __init__(self, store: RunStore, wake: threading.Event):
        super().__init__(name="numerics-refresher", daemon=True)
        self._store = weakref.ref(store)
        self._wake = wake

    def run(self) -> None:
        while True:
            store = self._store()
            if store is None:
                return
            self._wake.clear()
            try:
                store.refresh_round()
            except Exception:  # noqa: BLE001 - the refresher must outlive any failure
                logger.exception("numerics: background refresh failed")
            period = store._refresh_period()
            del store
            self._wake.wait(period)
