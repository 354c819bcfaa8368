"""Each token sent once per destination rank (unicoll.backends.once, unicoll.eager.moe_once):
the layout simulated between ranks on the host, and moe.dispatch / combine / redispatch and
their gradients on real processes, once per rank against one row per slot (UNICOLL_MOE_ONCE=0)
bit for bit, on small integer values whose sums are exact in every dtype."""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest
import torch

import unicoll as uc
from helpers.gpu_backends import restart_on_the_device_path
from helpers.several import SESSION, Case, share
from helpers.sync_counter import SyncCounter
from unicoll.backends.layout import rank_major_to_expert_major
from unicoll.backends.once import PLAIN, incoming, outgoing, read_meta, weight_code
from unicoll.eager.once_choice import ONCE_ENV_VAR
from unicoll.routing import route

# -- the layout, simulated on the host -------------------------------------------------------


def _simulated(world: int, experts: int, k: int, row_bytes: int, seed: int, weighted: bool) -> None:
    """Every rank's once layout, the blocks 'sent' by concatenation: each receiver's expanded
    rows are the rows the plain form sends it, and its weights those of their slots."""
    rng = np.random.default_rng(seed)
    tokens = [int(rng.integers(0, 9)) for _ in range(world)]
    ids = [rng.integers(-1, world * experts, (t, k)) for t in tokens]
    x = [rng.integers(0, 256, (t, row_bytes), dtype=np.uint8) for t in tokens]
    w = [rng.random((t, k)).astype(np.float32) for t in tokens]
    code = weight_code("float32") if weighted else 0
    routes = [route(i, world * experts, None) for i in ids]
    sides = [
        outgoing(r.send_tokens, r.slot_rows, r.local_count, c, world, k, code, row_bytes) for c, r in enumerate(routes)
    ]
    for d in range(world):  # receiver d
        counts = np.stack([r.local_count.reshape(world, experts)[d] for r in routes])  # (W, E) from each source
        told = np.stack([[s.tokens_told[d], code] for s in sides])
        into = incoming(counts.sum(1), told, row_bytes)
        blocks = []
        for c, side in enumerate(sides):
            sent = x[c][side.gather] if side.gather.size else np.zeros((0, row_bytes), np.uint8)
            start = int(side.sent_at[d])
            block = sent[start : start + side.sent[d]].copy()
            if side.once[d]:
                firsts = np.concatenate([[0], np.cumsum(side.slots)])
                rows = slice(firsts[d], firsts[d + 1])
                meta = np.concatenate(
                    [side.positions[rows].view(np.uint8)]
                    + ([w[c].reshape(-1)[side.row_slot[rows]].view(np.uint8)] if weighted else [])
                )
                block.reshape(-1)[: meta.size] = meta
            assert block.shape[0] == into.received[c]
            blocks.append(block)
        received = np.concatenate(blocks) if blocks else np.zeros((0, row_bytes), np.uint8)
        order = rank_major_to_expert_major(counts)
        expansion = read_meta(into, received, order, -1, None)
        plain = np.concatenate([x[c][r.send_tokens[_rows_to(r, world, experts, d)]] for c, r in enumerate(routes)])
        assert np.array_equal(received[expansion.rows], plain[order])
        if weighted and expansion.weights is not None:
            slot_w = np.concatenate(
                [w[c].reshape(-1)[_slots_to(r, world, experts, d)] for c, r in enumerate(routes)]
            ).astype(np.float64)
            once_rows = np.concatenate([np.full(int(n), bool(o)) for n, o in zip(into.slots, into.once)])
            assert np.array_equal(expansion.weights[once_rows[order]], slot_w[order][once_rows[order]])


def _rows_to(r, world: int, experts: int, d: int) -> slice:
    firsts = np.concatenate([[0], np.cumsum(r.local_count.reshape(world, experts).sum(1))])
    return slice(firsts[d], firsts[d + 1])


def _slots_to(r, world: int, experts: int, d: int) -> np.ndarray:
    row_slot = np.empty(r.send_tokens.size, dtype=np.int64)
    kept = r.slot_rows < r.send_tokens.size
    row_slot[r.slot_rows[kept]] = np.flatnonzero(kept)
    return row_slot[_rows_to(r, world, experts, d)]


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize(("world", "experts", "k"), [(2, 2, 2), (3, 4, 8), (4, 1, 3), (2, 8, 8)])
def test_the_expanded_rows_are_the_plain_forms(seed: int, world: int, experts: int, k: int) -> None:
    _simulated(world, experts, k, row_bytes=64, seed=seed, weighted=seed % 2 == 0)


def test_the_examples_in_the_docstrings() -> None:
    import doctest

    from unicoll.backends import once
    from unicoll.eager import static_once

    assert doctest.testmod(once).failed == 0
    assert doctest.testmod(static_once).failed == 0


def test_a_mix_of_compiled_and_other_forms_is_refused() -> None:
    """What every rank heard: a compiled once step beside eager ranks (auto, off) is refused,
    naming both sides; compiled once everywhere is no eager agreement; no compiled rank, no error."""
    from unicoll.eager.once_choice import ALWAYS, AUTO, COMPILED, COMPILED_PLAIN, OFF, agreed_on, refuse_mixed

    def heard(*modes: int) -> np.ndarray:
        told = np.zeros((len(modes), 5), dtype=np.int64)
        told[:, 2] = modes
        return told

    with pytest.raises(uc.CrossRankMismatchError) as refused:
        refuse_mixed("moe.dispatch", heard(COMPILED, AUTO, OFF))
    assert str(refused.value) == (
        "moe.dispatch: ranks disagree: ranks [0] run it compiled to send each token once per rank; ranks [1, 2] run it "
        "eager; compile the step on every rank, or on none, with the same UNICOLL_MOE_ONCE"
    )
    with pytest.raises(uc.CrossRankMismatchError, match=r"ranks \[1\] run it compiled to send one row per slot"):
        refuse_mixed("moe.dispatch", heard(AUTO, COMPILED_PLAIN))
    for same in (COMPILED, COMPILED_PLAIN):
        refuse_mixed("moe.dispatch", heard(same, same))
        assert not agreed_on(heard(same, same))
    refuse_mixed("moe.dispatch", heard(ALWAYS, AUTO))
    assert agreed_on(heard(ALWAYS, AUTO)) and not agreed_on(heard(ALWAYS, OFF))


