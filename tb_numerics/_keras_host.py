"""The Keras callback's host side, one for every backend: from a step's numbers to records on disk.

Each backend's training step (``backends/tensorflow_callback``,
``jax_callback``, ``torch_callback``) computes one array of statistics per
step, one row per ``_keras_plan.Row``, with a few values beside it
(``StepValues``). Everything after that is the same on every backend and
lives here, with no TensorFlow and no backend imported:

* ``NumericsCallbackBase``: the options, the wrappers put back after ``fit``
  (``Patches``), and per batch the flow every backend follows: the steps
  its program stored, written on a thread beside training, or inline where
  a step may stop training or need a replay; at the run's first anomaly the
  bad batch, the replay's verdict and the stop;
* ``HostRecords``: a step's rows turned into records in execution order
  (adding what the host derives: the global gradient norm, the update
  ratios, the loss scale), the every-N latch (``latch.decide``) that picks
  the steps to write, and the writer thread;
* ``stop_training``: the run's first anomaly, read back and printed in the
  report's words (``report_text``).

A backend provides its part through the methods ``NumericsCallbackBase`` names
"for a backend": wrapping the step, handing over the stored steps, the
kept batch and the replay of a step at op level.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import functools
import json
import sys
import weakref
from typing import Any, Callable, NamedTuple, Sequence

import keras
import numpy as np

from tb_numerics import _keras_batch, analysis, event_reader, latch, metadata, record_writer, records, report_text
from tb_numerics._keras_plan import RowPlan
from tb_numerics.records import F

__all__ = ["AUX_FIELDS", "AUX_INDEX", "HostRecords", "NumericsCallbackBase", "Patches", "Record", "Step", "StepValues",
           "step_counter", "stop_training"]

_MAX_PENDING_WRITES = 8  # batches whose records may wait for the writer thread

Record = tuple[str, np.ndarray, metadata.TensorInfo]
Step = tuple[np.ndarray, "StepValues"]  # a step's records [rows, NUM_FIELDS], and its values

# A step's values besides its records, by name, as a step program stores
# them: their slots at the head of the step's aux row. With update ratios
# the row goes on with ||w_new - w_old||^2 and ||w_old||^2 of each variable.
# The survival values (``held`` ...) are the TensorFlow program's (its
# ``on_anomaly`` gate); the other backends leave them at their defaults.
AUX_FIELDS = ("call", "step", "loss_scale", "weights_due", "held", "trigger", "loss_value", "grad_norm",
              "spike_mean", "spike_std")
AUX_INDEX = {name: i for i, name in enumerate(AUX_FIELDS)}


class StepValues(NamedTuple):
    """One step's values besides its records, as the host reads them."""

    call: int  # the number of the train_step call that stored them (0, 1, ...)
    step: int  # the step its records are written at
    loss_scale: float  # a LossScaleOptimizer's scale (1 without one)
    weights_due: bool  # whether the weights and update ratios were computed
    update_norms: np.ndarray  # [variables, 2]: ||w_new - w_old||^2, ||w_old||^2 (empty without update ratios)
    held: bool = False  # the update was not applied (the gate held it back, or a LossScaleOptimizer skipped it)
    trigger: int = 0  # why the step is an anomaly (``_survive_tf.TRIGGER_CODES``; 0: it is not)
    loss_value: float = float("nan")  # the loss (the mean over replicas)
    grad_norm: float = float("nan")  # the global gradient norm
    spike_mean: float = 0.0  # where a spike fired: the window's mean and standard deviation
    spike_std: float = 0.0

    @classmethod
    def of(cls, aux: np.ndarray) -> "StepValues":
        """The values of one aux row (``AUX_FIELDS``, then the norms).

        Args:
          aux: the row, as a step program stored it.
        """
        head = {name: aux[i] for name, i in AUX_INDEX.items()}
        return cls(call=int(head["call"]), step=int(head["step"]), loss_scale=float(head["loss_scale"]),
                   weights_due=bool(head["weights_due"] > 0), update_norms=np.asarray(aux[len(AUX_FIELDS):],
                                                                                      np.float64).reshape(-1, 2),
                   held=bool(head["held"] > 0), trigger=int(head["trigger"]), loss_value=float(head["loss_value"]),
                   grad_norm=float(head["grad_norm"]), spike_mean=float(head["spike_mean"]),
                   spike_std=float(head["spike_std"]))


