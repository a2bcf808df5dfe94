"""tb-numerics: log the numerical health of training, see it in TensorBoard.

    import tb_numerics as tbn
    tbn.log_numerics("dense1/output", h)
    tbn.log_gradients(grads, model.trainable_variables)
    train_step = tbn.guard(optimizer)(train_step)  # a custom loop's first bad step, at op level
    NumericsCallback(logdir, on_anomaly=tbn.OnAnomaly("rewind", lr_factor=0.5))  # survive it, and say so

The summary API needs TensorFlow and is imported on first use, so that
TensorBoard can load the plugin (``tb_numerics.plugin``) without importing
TensorFlow.
"""

__version__ = "0.1.0"

_LAZY = {
    "log_numerics": "tb_numerics.summary",
    "log_gradients": "tb_numerics.summary",
    "op_numerics": "tb_numerics.oplevel",
    "guard": "tb_numerics.step_guard",
    "OnAnomaly": "tb_numerics.survive",
    "Spike": "tb_numerics.survive",
}

# Submodules the README and http_api.md spell as ``tb_numerics.<name>`` (tests/
# test_docs_spelling.py checks every spelling): imported on
# first access too, so ``tb_numerics.keras.NumericsCallback`` works after a
# plain ``import tb_numerics``.
_SUBMODULES = (
    "keras", "xla", "oplevel", "summary", "analysis", "records", "record_writer", "event_reader", "cli", "metadata",
    "frontend", "rules", "safe_range", "survive", "record_kernel",
)

__all__ = sorted(_LAZY) + sorted(_SUBMODULES)


def __getattr__(name):
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module("tb_numerics." + name)
    raise AttributeError("module 'tb_numerics' has no attribute %r" % name)
