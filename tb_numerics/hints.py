"""Plain-language hints for a first anomaly, each following from the records it cites.

Part of the numpy-only analysis core. A hint is chosen by the first rule
whose evidence is in the records (``evidence`` gathers what lies in other
tensors' records):

0. the batch: the anomaly is the input batch's own record (it arrived
   holding NaN or Inf): the fix is in the data pipeline, whatever op the
   NaN reached;
1. the loss: a loss that takes a log (cross-entropies, KL divergence,
   Poisson) whose input, the tensor logged just before it, holds exact
   zeros or negative values at the anomaly's step (the fix is at the
   model's output, even where a replay names an op inside the loss);
2. the data: a cross-entropy loss below 0 at or before the anomaly's step
   (its targets are outside [0, 1], e.g. raw pixels), whatever op overflowed;
3. the op: its type (from op-level records or a replay), the layer's
   activation function, or a token of the tag (sqrt, log, division, exp,
   pow) says how a NaN or an Inf is made; inputs in raw units, or the
   outlier batch that triggered it, are added as what the batch shows;
4. the evidence of other tensors, most specific first: the first op to
   hold the NaN cannot make one (it came in with the batch); the targets
   or sample weights all 0 (a masked mean's 0/0); inputs in raw units at
   every batch; a loss that fell below 0 and on (no lower bound); an
   outlier batch that the gradient answered beyond any polynomial (an exp
   amplified it); a model output that a sigmoid or softmax rounds to 0 or
   1 where the loss went non-finite (a log of a probability); updates
   larger than the weights with the inputs in range (the learning rate);
   an outlier batch and nothing else;
5. the trend: warnings in the steps before (growth, a jump, a gradient
   spike, values beyond the safe range) point at divergence, and the hint
   says that growth is its only evidence;
6. otherwise no hint, and the text says what was checked: a wrong hint
   sends a user to change the wrong thing, which is worse than none.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable

from tb_numerics import evidence, metadata
from tb_numerics.rules import NONFINITE_WORDS, count, number, percent

__all__ = ["BatchFault", "Evidence", "LossInput", "NegativeLoss", "choose", "is_cross_entropy", "input_range", "op_family",
           "NO_HINT_PREFIX"]

NO_HINT_PREFIX = "no hint: "

_HINT_TOKENS = {
    "sqrt": "sqrt",
    "rsqrt": "sqrt",
    "log": "log",
    "log1p": "log",
    "logsoftmax": None,
    "xlogy": "log",
    "div": "div",
    "realdiv": "div",
    "truediv": "div",
    "floordiv": "div",
    "divnonan": "div",
    "reciprocal": "div",
    "inv": "div",
    "cosine": "div",
    "normalize": "div",
    "exp": "exp",
    "exponential": "exp",
    "expm1": "exp",
    "softplus": "exp",
    "pow": "pow",
}

_OP_HINTS = {
    ("sqrt", "backward"): "The gradient of sqrt is infinite at 0: sqrt of a value that reaches 0 "
    "(e.g. sqrt of a squared error) gives an infinite gradient. Drop the sqrt, or use sqrt(x + eps).",
    ("sqrt", "forward"): "sqrt of a negative value is NaN, and its gradient at 0 is infinite: "
    "keep the input positive, e.g. sqrt(maximum(x, eps)).",
    ("log", "forward"): "log(0) = -inf: the log of a value that reaches 0 (e.g. a saturated softmax "
    "probability). Use tf.nn.softmax_cross_entropy_with_logits / log_softmax, or add an epsilon (log(x + eps)) "
    "or clip the input away from 0.",
    ("log", "negative"): "The log of a negative value is NaN: the log's input went below 0 (e.g. a linear "
    "output or a difference, where a probability or a positive quantity was meant). Keep the input positive: a "
    "softmax, sigmoid or softplus output, or log(maximum(x, eps)).",
    ("log", "backward"): "The gradient of log is infinite at 0: the log's input reached 0. Use "
    "log_softmax or softmax_cross_entropy_with_logits, or add an epsilon.",
    ("div", "forward"): "Division by zero: 0/0 is NaN and x/0 is Inf (e.g. a norm of an all-zero "
    "vector in a denominator). Add an epsilon to the denominator, e.g. inside the norm.",
    ("div", "backward"): "Division by zero in the backward pass (e.g. the gradient of a norm or sqrt "
    "at 0). Add an epsilon inside the norm or to the denominator.",
    ("exp", "forward"): "exp overflows above ~88 in float32 (~11 in float16): its input grew too "
    "large. Use a numerically stable form (log-sum-exp, softmax with logits) or bound the input.",
    ("exp", "backward"): "exp overflowed in the backward pass: its input grew too large. Use a "
    "numerically stable form or bound the input.",
    ("pow", "forward"): "pow of a negative base with a fractional exponent is NaN, and 0 to a "
    "negative power is Inf: keep the base positive and away from 0.",
    ("pow", "backward"): "The gradient of pow is infinite at 0 for exponents below 1: keep the base "
    "away from 0.",
}

# Tags of quantities learnt in log space, not made by a log op.
_LOG_PARAMETER = re.compile(r"log_?(var|variance|sigma|std|scale)(?![A-Za-z])", re.I)

# Loss functions that take the log of (or divide by the sum of) their input.
_LOG_LOSS = re.compile(r"crossentropy|cross_entropy|kl_?div|kld|poisson|nll|log_?loss", re.I)
# Keras' loss functions known to take no log of a probability.
_NO_LOG_LOSS = re.compile(r"squared|absolute|\bms[el]e?\b|\bmae\b|mape|huber|hinge|cosine|log_?cosh", re.I)


@dataclasses.dataclass(frozen=True)
class LossInput:
    """The tensor logged just before a loss, at the anomaly's step."""

    tag: str
    zeros: int
    negatives: bool
    count: int
    # The share of exact zeros at the first record of the run, for the trend.
    first_zero_share: float
    first_step: int
    # The largest share of exact zeros it held at an earlier step where the
    # loss stayed finite: zeros the loss took without harm then.
    harmless_zero_share: float = 0.0


