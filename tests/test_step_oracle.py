"""A record's step is the step ``tf.summary`` writes at the same call.

The oracle is ``tf.summary`` itself: beside each call a ``tf.summary.scalar``
named "oracle" is written with the same step argument, holding the call's
id, which the logged tensor holds too (as its finite max). Every record read
back must sit at the step of the scalar of the same id, over step sources
(a Python int, a ``tf.Variable`` argument, a ``set_step`` variable,
``optimizer.iterations``), where the step is incremented (before the calls,
after them, outside the function), and the writing paths. (Under
``MirroredStrategy``: ``test_summary.test_mirrored_strategy_combines_replicas_into_one_record``.)
"""

from __future__ import annotations

import hypothesis
import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import strategies as hs

import tb_numerics as tbn

from step_oracle import assert_steps_agree, record_steps
from test_summary import cli_json

pytestmark = pytest.mark.e2e

STEPS = 3


class _StepSource:
    """A step as ``source`` names it: the argument each call passes, and its increment."""

    def __init__(self, source: str):
        self.source = source
        self.count = 0  # the Python int step
        if source == "iterations":
            self.optimizer = keras.optimizers.SGD(0.0)
            self._dummy = tf.Variable([0.0])
            self.optimizer.build([self._dummy])
            self.var = self.optimizer.iterations
        else:
            self.var = tf.Variable(0, dtype=tf.int64)

    def arg(self):
        return {"int": self.count, "variable": self.var, "iterations": self.var}.get(self.source)

    def increment(self) -> None:
        if self.source == "int":
            self.count += 1
        elif self.source == "iterations":
            self.optimizer.apply_gradients([(tf.zeros([1]), self._dummy)])
        else:
            self.var.assign_add(1)


def _scenario(logdir: str, source: str, where: str, path: str, oracle_first: bool, bad: int | None) -> None:
    """Logs tensor "t" at ``STEPS`` steps with the oracle beside each call."""
    src = _StepSource(source)
    every_n = 2 if path == "every_n" else None

    def log(i, step):
        x = tf.stack([tf.cast(i, tf.float32), tf.where(tf.equal(i, bad if bad is not None else -1), np.nan, 0.0)])
        if oracle_first:
            tf.summary.scalar("oracle", x[0], step=step)
        tbn.log_numerics("t", x, step=step, every_n_steps=every_n)
        if not oracle_first:
            tf.summary.scalar("oracle", x[0], step=step)

    def body(i, step):
        if where == "before":
            src.increment()
        if path == "cond":
            tf.cond(i >= 0, lambda: log(i, step) or tf.constant(0), lambda: tf.constant(0))
        else:
            log(i, step)
        if where == "after":
            src.increment()

    writer = tf.summary.create_file_writer(logdir)
    with writer.as_default():
        if source == "set_step":
            tf.summary.experimental.set_step(src.var)
        if path == "loop":  # the whole loop in one tf.function; a Python int step is the loop's counter
            @tf.function
            def run():
                for i in tf.range(STEPS, dtype=tf.int64):
                    body(i, i if source == "int" else src.arg())

            run()
        else:
            fn = body if path == "eager" else tf.function(body)
            for i in range(STEPS):
                fn(tf.constant(i, tf.int64), src.arg())
                if where == "outside":
                    src.increment()
    tf.summary.experimental.set_step(None)
    writer.close()


@hypothesis.settings(max_examples=6, deadline=None, database=None)
@hypothesis.given(
    source=hs.sampled_from(["int", "variable", "set_step", "iterations"]),
    where=hs.sampled_from(["before", "after", "outside"]),
    path=hs.sampled_from(["eager", "function", "loop", "every_n", "cond"]),
    oracle_first=hs.booleans(),
    bad=hs.none() | hs.integers(0, STEPS - 1),
)
@hypothesis.example(source="set_step", where="after", path="function", oracle_first=False, bad=1)
@hypothesis.example(source="variable", where="after", path="loop", oracle_first=False, bad=None)
def test_every_record_is_at_the_step_tf_summary_writes(tmp_path_factory, source, where, path, oracle_first, bad):
    logdir = str(tmp_path_factory.mktemp("oracle"))
    _scenario(logdir, source, where, path, oracle_first, bad)
    assert_steps_agree(logdir)


