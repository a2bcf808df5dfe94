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

The reads themselves and the snapshots they make are ``provider_reads``'s;
this module decides when to read, and keeps each run's state.

Why it works as it does: TensorBoard's data only changes on its reload, but
its provider has no "records after step N": a tag that grew is read again
whole, at 9-27 us a record. So a request reads a run itself only when that
is quick; otherwise it answers from the previous snapshot, marked stale, and
leaves the read to the refresher (see ``http_api.md``, "Freshness and cost").

Import-light like the plugin: no TensorFlow.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import threading
import time
import weakref
from typing import Any, Callable, Mapping

from tensorboard import context as tb_context
from tensorboard.data import provider

from tb_numerics import analysis, metadata, packed
from tb_numerics.provider_reads import (
    ProviderReader, Snapshot, TagData, listed_version, read_cost, records_listed, return_freed_memory,
)

__all__ = ["Answer", "Limits", "RunNotFound", "RunStore", "Snapshot"]

logger = logging.getLogger(__name__)


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
    # A run of more records than this is held compact (``compact``): what
    # the rules read of each record, the rest read back on demand.
    compact_above_records: int = 500_000
    # Analyses kept per compact run (each holds 2 bytes a record).
    analyses_per_compact_run: int = 2
    # A run whose background refresh failed is tried again after this long.
    retry_after_failure_s: float = 30.0
    # The refresher's period while TensorBoard is loading a run that changed.
    settling_period_s: float = 0.5


class RunNotFound(LookupError):
    """No numerics records for the run asked for; the message names it."""

    def __str__(self) -> str:  # LookupError would quote the message
        return str(self.args[0])


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
        self.prefetched: dict[str, TagData] = {}
        # Safe ranges asked for lately, most recent last: computed after a refresh.
        self.recent: collections.OrderedDict[analysis.SafeRange, None] = collections.OrderedDict()
        # The first look at a long run not read yet (``RunStore._first_look``):
        # (the index's marks it was made of, its snapshot or None), made once
        # per marks, under ``look_lock`` (a second asker waits for the first).
        self.look_lock = threading.Lock()
        self.look: tuple[Any, tuple[Snapshot, int] | None] | None = None

    def known(self) -> list[Mapping[str, TagData]]:
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

    def next_step(
        self, listing: Mapping[str, Any], inline_records: int
    ) -> tuple[_Next, Snapshot | None, threading.Event | None]:
        """What a request does now (see ``RunStore.answer``), with the
        snapshot and the refresh (claimed by it for READ, else the one under
        way, if any); a read of at most ``inline_records`` is the request's own."""
        with self.lock:
            snapshot, in_flight = self.snapshot, self.refreshing
            if snapshot is not None and snapshot.matches(listing):
                return _Next.USE, snapshot, None
            if in_flight is None and (snapshot is None or read_cost(listing, *self.known()) <= inline_records):
                return _Next.READ, snapshot, self.claim()
            if snapshot is None:
                return _Next.WAIT, None, in_flight
            return _Next.STALE, snapshot, in_flight

    def claim_background(
        self, listing: Mapping[str, Any], asked: bool, now: float, inline_records: int
    ) -> tuple[_BackgroundWork | None, bool]:
        """The refresh the refresher should do for the run now, claimed (None:
        nothing: current, a refresh under way, or, unless a request asked,
        refreshed less than a reload ago), and whether the run's listing
        changed since the refresher's last round (TensorBoard is loading it)."""
        with self.lock:
            changed = False
            if not asked:
                listed = tuple(sorted((tag, listed_version(ts)) for tag, ts in listing.items()))
                changed, self.listed = listed != self.listed, listed
            if self.refreshing is not None or (self.snapshot is not None and self.snapshot.matches(listing)):
                return None, changed
            if not asked and now < self.next_background:
                return None, changed
            known = self.known()
            blocks = None
            if changed and read_cost(listing, *known) > inline_records:
                # A big run TensorBoard is still loading: read it once its
                # listing holds still for a round (or when a request asks),
                # not now and again in full when loading ends. Its packed
                # blocks, though, are read as they load (a block is read
                # again only while it grows), so that little is left to read
                # when loading ends.
                blocks = {tag: ts for tag, ts in listing.items() if packed.is_block_tag(tag)}
                if not blocks:
                    return None, changed
            return _BackgroundWork(self.claim(), known, blocks, list(self.recent)[-1:]), changed


