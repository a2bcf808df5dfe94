"""Debian's Chromium for the dashboard's browser tests (never a downloaded browser)."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import pytest

CHROMIUM = "/usr/lib/chromium/chromium"
# Headless, and no background connections: this machine reaches no network.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

# The Numerics tab's page, as TensorBoard serves a plugin's iframe.
ENTRY = "/data/plugin_entry.html?name=numerics"


def launch(playwright):
    """A headless Chromium browser from Debian's package."""
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)


@contextlib.contextmanager
def browser() -> Iterator:
    """A headless Chromium browser (``launch``) for a module's tests, closed after them."""
    from playwright import sync_api

    with sync_api.sync_playwright() as p:
        b = launch(p)
        yield b
        b.close()


def require() -> None:
    """Skips browser tests where Chromium is missing, except in CI, where
    scripts/test.sh installs it and a missing browser is a failure."""
    if os.path.exists(CHROMIUM):
        return
    if os.environ.get("CI"):
        pytest.fail("Debian's chromium is not installed at %s" % CHROMIUM, pytrace=False)
    pytest.skip("Debian's chromium is not installed (apt-get install chromium)", allow_module_level=True)
