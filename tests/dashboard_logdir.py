"""A small, realistic numerics logdir for the dashboard's browser tests.

Written with the TF-free writer in well under a second. What it holds is what
the tests assert:

* run ``diverging`` (steps 0-199): ``dense1/output`` grows slowly (max |x| =
  1 + 0.05 * step, so ``max_abs=5`` first warns at step 81); the global
  gradient norm spikes 40x at step 140 (the first warning under the
  defaults); ``loss/Sqrt_grad`` (op Sqrt, backward) holds 2 NaN and 1 +Inf of
  4,096 values at step 150 (the first anomaly) and is NaN from then on;
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
        if tag == "global_norm" and diverging and step == SPIKE_STEP:
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
