"""A long packed run with warnings and an anomaly late in it, for the tests of long runs.

``write(logdir, steps, width)`` writes one run as the Keras callback's
writer does (``write_many``: packed blocks), with statistics made in numpy
for every tensor kind the rules treat apart: the input batch, linear,
ReLU, sigmoid and softmax activations (held compact), gradients (compact,
but for the two the by-depth rule compares), the loss and the global norm. Faults are injected at fixed fractions of the
run, so that their steps are known without any reader:

- a gradient jumps to 1e20 for three steps from ``jump_at`` (fast growth, a
  square its optimizer cannot hold, and a spike of the global norm; a jump
  that the next records undo would be a transient the detectors leave
  quiet): the first warning, at 60 % of the run;
- a gradient underflows (a fifth of its values below float32's smallest
  normal) for 40 steps from ``underflow_from``;
- a linear activation grows 10x a step for 12 steps from ``growth_at``
  (growth, then headroom running out);
- the ReLU activation is 90 % exact zeros for 20 steps from ``dead_from``
  (dead units, held compact);
- a gradient holds 3 NaN of 4,096 values at ``NAN_AT``: the first anomaly;
- an input batch holds -Inf at one step (an anomaly only where it is not
  allowed) after the NaN.
"""

from __future__ import annotations

import numpy as np

from tb_numerics import file_provider, metadata, run_store
from tb_numerics.metadata import FIELD_INDEX as F
from tb_numerics.record_writer import NumericsRecordWriter

RUN = "long"
# The store's limits that hold every run compact, however short, as TensorBoard holds a long one.
COMPACT = run_store.Limits(compact_above_records=0, inline_read_records=10**9)


def compact_store(logdir: str) -> run_store.RunStore:
    """The plugin's run store over ``logdir``'s files as they are now, every
    run held compact (``compact``), refreshed only when asked."""
    files = file_provider.FileProvider(logdir, on_listing=False)
    files.index_round()
    return run_store.RunStore(files, reload_interval=0, background=False, limits=COMPACT)


