"""A run's records as TensorBoard's data provider holds them: read, decoded, kept as snapshots.

``ProviderReader`` reads a run's numerics tags through
``context.data_provider`` (the Rust data server and the Python loader
alike), in batches under gRPC's message cap with one read ahead, sharing
the tags that did not change since the last read; ``Snapshot`` holds the
decoded records of one listing, immutable, with their analyses per safe
range. ``run_store.RunStore`` decides when to read and keeps the snapshots
current. Import-light: no TensorFlow.
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import dataclasses
import logging
import threading
from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np

from tensorboard import context as tb_context
from tensorboard.data import provider

from tb_numerics import analysis, compact, detectors, metadata, packed, records
from tb_numerics.run_analysis import is_op_level

if TYPE_CHECKING:
    from tb_numerics.run_store import Limits

__all__ = [
    "ProviderReader", "Snapshot", "TagData", "listed_version", "read_cost", "records_listed", "return_freed_memory",
]

logger = logging.getLogger("tb_numerics.run_store")

# `read_tensors` must return every record, never a sample: ask for far more
# points than a series can hold (the providers return min(len, downsample)).
_READ_ALL = 2**31 - 1


# ------------------------------------------------------------------ snapshots


@dataclasses.dataclass
class TagData:
    """One tag's records as last read, and the listing entry they match.

    A tensor's tag holds its ``series``; a packed block's holds ``parts``,
    the series of each tensor in the block (see ``_merge``). Neither: the
    tag cannot be read. A tensor's tag written by several trainings or
    writers keeps what merging them found (``packed.merge``): steps written
    by writers at once (``overlaps``), and again by a later training
    (``restarts``), each as (tag, first step, last step).
    """

    version: tuple  # (max_step, max_wall_time, plugin_content)
    series: records.TensorSeries | None
    problems: list[str]
    parts: dict[str, records.TensorSeries] | None = None
    overlaps: list[tuple[str, int, int]] = dataclasses.field(default_factory=list)
    restarts: list[tuple[str, int, int]] = dataclasses.field(default_factory=list)


def listed_version(ts: Any) -> tuple:
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

    def __init__(self, tags: dict[str, TagData], limits: "Limits"):
        self.tags = tags
        overlaps = [o for t in tags.values() for o in t.overlaps]
        restarts = [r for t in tags.values() for r in t.restarts]
        self.series = _merge(tags, overlaps, restarts)
        # A long run's records are read back for what its compact series do not hold.
        self.compact = any(isinstance(s, compact.CompactSeries) for s in self.series)
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
            (t := self.tags.get(tag)) is not None and t.version == listed_version(ts) for tag, ts in listing.items()
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
                return_freed_memory()  # the analysis' float64 copies of float32 records
            self._analyses[key] = result
            # A long run's analysis holds a health code and kind per record.
            keep = self._limits.analyses_per_compact_run if self.compact else self._limits.analyses_per_run
            while len(self._analyses) > keep:
                self._analyses.popitem(last=False)
            return result


def _merge(
    tags: Mapping[str, TagData], overlaps: list[tuple[str, int, int]], restarts: list[tuple[str, int, int]]
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
        merged, offsets = _merge_parts([part for _, part in placed], shared_steps, overlaps, restarts)
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


def _merge_parts(
    parts: list[records.TensorSeries],
    shared_steps: dict,
    overlaps: list[tuple[str, int, int]],
    restarts: list[tuple[str, int, int]],
) -> tuple[records.TensorSeries, list[int] | None]:
    """``packed.merge`` of one tensor's parts; compact parts (a long run's)
    make a compact series of their pieces where they lie end to end (the
    parts then stay as they are: the series shares their arrays), else
    their records are read back and merged in full."""
    if not any(isinstance(p, compact.CompactSeries) for p in parts):
        return packed.merge(parts, shared_steps, overlaps, restarts)
    if all(isinstance(p, compact.CompactSeries) for p in parts):
        got = compact.merge(parts, shared_steps, restarts)
        if got is not None:
            return got, None
    full = [records.TensorSeries(p.tag, p.info, p.steps, p.records(0, len(p.steps)), p.written)
            if isinstance(p, compact.CompactSeries) else p for p in parts]
    return packed.merge(full, None, overlaps, restarts)[0], None


def return_freed_memory() -> None:
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


def read_cost(listing: Mapping[str, Any], *known: Mapping[str, TagData]) -> int:
    """Steps to read for ``listing`` beyond the tags ``known`` as listed, a
    packed block's counted once: a rough measure of the read's cost."""
    return sum(
        _steps_held(tag, ts)
        for tag, ts in listing.items()
        if not any((t := k.get(tag)) is not None and t.version == listed_version(ts) for k in known)
    )


def records_listed(listing: Mapping[str, Any]) -> int:
    """About how many records ``listing``'s tags hold: a packed block's steps
    times the tensors of its table (``_steps_held``), a tag whose metadata
    cannot be read counted as one tensor."""
    return sum(_steps_held(tag, ts) * (max(1, len(_infos(ts))) if packed.is_block_tag(tag) and ts.plugin_content else 1)
               for tag, ts in listing.items())


def _at_step(series: records.TensorSeries, step: int) -> records.TensorSeries:
    """A series' records at one step."""
    at = series.steps == step
    return records.TensorSeries(series.tag, series.info, series.steps[at], series.values[at], series.written)


