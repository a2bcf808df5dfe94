"""The guard of a hand-written training step: the update of a step whose
gradients are not finite is held back, and that step is replayed at op level.

    @tbn.guard(optimizer)
    @tf.function            # optional: eager steps are guarded the same way
    def train_step(x, y):
        ...                 # forward, log_numerics, tape.gradient, log_gradients
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

What ``model.fit`` gets from ``NumericsCallback(replay=True)``, for a custom
loop. While the step runs (and is traced) the optimizer's ``apply`` is
gated, as a ``LossScaleOptimizer`` gates it: the sum of the squares of each
gradient, one pass over it, is finite on a healthy step and the update runs
as it would. A loss logged with ``log_numerics`` before the update that is
not finite holds the update back too (a squared error or a sum that
overflowed to +Inf has finite gradients; the next step's forward pass would
overflow instead, far from the cause). Where the sum is not finite, the rare
branch looks closer:

* a gradient holds a NaN or an Inf: the update is held back, so the weights
  and the optimizer's slots stay those the step used. After the call the
  guard checks that state (``update_check``; non-finite, the previous
  step's update made it, and that is written as the anomaly), else replays
  the step once, eagerly, under ``oplevel.replay_step``, with the update
  suppressed, and every
  variable the replay wrote put back (BatchNorm's moving statistics, a seed
  generator's state), the step's own summaries not written again: the report's ``first_anomaly.op`` names the op and
  the line of your code;
* every gradient is finite but a square overflows (a gradient beyond about
  1.8e19 in float32): the update runs, and after the call the guard checks
  the state it left, so an Adam second moment made infinite is the anomaly
  of this step, in phase ``update``.

A batch that arrived non-finite is no op's fault: where a held step's
arguments hold a NaN or an Inf (a -Inf alone may be a mask the program
made), they are written as records of role ``input`` at that step, as
``NumericsCallback`` records each batch, with where the bad values are
(``metadata.BATCH_TAG``): the batch is the step's first anomaly. A step
given an iterator it takes its batch from is not replayed (it would take
another batch from training); its verdict says why. A step that the
program's own ``tf.debugging.check_numerics`` (or ``assert_all_finite``)
stops at the run's first NaN is replayed too before its error goes on, so
the report names the op that made the value, not only the check.

What the guard finds is filed at the step the step's own records were
written at, read where the update is: in a function that runs several
steps a call (a ``tf.range`` loop advancing a step variable), the failing
iteration's step; in a trace made at an int step, that int, as
``tf.summary`` writes it.

Under the guard, gradient tags say whether the optimizer squares them
(``TensorInfo.squared_by``), for the square-overflow warning. Under a
``LossScaleOptimizer`` the update is not gated (it skips non-finite steps
and lowers its scale itself), its loss scale is recorded each step (tag
``loss_scale``, as ``NumericsCallback`` records it: the scaled gradients'
non-finite records at a skip the scale handled are then information, not
the run's anomaly); at each of its skips the guard looks at the
step's replay, writing nothing, and where its first non-finite op is a
forward one (which no loss scale makes: a log(0), a float16 overflow
inside a layer), that step is replayed as a held one; a gradient op that
overflowed float16 is the scale's to handle, unless the step's gradients are
still non-finite with the scale at 1 (a sqrt's gradient at 0): then that
step is replayed at 1 and is the anomaly (the verdict says ``unscaled``).
A skip no scale made is the step's anomaly, as a held step is (for
``on_anomaly`` too), as ``NumericsCallback`` rules: a loss logged before the
update is not finite, the scale is below 1, the batch arrived non-finite,
or the look above found the op. The guard replays the first non-finite step;
later ones are gated, and replayed where an ``on_anomaly`` policy acts on
them (three replays in all).

A step that applies several optimizers (a GAN's discriminator and
generator) names them all, ``tbn.guard(d_optimizer, g_optimizer)``: an
update held back holds back the updates after it in the step too, so that
the replay runs on the weights the step used.

``on_anomaly`` (``tb_numerics.survive``): ``"skip"`` goes on after a held
step (up to ``max_skips`` in a row), ``"rewind"`` puts back a snapshot of
the variables the optimizers write, their slots and step counters and
``variables=`` (e.g. ``model.non_trainable_variables`` for BatchNorm's
statistics), taken every ``snapshot_every`` applied steps, and ``"stop"``
raises ``survive.TrainingStopped``, whose message says why. A skip and a
stop put ``variables=`` back as the call began (a batch of NaN inputs makes
BatchNorm's moving statistics NaN before any update is held back). Each action is
an event written to the default writer at the step's ``tf.summary`` step.
The spike trigger watches each optimizer's global gradient norm (the guard
does not see the loss).
"""

