"""tb-numerics: a TensorBoard plugin for the numerical health of training."""

from setuptools import setup

setup(
    name="tb-numerics",
    version="0.1.0",
    description=(
        "Find the first step and op where training values leave a safe range "
        "(NaN, Inf, overflow, exploding or vanishing gradients), in TensorBoard."
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=["tb_numerics", "tb_numerics.backends", "tb_numerics.oplevel", "tb_numerics.frontend", "tb_numerics.rules"],
    # The dashboard's ES modules live at the top in frontend/ and ship inside
    # the package, where the plugin serves them from.
    package_dir={"tb_numerics": "tb_numerics", "tb_numerics.frontend": "frontend", "tb_numerics.rules": "tb_numerics/rules"},
    package_data={
        # record_kernel.cc: the record kernel's source, built on the machine
        # that uses it, against its TensorFlow (tb_numerics/record_kernel.py).
        "tb_numerics": ["http_api.md", "record_kernel.cc"],
        "tb_numerics.frontend": ["*.js", "*.css", "*.html"],
    },
    # No TensorFlow: "tensorflow-cpu" here would install a second
    # distribution beside a user's "tensorflow" or "tensorflow[and-cuda]",
    # each overwriting the other's files (TensorBoard depends on neither).
    # The plugin and the CLI need none; the writing API raises an
    # ImportError that names the extras below (tb_numerics/_requires.py).
    install_requires=[
        # TensorFlow 2.21 no longer pulls in TensorBoard.
        "tensorboard>=2.21",
        "werkzeug>=2.0",
        "numpy>=1.23",
        # The CPU's CRC32C for every event file the plugin and the CLI read,
        # and for the records written without TensorFlow (Keras on JAX and
        # PyTorch): 4.3 GB/s against TensorFlow's reader's 0.8 and 70 MB/s
        # for the numpy fallback (tb_numerics/_crc32c.py).
        "google-crc32c>=1.5",
    ],
    extras_require={
        # Pick the TensorFlow build: what these machines and most CI runners
        # have, or the GPU build with its CUDA libraries.
        "cpu": ["tensorflow-cpu>=2.16"],
        "gpu": ["tensorflow[and-cuda]>=2.16"],
        # Keras 3 on JAX or PyTorch (KERAS_BACKEND=jax|torch): NumericsCallback
        # there needs no TensorFlow (tb_numerics.backends). Ranges, not pins,
        # so that a user's own build (a CUDA jaxlib, a torch from PyTorch's
        # index) satisfies them; scripts/test.sh pins CI's CPU builds.
        "jax": ["jax>=0.4.30", "jaxlib>=0.4.30"],
        "torch": ["torch>=2.1"],
        "test": [
            "pytest>=7",
            # Property-based fuzzing of the HTTP routes (issue: reliability).
            "hypothesis>=6",
            # Drives Debian's Chromium for the dashboard's end-to-end tests;
            # never downloads a browser of its own.
            "playwright>=1.40",
            # Builds the wheel that the packaging test installs.
            "build>=1",
            # scripts/test.sh runs the suite on two workers, a module per
            # worker at a time: most tests keep one core busy (tracing,
            # a tensorboard process, a subprocess), so two halve the wall time.
            "pytest-xdist>=3",
        ],
    },
    entry_points={
        "tensorboard_plugins": ["numerics = tb_numerics.plugin:NumericsLoader"],
        "console_scripts": ["tb-numerics = tb_numerics.cli:main"],
    },
)
