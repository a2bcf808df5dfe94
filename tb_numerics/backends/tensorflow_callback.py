"""``NumericsCallback`` on Keras' TensorFlow backend: the records computed in the graph.

Keras callbacks never see gradients or inner activations, so for the
duration of ``fit`` (from ``on_train_begin`` to ``on_train_end``, when
everything is put back) the callback wraps the model's ``train_step``, its
top-level layers' ``call`` and the optimizer's ``scale_loss`` and ``apply``
on the instances only, and rebuilds ``model.train_function`` around them
(``_keras_patch``).

The statistics (``stats.tensor_stats``) are computed inside the training
step, compiled or not, and stored in a small variable; the callback reads it
after each batch and the host side every backend shares (``_keras_host``)
writes the records. So the same records come out under
``jit_compile=True``, where summary ops cannot run. The model's code,
outputs and training are unchanged.

The TensorFlow parts, each in a module named for its job:

* ``_keras_patch``: the wrappers;
* ``_keras_program``: inside the step, the records, the step's values
  (``StepValues``), the gated update and the replicas' combining;
* ``_keras_gate``: the gated update, every optimizer the step applies;
* ``_keras_diagnosis``: at a step that gives a reason, the update check,
  the kept batch and the replay hand-off (``_keras_replay``);
* ``_keras_survive``: the ``on_anomaly`` policy (skip, rewind, stop) after
  each batch, each action an event in the run.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from tb_numerics import _requires

tf = _requires.tensorflow(__name__)  # says what to install where TensorFlow is missing

from tb_numerics import _keras_replay, oplevel, survive  # noqa: E402 - after that check
from tb_numerics._keras_diagnosis import Diagnosis, why_no_replay  # noqa: E402
from tb_numerics._keras_host import NumericsCallbackBase, Step, StepValues  # noqa: E402
from tb_numerics._keras_patch import StepHooks  # noqa: E402
from tb_numerics._keras_program import StepProgram, strategy_of  # noqa: E402
from tb_numerics._keras_survive import SurvivalHost  # noqa: E402

__all__ = ["TensorFlowNumericsCallback"]


class TensorFlowNumericsCallback(NumericsCallbackBase):
    """``NumericsCallback`` for Keras' TensorFlow backend (the options: ``_keras_host.NumericsCallbackBase``).

    Beyond the other backends: under a ``tf.distribute`` strategy with
    several replicas, each record is that of all replicas' values together
    (one record per step, a NaN on any replica is seen); a gradient record
    is of the replicas' own gradients, before the optimizer combines them,
    and under ``MirroredStrategy`` the replay runs on the part of the batch
    of the replica whose records went bad (``first_anomaly.replay.replica``).
    After a step whose gradients' squares overflow (Adam, RMSprop, ...), the
    optimizer state its update left is checked, and written where it is
    not finite.

    Only here (README: "the policies work on TensorFlow only"), beyond the
    options every backend takes:

    Args:
      on_anomaly: what to do at a step whose loss or gradients hold a NaN
        or an Inf, or whose forward pass made the state it updates (a
        moving statistic) NaN or Inf: ``"skip"`` it (its update held back,
        that state put back as the step began), ``"rewind"`` to the last good
        state, ``"stop"`` (as ``stop_on_anomaly=True``), or a
        ``tb_numerics.OnAnomaly`` with its limits and a spike trigger (see
        ``tb_numerics.survive``). Each action is an event in the run
        (``actions`` in ``tb-numerics report --json``). None: a step whose
        loss or gradients are not finite is held back for the replay (its
        update and state, as a skip), and nothing else is done.
      skip_batches: (epoch, batch) pairs whose update is held back whatever
        they hold, each a skip event: the batches an earlier run failed on
        (``tb_numerics.survive.failed_batches(its log_dir)``), for a run
        trained again on the same data order. Needs ``on_anomaly``.

    ``anomaly`` is also set where a policy's stop ended training.
    """

    backend = "tensorflow"
    keeps_step = True

    def __init__(self, log_dir: str, *args: Any, on_anomaly: "str | survive.OnAnomaly | None" = None,
                 skip_batches: Sequence[tuple[int, int]] = (), **kwargs: Any):
        super().__init__(log_dir, *args, **kwargs)
        policy = survive.OnAnomaly.of(on_anomaly)
        self._skip_batches = frozenset((int(e), int(b)) for e, b in skip_batches)
        if self._skip_batches and policy is None:
            raise ValueError("skip_batches needs an on_anomaly policy: each listed batch's skip is its event")
        if self.stop_on_anomaly and policy is not None and policy.action != "stop":
            raise ValueError("stop_on_anomaly=True is on_anomaly='stop'; it cannot go with on_anomaly=%r" % (
                policy.action,))
        self._policy = policy or (survive.OnAnomaly("stop") if self.stop_on_anomaly else None)
        self.stop_on_anomaly = self._policy is not None and self._policy.action == "stop"
        self._survival: SurvivalHost | None = None  # set while fit runs, with a policy
        self._hooks: StepHooks | None = None

    def _begin(self, model: Any) -> None:
        self._replay = _keras_replay.StepReplay(model, self.log_dir) if self.replay else None
        if self._replay is not None:
            self._replay.why_not = why_no_replay(model)
        policy = self._policy
        self._program = StepProgram(model, self.plan, self._replay, update_ratios=self.update_ratios,
                                    weights_every_n_steps=self.weights_every_n_steps, safe_range=self.safe_range,
                                    policy=policy is not None, spike=policy.spike if policy is not None else None,
                                    listed=bool(self._skip_batches))
        self._last_call = -1  # before the policy's check, whose refusal ends the fit here (on_train_end)
        try:
            self._check_policy(model)
        except ValueError:
            self.on_train_end()  # fit calls no on_train_end after on_train_begin raised: the writer closes here
            raise
        hooks = StepHooks(model, self._program, self._replay)
        self._diagnosis = Diagnosis(model, self.plan, self._program, hooks, self._host, self._replay,
                                    safe_range=self.safe_range, squared_by=self._squared_by(model.optimizer))
        self._survival = None if policy is None else SurvivalHost(
            model, policy, self.plan, self._program, self._diagnosis, self._host, safe_range=self.safe_range,
            set_attribute=self._patches.set, first_verdict=lambda: self.replay_verdict,
            skip_batches=self._skip_batches)
        self._hooks = hooks
        self._patched = self._take_up(model, None)

    def _step_key(self, model: Any) -> tuple:
        return (strategy_of(model),)

    def _take_up(self, model: Any, train_function: Any) -> Any:
        # None: the first fit, which builds the train function. Otherwise
        # everything the kept step uses (its variables, the replay's kept
        # batch, the policy's state) is as the last fit left it.
        # The function the last fit kept is the one ``_checked_by_the_program`` made around its own.
        train_function = getattr(train_function, "unchecked", train_function)
        train_function = self._hooks.install(self._patches, self.activations, train_function=train_function)
        if self._survival is not None:
            self._survival.begin()
        model.train_function = self._checked_by_the_program(train_function)
        return model.train_function

    def _checked_by_the_program(self, train_function: Any) -> Any:
        """``train_function``, and where a numerics check of the program's
        own (``tf.debugging.check_numerics``) raised in it at a NaN or an
        Inf, the steps before it and that step's checked tensor written, and
        the step replayed, before the error goes on: a fit that the check
        ended is never a run with no anomaly."""

        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                return train_function(*args, **kwargs)
            except tf.errors.InvalidArgumentError as e:
                if oplevel.numerics_check_failed(e):
                    self._stopped_by_check()
                raise

        run.unchecked = train_function
        return run

    def _stopped_by_check(self) -> None:
        checked = self._program.checked() if self._host is not None else None
        if checked is None:
            return
        step, message, record = checked
        self._write_left()
        self._host.write_checked(step, message, record)
        if self.replay and self.replay_verdict is None and self._replay is not None:
            self.replay_verdict = self._replay.replay(step, self.model.train_step)
        self._host.writer.flush()

    def _check_policy(self, model: Any) -> None:
        """Refuses a policy the step cannot carry out (before anything is wrapped)."""
        if self._skip_batches and int(getattr(model, "steps_per_execution", 1) or 1) > 1:
            raise ValueError("NumericsCallback: skip_batches holds back one batch's update, and steps_per_execution="
                             "%d runs several batches per call; compile with steps_per_execution=1"
                             % int(model.steps_per_execution))
        policy = self._policy
        if policy is not None and policy.action != "stop" and not self._program.gate.gates:
            raise ValueError("NumericsCallback: on_anomaly=%r holds a bad step's update back, which it can under one "
                             "device or MirroredStrategy, not %s" % (policy.action, type(strategy_of(model)).__name__))

    def on_epoch_begin(self, epoch, logs=None) -> None:
        if self._survival is not None:
            self._survival.epoch = int(epoch)

    def on_train_batch_begin(self, batch, logs=None) -> None:
        if self._survival is not None:
            self._survival.before(batch)

    def _new_steps(self) -> list[Step]:
        steps = self._program.new_steps(self._last_call)
        if steps:
            self._last_call = steps[-1][1].call
        return steps

    def _check_update(self, steps: list[Step]) -> bool:
        return self._diagnosis.check_squares(steps)

    def _kept_batches(self, step: int) -> list[Any]:
        return self._diagnosis.kept_batches(step)

    def _looked_at_bad_steps(self) -> None:
        if self._replay is not None:
            self._replay.release()

    def _replay_verdict(self, step_stats: np.ndarray, values: StepValues) -> dict[str, Any]:
        # The TensorFlow replay writes its verdict itself (``_keras_replay``).
        # Under steps_per_execution > 1, the steps of its call after it ran before this.
        return self._diagnosis.replay(values.step, step_stats, self._scale(values),
                                      later_steps=self._last_call - values.call)

    def _skip_beyond_scaling(self, values: StepValues) -> bool:
        return self._diagnosis.skip_beyond_scaling(values.step, self._scale(values))

    def _scale(self, values: StepValues) -> float | None:
        """The loss scale the step ran with (its replay runs with it too), or None."""
        return values.loss_scale if self._program.lso else None

    # ------------------------------------------------------------ the on_anomaly policy

    def _policy_acts_on(self, steps: list[Step]) -> bool:
        return self._survival is not None and any(self._survival.acts_on(v) for _, v in steps)

    def _policy_after(self, steps: list[Step], batch: int) -> bool:
        return self._survival is not None and self._survival.after(steps, batch)

    def _stops_at(self, values: StepValues) -> bool:
        # A listed batch (``skip_batches``) is skipped, whatever it holds.
        return self.stop_on_anomaly and not (self._survival is not None and self._survival.listing)

    def _stop(self, step_stats: np.ndarray | None = None, values: StepValues | None = None, why: str = "") -> None:
        # Given a step, its stop event first (else the policy wrote it).
        if values is not None and self._survival is not None and not self.model.stop_training:
            self._survival.stop(step_stats, values, self._batch - (self._last_call - values.call), why)
        super()._stop()
