"""The Numerics plugin's routes, through TensorBoard's own WSGI app.

The app is built as ``tensorboard`` builds it: ``program.TensorBoard`` parses
the flags (running ``NumericsLoader.fix_flags``), TensorBoard's
``LocalDataIngester`` loads the event files into a real multiplexer, and
``TensorBoardWSGIApp`` routes requests to the plugin. Nothing is faked.
The run store's caching and refreshing are tested on their own in
``test_run_store.py``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import time
import urllib.parse

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensorboard import program
from tensorboard.backend import application
from tensorboard.backend.event_processing import data_ingester
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.plugins import base_plugin
from tensorboard.plugins.core import core_plugin
from tensorboard.summary.writer.event_file_writer import EventFileWriter
from werkzeug import test as wtest

from tb_numerics import analysis, cli, metadata, plugin
from tb_numerics.record_writer import NumericsRecordWriter
from tb_numerics.records import numpy_stats

pytestmark = pytest.mark.unit

P = "/data/plugin/numerics"
STEPS = 200
NAN_STEP = 150


def _stats(x) -> np.ndarray:
    return numpy_stats(np.asarray(x, dtype=np.float32))


def write_steps(w: NumericsRecordWriter, steps: range, nan_step: int | None) -> None:
    """Activation, loss (forward) and a global norm (backward) per step."""
    act = metadata.TensorInfo(role="activation", order=0, shape=(4,))
    loss = metadata.TensorInfo(role="loss", order=1, shape=())
    norm = metadata.TensorInfo(role="global_norm", order=2, shape=())
    for step in steps:
        x = [1.0, -2.0, 0.5, step / 100]
        if step == nan_step:
            x[1] = math.nan
            x[2] = math.inf
        w.write("dense1/output", step, _stats(x), act)
        w.write("loss", step, _stats([0.5 / (1 + step)]), loss)  # a loss that learns
        w.write("global_norm", step, _stats([1.0]), norm)
    w.flush()


def write_run(run_dir: str, steps: range, nan_step: int | None) -> None:
    with NumericsRecordWriter(run_dir) as w:
        write_steps(w, steps, nan_step)


class TB:
    """TensorBoard's WSGI app over a logdir, and a reload like its timer's."""

    def __init__(self, logdir: str, *extra_args: str):
        tb = program.TensorBoard(plugins=[core_plugin.CorePluginLoader(), plugin.NumericsLoader()])
        tb.configure(
            argv=["", "--logdir", logdir, "--load_fast", "false", "--reload_interval", "0",
                  "--reload_task", "blocking", *extra_args]
        )
        self.flags = tb.flags
        self.ingester = data_ingester.LocalDataIngester(tb.flags)
        self.ingester.start()  # loads once, synchronously
        app = application.TensorBoardWSGIApp(
            tb.flags, tb.plugin_loaders, self.ingester.data_provider, tb.assets_zip_provider,
            self.ingester.deprecated_multiplexer,
        )
        self.client = wtest.Client(app)
        self.logdir = logdir

    def reload(self) -> None:
        """What TensorBoard's reload thread does every --reload_interval."""
        mux = self.ingester.deprecated_multiplexer
        mux.AddRunsFromDirectory(self.logdir)
        mux.Reload()

    def get(self, path: str, **params) -> tuple[int, object]:
        if params:
            path += "?" + urllib.parse.urlencode(params)
        r = self.client.get(path)
        body = r.get_data()
        if r.headers["Content-Type"].startswith("application/json"):
            return r.status_code, _strict_json(body)
        return r.status_code, body

    def ok(self, path: str, **params):
        status, body = self.get(path, **params)
        assert status == 200, (path, params, status, body)
        return body


def _strict_json(body: bytes):
    """Parses JSON, refusing the NaN/Infinity literals browsers reject."""

    def refuse(name):
        raise AssertionError("invalid JSON literal %s in %r" % (name, body[:300]))

    return json.loads(body, parse_constant=refuse)


@pytest.fixture(scope="module")
def logdir(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("logs"))
    write_run(os.path.join(d, "bad"), range(STEPS), NAN_STEP)
    write_run(os.path.join(d, "good"), range(50), None)
    return d


@pytest.fixture(scope="module")
def tb(logdir) -> TB:
    return TB(logdir)


# ------------------------------------------------------------- loading