def _end_at_exit(callback: "weakref.ref[NumericsCallbackBase]") -> None:
    """At interpreter exit, a fit an exception ended: its last steps written, its writer closed."""
    cb = callback()
    if cb is not None and cb._host is not None:  # noqa: SLF001 - the callback's own end
        try:
            cb.on_train_end()
        except Exception as e:  # noqa: BLE001 - at exit, what can be written is; nothing may raise
            print("tb_numerics: the last steps of an interrupted fit could not be written: %s: %s"
                  % (type(e).__name__, e), file=sys.stderr)


class Patches:
    """Instance attributes set for a while, and how to put each one back."""

    def __init__(self) -> None:
        self._restore: list[Callable[[], None]] = []

    def set(self, obj: Any, name: str, value: Any) -> None:
        """Sets ``obj.name`` on the instance and remembers what was there (or that nothing was)."""
        had = name in vars(obj)
        old = vars(obj).get(name)
        setattr(obj, name, value)
        self._restore.append(lambda: setattr(obj, name, old) if had else delattr(obj, name))

    def on_restore(self, fn: Callable[[], None]) -> None:
        """Runs ``fn`` when everything is put back, in reverse order with the rest."""
        self._restore.append(fn)

    def restore(self) -> None:
        """Puts everything back, the last set first."""
        while self._restore:
            self._restore.pop()()


# The model's attribute naming the callback whose fit it is in (until its on_train_end).
_FITTING = "_tb_numerics_fitting"


@dataclasses.dataclass
class _Traced:
    """What a ``fit`` built and traced, kept for the next ``fit`` of the same model."""

    model: weakref.ref
    key: tuple  # ``_fit_key`` then
    plain: Any  # Keras' own train function, as put back
    patched: Any  # the train function traced around the wrappers
    host: HostRecords


