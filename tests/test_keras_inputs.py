"""Issues 25 and 26, item 5: a batch that arrives broken is the first anomaly,
in phase ``input``, with the data-pipeline hint; an input far out of range
is the likely cause of an overflow further on.

Truth comes from the injected fault (which batch, which feature, how many
values) and, for the step, from ``optimizer.iterations`` as ``fit`` runs
the batch (a probe callback) or a ``tf.summary.scalar`` written beside the
record in a hand-written loop.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tb_numerics as tbn
from tb_numerics import analysis, event_reader, hints, metadata
from tb_numerics.keras import NumericsCallback

pytestmark = pytest.mark.e2e

B, T, F, STEPS = 16, 8, 6, 6
BAD_STEP, BAD_FEATURE, BAD_EXAMPLE = 2, 3, 7


def _run(logdir) -> analysis.RunAnalysis:
    (run,) = event_reader.read_logdir(str(logdir))
    return analysis.analyze_run(run.run, run.series)


class _StepAt(keras.callbacks.Callback):
    """The step ``fit`` runs batch ``BAD_STEP`` at: the optimizer's iterations then."""

    def on_train_batch_begin(self, batch, logs=None):
        if batch == BAD_STEP:
            self.step = int(self.model.optimizer.iterations.numpy())


def _fit(logdir, model, x, y, jit_compile=False) -> tuple[analysis.RunAnalysis, int]:
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse", jit_compile=jit_compile)
    probe = _StepAt()
    model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0, callbacks=[NumericsCallback(str(logdir)), probe])
    return _run(logdir), probe.step


def _data(shape):
    rs = np.random.RandomState(0)
    return rs.randn(STEPS * B, *shape).astype("float32"), rs.randn(STEPS * B, 1).astype("float32")


@pytest.fixture(scope="module", params=[False, True], ids=["graph", "xla"])
def nan_feature(request, tmp_path_factory):
    """A Conv1D model whose batch BAD_STEP holds NaN in feature BAD_FEATURE of every example."""
    keras.utils.set_random_seed(0)
    x, y = _data((T, F))
    x[BAD_STEP * B:(BAD_STEP + 1) * B, :, BAD_FEATURE] = np.nan
    model = keras.Sequential([keras.Input((T, F)), keras.layers.Conv1D(4, 3, name="conv1d"),
                              keras.layers.GlobalAveragePooling1D(name="pool"), keras.layers.Dense(1, name="head")])
    return _fit(tmp_path_factory.mktemp("nan_feature"), model, x, y, request.param)


def test_a_nan_in_the_batch_is_the_first_anomaly_in_phase_input(nan_feature):
    ra, step = nan_feature
    a = analysis.first_anomaly(ra)
    assert (a["step"], a["tensor"], a["phase"], a["role"]) == (step, "input", "input", "input")
    assert step == BAD_STEP and a["nan"] == B * T  # every example's feature 3
    # The first layer that reads it is NaN too, and comes after it.
    conv = ra.find("conv1d/output")
    assert conv.codes[conv.series.steps.tolist().index(step)] == analysis.NONFINITE
    # No op of the step made the NaN: no op, no replay verdict is shown for it.
    assert a["op"] is None and a["replay"] is None


def test_the_hint_names_the_data_pipeline_the_feature_and_the_count(nan_feature):
    ra, step = nan_feature
    hint = analysis.first_anomaly(ra)["hint"]
    assert "data pipeline" in hint and "at step %d held %d NaN" % (step, B * T) in hint, hint
    assert "all in feature %d (of %d)" % (BAD_FEATURE, F) in hint and "in %d of its %d examples" % (B, B) in hint, hint


def test_nan_targets_are_the_first_anomaly_with_the_targets_named(tmp_path):
    keras.utils.set_random_seed(0)
    x, y = _data((F,))
    y[BAD_STEP * B + BAD_EXAMPLE, 0] = np.nan
    model = keras.Sequential([keras.Input((F,)), keras.layers.Dense(8, activation="tanh", name="hidden"),
                              keras.layers.Dense(1, name="head")])
    ra, step = _fit(tmp_path, model, x, y)
    a = analysis.first_anomaly(ra)
    assert (a["step"], a["tensor"], a["phase"], a["nan"]) == (step, "target", "input", 1)
    layer_level = [h.series.tag for h in ra.health if not analysis.is_op_level(h.series.tag)]
    assert layer_level[:3] == ["input", "target", "hidden/output"]  # the batch first
    assert "the targets (target)" in a["hint"] and "data pipeline" in a["hint"], a["hint"]
    assert "in 1 of its %d examples (the first: %d)" % (B, BAD_EXAMPLE) in a["hint"], a["hint"]