def _infos(ts: Any) -> list[metadata.TensorInfo]:
    """The ``TensorInfo`` of each tensor a listed tag holds (none where its metadata cannot be read)."""
    try:
        info = metadata.parse_content(ts.plugin_content, ts.description or "")
    except metadata.FormatError:
        return []
    return [info] if isinstance(info, metadata.TensorInfo) else [i for _, i in info]


def _has_loss_scale(listing: Mapping[str, Any]) -> bool:
    """Whether any listed tag holds a loss scale's records."""
    return any(i.role == "loss_scale" for ts in listing.values() if ts.plugin_content for i in _infos(ts))


def _blocks_holding(listing: Mapping[str, Any], step: int) -> set[str] | None:
    """The packed blocks that may hold ``step``: each writer's first block
    (by sequence) whose last step is at or after it, its steps rising from
    block to block; None where a writer's blocks do not (steps that go back
    in one writer: any block may then hold it). A tensor's repeated records
    (``packed.is_repeat_tag``) are not of that sequence: their block holds
    every record of the steps it has, the first too, so it may be
    non-finite at ``step`` wherever the tensor is, and is marked there."""
    by_writer: dict[str, list[tuple[str, str]]] = {}
    for tag in listing:
        if packed.is_block_tag(tag) and not packed.is_repeat_tag(tag):
            writer, _, seq = tag[len(packed.TAG_PREFIX):].rpartition("/")
            by_writer.setdefault(writer, []).append((seq, tag))
    out = set()
    for blocks in by_writer.values():
        ordered = [tag for _, tag in sorted(blocks)]
        last = [int(listing[tag].max_step) for tag in ordered]
        if any(b < a for a, b in zip(last, last[1:])):
            return None
        out.update(next(([tag] for tag, s in zip(ordered, last) if s >= step), []))
    return out


def _log_new_problems(run: str, prev: TagData | None, problems: list[str]) -> None:
    """Logs a tag's problems to the server log once: those its previous read had not."""
    for p in problems:
        if prev is None or p not in prev.problems:
            logger.warning("numerics: run %r: %s", run, p)


# Decodes a block's events into its parts, compact (those whose tensors keep
# their records aside): (block, table, steps, arrays, problems, wall times).
_Compactor = Callable[[str, "metadata.BlockTable", np.ndarray, list, list, list], list[records.TensorSeries]]

# A tag to read: its listed version, parsed metadata, and its previous read.
_ToRead = tuple[tuple, "metadata.TensorInfo | metadata.BlockTable", "TagData | None"]