@dataclasses.dataclass(frozen=True)
class NegativeLoss:
    """The first record, at or before an anomaly's step, of a cross-entropy
    loss below 0: impossible while its targets are in [0, 1]."""

    tag: str
    function: str  # the loss function's name, "" where only the tag says it
    step: int
    value: float


# Cross-entropies are never below 0 for targets in [0, 1] (a loss function's
# name, or a token of a loss's tag such as "bce_loss").
_CROSS_ENTROPY = re.compile(r"crossentropy|cross_entropy|(^|[^a-z])(bce|xent)([^a-z]|$)", re.I)


def is_cross_entropy(name: str) -> bool:
    """Whether a loss function's name or a loss's tag names a cross-entropy."""
    return bool(_CROSS_ENTROPY.search(name))


@dataclasses.dataclass(frozen=True)
class BatchFault:
    """A record of the input batch that is the anomaly, or its likely cause."""

    tag: str  # input, target, sample_weight (input/<key> in a dict or tuple)
    step: int
    what: str  # "128 NaN of 1,024 values", or the warning's detail
    nonfinite: bool  # the batch's record is the anomaly itself
    # Where the batch held its bad values, where the writer counted them
    # (untrusted JSON): {"examples", "bad_examples", "first_bad_example",
    # "features", "bad_features", "by_feature": [{"feature", "nan", ...}]}.
    where: dict[str, Any] | None = None
    # The finite batch's warning kind: "overflow_risk" where it was beyond the
    # safe range itself (a record holding 1e38), "fast_growth" for an outlier.
    kind: str = ""


@dataclasses.dataclass(frozen=True)
class Evidence:
    """What the records say about a first anomaly, for choosing its hint."""

    tag: str
    info: metadata.TensorInfo
    step: int
    # Earlier warnings that bear on the anomaly: kind -> its warning JSON
    # (the likely cause, and the tensor's own warnings before it).
    warnings_before: dict[str, dict[str, Any]]
    loss_input: LossInput | None = None
    # The exact op where a replay or op-level records name one:
    # {"name", "type", "source", "phase", "inputs": [{"min", "max", "zeros", "count"}]}.
    op: dict[str, Any] | None = None
    # A cross-entropy loss that went below 0 before the anomaly: its targets
    # are outside its domain.
    negative_loss: "NegativeLoss | None" = None
    batch: BatchFault | None = None
    # Evidence in other tensors' records (``evidence``): inputs in raw units,
    # an outlier batch and the gradient's answer to it, a model output that a
    # sigmoid or softmax rounds to 0 or 1, an early update larger than the weights.
    unscaled: evidence.Unscaled | None = None
    amplified: evidence.Amplified | None = None
    saturating: evidence.Saturating | None = None
    large_update: evidence.LargeUpdate | None = None
    # The exact op's own record at the step: {"nan", "posinf", "neginf", "count"}.
    op_output: dict[str, Any] | None = None
    # The target or sample-weight tag that was all zeros at the step, unlike before.
    zero_labels: str | None = None
    # A loss that fell below 0 and on: no lower bound.
    unbounded: evidence.Unbounded | None = None
    # Activations that grew from one to the next at the step: a block that amplifies, repeated.
    depth_growth: evidence.DepthGrowth | None = None
    # A variable the update made non-finite from finite gradients: the optimizer's own arithmetic.
    update_made: evidence.UpdateMade | None = None


def op_family(tag: str, op_type: str, activation: str = "") -> str | None:
    """sqrt / log / div / exp / pow where the op type, the activation
    function or a token of the tag names one, else None."""
    # A log-parameterised quantity (z_log_var) names no log op.
    tag = _LOG_PARAMETER.sub(" ", tag)
    for token in [op_type, activation] + re.split(r"[^A-Za-z0-9]+", tag)[::-1]:
        key = token.lower().removesuffix("grad").rstrip("_")
        if key in _HINT_TOKENS:
            return _HINT_TOKENS[key]
    return None


