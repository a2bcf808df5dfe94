"""Hostile metadata, tensors and JSON in event files: never a crash.

A log file is untrusted. Plugin metadata of the wrong JSON types or nested
a hundred thousand deep, a tensor whose shape claims 2**40 elements from
one value, a verdict or an action holding a 400-digit integer or deep
JSON: each is a problem that names what was skipped, everything readable
is still read, ``tb-numerics report`` exits 3 (or 1 for an anomaly) and
prints no traceback, and the server answers 200. Through the real reader,
the CLI in process and TensorBoard's WSGI app over the plugin.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter

from tb_numerics import analysis, cli, event_reader, metadata, packed, record_writer, survive
from tb_numerics.record_writer import NumericsRecordWriter, stats_tensor_proto
from tb_numerics.records import numpy_stats
from tb_numerics.rules import numbers

from test_plugin import P, TB

pytestmark = pytest.mark.unit

INFO = metadata.TensorInfo(dtype="float32", role="activation", order=0)
CONTENT = metadata.create_summary_metadata(INFO).plugin_data.content
DEEP = "[" * 100_000 + "]" * 100_000
# Deeper than metadata.MAX_JSON_DEPTH, shallow enough for json.loads.
NESTED_40 = "[" * 40 + "]" * 40


def _stats(step: int, nan: bool = False) -> np.ndarray:
    v = np.linspace(-1, 1, 64, dtype=np.float32) * (1 + step)
    if nan:
        v[:2] = np.nan
    return numpy_stats(v)


def _value(tag: str, tensor: tensor_pb2.TensorProto, content: bytes | None = None,
           plugin: str = metadata.PLUGIN_NAME) -> summary_pb2.Summary.Value:
    """A summary value; with ``content``, plugin metadata holding it."""
    value = summary_pb2.Summary.Value(tag=tag, tensor=tensor)
    if content is not None:
        value.metadata.plugin_data.plugin_name = plugin
        value.metadata.plugin_data.content = content
        value.metadata.data_class = summary_pb2.DATA_CLASS_TENSOR
    return value


def _write(run_dir: str, values: list[tuple[int, summary_pb2.Summary.Value]]) -> None:
    """One event per (step, value), in a file of its own in ``run_dir``."""
    w = EventFileWriter(run_dir, filename_suffix=".hostile")
    for step, value in values:
        w.add_event(event_pb2.Event(wall_time=1.0 + step, step=step, summary=summary_pb2.Summary(value=[value])))
    w.close()


def _healthy(run_dir: str, steps: int = 5, nan_step: int | None = None,
             verdict: tuple[str, str] | None = None) -> None:
    """Tag "t" over ``steps`` steps; with ``verdict``, a (tag, description)
    verdict record at ``nan_step``."""
    with NumericsRecordWriter(run_dir) as w:
        for step in range(steps):
            w.write("t", step, _stats(step, nan=step == nan_step), INFO)
        if verdict is not None:
            tag, description = verdict
            w.write(tag, nan_step, numpy_stats(np.zeros(0, np.float32)),
                    metadata.TensorInfo(role="other", op_type="Replay", description=description))


def _good_t(steps: int = 3) -> list[tuple[int, summary_pb2.Summary.Value]]:
    """Tag "t" over ``steps`` healthy steps, its metadata on the first."""
    return [(s, _value("t", stats_tensor_proto(_stats(s)), CONTENT if s == 0 else None)) for s in range(steps)]


def _huge(dtype: int = types_pb2.DT_DOUBLE, **values) -> tensor_pb2.TensorProto:
    """A tensor that claims 2**40 elements and holds ``values``' one."""
    shape = tensor_shape_pb2.TensorShapeProto(dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=2**40)])
    return tensor_pb2.TensorProto(dtype=dtype, tensor_shape=shape, **values)


def _by_run(logdir: str) -> dict[str, event_reader.RunRecords]:
    return {rr.run: rr for rr in event_reader.read_logdir(logdir)}


def _assert_served(logdir: str, run: str, tag: str) -> dict:
    """/runs and the run's /summary answer 200, the healthy run beside it
    too; the summary's problems name ``tag``. Returns the summary."""
    tb = TB(logdir)
    runs = {r["run"] for r in tb.ok(P + "/runs")["runs"]}
    assert {"healthy", run} <= runs
    assert not tb.ok(P + "/summary", run="healthy")["problems"]
    summary = tb.ok(P + "/summary", run=run)
    assert any(p.startswith(tag + ":") for p in summary["problems"]), summary["problems"]
    return summary


# ---------------------------------------------------------------- plugin metadata

