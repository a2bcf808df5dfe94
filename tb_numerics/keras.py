"""A Keras 3 callback that logs the numerics of ``model.fit``, on Keras' TensorFlow, JAX and PyTorch backends.

    from tb_numerics.keras import NumericsCallback
    model.fit(x, y, callbacks=[NumericsCallback("logs/run1")])

``NumericsCallback`` is the callback of the backend Keras runs on
(``keras.backend.backend()``, set by ``KERAS_BACKEND``), chosen here before
anything imports that backend: on JAX and PyTorch nothing imports
TensorFlow. Its options and records are the same on every backend
(``_keras_host.NumericsCallbackBase``); each backend's class says what it
adds or cannot do (``tb_numerics.backends``).
"""

import keras

from tb_numerics.backends import callback_class

__all__ = ["NumericsCallback"]

NumericsCallback = callback_class(keras.backend.backend())
