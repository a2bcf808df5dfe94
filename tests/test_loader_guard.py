"""``loader_guard`` under TensorBoard's own event-file loader, in process.

The oracle is TensorFlow's record iterator over the same bytes, unguarded:
the guarded loader yields exactly the records it yields, stops where it
stops, and resumes as it resumes, except on a header claiming more than any
event holds, where TensorFlow's iterator crashes the process (segfaults
where the machine cannot allocate the claim). That case is read here through
TensorBoard's stub reader (its install without TensorFlow, which raised
MemoryError there), so that a regression fails the test instead of ending
pytest; ``test_storm.py`` meets TensorFlow's reader on it in a real
TensorBoard.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading

import pytest
from tensorboard.backend.event_processing import event_file_loader
from tensorboard.compat.tensorflow_stub import pywrap_tensorflow as stub

from tb_numerics import loader_guard

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "bench"))
import storm as storm_damage  # noqa: E402 - bench/storm.py: the storm's damage kinds

pytestmark = pytest.mark.unit

HEALTHY = [storm_damage.frame(b"record %d" % i) for i in range(3)]


def write(path: str, *parts: bytes) -> str:
    with open(path, "ab") as f:
        for p in parts:
            f.write(p)
    return path


def tf_records(path: str) -> list[bytes]:
    """What TensorFlow's own iterator yields, up to the first record it cannot read."""
    import tensorflow as tf

    out = []
    try:
        for r in tf.compat.v1.io.tf_record_iterator(path):
            out.append(r)
    except tf.errors.DataLossError:
        pass
    return out


@pytest.fixture(scope="module", autouse=True)
def guarded():
    assert loader_guard.install()
    assert loader_guard.install()  # once only: not wrapped twice
    assert event_file_loader._make_tf_record_iterator.guarded


@pytest.mark.parametrize("kind", [k for k in storm_damage.KINDS if k != "giant"])
def test_up_to_any_other_damage_the_loader_reads_what_tensorflow_reads(tmp_path, kind: str) -> None:
    rng = random.Random(kind)
    for n in range(8):
        path = write(str(tmp_path / ("f%d" % n)), *HEALTHY[: n % 4], storm_damage.damage(kind, rng, n), *HEALTHY)
        loader = event_file_loader.RawEventFileLoader(path)
        want = tf_records(path)
        assert list(loader.Load()) == want, (kind, n)
        assert list(loader.Load()) == []  # stopped where TensorFlow stops, every time


def _tensorboards_loader(path: str):
    loader = event_file_loader.RawEventFileLoader(path)
    return lambda: list(loader.Load())


def _stub_loader(path: str):
    """TensorBoard's stub reader (its install without TensorFlow), guarded, as its loader drives it."""
    inner = event_file_loader._PyRecordReaderIterator(stub.PyRecordReader_New, path)
    it = loader_guard.GuardedRecordIterator(inner, path)

    def load():
        out = []
        while True:
            try:
                out.append(next(it))
            except StopIteration:
                return out
            except Exception as e:  # the stub's errors (TensorBoard's loader expects TensorFlow's here)
                assert type(e).__name__ in ("DataLossError", "OutOfRangeError"), e
                return out

    return load


@pytest.mark.parametrize("make_loader", [_tensorboards_loader, _stub_loader], ids=["tensorflow", "stub"])
def test_a_record_in_flight_is_read_once_its_file_holds_it(tmp_path, make_loader) -> None:
    whole = storm_damage.frame(b"x" * 5000)
    for cut in (3, 12, 13, 400, len(whole) - 1):  # inside the header, at its end, inside the data, the footer
        path = write(str(tmp_path / ("c%d" % cut)), *HEALTHY, whole[:cut])
        load = make_loader(path)
        assert load() == [b"record 0", b"record 1", b"record 2"]
        assert load() == []
        write(path, whole[cut:], HEALTHY[0])
        assert load() == [b"x" * 5000, b"record 0"], cut
        assert load() == []
    assert loader_guard.problems(str(tmp_path)) == []  # a record in flight is no damage


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_named_like_an_event_file_is_skipped_not_waited_on(tmp_path) -> None:
    path = str(tmp_path / "events.out.tfevents.1.fifo")
    os.mkfifo(path)
    got: list = []
    reader = threading.Thread(target=lambda: got.append(list(event_file_loader.RawEventFileLoader(path).Load())),
                              daemon=True)
    reader.start()
    reader.join(timeout=30)  # unguarded, TensorFlow's reader waits for a writer forever
    assert got == [[]]
    assert loader_guard.problems(str(tmp_path)) == [
        "events.out.tfevents.1.fifo: not a regular file (a FIFO or a device named like an event file); "
        "TensorBoard's Python loader would wait on it forever, and every run with it: skipped"
    ]


def test_a_terabyte_header_stops_the_reader_and_is_named_once(tmp_path, caplog) -> None:
    """Through TensorBoard's stub reader, which raises MemoryError at the header
    where TensorFlow's segfaults (``test_storm.py`` meets that one in a real
    TensorBoard): the guard never lets either read it."""
    path = write(str(tmp_path / "events.out.tfevents.giant"), *HEALTHY, storm_damage.damage("giant", None, 0))
    load = _stub_loader(path)
    assert load() == [b"record 0", b"record 1", b"record 2"]
    assert load() == [] and load() == []
    offset = sum(len(h) for h in HEALTHY)
    assert loader_guard.problems(str(tmp_path)) == [
        "events.out.tfevents.giant: a record header at byte offset %d claims 1099511627776 bytes, more than any "
        "event holds and more than the file (%d bytes); TensorBoard's Python loader reads this file no further "
        "(TensorFlow's record reader would crash TensorBoard on it), so what was written after it is not shown: "
        "remove or repair the file" % (offset, os.path.getsize(path))
    ]
    assert sum("claims 1099511627776 bytes" in r.getMessage() for r in caplog.records) == 1  # logged once
    os.remove(path)
    assert loader_guard.problems(str(tmp_path)) == []  # removed, as the problem asks


def test_the_plugin_installs_the_guard_before_tensorboard_loads_and_imports_no_tensorflow() -> None:
    check = r"""
import argparse, sys
from tensorboard import default
from tensorboard.backend.event_processing import event_file_loader
loader = next(p for p in default.get_dynamic_plugins() if p.__name__ == "NumericsLoader")()
loader.fix_flags(argparse.Namespace(samples_per_plugin={}))  # as TensorBoard does before it builds its loader
assert event_file_loader._make_tf_record_iterator.guarded
assert "tensorflow" not in sys.modules
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "ok", done.stderr[-2000:]