def step_counter(optimizer: Any) -> Any:
    """The optimizer's variable that counts its train steps, which the records'
    steps follow: ``iterations``, except under gradient accumulation, where
    ``iterations`` counts the updates (one every ``gradient_accumulation_steps``
    batches) and its raw counter the batches, as Keras' TensorBoard callback
    steps its batch summaries (a wrapper's inner optimizer's, under a
    LossScaleOptimizer)."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if getattr(inner, "gradient_accumulation_steps", None) and hasattr(inner, "_iterations"):
        return inner._iterations  # noqa: SLF001 - iterations is this counter floor-divided
    return optimizer.iterations


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError("%s must be a positive integer, got %r" % (name, value))
    return value


# Optimizers whose update keeps a running mean (or sum) of each gradient's
# square and divides by its root: a gradient beyond the square root of its
# dtype's largest value makes it Inf, and where it is 0 the update is 0/0
# without a positive epsilon.
_SQUARING = frozenset({"Adam", "AdamW", "Nadam", "RMSprop", "Adagrad", "Adadelta", "Adafactor", "Lamb", "Ftrl"})


def squares_gradients(optimizer: Any) -> str:
    """The optimizer's class name where its update squares the gradients
    (Adam, RMSprop, Adagrad, ... and their subclasses), else "". A
    LossScaleOptimizer is judged by the optimizer it wraps. Keras' own
    classes, so the same on every backend."""
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None:
        return squares_gradients(inner)
    if any(cls.__name__ in _SQUARING for cls in type(optimizer).__mro__):
        return type(optimizer).__name__
    return ""


class NumericsCallbackBase(keras.callbacks.Callback):
    """Logs per-layer activations, gradients, weights and update ratios during ``fit``.

    Records (steps are the optimizer's step before its update, i.e.
    ``optimizer.iterations`` (its batches under gradient accumulation:
    ``step_counter``), plus the steps a ``LossScaleOptimizer`` skipped, which
    do not advance it):

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
    * ``<variable path>`` (weight) of the state a forward pass updates, each
      trainable layer's non-trainable float variables (BatchNormalization's
      moving statistics), as the forward pass left it: computed every step,
      written with the weights and at any step where it is not finite (a
      finite batch of huge values can make a moving variance +Inf while the
      output, the loss and the gradients stay finite);
    * ``update_ratio/<layer>`` (weight): ||w_new - w_old|| / ||w_old|| over
      the layer's trainable variables, an early sign of a too-large learning
      rate. It keeps one copy of the trainable weights (``update_ratios=False``
      to save that memory);
    * ``loss_scale`` (under a ``LossScaleOptimizer``, e.g. with the
      ``mixed_float16`` policy): the scale the step used. A skipped step shows
      as non-finite gradients at a step with a loss-scale record, which the
      analysis reports as a warning, not the run's anomaly.

    Weights change slowly and are as big as the gradients, so their records
    and the update ratios are computed (and written) on every
    ``weights_every_n_steps``-th step only, and on any step whose loss is
    NaN or Inf (so a bad forward pass has the weights that made it); the
    activations, the loss and the gradients every ``every_n_steps``.

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
        at op level (eagerly) and record which op, at which line of your
        code, made the first NaN or Inf (``first_anomaly.op`` in the report).
        To keep the weights that step used, the update of a step whose loss
        or gradients are not finite is not applied (as a LossScaleOptimizer
        does); the batch of a step that went bad is kept for it.
      allow_neginf: tag patterns (fnmatch) where -Inf is intended, e.g.
        ``"attention*/output"`` for masks; a NaN there still counts.

    After training, ``anomaly`` holds the first anomaly (as in
    ``tb-numerics report --json``) when ``stop_on_anomaly`` stopped it, and
    ``replay_verdict`` the replay's verdict on the first non-finite step.
    ``tb_numerics.keras.NumericsCallback`` is the subclass of Keras' running
    backend (``tb_numerics.backends``), which says what it adds or cannot do.
    """

    backend = ""  # the Keras backend a subclass serves
    keeps_step = False  # whether a later fit of the same model takes up the step traced before (``_take_up``)

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
        self.every_n_steps = _positive_int("every_n_steps", every_n_steps)
        if weights_every_n_steps is None:
            weights_every_n_steps = 10 * every_n_steps
        w = weights_every_n_steps
        if isinstance(w, bool) or not isinstance(w, int) or w < 1 or w % every_n_steps:
            raise ValueError("weights_every_n_steps must be a positive multiple of every_n_steps (%d), got %r"
                             % (every_n_steps, weights_every_n_steps))
        self.log_dir = log_dir
        self.weights_every_n_steps = weights_every_n_steps
        self.inputs, self.activations, self.gradients = inputs, activations, gradients
        self.weights, self.update_ratios = weights, update_ratios
        self.stop_on_anomaly = stop_on_anomaly
        self.replay = replay
        self.safe_range = analysis.SafeRange(allow_neginf=tuple(allow_neginf))
        self.anomaly: dict[str, Any] | None = None
        # The replay's verdict on the first non-finite step, once it ran.
        self.replay_verdict: dict[str, Any] | None = None
        self.plan: RowPlan | None = None  # set while fit runs
        self._host: HostRecords | None = None
        self._patches = Patches()
        self._batch = 0  # the index of the batch last ended in its epoch
        self._patched: Any = None  # the train function this fit runs, once built (``_begin``)
        self._traced: _Traced | None = None  # the last fit's, between fits
        self._at_exit: Callable[[], None] | None = None  # ends a fit the interpreter leaves (``_end_at_exit``)

    # ------------------------------------------------------------ for a backend

    def _begin(self, model: keras.Model) -> None:
        """Wraps the model's training step (setting with ``self._patches``),
        once ``self.plan`` and ``self._host`` are made, and sets
        ``self._patched`` to the train function built around it."""
        raise NotImplementedError

    def _step_key(self, model: keras.Model) -> tuple:
        """What else a backend's traced step depends on (a distribution strategy)."""
        return ()

    def _take_up(self, model: keras.Model, train_function: Any) -> Any:
        """Installs the wrappers again around ``train_function``, the one
        the last ``fit`` of ``model`` traced, and sets it as the model's;
        returns it. Only where ``keeps_step`` (where a backend's ``_begin``
        may build its train function with ``train_function`` None)."""
        raise NotImplementedError

    def _new_steps(self) -> list[Step]:
        """The steps computed since the last call, oldest first."""
        raise NotImplementedError

    def _squared_by(self, optimizer: Any) -> str:
        """The optimizer's name where its update squares the gradients
        (kept in the gradients' metadata), else ""."""
        return squares_gradients(optimizer)

    def _check_update(self, steps: list[Step]) -> bool:
        """Looks at the state the steps' updates left, where they give a
        reason; whether it found a non-finite one (then it stops, if asked)."""
        return False

    def _kept_batches(self, step: int) -> list[Any]:
        """The batch of ``step`` (each replica's part), as kept for the replay; [] where none was."""
        return []

    def _looked_at_bad_steps(self) -> None:
        """After the steps of a call that may hold an anomaly were written
        (and the first one diagnosed): what the step kept for them may go."""

    def _replay_at(self, step: int) -> dict[str, Any]:
        """Runs ``step`` again at op level: ``{"reproduced": True, "op": {...}}``
        or ``{"reproduced": False, "why": ...}``."""
        raise NotImplementedError

    def _replay_verdict(self, step_stats: np.ndarray, values: StepValues) -> dict[str, Any]:
        """The replay's verdict on the first bad step, written into the run."""
        return self._host.replay_verdict(values.step, lambda: self._replay_at(values.step))

    def _skip_beyond_scaling(self, values: StepValues) -> bool:
        """At a step a LossScaleOptimizer skipped: whether its forward pass
        (which no loss scale changes) made a NaN or an Inf inside a layer,
        whose output stayed finite (``x / sqrt(inf)`` is 0), or its gradients
        are non-finite with the scale at 1 too (a sqrt's gradient at 0). Then
        the skip is the run's anomaly, not the scale's calibration. False
        where the backend cannot tell."""
        return False

    def _policy_acts_on(self, steps: list[Step]) -> bool:
        """Whether an ``on_anomaly`` policy acts on one of the steps (their
        records are then written inline, before it acts)."""
        return False

    def _policy_after(self, steps: list[Step], batch: int) -> bool:
        """An ``on_anomaly`` policy's actions on the batch's steps, once
        written (main thread, before the next step); True to stop training."""
        return False

    def _stops_at(self, values: StepValues) -> bool:
        """Whether training stops at a step whose records went bad."""
        return self.stop_on_anomaly

    # ------------------------------------------------------------ fit

    def on_train_begin(self, logs=None) -> None:
        if keras.backend.backend() != self.backend:
            raise RuntimeError("this NumericsCallback serves Keras' %s backend, not %s"
                               % (self.backend, keras.backend.backend()))
        model = self.model
        left = vars(model).get(_FITTING)
        if left is not None:
            # A fit that ended by an exception (Ctrl-C in a notebook): Keras calls
            # on_train_end only when fit returns, so its wrappers are still on the
            # model and its last records in the writer. Ended here first.
            left.on_train_end()
        if not model.trainable_variables:
            raise ValueError("NumericsCallback: the model %r has no variables yet (a subclassed model is built by "
                             "its first call): build it before fit, by calling it on a batch" % model.name)
        if not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        if not self._resume(model):
            self._build(model)
        self._patches.set(model, _FITTING, self)
        # A fit that an exception ends (a callback before this one raising
        # at a NaN loss) gets no on_train_end: its last steps are written
        # when the interpreter exits, or when the next fit begins (above).
        self._at_exit = functools.partial(_end_at_exit, weakref.ref(self))
        atexit.register(self._at_exit)

    def _build(self, model: keras.Model) -> None:
        """The plan, the records' host and the backend's wrapped step, for this fit."""
        self.plan = RowPlan(model, inputs=self.inputs, activations=self.activations, gradients=self.gradients,
                            weights=self.weights)
        self._lso = isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
        self._host = HostRecords(self.log_dir, self.plan, every_n_steps=self.every_n_steps,
                                 update_ratios=self.update_ratios, lso=self._lso, safe_range=self.safe_range,
                                 squared_by=self._squared_by(model.optimizer))
        self._begin(model)

    def _fit_key(self, model: keras.Model) -> tuple:
        """What the plan, the step's records and their trace depend on beyond
        the train function Keras keeps: the optimizer, the variables, how
        the step runs, and this callback's options."""
        return (model.optimizer, tuple(id(v) for v in model.trainable_variables),
                int(getattr(model, "steps_per_execution", 1) or 1), model.jit_compile, model.run_eagerly,
                self.inputs, self.activations, self.gradients, self.weights, self.update_ratios, self.replay,
                self.every_n_steps, self.weights_every_n_steps, self.stop_on_anomaly, self.safe_range,
                *self._step_key(model))

    def _resume(self, model: keras.Model) -> bool:
        """Takes up, for this ``fit``, what the last ``fit`` of ``model``
        built and traced (its plan, the step and the records' state, with a
        new event file) where nothing they depend on changed, as Keras keeps
        its own train function until the model is compiled again; whether
        it did. Tracing took most of the first epoch (ResNet-50: tens of
        seconds), which a user calling ``fit`` in a loop paid at each call."""
        kept, self._traced = self._traced, None
        if (kept is None or kept.model() is not model or model.train_function is not kept.plain
                or kept.key != self._fit_key(model)):
            return False
        self._host = kept.host
        self._host.reopen()
        self._patched = self._take_up(model, kept.patched)
        return True

    def on_train_end(self, logs=None) -> None:
        if self._at_exit is not None:
            atexit.unregister(self._at_exit)
            self._at_exit = None
        if self._host is not None:
            self._write_left()
        model, host, patched = self.model, self._host, self._patched
        ours = patched is not None and model is not None and model.train_function is patched
        self._patched = None
        self._patches.restore()
        self._traced = None
        if host is not None:
            self._host = None
            host.close()
        if ours and host is not None and self.anomaly is None and self.keeps_step:
            self._traced = _Traced(weakref.ref(model), self._fit_key(model), model.train_function, patched, host)

    def _write_left(self) -> None:
        """The steps the step ran that no ``on_train_batch_end`` of this
        callback took (an exception ended the batch before it): written
        as any step is, without a replay (the weights have moved on)."""
        steps = self._new_steps()
        if steps:
            self._host.wait()
            for step_stats, values in steps:
                self._host.write_step(step_stats, values)

    def on_epoch_end(self, epoch, logs=None) -> None:
        if self._host is not None:
            self._host.wait()
            self._host.writer.flush()  # the epoch's last steps, before validation or a pause

    def on_train_batch_end(self, batch, logs=None) -> None:
        if self._host is None:
            return
        steps = self._new_steps()
        if not steps:
            return
        self._batch = batch
        self._host.collect()
        if self._check_update(steps) and self.stop_on_anomaly:
            self._stop(*steps[-1], why="an update left the weights or the optimizer's slots non-finite")
        if self._policy_acts_on(steps) or any(self._host.may_be_anomaly(*s) for s in steps):
            # Inline, before the next step changes the weights the replay
            # needs, and so that a step holding a NaN is on disk before the
            # callbacks after this one run (one may end the process).
            self._host.wait()
            self._write_steps(steps)
            self._looked_at_bad_steps()
        else:
            self._host.submit(self._write_steps, steps)
        if not self.model.stop_training and self._policy_after(steps, batch):
            self._stop()

    def _write_steps(self, steps: list[Step]) -> None:
        for step_stats, values in steps:
            if self._step_done(step_stats, values):
                break

    def _step_done(self, step_stats: np.ndarray, values: StepValues) -> bool:
        """Writes one step's records; at the run's first anomaly, diagnoses
        it (the bad batch, the replay) and stops where asked. True to stop."""
        step_records, anomaly = self._host.write_step(step_stats, values)
        if not anomaly and self._host.skip_to_probe and self.replay and self.replay_verdict is None:
            anomaly = self._skip_beyond_scaling(values)
        if not anomaly:
            return False
        self._host.note_bad_batch(values.step, step_records, self._kept_batches)
        self._host.writer.flush()  # the step holding the NaN and its batch's verdict, on disk at once
        if self.replay and self.replay_verdict is None:
            self.replay_verdict = self._replay_verdict(step_stats, values)
        if not self._stops_at(values):
            return False
        self._stop(step_stats, values, why="a record of the step holds a NaN or an Inf")
        return True

    def _stop(self, step_stats: np.ndarray | None = None, values: StepValues | None = None, why: str = "") -> None:
        """Stops training and prints the diagnosis, in the analysis' words
        (once). ``step_stats``, ``values``, ``why``: the step that stops it
        and why, where one does (a backend's policy writes its stop event)."""
        self._host.writer.flush()
        self.model.stop_training = True
        if self.anomaly is None:
            self.anomaly = stop_training(self.model, self.log_dir, self.safe_range)


