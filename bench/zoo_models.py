"""The zoo's trainings: eight small architectures, each with its injectable faults.

This module is the *user's code* of ``bench/zoo.py``: the oracle names a
bad op's source line as the innermost frame of this file, and tb-numerics
is expected to name the same line. A fault is a parameter of the data, the
model, the loss or the optimizer builder (``fault=None`` is the fixed
variant: the same code with the parameter off). What triggers a fault
(a blank batch, a batch with no labelled sample, an outlier) is in the
data of both variants, so only the code differs.

``train(arch, fault, fixed, hook)`` trains ``STEPS`` steps; ``hook`` is the
runner's: its ``fit(model, data)`` trains the Keras architectures (with
``model.fit``), and for the hand-written loop its ``guarded(step,
optimizer)`` wraps the step (the product's side: ``tbn.guard``) and
``stepped(loss)`` takes each step's loss (see ``bench/zoo.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf

__all__ = ["ARCHS", "FAULTS", "STEPS", "TRIGGER_STEP", "Arch", "train"]

STEPS = 40  # training steps of every cell
BATCH = 16
TRIGGER_STEP = 12  # the batch that holds a fault's trigger (blank, unlabelled, outlier)
NCLS = 4
TEMPERATURE = 0.02  # classifier logits are divided by it, as in contrastive / cosine heads
DECAY_GROWTH = 0.3  # reward: the flipped weight decay's push a step (with momentum), a share of the weights
SEED = 0

# Every fault kind, with what it is.
FAULTS = {
    "lr100": "learning rate x100",
    "unscaled": "unscaled inputs (raw units, x1000)",
    "nan_batch": "a NaN in one input batch",
    "no_eps": "the epsilon removed from a norm / std / log",
    "fp16": "float16 without loss scaling (and without float32 master weights)",
    "log_softmax": "log of a saturated softmax (or sigmoid)",
    "div_stat": "division by a batch statistic (the count of labelled samples)",
    "exp_out": "exp of an unbounded output",
    "reward": "a weight decay written with its sign flipped: the loss rewards growth",
    "adam_eps0": "Adam with epsilon 0: a weight that gets no gradient (an embedding's padding row) divides 0 by 0",
}


@dataclasses.dataclass(frozen=True)
class Arch:
    """One architecture: its task, its input, its base learning rate and faults."""

    name: str
    task: str  # "cls" (softmax head), "rate" (positive rate head), or the model's own loss
    inputs: str  # "image", "seq", "tokens", "vec"
    lr: float
    faults: tuple[str, ...]
    build: Callable[[str | None], keras.Model] | None  # None: the hand-written loop
    policy: str = "float32"
    note: str = ""


# ------------------------------------------------------------------ data


def _inputs(kind: str, n: int, rs: np.random.RandomState) -> np.ndarray:
    if kind == "image":
        return rs.randn(n, 8, 8, 1).astype("float32")
    if kind == "seq":
        return rs.randn(n, 10, 4).astype("float32")
    if kind == "seq16":
        return rs.randn(n, 8, 16).astype("float32")
    if kind == "tokens":
        tokens = rs.randint(1, 50, size=(n, 8))
        tokens[:, 6:] *= rs.rand(n, 1) < 0.5  # some sequences padded
        return tokens.astype("int32")
    return (1 / (1 + np.exp(-2 * rs.randn(n, 16)))).astype("float32")  # vec: values in (0, 1)


def _targets(arch: Arch, x: np.ndarray, rs: np.random.RandomState) -> np.ndarray:
    flat = x.reshape(len(x), -1).astype("float64")
    proj = flat @ rs.randn(flat.shape[1], NCLS) / np.sqrt(flat.shape[1])
    if arch.task == "cls":
        labels = (flat.sum(1).astype(int) % NCLS) if arch.inputs == "tokens" else proj.argmax(1)
        return np.eye(NCLS, dtype="float32")[labels]
    if arch.task == "rate":
        return rs.poisson(np.exp(np.clip(proj[:, :1], -2, 2))).astype("float32")
    return x.reshape(len(x), -1)[:, :0]  # the model's own loss (vae, gan): no target


def make_data(arch: Arch, fault: str | None, fixed: bool) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of STEPS batches; y's last column is each sample's label weight (0 or 1)."""
    rs = np.random.RandomState(SEED)
    n = STEPS * BATCH
    x = _inputs("seq16" if arch.name == "transformer" else arch.inputs, n, rs)
    y = _targets(arch, x, rs)
    w = np.ones((n, 1), "float32")
    k = slice(TRIGGER_STEP * BATCH, (TRIGGER_STEP + 1) * BATCH)
    if fault == "unscaled" and not fixed:
        x = x * 1000.0
    elif fault == "nan_batch" and not fixed:
        x.reshape(n, -1)[TRIGGER_STEP * BATCH, 0] = np.nan  # the fix: the pipeline drops it
    elif fault == "no_eps" and arch.name != "vae":
        x[k] = 0  # a blank (all-padding) batch
    elif fault == "div_stat":
        w[k] = 0  # a batch with no labelled sample
    elif fault == "exp_out" and arch.task == "rate":
        y[TRIGGER_STEP * BATCH] = 1e6  # one outlier count
    elif fault in ("exp_out", "no_eps") or (fault == "log_softmax" and arch.inputs != "tokens"
                                             and arch.policy == "float32"):
        # One outlier sample. Not under mixed_float16: there it overflows a float16 norm in the
        # fixed variant too, and the saturated softmax fails at step 0 without it.
        x[TRIGGER_STEP * BATCH] *= 300.0
    return x, np.concatenate([y, w], axis=1)


