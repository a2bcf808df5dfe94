"""The replay of a failing step on JAX: its jaxpr evaluated equation by equation.

``replay(train_step, state, data, step)`` traces the model's own training
step to a jaxpr (``jax.make_jaxpr``) and evaluates it one primitive at a
time, eagerly, stepping into calls (``jit``, ``custom_jvp_call``, remat)
and, where its outputs are not finite, control flow (``scan``, ``while``,
``cond``: an RNN's cell, a layer's loop, each iteration), until an
equation's output holds a NaN or an Inf. That equation is the op:
its primitive is the type (``log``, ``div``, ``dot_general``), its name is
the Keras name scope it ran in with the primitive (``dense_3/dot_general``),
its phase comes from the transformations JAX wrote into the name stack
(``jvp(...)``: forward; ``transpose(jvp(...))``: backward; after the
gradients: update; a ``jvp`` equation that only the backward pass reads, a
derivative's coefficient such as ``0.5 / sqrt(x)``, is backward, inside a
call such as ``jnp.linalg.norm``'s too), its line is the innermost frame of the user's code in
the equation's traceback, and its inputs' ranges are those it was given.
Such a coefficient is computed in the forward part, before forward ops that
the step, as TensorFlow and PyTorch run it, runs before any derivative: where
one is not finite, the evaluation goes on, and it is the op only where no
forward op goes bad after it (a norm's slope at 0 is Inf; the 0/0 of the
division by that norm is the op).
The evaluation is pure: nothing of the model's state changes.

Unlike ``jax_debug_nans``, which re-runs a jitted function un-jitted after it
failed, this names the step, the layer and the phase, sees +Inf and -Inf as
well as NaN, and reads no flag that changes how training runs.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.extend import core

from tb_numerics import metadata, records
from tb_numerics.backends import _replay_common, _source
from tb_numerics.oplevel.record import OpRecord, passes_mask

__all__ = ["replay"]

_TRANSFORM = re.compile(r"^(?:[A-Za-z_]\w*\()+([^()]*)\)+$")
# Primitives whose work is a jaxpr of their own, by the parameter that holds it.
_CALL_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
# Primitives that only move or cast their input's values: a non-finite constant through them is still the program's.
_MOVES = frozenset({"convert_element_type", "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose",
                    "copy", "copy_p"})
_CALLS = {"pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr",
          "remat", "checkpoint", "remat2"}

NOT_REPRODUCED = (
    "every primitive's output was finite when the step's jaxpr was evaluated eagerly, one equation at a time: "
    "XLA computed the compiled step differently, or its batch or random draws were other than the step's; "
    "the layer-level answer stands"
)


class _Found(Exception):
    """Raised by the evaluation at the first equation with a non-finite output."""

    def __init__(self, eqn: Any, names: list[str], phase: str, invals: list, outvals: list, masked: list[bool]):
        super().__init__(eqn.primitive.name)
        self.eqn, self.names, self.phase, self.invals, self.outvals = eqn, names, phase, invals, outvals
        self.masked = masked  # per float input: whether its -Inf is a mask's


def _clean(component: str) -> str:
    """``jvp(dense_1)`` -> ``dense_1``: a name-stack component without its transformations."""
    m = _TRANSFORM.match(component)
    return m.group(1) if m else component


class _Phases(NamedTuple):
    """Where a jaxpr's backward phase lies (``_phases``)."""

    eqns: set[int]  # the indices of its equations of the backward phase
    read_by_backward: set[Any]  # its variables that only those equations read


def _phases(jaxpr: Any, backward_outs: set[int] = frozenset(), jvp: bool = False) -> _Phases:
    """The equations of ``jaxpr`` in the backward phase: those JAX
    transposed, and the forward (``jvp``) ones whose outputs only the
    backward pass reads: the derivatives' coefficients that JAX's
    linearization computes beside the forward ops (``0.5 / sqrt(x)`` for a
    sqrt); and the variables only they read (what a loop among them hands
    to the backward pass alone). ``backward_outs``: the indices of the
    outputs only the backward pass reads (of a loop's body); ``jvp``: every
    equation is a forward one (a body of a loop of the forward pass)."""
    consumers: dict[Any, list[int]] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not isinstance(v, core.Literal):
                consumers.setdefault(v, []).append(i)
    outvars = [v for v in jaxpr.outvars if not isinstance(v, core.Literal)]
    outputs = {v for k, v in enumerate(jaxpr.outvars) if not isinstance(v, core.Literal) and k not in backward_outs}
    backward: set[int] = set()
    for i in reversed(range(len(jaxpr.eqns))):
        names = str(jaxpr.eqns[i].source_info.name_stack)
        if "transpose(" in names:
            backward.add(i)
        elif jvp or "jvp(" in names:
            outs = [v for v in jaxpr.eqns[i].outvars if not isinstance(v, core.DropVar)]
            if outs and not any(v in outputs for v in outs) and all(
                    c in backward for v in outs for c in consumers.get(v, [])):
                backward.add(i)
    read = {v for v, cs in consumers.items() if v not in outvars and all(c in backward for c in cs)}
    return _Phases(backward, read)


