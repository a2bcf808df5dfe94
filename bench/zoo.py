"""A fault-injection zoo: does tb-numerics find the step, the op and the line an oracle finds?

    nice -n 19 .venv/bin/python bench/zoo.py [--jobs 2] [--arch A,B] [--fault F,G] [--slice ci] [--json OUT]

Each cell is an architecture of ``bench/zoo_models.py`` (a BatchNorm CNN,
residual blocks, a Transformer encoder under mixed_float16, a GRU, a VAE,
a GAN with two optimizers, an embedding model, a hand-written loop) with
one injected fault, and its fixed variant (the same code with the fault's
parameter off). Each run is its own subprocess (a crash is recorded, not
fatal):

* the oracle: the fault variant with ``tf.debugging.enable_check_numerics()``:
  its error names the first bad op's type and the stack that created it
  (the innermost line of ``zoo_models.py`` is the user's line), and the
  step is counted by the training loop, or by a callback at each batch's
  start. For ``model.fit`` the failing step is run again eagerly, so that
  the first op in program order decides. Under a ``LossScaleOptimizer``
  the graph runs unchecked (checks change its float16 numerics) and each
  step is checked eagerly first, from the same state; a backward overflow
  that the loss scale handles (it skips the step and lowers its scale) is
  noted, not taken for the failure. Nothing of tb-numerics runs in it. Where that step's input batch already holds a
  NaN (checked in numpy), the truth has no model op;
* the product: the same code under tb-numerics (``NumericsCallback()``
  with its defaults for ``model.fit``; ``log_numerics``/``log_gradients``
  under ``tbn.guard`` for the loop), then ``tb-numerics report --json``;
* the product on the fixed variant (its warnings are false warnings), and
  with ``--check-fixed`` the oracle on it (which must not fire: a fixed
  variant that still makes a NaN is a broken cell, reported as such).

It prints per cell and in total: step exact (the report's first anomaly
step is the oracle's), op type (``first_anomaly.op.type`` is the oracle's,
where the truth is a model op), source line (``op.source``'s file:line is
the oracle's, where the truth is a forward or update op: for a gradient op
check_numerics names the ``tape.gradient`` line while tb-numerics names
the forward op's, so those are not scored), crash (the training died, or
the replay raised), hint (right / absent / wrong, by fault kind in
``HINT_WORDS``), the first warning's lead (steps before the oracle's
step) where the loss grew 10x in magnitude over some 10 steps before
the NaN (rising at 8 of them), and the fixed variants' warnings
(each a false warning).

``--slice ci`` runs four cells without ``--check-fixed`` (tests/test_zoo_slice.py).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
USER_FILE = os.path.join(HERE, "zoo_models.py")

# What a right hint must name, by fault kind: a regular expression (case-insensitive)
# of the cause's words, written once per kind, never per cell.
HINT_WORDS = {
    "lr100": r"learning rate",
    "reward": r"rewards? growth|no lower bound|unbounded below",
    "unscaled": r"\binputs?\b.*\b(normali[sz]|standardi[sz]|scale)|unscaled|raw units",
    "nan_batch": r"input pipeline|input batch|\bdata(set)?\b|validate .*inputs?",
    "no_eps": r"\beps(ilon)?\b|division by zero|divides by zero|0/0",
    "fp16": r"float16|loss scal|mixed precision",
    "log_softmax": r"log_softmax|softmax_cross_entropy|from_logits|log_sigmoid|with_logits",
    "div_stat": r"division by zero|divides by zero|0/0|\beps(ilon)?\b|denominator",
    "exp_out": r"\bexp\b|exponential",
    "adam_eps0": r"\beps(ilon)?\b",
}
CI_SLICE = (("loop", "div_stat"), ("cnn_bn", "nan_batch"), ("gru", "no_eps"), ("transformer", "lr100"))
NO_HINT = "no hint: "


# ------------------------------------------------------------------ one run (in its subprocess)


def _loss_log(hook: Any) -> Any:
    """A Keras callback that appends each step's own loss to ``hook.losses`` (from Keras' logs,
    not from tb-numerics) and calls ``hook.step_begins()`` as each step begins."""
    import keras

    class _LossLog(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.mean, self.k = 0.0, 0

        def on_train_batch_begin(self, batch, logs=None):
            hook.step_begins()

        def on_train_batch_end(self, batch, logs=None):
            logged = float((logs or {}).get("loss", float("nan")))
            # The built-in train_step logs the mean of the epoch's losses so far: its k-th
            # value is (k + 1) * mean_k - k * mean_(k-1). A custom train_step logs its own.
            loss = (self.k + 1) * logged - self.k * self.mean if hook.running_mean else logged
            self.mean, self.k = logged, self.k + 1
            hook.losses.append(loss)

    return _LossLog()


class OracleHook:
    """The oracle's side of a training: counts steps and logs nothing."""

    def __init__(self) -> None:
        self.step = -1
        self.losses: list[float] = []  # each step's own loss
        self.skips: list[dict] = []  # loss-scale skips stepped over (see ``fit``)
        self.running_mean = False  # whether Keras logs the loss as the epoch's running mean
        self.eager = False  # whether the truth comes from an eager pass of the failing step
        self.state: list = []  # the model's and its optimizers' variables (``fit``)
        self.saved: list = []  # their values as the current step began
        self.pending: dict | None = None  # a backward overflow of the step being run (``_shadow_fit``)
        self.callbacks = [_loss_log(self)]

    def step_begins(self) -> None:
        self.step += 1
        self.saved = [v.numpy() for v in self.state]

    def fit(self, model: Any, data: Any) -> None:
        """``model.fit`` under check_numerics; under a ``LossScaleOptimizer``, each step checked
        eagerly beside a plain graph (``_shadow_fit``)."""
        import keras

        self.running_mean = _logs_running_mean(model)
        optimizers = {id(o): o for o in [model.optimizer, *vars(model).values()]
                      if isinstance(o, keras.optimizers.Optimizer)}
        if not model.optimizer.built:  # as fit would: its slots (and a loss scale) are state too
            model.optimizer.build(model.trainable_variables)
        self.state = list(model.variables) + [v for o in optimizers.values() for v in o.variables]
        if isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer):
            return self._shadow_fit(model, data)
        try:
            model.fit(data, epochs=1, verbose=0, callbacks=self.callbacks)
        except Exception as e:  # noqa: BLE001 - the oracle's own error
            if not _OP.search(str(e)):
                raise
            raise self._eager_pass(model, data, e) from e
        return None

    def _shadow_fit(self, model: Any, data: Any) -> None:
        """Under a ``LossScaleOptimizer`` (mixed_float16), ``model.fit`` runs its graph without
        the checks, and each step is first run eagerly under check_numerics, from the same state,
        which is then put back. check_numerics in the graph changes its float16 numerics (the
        Transformer's loss differed from the plain graph's at step 0, and its skips came at other
        steps), so the checked graph would not follow the user's training. A float16 backward op
        that overflows is not the failure: the optimizer skips that step's update and halves its
        scale, which is how it calibrates (TRAPS.md); such a step is noted (``skips``, with
        whether the graph's step skipped too), and the training goes on. The truth is the first
        forward (or update) op to go bad, or, where no applied step follows a run of skips (or
        the scale fell below 1), the first skip of that run: loss scaling could not handle it.
        """
        import keras
        import tensorflow as tf

        tf.debugging.disable_check_numerics()  # the graph runs as the user's does
        batches = list(data)
        metrics = [v for m in model.metrics for v in m.variables]
        hook, opt = self, model.optimizer

        class _Shadow(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                hook.pending = None
                kept = [v.numpy() for v in metrics]
                tf.debugging.enable_check_numerics()
                try:
                    model.train_step(batches[hook.step])
                except Exception as e:  # noqa: BLE001 - check_numerics' error, or not ours
                    if not _OP.search(str(e)) or _phase(e, _creation_frames(e)) != "backward":
                        hook.eager = True
                        raise
                    hook.pending = {"step": hook.step, "error": e, "scale": float(opt.dynamic_scale.numpy()),
                                    "before": int(opt.iterations.numpy())}
                finally:
                    tf.debugging.disable_check_numerics()
                    for v, value in [*zip(hook.state, hook.saved), *zip(metrics, kept)]:
                        v.assign(value)

            def on_train_batch_end(self, batch, logs=None):
                if hook.pending is not None:
                    before = hook.pending.pop("before")
                    hook.skips.append(dict(hook.pending, skipped=int(opt.iterations.numpy()) == before))

        model.fit(data, epochs=1, verbose=0, callbacks=[*self.callbacks, _Shadow()])

    def _eager_pass(self, model: Any, data: Any, e: BaseException) -> BaseException:
        """The error of the failing step run again eagerly under check_numerics (each op checked
        as it runs, in program order), where it fires at the same step; else ``e``.

        In a graph, the first check to raise is not always the first bad op's: gru:no_eps named
        the GRU's MatMul, no user line, while the NaN is born in InputNorm's RealDiv before it.
        The variables are put back as the step began: ops of the graph that did not wait for the
        failed check (an optimizer's update) may have run.
        """
        k = self.step
        for v, value in zip(self.state, self.saved):
            v.assign(value)
        model.run_eagerly, model.train_function = True, None
        self.step = k - 1
        try:
            model.fit(data.skip(k).take(1), epochs=1, verbose=0, callbacks=self.callbacks)
        except Exception as eager:  # noqa: BLE001 - the eager oracle's error is the result
            if _OP.search(str(eager)) and self.step == k:
                self.eager = True
                return eager
        self.step = k
        return e

    def unhandled_skip(self) -> tuple[int, BaseException] | None:
        """A skip that loss scaling did not handle, as (step, error): the first at a scale
        below 1, or the first of a run of skips that ends the training (no applied step after
        it); None where every skip was handled."""
        run: list[dict] = []
        for s in self.skips:
            if not s["skipped"] or (run and s["step"] != run[-1]["step"] + 1):
                run = []
            if s["skipped"]:
                run.append(s)
        low = next((s for s in self.skips if s["skipped"] and s["scale"] < 1), None)
        last = run[0] if run and run[-1]["step"] >= self.step else None
        bad = low or last
        return (bad["step"], bad["error"]) if bad else None

    def begin_step(self, step: int) -> None:
        self.step = step

    def log(self, name: str, tensor: Any) -> None:
        pass

    def log_gradients(self, grads: Any, variables: Any) -> None:
        pass

    def guarded(self, step_fn: Any, optimizer: Any) -> Any:
        return step_fn

    def stepped(self, loss: Any) -> None:
        self.losses.append(float(loss))

    def writing(self):
        return contextlib.nullcontext()


def _logs_running_mean(model: Any) -> bool:
    """Whether ``model.fit`` logs the loss as the epoch's running mean (the built-in train_step)."""
    return "train_step" not in type(model).__dict__


class ProductHook:
    """tb-numerics' side: the callback for model.fit, log_numerics and a replay for the loop."""

    def __init__(self, logdir: str) -> None:
        import tensorflow as tf

        import tb_numerics as tbn
        from tb_numerics.keras import NumericsCallback

        self.tf, self.tbn = tf, tbn
        self.losses: list[float] = []  # each step's own loss (Keras' logs), for ``damaged``
        self.running_mean = False
        self.callbacks = [NumericsCallback(logdir), _loss_log(self)]
        self.writer = tf.summary.create_file_writer(logdir)
        self.step_var = tf.Variable(0, dtype=tf.int64, trainable=False)

    def fit(self, model: Any, data: Any) -> None:
        self.running_mean = _logs_running_mean(model)
        model.fit(data, epochs=1, verbose=0, callbacks=self.callbacks)

    def step_begins(self) -> None:
        pass

    def begin_step(self, step: int) -> None:
        self.step_var.assign(step)

    def log(self, name: str, tensor: Any) -> None:
        self.tbn.log_numerics(name, tensor)

    def log_gradients(self, grads: Any, variables: Any) -> None:
        self.tbn.log_gradients(grads, variables)

    def guarded(self, step_fn: Any, optimizer: Any) -> Any:
        """The step under ``tbn.guard``, as the README tells a custom loop to
        run: a step whose gradients or logged loss are not finite is held
        back, the first one replayed at op level."""
        return self.tbn.guard(optimizer)(step_fn)

    def stepped(self, loss: Any) -> None:
        self.losses.append(float(loss))

    @contextlib.contextmanager
    def writing(self):
        with self.writer.as_default(step=self.step_var):
            yield
        self.writer.close()


_OP = re.compile(r'in output \d+ of (eagerly-executing|graph) op "([^"]+)"')
_FRAME = re.compile(r"\+ (\S+) \(L(\d+)\) (\S+)")  # a frame of a graph op's creation stack
_NODE = re.compile(r"\{\{node ([^}]+)\}\}")


def _creation_frames(e: BaseException) -> list[tuple[str, int, str]]:
    """(file, line, function) of the bad op's creation: from the message for a graph op
    (check_numerics prints that stack), from the traceback for an eager op."""
    text = str(e)
    if _OP.search(text).group(1) == "graph":
        return [(f, int(n), fn) for f, n, fn in _FRAME.findall(text)]
    return [(f.filename, f.lineno, f.name) for f in traceback.extract_tb(e.__traceback__)]


def _user_frame(frames: list[tuple[str, int, str]]) -> str | None:
    """``zoo_models.py:LINE (function)`` of the innermost frame of the user's code."""
    mine = [f for f in frames if os.path.basename(f[0]) == "zoo_models.py"]
    return "zoo_models.py:%d (%s)" % mine[-1][1:] if mine else None


def _phase(e: BaseException, frames: list[tuple[str, int, str]]) -> str:
    node = _NODE.search(str(e))
    names = {(os.path.basename(f), fn) for f, _, fn in frames}
    if (node and node.group(1).startswith("gradient_tape/")) or ("backprop.py", "gradient") in names:
        return "backward"
    if any("optimizer" in f and fn in ("apply", "apply_gradients") for f, fn in names):
        return "update"
    return "forward"


def _input_bad_step(arch: str, fault: str, fixed: bool) -> int | None:
    """The first batch whose inputs hold a NaN or an Inf, from the data itself."""
    import numpy as np

    import zoo_models

    x, _ = zoo_models.make_data(zoo_models.ARCHS[arch], fault, fixed)
    bad = ~np.isfinite(x.reshape(zoo_models.STEPS, -1).astype("float64")).all(axis=1)
    return int(np.argmax(bad)) if bad.any() else None


def run_oracle(arch: str, fault: str, fixed: bool) -> dict:
    """The truth: where tf.debugging.enable_check_numerics stops the training.

    The tf.functions stay traced (eagerly the CNN's 40 steps took 123 s, not 10 s): each op's
    output is checked in the graph and the error carries its creation stack. In a graph the first
    check to raise is not always the first bad op's, so for ``model.fit`` the failing step is run
    once more eagerly, its ops checked in program order (``OracleHook._eager_pass``; ``eager`` in
    the result says it decided). Under a loss scale, each step is checked eagerly beside an
    unchecked graph, and the backward overflows the scale handles are noted
    (``OracleHook._shadow_fit``; ``handled_skips``). LIMIT: the hand-written loop's step stays a graph.
    """
    import tensorflow as tf

    import keras
    import zoo_models

    # Keep Keras' and TensorFlow's own frames in an eager op's traceback: the
    # optimizer's frames are what tell an update op from a forward one (``_phase``).
    keras.config.disable_traceback_filtering()
    tf.debugging.disable_traceback_filtering()
    tf.debugging.enable_check_numerics()
    hook = OracleHook()
    out: dict[str, Any] = {"fired": False, "input_bad_step": _input_bad_step(arch, fault, fixed)}
    failure: tuple[int, BaseException] | None = None
    try:
        zoo_models.train(arch, fault, fixed, hook)
    except Exception as e:  # noqa: BLE001 - the oracle's error is the result
        failure = (hook.step, e)
    finally:
        out["losses"] = hook.losses
    skip = hook.unhandled_skip()
    if skip is not None and (failure is None or skip[0] <= failure[0]):
        failure = skip
    out["handled_skips"] = [s["step"] for s in hook.skips if s["skipped"]]
    out["eager"] = hook.eager
    if failure is not None:
        out.update(_truth(*failure))
    return out


def _truth(step: int, e: BaseException) -> dict:
    """The oracle's verdict from check_numerics' error at ``step``."""
    m = _OP.search(str(e))
    if m is None:
        return {"error": "%s: %s" % (type(e).__name__, str(e)[:400])}
    frames = _creation_frames(e)
    node = _NODE.search(str(e))
    return {"fired": True, "step": step, "op_type": m.group(2), "source": _user_frame(frames),
            "phase": _phase(e, frames), "node": node.group(1) if node else None}


def run_product(arch: str, fault: str, fixed: bool, logdir: str) -> dict:
    """Trains under tb-numerics, then ``tb-numerics report --json`` on its logdir (in this
    process, which has TensorFlow imported already: a subprocess would import it again)."""
    import io

    import zoo_models
    from tb_numerics import cli

    hook = ProductHook(logdir)
    zoo_models.train(arch, fault, fixed, hook)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli.main(["report", "--json", logdir])
    return {"rc": rc, "runs": json.loads(buf.getvalue())["runs"] if buf.getvalue().strip() else [],
            "losses": hook.losses}


def _cell_main(args: argparse.Namespace) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.path.insert(0, HERE)
    sys.path.insert(0, ROOT)
    import tensorflow as tf

    tf.config.experimental.enable_op_determinism()
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    arch, fault = args._cell.split(":")
    fixed = args.variant == "fixed"
    out = run_oracle(arch, fault, fixed) if args.mode == "oracle" else run_product(arch, fault, fixed, args.logdir)
    with open(args.result, "w") as f:
        json.dump(out, f)
    return 0


# ------------------------------------------------------------------ the parent: spawn, read, score


def _spawn(cell: tuple[str, str], variant: str, mode: str, workdir: str) -> dict:
    """One run in its own subprocess; the product's report is read by ``tb-numerics report --json``."""
    name = "%s-%s-%s-%s" % (cell[0], cell[1], variant, mode)
    logdir, result = os.path.join(workdir, name), os.path.join(workdir, name + ".json")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
               TF_CPP_MIN_LOG_LEVEL="2")
    cmd = [sys.executable, os.path.abspath(__file__), "--_cell", "%s:%s" % cell, "--variant", variant,
           "--mode", mode, "--logdir", logdir, "--result", result]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    out: dict[str, Any] = {"seconds": round(time.time() - t0, 1)}
    if p.returncode != 0 or not os.path.exists(result):
        out.update(crash=True, error=(p.stderr or p.stdout)[-1500:])
        return out
    with open(result) as f:
        out.update(json.load(f))
    if mode == "product":
        runs = out.pop("runs", [])
        out["report"] = runs[0] if len(runs) == 1 else None
        out["report_error"] = None if len(runs) == 1 else "report: %d runs, rc %s" % (len(runs), out.get("rc"))
    return out


