"""tb_numerics.compare on real Keras training: the same model trained twice,
once with a fault injected at a known layer and step (both stay finite); the comparison must
find that step and that layer (its output, the first tensor in execution
order that the fault changes), through the reader, the CLI's
``report --against`` and the parser of the band's parameters.
"""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest

from tb_numerics import cli, compare, event_reader
from tb_numerics.keras import NumericsCallback

pytestmark = pytest.mark.e2e

FAULT_STEP = 8
FAULT_LAYER = "d1"
STEPS = 12


class ScaleKernelAt(keras.callbacks.Callback):
    """The injected fault: multiplies a layer's kernel by 10 before one step runs (d1 is
    linear, so its output grows 10x, beyond the band's x4: tanh would saturate
    inside it). Training stays finite (no replay)."""

    def __init__(self, layer: str, step: int):
        super().__init__()
        self.layer, self.step = layer, step

    def on_train_batch_begin(self, batch, logs=None):
        if batch == self.step:
            kernel = self.model.get_layer(self.layer).kernel
            kernel.assign(kernel * 10.0)


def _train(logdir: str, fault: bool) -> None:
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="tanh", name="d0"),
         keras.layers.Dense(16, name="d1"), keras.layers.Dense(4, name="head")],
        name="mlp",
    )
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    rs = np.random.RandomState(0)
    x, y = rs.randn(STEPS * 8, 8).astype("float32"), rs.randn(STEPS * 8, 4).astype("float32")
    callbacks = ([ScaleKernelAt(FAULT_LAYER, FAULT_STEP)] if fault else []) + [NumericsCallback(logdir)]
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    _train(str(root / "clean"), fault=False)
    _train(str(root / "faulty"), fault=True)
    return str(root)


def test_the_first_departure_is_the_injected_layer_and_step(logdir):
    runs = {rr.run: rr.series for rr in event_reader.read_logdir(logdir)}
    got = compare.compare_runs(runs["faulty"], runs["clean"])
    d = got["first_departure"]
    assert (d["step"], d["tensor"]) == (FAULT_STEP, FAULT_LAYER + "/output"), d
    assert d["statistic"] in ("max_abs", "l2") and d["value"] > d["band"][1] * 4
    assert got["tensors_compared"] > 5 and got["steps_compared"] == [0, STEPS - 1]
    # The clean run against itself never leaves its band.
    assert compare.compare_runs(runs["clean"], runs["clean"])["first_departure"] is None


def test_report_against_prints_and_returns_the_same(logdir, capsys):
    assert cli.main(["report", logdir, "--against", "clean", "--json"]) == cli.EXIT_OK
    by_run = {r["run"]: r for r in json.loads(capsys.readouterr().out)["runs"]}
    d = by_run["faulty"]["against"]["first_departure"]
    assert (by_run["faulty"]["against"]["run"], d["step"], d["tensor"]) == ("clean", FAULT_STEP, FAULT_LAYER + "/output")
    assert "against" not in by_run["clean"]
    cli.main(["report", logdir, "--against", "clean"])
    out = capsys.readouterr().out
    assert "  against clean: leaves its band at step %d, %s/output (forward): " % (FAULT_STEP, FAULT_LAYER) in out
    assert cli.main(["report", logdir, "--against", "nope"]) == cli.EXIT_USAGE
    assert "no run named 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "params, error",
    [({"factor": "1"}, "factor must be a number above 1"), ({"factor": "x"}, "factor must be a number"),
     ({"zero_share": "2"}, "zero_share must be in [0, 1]"), ({"window": "2.5"}, "window must be a whole number")],
)
def test_band_parameters_are_checked(params, error):
    with pytest.raises(compare.BandError, match=error.replace("[", r"\[").replace("]", r"\]")):
        compare.parse_band(params)
    assert compare.parse_band({"factor": "10", "window": "0"}) == compare.Band(factor=10.0, window=0)