def test_an_input_far_out_of_range_is_the_likely_cause_of_the_loss_overflow(tmp_path):
    """1e38 is finite: the layers' outputs stay finite, the squared error is +Inf."""
    keras.utils.set_random_seed(0)
    x, y = _data((F,))
    x[BAD_STEP * B + BAD_EXAMPLE, BAD_FEATURE] = 1e38
    model = keras.Sequential([keras.Input((F,)), keras.layers.Dense(1, name="head")])
    ra, step = _fit(tmp_path, model, x, y)
    a = analysis.first_anomaly(ra)
    assert a["step"] == step and a["phase"] != "input"
    c = a["likely_cause"]
    assert (c["step"], c["tensor"], c["kind"], c["phase"]) == (step, "input", "overflow_risk", "input"), c
    hint = a["hint"]
    assert hint.startswith("The batch at step %d was already far out of range in input" % step), hint
    assert "max |x| = 1e38" in hint and "all in feature %d" % BAD_FEATURE in hint, hint
    assert "(the first: %d)" % BAD_EXAMPLE in hint, hint


def test_log_numerics_role_input_in_a_hand_written_loop(tmp_path):
    """A custom loop logs its batch with role="input": the same answer, at
    the step tf.summary writes beside it."""
    keras.utils.set_random_seed(0)
    x, y = _data((F,))
    x[BAD_STEP * B + BAD_EXAMPLE, BAD_FEATURE] = np.nan
    dense = keras.layers.Dense(1, name="head")
    dense.build((None, F))
    step = tf.Variable(0, dtype=tf.int64)
    writer = tf.summary.create_file_writer(str(tmp_path))

    @tf.function
    def train_step(xb, yb):
        tbn.log_numerics("batch_x", xb, role="input")
        tf.summary.scalar("oracle/batch_has_nan", tf.cast(tf.reduce_any(tf.math.is_nan(xb)), tf.float32))
        out = dense(xb)
        tbn.log_numerics("head/output", out)
        tbn.log_numerics("loss", tf.reduce_mean(tf.square(out - yb)))

    with writer.as_default(step=step):
        for i in range(STEPS):
            train_step(x[i * B:(i + 1) * B], y[i * B:(i + 1) * B])
            step.assign_add(1)
    writer.close()
    a = analysis.first_anomaly(_run(tmp_path))
    oracle = [e.step for e in tf.compat.v1.train.summary_iterator(writer_path(tmp_path))
              for v in e.summary.value if v.tag == "oracle/batch_has_nan" and tf.make_ndarray(v.tensor)]
    assert (a["step"], a["tensor"], a["phase"], a["nan"]) == (oracle[0], "batch_x", "input", 1)
    assert "data pipeline" in a["hint"] and "1 NaN of %d values in batch_x" % (B * F) in a["hint"], a["hint"]


def writer_path(logdir) -> str:
    (path,) = [str(p) for p in logdir.iterdir() if p.name.startswith("events.out.tfevents")]
    return path


def test_a_reader_of_the_previous_minor_version_reads_the_input_role_as_other(monkeypatch):
    """Records are written with role "input"; a reader whose ROLES lack it
    (minor version 1) reads "other", phase forward: still readable, and
    its order (before the layers') keeps it first in the forward phase."""
    content = metadata.create_summary_metadata(metadata.TensorInfo(role="input", order=0)).plugin_data.content
    assert metadata.parse_plugin_metadata(content).phase == "input"
    monkeypatch.setattr(metadata, "ROLES", tuple(r for r in metadata.ROLES if r != "input"))
    # The parse remembers recent contents (a run's blocks share one table):
    # an older reader is a new process, with nothing remembered.
    metadata._parse_content.cache_clear()
    try:
        old = metadata.parse_plugin_metadata(content)
    finally:
        metadata._parse_content.cache_clear()
    assert (old.role, old.phase, old.order) == ("other", "forward", 0)
    # A tag whose first event (and metadata) was lost: the callback's batch tags read as input.
    assert [metadata.info_from_tag(t).role for t in ("input", "target/0", "sample_weight", "input/output")] == [
        "input", "input", "input", "activation"]


@pytest.mark.parametrize("where, words", [
    ({"features": 8, "bad_features": 3, "by_feature": [{"feature": 5}, {"feature": 1}], "examples": 4,
      "bad_examples": 2, "first_bad_example": 1}, ", in 3 features (of 8): 5, 1, ..., in 2 of its 4 examples (the first: 1):"),
    ({"features": "8", "bad_features": -1, "by_feature": [7, {"feature": None}], "examples": 4.5}, ":"),
    ([1, 2], ":"),
])
def test_where_a_batch_held_its_bad_values_is_read_as_untrusted_json(where, words):
    ev = hints.Evidence("input", metadata.TensorInfo(role="input"), 3, {},
                        batch=hints.BatchFault("input", 3, "2 NaN of 32 values", nonfinite=True, where=where))
    assert hints.choose(ev).startswith("The batch at step 3 held 2 NaN of 32 values in input" + words)
