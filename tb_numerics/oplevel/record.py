"""The record of one op output at one step, as op-level recording reports it.

``OpRecord`` is what ``OpNumerics.first_bad`` and ``oplevel.replay_step``
return: the first op of a step, in execution order, whose output holds a
NaN or an Inf, with its source line, phase and, where the recorder saw them,
its inputs' ranges ("Log of an input whose min is exactly 0").

It is also what an eager block or a replay writes beside its op records at
a step where one is non-finite: one numerics record under
``metadata.OP_MARK_TAG`` whose description is ``OpRecord.to_json()``,
naming the op and which of its tag's records at that step (``occurrence``)
ran first (``mark_record``). Execution order across the iterations of a
loop (an op whose record of iteration 3 went bad because of an op after it
in iteration 2) is known only there: a tag's ``TensorInfo.order`` is where
the op first ran. The analysis reads it (older readers show an empty row);
``parse_mark`` checks one.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Sequence

import numpy as np
from tensorboard.compat.proto import summary_pb2

from tb_numerics import metadata
from tb_numerics.oplevel.tags import OpTags
from tb_numerics.records import F, nonfinite_count, numpy_stats

__all__ = [
    "GRADIENT_OF",
    "OpRecord",
    "first_bad",
    "mark_record",
    "op_record",
    "parse_mark",
]

# A gradient op's description: "<forward op's line>, gradient of <its tag>".
GRADIENT_OF = ", gradient of "


@dataclasses.dataclass(frozen=True)
class OpRecord:
    """An op output's record at one step: the first non-finite one, as
    ``OpNumerics.first_bad`` and ``replay_step`` return it.

    ``source`` is the user's line that made the op, ``file.py:LINE
    (function)``; for a gradient op, the line of the forward op it
    differentiates (``description`` says which). ``inputs`` holds, for each
    float input of the op at that step, its element count, shape, min, max
    (of the finite values), zero count and NaN / +Inf / -Inf counts, and
    ``name``, the scoped name of the op that made it (``mlp/dense_2/Relu``)
    where the replay saw that op run, where the recorder saw them
    (``replay_step``); else it is empty.
    """

    tag: str
    op_type: str
    source: str
    description: str
    phase: str
    step: int | None
    record: tuple[float, ...]
    inputs: tuple[dict[str, Any], ...] = ()
    # Each input's record, whose ranges ``inputs`` shows.
    input_records: tuple[tuple[float, ...], ...] = dataclasses.field(default=(), repr=False)
    occurrence: tuple[int, int] = (1, 1)  # (k, n): the k-th of its tag's n records at the step
    # Per input: whether its -Inf is intended (``passes_mask``): a mask the program wrote.
    inputs_masked: tuple[bool, ...] = ()

    def reads_nonfinite(self) -> bool:
        """Whether an input of the op already held a NaN or an Inf (the op
        did not make it: it read a value made non-finite before the step);
        an intended -Inf (a mask) does not count."""
        if not self.input_records:
            return False
        masked = np.asarray(self.inputs_masked or [False] * len(self.input_records), bool)
        return bool(np.any(nonfinite_count(np.asarray(self.input_records), masked) > 0))

    def beyond_loss_scaling(self) -> bool:
        """Whether no loss scale made this op's NaN or Inf: a forward (or
        input) op made it itself, where a LossScaleOptimizer's skip is the
        scale overflowing float16 in a gradient op."""
        return self.phase != "backward" and not self.reads_nonfinite()

    @property
    def name(self) -> str:
        """The op's name: its tag without ``ops/``."""
        return OpTags.op_name(self.tag)

    def to_json(self) -> dict[str, Any]:
        """The op as the report's ``first_anomaly.op`` object (name, type,
        source, phase), with its tag, occurrence, counts and inputs' ranges."""
        v = self.record
        return {
            "tag": self.tag,
            "occurrence": list(self.occurrence),
            "name": self.name,
            "type": self.op_type,
            "source": self.source,
            "phase": self.phase,
            "step": self.step,
            "nan": int(v[F["nan"]]),
            "posinf": int(v[F["posinf"]]),
            "neginf": int(v[F["neginf"]]),
            "size": int(v[F["count"]]),
            "inputs": [dict(i) for i in self.inputs],
        }


def float_inputs(inputs, names: Sequence[str | None]) -> list[tuple[Any, str | None]]:
    """Each float input (eager tensors) with the name of the op that made it, where known."""
    return [(t, names[k] if k < len(names) else None) for k, t in enumerate(inputs or ())
            if t is not None and t.dtype.is_floating]