def choose(ev: Evidence) -> str:
    """The hint for a first anomaly: the first rule whose evidence holds."""
    # A loss's input evidence first: a NaN inside a library loss function
    # (Keras's cross-entropy normalising an all-zero row) is fixed at the
    # model's output, not inside the loss.
    # A broken batch comes first: whatever it reaches, the data are the cause.
    # A cross-entropy below 0 says the data are wrong before anything grows:
    # it comes before the op that overflowed and the growth that led there.
    # Then what the op and the other tensors' records tell apart, most
    # specific first; an outlier batch alone, and growth alone, come last.
    # An update that made a NaN from finite gradients with zeros in them is
    # an adaptive optimizer's 0/0; any other update-made value is named last,
    # after the growth rules that say where a large update came from.
    for rule in (_by_batch, _by_loss_input, _by_negative_loss, _by_op, _by_optimizer_moments, _by_cast_overflow,
                 _by_masked_row, _by_nan_carried_in,
                 _by_zero_labels,
                 _by_unscaled, _by_unbounded,
                 _by_amplified, _by_saturating, _by_large_update, _by_outlier, _by_trend, _by_depth_growth,
                 _by_overflowed_op, _by_update):
        text = rule(ev)
        if text:
            return text
    return _no_hint(ev)


def _replayed_family(ev: Evidence) -> str | None:
    """``op_family`` of the op the replay named (untrusted JSON); None without one."""
    if ev.op is None:
        return None
    return op_family(str(ev.op.get("name") or ""), str(ev.op.get("type") or ""))


def _by_op(ev: Evidence) -> str:
    if ev.op is not None:
        family = _replayed_family(ev)
        phase = ev.op.get("phase")
    else:
        family, phase = op_family(ev.tag, ev.info.op_type, ev.info.activation), ev.info.phase
    if family is None or (family == "pow" and phase != "backward" and _overflowed(ev)):
        return ""
    negative = _negative_inputs(ev.op) if family == "log" and phase != "backward" else ""
    if negative:
        return _OP_HINTS[("log", "negative")] + negative + _inputs_evidence(ev.op) + _data_note(ev)
    text = _OP_HINTS[(family, "backward" if phase == "backward" else "forward")]
    return text + _inputs_evidence(ev.op) + _data_note(ev)


def _data_note(ev: Evidence) -> str:
    """What the batch adds to an op's or an output's hint: inputs in raw units,
    or the outlier batch that triggered the failure (a stable form survives it)."""
    u, a = ev.unscaled, ev.amplified
    if u is not None:
        return (" The batch's %s was in raw units at every batch (root mean square at least %s, max |x| %s): "
                "normalise it in the data pipeline too." % (u.tag, number(u.rms), number(u.max_abs)))
    if a is not None and ev.step - _OUTLIER_REACH <= a.step <= ev.step:
        return (" It followed an outlier batch at step %d (%s: max |x| %s× the median of the batches before): "
                "a numerically stable form survives such a batch; also check the data." % (
                    a.step, a.tag, number(a.input_factor)))
    return ""


# An outlier batch explains an anomaly this many steps after it at most (its
# update makes the weights overflow at the next step's forward pass).
_OUTLIER_REACH = 1

# Op types that cannot make a NaN from finite inputs (at most an overflow to
# +-Inf): a NaN in their output came in through an input.
_NAN_PASSING = frozenset({
    "Square", "Exp", "Relu", "Relu6", "Elu", "Selu", "LeakyRelu", "Abs", "Neg", "Identity", "Cast", "Reshape",
    "Transpose", "ExpandDims", "Squeeze", "Tanh", "Sigmoid", "Softplus", "Mul", "AddV2", "Add", "Sub", "BiasAdd",
    "Maximum", "Minimum", "StopGradient", "ConcatV2", "Pack", "GatherV2", "StridedSlice", "Slice", "Tile", "Pad",
    "PadV2", "SelectV2", "Floor", "Ceil", "Round", "Sign",
})


def _overflowed(ev: Evidence) -> bool:
    """Whether the op made Inf and no NaN from inputs with no zero: a large
    value raised beyond its dtype's range (x ** 2 of 1e20), not one of the
    cases the op's own hint names (a zero base's Inf, a negative base's NaN).
    The rules after the op's say where the large value came from."""
    out, inputs = ev.op_output or {}, (ev.op or {}).get("inputs")
    if _count(out.get("nan")) != 0 or not (_count(out.get("posinf")) or _count(out.get("neginf"))):
        return False
    return isinstance(inputs, list) and bool(inputs) and all(
        isinstance(i, dict) and _count(i.get("zeros")) == 0 for i in inputs)


# The largest finite float16: a value beyond it cast to float16 is +-Inf.
_FLOAT16_MAX = 65504.0
# A dtype conversion's op type on each backend: TensorFlow, JAX, PyTorch.
_CAST_TYPES = frozenset({"Cast", "convert_element_type", "_to_copy", "to"})


