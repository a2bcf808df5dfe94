"""Small programs of the kind TensorFlow's own ``check_numerics_callback_test``
runs, each with one step that makes a NaN or an Inf.

``PROGRAMS`` maps a name to ``(make, how)``: ``make()`` builds the program
(models, functions, datasets, traced where the program traces them) and
returns the step, a callable of no arguments; ``how`` says how tb-numerics
records it: ``"block"`` (an eager step inside ``with recorder:``) or
``"replay"`` (``oplevel.replay_step(step.fn, *step.args)``, the path for
compiled steps and for functions called with numpy arguments). The line of each program where
the first bad op is made ends with ``# BAD``; ``check_numerics_oracle.py``
runs every program under ``tf.debugging.enable_check_numerics`` for the
truth. Kept free of tb-numerics so the oracle's process never loads it.
"""

from __future__ import annotations

from typing import Callable

import keras
import numpy as np
import tensorflow as tf

Step = Callable[[], object]


class _Call:
    """A step that is one call of ``fn``: ``replay_step(step.fn, *step.args)``."""

    def __init__(self, fn: Callable[..., object], *args: object):
        self.fn, self.args = fn, args

    def __call__(self) -> object:
        return self.fn(*self.args)


def eager_ops() -> Step:
    def step():
        x = tf.constant([1.0, -2.0, 3.0])
        y = x * 2.0
        return tf.math.sqrt(y)  # BAD
    return step


def eager_loop() -> Step:
    """FloorMod's tag is made first, but Mul goes bad first (iteration 2)."""
    def step():
        s = tf.constant([1e30])
        for d in (2.0, 2.0, 0.0):
            r = tf.math.floormod(tf.constant([5.0]), tf.constant([d]))
            s = s * 1e6  # BAD
        return r, s
    return step


def nested_functions() -> Step:
    @tf.function
    def inner(x):
        return tf.math.log(x - 2.0)  # BAD

    @tf.function
    def outer(x):
        return inner(x * 1.0) + 1.0

    def step():
        return outer(tf.constant([1.0, 3.0]))
    return step


def while_loop() -> Step:
    """1,000 iterations; the running product overflows at iteration 350 or so."""
    @tf.function
    def grow(x):
        def body(i, v):
            return i + 1, v * 1.3  # BAD
        return tf.while_loop(lambda i, v: i < 1000, body, (tf.constant(0), x))[1]

    def step():
        return grow(tf.constant([1.0, 2.0]))
    return step


def data_map() -> Step:
    ds = tf.data.Dataset.from_tensor_slices(np.array([[1.0, 2.0], [3.0, -4.0]], np.float32))
    ds = ds.map(lambda v: tf.math.log(v) * 1.0)  # BAD

    def step():
        return [v * 2.0 for v in ds]
    return step


def data_pipeline() -> Step:
    """A pipeline around a map (a filter, batch, prefetch), the map reading a
    variable whose value changes after the dataset is built."""
    scale = tf.Variable(1.0)
    ds = tf.data.Dataset.range(8).map(lambda i: tf.cast(i, tf.float32) - 3.0).filter(lambda x: x < 3.5)
    ds = ds.map(lambda x: tf.math.sqrt(x * scale) + 1.0)  # BAD
    ds = ds.batch(2).prefetch(2)
    scale.assign(-1.0)  # sqrt(-x): NaN from x = 1, in the third batch

    def step():
        return [b * 2.0 for b in ds]
    step.dataset = ds
    return step


def data_zip() -> Step:
    """A map over a zip of a map: both functions were traced when the
    dataset was built, the one below makes the NaN, the one above carries it."""
    ds = tf.data.Dataset.from_tensor_slices(np.array([[1.0, 2.0], [3.0, -4.0]], np.float32))
    ds = tf.data.Dataset.zip((ds.map(lambda v: tf.math.log(v)), ds))  # BAD
    ds = ds.map(lambda a, b: a + b)

    def step():
        return [v * 2.0 for v in ds]
    return step


def _loop_over_a_map() -> tf.types.experimental.GenericFunction:
    """A tf.function whose for loop runs over a pipeline built before it (its
    graph captures the dataset)."""
    ds = tf.data.Dataset.from_tensor_slices(np.array([[2.0, 1.0], [-1.0, 3.0]], np.float32))
    ds = ds.map(lambda v: tf.math.log(v) + 1.0)  # BAD

    @tf.function
    def loop():
        total = tf.zeros([2])
        for v in ds:
            total += v * 2.0
        return total

    return loop


def data_in_function() -> Step:
    """A tf.function step over a pipeline, traced before the block."""
    step = _loop_over_a_map()
    step.get_concrete_function()  # traced here, before any recorder block
    return step


def data_map_replayed() -> Step:
    """A tf.function step that iterates a pipeline, replayed (run eagerly: the
    pipeline's functions are still traced, as tf.data always does)."""
    return _Call(_loop_over_a_map())


def nan_constant() -> Step:
    def step():
        x = tf.constant([1.0, 2.0])
        c = tf.constant([np.nan, 0.0], tf.float32)
        return x + c  # BAD
    return step


class LogLayer(keras.layers.Layer):
    """A custom layer whose ``call`` is a tf.function, traced when the model is built."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1],), initializer="ones")

    @tf.function
    def call(self, x):
        return tf.math.log(x * self.w)  # BAD


def custom_layer() -> Step:
    model = keras.Sequential([keras.Input((3,)), LogLayer(), keras.layers.Dense(1)])
    model(np.ones((1, 3), np.float32))  # traced here, before any recorder block

    def step():
        return model(np.array([[1.0, 0.0, 2.0]], np.float32))
    return step


def numpy_arguments() -> Step:
    @tf.function
    def f(x, y):
        return x / y  # BAD

    return _Call(f, np.array([1.0, 2.0], np.float32), np.array([1.0, 0.0], np.float32))


def xla() -> Step:
    @tf.function(jit_compile=True)
    def f(x):
        h = x * 3.0
        return tf.math.rsqrt(h)  # BAD

    return _Call(f, tf.constant([1.0, 0.0]))


PROGRAMS: dict[str, tuple[Callable[[], Step], str]] = {
    "eager_ops": (eager_ops, "block"),
    "eager_loop": (eager_loop, "block"),
    "nested_functions": (nested_functions, "block"),
    "while_loop": (while_loop, "block"),
    "data_map": (data_map, "block"),
    "data_pipeline": (data_pipeline, "block"),
    "data_zip": (data_zip, "block"),
    "data_in_function": (data_in_function, "block"),
    "data_map_replayed": (data_map_replayed, "replay"),
    "nan_constant": (nan_constant, "block"),
    "custom_layer": (custom_layer, "block"),
    "numpy_arguments": (numpy_arguments, "replay"),
    "xla": (xla, "replay"),
}
