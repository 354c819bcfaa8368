"""A one-way signal between processes on one machine, through a file: for tests that must
order what the ranks of a world do where no collective can (a second thread's, say, while an
operator in progress refuses every other call).

The test process names the signal when it builds a case (:func:`signal_path`); one rank
:func:`send`s it, the others :func:`wait_for` it. No timing is assumed: a waiting rank waits
until the signal comes, up to a deadline that only a broken test reaches.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile
import time

DEADLINE_S = 120.0
"""How long :func:`wait_for` waits before it gives up (the test failed elsewhere)."""


@functools.cache
def _folder() -> str:
    folder = tempfile.mkdtemp(prefix="unicoll-signals-")
    atexit.register(shutil.rmtree, folder, True)
    return folder


def signal_path(name: str) -> str:
    """The path of the signal ``name``, in a folder this process made (and removes at its exit)."""
    return os.path.join(_folder(), name)


def send(path: str) -> None:
    """Send the signal at ``path`` (once: a second send is a test's error)."""
    with open(path, "x"):
        pass


def wait_for(path: str) -> None:
    """Return once the signal at ``path`` was sent; TimeoutError after :data:`DEADLINE_S`."""
    deadline = time.monotonic() + DEADLINE_S
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no signal at {path} after {DEADLINE_S} s")
        time.sleep(0.005)