def _by_cast_overflow(ev: Evidence) -> str:
    """A cast made Inf, and no NaN, from finite inputs: a value beyond the
    range of the dtype it casts to (under mixed precision, Keras casts each
    layer's inputs to float16, whose largest value is 65,504)."""
    op, out = ev.op or {}, ev.op_output or {}
    inputs = op.get("inputs")
    if (op.get("type") not in _CAST_TYPES or _count(out.get("nan")) != 0
            or not (_count(out.get("posinf")) or _count(out.get("neginf")))
            or not isinstance(inputs, list) or not inputs):
        return ""
    ends = []
    for i in inputs:
        if not isinstance(i, dict) or any(_count(i.get(k)) != 0 for k in ("nan", "posinf", "neginf")):
            return ""  # an input not known finite: the Inf may have come in
        ends += [abs(v) for v in (_finite(i.get("min")), _finite(i.get("max"))) if v is not None]
    if not ends:
        return ""
    top = max(ends)
    if _FLOAT16_MAX < top < 3.4e38:
        why = ("beyond the largest float16, 65,504: under mixed precision (mixed_float16) each layer computes in "
               "float16 and Keras casts its inputs to it. Bring the values that reach it into float16's range "
               "(normalise or clip the inputs, bound the layer before it), or compute that layer in float32 "
               "(dtype=\"float32\")")
    else:
        why = ("beyond the largest value of the dtype it casts to. Bring the values into that dtype's range, or "
               "cast to a wider dtype")
    return ("A cast (%s) made %s from finite values at step %d: its input reached max |x| %s, %s." % (
        op["type"], _made(out), ev.step, _num(top), why)) + _outlier_note(ev)


def _by_masked_row(ev: Evidence) -> str:
    """The op made NaN from inputs holding -Inf and no NaN: a softmax (x -
    max(x), log-sum-exp) over a row that is all -Inf, an attention row whose
    every position is masked."""
    op, out = ev.op or {}, ev.op_output or {}
    inputs = op.get("inputs")
    if not _count(out.get("nan")) or not isinstance(inputs, list) or not inputs:
        return ""
    if any(not isinstance(i, dict) or _count(i.get("nan")) != 0 for i in inputs):
        return ""
    held = [(k, _count(i.get("neginf"))) for k, i in enumerate(inputs, 1) if _count(i.get("neginf"))]
    if not held:
        return ""
    k, n = held[0]
    return (
        "%s (%s) made NaN from -Inf at step %d: its input %d held %s -Inf and no NaN. -Inf - (-Inf) is NaN, so a "
        "softmax (x - max(x)) or a log-sum-exp over a row that is all -Inf gives NaN: an attention row whose every "
        "position is masked (a sequence with no token to attend to). Mask with a large finite negative value "
        "(-1e9, or the dtype's lowest) instead of -inf, or leave such rows out." % (
            op.get("type"), op.get("source") or op.get("name"), ev.step, k, count(n)))


def _made(out: dict[str, Any]) -> str:
    """"+Inf", "-Inf" or "+Inf and -Inf": what an op's output held."""
    made = [w for k, w in (("posinf", "+Inf"), ("neginf", "-Inf")) if _count(out.get(k))]
    return " and ".join(made)


def _outlier_note(ev: Evidence) -> str:
    """The outlier batch that brought the large values, where one did: what to look for in the data."""
    b, a = ev.batch, ev.amplified
    if b is not None and not b.nonfinite:
        return " The batch at step %d was far out of range in %s: %s%s; check the data." % (
            b.step, b.tag, b.what, _batch_where(b.where))
    if a is not None and ev.step - _OUTLIER_REACH <= a.step <= ev.step:
        return " The batch at step %d was an outlier (%s: max |x| %s× the median of the batches before): " \
            "check the data." % (a.step, a.tag, number(a.input_factor))
    return ""


def _by_nan_carried_in(ev: Evidence) -> str:
    """The first op of the step to hold a NaN cannot make one: the NaN came into the step."""
    op, out = ev.op or {}, ev.op_output or {}
    if op.get("phase") != "forward" or op.get("type") not in _NAN_PASSING or not _count(out.get("nan")):
        return ""
    return (
        "The first op to hold a NaN at step %d, %s (%s), cannot make one from finite values: its input already "
        "held NaN, and no op before it in that step made one. The NaN came into the step with its inputs: the "
        "input batch most often (check the data pipeline, e.g. a division by a zero std when normalising, or a "
        "missing value read as NaN; tf.debugging.assert_all_finite finds the record), or a variable."
        % (ev.step, op.get("type"), op.get("source") or op.get("name")))


def _by_zero_labels(ev: Evidence) -> str:
    if ev.zero_labels is None:
        return ""
    return (
        "The batch's %s was all exact zeros at step %d, unlike every batch before it: a batch with no labelled "
        "(or weighted) sample. A loss that averages over the labelled samples, sum(w * loss) / sum(w), divides "
        "0 by 0 there. Guard the denominator: tf.maximum(sum(w), 1) or an epsilon, or use tf.math.divide_no_nan."
        % (ev.zero_labels, ev.step))


def _by_unbounded(ev: Evidence) -> str:
    u = ev.unbounded
    if u is None:
        return ""
    which = "The loss" if u.tag == "loss" else "The loss %s" % u.tag
    return (
        "%s fell from %s at step %d to %s at step %d, below 0 and on: it has no lower bound, and the values "
        "grew to lower it until they overflowed; the loss rewards growth. Check its terms "
        "and their signs: a penalty or regulariser subtracted instead of added, targets outside a "
        "cross-entropy's domain, a likelihood without its normaliser. The learning rate only sets how fast."
        % (which, number(u.first), u.first_step, number(u.last), u.step))