def test_a_bad_setting_is_refused_before_anything_is_sent(monkeypatch) -> None:
    monkeypatch.setenv(ONCE_ENV_VAR, "yes")
    uc.init("gloo")
    try:
        with pytest.raises(ValueError, match=r"moe.dispatch: \$UNICOLL_MOE_ONCE: expected 0, 1 or auto .*, got 'yes'"):
            uc.moe.dispatch(torch.ones(2, 4), torch.tensor([[0, 1], [1, 0]]), experts_per_rank=2)
        with pytest.raises(ValueError, match=r"moe.dispatch_static: \$UNICOLL_MOE_ONCE: expected 0, 1 or auto"):
            uc.moe.dispatch_static(torch.ones(2, 4), torch.tensor([[0, 1], [1, 0]]), experts_per_rank=2, capacity=2)
    finally:
        uc.finalize()


def test_a_pair_goes_plain_where_it_would_not_save_rows() -> None:
    """Four tokens, each once to rank 1 (no token shares it): the plain form, told as PLAIN."""
    ids = np.array([[2, 0], [3, 1], [2, 0], [3, 1]])
    r = route(ids, 4, None)
    out = outgoing(r.send_tokens, r.slot_rows, r.local_count, 0, 2, 2, 0, 64)
    assert out.once.tolist() == [False, False] and out.tokens_told.tolist() == [PLAIN, PLAIN]
    shared = route(np.array([[2, 3], [3, 2], [2, 3], [3, 2]]), 4, None)  # both slots of every token on rank 1
    out = outgoing(shared.send_tokens, shared.slot_rows, shared.local_count, 0, 2, 2, 0, 64)
    assert out.once.tolist() == [False, True] and out.sent.tolist() == [0, 1 + 4]  # a metadata row, 4 tokens
    assert out.bytes_sent(0, 64) == (5 * 64, 8 * 64)


# -- on real processes: once per rank against one row per slot ---------------------------------

_DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _scenarios(rank: int, world: int):
    """(name, x, ids, weights, experts, capacity) on this rank: zeros and ones, weights of 1 and
    2, so that every sum below stays an integer under 256, exact even in bfloat16."""
    rng = np.random.default_rng(rank + 10 * world)
    for dtype in _DTYPES:
        for k, experts in ((2, 2), (8, 4), (3, 1)):
            if k > world * experts:
                continue
            tokens = 0 if (rank == 1 and dtype == "float16") else 6 + rank
            ids = np.array([rng.permutation(world * experts)[:k] for _ in range(tokens)], dtype=np.int64).reshape(
                tokens, k
            )
            if tokens and k == 2:
                ids[0, 1] = -1  # a dropped slot
            if tokens and k == 3:
                ids[1, 2] = ids[1, 0]  # one expert twice in a token
            x = torch.from_numpy(rng.integers(0, 2, (tokens, 16)).astype(np.float32)).to(_DTYPES[dtype])
            weights = torch.from_numpy(rng.choice([1.0, 2.0], (tokens, k)).astype(np.float32)).to(_DTYPES[dtype])
            for capacity in (None, 2):
                yield (
                    f"{dtype} top-{k} E={experts} capacity={capacity}",
                    x,
                    torch.from_numpy(ids),
                    weights,
                    experts,
                    capacity,
                )
    # every token of rank 0 to rank 1's experts, none of rank 1's anywhere but rank 0
    elsewhere = (rank + 1) % world
    ids = torch.tensor([[2 * elsewhere, 2 * elsewhere + 1]] * 5)
    yield "all elsewhere", torch.ones(5, 16), ids, torch.full((5, 2), 2.0), 2, None
    dropped = ids.clone()
    dropped[0, 1] = -1
    yield "all elsewhere, a slot dropped, capacity 3", torch.ones(5, 16), dropped, torch.full((5, 2), 2.0), 2, 3
    # rank 0 without weights, the others with: each rank's rows weighed as its own dispatch said
    yield "rank 0 unweighted", torch.ones(5, 16), ids, None if rank == 0 else torch.full((5, 2), 2.0), 2, None


def _outcome(rows, out, x, w, handle, **more) -> dict:
    """What a step's comparison reads: its rows, result and gradients as lists, whether the once
    form was used, the bytes sent against one row per slot, and ``more``."""
    return {
        "rows": rows.detach().float().tolist(),
        "out": out.detach().float().tolist(),
        "x.grad": x.grad.float().tolist(),
        "w.grad": None if w is None else w.grad.float().tolist(),
        "once": handle.once is not None,
        "bytes": (handle.bytes_sent, handle.bytes_one_row_per_slot),
        **more,
    }