from __future__ import annotations

import collections.abc
import contextlib
import dataclasses
import functools
import inspect
import json
from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf

from tb_numerics import (
    _keras_batch, _keras_gate, _keras_host, _survive_tf, _tf_internal, metadata, oplevel, records, rules, stats,
    summary, survive, update_check,
)

__all__ = ["StepGuard", "guard"]

_HELD, _OVERFLOWED, _SPIKED, _SCALE_SKIPPED = 0, 1, 2, 3  # slots of the guard's counters
_NO_STEP = np.iinfo(np.int64).min  # a step slot not set
_MAX_REPLAYS = 3  # replays at op level a guard runs in all (the first held step's, then its policy's events')


def guard(*optimizers: Any, replay: bool = True, on_anomaly: "str | survive.OnAnomaly | None" = None,
          variables: Sequence[Any] = ()) -> Callable[[Callable[..., Any]], "StepGuard"]:
    """Decorates a training step that applies the optimizers' updates (see the module).

    Args:
      optimizers: the Keras optimizers the step calls ``apply_gradients`` or ``apply`` of.
      replay: replay the first step whose update was held back at op level.
      on_anomaly: ``"skip"``, ``"rewind"``, ``"stop"`` or a ``tb_numerics.OnAnomaly``;
        None: hold a bad step's update back and go on.
      variables: more variables a rewind puts back (the optimizers' own and
        the ones they update always are), and a skip or a stop puts back as
        the call began, e.g. ``model.non_trainable_variables``.
    """
    if not optimizers:
        raise ValueError("tbn.guard needs the optimizer(s) the step applies")
    return lambda fn: StepGuard(fn, optimizers, replay=replay, on_anomaly=on_anomaly, variables=variables)


@contextlib.contextmanager
def _loss_scale_one(optimizers: Sequence[Any]):
    """Every LossScaleOptimizer's scale at 1 inside, put back after: what a
    step's gradients are without loss scaling."""
    scales = [s for s in (getattr(opt, "dynamic_scale", None) for opt in optimizers) if s is not None]
    saved = [s.numpy() for s in scales]
    for s in scales:
        s.assign(tf.ones_like(s))
    try:
        yield
    finally:
        for s, value in zip(scales, saved):
            s.assign(value)


def _sq_sum(g: Any) -> tf.Tensor:
    """sum(g * g), one pass: not finite where an element is not, or where a
    square or the sum overflows (float32 for half-precision gradients)."""
    return stats.sq_norm(g.values if isinstance(g, tf.IndexedSlices) else tf.convert_to_tensor(g))


def _current_step() -> int | None:
    step = tf.summary.experimental.get_step()
    return None if step is None else int(step)


def _traced_step() -> tf.Tensor | None:
    """The step the step's own records are written at, read where the call
    is (``summary.read_step``): inside a loop that runs several steps per
    call, the step of that iteration; inside a trace made at an int step,
    that int, as ``tf.summary`` writes it. None where no step is set."""
    step = tf.summary.experimental.get_step()
    return None if step is None else summary.read_step(step)


