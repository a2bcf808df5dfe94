"""The Keras callback's gated update: the optimizer's update held back at a step that went bad.

Inside the training step, around each optimizer update the step applies
(``StepProgram.recorded_apply`` for the model's optimizer, and every other
optimizer the model holds, as a GAN's second one), ``UpdateGate`` decides
whether the update runs: not where the step's loss or a gradient holds a
NaN or an Inf when a replay or an ``on_anomaly`` policy may need the
weights that step used, not where the spike trigger fired, with a policy
not where the state the forward pass updated (BatchNormalization's moving
statistics) went non-finite, and not after an update of the same step that
was held back, so that a step is held back whole: where it is, that state
is put back as the step began (a batch of NaN inputs makes the moving
statistics NaN in the forward pass, before any update: a skipped step that
left them would leave a model whose every prediction is NaN). It also
computes, from the step's records, the values an ``on_anomaly`` policy acts
on: the loss, the global gradient norm and the trigger
(``_survive_tf.TRIGGER_CODES``).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import numpy as np
import tensorflow as tf

from tb_numerics import _survive_tf, _tf_internal, analysis, stats
from tb_numerics._keras_plan import RowPlan
from tb_numerics.records import F
from tb_numerics.survive import Spike

__all__ = ["UpdateGate", "apply_if_all_finite"]


class UpdateGate:
    """The gated updates of a training step.

    Args:
      plan: the step's rows.
      safe_range: the user's allowlist of -Inf.
      lso: whether the model's optimizer is a LossScaleOptimizer (which
        skips a non-finite step itself).
      spike: the spike trigger, or None.
      gates: whether updates are gated at all (a replay or a policy).
      listed: whether the host may hold a batch's update back (``listed``).
      policy: whether an ``on_anomaly`` policy acts on the held steps (then
        a step whose forward-pass state went non-finite is held back too).

    Attributes:
      held_vars: the variables the gated updates hold back at a bad step.
      spike: the spike trigger's window (``_survive_tf.SpikeWindow``), or None.
    """

    def __init__(self, plan: RowPlan, safe_range: analysis.SafeRange, *, lso: bool, spike: Spike | None, gates: bool,
                 listed: bool = False, policy: bool = False):
        self._plan, self._safe_range, self.lso, self.gates = plan, safe_range, lso, gates
        # A policy holds back a step whose recorded state went non-finite.
        self._holds_state = bool(policy and gates and plan.state_rows)
        self.spike = _survive_tf.SpikeWindow(spike) if spike is not None and gates else None
        # Set by the host before a batch the user listed to skip (``skip_batches``).
        self.listed = _tf_internal.untracked_variable(np.bool_(False), "tb_numerics_listed") if listed else None
        self.held_vars: list = []

    def trigger(self, head: tf.Tensor) -> dict[str, tf.Tensor]:
        """The step's loss, global gradient norm and trigger (``_survive_tf.
        TRIGGER_CODES``) from its records (all replicas' together): a
        non-finite loss, else non-finite gradients, else a spike."""
        plan, codes = self._plan, _survive_tf.TRIGGER_CODES
        loss_row = head[plan.loss_row]
        loss = tf.where(loss_row[F["count"]] > 0, loss_row[F["sum"]] / tf.maximum(loss_row[F["count"]], 1.0),
                        tf.constant(np.nan, tf.float64))
        grad_rows = sorted(plan.grad_rows.values())
        grad_norm = (tf.sqrt(tf.reduce_sum(tf.gather(head[:, F["sum_sq"]], grad_rows))) if grad_rows
                     else tf.constant(np.nan, tf.float64))
        bad = stats.nonfinite_count(head, plan.neginf_ok(self._safe_range)[: plan.weight_row0]) > 0
        code, mean, std = (self.spike.check(loss, grad_norm) if self.spike is not None else
                           (tf.constant(0, tf.int64), tf.constant(0.0, tf.float64), tf.constant(0.0, tf.float64)))
        if plan.state_rows:
            state_bad = tf.reduce_any(tf.gather(bad, list(plan.state_rows)))
            code = tf.where(state_bad, tf.constant(codes["nonfinite_state"], tf.int64), code)
        grads_bad = tf.reduce_any(tf.gather(bad, grad_rows)) if grad_rows else tf.constant(False)
        code = tf.where(grads_bad, tf.constant(codes["nonfinite_gradients"], tf.int64), code)
        code = tf.where(bad[plan.loss_row], tf.constant(codes["nonfinite"], tf.int64), code)
        return {"trigger": code, "loss_value": loss, "grad_norm": grad_norm, "spike_mean": mean, "spike_std": std}

    def gated_apply(self, apply: Callable[..., Any], grads: list, variables: list, trace: Any, ctx: Any,
                    trigger: tf.Tensor) -> Any:
        """The optimizer's update, not applied where the loss or a gradient
        holds a NaN or an Inf when a replay or a policy may need the weights
        that step used, where a spike trigger fired (``trigger``), with a
        policy where the forward pass's state went non-finite (``trigger``),
        or where an update before it in the step was held back.

        The decision rests on the exact counts of the loss's and the
        gradients' records, which the step makes anyway (one record kernel
        op each on a CPU): no pass over a gradient of its own, and no branch
        that would count their elements. A LossScaleOptimizer skips such
        steps itself.
        Under several replicas the update merges across them, which cannot
        sit in a branch taken in a replica: the branch is taken in the
        cross-replica context (``apply_if_all_finite``), under the
        strategies a replay supports (MirroredStrategy).
        """
        if not self.gates or (self.lso and self.spike is None and self.listed is None and not self._holds_state
                              and trace.applied_so_far is None):
            return apply(grads, variables)
        self._hold(variables, grads)
        ok = tf.constant(True) if self.lso else self._finite(grads, variables, trace)
        if self._holds_state:
            ok = tf.logical_and(ok, tf.not_equal(trigger, _survive_tf.TRIGGER_CODES["nonfinite_state"]))
        if self.listed is not None:
            ok = tf.logical_and(ok, tf.logical_not(self.listed.read_value()))
        if self.spike is not None:
            codes = _survive_tf.TRIGGER_CODES
            spiked = (trigger == codes["loss_spike"]) | (trigger == codes["grad_norm_spike"])
            ok = tf.logical_and(ok, tf.logical_not(spiked))
        return self._apply_if(ok, apply, grads, variables, trace, ctx)

    def gated_other_apply(self, apply: Callable[..., Any], grads: list, variables: list, trace: Any) -> Any:
        """The update of another optimizer the step applies (a GAN's second
        one), held back with the step: where its gradients are not finite, or
        an update before it in the step was held back; and where it is held
        back, the model's optimizer's update after it too."""
        if not self.gates or trace is None:
            return apply(grads, variables)
        self._hold(variables, grads)
        present = [g for g in grads if g is not None]
        ok = stats.all_finite(present) if present else tf.constant(True)
        self._apply_if(ok, apply, grads, variables, trace, stats.replica_context())
        return None

    def state_before(self) -> list[tf.Tensor] | None:
        """The state the forward pass updates, read as the step begins (the
        automatic control dependencies order these reads before the forward
        pass's writes), for ``put_back``; None where no update is gated or
        there is no such state. Under several replicas, each replica's own."""
        if not self.gates or not self._plan.forward_state:
            return None
        return [tf.convert_to_tensor(v) for v in self._plan.forward_state]

    def put_back(self, trace: Any, held: tf.Tensor, trigger: tf.Tensor) -> None:
        """Where the step's update was held back (``held``), puts the state
        the forward pass updated back as the step began, so that the step
        leaves no trace; not where a LossScaleOptimizer skipped an update
        whose loss was finite (its scale's calibration: the forward pass
        was sound)."""
        before = trace.state_before
        if not before:
            return
        if self.lso:
            held = tf.logical_and(held, tf.not_equal(trigger, _survive_tf.TRIGGER_CODES["nonfinite_gradients"]))
        ctx = stats.replica_context()
        if ctx is not None:  # the decision is the same on every replica; their variables are written outside them
            ctx.merge_call(functools.partial(_put_back_every_replica, variables=self._plan.forward_state),
                           args=(held, *before))
            return

        # A select, not a cond: the forward pass wrote this state this step
        # anyway (a norm's moving statistics), so a select and a write cost
        # no more than that, and a cond's branches took an input per variable
        # and per value (ResNet-50's 106: 0.4 s of tracing).
        for v, value in zip(self._plan.forward_state, before):
            v.assign(tf.where(held, value, tf.convert_to_tensor(v)))

    def _hold(self, variables: list, grads: list) -> None:
        known = {id(v) for v in self.held_vars}
        self.held_vars += [v for g, v in zip(grads, variables) if g is not None and id(v) not in known]

    def _finite(self, grads: list, variables: list, trace: Any) -> tf.Tensor:
        """Whether the step's loss and gradients are all finite, read off
        their records' exact counts (no -Inf allowed) where the step made
        them; the others (a gradient whose row is off) are counted."""
        index = {id(v): j for j, v in enumerate(self._plan.variables)}
        records, counted = [], []
        for g, v in zip(grads, variables):
            if g is None:
                continue
            record = trace.grad_records.get(index.get(id(v), -1))
            if record is None:
                counted.append(g)
            else:
                records.append(record)
        if trace.loss is not None and trace.loss_record is not None:
            records.append(trace.loss_record)
        elif trace.loss is not None:
            counted.append(trace.loss)
        ok = (tf.equal(tf.reduce_sum(stats.nonfinite_count(tf.stack(records))), 0.0) if records
              else tf.constant(True))
        return tf.logical_and(ok, stats.all_finite(counted)) if counted else ok

    def _apply_if(self, ok: tf.Tensor, apply: Callable[..., Any], grads: list, variables: list, trace: Any,
                  ctx: Any) -> tf.Tensor:
        """Runs the update where ``ok`` and every update of the step before it
        ran; whether it ran (also kept in ``trace.applied_so_far``)."""
        if trace.applied_so_far is not None:
            ok = tf.logical_and(ok, trace.applied_so_far)
        if ctx is not None:
            applied = ctx.merge_call(functools.partial(apply_if_all_finite, apply=apply, variables=variables),
                                     args=(ok, grads))
        else:

            def update() -> tf.Tensor:
                apply(grads, variables)
                return tf.constant(True)

            applied = tf.cond(ok, update, lambda: tf.constant(False))
        trace.applied_so_far = applied
        return applied


def apply_if_all_finite(strategy: Any, finite: Any, grads: Any, *, apply: Callable[..., Any],
                         variables: list) -> tf.Tensor:
    """Under several replicas, in the cross-replica context: runs the
    optimizer's update on every replica where every replica's loss and
    gradients are finite (``finite``: each replica's verdict); whether it ran.

    Keras' own LossScaleOptimizer holds back an update under a strategy the
    same way: a cond around an update that merges across replicas must be
    taken outside them, and its branch enters the replicas again.
    """
    every = tf.reduce_all(tf.stack(strategy.experimental_local_results(finite)))

    def update() -> tf.Tensor:
        strategy.extended.call_for_each_replica(apply, args=(grads, variables))
        return tf.constant(True)

    return tf.cond(every, update, lambda: tf.constant(False))


def _put_back_every_replica(strategy: Any, held: Any, *before: Any, variables: list) -> tf.Tensor:
    """Under several replicas, in the cross-replica context: where the step
    was held back (one decision for all replicas), writes each replica's
    copy of ``variables`` back to its own value ``before`` the step, as the
    optimizer's update writes them (``extended.update``)."""
    held = strategy.experimental_local_results(held)[0]

    def restore() -> tf.Tensor:
        for v, value in zip(variables, before):
            strategy.extended.update(_survive_tf.tf_variable(v), lambda var, b: var.assign(b), args=(value,),
                                     group=False)
        return tf.constant(True)

    return tf.cond(held, restore, lambda: tf.constant(False))
