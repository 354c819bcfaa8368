"""An aborting mpi rank waits for its launcher to read what it wrote (its traceback) before
``MPI_Abort`` stops the launcher, which dropped the end of the output it had not read yet
(tests/backends/test_mpi_reliability.py saw a traceback cut short once)."""

from __future__ import annotations

import os
import time

from unicoll.backends.mpi.abort import _drained


def test_an_unread_pipe_is_waited_for_until_read_or_the_bound() -> None:
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, b"Traceback (most recent call last): ...\n")
        started = time.monotonic()
        _drained((write_end,), 0.2)
        assert 0.2 <= time.monotonic() - started < 1.0  # nobody read it: the bound
        os.read(read_end, 4096)
        started = time.monotonic()
        _drained((write_end,), 5.0)
        assert time.monotonic() - started < 0.1  # read: at once
    finally:
        os.close(read_end)
        os.close(write_end)


def test_files_and_closed_descriptors_are_not_waited_for(tmp_path) -> None:
    with open(tmp_path / "out.txt", "wb") as out:
        out.write(b"written")
        started = time.monotonic()
        _drained((out.fileno(),), 5.0)
    read_end, write_end = os.pipe()
    os.close(read_end)
    os.close(write_end)
    _drained((write_end,), 5.0)
    assert time.monotonic() - started < 0.5
