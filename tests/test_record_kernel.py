"""The record kernel: built where a compiler is, the numpy reference's record
at every size its shards and blocks split, and TensorFlow's ops where it
cannot be built. (tests/test_stats.py runs its cases both ways.)"""

import json
import os
import platform
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

from tb_numerics import metadata, record_kernel, stats
from tb_numerics.records import numpy_stats

pytestmark = pytest.mark.e2e

F = metadata.FIELD_INDEX
COUNTS = ["count", "nan", "posinf", "neginf", "zeros", "overflow", "underflow"]


def _kernel_or_skip():
    if record_kernel.load() is None:
        pytest.skip("no record kernel on this machine (see test_the_kernel_builds_where_a_compiler_is)")


def test_the_kernel_builds_where_a_compiler_is():
    if not (shutil.which("g++") or os.environ.get("CXX")) or platform.machine() != "x86_64":
        pytest.skip("no C++ compiler or not x86-64: TensorFlow's ops serve here")
    assert record_kernel.load() is not None, record_kernel.library_path().with_suffix(".failed").read_text()


# Sizes on each side of a block (8,192 values) and of a shard (65,536), and
# one split over many shards; the special values land in the last block.
@pytest.mark.parametrize("size", [1, 8191, 8193, 65535, 65537, 3 * 65536 + 7, 2**21 + 3])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("kind", ["relu", "signed", "nonfinite"])
def test_the_kernels_record_is_numpys_at_every_split(size, dtype, kind):
    _kernel_or_skip()
    rng = np.random.default_rng(size)
    x = rng.standard_normal(size).astype(dtype) * 3
    tiny = metadata.smallest_normal(dtype)
    if kind == "relu":
        x = np.maximum(x, 0)
        x[-1] = tiny / 8
    elif kind == "signed":
        x[-1] = -tiny / 2
    else:
        x[-1] = np.nan
        x[size // 2] = -np.inf
        x[0] = tiny / 4
    want = numpy_stats(x.astype(np.float64), dtype)
    for fn in (stats.tensor_stats, tf.function(stats.tensor_stats)):
        got = fn(tf.constant(x), "x").numpy()
        for f in COUNTS:
            assert got[F[f]] == want[F[f]], (f, got, want)
        for f in ("min", "max"):
            np.testing.assert_equal(got[F[f]] + 0.0, want[F[f]] + 0.0, err_msg=f)
        np.testing.assert_allclose(got[F["sum"]], want[F["sum"]], rtol=1e-6, atol=1e-6 * size * 10)
        # (a lone subnormal's square underflows in float32: 0 against numpy's float64)
        np.testing.assert_allclose(got[F["sum_sq"]], want[F["sum_sq"]], rtol=1e-6, atol=1e-30)


def test_many_small_records_and_moved_norms_are_one_node_per_dtype():
    # A step's hundreds of small weights and gradients cost one node each to
    # trace and instantiate when recorded one by one (ResNet-50's first
    # epoch); a large one keeps its own op, which starts as soon as its
    # tensor is made. The values are test_stats.py's (numpy's records).
    _kernel_or_skip()
    xs = [tf.zeros([i + 1]) for i in range(300)] + [tf.zeros([3], tf.float64), tf.zeros([2], tf.float16)]
    xs += [tf.zeros([stats.SMALL_TENSOR + 1])] * 2
    names = ["w%d" % i for i in range(len(xs))]
    graph = tf.function(lambda: stats.records_of(xs, names)).get_concrete_function().graph
    types = [op.type for op in graph.get_operations()]
    assert types.count("TbnRecords") == 2  # float32 (float16 widened) and float64
    assert types.count("TbnRecord") == 2
    due = tf.constant(True)
    graph = tf.function(lambda: stats.moved_since(xs[:300], stats.keep_if(xs[:300], names[:300], due, record=True,
                                                                          copy=True)[1], due)).get_concrete_function().graph
    types = [op.type for op in graph.get_operations()]
    assert types.count("TbnKeep") == types.count("TbnMoved") == 1 and "If" not in types and "StatelessIf" not in types


def test_not_used_inside_a_compiled_step():
    # XLA has no kernel of ours: a jit_compile step keeps TensorFlow's ops.
    _kernel_or_skip()
    fn = tf.function(lambda v: stats.tensor_stats(v, "x"), jit_compile=True)
    graph = fn.get_concrete_function(tf.zeros([8])).graph
    assert "TbnRecord" not in [op.type for op in graph.get_operations()]
    np.testing.assert_array_equal(fn(tf.constant([1.0, 0.0, -2.0])).numpy()[:6], [3, 0, 0, 0, -2, 1])


_PROBE = textwrap.dedent("""
    import json, logging, numpy as np, tensorflow as tf
    logging.basicConfig()
    from tb_numerics import record_kernel, stats
    got = stats.tensor_stats(tf.constant([0.0, 1.0, np.nan, -3.0], tf.float32), "x").numpy()
    print(json.dumps({"loaded": record_kernel.load() is not None, "record": [None if np.isnan(v) else v for v in got.tolist()]}))
""")


def _probe(env: dict) -> tuple[dict, str]:
    done = subprocess.run([sys.executable, "-c", _PROBE], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_where_it_cannot_be_built_the_ops_serve_the_same_record_and_it_is_not_tried_again(tmp_path):
    failing = tmp_path / "cxx"
    failing.write_text("#!/bin/sh\necho 'no compiler here' >&2\nexit 1\n")
    failing.chmod(0o755)
    env = {"TB_NUMERICS_CACHE_DIR": str(tmp_path / "cache"), "CXX": str(failing)}
    first, err = _probe(env)
    want = [4, 1, 0, 0, -3, 1, -2, 10, 1, 0, 0]
    assert first == {"loaded": False, "record": want}
    assert "record kernel was not built" in err and "no compiler here" in err
    marks = list((tmp_path / "cache").glob("*.failed"))
    assert len(marks) == 1 and "no compiler here" in marks[0].read_text()
    # The next process does not spend the build again.
    second, err = _probe(env)
    assert second == first and "building" not in err


def test_switched_off_by_the_environment(tmp_path):
    got, _ = _probe({"TB_NUMERICS_RECORD_KERNEL": "0", "TB_NUMERICS_CACHE_DIR": str(tmp_path)})
    assert got["loaded"] is False and got["record"][0] == 4
    assert not list(tmp_path.iterdir())  # nothing built


def test_a_cache_directory_that_cannot_be_made_leaves_the_ops_serving(tmp_path):
    # A read-only home, a cache path under a file: training goes on.
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    got, err = _probe({"TB_NUMERICS_CACHE_DIR": str(blocker / "cache")})
    assert got == {"loaded": False, "record": [4, 1, 0, 0, -3, 1, -2, 10, 1, 0, 0]}
    assert "no cache directory" in err


def test_processes_starting_together_build_it_once(tmp_path):
    # A sweep or a test farm starts many trainings on a fresh machine: one
    # builds, the others wait for its library.
    if not (shutil.which("g++") or os.environ.get("CXX")) or platform.machine() != "x86_64":
        pytest.skip("no C++ compiler or not x86-64: TensorFlow's ops serve here")
    env = {**os.environ, "TB_NUMERICS_CACHE_DIR": str(tmp_path)}
    env.pop("TB_NUMERICS_RECORD_KERNEL", None)
    procs = [subprocess.Popen([sys.executable, "-c", _PROBE], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err[-2000:] for _, err in outs]
    for out, _ in outs:
        assert json.loads(out.strip().splitlines()[-1]) == {"loaded": True, "record": [4, 1, 0, 0, -3, 1, -2, 10, 1, 0, 0]}
    assert sum("building its record kernel" in err for _, err in outs) == 1
    assert len(list(tmp_path.glob("*.so"))) == 1 and not list(tmp_path.glob("*.partial"))
