"""Property-based fuzz of every route and parameter of the Numerics plugin.

Requests go through TensorBoard's own WSGI app (routing included) over a real
data provider (TensorBoard's Python loader on a logdir with hostile names and
corrupt files). Whatever the path, query or bytes: only 200, 400 or 404, a
JSON body, never a 500 or traceback text, and static routes serve nothing
but the frontend's own files.
"""

from __future__ import annotations

import collections
import json
import os
import urllib.parse

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensorboard import program
from tensorboard.backend import application
from tensorboard.backend.event_processing import data_ingester
from tensorboard.plugins.core import core_plugin
from werkzeug import test as wtest

from tb_numerics import analysis, compare, metadata, plugin
from tb_numerics.record_writer import NumericsRecordWriter
from tb_numerics.records import numpy_stats

pytestmark = pytest.mark.unit

P = "/data/plugin/numerics"
API_ROUTES = ("runs", "summary", "timeline", "series", "safe_range", "compare")
PARAMS = ("run", "tensor", "width", "start", "end", "max_points", "against", *compare.BAND_PARAMS,
          *analysis.SAFE_RANGE_PARAMS)
RUNS = ("healthy", "nan", "<img src=x onerror=alert(1)>", "ctl\x1b[31m\x07run")
TAGS = ("dense/output", "loss", "<script>alert(1)</script>", "x" * 300)
FRONTEND = plugin.frontend_dir()
# Requests sent and statuses seen, printed at the end (pytest -s).
SEEN: collections.Counter = collections.Counter()


def _write_logdir(root: str) -> None:
    info = metadata.TensorInfo(role="activation", order=0)
    for run in RUNS:
        with NumericsRecordWriter(os.path.join(root, run)) as w:
            for step in range(30):
                for tag in TAGS:
                    x = np.linspace(-1, 1, 16, dtype=np.float32) * (step + 1)
                    if run == "nan" and step == 20:
                        x[0] = np.nan
                    w.write(tag, step, numpy_stats(x), info)
    with open(os.path.join(root, "nan", "events.out.tfevents.0.garbage"), "wb") as f:
        f.write(b"\x00" * 40 + os.urandom(200))


@pytest.fixture(scope="module")
def client(tmp_path_factory) -> wtest.Client:
    root = str(tmp_path_factory.mktemp("fuzz") / "logs")
    _write_logdir(root)
    tb = program.TensorBoard(plugins=[core_plugin.CorePluginLoader(), plugin.NumericsLoader()])
    tb.configure(argv=["", "--logdir", root, "--load_fast", "false", "--reload_interval", "0",
                       "--reload_task", "blocking"])
    ingester = data_ingester.LocalDataIngester(tb.flags)
    ingester.start()
    app = application.TensorBoardWSGIApp(
        tb.flags, tb.plugin_loaders, ingester.data_provider, tb.assets_zip_provider,
        ingester.deprecated_multiplexer,
    )
    yield wtest.Client(app)
    print("\nfuzz: %d requests; statuses %s" % (sum(SEEN.values()), dict(sorted(SEEN.items()))))


def check(client: wtest.Client, url: str) -> tuple[int, bytes]:
    """GETs ``url`` (already percent-encoded); asserts the answer is sane."""
    r = client.get(url)
    body = r.get_data()
    assert r.status_code in (200, 400, 404), (url, r.status_code, body[:300])
    assert b"Traceback" not in body and b'File "' not in body, url
    if (r.status_code, r.mimetype, body) == (404, "text/plain", b"Not found"):
        # TensorBoard's router: the path never reached the plugin (e.g. a
        # decoded "?" ends it at /data/plugin/numerics).
        SEEN["404 (TensorBoard's router)"] += 1
        return r.status_code, body
    SEEN[str(r.status_code)] += 1
    if r.status_code != 200 or r.mimetype == "application/json":
        assert r.mimetype == "application/json", (url, r.mimetype)
        doc = json.loads(body)
        if r.status_code != 200:
            assert isinstance(doc.get("error"), str) and doc["error"], (url, doc)
    return r.status_code, body


def _encode(raw: bytes | str) -> str:
    return urllib.parse.quote(raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogatepass"), safe="")


numbers = st.one_of(
    st.integers(-(2**70), 2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["", "none", "off", "nan", "NaN", "inf", "-inf", "1e309", "0x10", "1_000", " 5 ", "+3",
                     "-0", "10001", "0", "1", "2000", "100000", "100001", "1,2", "[]", "{}", "null"]),
)
names = st.one_of(st.sampled_from(RUNS + TAGS), st.text(max_size=40))
raw_bytes = st.binary(max_size=30)
values = st.one_of(numbers, names, raw_bytes)


@st.composite
def queries(draw) -> str:
    keys = draw(st.lists(st.one_of(st.sampled_from(PARAMS), st.text(max_size=8)), max_size=8))
    parts = [_encode(k) + "=" + _encode(draw(values)) for k in keys]
    if draw(st.booleans()):
        parts.insert(0, "run=" + _encode(draw(st.sampled_from(RUNS))))
        parts.insert(1, "tensor=" + _encode(draw(st.sampled_from(TAGS))))
        parts.insert(2, "against=" + _encode(draw(st.sampled_from(RUNS))))
    return "&".join(parts)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(query=queries())
def test_api_routes_answer_only_200_400_404_with_json(client: wtest.Client, query: str) -> None:
    for route in API_ROUTES:  # the same parameters to every route: 6 requests
        status, body = check(client, "%s/%s?%s" % (P, route, query))
        if status == 200:
            json.loads(body)


TRAVERSALS = [
    "../plugin.py", "..%2Fplugin.py", "..%2f..%2fsetup.py", "%2e%2e/setup.py", "%2e%2e%2fsetup.py",
    "%2E%2E%2F%2E%2E%2Fsetup.py", "..%5cplugin.py", "..\\plugin.py", "%2Fetc%2Fpasswd", "/etc/passwd",
    "//etc/passwd", "%252e%252e%252fsetup.py", "index.js%00.js", "index.js/..", ".%2e/plugin.py",
    "C:%5Cwindows%5Cwin.ini", "....//setup.py", "%c0%ae%c0%ae/setup.py", "index.js%2f..%2f..%2fsetup.py",
]


@pytest.mark.parametrize("path", TRAVERSALS)
def test_static_routes_refuse_traversal(client: wtest.Client, path: str) -> None:
    status, body = check(client, "%s/%s" % (P, path))
    assert status == 404, (path, body[:200])


segments = st.one_of(
    st.sampled_from(["..", ".", "%2e%2e", "%2E%2e", "%2f", "%5c", "\\", "/", "", "index.js", "styles.css",
                     "app.js", "plugin.py", "__init__.py", "etc", "passwd", "%00", ".git", "~"]),
    st.binary(max_size=12).map(_encode),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(segments, min_size=1, max_size=6), sep=st.sampled_from(["/", "%2f", "%2F", "%5c"]))
def test_static_routes_serve_only_frontend_files(client: wtest.Client, parts: list[str], sep: str) -> None:
    path = sep.join(parts)
    status, body = check(client, "%s/%s" % (P, path))
    if status == 200:
        name = urllib.parse.unquote(path)
        # A served file is one of the frontend's, byte for byte.
        assert "/" not in name and "\\" not in name and ".." not in name, path
        with open(os.path.join(FRONTEND, name), "rb") as f:
            assert f.read() == body
