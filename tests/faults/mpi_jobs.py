"""MPI jobs that let go of their transfers, or lose a rank; run by test_mpi_reliability.py as

    unicoll run --mpi -n 2 tests/faults/mpi_jobs.py CASE...

Each rank prints what it checked or did as JSON lines. The cases:

- ``dropped``: every operator issued with ``sync_op=False`` and let go of before it completed
  (the task dropped at once, an exception between issuing and waiting, a wait that timed out, a
  synchronous call that timed out, a task pending across ``finalize()`` and ``init()``), with
  one rank late so that the transfers are still in flight, and new arrays that take the freed
  memory: those must keep their values, the calls that follow must return the right results,
  and nothing may stay in flight at the end.
- ``zero-bytes``: every operator on rows of zero bytes (torch tensors of shape (rows, 0), and
  numpy arrays).
- ``raise``, ``exit``, ``interrupt``: rank 1 raises ``KeyError``, calls ``sys.exit(3)`` or gets
  SIGINT while rank 0 waits for it in ``all_reduce``.
- ``exit-early``, ``exit-early-0``, ``killed-early``: rank 1 ends before MPI starts (``sys.exit(3)``,
  ``sys.exit(0)``, SIGKILL) while rank 0 starts it.

Rank 1 reports the wall-clock time of its fault (``at``), so the test can time the job's end.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import time
from collections.abc import Callable

import numpy as np
import reporting  # tests/faults/reporting.py, beside this script

import unicoll as uc

ROUNDS = 3  # of each operator dropped in each way; 6 of 6 runs crashed at 4 KB on a04b29f
ROWS = 512  # 4 KiB of float64 per rank and call


def report(**fields: object) -> None:
    rank = uc.get_rank() if uc.is_initialized() else int(os.environ.get("PMI_RANK", "-1"))
    reporting.write(rank, fields)


NOISE: list[object] = []
"""Arrays of the transfers' sizes, made after each drop and kept until the next: they take the
memory just freed, which a transfer that lost its buffers then writes into."""


def churn() -> None:
    """Collect the youngest objects (a dropped task is in a reference cycle, collected only by
    the collector; a full sweep takes 60 ms with torch loaded) and replace the arrays in
    :data:`NOISE` with new ones."""
    import torch

    gc.collect(0)
    NOISE[:] = [make(shape, -1.0) for make in (np.full, torch.full) for shape in [(ROWS, 1)] * 4 + [(ROWS, 16)] * 2]


def operators(rank: int) -> list[Callable[[], uc.Task]]:
    """Every operator, issued with sync_op=False on fresh arrays (torch and numpy, bfloat16)."""
    import torch

    world = uc.get_world_size()
    x = torch.full((ROWS, 1), float(rank + 1), dtype=torch.float64)
    counts = np.full(2 * world, ROWS // (2 * world))
    topk = torch.arange(2 * ROWS).reshape(ROWS, 2) % (2 * world)
    return [
        lambda: uc.all_reduce(x.clone(), sync_op=False),
        lambda: uc.all_reduce(np.full(ROWS, 1.0), "max", sync_op=False),
        lambda: uc.all_reduce(torch.ones(ROWS, dtype=torch.bfloat16), sync_op=False),
        lambda: uc.alltoall_single(None, x.clone(), sync_op=False),
        lambda: uc.all_gather(None, torch.ones(ROWS + rank, 1), sync_op=False),
        lambda: uc.all_gather([torch.empty(ROWS, 1) for _ in range(world)], torch.ones(ROWS, 1), sync_op=False),
        lambda: uc.reduce_scatter(None, x.clone(), sync_op=False),
        lambda: uc.broadcast(x.clone(), 0, sync_op=False),
        lambda: uc.global_scatter(x.clone(), counts, counts, sync_op=False, use_calc_stream=False),
        lambda: uc.global_scatter(x.repeat(1, 16), counts, counts, sync_op=False, use_calc_stream=False),  # fused
        lambda: uc.moe.dispatch(x.clone(), topk, experts_per_rank=2, sync_op=False),
    ]


def check_world(rank: int, case: str) -> None:
    """Synchronous calls after the drops: their results, against what every rank sends."""
    world = uc.get_world_size()
    total = uc.all_reduce(np.full((ROWS, 3), float(rank + 1))).tolist()
    gathered = uc.all_gather(None, np.full((rank + 1, 2), float(rank))).tolist()
    expected = [[float(r)] * 2 for r in range(world) for _ in range(r + 1)]
    report(case=case, ok=total == [[world * (world + 1) / 2] * 3] * ROWS and gathered == expected)


def drop_at_once(issue: Callable[[], uc.Task]) -> None:
    issue()


def raise_before_waiting(issue: Callable[[], uc.Task]) -> None:
    try:
        task = issue()
        raise ValueError(f"the step failed with {task} in flight")
    except ValueError:
        pass


def wait_too_briefly(issue: Callable[[], uc.Task]) -> None:
    try:
        issue().wait(timeout=0)
    except uc.CollectiveTimeoutError:
        pass


def no_write_after_free(rank: int) -> None:
    """Each operator, its task and arrays let go of at once while rank 1 is late; new arrays of
    the same sizes (:func:`churn`) then take the memory freed. On rank 0, whose transfer cannot
    complete without rank 1's rows, MPI writes the result once rank 1 comes: into memory it must
    still own, not into the new arrays."""
    import torch

    world = uc.get_world_size()
    counts = np.full(2 * world, ROWS // (2 * world))
    issues = {  # none exchanges sizes first, which would wait for rank 1 before the transfer is issued
        "all_reduce": lambda x: uc.all_reduce(x, sync_op=False),
        "all_reduce numpy": lambda x: uc.all_reduce(x.numpy(), sync_op=False),
        "alltoall_single": lambda x: uc.alltoall_single(None, x, sync_op=False),
        "all_gather": lambda x: uc.all_gather([torch.empty_like(x) for _ in range(world)], x, sync_op=False),
        "reduce_scatter": lambda x: uc.reduce_scatter(None, x, sync_op=False),
        "broadcast": lambda x: uc.broadcast(x, 1, sync_op=False),  # from rank 1: rank 0 receives
        "global_scatter": lambda x: uc.global_scatter(x, counts, counts, sync_op=False, use_calc_stream=False),
        "global_scatter fused": lambda x: uc.global_scatter(
            x.repeat(1, 16), counts, counts, sync_op=False, use_calc_stream=False
        ),
    }
    for name, issue in issues.items():
        if rank == 1:
            time.sleep(0.1)
        issue(torch.full((ROWS, 1), float(rank + 1), dtype=torch.float64))
        churn()
        for _ in range(3):  # rank 1 has come: the transfer completes
            uc.all_reduce(np.zeros(1))
        report(case="no write after free", op=name, clean=all(bool((noise == -1).all()) for noise in NOISE))


def dropped(rank: int) -> None:
    """Tasks let go of before they completed, in every way; the world is checked after each way.
    The ranks take turns at coming late, so that the other's transfer is still in flight."""
    ways = {
        "dropped at once": drop_at_once,
        "an exception between issuing and waiting": raise_before_waiting,
        "a wait that timed out": wait_too_briefly,
    }
    for case, let_go in ways.items():
        for turn, issue in enumerate(operators(rank) * ROUNDS):
            if turn % 2 == rank:
                time.sleep(0.005)
            let_go(issue)
            churn()
        check_world(rank, case)

    uc.finalize()  # a synchronous call that times out: its transfer completes later, when the peer calls
    uc.init(timeout=0.2)
    if rank == 1:
        time.sleep(0.5)
    try:  # rank 0 times out; rank 1 returns, while rank 0 drives MPI's progress in the next init
        result = uc.all_reduce(np.full((ROWS, 1), float(rank + 1))).tolist() == [[3.0]] * ROWS
    except uc.CollectiveTimeoutError:
        result = "timed out"
    churn()
    report(case="a synchronous call that timed out", result=result)
    uc.finalize()
    uc.init()

    if rank == 0:  # a task pending across finalize() and init()
        time.sleep(0.02)
    tasks = [issue() for issue in operators(rank)[:4]]
    uc.finalize()
    churn()
    uc.init()
    try:
        tasks[0].wait()
        stale = "returned"
    except ValueError as exc:
        stale = str(exc)
    report(case="a task of the ended session", stale=stale)
    check_world(rank, "pending across finalize and init")

    from unicoll.backends.mpi import inflight  # every transfer let go of has completed: none is kept

    for _ in range(3):
        uc.all_reduce(np.zeros(1))
    report(case="still in flight at the end", count=inflight.reap())


