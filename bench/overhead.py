"""What logging numerics costs a training step, side by side in one run.

    python bench/overhead.py [--modes plain,numerics,histogram] [--steps 10] [--reps 15]

Each mode is a training step (``tf.function``) of the same MLP: 6 Dense
layers of 1024 units with ReLU, batch 512, SGD. The modes run interleaved,
``--steps`` steps each per repetition in a new order each time, so that
noise from other processes on the machine hits them alike; the figure per mode is the median over
repetitions of the mean step time.

Modes (add one with ``@mode("name")``: a function taking a ``Bench`` and
returning a zero-argument callable that runs one step; its optional
``settle()`` runs, timed, at the end of each block, so that work the mode
left running, such as the callback's writer thread, is charged to it):

* plain: no logging.
* numerics: ``log_numerics`` on every layer's output and the loss, and
  ``log_gradients`` on all gradients, every step.
* histogram: ``tf.summary.histogram`` of the same tensors, every step.
* guarded: numerics under ``tbn.guard(optimizer)`` (the custom-loop
  escalation); numerics_eager and guarded_eager: the same two, eagerly.
  Printed against numerics (target <= 1.03x, in CPU time).
* fit, fit_callback*: ``model.fit``'s loop, plain and with the callback;
  fit_callback_skip and fit_callback_rewind: with ``on_anomaly`` policies;
  fit_snapshot: plain fit plus a rewind snapshot's copy after every step
  (issue 31: one copy every 100 steps <= 2 % of a fit step; ``--modes
  fit,fit_snapshot,fit_callback,fit_callback_skip,fit_callback_rewind``).

Printed: median step times, the ratio of each mode to plain, and the targets
(numerics <= 1.10x plain; histograms' overhead, histogram - plain, at least
3x numerics' overhead, numerics - plain), and the bytes on disk per record.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from typing import Callable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402

import tb_numerics as tbn  # noqa: E402
from tb_numerics import event_reader  # noqa: E402
from tensorboard.compat.proto import event_pb2  # noqa: E402

WIDTH = 1024
DEPTH = 6
BATCH = 512


@dataclasses.dataclass
class Bench:
    """What a mode builds its step from: data, a fresh model, a logdir."""

    x: tf.Tensor
    y: tf.Tensor
    root: str

    def model(self) -> list[keras.layers.Dense]:
        """Fresh layers with the same initial weights for every mode."""
        keras.utils.set_random_seed(0)
        layers = [keras.layers.Dense(WIDTH, activation="relu", name="dense%d" % i) for i in range(DEPTH)]
        h = self.x
        for layer in layers:
            h = layer(h)
        return layers

    def logdir(self, name: str) -> str:
        return os.path.join(self.root, name)


MODES: dict[str, Callable[[Bench], Callable[[], object]]] = {}


def mode(name: str):
    """Registers a mode under ``name``."""

    def register(fn):
        MODES[name] = fn
        return fn

    return register


def _train_step(b: Bench, log_forward, log_grads, *, compiled: bool = True, guarded: bool = False):
    """A tf.function step (``compiled``, else eager) calling ``log_forward(name,
    h)`` on each layer output and the loss, and ``log_grads(grads,
    variables)``; ``guarded``: under ``tbn.guard`` of its optimizer."""
    layers = b.model()
    variables = [v for layer in layers for v in layer.trainable_variables]
    opt = keras.optimizers.SGD(learning_rate=1e-4)
    opt.build(variables)

    def step(x, y):
        with tf.GradientTape() as tape:
            h = x
            for layer in layers:
                h = layer(h)
                log_forward(layer.name + "/output", h)
            loss = tf.reduce_mean(tf.square(h - y))
            log_forward("loss", loss)
        grads = tape.gradient(loss, variables)
        log_grads(grads, variables)
        opt.apply(grads, variables)
        return loss

    step = tf.function(step) if compiled else step
    return tbn.guard(opt)(step) if guarded else step


def _with_writer(b: Bench, name: str, step_fn):
    writer = tf.summary.create_file_writer(b.logdir(name), max_queue=1000)
    counter = tf.Variable(0, dtype=tf.int64)

    def run():
        with writer.as_default(step=counter):
            out = step_fn(b.x, b.y)
        counter.assign_add(1)
        return out

    run.writer = writer
    return run


@mode("plain")
def plain(b: Bench):
    step = _train_step(b, lambda name, h: None, lambda g, v: None)
    return lambda: step(b.x, b.y)


@mode("numerics")
def numerics(b: Bench):
    return _with_writer(b, "numerics", _train_step(b, tbn.log_numerics, tbn.log_gradients))


@mode("histogram")
def histogram(b: Bench):
    def grads_hist(grads, variables):
        for g, v in zip(grads, variables):
            tf.summary.histogram("gradients/" + v.path, g)

    return _with_writer(
        b, "histogram", _train_step(b, lambda name, h: tf.summary.histogram(name, h), grads_hist)
    )


# The custom-loop escalation (``tbn.guard``) against the same loop with
# log_numerics alone, traced and eager (the quick start's loop).
for _name, _compiled, _guarded in (("guarded", True, True), ("numerics_eager", False, False),
                                   ("guarded_eager", False, True)):
    def _guard_mode(b: Bench, name=_name, compiled=_compiled, guarded=_guarded):
        step = _train_step(b, tbn.log_numerics, tbn.log_gradients, compiled=compiled, guarded=guarded)
        return _with_writer(b, name, step)

    mode(_name)(_guard_mode)


def _report_guard(med: dict[str, float], med_cpu: dict[str, float], times: dict[str, list[float]]) -> None:
    """The guard's cost on a healthy step against log_numerics alone: the
    ratio of the medians, the median of the paired ratios, and the ratio in
    CPU time, which the target is judged on (the guard's cost is compute in
    this process; the wall time of a shared machine swings by more than 3 %)."""
    for guarded, base in (("guarded", "numerics"), ("guarded_eager", "numerics_eager")):
        if guarded in med and base in med:
            ratio = med[guarded] / med[base]
            paired = statistics.median(g / n for g, n in zip(times[guarded], times[base]))
            cpu = med_cpu[guarded] / med_cpu[base]
            print("%s / %s = %.3f wall (median of the paired ratios %.3f), %.3f CPU time (target <= 1.03): %s" % (
                guarded, base, ratio, paired, cpu, "MET" if cpu <= 1.03 else "NOT MET"))


def _sync(out) -> None:
    if isinstance(out, tf.Tensor):
        out.numpy()


def bytes_per_record(logdir: str) -> tuple[float, float, int]:
    """Bytes on disk per numerics record in ``logdir``: (whole files / records,
    mean size of a record after its tag's first, record count).

    A tag's first event carries the whole metadata, later ones a compact
    copy (or, packed, the block's table again): they are the steady state. Sizes include the 16 bytes of TFRecord framing.
    """
    runs = event_reader.read_logdir(logdir)
    records = sum(len(s.steps) for rr in runs for s in rr.series)
    paths = [os.path.join(d, f) for d, _, fs in os.walk(logdir) for f in fs]
    later_bytes = later_records = 0
    seen = set()
    for path in paths:
        for raw in tf.data.TFRecordDataset(path):
            event = event_pb2.Event.FromString(raw.numpy())
            if event.summary.value:
                value = event.summary.value[0]
                if value.tag in seen:
                    later_bytes += len(raw.numpy()) + 16
                    # A packed event holds a row per record.
                    dims = value.tensor.tensor_shape.dim
                    later_records += dims[0].size if len(dims) == 2 else 1
                seen.add(value.tag)
    size = sum(os.path.getsize(p) for p in paths)
    whole = size / records if records else float("nan")
    return whole, (later_bytes / later_records if later_records else float("nan")), records


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="plain,numerics,histogram",
                   help="comma-separated, from: %s" % ", ".join(MODES))
    p.add_argument("--steps", type=int, default=10, help="steps per mode per repetition")
    p.add_argument("--reps", type=int, default=15, help="interleaved repetitions")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per mode first")
    args = p.parse_args(argv)
    names = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODES]
    if unknown:
        p.error("unknown mode(s) %s; known: %s" % (", ".join(unknown), ", ".join(MODES)))

    root = tempfile.mkdtemp(prefix="tbn_bench_")
    try:
        rng = np.random.default_rng(0)
        b = Bench(
            x=tf.constant(rng.standard_normal((BATCH, WIDTH)).astype(np.float32)),
            y=tf.constant(rng.standard_normal((BATCH, WIDTH)).astype(np.float32)),
            root=root,
        )
        steps = {name: MODES[name](b) for name in names}
        for name, fn in steps.items():
            for _ in range(args.warmup):
                _sync(fn())
        times: dict[str, list[float]] = {name: [] for name in names}
        cpu: dict[str, list[float]] = {name: [] for name in names}
        order = list(steps.items())
        for rep in range(args.reps):
            # A new order each repetition: no mode always follows the same one.
            random.Random(rep).shuffle(order)
            for name, fn in order:
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(args.steps):
                    out = fn()
                _sync(out)
                if hasattr(fn, "settle"):
                    fn.settle()  # work a mode left running (a writer thread) is charged to it
                times[name].append((time.perf_counter() - t0) / args.steps * 1e3)
                cpu[name].append((time.process_time() - c0) / args.steps * 1e3)
        for fn in steps.values():
            if hasattr(fn, "writer"):
                fn.writer.flush()
        med = {name: statistics.median(t) for name, t in times.items()}
        med_cpu = {name: statistics.median(t) for name, t in cpu.items()}
        print("median step time over %d interleaved repetitions of %d steps (%d cores); "
              "CPU time is this process's, less sensitive to other load:"
              % (args.reps, args.steps, os.cpu_count() or 0))
        base = med.get("plain")
        for name in names:
            ratio = "" if base is None else "  %.3fx plain" % (med[name] / base)
            cpu_ratio = "" if base is None else "  %.3fx plain" % (med_cpu[name] / med_cpu["plain"])
            print("  %-12s wall %8.2f ms%s   cpu %8.2f ms%s"
                  % (name, med[name], ratio, med_cpu[name], cpu_ratio))
        if base is not None and "numerics" in med:
            ratio = med["numerics"] / base
            print("numerics / plain = %.3f wall (target <= 1.10): %s; %.3f in CPU time"
                  % (ratio, "MET" if ratio <= 1.10 else "NOT MET",
                     med_cpu["numerics"] / med_cpu["plain"]))
            if "histogram" in med:
                ours = med["numerics"] - base
                theirs = med["histogram"] - base
                factor = theirs / ours if ours > 0 else float("inf")
                print("overhead: numerics %+.2f ms, histogram %+.2f ms per step; histogram "
                      "overhead / numerics overhead = %.1f (target >= 3): %s"
                      % (ours, theirs, factor, "MET" if factor >= 3 else "NOT MET"))
                ours_cpu = med_cpu["numerics"] - med_cpu["plain"]
                theirs_cpu = med_cpu["histogram"] - med_cpu["plain"]
                print("  in CPU time: numerics %+.2f ms, histogram %+.2f ms, factor %.1f"
                      % (ours_cpu, theirs_cpu, theirs_cpu / ours_cpu if ours_cpu > 0 else float("inf")))
        if "numerics" in steps:
            whole, later, n = bytes_per_record(b.logdir("numerics"))
            print("numerics records on disk: %d records; %.1f bytes per record after a tag's "
                  "first (target <= 150), %.1f with the metadata-carrying first records and "
                  "the file header" % (n, later, whole))
        _report_guard(med, med_cpu, times)
        for report in REPORTS:
            report(med, steps, times)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


# ------------------------------------------------------------------------
# Op-level mode (tbn.op_numerics) against TensorFlow's own op-level tools.
#
# The op-level modes wrap the plain step's Python function in
# op_numerics under its tf.function. TensorFlow's tools are process-wide op
# callbacks (enable_check_numerics, enable_dump_debug_info), so each runs the
# plain step in its own subprocess: the parent's other modes never see them,
# and one request over a pipe (well under 1 ms) runs one step there.

OP_FLIGHT_WINDOW = 8


def _counted(run, logdir: str):
    """``run`` that counts its calls, so the report can give bytes per step."""

    def counted():
        counted.calls += 1
        return run()

    counted.calls = 0
    counted.writer = run.writer
    counted.bytes = lambda: _dir_bytes(logdir)
    return counted


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _op_level(b: Bench, name: str, **kwargs):
    plain_step = _train_step(b, lambda n, h: None, lambda g, v: None)
    step = tf.function(tbn.op_numerics(**kwargs)(plain_step.python_function))
    return _counted(_with_writer(b, name, step), b.logdir(name))


@mode("op_full")
def op_full(b: Bench):
    """op_numerics(): every float op output of the step, written every step."""
    return _op_level(b, "op_full")


@mode("op_flight")
def op_flight(b: Bench):
    """op_numerics(flight_recorder=8): the last 8 steps kept on the device, written at the first NaN/Inf."""
    return _op_level(b, "op_flight", flight_recorder=OP_FLIGHT_WINDOW)


def _tool_worker(conn, tool: str, dump_root: str, x: np.ndarray, y: np.ndarray) -> None:
    """Subprocess: the plain step with one of TensorFlow's tools enabled."""
    b = Bench(x=tf.constant(x), y=tf.constant(y), root=dump_root)
    if tool == "check_numerics":
        tf.debugging.enable_check_numerics()
    elif tool == "dump_debug_info":
        tf.debugging.experimental.enable_dump_debug_info(
            dump_root, tensor_debug_mode="CONCISE_HEALTH", circular_buffer_size=-1)
    step = _train_step(b, lambda n, h: None, lambda g, v: None)
    while conn.recv():
        c0 = time.process_time()
        step(b.x, b.y).numpy()
        conn.send((time.process_time() - c0) * 1e3)  # this process's CPU ms for the step
    if tool == "check_numerics":
        tf.debugging.disable_check_numerics()
    elif tool == "dump_debug_info":
        tf.debugging.experimental.disable_dump_debug_info()  # flushes the dump files
    conn.send(_dir_bytes(dump_root) if os.path.isdir(dump_root) else 0)


def _tool(b: Bench, tool: str):
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # no fork of a process running TensorFlow
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_tool_worker, daemon=True,
                       args=(child, tool, b.logdir(tool), b.x.numpy(), b.y.numpy()))
    proc.start()

    def run():
        run.calls += 1
        parent.send(True)
        run.cpu_ms.append(parent.recv())

    def stop() -> int:
        parent.send(False)
        written = parent.recv()
        proc.join(timeout=60)
        return written

    run.calls = 0
    run.cpu_ms = []
    run.bytes = stop
    return run


@mode("plain_subprocess")
def plain_subprocess(b: Bench):
    """The plain step in a subprocess like the tools': the baseline of their overhead."""
    return _tool(b, "plain")


@mode("check_numerics")
def check_numerics(b: Bench):
    """tf.debugging.enable_check_numerics(), in a subprocess."""
    return _tool(b, "check_numerics")


@mode("dump_debug_info")
def dump_debug_info(b: Bench):
    """tf.debugging.experimental.enable_dump_debug_info(CONCISE_HEALTH, no circular buffer), in a subprocess."""
    return _tool(b, "dump_debug_info")


def _report_op_level(med: dict[str, float], steps: dict[str, Callable], times: dict[str, list[float]]) -> None:
    """Ratios, the op-level targets and bytes written per step."""
    names = [n for n in ("op_full", "op_flight", "plain_subprocess", "check_numerics", "dump_debug_info")
             if n in steps]
    if not names:
        return
    for name in names:
        fn = steps[name]
        print("%-15s bytes written per step: %.0f" % (name, fn.bytes() / max(fn.calls, 1)))
    base = med.get("plain")
    if base is None:
        return
    for tool in ("check_numerics", "dump_debug_info"):
        if tool in med and "plain_subprocess" in med:
            # The parent's CPU column cannot see a subprocess: its own CPU time per step.
            cpu = statistics.median(steps[tool].cpu_ms)
            cpu_base = statistics.median(steps["plain_subprocess"].cpu_ms)
            print("%s / plain_subprocess = %.3f wall, %.3f cpu (%.1f / %.1f ms)"
                  % (tool, med[tool] / med["plain_subprocess"], cpu / cpu_base, cpu, cpu_base))
    if "op_flight" in med:
        ratio = med["op_flight"] / base
        print("op_flight / plain = %.3f (target <= 1.5): %s" % (ratio, "MET" if ratio <= 1.5 else "NOT MET"))
    if "op_full" in med and "dump_debug_info" in med:
        # TensorFlow's tools run in a subprocess: measure them against the same step there.
        theirs_base = med.get("plain_subprocess", base)
        ours, theirs = med["op_full"] - base, med["dump_debug_info"] - theirs_base
        if ours <= 0 or theirs <= 0:
            verdict = "INCONCLUSIVE (an overhead below 0 is noise: rerun on a quieter machine)"
        else:
            verdict = "MET" if ours / theirs <= 0.5 else "NOT MET"
        print("overhead (wall): op_full %+.2f ms, dump_debug_info %+.2f ms per step; op_full overhead / "
              "dump_debug_info overhead = %.2f (target <= 0.5): %s"
              % (ours, theirs, ours / theirs if theirs else float("inf"), verdict))


REPORTS: list[Callable[[dict, dict, dict], None]] = [_report_op_level]


# ------------------------------------------------------------------------
# Keras: model.fit's per-batch loop, plain and with NumericsCallback.
#
# fit's own set-up (data adapter, callbacks, and the callback rebuilding the
# train function) is paid once per fit call, not per step, so a mode drives
# the loop fit runs for every batch: model.train_function on a dataset
# iterator, then callbacks.on_train_batch_end. The model is the same MLP as a
# Sequential model compiled with SGD and mse.


def _fit_loop(b: Bench, callbacks: list):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((WIDTH,))]
        + [keras.layers.Dense(WIDTH, activation="relu", name="dense%d" % i) for i in range(DEPTH)]
    )
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=1e-4), loss="mse")
    return fit_per_batch(model, b.x, b.y, callbacks)


