"""The tests' shared set-up: the helper modules on the path, and the tiers.

Every test carries exactly one tier marker, ``unit``, ``e2e`` or ``browser``
(pytest.ini says what each means, tests/README.md how to pick one): a module
sets it with ``pytestmark``; a module whose tests share one expensive
fixture across tiers marks each test. Collection stops with the names of the
tests that carry none or several, so that ``-m unit`` and ``-m "not unit"``
always split the suite in two.
"""

from __future__ import annotations

import os
import sys

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# tests/ holds shared helpers (tb_process) imported by the test modules.
sys.path.insert(0, os.path.dirname(__file__))

TIERS = ("unit", "e2e", "browser")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Refuses a test without exactly one tier marker (checked before ``-m``
    selects), and puts the modules that hold slow tests first.

    Slow first: on two workers (scripts/test.sh) the longest modules start
    at once rather than run alone at the end while the other worker idles.
    A module's tests stay together and in order, so its fixtures are built once.
    """
    slow = {_module(item) for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: _module(item) not in slow)
    wrong = []
    for item in items:
        tiers = sorted({m.name for m in item.iter_markers() if m.name in TIERS})
        if len(tiers) != 1:
            wrong.append("%s: %s" % (item.nodeid, " and ".join(tiers) or "no tier marker"))
    if wrong:
        raise pytest.UsageError(
            "each test needs exactly one tier marker, unit, e2e or browser (see tests/README.md):\n  "
            + "\n  ".join(wrong[:20])
            + ("\n  ... and %d more" % (len(wrong) - 20) if len(wrong) > 20 else "")
        )


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


@pytest.fixture(scope="module", params=[True, False], ids=["rust", "python"])
def served_logdir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(tensorboard, logdir): one real ``tensorboard`` process per loader (the
    Rust data server, then the Python loader) for all of a module's tests.

    The logdir starts empty; each test writes its runs under a name of its
    own and waits for TensorBoard to read them (``tb_process.wait_for``).
    """
    import tb_process

    root = tmp_path_factory.mktemp("served") / "logs"
    root.mkdir()
    with tb_process.tensorboard(str(root), load_fast=request.param) as tb:
        yield tb, root


@pytest.fixture(scope="module")
def browser():
    """One headless Chromium (Debian's, ``chromium.browser``) for all of a module's browser tests."""
    import chromium

    with chromium.browser() as b:
        yield b
