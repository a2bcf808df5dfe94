"""The on-disk action events (issue 31) and the report's words, without TensorFlow.

Events are written with the TensorFlow-free ``record_writer`` beside
ordinary records and read back by the CLI's reader: every event comes back
in step order, a damaged or hostile one is a problem (never a crash or a
wrong event), one of a newer format says to upgrade, and none of them is
read as a tensor's record, which is what a reader that does not know them
(every tb-numerics before them) sees: records of another plugin.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from tensorboard.compat.proto import summary_pb2

from tb_numerics import analysis, event_reader, metadata, plugin, record_writer, records, survive

pytestmark = pytest.mark.unit

_LOSS = metadata.TensorInfo(role="loss", dtype="float32", shape=())


def _event(action: str, trigger: str = "nonfinite", **fields) -> dict:
    return {"epoch": 0, "batch": 3, "trigger": trigger, "action": action, **fields}


def _run(tmp_path, events: dict[int, dict], steps: int = 8):
    with record_writer.NumericsRecordWriter(str(tmp_path)) as w:
        for step in range(steps):
            value = np.float32(np.nan) if step in events else np.float32(1.0)
            w.write_many(step, [("loss", records.numpy_stats(value), _LOSS)])
            if step in events:
                w.write_action(step, events[step])
    (rr,) = event_reader.read_logdir(str(tmp_path))
    return rr


def test_events_come_back_in_step_order_and_are_no_tensor(tmp_path):
    rr = _run(tmp_path, {2: _event("skip"), 3: _event("skip"), 5: _event("rewind", lr_factor=0.5, to_step=0)})
    assert [e["step"] for e in rr.actions] == [2, 3, 5] and not rr.problems
    assert [s.tag for s in rr.series] == ["loss"]  # the events are not records of a tensor
    # The first anomaly is the records' alone, as a reader that knows no events finds it.
    ra = analysis.analyze_run("run", rr.series)
    assert analysis.first_anomaly(ra)["step"] == 2
    actions = survive.summarize(rr.actions, analysis.first_anomaly(ra))
    assert actions["words"] == "survived 2 non-finite steps (skipped), 1 rewind at step 5 with lr × 0.5"
    assert actions["failed_batches"] == [{"step": s, "epoch": 0, "batch": 3} for s in (2, 3, 5)]
    assert actions["events"][0]["hint"] == analysis.first_anomaly(ra)["hint"]


@pytest.mark.parametrize("content, why", [
    (json.dumps({"version": metadata.ACTIONS_FORMAT_VERSION + 1}).encode(), "upgrade tb-numerics"),
    (b"{not json", "not valid JSON"),
    (b'{"version": "1"}', "no valid format version"),
])
def test_an_event_of_a_newer_or_broken_format_is_a_problem(content, why):
    tensor = record_writer.action_tensor_proto(_event("skip"))
    problems: list[str] = []
    assert event_reader.action_of(content, tensor, 4, problems) is None
    assert len(problems) == 1 and why in problems[0] and "step 4" in problems[0]


@pytest.mark.parametrize("data, kept", [
    (b"\xff\xfe", False), (b"[]", False), (b'{"action": "explode", "trigger": "nonfinite"}', False),
    (b'{"action": "skip"}', False), (b'{"action": "skip", "trigger": "nonfinite", "epoch": "0", "step": 99}', True),
])
def test_a_hostile_event_is_refused_or_cleaned(data, kept):
    event = survive.parse_event(data, 7)
    assert (event is not None) == kept
    if kept:  # its step is the record's; an index that is not an integer is dropped
        assert event["step"] == 7 and event["epoch"] is None and event["batch"] is None


def test_the_words_of_a_stop_after_rewinds():
    events = [dict(_event("rewind", lr_factor=0.5), step=s) for s in (100, 4200, 5000, 6000)]
    events.append(dict(_event("stop", reason="4 rewinds already (at most 4)"), step=7000))
    events.append(dict(_event("skip", trigger="loss_spike"), step=50))
    words = survive.summarize(events)["words"]
    assert words == ("survived 1 loss spike (skipped), 4 rewinds at steps 100, 4,200, 5,000 and 1 more, lr × 0.0625 in "
                     "all; stopped at step 7,000: 4 rewinds already (at most 4)")
    assert survive.summarize([]) is None


def test_the_policy_escalates_as_documented():
    s = survive.Survival(survive.OnAnomaly("skip", max_skips=2, then="rewind", max_rewinds=1))
    assert [s.decide()[0] for _ in range(3)] == ["skip", "skip", "rewind"]
    s.healthy()
    assert [s.decide()[0] for _ in range(3)] == ["skip", "skip", "stop"]
    assert survive.Survival(survive.OnAnomaly("rewind", max_rewinds=0)).decide()[0] == "stop"


@pytest.mark.parametrize("kwargs", [dict(action="ignore"), dict(then="skip"), dict(lr_factor=2.0), dict(lr_factor=math.nan),
                                    dict(max_skips=-1), dict(snapshot_every=0), dict(spike="yes")])
def test_a_bad_policy_is_refused_with_its_name(kwargs):
    with pytest.raises(ValueError, match="on_anomaly|OnAnomaly"):
        survive.OnAnomaly(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(z=0), dict(z=math.inf), dict(z=math.nan), dict(window=1),
                                    dict(warmup=200), dict(loss=False, grad_norm=False)])
def test_a_bad_spike_trigger_is_refused_with_its_name(kwargs):
    with pytest.raises(ValueError, match="Spike"):
        survive.Spike(**kwargs)


def test_tensorboard_keeps_every_event():
    class Flags:
        samples_per_plugin = "scalars=5"

    flags = Flags()
    plugin.NumericsLoader().fix_flags(flags)
    assert flags.samples_per_plugin == {"scalars": 5, metadata.PLUGIN_NAME: 0, metadata.ACTIONS_PLUGIN: 0}


def test_the_event_metadata_names_its_own_plugin():
    md = metadata.create_action_metadata()
    assert md.plugin_data.plugin_name == metadata.ACTIONS_PLUGIN != metadata.PLUGIN_NAME
    assert md.data_class == summary_pb2.DATA_CLASS_TENSOR
