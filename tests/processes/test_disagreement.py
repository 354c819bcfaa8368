"""Ranks that disagree, without check mode: the handshake of the host backends.

Every kind of disagreement of check mode's table (helpers/worlds.py) and those the handshake
adds (a broadcast of more rows, the static mode's experts per rank, hidden size, capacity and
overflow, MoE counts that do not pair up, counts of different lengths, split sizes given on one
rank and exchanged on another) must end in the same CrossRankMismatchError on every rank,
check mode off, on gloo and mpi; the world is in step afterwards. Before, gloo aborted the
process (SIGABRT) and mpi returned garbage or dropped rows. On 3 ranks, a pair of ranks that
disagree stops the third too, which would otherwise wait for them in the transfer.
"""

from __future__ import annotations

import numpy as np
import pytest

import unicoll as uc
from helpers.several import SESSION, Case, share
from helpers.worlds import MISMATCHES, TO_EXPERT_0, X
from unicoll import runtime


def _static(**kwargs: object) -> None:
    """moe.dispatch_static of X (every token to expert 0) with ``kwargs`` over the defaults."""
    options = {"experts_per_rank": 1, "capacity": 6, "overflow": "drop"} | kwargs
    rows = options.pop("rows", X)
    uc.moe.dispatch_static(rows, TO_EXPERT_0, **options)


# (label, what rank 0 calls, what the other ranks call, the message every rank must see)
HANDSHAKE_ONLY = [
    ("broadcast of more rows", lambda: uc.broadcast(X.copy(), 0), lambda: uc.broadcast(np.zeros((8, 2), np.float32), 0),
     "broadcast: ranks disagree: rank 0 broadcasts 6 rows from position 0 but rank 1 broadcasts 8 rows from position 0"),
    ("static experts per rank", lambda: _static(), lambda: _static(experts_per_rank=2),
     "moe.dispatch_static: ranks disagree: rank 0 passes experts_per_rank=1 but rank 1 passes 2"),
    ("static hidden size", lambda: _static(), lambda: _static(rows=np.zeros((6, 3), np.float32)),
     "moe.dispatch_static: ranks disagree: rank 0's rows have trailing shape (2,) but rank 1's have (3,)"),
    ("static capacity", lambda: _static(), lambda: _static(capacity=3),
     "moe.dispatch_static: ranks disagree: rank 0 passes capacity=6 but rank 1 passes 3"),
    ("static overflow", lambda: _static(), lambda: _static(overflow="error"),
     "moe.dispatch_static: ranks disagree: rank 0 passes overflow='drop' but rank 1 passes 'error'"),
    ("scatter counts", lambda: uc.global_scatter(X, [3, 3], [3, 3]), lambda: uc.global_scatter(X, [2, 4], [2, 4]),
     "global_scatter: ranks disagree: rank 0 expects 3 row(s) from rank 1 for expert 0, but rank 1 sends 2"),
    ("count lengths", lambda: uc.exchange_counts([1, 2]), lambda: uc.exchange_counts([1, 2, 3, 4]),
     "exchange_counts: ranks disagree: rank 0 passes 2 counts or sizes but rank 1 passes 4"),
    ("split sizes given on one rank only", lambda: uc.alltoall_single(None, X, None, [2, 4]),
     lambda: uc.alltoall_single(None, X, [5, 1], [5, 1]),
     "alltoall_single: ranks disagree: rank 1 expects 5 row(s) from rank 0, but rank 0 sends 4"),
]  # fmt: skip

CASES = [*MISMATCHES, *HANDSHAKE_ONLY]


def disagreements(rank: int) -> list[str]:
    """Each case on every rank, check mode off: the error each rank raised (the world is in step
    after each)."""
    assert runtime.state("test").handshake and not runtime.state("test").check
    seen = []
    for _, mine, others, _ in CASES:
        with pytest.raises(uc.CrossRankMismatchError) as info:
            (mine if rank == 0 else others)()
        seen.append(str(info.value))
        assert uc.all_gather(None, X).shape == (2 * len(X), 2)  # the world is still in step
    return seen


def a_pair_disagrees(rank: int) -> list[str]:
    """3 ranks: ranks 0 and 1 disagree on the rows between them, rank 2 agrees with both."""
    splits = {0: ([2, 2, 2], [2, 2, 2]), 1: ([3, 2, 1], [2, 2, 2]), 2: ([2, 2, 2], [2, 2, 2])}[rank]
    seen = []
    parts = [
        np.empty((6, 2), np.float32),
        np.empty((5 if rank == 0 else 6, 2), np.float32),
        np.empty((6, 2), np.float32),
    ]
    for call in (lambda: uc.alltoall_single(None, X, *splits[::-1]), lambda: uc.all_gather(parts, X)):
        try:
            call()
        except uc.CrossRankMismatchError as exc:
            seen.append(str(exc))
        else:
            seen.append("returned")
        assert uc.all_reduce(np.ones(1)).item() == 3.0  # the world is still in step
    return seen


WORLDS = {backend: share(backend, 2, [Case("disagreement: handshake", disagreements)]) for backend in ("gloo", "mpi")}
PAIRS = {backend: share(backend, 3, [Case("disagreement: a pair", a_pair_disagrees)]) for backend in ("gloo", "mpi")}


@pytest.mark.parametrize("backend", WORLDS)
def test_every_disagreement_raises_on_every_rank_without_check_mode(backend: str) -> None:
    for seen in SESSION.results(WORLDS[backend], "disagreement: handshake"):
        for (label, _, _, message), got in zip(CASES, seen):
            assert message in got, (label, got)


@pytest.mark.parametrize("backend", PAIRS)
def test_a_pair_that_disagrees_stops_the_third_rank_too(backend: str) -> None:
    expected = [
        "alltoall_single: ranks disagree: rank 0 expects 2 row(s) from rank 1, but rank 1 sends 3",
        "all_gather: ranks disagree: rank 0 expects 5 row(s) from rank 1, but rank 1 sends 6",
    ]
    assert SESSION.results(PAIRS[backend], "disagreement: a pair") == [expected] * 3