def zero_byte_calls(rank: int, make: Callable[[int], object]) -> dict[str, Callable[[], object]]:
    """Every operator on rows of zero bytes made by ``make(rows)``."""
    ones = [1, 1, 1, 1]
    return {
        "all_gather": lambda: uc.all_gather(None, make(2)),
        "all_gather uneven": lambda: uc.all_gather(None, make(rank + 1)),
        "all_gather list": lambda: uc.all_gather([make(2), make(2)], make(2)),
        "alltoall_single": lambda: uc.alltoall_single(None, make(4)),
        "all_reduce": lambda: uc.all_reduce(make(2)),
        "reduce_scatter": lambda: uc.reduce_scatter(None, make(4)),
        "broadcast": lambda: uc.broadcast(make(2), 0),
        "global_scatter": lambda: uc.global_scatter(make(4), ones, ones),
        "global_gather": lambda: uc.global_gather(make(4), ones, ones),
    }


def zero_bytes(rank: int) -> None:
    """Every operator on torch rows of zero bytes (and numpy's, for comparison): each result's
    shape, or its error."""
    import torch

    for library, make in (("torch", lambda rows: torch.empty(rows, 0)), ("numpy", lambda rows: np.empty((rows, 0)))):
        shapes: dict[str, object] = {}
        for name, call in zero_byte_calls(rank, make).items():
            try:
                out = call()
                shapes[name] = [list(o.shape) for o in out] if isinstance(out, list) else list(out.shape)
            except Exception as exc:  # reported to the test, which asserts on it
                shapes[name] = f"{type(exc).__name__}: {exc}".splitlines()[0]
        report(case="zero-bytes", library=library, shapes=shapes)