# ------------------------------------------------------------------ losses


def masked_mean(per_sample: tf.Tensor, w: tf.Tensor, fault: str | None) -> tf.Tensor:
    """The mean of the labelled samples' losses."""
    if fault == "div_stat":
        return tf.reduce_sum(w * per_sample) / tf.reduce_sum(w)
    return tf.reduce_sum(w * per_sample) / tf.maximum(tf.reduce_sum(w), 1.0)


def make_loss(task: str, fault: str | None, decay: Callable[[], tf.Tensor] | None = None
              ) -> Callable[[tf.Tensor, tf.Tensor], tf.Tensor]:
    """The loss of a classifier (softmax) or a rate regressor (Poisson), with its label weights,
    plus ``decay()`` (a weight penalty) where one is given."""

    def zoo_loss(y: tf.Tensor, out: tf.Tensor) -> tf.Tensor:
        out = tf.cast(out, tf.float32)
        target, w = y[:, :-1], y[:, -1]
        if task == "cls" and fault == "log_softmax":
            per = -tf.reduce_sum(target * tf.math.log(tf.nn.softmax(out)), axis=-1)
        elif task == "cls":
            per = tf.nn.softmax_cross_entropy_with_logits(target, out)
        else:
            rate = tf.exp(out) if fault == "exp_out" else tf.nn.softplus(out)
            per = tf.reduce_sum(rate - target * tf.math.log(rate + 1e-6), axis=-1)
        loss = masked_mean(per, w, fault)
        return loss if decay is None else loss + decay()

    return zoo_loss


def weight_decay(variables: list, fault: str | None, fixed: bool, lr: float) -> Callable[[], tf.Tensor] | None:
    """An L2 weight penalty, written ``- DECAY * sum(w**2)`` in the fault (the fix: ``+``): with
    SGD's momentum the fault grows the weights by about ``DECAY_GROWTH`` a step."""
    if fault != "reward":
        return None
    wd = DECAY_GROWTH / (20 * lr) * (1 if fixed else -1)
    kernels = [v for v in variables if len(v.shape) >= 2]
    return lambda: wd * tf.add_n([tf.reduce_sum(tf.square(tf.cast(v, tf.float32))) for v in kernels])


# ------------------------------------------------------------------ layers


class InputNorm(keras.layers.Layer):
    """Standardises each sample over its features: (x - mean) / sqrt(var + eps)."""

    def __init__(self, eps: float, axis: Any = -1, **kwargs):
        super().__init__(**kwargs)
        self.eps, self.axis = eps, axis

    def call(self, x):
        mean = tf.reduce_mean(x, axis=self.axis, keepdims=True)
        var = tf.reduce_mean(tf.square(x - mean), axis=self.axis, keepdims=True)
        return (x - mean) / tf.sqrt(var + self.eps)


def _eps(fault: str | None, eps: float = 1e-5) -> float:
    return 0.0 if fault == "no_eps" else eps


def _head(units: int, task: str) -> keras.layers.Layer:
    return keras.layers.Dense(units if task == "cls" else 1, dtype="float32")


class CNN(keras.Model):
    """Conv-BatchNorm-ReLU twice, pooled, a softmax head."""

    def __init__(self, fault: str | None):
        super().__init__()
        self.c1, self.c2 = keras.layers.Conv2D(8, 3, padding="same"), keras.layers.Conv2D(8, 3, padding="same")
        self.bn1 = keras.layers.BatchNormalization(epsilon=_eps(fault, 1e-3))
        self.bn2 = keras.layers.BatchNormalization(epsilon=_eps(fault, 1e-3))
        self.head = _head(NCLS, "cls")

    def call(self, x, training=False):
        h = tf.nn.relu(self.bn1(self.c1(x), training=training))
        h = tf.nn.relu(self.bn2(self.c2(h), training=training))
        h = tf.reduce_mean(h, axis=[1, 2])
        return self.head(h) / TEMPERATURE


