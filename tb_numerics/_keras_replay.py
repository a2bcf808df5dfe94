"""Replay of the first non-finite step of ``model.fit`` at op level.

The Keras callback records layers cheaply on every step. At the first step
whose records hold a NaN or an Inf it runs that step again, eagerly and
without XLA, under ``oplevel.replay_step``, so the report names the exact
op and source line (issue 14). What a replay needs, and how it is kept:

* the step's batch: a step whose layer outputs, loss or gradients hold a
  NaN or an Inf copies its batch into variables inside the training step,
  in a branch nothing else waits for (a healthy step copies nothing);
* the model's variables as they were before the step's update: the update
  of a step whose loss or gradients are not finite is not applied, as a
  ``LossScaleOptimizer`` does (a NaN update would only poison the weights),
  so after such a step the weights are still the ones it used. Under a
  ``LossScaleOptimizer`` its own skip does this; under several replicas the
  update is not gated (its cross-replica merge cannot sit in a branch), and
  the replay says it cannot reproduce.

The replay runs the model's own ``train_step`` (a custom one too) with the
optimizer's update suppressed, and puts back every non-trainable variable
and metric it touched (BatchNorm's moving statistics, the loss tracker).
Its verdict is written into the run as one record, ``REPLAY_TAG``, whose
description holds the JSON the report shows as ``first_anomaly.replay``.
"""

from __future__ import annotations

import json
from typing import Any, Callable

import numpy as np
import tensorflow as tf

from tb_numerics import _tf_internal, metadata, records

__all__ = ["REPLAY_TAG", "StepReplay"]

REPLAY_TAG = metadata.REPLAY_TAG

_NOT_REPRODUCED = (
    "every op output was finite when the step ran again eagerly without XLA: dropout or a random "
    "data pipeline drew other values, or XLA computed the step differently; the layer-level answer stands"
)


class StepReplay:
    """Keeps each step's batch, and replays one step at op level on demand."""

    def __init__(self, model: Any, log_dir: str):
        self._model = model
        self._log_dir = log_dir
        # One set of buffers per batch signature a trace met (XLA cannot change
        # a variable's shape, and the last batch may be smaller), and which
        # set the last step wrote.
        self._sets: dict[tuple, tuple[Any, list[tf.Variable]]] = {}
        self._order: list[tuple] = []
        self._last: tf.Variable | None = None
        self._step: tf.Variable | None = None  # the step whose batch is kept
        self.why_not: str | None = None  # set where a replay cannot run
        self.active = False  # True while the replay runs the step

    def keep_if(self, bad: tf.Tensor, data: Any, step: tf.Tensor) -> None:
        """Copies the step's batch into buffers where ``bad`` (inside the traced
        step): a healthy step copies nothing."""
        leaves = [tf.convert_to_tensor(t) for t in tf.nest.flatten(data)]
        key = tuple((t.dtype.name, tuple(t.shape.as_list()) if t.shape.rank is not None else None) for t in leaves)
        if key not in self._sets:
            self._sets[key] = (data, [_buffer(t) for t in leaves])
            self._order.append(key)
        if self._last is None:
            self._last = _tf_internal.untracked_variable(np.int32(-1), "tb_numerics_batch_set")
            self._step = _tf_internal.untracked_variable(np.int64(-1), "tb_numerics_batch_step")
        buffers, index = self._sets[key][1], self._order.index(key)

        def copy() -> tf.Tensor:
            for buf, leaf in zip(buffers, leaves):
                buf.assign(leaf)
            self._last.assign(index)
            self._step.assign(tf.cast(step, tf.int64))
            return tf.constant(True)

        tf.cond(bad, copy, lambda: tf.constant(False))

    def batch(self) -> Any:
        """The last step's batch, as the step received it."""
        structure, buffers = self._sets[self._order[int(self._last.numpy())]]
        return tf.nest.pack_sequence_as(structure, [b.read_value() for b in buffers])

    def replay(self, step: int, train_step: Callable[[Any], Any]) -> dict[str, Any]:
        """Runs ``train_step`` on the kept batch once more at op level, at
        ``step``; writes and returns the verdict (``first_anomaly.replay``)."""
        from tb_numerics import oplevel

        verdict: dict[str, Any] = {"step": int(step)}
        if self.why_not or self._last is None or int(self._step.numpy()) != int(step):
            verdict.update(reproduced=False, why=self.why_not or "no batch was kept for this step: its layer "
                           "outputs, loss and gradients were finite (it went bad in the update)")
            return self._write(verdict)
        saved = _state(self._model)
        for m in getattr(self._model, "metrics", []):
            m.reset_state()  # the failing step left a NaN in the loss tracker's total
        writer = tf.summary.create_file_writer(self._log_dir, filename_suffix=".replay")
        self.active = True
        try:
            found = oplevel.replay_step(train_step, self.batch(), step=int(step), writer=writer)
        except Exception as e:  # noqa: BLE001 - a replay must never stop training
            found, verdict["why"] = None, "the replay raised %s: %s" % (type(e).__name__, e)
        finally:
            self.active = False
            writer.close()
            for var, value in saved:
                var.assign(value)
        if found is None:
            verdict.update(reproduced=False, why=verdict.get("why", _NOT_REPRODUCED))
        elif any(i.get("nan") or i.get("posinf") or i.get("neginf") for i in found.to_json()["inputs"]):
            # Not born in the step: it read a variable the failing step had already made non-finite.
            verdict.update(reproduced=False, why="the first non-finite op (%s) read values that were already "
                           "non-finite (a variable the failing step updated): %s" % (found.name, _NOT_REPRODUCED))
        else:
            verdict.update(reproduced=True, op=found.to_json())
        return self._write(verdict)

    def _write(self, verdict: dict[str, Any]) -> dict[str, Any]:
        from tb_numerics import record_writer

        info = metadata.TensorInfo(role="other", op_type="Replay", description=json.dumps(verdict, default=_num))
        with record_writer.NumericsRecordWriter(self._log_dir, filename_suffix=".verdict") as w:
            w.write(REPLAY_TAG, verdict["step"], records.numpy_stats(np.zeros(0, np.float32)), info)
        return verdict


def _buffer(t: tf.Tensor) -> tf.Variable:
    """A variable for one leaf of the batch: of its static shape where that is
    known (XLA keeps a variable's shape), else of any shape."""
    dtype = t.dtype.as_numpy_dtype
    if t.shape.is_fully_defined():
        return _tf_internal.untracked_variable(np.zeros(t.shape.as_list(), dtype), "tb_numerics_batch")
    return _tf_internal.untracked_variable(np.zeros([0], dtype), "tb_numerics_batch", shape=tf.TensorShape(None))


def _num(x: Any) -> Any:
    return float(x) if isinstance(x, (np.floating, np.integer)) else str(x)


def _state(model: Any) -> list[tuple[tf.Variable, np.ndarray]]:
    """The values of the variables a replayed step may change besides the
    trainable weights: non-trainable ones and the metrics'."""
    variables = list(model.non_trainable_variables)
    for m in getattr(model, "metrics", []):
        variables.extend(m.variables)
    seen: set[int] = set()
    out = []
    for v in variables:
        if id(v) not in seen:
            seen.add(id(v))
            out.append((v, v.numpy()))
    return out