def faults(steps: int) -> dict[str, int]:
    """The steps of the injected faults in a run of ``steps`` steps."""
    return {"jump_at": steps * 3 // 5, "underflow_from": steps * 7 // 10, "underflow_to": steps * 7 // 10 + 40,
            "growth_at": steps * 3 // 4, "dead_from": steps * 13 // 20,
            "nan_at": steps * 9 // 10, "neginf_at": steps * 9 // 10 + 7}


def tensors(width: int) -> list[tuple[str, metadata.TensorInfo]]:
    """The run's tensors in execution order: ``width`` linear activations and as many gradients, and the rest."""
    out = [("input", metadata.TensorInfo(role="input", order=0, shape=(64, 32), dtype="float32"))]
    for i in range(width):
        out.append(("dense%02d/output" % i, metadata.TensorInfo(role="activation", order=1 + i, shape=(64, 64),
                                                                  dtype="float32")))
    out.append(("relu/output", metadata.TensorInfo(role="activation", order=width + 1, shape=(64, 64),
                                                    activation="relu", dtype="float32")))
    out.append(("gate/output", metadata.TensorInfo(role="activation", order=width + 2, shape=(64, 64),
                                                    activation="sigmoid", dtype="float32")))
    out.append(("probs/output", metadata.TensorInfo(role="activation", order=width + 3, shape=(64, 10),
                                                     activation="softmax", dtype="float32")))
    out.append(("loss", metadata.TensorInfo(role="loss", order=width + 4, shape=(), dtype="float32")))
    for i in reversed(range(width)):
        out.append(("dense%02d/kernel" % i, metadata.TensorInfo(role="gradient", order=width - i, shape=(64, 64),
                                                                  dtype="float32", squared_by="adam")))
        out.append(("dense%02d/bias" % i, metadata.TensorInfo(role="gradient", order=width - i, shape=(64,),
                                                                dtype="float32")))
    out.append(("gradients/global_norm", metadata.TensorInfo(role="global_norm", order=0, shape=(),
                                                              dtype="float32")))
    return out


def stats(rng: np.random.Generator, n: int, size: int, scale: np.ndarray, dtype: str = "float32") -> np.ndarray:
    """Plausible statistics of ``n`` records of ``size`` values around
    ``scale``; for float32, what float32 accumulation gives (also the
    records of ``bench/backend.py``)."""
    v = np.zeros((n, metadata.NUM_FIELDS))
    v[:, F["count"]] = size
    if size == 1:
        v[:, F["min"]] = v[:, F["max"]] = v[:, F["sum"]] = scale
        v[:, F["sum_sq"]] = scale**2
    else:
        v[:, F["min"]] = -3 * scale
        v[:, F["max"]] = 3 * scale
        v[:, F["sum"]] = rng.normal(0, 1, n) * scale
        v[:, F["sum_sq"]] = size * scale**2
        v[:, F["zeros"]] = rng.integers(0, 3, n)
    return v.astype(np.float32).astype(np.float64) if dtype == "float32" else v


def _values(name: str, info: metadata.TensorInfo, i: int, steps: int, nan: bool = True) -> np.ndarray:
    """Every record of one tensor, faults included (the NaN where ``nan``)."""
    rng = np.random.default_rng(i)
    f = faults(steps)
    size = 1 if info.shape == () else int(np.prod(info.shape))
    scale = (1.0 + 0.05 * i) * np.exp(rng.normal(0, 0.05, steps))
    if info.role == "loss":
        scale = 2.0 / np.sqrt(1 + np.arange(steps)) * np.exp(rng.normal(0, 0.05, steps))
    v = stats(rng, steps, size, scale)
    if info.activation == "relu":
        v[:, F["min"]] = 0
        v[:, F["zeros"]] = size // 3
        v[f["dead_from"] : f["dead_from"] + 20, F["zeros"]] = size * 9 // 10
    if info.activation in ("sigmoid", "softmax"):
        v[:, F["min"]], v[:, F["max"]] = 0.1, 0.9
        v[:, F["sum"]] = 0.5 * size
        v[:, F["sum_sq"]] = 0.3 * size
        v[:, F["zeros"]] = 0
    if name == "dense01/kernel":  # underflow: a fifth of the values below float32's smallest normal
        v[f["underflow_from"] : f["underflow_to"], F["underflow"]] = size // 5
    if name == "dense04/kernel":  # one step's jump
        j = slice(f["jump_at"], f["jump_at"] + 3)
        v[j, F["min"]], v[j, F["max"]] = -1e20, 1e20
        v[j, F["sum_sq"]] = 1e40
    if name == "dense02/output":  # growth towards overflow, 10x a step
        g = f["growth_at"]
        grow = 10.0 ** np.arange(1, 13)
        for k in ("min", "max", "sum"):
            v[g : g + 12, F[k]] *= grow
        v[g : g + 12, F["sum_sq"]] *= grow**2
        v[g + 12 :] = v[g + 11]
    if name == "dense03/kernel" and nan:
        v[f["nan_at"], F["nan"]] = 3
    if name == "input":
        v[f["neginf_at"], F["neginf"]] = 2
    return v


def write(logdir: str, steps: int, width: int, start: int = 0, nan: bool = True) -> str:
    """Writes the run ``RUN`` under ``logdir`` from step ``start`` (a
    restarted job writes again from there), its NaN where ``nan``; returns
    the run's directory."""
    run_dir = "%s/%s" % (logdir, RUN)
    table = tensors(width)
    values = [_values(name, info, i, steps, nan) for i, (name, info) in enumerate(table)]
    grads = [j for j, (_, info) in enumerate(table) if info.role == "gradient"]
    norm = np.sqrt(sum(values[j][:, F["sum_sq"]] for j in grads)).astype(np.float32).astype(np.float64)
    values[-1][:, F["min"]] = values[-1][:, F["max"]] = values[-1][:, F["sum"]] = norm
    values[-1][:, F["sum_sq"]] = norm**2
    with NumericsRecordWriter(run_dir) as w:
        for step in range(start, steps):
            w.write_many(step, [(name, vals[step], info) for (name, info), vals in zip(table, values)])
    return run_dir