# (field, a JSON value of the wrong type for it)
WRONG_TYPES = [
    ("dtype", ["float32"]), ("dtype", {"name": "float32"}), ("dtype", 32), ("dtype", None),
    ("compute_dtype", ["float16"]), ("compute_dtype", {"name": "float16"}), ("compute_dtype", 16),
    ("order", "1"), ("order", [1]), ("order", 1.5), ("order", 10**30),
    ("shape", {"0": 4}), ("shape", [[4]]), ("shape", "4"), ("shape", [2**70]),
    ("op_type", ["MatMul"]), ("activation", {"fn": "relu"}), ("squared_by", [1]),
]


def _content(**fields) -> bytes:
    return json.dumps({"version": metadata.RECORD_VERSION, "dtype": "float32", **fields}).encode()


def _table(**fields) -> bytes:
    md = metadata.create_block_metadata([("a", INFO), ("b", INFO)])
    raw = json.loads(md.plugin_data.content)
    raw["tensors"][1].update(fields)
    return json.dumps(raw, separators=(",", ":")).encode()


@pytest.mark.parametrize("field, value", WRONG_TYPES)
def test_a_field_of_the_wrong_json_type_is_a_format_error(field, value):
    for content in (_content(**{field: value}), _table(**{field: value})):
        with pytest.raises(metadata.FormatError):
            metadata.parse_content(content)


@pytest.mark.parametrize("version", [[1], {"v": 1}, "1", 10**30])
def test_a_version_of_the_wrong_json_type_is_a_format_error(version):
    with pytest.raises(metadata.FormatError):
        metadata.parse_content(json.dumps({"version": version, "dtype": "float32"}).encode())


def test_a_role_of_the_wrong_json_type_reads_as_other():
    assert metadata.parse_plugin_metadata(_content(role=["loss"])).role == "other"


@pytest.mark.parametrize("nested", [DEEP, NESTED_40], ids=["100k deep", "40 deep"])
def test_deeply_nested_metadata_is_a_format_error(nested):
    for content in (_content().replace(b"}", b',"x":%s}' % nested.encode()),
                    _table().replace(b'"tag":"b"', b'"tag":"b","x":%s' % nested.encode())):
        with pytest.raises(metadata.FormatError, match="nested"):
            metadata.parse_content(content)


def _hostile_metadata_logdir(tmp_path) -> str:
    """A healthy run, and a run whose tag "t" is healthy beside tags whose
    metadata is hostile: a list for a dtype, deep JSON, a block's table
    with an object for a compute dtype."""
    logdir = str(tmp_path)
    _healthy(str(tmp_path / "healthy"))
    block_tag = packed.TAG_PREFIX + "w/000000"
    dims = [tensor_shape_pb2.TensorShapeProto.Dim(size=n) for n in (1, packed.COLUMNS)]
    rows = tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, tensor_shape=tensor_shape_pb2.TensorShapeProto(dim=dims),
                                  tensor_content=np.zeros((1, packed.COLUMNS), "<f4").tobytes())
    _write(str(tmp_path / "hostile"), _good_t() + [
        (0, _value("bad", stats_tensor_proto(_stats(0)), _content(dtype=["float32"]))),
        (0, _value("deep", stats_tensor_proto(_stats(0)), _content().replace(b"}", b',"x":%s}' % DEEP.encode()))),
        (0, _value(block_tag, rows, _table(compute_dtype={"name": "float16"}))),
    ])
    return logdir


def test_hostile_metadata_is_a_problem_and_the_rest_is_read(tmp_path, capsys):
    logdir = _hostile_metadata_logdir(tmp_path)
    runs = _by_run(logdir)
    assert not runs["healthy"].problems and len(runs["healthy"].series[0].steps) == 5
    hostile = runs["hostile"]
    assert [(s.tag, list(s.steps)) for s in hostile.series] == [("t", [0, 1, 2])]
    for tag, why in (("bad", "unsupported dtype"), ("deep", "nested"),
                     (packed.TAG_PREFIX + "w/000000", "compute_dtype")):
        assert any(p.startswith(tag + ":") and why in p for p in hostile.problems), (tag, hostile.problems)
    assert cli.main(["report", logdir]) == cli.EXIT_UNREADABLE
    assert "hostile: bad: numerics metadata names an unsupported dtype" in capsys.readouterr().err


def test_hostile_metadata_is_served_as_a_problem(tmp_path):
    summary = _assert_served(_hostile_metadata_logdir(tmp_path), "hostile", "bad")
    assert summary["tensors"] == 1 and any(p.startswith("deep:") for p in summary["problems"])