class StepGuard:
    """A training step with its updates gated and its first bad step escalated."""

    def __init__(self, fn: Callable[..., Any], optimizers: Sequence[Any], *, replay: bool = True,
                 on_anomaly: "str | survive.OnAnomaly | None" = None, variables: Sequence[Any] = ()):
        functools.update_wrapper(self, fn)
        self._fn = fn
        self._opts = list(optimizers)
        self._replay = replay
        self._squared_by = next(filter(None, map(_keras_host.squares_gradients, self._opts)), "")
        # Steps held back, steps applied with an overflowing square, steps a spike held back,
        # steps a LossScaleOptimizer skipped (see _HELD).
        self._counts = _tf_internal.untracked_variable(np.zeros(4, np.int64), "tb_numerics_guard")
        self._seen = np.zeros(4, np.int64)
        self._written: list[list[Any]] = [[] for _ in self._opts]  # what each optimizer's update writes
        self._applied: Any = None  # within a step: whether every update so far ran (a bool tensor)
        self._losses: list = []  # within a step: the losses logged so far (``summary.watching_losses``)
        self._prev_step: int | None = None
        self._replays = 0
        self._batch_noted = False  # where a bad batch held its bad values: written once
        policy = survive.OnAnomaly.of(on_anomaly)
        self._policy = _GuardPolicy(policy, self._opts, variables) if policy is not None else None
        self._windows = ([_survive_tf.SpikeWindow(dataclasses.replace(policy.spike, loss=False, grad_norm=True))
                          for _ in self._opts] if policy is not None and policy.spike is not None else [])
        self._spike = _tf_internal.untracked_variable(np.zeros(3), "tb_numerics_guard_spike")  # norm, mean, std
        # The records' step of the last update applied, and, at the first anomaly of a call, the records'
        # step there and of the update applied before it (_NO_STEP: none).
        self._applied_at = _tf_internal.untracked_variable(np.int64(_NO_STEP), "tb_numerics_guard_applied_at")
        self._bad_at = _tf_internal.untracked_variable(np.full(2, _NO_STEP, np.int64), "tb_numerics_guard_bad_at")
        # What the guard found at the first bad step (``first_anomaly.replay``'s JSON, or
        # the update that made the state non-finite); None until then.
        self.verdict: dict[str, Any] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if tf.inside_function():
            # Its checks and its replay run in Python after each call: in a
            # trace they would run once, when the function is traced.
            raise RuntimeError(
                "tbn.guard(...) was called inside a tf.function (%s): the guard checks each step after it "
                "runs, so it must wrap the compiled step from outside: write @tbn.guard(optimizer) above "
                "@tf.function, and call the guarded step from Python" % getattr(self._fn, "__name__", "step"))
        step = _current_step()
        self._applied = None
        batch = None  # at a held step whose batch arrived non-finite: its event's tensor and detail
        before = self._policy.state_before() if self._policy is not None else None
        with contextlib.ExitStack() as stack:
            for i, opt in enumerate(self._opts):
                stack.enter_context(_apply_as(opt, functools.partial(self._gated, i)))
            stack.enter_context(summary.gradients_squared_by(self._squared_by))
            self._losses = stack.enter_context(summary.watching_losses())
            try:
                out = self._fn(*args, **kwargs)
            except tf.errors.InvalidArgumentError as e:
                self._checked(step, e, args, kwargs)
                raise
        counts = self._counts.numpy()
        new, self._seen = counts - self._seen, counts
        bad, applied = step, None
        if new.any():
            # Where the step's records went: a call that runs several steps, or a trace made at
            # another int step, wrote them elsewhere than at the step before the call.
            at = self._bad_at.numpy()
            if at[0] != _NO_STEP:
                bad, applied = int(at[0]), (int(at[1]) if at[1] != _NO_STEP else None)
                self._bad_at.assign(np.full(2, _NO_STEP, np.int64))
        if bad is not None and bad == step and (new[_HELD] or new[_SCALE_SKIPPED]):
            # One step a call (its records at the step set before it): the arguments are that step's batch.
            batch = self._note_bad_batch(bad, args, kwargs)
            if batch is not None:
                new = _not_the_scales(new)  # a batch that arrived non-finite: no scale's doing
        if self.verdict is None and bad is not None and (new[_HELD] or new[_OVERFLOWED]):
            self._escalate(bad, bool(new[_HELD]), args, kwargs, applied)
        elif self.verdict is None and bad is not None and new[_SCALE_SKIPPED] and self._replay:
            if self._look_inside_skip(bad, args, kwargs):
                new = _not_the_scales(new)
        if self._policy is not None:
            self._survive(bad, new, args, kwargs, before, batch)
        self._prev_step = step
        return out

    def _checked(self, step: int | None, error: BaseException, args: tuple, kwargs: dict) -> None:
        """Where the step's own numerics check (``tf.debugging.check_numerics``)
        stopped it at the run's first NaN or Inf: the batch's records where it
        arrived so, and the step's replay, so that the report names the op that
        made the value before the error goes on to the caller."""
        if self.verdict is not None or step is None or not oplevel.numerics_check_failed(error):
            return
        self._note_bad_batch(step, args, kwargs)
        if self._replay:
            self.verdict = self._replayed(step, args, kwargs)

    def _gated(self, i: int, apply: Callable[..., Any]) -> Callable[..., Any]:
        opt = self._opts[i]
        if hasattr(opt, "inner_optimizer"):  # a LossScaleOptimizer gates itself: its skips are counted
            return self._scale_gated(opt, apply)

        @tf.autograph.experimental.do_not_convert  # explicit conds: nothing for autograph to convert
        def gated(grads, trainable_variables=None):
            grads = list(grads)
            at = _traced_step()
            variables = list(trainable_variables if trainable_variables is not None
                             else opt._trainable_variables)  # noqa: SLF001 - Keras' own default
            self._written[i] = [v for g, v in zip(grads, variables) if g is not None]
            if not getattr(opt, "built", True):  # its slots, not inside the branch below
                opt.build(variables)
            present = [g for g in grads if g is not None]
            total = tf.add_n([_sq_sum(g) for g in present]) if present else tf.constant(0.0, tf.float64)

            def closer() -> tf.Tensor:  # rare: which of the two it is, by the one rule
                finite = stats.all_finite(present)
                return tf.where(finite, tf.constant(1 + _OVERFLOWED, tf.int64), tf.constant(1 + _HELD, tf.int64))

            code = tf.cond(stats.sums_finite([total]), lambda: tf.constant(0, tf.int64), closer)
            # A loss logged before the update that is not finite holds the update back though
            # its gradients are (a square or a sum that overflowed: its gradient stays finite).
            losses_finite = self._losses_finite()
            if losses_finite is not None:
                code = tf.where(losses_finite, code, tf.constant(1 + _HELD, tf.int64))
            if self._windows:
                code = self._spiked(self._windows[i], code, total)
            run = tf.not_equal(code, 1 + _HELD) & tf.not_equal(code, 1 + _SPIKED)
            if _reachable(self._applied):  # an update before it in the step was held back
                run = run & self._applied

            def update() -> tf.Tensor:
                apply(grads, trainable_variables)
                if at is not None:
                    self._applied_at.assign(at)
                return tf.constant(True)

            ctx = stats.replica_context()
            if ctx is None:
                self._applied = tf.cond(run, update, lambda: tf.constant(False))
            else:  # the update merges across replicas: its branch is taken outside them, for all of them
                self._applied = ctx.merge_call(functools.partial(
                    _keras_gate.apply_if_all_finite, apply=apply, variables=trainable_variables), args=(run, grads))
                if at is not None:
                    self._applied_at.assign(tf.where(self._applied, at, self._applied_at.read_value()))
            tf.cond(code > 0, lambda: self._count(code - 1, at), lambda: tf.constant(False))

        return gated

    def _scale_gated(self, opt: Any, apply: Callable[..., Any]) -> Callable[..., Any]:
        """A LossScaleOptimizer's ``apply``, which skips a step whose gradients
        are not finite by itself, with that skip counted (one pass over each
        gradient, as the gate's), and the loss scale the step's gradients
        were scaled by recorded (as ``NumericsCallback`` records it): the
        analysis reads a skip whose scale handled it as information, not as
        the run's anomaly (``rules.kinds``)."""

        @tf.autograph.experimental.do_not_convert
        def counted(grads, trainable_variables=None):
            grads = list(grads)
            at = _traced_step()
            scale = getattr(opt, "dynamic_scale", None)
            if scale is not None and at is not None:
                summary.log_numerics("loss_scale", tf.cast(tf.convert_to_tensor(scale), tf.float32),
                                     role="loss_scale", description="the LossScaleOptimizer's loss scale")
            present = [g for g in grads if g is not None]
            total = tf.add_n([_sq_sum(g) for g in present]) if present else tf.constant(0.0, tf.float64)
            skipped = tf.cond(stats.sums_finite([total]), lambda: tf.constant(False),
                              lambda: tf.logical_not(stats.all_finite(present)))
            # Not the scale's to handle (as the callback's rule): a loss logged before the update that
            # is not finite (no scale made it), or a scale below the one scaling down can still help.
            losses_finite = self._losses_finite()
            theirs = tf.constant(False) if losses_finite is None else tf.logical_not(losses_finite)
            if scale is not None:
                theirs |= tf.convert_to_tensor(scale) < rules.LOSS_SCALE_HANDLED_MIN
            slot = tf.where(theirs, tf.constant(_HELD, tf.int64), tf.constant(_SCALE_SKIPPED, tf.int64))
            tf.cond(skipped, lambda: self._count(slot, at), lambda: tf.constant(False))
            return apply(grads, trainable_variables)

        return counted

    def _losses_finite(self) -> tf.Tensor | None:
        """Whether every loss logged so far in the step that the update can
        read is finite (a bool tensor); None where there is none."""
        losses = [t for t in self._losses if _reachable(t)]
        return stats.all_finite(losses) if losses else None

    def _spiked(self, window: _survive_tf.SpikeWindow, code: tf.Tensor, total: tf.Tensor) -> tf.Tensor:
        """``code``, or the spike's where the gradient norm is a spike."""
        norm = tf.sqrt(tf.cast(total, tf.float64))
        fired, mean, std = window.check(tf.constant(np.nan, tf.float64), norm)
        spiked = tf.equal(code, 0) & (fired > 0)
        self._spike.assign(tf.where(spiked, tf.stack([norm, mean, std]), self._spike.read_value()))
        window.push(tf.constant(np.nan, tf.float64), norm)
        return tf.where(spiked, tf.constant(1 + _SPIKED, tf.int64), code)

    def _count(self, slot: tf.Tensor, step: tf.Tensor | None) -> tf.Tensor:
        """Counts an anomaly of kind ``slot``; the first of a call keeps the
        records' ``step`` and that of the last update applied before it."""
        self._counts.assign_add(tf.one_hot(slot, 4, dtype=tf.int64))
        if step is not None:
            first = tf.equal(self._bad_at[0], _NO_STEP)
            self._bad_at.assign(tf.where(first, tf.stack([step, self._applied_at.read_value()]), self._bad_at))
        return tf.constant(True)

    def _note_bad_batch(self, step: int, args: tuple, kwargs: dict) -> dict[str, str] | None:
        """At a held or skipped step: where the step's arguments (its batch,
        as the step received it) hold a NaN or an Inf, their records, of role
        and phase ``input`` (what ``NumericsCallback`` records of every
        batch), written at ``step``: no op of the step made those values, so
        the batch is the step's first anomaly; and once, where they hold
        them, per feature and example (``metadata.BATCH_TAG``, for the hint).
        Returns the first such argument's tag and its non-finite values in words, else None."""
        # A -Inf argument may be a mask the program made (an additive attention mask): intended.
        leaves = [(tag, a, records.numpy_stats(a)) for tag, a in _batch_leaves(self._fn, args, kwargs)]
        bad = [(tag, a, v) for tag, a, v in leaves if records.nonfinite_count(v, neginf_ok=True) > 0]
        if not bad:
            return None
        _write([(tag, v, metadata.TensorInfo(
            role="input", dtype=str(a.dtype), shape=tuple(a.shape), neginf_ok=True,
            description="the step's argument %s, as the guarded step received it" % tag[len("input/"):]))
            for tag, a, v in leaves], step)
        if not self._batch_noted:
            self._batch_noted = True
            found = [f for f in (_keras_batch.bad_features(tag, [a], str(a.dtype)) for tag, a, _ in bad) if f]
            if found:
                info = metadata.TensorInfo(role="other", op_type="Batch",
                                           description=json.dumps({"step": step, "tensors": found}))
                _write([(metadata.BATCH_TAG, records.numpy_stats(np.zeros(0, np.float32)), info)], step)
        tag, _, v = bad[0]
        return {"tensor": tag, "detail": "%s: %s" % (tag, rules.describe_nonfinite(v))}

    def _escalate(self, step: int, held: bool, args: tuple, kwargs: dict, applied: int | None = None) -> None:
        """At a step whose update was held back or overflowed: the state the
        update made non-finite, written at the step that made it (``applied``:
        the records' step of the last update applied, where the step knew
        it); else the op-level replay of a held-back step."""
        at = applied if applied is not None else (step if not held else self._prev_step)
        found = []
        if at is not None:
            for opt, written in zip(self._opts, self._written):
                found += update_check.nonfinite_state(opt, written, at)
        if found:
            _write(found, at)
            self.verdict = {"step": step, "update_of_step": at, "tensors": [tag for tag, _, _ in found]}
        elif held and self._replay:
            self.verdict = self._replayed(step, args, kwargs)

    def _look_inside_skip(self, step: int, args: tuple, kwargs: dict) -> bool:
        """At a step a LossScaleOptimizer skipped (non-finite gradients): its
        replay's first non-finite op, looked at writing nothing. A forward
        one (a log(0), or a float16 overflow inside a layer whose output
        stayed finite), which no loss scale makes, is the step's anomaly:
        the step is replayed again as any held one. A gradient op may be
        the scale overflowing float16, which the skip handles: the step is
        looked at again with the scale at 1, and a gradient still non-finite
        there (a sqrt's or a division's at 0) is the anomaly, replayed at 1.
        Returns whether the step is an anomaly: no skip of the scale's own."""
        try:
            with tf.summary.record_if(False):
                found = self._replay_op(step, args, kwargs)
                unscaled = found is not None and not found.beyond_loss_scaling()
                if unscaled:
                    with _loss_scale_one(self._opts):
                        found = self._replay_op(step, args, kwargs)
        except Exception:  # noqa: BLE001 - a look must never stop training
            return False
        if found is not None:
            self.verdict = self._replayed(step, args, kwargs, unscaled)
        return found is not None

    def _replay_op(self, step: int, args: tuple, kwargs: dict) -> Any:
        """The step's first non-finite op, run again at op level with every
        update suppressed and every variable write put back.

        Raises:
          _NotReplayable: the step reads its batch from an iterator argument.
        """
        if _reads_iterator(args, kwargs):
            raise _NotReplayable(
                "it was not run again: the step reads its batch from an iterator it is given, so a replay "
                "would take another batch, and take it from training; pass the batch itself "
                "(step(x, y), with next(iterator) outside the step) for the replay to name the op")
        with contextlib.ExitStack() as stack:
            for opt in self._opts:
                stack.enter_context(_apply_as(opt, lambda apply: lambda *a, **k: None))
            stack.enter_context(_tf_internal.variable_writes_undone())
            return oplevel.replay_step(_unrecorded(self._fn), *args, step=step, **kwargs)

    def _replayed(self, step: int, args: tuple, kwargs: dict, unscaled: bool = False) -> dict[str, Any]:
        """Runs the step again at op level (see the module) and writes the
        verdict; ``unscaled``: with every loss scale at 1 (said in the verdict)."""
        self._replays += 1
        verdict: dict[str, Any] = {"step": step, **({"unscaled": True} if unscaled else {})}
        try:
            with _loss_scale_one(self._opts) if unscaled else contextlib.nullcontext():
                found = self._replay_op(step, args, kwargs)
        except _NotReplayable as e:
            found, verdict["why"] = None, str(e)
        except Exception as e:  # noqa: BLE001 - a replay must never stop training
            found, verdict["why"] = None, "the replay raised %s: %s" % (type(e).__name__, e)
        if found is None:
            transient = "why" not in verdict
            verdict.update(reproduced=False, why=verdict.get("why", "every op output was finite when the step ran "
                           "again eagerly on the same weights and batch: the fault is not reproducible "
                           "(non-determinism: a random op drew other values; or a hardware fault)"))
            if transient:
                verdict["reproducible"] = False
        else:
            verdict.update(reproduced=True, reproducible=True, op=found.to_json())
        info = metadata.TensorInfo(role="other", op_type="Replay", description=json.dumps(verdict, default=str))
        _write([(metadata.REPLAY_TAG, records.numpy_stats(np.zeros(0, np.float32)), info)], step)
        return verdict

    def _survive(self, step: int | None, new: np.ndarray, args: tuple, kwargs: dict, before: list | None,
                 batch: dict[str, str] | None = None) -> None:
        """The policy's part after a call: nothing on a healthy step (but a
        snapshot every ``snapshot_every``), else an action and its event
        (``before``: ``variables=`` as the call began; ``batch``: the
        argument that arrived non-finite, the event's tensor: no op's fault,
        so no replay's op)."""
        if not (new[_HELD] or new[_SPIKED]):
            self._policy.applied(self._written)
            return
        event: dict[str, Any] = {"trigger": "grad_norm_spike" if not new[_HELD] else "nonfinite"}
        if new[_HELD] and batch is not None:
            event.update(batch)
        elif new[_HELD]:
            event.update(tensor="gradients", detail="the gradients or a loss logged before the update held a NaN or "
                         "an Inf (the update was held back)")
            verdict = self.verdict if self.verdict is not None and self.verdict.get("step") == step else None
            if verdict is None and self._replay and self._replays < _MAX_REPLAYS and step is not None:
                verdict = self._replayed(step, args, kwargs)
            if verdict is not None and "reproduced" in verdict:
                event["replay"] = {k: verdict[k] for k in ("reproduced", "reproducible", "why") if k in verdict}
                if isinstance(verdict.get("op"), dict):
                    event["op"] = {k: verdict["op"].get(k) for k in ("name", "type", "source", "phase")}
        else:
            norm, mean, std = self._spike.numpy()
            event.update(tensor="gradients/global_norm", value=float(norm), detail=(
                "global gradient norm %s is more than %s σ above the mean %s (σ %s) of the recent steps" % (
                    rules.number(norm), rules.number(self._policy.policy.spike.z), rules.number(mean),
                    rules.number(std))))
        self._policy.act(step, event, before)


