"""The every-N latch: which steps a writer logging every N steps writes.

One rule, shared by the summary API (in-graph, per tag) and the Keras
callback (on the host, per step):

* every step that is a multiple of N is written;
* so is the first step whose records hold a non-finite value (an intended
  -Inf excluded: the caller passes ``nonfinite`` without it), whatever N is;
* and, with it, the record logged just before it, unless that one was
  written already (it was at a multiple of N). "Before" includes an earlier
  record of the same step (a tag logged twice in one step).

After the first non-finite step the latch stays closed: later non-finite
steps are written only at multiples of N.

``decide`` uses only ``%``, ``==``, ``<``, ``>=``, ``&``, ``|`` and ``~`` on its
arguments, so the same function runs on TensorFlow tensors (inside a traced
step: integers int64, flags bool tensors) and on numpy scalars on the host.
Python ints and bools are turned into numpy scalars first (``~True`` is -2
on a Python bool, ``False`` on a numpy one).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

__all__ = ["Decision", "NO_PREVIOUS_STEP", "decide"]

# ``prev_step`` before any record was logged.
NO_PREVIOUS_STEP = -1


class Decision(NamedTuple):
    """What to write for the record just logged, and the latch's new state."""

    write_now: Any  # bool: write this record
    write_prev: Any  # bool: write the record logged before it first
    latched: Any  # bool: a non-finite record has been seen (the new state)


def _numpy(x: Any) -> Any:
    """``x`` unchanged if it is an array or tensor, else as a numpy scalar."""
    return x if hasattr(x, "dtype") else np.asarray(x)[()]


def decide(step: Any, prev_step: Any, nonfinite: Any, latched: Any, every_n: int) -> Decision:
    """Applies the every-N rule to one logged record.

    Args:
      step: the record's step (an int64 scalar tensor, or an integer).
      prev_step: the step of the record logged before it (written or not),
        ``NO_PREVIOUS_STEP`` if none.
      nonfinite: the record holds a NaN or an Inf that is not intended.
      latched: the latch's state: an earlier record was non-finite.
      every_n: N, a positive Python int.

    Returns:
      ``Decision(write_now, write_prev, latched)``, each a bool of the
      arguments' kind (a bool tensor, or a numpy bool). The caller keeps
      ``step`` as the next ``prev_step`` and the returned ``latched``.
    """
    step, prev_step, nonfinite, latched = (_numpy(v) for v in (step, prev_step, nonfinite, latched))
    first_bad = nonfinite & ~latched
    regular = step % every_n == 0
    # The previous record, unless it was written already (at a multiple of
    # N) or is not before this one (steps went back: a restarted loop).
    prev_unwritten = (prev_step >= 0) & ~(prev_step % every_n == 0) & ~(step < prev_step)
    return Decision(regular | first_bad, first_bad & prev_unwritten, latched | nonfinite)
