"""`tb-numerics report` on logdirs that TensorFlow's filesystems hold.

``ram://`` is TensorFlow's in-memory filesystem, one per process: the runs
are written there with ``log_numerics`` and read with ``cli.main`` in this
process, and must give the same answer as the same runs on local disk,
damage included. A scheme with no filesystem here is a usage error that
names it; local logdirs need no TensorFlow.
"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from tensorboard.compat.proto import event_pb2

import tb_numerics as tbn
from tb_numerics import cli
from tb_numerics.record_writer import NumericsRecordWriter
from tb_numerics.records import numpy_stats
from tb_numerics import metadata

pytestmark = pytest.mark.unit

NAN_STEP = 7


def _train(run_dir: str, nan: bool) -> None:
    """Ten steps of an activation and a loss, logged with ``log_numerics``,
    one event per record (``every_n_steps`` keeps that layout), so that the
    damage below hits one record."""
    writer = tf.summary.create_file_writer(run_dir)
    with writer.as_default():
        for step in range(10):
            values = np.linspace(-1, 1, 64).astype(np.float32) * (1 + step)
            if nan and step == NAN_STEP:
                values[:2] = np.nan
            h = tf.constant(values)
            tbn.log_numerics("dense/output", h, step=step, every_n_steps=1)
            tbn.log_numerics("loss", tf.reduce_mean(h * h), step=step, every_n_steps=1)
    writer.close()


def _records(data: bytes) -> list[tuple[int, event_pb2.Event]]:
    """(offset, event) of every record of an intact event file."""
    out, o = [], 0
    while o < len(data):
        (n,) = struct.unpack_from("<Q", data, o)
        out.append((o, event_pb2.Event.FromString(data[o + 12 : o + 12 + n])))
        o += 16 + n
    return out


def _flip_a_value(data: bytes, tag: str, step: int) -> bytes:
    """Flips a byte of the values of ``tag``'s record at ``step``."""
    for o, e in _records(data):
        values = [v for v in e.summary.value if v.tag == tag]
        if values and e.step == step:
            content = values[0].tensor.tensor_content
            at = data.index(content, o) + len(content) - 1
            return data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :]
    raise AssertionError("no record of %s at step %d" % (tag, step))


def _damage(run_dir: str, how) -> None:
    (name,) = tf.io.gfile.listdir(run_dir)
    path = run_dir + "/" + name
    with tf.io.gfile.GFile(path, "rb") as f:
        data = f.read()
    tf.io.gfile.remove(path)  # TensorFlow's ram:// appends where it should truncate
    with tf.io.gfile.GFile(path, "wb") as f:
        f.write(how(data))


def _write_runs(root: str) -> None:
    """The same four runs, wherever ``root`` is."""
    _train(root + "/healthy", nan=False)
    _train(root + "/nan", nan=True)
    _train(root + "/truncated", nan=True)
    _damage(root + "/truncated", lambda d: d[:-30])
    _train(root + "/bad_crc", nan=False)
    _damage(root + "/bad_crc", lambda d: _flip_a_value(d, "dense/output", 3))


def _report(capsys, *args: str) -> tuple[int, dict, str]:
    code = cli.main(["report", *args, "--json"])
    out, err = capsys.readouterr()
    return code, json.loads(out) if out else {}, err


def _without_file_names(report: dict) -> dict:
    """The report with event file names (host, pid, time) taken out of problems."""
    text = re.sub(r"events\.out\.tfevents\.[^:]*:", "FILE:", json.dumps(report, sort_keys=True))
    return json.loads(text)


def test_a_ram_logdir_reports_what_the_same_runs_on_disk_report(tmp_path, capsys):
    local, remote = str(tmp_path / "logs"), "ram://tbn-remote/logs"
    _write_runs(local)
    _write_runs(remote)
    code_local, want, _ = _report(capsys, local)
    code_remote, got, err = _report(capsys, remote)
    assert code_remote == code_local == cli.EXIT_ANOMALY, err
    assert _without_file_names(got) == _without_file_names(want)
    runs = {r["run"]: r for r in got["runs"]}
    assert sorted(runs) == ["bad_crc", "healthy", "nan", "truncated"]
    assert runs["nan"]["first_anomaly"]["step"] == NAN_STEP and runs["nan"]["problems"] == []
    assert runs["truncated"]["first_anomaly"]["step"] == NAN_STEP
    assert any("truncated" in p for p in runs["truncated"]["problems"])
    assert runs["bad_crc"]["records"] == 19 and runs["bad_crc"]["first_anomaly"] is None
    assert "dense/output: 1 damaged record(s) skipped" in runs["bad_crc"]["problems"]
    # Damage alone, remote too: not a clean exit.
    assert cli.main(["report", remote + "/bad_crc"]) == cli.EXIT_UNREADABLE
    assert cli.main(["report", remote + "/healthy"]) == cli.EXIT_OK
    capsys.readouterr()


