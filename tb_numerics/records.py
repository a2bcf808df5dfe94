"""Numerics records in numpy: fields by name, series, and the reference statistics.

One record is the float vector of ``metadata.FIELDS`` for one tensor at one
step. Every module that holds records (the writers, the packed format, the
reader, the analysis, the Keras callback) reads them through these
definitions, so "non-finite" and "global norm" mean one thing everywhere.

Numpy and TensorBoard protos only, no TensorFlow.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Sequence

import numpy as np

from tb_numerics import metadata

__all__ = [
    "F",
    "TensorSeries",
    "derived",
    "global_norm_record",
    "make_series",
    "nonfinite_count",
    "numpy_stats",
    "scalar_record",
    "union_steps",
    "valid_records",
    "zero_share",
]

F = metadata.FIELD_INDEX
NONFINITE_FIELDS = (F["nan"], F["posinf"], F["neginf"])
COUNT_FIELDS = tuple(F[k] for k in ("count", "nan", "posinf", "neginf", "zeros", "overflow", "underflow"))
# A sum of finite values can overflow only where they could add up past the
# largest float32 (sums are accumulated in float32 or wider): half of it,
# for rounding's sake.
_SUM_OVERFLOW = float(np.finfo(np.float32).max) / 2
# Records ``valid_records`` checks at a time.
_CHECK_ROWS = 1 << 15


def nonfinite_count(values: np.ndarray, neginf_ok: bool | np.ndarray = False) -> np.ndarray:
    """NaN + Inf (+ -Inf unless it is intended) of records ``[..., F]``;
    ``neginf_ok`` is one bool, or one per record. Its TensorFlow twin is
    ``stats.nonfinite_count``."""
    v = np.asarray(values)
    bad = v[..., F["nan"]].astype(np.float64) + v[..., F["posinf"]]
    return bad + np.where(np.asarray(neginf_ok, bool), 0.0, v[..., F["neginf"]])


@dataclasses.dataclass
class TensorSeries:
    """All records of one tag in one run, sorted by step.

    A step holds more than one record where the tag was logged more than
    once in it (micro-batches, a loop body): each record is an occurrence,
    in the order written.
    """

    tag: str
    info: metadata.TensorInfo
    steps: np.ndarray  # int64 [n], non-decreasing
    # [n, NUM_FIELDS], float64; or float32 where every value is exactly a
    # float32 (packed records): computations cast to float64 first.
    values: np.ndarray
    # Wall times of the first and last events the records came from, where
    # known: what tells two writers at once from a restarted job
    # (``packed.merge``).
    written: tuple[float, float] | None = None

    @property
    def sort_key(self) -> tuple[int, int, str]:
        return (metadata.PHASE_RANK.get(self.info.phase, 0), self.info.order, self.tag)

    def record(self, i: int) -> np.ndarray:
        """Record ``i`` in float64 (a compact series reads it back)."""
        return self.values[i].astype(np.float64)

    def records(self, lo: int, hi: int) -> np.ndarray:
        """Records ``[lo, hi)`` in float64 (a compact series reads them back)."""
        return self.values[lo:hi].astype(np.float64)

    def at_step(self, step: int) -> np.ndarray:
        """The records of ``step`` in float64 ``[k, F]``, in the order
        written (usually one; none where the step was not logged): a compact
        series reads back those alone."""
        lo = int(np.searchsorted(self.steps, step, side="left"))
        return self.records(lo, int(np.searchsorted(self.steps, step, side="right")))

    def zero_shares(self) -> tuple[np.ndarray, np.ndarray]:
        """Each record's share of exact zeros among its finite values (0
        where it has none) and its count of values, float64: what the
        dead-unit rule reads (a compact series of a ReLU-like activation
        holds them)."""
        v = self.values.astype(np.float64, copy=False)
        return zero_share(v[:, F["zeros"]], v[:, F["count"]] - nonfinite_count(v)), v[:, F["count"]]

    def marked(self, measure: Callable[[np.ndarray, dict[str, np.ndarray]], np.ndarray]) -> np.ndarray:
        """``measure(records, their derived statistics)`` over every record
        in float64: a rule's mask of one record at a time (a compact series
        of a saturating output holds the saturation rule's, ``compact``)."""
        v = self.values.astype(np.float64, copy=False)
        return measure(v, derived(v))

    def mask_values(self) -> np.ndarray:
        """The records the rules' series masks read, in float64: all of
        them (a compact series rebuilds what the masks read, ``compact``)."""
        return self.values.astype(np.float64, copy=False)

    def mask_view(self) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """``mask_values()`` and their ``derived`` statistics."""
        v = self.mask_values()
        return v, derived(v)

    def occurrence(self, i: int) -> tuple[int, int]:
        """(k, n): record ``i`` is the k-th (from 1) of the n records of its step."""
        lo = int(np.searchsorted(self.steps, self.steps[i], side="left"))
        hi = int(np.searchsorted(self.steps, self.steps[i], side="right"))
        return i - lo + 1, hi - lo


