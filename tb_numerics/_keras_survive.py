"""The Keras callback's ``on_anomaly`` policy on the host: skip, rewind or stop, each an event in the run.

Inside the step the gate (``_keras_gate``) holds back the update of a step
whose loss or gradients are not finite, or that the spike trigger caught;
after the batch, on the main thread and before the next step,
``SurvivalHost.after`` decides what to do about each held step
(``survive.Survival``) and does it:

* skip: nothing more to do for the weights (the update was not applied);
  the metrics the step left non-finite (Keras' loss tracker) are reset, so
  that the epoch's logs and callbacks such as ``EarlyStopping`` see a number;
* rewind: the state snapshot (``_survive_tf.StateSnapshot``, taken after
  every ``snapshot_every``-th healthy step) is put back, or the newest file
  a ``ModelCheckpoint`` wrote, and the learning rate scaled; the records'
  steps go on (``StepProgram.shift_steps``) while the optimizer's step
  counter, which a learning-rate schedule reads, goes back;
* stop: ``fit`` stops and the diagnosis is printed (``stop_training``).

Each is an event written into the run (``record_writer.write_action``) with
the step, the epoch and batch index, the trigger, the first non-finite
record's tag and counts (or the spike's numbers), and the verdict of the
step's replay at op level (the op, or that the fault is not reproducible).
A LossScaleOptimizer's own skips (non-finite gradients at a loss scale
above 1) are its business, never an event; at a scale of 1 or less, loss
scaling cannot be what fails, and the skip counts as a non-finite step (the
analysis' rule, ``rules.LOSS_SCALE_HANDLED_MIN``).
"""

from __future__ import annotations

import glob
import os
import re
import sys
from typing import Any, Callable

import numpy as np

from tb_numerics import records, report_text, rules, survive
from tb_numerics._keras_diagnosis import Diagnosis
from tb_numerics._keras_host import HostRecords, StepValues, step_counter
from tb_numerics._keras_patch import other_optimizers
from tb_numerics._keras_plan import RowPlan
from tb_numerics._keras_program import StepProgram, strategy_of
from tb_numerics._survive_tf import TRIGGER_CODES, LearningRate, StateSnapshot, optimizer_state

__all__ = ["SurvivalHost"]

# Replays at op level a run's events may run (each costs an eager step at op level).
_MAX_REPLAYS = 3
# The event's trigger of a step's code (0: held back after another optimizer's non-finite update).
_TRIGGER_OF_CODE = {0: "nonfinite", TRIGGER_CODES["nonfinite"]: "nonfinite",
                    TRIGGER_CODES["nonfinite_gradients"]: "nonfinite", TRIGGER_CODES["nonfinite_state"]: "nonfinite",
                    TRIGGER_CODES["loss_spike"]: "loss_spike",
                    TRIGGER_CODES["grad_norm_spike"]: "grad_norm_spike"}


