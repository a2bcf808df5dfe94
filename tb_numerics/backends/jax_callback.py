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
* the optimizer's ``stateless_apply``, for the gradients' records and the
  held-back update of a step whose loss or gradients are not finite (so a
  replay sees the weights that step used, as a LossScaleOptimizer does; the
  loss as Keras' trainer's ``jax.value_and_grad`` returns it, seen through
  ``_JaxSeeingTheLoss``);
  the weights before the update and the update ratios are taken between
  steps, on their steps only (``_WeightsBetweenSteps``), where such an
  update is held back, else there too;
* the model's ``train_step``, which takes that entry back out of the state and
  returns every record of the step beside the logs, and ``_make_function``,
  so that ``fit``'s loop hands each step's records (still on the device) and
  its batch to the callback.

All of it is traced into the one jitted step: no host round trip per
tensor, under ``jit_compile=True`` (JAX's default) or not. The host copies
one small array per step in ``on_train_batch_end``; the host side every
backend shares (``_keras_host``) writes it.
A custom ``train_step`` is recorded where it calls these same methods; a
custom ``compute_loss_and_updates`` (Keras' guide's hands out ``(y_pred,
ntv)``) where its auxiliary output holds the non-trainable variables' list.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import jax
import jax.numpy as jnp
import keras
import numpy as np
from jax import lax
from jax.extend import core as _jax_core

from keras.src.backend.jax import trainer as _jax_trainer

from tb_numerics import metadata
from tb_numerics._keras_host import NumericsCallbackBase, Step, StepValues, step_counter
from tb_numerics.backends import jax_replay, jax_stats

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
        self.forward_trace = None  # JAX's trace the forward pass runs in (its layers' outputs may leave it)
        self.apply_done = False
        self.loss = None  # the loss Keras' train_step differentiated, as value_and_grad returned it


class _JaxSeeingTheLoss:
    """``jax`` as Keras' JAX trainer sees it while a step traces: its
    ``value_and_grad`` hands the loss it returns to the step's trace as well,
    so that the update can be held back on a non-finite loss whose gradients
    are finite (a squared error of 1e20 overflows; Adafactor's factored
    squares of its finite gradients then make the weights NaN), as on the
    other backends. The trainer passes the loss nowhere the update sees."""

    def __init__(self, trace: _Trace) -> None:
        self._trace = trace
        self._thread = threading.get_ident()  # another thread's trace is not this step's

    def __getattr__(self, name: str) -> Any:
        return getattr(jax, name)

    def value_and_grad(self, fun, *args, **kwargs):
        differentiate, trace = jax.value_and_grad(fun, *args, **kwargs), self._trace
        has_aux = kwargs.get("has_aux", False)

        def call(*a, **k):
            out = differentiate(*a, **k)
            if trace.loss is None and threading.get_ident() == self._thread:
                trace.loss = out[0][0] if has_aux else out[0]
            return out

        return call


def _float_leaves(structure: Any) -> list:
    return [t for t in jax.tree_util.tree_leaves(structure)
            if hasattr(t, "dtype") and str(t.dtype) in metadata.DTYPE_LIMITS]  # a random key's is no numpy dtype


def _merged(tensors: list):
    """All of ``tensors`` as one flat array (a layer's outputs, or its repeated calls)."""
    if len(tensors) == 1:
        return tensors[0]
    dtype = jnp.result_type(*tensors)
    return jnp.concatenate([jnp.ravel(t).astype(dtype) for t in tensors])


def _records(tensors: dict[int, tuple[Any, str]]) -> dict[int, tuple]:
    """row -> (counts, values) of row -> (tensor, name): one ``many_stats`` for them all."""
    rows = sorted(tensors)
    counts, values = jax_stats.many_stats([tensors[r][0] for r in rows], [tensors[r][1] for r in rows])
    return {r: (counts[k], values[k]) for k, r in enumerate(rows)}


class _WeightsBetweenSteps:
    """The weights' records and update norms of a step, taken between steps
    by two small jitted functions, around the steps that record them.

    Inside the jitted step they cost every step, not only their own: the
    ``lax.cond`` that computed them read the old weights beside the new ones,
    and XLA then copied every weight and kept the update from happening in
    place (about 25 % of bench/overhead.py's step on JAX, with the statistics
    themselves reduced to one row). Between steps they cost their steps only:
    the records and a copy of the weights before, the norms after.

    A step whose gradients are not finite records its weights too; this is
    for the callbacks whose update of such a step is held back (the replay's,
    a LossScaleOptimizer's), so the weights it used are the ones left after it.

    Args:
      index: each variable's position in the trainable variables, in the plan's order.
      paths: their paths, for errors.
      weights: whether to record the weights (else only the norms).
    """

    def __init__(self, index: list[int], paths: list[str], weights: bool):
        self._index, self._paths, self._weights = index, paths, weights
        self._before = jax.jit(self._records_and_copy)
        self._after = jax.jit(self._norms)

    def _records_and_copy(self, tv: list):
        old = [tv[k] for k in self._index]
        if self._weights:
            counts, values = jax_stats.many_stats(old, self._paths)
        else:
            counts, values = jax_stats.many_stats([])
        return counts, values, [jnp.copy(w) for w in old]

    def _norms(self, old: list, tv: list):
        return jnp.stack([jnp.stack([jax_stats.sq_norm(tv[k] - w), jax_stats.sq_norm(w)]) for k, w in
                          zip(self._index, old)]).astype(jax_stats.value_dtype())

    def before(self, tv: list) -> tuple:
        """Before a step that records its weights, from the weights it begins with."""
        return self._before(list(tv))

    def after(self, before: tuple, tv: list) -> tuple:
        """After it, from the weights it left: (counts, values, norms), on the device."""
        counts, values, old = before
        return counts, values, self._after(old, list(tv))

    def held(self, tv: list) -> tuple:
        """After a step whose update was held back: its weights are ``tv``."""
        return self.after(self.before(tv), tv)


class JaxNumericsCallback(NumericsCallbackBase):
    """``NumericsCallback`` for Keras' JAX backend (the options: ``_keras_host.NumericsCallbackBase``)."""

    backend = "jax"
    keeps_step = True

    def _begin(self, model: keras.Model) -> None:
        self._patched = self._take_up(model, None)

    def _take_up(self, model: keras.Model, train_function: Any) -> Any:
        """The step's state and wrappers, for this fit, around the jitted
        train function built here (``train_function`` None: the first fit),
        or ``train_function``, the one the last fit of the model built
        (compiled for this plan and these wrappers)."""
        opt = model.optimizer
        self._trace: _Trace | None = None
        self._queue: list[tuple[int, dict, Any, tuple | None]] = []
        self._kept: dict[int, tuple[Any, list]] = {}
        self._step0 = int(np.asarray(keras.ops.convert_to_numpy(step_counter(opt))))
        self._calls = 0
        self._n_ntv = len(model.non_trainable_variables)
        self._seed_index = [i for i, v in enumerate(model.non_trainable_variables) if v.name == _SEED_STATE]
        ntv_index = {id(v): i for i, v in enumerate(model.non_trainable_variables)}
        self._state_index = [ntv_index[id(v)] for v in self.plan.states]
        self._tv_index = {id(v): k for k, v in enumerate(model.trainable_variables)}
        self._scale_index = next((k for k, v in enumerate(opt.variables) if v is getattr(opt, "dynamic_scale", None)),
                                 None) if self._lso else None
        self._train_step = model.train_step  # the model's own, for the replay
        self._between = None
        if (self.weights or self.update_ratios) and (self.replay or self._lso) and int(
                getattr(model, "steps_per_execution", 1) or 1) == 1:
            self._between = _WeightsBetweenSteps([self._tv_index[id(v)] for v in self.plan.variables],
                                                 [v.path for v in self.plan.variables], self.weights)
        self._last_tv = None  # the weights the last step left
        patches = self._patches
        patches.set(model, "train_step", self._wrap_train_step(model.train_step))
        patches.set(model, "compute_loss_and_updates", self._wrap_clu(model.compute_loss_and_updates))
        patches.set(opt, "stateless_apply", self._wrap_apply(opt.stateless_apply))
        if self.activations:
            for i, layer in enumerate(self.plan.layers):
                patches.set(layer, "call", self._wrap_call(i, layer.call))
        old_function = model.train_function
        patches.on_restore(lambda: setattr(model, "train_function", old_function))
        if train_function is not None:
            model.train_function = train_function
            return train_function
        make_function = model._make_function  # noqa: SLF001 - where fit's loop calls the jitted step
        model._make_function = lambda step_function, **kw: make_function(self._collector(step_function), **kw)
        try:
            model.make_train_function(force=True)
        finally:
            del model._make_function
        return model.train_function

    # ------------------------------------------------------------ inside the step

    def _collector(self, step_function):
        """Between fit's loop and the jitted step: hands the step its number and
        keeps its records (on the device) and its batch for the host side."""

        @functools.wraps(step_function)
        def run(state, data):
            step = self._step0 + self._calls
            self._calls += 1
            weights_due = self._between is not None and step % self.weights_every_n_steps == 0
            before = self._between.before(state[0]) if weights_due else None
            logs, state = step_function(state, (data, np.int32(step)))
            logs = dict(logs)
            self._last_tv = state[0]
            weights = self._between.after(before, state[0]) if weights_due else None
            self._queue.append((step, logs.pop(_KEY), data, weights))
            return logs, state

        return run

    def _wrap_train_step(self, train_step):
        @functools.wraps(train_step)
        def wrapped(state, data_and_step):
            data, step = data_and_step
            seeds = [state[1][i] for i in self._seed_index]  # as the step begins: its random draws
            self._trace = trace = _Trace(data)
            trace.step = step
            seen_before, _jax_trainer.jax = _jax_trainer.jax, _JaxSeeingTheLoss(trace)
            try:
                logs, state = train_step(state, data)
            finally:
                self._trace = None
                _jax_trainer.jax = seen_before
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
            trace = self._trace
            # Not a call inside a loop or a checkpoint of the forward pass
            # (keras.ops.scan in a layer): its tracers cannot leave that trace.
            if (trace is not None and not trace.forward_done
                    and trace.forward_trace == _jax_core.get_opaque_trace_state()):
                trace.outputs.setdefault(index, []).extend(_float_leaves(out))
            return out

        return wrapped

    def _wrap_clu(self, compute_loss_and_updates):
        @functools.wraps(compute_loss_and_updates)
        def wrapped(*args, **kwargs):
            trace = self._trace
            if trace is not None and not trace.forward_done:
                trace.forward_trace = _jax_core.get_opaque_trace_state()
            loss, aux = compute_loss_and_updates(*args, **kwargs)
            if trace is None or trace.forward_done or not kwargs.get("training", False):
                return loss, aux
            at = self._ntv_at(aux)
            if at is None:  # no list of the non-trainable variables to hand the records out in
                return loss, aux
            trace.forward_done = True
            keras_own = at == 2 and len(aux) == 4  # (unscaled loss, y_pred, ntv, metrics' variables)
            forward = self._forward_records(trace, aux[0] if keras_own else loss, aux[at])
            out = list(aux)
            out[at] = list(aux[at]) + [forward]
            return loss, type(aux)(out)

        return wrapped

    def _ntv_at(self, aux: Any) -> int | None:
        """Where the auxiliary output of ``compute_loss_and_updates`` holds the non-trainable
        variables' new values: Keras' own hands out (unscaled loss, y_pred, ntv, metrics'
        variables), a custom one as Keras' guide writes it (y_pred, ntv); None where no entry
        is a list of their shapes."""
        if not isinstance(aux, (tuple, list)):
            return None
        shapes = [tuple(v.shape) for v in self.model.non_trainable_variables]
        found = [k for k, item in enumerate(aux) if isinstance(item, (tuple, list)) and len(item) == len(shapes)
                 and all(tuple(getattr(t, "shape", ())) == s for t, s in zip(item, shapes))]
        if len(aux) == 4 and 2 in found:
            return 2
        return found[-1] if found else None

    def _forward_records(self, trace: _Trace, loss, ntv: list) -> dict[int, tuple]:
        """row -> record of the batch, each layer's outputs, the loss and the
        state the forward pass left (``ntv``, the non-trainable variables)."""
        plan, tensors = self.plan, {}
        if self.inputs:
            for i, tag, ts in plan.batch.assign(trace.data):
                row = plan.rows[plan.batch_row0 + i]
                row.tag, row.dtype = tag, jnp.dtype(ts[0].dtype).name
                row.shape = tuple(ts[0].shape) if len(ts) == 1 else None
                tensors[plan.batch_row0 + i] = (_merged([jnp.asarray(t) for t in ts]), tag)
        for i, ts in trace.outputs.items():
            row = plan.rows[plan.act_rows[i]]
            row.dtype, row.shape = jnp.dtype(ts[0].dtype).name, tuple(ts[0].shape)
            tensors[plan.act_rows[i]] = (_merged(ts), row.tag)
        if jnp.dtype(loss.dtype).name in metadata.DTYPE_LIMITS:
            row = plan.rows[plan.loss_row]
            row.dtype, row.shape = jnp.dtype(loss.dtype).name, tuple(loss.shape)
            tensors[plan.loss_row] = (loss, "loss")
        for r, k in zip(plan.state_rows, self._state_index):
            tensors[r] = (ntv[k], plan.rows[r].tag)
        return _records(tensors)

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
        tensors = {}
        for j, r in plan.grad_rows.items():
            g = grads[self._tv_index[id(plan.variables[j])]]
            if g is None:
                continue
            if trace.scale is not None:  # the gradients the update uses
                g = g / trace.scale.astype(g.dtype)
            tensors[r] = (g, plan.rows[r].tag)
        trace.grads = _records(tensors)
        counts = [c[1:4] for c, _ in trace.grads.values()]  # NaN, +Inf, -Inf
        if trace.loss is not None:
            counts.append(jax_stats.tensor_stats(trace.loss, "loss")[0][1:4])
        finite = jnp.all(jnp.stack(counts) == 0) if counts else jnp.asarray(True)
        if self.replay and not self._lso:
            new_tv, new_ov = lax.cond(finite, lambda: tuple(map(list, apply(ov, grads, tv))),
                                      lambda: (list(tv), list(ov)))
        else:
            new_tv, new_ov = apply(ov, grads, tv)
        trace.due = (trace.step % self.weights_every_n_steps == 0) | ~finite
        if (self.weights or self.update_ratios) and self._between is None:
            trace.weights, trace.norms = lax.cond(
                trace.due, functools.partial(self._weights_and_norms, tv, new_tv),
                functools.partial(self._no_weights, tv))
        return new_tv, new_ov

    def _weights_and_norms(self, old: list, new: list):
        """The weights' records before the update, and each variable's
        ||w_new - w_old||^2 and ||w_old||^2 (in the plan's variable order)."""
        index = [self._tv_index[id(v)] for v in self.plan.variables]
        weights = []
        if self.weights:
            found = _records({j: (old[k], v.path) for j, (k, v) in enumerate(zip(index, self.plan.variables))})
            weights = [found[j] for j in range(len(index))]
        norms = jnp.stack([jnp.stack([jax_stats.sq_norm(new[k] - old[k]), jax_stats.sq_norm(old[k])]).astype(
            jax_stats.value_dtype()) for k in index])
        return weights, norms

    def _no_weights(self, old: list):
        zero = (jnp.zeros(len(jax_stats.COUNT_FIELDS), jnp.int32),
                jnp.zeros(len(jax_stats.VALUE_FIELDS), jax_stats.value_dtype()))
        return [zero] * (len(self.plan.variables) if self.weights else 0), jnp.zeros((len(self.plan.variables), 2),
                                                                                        jax_stats.value_dtype())

    def _step_outputs(self, trace: _Trace, seeds: list) -> dict[str, Any]:
        """Every record of the step as two stacked arrays, and the numbers beside them."""
        plan = self.plan
        found = {**trace.forward, **trace.grads}
        for j, rec in enumerate(trace.weights):
            found[plan.weight_row0 + j] = rec
        for r, row in enumerate(plan.rows[: plan.weight_row0]):
            row.present = r in found  # a None gradient has no record
        zero_c = jnp.zeros(len(jax_stats.COUNT_FIELDS), jnp.int32)
        zero_v = jnp.zeros(len(jax_stats.VALUE_FIELDS), jax_stats.value_dtype())
        counts = jnp.stack([found[r][0] if r in found else zero_c for r in range(len(plan.rows))])
        values = jnp.stack([found[r][1] if r in found else zero_v for r in range(len(plan.rows))])
        return {"counts": counts, "values": values, "due": trace.due, "norms": trace.norms, "scale": trace.scale,
                "seeds": seeds}

    # ------------------------------------------------------------ host side

    def _new_steps(self) -> list[Step]:
        out = []
        self._kept = {}
        for step, o, data, weights in self._queue:
            o = jax.device_get(o)
            stats = jax_stats.to_records(o["counts"], o["values"])
            norms = np.zeros((0, 2)) if o["norms"] is None else np.asarray(o["norms"], np.float64)
            if self._between is not None and bool(o["due"]):
                if weights is None:  # not a weights step: a bad one, whose update was held back
                    weights = self._between.held(self._last_tv)
                norms = self._weights_between(stats, weights)
            values = StepValues(call=step, step=step, loss_scale=1.0 if o["scale"] is None else float(o["scale"]),
                                weights_due=bool(o["due"]), update_norms=norms)
            out.append((stats, values))
            self._kept[step] = (data, o["seeds"])
        self._queue.clear()
        return out

    def _weights_between(self, stats: np.ndarray, weights: tuple) -> np.ndarray:
        """The weights' records taken between steps (``_WeightsBetweenSteps``)
        into ``stats``; their update norms."""
        counts, values, norms = jax.device_get(weights)
        if self.weights:
            w0 = self.plan.weight_row0
            stats[w0:w0 + len(self.plan.variables)] = jax_stats.to_records(counts, values)
        return np.asarray(norms, np.float64)

    def _kept_batches(self, step: int) -> list[Any]:
        kept = self._kept.get(step)
        return [] if kept is None else [jax.device_get(kept[0])]

    def _replay_at(self, step: int) -> dict[str, Any]:
        """Evaluates the model's own ``train_step`` on the step's batch, from the
        state it began with, equation by equation (``jax_replay``)."""
        data, seeds = self._kept[step]
        st = self.model._jax_state  # noqa: SLF001 - the state fit holds between steps
        ntv = list(st["non_trainable_variables"])
        for i, seed in zip(self._seed_index, seeds):
            ntv[i] = seed  # the step's own random draws (dropout masks)
        state = (list(st["trainable_variables"]), ntv, list(st["optimizer_variables"]), list(st["metrics_variables"]))
        return jax_replay.replay(self._train_step, state, data, step)
