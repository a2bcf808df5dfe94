"""A Keras 3 callback that logs the numerics of ``model.fit`` (TensorFlow backend).

    from tb_numerics.keras import NumericsCallback
    model.fit(x, y, callbacks=[NumericsCallback("logs/run1")])

Keras callbacks never see gradients or inner activations, so for the
duration of ``fit`` (from ``on_train_begin`` to ``on_train_end``, when
everything is put back) the callback wraps, on the instances only:

* each top-level layer's ``call``, to keep its outputs;
* the model's ``train_step``, to know which layer calls belong to a training
  step (validation and ``predict`` calls are not recorded);
* the optimizer's ``scale_loss`` (for the loss) and ``apply`` (for the
  gradients, the weights before the update and the update itself);
* ``model.train_function``, rebuilt so that the wrappers are traced into it.

The statistics (``stats.tensor_stats``) are computed inside the training
step, compiled or not, and stored in a small variable; the callback reads it
after each batch and writes the records from the host. So the same records
come out under ``jit_compile=True``, where summary ops cannot run. The model's
code, outputs and training are unchanged.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import sys
from typing import Any, Callable, Sequence

import numpy as np

from tb_numerics import _requires

tf = _requires.tensorflow(__name__)
import keras  # noqa: E402 - after the check that says what to install

from tb_numerics import _keras_batch, _keras_replay, _tf_internal, analysis, cli, detectors, event_reader, latch, metadata, record_writer, records, stats, summary, update_check

F = metadata.FIELD_INDEX
_NONFINITE = slice(F["nan"], F["neginf"] + 1)
_MAX_PENDING_WRITES = 8  # batches whose records may wait for the writer thread
_NUM_AUX = 4  # call index, step, loss scale, whether weights were computed
NUM_FIELDS = metadata.NUM_FIELDS


@dataclasses.dataclass
class _Row:
    """One record computed in the step: its tag and what the metadata says."""

    tag: str
    role: str
    dtype: str = "float32"
    shape: tuple[int | None, ...] | None = None
    op_type: str = ""
    description: str = ""
    activation: str = ""  # the layer's activation function, or the loss function's name
    compute_dtype: str = ""  # the dtype the layer computes in (float16 under mixed_float16)
    present: bool = False  # set when the training step is traced


class _Trace:
    """What one trace (or eager run) of the training step collected."""

    def __init__(self) -> None:
        self.outputs: dict[int, list[tf.Tensor]] = {}
        self.loss: tf.Tensor | None = None
        # Each gradient's plain sum, as its statistics computed it (by variable index).
        self.grad_sums: dict[int, tf.Tensor] = {}
        self.data: Any = None  # the step's batch, kept for a replay if the step goes bad
        self.grads: list[tuple[Any, Any]] = []  # a replay's (gradient, variable) pairs


def _float_tensors(structure: Any) -> list[tf.Tensor]:
    return [
        t
        for t in tf.nest.flatten(structure)
        if isinstance(t, (tf.Tensor, tf.Variable)) and t.dtype.base_dtype.name in metadata.DTYPE_LIMITS
    ]


def _merged_stats(tensors: Sequence[tf.Tensor], name: str) -> tf.Tensor:
    """The record of all of ``tensors`` together (a layer's outputs, or its repeated calls)."""
    out = stats.tensor_stats(tf.stop_gradient(tensors[0]), name)
    for t in tensors[1:]:
        out = stats.merge_stats(out, stats.tensor_stats(tf.stop_gradient(t), name))
    return out


def _may_be_anomaly(step_stats: np.ndarray, aux: np.ndarray) -> bool:
    """Whether a step's records may hold an anomaly: a non-finite count, or a
    non-finite update norm (an update that overflowed finite weights)."""
    return bool(step_stats[:, _NONFINITE].any() or not np.isfinite(aux[_NUM_AUX:]).all())


def _function_name(fn: Any) -> str:
    """The name of a Keras activation or loss: a string, a function, or a
    Loss object ("" where none is known)."""
    if fn is None:
        return ""
    if isinstance(fn, str):
        return fn
    if isinstance(fn, (list, tuple)):
        return ",".join(filter(None, (_function_name(f) for f in fn)))
    if isinstance(fn, dict):
        return ",".join(filter(None, (_function_name(f) for f in fn.values())))
    name = getattr(fn, "name", None) or getattr(fn, "__name__", None) or type(fn).__name__
    return str(name)


def _strategy(model: Any) -> tf.distribute.Strategy:
    """The strategy ``fit`` runs the model's steps under (the default one on one device)."""
    return getattr(model, "distribute_strategy", None) or tf.distribute.get_strategy()


def _why_no_replay(model: Any) -> str | None:
    """Why this fit cannot replay a step, or None where it can."""
    strategy = _strategy(model)
    if strategy.num_replicas_in_sync > 1 and not isinstance(strategy, tf.distribute.MirroredStrategy):
        return "replay under several replicas is supported under MirroredStrategy only, not %s" % (
            type(strategy).__name__)
    if int(getattr(model, "steps_per_execution", 1) or 1) > 1:
        return "replay keeps one step's batch, and steps_per_execution > 1 runs several steps per call"
    return None


def _apply_if_all_finite(strategy, finite, grads, *, apply, variables) -> tf.Tensor:
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


def _bad_rows(counts: np.ndarray, neginf_ok: np.ndarray) -> np.ndarray:
    """Per row, whether its (NaN, +Inf, -Inf) counts (the last axis) hold a
    non-finite value; an allowlisted row's -Inf does not count."""
    return (counts[..., 0] > 0) | (counts[..., 1] > 0) | ((counts[..., 2] > 0) & ~neginf_ok)


def _state_variable(initial_value: tf.Tensor) -> tf.Variable:
    return _tf_internal.untracked_variable(initial_value, "tb_numerics_callback")


def _compute_dtype(layer: Any) -> str:
    """The dtype a layer computes in ("" where unknown)."""
    dtype = getattr(layer, "compute_dtype", None)
    return str(dtype) if dtype else ""


def _layer_of_variables(model: keras.Model) -> dict[int, int]:
    """id(variable) -> index of the top-level layer that owns it."""
    owner: dict[int, int] = {}
    for i, layer in enumerate(model.layers):
        for v in layer.weights:
            owner.setdefault(id(v), i)
    return owner


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

    Under a ``tf.distribute`` strategy with several replicas, each record is
    that of all replicas' values together (one record per step, a NaN on any
    replica is seen); a gradient record is of the replicas' own gradients,
    before the optimizer combines them.

    After training, ``anomaly`` holds the first anomaly (as in
    ``tb-numerics report --json``) when ``stop_on_anomaly`` stopped it.
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
    ):
        super().__init__()
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
        self._replay_trace = _Trace()  # what the last replay's layers made
        self._writer: record_writer.NumericsRecordWriter | None = None
        self._restore: list[Callable[[], None]] = []
        self._trace: _Trace | None = None

    # ------------------------------------------------------------ set-up

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
        self._lso = isinstance(opt, keras.optimizers.LossScaleOptimizer)
        layers = list(model.layers)
        self._plan_rows(model, layers)
        self._plan_update_check(opt)
        self._replay = _keras_replay.StepReplay(model, self.log_dir) if self.replay else None
        if self._replay is not None:
            self._replay.why_not = _why_no_replay(model)
        self._make_step_state(model)
        self._last_call = -1
        self._prev: tuple[int, list] | None = None  # the last step computed but not written
        self._seen = latch.NO_KINDS  # the kinds of non-finite values written so far (latch)
        self._batch_noted = False
        self._infos: dict[str, metadata.TensorInfo] = {}
        self._writer = record_writer.NumericsRecordWriter(self.log_dir)
        # Records are built and written by one thread beside training, off the
        # step's critical path; a batch that may stop training is handled inline.
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tb_numerics_callback")
        self._pending: list[concurrent.futures.Future] = []

        self._patch(model, "train_step", self._wrap_train_step(model.train_step))
        self._patch(opt, "scale_loss", self._wrap_scale_loss(opt.scale_loss))
        self._patch(opt, "apply", self._wrap_apply(opt.apply))
        if self.activations:
            for i, layer in enumerate(layers):
                self._patch(layer, "call", self._wrap_call(i, layer.call))
        old_function = model.train_function
        self._restore.append(lambda: setattr(model, "train_function", old_function))
        model.make_train_function(force=True)

    def _plan_rows(self, model: keras.Model, layers: list) -> None:
        """The rows the step computes, in execution order: forward, backward, update."""
        owner = _layer_of_variables(model)
        self._layer_names = [layer.name for layer in layers]
        self._rows: list[_Row] = []
        self._plan_batch_rows(model)
        self._act_rows = {}
        if self.activations:
            for i, layer in enumerate(layers):
                self._act_rows[i] = len(self._rows)
                self._rows.append(_Row("%s/output" % layer.name, "activation", op_type=type(layer).__name__,
                                       activation=_function_name(getattr(layer, "activation", None)),
                                       compute_dtype=_compute_dtype(layer)))
        self._loss_row = len(self._rows)
        self._rows.append(_Row("loss", "loss", activation=_function_name(getattr(model, "loss", None))))
        # Trainable variables in layer order; those of no top-level layer last.
        self._vars = sorted(model.trainable_variables, key=lambda v: owner.get(id(v), len(layers)))
        self._var_layer = [owner.get(id(v), -1) for v in self._vars]
        # Gradients in backward order (the last layer's first), as
        # backpropagation computes them and as log_gradients records them: the
        # first non-finite gradient of a step is then the one where it was born.
        self._grad_rows: dict[int, int] = {}
        if self.gradients:
            for j in reversed(range(len(self._vars))):
                v = self._vars[j]
                self._grad_rows[j] = len(self._rows)
                # A float32 master weight's gradient is computed in its layer's dtype.
                layer = layers[self._var_layer[j]] if self._var_layer[j] >= 0 else None
                self._rows.append(_Row(summary.gradient_tag(v), "gradient", str(v.dtype), tuple(v.shape),
                                       present=True, compute_dtype=_compute_dtype(layer)))
        self._weight_row0 = len(self._rows)
        if self.weights:
            for v in self._vars:
                self._rows.append(_Row(v.path, "weight", str(v.dtype), tuple(v.shape), present=True))

    def _plan_batch_rows(self, model: keras.Model) -> None:
        """The batch's rows (model inputs, targets, sample weights), first:
        the input phase comes before the layers'."""
        self._batch_plan = _keras_batch.BatchPlan.for_model(model)
        self._batch_row0 = len(self._rows)
        if self.inputs:
            self._rows += [_Row(tag, "input") for tag in self._batch_plan.tags()]

    def _plan_update_check(self, opt) -> None:
        """Where the update check looks (``update_check``): the gradient rows
        an optimizer that squares them could overflow, and their limits."""
        self._squared_by = update_check.squares_gradients(opt)
        rows = sorted(self._grad_rows.items(), key=lambda jr: jr[1]) if self._squared_by else []
        self._square_rows = np.array([r for _, r in rows], np.int64)
        self._square_limits = np.array([detectors.square_limit(str(self._vars[j].dtype)) for j, _ in rows])
        self._update_found: int | None = None  # the step whose update made the state non-finite
        # What the gated update holds back at a non-finite step: only these
        # are as the step before left them (a second optimizer's are not).
        self._held_vars: list = []

    def _make_step_state(self, model: keras.Model) -> None:
        """The variables the step stores its records in, one slot per step of
        a ``steps_per_execution`` call, and the copies for the update ratios."""
        nv = len(self._vars)
        self._slots = max(1, int(getattr(model, "steps_per_execution", 1) or 1))
        slots = self._slots
        # Plain variables, whatever strategy's scope ``fit`` runs in (a mirrored
        # one cannot be assigned a slice, and the records are stored once).
        self._stats_var = _state_variable(tf.zeros([slots, len(self._rows), NUM_FIELDS], tf.float64))
        # Per slot: _NUM_AUX numbers, then (with update ratios) ||dw||^2 and
        # ||w_old||^2 of each variable.
        aux0 = np.zeros([slots, _NUM_AUX + (2 * nv if self.update_ratios else 0)])
        aux0[:, 0] = -1
        self._aux_var = _state_variable(tf.constant(aux0, tf.float64))
        self._calls = _state_variable(tf.constant(0, tf.int64))
        self._skipped = _state_variable(tf.constant(0, tf.int64))
        self._snapshots = (
            [_state_variable(tf.zeros(v.shape, v.dtype)) for v in self._vars]
            if self.update_ratios
            else []
        )
        # Several replicas, replay on: each replica's own NaN/+Inf/-Inf counts
        # of the forward and gradient rows of the last step, to replay the
        # replica that went bad.
        replicas = _strategy(model).num_replicas_in_sync
        self._replica_nonfinite = (
            _state_variable(tf.zeros([replicas, self._weight_row0, 3], tf.float64))
            if self._replay is not None and replicas > 1 and self._replay.why_not is None
            else None
        )

    def _patch(self, obj: Any, name: str, value: Any) -> None:
        """Sets an instance attribute and remembers how to put it back."""
        had = name in vars(obj)
        old = vars(obj).get(name)
        setattr(obj, name, value)
        self._restore.append(lambda: setattr(obj, name, old) if had else delattr(obj, name))

    def on_train_end(self, logs=None) -> None:
        while self._restore:
            self._restore.pop()()
        self._trace = None
        if self._writer is not None:
            try:
                self._wait_for_writes()
            finally:
                self._pool.shutdown()
                self._writer.close()
                self._writer = None

    # ------------------------------------------------------------ wrappers

    def _wrap_train_step(self, train_step):
        @functools.wraps(train_step)
        def wrapped(data):
            if self._replay is not None and self._replay.active:
                # Replayed at op level: nothing recorded; what the layers made
                # is kept to compare with the step's records.
                self._trace = self._replay_trace = _Trace()
                try:
                    return train_step(data)
                finally:
                    self._trace = None
            if self._replay is not None and not self._replay.why_not:
                self._replay.step_begins()
            self._trace = _Trace()
            self._trace.data = data
            try:
                return train_step(data)
            finally:
                self._trace = None

        return wrapped

    def _wrap_call(self, index: int, call):
        @functools.wraps(call)
        def wrapped(*args, **kwargs):
            out = call(*args, **kwargs)
            if self._trace is not None:
                self._trace.outputs.setdefault(index, []).extend(_float_tensors(out))
            return out

        return wrapped

    def _wrap_scale_loss(self, scale_loss):
        @functools.wraps(scale_loss)
        def wrapped(loss):
            if self._trace is not None:
                self._trace.loss = loss
            return scale_loss(loss)

        return wrapped

    def _wrap_apply(self, apply):
        @functools.wraps(apply)
        def wrapped(grads, trainable_variables=None):
            if self._replay is not None and self._replay.active:
                if self._trace is not None:
                    self._trace.grads = list(zip(grads, trainable_variables or self.model.trainable_variables))
                return None  # a replay never updates the weights
            trace = self._trace
            if trace is None:
                return apply(grads, trainable_variables)
            self._trace = None  # one apply per step is recorded
            variables = trainable_variables or self.model.trainable_variables
            return self._recorded_apply(apply, trace, list(grads), list(variables))

        return wrapped

    def _recorded_apply(self, apply, trace: _Trace, grads: list, variables: list):
        """The optimizer's update, with the step's statistics stored around it."""
        opt = self.model.optimizer
        its_before = tf.cast(tf.convert_to_tensor(opt.iterations), tf.int64)
        scale = tf.cast(tf.convert_to_tensor(opt.dynamic_scale), tf.float32) if self._lso else tf.constant(1.0)
        rows = self._forward_and_gradient_rows(trace, grads, variables, scale)
        zero = tf.zeros([NUM_FIELDS], tf.float64)
        head = tf.stack([zero if r is None else r for r in rows])
        ctx = stats.replica_context()
        per_replica = ()
        step = its_before + self._skipped.read_value()
        if self._replay is not None and not self._replay.why_not:
            # On this replica's own records, before they are combined.
            self._replay.keep_if(self._step_is_bad(head), trace.data, step)
        if ctx is not None:
            # Several replicas: each record becomes that of all replicas' values
            # together (the weights are the same on every replica); each
            # replica's own non-finite counts are kept for the replay.
            gathered = stats.gather_replicas(head, ctx)
            head = stats.combine_replicas(gathered)
            if self._replica_nonfinite is not None:
                per_replica = (gathered[:, :, _NONFINITE],)
        due = self._weights_due(step, rows[self._loss_row], ctx)
        weight_rows = tf.cond(due, self._weights_before, lambda: tf.zeros([self._num_weight_rows, NUM_FIELDS], tf.float64))
        # No explicit control dependency: tf.function's automatic ones already
        # run the weights' reads (and the copy) before the update writes them,
        # and an explicit one made the update wait for the whole tf.cond
        # (measured: 1.11-1.12x plain fit with it, 1.08x without).
        result = self._gated_apply(apply, grads, variables, trace, ctx)
        if isinstance(result, tf.Tensor) and result.dtype == tf.bool:  # the gate says whether it applied
            skipped = tf.cast(tf.logical_not(result), tf.int64)
        else:  # a LossScaleOptimizer's own skip leaves the iterations where they were
            its_after = tf.cast(tf.convert_to_tensor(opt.iterations), tf.int64)
            skipped = tf.cast(tf.equal(its_after, its_before), tf.int64)
        norms = self._update_norms(due, weight_rows)
        numbers = [self._calls.read_value(), step, scale, due]
        aux = tf.concat([tf.stack([tf.cast(x, tf.float64) for x in numbers]), norms], 0)
        stacked = tf.concat([head, weight_rows], 0)
        if ctx is None:
            self._store(stacked, aux, skipped)
        else:  # once, not once per replica: all replicas hold the same values
            ctx.merge_call(
                lambda strategy, *values: self._store(*(strategy.experimental_local_results(v)[0] for v in values)),
                args=(stacked, aux, skipped) + per_replica,
            )
        return result

    def _forward_and_gradient_rows(self, trace: _Trace, grads: list, variables: list, scale: tf.Tensor) -> list:
        """The records computed before the weights': each layer's outputs, the
        loss and each gradient (None where absent), in row order."""
        rows: list[tf.Tensor | None] = [None] * self._weight_row0
        self._batch_records(trace, rows)
        graph = tf.compat.v1.get_default_graph()
        for i, tensors in trace.outputs.items():
            # Outputs of this step's graph only: a subclassed model's first call
            # also runs its layers in a scratch graph of Keras' own.
            tensors = [t for t in tensors if not hasattr(t, "graph") or t.graph is graph]
            if tensors:
                r = self._act_rows[i]
                self._rows[r].dtype = tensors[0].dtype.base_dtype.name
                self._rows[r].shape = tuple(tensors[0].shape.as_list()) if tensors[0].shape.rank is not None else None
                self._rows[r].present = True
                rows[r] = _merged_stats(tensors, self._rows[r].tag)
        if trace.loss is not None and trace.loss.dtype.base_dtype.name in metadata.DTYPE_LIMITS:
            row = self._rows[self._loss_row]
            row.dtype, row.shape, row.present = trace.loss.dtype.base_dtype.name, tuple(trace.loss.shape), True
            rows[self._loss_row] = stats.tensor_stats(tf.stop_gradient(trace.loss), "loss")
        if not self.gradients:
            return rows
        grad_of = {id(v): g for g, v in zip(grads, variables)}
        for j, v in enumerate(self._vars):
            r = self._grad_rows[j]
            g = grad_of.get(id(v))
            if isinstance(g, tf.IndexedSlices):
                g = g.values  # the rows it touches, as log_gradients does
            self._rows[r].present = g is not None
            if g is not None:
                if self._lso:  # the gradients the update uses (no pass over them otherwise)
                    g = g / tf.cast(scale, g.dtype)
                rows[r], trace.grad_sums[j] = stats.tensor_stats_and_sum(g, self._rows[r].tag)
        return rows

    def _batch_records(self, trace: _Trace, rows: list) -> None:
        """The records of the step's batch, in place in ``rows``: each row's
        tag, dtype and shape from the tensors the step received."""
        if not self.inputs or trace.data is None:
            return
        for i, tag, tensors in self._batch_plan.assign(trace.data):
            r = self._batch_row0 + i
            t = tf.convert_to_tensor(tensors[0])
            row = self._rows[r]
            row.tag, row.dtype, row.present = tag, t.dtype.base_dtype.name, True
            row.shape = tuple(t.shape.as_list()) if len(tensors) == 1 and t.shape.rank is not None else None
            rows[r] = _merged_stats([tf.convert_to_tensor(x) for x in tensors], tag)

    def _step_is_bad(self, head: tf.Tensor) -> tf.Tensor:
        """Whether a record of the step is not finite (an intended -Inf aside):
        where the replay needs the step's batch. Nothing waits for it."""
        counts = head[: self._weight_row0, _NONFINITE]
        neginf_ok = self._neginf_ok_before_weights()
        if neginf_ok.any():
            keep_neginf = tf.constant([[1.0, 1.0, 0.0 if ok else 1.0] for ok in neginf_ok], tf.float64)
            counts = counts * keep_neginf
        return tf.reduce_any(counts > 0)

    def _neginf_ok_before_weights(self) -> np.ndarray:
        """Per row before the weights': whether the user allowlisted its -Inf."""
        return np.array([analysis.neginf_intended(r.tag, metadata.TensorInfo(), self.safe_range)
                         for r in self._rows[: self._weight_row0]], bool)

    def _weights_due(self, step: tf.Tensor, loss_row: tf.Tensor | None, ctx) -> tf.Tensor:
        """Whether the weights (and the copy for the update ratios) are
        recorded: every weights_every_n_steps-th step, and any step whose
        loss is not finite. The update waits for this decision, so it rests
        on the loss, known early, not on the layers' or gradients' statistics
        (measured: a step waiting for those costs 3-6 ms more)."""
        if not ((self.weights or self.update_ratios) and self._vars):
            return tf.constant(False)
        loss_bad = tf.reduce_any(loss_row[_NONFINITE] > 0) if loss_row is not None else tf.constant(False)
        if ctx is not None:  # every replica must take the same branch
            loss_bad = ctx.all_reduce(tf.distribute.ReduceOp.SUM, tf.cast(loss_bad, tf.float32)) > 0
        return tf.logical_or(tf.equal(tf.math.floormod(step, self.weights_every_n_steps), 0), loss_bad)

    @property
    def _num_weight_rows(self) -> int:
        return len(self._vars) if self.weights else 0

    def _weights_before(self) -> tf.Tensor:
        """The weights' records before the update, after copying them for the update ratios."""
        snaps = [s.assign(tf.convert_to_tensor(v)) for s, v in zip(self._snapshots, self._vars)]
        with tf.control_dependencies(snaps):
            if not self._num_weight_rows:
                return tf.zeros([0, NUM_FIELDS], tf.float64)
            return tf.stack([stats.tensor_stats(tf.convert_to_tensor(v), v.path) for v in self._vars])

    def _update_norms(self, due: tf.Tensor, weight_rows: tf.Tensor) -> tf.Tensor:
        """||w_new - w_old||^2 and ||w_old||^2 of each variable, on due steps."""
        nv = len(self._vars)
        if not (self.update_ratios and nv):
            return tf.zeros([0], tf.float64)

        def norms() -> tf.Tensor:
            out = []
            for j, (s, v) in enumerate(zip(self._snapshots, self._vars)):
                old = s.read_value()
                # ||w_old||^2 is the weights record's sum of squares when there is one.
                w2 = weight_rows[j, F["sum_sq"]] if self._num_weight_rows else stats.sq_norm(old)
                out += [stats.sq_norm(tf.convert_to_tensor(v) - old), w2]
            return tf.stack(out)

        return tf.cond(due, norms, lambda: tf.zeros([2 * nv], tf.float64))

    def _gated_apply(self, apply, grads: list, variables: list, trace: _Trace, ctx) -> Any:
        """The optimizer's update, not applied where the loss or a gradient is
        not finite when a replay may need the weights that step used.

        The decision rests on each gradient's plain sum, which its statistics
        compute first anyway (a sum is not finite exactly when an element is
        NaN or Inf, or, beyond any sane gradient, when the sum overflows), so
        the update waits for no other statistic. A LossScaleOptimizer skips
        such steps itself. Under several replicas the update merges across
        them, which cannot sit in a branch taken in a replica: the branch is
        taken in the cross-replica context (``_apply_if_all_finite``), under
        the strategies a replay supports (MirroredStrategy).
        """
        if self._replay is None or self._lso or (ctx is not None and self._replica_nonfinite is None):
            return apply(grads, variables)
        self._held_vars = [v for g, v in zip(grads, variables) if g is not None]
        index = {id(v): j for j, v in enumerate(self._vars)}
        checks = []
        for g, v in zip(grads, variables):
            if g is None:
                continue
            total = trace.grad_sums.get(index.get(id(v), -1))
            if total is None:
                total = tf.reduce_sum(g.values if isinstance(g, tf.IndexedSlices) else g)
            checks.append(tf.math.is_finite(total))
        if trace.loss is not None:
            checks.append(tf.math.is_finite(tf.reduce_sum(tf.cast(trace.loss, tf.float32))))

        finite = tf.reduce_all(tf.stack(checks))
        if ctx is not None:
            return ctx.merge_call(functools.partial(_apply_if_all_finite, apply=apply, variables=variables),
                                  args=(finite, grads))

        def update() -> tf.Tensor:
            apply(grads, variables)
            return tf.constant(True)

        return tf.cond(finite, update, lambda: tf.constant(False))

    def _store(self, stacked: tf.Tensor, aux: tf.Tensor, skipped: tf.Tensor, per_replica=None) -> None:
        """Keeps a step's records for ``on_train_batch_end``."""
        if self._slots == 1:
            self._stats_var.assign(stacked[None])
            self._aux_var.assign(aux[None])
        else:
            # A scatter, not a slice assignment: XLA wants a slice's bounds
            # known when it compiles, and the slot is this call's number (aux[0]).
            slot = tf.reshape(tf.cast(aux[0], tf.int64) % self._slots, [1, 1])
            self._stats_var.scatter_nd_update(slot, stacked[None])
            self._aux_var.scatter_nd_update(slot, aux[None])
        if per_replica is not None:
            self._replica_nonfinite.assign(per_replica)
        self._skipped.assign_add(skipped)
        self._calls.assign_add(1)

    # ------------------------------------------------------------ host side

    def on_train_batch_end(self, batch, logs=None) -> None:
        if self._writer is None:
            return
        stats_np = self._stats_var.numpy()  # copies: the next step may overwrite the variables
        aux_np = self._aux_var.numpy()
        steps = []
        for slot in np.argsort(aux_np[:, 0], kind="stable"):
            call = int(aux_np[slot, 0])
            if call > self._last_call:
                self._last_call = call
                steps.append((stats_np[slot], aux_np[slot]))
        if not steps:
            return
        self._collect_writes(block=len(self._pending) >= _MAX_PENDING_WRITES)
        self._check_squares(steps)
        replay_due = self._replay is not None and self.replay_verdict is None
        if (self.stop_on_anomaly or replay_due) and any(_may_be_anomaly(st, aux) for st, aux in steps):
            # Inline, before the next step changes the weights the replay needs.
            self._wait_for_writes()
            self._write_steps(steps)
        else:
            self._pending.append(self._pool.submit(self._write_steps, steps))

    def _check_squares(self, steps: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """After a step whose gradients' squares overflow (an optimizer that
        squares them): the state its update left, written as the update's
        records where non-finite. Inline, before the next step changes it."""
        if self._update_found is not None or not self._square_rows.size:
            return
        for step_stats, aux in steps:
            g = step_stats[self._square_rows]
            max_abs = np.maximum(np.abs(g[:, F["min"]]), np.abs(g[:, F["max"]]))
            if (np.nan_to_num(max_abs) > self._square_limits).any():
                self._wait_for_writes()
                if self._write_nonfinite_state(int(aux[1])) and self.stop_on_anomaly:
                    self._stop()
                return

    def _write_nonfinite_state(self, step: int, variables: list | None = None) -> bool:
        """Writes the variables (the model's, or ``variables``) and optimizer
        slots that are not finite now, as the state the update of ``step``
        left; whether there were any."""
        variables = self._vars if variables is None else variables
        found = update_check.nonfinite_state(self.model.optimizer, variables, step) if step >= 0 else []
        for tag, vec, info in found:
            self._writer.write_many(step, [(tag, vec, self._info(tag, "update", info.dtype, info.shape,
                                                                  description=info.description))])
        if found:
            self._writer.flush()
            self._update_found = step
        return bool(found)

    def on_epoch_end(self, epoch, logs=None) -> None:
        if self._writer is not None:
            self._wait_for_writes()
            self._writer.flush()  # the epoch's last steps, before validation or a pause

    def _write_steps(self, steps: list[tuple[np.ndarray, np.ndarray]]) -> None:
        for step_stats, aux in steps:
            if self._step_done(step_stats, aux):
                break

    def _collect_writes(self, block: bool = False) -> None:
        """Forgets finished writes (waiting for the oldest when ``block``),
        raising the error of one that failed."""
        if block and self._pending:
            self._pending[0].result()
        while self._pending and self._pending[0].done():
            self._pending.pop(0).result()

    def _wait_for_writes(self) -> None:
        while self._pending:
            self._pending.pop(0).result()

    def _info(
        self, tag: str, role: str, dtype: str, shape, op_type: str = "", description: str = "", activation: str = "",
        compute_dtype: str = "",
    ) -> metadata.TensorInfo:
        info = self._infos.get(tag)
        if info is None:
            info = self._infos[tag] = metadata.TensorInfo(
                dtype=dtype, shape=shape, role=role, order=len(self._infos), op_type=op_type,
                description=description, activation=activation,
                compute_dtype=compute_dtype if compute_dtype in metadata.DTYPE_LIMITS and compute_dtype != dtype else "",
                squared_by=self._squared_by if role == "gradient" else "",
                # Written into the run, so every reader applies it.
                neginf_ok=analysis.neginf_intended(tag, metadata.TensorInfo(), self.safe_range),
            )
        return info

    def _records(self, step_stats: np.ndarray, aux: np.ndarray) -> list[tuple[str, np.ndarray, metadata.TensorInfo]]:
        """The step's records in execution order, host-derived ones included."""
        out = []
        grads = []
        weights_due = aux[3] > 0
        for r, row in enumerate(self._rows):
            if not row.present or (r >= self._weight_row0 and not weights_due):
                continue
            info = self._info(row.tag, row.role, row.dtype, row.shape, row.op_type, activation=row.activation,
                              compute_dtype=row.compute_dtype)
            out.append((row.tag, step_stats[r], info))
            if row.role == "gradient":
                grads.append(step_stats[r])
        if grads:
            last_grad = max(i for i, (_, _, info) in enumerate(out) if info.role == "gradient")
            out.insert(last_grad + 1, self._global_norm(grads))
        if self.update_ratios and weights_due:
            norms = aux[_NUM_AUX:].reshape(-1, 2)
            for i, name in enumerate(self._layer_names):
                mine = [j for j, l in enumerate(self._var_layer) if l == i]
                if not mine:
                    continue
                dw, w = norms[mine, 0].sum(), norms[mine, 1].sum()
                if w > 0:
                    tag = "update_ratio/%s" % name
                    out.append((tag, records.numpy_stats(np.float32(np.sqrt(dw / w))),
                                self._info(tag, "weight", "float32", (), description="||w_new - w_old|| / ||w_old|| of layer %s" % name)))
        if self._lso:
            out.append(("loss_scale", records.numpy_stats(np.float32(aux[2])),
                        self._info("loss_scale", "loss_scale", "float32", (), description="the LossScaleOptimizer's loss scale")))
        return out

    def _global_norm(self, grads: list[np.ndarray]):
        tag = "gradients/global_norm"
        return (tag, records.global_norm_record(np.asarray(grads)), self._info(tag, "global_norm", "float32", ()))

    def _step_done(self, step_stats: np.ndarray, aux: np.ndarray) -> bool:
        """Writes one step's records as every_n_steps says; True to stop training.

        The rule is the summary API's latch: every N-th step, the first step
        with a non-finite value and the step before it. Steps a
        LossScaleOptimizer skipped are always written, so that they show.
        """
        step = int(aux[1])
        step_records = self._records(step_stats, aux)
        nonfinite = any(records.nonfinite_count(v, info.neginf_ok) > 0 for _, v, info in step_records)
        scale = float(aux[2]) if self._lso else None
        # A LossScaleOptimizer's skip does not close the latch (it is written anyway, below).
        bad = [r for r in step_records if analysis.record_is_anomaly(*r, self.safe_range, scale)]
        anomaly = bool(bad)
        vals = np.array([r[1] for r in bad], np.float64).reshape(-1, metadata.NUM_FIELDS)
        ok = [analysis.neginf_intended(tag, info, self.safe_range) for tag, _, info in bad]
        kinds = latch.kinds(vals[:, F["nan"]], vals[:, F["posinf"]], vals[:, F["neginf"]], np.array(ok, bool))
        # _prev: the last step computed but not written (None once written).
        prev_step = self._prev[0] if self._prev is not None else latch.NO_PREVIOUS_STEP
        decision = latch.decide(step, prev_step, kinds, self._seen, self.every_n_steps)
        if decision.write_prev:
            self._writer.write_many(*self._prev)
        written = bool(decision.write_now) or (nonfinite and self._lso)
        if written:
            self._writer.write_many(step, step_records)
        self._prev = None if written else (step, step_records)
        self._seen = int(decision.seen)
        if not anomaly:
            return False
        self._note_bad_batch(step, step_records)
        if self._replay is not None and self.replay_verdict is None and self._born_in_update(step):
            self.replay_verdict = {"step": step, "reproduced": False, "update_of_step": self._update_found}
        if self._replay is not None and self.replay_verdict is None:
            self._writer.flush()
            replica = self._bad_replica()
            self.replay_verdict = self._replay.replay(
                step, self.model.train_step, replica, check=functools.partial(self._replay_differs, step_stats, replica))
        if not self.stop_on_anomaly:
            return False
        self._stop()
        return True

    def _note_bad_batch(self, step: int, step_records: list) -> None:
        """Once, at the first bad step: where the batch the replay kept holds
        the bad values of the batch's bad records, per feature and example
        (``metadata.BATCH_TAG``, for the hint). Every replica's kept part is
        counted; a replica whose records were finite kept none and holds none."""
        if self._batch_noted or self._replay is None or self._replay.why_not:
            return
        self._batch_noted = True
        bad = {tag: info.dtype for tag, v, info in step_records
               if info.role == "input" and (records.nonfinite_count(v) > 0 or v[F["overflow"]] > 0)}
        if not bad:
            return
        tensors: dict[str, list] = {}
        for r in range(_strategy(self.model).num_replicas_in_sync):
            batch = self._replay.batch(step, r)
            if batch is None:
                continue
            for _, tag, ts in self._batch_plan.assign(batch):
                if tag in bad:
                    tensors.setdefault(tag, []).extend(ts)
        found = [f for f in (_keras_batch.bad_features(tag, ts, bad[tag]) for tag, ts in tensors.items()) if f]
        if found:
            info = metadata.TensorInfo(role="other", op_type="Batch", description=json.dumps({"step": step, "tensors": found}))
            self._writer.write(metadata.BATCH_TAG, step, records.numpy_stats(np.zeros(0, np.float32)), info)

    def _born_in_update(self, step: int) -> bool:
        """At the first anomaly, whose update is held back: whether an earlier
        update made the weights or slots non-finite (then the step's replay
        could only read them). Found before, or now, before this step's
        update: the previous step's update made them."""
        if self._update_found is not None:
            return True
        # Only what this step's held-back update would have written is still
        # as the previous step left it: whatever else the step wrote (a second
        # optimizer's update, a layer's own assign) may have gone bad in it.
        return not self._lso and bool(self._held_vars) and self._write_nonfinite_state(step - 1, self._held_vars)

    def _replay_differs(self, step_stats: np.ndarray, replica: int | None) -> str | None:
        """Why the replay's layer outputs, loss and gradients disagree with the
        step's records about where values first went non-finite (a random
        op that drew other values in the replay), or None where they agree.

        They agree where the step's first non-finite record (in execution
        order) is non-finite in the replay too and none before it is. Later
        records may differ: XLA's ReluGrad masks a NaN the eager one passes.
        """
        neginf_ok = self._neginf_ok_before_weights()
        if replica is None:
            counts = step_stats[: self._weight_row0, _NONFINITE]
        else:  # that replica's own records
            counts = self._replica_nonfinite.numpy()[replica]
        in_step = _bad_rows(counts, neginf_ok)
        if not in_step.any():
            return None
        first = int(np.argmax(in_step))
        in_replay = self._replay_rows_nonfinite(neginf_ok)
        if not in_replay[first]:
            return "%s, the step's first non-finite record, was finite in the replay" % self._rows[first].tag
        earlier = np.flatnonzero(in_replay[:first])
        if earlier.size:
            return "%s was non-finite in the replay, finite in the step, which first went bad at %s" % (
                self._rows[int(earlier[0])].tag, self._rows[first].tag)
        return None

    def _replay_rows_nonfinite(self, neginf_ok: np.ndarray) -> np.ndarray:
        """Per row before the weights': whether the replay's tensors of that row
        (its layer outputs, loss, gradient) hold a NaN or an Inf."""
        trace = self._replay_trace
        out = np.zeros(self._weight_row0, bool)
        tensors: dict[int, list] = {self._act_rows[i]: ts for i, ts in trace.outputs.items()}
        if trace.loss is not None:
            tensors[self._loss_row] = [trace.loss]
        index = {id(v): j for j, v in enumerate(self._vars)}
        for g, v in trace.grads:
            j = index.get(id(v))
            if g is not None and j is not None and j in self._grad_rows:
                tensors[self._grad_rows[j]] = [g.values if isinstance(g, tf.IndexedSlices) else g]
        for r, ts in tensors.items():
            for t in ts:
                out[r] |= bool(records.nonfinite_count(records.numpy_stats(np.asarray(t.numpy(), np.float64)), neginf_ok[r]) > 0)
        return out

    def _bad_replica(self) -> int | None:
        """Under several replicas, the replica whose records of the last step
        went bad first, in execution order (the lowest on a tie); None on one
        device. An allowlisted -Inf does not count."""
        if self._replica_nonfinite is None:
            return None
        counts = self._replica_nonfinite.numpy()  # [replicas, rows, (NaN, +Inf, -Inf)]
        bad = _bad_rows(counts, self._neginf_ok_before_weights())
        first = np.where(bad.any(axis=1), bad.argmax(axis=1), bad.shape[1])
        return int(np.argmin(first))

    def _stop(self) -> None:
        """Stops training and prints the diagnosis, in the analysis' words."""
        self._writer.flush()
        # The run's event files: the callback's, and the replay's beside it.
        rr = event_reader.read_run(".", event_reader.find_runs(self.log_dir).get(".", []))
        ra = analysis.analyze_run(self.log_dir, rr.series, self.safe_range, rr.problems)
        self.anomaly = analysis.first_anomaly(ra)
        self.model.stop_training = True
        a = self.anomaly
        if a is None:  # not written (cannot happen: the first bad step always is)
            return
        print("\n".join(cli.anomaly_lines(a, head="tb-numerics: stopping training at ")), file=sys.stderr)
