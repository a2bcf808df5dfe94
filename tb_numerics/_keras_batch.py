"""The batch's records for the Keras callback: the model's inputs, the targets, the sample weights.

A NaN that arrives with the batch is no layer's fault: recorded before the
layers (role and phase ``input``), it is the step's first anomaly, and a
batch far out of its usual range (a corrupt record holding 1e38) is the
likely cause of an overflow further on.

Rows, planned before training: one per float input of the model (one per
output for the targets) where the model says how many (a functional or
Sequential model), else one; one for the sample weights. Tags name the data
as ``fit`` received it: ``input`` for a single tensor, ``input/<key>`` or
``input/<index>`` in a dict or a tuple; ``target`` and ``sample_weight``
alike. A batch with more float tensors of a kind than the model has rows
for is recorded as one merged row under the bare name.

At the first step whose records went bad, ``bad_features`` counts the bad
values per feature (the last axis) and per example of the batch kept for the
replay, once, on the host: the numbers the data-pipeline hint cites.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Sequence

import keras
import numpy as np

from tb_numerics import metadata

__all__ = ["BatchPlan", "bad_features", "float_leaves", "is_float_tensor"]

# How many of the features holding bad values a record lists (the worst first).
_MAX_FEATURES = 8


# The dense tensor types of each backend (a ragged or sparse tensor is none of them).
_TENSOR_TYPES = (("tensorflow", ("Tensor", "Variable")), ("jax", ("Array",)), ("torch", ("Tensor",)))


def is_float_tensor(t: Any) -> bool:
    """Whether ``t`` is a dense float tensor of a Keras backend (a traced one
    too), or a numpy array: a batch's leaf, or a layer's output.

    No backend is imported here (TensorFlow is not, on JAX or PyTorch): a
    backend's types are looked up where it was imported already.

    Args:
      t: anything; a ragged or sparse tensor is no dense tensor.
    """
    types = [np.ndarray] + [getattr(sys.modules[m], n) for m, names in _TENSOR_TYPES if m in sys.modules
                            for n in names if hasattr(sys.modules[m], n)]
    return isinstance(t, tuple(types)) and keras.backend.standardize_dtype(t.dtype) in metadata.DTYPE_LIMITS


def float_leaves(structure: Any) -> list[tuple[str, Any]]:
    """(path, tensor) of each float tensor of ``structure``; the path "" for a bare tensor."""
    return [("/".join(str(k) for k in path), t) for path, t in keras.tree.flatten_with_path(structure)
            if is_float_tensor(t)]


def _model_count(model: keras.Model, attr: str, floats_only: bool) -> int:
    """How many tensors the model's ``inputs`` or ``outputs`` hold (1 where it does not say)."""
    try:
        tensors = keras.tree.flatten(getattr(model, attr, None))
    except (AttributeError, ValueError):  # a subclassed model has neither
        return 1
    if floats_only:
        tensors = [t for t in tensors if str(getattr(t, "dtype", "")) in metadata.DTYPE_LIMITS]
    return max(1, len(tensors))


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """How many rows each part of the batch has: (tag head, rows) in row order."""

    parts: tuple[tuple[str, int], ...]

    @classmethod
    def for_model(cls, model: keras.Model) -> "BatchPlan":
        return cls((("input", _model_count(model, "inputs", True)),
                    ("target", _model_count(model, "outputs", False)), ("sample_weight", 1)))

    @property
    def size(self) -> int:
        return sum(n for _, n in self.parts)

    def tags(self) -> list[str]:
        """Each row's tag until a trace names it from the batch."""
        return [head if n == 1 else "%s/%d" % (head, i) for head, n in self.parts for i in range(n)]

    def assign(self, data: Any) -> list[tuple[int, str, list[Any]]]:
        """(row within the batch's rows, tag, tensors) of each float tensor of
        ``data`` (what ``train_step`` receives), merged where a part has more
        tensors than rows."""
        out, offset = [], 0
        for (head, n), part in zip(self.parts, keras.utils.unpack_x_y_sample_weight(data)):
            leaves = float_leaves(part)
            if len(leaves) > n:
                out.append((offset, head, [t for _, t in leaves]))
            else:
                out += [(offset + i, "%s/%s" % (head, path) if path else head, [t])
                        for i, (path, t) in enumerate(leaves)]
            offset += n
        return out


def bad_features(tag: str, tensors: Sequence[Any], dtype: str) -> dict[str, Any] | None:
    """Where ``tensors`` (one row's, as kept on the host) hold NaN, ±Inf or
    values beyond ``dtype``'s overflow margin: per feature (the last axis; a
    rank-1 tensor has none) and per example (the first axis). None where
    they hold none, or are not shaped alike."""
    arrays = [np.asarray(t) for t in tensors]
    if not arrays or arrays[0].ndim == 0 or any(a.shape[1:] != arrays[0].shape[1:] for a in arrays):
        return None
    a = np.concatenate(arrays).astype(np.float64)
    per = np.stack([np.isnan(a), a == np.inf, a == -np.inf, np.isfinite(a) & (np.abs(a) > metadata.overflow_margin(dtype))])
    by_example = per.reshape(4, a.shape[0], -1).any(axis=(0, 2))
    if not by_example.any():
        return None
    out: dict[str, Any] = {"tensor": tag, "shape": list(a.shape), "examples": int(a.shape[0]),
                           "bad_examples": int(by_example.sum()), "first_bad_example": int(np.argmax(by_example))}
    if a.ndim >= 2:
        counts = per.reshape(4, -1, a.shape[-1]).sum(axis=1)  # [kind, feature]
        bad = np.flatnonzero(counts.sum(axis=0))
        worst = bad[np.argsort(-counts.sum(axis=0)[bad], kind="stable")][:_MAX_FEATURES]
        out.update(features=int(a.shape[-1]), bad_features=int(bad.size), by_feature=[
            {"feature": int(f), **{k: int(counts[j, f]) for j, k in enumerate(("nan", "posinf", "neginf", "overflow"))}}
            for f in worst])
    return out