def run_cell(cell: tuple[str, str], workdir: str, fixed_oracle: bool = True) -> dict:
    """The oracle and the product on the fault variant, the product on the fixed variant, and
    (``fixed_oracle``) the oracle on it too."""
    runs = {"oracle": _spawn(cell, "fault", "oracle", workdir), "product": _spawn(cell, "fault", "product", workdir),
            "fixed_product": _spawn(cell, "fixed", "product", workdir)}
    if fixed_oracle:
        runs["fixed_oracle"] = _spawn(cell, "fixed", "oracle", workdir)
    return score_cell(cell, runs)


def _line(source: str | None) -> str | None:
    """``file.py:LINE`` of a ``path/file.py:LINE (function)`` source."""
    m = re.search(r"([^/\\\s]+\.py):(\d+)", source or "")
    return "%s:%s" % m.groups() if m else None


def hint_verdict(fault: str, anomaly: dict | None) -> str:
    """right / absent / wrong: whether the hint names the fault kind's cause (``HINT_WORDS``)."""
    hint = (anomaly or {}).get("hint") or ""
    if anomaly is None or not hint or hint.startswith(NO_HINT):
        return "absent"
    return "right" if re.search(HINT_WORDS[fault], hint, re.IGNORECASE) else "wrong"


def _grew(losses: list[float], step: int) -> bool:
    """The loss grew 10x in magnitude over 10 steps, rising at 8 of them at least, somewhere
    before ``step`` (a divergence, not one jump; a loss with no lower bound grows towards -inf).
    The growth need not end at ``step``: under a loss scale, the steps it skips hold the weights
    between the growth and the overflow (the Transformer's growth-rewarding loss grew 27x over
    steps 0 to 17 and overflowed at step 21)."""
    for end in range(11, min(step, len(losses)) + 1):
        window = [abs(x) for x in losses[end - 11:end]]
        rises = sum(b > a for a, b in zip(window, window[1:]))
        if window[0] > 0 and window[-1] >= 10 * window[0] and rises >= 8:
            return True
    return False


