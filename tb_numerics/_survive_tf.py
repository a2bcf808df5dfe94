"""The TensorFlow side of surviving an anomaly (``survive``): the state
snapshot a rewind goes back to, the spike trigger's rolling window, and the
learning-rate factor. Shared by the Keras callback and ``tbn.guard``.

* ``StateSnapshot``: a copy, on the device, of the variables a rewind puts
  back (the model's, every optimizer's slots and step counter, a
  LossScaleOptimizer's scale; never a learning rate, which the rewind
  scales instead). Taking it is one ``tf.function`` call that copies each
  variable where all of them are finite (one more pass over each, to never
  keep a poisoned state); a healthy step between snapshots pays nothing.
* ``SpikeWindow``: the last ``window`` losses and global gradient norms in
  one small variable, and, inside the step, whether the current ones are
  beyond ``z`` standard deviations of them (non-finite entries left out).
* ``LearningRate``: multiplies an optimizer's learning rate, a variable or
  a schedule (wrapped for the duration of training, so that the traced
  step reads the factor).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import keras
import numpy as np
import tensorflow as tf

from tb_numerics import _tf_internal, stats
from tb_numerics.survive import Spike

__all__ = ["LearningRate", "SpikeWindow", "StateSnapshot", "optimizer_state", "replica_copies", "tf_variable",
           "TRIGGER_CODES"]

# A step's trigger as a number inside the step (0: none). A non-finite loss
# and non-finite gradients with a finite loss are told apart for a
# LossScaleOptimizer, whose skips of the second kind are its own business;
# a non-finite state the forward pass updated (BatchNormalization's moving
# statistics) with the loss and gradients finite is the last kind.
TRIGGER_CODES = {"nonfinite": 1, "loss_spike": 2, "grad_norm_spike": 3, "nonfinite_gradients": 4,
                 "nonfinite_state": 5}


def tf_variable(v: Any) -> Any:
    """The TensorFlow variable behind a Keras one (or ``v`` itself)."""
    return getattr(v, "value", v) if isinstance(v, keras.Variable) else v


def _learning_rate_variable(optimizer: Any) -> Any:
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    lr = getattr(inner, "_learning_rate", None)
    return lr if isinstance(lr, keras.Variable) else None


def optimizer_state(optimizers: Sequence[Any]) -> list[Any]:
    """Every variable of ``optimizers`` a rewind puts back: step counters,
    slots, a loss scale; not their learning rates."""
    out = []
    for opt in optimizers:
        lr = _learning_rate_variable(opt)
        out += [v for v in opt.variables if v is not lr]
    return out


class StateSnapshot:
    """Two copies of ``variables`` on the device, the older one a rewind's target.

    A failure is often the end of a divergence that began steps before (the
    weights grow, still finite, then overflow): the newest copy may already
    hold that growth, and a rewind to it fails again at once. So copies are
    taken in turn into two buffers, and a rewind goes back to the older of
    the two: between one and two periods before the failure (PaLM restarted
    about 100 steps before a spike); the newer one, taken on the way to the
    failure, is dropped.

    Under several replicas each replica's own copy of a variable is kept
    and put back (on its own device): the forward pass writes each one's
    BatchNormalization statistics from its own part of the batch, so they
    differ.

    Args:
      variables: what a rewind restores (Keras or TensorFlow variables).

    Attributes:
      nbytes: the device memory the copies take (both buffers, every replica).
    """

    def __init__(self, variables: Sequence[Any]):
        seen: set[int] = set()
        self._vars = [c for v in variables if not (id(v) in seen or seen.add(id(v))) for c in replica_copies(v)]
        self._buffers = [[_copy_buffer(v) for v in self._vars] for _ in range(2)]
        self.nbytes = 2 * int(sum(np.prod(v.shape, dtype=np.int64) * v.dtype.size for v in self._vars))
        self._steps: list[int | None] = [None, None]  # the step each buffer's state starts
        self._takes = [tf.function(functools.partial(self._take_if_finite, b), autograph=False) for b in self._buffers]
        self._puts = [tf.function(functools.partial(self._put_back, b), autograph=False) for b in self._buffers]

    def _take_if_finite(self, copies: list) -> tf.Tensor:
        values = [v.read_value() for v in self._vars]
        floats = [x for x in values if x.dtype.is_floating]
        finite = stats.all_finite(floats) if floats else tf.constant(True)

        def copy() -> tf.Tensor:
            for c, x in zip(copies, values):
                c.assign(x)
            return tf.constant(True)

        return tf.cond(finite, copy, lambda: tf.constant(False))

    def _put_back(self, copies: list) -> None:
        for v, c in zip(self._vars, copies):
            v.assign(c.read_value())

    def take(self, step: int) -> bool:
        """Copies the variables, as the state ``step`` starts from, over the
        older copy, where all of them are finite; whether it did."""
        older = self._older()
        ok = bool(self._takes[older]())
        if ok:
            self._steps[older] = int(step)
        return ok

    def restore(self) -> int | None:
        """Puts the older copy back into the variables (on every replica) and
        drops the newer one; the step its state starts, or None where no
        copy was taken."""
        held = [i for i in (0, 1) if self._steps[i] is not None]
        if not held:
            return None
        i = min(held, key=lambda k: self._steps[k])
        self._puts[i]()
        self._steps[1 - i] = None
        return self._steps[i]

    def _older(self) -> int:
        """The buffer to write next: an empty one, else the older."""
        if None in self._steps:
            return self._steps.index(None)
        return 0 if self._steps[0] < self._steps[1] else 1


def replica_copies(v: Any) -> list[tf.Variable]:
    """The plain variables behind ``v``: each replica's copy of a
    distributed one (read and written apart, as a replica's own), else
    its TensorFlow variable."""
    tv = tf_variable(v)
    copies = getattr(tv, "values", None)
    return list(copies) if isinstance(copies, tuple) else [tv]


def _copy_buffer(v: tf.Variable) -> tf.Variable:
    """A plain variable on ``v``'s device to hold a copy of it."""
    with tf.device(v.device):
        return _tf_internal.untracked_variable(tf.zeros(v.shape, v.dtype), "tb_numerics_snapshot")


class SpikeWindow:
    """The spike trigger's rolling window, inside the step.

    Args:
      spike: the trigger's parameters.
    """

    def __init__(self, spike: Spike):
        self.spike = spike
        self._values = _tf_internal.untracked_variable(np.full([spike.window, 2], np.nan), "tb_numerics_spike")
        self._count = _tf_internal.untracked_variable(np.int64(0), "tb_numerics_spike_count")

    def check(self, loss: tf.Tensor, grad_norm: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        """(trigger code, the window's mean, its standard deviation) of the
        current step: ``TRIGGER_CODES``' spike where the loss (checked first)
        or the global gradient norm is more than z standard deviations above
        the window's mean; 0 otherwise (and for a non-finite value, another
        trigger's business)."""
        s = self.spike
        window = self._values.read_value()
        code, mean, std = tf.constant(0, tf.int64), tf.constant(0.0, tf.float64), tf.constant(0.0, tf.float64)
        watched = ((1, grad_norm, s.grad_norm, "grad_norm_spike"), (0, loss, s.loss, "loss_spike"))
        for col, value, on, name in watched:
            if not on:
                continue
            x = tf.cast(value, tf.float64)
            m, sd, n = _mean_std(window[:, col])
            fired = (n >= s.min_steps) & tf.math.is_finite(x) & (x > m + s.z * sd)
            code = tf.where(fired, tf.constant(TRIGGER_CODES[name], tf.int64), code)
            mean, std = tf.where(fired, m, mean), tf.where(fired, sd, std)
        return code, mean, std

    def push(self, loss: tf.Tensor, grad_norm: tf.Tensor) -> None:
        """Adds the step's loss and global gradient norm (non-finite ones are
        kept as NaN and left out of the statistics, as OLMo-core does)."""
        row = tf.stack([tf.cast(loss, tf.float64), tf.cast(grad_norm, tf.float64)])
        row = tf.where(tf.math.is_finite(row), row, tf.constant(np.nan, tf.float64))
        i = tf.math.floormod(self._count.read_value(), self.spike.window)
        self._values.scatter_nd_update(tf.reshape(i, [1, 1]), row[None])
        self._count.assign_add(1)


def _mean_std(column: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """Mean, sample standard deviation and count of the finite entries."""
    finite = tf.math.is_finite(column)
    n = tf.reduce_sum(tf.cast(finite, tf.float64))
    x = tf.where(finite, column, tf.zeros_like(column))
    mean = tf.reduce_sum(x) / tf.maximum(n, 1.0)
    var = tf.reduce_sum(tf.where(finite, tf.square(column - mean), tf.zeros_like(column))) / tf.maximum(n - 1.0, 1.0)
    return mean, tf.sqrt(var), n


class _ScaledSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """A learning-rate schedule times a factor held in a variable."""

    def __init__(self, schedule: Any, factor: tf.Variable):
        self.schedule, self.factor = schedule, factor

    def __call__(self, step: Any) -> Any:
        return self.schedule(step) * tf.cast(self.factor, tf.float32)

    def get_config(self) -> dict:
        return {"schedule": keras.saving.serialize_keras_object(self.schedule)}


class LearningRate:
    """Multiplies an optimizer's learning rate by a factor, on demand.

    Args:
      optimizer: the optimizer (a LossScaleOptimizer: the one it wraps).
      set_attribute: ``set_attribute(obj, name, value)`` sets an instance
        attribute until training ends (the callback's ``Patches.set``);
        needed where the learning rate is a schedule.

    Raises:
      ValueError: the learning rate is neither a variable nor a schedule.
    """

    def __init__(self, optimizer: Any, set_attribute: Callable[[Any, str, Any], None] | None):
        self._opt = getattr(optimizer, "inner_optimizer", optimizer)
        self._variable = _learning_rate_variable(optimizer)
        self._factor: tf.Variable | None = None
        lr = getattr(self._opt, "_learning_rate", None)
        if self._variable is None:
            if not isinstance(lr, keras.optimizers.schedules.LearningRateSchedule) or set_attribute is None:
                raise ValueError("OnAnomaly.lr_factor needs a learning rate that is a number or a Keras "
                                 "LearningRateSchedule, not %r" % (lr,))
            self._factor = _tf_internal.untracked_variable(np.float32(1.0), "tb_numerics_lr_factor")
            set_attribute(self._opt, "_learning_rate", _ScaledSchedule(lr, self._factor))

    def scale(self, factor: float) -> float:
        """Multiplies the learning rate by ``factor``; the learning rate now."""
        if self._variable is not None:
            self._variable.assign(self._variable.numpy() * factor)
        else:
            self._factor.assign(self._factor.numpy() * factor)
        return self.current()

    def current(self) -> float:
        """The learning rate the next step uses."""
        lr = self._opt.learning_rate  # a variable, or a schedule's tensor
        return float(lr.numpy()) if hasattr(lr, "numpy") else float(lr)
