"""The record kernel: a layer record in one TensorFlow CPU op, built once per machine.

``stats.tensor_stats`` computes a record with some twenty TensorFlow ops
inside a function call; on a CPU each is a pass over the tensor (TensorFlow
fuses none of them) and each call site costs the instantiation of that
body when the step first runs. ``record_kernel.cc`` computes the same
record in one vectorised pass (two for a tensor holding zeros, such as a
ReLU output) as a single op; ``TbnRecords`` the records of a list of
tensors (a step's small gradients) as one op; ``TbnKeep`` a due step's
weights' records and their copy before the update, and ``TbnMoved`` the
update ratios' squared norms, each one op for every weight and free at the
other steps, so that no cond surrounds them.

It is C++ built against the installed TensorFlow, so it is compiled on the
machine that uses it: the first time a record is traced (about 10 s, once),
or ahead with ``python -m tb_numerics.record_kernel`` (processes starting
together take a lock, so one builds). The library is kept
in a cache directory (``$TB_NUMERICS_CACHE_DIR``, else
``$XDG_CACHE_HOME/tb_numerics``, else ``~/.cache/tb_numerics``) under a
name that changes with the source, the TensorFlow build and the CPU, so an
upgrade builds it again. Where it cannot be built (no C++ compiler, not
x86-64, a failed build, ``TB_NUMERICS_RECORD_KERNEL=0``) the TensorFlow
ops serve, with the same record: only the cost differs.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator

from tb_numerics import _requires

tf = _requires.tensorflow(__name__)

__all__ = ["BuildError", "build", "library_path", "load", "use"]

_SOURCE = Path(__file__).with_name("record_kernel.cc")
_ENV_SWITCH = "TB_NUMERICS_RECORD_KERNEL"
_BUILD_TIMEOUT_S = 300
_log = logging.getLogger(__name__)
_lock = threading.Lock()
_override = threading.local()


class BuildError(RuntimeError):
    """The kernel could not be built; the message holds the compiler's output."""


def _cache_dir() -> Path:
    explicit = os.environ.get("TB_NUMERICS_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tb_numerics"


def _cpu_flags() -> str:
    """The CPU's feature flags: the library is built for this CPU (``-march=native``)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor()


def _flags() -> tuple[list[str], list[str]]:
    return list(tf.sysconfig.get_compile_flags()), list(tf.sysconfig.get_link_flags())


def library_path() -> Path:
    """Where the library built from this source, for this TensorFlow and CPU, lives."""
    compile_flags, link_flags = _flags()
    key = hashlib.sha256()
    for part in (_SOURCE.read_bytes(), tf.__version__.encode(), repr((compile_flags, link_flags)).encode(),
                 platform.machine().encode(), _cpu_flags().encode(), sys.version.encode()):
        key.update(part)
        key.update(b"\0")
    return _cache_dir() / ("record_kernel-%s.so" % key.hexdigest()[:16])


def build() -> Path:
    """Compiles the kernel into ``library_path()`` (replacing a failed attempt's mark).

    Raises:
      BuildError: no C++ compiler, not x86-64, or the compiler failed (its
        output in the message).
    """
    target = library_path()
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        raise BuildError("no C++ compiler (g++ or $CXX) on PATH")
    if platform.machine() not in ("x86_64", "AMD64"):
        raise BuildError("the record kernel is built for x86-64 only, not %s" % platform.machine())
    compile_flags, link_flags = _flags()
    # Built beside the target under a name of its own, then renamed: a
    # process loading the library never sees a half-written file, and two
    # processes building at once each finish with a whole one.
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(prefix=target.stem + ".", suffix=".partial", dir=target.parent)
        os.close(fd)
    except OSError as e:
        raise BuildError("no cache directory to build the record kernel in (set TB_NUMERICS_CACHE_DIR): %s" % e) from e
    cmd = [compiler, "-shared", "-fPIC", "-O3", "-march=native", "-fopenmp-simd", "-w",
           str(_SOURCE), "-o", partial, *compile_flags, *link_flags]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise BuildError("%s failed (exit %d):\n%s" % (" ".join(cmd[:1]), done.returncode, done.stderr[-4000:]))
        os.replace(partial, target)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BuildError("building the record kernel failed: %s" % e) from e
    finally:
        with contextlib.suppress(OSError):
            os.remove(partial)
    with contextlib.suppress(OSError):
        target.with_suffix(".failed").unlink(missing_ok=True)
    return target


@contextlib.contextmanager
def _build_lock(target: Path) -> Iterator[None]:
    """An exclusive lock on ``target``'s build across processes, where the
    cache directory can hold one (else none: each process builds alone)."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(target.with_suffix(".lock"), os.O_CREAT | os.O_RDWR, 0o600)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


@functools.cache
def _loaded() -> Any | None:
    """The loaded op module, building it first if needed; None where it cannot be."""
    if os.environ.get(_ENV_SWITCH, "1") == "0" or not _SOURCE.exists():
        return None
    target = library_path()
    failed = target.with_suffix(".failed")
    if not target.exists():
        with _build_lock(target):
            # Processes starting together (a sweep, a test farm): one builds,
            # the others wait for it here and find the library built.
            if failed.exists():
                return None  # tried on this machine for this build; python -m tb_numerics.record_kernel retries
            if not target.exists():
                _log.warning("tb_numerics: building its record kernel for this machine (once, about 10 s)")
                try:
                    build()
                except BuildError as e:
                    _log.warning("tb_numerics: the record kernel was not built, TensorFlow's ops serve (slower): %s", e)
                    with contextlib.suppress(OSError):
                        failed.write_text(str(e), encoding="utf-8")
                    return None
    try:
        module = tf.load_op_library(str(target))
    except (tf.errors.OpError, OSError) as e:
        _log.warning("tb_numerics: the record kernel did not load, TensorFlow's ops serve (slower): %s", e)
        return None
    for op in ("TbnRecord", "TbnRecords", "TbnKeep", "TbnMoved"):
        tf.no_gradient(op)
    return module


def load() -> Any | None:
    """The op module (``tbn_record``, ``tbn_records``, ``tbn_keep``, ``tbn_moved``: see
    record_kernel.cc), or None where the TensorFlow ops serve (see the module's docstring and ``use``)."""
    if getattr(_override, "enabled", True) is False:
        return None
    with _lock:
        return _loaded()


@contextlib.contextmanager
def use(enabled: bool) -> Iterator[None]:
    """Within the block, records traced in this thread use the kernel only if
    ``enabled`` (and it loads): the tests run both ways, the benches compare them."""
    before = getattr(_override, "enabled", True)
    _override.enabled = enabled
    try:
        yield
    finally:
        _override.enabled = before


def main() -> int:
    """Builds the kernel ahead of use and says where it is (or why not)."""
    try:
        path = build()
    except BuildError as e:
        print("tb_numerics: the record kernel was not built: %s" % e, file=sys.stderr)
        return 1
    tf.load_op_library(str(path))
    print("tb_numerics: record kernel built: %s" % path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
