"""``NumericsCallback`` on Keras' JAX and PyTorch backends, without TensorFlow.

Keras 3 picks its backend once per process (``KERAS_BACKEND``); so does
this package: ``callback_class()`` is the callback of the running backend
(``jax_callback.JaxNumericsCallback`` or
``torch_callback.TorchNumericsCallback``), and under ``KERAS_BACKEND=jax``
or ``torch`` ``tb_numerics.keras.NumericsCallback`` is that class (see
``keras_module``). The pieces every backend shares: the rows a step records
(``_plan``), writing them (``_host``), the user's source line (``_source``).
Each backend has its statistics (``jax_stats``, ``torch_stats``), its hooks
into Keras' training step and its replay of a failing step at op level
(``jax_replay``, ``torch_replay``). Nothing here imports TensorFlow.
"""

from __future__ import annotations

__all__ = ["BACKENDS", "NumericsCallback", "callback_class"]

# Keras backend -> the module and class of its callback.
BACKENDS = {
    "jax": ("tb_numerics.backends.jax_callback", "JaxNumericsCallback"),
    "torch": ("tb_numerics.backends.torch_callback", "TorchNumericsCallback"),
}


def callback_class(backend: str | None = None) -> type:
    """The ``NumericsCallback`` class of a Keras backend.

    Args:
      backend: "jax" or "torch"; None for the running one (``keras.backend.backend()``).

    Raises:
      ValueError: the backend is TensorFlow (``tb_numerics.keras`` serves it) or unknown.
    """
    import importlib

    if backend is None:
        import keras

        backend = keras.backend.backend()
    if backend not in BACKENDS:
        raise ValueError("tb_numerics.backends serves Keras' %s backends, not %r (the TensorFlow backend's "
                         "callback is tb_numerics.keras.NumericsCallback)" % (" and ".join(BACKENDS), backend))
    module, name = BACKENDS[backend]
    return getattr(importlib.import_module(module), name)


def __getattr__(name: str):
    if name == "NumericsCallback":
        return callback_class()
    raise AttributeError("module 'tb_numerics.backends' has no attribute %r" % name)