class _Evaluator:
    """Evaluates a jaxpr equation by equation, noting where the backward pass begins."""

    def __init__(self) -> None:
        self.seen_backward = False
        self._forced: str | None = None  # the phase of the equation being stepped into
        # The first residual (a derivative's coefficient the forward part computes for the
        # backward pass) that was not finite: the op, unless a forward op goes bad after it.
        self.deferred: _Found | None = None
        # id of each value that passes a mask's -Inf on (``passes_mask``), or a non-finite
        # constant of the program moved or cast (``_MOVES``) -> the value.
        self._masks: dict[int, Any] = {}

    def run(self, jaxpr: Any, consts: list, args: list, prefix: list[str], phases: _Phases | None = None) -> list:
        """``jaxpr``'s outputs; ``phases``: where its backward phase lies,
        where known (the step's, a loop's body)."""
        env: dict[Any, Any] = {}
        read = lambda v: v.val if isinstance(v, core.Literal) else env[v]  # noqa: E731
        for var, value in zip(jaxpr.constvars, consts):
            env[var] = value
        for var, value in zip(jaxpr.invars, args):
            env[var] = value
        outer = self._forced
        for i, eqn in enumerate(jaxpr.eqns):
            invals = [read(v) for v in eqn.invars]
            names = prefix + [c for c in str(eqn.source_info.name_stack).split("/") if c]
            if phases is not None:
                self._forced = "backward" if i in phases.eqns else outer
            sub = _sub_jaxpr(eqn)
            # Its outputs only the backward pass reads (a call's or a loop's residuals, such as 0.5 / sqrt(x)).
            back = {k for k, v in enumerate(eqn.outvars) if phases is not None and v in phases.read_by_backward}
            if sub is not None:
                jvp = any(c.startswith("jvp(") for c in names)
                inner = _phases(sub[0], back, jvp) if back or jvp else None
                outvals = self.run(sub[0], sub[1], invals, names or [""], inner)
            elif eqn.primitive.name in _CONTROL_FLOW:
                outvals = self._control_flow(eqn, invals, names or [""], back)
            else:
                outvals = self._bind(eqn, invals, names, lambda: [
                    self._is_mask(v, x, jaxpr.constvars) for v, x in zip(eqn.invars, invals) if _is_float(x)],
                    lambda: all(self._is_constant(v, x, jaxpr.constvars)
                                for v, x in zip(eqn.invars, invals) if _nonfinite(x)))
            for var, value in zip(eqn.outvars, outvals):
                if not isinstance(var, core.DropVar):
                    env[var] = value
        self._forced = outer
        return [read(v) for v in jaxpr.outvars]

    def _bind(self, eqn: Any, invals: list, names: list[str], masked: Any = None, constant: Any = None) -> list:
        """``eqn``'s outputs; raises ``_Found`` where one is not finite, unless
        it passes a mask's -Inf on (``masked()``: per float input, whether its
        -Inf is a mask's; None: a loop or a branch, run whole), or moves or
        casts a non-finite constant of the program (``constant()``: whether
        every non-finite input is one; ``jnp.var``'s ``where(n > 0, s / n, nan)``
        casts and broadcasts its NaN before the select drops it)."""
        params = eqn.primitive.get_bind_params(eqn.params)
        subfuns, params = params if isinstance(params, tuple) else ((), params)  # (subfuns, params) before JAX 0.7
        with eqn.ctx.manager:
            out = eqn.primitive.bind(*subfuns, *invals, **params)
        outvals = list(out) if eqn.primitive.multiple_results else [out]
        phase = self._phase(names)
        bad = [v for v in outvals if _nonfinite(v)]
        if bad:
            m = masked() if masked is not None else []
            ins = [records.numpy_stats(np.asarray(x, np.float64)) for x in invals if _is_float(x)]
            if masked is not None and len(bad) == 1 and passes_mask(records.numpy_stats(np.asarray(bad[0], np.float64)),
                                                                   ins, m):
                self._masks[id(bad[0])] = bad[0]  # an intended -Inf, passed on: no op of the step's making
                return outvals
            if constant is not None and eqn.primitive.name in _MOVES and len(bad) == 1 and constant():
                self._masks[id(bad[0])] = bad[0]  # the program's own NaN or Inf, moved or cast
                return outvals
            found = _Found(eqn, names, phase, invals, outvals, m)
            residual = self._forced == "backward" and not any(c.startswith("transpose(") for c in names)
            if residual and masked is not None:
                # The backward pass runs after the forward part it is computed in: a forward op
                # that goes bad later in that part ran first in the step's own order.
                self.deferred = self.deferred or found
                return outvals
            if self.deferred is not None and phase != "forward":
                raise self.deferred
            raise found
        return outvals

    def _is_mask(self, var: Any, value: Any, constvars: list) -> bool:
        """Whether input ``value``'s -Inf is a mask's: a value that passed one
        on, or a -Inf constant of the program (``where(m, s, -jnp.inf)``'s literal)."""
        if self._masks.get(id(value)) is value:
            return True
        return _literal(var, value, constvars) and bool(np.all(np.isneginf(np.asarray(value, np.float64))))

    def _is_constant(self, var: Any, value: Any, constvars: list) -> bool:
        """Whether input ``value`` is a non-finite constant of the program, or one moved or cast."""
        return self._masks.get(id(value)) is value or _literal(var, value, constvars)

    def _control_flow(self, eqn: Any, invals: list, names: list[str], backward_outs: set[int]) -> list:
        """A loop or branch run whole (compiled: an RNN over a long sequence
        costs one call); where an output is not finite, stepped into for the
        op inside it raises at, or the loop itself where none is found.
        ``backward_outs``: its outputs only the backward pass reads (a
        forward loop's residuals, such as ``0.5 / sqrt(x)``)."""
        try:
            return self._bind(eqn, invals, names)
        except _Found as whole:
            jvp = any(c.startswith("jvp(") for c in names)
            _CONTROL_FLOW[eqn.primitive.name](self, eqn.params, invals, names, backward_outs, jvp)
            bad_at = [k for k, v in enumerate(whole.outvals) if _nonfinite(v)]
            if self.deferred is not None and set(bad_at) <= backward_outs:
                return whole.outvals  # only residuals are not finite: the residual found inside stands for them
            bad = [whole.outvals[k] for k in bad_at]
            # Stepped through, no op inside made a value not finite: a -Inf it hands out is a mask's.
            if all(passes_mask(records.numpy_stats(np.asarray(v, np.float64)), [], []) for v in bad):
                self._masks.update((id(v), v) for v in bad)
                return whole.outvals
            raise whole

    def _phase(self, names: list[str]) -> str:
        if self._forced == "backward" or any(c.startswith("transpose(") for c in names):
            self.seen_backward = True
            return "backward"
        if any(c.startswith("jvp(") for c in names):
            return "forward"
        return "update" if self.seen_backward else "forward"


