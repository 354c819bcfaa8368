"""One rank misbehaves; every rank prints what it saw as one JSON line. Run by test_faults.py:

    unicoll run -n 2 tests/faults/inject.py FAULT          (gloo: UNICOLL_BACKEND=gloo)
    unicoll run --mpi -n 2 tests/faults/inject.py FAULT    (mpi)

FAULT is one of: mismatch-checked, mismatch-unchecked, peer-exits, peer-killed, peer-absent,
peer-absent-async, poll, init, init-absent, raises-mid-step:LIB, exits-mid-step:LIB (LIB: paddle or
jax), raises-beside-thread. Each rank reports the error it got (type, message)
and how long after the faulty call it came; the misbehaving rank reports what it did instead.
``init`` only starts the backend, timed (for worlds in which some rank never starts);
``init-absent`` does so too, but rank 1 never calls ``init`` (it starts MPI, on mpi).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import reporting  # tests/faults/reporting.py, beside this script

import unicoll as uc

if os.environ.get("UNICOLL_BACKEND") != "mpi":  # mpi's ranks move numpy arrays, without torch
    import torch.distributed  # noqa: F401  (imported before the clock starts: init times the rendezvous, not imports)

BIG_ROWS = 64 * 2**20 // 4096  # rows of 1024 float32: 64 MiB
ATTEMPTS = 50  # calls of peer-killed before rank 1 catches one in the middle of its transfer


def report(**fields: object) -> None:
    rank = uc.get_rank() if uc.is_initialized() else int(os.environ.get("RANK", os.environ.get("PMI_RANK", "-1")))
    reporting.write(rank, fields)


def timed(call) -> object:
    """``call()``'s result; reports its error (type and message) or None, the seconds it took,
    and the wall-clock time it ended."""
    start = time.monotonic()
    try:
        result = call()
    except Exception as exc:  # reported to the test, which asserts on it
        report(error=type(exc).__name__, message=str(exc), seconds=round(time.monotonic() - start, 3), at=time.time())
        return None
    report(error=None, seconds=round(time.monotonic() - start, 3), at=time.time())
    return result


def mismatch_unchecked(rank: int, x: np.ndarray) -> None:
    """Without check mode: rank 1 expects 3 rows from rank 0, which sends 2, then 1 row, which
    is 1 fewer. Rank 1 reports the rows it got."""
    for expected in (3, 1):
        out_splits = [2, 2] if rank == 0 else [expected, 2]
        start = time.monotonic()
        try:
            rows = uc.alltoall_single(None, x, out_splits, [2, 2]).tolist()
        except Exception as exc:
            report(error=type(exc).__name__, message=str(exc), seconds=round(time.monotonic() - start, 3))
        else:
            report(error=None, expected=expected, rows=rows, seconds=round(time.monotonic() - start, 3))


def peer_killed(rank: int) -> None:
    """Rank 1 is SIGKILLed in the middle of a 64 MiB all-to-all, while rank 0's rows are on
    their way to it: it stops itself once the first of them land in its output while the call
    is still running (calls that completed first are repeated, up to ``ATTEMPTS``), and a
    child it forks kills it 0.2 s later. Rank 0 repeats the call until it fails."""
    big = np.zeros((BIG_ROWS, 1024), dtype=np.float32)
    if rank == 0:
        timed(lambda: [uc.alltoall_single(None, big) for _ in range(ATTEMPTS)])
        return
    out = np.full_like(big, -1.0)  # rank 0's rows (zeros) land in the first half, first row first
    for _ in range(ATTEMPTS):
        task = uc.alltoall_single(out, big, sync_op=False)
        while out[0, 0] == -1.0 and not task.is_completed():
            pass
        if not task.is_completed():
            break
        task.wait()
        out[0, 0] = -1.0
    report(action="killed", at=time.time() + 0.2)
    parent = os.getpid()
    if os.fork() == 0:
        time.sleep(0.2)
        os.kill(parent, signal.SIGKILL)
        os._exit(0)
    os.kill(parent, signal.SIGSTOP)
    time.sleep(60)  # not reached


def poll(rank: int, x: np.ndarray) -> None:
    """Rank 0 polls a call that rank 1 makes 1 s late, then waits for it."""
    if rank == 1:
        time.sleep(1)
        uc.alltoall_single(None, x)
        return
    task = uc.alltoall_single(None, x, sync_op=False)
    timed(lambda: task.wait(timeout=0))
    rows = timed(task.wait)
    report(rows=rows.tolist(), completed=task.is_completed())


def mid_step(rank: int, fault: str) -> None:
    """A top-2 MoE step on Paddle tensors or JAX arrays with gradients (``torch``: a top-4 step on
    torch tensors that sends each token once per rank; ``torch-static``: the same in the static
    mode): rank 1 raises (or exits) between dispatch and combine; rank 0 reports what its step
    (dispatch, combine, backward) got."""
    how, library = fault.split("-mid-step:")
    rng = np.random.default_rng(rank)
    x = rng.standard_normal((64, 8)).astype(np.float32)
    ids = rng.integers(0, 4, (64, 2))

    def fail() -> None:
        report(action=how)
        if how == "exits":
            os._exit(0)
        raise RuntimeError("rank 1 raises mid-step")

    if library in ("torch", "torch-static"):
        import torch

        os.environ["UNICOLL_MOE_ONCE"] = "1"
        every = torch.from_numpy(np.argsort(rng.random((64, 4)), axis=1))  # both ranks' experts: once per rank pays
        static = library == "torch-static"

        def step() -> None:
            xt = torch.tensor(x, requires_grad=True)
            if static:
                rows, _, handle = uc.moe.dispatch_static(xt, every, torch.ones(64, 4), experts_per_rank=2, capacity=64)
            else:
                rows, _, handle = uc.moe.dispatch(xt, every, torch.ones(64, 4), experts_per_rank=2)
            if rank == 1:
                fail()
            assert handle.once is not None
            combine = uc.moe.combine_static if static else uc.moe.combine
            combine(rows * 2.0, handle).sum().backward()
    elif library == "paddle":
        import paddle

        def step() -> None:
            xt = paddle.to_tensor(x, stop_gradient=False)
            rows, _, handle = uc.moe.dispatch(xt, paddle.to_tensor(ids), experts_per_rank=2)
            if rank == 1:
                fail()
            uc.moe.combine(rows * 2.0, handle).sum().backward()
    else:
        import jax

        def loss(xj):
            rows, _, handle = uc.moe.dispatch(xj, jax.device_put(ids.astype(np.int32)), experts_per_rank=2)
            if rank == 1:
                fail()
            return uc.moe.combine(rows, handle).sum()

        def step() -> None:
            jax.grad(loss)(jax.device_put(x))

    if rank == 1:
        step()
    else:
        timed(step)


def raises_beside_thread(rank: int, x: np.ndarray) -> None:
    """Rank 1 raises while a thread that is not a daemon runs (a ThreadPoolExecutor's, with a
    minute of work); rank 0 waits for it in all_reduce meanwhile, and lets the error it gets
    there end it."""
    if rank == 0:
        report(action="waits in all_reduce")
        uc.all_reduce(x)
        report(action="returned")  # not reached
        return
    time.sleep(0.3)  # rank 0 is in all_reduce by then
    ThreadPoolExecutor(1).submit(time.sleep, 60)
    report(action="raises", at=time.time())
    raise KeyError("the expert table has no entry 7")


def init_absent() -> None:
    """Rank 0 starts the backend while rank 1 runs, having started MPI on mpi, but never calls init."""
    if os.environ.get("RANK", os.environ.get("PMI_RANK")) == "1":
        if os.environ.get("UNICOLL_BACKEND") == "mpi":
            from mpi4py import MPI  # noqa: F401  (MPI_Init waits for every rank of the job)
        report(action="never calls init")
        time.sleep(float(os.environ["UNICOLL_TIMEOUT"]) + 1)
        return
    timed(uc.init)


def stay_away(done: str | None, seconds: float) -> None:
    """Sleep ``seconds``, or until the file ``done`` exists (checked every 50 ms) when given."""
    end = time.monotonic() + seconds
    while time.monotonic() < end and not (done and os.path.exists(done)):
        time.sleep(0.05)


def main(fault: str) -> None:
    if fault == "init":
        timed(uc.init)
        return
    if fault == "init-absent":
        init_absent()
        return
    uc.init()
    rank = uc.get_rank()
    x = np.arange(8, dtype=np.float32).reshape(4, 2) + 100 * rank
    uc.alltoall_single(None, x)  # the world works before the fault
    if fault == "mismatch-checked":
        # rank 0 sends 1 row to expert 1 of rank 1, but rank 1 expects 2 from it
        local = [[1, 2, 0, 1], [1, 1, 1, 1]][rank]
        glob = [[1, 2, 1, 1], [0, 2, 1, 1]][rank]
        timed(lambda: uc.global_scatter(x, local, glob))
    elif fault == "mismatch-unchecked":
        mismatch_unchecked(rank, x)
    elif fault == "peer-exits":
        if rank == 1:
            report(action="exits")
            os._exit(0)
        time.sleep(0.5)
        timed(lambda: uc.alltoall_single(None, x))
        timed(lambda: uc.alltoall_single(None, x))  # the next operator fails too
    elif fault == "peer-killed":
        peer_killed(rank)
    elif fault.startswith("peer-absent"):
        done = os.environ.get("INJECT_DONE")  # a file rank 0 makes once it has its error (the tests set it)
        if rank == 1:
            report(action="sleeps")
            stay_away(done, float(os.environ["UNICOLL_TIMEOUT"]) + 3)
            return
        if fault == "peer-absent-async":
            # the handshake (on by default) waits for the peer's record when the call is issued
            timed(lambda: uc.alltoall_single(None, x, sync_op=False).wait(timeout=2))
        else:
            timed(lambda: uc.all_gather(None, x))
        if done:
            open(done, "w").close()
    elif fault == "poll":
        poll(rank, x)
    elif fault.startswith(("raises-mid-step:", "exits-mid-step:")):
        mid_step(rank, fault)
    elif fault == "raises-beside-thread":
        raises_beside_thread(rank, x)
    else:
        raise SystemExit(f"unknown fault {fault!r}")


if __name__ == "__main__":
    main(sys.argv[1])
