"""A rank gives up on a gloo transfer and exits, and gloo's worker thread ends that transfer while
the interpreter shuts down; run by tests/backends/test_gloo_workers.py as both ranks of a world of
2 (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set, no launcher), with GIVEN_UP_GO naming a path
that does not exist yet:

    python tests/faults/given_up.py

Rank 0 issues an ``all_reduce``, gives up at its ``wait(timeout=...)`` (``CollectiveTimeoutError``)
and ends. Its last two exit handlers, after unicoll's, are C functions, so no Python code runs
from them to the interpreter's shutdown: the first makes the directory GIVEN_UP_GO, the second
keeps the interpreter's lock for a while (libc's ``usleep`` through ``ctypes.PyDLL``, which does
not release it). Rank 1 calls the ``all_reduce`` once that directory exists, so rank 0's gloo
worker completes the transfer in that while and, where it frees the transfer's tensors, waits for
the lock: it gets it only once the interpreter has begun to shut down, where a thread that takes
it is ended, and the process aborts (SIGABRT, ``terminate called without an active exception``).
Without these handlers the same happens by chance when the transfer ends (gloo's timeout) in the
last milliseconds before the shutdown: in 7 of 24 runs of a rank that caught the timeout of a
synchronous call.
"""

import atexit
import ctypes
import functools
import os

GIVE_UP_S = 0.2  # rank 0's Task.wait(timeout=...)
HOLD_S = 1.0  # how long rank 0's last exit handler keeps the lock: rank 1's time to call
GO = os.environ["GIVEN_UP_GO"]

if os.environ["RANK"] == "0":  # registered before any module registers one: these run last
    atexit.register(functools.partial(ctypes.PyDLL(None).usleep, int(HOLD_S * 1e6)))
    atexit.register(functools.partial(os.mkdir, GO))

import time  # noqa: E402

import numpy as np  # noqa: E402

import unicoll as uc  # noqa: E402


def main() -> None:
    uc.init("gloo")
    uc.all_reduce(np.ones(4))  # the world works
    if uc.get_rank() == 1:
        deadline = time.monotonic() + 60
        while not os.path.exists(GO) and time.monotonic() < deadline:
            time.sleep(0.01)
        uc.all_reduce(np.ones(4))  # rank 0's worker completes its transfer while rank 0 shuts down
        return
    task = uc.all_reduce(np.ones(4), sync_op=False)
    try:
        task.wait(timeout=GIVE_UP_S)
    except uc.CollectiveTimeoutError:
        print("gave up", flush=True)


if __name__ == "__main__":
    main()
