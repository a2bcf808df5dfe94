"""A small logdir for the dashboard's first screen, its numbers, TensorBoard's
conventions and the run-against-run comparison (issue 30), written with the
TensorFlow-free writer in packed events, as ``log_numerics`` writes them.

What it holds is what the tests assert:

* runs ``failing`` and ``reference`` (steps 0-39): the same six tensors, drawn
  from the same distributions; ``failing`` has one injected difference,
  ``head/output`` times 100 from step ``FAULT_STEP`` (finite), and then goes
  bad: ``loss`` is +Inf (its one value) from ``LOSS_INF_STEP``, the kernel's
  gradient holds 1 -Inf of 512 values from the same step, and
  ``dense/output`` 2 NaN of 512 from ``NAN_STEP``.
* run ``replayed``: layer-level rows and the op-level rows of one replayed
  step (``REPLAY_STEP``), whose orders interleave as a replay's do.
* run ``restarted``: a first training (steps 0-10 and 100, a gap) and a
  second one, written later, over steps 0-4.
"""

from __future__ import annotations

import os

import numpy as np

from tb_numerics import metadata
from tb_numerics.record_writer import NumericsRecordWriter
from tb_numerics.records import numpy_stats

FAILING = "failing"
REFERENCE = "reference"
REPLAYED = "replayed"
RESTARTED = "restarted"
STEPS = 40
FAULT_STEP = 12
FAULT_TENSOR = "head/output"
LOSS_INF_STEP = 30
NAN_STEP = 33
GRAD_TENSOR = "gradients/dense/kernel"
SIZE = 512
REPLAY_STEP = 35
RESTART_STEPS = (0, 4)

TI = metadata.TensorInfo
TENSORS = [
    ("input", TI(role="input", order=0, shape=(SIZE,))),
    ("dense/output", TI(role="activation", order=1, shape=(SIZE,), op_type="Dense")),
    (FAULT_TENSOR, TI(role="activation", order=2, shape=(SIZE,), op_type="Dense")),
    ("loss", TI(role="loss", order=3, shape=())),
    (GRAD_TENSOR, TI(role="gradient", order=0, shape=(SIZE,))),
    ("gradients/global_norm", TI(role="global_norm", order=1, shape=())),
]


def _record(tag: str, step: int, rng: np.random.Generator, failing: bool) -> np.ndarray:
    if tag in ("loss", "gradients/global_norm"):
        x = np.float32([1.0 / (1 + 0.02 * step) + rng.normal(0, 0.01)])
        if failing and tag == "loss" and step >= LOSS_INF_STEP:
            x[0] = np.inf
        return numpy_stats(x)
    x = rng.standard_normal(SIZE).astype(np.float32)
    if failing and tag == FAULT_TENSOR and step >= FAULT_STEP:
        x *= 100
    if failing and tag == GRAD_TENSOR and step >= LOSS_INF_STEP:
        x[0] = -np.inf
    if failing and tag == "dense/output" and step >= NAN_STEP:
        x[:2] = np.nan
    return numpy_stats(x)


def _pair(logdir: str) -> None:
    for run, failing in ((FAILING, True), (REFERENCE, False)):
        rng = np.random.default_rng(7)
        with NumericsRecordWriter(os.path.join(logdir, run)) as w:
            for step in range(STEPS):
                w.write_many(step, [(tag, _record(tag, step, rng, failing), info) for tag, info in TENSORS])


# The replayed run: layers in order 0-3, and the ops of the replayed step in
# their own execution order 0-7, which /timeline interleaves with the layers'.
REPLAY_LAYERS = [
    ("dense_0/output", TI(role="activation", order=0, shape=(8, 8), op_type="Dense")),
    ("dense_1/output", TI(role="activation", order=1, shape=(8, 8), op_type="Dense")),
    ("loss", TI(role="loss", order=2, shape=())),
]
REPLAY_OPS = [
    ("ops/mlp/dense_0/MatMul", "MatMul"),
    ("ops/mlp/dense_0/BiasAdd", "BiasAdd"),
    ("ops/mlp/dense_1/MatMul", "MatMul"),
    ("ops/mlp/dense_1/BiasAdd", "BiasAdd"),
    ("ops/compile_loss/mse/Sub", "Sub"),
    ("ops/compile_loss/mse/Square", "Square"),
    ("ops/compile_loss/mse/Mean", "Mean"),
]
REPLAY_BAD_OP = "ops/mlp/dense_1/MatMul"


def _replayed(logdir: str) -> None:
    rng = np.random.default_rng(3)
    ops = [(tag, TI(role="activation", order=k, shape=(8, 8), op_type=t, description="model.py:%d (call)" % (10 + k)))
           for k, (tag, t) in enumerate(REPLAY_OPS)]
    F = metadata.FIELD_INDEX
    with NumericsRecordWriter(os.path.join(logdir, REPLAYED)) as w:
        for step in range(REPLAY_STEP + 5):
            rows = []
            for tag, info in REPLAY_LAYERS:
                x = rng.standard_normal(64 if info.shape else 1).astype(np.float32)
                if step >= REPLAY_STEP and tag != "dense_0/output":
                    x[:] = np.inf
                rows.append((tag, numpy_stats(x), info))
            if step == REPLAY_STEP:
                for tag, info in ops:
                    x = rng.standard_normal(64).astype(np.float32)
                    if REPLAY_OPS.index((tag, info.op_type)) >= REPLAY_OPS.index((REPLAY_BAD_OP, "MatMul")):
                        x[:] = np.inf
                    rec = numpy_stats(x)
                    rec[F["sum"]] = rec[F["sum_sq"]] = np.nan  # op-level records hold no sums
                    rows.append((tag, rec, info))
            w.write_many(step, rows)


def _restarted(logdir: str) -> None:
    info = TI(role="loss", order=0, shape=())
    first = [*range(0, 11), 100]
    second = range(RESTART_STEPS[0], RESTART_STEPS[1] + 1)
    for k, steps in enumerate((first, second)):
        with NumericsRecordWriter(os.path.join(logdir, RESTARTED)) as w:
            for step in steps:
                # The second training starts an hour after the first ended.
                w.write_many(step, [("loss", numpy_stats(np.float32([1.0 + k + 0.01 * step])), info)],
                             wall_time=1.7e9 + 3600 * k + step)
                w.flush()
        # Its file is named for its start, as a writer an hour later names it.
        rest = os.path.basename(w.path).split(".", 4)[4]  # events.out.tfevents.<time>.<rest>
        os.rename(w.path, os.path.join(logdir, RESTARTED, "events.out.tfevents.%010d.%s" % (1_700_000_000 + 3600 * k, rest)))


def write(logdir: str) -> str:
    """Writes every run under ``logdir``; returns it."""
    _pair(logdir)
    _replayed(logdir)
    _restarted(logdir)
    return logdir


def write_late(logdir: str, run: str = "late") -> None:
    """A run that appears after the page was opened (TensorBoard's reload)."""
    with NumericsRecordWriter(os.path.join(logdir, run)) as w:
        for step in range(5):
            w.write_many(step, [("loss", numpy_stats(np.float32([1.0])), TI(role="loss", order=0, shape=()))])