def _step(x, ids, weights, experts, capacity, once: str, sync_op: bool = True, count_reads: bool = False):
    """dispatch, redispatch and combine with the once form on or off; results and gradients,
    and with ``count_reads`` the host reads the step would make on a GPU
    (tests/helpers/sync_counter.py: only in a world of its own, whose session it outlives)."""
    os.environ[ONCE_ENV_VAR] = once
    try:
        x = x.clone().requires_grad_(x.is_floating_point())
        w = None if weights is None else weights.clone().requires_grad_()
        with SyncCounter() if count_reads else contextlib.nullcontext() as reads:
            got = uc.moe.dispatch(x, ids, w, experts_per_rank=experts, capacity=capacity, sync_op=sync_op)
            rows, rows_per_expert, handle = got if sync_op else got.wait()
            again = uc.moe.redispatch(x * 2, handle)
            scale = torch.cat([torch.full((n, 1), e + 1.0, dtype=rows.dtype) for e, n in enumerate(rows_per_expert)])
            out = uc.moe.combine((rows + again) * scale, handle, sync_op=sync_op)
            out = out if sync_op else out.wait()
            out.sum().backward()
        return _outcome(
            rows, out, x, w, handle, reads=reads.total if count_reads else None, rows_per_expert=rows_per_expert
        )
    finally:
        del os.environ[ONCE_ENV_VAR]


def once_against_plain(rank: int) -> dict:
    """Per scenario: whether the once form's rows, counts, result and gradients equal the plain
    form's exactly; and its bytes against one row per slot."""
    world = uc.get_world_size()
    report = {}
    for i, (name, x, ids, weights, experts, capacity) in enumerate(_scenarios(rank, world)):
        plain = _step(x, ids, weights, experts, capacity, "0")
        once = _step(x, ids, weights, experts, capacity, "1", sync_op=i % 3 != 0)
        same = all(plain[key] == once[key] for key in ("rows", "rows_per_expert", "out", "x.grad", "w.grad"))
        report[name] = (same, once["once"], plain["bytes"], once["bytes"])
    return report


def _static_step(x, ids, weights, experts, capacity, once: str, sync_op: bool = True, bound: int | None = None,
                 count_reads: bool = False):  # fmt: skip
    """dispatch_static, redispatch_static and combine_static with the once form on or off (on
    a device backend: with ``max_tokens_per_rank=bound``); with ``count_reads`` as _step's."""
    os.environ[ONCE_ENV_VAR] = once
    try:
        x = x.clone().requires_grad_(x.is_floating_point())
        w = None if weights is None else weights.clone().requires_grad_()
        with SyncCounter() if count_reads else contextlib.nullcontext() as reads:
            got = uc.moe.dispatch_static(x, ids, w, experts_per_rank=experts, capacity=capacity, sync_op=sync_op,
                                         max_tokens_per_rank=bound)  # fmt: skip
            rows, counts, handle = got if sync_op else got.wait()
            again = uc.moe.redispatch_static(x * 2, handle)
            scale = torch.arange(1.0, experts + 1, dtype=rows.dtype).reshape(experts, 1, 1)
            out = uc.moe.combine_static((rows + again) * scale + 1, handle, sync_op=sync_op)  # + 1: padding stays out
            out = out if sync_op else out.wait()
            out.sum().backward()
        drops = (counts.tolist(), handle.received_before_drop.tolist(), handle.sent_before_drop.tolist())
        return _outcome(rows, out, x, w, handle, counts=drops, reads=reads.total if count_reads else None)
    finally:
        del os.environ[ONCE_ENV_VAR]


def static_once_against_plain(rank: int) -> dict:
    """The static mode, per scenario (a capacity of 10 for none: no slot dropped): whether the
    once form's blocks, counts, result and gradients equal the plain form's exactly."""
    world = uc.get_world_size()
    report = {}
    for i, (name, x, ids, weights, experts, capacity) in enumerate(_scenarios(rank, world)):
        capacity = 10 if capacity is None else capacity
        plain = _static_step(x, ids, weights, experts, capacity, "0")
        once = _static_step(x, ids, weights, experts, capacity, "1", sync_op=i % 3 != 0)
        same = all(plain[key] == once[key] for key in ("rows", "counts", "out", "x.grad", "w.grad"))
        report[name] = (same, once["once"], plain["bytes"], once["bytes"])
    return report


def device_path_against_plain(rank: int) -> dict:
    """On a device backend's code path (torch-nccl's transport driving gloo, on CPU tensors) per
    scenario (the stand-in's dtypes): the once form against the plain one, as on the host; and
    the host reads of the whole step (one, the dispatch's)."""
    restart_on_the_device_path("nccl-device")
    world, report = uc.get_world_size(), {}
    tokens = 0 if rank == 1 else 6
    ids = np.array([np.random.default_rng(t).permutation(world * 4)[:6] for t in range(tokens)], dtype=np.int64)
    ids = torch.from_numpy(ids.reshape(tokens, 6))
    empty = ("rank 1 without tokens", torch.ones(tokens, 16), ids, torch.ones(tokens, 6), 4, None)
    for i, (name, *scenario) in enumerate([*_scenarios(rank, world), empty]):
        if name.startswith(("bfloat16", "float16")):  # not in the stand-in's dtypes
            continue
        plain = _step(*scenario, "0", count_reads=True)
        once = _step(*scenario, "1", sync_op=i % 3 != 0, count_reads=True)
        same = all(plain[key] == once[key] for key in ("rows", "rows_per_expert", "out", "x.grad", "w.grad"))
        report[name] = (same, once["once"], plain["bytes"], once["bytes"], (plain["reads"], once["reads"]))
    off = one_rank_turns_it_off(rank)
    report["rank 0 off"] = (off["out"], not off["once"], (0, 0), (0, 0), (1, 1))
    return report


