"""Hostile callers with Paddle tensors and JAX arrays, on gloo: a soak with new routing every
step (gradients right, resident memory flat, no handle kept), a second thread, outputs that
alias inputs, a dropped Task, ranks that disagree in check mode and an ended session's graph and
handle. The joined libraries' arrays reach every backend as torch tensors, through the same
eager calls (unicoll/carry.py), so the transport plays no part in these; Paddle's MoE layer runs
on mpi too (test_paddle_moe.py). A rank that raises or exits mid-step:
tests/processes/test_faults.py."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from helpers.joined_attacks import aliasing_and_tasks, disagreement, soak, stale_session, threads
from helpers.several import SESSION, Case, share
from helpers.signals import signal_path

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("paddle") is None or importlib.util.find_spec("jax") is None,
    reason="paddle or jax is not installed (pip install 'unicoll[paddle,jax]')",
)
"""(Paddle and JAX are imported by the ranks only: this process stays free of them.)"""

LIBRARIES = ("paddle", "jax")
GROWTH_LIMIT = 64 * 2**20


ATTACKS = share(
    "gloo",
    2,
    [Case(f"soak {library}", soak, (library,)) for library in LIBRARIES]
    + [Case(f"threads {library}", threads, (library, signal_path(f"threads-{library}"))) for library in LIBRARIES]
    + [Case("aliasing and tasks", aliasing_and_tasks)],
    timeout=240,
)
"""The attacks on the carry floor, in the session's gloo world of 2 (helpers/several.py): the
joined libraries' arrays reach every backend as torch tensors, through the same eager calls, so
the transport plays no part in them; mpi's own hostile callers (torch, numpy) are in
tests/processes/test_hostile_callers.py."""

CHECKED = {"paddle": 3, "jax": 2}
"""The size of gloo's check-mode world of the session that attacks each library."""
DISAGREEING = {
    library: share("gloo", size, [Case(f"disagreement {library}", disagreement, (library,))], check=True)
    for library, size in CHECKED.items()
}

STALE = share("gloo", 2, [Case("stale session", stale_session, ("gloo",))], last=True)


@pytest.mark.parametrize("library", LIBRARIES)
def test_a_soak_with_new_routing_every_step(library: str) -> None:
    for rank, seen in enumerate(SESSION.results(ATTACKS, f"soak {library}")):
        assert seen["right"] > 0 and seen["handles_kept"] == 0, seen
        assert seen["growth"] < GROWTH_LIMIT, f"rank {rank}: resident memory grew by {seen['growth'] / 2**20:.1f} MiB"


@pytest.mark.parametrize("library", LIBRARIES)
def test_a_second_thread_is_refused(library: str) -> None:
    outcomes = SESSION.results(ATTACKS, f"threads {library}")
    assert all(seen["gathered"] == (library, [0.0, 1.0]) for seen in outcomes), outcomes
    assert outcomes[0]["main"] == (
        "RuntimeError: alltoall_single: thread 'MainThread' called it while thread 'worker' is inside all_gather; "
        "unicoll's collectives must be issued from one thread at a time, in the same order on every rank"
    )
    assert outcomes[0]["worker_inside"], "refused only once the worker's all_gather was over"


def test_aliasing_and_tasks() -> None:
    for rank, seen in enumerate(SESSION.results(ATTACKS, "aliasing and tasks")):
        assert seen == {
            "aliased_is_x": True,
            "aliased_right": True,
            "after_dropped_task": [3.0, 3.0, 3.0],
            "waited_is_y": True,
        }, rank


def test_an_ended_sessions_graph_and_handle_raise() -> None:
    for seen in SESSION.results(STALE, "stale session"):
        assert "its session ended at finalize()" in seen["backward"], seen
        assert "its session ended at finalize()" in seen["combine"], seen
        assert seen["after"] == [2.0, 2.0]


@pytest.mark.parametrize("library", LIBRARIES)
def test_ranks_that_disagree_get_the_same_error(library: str) -> None:
    """In check mode, with Paddle tensors (3 ranks) and JAX arrays (2): counts that disagree end
    in CrossRankMismatchError on every rank; NaN and inf survive a max; the next call is right."""
    size = CHECKED[library]
    for seen in SESSION.results(DISAGREEING[library], f"disagreement {library}"):
        assert seen["mismatch"] == "CrossRankMismatchError", seen
        np.testing.assert_array_equal(seen["nan max"], [np.nan, 1.0, np.inf])  # NaN equal to NaN here
        assert seen["after"] == [float(size)]
