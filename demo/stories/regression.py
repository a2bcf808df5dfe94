"""Stories 5 and 6: one deep ReLU regression MLP, three runs.

* ``exploding_lr``: the learning rate is too large. Each SGD step overshoots
  by more than the last, and in a deep ReLU net the overshoot feeds on
  itself (larger weights make the next gradient larger in every layer): the
  gradient norm jumps by ~1000x two steps before a layer's output passes the
  float32 maximum (+Inf), and Inf - Inf then gives NaN everywhere.
  Cause: learning rate too large. Fix: lower it (or clip gradients).
* ``healthy``: the same model with a sane learning rate: no anomaly.
* ``bad_input``: the sane run, but one record of the data set holds 1e38 in
  one feature. 1e38 is finite, and so is every layer's output, but the
  prediction for that record is so large that its squared error overflows:
  the first anomaly is the loss (+Inf), and its likely cause is the input
  (logged with role "input"), already beyond the safe range (1/64 of the
  float32 maximum) in the same step.
  Cause: a corrupt record. Fix: validate or clip the inputs
  (``tf.debugging.assert_all_finite``, a range check in the input pipeline).
"""

import numpy as np
import tensorflow as tf

import tb_numerics as tbn
from demo.stories import _common

STEPS = 30
EXAMPLES, BATCH, FEATURES, WIDTH, DEPTH = 1024, 32, 8, 32, 5
CORRUPT_RECORD = 20 * BATCH + 7  # read at step 20
CORRUPT_FEATURE = 3


def data(corrupt: bool) -> tuple[np.ndarray, np.ndarray]:
    """A smooth target of the inputs; optionally one corrupt record."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(EXAMPLES, FEATURES)).astype(np.float32)
    y = (np.sin(x[:, :4]).sum(axis=1) + 0.5 * x[:, 4] * x[:, 5]).astype(np.float32)[:, None]
    if corrupt:
        x[CORRUPT_RECORD, CORRUPT_FEATURE] = 1e38
    return x, y


def train(logdir: str, name: str, learning_rate: float, corrupt: bool = False) -> None:
    writer, step = _common.start(logdir, name, seed=5)
    layers = [
        tf.keras.layers.Dense(WIDTH, activation="relu", name="dense_%d" % i)
        for i in range(DEPTH)
    ]
    head = tf.keras.layers.Dense(1, name="head")
    width = FEATURES
    for layer in layers + [head]:
        layer.build((None, width))
        width = layer.units
    variables = [v for layer in layers + [head] for v in layer.trainable_variables]
    optimizer = tf.keras.optimizers.SGD(learning_rate=learning_rate)
    x, y = data(corrupt)

    @tf.function
    def train_step(x, y):
        tbn.log_numerics("input", x, role="input")  # the batch as it arrived, before any layer
        with tf.GradientTape() as tape:
            h = x
            for layer in layers:
                h = layer(h)
                tbn.log_numerics(layer.name + "/output", h)
            pred = head(h)
            tbn.log_numerics("head/output", pred)
            loss = tf.reduce_mean(tf.math.squared_difference(pred, y))
            tbn.log_numerics("loss", loss)
        grads = tape.gradient(loss, variables)
        tbn.log_gradients(grads, variables)
        optimizer.apply_gradients(zip(grads, variables))

    with writer.as_default(step=step):
        for i in range(STEPS):
            batch = slice((i * BATCH) % EXAMPLES, (i * BATCH) % EXAMPLES + BATCH)
            train_step(x[batch], y[batch])
            step.assign_add(1)
    writer.close()


def run_exploding_lr(logdir: str) -> None:
    train(logdir, "exploding_lr", learning_rate=0.6)


def run_healthy(logdir: str) -> None:
    train(logdir, "healthy", learning_rate=0.01)


def run_bad_input(logdir: str) -> None:
    train(logdir, "bad_input", learning_rate=0.01, corrupt=True)