@dataclasses.dataclass(frozen=True)
class Answer:
    """A run's analysis and how current it is."""

    analysis: analysis.RunAnalysis
    stale: bool  # TensorBoard holds newer records; a refresh is under way
    as_of_step: int | None  # last step of the records analysed
    latest_step: int | None  # last step TensorBoard holds
    restarts: list = dataclasses.field(default_factory=list)  # steps a later training wrote again
    # A first look: the analysis of the few records that name the first
    # anomaly of a long run not yet read whole; nothing else in it stands.
    preliminary: bool = False

    def freshness(self) -> dict[str, Any]:
        """The routes' freshness fields (see ``http_api.md``)."""
        return {"stale": self.stale, "preliminary": self.preliminary, "as_of_step": self.as_of_step,
                "latest_step": self.latest_step}


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
    known: list[Mapping[str, TagData]]  # the tags held when claimed
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
        self._reader = ProviderReader(data_provider, limits.records_per_read, limits.compact_above_records)
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
        self, ctx, experiment: str, run: str, safe_range: analysis.SafeRange, listing: Mapping | None = None,
        first_look: bool = False,
    ) -> Answer:
        """The run's analysis under ``safe_range``: current, or the previous one while a long refresh runs.

        - The snapshot matches TensorBoard's listing: its (cached) analysis.
        - It is out of date and refreshing would be quick, or there is none
          yet: this call reads (or waits for the refresh under way).
        - It is out of date and a refresh is under way or would be long: the
          previous analysis at once, marked stale; the refresher catches up.
        - With ``first_look``, a long run (more than
          ``limits.compact_above_records`` records) of which nothing is read
          yet and whose files hold a NaN or an infinity: at once, the
          analysis of the few records that name its first anomaly, marked
          stale and preliminary (``_first_look``); the refresher reads the run.

        Args:
          ctx, experiment: the request's TensorBoard context and experiment.
          run: the run's name.
          safe_range: what counts as a warning.
          listing: the run's entry of ``listing`` where the caller has it.
          first_look: whether a preliminary answer will do (the routes of
            the first screen: the runs and their first anomaly).

        Raises:
          RunNotFound: TensorBoard lists no numerics records for ``run``.
        """
        if listing is None:
            listing = self.listing(ctx, experiment, [run]).get(run)
        if not listing:
            unread = self.unread_problems(run) if listing is not None else []
            if not unread:
                raise RunNotFound("no numerics data for run %r" % run)
            return Answer(analysis.analyze_run(run, (), safe_range, unread), False, None, None)
        latest = max(int(ts.max_step) for ts in listing.values())
        cache = self._cache(experiment, run)
        cache.remember(safe_range, self._limits.analyses_per_run)
        look = self._first_look(ctx, experiment, run, cache, listing) if first_look else None
        if look is not None:
            snapshot, step = look
            result = snapshot.analysis(run, safe_range, self._extra_problems(run))
            # Its first anomaly under this safe range, where it falls at the
            # step the index named; not an op's (the first anomaly is the first
            # layer's where one went bad, at any later step).
            first = analysis.run_summary(result)["first_anomaly"]
            if first is not None and first["step"] == step and not analysis.is_op_level(first["tensor"]):
                return Answer(result, True, None, latest, preliminary=True)
        snapshot, fresh = self._snapshot_to_answer_from(ctx, experiment, run, cache, listing)
        result = snapshot.analysis(run, safe_range, self._extra_problems(run))
        return Answer(result, not fresh, snapshot.as_of_step, latest, snapshot.restarts)

    def unread_problems(self, run: str) -> list[str]:
        """What kept ``run``'s files from being read, for a run of no numerics
        records: one whose only file is cut in its first record is listed
        with them, as ``tb-numerics report`` lists it, not left out."""
        return self._run_problems(run) if self._run_problems is not None else []

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
        out = self.unread_problems(run)
        if not self._sample_limit:
            return out
        return out + [
            "TensorBoard keeps only %d records per tensor (--samples_per_plugin "
            "numerics=%d): the first anomaly may be missing; restart TensorBoard "
            "without that setting to keep every record" % (self._sample_limit, self._sample_limit)
        ]

    # ---------------------------------------------------------- first look

    def _first_look(
        self, ctx, experiment: str, run: str, cache: _RunCache, listing: Mapping[str, Any]
    ) -> tuple[Snapshot, int] | None:
        """The records that name the first anomaly of a long run not read yet,
        and the step it must be at (``ProviderReader.first_look``); None
        where the run is read already, or short, or its files hold no NaN
        or infinity: the caller then waits for the whole read.

        A request that finds no read under way hands the run to the
        refresher, so the whole read starts at once whoever asked first.
        """
        with cache.lock:
            if cache.snapshot is not None:
                return None
            reading = cache.refreshing is not None
        marks = self._reader.nonfinite_marks(run)
        if not marks or records_listed(listing) <= self._limits.compact_above_records:
            return None
        if not reading:
            self._asked.add(ctx, experiment, run)
        with cache.look_lock:
            if cache.look is not None and cache.look[0] == marks:
                return cache.look[1]
            look = None
            try:
                found = self._reader.first_look(ctx, experiment, run, listing, marks)
                if found is not None:
                    look = Snapshot(found[0], self._limits), found[1]
            except Exception:  # noqa: BLE001 - the whole read answers anyway
                logger.exception("numerics: the first look at run %r failed", run)
            cache.look = (marks, look)
            return look

    # ---------------------------------------------------------- requests

    def _snapshot_to_answer_from(
        self, ctx, experiment: str, run: str, cache: _RunCache, listing: Mapping[str, Any]
    ) -> tuple[Snapshot, bool]:
        """The snapshot ``answer`` uses and whether it is current (see there)."""
        while True:
            step, snapshot, refresh = cache.next_step(listing, self._limits.inline_read_records)
            if step is _Next.USE:
                return snapshot, True
            if step is _Next.READ:
                return self._refresh(ctx, experiment, run, cache, listing, refresh), True
            if step is _Next.STALE:
                if refresh is None:  # none under way: too long to read here
                    self._asked.add(ctx, experiment, run)
                return snapshot, False
            refresh.wait()  # _Next.WAIT, then look again

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
            big = read_cost(listing, *known) > self._limits.inline_read_records
            snapshot = Snapshot(self._reader.read(ctx, experiment, run, listing, known), self._limits)
            if big:
                return_freed_memory()
            with cache.lock:
                cache.snapshot = snapshot
                cache.prefetched = {}
                cache.look = None
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
        work, changed = cache.claim_background(listing, asked, self._clock(), self._limits.inline_read_records)
        # A run TensorBoard is loading: the refresher looks again soon.
        self._settling |= changed
        if work is None:
            return
        if work.blocks is not None:
            self._prefetch_blocks(ctx, experiment, run, cache, work)
            return
        try:
            snapshot = self._refresh(ctx, experiment, run, cache, listing, work.done)
            for safe_range in dict.fromkeys([analysis.SafeRange(), *work.recent]):
                # The summary too: the first thing the tab asks for.
                analysis.run_summary(snapshot.analysis(run, safe_range, self._extra_problems(run)))
        except Exception:  # noqa: BLE001 - one bad run must not stop the others
            logger.exception("numerics: background refresh of run %r failed", run)

    def _prefetch_blocks(self, ctx, experiment: str, run: str, cache: _RunCache, work: _BackgroundWork) -> None:
        """Reads the packed blocks of a run being loaded into ``cache.prefetched``.

        The caller has claimed the refresh; it is released here.
        """
        try:
            got = self._reader.read(ctx, experiment, run, work.blocks, work.known)
            with cache.lock:
                cache.prefetched = got
            return_freed_memory()
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
