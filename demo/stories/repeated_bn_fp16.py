"""Story 3: a block with BatchNormalization applied 8 times to its own output, in float16.

A small regression MLP refines its hidden state by applying one weight-tied
block, ``Dense -> BatchNormalization -> ReLU``, eight times to its own
output, under the ``mixed_float16`` policy (float16 compute, float32
variables), trained with plain Adam in a hand-written loop. Two bugs that
users hit meet here:

* the mean absolute error is written ``mean(y - pred)``, without ``abs``:
  minimising it rewards ever larger predictions, so Adam keeps growing the
  block's weights and BN's gamma;
* the loop calls the block without ``training=True``, so BatchNormalization
  runs in inference mode with its initial moving statistics (mean 0,
  variance 1): it does not normalise, and each pass multiplies the values by
  the block's gain, eight times per step.

So the values grow by about 1.6x per step (the head's output: 0.11 at
step 0, 116 at step 9, 1.3e3 at step 14), visibly: the global gradient
norm spikes past 10x its running median at step 7, and the head's output
passes float16's safe range (1/64 of its maximum) at step 14, until at
step 23 it passes the float16 maximum 65504: +Inf, and the loss is -Inf. With ``training=True`` the passes stay
bounded (~4) and the head grows slowly; in float32 the same growth would
only overflow much later.

Cause: a loss that rewards growth, compounded by 8 passes that BN does not
normalise. Fix: ``tf.abs`` in the MAE (or ``keras.losses.MeanAbsoluteError``)
and call the model with ``training=True``.
"""

import numpy as np
import tensorflow as tf

import tb_numerics as tbn
from demo.stories import _common

NAME = "repeated_bn_fp16"
STEPS = 25
EXAMPLES, BATCH, FEATURES, WIDTH, PASSES = 256, 32, 8, 16, 8
POLICY = "mixed_float16"
LOG_EVERY = 2  # log every other pass: each logged tensor costs ~0.4 s of tracing


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(EXAMPLES, FEATURES)).astype(np.float32)
    y = np.sin(x[:, :4]).sum(axis=1, keepdims=True).astype(np.float32)
    return x, y


def build() -> tuple[list[tf.keras.layers.Layer], list[tf.Variable]]:
    """embed, the repeated block (Dense, BN) and the head, built."""
    embed = tf.keras.layers.Dense(WIDTH, activation="relu", dtype=POLICY, name="embed")
    # No bias before BN (BN's beta is the bias), as usual.
    block = tf.keras.layers.Dense(WIDTH, use_bias=False, dtype=POLICY, name="block")
    bn = tf.keras.layers.BatchNormalization(dtype=POLICY, name="block_bn")
    head = tf.keras.layers.Dense(1, dtype=POLICY, name="head")
    embed.build((None, FEATURES))
    for layer in (block, bn, head):
        layer.build((None, WIDTH))
    layers = [embed, block, bn, head]
    return layers, [v for layer in layers for v in layer.trainable_variables]


def forward(layers, x, log=tbn.log_numerics):
    """The model; ``log(name, tensor)`` sees each tensor the story logs."""
    embed, block, bn, head = layers
    h = embed(x)
    log("embed/output", h)
    for k in range(PASSES):
        # The bug: no training=True, so BN uses its moving statistics.
        h = tf.nn.relu(bn(block(h)))
        if (k + 1) % LOG_EVERY == 0:
            log("block/pass_%d" % (k + 1), h)
    pred = head(h)
    log("head/output", pred)
    return pred


def loss_fn(y, pred):
    # The bug: a mean absolute error without the abs.
    return tf.reduce_mean(y - tf.cast(pred, tf.float32))


def run(logdir: str) -> None:
    writer, step = _common.start(logdir, NAME, seed=3)
    layers, variables = build()
    optimizer = tf.keras.optimizers.Adam(learning_rate=0.01)
    x, y = data()

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, forward(layers, x))
            tbn.log_numerics("loss", loss)
        grads = tape.gradient(loss, variables)
        tbn.log_gradients(grads, variables)
        optimizer.apply_gradients(zip(grads, variables))

    with writer.as_default(step=step):
        for i in range(STEPS):
            batch = slice((i * BATCH) % EXAMPLES, (i * BATCH) % EXAMPLES + BATCH)
            train_step(x[batch], y[batch])
            step.assign_add(1)
    writer.close()