def fit_per_batch(model, x, y, callbacks: list) -> Callable:
    """One call of the result runs one batch of fit's loop on compiled
    ``model``: ``train_function`` on a dataset of the batch (x, y), between
    the callbacks' batch hooks. ``settle()`` ends a block of steps as an
    epoch's end (the callback's writes finish there), ``end()`` the training;
    ``model`` is the model (``fit_snapshot`` copies its state). Also used by
    ``bench/arch_cost.py``."""
    iterator = iter(tf.data.Dataset.from_tensors((x, y)).repeat())
    cbs = keras.callbacks.CallbackList(callbacks, model=model)
    model.make_train_function()
    cbs.on_train_begin()

    def run():
        run.batch += 1
        cbs.on_train_batch_begin(run.batch)
        logs = model.train_function(iterator)
        cbs.on_train_batch_end(run.batch, logs)
        return logs["loss"]

    run.batch = 0
    run.model = model
    run.settle = lambda: cbs.on_epoch_end(0)
    run.end = cbs.on_train_end
    return run


@mode("fit")
def fit(b: Bench):
    """model.fit's per-batch loop, no callback."""
    return _fit_loop(b, [])


@mode("fit_callback")
def fit_callback(b: Bench):
    """The same with NumericsCallback's defaults: activations, the loss and gradients
    every step, weights and update ratios every 10th."""
    from tb_numerics.keras import NumericsCallback

    return _fit_loop(b, [NumericsCallback(b.logdir("fit_callback"))])


