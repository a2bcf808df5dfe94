"""The wheel carries everything: modules, the frontend, the entry points."""

import glob
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), ROOT],
        check=True, capture_output=True, timeout=300,
    )
    (whl,) = glob.glob(str(out / "*.whl"))
    return whl


@pytest.fixture(scope="module")
def venv_python(wheel, tmp_path_factory):
    """A fresh venv's python with the wheel installed. Dependencies are the
    ones already installed for the tests (on PYTHONPATH); the package itself
    comes only from the wheel."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = str(venv / "bin" / "python")
    subprocess.run([py, "-m", "pip", "install", "--quiet", "--no-deps", wheel], check=True, timeout=300)
    return py


def test_wheel_installs_into_a_fresh_venv_and_tensorboard_finds_the_plugin(venv_python, tmp_path):
    py = venv_python
    deps = sysconfig.get_paths()["purelib"]
    check = r"""
import importlib.metadata as md, importlib.resources as res, os, sys
import tb_numerics, tb_numerics.plugin, tb_numerics.cli, tb_numerics.analysis
assert os.path.dirname(tb_numerics.__file__).startswith(sys.prefix), tb_numerics.__file__
assert "tensorflow" not in sys.modules, "the plugin must not import TensorFlow"
eps = {e.name: e.value for e in md.entry_points(group="tensorboard_plugins")}
assert eps.get("numerics") == "tb_numerics.plugin:NumericsLoader", eps
assert any(e.name == "tb-numerics" for e in md.entry_points(group="console_scripts"))
files = {p.name for p in res.files("tb_numerics.frontend").iterdir()}
assert "index.js" in files, files
assert res.files("tb_numerics").joinpath("http_api.md").is_file()
assert res.files("tb_numerics").joinpath("oplevel", "recorder.py").is_file()  # the subpackage ships too
from tensorboard import default
assert any(getattr(p, "__name__", "") == "NumericsLoader" for p in default.get_dynamic_plugins())
print("ok")
"""
    env = dict(os.environ, PYTHONPATH=deps, TF_CPP_MIN_LOG_LEVEL="2")
    p = subprocess.run([py, "-c", check], capture_output=True, text=True, timeout=120, env=env, cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "ok"


def test_the_wheel_declares_no_tensorflow_and_its_api_says_what_to_install(venv_python, tmp_path):
    """Issue 27: ``tensorflow-cpu`` in the requirements installed a second
    TensorFlow beside a user's GPU build. The plugin and the CLI run with
    TensorFlow blocked; the writing API's ImportError names the extras."""
    py = venv_python
    logdir = tmp_path / "logs"
    check = r"""
import importlib.metadata as md, sys
sys.modules["tensorflow"] = None  # as if TensorFlow were not installed
# The wheel's own metadata (an editable install on PYTHONPATH may shadow it).
(dist,) = md.distributions(name="tb-numerics", path=[p for p in sys.path if p.startswith(sys.prefix)])
reqs = dist.requires
plain = [r for r in reqs if "extra ==" not in r]
assert not any(r.startswith("tensorflow") for r in plain), plain
assert any(r.startswith("google-crc32c") for r in plain), plain  # the event files' checksums at the CPU's speed
assert any(r.startswith("tensorflow-cpu") and 'extra == "cpu"' in r for r in reqs), reqs
assert any(r.startswith("tensorflow[and-cuda]") and 'extra == "gpu"' in r for r in reqs), reqs
import tb_numerics.plugin
from tb_numerics import cli, metadata
from tb_numerics.record_writer import NumericsRecordWriter
from tb_numerics.records import numpy_stats
with NumericsRecordWriter(sys.argv[1] + "/run") as w:
    w.write("x", 0, numpy_stats(__import__("numpy").ones(4)), metadata.TensorInfo(dtype="float32"))
assert cli.main(["report", sys.argv[1]]) == 0
try:
    import tb_numerics.summary
except ImportError as e:
    assert 'pip install "tb-numerics[cpu]"' in str(e) and "tb-numerics[gpu]" in str(e), e
else:
    raise AssertionError("tb_numerics.summary imported without TensorFlow")
print("ok")
"""
    env = dict(os.environ, PYTHONPATH=sysconfig.get_paths()["purelib"], TF_CPP_MIN_LOG_LEVEL="2")
    p = subprocess.run([py, "-c", check, str(logdir)], capture_output=True, text=True, timeout=120, env=env,
                       cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == "ok"


def test_a_source_checkout_that_shadows_the_wheel_still_serves_the_dashboard(venv_python, tmp_path):
    """``python -m demo`` from the repository's top imports tb_numerics from the
    checkout, where the frontend is not a subpackage: the plugin must still
    find the dashboard's files (the README's first command does exactly this)."""
    py = venv_python
    check = r"""
import os, tb_numerics.plugin as p
assert p.__file__.startswith(os.getcwd()), p.__file__
d = p.frontend_dir()
assert d and os.path.isfile(os.path.join(d, "index.js")), d
print("ok")
"""
    env = dict(os.environ, PYTHONPATH=sysconfig.get_paths()["purelib"], TF_CPP_MIN_LOG_LEVEL="2")
    p = subprocess.run([py, "-c", check], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "ok"


def test_the_installed_wheel_builds_its_record_kernel_at_first_use(venv_python, tmp_path):
    """The README's first command installs the wheel, not the checkout: its
    first record builds the kernel from the source the wheel ships, into the
    cache, and the record is numpy's."""
    if not (shutil.which("g++") or os.environ.get("CXX")):
        pytest.skip("no C++ compiler: TensorFlow's ops serve (tests/test_record_kernel.py)")
    check = r"""
import os, sys, numpy as np, tensorflow as tf
from tb_numerics import record_kernel, stats
from tb_numerics.records import numpy_stats
assert record_kernel.__file__.startswith(sys.prefix), record_kernel.__file__
x = np.maximum(np.random.default_rng(0).standard_normal(100000).astype(np.float32), 0)
fn = tf.function(lambda v: stats.tensor_stats(v, "x"))
ops = [op.type for op in fn.get_concrete_function(tf.constant(x)).graph.get_operations()]
assert "TbnRecord" in ops, ops
got, want = fn(tf.constant(x)).numpy(), numpy_stats(x)
assert (got[[0, 1, 2, 3, 4, 5, 8, 9, 10]] == want[[0, 1, 2, 3, 4, 5, 8, 9, 10]]).all(), (got, want)
assert np.allclose(got, want, rtol=1e-6)
names = os.listdir(sys.argv[1])
print("ok", sum(n.endswith(".so") for n in names), sum(n.endswith(".partial") for n in names))
"""
    cache = tmp_path / "cache"
    env = dict(os.environ, PYTHONPATH=sysconfig.get_paths()["purelib"], TF_CPP_MIN_LOG_LEVEL="2",
               TB_NUMERICS_CACHE_DIR=str(cache))
    env.pop("TB_NUMERICS_RECORD_KERNEL", None)
    p = subprocess.run([venv_python, "-c", check, str(cache)], capture_output=True, text=True,
                       timeout=600, env=env, cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip() == "ok 1 0"  # the library, and nothing half-written beside it
    assert "building its record kernel" in p.stderr
