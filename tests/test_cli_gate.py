"""`tb-numerics report` as a gate (issue 27): it never says "healthy" by
mistake, never hangs, and needs no TensorFlow for a local logdir.

Every check goes through the real CLI in a subprocess, on event files
written by real writers: two processes at once, hand-crafted impossible
records through the project's record writer, a FIFO, a damaged record of
hundreds of megabytes, Keras' own TensorBoard callback.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tb_numerics import metadata
from tb_numerics.record_writer import NumericsRecordWriter
from tb_numerics.records import F, numpy_stats

import tiny_disk

pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ACT = metadata.TensorInfo(dtype="float32", role="activation", order=0)
LOSS = metadata.TensorInfo(dtype="float32", role="loss", order=1)
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)


def run_cli(*args, python_flags=(), timeout=60):
    p = subprocess.run(
        [sys.executable, *python_flags, "-m", "tb_numerics.cli", "report", *args],
        capture_output=True, text=True, timeout=timeout, env=ENV,
    )
    return p.returncode, p.stdout, p.stderr


def runs_of(out: str) -> dict[str, dict]:
    return {r["run"]: r for r in json.loads(out)["runs"]}


def healthy(n=64, seed=0):
    return numpy_stats(np.random.default_rng(seed).normal(size=n).astype(np.float32))


# Two writer processes in one run: each writes its first half, waits for the
# other's, then its second half, so that they really write at the same time.
# The second waits until the first's file is named a second earlier (event
# files sort by the time in their name): the earlier file holds the NaN.
_WRITER = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    from tb_numerics import metadata
    from tb_numerics.record_writer import NumericsRecordWriter
    from tb_numerics.records import numpy_stats
    run, me, other, steps, nan_step = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    def wait(path):
        while not os.path.exists(path):
            time.sleep(0.01)
    if me == "b":
        wait(run + "/../a.named")
        while int(time.time()) <= int(open(run + "/../a.named").read()):
            time.sleep(0.01)
    w = NumericsRecordWriter(run)
    open(run + "/../%s.named" % me, "w").write(os.path.basename(w.path).split(".")[3])
    info = metadata.TensorInfo(dtype="float32", role="activation", order=0)
    rng = np.random.default_rng(ord(me))
    for step in range(steps):
        if step == steps // 2:
            w.flush()
            open(run + "/../%s.half" % me, "w").close()
            wait(run + "/../%s.half" % other)
        x = rng.normal(size=64).astype(np.float32)
        if step == nan_step:
            x[3] = np.nan
        w.write_many(step, [("dense/output", numpy_stats(x), info), ("loss", numpy_stats(x[:1]), info)])
    w.close()
""")


def test_two_writers_at_once_keep_both_and_find_the_nan_in_the_earlier_file(tmp_path):
    run = tmp_path / "logs" / "run"
    run.mkdir(parents=True)
    steps = 300
    procs = [
        subprocess.Popen([sys.executable, "-c", _WRITER, str(run), me, other, str(steps), str(nan)], env=ENV)
        for me, other, nan in (("a", "b", 120), ("b", "a", -1))
    ]
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    a_file = sorted(os.listdir(run))[0]
    assert a_file.split(".")[3] == (tmp_path / "logs" / "a.named").read_text()  # the NaN's file sorts first
    code, out, err = run_cli(str(tmp_path / "logs"), "--json")
    r = runs_of(out)["run"]
    assert code == 1, err
    assert r["first_anomaly"]["step"] == 120 and r["first_anomaly"]["tensor"] == "dense/output"
    assert r["records"] == 2 * 2 * steps  # both writers' records of both tensors
    assert any("more than one writer at once" in p and "steps 0 to %d" % (steps - 1) in p for p in r["problems"])


def _impossible(kind: str) -> tuple[int, np.ndarray]:
    """(step, record) of a record no tensor can produce; NaN-bearing where
    that would otherwise be reported as the first anomaly."""
    rec = healthy()
    if kind == "empty_with_nan_stats":
        rec[:] = 0
        rec[[F["min"], F["max"], F["sum"]]] = np.nan
    elif kind == "min_above_max":
        rec[F["min"]], rec[F["max"]] = 2.0, -2.0
    elif kind == "infinite_sum_without_inf":
        rec[F["sum"]] = np.inf
    elif kind == "fractional_count":
        rec[F["count"]] = 63.5
    elif kind == "negative_step":
        rec = numpy_stats(np.array([np.nan, 1.0], np.float32))
        return -3, rec
    return 5, rec


IMPOSSIBLE = ["empty_with_nan_stats", "min_above_max", "infinite_sum_without_inf", "fractional_count", "negative_step"]