def device_static_against_plain(rank: int) -> dict:
    """On a device backend's code path, per scenario (capacity 10 for none): the static mode
    given max_tokens_per_rank against whole blocks, blocks, counts, result and gradients; whether
    the form was chosen (and whether unicoll.once_blocks.chosen says it should be), the bytes
    each sent, and the host reads of each whole step (none)."""
    from unicoll.once_blocks import chosen

    restart_on_the_device_path("nccl-device")
    world, report = uc.get_world_size(), {}
    tokens = 0 if rank == 1 else 6
    ids = np.array([np.random.default_rng(t).permutation(world * 4)[:6] for t in range(tokens)], dtype=np.int64)
    ids = torch.from_numpy(ids.reshape(tokens, 6))
    empty = ("rank 1 without tokens", torch.ones(tokens, 16), ids, torch.ones(tokens, 6), 4, 10)
    bound = 6 + world  # at least every rank's tokens
    for i, (name, x, ids, weights, experts, capacity) in enumerate([*_scenarios(rank, world), empty]):
        if name.startswith(("bfloat16", "float16")):  # not in the stand-in's dtypes
            continue
        capacity = 10 if capacity is None else capacity
        scenario = (x, ids, weights, experts, capacity, "0")
        plain = _static_step(*scenario, count_reads=True)
        once = _static_step(*scenario, sync_op=i % 3 != 0, bound=bound, count_reads=True)
        same = all(plain[key] == once[key] for key in ("rows", "counts", "out", "x.grad", "w.grad"))
        expected = chosen(bound, world, experts, capacity, x, ids.shape[1])
        reads = plain["reads"] + once["reads"]
        report[name] = (same, once["once"], expected, plain["bytes"][0], once["bytes"][0], reads)
    if world == 3:  # ranks 0 and 2 in a group of their own; world rank 1 takes no part
        group = uc.new_group([0, 2])
        if rank != 1:
            rng = np.random.default_rng(rank)
            ids = torch.from_numpy(np.array([rng.permutation(8)[:6] for _ in range(7)]))
            x = torch.from_numpy(rng.integers(0, 2, (7, 16)).astype(np.float32))
            plain, once = (_static_in_group(x, ids, group, bound) for bound in (None, 7))
            same = plain["outcome"] == once["outcome"]
            report["in a group"] = (same, once["once"], True, plain["bytes"], once["bytes"], once["reads"])
    return report


def _static_in_group(x, ids, group, bound) -> dict:
    """A static step of 4 experts per rank in ``group``: blocks, result and x's gradient, whether
    the once form was used, the bytes sent and the host reads."""
    x = x.clone().requires_grad_()
    with SyncCounter() as reads:
        rows, _, handle = uc.moe.dispatch_static(x, ids, experts_per_rank=4, capacity=8, group=group,
                                                 max_tokens_per_rank=bound)  # fmt: skip
        out = uc.moe.combine_static(rows * 3, handle)
        out.sum().backward()
    outcome = (rows.tolist(), out.tolist(), x.grad.tolist())
    return {"outcome": outcome, "once": handle.once is not None, "bytes": handle.bytes_sent, "reads": reads.total}


def bounds_that_differ(rank: int) -> list[str]:
    """In check mode on a device backend's path: ranks passing different max_tokens_per_rank,
    then the same one with different k: each refused on every rank before a row moves."""
    restart_on_the_device_path("nccl-device")
    messages = []
    for bound, k in ((8 + (rank == 1), 2), (8, 2 + (rank == 2))):
        ids = torch.zeros((3, k), dtype=torch.int64)
        with pytest.raises(uc.CrossRankMismatchError) as refused:
            uc.moe.dispatch_static(torch.ones(3, 4), ids, experts_per_rank=2, capacity=4, max_tokens_per_rank=bound)
        messages.append(str(refused.value))
    return messages


def _compiled_scenarios(rank: int, world: int):
    """(name, x, ids, weights, experts, capacity) for the compiled step (each compile costs
    seconds): float64 top-4 weighted, float32 top-2 unweighted with a capacity and a rank
    without tokens; dropped slots in both."""
    rng = np.random.default_rng([rank, world])
    for dtype, k, experts, capacity, weighted in ((torch.float64, 4, 2, None, True), (torch.float32, 2, 2, 2, False)):
        tokens = 0 if (rank == 1 and k == 2) else 7
        ids = np.array([rng.permutation(world * experts)[:k] for _ in range(tokens)], dtype=np.int64)
        ids = ids.reshape(tokens, k)
        if tokens:
            ids[0, 1] = -1
        x = torch.from_numpy(rng.integers(0, 3, (tokens, 8))).to(dtype)
        w = torch.from_numpy(rng.choice([1.0, 2.0], (tokens, k))).to(dtype) if weighted else None
        yield f"{dtype} top-{k} E={experts} capacity={capacity} weighted={weighted}", x, ids, w, experts, capacity


def _moe_step(x, ids, w, experts, capacity):
    rows, rows_per_expert, handle = uc.moe.dispatch(x, ids, w, experts_per_rank=experts, capacity=capacity)
    again = uc.moe.redispatch(x * 2, handle)
    parts = torch.split(rows + again, rows_per_expert)
    y = torch.cat([part * (e + 2.0) for e, part in enumerate(parts)])
    return uc.moe.combine(y, handle), handle.once is not None


