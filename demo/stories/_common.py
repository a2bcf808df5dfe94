"""What every story shares: seeding and the writer of its run."""

import os

import tensorflow as tf


def start(logdir: str, name: str, seed: int) -> tuple[tf.summary.SummaryWriter, tf.Variable]:
    """Seeds everything and returns the run's writer and its step counter.

    The writer is made the default with the step counter as its step before
    the training step is traced: a ``tf.function`` captures both when it is
    traced (see TRAPS.md), and reading the step from a variable keeps one
    trace for the whole run.
    """
    tf.keras.utils.set_random_seed(seed)
    tf.config.experimental.enable_op_determinism()
    step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
    writer = tf.summary.create_file_writer(os.path.join(logdir, name))
    return writer, step
