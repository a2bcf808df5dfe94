"""Story 7: the exploding learning rate again, trained with ``model.fit``.

The same kind of failure as ``exploding_lr``, in the way most Keras users
train: a Sequential ReLU regression MLP, ``model.fit`` with an SGD learning
rate far too large, and ``tb_numerics.keras.NumericsCallback`` added to the
callbacks, with no change to the model. The callback records every layer's
output, the loss, each gradient and the global norm, the weights and each
layer's update ratio ||dw||/||w||; the report names the first layer whose
output overflows, and the update ratios show the learning rate's jumps.

The same story runs on Keras' JAX and PyTorch backends (``python -m demo
--backend jax``): its initial weights are drawn with numpy, so every backend
trains the same model and fails at the same step, in the same layer.

Cause: the learning rate. Fix: lower it, or clip gradients (``clipnorm=`` on
the optimizer).
"""

import os

import keras
import numpy as np

from tb_numerics.keras import NumericsCallback

NAME = "keras_fit"
STEPS = 24
BATCH = 64
# Far too large for this model: the first overshoot comes within a few steps.
LEARNING_RATE = 0.1


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    x = rng.normal(size=(STEPS * BATCH, 16)).astype(np.float32)
    y = (x @ rng.normal(size=(16, 1)) + 1.0).astype(np.float32)
    return x, y


def initial_weights(model: keras.Model) -> list[np.ndarray]:
    """Glorot-uniform kernels and zero biases drawn with numpy: the same
    weights on every Keras backend (each backend's own random generator
    draws other ones from the same seed), so the story fails alike there."""
    rng = np.random.default_rng(4)
    out = []
    for w in model.get_weights():
        if w.ndim == 2:
            limit = np.sqrt(6.0 / (w.shape[0] + w.shape[1]))
            out.append(rng.uniform(-limit, limit, size=w.shape).astype(np.float32))
        else:
            out.append(np.zeros_like(w))
    return out


def run(logdir: str) -> None:
    keras.utils.set_random_seed(7)
    model = keras.Sequential(
        [keras.Input((16,))]
        + [keras.layers.Dense(64, activation="relu", name="dense_%d" % i) for i in range(4)]
        + [keras.layers.Dense(1, name="head")],
        name="mlp",
    )
    model.set_weights(initial_weights(model))
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=LEARNING_RATE), loss="mse")
    x, y = data()
    model.fit(
        x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
        callbacks=[NumericsCallback(os.path.join(logdir, NAME))],
    )

