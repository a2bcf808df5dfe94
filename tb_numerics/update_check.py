"""Failures born in the optimizer's update: the variables and optimizer
slots an applied update left non-finite, as records of that update.

Adam, RMSprop and Adagrad square the gradient: a finite float32 gradient
beyond about 1.8e19 makes Adam's second moment infinite, the next update
makes it (and the weights) NaN, and the first non-finite record is a
forward tensor two steps after the step that did it, with every recorded
gradient finite. The records of a step hold the values it computed, not
the state its update left, so the callback and the step guard look at that
state, on the host and only where a step gives a reason (never on a healthy
step):

* after an update whose gradients' squares overflow (``detectors.
  square_overflows``, for an optimizer that squares), the state it left;
* at the first non-finite step, whose update is held back, the state before
  it: non-finite there, the previous step's update made it.

A variable or slot found non-finite is written as a record of role
"update" (phase ``update``) at the step whose update made it, tagged
``update/<variable or slot path>``: the run's first anomaly names the step,
the phase and the variable or slot.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import numpy as np
import tensorflow as tf

from tb_numerics import metadata, records, stats

__all__ = ["UPDATE_PREFIX", "nonfinite_state"]

UPDATE_PREFIX = "update/"
Record = tuple[str, np.ndarray, metadata.TensorInfo]


def _path(variable: Any) -> str:
    path = getattr(variable, "path", None) or variable.name
    return path[:-2] if path.endswith(":0") else path


def _dtype(variable: Any) -> str:
    return tf.as_dtype(variable.dtype).base_dtype.name  # a Keras variable's dtype is a string


def _float(variables: Iterable[Any]) -> list[Any]:
    return [v for v in variables if v is not None and _dtype(v) in metadata.DTYPE_LIMITS]


def nonfinite_state(optimizer: Any, variables: Sequence[Any], step: int) -> list[Record]:
    """Records of the optimizer's slots and of ``variables`` (the ones its
    update writes) that hold a NaN or an Inf now, as the state the update of
    ``step`` left; slots first, as the update computes them before the
    variable. Runs eagerly, once per reason (a few reductions per variable).
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    mine = {id(v) for v in variables}
    slots = [v for v in _float(getattr(inner, "variables", [])) if id(v) not in mine]
    out: list[Record] = []
    for kind, group in (("the optimizer's slot", slots), ("the variable", _float(variables))):
        for v in group:
            path = _path(v)
            with tf.init_scope():
                vec = stats.tensor_stats(tf.convert_to_tensor(v), path).numpy()
            if records.nonfinite_count(vec) == 0:
                continue
            info = metadata.TensorInfo(
                dtype=_dtype(v), shape=tuple(v.shape), role="update",
                description="%s %s, as the update of step %d left it" % (kind, path, step))
            out.append((UPDATE_PREFIX + path, vec, info))
    return out
