"""The on-disk record: versioned metadata, data class, field layout."""

import json

import numpy as np
import pytest
from tensorboard.compat.proto import summary_pb2

from tb_numerics import metadata
from tb_numerics.records import numpy_stats

pytestmark = pytest.mark.unit


def test_metadata_marks_tensor_data_class_and_round_trips():
    info = metadata.TensorInfo(dtype="bfloat16", shape=(4, None), role="gradient", order=7, op_type="Sqrt")
    md = metadata.create_summary_metadata(info)
    # Without DATA_CLASS_TENSOR the Rust data server silently drops the series.
    assert md.data_class == summary_pb2.DATA_CLASS_TENSOR
    assert md.plugin_data.plugin_name == "numerics"
    back = metadata.parse_plugin_metadata(md.plugin_data.content)
    assert back == info
    assert back.phase == "backward"


def test_newer_major_version_is_rejected_with_a_clear_error():
    content = json.dumps({"version": metadata.FORMAT_VERSION + 1, "dtype": "float32"}).encode()
    with pytest.raises(metadata.FormatError, match="newer than this tb-numerics understands"):
        metadata.parse_plugin_metadata(content)


@pytest.mark.parametrize(
    "content, match",
    [
        (b"\xff\xfe", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"dtype": "float32"}', "format version"),
        (b'{"version": 1, "dtype": "int32"}', "unsupported dtype"),
        (b'{"version": 1, "dtype": "float32", "order": "x"}', "non-integer order"),
        (b'{"version": 1, "dtype": "float32", "shape": "big"}', "invalid shape"),
    ],
)
def test_malformed_metadata_names_what_is_wrong(content, match):
    with pytest.raises(metadata.FormatError, match=match):
        metadata.parse_plugin_metadata(content)


def test_minor_additions_are_ignored_by_this_reader():
    content = json.dumps({"version": 1, "minor": 9, "dtype": "float16", "future_key": [1]}).encode()
    assert metadata.parse_plugin_metadata(content).dtype == "float16"


def test_dtype_limits_match_numpy():
    for name in ("float16", "float32", "float64"):
        fi = np.finfo(name)
        assert metadata.DTYPE_LIMITS[name] == (float(fi.max), float(fi.smallest_normal))
    import ml_dtypes  # ships with TensorFlow

    bf = ml_dtypes.finfo(ml_dtypes.bfloat16)
    assert metadata.DTYPE_LIMITS["bfloat16"] == (float(bf.max), float(bf.smallest_normal))


def test_numpy_reference_stats_layout():
    x = np.array([0.0, 1.0, -2.0, np.nan, np.inf, -np.inf, 1e-40, 6e36], dtype=np.float32)
    s = dict(zip(metadata.FIELDS, numpy_stats(x)))
    assert s["count"] == 8 and s["nan"] == 1 and s["posinf"] == 1 and s["neginf"] == 1
    assert s["min"] == -2.0 and s["max"] == pytest.approx(6e36, rel=1e-6)
    assert s["zeros"] == 1
    assert s["overflow"] == 1  # 6e36 > float32 max / 64
    assert s["underflow"] == 1  # 1e-40 is subnormal in float32
    assert s["sum"] == pytest.approx(-1.0 + 1e-40 + float(np.float32(6e36)), rel=1e-6)


def test_empty_tensor_is_a_record_with_count_zero():
    s = dict(zip(metadata.FIELDS, numpy_stats(np.zeros((0, 3), np.float32))))
    assert s["count"] == 0 and np.isnan(s["min"]) and np.isnan(s["max"]) and s["sum"] == 0


def test_non_float_is_a_type_error():
    with pytest.raises(TypeError):
        numpy_stats(np.arange(3))
