"""Compact series: a long run's records held as what the rules read, the rest read back on demand.

Why: a run of 500 tensors x 100,000 steps holds 50 M records, 2.2 GB as
float32; the plugin must serve it from well under that. A ``CompactSeries``
holds, for each record of a tensor logged in packed blocks:

- what every series mask reads of a usual tensor (an activation, a
  gradient): max |x| (in the records' own dtype), one byte of
  flags (NaN, +Inf, -Inf, overflow counts above 0) and, where the tensor
  ever underflowed, the share of its nonzero values below the smallest
  normal: 5 bytes a record, from which ``mask_values`` rebuilds records on
  which every mask answers as on the real ones (the rules core's masks read
  nothing else of such a tensor; ``tests/test_compact.py`` checks each kind);
  for a ReLU-like activation also what the dead-unit rule reads
  (``TensorSeries.zero_shares``): its share of exact zeros and its count, 12
  bytes more; for a sigmoid, tanh or softmax output whether the saturation
  rule finds it pinned at its bounds (``detectors.pinned``), 1 byte;
- chart aggregates of each ``CHUNK`` records (min of mins, max of maxes,
  sums of counts, sums of the finite means, stds and L2 norms): 2.5 bytes a
  record, exact for any chart point made of whole chunks;
- where each record came from (its packed block): a record's full
  statistics (``record``), a range of them (``records``) and, where
  something reads them, all of them (``values``) are read back through the
  source they came from, TensorBoard's data provider or the event files.

Tensors whose rules read more of each record (losses, the global norm, the
loss scale, the batch's inputs and targets, which the hints' evidence reads
whole, update ratios, the two gradients the by-depth rule compares,
op-level records) keep every record (``keeps_records``). Numpy only, no
TensorFlow.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import threading
from typing import Callable, Sequence

import numpy as np

from tb_numerics import detectors, metadata, packed, records
from tb_numerics.records import F, TensorSeries, derived

__all__ = ["CHART_COUNTS", "CHART_MOMENTS", "CHUNK", "ChunkStats", "CompactSeries", "PartCache", "Piece",
           "compact_parts", "compact_rows", "keeps_records", "merge"]

logger = logging.getLogger(__name__)

# Records per chart aggregate: 2,000 points over 100,000 steps.
CHUNK = 50
# A record's flag bits: each of these counts above 0.
_FLAGS = (("nan", np.uint8(1)), ("posinf", np.uint8(2)), ("neginf", np.uint8(4)), ("overflow", np.uint8(8)))
# Records made compact at once (13 float64 fields each: 3.4 MB).
_WORK_RECORDS = 1 << 15
# The chart's statistics, as ``views`` shows them.
CHART_COUNTS = ("count", "nan", "posinf", "neginf", "zeros", "overflow", "underflow")
CHART_MOMENTS = ("mean", "std", "l2")
# Where the chart's counts lie in a record.
_COUNT_ROWS = [metadata.FIELD_INDEX[k] for k in CHART_COUNTS]

# (block tag, tensor tag) -> that tensor's part of the block, read again.
PartLoader = Callable[[str, str], TensorSeries]


def keeps_records(tag: str, info: metadata.TensorInfo, depth_pair: Sequence[str] = ()) -> bool:
    """Whether a tensor keeps every record in full: one some rule or the
    hints' evidence (``evidence``: the batch's inputs) reads beyond what a
    compact piece holds (max |x|, the non-finite and overflow counts, the
    underflow share, and an activation's zero shares or pinned marks).

    Args:
      tag, info: the tensor.
      depth_pair: the gradient tags the by-depth rule compares.
    """
    if info.role in ("loss", "global_norm", "loss_scale", "input") or tag in depth_pair:
        return True
    return tag.startswith(("update_ratio/", "ops/")) or tag in metadata.VERDICT_TAGS


def _is_pinned(measure: Callable, info: metadata.TensorInfo) -> bool:
    """Whether ``measure`` is the saturation rule's for the tensor's own
    function (``detectors.pinned``), which its compact pieces hold."""
    return (isinstance(measure, functools.partial) and measure.func is detectors.pinned
            and measure.args == (detectors.saturating_function(info),) and not measure.keywords)


def _holds_zero_shares(info: metadata.TensorInfo) -> bool:
    """Whether a compact tensor holds what the dead-unit rule reads."""
    return info.role == "activation" and detectors.relu_like(info)


@dataclasses.dataclass
class ChunkStats:
    """Chart aggregates of consecutive chunks of records: chunk ``c`` holds
    records ``[start[c], start[c + 1])`` (the last to the series' end)."""

    start: np.ndarray  # int64 [m], record index of each chunk's first record
    lo: np.ndarray  # [m] min of the finite mins (NaN where none)
    hi: np.ndarray  # [m] max of the finite maxes
    max_abs: np.ndarray  # [m]
    moments: np.ndarray  # float64 [m, 2 * len(CHART_MOMENTS)]: sum and number of finite values of each
    counts: np.ndarray  # float64 [m, len(CHART_COUNTS)]: sums
    unrecorded: np.ndarray  # bool [m]: no record of the chunk holds sums

    @staticmethod
    def joined(parts: Sequence["ChunkStats"], offsets: Sequence[int]) -> "ChunkStats":
        """The chunks of parts laid end to end at ``offsets``."""
        fields = {f.name: np.concatenate([getattr(p, f.name) for p in parts]) for f in dataclasses.fields(ChunkStats)}
        fields["start"] = np.concatenate([p.start + at for p, at in zip(parts, offsets)])
        return ChunkStats(**fields)


@dataclasses.dataclass
class Piece:
    """One block's records of a tensor, compact: what a ``CompactSeries`` is made of."""

    block: str  # the block's tag, to read the records back with
    max_abs: np.ndarray  # [n], in the records' dtype
    flags: np.ndarray  # uint8 [n]: NaN, +Inf, -Inf, overflow counts above 0
    underflow: np.ndarray | None  # float64 [n]: the underflow share; None where all 0
    chunks: ChunkStats
    # A ReLU-like activation's share of exact zeros (float64 [n]) and count
    # of values (float32 [n], exact at the rule's threshold): None for others.
    zero_share: np.ndarray | None = None
    count: np.ndarray | None = None
    # A saturating output's records pinned at its bounds (bool [n]): None for others.
    pinned: np.ndarray | None = None

    def prefix(self, n: int, tag: str, load: PartLoader) -> "Piece":
        """Its first ``n`` records (a restarted job wrote the others again):
        views, but for the chunk the cut falls in, made again from the
        records read back."""
        whole = self.chunks.start + CHUNK <= n
        cut = {f.name: getattr(self.chunks, f.name)[whole] for f in dataclasses.fields(ChunkStats)}
        chunks = ChunkStats(**cut)
        at = int(self.chunks.start[~whole][0]) if (~whole).any() else n
        if at < n:
            last = _chunks_of(load(self.block, tag).values[at:n])
            chunks = ChunkStats(**{f.name: np.concatenate([getattr(chunks, f.name), getattr(last, f.name) + (
                at if f.name == "start" else 0)]) for f in dataclasses.fields(ChunkStats)})
        return Piece(self.block, self.max_abs[:n], self.flags[:n],
                     None if self.underflow is None else self.underflow[:n], chunks,
                     None if self.zero_share is None else self.zero_share[:n],
                     None if self.count is None else self.count[:n],
                     None if self.pinned is None else self.pinned[:n])


class CompactSeries(TensorSeries):
    """One tensor's records as the rules read them, the rest read back on
    demand (see the module docstring): its blocks' pieces, laid end to end
    by step. Stands wherever a ``TensorSeries`` does; ``values`` reads every
    record back, so the analysis reads ``record``, ``records`` and
    ``mask_view`` instead.

    Args:
      tag, info, steps, written: as ``TensorSeries``'s.
      pieces: the pieces, in step order.
      load: reads a block's part again: ``load(block, tensor tag)``.
      width: how many tensors its blocks hold (reading a record back decodes as many).
    """

    def __init__(self, tag: str, info: metadata.TensorInfo, steps: np.ndarray, pieces: list[Piece],
                 load: PartLoader, written: tuple[float, float] | None = None, width: int = 1):
        self.tag, self.info, self.steps, self.written = tag, info, steps, written
        self.pieces, self.load, self.width = pieces, load, width

    @functools.cached_property
    def starts(self) -> np.ndarray:
        """Where each piece begins, and the end (made when first read: a long
        run makes tens of thousands of series, most never read back)."""
        return np.fromiter(itertools.accumulate((len(p.flags) for p in self.pieces), initial=0), np.int64,
                           count=len(self.pieces) + 1)

    def __repr__(self) -> str:
        return "CompactSeries(%r, %d records)" % (self.tag, len(self.steps))

    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def _joined(self, name: str) -> np.ndarray:
        arrays = [getattr(p, name) for p in self.pieces]
        return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)

    @property
    def values(self) -> np.ndarray:  # type: ignore[override]
        """Every record, read back from the source (slow: a fallback)."""
        logger.info("numerics: reading all %d records of %s back", len(self.steps), self.tag)
        return self.records(0, len(self.steps))

    @property
    def max_abs(self) -> np.ndarray:
        return self._joined("max_abs")

    @property
    def chunks(self) -> ChunkStats:
        """Every piece's chunks, by record index in the series."""
        if len(self.pieces) == 1:
            return self.pieces[0].chunks
        fields = {f.name: np.concatenate([getattr(p.chunks, f.name) for p in self.pieces])
                  for f in dataclasses.fields(ChunkStats)}
        fields["start"] = np.concatenate([p.chunks.start + at for p, at in zip(self.pieces, self.starts)])
        return ChunkStats(**fields)

    def record(self, i: int) -> np.ndarray:
        return self.records(i, i + 1)[0]

    def records(self, lo: int, hi: int) -> np.ndarray:
        """Records ``[lo, hi)`` in float64, read back from their blocks."""
        out = np.empty((max(0, hi - lo), metadata.NUM_FIELDS), np.float64)
        k = max(0, int(np.searchsorted(self.starts, lo, side="right")) - 1)
        at = lo
        while at < hi:
            take = min(hi, int(self.starts[k + 1])) - at
            j = at - int(self.starts[k])
            got = self.load(self.pieces[k].block, self.tag).values[j : j + take]
            if len(got) < take:
                raise ValueError("%s: block %s no longer holds its records" % (self.tag, self.pieces[k].block))
            out[at - lo : at - lo + take] = got
            at += take
            k += 1
        return out

    def zero_shares(self) -> tuple[np.ndarray, np.ndarray]:
        """As ``TensorSeries.zero_shares``, from what its pieces hold (a
        ReLU-like activation's; any other's records are read back)."""
        if all(p.zero_share is not None for p in self.pieces):
            return self._joined("zero_share"), self._joined("count").astype(np.float64)
        return super().zero_shares()

    def marked(self, measure: Callable[[np.ndarray, dict[str, np.ndarray]], np.ndarray]) -> np.ndarray:
        """As ``TensorSeries.marked``; a saturating output's pieces hold the
        saturation rule's measure (``_Pieces``), any other's records are read back."""
        if all(p.pinned is not None for p in self.pieces) and _is_pinned(measure, self.info):
            return self._joined("pinned")
        return super().marked(measure)

    def mask_values(self) -> np.ndarray:
        """Records on which every series mask answers as on the real ones
        (float64): max |x| as min and max, the non-finite and overflow
        counts as 0 or 1, the underflow share as the underflow count of one
        finite nonzero value; sums NaN (not recorded), zeros 0."""
        n = len(self.steps)
        v = np.zeros((n, metadata.NUM_FIELDS), order="F")  # the masks read a field at a time
        flags = self._joined("flags")
        for k, bit in _FLAGS:
            v[:, F[k]] = (flags & bit) > 0
        v[:, F["count"]] = 1 + v[:, F["nan"]] + v[:, F["posinf"]] + v[:, F["neginf"]]
        v[:, F["min"]] = v[:, F["max"]] = self.max_abs
        v[:, F["sum"]] = v[:, F["sum_sq"]] = np.nan
        if any(p.underflow is not None for p in self.pieces):
            v[:, F["underflow"]] = np.concatenate(
                [p.underflow if p.underflow is not None else np.zeros(len(p.flags)) for p in self.pieces])
        return v

    def mask_view(self) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """``mask_values()`` and their ``derived`` statistics, made directly:
        one finite value a record, max |x|, no sums."""
        n = len(self.steps)
        nan = np.full(n, np.nan)
        v = self.mask_values()
        return v, {"mean": nan, "std": nan, "max_abs": v[:, F["max"]], "l2": nan, "finite": np.ones(n)}


def compact_parts(block: str, parts: Sequence[TensorSeries], keep: Callable[[str, metadata.TensorInfo], bool],
                  load: PartLoader) -> list[TensorSeries]:
    """A block's parts (``packed.decode_tag``), each compact unless ``keep``
    says its tensor keeps its records (then a copy: a view would hold the
    whole block).

    Args:
      block: the block's tag, to read the records back with.
      parts: its parts.
      keep: whether a tensor (tag, info) keeps its records.
      load: reads a block's part again: ``load(block, tensor tag)``.
    """
    kept = [keep(p.tag, p.info) or not len(p.steps) for p in parts]
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(parts):
        if not kept[i]:
            groups.setdefault((id(p.steps), len(p.steps), p.values.dtype == np.float32), []).append(i)
    out = [TensorSeries(p.tag, p.info, p.steps, p.values.copy(), p.written) if k else p for p, k in zip(parts, kept)]
    for idx in groups.values():
        steps, written = parts[idx[0]].steps, parts[idx[0]].written
        pieces = _Pieces(len(idx), len(steps), parts[idx[0]].values.dtype, [parts[i].info for i in idx])
        at_once = _steps_at_once(len(idx))
        for s0 in range(0, len(steps), at_once):
            n = min(at_once, len(steps) - s0)
            fields = np.empty((metadata.NUM_FIELDS, n, len(idx)))
            for j, i in enumerate(idx):
                fields[:, :, j] = parts[i].values[s0 : s0 + n].T
            pieces.add(s0, fields.reshape(metadata.NUM_FIELDS, -1))
        for i, series in zip(idx, pieces.series(block, [(parts[i].tag, parts[i].info) for i in idx], steps, load,
                                                  written)):
            series.width = len(parts)
            out[i] = series
    return out


def compact_rows(block: str, table: metadata.BlockTable, rows: np.ndarray, ids: np.ndarray,
                 keep: Callable[[str, metadata.TensorInfo], bool], load: PartLoader,
                 written: tuple[float, float] | None) -> list[TensorSeries] | None:
    """``compact_parts`` of a usual block, where each step logs the tensors
    ``ids`` (``packed.regular_ids``), made straight from its rows: a slice
    of steps at a time, each field of the slice copied out once (float64,
    field by field, step by step), its rows checked as ``packed.regular_cube``
    checks them and its records made compact from that one copy. None where
    a row is not as a usual block's: then decode it as any other block.

    Args:
      block, keep, load: as ``compact_parts``'s.
      table: the block's table.
      rows: its rows ``[S * T, COLUMNS]`` (``packed.block_rows``).
      ids: the tensors each step logs, as indices in ``table``.
      written: the block's events' first and last wall time, where known.
    """
    t = len(ids)
    s = len(rows) // t
    infos = [table[int(i)] for i in ids]
    kept = [keep(tag, info) for tag, info in infos]
    pieces = None if all(kept) else _Pieces(t, s, rows.dtype, [None if k else info for (_, info), k in zip(infos, kept)])
    steps = np.empty(s, np.int64)
    at_once = _steps_at_once(t)
    buffer = np.empty((packed.COLUMNS, min(s, at_once) * t), rows.dtype)
    for s0 in range(0, s, at_once):
        n = min(at_once, s - s0)
        fields = buffer if n * t == buffer.shape[1] else np.empty((packed.COLUMNS, n * t), rows.dtype)
        fields[...] = rows[s0 * t : (s0 + n) * t].T
        got = packed.regular_steps(ids, fields[0], fields[1])
        # Checked in the rows' dtype (float32 comparisons are exact, and twice as fast).
        if got is None or (s0 and got[0] <= steps[s0 - 1]) or not records.valid_records(fields[2:].T).all():
            return None
        steps[s0 : s0 + n] = got
        if pieces is not None:
            pieces.add(s0, fields[2:].astype(np.float64))
    cube = rows.reshape(s, t, packed.COLUMNS)
    out: list[TensorSeries | None] = [
        TensorSeries(tag, info, steps, cube[:, j, 2:].copy(), written) if k else None
        for j, ((tag, info), k) in enumerate(zip(infos, kept))]
    if pieces is not None:
        for j, series in enumerate(pieces.series(block, infos, steps, load, written)):
            if out[j] is None:
                series.width = t
                out[j] = series
    return out  # type: ignore[return-value]


def _steps_at_once(n_tensors: int) -> int:
    """Steps of ``n_tensors`` made compact at once: whole chunks, about
    ``_WORK_RECORDS`` records, so that the copy and its temporaries stay in
    cache and are reused."""
    return CHUNK * max(1, _WORK_RECORDS // (CHUNK * max(1, n_tensors)))


class _Pieces:
    """The compact pieces of ``T`` tensors over ``S`` steps of one block,
    made a slice of steps at a time (``add``) from their records laid out
    field by field, step by step, where every pass reads a field of every
    record at once and the chunks are reductions across steps."""

    def __init__(self, n_tensors: int, n_steps: int, dtype: np.dtype,
                 infos: Sequence[metadata.TensorInfo | None] = ()):
        t, m = n_tensors, -(-n_steps // CHUNK)
        # The tensors (their infos; None: not made compact) that hold what the
        # dead-unit rule reads, and it; those that hold whether each record
        # is pinned at its function's bounds, by function, and it.
        self._zero_cols = np.asarray([i for i, info in enumerate(infos) if info and _holds_zero_shares(info)], int)
        self._zero_share = np.empty((n_steps, len(self._zero_cols)))
        self._count = np.empty((n_steps, len(self._zero_cols)), np.float32)
        fns = [detectors.saturating_function(info) if info else "" for info in infos]
        self._pinned_cols = {fn: np.asarray([i for i, f in enumerate(fns) if f == fn], int) for fn in set(fns) if fn}
        self._pinned = np.empty((n_steps, t), bool) if self._pinned_cols else None
        self._n_steps = n_steps
        self._max_abs = np.empty((n_steps, t), dtype)  # in the records' own dtype
        self._flags = np.empty((n_steps, t), np.uint8)
        self._share: np.ndarray | None = None  # [S, T], made at the first underflow
        self._under = np.zeros(t, bool)
        self._lo, self._hi, self._chunk_max = np.empty((m, t)), np.empty((m, t)), np.empty((m, t))
        self._moments = np.empty((m, t, 2 * len(CHART_MOMENTS)))
        self._counts = np.empty((m, t, len(CHART_COUNTS)))
        self._unrecorded = np.empty((m, t), bool)

    def add(self, s0: int, v: np.ndarray) -> None:
        """The records of steps ``[s0, s0 + k)``: ``v``, float64
        ``[NUM_FIELDS, k * T]``, step by step; ``s0`` a multiple of ``CHUNK``."""
        t = self._max_abs.shape[1]
        k = v.shape[1] // t
        d = derived(v.T)
        self._max_abs[s0 : s0 + k] = d["max_abs"].reshape(k, t)
        flags = np.zeros(k * t, np.uint8)
        for name, bit in _FLAGS:
            flags |= (v[F[name]] > 0).view(np.uint8) * bit  # a bool's byte is 0 or 1
        self._flags[s0 : s0 + k] = flags.reshape(k, t)
        if len(self._zero_cols):  # as ``TensorSeries.zero_shares`` makes them
            cols = self._zero_cols
            self._zero_share[s0 : s0 + k] = records.zero_share(
                v[F["zeros"]].reshape(k, t)[:, cols], d["finite"].reshape(k, t)[:, cols])
            self._count[s0 : s0 + k] = v[F["count"]].reshape(k, t)[:, cols]
        for fn, cols in self._pinned_cols.items():  # as the saturation rule measures them
            self._pinned[s0 : s0 + k, cols] = detectors.pinned(fn, v.T, d).reshape(k, t)[:, cols]
        under = (v[F["underflow"]] > 0).reshape(k, t).any(axis=0)
        if under.any():  # the share of nonzero values below the smallest normal, as the underflow rule reads it
            self._under |= under
            if self._share is None:
                self._share = np.zeros((self._n_steps, t))
            with np.errstate(invalid="ignore", divide="ignore"):
                nonzero = d["finite"] - v[F["zeros"]]
                self._share[s0 : s0 + k] = np.where(nonzero > 0, v[F["underflow"]] / np.maximum(nonzero, 1), 0.0
                                                     ).reshape(k, t)
        # The chart's chunks: reductions across the steps of each, of every field at once.
        c = slice(s0 // CHUNK, s0 // CHUNK + -(-k // CHUNK))
        with np.errstate(invalid="ignore"):
            self._lo[c] = _by_chunk(np.fmin, v[F["min"]], k)
            self._hi[c] = _by_chunk(np.fmax, v[F["max"]], k)
            self._chunk_max[c] = _by_chunk(np.fmax, d["max_abs"], k)
            moments = np.stack([d[name] for name in CHART_MOMENTS])
            ok = np.isfinite(moments)
            self._moments[c, :, 0::2] = _by_chunk(np.add, np.where(ok, moments, 0.0), k).transpose(1, 2, 0)
            self._moments[c, :, 1::2] = _by_chunk(np.add, ok.astype(np.float64), k).transpose(1, 2, 0)
            self._counts[c] = _by_chunk(np.add, v, k)[_COUNT_ROWS].transpose(1, 2, 0)
            self._unrecorded[c] = _by_chunk(np.logical_and, np.isnan(v[F["sum_sq"]]) & (d["finite"] > 0), k)

    def chunks(self) -> list[ChunkStats]:
        """Each tensor's chunks."""
        own = np.arange(0, self._n_steps, CHUNK, dtype=np.int64)
        each = [np.ascontiguousarray(a.swapaxes(0, 1)) for a in (
            self._lo, self._hi, self._chunk_max, self._moments, self._counts, self._unrecorded)]
        return [ChunkStats(own, *fields) for fields in zip(*each)]

    def series(self, block: str, tensors: Sequence[tuple[str, metadata.TensorInfo]], steps: np.ndarray,
               load: PartLoader, written: tuple[float, float] | None) -> list["CompactSeries"]:
        """Each tensor's compact series, one piece of ``block``."""
        max_abs, flags = self._max_abs.T.copy(), self._flags.T.copy()
        zero_share, count = self._zero_share.T.copy(), self._count.T.copy()
        held = {int(c): j for j, c in enumerate(self._zero_cols)}
        pinned = {int(c): self._pinned[:, c].copy() for cols in self._pinned_cols.values() for c in cols}
        return [
            CompactSeries(tag, info, steps, [Piece(
                block, max_abs[i], flags[i], self._share[:, i].copy() if self._under[i] else None, chunks,
                zero_share[held[i]] if i in held else None, count[held[i]] if i in held else None,
                pinned.get(i))],
                load, written)
            for i, ((tag, info), chunks) in enumerate(zip(tensors, self.chunks()))
        ]


def _by_chunk(ufunc: np.ufunc, x: np.ndarray, k: int) -> np.ndarray:
    """``ufunc``'s reduction over each chunk of the ``k`` steps of ``x``
    (``[..., k * T]``, step by step): ``[..., ceil(k / CHUNK), T]``."""
    lead = x.shape[:-1]
    x = x.reshape(lead + (k, -1))
    whole = k - k % CHUNK
    out = [ufunc.reduce(x[..., :whole, :].reshape(lead + (whole // CHUNK, CHUNK, -1)), axis=-2)] if whole else []
    if whole < k:
        out.append(ufunc.reduce(x[..., whole:, :], axis=-2, keepdims=True))
    return out[0] if len(out) == 1 else np.concatenate(out, axis=-2)


def _chunks_of(values: np.ndarray) -> ChunkStats:
    """The chunks of one tensor's records ``[n, F]``."""
    pieces = _Pieces(1, len(values), values.dtype)
    pieces.add(0, np.asarray(values, np.float64).T.copy())
    return pieces.chunks()[0]


def merge(
    parts: Sequence[CompactSeries],
    shared_steps: dict | None = None,
    restarts: list[tuple[str, int, int]] | None = None,
) -> CompactSeries | None:
    """One tensor's compact series from its compact parts of one block each,
    given in the order written, as ``packed.merge`` would make it: where a
    later part writes again the steps at the end of an earlier one (a job
    restarted from a checkpoint), the later records replace them; the parts
    then lie end to end by step, and their pieces are shared, not copied.
    None where that cannot be (two writers at once, a later part holding
    only some of the steps it overlaps): ``packed.merge`` then decides on
    the full records. Steps a later training wrote again go to ``restarts``
    as ``packed.merge`` puts them there."""
    keep = [len(p.steps) for p in parts]
    first = [int(p.steps[0]) if len(p.steps) else 0 for p in parts]
    last = [int(p.steps[-1]) if len(p.steps) else -1 for p in parts]
    by_first = sorted(range(len(parts)), key=first.__getitem__)
    if all(last[a] < first[b] for a, b in zip(by_first, by_first[1:])):
        return _laid_end_to_end(parts, keep, shared_steps)  # the usual case: no step written twice
    replaced: list[tuple[int, int]] = []
    for j, later in enumerate(parts):
        for i in range(j):
            earlier = parts[i]
            if not keep[i] or not len(later.steps) or int(earlier.steps[keep[i] - 1]) < first[j]:
                continue
            if packed.written_at_once(earlier, later) or len(earlier.pieces) > 1:
                return None
            cut = int(np.searchsorted(earlier.steps, later.steps[0]))
            rewritten = earlier.steps[cut : keep[i]]
            if not (rewritten[-1] <= later.steps[-1] and np.isin(rewritten, later.steps).all()):
                return None
            keep[i] = cut
            if restarts is not None and packed.follows(earlier, later):
                replaced.append((int(rewritten[0]), int(rewritten[-1])))
    got = _laid_end_to_end(parts, keep, shared_steps)
    if got is not None and replaced and restarts is not None:
        restarts.append((parts[-1].tag, min(lo for lo, _ in replaced), max(hi for _, hi in replaced)))
    return got


def _laid_end_to_end(parts: Sequence[CompactSeries], keep: list[int], shared_steps: dict | None) -> CompactSeries | None:
    """The series of each part's first ``keep`` records laid end to end by
    step; None where they overlap."""
    laid = sorted((i for i in range(len(parts)) if keep[i]), key=lambda i: int(parts[i].steps[0]))
    if not laid or not all(parts[a].steps[keep[a] - 1] < parts[b].steps[0] for a, b in zip(laid, laid[1:])):
        return None
    pieces = [pc if keep[i] == len(parts[i].steps) else pc.prefix(keep[i], parts[i].tag, parts[i].load)
              for i in laid for pc in parts[i].pieces]
    key = tuple((id(parts[i].steps), keep[i]) for i in laid)
    steps = None if shared_steps is None else shared_steps.get(key)
    if steps is None:
        steps = np.concatenate([parts[i].steps[: keep[i]] for i in laid])
        if shared_steps is not None:
            shared_steps[key] = steps
    last = parts[-1]
    return CompactSeries(last.tag, last.info, steps, pieces, last.load, last.written,
                         max(parts[i].width for i in laid))


class PartCache:
    """The last few blocks read back, decoded: the parts of a run's blocks
    by tensor, for ``CompactSeries.records`` (a chart, a warning's detail).
    Two by default: a chart around a step reads at most two blocks; each
    holds every tensor's records (26 MB for 500 tensors)."""

    def __init__(self, read_block: Callable[[str], dict[str, TensorSeries]], keep: int = 2):
        self._read_block = read_block
        self._keep = keep
        self._lock = threading.Lock()
        self._blocks: dict[str, dict[str, TensorSeries]] = {}

    def forget(self, block: str) -> None:
        """Drops a block read before (it grew)."""
        with self._lock:
            self._blocks.pop(block, None)

    def __call__(self, block: str, tag: str) -> TensorSeries:
        with self._lock:
            parts = self._blocks.pop(block, None)
        if parts is None:
            parts = self._read_block(block)
        with self._lock:
            self._blocks[block] = parts
            while len(self._blocks) > self._keep:
                self._blocks.pop(next(iter(self._blocks)))
        if tag not in parts:
            raise ValueError("%s: block %s no longer holds it" % (tag, block))
        return parts[tag]
