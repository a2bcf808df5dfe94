"""The fault-injection zoo's CI slice: the instrument works, and the targets today's product meets hold.

Runs ``bench/zoo.py --slice ci`` (a few cells, each the oracle's run under
``tf.debugging.enable_check_numerics`` and tb-numerics' runs on the fault
and the fixed variant, each in its own subprocess) once for the module.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """Where the slice's runs write their logdirs (one a run, named ``<arch>-<fault>-<variant>-<mode>``)."""
    return tmp_path_factory.mktemp("zoo")


@pytest.fixture(scope="module")
def zoo(workdir) -> dict:
    out = workdir
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "zoo.py"), "--slice", "ci", "--jobs", "2",
         "--json", str(out / "zoo.json"), "--workdir", str(out)],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    with open(out / "zoo.json") as f:
        return json.load(f)


def test_the_oracle_names_an_op_and_a_step_in_every_cell(zoo):
    for cell in zoo["cells"]:
        truth = cell["truth"]
        assert truth["fired"], cell
        assert truth["step"] >= 0 and truth["op_type"], cell


def test_the_oracle_names_the_injected_faults_op(zoo):
    """The truth is the fault's own op, at the fault's own line, not some op downstream."""
    by_cell = {(c["arch"], c["fault"]): c["truth"] for c in zoo["cells"]}
    div = by_cell[("loop", "div_stat")]
    assert (div["op_type"], div["phase"]) == ("RealDiv", "forward") and "masked_mean" in div["source"]
    # The NaN is born in InputNorm's RealDiv (0/0 on a blank batch); check_numerics in the graph
    # raised at the GRU's MatMul after it, so the oracle decides on an eager pass of that step.
    norm = by_cell[("gru", "no_eps")]
    assert (norm["op_type"], norm["phase"]) == ("RealDiv", "forward") and "(call)" in norm["source"], norm
    assert norm["eager"], norm
    nan = [c for c in zoo["cells"] if c["fault"] == "nan_batch"]
    assert nan and all(c["input_truth"] for c in nan)


def test_every_cell_trained_and_has_a_report(zoo):
    for cell in zoo["cells"]:
        assert not cell["died"] and not cell["fixed_crash"], cell
        assert cell["report"] and cell["fixed_report"], cell


def test_todays_targets_on_the_slice(zoo):
    """What today's product meets here: the oracle's step in every cell, no wrong hint, and
    the custom loop's replay names the oracle's op and line."""
    for cell in zoo["cells"]:
        assert cell["step_exact"], cell
        assert cell["hint"] != "wrong", cell
    loop = next(c for c in zoo["cells"] if c["arch"] == "loop")
    assert loop["op_type"] and loop["source_line"] and not loop["crash"], loop
    assert loop["hint"] == "right", loop


def test_a_learning_rate_100x_under_mixed_float16_warns_first_and_names_it(zoo):
    """Issue 26 item 4: the mixed_float16 Transformer (hand-written norms, a LossScaleOptimizer)
    at 100x its learning rate gets a warning before the first non-finite value the oracle
    names, a hint that names the learning rate, and the op inside the model (not the model,
    a container layer) at the oracle's step; its fixed variant gets no warning."""
    cell = next(c for c in zoo["cells"] if (c["arch"], c["fault"]) == ("transformer", "lr100"))
    assert cell["truth"]["phase"] == "forward", cell["truth"]
    assert cell["lead"] is not None and cell["lead"] >= 1, cell["product"]["first_warning"]
    assert cell["hint"] == "right", cell["product"]["hint"]
    assert cell["step_exact"] and cell["op_type"] and cell["source_line"], cell["product"]
    assert cell["false_warnings"] == 0, cell


def test_each_product_run_held_compact_reports_what_every_record_read_reports(zoo, workdir, caplog):
    """TensorBoard holds a long run compact (``compact``): every product run
    of the slice (real architectures, ``fit`` and the custom loop, the
    fault and its fix), held so however short, gives ``tb-numerics
    report``'s first anomaly, hint and warnings (its answer from every
    record read is the truth) without reading any tensor's records back
    whole (on a long run each would be the event files read again)."""
    from tensorboard.context import RequestContext

    import long_run
    from tb_numerics import analysis, cli, compact, rules

    caplog.set_level(logging.INFO, logger="tb_numerics.compact")
    logdirs = sorted(p for p in workdir.iterdir() if p.is_dir() and p.name.endswith("-product"))
    assert len(logdirs) == 2 * len(zoo["cells"])
    held_compact = 0
    for logdir in logdirs:
        truth, _ = cli.report(str(logdir), analysis.SafeRange())
        store = long_run.compact_store(str(logdir))
        for want in truth:
            run = "." if want["run"] == logdir.name else want["run"]  # the report names the logdir's own run so
            ra = store.answer(RequestContext(), "", run, analysis.SafeRange()).analysis
            held_compact += any(isinstance(h.series, compact.CompactSeries) for h in ra.health)
            got = analysis.run_summary(ra)
            for key in ("first_anomaly", "first_warning", "warnings", "info"):
                assert rules.dumps(got[key]) == rules.dumps(want[key]), (logdir.name, want["run"], key)
    assert held_compact >= len(zoo["cells"])  # the Keras runs' records are packed, and so held compact
    assert "reading all" not in caplog.text


def test_a_first_look_at_each_product_run_is_the_reports_first_anomaly_or_none(zoo, workdir):
    """A first look (``run_store``'s answer before a long run is read) at
    every product run of the slice, held as a long run however short: its
    first anomaly's own fields are ``tb-numerics report``'s (every record
    read), or there is none and the answer is the whole run's; never one on
    a fixed variant (real architectures: a BatchNorm CNN fed a NaN batch, a
    GRU, a Transformer, a custom loop; ``fit`` and the loop alike)."""
    from tensorboard.context import RequestContext

    import long_run
    from tb_numerics import analysis, cli, rules

    own = ("step", "tensor", "op_type", "phase", "role", "nan", "posinf", "neginf", "size", "description",
           "occurrence", "op", "replay")
    looks = 0
    for logdir in sorted(p for p in workdir.iterdir() if p.is_dir() and p.name.endswith("-product")):
        truth, _ = cli.report(str(logdir), analysis.SafeRange())
        store = long_run.compact_store(str(logdir))
        for want in truth:
            run = "." if want["run"] == logdir.name else want["run"]
            answer = store.answer(RequestContext(), "", run, analysis.SafeRange(), first_look=True)
            if answer.preliminary:
                looks += 1
                got = analysis.first_look_summary(answer.analysis)["first_anomaly"]
                assert want["first_anomaly"] is not None and "fixed" not in logdir.name, (logdir.name, run)
                assert rules.dumps({k: got[k] for k in own}) == rules.dumps(
                    {k: want["first_anomaly"][k] for k in own}), (logdir.name, run)
            else:
                got = analysis.run_summary(answer.analysis)["first_anomaly"]
                assert rules.dumps(got) == rules.dumps(want["first_anomaly"]), (logdir.name, run)
    assert looks >= 1
