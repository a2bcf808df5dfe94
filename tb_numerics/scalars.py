"""The first NaN or Inf among a run's standard scalar summaries.

Why: a logdir that holds only ``tf.summary.scalar`` values (what Keras' own
TensorBoard callback writes: ``epoch_loss`` going NaN) has no numerics
records, and a gate that passed it would pass any broken training that did
not log numerics. A scalar says when, never where: the anomaly it gives is
coarse (its tag and step), with a pointer to ``log_numerics`` for the op.

Numpy only, no TensorFlow.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

__all__ = ["HINT", "first_anomaly"]

HINT = (
    "a scalar summary (tf.summary.scalar) says at which step, not in which op: log the model's "
    "tensors with tb_numerics.log_numerics, or tb_numerics.keras.NumericsCallback for model.fit, "
    "to find the first op that went bad"
)


def first_anomaly(scalars: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, Any] | None:
    """The earliest non-finite scalar value of a run, in the report's
    ``first_anomaly`` shape, or None where every value is finite.

    Args:
      scalars: tag -> (steps, values), each in the order written.

    Returns:
      ``step``, ``tensor`` (the tag), ``nan``, ``posinf``, ``neginf``,
      ``size`` (1), ``last_healthy_step`` (that tag's last finite step
      before), ``description``, ``hint`` and ``source: "scalar summary"``;
      ``op_type`` and ``phase`` are None. Ties of step go to the first tag
      by name.
    """
    found = []
    for tag, (steps, values) in sorted(scalars.items()):
        bad = ~np.isfinite(values)
        if bad.any():
            i = int(np.argmin(np.where(bad, steps, np.iinfo(np.int64).max)))
            found.append((int(steps[i]), tag, i))
    if not found:
        return None
    step, tag, i = min(found)
    steps, values = scalars[tag]
    x = float(values[i])
    before = steps[(steps < step) & np.isfinite(values)]
    return {
        "step": step,
        "tensor": tag,
        "op_type": None,
        "phase": None,
        "source": "scalar summary",
        "nan": int(np.isnan(x)),
        "posinf": int(x == np.inf),
        "neginf": int(x == -np.inf),
        "size": 1,
        "description": "its scalar summary is %s" % ("NaN" if np.isnan(x) else "%+g" % x),
        "last_healthy_step": int(before.max()) if before.size else None,
        "last_finite_step": int(before.max()) if before.size else None,
        "hint": HINT,
        "likely_cause": None,
    }
