"""How the Keras callback sees inside ``fit``: wrappers on the instances, each put back.

Keras callbacks never see gradients or inner activations. For the duration
of ``fit`` the callback sets, on the instances only (``_keras_host.Patches``,
which remembers how to put each one back):

* each layer's ``call`` (``RowPlan.layers``: a nested model's layers
  too), to keep its outputs;
* the model's ``train_step``, to know which layer calls belong to a training
  step (validation and ``predict`` calls are not recorded);
* the model's ``compute_loss`` and the optimizer's ``scale_loss`` (for the
  loss: a custom ``train_step`` written as Keras' guide writes it calls the
  first and not the second), and ``tf.GradientTape.gradient`` (the target of
  the step's first gradient is its loss, where a custom ``train_step``
  computed it by hand and called neither), and the optimizer's ``apply`` (for the
  gradients, the weights before the update and the update itself, which
  ``StepProgram.recorded_apply`` records);
* the ``apply`` of every other optimizer the model holds as an attribute
  (a GAN's second one), whose gradients are recorded with the model
  optimizer's where it runs before it, and whose update is held back with
  the step's (``UpdateGate.gated_other_apply``);
* ``tf.debugging.check_numerics`` and ``assert_all_finite`` (the module's
  attributes, which a program's own numerics checks call): in the step, what
  such a check finds non-finite is kept before it raises and ends the step
  (``StepProgram.keep_checked``), so that the callback still has that step;
* ``model.train_function``, rebuilt so that the wrappers are traced into it
  (or, at a later ``fit`` of the same model, the one built before).

While a replay runs a step again (``_keras_replay``), the wrappers record
nothing and never update the weights: they keep what the replay's layers
made (``StepHooks.replay_trace``) for the callback's consistency check.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import keras
import tensorflow as tf

from tb_numerics import _keras_replay, stats
from tb_numerics._keras_host import Patches
from tb_numerics._keras_plan import float_tensors
from tb_numerics._keras_program import StepProgram, Trace

__all__ = ["StepHooks", "other_optimizers"]


class StepHooks:
    """The wrappers that route a training step into the step program.

    Args:
      model: the model ``fit`` trains.
      program: what records the step (``StepProgram``).
      replay: the step replay, or None.
    """

    def __init__(self, model: Any, program: StepProgram, replay: _keras_replay.StepReplay | None):
        self._model, self._program, self._replay = model, program, replay
        self._trace: Trace | None = None
        self._step_trace: Trace | None = None  # the training step's, for the whole step
        self.replay_trace = Trace()  # what the last replay's layers made

    def install(self, patches: Patches, activations: bool, train_function: Any = None) -> Any:
        """Wraps the model's step, the optimizer and (with ``activations``)
        each recorded layer, and rebuilds the train function around them;
        returns it. ``train_function``: the one these hooks' last install
        built, taken up again instead (already traced around them)."""
        model, opt = self._model, self._model.optimizer
        patches.set(model, "train_step", self._wrap_train_step(model.train_step))
        patches.set(model, "compute_loss", self._wrap_compute_loss(model.compute_loss))
        patches.set(opt, "scale_loss", self._wrap_scale_loss(opt.scale_loss))
        patches.set(tf.GradientTape, "gradient", self._wrap_gradient(tf.GradientTape.gradient))
        patches.set(opt, "apply", self._wrap_apply(opt.apply))
        patches.set(tf.debugging, "check_numerics", self._wrap_check(tf.debugging.check_numerics))
        patches.set(tf.debugging, "assert_all_finite", self._wrap_check(tf.debugging.assert_all_finite))
        for other in other_optimizers(model):
            patches.set(other, "apply", self._wrap_other_apply(other.apply))
        if activations:
            for i, layer in enumerate(self._program.plan.layers):
                patches.set(layer, "call", self._wrap_call(i, layer.call))
        old_function = model.train_function
        patches.on_restore(lambda: setattr(model, "train_function", old_function))
        patches.on_restore(self._forget)
        if train_function is None:
            model.make_train_function(force=True)
        else:
            model.train_function = train_function
        return model.train_function

    def _forget(self) -> None:
        self._trace = None

    def _replaying(self) -> bool:
        return self._replay is not None and self._replay.active

    def _wrap_train_step(self, train_step: Callable[[Any], Any]) -> Callable[[Any], Any]:
        @functools.wraps(train_step)
        def wrapped(data):
            if self._replaying():
                # Replayed at op level: nothing recorded; what the layers made
                # is kept to compare with the step's records.
                self._trace = self.replay_trace = Trace()
                try:
                    return train_step(data)
                finally:
                    self._trace = None
            if self._replay is not None and not self._replay.why_not:
                self._replay.step_begins()
            self._trace = self._step_trace = Trace(data=data, state_before=self._program.gate.state_before())
            try:
                return train_step(data)
            finally:
                self._trace = self._step_trace = None

        return wrapped

    def _wrap_call(self, index: int, call: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(call)
        def wrapped(*args, **kwargs):
            out = call(*args, **kwargs)
            if self._trace is not None:
                self._trace.outputs.setdefault(index, []).extend(float_tensors(out))
            return out

        return wrapped

    def _wrap_check(self, check: Callable[..., Any]) -> Callable[..., Any]:
        """A numerics check of the program's own (``tf.debugging.check_numerics``,
        ``assert_all_finite``): in the traced step, what it finds non-finite
        is kept before it can raise (``StepProgram.keep_checked``)."""

        signature = inspect.signature(check)
        tensor_arg, message_arg = list(signature.parameters)[:2]  # (tensor, message), (x, message)

        @functools.wraps(check)
        def wrapped(*args, **kwargs):
            trace = self._step_trace
            bound = signature.bind(*args, **kwargs)
            t = bound.arguments[tensor_arg]
            if (trace is None or self._replaying() or stats.replica_context() is not None
                    or not (tf.is_tensor(t) and t.dtype.is_floating)):
                return check(*args, **kwargs)
            kept = self._program.keep_checked(t, str(bound.arguments.get(message_arg, "")), trace)
            with tf.control_dependencies([kept]):
                bound.arguments[tensor_arg] = tf.identity(t)
                return check(*bound.args, **bound.kwargs)

        return wrapped

    def _wrap_compute_loss(self, compute_loss: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(compute_loss)
        def wrapped(*args, **kwargs):
            loss = compute_loss(*args, **kwargs)
            if self._trace is not None and self._trace.loss is None:  # the step's first: its loss
                self._trace.loss = loss
            return loss

        return wrapped

    def _wrap_gradient(self, gradient: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(gradient)
        def wrapped(tape, target, sources, *args, **kwargs):
            # A loss computed by hand: no compute_loss before it. Only a gradient with respect to
            # weights: a gradient penalty's (WGAN-GP) is the critic's output's, with respect to inputs.
            weights = tf.nest.flatten(sources)
            if (self._trace is not None and self._trace.loss is None and tf.is_tensor(target)
                    and target.dtype.is_floating and weights
                    and all(isinstance(w, (tf.Variable, keras.Variable)) for w in weights)):
                self._trace.loss = target
            return gradient(tape, target, sources, *args, **kwargs)

        return wrapped

    def _wrap_scale_loss(self, scale_loss: Callable[[Any], Any]) -> Callable[[Any], Any]:
        @functools.wraps(scale_loss)
        def wrapped(loss):
            if self._trace is not None:
                self._trace.loss = loss
            return scale_loss(loss)

        return wrapped

    def _wrap_apply(self, apply: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(apply)
        def wrapped(grads, trainable_variables=None):
            if self._replaying():
                if self._trace is not None:
                    self._trace.grads += list(zip(grads, trainable_variables or self._model.trainable_variables))
                return None  # a replay never updates the weights
            trace = self._trace
            if trace is None:
                return apply(grads, trainable_variables)
            self._trace = None  # one apply per step is recorded
            variables = trainable_variables or self._model.trainable_variables
            return self._program.recorded_apply(apply, trace, list(grads), list(variables))

        return wrapped

    def _wrap_other_apply(self, apply: Callable[..., Any]) -> Callable[..., Any]:
        opt = apply.__self__

        @functools.wraps(apply)
        def wrapped(grads, trainable_variables=None):
            grads = list(grads)
            variables = list(trainable_variables if trainable_variables is not None
                             else opt._trainable_variables)  # noqa: SLF001 - Keras' own default
            trace = self._trace if self._replaying() else self._step_trace
            if trace is not None:  # its gradients are the step's records too (before the model's update)
                trace.grads += list(zip(grads, variables))
            if self._replaying():
                return None  # a replay never updates the weights
            return self._program.gate.gated_other_apply(apply, grads, variables, self._step_trace)

        return wrapped


def other_optimizers(model: Any) -> list[Any]:
    """The optimizers a model holds as attributes (directly, or in a list,
    tuple or dict), besides ``model.optimizer`` and the optimizer a
    LossScaleOptimizer wraps: those a custom ``train_step`` may apply."""
    main = model.optimizer
    skip = {id(main), id(getattr(main, "inner_optimizer", None))}
    out: list[Any] = []
    for value in vars(model).values():
        items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
        for item in items:
            if isinstance(item, keras.optimizers.Optimizer) and id(item) not in skip:
                skip.add(id(item))
                out.append(item)
    return out
