"""The demo's failure stories: small, seeded TF2 training runs.

Each story trains for a few seconds on a CPU, logs the tensors a user would
name with ``tb_numerics.log_numerics`` and the gradients with
``tb_numerics.log_gradients``, and writes one run, ``<logdir>/<name>``.
Stories that use the Keras callback or the op-level mode go in ``STORIES``
too, next to the hand-written loops they mirror.
"""

import dataclasses
import importlib
import os
import shutil
import time
from typing import Callable


def _lazy(module: str, function: str = "run") -> Callable[[str], None]:
    """``demo.stories.<module>.<function>``, imported when called: most
    stories import TensorFlow, which a run on JAX or PyTorch must not need."""

    def run(logdir: str) -> None:
        getattr(importlib.import_module("demo.stories." + module), function)(logdir)

    run.__qualname__ = "%s.%s" % (module, function)
    return run


@dataclasses.dataclass(frozen=True)
class Story:
    name: str  # the run's directory under the logdir
    run: Callable[[str], None]  # run(logdir) trains and writes <logdir>/<name>
    cause: str  # what went wrong, as built (the README's table)
    fix: str
    truth: str | None = None  # a word a right hint holds (scored by demo.hint_suite)
    # The Keras backends it runs on (``python -m demo --backend``): a story
    # written with tf.* runs on TensorFlow only.
    backends: tuple[str, ...] = ("tensorflow",)


STORIES = (
    Story(
        "gru_sqrt_loss",
        _lazy("gru_sqrt_loss"),
        cause="sqrt of a squared error: its gradient is infinite where the error is exactly 0",
        fix="drop the sqrt around the squared error (use tf.abs or the squared error itself)",
        truth="gradient of sqrt",
    ),
    Story(
        "softmax_log",
        _lazy("softmax_log"),
        cause="log of a softmax that saturated to exactly 0 at a too-high learning rate",
        fix="use tf.nn.softmax_cross_entropy_with_logits (or log_softmax), and a lower peak learning rate",
        truth="log(0)",
    ),
    Story(
        "repeated_bn_fp16",
        _lazy("repeated_bn_fp16"),
        cause="an MAE written without abs rewards ever larger outputs, and BatchNorm called without "
        "training=True does not normalise: 8 passes compound the growth until float16 overflows",
        fix="tf.abs in the loss (or keras.losses.MeanAbsoluteError), and call the model with training=True",
        truth="grew",
    ),
    Story(
        "cosine_zero_tower",
        _lazy("cosine_zero_tower"),
        cause="cosine similarity of an all-zero ReLU embedding: norm 0, 0/0",
        fix="add an epsilon inside the norm (or use tf.math.l2_normalize)",
        truth="Division by zero",
    ),
    Story(
        "exploding_lr",
        _lazy("regression", "run_exploding_lr"),
        cause="learning rate too large: each step overshoots more, the gradient norm spikes, activations overflow",
        fix="lower the learning rate (or clip gradients)",
        truth="learning rate",
    ),
    Story(
        "keras_fit",
        _lazy("keras_fit"),
        cause="the same too-large learning rate, trained with model.fit and NumericsCallback: "
        "the gradient norm spikes, then a layer overflows",
        fix="lower the learning rate, or clip gradients (clipnorm= on the optimizer)",
        truth="learning rate",
        backends=("tensorflow", "jax", "torch"),
    ),
    Story(
        "healthy",
        _lazy("regression", "run_healthy"),
        cause="none: the same model at a sane learning rate",
        fix="nothing to fix",
    ),
    Story(
        "bad_input",
        _lazy("regression", "run_bad_input"),
        cause="one corrupt record holds 1e38: finite, but its squared error overflows in the loss",
        fix="validate or clip inputs in the input pipeline",
        truth="far out of range in input",
    ),
)


def run_story(name: str, logdir: str) -> float:
    """Runs story ``name`` afresh into ``logdir``; returns its seconds.

    A run's directory belongs to the demo: it is removed first, so a rerun
    does not add a second copy of every step. A module-level function, so
    the runner can call it in worker processes.
    """
    story = next(s for s in STORIES if s.name == name)
    shutil.rmtree(os.path.join(logdir, story.name), ignore_errors=True)
    start = time.perf_counter()
    story.run(logdir)
    return time.perf_counter() - start
