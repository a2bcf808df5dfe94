"""``NumericsCallback`` on Keras' PyTorch backend.

Keras' PyTorch ``train_step(data)`` runs eagerly (or under ``torch.compile``
with ``jit_compile=True``) as TensorFlow's does, so the callback wraps, on
the instances only and for the duration of ``fit``, the same places:

* each top-level layer's ``call``, to keep its outputs;
* the model's ``compute_loss`` (a custom ``train_step`` written as Keras'
  guide writes it calls it and not ``scale_loss``), the optimizer's
  ``scale_loss`` and ``torch.Tensor.backward`` (a loss computed by hand),
  whichever comes first in the step, for the loss, and ``apply``, where the
  gradients are known: there the step's records are computed (``torch_stats``:
  three to nine passes per tensor on its device, on one intra-op thread, a
  few copies of a few numbers per tensor to the host for the whole step),
  the weights are recorded before
  the update on their steps, and the update of a step whose loss or
  gradients are not finite is held back (a replay needs the weights the
  step used; a LossScaleOptimizer skips such steps itself);
* the model's ``train_step``, which keeps the batch and the seed
  generators' states as the step began, for the replay.

The replay (``torch_replay``) runs the model's own ``train_step`` again on the
kept batch, the update suppressed, under a ``TorchDispatchMode`` that checks
every operator's output.
"""

from __future__ import annotations

import functools
from typing import Any

import keras
import numpy as np
import torch

from tb_numerics import metadata, records
from tb_numerics._keras_host import NumericsCallbackBase, Step, StepValues, step_counter
from tb_numerics.backends import torch_replay, torch_stats

__all__ = ["TorchNumericsCallback"]

F = metadata.FIELD_INDEX
_SEED_STATE = "seed_generator_state"  # the name keras.random.SeedGenerator gives its state variable


class _Trace:
    """What one run of the training step collected."""

    def __init__(self, data: Any) -> None:
        self.data = data
        self.outputs: dict[int, list[torch.Tensor]] = {}
        self.loss: torch.Tensor | None = None
        self.applied = False


def _float_leaves(structure: Any) -> list[torch.Tensor]:
    return [t.detach() for t in keras.tree.flatten(structure)
            if isinstance(t, torch.Tensor) and t.dtype in torch_stats.FLOAT_DTYPES]


def _merged(tensors: list[torch.Tensor]) -> torch.Tensor:
    """All of ``tensors`` as one (a layer's outputs, or its repeated calls)."""
    if len(tensors) == 1:
        return tensors[0]
    dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors))
    return torch.cat([t.reshape(-1).to(dtype) for t in tensors])