def _scan(ev: _Evaluator, params: dict, invals: list, names: list[str], backward_outs: set[int], jvp: bool) -> None:
    """A ``scan`` (a layer's loop, an RNN over time) stepped into: its body
    evaluated equation by equation at each iteration, as ``lax.scan`` runs it."""
    body, n_consts, n_carry = params["jaxpr"], params["num_consts"], params["num_carry"]
    consts, carry, xs = invals[:n_consts], invals[n_consts:n_consts + n_carry], invals[n_consts + n_carry:]
    phases = _phases(body.jaxpr, backward_outs, jvp)
    length = params["length"]
    for i in (reversed(range(length)) if params["reverse"] else range(length)):
        carry = ev.run(body.jaxpr, list(body.consts), consts + carry + [x[i] for x in xs], names, phases)[:n_carry]


def _while(ev: _Evaluator, params: dict, invals: list, names: list[str], backward_outs: set[int], jvp: bool) -> None:
    """A ``while`` loop stepped into: its condition and body evaluated at each iteration."""
    nc, nb = params["cond_nconsts"], params["body_nconsts"]
    cond, body = params["cond_jaxpr"], params["body_jaxpr"]
    cond_consts, body_consts, carry = invals[:nc], invals[nc:nc + nb], invals[nc + nb:]
    phases = _phases(body.jaxpr, backward_outs, jvp)  # its outputs are its carry, as the loop's
    while bool(ev.run(cond.jaxpr, list(cond.consts), cond_consts + carry, names)[0]):
        carry = ev.run(body.jaxpr, list(body.consts), body_consts + carry, names, phases)


