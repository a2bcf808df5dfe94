"""The replay of a failing step on PyTorch: every operator's output checked as the step runs again.

``StepReplay.replay`` runs the model's own ``train_step`` on the kept batch,
from the seed generators' states the step began with, with the optimizer's
update suppressed (the callback's ``apply`` does nothing while ``active``),
under a ``TorchDispatchMode`` that sees each ATen operator below autograd,
forward and backward alike. The first operator whose output holds a NaN or
an Inf is the op: its type is the operator (``log``, ``div``, ``addmm``),
its name the top-level Keras layer it ran in (or, in the backward pass, the
autograd node that ran it, ``LogBackward0``) with the operator, its line
the innermost frame of the user's code on the Python stack, or for a
backward operator on the stack that created its node in the forward pass
(anomaly mode keeps it, ``check_nan=False``: nothing raises), and its
inputs' ranges those it was given. Every non-trainable and metric variable
the replay changes is put back.

Unlike PyTorch's anomaly mode, which checks the backward pass only and
raises, this sees the forward pass too, names the step, the layer and the
phase, and lets training go on.
"""

from __future__ import annotations

import contextlib
import math
import re
from typing import Any, Iterator

import keras
import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tb_numerics.backends import _replay_common, _source, torch_stats
from tb_numerics.oplevel.record import OpRecord, passes_mask
from tb_numerics.records import numpy_stats

__all__ = ["StepReplay"]

_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')

NOT_REPRODUCED = (
    "every operator's output was finite when the step ran again: a random op outside Keras' seeded layers "
    "(torch.rand, torch.nn.functional.dropout) or a random data pipeline drew other values, or torch.compile "
    "computed the step differently; the layer-level answer stands"
)


# Operators whose input is a constant the program wrote, made a tensor outside the step's operators.
_LIFTS_CONSTANTS = frozenset({"lift_fresh", "lift_fresh_copy"})
# Operators that allocate without writing: their output is whatever the memory held (a NaN
# among it is no value of the step's), until an op fills it (Dropout's bernoulli_ on empty_like).
_UNINITIALIZED = frozenset({"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty",
                            "new_empty_strided"})


def _tensors(structure: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(structure)
            if isinstance(t, torch.Tensor) and t.dtype in torch_stats.FLOAT_DTYPES]


def _host(t: torch.Tensor) -> np.ndarray:
    """A float tensor's values on the host, in float64 (numpy has no bfloat16)."""
    return t.detach().to(torch.float64).cpu().numpy()


def _nonfinite(t: torch.Tensor) -> bool:
    return t.numel() > 0 and not bool(torch.isfinite(t).all())


def _node_frames(node: Any) -> list[tuple[str, int, str]]:
    """The forward stack that created an autograd node (anomaly mode's), innermost first."""
    lines = node.metadata.get("traceback_") or []
    found = [_FRAME.search(line) for line in lines]
    return [(m["file"], int(m["line"]), m["func"]) for m in reversed(found) if m]


class _FirstNonFinite(TorchDispatchMode):
    """Notes the first operator whose float output is not finite."""

    def __init__(self, replay: "StepReplay", step: int):
        super().__init__()
        self._replay, self._step = replay, step
        self.found: OpRecord | None = None
        self._seen_backward = False
        # id of each output that passes a mask's -Inf on -> the tensor (``passes_mask``).
        self._masks: dict[int, torch.Tensor] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        node = torch._C._current_autograd_node()
        self._seen_backward |= node is not None
        if self.found is None and func.overloadpacket.__name__ not in _UNINITIALIZED:
            bad = [t for t in _tensors(out) if _nonfinite(t)]
            if bad:
                inputs = _tensors((args, kwargs))
                # lift_fresh lifts a tensor the program wrote as data (torch.tensor(-math.inf)): a constant.
                constant = func.overloadpacket.__name__ in _LIFTS_CONSTANTS
                masked = [constant or self._masks.get(id(t)) is t for t in inputs]
                # A -Inf the program wrote as a number: torch.where(mask, scores, -math.inf).
                literals = [x for x in torch.utils._pytree.tree_leaves((args, kwargs))
                            if isinstance(x, float) and x == -math.inf]
                records_in = [numpy_stats(_host(t)) for t in inputs] + [numpy_stats(np.float64(x)) for x in literals]
                if len(bad) == 1 and passes_mask(numpy_stats(_host(bad[0])), records_in,
                                                 masked + [True] * len(literals)):
                    self._masks[id(bad[0])] = bad[0]  # an intended -Inf, passed on: no op of the step's making
                else:
                    self.found = self._record(func, node, bad[0], inputs, masked)
        return out

    def _record(self, func: Any, node: Any, bad: torch.Tensor, inputs: list[torch.Tensor],
                masked: list[bool]) -> OpRecord:
        op_type = func.overloadpacket.__name__
        if node is not None:
            phase, scope, frame = "backward", node.name(), _source.user_frame(_node_frames(node))
        else:
            phase = "update" if self._seen_backward else "forward"
            frame = _source.user_frame(_source.python_stack())
            scope = self._replay.layer or (frame[2] if frame else "")
        name = "/".join(filter(None, (scope, op_type)))
        return _replay_common.found_op(name, op_type, _source.format_where(frame), phase, self._step, _host(bad),
                                       [_host(t) for t in inputs], masked)


class StepReplay:
    """Runs a model's ``train_step`` once more with every operator checked."""

    def __init__(self, model: keras.Model, train_step: Any):
        self._model = model
        self._train_step = train_step
        self.active = False  # True while the replay runs the step
        self._layers: list[str] = []

    @property
    def layer(self) -> str:
        """The top-level layer the replay is in ("" outside every layer)."""
        return self._layers[-1] if self._layers else ""

    @contextlib.contextmanager
    def in_layer(self, name: str) -> Iterator[None]:
        """Notes, while the replay runs, that the top-level layer ``name`` is running."""
        if not self.active:
            yield
            return
        self._layers.append(name)
        try:
            yield
        finally:
            self._layers.pop()

    def replay(self, data: Any, seeds: list[torch.Tensor], step: int) -> dict[str, Any]:
        """The verdict of running ``train_step(data)`` again from the seed
        states ``seeds``: ``{"reproduced": True, "op": {...}}`` or
        ``{"reproduced": False, "why": ...}``."""
        model = self._model
        saved = [(v, v.value.detach().clone()) for v in _state_variables(model)]
        mode = _FirstNonFinite(self, step)
        self.active = True
        try:
            for m in model.metrics:
                m.reset_state()  # the failing step left a NaN in the loss tracker's total
            for v, seed in zip([v for v in model.non_trainable_variables if v.name == "seed_generator_state"], seeds):
                v.assign(seed)
            with torch.autograd.set_detect_anomaly(True, check_nan=False), mode:
                self._train_step(data)
        finally:
            self.active = False
            self._layers.clear()
            for v, value in saved:
                v.assign(value)
            model.zero_grad()
        return _replay_common.verdict(mode.found, NOT_REPRODUCED, not any(_nonfinite(t) for t in _tensors(data)))


def _state_variables(model: keras.Model) -> list[Any]:
    """The variables a replayed step may change besides the trainable
    weights: the non-trainable ones and the metrics'."""
    seen: set[int] = set()
    out = []
    for v in list(model.non_trainable_variables) + [v for m in model.metrics for v in m.variables]:
        if id(v) not in seen:
            seen.add(id(v))
            out.append(v)
    return out
