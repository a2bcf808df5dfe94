"""Story 2: log of a softmax that saturated to exactly 0.

A small softmax classifier is trained with the cross-entropy written out,
``-reduce_sum(y * log(softmax(logits)))``, and a learning rate that is too
high (a linear warm-up to a peak that is far too high). The logits grow
quickly; once the gap between two logits of one example exceeds ~87, the
float32 ``exp`` of the smaller one underflows (TensorFlow flushes subnormals
to zero on CPU) and the softmax gives exactly 0 for that class. ``log(0)`` is -Inf, and ``0 * -Inf`` (the
label of a wrong class times its log-probability) is NaN in the loss.

Cause: log of a softmax probability. Fix: use
``tf.nn.softmax_cross_entropy_with_logits`` (or ``tf.nn.log_softmax``), which
never takes the log of an underflowed probability.
"""

import numpy as np
import tensorflow as tf

import tb_numerics as tbn
from demo.stories import _common

NAME = "softmax_log"
STEPS = 30
PEAK = 20.0  # the peak learning rate of the warm-up
BATCH, FEATURES, HIDDEN, CLASSES = 128, 16, 32, 4


def data() -> tuple[np.ndarray, np.ndarray]:
    """Inputs and one-hot labels of a random linear teacher, 10% of them wrong."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(BATCH, FEATURES)).astype(np.float32)
    teacher = rng.normal(size=(FEATURES, CLASSES))
    label = np.argmax(x @ teacher, axis=1)
    noisy = rng.random(BATCH) < 0.1
    label[noisy] = rng.integers(0, CLASSES, size=noisy.sum())
    y = np.eye(CLASSES, dtype=np.float32)[label]
    return x, y


def run(logdir: str) -> None:
    writer, step = _common.start(logdir, NAME, seed=2)
    hidden = tf.keras.layers.Dense(HIDDEN, activation="relu", name="hidden")
    head = tf.keras.layers.Dense(CLASSES, name="head")
    hidden.build((None, FEATURES))
    head.build((None, HIDDEN))
    variables = hidden.trainable_variables + head.trainable_variables
    # Warm up linearly to a peak learning rate that is far too high.
    schedule = tf.keras.optimizers.schedules.CosineDecay(
        initial_learning_rate=0.5, decay_steps=1000, warmup_target=PEAK, warmup_steps=30
    )
    optimizer = tf.keras.optimizers.SGD(learning_rate=schedule)
    x, y = data()

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            h = hidden(x)
            tbn.log_numerics("hidden/output", h)
            logits = head(h)
            tbn.log_numerics("logits", logits)
            probs = tf.nn.softmax(logits)
            tbn.log_numerics("probs", probs)
            log_probs = tf.math.log(probs)
            tbn.log_numerics("log_probs", log_probs)
            loss = -tf.reduce_mean(tf.reduce_sum(y * log_probs, axis=1))
            tbn.log_numerics("loss", loss)
        grads = tape.gradient(loss, variables)
        tbn.log_gradients(grads, variables)
        optimizer.apply_gradients(zip(grads, variables))

    with writer.as_default(step=step):
        for _ in range(STEPS):
            train_step(x, y)
            step.assign_add(1)
    writer.close()
