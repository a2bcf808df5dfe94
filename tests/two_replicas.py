"""Runs a script under tf.distribute.MirroredStrategy with two replicas on CPU.

TensorFlow splits a CPU into logical devices only before it first uses it,
so such a test runs its script in a fresh interpreter: ``run(script, arg)``
prepends the set-up (``tf``, ``np``, ``json``, ``sys`` and ``strategy`` are
then defined), and returns the JSON the script prints on its last line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

_PRELUDE = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()])
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    """
)


def run(script: str, arg: str, timeout: float = 300) -> Any:
    """The JSON ``script`` prints last, run with ``arg`` as ``sys.argv[1]`` after the set-up."""
    out = subprocess.run(
        [sys.executable, "-c", _PRELUDE + textwrap.dedent(script), arg],
        capture_output=True, text=True, timeout=timeout, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