TRIGGER_STEP = 12  # zoo_models.TRIGGER_STEP: the batch that holds a fault's trigger


def damaged(losses: list[float]) -> bool:
    """Whether a fixed variant's training did not come back from its trigger: each step's loss
    over its last 10 steps (from Keras' logs, not from tb-numerics) is 3x or more its loss over
    the 10 steps before the trigger, or not finite. A healthy training ends no worse than that,
    and warnings on a damaged one are true (an outlier count of 1e6 wrecks a softplus head too)."""
    if len(losses) < TRIGGER_STEP + 10:
        return False
    before = [abs(x) for x in losses[TRIGGER_STEP - 10:TRIGGER_STEP]]
    after = [abs(x) for x in losses[-10:]]
    if not all(map(math.isfinite, before + after)):
        return True
    return sum(after) >= 3 * sum(before)


def score_cell(cell: tuple[str, str], runs: dict) -> dict:
    """One cell's scores; ``None`` where a score does not apply to it."""
    truth, prod = runs["oracle"], runs["product"]
    rep = prod.get("report") or {}
    fa = rep.get("first_anomaly")
    op = (fa or {}).get("op") or {}
    replay = (fa or {}).get("replay") or {}
    valid = bool(truth.get("fired"))
    input_truth = valid and truth.get("input_bad_step") == truth.get("step")
    model_op = valid and not input_truth
    line_truth = model_op and truth.get("phase") != "backward" and truth.get("source") is not None
    fw = rep.get("first_warning")
    # The warning's lead on the truth's step: before the first non-finite value, not the product's.
    lead = (truth["step"] - fw["step"] if valid and fw and fw.get("step") is not None and fw["step"] <= truth["step"]
            else None)
    s = {
        "arch": cell[0], "fault": cell[1], "valid": valid, "truth": truth, "input_truth": input_truth,
        "product": {"step": (fa or {}).get("step"), "tensor": (fa or {}).get("tensor"), "op_type": op.get("type"),
                    "source": op.get("source"), "replay": replay or None, "hint": (fa or {}).get("hint"),
                    "first_warning": fw, "report_error": prod.get("report_error"), "error": prod.get("error")},
        "died": bool(prod.get("crash")),  # the training under tb-numerics raised or its process died
        "crash": bool(prod.get("crash")) or "raised" in str(replay.get("why", "")),
        "report": bool(rep),
        "step_exact": valid and fa is not None and fa["step"] == truth["step"],
        "op_type": (op.get("type") == truth.get("op_type")) if model_op else None,
        "source_line": (_line(op.get("source")) == _line(truth.get("source"))) if line_truth else None,
        "hint": hint_verdict(cell[1], fa),
        "grew": valid and _grew(truth.get("losses", []), truth["step"]),
        "lead": lead,
    }
    frep = runs["fixed_product"].get("report") or {}
    s["fixed_crash"] = bool(runs["fixed_product"].get("crash"))
    s["fixed_report"] = bool(frep)
    s["fixed_damaged"] = damaged(runs["fixed_product"].get("losses") or [])
    s["false_warnings"] = len(frep.get("warnings") or []) + (1 if frep.get("first_anomaly") else 0)
    s["fixed_oracle_fired"] = runs["fixed_oracle"].get("fired") if "fixed_oracle" in runs else None
    return s