def test_records_that_no_tensor_can_produce_are_damage_not_health(tmp_path):
    for kind in IMPOSSIBLE:
        bad_step, bad = _impossible(kind)
        with NumericsRecordWriter(str(tmp_path / ("single_" + kind))) as w:
            for step in range(10):
                w.write("dense/output", step, bad if step == bad_step else healthy(seed=step), ACT)
            if bad_step < 0:
                w.write("dense/output", bad_step, bad, ACT)
        with NumericsRecordWriter(str(tmp_path / ("packed_" + kind))) as w:
            for step in range(10):
                w.write_many(step, [("dense/output", bad if step == bad_step else healthy(seed=step), ACT)])
            if bad_step < 0:
                w.write_many(bad_step, [("dense/output", bad, ACT)])
    code, out, err = run_cli(str(tmp_path), "--json")
    runs = runs_of(out)
    assert code == 3, (err, {k: r["first_anomaly"] for k, r in runs.items()})
    assert len(runs) == 2 * len(IMPOSSIBLE)
    for name, r in runs.items():
        assert r["first_anomaly"] is None, name
        assert r["records"] == (10 if name.endswith("negative_step") else 9), name
        assert any("malformed" in p or "no valid step" in p for p in r["problems"]), (name, r["problems"])


def test_a_fifo_named_like_an_event_file_is_skipped_and_named(tmp_path):
    with NumericsRecordWriter(str(tmp_path / "healthy")) as w:
        w.write("dense/output", 0, healthy(), ACT)
    (tmp_path / "live").mkdir()
    os.mkfifo(tmp_path / "live" / "events.out.tfevents.1.host.fifo")
    code, out, err = run_cli(str(tmp_path), "--json", timeout=30)
    runs = runs_of(out)
    assert code == 3, err
    assert runs["healthy"]["first_anomaly"] is None and not runs["healthy"]["problems"]
    assert "events.out.tfevents.1.host.fifo: cannot open (not a regular file: skipped)" in runs["live"]["problems"]
    assert "not a regular file" in err


# Peak memory of the CLI, run in process so that ru_maxrss is its own.
_PEAK = textwrap.dedent("""
    import resource, sys
    from tb_numerics import cli
    code = cli.main(["report", "--json", sys.argv[1]])
    print(code, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)
""")


def _peak(logdir):
    p = subprocess.run([sys.executable, "-c", _PEAK, str(logdir)], capture_output=True, text=True, env=ENV, timeout=120)
    code, kb = p.stderr.split()[-2:]
    return int(code), int(kb) * 1024, p.stdout


def test_a_huge_damaged_record_is_checked_in_bounded_memory(tmp_path):
    """A record of 80 MiB (beyond what is held whole) with a bad checksum:
    skipped, reported, and never held (it was held about twice)."""
    with NumericsRecordWriter(str(tmp_path / "small" / "run")) as w:
        w.write("dense/output", 0, healthy(), ACT)
    big = tmp_path / "big" / "run"
    with NumericsRecordWriter(str(big)) as w:
        w.write("dense/output", 0, healthy(), ACT)
        path = w.path
    size = 80 << 20
    with open(path, "ab") as f:
        header = struct.pack("<Q", size)
        from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
        f.write(header + struct.pack("<I", masked_crc32c(header)))
        f.truncate(f.tell() + size + 4)  # zeros: the data's checksum fails
    _, base, _ = _peak(tmp_path / "small")
    code, peak, out = _peak(tmp_path / "big")
    (r,) = json.loads(out)["runs"]
    assert code == 3 and r["records"] == 1
    assert any("1 corrupt record(s) skipped" in p for p in r["problems"]), r["problems"]
    assert peak - base < 40 << 20, (peak, base)


def test_nothing_found_is_its_own_exit_status(tmp_path):
    (tmp_path / "empty").mkdir()
    for run in ("a", "b/c"):
        (tmp_path / "not_yet" / run).mkdir(parents=True)
    code, out, _ = run_cli(str(tmp_path / "empty"))
    assert code == 4 and "no numerics records and no scalar summaries" in out
    assert run_cli(str(tmp_path / "not_yet"))[0] == 4
    with NumericsRecordWriter(str(tmp_path / "not_yet" / "a")):
        pass  # a training that opened its writer and wrote nothing yet
    assert run_cli(str(tmp_path / "not_yet"))[0] == 4