def compiled_against_eager(rank: int) -> dict:
    """Per scenario, a step compiled (fullgraph, aot_eager) with UNICOLL_MOE_ONCE=1 against the
    eager step with one row per slot: the result and the gradients of x and the weights equal,
    the once form used; and the compiles of one routing after another (three new routings of
    the same shapes: one compile each scenario)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    report = {}
    for name, x0, ids0, w0, experts, capacity in _compiled_scenarios(rank, uc.get_world_size()):
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(_moe_step, fullgraph=True, backend=counter)
        same = True
        for turn in range(3):  # a new routing each turn: the rows per expert change, no recompile
            ids = torch.from_numpy(np.roll(ids0, turn, axis=1).copy())
            results = []
            for once, fn in (("0", _moe_step), ("1", compiled)):
                os.environ[ONCE_ENV_VAR] = once
                try:
                    x = x0.clone().requires_grad_()
                    w = None if w0 is None else w0.clone().requires_grad_()
                    out, used = fn(x, ids, w, experts, capacity)
                    (out * out).sum().backward()
                    grads = (x.grad.tolist(), None if w is None else w.grad.tolist())
                    results.append((out.detach().tolist(), grads, used))
                finally:
                    del os.environ[ONCE_ENV_VAR]
            (plain, plain_grads, plain_used), (once, once_grads, used) = results
            same &= plain == once and plain_grads == once_grads and used and not plain_used
        report[name] = (same, counter.frame_count)
    return report


def compiled_on_one_rank_only(rank: int) -> str:
    """Rank 0 runs the step compiled to send each token once per rank, rank 1 compiled to send
    one row per slot: the layout's count exchange refuses it on both."""
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]])
    os.environ[ONCE_ENV_VAR] = "1" if rank == 0 else "0"
    try:
        step = torch.compile(_moe_step, fullgraph=True, backend="aot_eager")
        with pytest.raises(uc.CrossRankMismatchError) as refused:
            step(torch.ones(3, 4), ids, None, 2, None)
        return str(refused.value)
    finally:
        del os.environ[ONCE_ENV_VAR]


def one_rank_turns_it_off(rank: int) -> dict:
    """Rank 0 turns the once form off: every rank then sends one row per slot, correctly."""
    ids = torch.tensor([[0, 1], [2, 3], [0, 1]])
    x = torch.arange(6.0).reshape(3, 2) + rank
    if rank == 0:
        os.environ[ONCE_ENV_VAR] = "0"
    try:
        rows, _, handle = uc.moe.dispatch(x, ids, torch.ones(3, 2), experts_per_rank=2)
        out = uc.moe.combine(rows, handle)
    finally:
        os.environ.pop(ONCE_ENV_VAR, None)
    return {"once": handle.once is not None, "out": out.tolist() == (2 * x).tolist()}


def _numpy_step(x, ids, w, static: bool, once: str) -> tuple:
    """One step of numpy arrays in either mode with the once form on or off: rows, result, used."""
    os.environ[ONCE_ENV_VAR] = once
    try:
        if static:
            rows, counts, handle = uc.moe.dispatch_static(x, ids, w, experts_per_rank=4, capacity=9)
            again = uc.moe.redispatch_static(x * 3, handle)
            out = (uc.moe.combine_static(rows + again, handle).tolist(), counts.tolist())
        else:
            rows, _, handle = uc.moe.dispatch(x, ids, w, experts_per_rank=4)
            again = uc.moe.redispatch(x * 3, handle)
            out = uc.moe.combine(rows + again, handle).tolist()
        return rows.tolist(), out, handle.once is not None
    finally:
        del os.environ[ONCE_ENV_VAR]


def numpy_arrays(rank: int) -> bool:
    """numpy arrays in and out (mpi's natives, gloo's through torch), in both modes: the same as
    one row per slot."""
    world = uc.get_world_size()
    rng = np.random.default_rng(rank)
    ids = np.array([rng.permutation(world * 4)[:6] for _ in range(9)])
    x = rng.integers(0, 2, (9, 16)).astype(np.float32)
    w = rng.choice([1.0, 2.0], (9, 6)).astype(np.float32)
    for static in (False, True):
        plain, once = (_numpy_step(x, ids, w, static, setting) for setting in "01")
        if plain[:2] != once[:2] or plain[2] or not once[2]:
            return False
    return True


def in_a_group(rank: int) -> bool | None:
    """Ranks 0 and 2 of three in a group of their own (its rank 1 is world rank 2): the once
    form there equals one row per slot in both modes, gradients included; world rank 1 takes
    no part."""
    group = uc.new_group([0, 2])
    if rank == 1:
        return None
    rng = np.random.default_rng(rank)
    ids = torch.from_numpy(np.array([rng.permutation(8)[:6] for _ in range(7)]))
    x = torch.from_numpy(rng.integers(0, 2, (7, 16)).astype(np.float32))
    results = []
    for static in (False, True):
        for once in "01":
            os.environ[ONCE_ENV_VAR] = once
            try:
                xs, w = x.clone().requires_grad_(), torch.full((7, 6), 2.0, requires_grad=True)
                if static:
                    rows, _, handle = uc.moe.dispatch_static(xs, ids, w, experts_per_rank=4, capacity=7, group=group)
                    out = uc.moe.combine_static(rows * 3.0, handle)
                else:
                    rows, _, handle = uc.moe.dispatch(xs, ids, w, experts_per_rank=4, group=group)
                    out = uc.moe.combine(rows * 3.0, handle)
                out.sum().backward()
                results.append((out.tolist(), xs.grad.tolist(), w.grad.tolist(), handle.once is not None))
            finally:
                del os.environ[ONCE_ENV_VAR]
    pairs = (results[0], results[1]), (results[2], results[3])
    return all(plain[:3] == once[:3] and once[3] and not plain[3] for plain, once in pairs)


def written_after_combine(rank: int) -> str:
    """The expert rows written in place after a once combine: its backward refuses, as torch
    refuses a tensor it saved and that was changed since (every rank writes, so none waits)."""
    world = uc.get_world_size()
    ids = torch.from_numpy(np.array([np.random.default_rng(t).permutation(world * 2)[:4] for t in range(6)]))
    os.environ[ONCE_ENV_VAR] = "1"
    try:
        x, w = torch.ones(6, 16, requires_grad=True), torch.full((6, 4), 2.0, requires_grad=True)
        rows, _, handle = uc.moe.dispatch(x, ids, w, experts_per_rank=2)
        y = rows * 3.0
        out = uc.moe.combine(y, handle)
        y.mul_(2.0)
        with pytest.raises(RuntimeError, match="y was modified in place after combine") as refused:
            out.sum().backward()
        return str(refused.value).split(":")[0]
    finally:
        del os.environ[ONCE_ENV_VAR]