def _by_unscaled(ev: Evidence) -> str:
    u = ev.unscaled
    if u is None:
        return ""
    return (
        "The batch's %s was in raw units at every batch up to step %d (root mean square at least %s, max |x| %s "
        "over %d batches): values that large make large activations, gradients and updates from the first step, "
        "whatever the learning rate. Normalise or standardise them in the data pipeline (e.g. pixels / 255, each "
        "feature to mean 0 and std 1) or in a first Rescaling/Normalization layer."
        % (u.tag, ev.step, number(u.rms), number(u.max_abs), u.batches))


def _by_amplified(ev: Evidence) -> str:
    a = ev.amplified
    if a is None or not a.exponential or not ev.step - _OUTLIER_REACH <= a.step <= ev.step:
        return ""
    return (
        "The batch at step %d was an outlier (%s: max |x| %s× the median of the batches before it), and the "
        "gradient norm answered it %s× its median: faster than any power of the input's growth that products, "
        "squares and ReLUs give, so an exponential amplified it: an exp (or a large power) of an output without "
        "a bound, such as a log-variance, a log-rate, or logits over a small temperature. Bound what reaches the "
        "exp (tanh, softplus or a clip) or compute in log space, and clip gradients; a numerically stable model "
        "survives such a batch." % (a.step, a.tag, number(a.input_factor), number(a.gradient_factor)))


def _by_saturating(ev: Evidence) -> str:
    sat = ev.saturating
    if sat is None or _NO_LOG_LOSS.search(sat.loss_function):
        return ""  # a loss known to take no log (a squared error) meets no log(0)
    if ev.op is not None and _overflowed(ev) and _replayed_family(ev) != "exp":
        return ""  # the replay's op raised large finite values beyond range (x ** 2 of 1e20): no log(0), no exp
    exp = (" Beyond 88, exp(x) overflows too: if the loss takes exp of it, bound it or use a stable form."
           if sat.max_abs >= 88.7 else "")
    return (
        "At step %d the model's output %s held finite values up to |x| = %s, and the loss was not finite: beyond "
        "±17 float32's sigmoid rounds to exactly 1 (and a softmax's probabilities to exactly 0 and 1), so "
        "log(sigmoid(x)), log(1 - sigmoid(x)) or log(softmax(x)) meets log(0), and 0 × log(0) is NaN. Compute the "
        "loss from logits: tf.nn.sigmoid_cross_entropy_with_logits, softmax_cross_entropy_with_logits, "
        "tf.math.log_sigmoid, or from_logits=True.%s" % (sat.step, sat.tag, number(sat.max_abs), exp)
    ) + _data_note(ev)


def _by_large_update(ev: Evidence) -> str:
    lu = ev.large_update
    if lu is None or lu.step > ev.step:
        return ""
    worst = sorted(lu.ratios.items(), key=lambda kv: -kv[1])[:3]
    named = ", ".join("%s %s" % (k, number(v)) for k, v in worst)
    return (
        "At step %d, before the first non-finite value, one update moved the weights of %d layer%s by more than "
        "their own size (||w_new - w_old|| / ||w_old||: %s), with the inputs in range: the step size is too "
        "large for this model, most often a learning rate too high (or a warm-up missing). Lower the learning "
        "rate (e.g. 10×), or clip gradients." % (lu.step, len(lu.ratios), "" if len(lu.ratios) == 1 else "s", named))


def _by_optimizer_moments(ev: Evidence) -> str:
    """A value an optimizer that divides by the root of its squared
    gradients made non-finite from finite gradients: a gradient whose square
    overflowed its dtype (v is Inf), or, for a NaN where some gradients were
    exactly 0, m / (sqrt(v) + epsilon) at 0/0 for a weight that has had no
    gradient yet, unless epsilon is positive."""
    u = ev.update_made
    if u is None or not u.optimizer:
        return ""
    if u.square_overflow:
        return (
            "The update of step %d made %s non-finite from finite gradients: %s keeps a running mean of each "
            "gradient's square, and a gradient of |g| = %s at that step has a square beyond %s's largest value %s, "
            "so that running mean is Inf, and every later update of that weight divides by it. Find what made that gradient so "
            "large (a loss or sample weight far out of scale, a learning rate too high before it) and clip "
            "gradients (clipnorm) before the update." % (
                u.step, _updated(ev), u.optimizer, number(u.square_overflow), u.dtype,
                number(metadata.DTYPE_LIMITS[u.dtype][0])))
    if not u.nan or not u.zeros:
        return ""
    return (
        "The update of step %d made %s NaN from finite gradients: %s divides each weight's step by the root "
        "of its running mean of squared gradients, m / (sqrt(v) + epsilon), and where a weight's gradient has been "
        "exactly 0 at every step so far (at step %d, %s of the %s values of its gradient were 0), m and v are 0: "
        "0/0 unless epsilon is positive. Keep the optimizer's epsilon above 0 (Keras' default is 1e-7; in float16 "
        "an epsilon of 1e-8 rounds to 0), and look for the weights that get no gradient (an input feature that is "
        "always 0, an embedding row never looked up, a unit that never fires)." % (
            u.step, _updated(ev), u.optimizer, u.step, count(u.zeros), count(u.count)))


