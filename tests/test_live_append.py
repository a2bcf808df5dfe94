"""Live appends under load, in a real TensorBoard on 127.0.0.1.

A writer appends to a run while 50 clients poll every route (the code of
``bench/load.py``, for ``TBN_LOAD_SECONDS`` seconds, 8 by default; the
benchmark runs it for 60). Every answer is 200 with a JSON body; after the
writer stops and one reload passes, /summary counts every record written and
its first anomaly equals ``tb-numerics report --json``'s.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "bench"))
import load  # noqa: E402 - bench/load.py

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SECONDS = float(os.environ.get("TBN_LOAD_SECONDS", 8))


@pytest.mark.parametrize("load_fast", [True, False], ids=["load_fast", "python_loader"])
def test_live_appends_under_50_clients_lose_nothing(tmp_path, load_fast: bool) -> None:
    r = load.live_load(str(tmp_path / "logs"), SECONDS, clients=50, load_fast=load_fast)
    load.print_live(r)
    assert r.requests >= 50
    assert r.invalid == [] and r.server_errors == 0
    assert r.last_step >= load.LIVE_NAN_STEP
    assert (r.records_served, r.last_step_served) == (r.records_written, r.last_step)
    assert r.first_anomaly_cli is not None and r.first_anomaly_cli["step"] == load.LIVE_NAN_STEP
    assert r.anomalies_missed == 0, (r.first_anomaly_server, r.first_anomaly_cli)
