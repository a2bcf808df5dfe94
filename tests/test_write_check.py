"""``write_check.GrowthCheck`` on plain files this process holds open (no TensorFlow).

The truth is the bytes each test appends itself: a write that reached the
file is never called lost, one that did not is said once, naming the
directory. (``test_disk_full.py`` runs it under a real training on a
filesystem that fills.)
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from tb_numerics import write_check

pytestmark = pytest.mark.unit

TAG = "__numerics_block__/write-check-test/"
ROWS = np.zeros((50, 13))  # 50 rows written: at least 2,600 bytes


@pytest.fixture
def event_file(tmp_path):
    """An event file held open for appending, as TensorFlow's writer holds its own."""
    path = tmp_path / "events.out.tfevents.1.host.1.0.v2"
    f = open(path, "ab", buffering=0)
    yield path, f
    f.close()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="the writer's file is found through /proc (Linux)")
def test_a_file_that_grows_by_what_was_written_is_never_called_lost(event_file, capsys) -> None:
    path, f = event_file
    check = write_check.GrowthCheck(TAG)
    f.write(b"x" * 100 + TAG.encode() + b"y" * 4000)
    check(ROWS)
    assert check.logdir == str(path.parent)
    for _ in range(3):
        f.write(b"z" * (4 * ROWS.size))  # exactly the lower bound
        check(ROWS)
    assert capsys.readouterr().err == ""


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="the writer's file is found through /proc (Linux)")
def test_a_file_that_did_not_grow_is_said_once_naming_its_directory(event_file, capsys) -> None:
    path, f = event_file
    check = write_check.GrowthCheck(TAG)
    f.write(TAG.encode() + b"y" * 4000)
    check(ROWS)
    f.write(b"z" * 1000)  # a write cut short
    check(ROWS)
    check(ROWS)  # and nothing at all
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("tb-numerics: warning: numerics records could not be written to %s (" % path.parent)
    assert "grew by 1000 bytes where 2600 bytes of records were written" in err[0]


def test_a_first_write_that_never_arrived_is_said_where_the_file_is_the_only_one(event_file, capsys) -> None:
    path, f = event_file
    f.write(b"file version only")
    write_check.GrowthCheck(TAG, lambda: [str(path)])(ROWS)
    err = capsys.readouterr().err
    assert "could not be written to %s (2600 bytes of records written are not in its event file" % path.parent in err


def test_without_the_writers_file_nothing_is_said(tmp_path, capsys, monkeypatch) -> None:
    """Two candidate files and neither holds the tag; or no /proc at all."""
    files = [str(tmp_path / ("events.out.tfevents.%d" % i)) for i in range(2)]
    for p in files:
        with open(p, "wb") as f:
            f.write(b"another writer's")
    check = write_check.GrowthCheck(TAG, lambda: files)
    check(ROWS)
    assert check.logdir is None
    monkeypatch.setattr(write_check, "_FD_DIR", str(tmp_path / "no_proc"))
    assert write_check.open_event_files() == []
    assert capsys.readouterr().err == ""


def test_a_check_never_raises_into_the_step(event_file, capsys) -> None:
    path, f = event_file
    check = write_check.GrowthCheck(TAG)
    f.write(TAG.encode())
    check(ROWS)
    os.remove(path)  # stat fails from now on
    assert check(ROWS) == np.bool_(True)
    print("still here", file=sys.stderr)
    assert capsys.readouterr().err == "still here\n"