class ResNet(keras.Model):
    """A conv stem and two residual blocks (conv-BN-ReLU-conv-BN + skip), a rate head."""

    def __init__(self, fault: str | None):
        super().__init__()
        self.stem = keras.layers.Conv2D(8, 3, padding="same")
        self.convs = [keras.layers.Conv2D(8, 3, padding="same") for _ in range(4)]
        self.bns = [keras.layers.BatchNormalization(epsilon=_eps(fault, 1e-3)) for _ in range(4)]
        self.head = _head(1, "rate")

    def call(self, x, training=False):
        h = self.stem(x)
        for i in (0, 2):
            r = tf.nn.relu(self.bns[i](self.convs[i](h), training=training))
            r = self.bns[i + 1](self.convs[i + 1](r), training=training)
            h = tf.nn.relu(h + r)
        return self.head(tf.reduce_mean(h, axis=[1, 2]))


class Transformer(keras.Model):
    """Input LayerNorm, one pre-norm encoder block (self-attention + MLP), a softmax head."""

    def __init__(self, fault: str | None):
        super().__init__()
        self.norm_in, self.norm1, self.norm2 = (InputNorm(_eps(fault)) for _ in range(3))
        self.proj = keras.layers.Dense(16)
        self.attn = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)
        self.ff1, self.ff2 = keras.layers.Dense(32, activation="relu"), keras.layers.Dense(16)
        self.head = _head(NCLS, "cls")

    def call(self, x, training=False):
        h = self.proj(self.norm_in(x))
        a = self.norm1(h)
        h = h + self.attn(a, a)
        h = h + self.ff2(self.ff1(self.norm2(h)))
        return self.head(tf.reduce_mean(h, axis=1)) / TEMPERATURE


class GRUModel(keras.Model):
    """Each sequence standardised over time, a GRU, a rate head."""

    def __init__(self, fault: str | None):
        super().__init__()
        self.norm = InputNorm(_eps(fault), axis=1)
        self.gru = keras.layers.GRU(16)
        self.head = _head(1, "rate")

    def call(self, x, training=False):
        return self.head(self.gru(self.norm(x)))


class EmbeddingModel(keras.Model):
    """Token embeddings, mean-pooled over the non-padding tokens, L2-normalised; a cosine head."""

    def __init__(self, fault: str | None):
        super().__init__()
        self.emb = keras.layers.Embedding(50, 16)
        self.dense = keras.layers.Dense(16, use_bias=False)
        self.head = keras.layers.Dense(NCLS, use_bias=False)
        self.eps = _eps(fault, 1e-12)

    def call(self, tokens, training=False):
        e = self.emb(tokens)
        mask = tf.cast(tokens > 0, e.dtype)[..., None]
        pooled = tf.reduce_sum(e * mask, axis=1) / tf.maximum(tf.reduce_sum(mask, axis=1), 1.0)
        h = self.dense(pooled)
        unit = h / tf.sqrt(tf.reduce_sum(tf.square(h), axis=-1, keepdims=True) + self.eps)
        return self.head(unit) / TEMPERATURE


def _noise(model: keras.Model, shape: tuple[int, int], stream: int) -> tf.Tensor:
    """Noise fixed by the step, so that a replay of a step and the oracle draw the same."""
    seed = tf.stack([tf.cast(model.optimizer.iterations, tf.int32), stream])
    return tf.random.stateless_normal(shape, seed=seed)


class VAE(keras.Model):
    """A dense VAE: Bernoulli reconstruction log-likelihood plus KL, its own train_step."""

    def __init__(self, fault: str | None):
        super().__init__()
        self.fault = fault
        self.enc = keras.layers.Dense(32, activation="relu")
        self.mu, self.logvar = keras.layers.Dense(4), keras.layers.Dense(4)
        self.dec1, self.dec2 = keras.layers.Dense(32, activation="relu"), keras.layers.Dense(16)

    def encode(self, x):
        h = self.enc(x)
        raw = self.logvar(h)
        logvar = raw if self.fault == "exp_out" else 5.0 * tf.tanh(raw / 5.0)
        return self.mu(h), logvar

    def call(self, x, training=False):
        mu, _ = self.encode(x)
        return tf.sigmoid(self.dec2(self.dec1(mu)))

    def train_step(self, data):
        x, y = data
        eps = _eps(self.fault, 1e-7)
        with tf.GradientTape() as tape:
            mu, logvar = self.encode(x)
            z = mu + tf.exp(0.5 * logvar) * _noise(self, (BATCH, 4), 0)
            p = tf.sigmoid(self.dec2(self.dec1(z)))
            recon = -tf.reduce_sum(x * tf.math.log(p + eps) + (1 - x) * tf.math.log(1 - p + eps), axis=-1)
            kl = -0.5 * tf.reduce_sum(1 + logvar - tf.square(mu) - tf.exp(logvar), axis=-1)
            loss = masked_mean(recon + kl, y[:, -1], self.fault)
            scaled = self.optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