def _cond(ev: _Evaluator, params: dict, invals: list, names: list[str], backward_outs: set[int], jvp: bool) -> None:
    """A ``cond`` stepped into: the branch its index chose (clamped, as ``lax.switch`` does)."""
    branches = params["branches"]
    branch = branches[min(max(int(invals[0]), 0), len(branches) - 1)]
    ev.run(branch.jaxpr, list(branch.consts), invals[1:], names, _phases(branch.jaxpr, backward_outs, jvp))


# Control flow stepped into where its outputs are not finite: the first
# non-finite op inside a loop (an RNN's cell, a layer's keras.ops.fori_loop)
# is named, not the loop. (A value masked inside a loop whose outputs are
# finite is not looked for, as a loop run whole never showed it.)
_CONTROL_FLOW = {"scan": _scan, "while": _while, "cond": _cond}


def _sub_jaxpr(eqn: Any) -> tuple[Any, list] | None:
    """(jaxpr, consts) of a call-like equation, else None."""
    if eqn.primitive.name not in _CALLS:
        return None
    for key in _CALL_PARAMS:
        sub = eqn.params.get(key)
        if isinstance(sub, core.ClosedJaxpr):
            return sub.jaxpr, list(sub.consts)
        if isinstance(sub, core.Jaxpr):
            return sub, []
    return None


def _literal(var: Any, value: Any, constvars: list) -> bool:
    """Whether ``value`` is a scalar literal, a constant, or a literal handed into a call (a
    typed scalar, not an array the step computed or read from its state)."""
    literal = isinstance(var, core.Literal) or var in constvars or not isinstance(value, jax.Array)
    return literal and np.size(value) == 1


def _is_float(value: Any) -> bool:
    # str(), not np.dtype(): a random key's dtype (key<fry>: Dropout's) is no numpy dtype.
    return hasattr(value, "dtype") and str(value.dtype) in metadata.DTYPE_LIMITS


def _nonfinite(value: Any) -> bool:
    return _is_float(value) and records.nonfinite_count(records.numpy_stats(np.asarray(value, np.float64))) > 0


def _op(found: _Found, step: int, fallback: str) -> OpRecord:
    """The OpRecord of the equation the evaluation stopped at."""
    eqn = found.eqn
    tb = eqn.source_info.traceback
    frames = [(f.file_name, f.line_num, f.function_name) for f in tb.frames] if tb is not None else []
    source = _source.format_where(_source.user_frame(frames)) or fallback
    scope = [c for c in (_clean(n) for n in found.names) if c]
    name = "/".join(scope + [eqn.primitive.name])
    bad = next(v for v in found.outvals if _nonfinite(v))
    return _replay_common.found_op(name, eqn.primitive.name, source, found.phase, step, np.asarray(bad),
                                   [np.asarray(v) for v in found.invals if _is_float(v)], found.masked)


def replay(train_step: Any, state: Any, data: Any, step: int) -> dict[str, Any]:
    """The verdict of evaluating ``train_step(state, data)`` equation by
    equation: ``{"reproduced": True, "op": {...}}`` naming the first
    equation whose output is not finite, or ``{"reproduced": False, "why": ...}``.

    Args:
      train_step: the model's own training step (pure: ``(state, data) -> (logs, state)``).
      state: the state the step began with.
      data: the step's batch.
      step: the step's number, for the op's record.
    """
    fallback = _source.format_where(_source.user_frame(_source.python_stack()))
    closed = jax.make_jaxpr(train_step)(state, data)
    args = jax.tree_util.tree_leaves((state, data))
    evaluator = _Evaluator()
    try:
        evaluator.run(closed.jaxpr, list(closed.consts), args, [], _phases(closed.jaxpr))
        if evaluator.deferred is not None:
            raise evaluator.deferred
    except _Found as found:
        batch_finite = not any(_nonfinite(x) for x in jax.tree_util.tree_leaves(data))
        return _replay_common.verdict(_op(found, step, fallback), NOT_REPRODUCED, batch_finite)
    return _replay_common.verdict(None, NOT_REPRODUCED)
