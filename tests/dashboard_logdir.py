"""A small, realistic numerics logdir for the dashboard's browser tests.

Written with the TF-free writer in well under a second. What it holds is what
the tests assert:

* run ``diverging`` (steps 0-199): ``dense1/output`` grows slowly (max |x| =
  1 + 0.05 * step, so ``max_abs=5`` first warns at step 81); the global
  gradient norm spikes 40x at step 140 and stays there at 141 (the first
  warning under the defaults, at step 140 only: a spike that the next two
  records undo, as an outlier batch's is, warns nothing); ``loss/Sqrt_grad``
  (op Sqrt, backward) holds 2 NaN and 1 +Inf of 4,096 values at step 150 (the first anomaly) and is NaN from then on;
  a tag named ``<img src=x onerror=alert(1)>`` and one with a very long name.
* run ``healthy`` (steps 0-99): nothing wrong.
"""

from __future__ import annotations

import os

import numpy as np

from tb_numerics import metadata
from tb_numerics.record_writer import NumericsRecordWriter
from tb_numerics.records import numpy_stats

NAN_RUN = "diverging"
HEALTHY_RUN = "healthy"
NAN_STEP = 150
NAN_TENSOR = "loss/Sqrt_grad"
SPIKE_STEP = 140
GROWING_TENSOR = "dense1/output"
HOSTILE_TAG = "<img src=x onerror=alert(1)>"
LONG_TAG = "model/encoder/layer_07/self_attention/multi_head/query_projection/kernel_grad_with_a_very_long_name"
SIZE = 4096


def _tensors():
    TI = metadata.TensorInfo
    return [
        ("input", TI(role="activation", order=0, shape=(64, 64))),
        (GROWING_TENSOR, TI(role="activation", order=1, shape=(64, 64), op_type="MatMul")),
        (HOSTILE_TAG, TI(role="activation", order=2, shape=(64, 64))),
        ("loss", TI(role="loss", order=3, shape=(), op_type="Sqrt")),
        ("dense1/kernel_grad", TI(role="gradient", order=0, shape=(64, 64))),
        (LONG_TAG, TI(role="gradient", order=1, shape=(64, 64))),
        (NAN_TENSOR, TI(role="gradient", order=2, shape=(64, 64), op_type="Sqrt")),
        ("global_norm", TI(role="global_norm", order=3, shape=())),
    ]


def _values(tag: str, step: int, rng: np.random.Generator, diverging: bool) -> np.ndarray:
    if tag in ("loss", "global_norm"):
        value = 1.0 / (1 + 0.01 * step) + rng.normal(0, 0.02)
        if tag == "global_norm" and diverging and SPIKE_STEP <= step < SPIKE_STEP + 2:
            value *= 40
        return numpy_stats(np.array(value, np.float32))
    # Max |x| about 2: only the growing tensor crosses a max_abs of 5.
    x = 0.5 * rng.standard_normal(SIZE).astype(np.float32)
    if tag == GROWING_TENSOR and diverging:
        x *= (1 + 0.05 * step) / np.abs(x).max()
    if tag == NAN_TENSOR and diverging and step >= NAN_STEP:
        x[:2] = np.nan
        x[2] = np.inf
    return numpy_stats(x)


def write(logdir: str) -> str:
    """Writes both runs under ``logdir``; returns it."""
    rng = np.random.default_rng(0)
    for run, steps, diverging in ((NAN_RUN, 200, True), (HEALTHY_RUN, 100, False)):
        with NumericsRecordWriter(os.path.join(logdir, run)) as w:
            for step in range(steps):
                for tag, info in _tensors():
                    w.write(tag, step, _values(tag, step, rng, diverging), info)
    return logdir