def test_a_remote_file_is_streamed_in_chunks_not_read_whole(monkeypatch, capsys):
    """A packed run bigger than several chunks reads the same, one pass."""
    from tb_numerics import tfrecord

    monkeypatch.setattr(tfrecord, "CHUNK_BYTES", 4096)
    reads: list[int] = []
    real_read = tf.io.gfile.GFile.read

    def counting_read(self, n=-1):
        data = real_read(self, n)
        if self.name.startswith("ram://tbn-chunks/"):
            reads.append(len(data))
        return data

    monkeypatch.setattr(tf.io.gfile.GFile, "read", counting_read)
    info = metadata.TensorInfo(role="activation")
    run = "ram://tbn-chunks/logs/run"
    tf.io.gfile.makedirs(run)
    path = run + "/events.out.tfevents.1.test"
    with tf.io.gfile.GFile(path, "wb") as f:
        f.write(_packed_file_bytes(info))
    size = tf.io.gfile.stat(path).length
    code, report, err = _report(capsys, "ram://tbn-chunks/logs")
    (r,) = report["runs"]
    assert code == cli.EXIT_ANOMALY and r["first_anomaly"]["step"] == 1500 and r["records"] == 2000 * 3, err
    assert sum(reads) == size and max(reads) <= 4096 and size > 20 * 4096


def _packed_file_bytes(info: metadata.TensorInfo) -> bytes:
    """A packed run of 3 tensors over 2,000 steps, NaN at step 1500, as bytes."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        with NumericsRecordWriter(d) as w:
            for step in range(2000):
                bad = np.float32([np.nan]) if step == 1500 else np.float32([1.0, step])
                w.write_many(step, [("a", numpy_stats(np.float32([step])), info), ("b", numpy_stats(bad), info),
                                    ("c", numpy_stats(np.float32([2.0])), info)])
        with open(w.path, "rb") as f:
            return f.read()


@pytest.mark.parametrize("scheme", ["s3", "nosuchfs"])
def test_a_filesystem_that_is_not_available_is_a_usage_error_naming_it(scheme, capsys):
    code = cli.main(["report", "%s://bucket/logs" % scheme])
    _, err = capsys.readouterr()
    assert code == cli.EXIT_USAGE
    assert "the filesystem %s:// is not available" % scheme in err and "Traceback" not in err


def test_a_missing_remote_logdir_is_a_usage_error(capsys):
    assert cli.main(["report", "ram://tbn-missing/logs"]) == cli.EXIT_USAGE
    assert "no such logdir: ram://tbn-missing/logs" in capsys.readouterr().err


# Runs the CLI with TensorFlow made unimportable.
_NO_TF = "import sys; sys.modules['tensorflow'] = None; from tb_numerics import cli; sys.exit(cli.main(sys.argv[1:]))"


def test_local_logdirs_need_no_tensorflow_and_remote_ones_say_so(tmp_path):
    info = metadata.TensorInfo(role="activation")
    with NumericsRecordWriter(str(tmp_path / "run")) as w:
        for step in range(5):
            w.write("t", step, numpy_stats(np.float32([np.inf] if step == 3 else [1.0])), info)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", _NO_TF, *args], capture_output=True, text=True, timeout=120, env=env)

    p = run("report", str(tmp_path), "--json")
    assert p.returncode == cli.EXIT_ANOMALY, p.stderr
    assert json.loads(p.stdout)["runs"][0]["first_anomaly"]["step"] == 3
    p = run("report", "gs://bucket/logs")
    assert p.returncode == cli.EXIT_USAGE and "gs:// paths are read through TensorFlow" in p.stderr


@pytest.mark.parametrize("fast", [True, False], ids=["google_crc32c", "numpy"])
def test_the_crc32c_is_tensorboards(fast, monkeypatch):
    """Both ways of checking a record (the CPU's CRC32C, and the numpy
    lanes where google-crc32c is missing) give TensorBoard's checksums."""
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    from tb_numerics import _crc32c

    if fast:
        assert _crc32c.FAST is not None, "google-crc32c with its C extension is a dependency"
    else:
        monkeypatch.setattr(_crc32c, "FAST", None)
    rng = np.random.default_rng(0)
    sizes = [0, 1, 7, 8, 63, 64, 65, 1000, 130_000] + rng.integers(0, 300, 100).tolist()
    datas = [rng.bytes(int(n)) for n in sizes]
    assert _crc32c.masked_crc32c_many(datas).tolist() == [masked_crc32c(d) for d in datas]
    assert _crc32c.masked_crc32c_many([]).tolist() == []
    assert [_crc32c.masked_crc32c(d) for d in datas[:20]] == [masked_crc32c(d) for d in datas[:20]]
    whole = rng.bytes(300_001)
    cuts = [whole[:1], whole[1:70_000], whole[70_000:70_000], whole[70_000:]]
    assert _crc32c.masked_crc32c_chunks(cuts) == masked_crc32c(whole)
    assert _crc32c.masked_crc32c_chunks([]) == masked_crc32c(b"")
