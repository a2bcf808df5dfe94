"""Replay of the first non-finite step of ``model.fit`` at op level.

The Keras callback records layers cheaply on every step. At the first step
whose records hold a NaN or an Inf it runs that step again, eagerly and
without XLA, under ``oplevel.replay_step``, so the report names the exact
op and source line (issue 14). What a replay needs, and how it is kept:

* the step's batch: a step whose layer outputs, loss or gradients hold a
  NaN or an Inf copies its batch into variables inside the training step,
  in a branch nothing else waits for (a healthy step copies nothing). Under
  ``MirroredStrategy`` each replica decides on its own records and copies
  its own part of the batch into variables of its own, on its own device:
  no collective, no copy between devices;
  under ``steps_per_execution > 1`` the first bad step of a call keeps its
  batch until the host has looked at the call's steps (``release``), and
  the replay, after the call, runs on the weights its later steps left
  (the verdict says so where it stays finite there);
* the model's variables as they were before the step's update: the update
  of a step whose loss or gradients are not finite is not applied, as a
  ``LossScaleOptimizer`` does (a NaN update would only poison the weights),
  so after such a step the weights are still the ones it used. Under a
  ``LossScaleOptimizer`` its own skip does this. Under several replicas the
  update merges across replicas, which cannot sit in a branch taken in a
  replica; so, as Keras' own ``LossScaleOptimizer`` does there, the branch
  is taken once in the cross-replica context (a ``merge_call``), on every
  replica's verdict together, and its update branch runs the update on
  each replica again (``call_for_each_replica``). Holding the update back
  keeps the optimizer's slots (Adam's moments) as they were, which zeroed
  gradients would not, and costs no copy of the weights, which a snapshot
  restored after a bad step would on every step.

The replay runs the model's own ``train_step`` (a custom one too) with the
optimizer's update suppressed, and puts back every non-trainable variable
and metric it touched (BatchNorm's moving statistics, the loss tracker, the
seed generators). Keras' random layers (Dropout, the dropout of attention
and RNN cells, GaussianNoise, random augmentation) draw stateless values
from a ``keras.random.SeedGenerator`` whose state advances every step; the
kept batch carries those states as the step began, and the replay starts
from them, so it draws the step's own masks. TensorFlow's stateful random
ops (``tf.nn.dropout``, ``tf.random.uniform``) cannot be rewound: where
they made the failure, the replay does not reproduce it, and ``check``
(the callback's comparison of the replay's layer records with the step's)
turns a replay that went bad elsewhere than the step into "not reproduced"
rather than a wrong op. Whatever a replay raises, training goes on: the
verdict says why.
Under several replicas it runs once, outside ``strategy.run``, on the part
of the batch of the replica whose records went bad (the callback says
which), and the verdict names that replica (``"replica"``). There the loss
is not divided by the number of replicas as in the step: a factor that
makes no NaN or Inf and hides none (only a value within that factor of its
dtype's largest could overflow in one and not the other), so the replay
finds the same first non-finite op.

Its verdict is written into the run as one record, ``REPLAY_TAG``, whose
description holds the JSON the report shows as ``first_anomaly.replay``.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import re
from typing import Any, Callable

import numpy as np
import tensorflow as tf

from tb_numerics import _survive_tf, _tf_internal, metadata, records, stats
from tb_numerics.backends import _replay_common

__all__ = ["REPLAY_TAG", "StepReplay", "seed_states"]

REPLAY_TAG = metadata.REPLAY_TAG

# The name keras.random.SeedGenerator gives its state variable.
_SEED_STATE = "seed_generator_state"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_MAX_WHY = 600  # characters of an error's message in a verdict

_log = logging.getLogger(__name__)

_NOT_REPRODUCED = (
    "every op output was finite when the step ran again eagerly without XLA, on the same weights and batch: the "
    "fault is not reproducible, so not in the data or the model: non-determinism (a TensorFlow random op, "
    "tf.nn.dropout or tf.random.*, where Keras' seeded layers draw the step's own values; a random data "
    "pipeline; XLA computing the step differently) or a hardware fault; the layer-level answer stands"
)

_MOVED = (
    "every op output was finite when the step ran again eagerly without XLA on its batch, but on the weights as "
    "its call of the train function left them (steps_per_execution > 1: %d later step(s) of that call ran "
    "first and may have updated them), so the fault may lie in the step's own weights; the layer-level answer stands"
)

_XLA_DRAWS = (
    "the step ran under XLA, whose random numbers differ from TensorFlow's eager kernels for the same seed, so "
    "the replay, eager, could not redraw its Keras random values (dropout masks); the layer-level answer stands"
)


class StepReplay:
    """Keeps the batch of a step that went bad, and replays it at op level on demand."""

    def __init__(self, model: Any, log_dir: str):
        self._model = model
        self._log_dir = log_dir
        # One set of buffers per replica and batch signature a trace met (XLA
        # cannot change a variable's shape, and the last batch may be
        # smaller), and, per replica, which set its last step wrote.
        self._sets: dict[tuple, tuple[Any, list[tf.Variable]]] = {}
        self._order: list[tuple] = []
        self._last: dict[int, tf.Variable] = {}  # per replica: the set its last bad step wrote
        self._step: dict[int, tf.Variable] = {}  # per replica: the step whose batch is kept
        self.why_not: str | None = None  # set where a replay cannot run
        self.active = False  # True while the replay runs the step
        self._seeds = seed_states(model)
        # Under XLA, Keras' random layers drew values the eager replay cannot redraw.
        self._xla_draws = bool(self._seeds) and getattr(model, "jit_compile", False) is True
        self._seeds_at_start: list[tf.Tensor] = []  # of the step being traced
        # Under steps_per_execution > 1 the host sees a call's steps after
        # all of them ran: the batch kept is the call's first bad step's,
        # until the host has looked at them (``release``).
        self._first_of_call = int(getattr(model, "steps_per_execution", 1) or 1) > 1

    def step_begins(self) -> None:
        """Reads the seed generators' states as the step being traced begins
        (before its random layers advance them), for ``keep_if``."""
        self._seeds_at_start = [tf.convert_to_tensor(v) for v in self._seeds]

    def keep_if(self, bad: tf.Tensor, data: Any, step: tf.Tensor) -> None:
        """Copies the step's batch, and its seed generators' states as it began,
        into buffers where ``bad`` (inside the traced step): a healthy step
        copies nothing. Under several replicas, each replica its own part, on
        its own verdict, into buffers of its own. A batch it cannot keep
        leaves the step as it was, and the replay says why."""
        try:
            self._keep_if(bad, data, step)
        except (TypeError, ValueError) as e:
            self.why_not = "the replay could not keep the step's batch: %s" % _error_text(e)

    def _keep_if(self, bad: tf.Tensor, data: Any, step: tf.Tensor) -> None:
        replica = _replica_id()
        data = (data, list(self._seeds_at_start))
        # Ragged and sparse leaves as their component tensors.
        leaves = [tf.convert_to_tensor(t) for t in tf.nest.flatten(data, expand_composites=True)]
        key = (replica,) + tuple(
            (t.dtype.name, tuple(t.shape.as_list()) if t.shape.rank is not None else None) for t in leaves)
        if key not in self._sets:
            # Made in the replica's device scope, so on its device.
            self._sets[key] = (data, [_buffer(t) for t in leaves])
            self._order.append(key)
        if replica not in self._last:
            self._last[replica] = _tf_internal.untracked_variable(np.int32(-1), "tb_numerics_batch_set")
            self._step[replica] = _tf_internal.untracked_variable(np.int64(-1), "tb_numerics_batch_step")
        buffers, index = self._sets[key][1], self._order.index(key)
        last, kept_step = self._last[replica], self._step[replica]

        def copy() -> tf.Tensor:
            for buf, leaf in zip(buffers, leaves):
                buf.assign(leaf)
            last.assign(index)
            kept_step.assign(tf.cast(step, tf.int64))
            return tf.constant(True)

        if self._first_of_call:
            bad = tf.logical_and(bad, kept_step.read_value() < 0)
        tf.cond(bad, copy, lambda: tf.constant(False))

    def release(self) -> None:
        """Under steps_per_execution > 1, once the host has looked at a call's
        steps: the next call's first bad step may keep its batch."""
        if self._first_of_call:
            for kept_step in self._step.values():
                kept_step.assign(-1)

    def _kept(self, step: int, replica: int) -> tuple[Any, list[tf.Tensor]] | None:
        """(batch, seed generators' states as the step began) of ``step``; None
        where none was kept for that step."""
        last = self._last.get(replica)
        if last is None or int(self._step[replica].numpy()) != step:
            return None
        structure, buffers = self._sets[self._order[int(last.numpy())]]
        return tf.nest.pack_sequence_as(structure, [b.read_value() for b in buffers], expand_composites=True)

    def batch(self, step: int, replica: int = 0) -> Any:
        """The batch of ``step`` (``replica``'s part of it), as the step received
        it; None where none was kept for that step."""
        kept = self._kept(step, replica)
        return None if kept is None else kept[0]

    def replay(self, step: int, train_step: Callable[[Any], Any], replica: int | None = None,
               check: Callable[[], str | None] | None = None, loss_scale: float | None = None,
               unscaled: bool = False, later_steps: int = 0) -> dict[str, Any]:
        """Runs ``train_step`` on the kept batch once more at op level, at
        ``step``; writes and returns the verdict (``first_anomaly.replay``).
        It never raises: a replay that fails says why in the verdict.

        Args:
          step: the step that went bad.
          train_step: the model's training step (its update suppressed).
          replica: under several replicas, the one whose part of the batch
            to replay (the verdict names it); None on one device.
          check: called after a replay that found a non-finite op: why the
            replay computed other values than the step (the op would be the
            wrong one), or None where they agree.
          loss_scale: a LossScaleOptimizer's scale as the step ran (its skip
            has lowered it since); None without one.
          unscaled: run with the scale at 1 instead, where the step's
            gradients were non-finite at 1 too (said in the verdict: ``rules.kinds``).
          later_steps: under steps_per_execution > 1, how many steps of the
            same call ran after ``step`` (their updates, where applied, moved
            the weights the replay runs on).
        """
        verdict: dict[str, Any] = {"step": int(step), **({"unscaled": True} if unscaled else {})}
        if unscaled:
            loss_scale = 1.0
        if replica is not None:
            verdict["replica"] = int(replica)
        try:
            kept = None if self.why_not else self._kept(int(step), replica or 0)
            if kept is None:
                verdict.update(reproduced=False, why=self.why_not or "its layer outputs, loss and gradients were "
                               "finite: it went bad in the optimizer's update, which a replay of the step does not run")
            else:
                verdict.update(self._verdict(self._run(train_step, kept, int(step), loss_scale), check,
                                             stats.batch_finite(kept[0]), later_steps))
        except Exception as e:  # noqa: BLE001 - a replay must never stop training
            verdict.update(reproduced=False, why="the replay raised %s" % _error_text(e))
        return self._write(verdict)

    def probe(self, step: int, train_step: Callable[[Any], Any], replica: int | None = None,
              loss_scale: float | None = None) -> Any:
        """The first non-finite op (an ``oplevel.OpRecord``) of ``train_step``
        run again at op level on ``step``'s kept batch, writing nothing; None
        where it found none, or no batch was kept, or it raised."""
        kept = None if self.why_not else self._kept(int(step), replica or 0)
        if kept is None:
            return None
        try:
            return self._run(train_step, kept, int(step), loss_scale, quiet=True)
        except Exception:  # noqa: BLE001 - a probe must never stop training
            _log.warning("tb_numerics: the look inside step %d's forward pass raised", step, exc_info=True)
            return None

    def _run(self, train_step: Callable[[Any], Any], kept: tuple[Any, list[tf.Tensor]], step: int,
             loss_scale: float | None = None, quiet: bool = False) -> Any:
        """The first non-finite op of ``train_step`` on the kept batch, from the
        seed states (and loss scale) the step began with; every state it
        changes is put back. Its op records go to a ``.replay`` file of the
        run, or nowhere where ``quiet``."""
        batch, seeds = kept
        saved = _state(self._model)
        scale = getattr(self._model.optimizer, "dynamic_scale", None) if loss_scale is not None else None
        if scale is not None:
            saved.append((scale, scale.numpy()))
            scale.assign(loss_scale)
        self.active = True
        try:
            for m in getattr(self._model, "metrics", []):
                m.reset_state()  # the failing step left a NaN in the loss tracker's total
            for var, value in zip(self._seeds, seeds):
                var.assign(value)  # the step's own random draws (dropout masks)
            return _outside_strategy_scope(self._replay_step, train_step, batch, step, quiet)
        finally:
            self.active = False
            for var, value in saved:
                var.assign(value)

    def _verdict(self, found: Any, check: Callable[[], str | None] | None, batch_finite: bool = True,
                 later_steps: int = 0) -> dict[str, Any]:
        """``reproduced`` and ``op``, or ``why`` not, of a replay that found ``found``
        (``batch_finite``: whether the step's batch was finite as it arrived;
        ``later_steps``: steps of its call that ran after it)."""
        if found is None and later_steps:
            # Not a verdict on reproducibility: the weights were not the step's.
            return {"reproduced": False, "reproducible": None, "why": _MOVED % later_steps}
        if found is None:
            # Ran, and finite: not reproducible (unless XLA's draws could not be redrawn).
            return {"reproduced": False, "reproducible": None if self._xla_draws else False,
                    "why": _XLA_DRAWS if self._xla_draws else _NOT_REPRODUCED}
        if found.reads_nonfinite():  # not born in the step: the batch's, or a variable's
            return _replay_common.verdict(found, _NOT_REPRODUCED, batch_finite)
        other = check() if check is not None else None
        if other:
            why = "the replay computed other values than the step: %s; the op it found (%s) may not be the " \
                  "step's, so the layer-level answer stands" % (other, found.name)
            if later_steps:
                why += " (it ran on the weights as %d later step(s) of the step's call left them)" % later_steps
            return {"reproduced": False, "why": why + (" (%s)" % _XLA_DRAWS if self._xla_draws else "")}
        return {"reproduced": True, "op": found.to_json()}

    def _replay_step(self, train_step: Callable[[Any], Any], batch: Any, step: int, quiet: bool = False) -> Any:
        from tb_numerics import oplevel

        if quiet:  # in the thread that runs it: summaries' recording is per thread
            with tf.summary.record_if(False):
                return oplevel.replay_step(train_step, batch, step=step)
        writer = tf.summary.create_file_writer(self._log_dir, filename_suffix=".replay")
        try:
            return oplevel.replay_step(train_step, batch, step=step, writer=writer)
        finally:
            writer.close()

    def _write(self, verdict: dict[str, Any]) -> dict[str, Any]:
        from tb_numerics import record_writer

        info = metadata.TensorInfo(role="other", op_type="Replay", description=json.dumps(verdict, default=_num))
        try:
            with record_writer.NumericsRecordWriter(self._log_dir, filename_suffix=".verdict") as w:
                w.write(REPLAY_TAG, verdict["step"], records.numpy_stats(np.zeros(0, np.float32)), info)
        except Exception:  # noqa: BLE001 - nor may writing its verdict
            _log.exception("tb_numerics: could not write the replay's verdict to %s", self._log_dir)
        return verdict


