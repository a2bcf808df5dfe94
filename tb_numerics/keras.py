"""A Keras 3 callback that logs the numerics of ``model.fit`` (TensorFlow backend).

    from tb_numerics.keras import NumericsCallback
    model.fit(x, y, callbacks=[NumericsCallback("logs/run1")])

Keras callbacks never see gradients or inner activations, so for the
duration of ``fit`` (from ``on_train_begin`` to ``on_train_end``, when
everything is put back) the callback wraps the model's ``train_step``, its
top-level layers' ``call`` and the optimizer's ``scale_loss`` and ``apply``
on the instances only, and rebuilds ``model.train_function`` around them
(``_keras_patch``).

The statistics (``stats.tensor_stats``) are computed inside the training
step, compiled or not, and stored in a small variable; the callback reads it
after each batch and writes the records from the host. So the same records
come out under ``jit_compile=True``, where summary ops cannot run. The model's
code, outputs and training are unchanged.

The callback composes small parts, each in a module named for its job:

* ``_keras_plan``: the rows the step computes, in execution order;
* ``_keras_patch``: the wrappers, and putting everything back;
* ``_keras_program``: inside the step, the records, the step's values by
  name (``StepValues``), the gated update and the replicas' combining;
* ``_keras_host``: on the host, records from a step's rows, the every-N
  latch, the writer thread;
* ``_keras_gate``: the gated update, every optimizer the step applies;
* ``_keras_diagnosis``: at a step that gives a reason, the update check,
  the bad batch, the replay hand-off (``_keras_replay``) and the stop,
  printed in the report's words (``report_text``);
* ``_keras_survive``: the ``on_anomaly`` policy (skip, rewind, stop) after
  each batch, each action an event in the run.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from tb_numerics import _requires

_requires.tensorflow(__name__)  # says what to install where TensorFlow is missing
import keras  # noqa: E402 - after that check

from tb_numerics import _keras_replay, analysis, survive, update_check  # noqa: E402
from tb_numerics._keras_diagnosis import Diagnosis, stop_training, why_no_replay  # noqa: E402
from tb_numerics._keras_host import HostRecords  # noqa: E402
from tb_numerics._keras_patch import Patches, StepHooks  # noqa: E402
from tb_numerics._keras_plan import RowPlan, strategy_of  # noqa: E402
from tb_numerics._keras_program import StepProgram, StepValues  # noqa: E402
from tb_numerics._keras_survive import SurvivalHost  # noqa: E402

__all__ = ["NumericsCallback"]


class NumericsCallback(keras.callbacks.Callback):
    """Logs per-layer activations, gradients, weights and update ratios during ``fit``.

    Records (steps are the optimizer's step before its update, i.e.
    ``optimizer.iterations``, plus the steps a ``LossScaleOptimizer`` skipped,
    which do not advance it):

    * ``input``, ``target``, ``sample_weight`` (role and phase ``input``):
      the batch as the step received it, before any layer ran, so a batch
      that arrives holding NaN is the step's first anomaly (``input/<key>``
      for each tensor of a dict or tuple; see ``_keras_batch``). At the first
      bad step, where the batch holds NaN, Inf or values beyond the overflow
      margin, the replay's kept batch is counted per feature once
      (``metadata.BATCH_TAG``) for the hint;
    * ``<layer>/output`` (activation): every float output of each top-level
      layer, in the order the layers run;
    * ``loss``: the training loss, as ``optimizer.scale_loss`` receives it;
    * ``gradients/<variable path>`` (gradient, unscaled), in backward order
      as ``log_gradients`` writes them, and ``gradients/global_norm``;
    * ``<variable path>`` (weight), before the update;
    * ``update_ratio/<layer>`` (weight): ||w_new - w_old|| / ||w_old|| over
      the layer's trainable variables, an early sign of a too-large learning
      rate. It keeps one copy of the trainable weights (``update_ratios=False``
      to save that memory);

    Weights change slowly and are as big as the gradients, so their records
    and the update ratios are computed (and written) on every
    ``weights_every_n_steps``-th step only, and on any step whose loss is
    NaN or Inf (so a bad forward pass has the weights that made it); the
    activations, the loss and the gradients every ``every_n_steps``.
    * ``loss_scale`` (under a ``LossScaleOptimizer``, e.g. with the
      ``mixed_float16`` policy): the scale the step used. A skipped step shows
      as non-finite gradients at a step with a loss-scale record, which the
      analysis reports as a warning, not the run's anomaly.

    Args:
      log_dir: where the event file goes (a TensorBoard run directory).
      every_n_steps: write every N-th step; the first step with a non-finite
        value and the step before it are written whatever N is.
      weights_every_n_steps: the steps with weight and update-ratio records;
        a multiple of ``every_n_steps``, by default ``10 * every_n_steps``.
        ``1`` records them on every step, which about doubles the callback's
        cost on a model whose weights are as large as its activations.
      inputs, activations, gradients, weights, update_ratios: what to record.
      stop_on_anomaly: stop training at the first step with a non-finite
        record (an allowlisted -Inf, or gradients of a step the loss-scale
        optimizer skipped, do not count) and print the diagnosis.
      replay: at the first step with a non-finite record, run that step again
        at op level (eagerly, without XLA) and record which op, at which line
        of your code, made the first NaN or Inf (``first_anomaly.op`` in the
        report). To keep the weights that step used, the update of a step
        whose loss or gradients are not finite is not applied (as a
        LossScaleOptimizer does); the batch of a step that went bad is kept for it. Under
        ``MirroredStrategy`` it replays the part of the batch of the replica
        whose records went bad (``first_anomaly.replay.replica``).
      allow_neginf: tag patterns (fnmatch) where -Inf is intended, e.g.
        ``"attention*/output"`` for masks; a NaN there still counts.
      on_anomaly: what to do at a step whose loss or gradients hold a NaN
        or an Inf: ``"skip"`` its update, ``"rewind"`` to the last good
        state, ``"stop"`` (as ``stop_on_anomaly=True``), or a
        ``tb_numerics.OnAnomaly`` with its limits and a spike trigger (see
        ``tb_numerics.survive``). Each action is an event in the run
        (``actions`` in ``tb-numerics report --json``). None: the update of
        such a step is held back for the replay, and nothing else is done.
      skip_batches: (epoch, batch) pairs whose update is held back whatever
        they hold, each a skip event: the batches an earlier run failed on
        (``tb_numerics.survive.failed_batches(its log_dir)``), for a run
        trained again on the same data order. Needs ``on_anomaly``.

    Under a ``tf.distribute`` strategy with several replicas, each record is
    that of all replicas' values together (one record per step, a NaN on any
    replica is seen); a gradient record is of the replicas' own gradients,
    before the optimizer combines them.

    After training, ``anomaly`` holds the first anomaly (as in
    ``tb-numerics report --json``) when the callback stopped training
    (``stop_on_anomaly``, or an ``on_anomaly`` policy's stop).
    """

    def __init__(
        self,
        log_dir: str,
        every_n_steps: int = 1,
        weights_every_n_steps: int | None = None,
        activations: bool = True,
        gradients: bool = True,
        weights: bool = True,
        update_ratios: bool = True,
        stop_on_anomaly: bool = False,
        allow_neginf: Sequence[str] = (),
        replay: bool = True,
        inputs: bool = True,
        on_anomaly: "str | survive.OnAnomaly | None" = None,
        skip_batches: Sequence[tuple[int, int]] = (),
    ):
        super().__init__()
        policy = survive.OnAnomaly.of(on_anomaly)
        self._skip_batches = frozenset((int(e), int(b)) for e, b in skip_batches)
        if self._skip_batches and policy is None:
            raise ValueError("skip_batches needs an on_anomaly policy: each listed batch's skip is its event")
        if stop_on_anomaly and policy is not None and policy.action != "stop":
            raise ValueError("stop_on_anomaly=True is on_anomaly='stop'; it cannot go with on_anomaly=%r" % (
                policy.action,))
        self._policy = policy or (survive.OnAnomaly("stop") if stop_on_anomaly else None)
        stop_on_anomaly = self._policy is not None and self._policy.action == "stop"
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError("every_n_steps must be a positive integer, got %r" % (every_n_steps,))
        if weights_every_n_steps is None:
            weights_every_n_steps = 10 * every_n_steps
        if (
            isinstance(weights_every_n_steps, bool)
            or not isinstance(weights_every_n_steps, int)
            or weights_every_n_steps < 1
            or weights_every_n_steps % every_n_steps
        ):
            raise ValueError(
                "weights_every_n_steps must be a positive multiple of every_n_steps (%d), got %r"
                % (every_n_steps, weights_every_n_steps)
            )
        self.log_dir = log_dir
        self.every_n_steps = every_n_steps
        self.weights_every_n_steps = weights_every_n_steps
        self.inputs = inputs
        self.activations = activations
        self.gradients = gradients
        self.weights = weights
        self.update_ratios = update_ratios
        self.stop_on_anomaly = stop_on_anomaly
        self.safe_range = analysis.SafeRange(allow_neginf=tuple(allow_neginf))
        self.anomaly: dict[str, Any] | None = None
        self.replay = replay
        # The replay's verdict on the first non-finite step, once it ran.
        self.replay_verdict: dict[str, Any] | None = None
        self._replay: _keras_replay.StepReplay | None = None
        self._host: HostRecords | None = None  # set while fit runs
        self._survival: SurvivalHost | None = None  # set while fit runs, with a policy
        self._patches = Patches()
        self._batch = 0

    def on_train_begin(self, logs=None) -> None:
        if keras.backend.backend() != "tensorflow":
            raise RuntimeError("NumericsCallback needs the TensorFlow backend of Keras")
        model = self.model
        opt = model.optimizer
        if not model.trainable_variables:
            raise ValueError(
                "NumericsCallback: the model %r has no variables yet (a subclassed model is built by its "
                "first call): build it before fit, by calling it on a batch"
                % model.name
            )
        if not opt.built:
            opt.build(model.trainable_variables)
        plan = RowPlan(model, inputs=self.inputs, activations=self.activations, gradients=self.gradients,
                       weights=self.weights)
        self._replay = _keras_replay.StepReplay(model, self.log_dir) if self.replay else None
        if self._replay is not None:
            self._replay.why_not = why_no_replay(model)
        policy = self._policy
        self._program = StepProgram(model, plan, self._replay, update_ratios=self.update_ratios,
                                    weights_every_n_steps=self.weights_every_n_steps, safe_range=self.safe_range,
                                    policy=policy is not None, spike=policy.spike if policy is not None else None,
                                    listed=bool(self._skip_batches))
        if self._skip_batches and int(getattr(model, "steps_per_execution", 1) or 1) > 1:
            raise ValueError("NumericsCallback: skip_batches holds back one batch's update, and steps_per_execution="
                             "%d runs several batches per call; compile with steps_per_execution=1"
                             % int(model.steps_per_execution))
        if policy is not None and policy.action != "stop" and not self._program.gate.gates:
            raise ValueError("NumericsCallback: on_anomaly=%r holds a bad step's update back, which it can under one "
                             "device or MirroredStrategy, not %s" % (policy.action, type(strategy_of(model)).__name__))
        squared_by = update_check.squares_gradients(opt)
        self._host = HostRecords(self.log_dir, plan, every_n_steps=self.every_n_steps,
                                 update_ratios=self.update_ratios, lso=self._program.lso,
                                 safe_range=self.safe_range, squared_by=squared_by)
        hooks = StepHooks(model, self._program, self._replay)
        self._diagnosis = Diagnosis(model, plan, self._program, hooks, self._host, self._replay,
                                    safe_range=self.safe_range, squared_by=squared_by)
        self._last_call = -1
        self._survival = None if policy is None else SurvivalHost(
            model, policy, plan, self._program, self._diagnosis, self._host, safe_range=self.safe_range,
            set_attribute=self._patches.set, first_verdict=lambda: self.replay_verdict,
            skip_batches=self._skip_batches)
        hooks.install(self._patches, self.activations)
        if self._survival is not None:
            self._survival.begin()

    def on_train_end(self, logs=None) -> None:
        self._patches.restore()
        if self._host is not None:
            host, self._host = self._host, None
            host.close()

    def on_train_batch_end(self, batch, logs=None) -> None:
        if self._host is None:
            return
        steps = self._program.new_steps(self._last_call)
        if not steps:
            return
        self._last_call = steps[-1][1].call
        self._batch = batch
        self._host.collect()
        if self._diagnosis.check_squares(steps) and self.stop_on_anomaly:
            self._stop(*steps[-1], why="an update left the weights or the optimizer's slots non-finite")
        replay_due = self._replay is not None and self.replay_verdict is None
        held = self._survival is not None and any(self._survival.acts_on(v) for _, v in steps)
        if held or ((self.stop_on_anomaly or replay_due) and any(self._host.may_be_anomaly(*s) for s in steps)):
            # Inline, before the next step changes the weights the replay needs.
            self._host.wait()
            self._write_steps(steps)
        else:
            self._host.submit(self._write_steps, steps)
        if self._survival is not None and not self.model.stop_training and self._survival.after(steps, batch):
            self._stop()

    def on_epoch_begin(self, epoch, logs=None) -> None:
        if self._survival is not None:
            self._survival.epoch = int(epoch)

    def on_train_batch_begin(self, batch, logs=None) -> None:
        if self._survival is not None:
            self._survival.before(batch)

    def on_epoch_end(self, epoch, logs=None) -> None:
        if self._host is not None:
            self._host.wait()
            self._host.writer.flush()  # the epoch's last steps, before validation or a pause

    def _write_steps(self, steps: list[tuple[np.ndarray, StepValues]]) -> None:
        for step_stats, values in steps:
            if self._step_done(step_stats, values):
                break

    def _step_done(self, step_stats: np.ndarray, values: StepValues) -> bool:
        """Writes one step's records; at the run's first anomaly, diagnoses
        it (the bad batch, the replay) and stops where asked. True to stop."""
        step_records, anomaly = self._host.write_step(step_stats, values)
        if not anomaly:
            return False
        self._diagnosis.note_bad_batch(values.step, step_records)
        if self._replay is not None and self.replay_verdict is None:
            self.replay_verdict = self._diagnosis.replay(values.step, step_stats)
        if not self.stop_on_anomaly or (self._survival is not None and self._survival.listing):
            return False  # (a listed batch is skipped, whatever it holds)
        self._stop(step_stats, values, why="a record of the step holds a NaN or an Inf")
        return True

    def _stop(self, step_stats: np.ndarray | None = None, values: StepValues | None = None, why: str = "") -> None:
        """Stops training and prints the diagnosis, in the analysis' words;
        given a step, its stop event first (else the policy wrote it)."""
        if values is not None and self._survival is not None and not self.model.stop_training:
            self._survival.stop(step_stats, values, self._batch - (self._last_call - values.call), why)
        self._host.writer.flush()
        self.model.stop_training = True
        if self.anomaly is None:
            self.anomaly = stop_training(self.model, self.log_dir, self.safe_range)
