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
* ``_keras_diagnosis``: at a step that gives a reason, the update check,
  the kept batch and the replay hand-off (``_keras_replay``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tb_numerics import _requires

_requires.tensorflow(__name__)  # says what to install where TensorFlow is missing

from tb_numerics import _keras_replay, update_check  # noqa: E402 - after that check
from tb_numerics._keras_diagnosis import Diagnosis, why_no_replay  # noqa: E402
from tb_numerics._keras_host import NumericsCallbackBase, Step  # noqa: E402
from tb_numerics._keras_patch import StepHooks  # noqa: E402
from tb_numerics._keras_program import StepProgram  # noqa: E402

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
    """

    backend = "tensorflow"

    def _begin(self, model: Any) -> None:
        self._replay = _keras_replay.StepReplay(model, self.log_dir) if self.replay else None
        if self._replay is not None:
            self._replay.why_not = why_no_replay(model)
        self._program = StepProgram(model, self.plan, self._replay, update_ratios=self.update_ratios,
                                    weights_every_n_steps=self.weights_every_n_steps, safe_range=self.safe_range)
        hooks = StepHooks(model, self._program, self._replay)
        self._diagnosis = Diagnosis(model, self.plan, self._program, hooks, self._host, self._replay,
                                    safe_range=self.safe_range, squared_by=self._squared_by(model.optimizer))
        self._last_call = -1
        hooks.install(self._patches, self.activations)

    def _squared_by(self, optimizer: Any) -> str:
        return update_check.squares_gradients(optimizer)

    def _new_steps(self) -> list[Step]:
        steps = self._program.new_steps(self._last_call)
        if steps:
            self._last_call = steps[-1][1].call
        return steps

    def _check_update(self, steps: list[Step]) -> bool:
        return self._diagnosis.check_squares(steps)

    def _kept_batches(self, step: int) -> list[Any]:
        return self._diagnosis.kept_batches(step)

    def _replay_verdict(self, step: int, step_stats: np.ndarray) -> dict[str, Any]:
        # The TensorFlow replay writes its verdict itself (``_keras_replay``).
        return self._diagnosis.replay(step, step_stats)