# ------------------------------------------------------------------ totals and printing


def cells(archs: list[str] | None = None, faults: list[str] | None = None) -> list[tuple[str, str]]:
    """Every (architecture, fault) cell of the zoo, filtered, each architecture's first fault first."""
    import zoo_models

    chosen = [(i, n, a.name, f) for n, a in enumerate(zoo_models.ARCHS.values()) for i, f in enumerate(a.faults)
              if (not archs or a.name in archs) and (not faults or f in faults)]
    return [(a, f) for _, _, a, f in sorted(chosen)]  # round robin: an interrupted zoo has seen every arch


def _share(xs: list[bool]) -> str:
    return "%d/%d (%.0f %%)" % (sum(xs), len(xs), 100 * sum(xs) / len(xs)) if xs else "0/0"


def totals(scores: list[dict]) -> dict:
    """The zoo's figures against the targets of issues 25 and 26."""
    valid = [s for s in scores if s["valid"]]
    fixed = scores
    healthy = [s for s in fixed if not s.get("fixed_damaged")]
    hints = [s["hint"] for s in valid]
    grew = [s for s in valid if s["grew"]]
    return {
        "cells": len(scores), "valid": len(valid), "oracle_silent": [s["arch"] + ":" + s["fault"] for s in scores
                                                                     if not s["valid"]],
        "step_exact": _share([s["step_exact"] for s in valid]),
        "op_type": _share([s["op_type"] for s in valid if s["op_type"] is not None]),
        "source_line": _share([s["source_line"] for s in valid if s["source_line"] is not None]),
        "input_cells_step_exact": _share([s["step_exact"] for s in valid if s["input_truth"]]),
        "crashes": sum(s["crash"] for s in scores),
        "no_report": [s["arch"] + ":" + s["fault"] for s in scores if not s["report"] or not s["fixed_report"]],
        "hints": {k: hints.count(k) for k in ("right", "absent", "wrong")},
        "lead_10": _share([s["lead"] is not None and s["lead"] >= 10 for s in grew]),
        "false_warnings": "%d in %d of %d fixed variants" % (
            sum(s["false_warnings"] for s in healthy), sum(bool(s["false_warnings"]) for s in healthy), len(healthy)),
        # Fixed variants whose training the trigger damaged (``damaged``): their warnings are true.
        "damaged_fixed": {s["arch"] + ":" + s["fault"]: s["false_warnings"] for s in fixed if s.get("fixed_damaged")},
        "fixed_crashes": sum(s.get("fixed_crash", False) for s in fixed),
        "fixed_oracle_fired": [s["arch"] + ":" + s["fault"] for s in fixed if s.get("fixed_oracle_fired")],
    }