def _input_range(t: Any, name: str | None, v: Sequence[float]) -> dict[str, Any]:
    """An input's name (where known), shape, count, min, max (of the finite
    values), zeros and non-finite counts, from its record: what ``inputs`` shows."""
    return {**({"name": name} if name else {}),
            "shape": list(t.shape.as_list()) if t.shape.rank is not None else None,
            "count": int(v[F["count"]]), "min": float(v[F["min"]]), "max": float(v[F["max"]]),
            **{k: int(v[F[k]]) for k in ("zeros", "nan", "posinf", "neginf")}}


def passes_mask(output: Sequence[float], inputs: Sequence[Sequence[float]], masked: Sequence[bool]) -> bool:
    """Whether an op's output holds -Inf and nothing else non-finite, every
    -Inf it read being a mask's (``masked``: per input record), and it read
    one: it passes an intended -Inf on (``where(mask, scores, -inf)``, the
    scores plus that mask, a transpose of it), and made nothing itself.

    A mask's -Inf is one the program wrote: a -Inf constant (a literal the
    step did not compute, or an op that reads no float and makes only -Inf:
    a ``full`` of it), or an output that passed one on. An op that makes
    a NaN or a +Inf of it (a softmax over a row that is all -Inf) is the first
    non-finite op; so is one whose -Inf comes from finite values (a log of 0).
    """
    out = np.asarray(output, np.float64)
    if not (out[F["neginf"]] > 0 and out[F["nan"]] == 0 and out[F["posinf"]] == 0):
        return False
    read = not len(inputs)  # a constant made from no float: -inf filled in
    for v, m in zip(inputs, masked):
        v = np.asarray(v, np.float64)
        if v[F["nan"]] > 0 or v[F["posinf"]] > 0 or (v[F["neginf"]] > 0 and not m):
            return False
        read |= bool(v[F["neginf"]] > 0)
    return read


def op_record(tag: str, vec: Any, info: metadata.TensorInfo, step: int | None,
              inputs: Any = None, names: Sequence[str | None] = (), masked: Sequence[bool] = ()) -> OpRecord:
    """The OpRecord of one record, with its op's inputs' ranges where ``inputs``
    are given (named by ``names``, the ops that made them, where known;
    ``masked``: per float input, whether its -Inf is a mask's)."""
    v = np.asarray(vec, np.float64)
    floats = float_inputs(inputs, names)
    input_records = input_records_of(floats)
    return OpRecord(
        tag=tag,
        op_type=info.op_type,
        source=info.description.split(GRADIENT_OF)[0],
        description=info.description,
        phase=info.phase,
        step=step,
        record=tuple(float(x) for x in v),
        inputs=tuple(_input_range(t, n, r) for (t, n), r in zip(floats, input_records)),
        input_records=input_records,
        inputs_masked=tuple(bool(m) for m in masked),
    )


def input_records_of(floats: Sequence[tuple[Any, str | None]]) -> tuple[tuple[float, ...], ...]:
    """The record of each float input (``float_inputs``'s pairs)."""
    return tuple(tuple(numpy_stats(np.asarray(t.numpy(), np.float64), "float64")) for t, _ in floats)


def first_bad(recs: Sequence[tuple[str, Any, metadata.TensorInfo]], step: int | None,
              found: OpRecord | None = None) -> OpRecord | None:
    """The first non-finite record of ``recs`` (one step's, in execution order),
    with its occurrence; ``found``, where given, is the first non-finite
    eager op's record made as ops ran (with its inputs): used where it is
    that record, not where a nested graph's record ran before it."""
    for i, (tag, vec, info) in enumerate(recs):
        v = np.asarray(vec, np.float64)
        if nonfinite_count(v, info.neginf_ok) > 0:
            same = [t == tag for t, _, _ in recs]
            occurrence = (sum(same[:i]) + 1, sum(same))
            made = found if found is not None and found.tag == tag else op_record(tag, v, info, step)
            return dataclasses.replace(made, occurrence=occurrence)
    return None


def mark_record(op: OpRecord) -> tuple[np.ndarray, summary_pb2.SummaryMetadata]:
    """The statistics (of no values) and metadata of the mark naming ``op``."""
    info = metadata.TensorInfo(role="other", op_type="OpMark", description=json.dumps(op.to_json()))
    return numpy_stats(np.zeros(0, np.float32)), metadata.create_summary_metadata(info)


def parse_mark(text: bytes | str) -> dict[str, Any]:
    """The op of a mark's string tensor, as ``OpRecord.to_json`` wrote it.

    Raises:
      metadata.FormatError: the text is not such an object.
    """
    try:
        op = json.loads(text)
    except (TypeError, ValueError, UnicodeDecodeError) as e:
        raise metadata.FormatError("a first-op mark is not JSON: %s" % e) from None
    need = {"tag": str, "name": str, "type": str, "source": str, "phase": str, "occurrence": list}
    bad = [k for k, t in need.items() if not isinstance(op, dict) or not isinstance(op.get(k), t)]
    if bad:
        raise metadata.FormatError("a first-op mark lacks %s" % ", ".join(bad))
    return op
