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
as it would. Where it is not, the rare branch looks closer:

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

Under the guard, gradient tags say whether the optimizer squares them
(``TensorInfo.squared_by``), for the square-overflow warning. Under a
``LossScaleOptimizer`` the update is not gated (it skips non-finite steps
and lowers its scale itself). The guard acts on the first non-finite step
once; later steps are gated only.
"""

from __future__ import annotations

import contextlib
import functools
import json
from typing import Any, Callable

import numpy as np
import tensorflow as tf

from tb_numerics import _tf_internal, metadata, oplevel, records, stats, summary, update_check

__all__ = ["StepGuard", "guard"]

_HELD, _OVERFLOWED = 0, 1  # slots of the guard's counters


def guard(optimizer: Any, *, replay: bool = True) -> Callable[[Callable[..., Any]], "StepGuard"]:
    """Decorates a training step that applies ``optimizer``'s update (see the module).

    Args:
      optimizer: the Keras optimizer the step calls ``apply_gradients`` or ``apply`` of.
      replay: replay the first step whose update was held back at op level.
    """
    return lambda fn: StepGuard(fn, optimizer, replay=replay)


def _sq_sum(g: Any) -> tf.Tensor:
    """sum(g * g), one pass: not finite where an element is not, or where a
    square or the sum overflows (float32 for half-precision gradients)."""
    return stats.sq_norm(g.values if isinstance(g, tf.IndexedSlices) else tf.convert_to_tensor(g))


def _current_step() -> int | None:
    step = tf.summary.experimental.get_step()
    return None if step is None else int(step)


class StepGuard:
    """A training step with its update gated and its first bad step escalated."""

    def __init__(self, fn: Callable[..., Any], optimizer: Any, *, replay: bool = True):
        functools.update_wrapper(self, fn)
        self._fn = fn
        self._opt = optimizer
        self._replay = replay
        self._squared_by = update_check.squares_gradients(optimizer)
        self._gates = not hasattr(optimizer, "inner_optimizer")  # a LossScaleOptimizer gates itself
        # Steps held back, steps applied with an overflowing square (see _HELD).
        self._counts = _tf_internal.untracked_variable(np.zeros(2, np.int64), "tb_numerics_guard")
        self._seen = np.zeros(2, np.int64)
        self._variables: list[Any] = []  # what the step's update writes
        self._prev_step: int | None = None
        # What the guard found at the first bad step (``first_anomaly.replay``'s JSON, or
        # the update that made the state non-finite); None until then.
        self.verdict: dict[str, Any] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        step = _current_step()
        with self._apply_as(self._gated), summary.gradients_squared_by(self._squared_by):
            out = self._fn(*args, **kwargs)
        counts = self._counts.numpy()
        new, self._seen = counts - self._seen, counts
        if self.verdict is None and step is not None and new.any():
            self._escalate(step, bool(new[_HELD]), args, kwargs)
        self._prev_step = step
        return out

    @contextlib.contextmanager
    def _apply_as(self, make: Callable[[Any], Any]):
        """The optimizer's ``apply`` replaced by ``make(apply)`` on the instance, inside."""
        opt = self._opt
        had, old = "apply" in vars(opt), vars(opt).get("apply")
        opt.apply = make(type(opt).apply.__get__(opt) if not had else old)
        try:
            yield
        finally:
            if had:
                opt.apply = old
            else:
                del opt.apply

    def _gated(self, apply: Callable[..., Any]) -> Callable[..., Any]:
        if not self._gates:
            return apply

        @tf.autograph.experimental.do_not_convert  # explicit conds: nothing for autograph to convert
        def gated(grads, trainable_variables=None):
            grads = list(grads)
            variables = list(trainable_variables if trainable_variables is not None
                             else self._opt._trainable_variables)  # noqa: SLF001 - Keras' own default
            self._variables = [v for g, v in zip(grads, variables) if g is not None]
            if not getattr(self._opt, "built", True):  # its slots, not inside the branch below
                self._opt.build(variables)
            present = [g for g in grads if g is not None]
            total = tf.add_n([_sq_sum(g) for g in present]) if present else tf.constant(0.0, tf.float64)

            def closer() -> tf.Tensor:  # rare: which of the two it is, by the one rule
                finite = stats.all_finite(present)
                return tf.where(finite, tf.constant(1 + _OVERFLOWED, tf.int64), tf.constant(1 + _HELD, tf.int64))

            code = tf.cond(stats.sums_finite([total]), lambda: tf.constant(0, tf.int64), closer)

            def update() -> tf.Tensor:
                apply(grads, trainable_variables)
                return tf.constant(True)

            tf.cond(tf.not_equal(code, 1 + _HELD), update, lambda: tf.constant(False))
            tf.cond(code > 0, lambda: self._count(code - 1), lambda: tf.constant(False))

        return gated

    def _count(self, slot: tf.Tensor) -> tf.Tensor:
        self._counts.assign_add(tf.one_hot(slot, 2, dtype=tf.int64))
        return tf.constant(True)

    def _escalate(self, step: int, held: bool, args: tuple, kwargs: dict) -> None:
        """At a step whose update was held back or overflowed: the state the
        update made non-finite, written at the step that made it; else the
        op-level replay of a held-back step."""
        at = step if not held else self._prev_step
        found = update_check.nonfinite_state(self._opt, self._variables, at) if at is not None else []
        if found:
            _write(found, at)
            self.verdict = {"step": step, "update_of_step": at, "tensors": [tag for tag, _, _ in found]}
        elif held and self._replay:
            self.verdict = self._replayed(step, args, kwargs)

    def _replayed(self, step: int, args: tuple, kwargs: dict) -> dict[str, Any]:
        """Runs the step again at op level (see the module) and writes the verdict."""
        verdict: dict[str, Any] = {"step": step}
        try:
            with self._apply_as(lambda apply: lambda *a, **k: None), _tf_internal.variable_writes_undone():
                found = oplevel.replay_step(_unrecorded(self._fn), *args, step=step, **kwargs)
        except Exception as e:  # noqa: BLE001 - a replay must never stop training
            found, verdict["why"] = None, "the replay raised %s: %s" % (type(e).__name__, e)
        if found is None:
            verdict.update(reproduced=False, why=verdict.get("why", "every op output was finite when the step "
                                                             "ran again eagerly: a random op drew other values"))
        else:
            verdict.update(reproduced=True, op=found.to_json())
        info = metadata.TensorInfo(role="other", op_type="Replay", description=json.dumps(verdict, default=str))
        _write([(metadata.REPLAY_TAG, records.numpy_stats(np.zeros(0, np.float32)), info)], step)
        return verdict


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