@mode("fit_callback_no_inputs")
def fit_callback_no_inputs(b: Bench):
    """NumericsCallback(inputs=False): the defaults without the batch's records (input, target)."""
    from tb_numerics.keras import NumericsCallback

    return _fit_loop(b, [NumericsCallback(b.logdir("fit_callback_no_inputs"), inputs=False)])


@mode("fit_callback_w1")
def fit_callback_w1(b: Bench):
    """NumericsCallback(weights_every_n_steps=1): weights and update ratios every step too."""
    from tb_numerics.keras import NumericsCallback

    return _fit_loop(b, [NumericsCallback(b.logdir("fit_callback_w1"), weights_every_n_steps=1)])


@mode("fit_callback_n100")
def fit_callback_n100(b: Bench):
    """NumericsCallback(every_n_steps=100): statistics every step (the first bad step and
    the one before it are always written), written every 100th."""
    from tb_numerics.keras import NumericsCallback

    return _fit_loop(b, [NumericsCallback(b.logdir("fit_callback_n100"), every_n_steps=100)])


@mode("fit_callback_lean")
def fit_callback_lean(b: Bench):
    """NumericsCallback(weights=False, update_ratios=False): layer outputs and gradients only,
    the same tensors as the "numerics" mode, to separate the callback's cost from the weights'."""
    from tb_numerics.keras import NumericsCallback

    return _fit_loop(b, [NumericsCallback(b.logdir("fit_callback_lean"), weights=False, update_ratios=False)])


