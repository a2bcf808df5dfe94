"""`tb-numerics report`: JSON schema, table, exit codes, damaged files."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from tensorboard.compat.proto import event_pb2

from tb_numerics import metadata
from tb_numerics.record_writer import NumericsRecordWriter
from tb_numerics.records import numpy_stats

pytestmark = pytest.mark.e2e

RNG = np.random.default_rng(1)
ACT = metadata.TensorInfo(dtype="float32", role="activation", order=0)
GRAD = metadata.TensorInfo(dtype="float32", role="gradient", order=1, op_type="Sqrt")


def run_cli(*args):
    p = subprocess.run(
        [sys.executable, "-m", "tb_numerics.cli", *args],
        capture_output=True, text=True, timeout=120,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
    )
    return p.returncode, p.stdout, p.stderr


def x(scale=1.0, **bad):
    v = RNG.normal(size=64).astype(np.float32) * scale
    for i, val in enumerate(bad.values()):
        v[i] = val
    return v


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("logs"))
    with NumericsRecordWriter(os.path.join(root, "healthy")) as w:
        for step in range(20):
            w.write("dense/output", step, numpy_stats(x()), ACT)
    with NumericsRecordWriter(os.path.join(root, "nan")) as w:
        for step in range(20):
            w.write("dense/output", step, numpy_stats(x()), ACT)
            w.write("loss/Sqrt_grad", step, numpy_stats(x(a=np.nan, b=np.nan, c=np.inf) if step == 13 else x()), GRAD)
    with NumericsRecordWriter(os.path.join(root, "overflow")) as w:
        for step in range(20):
            big = x(a=1e37) if step >= 8 else x()
            w.write("dense/output", step, numpy_stats(big if step < 15 else x(a=np.inf)), ACT)
    return root


def test_json_report_matches_the_spec_schema(logdir):
    code, out, err = run_cli("report", logdir, "--json")
    assert code == 1, err
    runs = {r["run"]: r for r in json.loads(out)["runs"]}
    assert set(runs) == {"healthy", "nan", "overflow"}
    assert runs["healthy"]["first_anomaly"] is None and runs["healthy"]["first_warning"] is None
    a = runs["nan"]["first_anomaly"]
    assert {k: a[k] for k in ("step", "tensor", "op_type", "phase", "nan", "posinf", "neginf", "size", "last_healthy_step")} == {
        "step": 13, "tensor": "loss/Sqrt_grad", "op_type": "Sqrt", "phase": "backward",
        "nan": 2, "posinf": 1, "neginf": 0, "size": 64, "last_healthy_step": 12,
    }
    assert "sqrt" in a["hint"]
    o = runs["overflow"]
    assert o["first_anomaly"]["step"] == 15
    assert o["first_warning"]["step"] == 8 and o["first_warning"]["kind"] == "overflow_risk"
    assert o["first_warning"]["tensor"] == "dense/output" and o["first_warning"]["detail"]


def test_flags_change_what_counts_as_a_warning(logdir):
    code, out, _ = run_cli("report", os.path.join(logdir, "healthy"), "--json", "--max-abs", "0.5")
    assert code == 0
    w = json.loads(out)["runs"][0]["first_warning"]
    assert w["step"] == 0 and w["kind"] == "overflow_risk"


def test_table_and_exit_codes(logdir, tmp_path):
    code, out, _ = run_cli("report", logdir)
    assert code == 1
    assert "first anomaly: step 13, loss/Sqrt_grad (Sqrt), backward: 2 NaN, 1 +Inf of 64 values" in out
    assert run_cli("report", os.path.join(logdir, "healthy"))[0] == 0
    code, _, err = run_cli("report", str(tmp_path / "missing"))
    assert code == 2 and "no such logdir" in err
    code, _, err = run_cli("report", logdir, "--spike-factor", "zero")
    assert code == 2 and "--spike-factor must be a number" in err
    assert run_cli("frobnicate")[0] == 2


def test_truncated_event_file_is_reported_and_the_rest_still_read(tmp_path):
    run = tmp_path / "run"
    with NumericsRecordWriter(str(run)) as w:
        for step in range(10):
            w.write("t", step, numpy_stats(x(a=np.nan) if step == 7 else x()), ACT)
        path = w.path
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[:-30])  # cut into the last record
    with NumericsRecordWriter(str(tmp_path / "other")) as w:
        w.write("u", 0, numpy_stats(x(a=np.inf)), ACT)
    code, out, err = run_cli("report", str(tmp_path), "--json")
    runs = {r["run"]: r for r in json.loads(out)["runs"]}
    assert code == 1
    assert runs["run"]["first_anomaly"]["step"] == 7
    assert runs["run"]["records"] == 9
    assert any("truncated" in p for p in runs["run"]["problems"])
    assert "truncated" in err
    assert runs["other"]["first_anomaly"]["step"] == 0


def test_control_characters_in_names_are_escaped_in_the_table(tmp_path):
    with NumericsRecordWriter(str(tmp_path / "r")) as w:
        w.write("evil\x1b[31mred\nname", 0, numpy_stats(x(a=np.nan)), ACT)
    code, out, _ = run_cli("report", str(tmp_path))
    assert code == 1
    assert "\x1b" not in out and "evil\\x1b[31mred\\x0aname" in out


def test_the_table_names_where_the_anomalous_tensor_was_created(tmp_path):
    info = metadata.TensorInfo(dtype="float32", role="gradient", op_type="SqrtGrad",
                               description="model.py:57 (loss)")
    with NumericsRecordWriter(str(tmp_path / "r")) as w:
        w.write("ops/gradient_tape/SqrtGrad", 0, numpy_stats(x(a=np.inf)), info)
    code, out, _ = run_cli("report", str(tmp_path))
    assert code == 1
    assert "first anomaly: step 0, ops/gradient_tape/SqrtGrad (SqrtGrad), backward" in out
    assert "    tensor: model.py:57 (loss)" in out


def _flip_a_value(path, k):
    """Flips a byte of the values of the file's k-th record: its checksum
    fails, and its data still decodes as an event."""
    data = bytearray(open(path, "rb").read())
    offset = 0
    for _ in range(k):
        offset += 16 + int.from_bytes(data[offset : offset + 8], "little")
    length = int.from_bytes(data[offset : offset + 8], "little")
    record = bytes(data[offset + 12 : offset + 12 + length])
    content = event_pb2.Event.FromString(record).summary.value[0].tensor.tensor_content
    data[offset + 12 + record.index(content) + len(content) - 1] ^= 0x01
    with open(path, "wb") as f:
        f.write(data)


def test_damage_without_an_anomaly_exits_3_naming_the_tag_and_count(tmp_path):
    """Records that could not be read are not a clean bill of health."""
    with NumericsRecordWriter(str(tmp_path / "single")) as w:
        for step in range(10):
            w.write("dense/output", step, numpy_stats(x()), ACT)
    _flip_a_value(w.path, 5)  # after file_version: the record of step 4
    with NumericsRecordWriter(str(tmp_path / "packed")) as w:
        for step in range(10):
            w.write_many(step, [("loss", numpy_stats(x()), ACT)])
            if step == 2:
                w.flush()
    _flip_a_value(w.path, 1)  # the block's first event, steps 0-2, with its table in full
    code, out, err = run_cli("report", str(tmp_path), "--json")
    assert code == 3, err
    runs = {r["run"]: r for r in json.loads(out)["runs"]}
    assert runs["single"]["first_anomaly"] is None and runs["single"]["records"] == 9
    assert "dense/output: 1 damaged record(s) skipped" in runs["single"]["problems"]
    assert runs["packed"]["first_anomaly"] is None and runs["packed"]["records"] == 7
    assert any(p.endswith("(a packed block of loss): 1 damaged record(s) skipped") for p in runs["packed"]["problems"])
    code, out, _ = run_cli("report", str(tmp_path / "single"))
    assert code == 3
    assert "first anomaly: none among the records read" in out and "2 problem(s)" in out


def test_an_anomaly_beats_damage(tmp_path):
    with NumericsRecordWriter(str(tmp_path / "r")) as w:
        for step in range(10):
            w.write("t", step, numpy_stats(x(a=np.nan) if step == 7 else x()), ACT)
    _flip_a_value(w.path, 1)  # the tag's first record, with its metadata
    code, out, err = run_cli("report", str(tmp_path), "--json")
    (run,) = json.loads(out)["runs"]
    assert code == 1 and run["first_anomaly"]["step"] == 7, err
    assert run["records"] == 9 and "t: 1 damaged record(s) skipped" in run["problems"]


def test_the_report_says_what_the_last_healthy_and_last_finite_steps_are():
    """Issue 26 item 6: two bare step numbers read as a contradiction."""
    from tb_numerics import analysis, records, report_text

    info = metadata.TensorInfo(dtype="float32", role="activation")
    # Warned (beyond the float32 margin) from step 5, +Inf at step 8.
    vals = [numpy_stats(np.float32([1.0, 1e37 if 5 <= s < 8 else np.inf if s == 8 else 1.0])) for s in range(9)]
    ra = analysis.analyze_run("r", [records.make_series("h", info, range(9), vals)])
    lines = report_text.anomaly_lines(analysis.first_anomaly(ra))
    assert lines[1] == ("  last healthy step: 4 (no warning and no NaN/Inf in this tensor); "
                        "last finite step: 7 (a warning, but no NaN/Inf)")


def test_a_tensor_bad_at_its_first_record_has_no_last_healthy_step_in_words():
    """A batch the guard recorded only at the step it arrived non-finite: the
    text says the tensor has no record before it, not Python's None."""
    from tb_numerics import analysis, records, report_text

    info = metadata.TensorInfo(dtype="float32", role="input")
    ra = analysis.analyze_run("r", [records.make_series("input/x", info, [6], [numpy_stats(np.float32([np.nan, 1]))])])
    lines = report_text.anomaly_lines(analysis.first_anomaly(ra))
    assert lines[1] == "  last healthy step: none (this tensor has no healthy record before it)"
    assert not any("None" in line for line in lines)
