"""Ordinary healthy Keras trainings: the early warnings must stay quiet on them.

Each is a real ``model.fit`` with ``NumericsCallback`` and the defaults, of a
kind people train every day; ``bench/healthy.py`` counts the warnings they
raise (the false positives) and ``tests/test_detectors.py`` holds that count
at zero.
"""

from __future__ import annotations

import os
from typing import Callable

import keras
import numpy as np

from tb_numerics.keras import NumericsCallback


def _fit(model: keras.Model, x, y, logdir: str, name: str, loss, epochs: int = 3, optimizer=None) -> None:
    model.compile(optimizer=optimizer or keras.optimizers.Adam(1e-3), loss=loss)
    model.fit(x, y, batch_size=32, epochs=epochs, verbose=0, callbacks=[NumericsCallback(os.path.join(logdir, name))])


def _rs(seed: int = 0) -> np.random.RandomState:
    keras.utils.set_random_seed(seed)
    return np.random.RandomState(seed)


def mlp(logdir: str) -> None:
    rs = _rs()
    x = rs.randn(512, 20).astype("float32")
    y = keras.utils.to_categorical((x[:, :3].sum(1) > 0).astype(int) + (x[:, 3] > 1), 3)
    model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(64, activation="relu"), keras.layers.Dense(3, activation="softmax")])
    _fit(model, x, y, logdir, "mlp", "categorical_crossentropy")


def cnn(logdir: str) -> None:
    rs = _rs(1)
    x = rs.rand(256, 12, 12, 1).astype("float32")
    y = keras.utils.to_categorical((x[:, :6].mean((1, 2, 3)) > x[:, 6:].mean((1, 2, 3))).astype(int), 2)
    model = keras.Sequential([keras.Input((12, 12, 1)), keras.layers.Conv2D(8, 3, activation="relu"),
                              keras.layers.MaxPooling2D(), keras.layers.Conv2D(16, 3, activation="relu"),
                              keras.layers.Flatten(), keras.layers.Dense(2, activation="softmax")])
    _fit(model, x, y, logdir, "cnn", "categorical_crossentropy")


def rnn(logdir: str) -> None:
    rs = _rs(2)
    x = rs.randn(256, 10, 4).astype("float32")
    y = x[:, :, 0].sum(1, keepdims=True).astype("float32")
    model = keras.Sequential([keras.Input((10, 4)), keras.layers.GRU(16), keras.layers.Dense(1)])
    _fit(model, x, y, logdir, "rnn", "mse")


def autoencoder(logdir: str) -> None:
    rs = _rs(3)
    x = (rs.randn(512, 4) @ rs.randn(4, 32)).astype("float32")
    model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(4), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(32)])
    _fit(model, x, x, logdir, "autoencoder", "mse")


def batchnorm(logdir: str) -> None:
    rs = _rs(4)
    x = (rs.randn(512, 16) * 5 + 3).astype("float32")
    y = (x @ rs.randn(16, 1)).astype("float32")
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32), keras.layers.BatchNormalization(),
                              keras.layers.Activation("relu"), keras.layers.Dense(32), keras.layers.BatchNormalization(),
                              keras.layers.Activation("relu"), keras.layers.Dense(1)])
    _fit(model, x, y, logdir, "batchnorm", "mse")


def masked_attention_fp16(logdir: str) -> None:
    """Embeddings with mask_zero and self-attention under mixed_float16:
    padding masks, a LossScaleOptimizer calibrating its scale."""
    rs = _rs(5)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        tokens = rs.randint(1, 50, size=(256, 12))
        for row in tokens:
            row[rs.randint(4, 12):] = 0  # padding
        y = keras.utils.to_categorical((tokens[:, 0] > 25).astype(int), 2)
        inp = keras.Input((12,), dtype="int32")
        h = keras.layers.Embedding(50, 16, mask_zero=True)(inp)
        h = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)(h, h)
        h = keras.layers.GlobalAveragePooling1D()(h)
        out = keras.layers.Dense(2, activation="softmax", dtype="float32")(h)
        _fit(keras.Model(inp, out), tokens, y, logdir, "masked_attention_fp16", "categorical_crossentropy")
    finally:
        keras.mixed_precision.set_global_policy("float32")


CASES: tuple[tuple[str, Callable[[str], None]], ...] = (
    ("mlp", mlp),
    ("cnn", cnn),
    ("rnn", rnn),
    ("autoencoder", autoencoder),
    ("batchnorm", batchnorm),
    ("masked_attention_fp16", masked_attention_fp16),
)