class TorchNumericsCallback(NumericsCallbackBase):
    """``NumericsCallback`` for Keras' PyTorch backend (the options: ``_keras_host.NumericsCallbackBase``)."""

    backend = "torch"

    def _begin(self, model: keras.Model) -> None:
        opt = model.optimizer
        self._trace: _Trace | None = None
        self._results: list[Step] = []
        self._kept: dict[int, tuple[Any, list[torch.Tensor]]] = {}
        self._step = int(np.asarray(keras.ops.convert_to_numpy(step_counter(opt))))
        self._seeds = [v for v in model.non_trainable_variables if v.name == _SEED_STATE]
        self._replayer = torch_replay.StepReplay(model, model.train_step)
        patches = self._patches
        patches.set(model, "train_step", self._wrap_train_step(model.train_step))
        patches.set(model, "compute_loss", self._wrap_loss_source(model.compute_loss, result=True))
        patches.set(opt, "scale_loss", self._wrap_loss_source(opt.scale_loss))
        patches.set(torch.Tensor, "backward", self._wrap_loss_source(torch.Tensor.backward))
        patches.set(opt, "apply", self._wrap_apply(opt.apply))
        for i, layer in enumerate(self.plan.layers):
            patches.set(layer, "call", self._wrap_call(i, layer.call))
        old_function = model.train_function
        patches.on_restore(lambda: setattr(model, "train_function", old_function))
        model.make_train_function(force=True)

    # ------------------------------------------------------------ wrappers

    def _wrap_train_step(self, train_step):
        @functools.wraps(train_step)
        def wrapped(data):
            seeds = [v.value.detach().clone() for v in self._seeds]  # as the step begins: its random draws
            self._trace = _Trace(data)
            try:
                return train_step(data)
            finally:
                trace, self._trace = self._trace, None
                if trace.applied:
                    self._kept = {self._step: (data, seeds)}  # the last step's only
                    self._step += 1

        return wrapped

    def _wrap_call(self, index: int, call):
        @functools.wraps(call)
        def wrapped(*args, **kwargs):
            with self._replayer.in_layer(self.plan.layer_names[index]):
                out = call(*args, **kwargs)
            if self._trace is not None and self.activations and not self._trace.applied:
                self._trace.outputs.setdefault(index, []).extend(_float_leaves(out))
            return out

        return wrapped

    def _wrap_loss_source(self, fn, result: bool = False):
        """``fn`` (``compute_loss``, ``scale_loss``, ``Tensor.backward``), keeping the step's
        loss from the first of them: the result of ``compute_loss``, the argument of the others."""
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            out = fn(*args, **kwargs)
            loss = out if result else (args[0] if args else None)
            trace = self._trace
            if trace is not None and trace.loss is None and not trace.applied and isinstance(loss, torch.Tensor):
                trace.loss = loss.detach()
            return out

        return wrapped

    def _wrap_apply(self, apply):
        @functools.wraps(apply)
        def wrapped(grads, trainable_variables=None):
            if self._replayer.active:
                return None  # a replay never updates the weights
            trace = self._trace
            if trace is None or trace.applied:
                return apply(grads, trainable_variables)
            trace.applied = True
            variables = trainable_variables if trainable_variables is not None else self.model.trainable_variables
            return self._recorded_apply(apply, trace, list(grads), list(variables))

        return wrapped

    def _recorded_apply(self, apply, trace: _Trace, grads: list, variables: list):
        """The optimizer's update, with the step's records computed around it."""
        plan, opt = self.plan, self.model.optimizer
        scale = float(keras.ops.convert_to_numpy(opt.dynamic_scale)) if self._lso else None
        tensors = self._forward_tensors(trace)
        grad_of = {id(v): g for g, v in zip(grads, variables)}
        for j, r in plan.grad_rows.items():
            g = grad_of.get(id(plan.variables[j]))
            if g is not None:  # the gradients the update uses
                tensors[r] = g.detach() / scale if scale is not None else g.detach()
        stats = np.zeros((len(plan.rows), metadata.NUM_FIELDS))
        for r, row in enumerate(plan.rows[: plan.weight_row0]):
            row.present = r in tensors  # a None gradient has no record
        self._fill(stats, tensors)
        loss_bad = plan.rows[plan.loss_row].present and records.nonfinite_count(stats[plan.loss_row]) > 0
        grads_bad = any(records.nonfinite_count(stats[r]) > 0 for r in plan.grad_rows.values() if r in tensors)
        due = self._step % self.weights_every_n_steps == 0 or bool(loss_bad)
        with torch_stats.one_thread():
            old = [v.value.detach().clone() for v in plan.variables] if due and self.update_ratios else []
        if due and self.weights:
            self._fill(stats, {plan.weight_row0 + j: v.value.detach() for j, v in enumerate(plan.variables)})
        held = self.replay and not self._lso and (loss_bad or grads_bad)
        result = None if held else apply(grads, variables)
        norms = np.zeros((0, 2))
        if old:
            with torch_stats.one_thread():
                norms = torch.stack([torch.stack([torch_stats.sq_norm(v.value.detach() - w), torch_stats.sq_norm(w)])
                                     for v, w in zip(plan.variables, old)]).to(torch.float64).cpu().numpy()
        values = StepValues(call=self._step, step=self._step, loss_scale=1.0 if scale is None else scale,
                            weights_due=due, update_norms=norms)
        self._results.append((stats, values))
        return result

    def _forward_tensors(self, trace: _Trace) -> dict[int, torch.Tensor]:
        """row -> tensor of the batch, each layer's outputs, the loss and the
        state the forward pass updated; each row's dtype and shape noted from
        the tensors the step made."""
        plan, out = self.plan, {}
        if self.inputs and trace.data is not None:
            for i, tag, ts in plan.batch.assign(trace.data):
                r = plan.batch_row0 + i
                ts = [torch.as_tensor(t).detach() for t in ts]
                out[r] = _merged(ts)
                plan.rows[r].tag, plan.rows[r].dtype = tag, torch_stats.check_dtype(ts[0], tag)
                plan.rows[r].shape = tuple(ts[0].shape) if len(ts) == 1 else None
        for i, ts in trace.outputs.items():
            r = plan.act_rows[i]
            out[r] = _merged(ts)
            plan.rows[r].dtype, plan.rows[r].shape = torch_stats.check_dtype(ts[0], plan.rows[r].tag), tuple(ts[0].shape)
        if trace.loss is not None and trace.loss.dtype in torch_stats.FLOAT_DTYPES:
            row = plan.rows[plan.loss_row]
            row.dtype, row.shape = torch_stats.check_dtype(trace.loss, "loss"), tuple(trace.loss.shape)
            out[plan.loss_row] = trace.loss
        for r, v in zip(plan.state_rows, plan.states):
            out[r] = v.value.detach()  # as the forward pass left it
        return out

    def _fill(self, stats: np.ndarray, tensors: dict[int, torch.Tensor]) -> None:
        """The records of ``tensors`` (row -> tensor) into ``stats``, in one copy to the host."""
        rows = sorted(tensors)
        stats[rows] = torch_stats.records([tensors[r] for r in rows], [self.plan.rows[r].tag for r in rows])

    # ------------------------------------------------------------ host side

    def _new_steps(self) -> list[Step]:
        out, self._results = self._results, []
        return out

    def _kept_batches(self, step: int) -> list[Any]:
        kept = self._kept.get(step)
        return [] if kept is None else [keras.tree.map_structure(
            lambda t: t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else t, kept[0])]

    def _replay_at(self, step: int) -> dict[str, Any]:
        kept = self._kept.get(step)
        if kept is None:
            return {"reproduced": False, "why": "no batch was kept for this step"}
        return self._replayer.replay(kept[0], kept[1], step)