def seed_states(model: Any) -> list[tf.Variable]:
    """The state variables of the model's Keras seed generators (Dropout's,
    an attention or RNN cell's dropout, GaussianNoise, random augmentation):
    their values as a step begins decide its random draws."""
    return [v for v in model.non_trainable_variables if v.name == _SEED_STATE]


def _error_text(e: BaseException) -> str:
    """``Type: message`` of an error on one line, without the terminal's colour
    codes Keras puts in a layer's error, and cut to a readable length."""
    text = " ".join(_ANSI.sub("", "%s: %s" % (type(e).__name__, e)).split())
    return text if len(text) <= _MAX_WHY else text[: _MAX_WHY - 3] + "..."


def _buffer(t: tf.Tensor) -> tf.Variable:
    """A variable for one leaf of the batch: of its static shape where that is
    known (XLA keeps a variable's shape), else of any shape."""
    zero = b"" if t.dtype == tf.string else 0  # a string input (StringLookup, TextVectorization)
    if t.shape.is_fully_defined():
        initial = np.full(t.shape.as_list(), zero, t.dtype.as_numpy_dtype)
        return _tf_internal.untracked_variable(initial, "tb_numerics_batch")
    initial = np.full([0], zero, t.dtype.as_numpy_dtype)
    return _tf_internal.untracked_variable(initial, "tb_numerics_batch", shape=tf.TensorShape(None))