def _updated(ev: Evidence) -> str:
    """What the update made non-finite, in words: a variable, or a layer's weights."""
    if ev.tag.startswith("update_ratio/"):
        return "the weights of layer %s" % ev.tag.split("/", 1)[1]
    return ev.tag.removeprefix("update/")


def _by_update(ev: Evidence) -> str:
    """Any other value an update made non-finite from finite gradients."""
    u = ev.update_made
    if u is None:
        return ""
    made = " and ".join(w for w in ("%s NaN" % count(u.nan) if u.nan else "", "%s Inf" % count(u.inf) if u.inf
                                    else "") if w)
    grads = "its gradients at that step were finite" if u.count else "the step's loss and gradients were finite"
    return (
        "The update of step %d made %s non-finite (%s), and %s: the optimizer's own arithmetic made the value, not "
        "the forward or backward pass. Check its hyperparameters (a positive epsilon; a finite learning rate: a "
        "schedule that divides by the step count is Inf at step 0) and any code of your own in the update (a "
        "constraint, a weight decay, a custom optimizer)." % (u.step, _updated(ev), made, grads))


def _by_outlier(ev: Evidence) -> str:
    """A finite batch far out of range, with no mechanism found: name the batch."""
    b, a = ev.batch, ev.amplified
    if b is not None and not b.nonfinite:
        what, at, detail, where = b.tag, b.step, b.what, _batch_where(b.where)
    elif a is not None and ev.step - _OUTLIER_REACH <= a.step <= ev.step:
        what, at, detail, where = a.tag, a.step, "max |x| %s× the median of the batches before" % number(
            a.input_factor), ""
    else:
        return ""
    return _finite_batch(at, what, detail, where)


def _finite_batch(step: int, what: str, detail: str, where: str) -> str:
    return (
        "The batch at step %d was already far out of range in %s, before the first non-finite value: %s%s. "
        "A corrupt or unscaled record, finite but large enough for a layer or the loss to overflow: validate "
        "or clip the inputs in the data pipeline (a range check, normalisation)." % (step, what, detail, where))


def _inputs_held(op: dict[str, Any] | None, held: Callable[[dict[str, Any]], str | None]) -> str:
    """" At that step its input K held ...; ...." for each input of the op,
    where a replay saw them, that ``held`` describes (None: nothing to say)."""
    if not op or not isinstance(op.get("inputs"), list):
        return ""
    parts = []
    for k, i in enumerate(op["inputs"], 1):
        what = held(i) if isinstance(i, dict) else None
        if what:
            parts.append("input %d held %s" % (k, what))
    return (" At that step its " + "; ".join(parts) + ".") if parts else ""


def _inputs_evidence(op: dict[str, Any] | None) -> str:
    """The op's inputs that held exact zeros: e.g. " At that step its input 1
    held 3 exact zeros of 64 (min 0, max 2)." """
    return _inputs_held(op, lambda i: "%s exact zeros of %s (min %s, max %s)" % (
        count(i["zeros"]), count(_finite(i.get("count")) or 0), _num(i.get("min")), _num(i.get("max")))
        if _finite(i.get("zeros")) else None)


def _negative_inputs(op: dict[str, Any] | None) -> str:
    """The op's inputs that held negative values (a log's NaN, not its
    log(0)): e.g. " At that step its input 1 held negative values (min -4,
    max -3.9)." """
    return _inputs_held(op, lambda i: "negative values (min %s, max %s)" % (number(i["min"]), _num(i.get("max")))
                        if (_finite(i.get("min")) or 0) < 0 else None)


def _by_batch(ev: Evidence) -> str:
    b = ev.batch
    if b is None:
        return ""
    what = "the targets (%s)" % b.tag if b.tag.startswith("target") else b.tag
    where = _batch_where(b.where)
    if not b.nonfinite and b.kind != "overflow_risk":
        return ""  # a finite outlier: the op or the output may say how it failed (``_by_outlier``)
    if not b.nonfinite:
        return _finite_batch(b.step, what, b.what, where)
    effect = _BATCH_EFFECT.get(b.tag.split("/")[0], _BATCH_EFFECT["input"])
    return (
        "The batch at step %d held %s in %s%s: it arrived so from the data pipeline, before any layer "
        "ran (%s). Check the preprocessing, e.g. a division by a zero std when normalising, a log of 0, "
        "or a missing value read as NaN; tf.debugging.assert_all_finite in the pipeline finds the record."
        % (b.step, b.what, what, where, effect))


# What a non-finite value in each part of the batch does to the step.
_BATCH_EFFECT = {
    "input": "the layers after it did not make them",
    "target": "the loss of a non-finite target is not finite, whatever the model does",
    "sample_weight": "the loss weighs each example by it, so the loss is not finite",
}