def test_fix_flags_keeps_every_numerics_record_where_the_plugin_reads_through_tensorboard():
    loader = plugin.NumericsLoader()
    tb = program.TensorBoard(plugins=[core_plugin.CorePluginLoader(), loader])
    # The action events (a plugin of their own) are kept whole in every case.
    tb.configure(argv=["", "--logdir", "x"])  # a local logdir: the plugin reads its files
    assert tb.flags.samples_per_plugin == {"numerics": 1, "numerics_actions": 0}
    tb.configure(argv=["", "--logdir", "gs://bucket/x"])
    assert tb.flags.samples_per_plugin == {"numerics": 0, "numerics_actions": 0}
    tb.configure(argv=["", "--logdir_spec", "a:x,b:y"])
    assert tb.flags.samples_per_plugin == {"numerics": 0, "numerics_actions": 0}
    tb.configure(argv=["", "--logdir", "x", "--samples_per_plugin", "numerics=5,images=3"])
    assert tb.flags.samples_per_plugin == {"numerics": 5, "images": 3, "numerics_actions": 0}


def test_no_record_lost_to_sampling(tb):
    # The Python loader keeps 10 records per tag of an unknown plugin by default.
    s = tb.ok(P + "/summary", run="bad")
    assert s["records"] == 3 * STEPS
    a = s["first_anomaly"]
    assert (a["step"], a["tensor"], a["last_healthy_step"]) == (NAN_STEP, "dense1/output", NAN_STEP - 1)
    assert (a["nan"], a["posinf"], a["size"]) == (1, 1, 4)


def test_a_user_sampling_setting_limits_tensorboard_not_the_plugin_of_a_local_logdir(logdir):
    sampled = TB(logdir, "--samples_per_plugin", "numerics=10")
    assert sampled.flags.samples_per_plugin == {"numerics": 10, "numerics_actions": 0}
    s = sampled.ok(P + "/summary", run="bad")
    assert s["records"] == 3 * STEPS and s["problems"] == []  # read from the files


def test_plugin_is_listed_with_its_es_module(tb):
    listing = tb.ok("/data/plugins_listing")["numerics"]
    assert listing["enabled"] is True
    assert listing["tab_name"] == "Numerics"
    assert listing["loading_mechanism"] == {"type": "IFRAME", "module_path": P + "/index.js"}


def test_plugin_module_does_not_import_tensorflow():
    code = "import sys, tb_numerics.plugin; sys.exit('tensorflow' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# ------------------------------------------------------------- routes


def test_safe_range_lists_the_cli_parameters_and_defaults(tb):
    body = tb.ok(P + "/safe_range")
    assert set(body["defaults"]) == set(analysis.SAFE_RANGE_PARAMS) == set(body["params"])
    assert body["defaults"]["spike_factor"] == analysis.SafeRange().spike_factor
    assert body["defaults"]["max_abs"] is None


def test_runs(tb):
    runs = {r["run"]: r for r in tb.ok(P + "/runs")["runs"]}
    assert set(runs) == {"bad", "good"}
    assert runs["bad"]["first_anomaly_step"] == NAN_STEP
    assert runs["good"]["first_anomaly_step"] is None
    assert (runs["good"]["tensors"], runs["good"]["records"], runs["good"]["last_step"]) == (3, 150, 49)


def test_summary_matches_the_cli_report(tb, logdir):
    summaries, _ = cli.report(logdir, analysis.SafeRange(max_abs=1.2))
    expected = {s["run"]: s for s in summaries}
    for run in ("bad", "good"):
        got = tb.ok(P + "/summary", run=run, max_abs="1.2")
        assert got.pop("safe_range")["max_abs"] == 1.2
        assert (got.pop("stale"), got.pop("preliminary"), got.pop("as_of_step"), got.pop("latest_step")) == (
            False, False, *[expected[run]["last_step"]] * 2)
        assert got == json.loads(json.dumps(expected[run]))


def test_safe_range_override_changes_the_first_warning(tb):
    assert tb.ok(P + "/summary", run="good")["first_warning"] is None
    w = tb.ok(P + "/summary", run="good", max_abs="1.5")["first_warning"]
    assert (w["step"], w["tensor"], w["kind"]) == (0, "dense1/output", "overflow_risk")


@pytest.mark.parametrize(
    "params",
    [{"max_abs": "-1"}, {"max_abs": "abc"}, {"max_abs": "nan"}, {"spike_factor": "inf"},
     {"spike_window": "2.5"}, {"underflow_share": "2"}],
)
def test_malformed_safe_range_is_400(tb, params):
    status, body = tb.get(P + "/summary", run="bad", **params)
    assert status == 400
    assert list(params)[0] in body["error"]


