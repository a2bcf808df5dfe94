"""Starts a real ``tensorboard`` process on 127.0.0.1 for end-to-end tests."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Iterator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TensorBoardProcess:
    """A running TensorBoard: ``url``, ``get_json(path)``, ``log`` (its output)."""

    def __init__(self, proc: subprocess.Popen, url: str, log_path: str):
        self.proc = proc
        self.url = url
        self.log_path = log_path

    def get(self, path: str, timeout: float = 30) -> tuple[int, bytes]:
        req = urllib.request.Request(self.url + path)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def get_json(self, path: str, timeout: float = 30):
        status, body = self.get(path, timeout)
        if status != 200:
            raise AssertionError("GET %s -> %d %s" % (path, status, body[:500]))
        return json.loads(body)

    def wait_for_runs(self, n: int, timeout: float = 60) -> None:
        """Waits until the Numerics plugin lists ``n`` runs (TensorBoard loads a logdir in the background)."""
        wait_for(lambda: len(self.get_json("/data/plugin/numerics/runs")["runs"]) == n, timeout=timeout)

    @property
    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()


@contextlib.contextmanager
def tensorboard(
    logdir: str,
    load_fast: bool = True,
    reload_interval: float = 1,
    extra_args: tuple[str, ...] = (),
    startup_timeout: float = 90,
) -> Iterator[TensorBoardProcess]:
    """Runs ``tensorboard --logdir logdir`` on a free 127.0.0.1 port until exit.

    Waits until the plugin listing answers. ``load_fast`` picks the Rust data
    server (True) or the Python loader (False).
    """
    port = free_port()
    log_path = os.path.join(logdir, os.pardir, "tensorboard-%d.log" % port)
    log_path = os.path.abspath(log_path)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    args = [
        sys.executable,
        "-m",
        "tensorboard.main",
        "--logdir",
        logdir,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--load_fast",
        "true" if load_fast else "false",
        "--reload_interval",
        str(reload_interval),
        *extra_args,
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    tb = TensorBoardProcess(proc, "http://127.0.0.1:%d" % port, log_path)
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError("tensorboard exited with %s:\n%s" % (proc.returncode, tb.log))
            try:
                status, _ = tb.get("/data/plugins_listing", timeout=5)
                if status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("tensorboard did not start in %ss:\n%s" % (startup_timeout, tb.log))
            time.sleep(0.2)
        yield tb
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_for(predicate, timeout: float = 60, interval: float = 0.25):
    """Polls ``predicate()`` until it returns a truthy value; returns it."""
    deadline = time.monotonic() + timeout
    last_exc = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except (AssertionError, OSError, ValueError, KeyError) as e:
            last_exc = e
        time.sleep(interval)
    raise AssertionError("condition not met in %ss (last error: %r)" % (timeout, last_exc))
