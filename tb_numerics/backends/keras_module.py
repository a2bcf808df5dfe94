"""``tb_numerics.keras`` under ``KERAS_BACKEND=jax`` or ``torch``: the callback, without TensorFlow.

    from tb_numerics.keras import NumericsCallback
    model.fit(x, y, callbacks=[NumericsCallback("logs/run1")])

The same options and records as on TensorFlow (see the TensorFlow module's
``NumericsCallback``); what each backend cannot do is in the README.
``tb_numerics`` loads this file as ``tb_numerics.keras`` where Keras' backend
is not TensorFlow (``tb_numerics/__init__.py``), so that the TensorFlow
module, which imports TensorFlow, is never imported there.
"""

from tb_numerics.backends import callback_class

__all__ = ["NumericsCallback"]

NumericsCallback = callback_class()