@pytest.mark.parametrize("flight_recorder", [None, 2])
def test_op_numerics_records_at_the_step_its_traced_step_started(tmp_path, flight_recorder):
    step = tf.Variable(0, dtype=tf.int64)
    recorder = tbn.op_numerics(step=step, flight_recorder=flight_recorder, op_types=["Log"])

    @tf.function
    @recorder
    def train_step(x):
        y = tf.math.log(x)
        tf.summary.scalar("oracle", tf.reduce_max(y), step=step)
        step.assign_add(1)
        return y

    writer = tf.summary.create_file_writer(str(tmp_path))
    with writer.as_default():
        for i in range(STEPS):  # Log's max is log(e^i) = i; step 2 holds log(0) = -Inf
            train_step(tf.constant([np.exp(i), 0.0 if i == 2 else 1.0], tf.float32))
    writer.close()
    assert_steps_agree(str(tmp_path), "ops/")


def test_replay_records_at_the_default_step_it_was_called_at(tmp_path):
    step = tf.Variable(5, dtype=tf.int64)

    def train_step(x):
        y = tf.math.log(x)
        tf.summary.scalar("oracle", tf.reduce_max(y), step=step)
        step.assign_add(1)  # the step function moves the step on; the replay keeps the one it saw

    writer = tf.summary.create_file_writer(str(tmp_path))
    with writer.as_default():
        tf.summary.experimental.set_step(step)
        bad = tbn.oplevel.replay_step(train_step, tf.constant([np.exp(3.0), 0.0], tf.float32))
        tf.summary.experimental.set_step(None)
    writer.close()
    assert bad is not None and bad.op_type == "Log"
    assert_steps_agree(str(tmp_path), "ops/")


class _Probe(keras.layers.Layer):
    """Writes the oracle at ``optimizer.iterations`` (fit's step) and passes
    its input on with a -Inf column beside it (intended, but only the
    reader is told) and a NaN column at the batch that holds ``NAN_AT``."""

    def __init__(self, optimizer, **kwargs):
        super().__init__(**kwargs)
        self._optimizer = optimizer

    def call(self, x):
        tf.summary.scalar("oracle", tf.reduce_max(x), step=self._optimizer.iterations)
        col = tf.ones_like(x[:, :1])
        return tf.concat([x, -np.inf * col, tf.where(tf.equal(x[:, :1], NAN_AT), np.nan, 0.0 * col)], 1)


NAN_AT = 4


@pytest.fixture(scope="module")
def fit_logdir(tmp_path_factory):
    """A fit of 6 one-sample batches (batch i holds i), callback every 3 steps."""
    logdir = str(tmp_path_factory.mktemp("fit"))
    optimizer = keras.optimizers.SGD(0.01)
    model = keras.Sequential([
        keras.Input((2,)), _Probe(optimizer, name="probe"), keras.layers.Lambda(lambda t: t[:, :2]), keras.layers.Dense(1),
    ])
    model.compile(optimizer, "mse")
    x = np.repeat(np.arange(6, dtype=np.float32), 2).reshape(6, 2)
    writer = tf.summary.create_file_writer(logdir)
    callback = tbn.keras.NumericsCallback(logdir, every_n_steps=3, replay=False)
    with writer.as_default():
        model.fit(x, np.zeros((6, 1)), batch_size=1, shuffle=False, verbose=0, callbacks=[callback])
    writer.close()
    return logdir


def test_callback_records_at_the_step_fit_gives_tf_summary(fit_logdir):
    assert_steps_agree(fit_logdir, "probe/output")


def test_callback_writes_a_new_kind_of_nonfinite_value_whatever_n(fit_logdir):
    # -Inf from step 0 on closed the old latch: the NaN at step 4 was never written.
    steps = sorted(s for s, in record_steps(fit_logdir, "probe/output").values())
    assert steps == [0, 3, 4]
    status, runs = cli_json(fit_logdir, "--allow-neginf", "probe/*")
    a = runs[0]["first_anomaly"]
    assert status == 1 and (a["step"], a["tensor"], a["last_healthy_step"]) == (NAN_AT, "probe/output", 3)
