"""The tab keeps answering when TensorBoard's data server dies.

TensorBoard's Rust data server aborts on a checksummed record header that
claims a terabyte, and every data-provider call fails from then on. A
plugin reading through the data provider then reads the logdir itself
(``logdir_provider``); the oracle for what it reads is TensorBoard's own
Python loader over the same files. For a local logdir the plugin reads the
event files itself from the start (``file_provider``): the end-to-end test
damages a file while a real ``tensorboard --load_fast=true`` serves, and
compares the answers with those given before the damage.
"""

from __future__ import annotations

import math
import os
import struct

import numpy as np
import pytest
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
from tensorboard.context import RequestContext
from tensorboard.data import provider

from tb_numerics import logdir_provider, metadata
from tb_numerics.record_writer import NumericsRecordWriter
from tb_numerics.records import numpy_stats
from tb_numerics.run_store import RunStore
from tb_numerics import analysis
from tb_process import tensorboard, wait_for
from test_run_store import Logdir

CTX = RequestContext()
ACT = metadata.TensorInfo(role="activation", order=0)
LOSS = metadata.TensorInfo(role="loss", order=1)


def write_run(path: str, steps: int, nan_step: int | None, packed_steps: bool) -> None:
    """Two tensors a step, per tensor or packed (as the callback writes)."""
    w = NumericsRecordWriter(path)
    for step in range(steps):
        act = numpy_stats(np.float32([1.0, math.nan if step == nan_step else 2.0 + step]))
        loss = numpy_stats(np.float32([0.5 / (step + 1)]))
        if packed_steps:
            w.write_many(step, [("dense1/output", act, ACT), ("loss", loss, LOSS)])
        else:
            w.write("dense1/output", step, act, ACT)
            w.write("loss", step, loss, LOSS)
    w.close()


def event_file(run_dir: str) -> str:
    return os.path.join(run_dir, next(f for f in sorted(os.listdir(run_dir)) if "tfevents" in f))


def append_giant_header(path: str) -> None:
    """A record header with a valid checksum that claims 1 TiB."""
    header = struct.pack("<Q", 2**40)
    with open(path, "ab") as f:
        f.write(header + struct.pack("<I", masked_crc32c(header)) + b"x" * 64)


@pytest.fixture(scope="module")
def logdir(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("outage") / "logs")
    write_run(os.path.join(root, "nan_packed"), 30, 17, packed_steps=True)
    write_run(os.path.join(root, "nan_per_tensor"), 12, 5, packed_steps=False)
    write_run(os.path.join(root, "healthy"), 20, None, packed_steps=True)
    return root


@pytest.mark.unit
def test_the_logdir_provider_serves_what_tensorboards_own_loader_serves(logdir: str) -> None:
    oracle = Logdir(logdir).provider
    ours = logdir_provider.LogdirProvider(logdir)
    kw = dict(experiment_id="", plugin_name=metadata.PLUGIN_NAME)
    want, got = oracle.list_tensors(CTX, **kw), ours.list_tensors(CTX, **kw)
    assert sorted(got) == sorted(want) == ["healthy", "nan_packed", "nan_per_tensor"]
    for run in want:
        assert sorted(got[run]) == sorted(want[run])
        for tag, ts in want[run].items():
            assert (got[run][tag].max_step, got[run][tag].plugin_content) == (ts.max_step, ts.plugin_content)
    rtf = provider.RunTagFilter(runs=["nan_packed", "nan_per_tensor"])
    want = oracle.read_tensors(CTX, downsample=10**9, run_tag_filter=rtf, **kw)
    got = ours.read_tensors(CTX, downsample=10**9, run_tag_filter=rtf, **kw)
    assert sorted(got) == sorted(want)
    for run in want:
        for tag, data in want[run].items():
            assert [d.step for d in got[run][tag]] == [d.step for d in data]
            for a, b in zip(got[run][tag], data):
                np.testing.assert_array_equal(a.numpy, b.numpy)
    assert ours.list_plugins(CTX, experiment_id="") == [metadata.PLUGIN_NAME]
    assert ours.list_tensors(CTX, experiment_id="", plugin_name="scalars") == {}


