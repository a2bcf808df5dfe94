"""The JAX and PyTorch statistics agree with the numpy reference, records.numpy_stats.

Every dtype the record supports, with NaN, +Inf, -Inf, signed zeros,
subnormals (which XLA on CPU flushes to zero in float compares), values
beyond the overflow margin, finite values whose squares overflow float32,
and empty tensors. Counts and extrema must be exact, sums within the
accumulation precision. On JAX's CPU backend, which flushes float32,
bfloat16 and float64 subnormals to zero in the step itself, the reference
is the numpy record of the flushed values (``jax_stats.flushes``).
"""

import inspect
import sys

import numpy as np
import pytest

from tb_numerics import metadata, records

pytestmark = pytest.mark.unit

F = metadata.FIELD_INDEX
DTYPES = ("float16", "bfloat16", "float32", "float64")
SUBNORMAL = {"float16": 3e-6, "bfloat16": 1e-39, "float32": 1e-40, "float64": 1e-310}
HUGE = {"float16": 2000.0, "bfloat16": 1e37, "float32": 1e37, "float64": 1e306}


def _cases(dtype):
    rng = np.random.default_rng(0)
    base = rng.normal(size=257) * 10
    yield "healthy", base
    bad = base.copy()
    bad[:6] = [np.nan, np.inf, -np.inf, 0.0, -0.0, np.nan]
    bad[6], bad[7], bad[8] = SUBNORMAL[dtype], -SUBNORMAL[dtype] / 2, HUGE[dtype]
    yield "nonfinite", bad
    near_zero = np.abs(base)
    near_zero[:5] = [0.0, 0.0, SUBNORMAL[dtype], SUBNORMAL[dtype] * 2, 0.0]
    yield "relu_like", near_zero
    zeros_only = np.abs(base)
    zeros_only[::3] = 0.0
    yield "relu_zeros_no_subnormal", zeros_only  # counted by sums alone
    yield "signed_zeros_no_subnormal", np.where(np.arange(257) % 3 == 0, 0.0, base)
    yield "negative_relu_like", -near_zero
    signed_small = base.copy()
    signed_small[:4] = [0.0, -0.0, SUBNORMAL[dtype], -SUBNORMAL[dtype] * 2]
    yield "signed_near_zero", signed_small  # finite, both signs: zeros and subnormals counted
    yield "overflow", np.full(9, HUGE[dtype])
    yield "empty", np.zeros(0)
    yield "all_nan", np.full(4, np.nan)
    if dtype == "float32":
        yield "squares_overflow", np.array([3e30, -2e30, 1.0])  # finite: the norm must not read as Inf


def _check(got, x_np, dtype, name):
    ref = records.numpy_stats(x_np, dtype)
    exact = [F[k] for k in ("count", "nan", "posinf", "neginf", "zeros", "overflow", "underflow")]
    np.testing.assert_array_equal(got[exact], ref[exact], err_msg=name)
    np.testing.assert_array_equal(got[[F["min"], F["max"]]], ref[[F["min"], F["max"]]], err_msg=name)
    for k in ("sum", "sum_sq"):
        tol = 2e-3 * max(1.0, abs(ref[F["sum_sq"]]) if k == "sum_sq" else np.sqrt(abs(ref[F["sum_sq"]])) * 20)
        assert got[F[k]] == ref[F[k]] or abs(got[F[k]] - ref[F[k]]) <= tol, (name, k, got[F[k]], ref[F[k]])
    assert np.isfinite(got[F["sum_sq"]]) or not np.isfinite(ref[F["sum_sq"]]), name