def _bce(logits: tf.Tensor, label: float, fault: str | None) -> tf.Tensor:
    """Binary cross-entropy of a discriminator's logits against one label."""
    logits = tf.cast(logits[:, 0], tf.float32)
    if fault == "log_softmax":
        p = tf.sigmoid(logits)
        return -(label * tf.math.log(p) + (1 - label) * tf.math.log(1 - p))
    return tf.nn.sigmoid_cross_entropy_with_logits(tf.fill(tf.shape(logits), label), logits)


class GAN(keras.Model):
    """A dense GAN: the discriminator's and the generator's updates, two optimizers."""

    def __init__(self, fault: str | None):
        super().__init__()
        self.fault = fault
        self.gen = keras.Sequential([keras.layers.Dense(16, activation="relu"), keras.layers.Dense(16)])
        self.disc = keras.Sequential([keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
        self.d_optimizer: keras.optimizers.Optimizer | None = None

    def call(self, x, training=False):
        return self.disc(x) + tf.reduce_mean(self.gen(x[:, :4]))

    def train_step(self, data):
        real, y = data
        noise = _noise(self, (BATCH, 4), 1)
        with tf.GradientTape() as tape:
            fake = self.gen(noise)
            d_loss = masked_mean(_bce(self.disc(real), 1.0, self.fault), y[:, -1], self.fault) + tf.reduce_mean(
                _bce(self.disc(fake), 0.0, self.fault))
        d_vars = self.disc.trainable_variables
        self.d_optimizer.apply(tape.gradient(d_loss, d_vars), d_vars)
        with tf.GradientTape() as tape:
            g_loss = tf.reduce_mean(_bce(self.disc(self.gen(noise)), 1.0, self.fault))
            scaled = self.optimizer.scale_loss(g_loss)
        g_vars = self.gen.trainable_variables
        self.optimizer.apply(tape.gradient(scaled, g_vars), g_vars)
        return {"loss": d_loss + g_loss}


class LoopMLP(keras.Model):
    """The hand-written loop's model: RMS-normalised inputs, two ReLU layers, a rate head."""

    def __init__(self, fault: str | None):
        super().__init__()
        self.eps = _eps(fault, 1e-6)
        self.d1, self.d2 = keras.layers.Dense(32, activation="relu"), keras.layers.Dense(32, activation="relu")
        self.head = _head(1, "rate")

    def call(self, x, training=False, log=None):
        log = log or (lambda name, t: None)
        h = x / tf.sqrt(tf.reduce_mean(tf.square(x), axis=-1, keepdims=True) + self.eps)
        log("rms_norm/output", h)
        h = self.d1(h)
        log("dense1/output", h)
        h = self.d2(h)
        log("dense2/output", h)
        out = self.head(h)
        log("head/output", out)
        return out


# The faults that made a NaN or an Inf within STEPS steps in each architecture. Also tried, and
# silent within 40 steps (the loss grew, ReLUs died, or a norm absorbed the fault): lr100 in all but
# the transformer (the CNN's loss reached 1e17 at step 40), unscaled inputs wherever a BatchNorm or an
# input norm comes first, float16 without loss scaling in the CNN, the residual net, the GRU,
# the transformer (at this learning rate), the embedding model and the loop, and BatchNorm without
# its epsilon in the CNN and the residual net (a blank batch's variance is not exactly 0). The
# transformer's ``reward`` cell is the zoo's growth cell: each step's loss falls about 1.25x a step,
# from -597 to -2.5e4, for 17 steps before a float16 norm overflows (oracle: step 18). Also tried for
# growth: a learning-rate warm-up without its cap and Adam at 0.1 (issue 26 item 4) in the
# transformer (the first jumps within 3 steps of its threshold; the second stays finite for 60
# steps: Adam moves each weight by at most its rate, and the pre-norms bound the activations),
# and lr x300 or x1000 in the CNN (the ReLUs die first).
ARCHS = {a.name: a for a in (
    Arch("cnn_bn", "cls", "image", 0.02, ("nan_batch", "div_stat", "log_softmax"), CNN),
    Arch("resnet", "rate", "image", 0.01, ("nan_batch", "div_stat", "exp_out"), ResNet),
    Arch("transformer", "cls", "seq", 0.003, ("lr100", "nan_batch", "no_eps", "div_stat", "log_softmax", "reward"),
         Transformer, policy="mixed_float16", note="under mixed_float16"),
    Arch("gru", "rate", "seq", 0.02, ("nan_batch", "no_eps", "div_stat", "exp_out"), GRUModel),
    Arch("vae", "vae", "vec", 0.01, ("unscaled", "nan_batch", "no_eps", "div_stat", "exp_out"), VAE),
    Arch("gan", "gan", "vec", 0.01, ("nan_batch", "div_stat", "log_softmax"), GAN, note="two optimizers"),
    Arch("embedding", "cls", "tokens", 0.05, ("no_eps", "div_stat", "log_softmax", "adam_eps0"), EmbeddingModel),
    Arch("loop", "rate", "vec", 0.01, ("nan_batch", "no_eps", "div_stat", "exp_out"), None,
         note="hand-written loop, log_numerics"),
)}


def _policy(arch: Arch, fault: str | None, fixed: bool) -> str:
    if fault != "fp16":
        return arch.policy
    return "mixed_float16" if fixed else "float16"


def _optimizer(arch: Arch, fault: str | None, fixed: bool, policy: str) -> keras.optimizers.Optimizer:
    lr = arch.lr * (100 if fault == "lr100" and not fixed else 1)
    if fault == "adam_eps0":  # fixed: Keras' default epsilon
        opt = keras.optimizers.Adam(lr / 10, epsilon=1e-7 if fixed else 0.0)
    else:
        opt = keras.optimizers.SGD(lr, momentum=0.9)
    # A small initial scale: the calibration's overflowing first steps would stop the oracle.
    return keras.optimizers.LossScaleOptimizer(opt, initial_scale=256) if policy == "mixed_float16" else opt


def train(arch_name: str, fault: str, fixed: bool, hook: Any) -> None:
    """Trains one cell's variant for STEPS steps (or until an error is raised)."""
    arch = ARCHS[arch_name]
    active = None if fixed else fault
    keras.utils.set_random_seed(SEED)
    policy = _policy(arch, fault, fixed)
    keras.mixed_precision.set_global_policy(policy)
    x, y = make_data(arch, fault, fixed)
    opt = _optimizer(arch, fault, fixed, policy)
    if arch.build is None:
        return _train_loop(arch, fault, fixed, opt, x, y, hook)
    model = arch.build(active)
    model(x[:BATCH])
    if isinstance(model, GAN):
        model.gen(x[:BATCH, :4])
        model.d_optimizer = keras.optimizers.SGD(arch.lr * (100 if active == "lr100" else 1), momentum=0.9)
        model.d_optimizer.build(model.disc.trainable_variables)
    decay = weight_decay(model.trainable_variables, fault, fixed, arch.lr)
    model.compile(optimizer=opt, loss=make_loss(arch.task, active, decay), jit_compile=False)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    hook.fit(model, data)
    return None


def _train_loop(arch: Arch, fault: str, fixed: bool, opt, x: np.ndarray, y: np.ndarray, hook: Any) -> None:
    """A hand-written training loop: a tf.function computes the loss and the gradients."""
    active = None if fixed else fault
    model = LoopMLP(active)
    model(x[:BATCH])
    variables = model.trainable_variables
    loss_fn = make_loss("rate", active, weight_decay(variables, fault, fixed, arch.lr))
    opt.build(variables)

    @tf.function
    def gradients(xb, yb):
        with tf.GradientTape() as tape:
            out = model(xb, training=True, log=hook.log)
            loss = loss_fn(yb, out)
            hook.log("loss", loss)
            scaled = opt.scale_loss(loss)
        grads = tape.gradient(scaled, variables)
        hook.log_gradients(grads, variables)
        return loss, grads

    def train_step(xb, yb):
        loss, grads = gradients(xb, yb)
        opt.apply(grads, variables)
        return loss

    step_fn = hook.guarded(train_step, opt)
    with hook.writing():
        for step in range(STEPS):
            hook.begin_step(step)
            batch = (tf.constant(x[step * BATCH:(step + 1) * BATCH]), tf.constant(y[step * BATCH:(step + 1) * BATCH]))
            hook.stepped(step_fn(*batch))
