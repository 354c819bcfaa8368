"""gloo's worker threads at the end of a session (unicoll.backends.torch.workers): finalize()
lets every worker finish before the program may exit.

Before, a training script that imported ``torch._dynamo`` (``torch.optim`` does) kept its gloo
process group alive after ``finalize()``; a worker that let go of the last transfer's tensors
after the interpreter began to shut down aborted the process (SIGABRT, ``terminate called
without an active exception``): examples/train_moe.py on 2 ranks failed 5 times in 40 runs.
The same crash came from a transfer given up on (a timeout caught), which gloo's worker ended
during the shutdown: finalize() now keeps such transfers, so the worker frees nothing then.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import unicoll as uc
from unicoll.backends.torch import workers
from unicoll.launch.local import free_port, world_env

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the workers' states are read from /proc")

GIVEN_UP = Path(__file__).parents[1] / "faults" / "given_up.py"


def _named_worker(spin: float, done: threading.Event, ids: list[str]) -> None:
    """A thread that names itself as gloo names its workers, runs for ``spin`` seconds, then sleeps."""
    ctypes.CDLL(None).prctl(15, b"pt_gloo_runloop", 0, 0, 0)  # PR_SET_NAME
    ids.append(str(threading.get_native_id()))
    end = time.monotonic() + spin
    while time.monotonic() < end:
        pass
    done.wait()


def test_settle_waits_for_a_running_worker_to_sleep() -> None:
    """(Workers of groups that earlier tests left to torch are asleep beside it.)"""
    done, ids = threading.Event(), []
    worker = threading.Thread(target=_named_worker, args=(0.3, done, ids))
    start = time.monotonic()
    worker.start()
    time.sleep(0.05)  # the worker has named itself and runs
    try:
        assert workers._workers()[ids[0]] in ("R", "S")  # R, or S while this thread held the GIL
        workers.settle(bound=5)
        waited = time.monotonic() - start
        assert 0.3 <= waited < 5, waited
        assert workers._workers()[ids[0]] == "S"
    finally:
        done.set()
        worker.join()


def test_settle_returns_at_once_without_workers() -> None:
    start = time.monotonic()
    workers.settle()
    assert time.monotonic() - start < workers.SETTLE_S / 2  # no wait for the bound


def workers_after_finalize(rank: int) -> list[str]:
    """The gloo workers' states after finalize() in a process that imported torch._dynamo while
    the session ran, which keeps the world's process group (and its workers) alive."""
    import torch
    import torch._dynamo  # noqa: F401

    for _ in range(50):
        uc.all_reduce(torch.ones(4))
    uc.finalize()
    return sorted(workers._workers().values())


def test_finalize_leaves_the_workers_asleep() -> None:
    """(Fresh interpreters: the suite's forkserver has Dynamo loaded already, tests/conftest.py.)"""
    for states in uc.testing.spawn(workers_after_finalize, 2, backend="gloo", start_method="spawn"):
        assert states == ["S", "S"]  # alive (torch keeps the group) and asleep, holding no transfer


def test_a_transfer_given_up_on_and_ended_at_exit_does_not_abort(tmp_path) -> None:
    """Rank 0 gives up on an all_reduce (CollectiveTimeoutError) and exits; rank 1 makes the call
    while rank 0 shuts down, so rank 0's gloo worker completes the transfer then
    (tests/faults/given_up.py). Rank 0 exits with 0; before, it aborted in every run (SIGABRT:
    the worker freed the transfer's tensors, the last reference to them, during the shutdown)."""
    port = free_port()
    env = {
        **os.environ,
        "GIVEN_UP_GO": str(tmp_path / "go"),
        "UNICOLL_TIMEOUT": "60",  # gloo's own timeout never ends the transfer: rank 1's call does
        "UNICOLL_CHECK": "0",
        "UNICOLL_HANDSHAKE": "0",  # a comparison before the call would wait for rank 1
        "UNICOLL_VERIFY": "0",  # and so would a check after it
    }
    ranks = [
        subprocess.Popen(
            [sys.executable, str(GIVEN_UP)],
            env={**env, **world_env(rank, 2, "127.0.0.1", port)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        outputs = [rank.communicate(timeout=90)[0] for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    assert "gave up" in outputs[0], outputs
    assert [rank.returncode for rank in ranks] == [0, 0], outputs
