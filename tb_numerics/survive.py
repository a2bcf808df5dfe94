"""Surviving an anomaly: skip the step, rewind to a good state, or stop, and say so.

A NaN that appears "only sometimes", after hours, is a sign of instability,
and skipping it without saying why hides the problem. So each policy here
acts and leaves evidence: every skip, rewind and stop is an event written
into the run (``metadata.ACTIONS_TAG``), which the report's ``actions``, the
dashboard's banner and timeline show.

The policies (``OnAnomaly``), shared by ``NumericsCallback(on_anomaly=...)``
and ``tbn.guard(..., on_anomaly=...)``:

* ``"skip"``: the update of a step whose loss or gradients hold a NaN or an
  Inf (or that a spike trigger caught) is not applied, and training goes
  on; after ``max_skips`` such steps in a row the next one escalates to
  ``then`` (``"stop"``, or ``"rewind"``);
* ``"rewind"``: the state is put back to the last good snapshot (weights,
  optimizer slots and step counter, a loss scale), kept on the device every
  ``snapshot_every`` steps, and the learning rate scaled by ``lr_factor``;
  the data goes on (the failed batch is skipped); after ``max_rewinds``
  the next one stops;
* ``"stop"``: training stops with the diagnosis (``stop_on_anomaly=True``).

The optional spike trigger (``Spike``) treats a finite step as an anomaly
where its loss or global gradient norm is more than ``z`` standard
deviations above the mean of the last ``window`` steps, once ``warmup``
steps are in the window: OLMo-core's ``SkipStepOptimizer`` defaults (6 σ
over 128 steps, from 64).

This module needs no TensorFlow: the policy, the decision on
the host, the events' format and the report's words; the readers (the CLI,
the plugin) use it too.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Iterable, Sequence

from tb_numerics import metadata
from tb_numerics.rules import numbers

__all__ = [
    "ACTIONS", "TRIGGERS", "OnAnomaly", "Spike", "Survival", "TrainingStopped", "failed_batches", "parse_event",
    "summarize",
]

ACTIONS = ("skip", "rewind", "stop")
# What made a step an anomaly: a NaN or an Inf in its loss or gradients
# (under a LossScaleOptimizer: in its loss, or its gradients at a scale of
# 1 or less, where scaling down no longer helps); its loss or global
# gradient norm beyond the spike trigger's threshold.
# "listed": a batch the user listed to skip (``skip_batches``: one that
# failed before, so that a resumed run skips it deterministically).
TRIGGERS = ("nonfinite", "loss_spike", "grad_norm_spike", "listed")
_TRIGGER_WORDS = {"nonfinite": ("non-finite step", "non-finite steps"), "loss_spike": ("loss spike", "loss spikes"),
                  "grad_norm_spike": ("gradient-norm spike", "gradient-norm spikes"),
                  "listed": ("listed batch", "listed batches")}
# How many events a report's words list by step before it counts the rest.
_STEPS_SHOWN = 3


def _positive_int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError("%s must be an integer >= %d, got %r" % (name, minimum, value))
    return value


@dataclasses.dataclass(frozen=True)
class Spike:
    """The spike trigger: a finite step whose loss or global gradient norm
    is more than ``z`` standard deviations above the mean of the recent
    steps is handled as an anomaly.

    Args:
      z: the threshold in standard deviations (OLMo-core: 6).
      window: how many recent steps the mean and deviation are of (OLMo-core: 128).
      warmup: the steps in the window before the trigger can fire (by
        default ``window // 2``, as OLMo-core).
      loss, grad_norm: which of the two it watches.
    """

    z: float = 6.0
    window: int = 128
    warmup: int | None = None
    loss: bool = True
    grad_norm: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.z, bool) or not isinstance(self.z, (int, float)) or not 0 < self.z < math.inf:
            raise ValueError("Spike.z must be a positive number of standard deviations, got %r" % (self.z,))
        _positive_int("Spike.window", self.window, 2)
        if self.warmup is not None:
            _positive_int("Spike.warmup", self.warmup, 2)
            if self.warmup > self.window:
                raise ValueError("Spike.warmup (%d) cannot exceed the window (%d)" % (self.warmup, self.window))
        if not (self.loss or self.grad_norm):
            raise ValueError("Spike watches nothing: set loss or grad_norm")

    @property
    def min_steps(self) -> int:
        """Steps in the window before the trigger can fire."""
        return self.warmup if self.warmup is not None else max(2, self.window // 2)


@dataclasses.dataclass(frozen=True)
class OnAnomaly:
    """What to do at a step whose loss or gradients hold a NaN or an Inf.

    Args:
      action: ``"skip"``, ``"rewind"`` or ``"stop"`` (see the module).
      max_skips: with ``"skip"``, how many such steps in a row are skipped
        before the next one escalates to ``then``.
      then: ``"stop"`` or ``"rewind"``: what ``"skip"`` escalates to.
      snapshot_every: with a rewind possible, the snapshot of the state is
        taken after every ``snapshot_every``-th step (where it is finite).
      max_rewinds: how many rewinds before the next anomaly stops training.
      lr_factor: each rewind multiplies the learning rate by it (e.g. 0.5);
        None leaves it.
      spike: a ``Spike`` trigger, or None for NaN and Inf only.
      checkpoint: a Keras ``ModelCheckpoint`` (callback only): rewind to the
        newest file it wrote instead of the snapshot on the device.
    """

    action: str = "stop"
    max_skips: int = 3
    then: str = "stop"
    snapshot_every: int = 100
    max_rewinds: int = 3
    lr_factor: float | None = None
    spike: Spike | None = None
    checkpoint: Any = None

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError("on_anomaly must be one of %s, got %r" % (", ".join(map(repr, ACTIONS)), self.action))
        if self.then not in ("stop", "rewind"):
            raise ValueError("OnAnomaly.then must be 'stop' or 'rewind', got %r" % (self.then,))
        _positive_int("OnAnomaly.max_skips", self.max_skips, 0)
        _positive_int("OnAnomaly.snapshot_every", self.snapshot_every)
        _positive_int("OnAnomaly.max_rewinds", self.max_rewinds, 0)
        f = self.lr_factor
        if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1):
            raise ValueError("OnAnomaly.lr_factor must be in (0, 1], got %r" % (f,))
        if self.spike is not None and not isinstance(self.spike, Spike):
            raise ValueError("OnAnomaly.spike must be a tb_numerics.Spike, got %r" % (self.spike,))

    @classmethod
    def of(cls, spec: "str | OnAnomaly | None") -> "OnAnomaly | None":
        """A policy from what a user passed: a name, a policy, or None."""
        if spec is None or isinstance(spec, OnAnomaly):
            return spec
        if isinstance(spec, str):
            return cls(action=spec)
        raise ValueError("on_anomaly must be 'skip', 'rewind', 'stop' or a tb_numerics.OnAnomaly, got %r" % (spec,))

    @property
    def may_rewind(self) -> bool:
        """Whether a rewind can happen (a snapshot must then be kept)."""
        return self.max_rewinds > 0 and (self.action == "rewind" or (self.action == "skip" and self.then == "rewind"))


class TrainingStopped(RuntimeError):
    """Raised by ``tbn.guard``'s step where its ``on_anomaly`` policy stops
    training (a custom loop has no ``stop_training`` to set): the message
    says why and where; ``event`` is the stop event written into the run."""

    def __init__(self, message: str, event: dict[str, Any]):
        super().__init__(message)
        self.event = event


class Survival:
    """The policy's decisions, step after step, on the host.

    Args:
      policy: the policy.
    """

    def __init__(self, policy: OnAnomaly):
        self.policy = policy
        self.in_a_row = 0  # anomalies in a row handled by skipping
        self.rewinds = 0
        self.stopped = False

    def decide(self) -> tuple[str, str]:
        """The action at an anomaly whose update was held back, and why in words."""
        p = self.policy
        self.in_a_row += 1
        if p.action == "stop":
            return self._stop("on_anomaly is 'stop'")
        if p.action == "skip" and self.in_a_row <= p.max_skips:
            return "skip", ""
        escalated = p.action == "skip"
        why = "%d anomalous steps in a row (at most %d skipped)" % (self.in_a_row, p.max_skips) if escalated else ""
        if (p.action == "rewind" or p.then == "rewind") and self.rewinds < p.max_rewinds:
            self.rewinds += 1
            self.in_a_row = 0
            return "rewind", why
        if p.action == "rewind" or p.then == "rewind":
            return self._stop("%s%d rewinds already (at most %d)" % (why + "; " if why else "", self.rewinds,
                                                                     p.max_rewinds))
        return self._stop(why)

    def _stop(self, why: str) -> tuple[str, str]:
        self.stopped = True
        return "stop", why

    def healthy(self) -> None:
        """A step whose update was applied: the run of anomalies ends."""
        self.in_a_row = 0


# ---------------------------------------------------------------- events on disk


def encode_event(event: dict[str, Any]) -> bytes:
    """An event's bytes as written (``metadata.ACTIONS_TAG``'s string tensor)."""
    return json.dumps(event, sort_keys=True, allow_nan=False, default=_plain).encode("utf-8")


def _plain(x: Any) -> Any:
    try:
        return float(x)
    except (TypeError, ValueError):
        return str(x)


def parse_event(data: bytes, step: int) -> dict[str, Any] | None:
    """An event read from a log (untrusted): a dict with a valid action and
    trigger, its step the record's; None where it is not one (nor JSON
    ``metadata.parse_json`` reads: too deep, an integer beyond 64 bits)."""
    try:
        event = metadata.parse_json(bytes(data), "an action")
    except (metadata.FormatError, TypeError):
        return None
    if not isinstance(event, dict) or event.get("action") not in ACTIONS or event.get("trigger") not in TRIGGERS:
        return None
    event["step"] = int(step)
    for key in ("epoch", "batch"):
        if type(event.get(key)) is not int:
            event[key] = None
    return event


def summarize(events: Iterable[dict[str, Any]], first_anomaly: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The report's ``actions``: every event in step order, the counts, the
    batches that failed (for a resumed run to skip) and the words; None
    where the run has no event.

    Args:
      events: the run's events (``parse_event``).
      first_anomaly: the run's first anomaly (``analysis.first_anomaly``):
        the event at its step gets its hint, and its op where the event has none.
    """
    events = sorted(events, key=lambda e: e["step"])
    if not events:
        return None
    for e in events:
        if first_anomaly is not None and e["step"] == first_anomaly.get("step"):
            e.setdefault("hint", first_anomaly.get("hint"))
            if not isinstance(e.get("op"), dict) and isinstance(first_anomaly.get("op"), dict):
                e["op"] = first_anomaly["op"]
    skips = [e for e in events if e["action"] == "skip"]
    rewinds = [e for e in events if e["action"] == "rewind"]
    stop = next((e for e in events if e["action"] == "stop"), None)
    failed = [{"step": e["step"], "epoch": e["epoch"], "batch": e["batch"]} for e in events]
    return {"events": events, "skipped": len(skips), "rewinds": len(rewinds), "stopped": stop is not None,
            "stopped_at": None if stop is None else stop["step"], "failed_batches": failed,
            "words": words(skips, rewinds, stop)}