def _replica_id() -> int:
    """The replica this trace runs for: 0 on one device. Under several
    replicas its number, known when the step is traced (MirroredStrategy)."""
    ctx = stats.replica_context()
    return 0 if ctx is None else int(tf.get_static_value(ctx.replica_id_in_sync_group))


def _outside_strategy_scope(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` where no strategy's scope is entered.

    Within a scope (``fit`` called inside ``with strategy.scope()``), a
    distributed variable cannot be read outside ``strategy.run``; a scope
    holds for the thread that entered it, so there ``fn`` runs on a thread
    of its own.
    """
    if not tf.distribute.has_strategy():
        return fn(*args)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tb_numerics_replay") as pool:
        return pool.submit(fn, *args).result()


def _num(x: Any) -> Any:
    return float(x) if isinstance(x, (np.floating, np.integer)) else str(x)


def _state(model: Any) -> list[tuple[tf.Variable, np.ndarray]]:
    """The values of the variables a replayed step may change besides the
    trainable weights: non-trainable ones and the metrics' (each replica's
    copy of a distributed one)."""
    variables = list(model.non_trainable_variables)
    for m in getattr(model, "metrics", []):
        variables.extend(m.variables)
    seen: set[int] = set()
    out = []
    for v in variables:
        if id(v) not in seen:
            seen.add(id(v))
            # Under several replicas, each replica's own copy: BatchNormalization's
            # moving statistics differ between replicas (each normalises its own part).
            out += [(c, c.numpy()) for c in _survive_tf.replica_copies(v)]
    return out
