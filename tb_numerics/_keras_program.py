"""The Keras callback's part of the training step: the step's records, computed in the graph.

Inside the training step (traced, compiled or not), around the optimizer's
update, ``StepProgram.recorded_apply`` computes the records of the batch,
each layer's outputs, the loss and each gradient (``stats.tensor_stats``),
and on the steps that record them the weights' and the norms for the update
ratios; it stores them, with the step's values (``StepValues``), in a few
untracked variables that the host reads after the batch
(``StepProgram.new_steps``). Summary ops cannot run under
``jit_compile=True``; variables can, so the same records come out there.

It also holds the update back where the step's loss or a gradient holds a
NaN or an Inf and a replay may need the weights that step used (the gated
update; see ``_keras_replay``), and, under several replicas, combines each
record across them and keeps each replica's own non-finite counts.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf

from tb_numerics import _keras_replay, _tf_internal, analysis, metadata, stats
from tb_numerics._keras_gate import UpdateGate
from tb_numerics._keras_host import AUX_FIELDS, AUX_INDEX, StepValues, step_counter
from tb_numerics._keras_plan import RowPlan
from tb_numerics.records import F
from tb_numerics.survive import Spike

__all__ = ["AUX_FIELDS", "StepProgram", "StepValues", "Trace", "strategy_of"]

NUM_FIELDS = metadata.NUM_FIELDS


def _aux_row(norms: tf.Tensor, **values: tf.Tensor) -> tf.Tensor:
    """The float64 aux row of a step's values, given by name (``AUX_FIELDS``, each once), then ``norms``."""
    if set(values) != set(AUX_FIELDS):
        raise ValueError("tb_numerics: aux values missing %s, unknown %s" % (
            sorted(set(AUX_FIELDS) - set(values)), sorted(set(values) - set(AUX_FIELDS))))
    return tf.concat([tf.stack([tf.cast(values[k], tf.float64) for k in AUX_FIELDS]), norms], 0)


@dataclasses.dataclass
class Trace:
    """What one trace (or eager run) of the training step collected."""

    outputs: dict[int, list[tf.Tensor]] = dataclasses.field(default_factory=dict)  # by layer index
    loss: tf.Tensor | None = None
    # The records of the loss and of each gradient (by variable index), which
    # the gated update decides on (``UpdateGate``).
    loss_record: tf.Tensor | None = None
    grad_records: dict[int, tf.Tensor] = dataclasses.field(default_factory=dict)
    data: Any = None  # the step's batch, kept for a replay if the step goes bad
    # (gradient, variable) pairs of the other optimizers the step applied
    # before the model's (a GAN's), recorded as its gradients; in a replay,
    # every optimizer's.
    grads: list[tuple[Any, Any]] = dataclasses.field(default_factory=list)
    # Whether every update of the step so far was applied (a bool tensor), so
    # that a second optimizer's update is held back with the first's; None
    # before the step's first gated update.
    applied_so_far: Any = None
    # The state the forward pass updates, as the step began (``UpdateGate.
    # state_before``): put back where the step's update is held back.
    state_before: list | None = None


def _merged_stats(tensors: list[tf.Tensor], name: str) -> tf.Tensor:
    """The record of all of ``tensors`` together (a layer's outputs, or its repeated calls)."""
    out = stats.tensor_stats(tensors[0], name)
    for t in tensors[1:]:
        out = stats.merge_stats(out, stats.tensor_stats(t, name))
    return out


def _batched_records(items: list[tuple[list[tf.Tensor], str]]) -> list[tf.Tensor]:
    """The record of each item (a row's tensors, merged; its tag).

    Rows of one tensor are made by ``stats.records_of`` (the small ones
    together, in a fixed number of nodes: ResNet-50's 161 small gradients
    were 161 sites to trace and instantiate at the first step). A layer
    called several times merges its calls' records.
    """
    single = [k for k, (tensors, _) in enumerate(items) if len(tensors) == 1]
    records: list[tf.Tensor | None] = [None] * len(items)
    if single:
        made = stats.records_of([items[k][0][0] for k in single], [items[k][1] for k in single])
        # One op for all the rows (indexing each took a slice and its three constants).
        for k, row in zip(single, tf.unstack(made, num=len(single))):
            records[k] = row
    for k, (tensors, tag) in enumerate(items):
        if records[k] is None:
            records[k] = _merged_stats(tensors, tag)
    return records


