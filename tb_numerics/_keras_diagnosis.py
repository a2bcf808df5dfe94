"""The TensorFlow Keras callback at the first anomaly: diagnosis and the replay hand-off.

What runs on the host only where a step gives a reason, never on a healthy
one:

* the update check (``update_check``): after a step whose gradients'
  squares overflow (an optimizer that squares them), and at the first bad
  step for the step before it, the variables and slots an update left
  non-finite, written as that update's records;
* at the first bad step: the batch the replay kept (each replica's part),
  whose bad values the host counts (``_keras_host``), then the replay of
  the step at op level (``_keras_replay``), checked against the step's own
  records (a replay that went bad elsewhere is "not reproduced", not a
  wrong op).

The stop, the same on every backend, is ``_keras_host.stop_training``.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import tensorflow as tf

from tb_numerics import _keras_replay, analysis, detectors, records, update_check
from tb_numerics._keras_host import HostRecords, StepValues
from tb_numerics._keras_patch import StepHooks
from tb_numerics._keras_plan import RowPlan
from tb_numerics._keras_program import StepProgram, strategy_of
from tb_numerics.records import F

__all__ = ["Diagnosis", "why_no_replay"]


def why_no_replay(model: Any) -> str | None:
    """Why this fit cannot replay a step, or None where it can."""
    strategy = strategy_of(model)
    if strategy.num_replicas_in_sync > 1 and not isinstance(strategy, tf.distribute.MirroredStrategy):
        return "replay under several replicas is supported under MirroredStrategy only, not %s" % (
            type(strategy).__name__)
    return None


class Diagnosis:
    """The callback's work at a step that gives a reason.

    Args:
      model: the model ``fit`` trains.
      plan, program, hooks, host: the callback's other parts.
      replay: the step replay, or None.
      safe_range: the analysis' safe range.
      squared_by: the optimizer that squares the gradients ("" if none).

    Attributes:
      update_found: the step whose update made the state non-finite, once found.
    """

    def __init__(self, model: Any, plan: RowPlan, program: StepProgram, hooks: StepHooks, host: HostRecords,
                 replay: _keras_replay.StepReplay | None, *, safe_range: analysis.SafeRange, squared_by: str):
        self._model, self._plan, self._program, self._hooks, self._host = model, plan, program, hooks, host
        self._replay = replay
        self._safe_range = safe_range
        rows = sorted(plan.grad_rows.items(), key=lambda jr: jr[1]) if squared_by else []
        self._square_rows = np.array([r for _, r in rows], np.int64)
        self._square_limits = np.array([detectors.square_limit(str(plan.variables[j].dtype)) for j, _ in rows])
        self.update_found: int | None = None
        self._unscaled: set[int] = set()  # skipped steps whose gradients were non-finite with the scale at 1

    @property
    def can_replay(self) -> bool:
        """Whether a bad step can be replayed at op level."""
        return self._replay is not None and not self._replay.why_not

    # ------------------------------------------------------------ the update

    def check_squares(self, steps: list[tuple[np.ndarray, StepValues]]) -> bool:
        """After a step whose gradients' squares overflow (an optimizer that
        squares them): writes the state its update left, as the update's
        records where non-finite. Inline, before the next step changes it.
        Whether it found any."""
        if self.update_found is not None or not self._square_rows.size:
            return False
        for step_stats, values in steps:
            g = step_stats[self._square_rows]
            max_abs = np.maximum(np.abs(g[:, F["min"]]), np.abs(g[:, F["max"]]))
            if (np.nan_to_num(max_abs) > self._square_limits).any():
                self._host.wait()
                return self._write_nonfinite_state(values.step)
        return False

    def _write_nonfinite_state(self, step: int, variables: list | None = None) -> bool:
        """Writes the variables (the model's, or ``variables``) and optimizer
        slots that are not finite now, as the state the update of ``step``
        left; whether there were any."""
        variables = self._plan.variables if variables is None else variables
        found = update_check.nonfinite_state(self._model.optimizer, variables, step) if step >= 0 else []
        for tag, vec, info in found:
            self._host.writer.write_many(step, [(tag, vec, self._host.info(
                tag, "update", info.dtype, info.shape, description=info.description))])
        if found:
            self._host.writer.flush()
            self.update_found = step
        return bool(found)

    def born_in_update(self, step: int) -> bool:
        """At the first anomaly, whose update is held back: whether an earlier
        update made the weights or slots non-finite (then the step's replay
        could only read them). Found before, or now, before this step's
        update: the previous step's update made them."""
        if self.update_found is not None:
            return True
        # Only what this step's held-back update would have written is still
        # as the previous step left it: whatever else the step wrote (a second
        # optimizer's update, a layer's own assign) may have gone bad in it.
        held = self._program.gate.held_vars
        return not self._program.lso and bool(held) and self._write_nonfinite_state(step - 1, held)

    # ------------------------------------------------------------ the first bad step

    def kept_batches(self, step: int) -> list[Any]:
        """The batch the replay kept of ``step``: each replica's part that
        was kept (a replica whose records were finite kept none)."""
        if self._replay is None or self._replay.why_not:
            return []
        kept = (self._replay.batch(step, r) for r in range(strategy_of(self._model).num_replicas_in_sync))
        return [batch for batch in kept if batch is not None]

    def replay(self, step: int, step_stats: np.ndarray, loss_scale: float | None = None,
               later_steps: int = 0) -> dict[str, Any]:
        """The verdict on the first bad step: born in an earlier update, or
        the op the step's replay found (``first_anomaly.replay``).
        ``loss_scale``: the LossScaleOptimizer's scale at the step, if any;
        ``later_steps``: the steps of its call that ran after it."""
        if self.born_in_update(step):
            return {"step": step, "reproduced": False, "update_of_step": self.update_found}
        self._host.writer.flush()
        replica = self._bad_replica()
        return self._replay.replay(step, self._model.train_step, replica,
                                   check=functools.partial(self._replay_differs, step_stats, replica),
                                   loss_scale=loss_scale, unscaled=step in self._unscaled,
                                   later_steps=later_steps)

    def skip_beyond_scaling(self, step: int, loss_scale: float | None) -> bool:
        """At a step a LossScaleOptimizer skipped: whether its replay's first
        non-finite op is in the forward pass (or reads the batch), where no
        loss scale reaches, or its gradients are still non-finite with the
        scale at 1 (a sqrt's gradient at 0), rather than a gradient op the
        scale overflowed. The replay writes nothing here: the step's
        anomaly, if it is one, is replayed again (at 1 in the second case)
        and written as any first anomaly is."""
        if not self.can_replay:
            return False
        train_step, replica = self._model.train_step, self._bad_replica()
        found = self._replay.probe(step, train_step, replica, loss_scale)
        if found is None or found.beyond_loss_scaling():
            return found is not None
        if self._replay.probe(step, train_step, replica, 1.0) is None:
            return False
        self._unscaled.add(step)
        return True

    def _rows_bad_in_step(self, step_stats: np.ndarray, replica: int | None) -> np.ndarray:
        """Per row before the weights': whether the step's record (that
        replica's own, under several) holds a non-finite value."""
        if replica is not None:
            return self._program.replica_nonfinite.numpy()[replica] > 0
        w0 = self._plan.weight_row0
        return records.nonfinite_count(step_stats[:w0], self._plan.neginf_ok(self._safe_range)[:w0]) > 0

    def _replay_differs(self, step_stats: np.ndarray, replica: int | None) -> str | None:
        """Why the replay's layer outputs, loss and gradients disagree with the
        step's records about where values first went non-finite (a random
        op that drew other values in the replay), or None where they agree.

        They agree where the step's first non-finite record (in execution
        order) is non-finite in the replay too and none before it is. Later
        records may differ: XLA's ReluGrad masks a NaN the eager one passes.
        Rows the step does not compute are not compared: a layer called
        inside a loop of the step's graph records nothing there, while the
        eager replay runs the loop in Python and sees its calls.
        """
        in_step = self._rows_bad_in_step(step_stats, replica)
        in_step[list(self._plan.state_rows)] = False  # state the replay restores, not a tensor it records
        if not in_step.any():
            return None
        first = int(np.argmax(in_step))
        in_replay = self._replay_rows_nonfinite()
        rows = self._plan.rows
        if not in_replay[first]:
            return "%s, the step's first non-finite record, was finite in the replay" % rows[first].tag
        earlier = np.flatnonzero(in_replay[:first])
        if earlier.size:
            return "%s was non-finite in the replay, finite in the step, which first went bad at %s" % (
                rows[int(earlier[0])].tag, rows[first].tag)
        return None

    def _replay_rows_nonfinite(self) -> np.ndarray:
        """Per row before the weights': whether the replay's tensors of that row
        (its layer outputs, loss, gradient) hold a NaN or an Inf."""
        plan, trace = self._plan, self._hooks.replay_trace
        neginf_ok = plan.neginf_ok(self._safe_range)
        out = np.zeros(plan.weight_row0, bool)
        tensors: dict[int, list] = {plan.act_rows[i]: ts for i, ts in trace.outputs.items()}
        if trace.loss is not None:
            tensors[plan.loss_row] = [trace.loss]
        index = {id(v): j for j, v in enumerate(plan.variables)}
        for g, v in trace.grads:
            j = index.get(id(v))
            if g is not None and j is not None and j in plan.grad_rows:
                tensors[plan.grad_rows[j]] = [g.values if isinstance(g, tf.IndexedSlices) else g]
        for r, ts in tensors.items():
            if not plan.rows[r].present:
                continue
            for t in ts:
                out[r] |= bool(records.nonfinite_count(records.numpy_stats(np.asarray(t.numpy(), np.float64)), neginf_ok[r]) > 0)
        return out

    def _bad_replica(self) -> int | None:
        """Under several replicas, the replica whose records of the last step
        went bad first, in execution order (the lowest on a tie); None on one
        device. An allowlisted -Inf does not count."""
        if self._program.replica_nonfinite is None:
            return None
        bad = self._program.replica_nonfinite.numpy() > 0  # [replicas, rows]
        first = np.where(bad.any(axis=1), bad.argmax(axis=1), bad.shape[1])
        return int(np.argmin(first))