@mode("fit_callback_no_replay")
def fit_callback_no_replay(b: Bench):
    """NumericsCallback(replay=False): the defaults without the replay's batch
    copy and gated update, to separate what keeping a step replayable costs."""
    from tb_numerics.keras import NumericsCallback

    return _fit_loop(b, [NumericsCallback(b.logdir("fit_callback_no_replay"), replay=False)])


@mode("fit_callback_skip")
def fit_callback_skip(b: Bench):
    """NumericsCallback(on_anomaly="skip"): the defaults, a bad step's update
    skipped and said; a healthy step should pay nothing more than fit_callback."""
    from tb_numerics.keras import NumericsCallback

    return _fit_loop(b, [NumericsCallback(b.logdir("fit_callback_skip"), on_anomaly="skip")])


@mode("fit_callback_rewind")
def fit_callback_rewind(b: Bench):
    """NumericsCallback(on_anomaly=OnAnomaly("rewind", snapshot_every=100)): the
    defaults, and a copy of the state on the device every 100 steps."""
    from tb_numerics.keras import NumericsCallback

    return _fit_loop(b, [NumericsCallback(b.logdir("fit_callback_rewind"),
                                          on_anomaly=tbn.OnAnomaly("rewind", snapshot_every=100))])


@mode("fit_snapshot")
def fit_snapshot(b: Bench):
    """Plain fit and, after every step, the copy a rewind policy takes (all
    variables of the model and the optimizer, checked finite, into a buffer on
    the device): its difference from fit is one copy's cost, which the rewind
    policy pays once per ``snapshot_every`` steps."""
    from tb_numerics._survive_tf import StateSnapshot, optimizer_state

    run = _fit_loop(b, [])
    model = run.model
    snapshot = StateSnapshot(list(model.trainable_variables) + list(model.non_trainable_variables)
                             + optimizer_state([model.optimizer]))

    def step():
        out = run()
        snapshot.take(run.batch)
        return out

    step.settle, step.snapshot = run.settle, snapshot
    return step


