"""Healthy custom training loops that log every intermediate with ``log_numerics``.

Tensors that are mostly exact zeros by design (one-hot label products, an
attention padding mask and the attention weights it zeroes, padded
sequences, sparse bag-of-words features), under tags that do not say so,
beside ordinary ones, and one loop
under ``mixed_float16`` with a ``LossScaleOptimizer``. Every tensor's
producing function is unknown to the records unless the graph op says so
(``Relu`` inside a ``tf.function``). ``bench/healthy.py`` counts the warnings
they raise (false positives) and ``tests/test_custom_loops.py`` holds that
count at zero.
"""

from __future__ import annotations

import os
from typing import Callable

import keras
import numpy as np
import tensorflow as tf

import tb_numerics as tbn

STEPS = 60


def train_loop(logdir: str, name: str, forward: Callable, layers: list, batch, *, eager: bool = False,
               optimizer=None, steps: int = STEPS) -> None:
    """Trains ``layers`` on one batch for ``steps`` steps: ``forward(x, y)``
    returns the loss (logging what it computes); the gradients are logged.
    Under a ``LossScaleOptimizer`` the loss is scaled and the gradients
    logged unscaled, as the optimizer applies them."""
    optimizer = optimizer or keras.optimizers.Adam(1e-2)
    variables = [v for layer in layers for v in layer.trainable_variables]
    optimizer.build(variables)
    scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    writer = tf.summary.create_file_writer(os.path.join(logdir, name))
    step = tf.Variable(0, dtype=tf.int64, trainable=False)

    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = forward(x, y)
            tbn.log_numerics("loss", loss)
            target = optimizer.scale_loss(loss) if scaled else loss
        grads = tape.gradient(target, variables)
        if scaled:
            tbn.log_gradients([g / tf.cast(optimizer.dynamic_scale, g.dtype) for g in grads], variables)
        else:
            tbn.log_gradients(grads, variables)
        optimizer.apply(grads, variables)

    fn = train_step if eager else tf.function(train_step)
    with writer.as_default(step=step):
        for _ in range(steps):
            fn(*batch)
            step.assign_add(1)
    writer.close()


def _seed(seed: int) -> np.random.RandomState:
    keras.utils.set_random_seed(seed)
    return np.random.RandomState(seed)


def built(layer: keras.layers.Layer, shape: tuple) -> keras.layers.Layer:
    """``layer``, built for inputs of ``shape`` (a custom loop builds its layers before tracing)."""
    layer.build(shape)
    return layer


def onehot_products(logdir: str) -> None:
    """Cross-entropy written out: ``y * log_softmax(logits)`` is 3/4 exact zeros."""
    rs = _seed(10)
    x = rs.randn(256, 16).astype("float32")
    y = np.eye(4, dtype="float32")[np.argmax(x @ rs.randn(16, 4), 1)]
    hidden, head = built(keras.layers.Dense(32, activation="relu"), (None, 16)), built(keras.layers.Dense(4), (None, 32))

    def forward(x, y):
        h = hidden(x)
        tbn.log_numerics("hidden/output", h)
        log_p = tf.nn.log_softmax(head(h))
        tbn.log_numerics("log_probs", log_p)
        terms = y * log_p
        tbn.log_numerics("label_log_probs", terms)
        return -tf.reduce_mean(tf.reduce_sum(terms, 1))

    train_loop(logdir, "loop_onehot_products", forward, [hidden, head], (x, y))


