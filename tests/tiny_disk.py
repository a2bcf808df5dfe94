"""A 64 KiB filesystem for the disk-full tests: a tmpfs where this process may mount one (root in a container)."""

from __future__ import annotations

import contextlib
import pathlib
import subprocess
from typing import Iterator


@contextlib.contextmanager
def tiny_tmpfs(root: pathlib.Path, mount: bool = True) -> Iterator[tuple[pathlib.Path, bool]]:
    """(``root``/tiny, whether a 64 KiB tmpfs is mounted there); unmounted afterwards.

    Args:
      root: where the directory is made.
      mount: whether to try mounting at all (False: a plain directory).
    """
    tiny = root / "tiny"
    tiny.mkdir()
    mounted = mount and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(tiny)],
                                       capture_output=True).returncode == 0
    try:
        yield tiny, mounted
    finally:
        if mounted:
            subprocess.run(["umount", str(tiny)], check=True)