def _state_variable(initial_value: Any) -> tf.Variable:
    # Plain variables, whatever strategy's scope ``fit`` runs in (a mirrored
    # one cannot be assigned a slice, and the records are stored once).
    return _tf_internal.untracked_variable(initial_value, "tb_numerics_callback")


def strategy_of(model: Any) -> tf.distribute.Strategy:
    """The strategy ``fit`` runs the model's steps under (the default one on one device)."""
    return getattr(model, "distribute_strategy", None) or tf.distribute.get_strategy()


class _Snapshot:
    """A copy of the weights before the update (for the update ratios) where
    the record kernel does not serve (``stats.keep_if``), in one flat
    variable per dtype: one resource for a cond branch to capture, not one
    per weight (ResNet-50's 214 made 214 inputs of each branch of each cond
    that reads them, each a node to trace and optimise). Made at the first
    trace that needs it: with the kernel, a due step's copy lives in the
    step alone."""

    def __init__(self, variables: list):
        self._count = len(variables)
        # dtype -> (the positions of its weights, their sizes)
        self._groups: dict[tf.DType, tuple[list[int], list[int]]] = {}
        for i, v in enumerate(variables):
            where, sizes = self._groups.setdefault(tf.as_dtype(v.dtype), ([], []))
            where.append(i)
            sizes.append(int(np.prod(v.shape)))
        self._made: dict[tf.DType, tf.Variable] = {}

    def _buffers(self) -> dict[tf.DType, tf.Variable]:
        if not self._made:
            # Made inside the trace: the initial value too, under tf.init_scope.
            self._made = {dtype: _state_variable(functools.partial(tf.zeros, [sum(sizes)], dtype))
                          for dtype, (_, sizes) in self._groups.items()}
        return self._made

    def keep(self, values: list[tf.Tensor]) -> None:
        """Copies ``values`` (the weights, in order) into the buffers."""
        buffers = self._buffers()
        for dtype, (where, _) in self._groups.items():
            part = [stats.flatten(values[i]) for i in where]
            buffers[dtype].assign(tf.concat(part, 0) if len(part) > 1 else part[0])

    def moved(self, values: list[tf.Tensor]) -> tf.Tensor:
        """||w - kept||^2 of each weight (``values``: the weights now, in order), float64."""
        olds = self.flat_values()
        return stats.sq_norms([stats.flatten(v) - old for v, old in zip(values, olds)])

    def flat_values(self) -> list[tf.Tensor]:
        """The kept weights, flat, in order."""
        out: list[tf.Tensor | None] = [None] * self._count
        for dtype, (where, sizes) in self._groups.items():
            value = self._buffers()[dtype].read_value()
            for i, part in zip(where, tf.split(value, sizes) if len(sizes) > 1 else [value]):
                out[i] = part
        return out