def union_steps(series: Sequence[TensorSeries]) -> np.ndarray:
    """Every step at which any of ``series`` holds a record, sorted, each
    once (a tag logged twice in a step holds two records of it): the steps
    they share, at no cost, where they were all logged once at the same
    steps (the usual run)."""
    if not series:
        return np.zeros(0, np.int64)
    first = series[0].steps
    if all(s.steps is first or np.array_equal(s.steps, first) for s in series[1:]):
        return first if not np.any(first[1:] == first[:-1]) else np.unique(first)
    return np.unique(np.concatenate([s.steps for s in series]))


def make_series(
    tag: str,
    info: metadata.TensorInfo,
    steps: Iterable[int],
    values: Iterable[Sequence[float]] | np.ndarray,
    problems: list[str] | None = None,
) -> TensorSeries:
    """Builds a TensorSeries, dropping records that cannot be valid.

    Records of the wrong length, at a negative step, or that no tensor can
    produce (``valid_records``) are dropped and described in ``problems``.
    Records of one step are all kept, in the order given (occurrences).
    """
    if isinstance(values, np.ndarray) and values.ndim == 2 and values.shape[1] == metadata.NUM_FIELDS:
        # Already one array (the plugin's reads): no per-record Python work.
        st = np.asarray(steps, dtype=np.int64).reshape(-1)[: len(values)]
        vals = values[: len(st)].astype(np.float64, copy=False)
        n_given = len(vals)
    else:
        steps_list = [int(s) for s in steps]
        rows = [np.asarray(row, dtype=np.float64).reshape(-1) for row in values][: len(steps_list)]
        n_given = len(rows)
        steps_list = steps_list[:n_given]
        # Checked all at once: a run can hold a million records of one tensor.
        shaped = np.fromiter((r.shape == (metadata.NUM_FIELDS,) for r in rows), bool, n_given)
        vals = np.zeros((0, metadata.NUM_FIELDS))
        if shaped.any():
            vals = np.stack([r for r, ok in zip(rows, shaped) if ok])
        st = np.asarray(steps_list, dtype=np.int64)[shaped]
    # A step is never negative (tf.summary's steps count from 0).
    valid = valid_records(vals) & (st >= 0)
    vals, st = vals[valid], st[valid]
    bad = n_given - len(st)
    if bad and problems is not None:
        problems.append("%s: %d malformed record(s) skipped" % (tag, bad))
    if not len(st):
        return TensorSeries(tag, info, np.zeros(0, np.int64), np.zeros((0, metadata.NUM_FIELDS)))
    if np.any(st[1:] < st[:-1]):
        order = np.argsort(st, kind="stable")
        st, vals = st[order], vals[order]
    return TensorSeries(tag, info, st, vals)


def zero_share(zeros: np.ndarray, finite: np.ndarray) -> np.ndarray:
    """The share of exact zeros among a record's finite values, 0 where it
    has none (float64): the dead-unit rule's measure."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(finite > 0, zeros / np.maximum(finite, 1), 0.0)


def valid_records(v: np.ndarray) -> np.ndarray:
    """Which records ``[n, F]`` hold statistics that some tensor can produce.

    Damage, not data (issue 27): counts that are not whole numbers, negative,
    or more than the element count together; min or max infinite, NaN where
    finite values were counted (or a number where none were), or min above
    max; a sum that is not 0 over no finite value; a sum that is not finite
    where the finite values could not overflow it (the number of finite
    values times max |x| below ``_SUM_OVERFLOW``). Op-level records leave
    sum and sum of squares out, both NaN: possible.
    """
    v = np.asarray(v)
    if len(v) > _CHECK_ROWS and not v.flags.f_contiguous:
        # A slice at a time: temporaries that fit in a cache and are reused
        # (a packed block of 500 tensors checked whole took 5x longer).
        # Records laid out field by field already are read as they are.
        return np.concatenate([valid_records(v[i : i + _CHECK_ROWS]) for i in range(0, len(v), _CHECK_ROWS)])
    # A field at a time, in float32 where the records are: comparisons of
    # float32 values are exact, and the sums below are made in float64.
    v = np.asfortranarray(v, dtype=v.dtype if v.dtype in (np.float32, np.float64) else np.float64)
    count = v[:, F["count"]]
    lo, hi, total, total_sq = (v[:, F[k]] for k in ("min", "max", "sum", "sum_sq"))
    with np.errstate(invalid="ignore", over="ignore"):
        ok = np.isfinite(count) & (count >= 0) & (count == np.floor(count))
        for k in COUNT_FIELDS[1:]:  # a field at a time: no [n, 6] temporaries
            c = v[:, k]
            ok &= (c >= 0) & (c == np.floor(c)) & (c <= count)
        finite = count.astype(np.float64) - nonfinite_count(v)
        ok &= (finite >= 0) & ~np.isinf(lo) & ~np.isinf(hi)
        none = finite == 0
        ok &= np.where(none, np.isnan(lo) & np.isnan(hi), ~np.isnan(lo) & ~np.isnan(hi) & (lo <= hi))
        not_recorded = np.isnan(total) & np.isnan(total_sq)
        ok &= not_recorded | np.where(none, (total == 0) & (total_sq == 0), np.isfinite(total) | (
            finite * np.fmax(np.abs(lo), np.abs(hi)) >= _SUM_OVERFLOW))
    return ok


def derived(values: np.ndarray) -> dict[str, np.ndarray]:
    """Mean, std, max |x|, L2 norm and finite count of records ``[n, F]``.

    All over the finite values, from the stored sums; NaN where a record has
    no finite value.
    """
    v = np.atleast_2d(values).astype(np.float64, copy=False)
    n_finite = v[:, F["count"]] - nonfinite_count(v)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        mean = np.where(n_finite > 0, v[:, F["sum"]] / n_finite, np.nan)
        var = np.where(n_finite > 0, v[:, F["sum_sq"]] / n_finite - mean * mean, np.nan)
        std = np.sqrt(np.maximum(var, 0.0))
        max_abs = np.fmax(np.abs(v[:, F["min"]]), np.abs(v[:, F["max"]]))
        l2 = np.sqrt(v[:, F["sum_sq"]])
    return {"mean": mean, "std": std, "max_abs": max_abs, "l2": l2, "finite": n_finite}


def record_to_json(values: np.ndarray) -> dict[str, float]:
    """One record's stored and derived statistics by name."""
    out = {name: float(values[i]) for i, name in enumerate(metadata.FIELDS)}
    d = derived(values)
    for k in ("mean", "std", "max_abs", "l2"):
        out[k] = float(d[k][0])
    return out