class _GuardPolicy:
    """The guard's ``on_anomaly`` policy on the host: decisions, snapshots, events."""

    def __init__(self, policy: survive.OnAnomaly, optimizers: list, variables: Sequence[Any]):
        if policy.checkpoint is not None:
            raise ValueError("tbn.guard rewinds to a snapshot on the device; OnAnomaly.checkpoint is for the callback")
        self.policy = policy
        self._survival = survive.Survival(policy)
        self._opts, self._extra = optimizers, list(variables)
        self._snapshot: _survive_tf.StateSnapshot | None = None
        self._applied = 0
        self._lrs = ([_survive_tf.LearningRate(o, setattr) for o in optimizers]
                     if policy.lr_factor is not None and policy.may_rewind else [])

    def applied(self, written: list[list[Any]]) -> None:
        """After a step whose updates ran: the run of anomalies ends; the
        first snapshot, and one every ``snapshot_every`` such steps."""
        self._survival.healthy()
        if not self.policy.may_rewind:
            return
        if self._snapshot is None:
            state = [v for vs in written for v in vs] + _survive_tf.optimizer_state(self._opts) + self._extra
            self._snapshot = _survive_tf.StateSnapshot(state)
        if self._applied % self.policy.snapshot_every == 0:
            self._snapshot.take(self._applied)
        self._applied += 1

    def state_before(self) -> list[tf.Tensor] | None:
        """``variables=`` as a call begins (copies on their device), for a
        skip or a stop to put back; None where there are none."""
        return [tf.identity(v) for v in self._extra] if self._extra else None

    def act(self, step: int | None, event: dict[str, Any], before: list | None = None) -> None:
        """Decides and acts on a held step, and writes its event; raises
        ``survive.TrainingStopped`` where training stops. A skip or a stop
        puts ``variables=`` back to ``before``: the forward pass of the held
        step updated them (a rewind puts back its snapshot)."""
        action, why = self._survival.decide()
        if action in ("skip", "stop") and before is not None:
            for v, value in zip(self._extra, before):
                v.assign(value)
        if action == "rewind":
            to = self._snapshot.restore() if self._snapshot is not None else None
            if to is None:
                action, why = "stop", "no state to rewind to (no finite snapshot yet)"
            else:
                event["to_applied_step"] = to
                if self._lrs:
                    lr = [r.scale(self.policy.lr_factor) for r in self._lrs][0]
                    event.update(lr_factor=self.policy.lr_factor, lr=lr)
        event.update(action=action, epoch=None, batch=None)
        if why or action == "stop":
            event["reason"] = why or "on_anomaly is stop"
        if step is not None:
            _write_action(step, event)
        if action == "stop":
            words = survive.summarize([dict(event, step=step if step is not None else -1)])["words"]
            raise survive.TrainingStopped("tb-numerics: %s (%s)" % (words, event.get("detail", "")), event)


