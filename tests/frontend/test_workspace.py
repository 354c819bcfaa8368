"""The workspace (unicoll.workspace): what it lends, when it takes memory back, its bound; and
the MoE step on rows large enough to go through it, on gloo and mpi, while everything the
workspace could confuse changes from step to step. The MoE steps run in the session's shared
worlds of 2 ranks (helpers/several.py)."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
import torch

import unicoll as uc
from helpers.several import SESSION, Case, share
from unicoll import runtime
from unicoll.backends.host import host_rows, row_bytes
from unicoll.workspace import FROM_BYTES, IDLE_LOANS, WINDOW, Workspace

# -- the workspace alone ---------------------------------------------------------------------


def test_a_buffer_given_back_serves_the_next_loan_and_a_lent_one_never_does() -> None:
    ws = Workspace(max_bytes=1 << 24)
    first = ws.lend(3000)
    second = ws.lend(3000)
    assert first is not second and not np.shares_memory(first, second)
    ws.give_back(first)
    assert ws.lend(2000) is first
    assert ws.lend(2000) is not second  # still lent


def test_the_bound_drops_the_oldest_buffers() -> None:
    ws = Workspace(max_bytes=3 << 16)
    buffers = []
    for size in (1, 2, 3, 4):  # one at a time, each too large for the ones kept before it
        buffers.append(ws.lend(size << 16))
        ws.give_back(buffers[-1])
    assert ws.bound == 4 << 16 and ws.kept_bytes == 4 << 16  # the newest; the three before went
    assert ws.lend(3 << 16) is buffers[-1]


def test_the_bound_follows_the_most_lent_at_once_and_comes_back_down() -> None:
    ws = Workspace(max_bytes=1 << 16)
    step = [ws.lend(1 << 20) for _ in range(3)]  # a step that needs 3 MiB at once
    for buffer in step:
        ws.give_back(buffer)
    assert ws.bound == 3 << 20 and ws.kept_bytes == 3 << 20  # all kept for the next step
    again = [ws.lend(1 << 20) for _ in range(3)]
    assert all(any(a is b for b in step) for a in again)  # the next step faults nothing in
    for buffer in again:
        ws.give_back(buffer)
    for _ in range(WINDOW):  # steps of one loan at a time: the peak leaves the window
        ws.give_back(ws.lend(1 << 10))
    assert ws.bound == 1 << 16 and ws.kept_bytes == 1 << 16  # the one buffer those loans use, of their size


_LARGE = 3 << 23
"""A step of 3 loans of 8 MiB at once: past the bound of the tests below (buffers made, never touched)."""


def _large_step(ws: Workspace) -> None:
    """Lend :data:`_LARGE` at once, then give it all back: the workspace keeps it for the next step."""
    step = [ws.lend(_LARGE // 3) for _ in range(3)]
    for buffer in step:
        ws.give_back(buffer)
    assert ws.kept_bytes == _LARGE > ws.max_bytes


@pytest.mark.parametrize("small", [FROM_BYTES // 8, 2 * FROM_BYTES], ids=["below FROM_BYTES", "above FROM_BYTES"])
def test_smaller_steps_bring_the_kept_bytes_back_under_the_bound(small: int) -> None:
    """After a large step, WINDOW smaller ones (host rows as the backends make them, dropped at
    once as a step's results are): the workspace keeps no more than its bound again. Before,
    rows below FROM_BYTES never counted, and larger ones were lent the large step's buffers,
    whose size then stood as the peak: the large step's 24 MiB stayed."""
    ws = Workspace(max_bytes=4 << 20)
    _large_step(ws)
    like = np.empty((0, 1024), np.float32)
    for _ in range(WINDOW):
        host_rows(like, small // row_bytes(like), ws)
    assert ws.bound == ws.max_bytes and ws.kept_bytes <= ws.max_bytes


def test_a_small_loan_is_not_handed_a_large_buffer() -> None:
    """Before, a loan took the smallest kept buffer large enough, however large: a small step
    after a large one held the large step's buffers, and counted their size as its peak."""
    ws = Workspace(max_bytes=4 << 20)
    _large_step(ws)
    small = ws.lend(FROM_BYTES)
    assert small.nbytes == FROM_BYTES and ws.kept_bytes == _LARGE  # a new buffer of its own size
    assert ws.lend(_LARGE // 3).nbytes == _LARGE // 3  # a loan of the large step's size gets one of them


def test_a_large_steps_buffers_go_once_smaller_steps_follow_even_under_the_bound() -> None:
    """The large step's 24 MiB fit under a bound of 256 MiB, and a small loan never takes one of
    them: before, they stayed kept until finalize() (a training loop's resident memory grew by
    its largest step for good). A buffer the smaller steps use stays."""
    ws = Workspace(max_bytes=256 << 20)
    step = [ws.lend(_LARGE // 3) for _ in range(3)]
    for buffer in step:
        ws.give_back(buffer)
    small = ws.lend(FROM_BYTES)
    ws.give_back(small)
    for _ in range(IDLE_LOANS - 1):
        assert ws.kept_bytes == _LARGE + FROM_BYTES  # still kept for a step of that size
        again = ws.lend(FROM_BYTES)
        assert again is small
        ws.give_back(again)
    ws.give_back(ws.lend(FROM_BYTES))
    assert ws.kept_bytes == FROM_BYTES  # no loan took the large ones over the last IDLE_LOANS loans


def test_a_loan_dropped_unreturned_stops_counting_toward_the_bound() -> None:
    ws = Workspace(max_bytes=1 << 16)
    dropped = ws.lend(1 << 20)  # a Task never waited for
    del dropped
    gc.collect()
    kept = ws.lend(1 << 20)
    assert ws.bound == kept.nbytes  # not both: the first is garbage
    ws.clear()
    assert ws.bound == 0


@pytest.mark.parametrize("make_view", ["numpy slice", "tensor", "tensor view", "numpy of tensor"])
def test_a_result_comes_back_only_when_nothing_made_from_it_is_alive(make_view: str) -> None:
    ws = Workspace(max_bytes=1 << 24)
    result = ws.lend_until_freed(1 << 20)
    result[:] = 7
    if make_view == "numpy slice":
        view = result[10:20]
    elif make_view == "tensor":
        view = torch.from_numpy(result)
    elif make_view == "tensor view":
        view = torch.from_numpy(result).view(torch.int32)[5:]
    else:
        view = torch.from_numpy(result).numpy()[3:]
    del result
    gc.collect()
    assert ws.kept_bytes == 0
    taken = ws.lend(1 << 20)  # a new buffer: the result's is still in use
    taken[:] = 0
    assert int(np.asarray(view).view(np.uint8)[0]) == 7
    del view
    gc.collect()
    assert ws.kept_bytes >= 1 << 20


def test_a_cleared_workspace_keeps_nothing_given_back_later() -> None:
    ws = Workspace(max_bytes=1 << 24)
    result, lent = ws.lend_until_freed(1 << 16), ws.lend(1 << 16)
    ws.clear()
    ws.give_back(lent)
    del result
    gc.collect()
    assert ws.kept_bytes == 0


def test_threads_never_share_a_buffer() -> None:
    ws, errors = Workspace(max_bytes=1 << 22), []

    def work(mark: int) -> None:
        for _ in range(300):
            buffer = ws.lend(1 << 12)
            buffer[:64] = mark
            if not (buffer[:64] == mark).all():
                errors.append(mark)
            ws.give_back(buffer)
            kept = ws.lend_until_freed(1 << 12)
            kept[:8] = mark
            del kept

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and ws.kept_bytes <= ws.max_bytes


# -- the MoE step through it, on 2 ranks ----------------------------------------------------

_TOKENS, _HIDDEN = 1024, 256
"""1024 tokens x 256 float32 x top-2: 2 MiB of dispatched rows, past FROM_BYTES."""


def _routing(rng: np.random.Generator, tokens: int, k: int, experts: int) -> np.ndarray:
    ids = rng.random((tokens, experts)).argsort(axis=1)[:, :k]
    ids[rng.random(ids.shape) < 0.05] = -1  # some slots dropped
    return ids


def _steps(rank: int) -> list[str]:
    """Steps whose routing, sizes, dtypes, libraries and groups change every time, two of them
    in flight at once, results of earlier steps kept: each checked against the reference."""
    assert _TOKENS * 2 * _HIDDEN * 4 >= FROM_BYTES
    world, failures, kept = uc.get_world_size(), [], []
    pair = uc.new_group([0, 1])
    for step in range(8):
        rng = np.random.default_rng(step)
        k, experts_per_rank = (2, 4) if step % 2 else (3, 2)
        tokens = _TOKENS + 37 * step
        hidden = _HIDDEN // (1 + step % 3)
        capacity = None if step % 4 else tokens // 3
        dtype = (np.float32, np.float64, np.float32, np.int32)[step % 4]
        library = "numpy" if step % 3 == 0 else "torch"
        group = pair if step % 2 else None
        every = [rng.integers(0, 9, (tokens, hidden)).astype(dtype) for _ in range(world)]
        ids = [_routing(rng, tokens, k, world * experts_per_rank) for _ in range(world)]
        weights = [rng.choice([0.5, 1.0, 2.0], (tokens, k)).astype(np.float32) for _ in range(world)]
        weighted = dtype != np.int32
        received, _ = uc.reference.moe_dispatch(every, ids, experts_per_rank, capacity)
        expected = uc.reference.moe_combine(
            [r * 3 for r in received], ids, experts_per_rank, weights if weighted else None, capacity
        )
        as_lib = torch.from_numpy if library == "torch" else np.asarray
        x, w = as_lib(every[rank]), as_lib(weights[rank]) if weighted else None
        tasks = [
            uc.moe.dispatch(
                x,
                as_lib(ids[rank]),
                w,
                experts_per_rank=experts_per_rank,
                group=group,
                capacity=capacity,
                sync_op=False,
            )  # fmt: skip
            for _ in range(2)
        ]
        for task in reversed(tasks):
            rows, _, handle = task.wait()
            if not np.array_equal(np.asarray(rows), received[rank]):
                failures.append(f"step {step}: dispatch")
            combined = uc.moe.combine(rows * 3, handle)
            if not np.array_equal(np.asarray(combined), expected[rank]):
                failures.append(f"step {step}: combine")
            kept.append((rows, received[rank]))
    for n, (rows, want) in enumerate(kept):  # no later step reused a result's memory
        if not np.array_equal(np.asarray(rows), want):
            failures.append(f"result {n} changed after it was returned")
    return failures


def _gradients(rank: int) -> list[str]:
    """dispatch's backward (a combine without weights) and combine's autograd on rows through
    the workspace: identity experts, so d(sum(out * g))/dx = g times each token's kept slots
    weighed, and d/dw = g . x for each kept slot."""
    world, failures = uc.get_world_size(), []
    for capacity in (None, 300):
        rng = np.random.default_rng([rank, capacity or 0])
        ids = torch.from_numpy(_routing(rng, _TOKENS, 2, 4 * world))
        x = torch.from_numpy(rng.standard_normal((_TOKENS, _HIDDEN), dtype=np.float32)).requires_grad_()
        w = torch.rand(_TOKENS, 2, dtype=torch.float64).requires_grad_()
        g = torch.from_numpy(rng.standard_normal((_TOKENS, _HIDDEN), dtype=np.float32))
        rows, _, handle = uc.moe.dispatch(x, ids, w, experts_per_rank=4, capacity=capacity)
        (uc.moe.combine(rows, handle) * g).sum().backward()
        kept = torch.from_numpy(handle.routing.kept)
        want_x = (g * (w.detach() * kept).sum(1, keepdim=True)).float()
        want_w = (g * x.detach()).sum(1, keepdim=True).double() * kept
        if not torch.allclose(x.grad, want_x, rtol=1e-5, atol=1e-5):
            failures.append(f"capacity {capacity}: x.grad")
        if not torch.allclose(w.grad, want_w, rtol=1e-4, atol=1e-4):
            failures.append(f"capacity {capacity}: w.grad")
    return failures


def _kept_after_smaller_steps(rank: int) -> list[int]:
    """A MoE step past the workspace's bound (lowered to 8 MiB here, so the step needs only 8 MiB
    of dispatched rows), then WINDOW steps below FROM_BYTES; again, then WINDOW steps above it
    but within the bound. The workspace's kept bytes after each large step and after each run
    of smaller steps (results dropped at once, as a training loop drops a step's rows)."""
    workspace = runtime.state("test").backend.workspace
    default, workspace.max_bytes = workspace.max_bytes, 8 << 20
    rng, kept = np.random.default_rng(rank), []
    try:
        for smaller in (64, 768):  # 128 KiB and 1.5 MiB of dispatched rows
            for tokens, steps in ((4096, 1), (smaller, WINDOW)):
                x = np.ones((tokens, 256), np.float32)
                ids = rng.integers(0, 2 * uc.get_world_size(), (tokens, 2))
                for _ in range(steps):
                    rows, _, handle = uc.moe.dispatch(x, ids, experts_per_rank=2)
                    uc.moe.combine(rows, handle)
                kept.append(workspace.kept_bytes)
    finally:
        workspace.max_bytes = default
    return kept


STEPS = {backend: share(backend, 2, [Case("workspace: steps", _steps)]) for backend in ("gloo", "mpi")}
KEPT = {backend: share(backend, 2, [Case("workspace: smaller steps", _kept_after_smaller_steps)])
        for backend in ("gloo", "mpi")}  # fmt: skip
GRADIENTS = share("gloo", 2, [Case("workspace: gradients", _gradients)])


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_moe_steps_through_the_workspace_match_the_reference(backend: str) -> None:
    assert SESSION.results(STEPS[backend], "workspace: steps") == [[], []]


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_smaller_moe_steps_bring_the_kept_bytes_back_under_the_bound(backend: str) -> None:
    """Before, steps below FROM_BYTES never trimmed the workspace, and larger ones were lent the
    large step's buffers: its rows stayed kept until finalize()."""
    for large, small, large_again, larger in SESSION.results(KEPT[backend], "workspace: smaller steps"):
        assert large > 8 << 20 and large_again > 8 << 20  # kept for the next step of that size
        assert small <= 8 << 20 and larger <= 8 << 20


def test_moe_gradients_through_the_workspace() -> None:
    assert SESSION.results(GRADIENTS, "workspace: gradients") == [[], []]
