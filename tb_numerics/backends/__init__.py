"""``NumericsCallback`` on each Keras backend: TensorFlow, JAX and PyTorch.

Keras 3 picks its backend once per process (``KERAS_BACKEND``); so does
``tb_numerics.keras``: its ``NumericsCallback`` is ``callback_class()``, the
class of the running backend, and only that backend's module is imported
(on JAX and PyTorch, nothing imports TensorFlow).

Every backend shares the rows a step records (``_keras_plan``), the batch's
rows (``_keras_batch``) and the whole host side: options, writing, the
every-N latch, the stop (``_keras_host``). Each backend has its hooks into
Keras' training step, its statistics inside the step and its replay of a
failing step at op level: ``tensorflow_callback`` (composing the
``_keras_*`` modules, ``stats`` and ``_keras_replay``), ``jax_callback``
(``jax_stats``, ``jax_replay``), ``torch_callback`` (``torch_stats``,
``torch_replay``); ``_replay_common`` and ``_source`` serve the JAX and
PyTorch replays (and the verdict's words on a non-finite batch, TensorFlow's too).
"""

from __future__ import annotations

import importlib

__all__ = ["BACKENDS", "callback_class"]

# Keras backend -> the module and class of its callback.
BACKENDS = {
    "tensorflow": ("tb_numerics.backends.tensorflow_callback", "TensorFlowNumericsCallback"),
    "jax": ("tb_numerics.backends.jax_callback", "JaxNumericsCallback"),
    "torch": ("tb_numerics.backends.torch_callback", "TorchNumericsCallback"),
}


def callback_class(backend: str | None = None) -> type:
    """The ``NumericsCallback`` class of a Keras backend; its module is imported now.

    Args:
      backend: "tensorflow", "jax" or "torch"; None for the running one
        (``keras.backend.backend()``).

    Raises:
      ValueError: a backend this package does not serve (naming those it does).
    """
    if backend is None:
        import keras

        backend = keras.backend.backend()
    if backend not in BACKENDS:
        raise ValueError("tb_numerics.keras.NumericsCallback serves Keras' %s backends, not %r"
                         % (", ".join(BACKENDS), backend))
    module, name = BACKENDS[backend]
    return getattr(importlib.import_module(module), name)