class HostRecords:
    """Records of the steps, from their rows, written as ``every_n_steps`` says.

    Args:
      log_dir: the run directory the records go to.
      plan: the step's rows.
      every_n_steps: the latch's N.
      update_ratios: whether to derive the update ratios.
      lso: whether the optimizer is a LossScaleOptimizer (its scale is recorded).
      safe_range: the analysis' safe range (its allowlist of -Inf).
      squared_by: the optimizer that squares the gradients ("" if none), kept
        in the gradients' metadata.

    Attributes:
      writer: the run's record writer.
      skip_to_probe: whether the last step written was a LossScaleOptimizer
        skip after an applied update (``NumericsCallbackBase._skip_beyond_scaling``).
    """

    def __init__(self, log_dir: str, plan: RowPlan, *, every_n_steps: int, update_ratios: bool, lso: bool,
                 safe_range: analysis.SafeRange, squared_by: str):
        self._plan, self._every_n_steps, self._update_ratios = plan, every_n_steps, update_ratios
        self._lso, self._safe_range, self._squared_by = lso, safe_range, squared_by
        self._infos: dict[str, metadata.TensorInfo] = {}
        self._prev: tuple[int, list[Record]] | None = None  # the last step computed but not written
        self._seen = latch.NO_KINDS  # the kinds of non-finite values written so far (latch)
        self._batch_noted = False
        self._applied = False  # whether a step's records were finite (its update applied)
        self.skip_to_probe = False
        self._log_dir = log_dir
        self._pending: list[concurrent.futures.Future] = []
        self.reopen()

    def reopen(self) -> None:
        """A new event file and writer thread: at the start of a ``fit``,
        the first or a later one of the same run (after ``close``), which
        goes on from the records written before (the tags' order, the
        step held back and the non-finite kinds seen)."""
        self.writer = record_writer.NumericsRecordWriter(self._log_dir)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tb_numerics_callback")

    # ------------------------------------------------------------ the writer thread

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Runs ``fn(*args)`` on the writer thread, after what is queued."""
        self._pending.append(self._pool.submit(fn, *args))

    def collect(self) -> None:
        """Forgets finished writes, raising the error of one that failed;
        where too many wait, waits for the oldest first."""
        if len(self._pending) >= _MAX_PENDING_WRITES:
            self._pending[0].result()
        while self._pending and self._pending[0].done():
            self._pending.pop(0).result()

    def wait(self) -> None:
        """Waits for every queued write, raising the error of one that failed."""
        while self._pending:
            self._pending.pop(0).result()

    def close(self) -> None:
        """Waits for the queued writes, then closes the thread and the writer."""
        try:
            self.wait()
        finally:
            self._pool.shutdown()
            self.writer.close()

    # ------------------------------------------------------------ records

    def may_be_anomaly(self, step_stats: np.ndarray, values: StepValues) -> bool:
        """Whether a step's records may hold an anomaly: a non-finite value
        (an intended -Inf aside), or a non-finite update norm (an update
        that overflowed finite weights)."""
        ok = self._plan.neginf_ok(self._safe_range)
        norms = records.numpy_stats(values.update_norms.astype(np.float64))
        return bool((records.nonfinite_count(step_stats, ok) > 0).any() or records.nonfinite_count(norms) > 0)

    def info(self, tag: str, role: str, dtype: str, shape: Any, op_type: str = "", description: str = "",
             activation: str = "", compute_dtype: str = "") -> metadata.TensorInfo:
        """The metadata of ``tag``: made at its first record, then kept (its order is its first time)."""
        info = self._infos.get(tag)
        if info is None:
            info = self._infos[tag] = metadata.TensorInfo(
                dtype=dtype, shape=shape, role=role, order=len(self._infos), op_type=op_type,
                description=description, activation=activation,
                compute_dtype=compute_dtype if compute_dtype in metadata.DTYPE_LIMITS and compute_dtype != dtype else "",
                squared_by=self._squared_by if role == "gradient" else "",
                # Written into the run, so every reader applies it.
                neginf_ok=analysis.neginf_intended(tag, metadata.TensorInfo(), self._safe_range),
            )
        return info

    def records(self, step_stats: np.ndarray, values: StepValues) -> list[Record]:
        """The step's records in execution order, host-derived ones included."""
        out: list[Record] = []
        grads = []
        plan = self._plan
        # The state is computed every step, written with the weights or where it went bad.
        states = plan.state_rows
        quiet = set() if values.weights_due else {
            states[k] for k in np.flatnonzero(records.nonfinite_count(step_stats[states.start:states.stop]) == 0)}
        for r, row in enumerate(plan.rows):
            if not row.present or (r >= plan.weight_row0 and not values.weights_due) or r in quiet:
                continue
            info = self.info(row.tag, row.role, row.dtype, row.shape, row.op_type, row.description,
                             activation=row.activation, compute_dtype=row.compute_dtype)
            out.append((row.tag, step_stats[r], info))
            if row.role == "gradient":
                grads.append(step_stats[r])
        if grads:
            last_grad = max(i for i, (_, _, info) in enumerate(out) if info.role == "gradient")
            tag = "gradients/global_norm"
            out.insert(last_grad + 1, (tag, records.global_norm_record(np.asarray(grads)),
                                       self.info(tag, "global_norm", "float32", ())))
        if self._update_ratios and values.weights_due:
            out += self._update_ratio_records(values.update_norms)
        if self._lso:
            out.append(("loss_scale", records.numpy_stats(np.float32(values.loss_scale)),
                        self.info("loss_scale", "loss_scale", "float32", (), description="the LossScaleOptimizer's loss scale")))
        return out

    def _update_ratio_records(self, norms: np.ndarray) -> list[Record]:
        """``update_ratio/<layer>``: ||w_new - w_old|| / ||w_old|| over each layer's trainable variables."""
        out: list[Record] = []
        if not norms.size:
            return out
        for i, name in enumerate(self._plan.layer_names):
            mine = self._plan.variables_of_layer(i)
            if not mine:
                continue
            dw, w = norms[mine, 0].sum(), norms[mine, 1].sum()
            if w > 0:
                tag = "update_ratio/%s" % name
                out.append((tag, records.numpy_stats(np.float32(np.sqrt(dw / w))),
                            self.info(tag, "weight", "float32", (), description="||w_new - w_old|| / ||w_old|| of layer %s" % name)))
        return out

    def write_step(self, step_stats: np.ndarray, values: StepValues) -> tuple[list[Record], bool]:
        """Writes one step's records as every_n_steps says; (its records,
        whether it holds the anomaly the analysis would report).

        The rule is the summary API's latch: every N-th step, the first step
        with a non-finite value and the step before it. Steps a
        LossScaleOptimizer skipped are always written, so that they show.
        """
        step = values.step
        step_records = self.records(step_stats, values)
        nonfinite = any(records.nonfinite_count(v, info.neginf_ok) > 0 for _, v, info in step_records)
        scale = values.loss_scale if self._lso else None
        # A LossScaleOptimizer's skip does not close the latch (it is written anyway, below).
        bad = [r for r in step_records if analysis.record_is_anomaly(*r, self._safe_range, scale)]
        vals = np.array([r[1] for r in bad], np.float64).reshape(-1, metadata.NUM_FIELDS)
        ok = [analysis.neginf_intended(tag, info, self._safe_range) for tag, _, info in bad]
        kinds = latch.kinds(vals[:, F["nan"]], vals[:, F["posinf"]], vals[:, F["neginf"]], np.array(ok, bool))
        prev_step = self._prev[0] if self._prev is not None else latch.NO_PREVIOUS_STEP
        decision = latch.decide(step, prev_step, kinds, self._seen, self._every_n_steps)
        if decision.write_prev:
            self.writer.write_many(*self._prev)
        written = bool(decision.write_now) or (nonfinite and self._lso)
        if written:
            self.writer.write_many(step, step_records)
        self._prev = None if written else (step, step_records)
        self._seen = int(decision.seen)
        # A skip after an applied update (not the scale's opening calibration,
        # whose skips run from the first step), which only a look inside the
        # forward pass tells from the scaling's own overflow.
        self.skip_to_probe = self._lso and nonfinite and not bad and self._applied
        self._applied |= not nonfinite
        return step_records, bool(bad)

    # ------------------------------------------------------------ at the first anomaly

    def note_bad_batch(self, step: int, step_records: list[Record], kept_batches: Callable[[int], list]) -> None:
        """Once, at the first bad step: where the kept batch holds the bad
        values of the batch's bad records, per feature and example
        (``metadata.BATCH_TAG``, for the hint).

        Args:
          step: the first bad step.
          step_records: its records.
          kept_batches: step -> that step's kept batch, each replica's part
            ([] where none was kept; a replica whose records were finite kept none).
        """
        if self._batch_noted:
            return
        self._batch_noted = True
        bad = {tag: info.dtype for tag, v, info in step_records
               if info.role == "input" and (records.nonfinite_count(v, info.neginf_ok) > 0 or v[F["overflow"]] > 0)}
        if not bad:
            return
        tensors: dict[str, list] = {}
        for batch in kept_batches(step):
            for _, tag, ts in self._plan.batch.assign(batch):
                if tag in bad:
                    tensors.setdefault(tag, []).extend(ts)
        found = [f for f in (_keras_batch.bad_features(tag, ts, bad[tag]) for tag, ts in tensors.items()) if f]
        if found:
            self._write_note(metadata.BATCH_TAG, step, "Batch", {"step": step, "tensors": found})

    def write_checked(self, step: int, message: str, record: np.ndarray) -> None:
        """The record of the tensor a numerics check of the program's own
        (``tf.debugging.check_numerics(t, message)``) found non-finite at
        ``step``, which it then ended: tag ``checked/<message>``."""
        info = metadata.TensorInfo(role="other", op_type="CheckNumerics", description=(
            "the tensor tf.debugging.check_numerics(..., %r) checked when it stopped the step" % message))
        self.writer.write("checked/" + message, step, record, info)

    def replay_verdict(self, step: int, replay: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The verdict of ``replay()`` on ``step`` (``first_anomaly.replay``),
        written into the run; it never raises (a replay must never stop training)."""
        self.writer.flush()
        verdict: dict[str, Any] = {"step": int(step)}
        try:
            verdict.update(replay())
        except Exception as e:  # noqa: BLE001 - the verdict says why
            verdict.update(reproduced=False, why="the replay raised %s: %s" % (type(e).__name__, e))
        self._write_note(metadata.REPLAY_TAG, step, "Replay", verdict)
        self.writer.flush()
        return verdict

    def _write_note(self, tag: str, step: int, op_type: str, what: dict[str, Any]) -> None:
        """A record of no values whose description holds ``what`` as JSON."""
        info = metadata.TensorInfo(role="other", op_type=op_type, description=json.dumps(what, default=_num))
        self.writer.write(tag, step, records.numpy_stats(np.zeros(0, np.float32)), info)


def stop_training(model: Any, log_dir: str, safe_range: analysis.SafeRange) -> dict[str, Any] | None:
    """Stops ``fit`` and prints the run's first anomaly, in the report's
    words; returns it (as ``tb-numerics report --json`` does), or None
    where none was written.

    Args:
      model: the model ``fit`` trains.
      log_dir: the run's directory.
      safe_range: the callback's safe range.
    """
    # The run's event files: the callback's, and the replay's beside it.
    rr = event_reader.read_run(".", event_reader.find_runs(log_dir).get(".", []))
    ra = analysis.analyze_run(log_dir, rr.series, safe_range, rr.problems)
    anomaly = analysis.first_anomaly(ra)
    model.stop_training = True
    if anomaly is not None:  # (always: the first bad step is always written)
        print("\n".join(report_text.anomaly_lines(anomaly, head="tb-numerics: stopping training at ")),
              file=sys.stderr)
    return anomaly


def _num(x: Any) -> Any:
    return float(x) if isinstance(x, (np.floating, np.integer)) else str(x)