# ---------------------------------------------------------------- tensors claiming a huge shape


@pytest.mark.parametrize("tensor", [
    _huge(double_val=[1.0]), _huge(types_pb2.DT_FLOAT, float_val=[1.0]), _huge(types_pb2.DT_HALF, half_val=[1]),
    _huge(types_pb2.DT_STRING, string_val=[b"{}"]), _huge(types_pb2.DT_INT64, int64_val=[1]),
    _huge(types_pb2.DT_COMPLEX128, dcomplex_val=[1.0, 2.0]),
], ids=["double", "float", "half", "string", "int64", "complex"])
def test_a_tensor_claiming_more_elements_than_it_holds_is_refused_unallocated(tensor):
    with pytest.raises(ValueError, match="refused"):
        packed.tensor_values(tensor)


def test_a_small_broadcast_and_a_negative_dimension():
    """The proto's convention, one value for a tensor of equal values, is
    kept for a tensor of a record's size; a negative dimension is refused."""
    dims = [tensor_shape_pb2.TensorShapeProto.Dim(size=metadata.NUM_FIELDS)]
    small = tensor_pb2.TensorProto(dtype=types_pb2.DT_DOUBLE, double_val=[2.0],
                                   tensor_shape=tensor_shape_pb2.TensorShapeProto(dim=dims))
    assert packed.tensor_values(small).tolist() == [2.0] * metadata.NUM_FIELDS
    negative = tensor_pb2.TensorProto(dtype=types_pb2.DT_DOUBLE, double_val=[2.0], tensor_shape=(
        tensor_shape_pb2.TensorShapeProto(dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=-4)])))
    with pytest.raises(ValueError, match="negative"):
        packed.tensor_values(negative)


def _huge_tensor_logdir(tmp_path) -> str:
    """A healthy run; a run whose "t" has a record claiming 2**40 values
    after three healthy ones, and a scalar summary that claims as many."""
    _healthy(str(tmp_path / "healthy"))
    _write(str(tmp_path / "hostile"), _good_t() + [
        (3, _value("t", _huge(double_val=[1.0]))),
        (0, _value("loss", _huge(types_pb2.DT_FLOAT, float_val=[1.0]), b"", plugin="scalars")),
        (1, _value("loss", tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, float_val=[0.5]), b"", plugin="scalars")),
    ])
    return str(tmp_path)


def test_a_record_claiming_a_huge_shape_is_skipped_and_the_rest_is_read(tmp_path, capsys):
    logdir = _huge_tensor_logdir(tmp_path)
    hostile = _by_run(logdir)["hostile"]
    assert [(s.tag, list(s.steps)) for s in hostile.series] == [("t", [0, 1, 2])]
    assert "t: 1 malformed record(s) skipped" in hostile.problems
    assert any(p.startswith("loss: a scalar summary at step 0 skipped") and "refused" in p for p in hostile.problems)
    assert [list(a) for a in hostile.scalars["loss"]] == [[1], [0.5]]
    assert cli.main(["report", logdir]) == cli.EXIT_UNREADABLE
    assert "Traceback" not in capsys.readouterr().err


def test_a_record_claiming_a_huge_shape_is_served_as_a_problem(tmp_path):
    _healthy(str(tmp_path / "healthy"))
    _write(str(tmp_path / "hostile"), _good_t() + [(3, _value("t", _huge(double_val=[1.0])))])
    summary = _assert_served(str(tmp_path), "hostile", "t")
    assert (summary["records"], summary["last_step"]) == (3, 2)


def test_an_action_claiming_a_huge_shape_is_a_problem():
    problems: list[str] = []
    tensor = _huge(types_pb2.DT_STRING, string_val=[survive.encode_event({"action": "skip", "trigger": "nonfinite"})])
    assert event_reader.action_of(metadata.create_action_metadata().plugin_data.content, tensor, 2, problems) is None
    assert len(problems) == 1 and problems[0].startswith(metadata.ACTIONS_TAG + ": an action at step 2")


# ---------------------------------------------------------------- verdicts


def _op_verdict(inputs: str) -> str:
    return ('{"step":7,"reproduced":true,"op":{"name":"x","type":"Sqrt","source":"a.py:1 (f)",'
            '"phase":"forward","inputs":[%s]}}' % inputs)


def _verdict_run(tmp_path, tag: str, description: str) -> str:
    """A healthy run and a run non-finite at step 7 with a verdict record."""
    _healthy(str(tmp_path / "healthy"))
    _healthy(str(tmp_path / "run1"), steps=10, nan_step=7, verdict=(tag, description))
    return str(tmp_path)