def _mark(v: bool | None) -> str:
    return "-" if v is None else ("yes" if v else "NO")


def print_cell(s: dict) -> None:
    t, p = s["truth"], s["product"]
    truth = ("step %s %s %s %s" % (t.get("step"), "input" if s["input_truth"] else t.get("op_type"), t.get("phase"),
                                   t.get("source")) if s["valid"] else "oracle silent %s" % t.get("error", ""))
    print("%-12s %-11s truth: %s" % (s["arch"], s["fault"], truth))
    print("%25s product: step %s %s %s %s" % ("", p["step"], p["tensor"], p["op_type"], p["source"]))
    extra = " replay: %s" % p["replay"] if p["replay"] and not p["replay"].get("reproduced", True) else ""
    print("%25s step %s, op %s, line %s, crash %s, hint %s, lead %s%s, fixed: %s warnings%s%s%s" % (
        "", _mark(s["step_exact"]), _mark(s["op_type"]), _mark(s["source_line"]), "YES" if s["crash"] else "no",
        s["hint"], s["lead"], " (grew)" if s["grew"] else "", s.get("false_warnings", "-"),
        " (its training damaged: true warnings)" if s.get("fixed_damaged") else "",
        ", ORACLE FIRED ON FIXED" if s.get("fixed_oracle_fired") else "", extra), flush=True)
    if p.get("error"):
        print("%25s crash: %s" % ("", p["error"].strip().splitlines()[-1:]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="", help="comma-separated architectures (default: all)")
    p.add_argument("--fault", default="", help="comma-separated fault kinds (default: all)")
    p.add_argument("--cells", default="", help="comma-separated ARCH:FAULT cells (instead of --arch/--fault)")
    p.add_argument("--slice", choices=["ci"], default=None, help="ci: %s" % ", ".join(map(":".join, CI_SLICE)))
    p.add_argument("--jobs", type=int, default=2, help="cells run at once")
    p.add_argument("--json", default=None, help="write every cell's scores and the totals here")
    p.add_argument("--check-fixed", action="store_true",
                   help="run the oracle on each fixed variant too (it must not fire): one more run a cell")
    p.add_argument("--workdir", default=None, help="where the runs' logdirs go (default: a temporary folder)")
    p.add_argument("--_cell", help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--logdir", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._cell:
        return _cell_main(args)
    sys.path.insert(0, HERE)
    chosen = list(CI_SLICE) if args.slice == "ci" else [tuple(c.split(":")) for c in args.cells.split(",") if c] or cells(
        [a for a in args.arch.split(",") if a], [f for f in args.fault.split(",") if f])
    workdir = args.workdir or tempfile.mkdtemp(prefix="zoo_")
    os.makedirs(workdir, exist_ok=True)  # a run's result file goes there before any logdir exists
    t0 = time.time()
    scores: list[dict] = []
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        for s in pool.map(lambda c: run_cell(c, workdir, fixed_oracle=args.check_fixed), chosen):
            print_cell(s)
            scores.append(s)
            _write(args.json, scores, t0)  # so that an interrupted zoo leaves what it measured
    tot = _write(args.json, scores, t0)
    print(json.dumps(tot, indent=1))
    return 0


def _write(path: str | None, scores: list[dict], t0: float) -> dict:
    tot = dict(totals(scores), seconds=round(time.time() - t0))
    if path:
        with open(path, "w") as f:
            json.dump({"cells": scores, "totals": tot}, f, indent=1)
    return tot


if __name__ == "__main__":
    sys.exit(main())
