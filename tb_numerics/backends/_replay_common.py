"""What the replays share: the op they found, as a record (JAX, PyTorch), and their verdict (TensorFlow's too).

A replay runs the failing step again and stops at the first primitive or
operator whose output holds a NaN or an Inf. ``found_op`` makes the
``OpRecord`` the report shows (``first_anomaly.op``) from that output and
its inputs, as host arrays; ``verdict`` turns it into the replay's verdict,
where an op that read an input already non-finite (a variable an earlier
update made so) is no op born in the step: "not reproduced", with why.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from tb_numerics.oplevel.record import OpRecord
from tb_numerics.records import F, numpy_stats

__all__ = ["batch_text", "found_op", "verdict"]


def batch_text(op_name: str) -> str:
    """Why a replay whose first non-finite op read the step's non-finite batch reproduced nothing."""
    return ("the step's batch held NaN or Inf as it arrived, and the first op that read it (%s) passed them on: "
            "no op of the step made them (the input's record says where they are)" % op_name)


def _input_range(x: np.ndarray, v: np.ndarray) -> dict[str, Any]:
    """An input's shape, count, min, max (of the finite values), zeros and non-finite counts."""
    return {"shape": list(x.shape), "count": int(v[F["count"]]), "min": float(v[F["min"]]),
            "max": float(v[F["max"]]), **{k: int(v[F[k]]) for k in ("zeros", "nan", "posinf", "neginf")}}


def found_op(name: str, op_type: str, source: str, phase: str, step: int, output: np.ndarray,
             inputs: Sequence[np.ndarray], masked: Sequence[bool] = ()) -> OpRecord:
    """The record of the op a replay stopped at.

    Args:
      name: the op's scoped name (``dense_1/log``); its tag is ``ops/<name>``.
      op_type: the primitive or operator (``log``).
      source: the user's line, ``file.py:LINE (function)``.
      phase: forward, backward or update.
      step: the step replayed.
      output: its non-finite output, on the host.
      inputs: its float inputs, on the host.
      masked: per input, whether its -Inf is a mask's (``oplevel.record.passes_mask``).
    """
    input_records = [numpy_stats(np.asarray(x, np.float64), "float64") for x in inputs]
    return OpRecord(tag="ops/" + name, op_type=op_type, source=source, description=source, phase=phase, step=step,
                    record=tuple(numpy_stats(np.asarray(output, np.float64), "float64")),
                    inputs=tuple(_input_range(np.asarray(x), v) for x, v in zip(inputs, input_records)),
                    input_records=tuple(tuple(v) for v in input_records), inputs_masked=tuple(map(bool, masked)))


def verdict(op: OpRecord | None, not_reproduced: str, batch_finite: bool = True) -> dict[str, Any]:
    """The replay's verdict on the op it found (None: every output was finite).

    Args:
      op: the first op whose output was not finite, or None.
      not_reproduced: why a replay may not reproduce the step, on this backend.
      batch_finite: whether every float tensor of the step's batch was finite.
    """
    if op is None:
        return {"reproduced": False, "why": not_reproduced}
    if op.reads_nonfinite() and not batch_finite:
        return {"reproduced": False, "why": batch_text(op.name)}
    if op.reads_nonfinite():
        return {"reproduced": False, "why": "the first non-finite op (%s) read values that were already "
                "non-finite: a variable an earlier update made so, which a replay of the step does not run "
                "(the update's records say which)" % op.name}
    return {"reproduced": True, "op": op.to_json()}