class StepProgram:
    """The step's records and gated update, inside the training step.

    Args:
      model: the model ``fit`` trains.
      plan: its rows (``RowPlan``).
      replay: the replay that keeps a bad step's batch, or None.
      update_ratios: whether to keep the weights before the update.
      weights_every_n_steps: the steps that compute the weights' rows.
      safe_range: the user's allowlist of -Inf.

    Attributes:
      lso: whether the optimizer is a LossScaleOptimizer.
      gate: the gated update (``_keras_gate``).
      replica_nonfinite: under several replicas with a replay, each
        replica's own non-finite count of each row before the weights' at
        the last step (``[replicas, rows]``); else None.
    """

    def __init__(self, model: Any, plan: RowPlan, replay: _keras_replay.StepReplay | None, *,
                 update_ratios: bool, weights_every_n_steps: int, safe_range: analysis.SafeRange,
                 policy: bool = False, spike: Spike | None = None, listed: bool = False):
        self._model, self._plan, self._replay = model, plan, replay
        self._update_ratios = update_ratios and bool(plan.variables)
        self._weights_every_n_steps = weights_every_n_steps
        self._safe_range = safe_range
        self.lso = isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
        self._slots = max(1, int(getattr(model, "steps_per_execution", 1) or 1))
        nv = len(plan.variables)
        self._stats_var = _state_variable(tf.zeros([self._slots, len(plan.rows), NUM_FIELDS], tf.float64))
        aux0 = np.zeros([self._slots, len(AUX_FIELDS) + (2 * nv if self._update_ratios else 0)])
        aux0[:, AUX_INDEX["call"]] = -1
        self._aux_var = _state_variable(tf.constant(aux0, tf.float64))
        self._calls = _state_variable(tf.constant(0, tf.int64))
        self._skipped = _state_variable(tf.constant(0, tf.int64))
        # What a numerics check of the program's own (tf.debugging.check_numerics) found
        # non-finite, kept before it raises: its record, its step and which check (or -1).
        self._checked = _state_variable(tf.zeros([NUM_FIELDS], tf.float64))
        self._checked_at = _state_variable(tf.constant([-1, -1], tf.int64))
        self.checks: list[str] = []  # the messages of the checks traced, by index
        self._snapshot = _Snapshot(plan.variables) if update_ratios else None
        strategy = strategy_of(model)
        replicas = strategy.num_replicas_in_sync
        self.replica_nonfinite = (
            _state_variable(tf.zeros([replicas, plan.weight_row0], tf.float64))
            if replay is not None and replicas > 1 and replay.why_not is None else None
        )
        # The update is gated (held back at a bad step) for a replay or an
        # on_anomaly policy; under several replicas where the gate can be
        # taken across them (MirroredStrategy).
        replicas_ok = replicas == 1 or isinstance(strategy, tf.distribute.MirroredStrategy)
        self.gate = UpdateGate(plan, safe_range, lso=self.lso, spike=spike, listed=listed,
                               gates=replicas_ok and (replay is not None or policy or spike is not None),
                               policy=policy)

    @property
    def plan(self) -> RowPlan:
        """The step's rows."""
        return self._plan

    # ------------------------------------------------------------ host

    def new_steps(self, last_call: int) -> list[tuple[np.ndarray, StepValues]]:
        """The steps stored since call ``last_call``, oldest first: each
        one's records ``[rows, NUM_FIELDS]`` and values (copies: the next
        step may overwrite the variables)."""
        stats_np, aux_np = self._stats_var.numpy(), self._aux_var.numpy()
        order = np.argsort(aux_np[:, AUX_INDEX["call"]], kind="stable")
        values = [(stats_np[slot], StepValues.of(aux_np[slot])) for slot in order]
        return [(s, v) for s, v in values if v.call > last_call]

    def checked(self) -> tuple[int, str, np.ndarray] | None:
        """(step, message, record) of the tensor a numerics check of the
        program's own found non-finite in the step it stopped, or None."""
        step, which = (int(v) for v in self._checked_at.numpy())
        if step < 0:
            return None
        self._checked_at.assign([-1, -1])
        return step, self.checks[which], self._checked.numpy()

    # ------------------------------------------------------------ in the step

    def keep_checked(self, tensor: tf.Tensor, message: str, trace: Trace) -> tf.Tensor:
        """Inside the step, before a numerics check of the program's own
        reads ``tensor``: where it holds a NaN or an Inf, its record, the
        step and the batch (for the replay) are kept, so that the host still
        has them after the check raised and ended the step. Returns a tensor
        to make the check wait for."""
        self.checks.append(message)
        which = len(self.checks) - 1
        opt = self._model.optimizer
        step = tf.cast(tf.convert_to_tensor(step_counter(opt)), tf.int64) + self._skipped.read_value()

        def keep() -> tf.Tensor:
            self._checked.assign(stats.tensor_stats(tensor, message))
            self._checked_at.assign(tf.stack([step, tf.constant(which, tf.int64)]))
            if self._replay is not None and not self._replay.why_not:
                self._replay.keep_if(tf.constant(True), trace.data, step)
            return tf.constant(True)

        return tf.cond(stats.all_finite([tensor]), lambda: tf.constant(False), keep)


    def recorded_apply(self, apply: Callable[..., Any], trace: Trace, grads: list, variables: list) -> Any:
        """The optimizer's update, with the step's statistics stored around it."""
        opt = self._model.optimizer
        its_before = tf.cast(tf.convert_to_tensor(step_counter(opt)), tf.int64)
        scale = tf.cast(tf.convert_to_tensor(opt.dynamic_scale), tf.float32) if self.lso else tf.constant(1.0)
        rows = self._forward_and_gradient_rows(trace, grads, variables, scale)
        zero = tf.zeros([NUM_FIELDS], tf.float64)
        head = tf.stack([zero if r is None else r for r in rows])
        ctx = stats.replica_context()
        step = its_before + self._skipped.read_value()
        neginf_ok = self._plan.neginf_ok(self._safe_range)[: self._plan.weight_row0]
        if self._replay is not None and not self._replay.why_not:
            # On this replica's own records, before they are combined; nothing waits for it.
            self._replay.keep_if(tf.reduce_any(stats.nonfinite_count(head, neginf_ok) > 0), trace.data, step)
        head, per_replica = self._combined(head, ctx, neginf_ok)
        due = self._weights_due(step, rows[self._plan.loss_row], ctx)
        kept = self._kept_before(due, ctx)
        if kept is None:
            weight_rows = tf.cond(due, self._weights_before,
                                  lambda: tf.zeros([self._plan.num_weight_rows, NUM_FIELDS], tf.float64))
            # No explicit control dependency: tf.function's automatic ones already
            # run the weights' reads (and the copy) before the update writes them,
            # and an explicit one made the update wait for the whole tf.cond
            # (measured: 1.11-1.12x plain fit with it, 1.08x without).
            waits: list = []
        else:
            weight_rows, copies = kept
            # The update writes the weights once the kernel has read them: a
            # read still held when the update writes would be copied first.
            waits = [weight_rows, *copies]
        trigger = self.gate.trigger(head)
        with tf.control_dependencies(waits):
            result = self.gate.gated_apply(apply, grads, variables, trace, ctx, trigger["trigger"])
        applied = result if isinstance(result, tf.Tensor) and result.dtype == tf.bool else tf.constant(True)
        if self.lso:  # a LossScaleOptimizer's own skip leaves the iterations where they were
            its_after = tf.cast(tf.convert_to_tensor(step_counter(opt)), tf.int64)
            applied = tf.logical_and(applied, tf.not_equal(its_after, its_before))
        self.gate.put_back(trace, tf.logical_not(applied), trigger["trigger"])
        skipped = tf.cast(tf.logical_not(applied), tf.int64)
        aux = _aux_row(self._update_norms(due, weight_rows, kept), call=self._calls.read_value(), step=step,
                       loss_scale=scale, weights_due=due, held=skipped, **trigger)
        stacked = tf.concat([head, weight_rows], 0)
        if ctx is None:
            self._store(stacked, aux, skipped)
        else:  # once, not once per replica: all replicas hold the same values
            ctx.merge_call(
                lambda strategy, *values: self._store(*(strategy.experimental_local_results(v)[0] for v in values)),
                args=(stacked, aux, skipped) + per_replica,
            )
        return result

    def shift_steps(self, n: int) -> None:
        """Moves the steps the records are written at on by ``n`` (a rewind
        set the optimizer's step counter back: the records' steps go on)."""
        self._skipped.assign_add(n)

    def _combined(self, head: tf.Tensor, ctx: Any, neginf_ok: np.ndarray) -> tuple[tf.Tensor, tuple]:
        """Under several replicas, each record of all replicas' values together
        (the weights are the same on every replica), and, for the replay,
        each replica's own non-finite counts; on one device, ``head``."""
        if ctx is None:
            return head, ()
        gathered = stats.gather_replicas(head, ctx)
        per_replica = (stats.nonfinite_count(gathered, neginf_ok),) if self.replica_nonfinite is not None else ()
        return stats.combine_replicas(gathered), per_replica

    def _forward_and_gradient_rows(self, trace: Trace, grads: list, variables: list, scale: tf.Tensor) -> list:
        """The records computed before the weights': the batch's, each layer's
        outputs, the loss, the state the forward pass updated and each
        gradient (None where absent), in row order."""
        plan = self._plan
        rows: list[tf.Tensor | None] = [None] * plan.weight_row0
        self._batch_records(trace, rows)
        forward: list[tuple[int, list[tf.Tensor]]] = []
        graph = tf.compat.v1.get_default_graph()
        for i, tensors in trace.outputs.items():
            # Outputs of this step's graph only: a subclassed model's first call
            # also runs its layers in a scratch graph of Keras' own.
            tensors = [t for t in tensors if not hasattr(t, "graph") or t.graph is graph]
            if tensors:
                row = plan.rows[plan.act_rows[i]]
                row.dtype = tensors[0].dtype.base_dtype.name
                row.shape = tuple(tensors[0].shape.as_list()) if tensors[0].shape.rank is not None else None
                row.present = True
                # No stop_gradient here: no gradient is ever taken of a
                # record (they are made in the optimizer's apply, after the
                # tape), and tensor_stats stops the gradient of what it reads.
                forward.append((plan.act_rows[i], tensors))
        if trace.loss is not None and trace.loss.dtype.base_dtype.name in metadata.DTYPE_LIMITS:
            row = plan.rows[plan.loss_row]
            row.dtype, row.shape, row.present = trace.loss.dtype.base_dtype.name, tuple(trace.loss.shape), True
            forward.append((plan.loss_row, [trace.loss]))
        # Read after the forward pass's own assignments (the automatic control
        # dependencies order reads and writes of one variable).
        forward += [(r, [tf.convert_to_tensor(v)]) for r, v in zip(plan.state_rows, plan.states)]
        records = _batched_records([(tensors, plan.rows[r].tag) for r, tensors in forward])
        for (r, _), record in zip(forward, records):
            rows[r] = record
        if trace.loss is not None:
            trace.loss_record = rows[plan.loss_row]
        backward = self._gradients(trace.grads + list(zip(grads, variables)), scale)
        records = _batched_records([([g], plan.rows[plan.grad_rows[j]].tag) for j, g in backward])
        for (j, _), record in zip(backward, records):
            rows[plan.grad_rows[j]] = trace.grad_records[j] = record
        return rows

    def _gradients(self, pairs: list, scale: tf.Tensor) -> list[tuple[int, tf.Tensor]]:
        """(variable index, gradient) of each gradient row that has one, in
        row order, as the updates use them; marks each row present or not.

        ``pairs``: the step's (gradient, variable) pairs, the other
        optimizers' (``Trace.grads``) before the model optimizer's, whose
        gradient wins where both update one variable."""
        plan = self._plan
        grad_of = {id(v): g for g, v in pairs if g is not None}
        out = []
        for j in sorted(plan.grad_rows, key=plan.grad_rows.get):
            g = grad_of.get(id(plan.variables[j]))
            if isinstance(g, tf.IndexedSlices):
                g = g.values  # the rows it touches, as log_gradients does
            plan.rows[plan.grad_rows[j]].present = g is not None
            if g is not None:
                if self.lso:  # the gradients the update uses (no pass over them otherwise)
                    g = g / tf.cast(scale, g.dtype)
                out.append((j, tf.convert_to_tensor(g)))
        return out

    def _batch_records(self, trace: Trace, rows: list) -> None:
        """The records of the step's batch, in place in ``rows``: each row's
        tag, dtype and shape from the tensors the step received."""
        plan = self._plan
        if not plan.batch_rows or trace.data is None:
            return
        for i, tag, tensors in plan.batch.assign(trace.data):
            r = plan.batch_row0 + i
            t = tf.convert_to_tensor(tensors[0])
            row = plan.rows[r]
            row.tag, row.dtype, row.present = tag, t.dtype.base_dtype.name, True
            row.shape = tuple(t.shape.as_list()) if len(tensors) == 1 and t.shape.rank is not None else None
            rows[r] = _merged_stats([tf.convert_to_tensor(x) for x in tensors], tag)

    def _weights_due(self, step: tf.Tensor, loss_row: tf.Tensor | None, ctx: Any) -> tf.Tensor:
        """Whether the weights (and the copy for the update ratios) are
        recorded: every weights_every_n_steps-th step, and any step whose
        loss is not finite. The update waits for this decision, so it rests
        on the loss, known early, not on the layers' or gradients' statistics
        (measured: a step waiting for those costs 3-6 ms more)."""
        if not (self._plan.num_weight_rows or self._update_ratios):
            return tf.constant(False)
        loss_ok = self._plan.neginf_ok(self._safe_range)[self._plan.loss_row]
        loss_bad = stats.nonfinite_count(loss_row, loss_ok) > 0 if loss_row is not None else tf.constant(False)
        if ctx is not None:  # every replica must take the same branch
            loss_bad = ctx.all_reduce(tf.distribute.ReduceOp.SUM, tf.cast(loss_bad, tf.float32)) > 0
        return tf.logical_or(tf.equal(tf.math.floormod(step, self._weights_every_n_steps), 0), loss_bad)

    def _kept_before(self, due: tf.Tensor, ctx: Any) -> tuple[tf.Tensor, list[tf.Tensor]] | None:
        """On one device where the record kernel serves (``stats.keep_if``):
        the weights' records before the update and their copies for the
        update ratios, made where ``due`` with no cond; else None (a cond,
        ``_weights_before``)."""
        plan = self._plan
        if ctx is not None or not (plan.num_weight_rows or self._update_ratios):
            return None
        return stats.keep_if([tf.convert_to_tensor(v) for v in plan.variables], [v.path for v in plan.variables],
                             due, record=bool(plan.num_weight_rows), copy=self._update_ratios)

    def _weights_before(self) -> tf.Tensor:
        """The weights' records before the update, after copying them for the update ratios."""
        # The copies need no control dependency on what follows: a branch's
        # stateful ops all run, and the records read the variables, not the
        # copies. Made the context of the records (as it was), each of their
        # ops took one control edge per variable: ResNet-50's 214 copies
        # times some 1,900 ops; this branch, traced as a function of its
        # own, took 18.2 s to its first result, 7.7 s without the edges.
        variables = self._plan.variables
        values = [tf.convert_to_tensor(v) for v in variables]
        if self._snapshot is not None:
            self._snapshot.keep(values)
        if not self._plan.num_weight_rows:
            return tf.zeros([0, NUM_FIELDS], tf.float64)
        return stats.records_of(values, [v.path for v in variables])

    def _update_norms(self, due: tf.Tensor, weight_rows: tf.Tensor,
                      kept: tuple[tf.Tensor, list[tf.Tensor]] | None) -> tf.Tensor:
        """||w_new - w_old||^2 and ||w_old||^2 of each variable, on due steps
        (``kept``: ``_kept_before``'s, or None where a cond made the copy)."""
        variables = self._plan.variables
        if not self._update_ratios:
            return tf.zeros([0], tf.float64)
        if kept is not None:
            return tf.reshape(stats.moved_since([tf.convert_to_tensor(v) for v in variables], kept[1], due), [-1])

        def norms() -> tf.Tensor:
            moved = self._snapshot.moved([tf.convert_to_tensor(v) for v in variables])
            # ||w_old||^2 is the weights records' sum of squares when there are any.
            w2 = (weight_rows[:, F["sum_sq"]] if self._plan.num_weight_rows
                  else stats.sq_norms(self._snapshot.flat_values()))
            return tf.reshape(tf.stack([moved, w2], axis=1), [-1])

        return tf.cond(due, norms, lambda: tf.zeros([2 * len(variables)], tf.float64))

    def _store(self, stacked: tf.Tensor, aux: tf.Tensor, skipped: tf.Tensor, per_replica: Any = None) -> None:
        """Keeps a step's records for the host (``new_steps``)."""
        if self._slots == 1:
            self._stats_var.assign(stacked[None])
            self._aux_var.assign(aux[None])
        else:
            # A scatter, not a slice assignment: XLA wants a slice's bounds
            # known when it compiles, and the slot is this call's number.
            slot = tf.reshape(tf.cast(aux[AUX_INDEX["call"]], tf.int64) % self._slots, [1, 1])
            self._stats_var.scatter_nd_update(slot, stacked[None])
            self._aux_var.scatter_nd_update(slot, aux[None])
        if per_replica is not None:
            self.replica_nonfinite.assign(per_replica)
        if self.gate.spike is not None:
            self.gate.spike.push(aux[AUX_INDEX["loss_value"]], aux[AUX_INDEX["grad_norm"]])
        self._skipped.assign_add(skipped)
        self._calls.assign_add(1)