def auto_by_the_bytes_saved(rank: int) -> list:
    """With UNICOLL_MOE_ONCE unset, the form is used where the ranks save ONCE_FROM_BYTES or
    more between them: not for 8 tokens, but for 512 tokens of 1 KiB at top-8, also where the
    other ranks send too few bytes to weigh it (they send one row per slot, and receive once).
    The static mode sends one row per slot unless the variable is 1."""
    world, used = uc.get_world_size(), []
    rng = np.random.default_rng(rank)
    for tokens in (8, 512, 512 if rank == 0 else 4):  # the last: only rank 0 weighs the form
        ids = torch.from_numpy(np.array([rng.permutation(world * 4)[:8] for _ in range(tokens)]))
        x = torch.ones(tokens, 256)
        rows, _, handle = uc.moe.dispatch(x, ids, experts_per_rank=4)
        out = uc.moe.combine(rows, handle)
        used.append((tokens, handle.once is not None, bool((out == 8).all())))
        blocks, _, handle = uc.moe.dispatch_static(x, ids, experts_per_rank=4, capacity=512)
        out = uc.moe.combine_static(blocks, handle)
        used.append(("static", handle.once is not None, bool((out == 8).all())))
    return used


def steady_over_many_steps(rank: int) -> dict:
    """300 steps, a new routing each, the once form forced, every other step in the static mode,
    every third with its backward pass:
    the handles (and what their layout made) go with their step, and resident memory after step
    300 is within a few MiB of step 50."""
    import gc
    import weakref
    from pathlib import Path

    def resident() -> int:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmRSS:"))
        return int(line.split()[1]) * 1024

    rng, layouts, sizes = np.random.default_rng(rank), [], {}
    x = torch.ones(64, 64, requires_grad=True)
    os.environ[ONCE_ENV_VAR] = "1"
    try:
        for step in range(300):
            ids = torch.from_numpy(np.array([rng.permutation(uc.get_world_size() * 4)[:6] for _ in range(64)]))
            w = torch.rand(64, 6, requires_grad=True)
            if step % 2:  # the static mode every other step
                rows, _, handle = uc.moe.dispatch_static(x, ids, w, experts_per_rank=4, capacity=64)
                out = uc.moe.combine_static(rows * 2.0, handle)
                layouts.append(weakref.ref(handle.once.layout))
            else:
                rows, _, handle = uc.moe.dispatch(x, ids, w, experts_per_rank=4)
                out = uc.moe.combine(rows * 2.0, handle)
                layouts.append(weakref.ref(handle.once))
            if step % 3 == 0:  # a backward every third step: what its graph holds goes too
                out.sum().backward()
            del rows, handle, w, out
            if step in (50, 299):
                gc.collect()
                sizes[step] = resident()
    finally:
        del os.environ[ONCE_ENV_VAR]
    gc.collect()
    return {"layouts alive": sum(ref() is not None for ref in layouts), "grown (MiB)": (sizes[299] - sizes[50]) >> 20}


ONCE = {
    (backend, world, check): share(
        backend,
        world,
        [
            Case("once: against plain", once_against_plain),
            Case("once: static against plain", static_once_against_plain),
            Case("once: one rank off", one_rank_turns_it_off),
            Case("once: auto", auto_by_the_bytes_saved),
            Case("once: numpy", numpy_arrays),
            Case("once: written after combine", written_after_combine),
        ],
        check=check,
    )
    for backend, world, check in (("gloo", 2, False), ("mpi", 2, False), ("gloo", 3, False), ("gloo", 2, True))
}


@pytest.mark.parametrize(("backend", "world", "check"), list(ONCE))
def test_once_per_rank_equals_one_row_per_slot(backend: str, world: int, check: bool) -> None:
    reports = SESSION.results(ONCE[backend, world, check], "once: against plain")
    for report in reports:
        for name, (same, used, plain_bytes, once_bytes) in report.items():
            assert same, name
            assert used, name  # top-k > 1 on more than one rank, all offering it
            assert once_bytes[1] == plain_bytes[0] == plain_bytes[1], name  # one row per slot, as plain sent
            assert once_bytes[0] <= once_bytes[1], name
    saved = [once_bytes[0] < once_bytes[1] for report in reports for (_, _, _, once_bytes) in report.values()]
    assert any(saved)  # top-8 over 4 experts per rank shares ranks


@pytest.mark.parametrize(("backend", "world", "check"), list(ONCE))
def test_the_static_mode_once_per_rank_equals_one_row_per_slot(backend: str, world: int, check: bool) -> None:
    reports = SESSION.results(ONCE[backend, world, check], "once: static against plain")
    for report in reports:
        for name, (same, used, plain_bytes, once_bytes) in report.items():
            assert same, name
            assert used, name
            assert once_bytes[1] == plain_bytes[0] == plain_bytes[1], name  # the valid rows, as plain sent
            assert once_bytes[0] <= once_bytes[1], name
    assert any(once_bytes[0] < once_bytes[1] for report in reports for (_, _, _, once_bytes) in report.values())


@pytest.mark.parametrize(("backend", "world", "check"), list(ONCE))
def test_one_rank_turning_it_off_turns_it_off_everywhere(backend: str, world: int, check: bool) -> None:
    assert SESSION.results(ONCE[backend, world, check], "once: one rank off") == [{"once": False, "out": True}] * world