class _NotReplayable(Exception):
    """A step that cannot be run again as it ran (the verdict says why)."""


def _not_the_scales(new: np.ndarray) -> np.ndarray:
    """A call's new counts with its LossScaleOptimizer skips counted as held
    steps: anomalies of the step, not a scale calibrating itself."""
    out = new.copy()
    out[_HELD] += out[_SCALE_SKIPPED]
    out[_SCALE_SKIPPED] = 0
    return out


def _reads_iterator(args: tuple, kwargs: dict) -> bool:
    """Whether an argument is an iterator (a ``tf.data`` one, a generator):
    each run of the step takes the next batch from it."""
    return any(isinstance(t, (tf.data.Iterator, collections.abc.Iterator)) for t in (*args, *kwargs.values()))


def _batch_leaves(fn: Callable[..., Any], args: tuple, kwargs: dict) -> list[tuple[str, np.ndarray]]:
    """(tag, values) of each float tensor or array among a step's arguments
    (not a variable: a weight is no batch), tagged ``input/<parameter>``, and
    ``input/<parameter>/<path>`` inside a tuple or a dict."""
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs).arguments
    except (TypeError, ValueError):  # no signature to bind to: by position
        bound = {**{"arg%d" % i: a for i, a in enumerate(args)}, **kwargs}
    out = []
    for name, value in bound.items():
        try:
            leaves = _keras_batch.float_leaves(value)
        except (TypeError, ValueError):  # a structure no tree library walks (a dict of mixed keys)
            continue
        out += [("/".join(filter(None, ["input", name, path])), np.asarray(t)) for path, t in leaves
                if not isinstance(t, tf.Variable)]
    return out


