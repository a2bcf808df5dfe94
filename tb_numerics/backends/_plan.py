"""The rows a training step records, in execution order, for any Keras backend.

The same tags, roles and order as the TensorFlow callback, so that one model
trained on TensorFlow, JAX or PyTorch gives the same report: the batch
(``input``, ``target``, ``sample_weight``), each top-level layer's output,
the loss, each gradient in backward order (the last layer's first), then the
weights. Keras only: no backend is imported here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras

from tb_numerics import _keras_batch

__all__ = ["Plan", "Row", "function_name", "plan_rows"]


@dataclasses.dataclass
class Row:
    """One record computed in the step: its tag and what its metadata says."""

    tag: str
    role: str
    dtype: str = "float32"
    shape: tuple[int | None, ...] | None = None
    op_type: str = ""
    activation: str = ""  # the layer's activation function, or the loss function's name
    compute_dtype: str = ""  # the dtype the layer computes in (float16 under mixed_float16)
    present: bool = False  # whether the step computed it (set as the step runs)


@dataclasses.dataclass
class Plan:
    """Every row of a step, and where each kind of row starts."""

    rows: list[Row]
    batch: _keras_batch.BatchPlan
    batch_row0: int  # the batch's rows start here (when recorded)
    act_rows: dict[int, int]  # layer index -> its output's row
    loss_row: int
    variables: list[Any]  # trainable variables in layer order
    var_layer: list[int]  # per variable: its top-level layer's index, -1 if none
    grad_rows: dict[int, int]  # variable index -> its gradient's row
    weight_row0: int  # the weights' rows (recorded on some steps only) start here
    layer_names: list[str]


def function_name(fn: Any) -> str:
    """The name of a Keras activation or loss: a string, a function, or a
    Loss object ("" where none is known)."""
    if fn is None:
        return ""
    if isinstance(fn, str):
        return fn
    if isinstance(fn, (list, tuple)):
        return ",".join(filter(None, (function_name(f) for f in fn)))
    if isinstance(fn, dict):
        return ",".join(filter(None, (function_name(f) for f in fn.values())))
    return str(getattr(fn, "name", None) or getattr(fn, "__name__", None) or type(fn).__name__)


def _compute_dtype(layer: Any) -> str:
    dtype = getattr(layer, "compute_dtype", None)
    return str(dtype) if dtype else ""


def plan_rows(model: keras.Model, *, inputs: bool, activations: bool, gradients: bool, weights: bool) -> Plan:
    """The rows of ``model``'s training step, as the TensorFlow callback plans them.

    Args:
      model: a built Keras model.
      inputs, activations, gradients, weights: which rows to record.
    """
    layers = list(model.layers)
    owner: dict[int, int] = {}
    for i, layer in enumerate(layers):
        for v in layer.weights:
            owner.setdefault(id(v), i)
    rows: list[Row] = []
    batch = _keras_batch.BatchPlan.for_model(model)
    batch_row0 = len(rows)
    if inputs:
        rows += [Row(tag, "input") for tag in batch.tags()]
    act_rows = {}
    if activations:
        for i, layer in enumerate(layers):
            act_rows[i] = len(rows)
            rows.append(Row("%s/output" % layer.name, "activation", op_type=type(layer).__name__,
                            activation=function_name(getattr(layer, "activation", None)),
                            compute_dtype=_compute_dtype(layer)))
    loss_row = len(rows)
    rows.append(Row("loss", "loss", activation=function_name(getattr(model, "loss", None))))
    variables = sorted(model.trainable_variables, key=lambda v: owner.get(id(v), len(layers)))
    var_layer = [owner.get(id(v), -1) for v in variables]
    grad_rows: dict[int, int] = {}
    if gradients:
        for j in reversed(range(len(variables))):
            v = variables[j]
            grad_rows[j] = len(rows)
            layer = layers[var_layer[j]] if var_layer[j] >= 0 else None
            rows.append(Row("gradients/" + v.path, "gradient", _dtype(v), tuple(v.shape), present=True,
                            compute_dtype=_compute_dtype(layer)))
    weight_row0 = len(rows)
    if weights:
        rows += [Row(v.path, "weight", _dtype(v), tuple(v.shape), present=True) for v in variables]
    return Plan(rows, batch, batch_row0, act_rows, loss_row, variables, var_layer, grad_rows, weight_row0,
                [layer.name for layer in layers])


def _dtype(v: Any) -> str:
    return keras.backend.standardize_dtype(v.dtype)