@pytest.mark.parametrize(("backend", "world", "check"), list(ONCE))
def test_by_default_it_is_used_where_the_ranks_save_enough(backend: str, world: int, check: bool) -> None:
    reports = SESSION.results(ONCE[backend, world, check], "once: auto")
    static = [("static", False, True)] * 3  # by default the static mode sends one row per slot
    assert reports[0] == [
        x for pair in zip([(8, False, True), (512, True, True), (512, True, True)], static) for x in pair
    ]
    others = [x for pair in zip([(8, False, True), (512, True, True), (4, True, True)], static) for x in pair]
    assert reports[1:] == [others] * (world - 1)


@pytest.mark.parametrize(("world", "check"), [(2, False), (3, True)])
def test_on_a_device_backend_once_per_rank_equals_one_row_per_slot(world: int, check: bool) -> None:
    env = {"UNICOLL_CHECK": "1"} if check else {}
    reports = uc.testing.spawn(device_path_against_plain, world, backend="gloo", env=env, timeout=120)
    for report in reports:
        for name, (same, used, plain_bytes, once_bytes, reads) in report.items():
            assert same, name
            assert used, name
            assert once_bytes[1] == plain_bytes[0] == plain_bytes[1], name
            assert once_bytes[0] <= once_bytes[1], name  # never more rows than one per slot
            # the dispatch's one read of its counts and nothing more (check mode reads what it compares)
            assert reads[1] == reads[0] and (check or reads == (1, 1)), (name, reads)
    assert any(b[0] < b[1] for report in reports for (_, _, _, b, _) in report.values())


@pytest.mark.parametrize(("world", "check"), [(2, False), (3, True)])
def test_on_a_device_backend_the_static_mode_given_a_bound_sends_each_token_once(world: int, check: bool) -> None:
    env = {"UNICOLL_CHECK": "1"} if check else {}
    reports = uc.testing.spawn(device_static_against_plain, world, backend="gloo", env=env, timeout=120)
    for report in reports:
        for name, (same, used, expected, plain_bytes, once_bytes, reads) in report.items():
            assert same, name
            assert used == expected, name
            assert once_bytes < plain_bytes if used else once_bytes == plain_bytes, name
            assert check or reads == 0, (name, reads)  # nothing read on the host (check mode reads what it compares)
    assert sum(used for report in reports for (_, used, *_) in report.values()) >= 10
    assert world == 2 or ["in a group" in report for report in reports] == [True, False, True]


def test_ranks_passing_different_bounds_or_k_are_refused_in_check_mode() -> None:
    reports = uc.testing.spawn(bounds_that_differ, 3, backend="gloo", env={"UNICOLL_CHECK": "1"}, timeout=60)
    expected = [
        "moe.dispatch_static: ranks disagree: rank 0 passes max_tokens_per_rank=8 but rank 1 passes 9",
        "moe.dispatch_static: ranks disagree: rank 0 passes topk_idx.shape[1]=2 but rank 2 passes 3",
    ]
    assert reports == [expected] * 3


def _static_moe_step(x, ids, w, experts, capacity, bound):
    rows, counts, handle = uc.moe.dispatch_static(x, ids, w, experts_per_rank=experts, capacity=capacity,
                                                  max_tokens_per_rank=bound)  # fmt: skip
    again = uc.moe.redispatch_static(x * 2, handle)
    scale = torch.arange(2.0, experts + 2, dtype=rows.dtype).reshape(experts, 1, 1)
    return rows, counts, uc.moe.combine_static((rows + again) * scale + 1, handle), handle.once is not None


def compiled_static_against_eager(rank: int) -> tuple[bool, int]:
    """The static step compiled (fullgraph, static shapes) given max_tokens_per_rank against the
    eager step's whole blocks, three routings (a token with one expert twice; rank 1 without
    tokens): blocks, counts, result and gradients equal, the once form used; and the compiles."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_static_moe_step, fullgraph=True, dynamic=False, backend=counter)
    world, tokens, same = uc.get_world_size(), 0 if rank == 1 else 6, True
    for turn in range(3):
        rng = np.random.default_rng([rank, turn])
        ids = [rng.permutation(world * 2)[:3] for _ in range(tokens)]
        ids = torch.from_numpy(np.array(ids, dtype=np.int64).reshape(tokens, 3))
        if tokens:
            ids[0, 2] = ids[0, 0]
        x0 = torch.from_numpy(rng.integers(0, 3, (tokens, 8))).double()
        w0 = torch.from_numpy(rng.integers(1, 3, (tokens, 3))).double()
        results = []
        for fn, bound in ((_static_moe_step, None), (compiled, 6)):
            x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
            rows, counts, out, used = fn(x, ids, w, 2, 6, bound)
            (out * out).sum().backward()
            results.append((rows.tolist(), counts.tolist(), out.tolist(), x.grad.tolist(), w.grad.tolist(), used))
        (*plain, plain_used), (*once, used) = results
        same &= plain == once and used and not plain_used
    return same, counter.frame_count


def compiled_before_anything_eager(rank: int) -> tuple[int, list[str]]:
    """A dynamic step compiled in a fresh process before any eager call, three routings: the
    compiles and Dynamo's warnings (before: two compiles, the first one's trace having filled
    the array-type cache it then guarded on, and three lru_cache warnings)."""
    import warnings

    from torch._dynamo.testing import CompileCounterWithBackend

    def step(x, ids, w):
        rows, _, handle = uc.moe.dispatch(x, ids, w, experts_per_rank=2)
        return uc.moe.combine(rows * 2, handle)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for turn in range(3):
            rng = np.random.default_rng([rank, turn])
            ids = torch.from_numpy(np.array([rng.permutation(4)[:2] for _ in range(5)]))
            x, w = torch.ones(5, 4, requires_grad=True), torch.ones(5, 2, requires_grad=True)
            compiled(x, ids, w).sum().backward()
    return counter.frame_count, [str(warning.message)[:60] for warning in caught]


def compiled_here_eager_there(rank: int) -> str:
    """Rank 0 runs the step compiled (one row per slot), rank 1 eager: refused on both, by the
    layout's count exchange, before a row moves."""
    step = torch.compile(_moe_step, fullgraph=True, backend="aot_eager") if rank == 0 else _moe_step
    with pytest.raises(uc.CrossRankMismatchError) as refused:
        step(torch.ones(3, 4), torch.tensor([[0, 1], [2, 3], [1, 2]]), None, 2, None)
    return str(refused.value)


