"""Issue 28's architectures, in Keras alone, so that every backend builds the same ones.

* ``mlp``: 6 Dense layers of 1024 units with ReLU, batch 512, mse
  (``bench/overhead.py``'s model);
* ``cnn``: 4 x (Conv2D, BatchNormalization, ReLU), 32x32x3, batch 64,
  pooled, a 10-way softmax head;
* ``transformer``: token and position embeddings, 2 encoder blocks
  (MultiHeadAttention, Add, LayerNormalization, a 256-wide ReLU MLP, Add,
  LayerNormalization), seq 64, d 128, batch 32, pooled, a 10-way head;
* ``resnet50``: ``keras.applications.ResNet50(weights=None)``, 64x64x3,
  batch 16, 10 classes.

Used by ``bench/arch_cost.py`` (TensorFlow) and ``bench/keras_backends.py
--model`` (TensorFlow, JAX and PyTorch).
"""

from __future__ import annotations

import keras
import numpy as np

CLASSES = 10


class PositionEmbedding(keras.layers.Layer):
    """A learned position embedding added to the tokens' embeddings."""

    def build(self, input_shape):
        self.table = self.add_weight(shape=tuple(input_shape[1:]), initializer="random_normal", name="table")

    def call(self, x):
        return x + self.table


def _mlp() -> keras.Model:
    x = inp = keras.Input((1024,))
    for i in range(6):
        x = keras.layers.Dense(1024, activation="relu", name="dense%d" % i)(x)
    return keras.Model(inp, x, name="mlp")


def _cnn() -> keras.Model:
    x = inp = keras.Input((32, 32, 3))
    for i, filters in enumerate((16, 16, 32, 32)):
        x = keras.layers.Conv2D(filters, 3, padding="same", name="conv%d" % i)(x)
        x = keras.layers.BatchNormalization(name="bn%d" % i)(x)
        x = keras.layers.ReLU(name="relu%d" % i)(x)
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    return keras.Model(inp, keras.layers.Dense(CLASSES, name="head")(x), name="cnn")


def _transformer(seq: int = 64, d: int = 128, vocab: int = 1000) -> keras.Model:
    inp = keras.Input((seq,), dtype="int32")
    x = keras.layers.Embedding(vocab, d, name="embed")(inp)
    x = PositionEmbedding(name="position")(x)
    for b in range(2):
        a = keras.layers.MultiHeadAttention(num_heads=4, key_dim=d // 4, name="attn%d" % b)(x, x)
        x = keras.layers.LayerNormalization(name="norm%da" % b)(keras.layers.Add(name="add%da" % b)([x, a]))
        f = keras.layers.Dense(2 * d, activation="relu", name="ff%da" % b)(x)
        f = keras.layers.Dense(d, name="ff%db" % b)(f)
        x = keras.layers.LayerNormalization(name="norm%db" % b)(keras.layers.Add(name="add%db" % b)([x, f]))
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    return keras.Model(inp, keras.layers.Dense(CLASSES, name="head")(x), name="transformer")


def _resnet50() -> keras.Model:
    return keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3), classes=CLASSES,
                                       classifier_activation=None)


def data(model: str) -> tuple[np.ndarray, np.ndarray]:
    """One batch of synthetic (x, y) of the model's size."""
    rng = np.random.default_rng(0)
    if model == "mlp":
        return rng.standard_normal((512, 1024), np.float32), rng.standard_normal((512, 1024), np.float32)
    labels = rng.integers(0, CLASSES, 64).astype(np.int32)
    if model == "cnn":
        return rng.standard_normal((64, 32, 32, 3), np.float32), labels
    if model == "transformer":
        return rng.integers(0, 1000, (32, 64)).astype(np.int32), labels[:32]
    return rng.standard_normal((16, 64, 64, 3), np.float32), labels[:16]


BUILDERS = {"mlp": _mlp, "cnn": _cnn, "transformer": _transformer, "resnet50": _resnet50}


def loss(model: str) -> keras.losses.Loss:
    """Mean squared error for the MLP, a sparse softmax cross-entropy for the classifiers."""
    if model == "mlp":
        return keras.losses.MeanSquaredError()
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def build(model: str) -> keras.Model:
    """A fresh compiled model, the same initial weights on every call."""
    keras.utils.set_random_seed(0)
    m = BUILDERS[model]()
    m.compile(optimizer=keras.optimizers.SGD(learning_rate=1e-3), loss=loss(model))
    return m