def _report_survive(med: dict[str, float], steps: dict[str, Callable], times: dict[str, list[float]]) -> None:
    """The on_anomaly policies on a healthy run: skip against the callback's
    defaults (target: nothing more), and one snapshot's copy amortised over
    100 steps against plain fit (target <= 2 %)."""
    if "fit_callback_skip" in med and "fit_callback" in med:
        paired = statistics.median(t / f for t, f in zip(times["fit_callback_skip"], times["fit_callback"]))
        print("fit_callback_skip / fit_callback = %.3f (median of the paired ratios %.3f)"
              % (med["fit_callback_skip"] / med["fit_callback"], paired))
    if "fit_callback_rewind" in med and "fit_callback" in med:
        paired = statistics.median(t / f for t, f in zip(times["fit_callback_rewind"], times["fit_callback"]))
        print("fit_callback_rewind / fit_callback = %.3f (median of the paired ratios %.3f)"
              % (med["fit_callback_rewind"] / med["fit_callback"], paired))
    if "fit_snapshot" in med and "fit" in med:
        copy = statistics.median(t - f for t, f in zip(times["fit_snapshot"], times["fit"]))
        share = copy / 100 / med["fit"]
        print("one snapshot copy: %+.2f ms (median of the paired differences; %.3fx a fit step); every 100 steps "
              "that is %.3f %% of a fit step (target <= 2 %%): %s; device memory %.1f MB (two buffers)"
              % (copy, copy / med["fit"], 100 * share, "MET" if share <= 0.02 else "NOT MET",
                 steps["fit_snapshot"].snapshot.nbytes / 1e6))


REPORTS.append(_report_survive)


def _report_fit(med: dict[str, float], steps: dict[str, Callable], times: dict[str, list[float]]) -> None:
    """Each callback mode against plain fit: the ratio of the medians, and the
    median of the ratios of the blocks run side by side in one repetition
    (a slow stretch of the machine hits both blocks of a pair)."""
    if "fit" not in med:
        return
    for name in ("fit_callback", "fit_callback_no_replay", "fit_callback_w1", "fit_callback_n100", "fit_callback_lean"):
        if name in med:
            ratio = med[name] / med["fit"]
            paired = statistics.median(t / f for t, f in zip(times[name], times["fit"]))
            line = "%s / fit = %.3f (median of the paired ratios %.3f)" % (name, ratio, paired)
            if name == "fit_callback":  # the target is on the callback's defaults
                line += " (target <= 1.10): %s" % ("MET" if max(ratio, paired) <= 1.10 else "NOT MET")
            print(line)


REPORTS.append(_report_fit)


if __name__ == "__main__":
    sys.exit(main())
