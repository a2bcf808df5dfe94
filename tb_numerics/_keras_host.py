"""The Keras callback's host side: a step's statistics turned into records and written.

After each batch the callback reads what the step program stored
(``_keras_program``); ``HostRecords`` turns a step's rows and values into
records in execution order (adding what the host derives: the global
gradient norm, the update ratios, the loss scale), decides with the
every-N latch (``latch.decide``) which steps to write, and writes them. The
writing runs on one thread beside training, off the step's critical path
(``submit``); a batch that may stop training or need a replay is handled
inline by the callback.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Callable

import numpy as np

from tb_numerics import analysis, latch, metadata, record_writer, records
from tb_numerics._keras_plan import RowPlan
from tb_numerics._keras_program import StepValues
from tb_numerics.records import F

__all__ = ["HostRecords", "Record"]

_MAX_PENDING_WRITES = 8  # batches whose records may wait for the writer thread

Record = tuple[str, np.ndarray, metadata.TensorInfo]


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
    """

    def __init__(self, log_dir: str, plan: RowPlan, *, every_n_steps: int, update_ratios: bool, lso: bool,
                 safe_range: analysis.SafeRange, squared_by: str):
        self._plan, self._every_n_steps, self._update_ratios = plan, every_n_steps, update_ratios
        self._lso, self._safe_range, self._squared_by = lso, safe_range, squared_by
        self._infos: dict[str, metadata.TensorInfo] = {}
        self._prev: tuple[int, list[Record]] | None = None  # the last step computed but not written
        self._seen = latch.NO_KINDS  # the kinds of non-finite values written so far (latch)
        self.writer = record_writer.NumericsRecordWriter(log_dir)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tb_numerics_callback")
        self._pending: list[concurrent.futures.Future] = []

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
        for r, row in enumerate(plan.rows):
            if not row.present or (r >= plan.weight_row0 and not values.weights_due):
                continue
            info = self.info(row.tag, row.role, row.dtype, row.shape, row.op_type, activation=row.activation,
                             compute_dtype=row.compute_dtype)
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
        return step_records, bool(bad)