class SurvivalHost:
    """Carries out the ``on_anomaly`` policy after each batch.

    Args:
      model: the model ``fit`` trains.
      policy: the policy.
      plan, program, diagnosis, host: the callback's other parts.
      safe_range: the analysis' safe range (its allowlist of -Inf).
      set_attribute: sets an instance attribute until training ends (a
        learning-rate schedule is wrapped so that the factor reaches it).
      first_verdict: the callback's replay verdict on the run's first
        anomaly, once it ran (an event at that step reuses it).
      skip_batches: (epoch, batch) of the batches whose update is held back
        whatever they hold (``survive.failed_batches`` of an earlier run).
    """

    def __init__(self, model: Any, policy: survive.OnAnomaly, plan: RowPlan, program: StepProgram,
                 diagnosis: Diagnosis, host: HostRecords, *, safe_range: Any, set_attribute: Callable[..., None],
                 first_verdict: Callable[[], dict | None], skip_batches: frozenset = frozenset()):
        self._model, self._policy, self._plan, self._program = model, policy, plan, program
        self._skip_batches, self._listed_now = skip_batches, False
        self._diagnosis, self._host, self._safe_range = diagnosis, host, safe_range
        self._first_verdict = first_verdict
        self._survival = survive.Survival(policy)
        self.snapshot: StateSnapshot | None = None
        if policy.may_rewind and policy.checkpoint is None:
            optimizers = [model.optimizer] + other_optimizers(model)
            variables = (list(model.trainable_variables) + list(model.non_trainable_variables)
                         + optimizer_state(optimizers))
            self.snapshot = StateSnapshot(variables)
        scales_lr = policy.lr_factor is not None and policy.may_rewind
        self._lr = LearningRate(model.optimizer, set_attribute) if scales_lr else None
        self._replays = 0
        self.epoch = 0

    def begin(self) -> None:
        """At the start of training: the first snapshot (the state training starts from)."""
        if self.snapshot is not None:
            self.snapshot.take(_value(step_counter(self._model.optimizer)))

    def acts_on(self, values: StepValues) -> bool:
        """Whether the policy acts on a step: its update was held back, and
        not by a LossScaleOptimizer calibrating its scale."""
        lso_own = (self._program.lso and values.trigger == TRIGGER_CODES["nonfinite_gradients"]
                   and values.loss_scale >= rules.LOSS_SCALE_HANDLED_MIN)
        return values.held and not lso_own

    @property
    def listing(self) -> bool:
        """Whether the batch being handled is one ``skip_batches`` lists."""
        return self._listed_now

    def before(self, batch: int) -> None:
        """Before a batch: a listed one (``skip_batches``) has its update held back."""
        if (self.epoch, batch) in self._skip_batches:
            self._program.gate.listed.assign(True)
            self._listed_now = True

    def after(self, steps: list[tuple[np.ndarray, StepValues]], batch: int) -> bool:
        """Acts on the batch's steps (main thread, before the next step);
        True where training stops."""
        for i, (step_stats, values) in enumerate(steps):
            if not values.held:
                self._survival.healthy()
            elif self._listed_now and i == 0:
                self._skip_listed(values, batch - (len(steps) - 1))
            elif self.acts_on(values) and self._act(step_stats, values, batch - (len(steps) - 1 - i)):
                return True
        if self._listed_now:
            self._program.gate.listed.assign(False)
            self._listed_now = False
        last = steps[-1][1]
        if self.snapshot is not None and not last.held and (last.step + 1) % self._policy.snapshot_every == 0:
            self.snapshot.take(last.step + 1)
        return False

    def stop(self, step_stats: np.ndarray, values: StepValues, batch: int, why: str) -> None:
        """Writes the stop event of a step whose records went bad
        (``stop_on_anomaly``); the callback stops training."""
        self._act(step_stats, values, batch, stop_why=why)

    def _act(self, step_stats: np.ndarray, values: StepValues, batch: int, stop_why: str | None = None) -> bool:
        """Decides and acts on one held step (or stops, with ``stop_why``),
        writes its event; True to stop."""
        trigger = _TRIGGER_OF_CODE.get(values.trigger, "nonfinite")
        event: dict[str, Any] = {"epoch": self.epoch, "batch": batch, "trigger": trigger}
        event.update(self._what(step_stats, values))
        replay = self._replayed(step_stats, values)
        if replay is not None:
            event["replay"] = {k: replay[k] for k in ("reproduced", "reproducible", "why", "replica") if k in replay}
            if isinstance(replay.get("op"), dict):
                event["op"] = {k: replay["op"].get(k) for k in ("name", "type", "source", "phase")}
        action, why = self._survival.decide() if stop_why is None else ("stop", stop_why)
        if action == "rewind":
            rewound = self._rewind()
            if rewound is None:
                action, why = "stop", "no state to rewind to (no finite snapshot, or no checkpoint written yet)"
            else:
                event.update(rewound)
        event["action"] = action
        if why or action == "stop":
            event["reason"] = why or "on_anomaly is stop"
        if action != "stop":
            self._reset_nonfinite_metrics()
        self._host.writer.write_action(values.step, event)
        line = report_text.action_lines(survive.summarize([dict(event, step=values.step)]))[1]
        print("tb-numerics: %s" % line.strip(), file=sys.stderr)
        return action == "stop"

    def _skip_listed(self, values: StepValues, batch: int) -> None:
        """The event of a listed batch's skip: planned, so no anomaly of the
        policy's (it neither counts towards ``max_skips`` nor is replayed)."""
        event = {"epoch": self.epoch, "batch": batch, "trigger": "listed", "action": "skip", "tensor": None,
                 "detail": "listed in skip_batches (it failed in an earlier run)"}
        self._reset_nonfinite_metrics()
        self._host.writer.write_action(values.step, event)

    def _what(self, step_stats: np.ndarray, values: StepValues) -> dict[str, Any]:
        """The tensor and detail of the event: the first non-finite record of
        the step, or the spike's numbers."""
        trigger = _TRIGGER_OF_CODE.get(values.trigger, "nonfinite")
        if trigger != "nonfinite":
            loss = trigger == "loss_spike"
            name, value = ("loss", values.loss_value) if loss else ("gradients/global_norm", values.grad_norm)
            z = (value - values.spike_mean) / values.spike_std if values.spike_std > 0 else float("inf")
            detail = "%s %s is %s σ above the mean %s (σ %s) of the recent steps; the threshold is %s σ" % (
                "loss" if loss else "global gradient norm", rules.number(value), rules.number(z),
                rules.number(values.spike_mean), rules.number(values.spike_std), rules.number(self._policy.spike.z))
            return {"tensor": name, "value": value, "detail": detail}
        w0 = self._plan.weight_row0
        bad = np.flatnonzero(records.nonfinite_count(step_stats[:w0], self._plan.neginf_ok(self._safe_range)[:w0]) > 0)
        if not bad.size:
            return {"tensor": None, "detail": "an update before the model optimizer's in the step held a NaN or an Inf"
                    if values.trigger == 0 else "the update's gradients held a NaN or an Inf"}
        tag = self._plan.rows[int(bad[0])].tag
        return {"tensor": tag, "detail": "%s: %s" % (tag, rules.describe_nonfinite(step_stats[int(bad[0])]))}

    def _replayed(self, step_stats: np.ndarray, values: StepValues) -> dict | None:
        """The verdict of the step's replay at op level: the callback's for
        the run's first anomaly, else a new replay while any are left."""
        first = self._first_verdict()
        if first is not None and first.get("step") == values.step:
            return first
        spike = values.trigger in (TRIGGER_CODES["loss_spike"], TRIGGER_CODES["grad_norm_spike"])
        if spike or self._replays >= _MAX_REPLAYS or not self._diagnosis.can_replay:
            return None  # (a spike is finite: no op to find)
        self._replays += 1
        return self._diagnosis.replay(values.step, step_stats)

    def _rewind(self) -> dict[str, Any] | None:
        """Puts the last good state back and scales the learning rate; the
        event's fields, or None where there is no state to go back to."""
        opt = self._model.optimizer
        its_now = _value(step_counter(opt))
        if self.snapshot is not None:
            to = self.snapshot.restore()
            if to is None:
                return None
            out: dict[str, Any] = {"to_step": to}
        else:
            path = newest_checkpoint(self._policy.checkpoint)
            if path is None:
                return None
            self._model.load_weights(path)
            out = {"checkpoint": os.path.basename(path)}
        self._program.shift_steps(its_now - _value(step_counter(opt)))
        if self._lr is not None:
            with strategy_of(self._model).scope():  # a mirrored learning rate is written on every replica
                out.update(lr_factor=self._policy.lr_factor, lr=self._lr.scale(self._policy.lr_factor))
        return out

    def _reset_nonfinite_metrics(self) -> None:
        """Resets each metric whose state the held step left non-finite (the
        loss tracker's total): the epoch's mean then covers the other batches."""
        for m in getattr(self._model, "metrics", []):
            values = [v.numpy().astype(np.float64) for v in m.variables if v.numpy().dtype.kind == "f"]
            if any(records.nonfinite_count(records.numpy_stats(v)) > 0 for v in values):
                with strategy_of(self._model).scope():
                    m.reset_state()


def _value(variable: Any) -> int:
    """An integer variable's value (a step counter)."""
    return int(variable.numpy())


def newest_checkpoint(checkpoint: Any) -> str | None:
    """The newest file a Keras ``ModelCheckpoint`` wrote (its ``filepath``
    with every ``{field}`` of its format matched by any text), or None."""
    pattern = re.sub(r"\{[^{}]*\}", "*", str(checkpoint.filepath))
    found = [p for p in glob.glob(pattern) if os.path.isfile(p)]
    return max(found, key=os.path.getmtime) if found else None