# ---------------------------------------------------------------- more runs
#
# A second logdir (write_more), for what the first one's runs cannot show
# without changing what the tests above assert:
#
# * run ``masked`` (steps 0-59): ``attention/scores`` holds 4 -Inf at every
#   step (an attention mask, not marked as intended by its writer), and
#   ``loss`` is NaN from step 30: the first anomaly is step 0 unless
#   ``allow_neginf`` matches ``attention/*``, then step 30.
# * run ``ops``: layer-level ``logrelu/output`` and op-level records
#   (``ops/...``, op type and source line as description) of the ops inside
#   it; ``ops/logrelu/Log`` goes -Inf at step 5, where the ReLU before it
#   emits exact zeros.
# * run ``repeated``: ``grads/accum`` logged twice per step (two
#   micro-batches, in packed events); max |x| beyond float32's overflow margin from step 4,
#   and -Inf in the first of the two records at step 7.

MASKED_RUN = "masked"
MASKED_TENSOR = "attention/scores"
MASKED_NAN_STEP = 30
OPS_RUN = "ops"
OP_TENSOR = "ops/logrelu/Log"
OP_SOURCE = "model.py:12 (call)"
OP_NAN_STEP = 5
REPEATED_RUN = "repeated"
REPEATED_TENSOR = "grads/accum"
REPEATED_NAN_STEP = 7
REPEATED_WARN_STEP = 4


def _masked(w: NumericsRecordWriter, rng: np.random.Generator) -> None:
    TI = metadata.TensorInfo
    tensors = [
        (MASKED_TENSOR, TI(role="activation", order=0, shape=(8, 8))),
        ("dense/output", TI(role="activation", order=1, shape=(8, 8))),
        ("loss", TI(role="loss", order=2, shape=())),
    ]
    for step in range(60):
        for tag, info in tensors:
            x = rng.standard_normal(64 if info.shape else 1).astype(np.float32)
            if tag == MASKED_TENSOR:
                x[:4] = -np.inf
            if tag == "loss" and step >= MASKED_NAN_STEP:
                x[:] = np.nan
            w.write(tag, step, numpy_stats(x), info)


def _ops(w: NumericsRecordWriter, rng: np.random.Generator) -> None:
    TI = metadata.TensorInfo
    tensors = [
        ("ops/logrelu/MatMul", TI(role="activation", order=0, shape=(8, 8), op_type="MatMul", description="model.py:10 (call)")),
        ("ops/logrelu/Relu", TI(role="activation", order=1, shape=(8, 8), op_type="Relu", description="model.py:11 (call)")),
        (OP_TENSOR, TI(role="activation", order=2, shape=(8, 8), op_type="Log", description=OP_SOURCE)),
        ("logrelu/output", TI(role="activation", order=10, shape=(8, 8), op_type="LogRelu")),
    ]
    for step in range(20):
        for tag, info in tensors:
            x = np.abs(rng.standard_normal(64)).astype(np.float32) + 0.5
            if step >= OP_NAN_STEP and tag == "ops/logrelu/Relu":
                x[:3] = 0
            if step >= OP_NAN_STEP and tag in (OP_TENSOR, "logrelu/output"):
                x[:3] = -np.inf
            w.write(tag, step, numpy_stats(x), info)


def _repeated(w: NumericsRecordWriter, rng: np.random.Generator) -> None:
    info = metadata.TensorInfo(role="gradient", order=0, shape=(8, 8))
    for step in range(12):
        records = []
        for occurrence in range(2):
            x = rng.standard_normal(64).astype(np.float32)
            if step >= REPEATED_WARN_STEP:
                x[0] = 3e38
            if step == REPEATED_NAN_STEP and occurrence == 0:
                x[1] = -np.inf
            records.append((REPEATED_TENSOR, numpy_stats(x), info))
        # Packed: TensorBoard keeps one event per tag and step, a block keeps every row.
        w.write_many(step, records)


def write_more(logdir: str) -> str:
    """Writes the runs ``masked``, ``ops`` and ``repeated`` under ``logdir``."""
    rng = np.random.default_rng(1)
    for run, fill in ((MASKED_RUN, _masked), (OPS_RUN, _ops), (REPEATED_RUN, _repeated)):
        with NumericsRecordWriter(os.path.join(logdir, run)) as w:
            fill(w, rng)
    return logdir
