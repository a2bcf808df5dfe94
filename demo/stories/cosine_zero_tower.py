"""Story 4: cosine similarity of an embedding that is all zeros.

Two ReLU towers embed the two sides of a pair, and a hand-written cosine
similarity ``dot(a, b) / (norm(a) * norm(b))`` scores it. Training pushes
the dissimilar pairs towards a cosine of 0; with non-negative (ReLU)
embeddings the easy way there is to switch units off, until every unit of
one tower is off for some input: its embedding is all zeros, ``norm`` is 0,
and the cosine is 0/0 = NaN in the forward pass (and the gradient of the
norm's sqrt at 0 is infinite in the backward pass).

Cause: a norm that can be 0 in a denominator. Fix: add an epsilon inside
the norm (``tf.math.l2_normalize`` does), e.g. ``sqrt(sum(a * a) + 1e-12)``.
"""

import numpy as np
import tensorflow as tf

import tb_numerics as tbn
from demo.stories import _common

NAME = "cosine_zero_tower"
STEPS = 30
BATCH, FEATURES, HIDDEN, EMBED = 64, 8, 16, 8


def tower(name: str) -> tf.keras.Sequential:
    model = tf.keras.Sequential(
        [
            tf.keras.layers.Dense(HIDDEN, activation="relu", name="hidden"),
            tf.keras.layers.Dense(
                EMBED, activation="relu", bias_initializer=tf.keras.initializers.Constant(0.1),
                name="embedding",
            ),
        ],
        name=name,
    )
    model.build((None, FEATURES))
    return model


def data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pairs and a 0/1 label: 1 where the two sides are close."""
    rng = np.random.default_rng(4)
    a = rng.normal(size=(BATCH, FEATURES)).astype(np.float32)
    similar = rng.random(BATCH) < 0.5
    noise = rng.normal(size=(BATCH, FEATURES)).astype(np.float32)
    b = np.where(similar[:, None], a + 0.3 * noise, noise)
    return a, b, similar.astype(np.float32)


def run(logdir: str) -> None:
    writer, step = _common.start(logdir, NAME, seed=4)
    tower_a, tower_b = tower("tower_a"), tower("tower_b")
    variables = tower_a.trainable_variables + tower_b.trainable_variables
    optimizer = tf.keras.optimizers.SGD(learning_rate=0.5)
    xa, xb, label = data()

    @tf.function
    def train_step(xa, xb, label):
        with tf.GradientTape() as tape:
            a = tower_a(xa)
            tbn.log_numerics("tower_a/embedding", a)
            b = tower_b(xb)
            tbn.log_numerics("tower_b/embedding", b)
            dot = tf.reduce_sum(a * b, axis=1)
            norm_a = tf.sqrt(tf.reduce_sum(a * a, axis=1))
            norm_b = tf.sqrt(tf.reduce_sum(b * b, axis=1))
            tbn.log_numerics("cosine/norm_a", norm_a)
            tbn.log_numerics("cosine/norm_b", norm_b)
            cosine = dot / (norm_a * norm_b)
            tbn.log_numerics("cosine/similarity", cosine)
            loss = tf.reduce_mean(tf.math.squared_difference(cosine, label))
            tbn.log_numerics("loss", loss)
        grads = tape.gradient(loss, variables)
        tbn.log_gradients(grads, variables)
        optimizer.apply_gradients(zip(grads, variables))

    with writer.as_default(step=step):
        for _ in range(STEPS):
            train_step(xa, xb, label)
            step.assign_add(1)
    writer.close()
