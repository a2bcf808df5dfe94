"""Scale limits, modest for CI: the code of ``bench/load.py --scale``.

A run of 1,000 tensors and a run of 50,000 steps of one tensor (the
benchmark: 1,000,000), each with one non-finite step, in a real TensorBoard:
the timeline shows that single step in its bucket, the first anomaly is it,
and a small run keeps answering while the big ones are read. Prints the
response times.
"""

from __future__ import annotations

import pytest
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "bench"))
import load  # noqa: E402 - bench/load.py

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# Generous bounds for a shared 2-core CI machine; bench/load.py states the figures.
COLD_S = 60.0
WARM_S = 5.0
SMALL_RUN_MAX_S = 10.0


def test_thousand_tensors_and_long_run_stay_responsive(tmp_path) -> None:
    results, resp = load.scale(str(tmp_path / "logs"), tensors=1000, tensor_steps=3, steps=50_000)
    load.print_scale(results, resp)
    assert [(s.run, s.records) for s in results] == [("wide", 3000), ("long", 50_000)]
    for s in results:
        assert s.bad_bucket_shown, s.run
        assert s.anomaly_step == s.bad_step, s.run
        assert s.times_s["loaded and first /summary (cold)"] < COLD_S, s.times_s
        warm = {k: t for k, t in s.times_s.items() if "cold" not in k}
        assert max(warm.values()) < WARM_S, warm
    assert resp.requests > 0 and resp.max_s < SMALL_RUN_MAX_S