def test_timeline_keeps_the_anomaly_when_downsampled(tb):
    t = tb.ok(P + "/timeline", run="bad", width=7)
    assert len(t["bucket_start"]) == 7 and t["bucket_start"][0] == 0 and t["bucket_end"][-1] == STEPS - 1
    assert [r["tensor"] for r in t["rows"]] == ["dense1/output", "loss", "global_norm"]
    assert [r["phase"] for r in t["rows"]] == ["forward", "forward", "backward"]
    cells = t["rows"][0]["cells"]
    b = next(i for i, (lo, hi) in enumerate(zip(t["bucket_start"], t["bucket_end"])) if lo <= NAN_STEP <= hi)
    assert cells[b] == analysis.NONFINITE
    assert cells.count(analysis.NONFINITE) == 1
    assert t["legend"]["2"] == "nonfinite"


def test_timeline_step_range(tb):
    t = tb.ok(P + "/timeline", run="bad", start=140, end=160)
    assert t["bucket_start"] == list(range(140, 161))
    assert t["rows"][0]["cells"][NAN_STEP - 140] == analysis.NONFINITE


def test_series_encodes_nonfinite_as_strings(tmp_path):
    run_dir = str(tmp_path / "run")
    info = metadata.TensorInfo(role="activation")
    with NumericsRecordWriter(run_dir) as w:
        w.write("x", 0, _stats([1.0, 2.0]), info)
        w.write("x", 1, _stats([math.nan, math.nan]), info)  # no finite value: min, mean are NaN
    s = TB(str(tmp_path)).ok(P + "/series", run="run", tensor="x")
    assert s["steps"] == [0, 1] and s["downsampled"] is False
    assert s["fields"]["min"] == [1.0, "NaN"]
    assert s["fields"]["mean"] == [1.5, "NaN"]
    assert s["fields"]["nan"] == [0, 2]
    assert s["health"] == [analysis.HEALTHY, analysis.NONFINITE]


def test_series_sends_moments_an_op_level_record_leaves_out_as_null(tmp_path):
    """Op-level records hold no sums: their mean, std and L2 norm are "not
    recorded" (null, a gap in the charts), not NaN (a marker saying the
    tensor had no finite value)."""
    run_dir = str(tmp_path / "run")
    info = metadata.TensorInfo(role="activation", op_type="MatMul")
    F = metadata.FIELD_INDEX
    with NumericsRecordWriter(run_dir) as w:
        for step in range(6):
            rec = _stats([1.0, 2.0] if step != 4 else [math.nan, math.nan])
            if step >= 2:  # what stats.op_stats writes
                rec[F["sum"]] = rec[F["sum_sq"]] = math.nan
            w.write("ops/MatMul", step, rec, info)
    tb = TB(str(tmp_path))
    s = tb.ok(P + "/series", run="run", tensor="ops/MatMul")
    for field in ("mean", "std", "l2"):
        assert s["fields"][field][2:] == [None, None, "NaN", None], field
    assert s["fields"]["mean"][:2] == [1.5, 1.5]
    assert s["fields"]["max"] == [2.0, 2.0, 2.0, 2.0, "NaN", 2.0]
    # Bucketed: a bucket of unrecorded sums is null too; one holding a
    # record without a finite value stays NaN.
    s = tb.ok(P + "/series", run="run", tensor="ops/MatMul", max_points=3)
    assert s["downsampled"] is True and s["fields"]["mean"] == [1.5, None, "NaN"]


def test_series_full_and_downsampled(tb):
    s = tb.ok(P + "/series", run="bad", tensor="dense1/output")
    assert s["steps"] == list(range(STEPS)) and s["downsampled"] is False
    assert s["info"]["role"] == "activation" and s["info"]["shape"] == [4]
    assert s["fields"]["max"][10] == pytest.approx(1.0)
    assert s["health"][NAN_STEP] == analysis.NONFINITE

    d = tb.ok(P + "/series", run="bad", tensor="dense1/output", max_points=9)
    assert d["downsampled"] is True and len(d["steps"]) == 9
    assert d["steps"][0] == 0 and d["step_end"][-1] == STEPS - 1
    assert sum(d["fields"]["count"]) == 4 * STEPS
    assert sum(d["fields"]["nan"]) == 1
    assert d["health"].count(analysis.NONFINITE) == 1
    assert max(d["fields"]["max_abs"]) == pytest.approx(2.0)

    z = tb.ok(P + "/series", run="bad", tensor="dense1/output", start=149, end=151)
    assert z["steps"] == [149, 150, 151] and z["health"] == [0, 2, 0]


