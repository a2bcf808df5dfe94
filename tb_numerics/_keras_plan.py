"""The rows the Keras callback's training step computes, planned before training, on every backend.

One row per record the step computes, in execution order: the batch (model
inputs, targets, sample weights; see ``_keras_batch``), each layer's
outputs (a nested model's and a user-written layer's layers too: ``recorded_layers``), the loss, the
state the forward pass updated (the non-trainable float variables:
BatchNormalization's moving statistics), each gradient in backward order, then each weight. The rows before the
weights' are computed on every step; the weights' only on the steps that
record them. A row's tag, dtype and shape
are what its metadata will say; those known only when the step runs (a
layer's output dtype, the batch's keys) are filled in then.

Keras and numpy only: no backend is imported here, so that the TensorFlow,
JAX and PyTorch callbacks plan the same rows, and one model trained on each
gives the same report.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras
import numpy as np

from tb_numerics import _keras_batch, analysis, metadata

__all__ = ["Row", "RowPlan", "float_tensors", "recorded_layers"]


@dataclasses.dataclass
class Row:
    """One record computed in the step: its tag and what the metadata says."""

    tag: str
    role: str
    dtype: str = "float32"
    shape: tuple[int | None, ...] | None = None
    op_type: str = ""
    description: str = ""
    activation: str = ""  # the layer's activation function, or the loss function's name
    compute_dtype: str = ""  # the dtype the layer computes in (float16 under mixed_float16)
    present: bool = False  # whether the step computes it: set when the step is traced (or run)


class RowPlan:
    """The step's rows, and where each part of the step lands among them.

    Args:
      model: the Keras model ``fit`` trains (built).
      inputs, activations, gradients, weights: which rows to plan.

    Attributes:
      rows: every row, in execution order.
      batch: how the batch's rows are assigned (``_keras_batch.BatchPlan``);
        ``batch_rows`` of them (0 without ``inputs``) start at ``batch_row0``.
      layers: the layers whose outputs are recorded (``recorded_layers``),
        in the order their outputs are complete; act_rows: layer index ->
        its output row.
      loss_row: the loss's row.
      forward_state: the float variables the forward pass updates
        (``_forward_state``) in layer order: what a step held back puts back.
      states: ``forward_state`` with ``weights``, else none; their records
        (``state_rows``) are computed every step and written with the weights' or where not
        finite: a forward pass can make a moving statistic non-finite while
        its output, the loss and the gradients stay finite (training
        normalises by the batch's own statistics), and only inference shows it.
      variables: the trainable variables in layer order (those of no
        recorded layer last); ``var_layer`` their layers' indices (-1: none).
      grad_rows: variable index -> its gradient's row.
      weight_row0: the first weight row: rows before it are computed every step.
      layer_names: the recorded layers' names (a layer inside another
        as ``outer/layer``).
    """

    def __init__(self, model: keras.Model, *, inputs: bool, activations: bool, gradients: bool, weights: bool):
        named = recorded_layers(model)
        self.layers = layers = [layer for _, layer in named]
        owner = _layer_of_variables(layers)
        self.layer_names = [name for name, _ in named]
        self.rows: list[Row] = []
        self.batch = _keras_batch.BatchPlan.for_model(model)
        self.batch_row0 = len(self.rows)
        if inputs:  # first: the input phase comes before the layers'
            self.rows += [Row(tag, "input") for tag in self.batch.tags()]
        self.batch_rows = len(self.rows) - self.batch_row0
        self.act_rows: dict[int, int] = {}
        if activations:
            for i, layer in enumerate(layers):
                self.act_rows[i] = len(self.rows)
                self.rows.append(Row("%s/output" % self.layer_names[i], "activation", op_type=type(layer).__name__,
                                     activation=_function_name(getattr(layer, "activation", None)),
                                     compute_dtype=_compute_dtype(layer)))
        self.loss_row = len(self.rows)
        self.rows.append(Row("loss", "loss", activation=_function_name(getattr(model, "loss", None))))
        every_state = sorted(_forward_state(model), key=lambda vt: owner.get(id(vt[0]), len(layers)))
        self.forward_state = [v for v, _ in every_state]
        states = every_state if weights else []
        self.states = [v for v, _ in states]
        self.state_rows = range(len(self.rows), len(self.rows) + len(states))
        self.rows += [Row(v.path, "weight", _dtype(v), tuple(v.shape), present=True,
                          description="non-trainable variable of a %s, %s" % (kind, metadata.FORWARD_STATE))
                      for v, kind in states]
        self.variables = sorted(model.trainable_variables, key=lambda v: owner.get(id(v), len(layers)))
        self.var_layer = [owner.get(id(v), -1) for v in self.variables]
        self.grad_rows: dict[int, int] = {}
        if gradients:
            self._plan_gradients(layers)
        self.weight_row0 = len(self.rows)
        if weights:
            self.rows += [Row(v.path, "weight", _dtype(v), tuple(v.shape), present=True) for v in self.variables]
        self._neginf_ok: tuple[tuple, np.ndarray] | None = None

    def _plan_gradients(self, layers: list) -> None:
        """Gradients in backward order (the last layer's first), as
        backpropagation computes them and as log_gradients records them: the
        first non-finite gradient of a step is then the one where it was born."""
        for j in reversed(range(len(self.variables))):
            v = self.variables[j]
            self.grad_rows[j] = len(self.rows)
            # A float32 master weight's gradient is computed in its layer's dtype.
            layer = layers[self.var_layer[j]] if self.var_layer[j] >= 0 else None
            # The tag log_gradients gives a Keras variable's gradient.
            self.rows.append(Row("gradients/" + v.path, "gradient", _dtype(v), tuple(v.shape),
                                 present=True, compute_dtype=_compute_dtype(layer)))

    @property
    def num_weight_rows(self) -> int:
        """How many weight rows the step computes on the steps that record them."""
        return len(self.rows) - self.weight_row0

    def variables_of_layer(self, i: int) -> list[int]:
        """The indices (in ``variables``) of top-level layer ``i``'s trainable variables."""
        return [j for j, layer in enumerate(self.var_layer) if layer == i]

    def neginf_ok(self, safe_range: analysis.SafeRange) -> np.ndarray:
        """Per row: whether the user allowlisted its -Inf (``allow_neginf``).

        Rows' tags are final once the step was traced; kept while they stay.
        """
        tags = tuple(r.tag for r in self.rows)
        if self._neginf_ok is None or self._neginf_ok[0] != tags:
            ok = np.array([analysis.neginf_intended(t, metadata.TensorInfo(), safe_range) for t in tags], bool)
            self._neginf_ok = (tags, ok)
        return self._neginf_ok[1]


def float_tensors(structure: Any) -> list[Any]:
    """The dense float tensors of a nested structure (a layer's outputs), of whichever backend runs."""
    return [t for t in keras.tree.flatten(structure) if _keras_batch.is_float_tensor(t)]


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


def _compute_dtype(layer: Any) -> str:
    """The dtype a layer computes in ("" where unknown)."""
    dtype = getattr(layer, "compute_dtype", None)
    return str(dtype) if dtype else ""


def _forward_state(model: keras.Model) -> list[tuple[Any, str]]:
    """The float variables a forward pass may update: each trainable layer's
    non-trainable ones (BatchNormalization's moving statistics). A frozen
    layer's variables are non-trainable too, but stay as they are."""
    out: dict[int, tuple[Any, str]] = {}
    for layer in model._flatten_layers(include_self=True):  # noqa: SLF001 - every nested layer, once
        if layer.trainable:
            for v in getattr(layer, "_non_trainable_variables", []):  # noqa: SLF001 - made non-trainable
                if not v.trainable and _dtype(v) in metadata.DTYPE_LIMITS:  # one a user made trainable is a weight
                    out.setdefault(id(v), (v, type(layer).__name__))
    return list(out.values())


def _dtype(variable: Any) -> str:
    """A variable's dtype by name, as every backend spells it."""
    return keras.backend.standardize_dtype(variable.dtype)


def recorded_layers(model: keras.Model) -> list[tuple[str, Any]]:
    """The layers whose outputs the callback records, with their names:
    the model's own layers, and inside each layer that holds layers it calls
    itself (``_opened_layers``: a pretrained base in a ``Sequential``, a
    user-written Transformer block) those layers first, named
    ``outer/layer``, then the outer layer itself (its ``call`` may compute
    more than its last layer). So a NaN born inside is first seen at the
    layer that made it, as in a model built flat. A layer reached twice (a
    shared one) is recorded once, where first reached."""
    out: list[tuple[str, Any]] = []
    seen: set[int] = set()

    def add(layers: list, prefix: str) -> None:
        for layer in layers:
            if id(layer) in seen:
                continue
            seen.add(id(layer))
            add(_opened_layers(layer), prefix + layer.name + "/")
            out.append((prefix + layer.name, layer))

    add(list(model.layers), "")
    return out


def _opened_layers(layer: Any) -> list:
    """The layers recorded inside ``layer``: a nested model's, and those a
    user-written layer holds (its ``call`` is the user's: what it calls is
    the user's model). A Keras layer's own (an RNN's cell, called in a
    loop; MultiHeadAttention's projections) are its implementation, not
    opened."""
    if isinstance(layer, keras.Model):
        return list(layer.layers)
    if (getattr(type(layer).call, "__module__", None) or "keras.").startswith("keras."):
        return []
    # Keras' own list of a layer's tracked sublayers, as Model.layers reads it.
    return list(layer._flatten_layers(include_self=False, recursive=False))  # noqa: SLF001


def _layer_of_variables(layers: list) -> dict[int, int]:
    """id(variable) -> index of the first of ``layers`` that owns it (a
    nested model's layers come before the model)."""
    owner: dict[int, int] = {}
    for i, layer in enumerate(layers):
        for v in layer.weights:
            owner.setdefault(id(v), i)
    return owner
