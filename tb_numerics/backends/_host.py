"""The host side of the Keras callback on JAX and PyTorch: from a step's numbers to records on disk.

A backend's training step computes one array of statistics per step (one row
per ``_plan.Row``), with a few numbers beside it (``StepResult``). This base
callback turns them into records exactly as the TensorFlow callback does:
the same tags and metadata, the global gradient norm and the update ratios
derived on the host, the every-N latch (``latch.py``), the replay at the
first non-finite step, and the stop message in the analysis' words. It
imports neither TensorFlow nor a backend; the subclasses in ``jax_callback``
and ``torch_callback`` hook the backend's training step.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import sys
from typing import Any, Callable, Sequence

import keras
import numpy as np

from tb_numerics import _keras_batch, analysis, event_reader, latch, metadata, record_writer, records, report_text
from tb_numerics.backends import _plan

__all__ = ["BackendCallback", "StepResult"]

F = metadata.FIELD_INDEX
_MAX_PENDING_WRITES = 8  # batches whose records may wait for the writer thread


@dataclasses.dataclass
class StepResult:
    """One step's numbers as the backend's step computed them.

    ``stats``: ``[rows, NUM_FIELDS]`` float64 (a row the step did not compute
    is not ``present``); ``norms``: per trainable variable ``||w_new -
    w_old||^2`` and ``||w_old||^2`` on steps whose weights are recorded,
    else None; ``loss_scale``: a LossScaleOptimizer's scale, else None.
    """

    step: int
    stats: np.ndarray
    present: np.ndarray
    weights_due: bool
    norms: np.ndarray | None = None
    loss_scale: float | None = None


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError("%s must be a positive integer, got %r" % (name, value))
    return value


class BackendCallback(keras.callbacks.Callback):
    """What ``NumericsCallback`` does on every backend but TensorFlow's hooks:
    the options, the rows, and writing each step (see ``tb_numerics.keras``
    for the options; they mean the same here)."""

    backend = ""  # the Keras backend a subclass serves

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
        if _positive_int("weights_every_n_steps", weights_every_n_steps) % every_n_steps:
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
        self.replay_verdict: dict[str, Any] | None = None
        self._writer: record_writer.NumericsRecordWriter | None = None
        self._restore: list[Callable[[], None]] = []

    # ------------------------------------------------------------ hooks for a backend

    def _install(self, model: keras.Model) -> None:
        """Hooks the model's training step (with ``_patch``)."""
        raise NotImplementedError

    def _drain(self) -> list[StepResult]:
        """The steps computed since the last call, oldest first."""
        raise NotImplementedError

    def _replay_step(self, result: StepResult) -> dict[str, Any]:
        """Runs the step of ``result`` again at op level: the replay's verdict
        (``{"reproduced": True, "op": {...}}`` or ``{"reproduced": False, "why": ...}``)."""
        raise NotImplementedError

    def _kept_batch(self, step: int) -> Any:
        """The batch of ``step`` as numpy arrays, where it was kept; else None."""
        return None

    # ------------------------------------------------------------ set-up and tear-down

    def on_train_begin(self, logs=None) -> None:
        if keras.backend.backend() != self.backend:
            raise RuntimeError("this NumericsCallback serves Keras' %s backend, not %s"
                               % (self.backend, keras.backend.backend()))
        model = self.model
        if not model.trainable_variables:
            raise ValueError("NumericsCallback: the model %r has no variables yet (a subclassed model is built by "
                             "its first call): build it before fit, by calling it on a batch" % model.name)
        if not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        self.plan = _plan.plan_rows(model, inputs=self.inputs, activations=self.activations,
                                    gradients=self.gradients, weights=self.weights)
        self._lso = isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
        self._prev: tuple[int, list] | None = None  # the last step computed but not written
        self._seen = latch.NO_KINDS
        self._infos: dict[str, metadata.TensorInfo] = {}
        self._writer = record_writer.NumericsRecordWriter(self.log_dir)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tb_numerics_callback")
        self._pending: list[concurrent.futures.Future] = []
        self._install(model)

    def _patch(self, obj: Any, name: str, value: Any) -> None:
        """Sets an instance attribute and remembers how to put it back."""
        had = name in vars(obj)
        old = vars(obj).get(name)
        setattr(obj, name, value)
        self._restore.append(lambda: setattr(obj, name, old) if had else delattr(obj, name))

    def on_train_end(self, logs=None) -> None:
        while self._restore:
            self._restore.pop()()
        if self._writer is not None:
            try:
                self._wait_for_writes()
            finally:
                self._pool.shutdown()
                self._writer.close()
                self._writer = None

    def on_epoch_end(self, epoch, logs=None) -> None:
        if self._writer is not None:
            self._wait_for_writes()
            self._writer.flush()

    # ------------------------------------------------------------ each step

    def on_train_batch_end(self, batch, logs=None) -> None:
        if self._writer is None:
            return
        steps = self._drain()
        if not steps:
            return
        if self._pending and (len(self._pending) >= _MAX_PENDING_WRITES or self._pending[0].done()):
            self._pending.pop(0).result()
        replay_due = self.replay and self.replay_verdict is None
        if (self.stop_on_anomaly or replay_due) and any(_may_be_anomaly(r) for r in steps):
            self._wait_for_writes()  # inline: the replay needs the state this step left
            self._write_steps(steps)
        else:
            self._pending.append(self._pool.submit(self._write_steps, steps))

    def _write_steps(self, steps: list[StepResult]) -> None:
        for result in steps:
            if self._step_done(result):
                break

    def _wait_for_writes(self) -> None:
        while self._pending:
            self._pending.pop(0).result()

    def _info(self, row: _plan.Row) -> metadata.TensorInfo:
        info = self._infos.get(row.tag)
        if info is None:
            compute = row.compute_dtype
            info = self._infos[row.tag] = metadata.TensorInfo(
                dtype=row.dtype, shape=row.shape, role=row.role, order=len(self._infos), op_type=row.op_type,
                activation=row.activation,
                compute_dtype=compute if compute in metadata.DTYPE_LIMITS and compute != row.dtype else "",
                neginf_ok=analysis.neginf_intended(row.tag, metadata.TensorInfo(), self.safe_range))
        return info

    def _host_info(self, tag: str, role: str, description: str = "") -> metadata.TensorInfo:
        """The metadata of a record derived on the host (a float32 scalar)."""
        if tag not in self._infos:
            self._infos[tag] = metadata.TensorInfo(dtype="float32", shape=(), role=role, order=len(self._infos),
                                                   description=description)
        return self._infos[tag]

    def _records(self, r: StepResult) -> list[tuple[str, np.ndarray, metadata.TensorInfo]]:
        """The step's records in execution order, host-derived ones included."""
        plan = self.plan
        out, grads = [], []
        for i, row in enumerate(plan.rows):
            if not r.present[i] or (i >= plan.weight_row0 and not r.weights_due):
                continue
            out.append((row.tag, r.stats[i], self._info(row)))
            if row.role == "gradient":
                grads.append(r.stats[i])
        if grads:
            last = max(k for k, (_, _, info) in enumerate(out) if info.role == "gradient")
            out.insert(last + 1, ("gradients/global_norm", records.global_norm_record(np.asarray(grads)),
                                  self._host_info("gradients/global_norm", "global_norm")))
        if self.update_ratios and r.weights_due and r.norms is not None:
            for i, name in enumerate(plan.layer_names):
                mine = [j for j, layer in enumerate(plan.var_layer) if layer == i]
                dw, w = r.norms[mine, 0].sum(), r.norms[mine, 1].sum()
                if mine and w > 0:
                    tag = "update_ratio/%s" % name
                    out.append((tag, records.numpy_stats(np.float32(np.sqrt(dw / w))), self._host_info(
                        tag, "weight", "||w_new - w_old|| / ||w_old|| of layer %s" % name)))
        if r.loss_scale is not None:
            out.append(("loss_scale", records.numpy_stats(np.float32(r.loss_scale)),
                        self._host_info("loss_scale", "loss_scale", "the LossScaleOptimizer's loss scale")))
        return out

    def _step_done(self, r: StepResult) -> bool:
        """Writes one step's records as every_n_steps says (the summary API's
        latch); True to stop training."""
        step_records = self._records(r)
        nonfinite = any(records.nonfinite_count(v, info.neginf_ok) > 0 for _, v, info in step_records)
        bad = [x for x in step_records if analysis.record_is_anomaly(*x, self.safe_range, r.loss_scale)]
        vals = np.array([x[1] for x in bad], np.float64).reshape(-1, metadata.NUM_FIELDS)
        ok = np.array([analysis.neginf_intended(tag, info, self.safe_range) for tag, _, info in bad], bool)
        kinds = latch.kinds(vals[:, F["nan"]], vals[:, F["posinf"]], vals[:, F["neginf"]], ok)
        prev_step = self._prev[0] if self._prev is not None else latch.NO_PREVIOUS_STEP
        decision = latch.decide(r.step, prev_step, kinds, self._seen, self.every_n_steps)
        if decision.write_prev:
            self._writer.write_many(*self._prev)
        written = bool(decision.write_now) or (nonfinite and self._lso)
        if written:
            self._writer.write_many(r.step, step_records)
        self._prev = None if written else (r.step, step_records)
        self._seen = int(decision.seen)
        if not bad:
            return False
        self._note_bad_batch(r.step, step_records)
        if self.replay and self.replay_verdict is None:
            self._writer.flush()
            self.replay_verdict = self._replay(r)
        if not self.stop_on_anomaly:
            return False
        self._stop()
        return True

    def _replay(self, r: StepResult) -> dict[str, Any]:
        """The replay's verdict on step ``r``, written into the run; it never raises."""
        verdict: dict[str, Any] = {"step": int(r.step)}
        try:
            verdict.update(self._replay_step(r))
        except Exception as e:  # noqa: BLE001 - a replay must never stop training
            verdict.update(reproduced=False, why="the replay raised %s: %s" % (type(e).__name__, e))
        info = metadata.TensorInfo(role="other", op_type="Replay", description=json.dumps(verdict, default=_num))
        self._writer.write(metadata.REPLAY_TAG, r.step, records.numpy_stats(np.zeros(0, np.float32)), info)
        self._writer.flush()
        return verdict

    def _note_bad_batch(self, step: int, step_records: list) -> None:
        """At the first bad step: where the kept batch held the bad values of
        the batch's bad records, per feature (``metadata.BATCH_TAG``, for the hint)."""
        if getattr(self, "_batch_noted", False):
            return
        self._batch_noted = True
        bad = {tag: info.dtype for tag, v, info in step_records
               if info.role == "input" and (records.nonfinite_count(v) > 0 or v[F["overflow"]] > 0)}
        batch = self._kept_batch(step) if bad else None
        if batch is None:
            return
        found = [_keras_batch.bad_features(tag, ts, bad[tag]) for _, tag, ts in self.plan.batch.assign(batch)
                 if tag in bad]
        found = [f for f in found if f]
        if found:
            info = metadata.TensorInfo(role="other", op_type="Batch",
                                       description=json.dumps({"step": step, "tensors": found}))
            self._writer.write(metadata.BATCH_TAG, step, records.numpy_stats(np.zeros(0, np.float32)), info)

    def _stop(self) -> None:
        """Stops training and prints the diagnosis, in the analysis' words."""
        self._writer.flush()
        rr = event_reader.read_run(".", event_reader.find_runs(self.log_dir).get(".", []))
        ra = analysis.analyze_run(self.log_dir, rr.series, self.safe_range, rr.problems)
        self.anomaly = analysis.first_anomaly(ra)
        self.model.stop_training = True
        if self.anomaly is not None:
            print("\n".join(report_text.anomaly_lines(self.anomaly, head="tb-numerics: stopping training at ")),
                  file=sys.stderr)


def _may_be_anomaly(r: StepResult) -> bool:
    """Whether a step's records may hold a non-finite value (before the
    latch's exact rule): a non-finite count, or a non-finite update norm."""
    counts = r.stats[r.present][:, F["nan"]:F["neginf"] + 1]
    return bool(counts.any() or (r.norms is not None and not np.isfinite(r.norms).all()))


def _num(x: Any) -> Any:
    return float(x) if isinstance(x, (np.floating, np.integer)) else str(x)
