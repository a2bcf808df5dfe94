"""``NumericsCallback`` on Keras' JAX backend: the records computed inside the jitted train step.

Keras' JAX ``train_step(state, data)`` is a pure function that ``fit``
compiles with ``jax.jit``; the callback wraps, on the instances only and for
the duration of ``fit``:

* each top-level layer's ``call``, to keep its outputs as the step traces them;
* the model's ``compute_loss_and_updates`` (the function Keras differentiates),
  which computes the records of those outputs and of the loss and hands them
  out of ``jax.value_and_grad`` in its auxiliary output, as one more entry
  of the non-trainable variables' list (Keras passes that list on into the
  step's new state);
* the optimizer's ``stateless_apply``, for the gradients' records, the
  weights before the update, the update ratios, and the held-back update of
  a step whose loss or gradients are not finite (so a replay sees the
  weights that step used, as a LossScaleOptimizer does);
* the model's ``train_step``, which takes that entry back out of the state and
  returns every record of the step beside the logs, and ``_make_function``,
  so that ``fit``'s loop hands each step's records (still on the device) and
  its batch to the callback.

All of it is traced into the one jitted step: no host round trip per
tensor, under ``jit_compile=True`` (JAX's default) or not. The host copies
one small array per step in ``on_train_batch_end``; ``_host`` writes it.
A custom ``train_step`` is recorded where it calls these same methods.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import keras
import numpy as np
from jax import lax

from tb_numerics import metadata
from tb_numerics.backends import _host, jax_replay, jax_stats

__all__ = ["JaxNumericsCallback"]

_KEY = "_tb_numerics"  # the step's records beside the logs, taken out before any callback sees them
_SEED_STATE = "seed_generator_state"  # the name keras.random.SeedGenerator gives its state variable


class _Trace:
    """What one trace (or eager run) of the training step collected."""

    def __init__(self, data: Any) -> None:
        self.data = data
        self.outputs: dict[int, list] = {}  # layer index -> its float outputs
        self.forward: dict[int, tuple] = {}  # row -> (counts, values), in the forward pass
        self.grads: dict[int, tuple] = {}  # row -> (counts, values)
        self.weights: list[tuple] = []  # per variable (plan order): (counts, values) before the update
        self.norms = None  # [nv, 2]: ||w_new - w_old||^2, ||w_old||^2
        self.due = jnp.asarray(False)
        self.scale = None  # a LossScaleOptimizer's scale
        self.step = None
        self.forward_done = False  # one forward pass and one update per step are recorded
        self.apply_done = False


def _float_leaves(structure: Any) -> list:
    return [t for t in jax.tree_util.tree_leaves(structure)
            if hasattr(t, "dtype") and jnp.dtype(t.dtype).name in metadata.DTYPE_LIMITS]


def _merged(tensors: list) -> tuple:
    """The record of all of ``tensors`` together (a layer's outputs, or its repeated calls)."""
    if len(tensors) == 1:
        return jax_stats.tensor_stats(tensors[0])
    dtype = jnp.result_type(*tensors)
    return jax_stats.tensor_stats(jnp.concatenate([jnp.ravel(t).astype(dtype) for t in tensors]))


class JaxNumericsCallback(_host.BackendCallback):
    """``NumericsCallback`` for Keras' JAX backend (see ``tb_numerics.keras``)."""

    backend = "jax"

    def _install(self, model: keras.Model) -> None:
        opt = model.optimizer
        self._trace: _Trace | None = None
        self._queue: list[tuple[int, dict, Any]] = []
        self._step0 = int(np.asarray(opt.iterations.value))
        self._calls = 0
        self._n_ntv = len(model.non_trainable_variables)
        self._seed_index = [i for i, v in enumerate(model.non_trainable_variables) if v.name == _SEED_STATE]
        self._tv_index = {id(v): k for k, v in enumerate(model.trainable_variables)}
        self._scale_index = next((k for k, v in enumerate(opt.variables) if v is getattr(opt, "dynamic_scale", None)),
                                 None) if self._lso else None
        self._train_step = model.train_step  # the model's own, for the replay
        self._patch(model, "train_step", self._wrap_train_step(model.train_step))
        self._patch(model, "compute_loss_and_updates", self._wrap_clu(model.compute_loss_and_updates))
        self._patch(opt, "stateless_apply", self._wrap_apply(opt.stateless_apply))
        if self.activations:
            for i, layer in enumerate(model.layers):
                self._patch(layer, "call", self._wrap_call(i, layer.call))
        old_function = model.train_function
        self._restore.append(lambda: setattr(model, "train_function", old_function))
        make_function = model._make_function  # noqa: SLF001 - where fit's loop calls the jitted step
        model._make_function = lambda step_function, **kw: make_function(self._collector(step_function), **kw)
        try:
            model.make_train_function(force=True)
        finally:
            del model._make_function

    # ------------------------------------------------------------ inside the step

    def _collector(self, step_function):
        """Between fit's loop and the jitted step: hands the step its number and
        keeps its records (on the device) and its batch for the host side."""

        @functools.wraps(step_function)
        def run(state, data):
            step = self._step0 + self._calls
            self._calls += 1
            logs, state = step_function(state, (data, np.int32(step)))
            logs = dict(logs)
            self._queue.append((step, logs.pop(_KEY), data))
            return logs, state

        return run

    def _wrap_train_step(self, train_step):
        @functools.wraps(train_step)
        def wrapped(state, data_and_step):
            data, step = data_and_step
            seeds = [state[1][i] for i in self._seed_index]  # as the step begins: its random draws
            self._trace = trace = _Trace(data)
            trace.step = step
            try:
                logs, state = train_step(state, data)
            finally:
                self._trace = None
            tv, ntv, ov, mv = state
            for extra in ntv[self._n_ntv:]:  # what compute_loss_and_updates handed out
                trace.forward.update(extra)
            logs = dict(logs)
            logs[_KEY] = self._step_outputs(trace, seeds)
            return logs, (tv, list(ntv[: self._n_ntv]), ov, mv)

        return wrapped

    def _wrap_call(self, index: int, call):
        @functools.wraps(call)
        def wrapped(*args, **kwargs):
            out = call(*args, **kwargs)
            if self._trace is not None and not self._trace.forward_done:
                self._trace.outputs.setdefault(index, []).extend(_float_leaves(out))
            return out

        return wrapped

    def _wrap_clu(self, compute_loss_and_updates):
        @functools.wraps(compute_loss_and_updates)
        def wrapped(*args, **kwargs):
            trace = self._trace
            loss, aux = compute_loss_and_updates(*args, **kwargs)
            if trace is None or trace.forward_done or not kwargs.get("training", False):
                return loss, aux
            trace.forward_done = True
            unscaled_loss, y_pred, ntv, mv = aux
            forward = self._forward_records(trace, unscaled_loss)
            return loss, (unscaled_loss, y_pred, list(ntv) + [forward], mv)

        return wrapped

    def _forward_records(self, trace: _Trace, loss) -> dict[int, tuple]:
        """row -> record of the batch, each layer's outputs and the loss."""
        plan, out = self.plan, {}
        if self.inputs:
            for i, tag, tensors in plan.batch.assign(trace.data):
                row = plan.rows[plan.batch_row0 + i]
                row.tag, row.dtype = tag, jnp.dtype(tensors[0].dtype).name
                row.shape = tuple(tensors[0].shape) if len(tensors) == 1 else None
                out[plan.batch_row0 + i] = _merged([jnp.asarray(t) for t in tensors])
        for i, tensors in trace.outputs.items():
            row = plan.rows[plan.act_rows[i]]
            row.dtype, row.shape = jnp.dtype(tensors[0].dtype).name, tuple(tensors[0].shape)
            out[plan.act_rows[i]] = _merged(tensors)
        if jnp.dtype(loss.dtype).name in metadata.DTYPE_LIMITS:
            row = plan.rows[plan.loss_row]
            row.dtype, row.shape = jnp.dtype(loss.dtype).name, tuple(loss.shape)
            out[plan.loss_row] = jax_stats.tensor_stats(loss, "loss")
        return out

    def _wrap_apply(self, stateless_apply):
        @functools.wraps(stateless_apply)
        def wrapped(optimizer_variables, grads, trainable_variables):
            trace = self._trace
            if trace is None or trace.apply_done:
                return stateless_apply(optimizer_variables, grads, trainable_variables)
            trace.apply_done = True
            return self._recorded_apply(stateless_apply, trace, optimizer_variables, grads, trainable_variables)

        return wrapped

    def _recorded_apply(self, apply, trace: _Trace, ov, grads, tv):
        """The optimizer's update, with the gradients' and weights' records kept
        in ``trace``; held back where a gradient is not finite and a replay may
        need the weights the step used (a LossScaleOptimizer skips such steps itself)."""
        plan = self.plan
        if self._scale_index is not None:
            trace.scale = ov[self._scale_index]
        ok = []
        for j, r in plan.grad_rows.items():
            g = grads[self._tv_index[id(plan.variables[j])]]
            if g is None:
                continue
            if trace.scale is not None:  # the gradients the update uses
                g = g / trace.scale.astype(g.dtype)
            trace.grads[r] = jax_stats.tensor_stats(g, plan.rows[r].tag)
            ok.append(jnp.all(trace.grads[r][0][1:4] == 0))
        finite = jnp.all(jnp.stack(ok)) if ok else jnp.asarray(True)
        if self.replay and not self._lso:
            new_tv, new_ov = lax.cond(finite, lambda: tuple(map(list, apply(ov, grads, tv))),
                                      lambda: (list(tv), list(ov)))
        else:
            new_tv, new_ov = apply(ov, grads, tv)
        trace.due = (trace.step % self.weights_every_n_steps == 0) | ~finite
        if self.weights or self.update_ratios:
            trace.weights, trace.norms = lax.cond(
                trace.due, functools.partial(self._weights_and_norms, tv, new_tv),
                functools.partial(self._no_weights, tv))
        return new_tv, new_ov

    def _weights_and_norms(self, old: list, new: list):
        """The weights' records before the update, and each variable's
        ||w_new - w_old||^2 and ||w_old||^2 (in the plan's variable order)."""
        index = [self._tv_index[id(v)] for v in self.plan.variables]
        weights = [_widened(jax_stats.tensor_stats(old[k])) for k in index] if self.weights else []
        norms = jnp.stack([jnp.stack([jax_stats.sq_norm(new[k] - old[k]), jax_stats.sq_norm(old[k])]).astype(
            _VALUE_DTYPE()) for k in index])
        return weights, norms

    def _no_weights(self, old: list):
        zero = (jnp.zeros(len(jax_stats.COUNT_FIELDS), jnp.int32), jnp.zeros(len(jax_stats.VALUE_FIELDS), _VALUE_DTYPE()))
        return [zero] * (len(self.plan.variables) if self.weights else 0), jnp.zeros((len(self.plan.variables), 2),
                                                                                        _VALUE_DTYPE())

    def _step_outputs(self, trace: _Trace, seeds: list) -> dict[str, Any]:
        """Every record of the step as two stacked arrays, and the numbers beside them."""
        plan = self.plan
        found = {**trace.forward, **trace.grads}
        for j, rec in enumerate(trace.weights):
            found[plan.weight_row0 + j] = rec
        present = np.zeros(len(plan.rows), bool)
        present[list(found)] = True
        for r in found:
            plan.rows[r].present = True
        zero_c = jnp.zeros(len(jax_stats.COUNT_FIELDS), jnp.int32)
        zero_v = jnp.zeros(len(jax_stats.VALUE_FIELDS), _VALUE_DTYPE())
        counts = jnp.stack([found[r][0] if r in found else zero_c for r in range(len(plan.rows))])
        values = jnp.stack([_widened(found[r])[1] if r in found else zero_v for r in range(len(plan.rows))])
        return {"counts": counts, "values": values, "present": jnp.asarray(present), "due": trace.due,
                "norms": trace.norms, "scale": trace.scale, "seeds": seeds}

    # ------------------------------------------------------------ host side

    def _drain(self) -> list[_host.StepResult]:
        out = []
        self._kept = {}
        for step, o, data in self._queue:
            o = jax.device_get(o)
            out.append(_host.StepResult(
                step=step, stats=jax_stats.to_records(o["counts"], o["values"]), present=np.asarray(o["present"]),
                weights_due=bool(o["due"]), norms=None if o["norms"] is None else np.asarray(o["norms"], np.float64),
                loss_scale=None if o["scale"] is None else float(o["scale"])))
            self._kept[step] = (data, o["seeds"])
        self._queue.clear()
        return out

    def _kept_batch(self, step: int) -> Any:
        kept = self._kept.get(step)
        return None if kept is None else jax.device_get(kept[0])

    def _replay_step(self, result: _host.StepResult) -> dict[str, Any]:
        """Evaluates the model's own ``train_step`` on the step's batch, from the
        state it began with, equation by equation (``jax_replay``)."""
        data, seeds = self._kept[result.step]
        st = self.model._jax_state  # noqa: SLF001 - the state fit holds between steps
        ntv = list(st["non_trainable_variables"])
        for i, seed in zip(self._seed_index, seeds):
            ntv[i] = seed  # the step's own random draws (dropout masks)
        state = (list(st["trainable_variables"]), ntv, list(st["optimizer_variables"]), list(st["metrics_variables"]))
        return jax_replay.replay(self._train_step, state, data, result.step)


def _VALUE_DTYPE():  # noqa: N802 - a dtype, decided when traced
    return jnp.float64 if jax_stats.x64() else jnp.float32


def _widened(rec: tuple) -> tuple:
    return rec[0], rec[1].astype(_VALUE_DTYPE())