@pytest.mark.parametrize(
    "route, params, status",
    [
        ("/summary", {}, 400),
        ("/summary", {"run": "nope"}, 404),
        ("/timeline", {"run": "nope"}, 404),
        ("/timeline", {"run": "bad", "width": "0"}, 400),
        ("/timeline", {"run": "bad", "width": "-3"}, 400),
        ("/timeline", {"run": "bad", "width": "10001"}, 400),
        ("/timeline", {"run": "bad", "width": "1e3"}, 400),
        ("/timeline", {"run": "bad", "width": "NaN"}, 400),
        ("/timeline", {"run": "bad", "width": "9" * 40}, 400),
        ("/timeline", {"run": "bad", "width": "\uff15"}, 400),  # a fullwidth 5: digits are 0-9
        ("/timeline", {"run": "bad", "start": "\u0661"}, 400),  # an Arabic-Indic 1
        ("/series", {"run": "bad", "tensor": "loss", "max_points": "\u0968"}, 400),  # a Devanagari 2
        ("/timeline", {"run": "bad", "start": "10", "end": "5"}, 400),
        ("/timeline", {"run": "bad", "start": "-1"}, 400),
        ("/series", {"run": "bad"}, 400),
        ("/series", {"run": "bad", "tensor": "nope"}, 404),
        ("/series", {"run": "nope", "tensor": "loss"}, 404),
        ("/series", {"run": "bad", "tensor": "loss", "max_points": "0"}, 400),
        ("/series", {"run": "bad", "tensor": "loss", "max_points": "100001"}, 400),
        ("/series", {"run": "bad", "tensor": "loss", "end": "x"}, 400),
    ],
)
def test_bad_requests_answer_json_errors(tb, route, params, status):
    got, body = tb.get(P + route, **params)
    assert got == status
    assert isinstance(body["error"], str) and body["error"]


def test_post_is_refused(tb):
    r = tb.client.post(P + "/summary?run=bad")
    assert r.status_code == 405 and "error" in _strict_json(r.get_data())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    route=st.sampled_from(["/runs", "/summary", "/timeline", "/series", "/safe_range"]),
    params=st.dictionaries(
        st.sampled_from(["run", "tensor", "width", "start", "end", "max_points", *analysis.SAFE_RANGE_PARAMS]),
        st.one_of(st.text(max_size=12), st.sampled_from(["bad", "loss", "0", "1", "-1", "1e308", "nan", "inf"])),
        max_size=5,
    ),
)
def test_no_request_fails_the_server(tb, route, params):
    status, body = tb.get(P + route, **params)
    assert status in (200, 400, 404), (route, params, status, body)
    if status != 200:
        assert isinstance(body["error"], str)


# ------------------------------------------------------------- caching, growth, damage


def test_run_growth_is_picked_up_on_reload(tmp_path):
    # A training job appending to its event file while TensorBoard runs.
    w = NumericsRecordWriter(str(tmp_path / "live"))
    write_steps(w, range(20), None)
    live = TB(str(tmp_path))
    assert live.ok(P + "/summary", run="live")["first_anomaly"] is None

    write_steps(w, range(20, 40), 33)
    w.close()
    live.reload()
    # A small growth is read by the request itself: the answer is complete at once.
    s = live.ok(P + "/summary", run="live")
    assert (s["last_step"], s["first_anomaly"]["step"]) == (39, 33)
    assert (s["stale"], s["as_of_step"], s["latest_step"]) == (False, 39, 39)


def _raw_numerics_event(tag: str, step: int, content: bytes, vec: np.ndarray) -> event_pb2.Event:
    from tb_numerics.record_writer import stats_tensor_proto

    md = summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="numerics", content=content),
        data_class=summary_pb2.DATA_CLASS_TENSOR,
    )
    value = summary_pb2.Summary.Value(tag=tag, tensor=stats_tensor_proto(vec), metadata=md)
    return event_pb2.Event(step=step, summary=summary_pb2.Summary(value=[value]))