def _skipping_step(x, ids, w):
    """A step whose experts, as transformers' eager experts code, make their output without the
    rows where none came (zeros, cut off from them), and else from them."""
    rows, _, handle = uc.moe.dispatch(x, ids, w, experts_per_rank=2)
    y = rows * 3 if rows.shape[0] else torch.zeros_like(rows)
    return uc.moe.combine(y, handle)


def compiled_with_no_rows_here(rank: int) -> list[float]:
    """Every slot goes to rank 0's experts, so rank 1's receive no rows: the compiled step (the
    dynamic mode, graphs that differ between the ranks) against eager, result and gradients of
    x and the weights. Before combine joined its rows to the dispatched ones in compiled code,
    rank 1 skipped dispatch's backward collective and rank 0 waited for it."""
    compiled = torch.compile(_skipping_step, backend="aot_eager")
    ids = torch.tensor([[0, 1]] * 4)
    results = []
    for step in (compiled, _skipping_step):
        x = torch.arange(8.0, dtype=torch.float64).reshape(4, 2).add(rank).requires_grad_()
        w = torch.full((4, 2), 0.5, dtype=torch.float64, requires_grad=True)
        out = step(x, ids, w)
        out.square().sum().backward()
        results.append((out.detach(), x.grad, w.grad))
    return [(a - b).abs().max().item() for a, b in zip(*results)]


def compiled_world(rank: int) -> dict:
    """The compiled cases, in a world of their own: nothing a compile leaves behind (Dynamo's
    caches, its references to the session's group: docs/compile.md) reaches the later cases of
    a shared world."""
    return {
        "first": compiled_before_anything_eager(rank),  # first: nothing eager has run in this process
        "compiled": compiled_against_eager(rank),
        "one rank": compiled_on_one_rank_only(rank),
        "compiled here": compiled_here_eager_there(rank),
        "no rows": compiled_with_no_rows_here(rank),
        "static": compiled_static_against_eager(rank),
    }


@pytest.fixture(scope="module")
def compiled_reports() -> list[dict]:
    """On gloo only: compiled code reaches the backend through the eager operators and the once
    layout that the eager cases above run on mpi too, and a compiled Mixtral runs over mpi in
    tests/frameworks/test_hf_expert_parallel.py."""
    return uc.testing.spawn(compiled_world, 2, backend="gloo", timeout=240)


def test_a_compiled_step_sends_each_token_once_per_rank_with_eager_s_results(compiled_reports) -> None:
    for report in compiled_reports:
        for name, (same, compiles) in report["compiled"].items():
            assert same, name
            assert compiles == 1, (name, compiles)  # new routings never recompile


def test_a_step_compiled_before_any_eager_call_compiles_once_without_warnings(compiled_reports) -> None:
    assert [report["first"] for report in compiled_reports] == [(1, [])] * 2


def test_a_compiled_static_step_given_a_bound_sends_each_token_once_with_eager_s_results(compiled_reports) -> None:
    assert [report["static"] for report in compiled_reports] == [(True, 1)] * 2  # new routings never recompile


def test_a_step_compiled_to_send_once_on_some_ranks_only_is_refused_on_every_rank(compiled_reports) -> None:
    messages = [report["one rank"] for report in compiled_reports]
    expected = (
        "moe.dispatch: ranks disagree: ranks [0] run it compiled to send each token once per rank; ranks [1] run it "
        "compiled to send one row per slot"
    )
    assert all(m.startswith(expected) for m in messages), messages


def test_a_step_compiled_on_one_rank_and_eager_on_the_other_is_refused_on_every_rank(compiled_reports) -> None:
    expected = (
        "moe.dispatch: ranks disagree: ranks [0] run it compiled to send one row per slot; ranks [1] run it eager"
    )
    assert all(report["compiled here"].startswith(expected) for report in compiled_reports)


def test_a_compiled_rank_whose_experts_get_no_rows_runs_every_backward_collective(compiled_reports) -> None:
    for report in compiled_reports:
        assert report["no rows"] == [0.0, 0.0, 0.0]


GROUP = share("gloo", 3, [Case("once: in a group", in_a_group)])


def test_once_per_rank_in_a_group() -> None:
    assert SESSION.results(GROUP, "once: in a group") == [True, None, True]


MANY = {backend: share(backend, 2, [Case("once: many steps", steady_over_many_steps)]) for backend in ("gloo", "mpi")}


@pytest.mark.parametrize("backend", list(MANY))
def test_memory_stays_flat_over_300_steps_with_new_routing(backend: str) -> None:
    for report in SESSION.results(MANY[backend], "once: many steps"):
        assert report["layouts alive"] == 0
        assert report["grown (MiB)"] <= 8, report


@pytest.mark.parametrize(("backend", "world", "check"), list(ONCE))
def test_numpy_arrays_go_once_per_rank_too(backend: str, world: int, check: bool) -> None:
    assert SESSION.results(ONCE[backend, world, check], "once: numpy") == [True] * world


@pytest.mark.parametrize(("backend", "world", "check"), list(ONCE))
def test_rows_written_in_place_after_combine_are_refused_in_its_backward(backend: str, world: int, check: bool) -> None:
    assert (
        SESSION.results(ONCE[backend, world, check], "once: written after combine")
        == ["moe.combine (backward)"] * world
    )
