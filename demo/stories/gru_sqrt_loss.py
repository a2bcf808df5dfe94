"""Story 1: sqrt of a squared error, whose gradient is infinite at 0.

A GRU cell written by hand is unrolled over a sequence and regresses a
non-negative target through a ReLU head, with the loss
``mean(sqrt(squared_difference(pred, label)))`` (an L1 loss written the long
way) and ``clip_by_global_norm``. Many labels are exactly 0. Training pushes
those predictions down until the ReLU clips one of them to exactly 0: the
squared difference is then 0, the forward pass is still finite (sqrt(0) = 0),
but the gradient of sqrt at 0 is +Inf, and +Inf x 0 (the squared
difference's own gradient at 0) is NaN in every gradient. Clipping does not
help: the global norm of NaN gradients is NaN.

Cause: the sqrt around a squared error. Fix: drop it (``tf.abs(pred -
label)``, or plain squared error), or use ``sqrt(x + eps)``.
"""

import numpy as np
import tensorflow as tf

import tb_numerics as tbn
from demo.stories import _common

NAME = "gru_sqrt_loss"
STEPS = 30
BATCH, TIME, FEATURES, HIDDEN = 64, 8, 4, 16


class GRU(tf.Module):
    """A GRU cell, written out, unrolled over the time axis."""

    def __init__(self, features: int, hidden: int):
        super().__init__(name="gru")
        init = tf.keras.initializers.GlorotUniform()
        self.hidden = hidden
        with self.name_scope:
            self.w = tf.Variable(init((features, 3 * hidden)), name="w")
            self.u = tf.Variable(init((hidden, 3 * hidden)), name="u")
            self.b = tf.Variable(tf.zeros(3 * hidden), name="b")

    def __call__(self, x: tf.Tensor) -> tf.Tensor:
        h = tf.zeros((tf.shape(x)[0], self.hidden))
        u_zr, u_h = self.u[:, : 2 * self.hidden], self.u[:, 2 * self.hidden :]
        for t in range(x.shape[1]):
            xw = x[:, t] @ self.w + self.b
            zr = tf.sigmoid(xw[:, : 2 * self.hidden] + h @ u_zr)
            z, r = zr[:, : self.hidden], zr[:, self.hidden :]
            candidate = tf.tanh(xw[:, 2 * self.hidden :] + (r * h) @ u_h)
            h = (1 - z) * h + z * candidate
        return h


def data() -> tuple[np.ndarray, np.ndarray]:
    """Sequences and a non-negative target: half the labels are exactly 0."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(BATCH, TIME, FEATURES)).astype(np.float32)
    label = np.maximum(x[:, -3:, 0].sum(axis=1), 0).astype(np.float32)
    return x, label


def run(logdir: str) -> None:
    writer, step = _common.start(logdir, NAME, seed=1)
    gru = GRU(FEATURES, HIDDEN)
    head_w = tf.Variable(tf.keras.initializers.GlorotUniform()((HIDDEN, 1)), name="head/w")
    head_b = tf.Variable([1.0], name="head/b")  # predictions start positive
    variables = [gru.w, gru.u, gru.b, head_w, head_b]
    optimizer = tf.keras.optimizers.SGD(learning_rate=0.02)
    x, label = data()

    @tf.function
    def train_step(x, label):
        with tf.GradientTape() as tape:
            state = gru(x)
            tbn.log_numerics("gru/state", state)
            pred = tf.nn.relu(state @ head_w + head_b)[:, 0]
            tbn.log_numerics("head/pred", pred)
            squared_error = tf.math.squared_difference(pred, label)
            loss = tf.reduce_mean(tf.sqrt(squared_error))
            tbn.log_numerics("loss", loss)
        sqrt_grad, *grads = tape.gradient(loss, [squared_error] + variables)
        # d loss / d squared_error: the gradient coming out of the sqrt.
        tbn.log_numerics("loss/sqrt_grad", sqrt_grad, role="gradient")
        tbn.log_gradients(grads, variables)
        grads, _ = tf.clip_by_global_norm(grads, 1.0)
        optimizer.apply_gradients(zip(grads, variables))

    with writer.as_default(step=step):
        for _ in range(STEPS):
            train_step(x, label)
            step.assign_add(1)
    writer.close()