def _reachable(t: Any) -> bool:
    """Whether ``t`` (an earlier update's verdict in this step) can be used
    here: eagerly an eager tensor; in a trace, a tensor of this graph or of
    one it is nested in (not of an earlier trace: ``tf.function`` traces a
    step again after its first trace created the optimizers' variables)."""
    if t is None:
        return False
    if tf.executing_eagerly():
        return not tf.is_symbolic_tensor(t)
    graph = tf.compat.v1.get_default_graph()
    while graph is not None:
        if getattr(t, "graph", None) is graph:
            return True
        graph = getattr(graph, "outer_graph", None)
    return False


@contextlib.contextmanager
def _apply_as(opt: Any, make: Callable[[Any], Any]):
    """The optimizer's ``apply`` replaced by ``make(apply)`` on the instance, inside."""
    had, old = "apply" in vars(opt), vars(opt).get("apply")
    opt.apply = make(type(opt).apply.__get__(opt) if not had else old)
    try:
        yield
    finally:
        if had:
            opt.apply = old
        else:
            del opt.apply


def _unrecorded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with its own summaries (``log_numerics``, ``tf.summary.scalar``)
    not written: they are on disk from the step's own run. The op records
    of a replay are written as its recorder closes, outside this."""

    def run(*args: Any, **kwargs: Any) -> Any:
        with tf.summary.record_if(False):
            return fn(*args, **kwargs)

    return run


def _write(recs: list[update_check.Record], step: int) -> None:
    """Writes records to the default writer at ``step``, on disk at once."""
    for tag, vec, info in recs:
        summary.write_stats(tag, vec, step=step, info=info)
    writer = _tf_internal.default_summary_writer()  # the writer the step's records went to
    if writer is not None:
        writer.flush()


def _write_action(step: int, event: dict[str, Any]) -> None:
    """Writes an action event (``survive``) to the default writer at ``step``, on disk at once."""
    writer = _tf_internal.default_summary_writer()
    if writer is None:
        return
    with tf.init_scope():
        tf.summary.write(metadata.ACTIONS_TAG, tf.constant(survive.encode_event(event)), step=step,
                         metadata=metadata.create_action_metadata().SerializeToString())
    writer.flush()
