#!/usr/bin/env bash
# Installs everything the tests need into .venv and runs them: the README's
# second command, and what .ci/run calls.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m venv .venv
.venv/bin/pip install --quiet --upgrade pip
# TensorFlow's CPU build comes with the "cpu" extra (the package declares none).
.venv/bin/pip install --quiet -e ".[test,cpu]"
# Keras' JAX and PyTorch backends for tests/test_backends.py, pinned to CPU
# builds: torch 2.13.0's CPU wheel lies on these machines (a plain "torch",
# or a range that admits a newer release, downloads a CUDA build of several
# GB); jax and jaxlib are CPU builds (about 600 MB). Measured here: about 25 s
# for jax and jaxlib, about 65 s for torch, beside tensorflow-cpu (no conflict).
.venv/bin/pip install --quiet -e ".[jax,torch]" "jax==0.10.2" "jaxlib==0.10.2" "torch==2.13.0"

# The record kernel (tb_numerics/record_kernel.py), built once for this
# machine before the workers start, so that no test waits for its build;
# where it cannot be built, TensorFlow's ops serve and
# tests/test_record_kernel.py says why.
.venv/bin/python -m tb_numerics.record_kernel || true

# The dashboard's browser tests drive Debian's Chromium (never a browser
# downloaded by playwright).
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq chromium >/dev/null
fi

export TF_CPP_MIN_LOG_LEVEL=2
# Two workers (pytest-xdist), each taking a whole module at a time
# (--dist loadfile), so that a module's fixtures (its tensorboard processes,
# its trainings) are built once; in the order tests/conftest.py gives them
# (slow modules first), not xdist's most-tests-first. Arguments go to pytest
# after these: "-n 0" runs in this process alone.
# pytest exits 5 when it collects no test: set -e turns that into a failure.
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder "$@"