def _batch_where(where: dict[str, Any] | None) -> str:
    """Where the batch held its bad values, from untrusted JSON: e.g.
    ", all in feature 3 (of 8), in 16 of its 16 examples"."""
    if not isinstance(where, dict):
        return ""
    words = []
    by_feature = where.get("by_feature")
    shown = [f for f in by_feature if isinstance(f, dict) and _count(f.get("feature")) is not None] \
        if isinstance(by_feature, list) else []
    bad, of = _count(where.get("bad_features")), _count(where.get("features"))
    if shown and bad is not None:
        of_words = " (of %s)" % format(of, ",") if of is not None else ""
        names = ", ".join(str(_count(f["feature"])) for f in shown)
        if bad == 1:
            words.append("all in feature %s%s" % (names, of_words))
        else:
            more = ", ..." if bad > len(shown) else ""
            words.append("in %s features%s: %s%s" % (format(bad, ","), of_words, names, more))
    examples, of_examples = _count(where.get("bad_examples")), _count(where.get("examples"))
    if examples is not None and of_examples is not None:
        first = _count(where.get("first_bad_example"))
        words.append("in %s of its %s examples%s" % (format(examples, ","), format(of_examples, ","),
                                                    " (the first: %d)" % first if first is not None else ""))
    return ", " + ", ".join(words) if words else ""


def _count(x: Any) -> int | None:
    """A whole count from untrusted JSON, or None."""
    return x if type(x) is int and x >= 0 else None


def _by_loss_input(ev: Evidence) -> str:
    li = ev.loss_input
    if ev.info.role != "loss" or li is None:
        return ""
    loss_fn = ev.info.activation or _log_loss_scope(ev.op)
    if loss_fn and not _LOG_LOSS.search(loss_fn):
        return ""
    if _op_not_broken_by_zeros(ev) or _log_read_zeros_elsewhere(ev, li):
        return ""
    if not loss_fn and ev.op is not None:
        # A hand-written loss whose op the replay named (a cosine's 0/0, the log of a softmax
        # probability that rounded to 0): the op's hint, with its inputs' zeros, says what happened.
        return ""
    # A loss function of unknown name: only exact zeros, which no loss but a
    # log (or a normalisation) turns into a NaN, are evidence enough; not
    # where the loss stayed finite at a step its input held as large a share
    # of them or larger (a ReLU output's usual zeros, a loss that takes no log).
    what = "The loss (%s) takes" % loss_fn if loss_fn else "If the loss takes"
    share = li.zeros / max(li.count, 1)
    if li.zeros > 0 and li.harmless_zero_share < share:
        trend = ""
        if li.first_step < ev.step:
            trend = " (%s at step %d)" % (percent(li.first_zero_share), li.first_step)
        return (
            "%s the log of its input: %s held exact zeros at step %d: %s of %s values, %s%s. "
            "log(0) is -Inf, and a cross-entropy that normalises an all-zero row divides 0 by 0. "
            "An output that can be exactly 0 (ReLU, linear) does not fit a log loss: use a softmax or "
            "sigmoid output, or from_logits=True on the loss; an output that is a softmax or sigmoid already "
            "rounded to 0 in float32: compute the loss from its logits (from_logits=True, tf.nn.log_softmax)."
            % (what, li.tag, ev.step, format(li.zeros, ","), format(li.count, ","), percent(share), trend)
        )
    if li.negatives and loss_fn:
        return (
            "%s the log of its input: %s held negative values at step %d: the log of a negative "
            "value is NaN. Use a softmax or sigmoid output, or from_logits=True on the loss."
            % (what, li.tag, ev.step)
        )
    return ""


def _log_loss_scope(op: dict[str, Any] | None) -> str:
    """The library loss the replayed op ran inside, by its name scope
    (``categorical_crossentropy/RealDiv``), where it names one that takes a log; else ""."""
    name = str((op or {}).get("name") or "")
    return next((part for part in name.split("/")[:-1] if _LOG_LOSS.search(part)), "")


def _op_not_broken_by_zeros(ev: Evidence) -> bool:
    """Whether the replay named an op that exact zeros do not make non-finite
    (a Square that overflowed, an Exp): neither a log nor a division. Then
    the zeros of the tensor logged before the loss are no cause."""
    return ev.op is not None and _replayed_family(ev) not in ("log", "div")


def _log_read_zeros_elsewhere(ev: Evidence, li: LossInput) -> bool:
    """Whether the replay's op is a log whose input held exact zeros and is
    not the tensor logged before the loss (a hand-written log(|p - y|) after
    a logged ReLU layer): then the op's own input is the evidence
    (``_by_op``), and the logged tensor's usual zeros are not."""
    if _replayed_family(ev) != "log":
        return False
    inputs = [i for i in ev.op.get("inputs") or [] if isinstance(i, dict)]
    held = [(_count(i.get("count")), _count(i.get("zeros"))) for i in inputs if _count(i.get("zeros"))]
    return bool(held) and (li.count, li.zeros) not in held


def _by_negative_loss(ev: Evidence) -> str:
    n = ev.negative_loss
    if n is None:
        return ""
    what = "%s (%s)" % (n.tag, n.function) if n.function else n.tag
    return (
        "The loss %s was negative at step %d (%s), before the first non-finite value: a cross-entropy is never "
        "below 0 while its targets are in [0, 1], so its targets are outside that domain (e.g. raw 0..255 pixels "
        "without the /255). The loss then has no lower bound and training grows values without end to lower it. "
        "Scale the targets into [0, 1]; the learning rate is not the cause." % (what, n.step, number(n.value))
    )