def fails(rank: int, case: str) -> None:
    """Rank 1 fails the way ``case`` says while rank 0 waits for it in all_reduce."""
    x = np.ones(4)
    uc.all_reduce(x)  # the world works before the fault
    if rank == 0:
        report(action="waits in all_reduce")
        uc.all_reduce(x)
        report(action="returned")  # not reached: the job ends first
        return
    time.sleep(0.3)  # rank 0 is in all_reduce by then, and its report on its way
    report(action=case, at=time.time())
    if case == "raise":
        raise KeyError("the expert table has no entry 7")
    if case == "exit":
        sys.exit(3)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(10)  # not reached: KeyboardInterrupt


def early(case: str) -> None:
    """Rank 1 ends before MPI starts, while rank 0 starts it, whose start waits for every rank.
    ``killed-early`` waits a second first, so that rank 0 is in MPI's start by then (MPICH's
    hydra stops a job when a rank is killed, even before MPI started)."""
    if os.environ.get("PMI_RANK") == "1":
        time.sleep(1 if case == "killed-early" else 0)
        report(action=case, at=time.time())
        if case == "killed-early":
            os.kill(os.getpid(), signal.SIGKILL)
        sys.exit(3 if case == "exit-early" else 0)
    uc.init()
    report(action="returned from init")  # not reached


def main(cases: list[str]) -> None:
    if "-early" in cases[0]:
        early(cases[0])
        return
    uc.init()
    rank = uc.get_rank()
    for case in cases:
        if case == "dropped":
            no_write_after_free(rank)
            dropped(rank)
        elif case == "zero-bytes":
            zero_bytes(rank)
        else:
            fails(rank, case)
    report(action="done")


if __name__ == "__main__":
    main(sys.argv[1:])
