"""One rank misbehaves; every rank prints what it saw as one JSON line. Run by test_faults.py:

    unicoll run -n 2 tests/faults/inject.py FAULT

FAULT is one of: mismatch-checked, mismatch-unchecked, peer-exits, peer-absent,
peer-absent-async. Each rank reports the error it got (type, message) and how long after the
faulty call it came; the misbehaving rank reports what it did instead.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

import unicoll as uc


def report(**fields: object) -> None:
    print(json.dumps({"rank": uc.get_rank(), **fields}), flush=True)


def timed(call) -> None:
    start = time.monotonic()
    try:
        call()
    except Exception as exc:  # reported to the test, which asserts on it
        report(error=type(exc).__name__, message=str(exc), seconds=round(time.monotonic() - start, 3))
    else:
        report(error=None, seconds=round(time.monotonic() - start, 3))


def main(fault: str) -> None:
    uc.init("gloo")
    rank = uc.get_rank()
    x = np.arange(8, dtype=np.float32).reshape(4, 2)
    uc.alltoall_single(None, x)  # the world works before the fault
    if fault.startswith("mismatch"):
        # rank 0 sends 1 row to expert 1 of rank 1, but rank 1 expects 2 from it
        local = [[1, 2, 0, 1], [1, 1, 1, 1]][rank]
        glob = [[1, 2, 1, 1], [0, 2, 1, 1]][rank]
        timed(lambda: uc.global_scatter(x, local, glob))
    elif fault == "peer-exits":
        if rank == 1:
            report(action="exits")
            os._exit(0)
        time.sleep(0.5)
        timed(lambda: uc.alltoall_single(None, x))
        timed(lambda: uc.alltoall_single(None, x))  # the next operator fails too
    elif fault.startswith("peer-absent"):
        if rank == 1:
            report(action="sleeps")
            time.sleep(float(os.environ["UNICOLL_TIMEOUT"]) + 3)
            return
        if fault == "peer-absent-async":
            task = uc.alltoall_single(None, x, sync_op=False)
            timed(lambda: task.wait(timeout=2))
        else:
            timed(lambda: uc.all_gather(None, x))
    else:
        raise SystemExit(f"unknown fault {fault!r}")


if __name__ == "__main__":
    main(sys.argv[1])