class ProviderReader:
    """Reads and decodes a run's tags through TensorBoard's data provider.

    A run of more than ``compact_above`` records keeps its packed blocks'
    parts compact (``compact.CompactSeries``), read back through this
    reader (a few blocks cached per run) for what they do not hold.
    """

    def __init__(self, data_provider: provider.DataProvider, records_per_read: int, compact_above: int = 500_000):
        self._provider = data_provider
        self._records_per_read = records_per_read
        self._compact_above = compact_above
        self._lock = threading.Lock()
        self._blocks: dict[tuple[str, str], _BlockReader] = {}

    def block_reader(self, experiment: str, run: str) -> "_BlockReader":
        """The run's reader of packed blocks read again (one per run, kept)."""
        with self._lock:
            return self._blocks.setdefault((experiment, run), _BlockReader(self, experiment, run))

    def read(
        self, ctx, experiment: str, run: str, listing: Mapping[str, Any], known: list[Mapping[str, TagData]],
        whole: bool = False,
    ) -> dict[str, TagData]:
        """The records of ``listing``'s tags: those ``known`` as of the listed
        version are shared, the others read again (whole: the data provider
        has no "steps after N"); a long run's held compact unless ``whole``."""
        tags, to_read = _unchanged_and_to_read(run, listing, known)
        blocks = self.block_reader(experiment, run)
        held = _records_held(tags) + records_listed({tag: listing[tag] for tag in to_read})
        compactor = None
        if not whole:
            blocks.learn(to_read)
            compactor = blocks.compactor(to_read) if held > self._compact_above else None

        def read_and_decode(batch: list[str]) -> dict[str, TagData]:
            data, unreadable = self._read_tags(ctx, experiment, run, batch)
            return _decode_tags(run, batch, data, unreadable, to_read, compactor)

        # Two batches at a time, each read and decoded by its own thread:
        # the data server (or the files) prepares one while the other is
        # decoded, and numpy's work, which releases the GIL, takes both
        # cores (a long run reads in about half the time).
        batches = self._batches(to_read, listing)
        with concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="numerics-read") as pool:
            reads = [pool.submit(read_and_decode, b) for b in batches[:2]]
            for i in range(len(batches)):
                done = reads[i].result()
                if i + 2 < len(batches):
                    reads.append(pool.submit(read_and_decode, batches[i + 2]))
                tags.update(done)
        return tags

    def nonfinite_marks(self, run: str) -> dict[str, int]:
        """Per tag of ``run``, the earliest step at which it may hold a NaN or
        an infinity, as the provider's index of the event files says
        (``FileProvider.nonfinite_steps``); {} where the provider keeps no
        such index (TensorBoard's own) or none may."""
        marks_of = getattr(self._provider, "nonfinite_steps", None)
        return marks_of(run) if marks_of is not None else {}

    def first_look(
        self, ctx, experiment: str, run: str, listing: Mapping[str, Any], marks: Mapping[str, int]
    ) -> tuple[dict[str, TagData], int] | None:
        """What names a long run's first anomaly before the run is read, and
        the step it must be at: the records read whole of the tags that may
        hold a NaN or an infinity at the earliest step any tag may
        (``marks``, from ``nonfinite_marks``: no record is non-finite before
        it), of each writer's block that may hold that step too (a later
        training may have written it again), and of the small tags that name
        its op (op-level records, the replays' verdicts).

        None where no listed tag may hold a NaN or an infinity, or the run
        has a loss scale: a non-finite gradient is then a skipped step that
        loss scaling handles only if training recovers after it, which no
        part of the run can tell. The analysis of what this returns names
        the first anomaly exactly where it falls at the step returned (among
        the tensors non-finite there, the first in execution order); one at
        another step proves nothing (a -Inf the tensor allows made the index
        look too early).
        """
        marks = {tag: step for tag, step in marks.items() if tag in listing}
        if not marks or _has_loss_scale(listing):
            return None
        first = min(marks.values())
        covering = _blocks_holding(listing, first)
        if covering is None:
            return None
        naming = {tag for tag in listing if is_op_level(tag) or tag in metadata.VERDICT_TAGS}
        wanted = {tag: ts for tag, ts in listing.items() if marks.get(tag) == first or tag in covering or tag in naming}
        tags = self.read(ctx, experiment, run, wanted, [], whole=True)
        # Only that step's records of the tensors that may be non-finite there
        # count (from every tag read: a later training's record of it stands),
        # and the op's tags whole: their analysis is then instant.
        at = {tag: {s.tag: _at_step(s, first) for s in ([data.series] if data.series else (data.parts or {}).values())}
              for tag, data in tags.items() if tag not in naming}
        bad = {name for got in at.values() for name, s in got.items()
               if packed.nonfinite_step(s.values, first) is not None}
        for tag, got in at.items():
            data = tags[tag]
            data.series = data.series and got[data.series.tag]
            data.parts = data.parts and {name: s for name, s in got.items() if name in bad}
        return tags, first

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


def _records_held(tags: Mapping[str, TagData]) -> int:
    """How many records the tags held already hold."""
    return sum(len(t.series.steps) if t.series is not None else sum(len(p.steps) for p in (t.parts or {}).values())
               for t in tags.values())


