"""Small buggy Keras trainings, of the kinds in the fault-localisation literature.

Each case is a real ``model.fit`` with ``NumericsCallback`` and no change to
the model; its ``truth`` is the word a right hint must contain. The hint
suite (``python -m demo.hint_suite``) scores the analysis' hints on them
beside the demo's stories; ``healthy_*`` cases must raise nothing at all.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

import keras
import numpy as np
import tensorflow as tf

from tb_numerics.keras import NumericsCallback


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    run: Callable[[str], None]  # run(logdir) trains and writes <logdir>/<name>
    truth: str | None  # a word the right hint holds; None: a healthy run


def _classes(n: int = 256, d: int = 8, k: int = 4, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rs = np.random.RandomState(seed)
    x = rs.randn(n, d).astype("float32")
    return x, keras.utils.to_categorical(rs.randint(0, k, n), k).astype("float32")


def _regression(n: int = 256, d: int = 8, seed: int = 0, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    rs = np.random.RandomState(seed)
    x = rs.randn(n, d).astype("float32")
    return x, (x @ rs.randn(d, 1) * scale).astype("float32")


def _fit(model: keras.Model, data, logdir: str, name: str, epochs: int, loss, lr: float, batch: int = 32) -> None:
    model.compile(optimizer=keras.optimizers.SGD(lr), loss=loss)
    x, y = data
    model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0,
              callbacks=[NumericsCallback(os.path.join(logdir, name))])


def relu_output_cce(logdir: str) -> None:
    """A ReLU output layer under categorical cross-entropy: rows of exact zeros, 0/0 in the loss."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(4, activation="relu", name="out")])
    _fit(model, _classes(), logdir, "relu_output_cce", 10, "categorical_crossentropy", 0.5)


def exponential_activation(logdir: str) -> None:
    """Dense(activation="exponential") on unnormalised inputs: exp overflows."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(16, activation="exponential", name="expo"), keras.layers.Dense(1)])
    x, y = _regression(scale=10.0)
    _fit(model, (x * 3, y), logdir, "exponential_activation", 10, "mse", 0.05)


def sgd_divergence(logdir: str) -> None:
    """MSE with plain SGD at learning rate 3: loss and gradients grow ~1e8x a step."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(1)])
    _fit(model, _regression(), logdir, "sgd_divergence", 5, "mse", 3.0)


class LogOfRelu(keras.layers.Layer):
    """A custom layer taking the log of a ReLU: -Inf where a unit is exactly 0."""

    def call(self, x):
        return tf.math.log(tf.nn.relu(x))


def custom_log_layer(logdir: str) -> None:
    """A custom layer's log of a ReLU output that reaches exact 0."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), LogOfRelu(name="feature"),
                              keras.layers.Dense(1)])
    _fit(model, _regression(), logdir, "custom_log_layer", 2, "mse", 0.01)


def healthy_mlp(logdir: str) -> None:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(4, activation="softmax")])
    _fit(model, _classes(), logdir, "healthy_mlp", 5, "categorical_crossentropy", 0.05)


CASES = (
    Case("relu_output_cce", relu_output_cce, "use a softmax"),
    Case("exponential_activation", exponential_activation, "exp overflows"),
    Case("sgd_divergence", sgd_divergence, "learning rate"),
    Case("custom_log_layer", custom_log_layer, "log(0)"),
    Case("healthy_mlp", healthy_mlp, None),
)
