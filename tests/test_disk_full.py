"""``log_numerics`` on a disk that fills: said once, naming the logdir; training goes on.

TensorFlow's summary writer ignores a failed append (``write_check``): a
``tf.function`` step that logs 10 tensors trains on a full filesystem with
nothing raised and nothing said, its NaN step among the records lost. One
subprocess trains twice: first into a healthy logdir (nothing may be said),
then into one on a 64 KiB tmpfs that is filled after step 0 is on disk (the
tests run as root; where no tmpfs can be mounted, a file-size limit,
``RLIMIT_FSIZE``, makes the writes fail instead: set ``TBN_FULL_DISK=rlimit``
to force that). Truth: the step of the injected NaN, found in the healthy
logdir and missing from the full one (so the records were really lost).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import tiny_disk

pytestmark = pytest.mark.e2e

NAN_STEP = 150

_TRAIN = textwrap.dedent("""
    import os, resource, signal, sys
    import numpy as np
    import tensorflow as tf
    import tb_numerics as tbn

    healthy, full, how = sys.argv[1:4]

    def fill_filesystem(path):
        with open(os.path.join(os.path.dirname(full), "filler"), "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"x" * 4096)
            except OSError:
                pass

    def limit_file_size(path):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(path) + 2048, hard))

    def train(logdir, make_full):
        writer = tf.summary.create_file_writer(logdir)
        step = tf.Variable(0, dtype=tf.int64)

        @tf.function
        def log(x):
            for i in range(10):
                tbn.log_numerics("t%d" % i, x + i)

        with writer.as_default(step=step):
            log(tf.ones([64]))
            writer.flush()  # step 0 on disk
            if make_full:
                path = [os.path.join(logdir, f) for f in os.listdir(logdir)][0]
                make_full(path)
            for s in range(1, 300):
                step.assign(s)
                log(tf.ones([64]) * (np.nan if s == NAN_STEP else 1.0))
        writer.close()

    train(healthy, None)
    print("healthy run done", file=sys.stderr, flush=True)
    train(full, fill_filesystem if how == "tmpfs" else limit_file_size)
    print("training went on")
""").replace("NAN_STEP", str(NAN_STEP))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(healthy logdir, full logdir, how it was filled, the process)."""
    root = tmp_path_factory.mktemp("disk_full")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    with tiny_disk.tiny_tmpfs(root, mount=os.environ.get("TBN_FULL_DISK", "tmpfs") == "tmpfs") as (tiny, mounted):
        how = "tmpfs" if mounted else "rlimit"
        p = subprocess.run([sys.executable, "-c", _TRAIN, str(root / "healthy"), str(tiny / "run"), how],
                           capture_output=True, text=True, env=env, timeout=300)
        yield root / "healthy", tiny / "run", how, p


def report(logdir) -> tuple[int, dict]:
    p = subprocess.run([sys.executable, "-m", "tb_numerics.cli", "report", str(logdir), "--json"],
                       capture_output=True, text=True, timeout=120)
    return p.returncode, json.loads(p.stdout)["runs"][0]


def test_lost_records_are_said_once_naming_the_logdir_and_training_goes_on(trained) -> None:
    healthy, full, how, p = trained
    assert p.returncode == 0 and "training went on" in p.stdout, p.stderr[-3000:]
    before, _, after = p.stderr.partition("healthy run done")
    said = [line for line in after.splitlines() if line.startswith("tb-numerics: warning:")]
    assert "tb-numerics: warning:" not in before, before[-3000:]  # a healthy run: nothing said
    assert len(said) == 1, (how, p.stderr[-3000:])
    assert said[0].startswith("tb-numerics: warning: numerics records could not be written to %s (its event file "
                              % full), said[0]
    assert "bytes of records were written" in said[0]
    # The oracle: the injected NaN is on disk in the healthy run, and was lost in the full one.
    code, run = report(healthy)
    assert (code, run["first_anomaly"]["step"]) == (1, NAN_STEP)
    code, run = report(full)
    assert code == 3 and run["first_anomaly"] is None, run  # a cut file, named; the NaN step not in it
    assert any("truncated" in problem for problem in run["problems"]), run["problems"]