def numpy_stats(values: np.ndarray, dtype: str | None = None) -> np.ndarray:
    """The record of a numpy array, computed in numpy (the reference).

    The TensorFlow path (``stats.py``) must agree with this; tests compare
    the two, and tools without TensorFlow use it directly.

    Raises:
      TypeError: ``dtype`` (by default the array's) is not a supported float dtype.
    """
    arr = np.asarray(values)
    if dtype is None:
        dtype = str(arr.dtype)
    if dtype not in metadata.DTYPE_LIMITS:
        raise TypeError("numerics are only defined for float tensors, got %s" % dtype)
    x = arr.astype(np.float64).reshape(-1)
    finite = np.isfinite(x)
    xf = x[finite]
    absf = np.abs(xf)
    out = np.zeros(metadata.NUM_FIELDS, dtype=np.float64)
    out[F["count"]] = x.size
    out[F["nan"]] = np.count_nonzero(np.isnan(x))
    out[F["posinf"]] = np.count_nonzero(x == np.inf)
    out[F["neginf"]] = np.count_nonzero(x == -np.inf)
    out[F["min"]] = xf.min() if xf.size else np.nan
    out[F["max"]] = xf.max() if xf.size else np.nan
    out[F["sum"]] = xf.sum()
    out[F["sum_sq"]] = np.square(xf).sum()
    out[F["zeros"]] = np.count_nonzero(x == 0)
    out[F["overflow"]] = np.count_nonzero(absf > metadata.overflow_margin(dtype))
    out[F["underflow"]] = np.count_nonzero((absf > 0) & (absf < metadata.smallest_normal(dtype)))
    return out


def scalar_record(value: float, dtype: str = "float32") -> np.ndarray:
    """The record of one value held to ``dtype``'s range, without rounding it
    to ``dtype``: a value beyond the range counts as an overflow, not as Inf.

    (A global norm of finite float32 gradients can exceed float32's largest
    value; stored as float32 it would read as a fake +Inf.)
    """
    v = float(value)
    out = np.zeros(metadata.NUM_FIELDS, dtype=np.float64)
    out[F["count"]] = 1
    if np.isnan(v):
        out[F["nan"]] = 1
        out[F["min"]] = out[F["max"]] = np.nan
        return out
    if np.isinf(v):
        out[F["posinf" if v > 0 else "neginf"]] = 1
        out[F["min"]] = out[F["max"]] = np.nan
        return out
    out[F["min"]] = out[F["max"]] = out[F["sum"]] = v
    with np.errstate(over="ignore"):
        out[F["sum_sq"]] = v * v
    out[F["zeros"]] = v == 0
    out[F["overflow"]] = abs(v) > metadata.overflow_margin(dtype)
    out[F["underflow"]] = 0 < abs(v) < metadata.smallest_normal(dtype)
    return out


def global_norm(grad_records: np.ndarray) -> float:
    """The L2 norm of all gradients together from their records ``[n, F]``:
    NaN where any element is NaN, else Inf where any is ±Inf (as
    ``tf.linalg.global_norm``), else sqrt of the summed squares in float64."""
    g = np.asarray(grad_records, np.float64).reshape(-1, metadata.NUM_FIELDS)
    if g[:, F["nan"]].sum() > 0:
        return float("nan")
    if (g[:, F["posinf"]] + g[:, F["neginf"]]).sum() > 0:
        return float("inf")
    return float(np.sqrt(g[:, F["sum_sq"]].sum()))


def global_norm_record(grad_records: np.ndarray, dtype: str = "float32") -> np.ndarray:
    """The record of the global gradient norm, held to ``dtype``'s range:
    finite gradients never make a non-finite record."""
    return scalar_record(global_norm(grad_records), dtype)