def failed_batches(run_dir: str) -> list[tuple[int, int]]:
    """The (epoch, batch) of every step a training in ``run_dir`` acted on,
    for ``NumericsCallback(skip_batches=...)`` to skip them when the run is
    resumed or trained again (with the same data order).

    Args:
      run_dir: the run's log directory (the callback's ``log_dir``).
    """
    from tb_numerics import event_reader

    rr = event_reader.read_run(".", event_reader.find_runs(run_dir).get(".", []))
    return sorted({(e["epoch"], e["batch"]) for e in rr.actions if e["epoch"] is not None and e["batch"] is not None})


def words(skips: Sequence[dict], rewinds: Sequence[dict], stop: dict | None) -> str:
    """E.g. "survived 3 non-finite steps (skipped), 1 rewind at step 4,200
    with lr × 0.5; stopped at step 5,000: 3 rewinds already (at most 3)"."""
    parts = []
    if skips:
        by = {}
        for e in skips:
            by[e["trigger"]] = by.get(e["trigger"], 0) + 1
        parts.append(" and ".join("%s %s" % (numbers.count(n), _TRIGGER_WORDS[t][n != 1])
                                  for t, n in sorted(by.items(), key=lambda tn: TRIGGERS.index(tn[0]))) + " (skipped)")
    if rewinds:
        steps = ", ".join(numbers.count(e["step"]) for e in rewinds[:_STEPS_SHOWN])
        more = " and %d more" % (len(rewinds) - _STEPS_SHOWN) if len(rewinds) > _STEPS_SHOWN else ""
        text = "%d rewind%s at step%s %s%s" % (len(rewinds), "" if len(rewinds) == 1 else "s",
                                               "" if len(rewinds) == 1 else "s", steps, more)
        factor = _lr_factor_in_all(rewinds)
        if factor is not None:
            text += " with lr × %s" % numbers.number(factor) if len(rewinds) == 1 else \
                ", lr × %s in all" % numbers.number(factor)
        parts.append(text)
    head = "survived " + ", ".join(parts) if parts else ""
    if stop is None:
        return head
    reason = ": " + str(stop["reason"]) if stop.get("reason") else ""
    tail = "stopped at step %s%s" % (numbers.count(stop["step"]), reason)
    return head + "; " + tail if head else tail


def _lr_factor_in_all(rewinds: Sequence[dict]) -> float | None:
    factors = [e.get("lr_factor") for e in rewinds]
    if not any(isinstance(f, (int, float)) and not isinstance(f, bool) for f in factors):
        return None
    total = 1.0
    for f in factors:
        if isinstance(f, (int, float)) and not isinstance(f, bool) and 0 < f <= 1:
            total *= f
    return total