def _by_trend(ev: Evidence) -> str:
    w = ev.warnings_before
    grew = [k for k in ("fast_growth", "growth", "headroom") if k in w]
    if grew:
        c = w[grew[0]]
        return (
            "Values grew before the first non-finite value (%s, step %d: %s), and growth is the only evidence "
            "the records hold (no op that makes NaN, no loss outside its domain): something keeps scaling them "
            "up, most often a too-large learning rate, also a loss that rewards growth or a layer that does "
            "not normalise. Lower the learning rate or clip gradients, and check the loss."
            % (c["tensor"], c["step"], c["detail"])
        )
    for kind in ("gradient_spike", "exploding_gradient"):
        if kind in w:
            c = w[kind]
            return (
                "The gradient norm jumped before the first non-finite value (step %d: %s): the learning "
                "rate is likely too large for this loss surface. Lower it, or clip gradients "
                "(clip_by_global_norm)." % (c["step"], c["detail"])
            )
    if "overflow_risk" in w:
        c = w["overflow_risk"]
        return (
            "Values were already beyond the safe range before the first non-finite value (%s, step %d: %s): "
            "look at where they come from (a large input, or a layer whose values overflow)."
            % (c["tensor"], c["step"], c["detail"])
        )
    return ""


def _by_depth_growth(ev: Evidence) -> str:
    """An overflow at the end of activations that grew from one to the next
    within the step (a block applied to its own output, a deep stack that
    does not keep its scale): the growth is the cause, the op its last stop.
    Only where the replay's op overflowed: growth beside a NaN that no
    overflow made (an acos beyond [-1, 1]) explains nothing."""
    dg = ev.depth_growth
    if dg is None or ev.op is None or not _overflowed(ev):
        return ""
    per = (dg.last_max / dg.first_max) ** (1.0 / (dg.count - 1))
    return (
        "At step %d the values grew from one logged tensor to the next, %d in a row: %s max |x| %s to %s max |x| "
        "%s (about %s× at each), until they overflowed. A block that amplifies what it is given, applied in "
        "sequence or to its own output, does not keep their scale: normalise inside it (LayerNormalization, or "
        "BatchNormalization in training mode), scale its weights or its residual branch down, or clip its "
        "output." % (ev.step, dg.count, dg.first, number(dg.first_max), dg.last, number(dg.last_max), number(per))
    )


def _by_overflowed_op(ev: Evidence) -> str:
    """The op made Inf, and no NaN, from finite inputs with nothing else to
    say why: its values were too large when they reached it; name them."""
    op, out = ev.op or {}, ev.op_output or {}
    inputs = op.get("inputs")
    if (_count(out.get("nan")) != 0 or not (_count(out.get("posinf")) or _count(out.get("neginf")))
            or not isinstance(inputs, list) or not inputs):
        return ""
    parts = []
    for k, i in enumerate(inputs, 1):
        if not isinstance(i, dict) or any(_count(i.get(c)) != 0 for c in ("nan", "posinf", "neginf")):
            return ""
        name = i.get("name")
        parts.append("input %d%s min %s, max %s" % (
            k, " (%s)" % name if isinstance(name, str) and name else "", _num(i.get("min")), _num(i.get("max"))))
    return (
        "%s (%s) made %s from finite values at step %d: its result went beyond its dtype's range (%s). No "
        "record before it says why its inputs were that large: log the tensors that feed it (the targets and "
        "the batch too, with role=\"input\") to see where they grew, or bound them before it." % (
            op.get("type"), op.get("source") or op.get("name"), _made(out), ev.step, "; ".join(parts)))


def _no_hint(ev: Evidence) -> str:
    checked = ["op type %s" % (ev.info.op_type or "unknown")]
    if ev.info.activation:
        checked.append("function %s" % ev.info.activation)
    checked.append("no warning before it" if not ev.warnings_before else
                   "warnings before it (%s) that suggest no cause" % ", ".join(sorted(ev.warnings_before)))
    li = ev.loss_input
    if ev.info.role == "loss":
        checked.append("no tensor logged before the loss" if li is None
                       else "the loss's input %s (no exact zeros)" % li.tag if not li.zeros
                       else "the loss's input %s (exact zeros, %s; the loss stayed finite with %s before)" % (
                           li.tag, percent(li.zeros / max(li.count, 1)), percent(li.harmless_zero_share)))
    return NO_HINT_PREFIX + "checked " + "; ".join(checked) + "."


def input_range(i: dict[str, Any]) -> str:
    """An op input's range at the failing step, from untrusted JSON:
    "min 0, max 3.3e34, 3,072 exact zeros, of 4,096 values"."""
    words = ["min %s, max %s" % (_num(i.get("min")), _num(i.get("max")))]
    for key, what in (("zeros", "exact zeros"), *NONFINITE_WORDS.items()):
        if _finite(i.get(key)):
            words.append("%s %s" % (count(i[key]), what))
    if _finite(i.get("count")) is not None:
        words.append("of %s values" % count(i["count"]))
    return ", ".join(words)


def _finite(x: Any) -> float | None:
    """A number from untrusted JSON, or None where it is not a finite one
    (an integer beyond a float's range included)."""
    try:
        return x if isinstance(x, (int, float)) and math.isfinite(x) else None
    except OverflowError:
        return None


def _num(x: Any) -> str:
    """A number from untrusted JSON, or "unknown"."""
    return number(x) if isinstance(x, (int, float)) else "unknown"