class _BlockReader:
    """Reads a run's packed blocks again and decodes them: the source of a
    compact series' records (through ``compact.PartCache``)."""

    def __init__(self, reader: ProviderReader, experiment: str, run: str):
        self._reader, self._experiment, self._run = reader, experiment, run
        self._tables: dict[str, metadata.BlockTable] = {}
        self.cache = compact.PartCache(self._read)

    def learn(self, to_read: Mapping[str, _ToRead]) -> None:
        """Keeps the tables of the blocks about to be read."""
        for tag, (_, info, _) in to_read.items():
            if not isinstance(info, metadata.TensorInfo):
                self._tables[tag] = info
                self.cache.forget(tag)

    def compactor(self, to_read: Mapping[str, _ToRead]) -> _Compactor:
        """What makes a block's part compact, unless its tensor keeps its
        records (the gradients the by-depth rule compares: as each block's
        table orders them)."""
        pairs: dict[str, tuple[str, ...]] = {}
        for tag, (_, info, _) in to_read.items():
            if not isinstance(info, metadata.TensorInfo):
                grads = sorted(((t, i) for t, i in info if i.role == "gradient"),
                               key=lambda g: (metadata.PHASE_RANK.get(g[1].phase, 0), g[1].order, g[0]))
                pairs[tag] = detectors.depth_pair(grads) or ()

        def make(block: str, table: metadata.BlockTable, steps: np.ndarray, arrays: list, problems: list[str],
                 walls: list[float]) -> list[records.TensorSeries]:
            def keep(tag: str, info: metadata.TensorInfo) -> bool:
                return compact.keeps_records(tag, info, pairs.get(block, ()))

            rows = packed.block_rows(block, table, steps, arrays, problems)
            ids = packed.regular_ids(table, rows) if rows is not None else None
            span = (float(min(walls)), float(max(walls))) if walls else None
            got = compact.compact_rows(block, table, rows, ids, keep, self.cache, span) if ids is not None else None
            if got is None:  # an unusual block: decoded as any, then made compact
                parts = packed.decode_tag(block, table, steps, arrays, problems, walls)
                return compact.compact_parts(block, parts, keep, self.cache)
            return got

        return make

    def _read(self, block: str) -> dict[str, records.TensorSeries]:
        table = self._tables[block]
        data, unreadable = self._reader._read_tags(tb_context.RequestContext(), self._experiment, self._run, [block])
        if block in unreadable:
            raise ValueError(unreadable[block])
        points = data.get(block, [])
        steps = np.fromiter((d.step for d in points), dtype=np.int64, count=len(points))
        parts = packed.decode_tag(block, table, steps, [d.numpy for d in points], [], [d.wall_time for d in points])
        return {p.tag: p for p in parts}


def _unchanged_and_to_read(
    run: str, listing: Mapping[str, Any], known: list[Mapping[str, TagData]]
) -> tuple[dict[str, TagData], dict[str, _ToRead]]:
    """The tags ``known`` as listed (or whose metadata cannot be read), and
    the others with what reading them needs."""
    tags: dict[str, TagData] = {}
    to_read: dict[str, _ToRead] = {}
    for tag, ts in listing.items():
        version = listed_version(ts)
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
            tags[tag] = TagData(version, None, ["%s: %s" % (tag, e)])
            _log_new_problems(run, prev, tags[tag].problems)
            continue
        to_read[tag] = (version, info, prev)
    return tags, to_read


def _tensor_tag(version: tuple, trainings: list[records.TensorSeries], problems: list[str]) -> TagData:
    """A per-tensor tag's ``TagData``: its series of each training (or
    writer) merged as the CLI merges them (``packed.merge``), so that a
    restarted job's later records are all kept. One training's series is
    kept as decoded (no copy: the usual case)."""
    if len(trainings) == 1:
        return TagData(version, trainings[0], problems)
    tag = TagData(version, None, problems)
    tag.series = packed.merge(trainings, overlaps=tag.overlaps, restarts=tag.restarts)[0]
    return tag


def _decode_tags(
    run: str, batch: list[str], data: dict, unreadable: Mapping[str, str], to_read: Mapping[str, _ToRead],
    compactor: _Compactor | None = None,
) -> dict[str, TagData]:
    """The ``TagData`` of each tag of a read ``batch``: a per-tensor tag's
    series, or a packed block's parts (made compact by ``compactor``, a
    long run's), with the problems found."""
    out: dict[str, TagData] = {}
    for tag in batch:
        version, info, prev = to_read[tag]
        if tag in unreadable:
            out[tag] = TagData(version, None, [unreadable[tag]])
            _log_new_problems(run, prev, out[tag].problems)
            continue
        problems: list[str] = []
        points = data.pop(tag, [])
        steps = np.fromiter((d.step for d in points), dtype=np.int64, count=len(points))
        walls = [d.wall_time for d in points]
        arrays = [d.numpy for d in points]
        if compactor is not None and not isinstance(info, metadata.TensorInfo):
            parts = compactor(tag, info, steps, arrays, problems, walls)
            out[tag] = TagData(version, None, problems, {p.tag: p for p in parts})
        else:
            decoded = packed.decode_tag(tag, info, steps, arrays, problems, walls)
            if isinstance(info, metadata.TensorInfo):
                out[tag] = _tensor_tag(version, decoded, problems)
            else:
                out[tag] = TagData(version, None, problems, {p.tag: p for p in decoded})
        _log_new_problems(run, prev, problems)
    return out


