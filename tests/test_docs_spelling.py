"""Every ``tbn.`` / ``tb_numerics.`` name the documentation spells resolves,
and the README's Python blocks run, so that a documented spelling cannot
break again (issue 25, item 6: ``tbn.oplevel.replay_step`` raised
``AttributeError`` after ``import tb_numerics as tbn``)."""

from __future__ import annotations

import pathlib
import re
import types

import pytest

import tb_numerics

from tb_numerics import event_reader

pytestmark = pytest.mark.unit

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "tb_numerics" / "http_api.md"]
_NAME = re.compile(r"\b(?:tbn|tb_numerics)(?:\.[A-Za-z_]\w*)+")
_PYTHON_BLOCK = re.compile(r"^( *)```python\n(.*?)^\1```", re.S | re.M)

# What the README's quick start leaves to the user: a tiny model and data.
_PRELUDE = """
import keras
import tensorflow as tf
dense1 = keras.layers.Dense(4, activation="relu", name="dense1")
head = keras.layers.Dense(1, name="head")
model = keras.Sequential([keras.Input((3,)), dense1, head])
loss_fn = keras.losses.MeanSquaredError()
optimizer = keras.optimizers.SGD(0.01)
dataset = tf.data.Dataset.from_tensor_slices((tf.ones([4, 3]), tf.zeros([4, 1]))).batch(2)
"""


def documented_names() -> list[str]:
    """The dotted ``tbn.`` / ``tb_numerics.`` names the documents spell."""
    return sorted({m.group(0) for doc in DOCS for m in _NAME.finditer(doc.read_text())})


def python_blocks(doc: pathlib.Path) -> list[str]:
    """The fenced ``python`` blocks of ``doc``, dedented."""
    out = []
    for m in _PYTHON_BLOCK.finditer(doc.read_text()):
        indent = len(m.group(1))
        out.append("\n".join(line[indent:] for line in m.group(2).splitlines()))
    return out


def _package_attribute(name: str):
    """``tb_numerics.<name>`` as a user gets it right after ``import tb_numerics``:
    what the package's own ``__getattr__`` gives, or a non-module attribute it
    defines itself. (A submodule some other import loaded does not count.)"""
    try:
        return tb_numerics.__getattr__(name)
    except AttributeError:
        value = vars(tb_numerics).get(name)
        if value is None or isinstance(value, types.ModuleType):
            raise
        return value


def test_the_documents_spell_names_and_a_python_block():
    names = documented_names()
    assert "tbn.oplevel.replay_step" in names and "tbn.log_numerics" in names, names
    assert python_blocks(ROOT / "README.md")


@pytest.mark.parametrize("name", documented_names())
def test_every_documented_name_resolves(name):
    _, first, *rest = name.split(".")
    obj = _package_attribute(first)
    for part in rest:
        obj = getattr(obj, part)


def test_the_readme_python_blocks_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for block in python_blocks(ROOT / "README.md"):
        exec(compile(_PRELUDE + block, "README.md", "exec"), {})  # noqa: S102 - the README's own code
    # One directory per training, as the README advises: the quick start's
    # custom loop and the Keras example.
    runs = {r.run: r for r in event_reader.read_logdir(str(tmp_path / "logs"))}
    assert set(runs) == {"custom_loop", "keras_fit"}
    for run in runs.values():
        assert {"dense1/output", "loss", "gradients/global_norm"} <= {s.tag for s in run.series}, run.run