class _DeadServer:
    """TensorBoard's gRPC provider once its Rust server has died."""

    def __getattr__(self, name):
        import grpc

        class Unavailable(grpc.RpcError):
            def code(self):
                return grpc.StatusCode.UNAVAILABLE

            def details(self):
                return "failed to connect to all addresses"

        def call(*args, **kwargs):
            raise Unavailable()

        return call


@pytest.mark.unit
def test_an_outage_fails_over_to_the_logdir_and_says_so_in_every_run(logdir: str) -> None:
    failover = logdir_provider.FailoverProvider(_DeadServer(), logdir)
    store = RunStore(failover, reload_interval=0, background=False, run_problems=failover.problems)
    summary = analysis.run_summary(store.answer(CTX, "", "nan_packed", analysis.SafeRange()).analysis)
    assert (summary["first_anomaly"]["step"], summary["first_anomaly"]["tensor"]) == (17, "dense1/output")
    problems = summary["problems"]
    assert any("data server stopped answering" in p and "UNAVAILABLE" in p for p in problems), problems
    healthy = analysis.run_summary(store.answer(CTX, "", "healthy", analysis.SafeRange()).analysis)
    assert healthy["first_anomaly"] is None and healthy["records"] == 40
    # No logdir to read: a clear error, not a traceback.
    with pytest.raises(logdir_provider.DataServerUnavailable, match="restart TensorBoard"):
        logdir_provider.FailoverProvider(_DeadServer(), None).list_tensors(
            CTX, experiment_id="", plugin_name=metadata.PLUGIN_NAME
        )


@pytest.mark.e2e
def test_a_terabyte_header_kills_the_data_server_but_not_the_tab(tmp_path) -> None:
    """For a local logdir the plugin reads the event files itself
    (``file_provider``): the data server's death changes nothing the tab
    says, but that the damaged file is named in its run."""
    root = str(tmp_path / "logs")
    write_run(os.path.join(root, "nan_packed"), 30, 17, packed_steps=True)
    write_run(os.path.join(root, "healthy"), 20, None, packed_steps=True)
    with tensorboard(root, load_fast=True, reload_interval=1) as tb:
        before = wait_for(lambda: tb.get_json("/data/plugin/numerics/summary?run=nan_packed"))
        assert before["first_anomaly"]["step"] == 17
        damaged = event_file(os.path.join(root, "healthy"))
        append_giant_header(damaged)
        wait_for(lambda: "memory allocation" in tb.log, timeout=60)  # the oracle: the data server really died

        def named():
            s = tb.get_json("/data/plugin/numerics/summary?run=healthy")
            return s if any(os.path.basename(damaged) in p for p in s["problems"]) else None

        healthy = wait_for(named, timeout=60)
        after = tb.get_json("/data/plugin/numerics/summary?run=nan_packed")
        assert after["first_anomaly"]["step"] == before["first_anomaly"]["step"]
        assert after["first_anomaly"]["tensor"] == before["first_anomaly"]["tensor"]
        assert not any("stopped answering" in p for p in after["problems"])
        assert healthy["first_anomaly"] is None and healthy["records"] == 40
        # The damaged file is named in its run's problems, and only there.
        assert any(os.path.basename(damaged) in p and "truncated" in p for p in healthy["problems"])
        assert not any(os.path.basename(damaged) in p for p in after["problems"])
        assert len(tb.get_json("/data/plugin/numerics/runs")["runs"]) == 2
        timeline = tb.get_json("/data/plugin/numerics/timeline?run=nan_packed&width=10")
        assert any(2 in row["cells"] for row in timeline["rows"])
        # A run written after the outage is read too.
        write_run(os.path.join(root, "later"), 8, 3, packed_steps=False)
        later = wait_for(lambda: tb.get_json("/data/plugin/numerics/summary?run=later"), timeout=30)
        assert later["first_anomaly"]["step"] == 3