# One TensorFlow process for two checks: Keras' own TensorBoard callback
# writing a loss that goes NaN at epoch 2, and (where a tiny filesystem could
# be mounted) the project's record writer, with TensorFlow loaded as in the
# Keras callback, writing to a full disk with a NaN step among the lost.
_TF_WRITERS = textwrap.dedent("""
    import os, sys
    import numpy as np, keras
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    poison = keras.callbacks.LambdaCallback(on_epoch_begin=lambda epoch, logs: epoch == 2 and
                                            model.layers[0].kernel.assign(np.full((4, 1), np.nan)))
    x, y = np.ones((8, 4), np.float32), np.ones((8, 1), np.float32)
    model.fit(x, y, epochs=4, verbose=0, callbacks=[keras.callbacks.TensorBoard(sys.argv[1]), poison])
    if len(sys.argv) > 2:
        from tb_numerics import metadata
        from tb_numerics.record_writer import NumericsRecordWriter
        from tb_numerics.records import numpy_stats
        info = metadata.TensorInfo(dtype="float32")
        w = NumericsRecordWriter(sys.argv[2])
        w.write_many(0, [("x", numpy_stats(np.ones(4)), info)])
        w.flush()
        with open(os.path.join(sys.argv[2], "..", "filler"), "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"x" * 4096)
            except OSError:
                pass
        for step in range(1, 200):
            w.write_many(step, [("x", numpy_stats(np.full(4, np.nan if step == 150 else 1.0)), info)])
        w.close()
        print("training went on")
""")


@pytest.fixture(scope="module")
def tf_writers(tmp_path_factory):
    """(Keras logdir, full logdir or None, the process' stdout and stderr)."""
    root = tmp_path_factory.mktemp("tf_writers")
    with tiny_disk.tiny_tmpfs(root) as (tiny, mounted):
        args = [str(root / "keras")] + ([str(tiny / "run")] if mounted else [])
        p = subprocess.run([sys.executable, "-c", _TF_WRITERS, *args], capture_output=True, text=True, env=ENV,
                           timeout=180)
        yield root / "keras", (tiny / "run") if mounted else None, p


def test_keras_scalar_summaries_going_nan_fail_the_gate(tf_writers):
    """Keras' own TensorBoard callback writes tf.summary.scalar only: its
    loss going NaN at epoch 2 is found, with a pointer to log_numerics."""
    logdir, _, p = tf_writers
    assert p.returncode == 0, p.stderr[-3000:]
    code, out, err = run_cli(str(logdir), "--json")
    assert code == 1, err
    a = runs_of(out)["train"]["first_anomaly"]
    assert (a["step"], a["tensor"], a["nan"], a["last_healthy_step"]) == (2, "epoch_loss", 1, 1)
    assert "log_numerics" in a["hint"]
    code, out, _ = run_cli(str(logdir))
    assert "first anomaly: step 2, epoch_loss (scalar summary): its scalar summary is NaN" in out


def test_a_full_disk_is_said_once_naming_the_logdir_and_training_goes_on(tf_writers):
    _, full, p = tf_writers
    if full is None:
        pytest.skip("no tmpfs could be mounted here (needs root)")
    assert p.returncode == 0 and "training went on" in p.stdout, p.stderr[-3000:]
    said = [line for line in p.stderr.splitlines() if line.startswith("tb-numerics: warning:")]
    assert len(said) == 1 and "could not be written to %s (" % full in said[0], p.stderr[-3000:]


# The CLI's own entry point, then what it imported.
_MODULES = textwrap.dedent("""
    import runpy, sys
    sys.argv = ["tb-numerics", "report", sys.argv[1]]
    try:
        runpy.run_module("tb_numerics.cli", run_name="__main__")
    except SystemExit as e:
        print(e.code, sorted(m for m in sys.modules if m.split(".")[0] in ("tensorflow", "tb_numerics")))
""")


def test_a_local_report_never_imports_tensorflow(tmp_path):
    with NumericsRecordWriter(str(tmp_path / "run")) as w:
        for step in range(3):
            w.write_many(step, [("dense/output", healthy(seed=step), ACT), ("loss", healthy(1), LOSS)])
    p = subprocess.run([sys.executable, "-c", _MODULES, str(tmp_path)], capture_output=True, text=True, env=ENV, timeout=60)
    code, modules = p.stdout.strip().splitlines()[-1].split(" ", 1)
    assert code == "0" and "tb_numerics.event_reader" in modules, p.stdout[-2000:]
    assert "'tensorflow'" not in modules, "the report imported TensorFlow"


def test_cli_wording_names_flags_and_the_run(tmp_path):
    with NumericsRecordWriter(str(tmp_path / "run1")) as w:
        w.write("dense/output", 0, healthy(), ACT)
    code, _, err = run_cli(str(tmp_path), "--spike-factor", "zero")
    assert code == 2 and "--spike-factor must be a number" in err and "spike_factor" not in err
    code, _, err = run_cli(w.path)
    assert code == 2 and "is a file, not a logdir" in err and "no such logdir" not in err
    code, out, _ = run_cli(str(tmp_path / "run1"), "--json")
    assert code == 0 and [r["run"] for r in json.loads(out)["runs"]] == ["run1"]