def _flushed(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` with ``dtype``'s subnormals as signed zeros: what a device that
    flushes them computes with (XLA on CPU, for all but float16)."""
    with np.errstate(invalid="ignore"):
        small = np.abs(x) < metadata.smallest_normal(dtype)
    return np.where(small, np.copysign(0.0, x), x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_jax_stats_agree_with_numpy(dtype):
    """Exact, except that where the device flushes subnormals (XLA on CPU)
    they are zeros, as the step itself computes with them."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    enable_x64 = jax.enable_x64 if hasattr(jax, "enable_x64") else jax.experimental.enable_x64  # moved in JAX 0.8

    from tb_numerics.backends import jax_stats

    stats = jax.jit(jax_stats.tensor_stats)
    with enable_x64(dtype == "float64"):
        for name, values in _cases(dtype):
            x = jnp.asarray(values, jnp.dtype(dtype))
            counts, vals = stats(x)
            got = jax_stats.to_records(np.asarray(counts)[None], np.asarray(vals)[None])[0]
            _check(got, _flushed(np.asarray(x, np.float64), dtype) if jax_stats.flushes(dtype) else np.asarray(x, np.float64), dtype, name)


@pytest.mark.parametrize("counting", ["flushing", "arithmetic"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_stats_agree_with_numpy(dtype, counting, monkeypatch):
    """Both ways of counting zeros and subnormals: by reading subnormals as
    zeros (the CPU's flushing, where a probe shows it works) and by float
    arithmetic (other devices, float16, a CPU that cannot flush)."""
    torch = pytest.importorskip("torch")
    from tb_numerics.backends import torch_stats

    if counting == "arithmetic":
        monkeypatch.setattr(torch_stats, "_flush_counts", lambda x: False)
    elif dtype == "float16" or not torch_stats._flush_counts(torch.zeros(1, dtype=getattr(torch, dtype))):
        pytest.skip("counted by arithmetic here: float16, or a CPU that cannot flush subnormals")
    for name, values in _cases(dtype):
        x = torch.tensor(values, dtype=torch.float64).to(getattr(torch, dtype))
        got = torch_stats.records([x], [name])[0]
        _check(got, x.to(torch.float64).numpy(), dtype, name)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_steps_tensors_reduced_together_agree_row_by_row(dtype):
    """The callbacks reduce a step's tensors in one call: where one of them
    takes the exact path (NaN, Inf, large values), the others keep their own
    records."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    torch = pytest.importorskip("torch")
    from tb_numerics.backends import jax_stats, torch_stats

    cases = list(_cases(dtype))
    enable_x64 = jax.enable_x64 if hasattr(jax, "enable_x64") else jax.experimental.enable_x64
    with enable_x64(dtype == "float64"):
        xs = [jnp.asarray(values, jnp.dtype(dtype)) for _, values in cases]
        counts, vals = jax.jit(jax_stats.many_stats)(xs)
        got = jax_stats.to_records(np.asarray(counts), np.asarray(vals))
        for (name, _), x, row in zip(cases, xs, got):
            ref = np.asarray(x, np.float64)
            _check(row, _flushed(ref, dtype) if jax_stats.flushes(dtype) else ref, dtype, "jax " + name)
    ts = [torch.tensor(values, dtype=torch.float64).to(getattr(torch, dtype)) for _, values in cases]
    got = torch_stats.records(ts, [name for name, _ in cases])
    for (name, _), x, row in zip(cases, ts, got):
        _check(row, x.to(torch.float64).numpy(), dtype, "torch " + name)


def test_torch_counts_subnormals_whatever_the_callers_flushing_and_keeps_it():
    """A caller that has PyTorch flush subnormals (``set_flush_denormal``)
    gets exact records of tensors holding some, and keeps its setting."""
    torch = pytest.importorskip("torch")
    from tb_numerics.backends import torch_stats

    values = np.array([0.0, -0.0, 1e-40, -2e-40, 1e-39, 0.5, -3.0, 1.17549435e-38] * 9, np.float32)
    x = torch.from_numpy(values.copy())
    relu = torch.relu(x)  # made before flushing, so its subnormals are there
    probe = torch.from_numpy(np.array([1e-40], np.float32))
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush subnormals")
    try:
        got = torch_stats.records([x, relu], ["signed", "relu"])
        assert torch.mul(probe, 2.0).item() == 0.0  # still flushing
    finally:
        torch.set_flush_denormal(False)
    assert torch.mul(probe, 2.0).item() != 0.0
    _check(got[0], values.astype(np.float64), "float32", "signed")
    _check(got[1], np.maximum(values, 0).astype(np.float64), "float32", "relu")
    assert got[0][F["underflow"]] == 3 * 9 and got[0][F["zeros"]] == 2 * 9


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float64"])
def test_torch_counts_of_large_tensors_are_exact(dtype):
    """Zeros and subnormals scattered through tensors larger than one
    thread's share of an op: a gradient's both signs, a ReLU output's one."""
    torch = pytest.importorskip("torch")
    from tb_numerics.backends import torch_stats

    rng = np.random.default_rng(1)
    values = rng.normal(size=1 << 20)
    values[rng.random(values.size) < 0.3] = 0.0
    small = rng.random(values.size) < 0.01
    values[small] = SUBNORMAL[dtype] * rng.choice([-1.0, 1.0], size=int(small.sum()))
    tensors = [torch.tensor(v, dtype=torch.float64).to(getattr(torch, dtype)) for v in (values, np.abs(values))]
    got = torch_stats.records(tensors, ["gradient", "relu"])
    for name, x, row in zip(("gradient", "relu"), tensors, got):
        _check(row, x.to(torch.float64).numpy(), dtype, name)
        assert row[F["zeros"]] > 0 and row[F["underflow"]] > 0, name


def test_torch_records_stay_exact_when_a_tensors_zeros_come_and_go():
    """Which passes a tensor of both signs gets follows its last record
    (zeros then, counted at once): never what is counted."""
    torch = pytest.importorskip("torch")
    from tb_numerics.backends import torch_stats

    rng = np.random.default_rng(2)
    with_zeros = rng.normal(size=4096)
    with_zeros[::5] = 0.0
    with_zeros[1::97] = SUBNORMAL["float32"]
    for values in (with_zeros, rng.normal(size=4096), with_zeros, rng.normal(size=4096)):
        x = torch.tensor(values, dtype=torch.float32)
        _check(torch_stats.records([x], ["gradients/kernel"])[0], x.to(torch.float64).numpy(), "float32", "step")


def test_non_float_tensors_are_refused_by_name():
    torch = pytest.importorskip("torch")
    jnp = pytest.importorskip("jax.numpy")
    from tb_numerics.backends import jax_stats, torch_stats

    with pytest.raises(TypeError, match="'ids'.*int32"):
        torch_stats.records([torch.zeros(3, dtype=torch.int32)], ["ids"])
    with pytest.raises(TypeError, match="'ids'.*int32"):
        jax_stats.tensor_stats(jnp.zeros(3, jnp.int32), "ids")


def test_memory_an_operator_allocates_without_writing_is_no_value_of_the_step():
    """``torch.empty`` hands out whatever the memory held, NaN too, until an op fills it
    (Dropout's ``empty_like(x).bernoulli_(p)``, a GRU's ``recurrent_dropout``): the PyTorch
    replay named ``empty_like`` as the step's first non-finite op. The truth: the log(0)
    injected after the fills."""
    torch = pytest.importorskip("torch")
    from tb_numerics.backends import torch_replay

    class Outside:
        layer = ""  # the replay's layer scope: none

    mode = torch_replay._FirstNonFinite(Outside(), 3)
    garbage = 0
    for _ in range(20):
        freed = torch.full((64,), float("nan"))  # made outside the replay's mode
        del freed  # the allocator hands its block out again, NaNs and all
        with mode:
            t = torch.empty(64)
            garbage += int(torch.isnan(t).any())
            t.fill_(1.0)
    with mode:
        torch.log(t - 1.0)  # INJECTED_LOG0
    if not garbage:
        pytest.skip("this allocator handed out no NaN left by a freed tensor")
    lines = inspect.getsource(sys.modules[__name__]).splitlines()
    line = next(i for i, text in enumerate(lines, 1) if text.rstrip().endswith("INJECTED_LOG0"))
    assert mode.found is not None and mode.found.op_type == "log", mode.found
    assert ("test_backend_stats.py:%d (" % line) in mode.found.source, mode.found.source