UNREADABLE_VERDICTS = {
    "400-digit max": (metadata.REPLAY_TAG, _op_verdict('{"min":0,"max":1%s,"zeros":1,"count":4}' % ("0" * 400))),
    "deep replay": (metadata.REPLAY_TAG, '{"step":7,"reproduced":true,"x":%s}' % DEEP),
    "40 deep replay": (metadata.REPLAY_TAG, '{"step":7,"reproduced":true,"x":%s}' % NESTED_40),
    "deep batch": (metadata.BATCH_TAG, '{"step":7,"tensors":[],"x":%s}' % DEEP),
    "deep op mark": (metadata.OP_MARK_TAG, '{"tag":"ops/x","occurrence":[1],"x":%s}' % DEEP),
    "not a verdict": (metadata.REPLAY_TAG, '{"step":"7"}'),
}


@pytest.mark.parametrize("tag, description", UNREADABLE_VERDICTS.values(), ids=UNREADABLE_VERDICTS.keys())
def test_an_unreadable_verdict_is_a_problem_and_the_anomaly_is_still_reported(tmp_path, capsys, tag, description):
    logdir = _verdict_run(tmp_path, tag, description)
    assert cli.main(["report", logdir, "--json"]) == cli.EXIT_ANOMALY
    run = {r["run"]: r for r in json.loads(capsys.readouterr().out)["runs"]}["run1"]
    assert run["first_anomaly"]["step"] == 7 and run["first_anomaly"]["op"] is None
    assert [p for p in run["problems"] if p.startswith(tag + ":")], run["problems"]
    assert cli.main(["report", logdir]) == cli.EXIT_ANOMALY
    _assert_served(logdir, "run1", tag)


@pytest.mark.parametrize("inputs", [
    '{"min":0,"max":1,"zeros":"x","count":4}', '{"min":0,"max":1,"zeros":NaN,"count":4}',
    '{"min":0,"max":1,"zeros":Infinity,"count":"x"}', '{"min":[0],"max":{},"zeros":2,"count":Infinity}',
], ids=["zeros text", "zeros NaN", "zeros Infinity", "min list, count Infinity"])
def test_a_verdicts_values_of_the_wrong_type_are_left_out_of_its_words(tmp_path, capsys, inputs):
    logdir = _verdict_run(tmp_path, metadata.REPLAY_TAG, _op_verdict(inputs))
    assert cli.main(["report", logdir, "--json"]) == cli.EXIT_ANOMALY
    a = {r["run"]: r for r in json.loads(capsys.readouterr().out)["runs"]}["run1"]["first_anomaly"]
    assert a["op"]["type"] == "Sqrt" and "sqrt" in a["hint"].lower()
    assert cli.main(["report", logdir]) == cli.EXIT_ANOMALY
    assert "op: x (Sqrt, forward)" in capsys.readouterr().out


def test_a_number_beyond_a_floats_range_is_written_in_words():
    assert (numbers.number(10**400), numbers.number(-3 * 10**400)) == ("1e400", "-3e400")


# ---------------------------------------------------------------- actions


@pytest.mark.parametrize("extra", [DEEP, NESTED_40, "1" + "0" * 400], ids=["100k deep", "40 deep", "400 digits"])
def test_a_hostile_action_is_not_an_event(extra):
    data = b'{"action":"skip","trigger":"nonfinite","x":%s}' % extra.encode()
    assert survive.parse_event(data, 2) is None


def test_a_deeply_nested_action_is_a_problem_and_served(tmp_path, capsys):
    _healthy(str(tmp_path / "healthy"))
    payload = b'{"action":"skip","trigger":"nonfinite","x":%s}' % DEEP.encode()
    action = record_writer.action_tensor_proto({"action": "skip", "trigger": "nonfinite"})
    action.string_val[0] = payload
    content = metadata.create_action_metadata().plugin_data.content
    _write(str(tmp_path / "run1"), _good_t() + [(2, _value(metadata.ACTIONS_TAG, action, content,
                                                           plugin=metadata.ACTIONS_PLUGIN))])
    rr = _by_run(str(tmp_path))["run1"]
    assert rr.actions == [] and [len(s.steps) for s in rr.series] == [3]
    assert rr.problems == ["%s: the action at step 2 is not a valid event" % metadata.ACTIONS_TAG]
    assert cli.main(["report", str(tmp_path)]) == cli.EXIT_UNREADABLE
    summary = _assert_served(str(tmp_path), "run1", metadata.ACTIONS_TAG)
    assert summary["actions"] is None
