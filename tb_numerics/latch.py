"""The every-N latch: which steps a writer logging every N steps writes.

One rule, shared by the summary API (in-graph, per tag) and the Keras
callback (on the host, per step, its tags together):

* every step that is a multiple of N is written;
* so is each step whose records hold a *kind* of non-finite value (NaN,
  +Inf, -Inf) not seen before, whatever N is: the first non-finite step, and
  a NaN or a +Inf where there was only -Inf (an intended -Inf excluded: the
  caller leaves its bit out, see ``kinds``). A reader may allow -Inf that
  the writer was not told about (``--allow-neginf`` on the CLI): the first
  NaN after it must still be on disk;
* and, with it, the record logged just before it, unless that one was
  written already (it was at a multiple of N). "Before" includes an earlier
  record of the same step (a tag logged twice in one step).

Once every kind was seen the latch is closed: later non-finite steps are
written only at multiples of N.

A set of kinds is a bit mask (``KIND_BITS``: NaN 1, +Inf 2, -Inf 4).
``decide`` uses only ``%``, ``==``, ``<``, ``>=``, ``&``, ``|`` and ``~`` on
its arguments, so the same function runs on TensorFlow tensors (inside a
traced step: int64 integers and masks, bool flags) and on numpy scalars on
the host. Python ints and bools are turned into numpy scalars first (``~True``
is -2 on a Python bool, ``False`` on a numpy one).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

__all__ = ["Decision", "KIND_BITS", "NO_KINDS", "NO_PREVIOUS_STEP", "decide", "kinds"]

# ``prev_step`` before any record was logged.
NO_PREVIOUS_STEP = -1
# The bit of each kind of non-finite value in a kinds mask.
KIND_BITS = {"nan": 1, "posinf": 2, "neginf": 4}
# The mask of a finite record, and the latch's state before any record.
NO_KINDS = 0


class Decision(NamedTuple):
    """What to write for the record just logged, and the latch's new state."""

    write_now: Any  # bool: write this record
    write_prev: Any  # bool: write the record logged before it first
    seen: Any  # int mask: the kinds of non-finite values seen so far (the new state)


def _numpy(x: Any) -> Any:
    """``x`` unchanged if it is an array or tensor, else as a numpy scalar."""
    return x if hasattr(x, "dtype") else np.asarray(x)[()]


def kinds(nan: Any, posinf: Any, neginf: Any, neginf_ok: Any = False) -> int:
    """The kinds mask of host records from their NaN, +Inf and -Inf counts
    (numpy arrays of any shape, ``neginf_ok`` broadcast with them): the
    kinds any of them holds, -Inf left out where it is intended."""
    nan, posinf, neginf = (np.asarray(v) for v in (nan, posinf, neginf))
    neginf = neginf * ~np.asarray(neginf_ok, bool)
    present = {"nan": nan, "posinf": posinf, "neginf": neginf}
    return sum(bit for key, bit in KIND_BITS.items() if np.any(present[key] > 0))


def decide(step: Any, prev_step: Any, kinds: Any, seen: Any, every_n: int) -> Decision:
    """Applies the every-N rule to one logged record.

    Args:
      step: the record's step (an int64 scalar tensor, or an integer).
      prev_step: the step of the record logged before it (written or not),
        ``NO_PREVIOUS_STEP`` if none.
      kinds: the mask (``KIND_BITS``) of the non-finite values the record
        holds that are not intended; ``NO_KINDS`` for a finite record.
      seen: the latch's state: the mask of the kinds earlier records held
        (``NO_KINDS`` at first).
      every_n: N, a positive Python int.

    Returns:
      ``Decision(write_now, write_prev, seen)``: two bools and a mask, of
      the arguments' kind (tensors, or numpy scalars). The caller keeps
      ``step`` as the next ``prev_step`` and the returned ``seen``.
    """
    step, prev_step, kinds, seen = (_numpy(v) for v in (step, prev_step, kinds, seen))
    new_kind = ~((kinds | seen) == seen)
    regular = step % every_n == 0
    # The previous record, unless it was written already (at a multiple of
    # N) or is not before this one (steps went back: a restarted loop).
    prev_unwritten = (prev_step >= 0) & ~(prev_step % every_n == 0) & ~(step < prev_step)
    return Decision(regular | new_kind, new_kind & prev_unwritten, seen | kinds)
