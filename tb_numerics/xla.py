"""Numerics of a ``jit_compile=True`` step: computed inside, written outside.

Summary ops cannot run inside an XLA-compiled function, and
``tf.debugging.check_numerics`` there lets NaN through (TensorFlow issues
117319, 118075). ``stats.tensor_stats`` is plain reductions, so it compiles;
return its records from the step and write them after it::

    numerics = tb_numerics.xla.CompiledStats()

    @tf.function(jit_compile=True)
    def train_step(x, y):
        with tf.GradientTape() as tape:
            h = dense1(x)
            loss = loss_fn(y, head(h))
        grads = tape.gradient(loss, variables)
        optimizer.apply_gradients(zip(grads, variables))
        records = numerics.collect({"dense1/output": h, "loss": loss})
        records.update(numerics.collect_gradients(grads, variables))
        return loss, records

    with writer.as_default():
        for step, (x, y) in enumerate(dataset):
            loss, records = train_step(x, y)
            numerics.write(records, step=step)

The records are the same as ``log_numerics`` / ``log_gradients`` would write
from an uncompiled step. ``NumericsCallback`` does this for ``model.fit``.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from tb_numerics import _requires

tf = _requires.tensorflow(__name__)

from tb_numerics import metadata, stats, summary  # noqa: E402


class CompiledStats:
    """Collects records inside a compiled step and writes them outside it.

    It remembers each tag's dtype, shape and role when the step is traced,
    and the order tags were collected in (their execution order).
    """

    def __init__(self) -> None:
        self._infos: dict[str, metadata.TensorInfo] = {}

    def collect(self, tensors: Mapping[str, tf.Tensor], role: str | None = None) -> dict[str, tf.Tensor]:
        """The records (float64 ``[NUM_FIELDS]``) of named float tensors; call inside the step.

        ``role`` defaults as in ``log_numerics``: "loss" where the name's last
        component mentions loss, else "activation".
        """
        if role is not None and role not in metadata.ROLES:
            raise ValueError("role must be one of %s, got %r" % (", ".join(metadata.ROLES), role))
        out = {}
        for name, t in tensors.items():
            role_of = role or summary.default_role(name)
            t = tf.convert_to_tensor(t)
            dtype = stats.check_dtype(t, name)
            shape = None if t.shape.rank is None else tuple(t.shape.as_list())
            self._infos.setdefault(name, metadata.TensorInfo(dtype=dtype, shape=shape, role=role_of))
            out[name] = stats.tensor_stats(t, name)
        return out

    def collect_gradients(self, grads: Sequence, variables: Sequence) -> dict[str, tf.Tensor]:
        """Per-gradient records (backward order, ``gradients/<path>``) and the global norm."""
        grads, variables = list(grads), list(variables)
        if len(grads) != len(variables):
            raise ValueError("collect_gradients got %d gradients for %d variables" % (len(grads), len(variables)))
        named = {}
        for g, v in reversed(list(zip(grads, variables))):
            if g is None:
                continue
            if isinstance(g, tf.IndexedSlices):
                g = g.values
            named[summary.gradient_tag(v)] = g
        out = self.collect(named, role="gradient")
        if out:
            norm_dtype = "float64" if any(self._infos[t].dtype == "float64" for t in out) else "float32"
            tag = "gradients/global_norm"
            self._infos.setdefault(tag, metadata.TensorInfo(dtype=norm_dtype, shape=(), role="global_norm"))
            out[tag] = summary.global_norm_record(tf.stack(list(out.values())), norm_dtype)
        return out

    def write(self, records: Mapping[str, tf.Tensor], step=None, every_n_steps: int | None = None) -> bool:
        """Writes records returned by a compiled step to the default writer.

        Call outside the compiled function (eagerly, or in an uncompiled
        ``tf.function``). ``every_n_steps`` is the summary API's latch.
        Returns whether anything was written.
        """
        wrote = False
        for name, info in self._infos.items():
            if name in records:
                w = summary.write_stats(name, records[name], step, info=info, every_n_steps=every_n_steps)
                wrote = bool(w) or wrote
        return wrote