def test_unreadable_metadata_is_skipped_and_reported(tmp_path, caplog):
    run_dir = str(tmp_path / "run")
    write_run(run_dir, range(10), 7)
    w = EventFileWriter(run_dir, filename_suffix=".other")
    good = _stats([1.0])
    newer = json.dumps({"version": metadata.FORMAT_VERSION + 1, "dtype": "float32"}).encode()
    for step in range(3):
        w.add_event(_raw_numerics_event("from_the_future", step, newer, good))
        w.add_event(_raw_numerics_event("garbage", step, b"\xff not json", good))
    w.close()
    s = TB(str(tmp_path)).ok(P + "/summary", run="run")
    assert s["first_anomaly"]["step"] == 7 and s["tensors"] == 3
    assert any(p.startswith("from_the_future:") and "newer" in p for p in s["problems"])
    assert any(p.startswith("garbage:") for p in s["problems"])
    # The server log says it too, once, however often the run is asked for.
    caplog.clear()
    tb = TB(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="tb_numerics.run_store"):
        for _ in range(3):
            tb.ok(P + "/summary", run="run")
    logged = [r.getMessage() for r in caplog.records if "from_the_future" in r.getMessage()]
    assert len(logged) == 1 and "newer" in logged[0]


def test_a_run_with_nothing_readable_is_listed_with_what_went_wrong(tmp_path):
    """A run whose only file is cut inside its first record (a job killed
    as it started, long ago) is listed as ``tb-numerics report`` lists it,
    its summary and timeline answer with the damage named; a run of no
    numerics records and no damage stays unlisted."""
    write_run(str(tmp_path / "good"), range(10), None)
    write_run(str(tmp_path / "cut"), range(3), None)
    (cut,) = [str(f) for f in (tmp_path / "cut").iterdir()]
    with open(cut, "rb") as f:
        head = f.read(20)
    with open(cut, "wb") as f:
        f.write(head)
    os.utime(cut, (time.time() - 3600,) * 2)  # finished long ago: not a record being written
    other = EventFileWriter(str(tmp_path / "scalars_only"))
    other.add_event(event_pb2.Event(step=0, summary=summary_pb2.Summary(
        value=[summary_pb2.Summary.Value(tag="loss", simple_value=1.0)])))
    other.close()
    (reference,) = [s for s in cli.report(str(tmp_path), analysis.SafeRange())[0] if s["run"] == "cut"]
    assert reference["problems"] and "truncated" in reference["problems"][0]
    tb = TB(str(tmp_path))
    runs = {r["run"]: r for r in tb.ok(P + "/runs")["runs"]}
    assert set(runs) == {"cut", "good"}
    assert (runs["cut"]["records"], runs["cut"]["problems"]) == (0, reference["problems"])
    s = tb.ok(P + "/summary", run="cut")
    assert (s["first_anomaly"], s["records"], s["problems"]) == (None, 0, reference["problems"])
    assert tb.ok(P + "/timeline", run="cut", width="100")["rows"] == []
    status, body = tb.get(P + "/series", run="cut", tensor="x")
    assert status == 404 and "x" in body["error"]
    status, _ = tb.get(P + "/summary", run="scalars_only")
    assert status == 404


# ------------------------------------------------------------- frontend files


def test_serves_frontend_modules(tb):
    frontend = plugin.frontend_dir()
    name = next(f for f in sorted(os.listdir(frontend)) if f.endswith(".js"))
    r = tb.client.get(P + "/" + name)
    assert r.status_code == 200
    assert r.headers["Content-Type"].startswith("text/javascript")
    with open(os.path.join(frontend, name), "rb") as f:
        assert r.get_data() == f.read()


@pytest.mark.parametrize(
    "path",
    ["../plugin.py", "..%2Fplugin.py", "..%2f..%2fsetup.py", "%2e%2e/setup.py", "%2Fetc%2Fpasswd",
     "/etc/passwd", "__init__.py", ".hidden.js", "sub/dir.js", "nope.js", "index.js%00.py", ""],
)
def test_static_route_refuses_anything_but_frontend_files(tb, path):
    r = tb.client.get(P + "/" + path)
    assert r.status_code == 404
    assert b"root:" not in r.get_data() and b"import" not in r.get_data()


def test_static_route_refuses_symlinks(tmp_path):
    (tmp_path / "real.js").write_text("export function render() {}")
    os.symlink("/etc/hostname", tmp_path / "link.js")
    p = plugin.NumericsPlugin(base_plugin.TBContext(), frontend=str(tmp_path))
    static = wtest.Client(p.get_plugin_apps()["/*"])
    real = static.get(P + "/real.js")
    assert real.status_code == 200 and real.headers["Content-Type"].startswith("text/javascript")
    link = static.get(P + "/link.js")
    assert link.status_code == 404 and "link.js" in _strict_json(link.get_data())["error"]