def _padded_tokens(rs: np.random.RandomState, n: int, t: int, vocab: int) -> np.ndarray:
    tokens = rs.randint(1, vocab, size=(n, t))
    for row in tokens:
        row[rs.randint(2, t // 2):] = 0  # padding: more than half of most rows
    return tokens


def attention_mask(logdir: str) -> None:
    """Self-attention over padded tokens: the padding mask, the additive mask
    on the scores and the attention weights it zeroes."""
    rs = _seed(11)
    tokens = _padded_tokens(rs, 128, 12, 40)
    y = (tokens[:, 0] > 20).astype("int32")
    embed = built(keras.layers.Embedding(40, 16), (None, 12))
    qkv = built(keras.layers.Dense(48), (None, 12, 16))
    head = built(keras.layers.Dense(2), (None, 16))

    def forward(tok, y):
        mask = tf.cast(tok > 0, tf.float32)
        tbn.log_numerics("tokens/keep", mask)
        q, k, v = tf.split(qkv(embed(tok)), 3, axis=-1)
        scores = tf.matmul(q, k, transpose_b=True) / 4.0 + (1.0 - mask[:, None, :]) * -1e9
        tbn.log_numerics("self_attn/scores", scores)
        weights = tf.nn.softmax(scores)
        tbn.log_numerics("self_attn/probs", weights)
        context = tf.matmul(weights, v) * mask[:, :, None]
        tbn.log_numerics("self_attn/context", context)
        pooled = tf.reduce_sum(context, 1) / tf.reduce_sum(mask, 1, keepdims=True)
        logits = head(pooled)
        tbn.log_numerics("logits", logits)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    train_loop(logdir, "loop_attention_mask", forward, [embed, qkv, head], (tokens, y))


def padded_sequences(logdir: str) -> None:
    """A masked mean-pooled encoder of zero-padded sequences, eagerly."""
    rs = _seed(12)
    lengths = rs.randint(2, 5, size=128)
    x = rs.randn(128, 12, 4).astype("float32") * (np.arange(12)[None, :, None] < lengths[:, None, None])
    y = x.sum((1, 2))[:, None].astype("float32") / lengths[:, None]
    step_fn, head = built(keras.layers.Dense(16, activation="relu"), (None, 12, 4)), built(keras.layers.Dense(1), (None, 16))
    mask = (np.arange(12)[None, :] < lengths[:, None]).astype("float32")[:, :, None]

    def forward(x, y):
        tbn.log_numerics("inputs/sequences", x)
        feats = step_fn(x) * mask
        tbn.log_numerics("encoder/step_features", feats)
        pred = head(tf.reduce_sum(feats, 1) / mask.sum(1))
        tbn.log_numerics("prediction", pred)
        return tf.reduce_mean(tf.square(pred - y))

    train_loop(logdir, "loop_padded_sequences", forward, [step_fn, head], (x, y), eager=True, steps=40)


def sparse_features(logdir: str) -> None:
    """Logistic regression on bag-of-words counts, 97% exact zeros."""
    rs = _seed(13)
    x = (rs.rand(256, 200) < 0.03).astype("float32") * rs.randint(1, 4, size=(256, 200))
    y = (x[:, :100].sum(1) > x[:, 100:].sum(1)).astype("float32")[:, None]
    hidden, head = built(keras.layers.Dense(16, activation="relu"), (None, 200)), built(keras.layers.Dense(1), (None, 16))

    def forward(x, y):
        tbn.log_numerics("features", x)
        h = hidden(x)
        tbn.log_numerics("hidden/output", h)
        logits = head(h)
        tbn.log_numerics("logits", logits)
        return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(y, logits))

    train_loop(logdir, "loop_sparse_features", forward, [hidden, head], (x, y))


def mixed_float16(logdir: str) -> None:
    """float16 compute, float32 variables, a LossScaleOptimizer; one-hot
    label products in float32."""
    rs = _seed(14)
    x = rs.randn(256, 16).astype("float32")
    y = np.eye(4, dtype="float32")[np.argmax(x @ rs.randn(16, 4), 1)]
    hidden = built(keras.layers.Dense(32, activation="relu", dtype="mixed_float16"), (None, 16))
    head = built(keras.layers.Dense(4, dtype="mixed_float16"), (None, 32))

    def forward(x, y):
        h = hidden(x)
        tbn.log_numerics("hidden/output", h)
        logits = head(h)
        tbn.log_numerics("logits", logits)
        terms = y * tf.nn.log_softmax(tf.cast(logits, tf.float32))
        tbn.log_numerics("label_log_probs", terms)
        return -tf.reduce_mean(tf.reduce_sum(terms, 1))

    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-2))
    train_loop(logdir, "loop_mixed_float16", forward, [hidden, head], (x, y), optimizer=optimizer)


CASES: tuple[tuple[str, Callable[[str], None]], ...] = (
    ("loop_onehot_products", onehot_products),
    ("loop_attention_mask", attention_mask),
    ("loop_padded_sequences", padded_sequences),
    ("loop_sparse_features", sparse_features),
    ("loop_mixed_float16", mixed_float16),
)
