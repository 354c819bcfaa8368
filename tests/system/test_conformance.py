"""The conformance matrix on the CPU backends (gloo, mpi): 1 to 4 ranks (4 with the handshake
off and torch's half; gloo's 3 in check mode), one spawned world per backend and size, two worlds at a time
(mpi's of 2 and 3 in the session's shared MPI worlds); Paddle and JAX in gloo's worlds of 2 and
3. A backend that cannot run here is skipped with the reason."""

from __future__ import annotations

import pytest

from helpers import conformance
from helpers.background import Worlds
from helpers.conformance import JOINED, assert_all_passed, by_operator, cases, run_cases
from helpers.several import SESSION, Case, share
from unicoll import registry

CPU_BACKENDS = ("gloo", "mpi")
WORLD_SIZES = (1, 2, 3, 4)
FACTORIES = {name: registry.registered()[name] for name in CPU_BACKENDS}
JOINED_WORLDS = (2, 3)
"""The gloo worlds that run Paddle's and JAX's cases."""
FOUR = ("torch",)
"""The libraries of the worlds of 4 ranks: the most expensive worlds (4 ranks on this
machine's 2 cores: 15 CPU-s for gloo's whole matrix, 23 for mpi's), where numpy's half would
repeat what both backends prove at 1-3 ranks: how numpy arrays and torch tensors are handed
to a transport does not depend on the world size, and torch's half runs every operator,
variant and dtype at 4, and every setting (by some dtypes)."""


def _in_matrix(case: conformance.Case, backend: str, w: int) -> bool:
    """Whether ``case`` runs on ``backend``'s world of ``w`` ranks (see :data:`MATRIX`)."""
    if case.library in JOINED:
        return backend == "gloo" and w in JOINED_WORLDS
    return w != 4 or case.library in FOUR


MATRIX = {
    (b, w): [case for case in cases(FACTORIES[b].capabilities, w) if _in_matrix(case, b, w)]
    for b in CPU_BACKENDS
    for w in WORLD_SIZES
}
"""Each backend's cases by world size. Paddle tensors and JAX arrays travel as torch tensors,
through the same eager calls on every backend: their cases run in gloo's worlds of 2 and 3
ranks (each rank of a world that runs one imports Paddle and JAX, about 2.6 s of CPU time
apiece; every operator and variant still runs with each library there), and
tests/frameworks runs Paddle's MoE layer on mpi (test_paddle_moe.py). The worlds of
4 run torch's half (:data:`FOUR`)."""


def _spawn_kwargs(backend: str, w: int) -> dict:
    """How the world of ``backend`` and ``w`` ranks is spawned: the worlds of 4 ranks without the
    handshake (``UNICOLL_HANDSHAKE=0``) and gloo's of 3 in check mode (``UNICOLL_CHECK=1``: no
    false alarm over the whole matrix), so that the matrix proves every setting right; the
    handshake's and check mode's comparisons themselves are tested in
    tests/processes/test_disagreement.py and test_reliability.py."""
    env = {"UNICOLL_HANDSHAKE": "0"} if w == 4 else {}
    if (backend, w) == ("gloo", 3):
        env["UNICOLL_CHECK"] = "1"
    return {"backend": backend, "timeout": 240, "env": env}


def _params():
    for backend in CPU_BACKENDS:
        reason = FACTORIES[backend].probe()
        marks = [pytest.mark.skipif(reason is not None, reason=f"backend {backend} is not usable here: {reason}")]
        for w in WORLD_SIZES:
            for op, group in by_operator(MATRIX[backend, w]).items():
                yield pytest.param(backend, w, group, marks=marks, id=f"{backend}-W{w}-{op}")


def test_every_operator_and_variant_runs_with_each_joined_library() -> None:
    """Paddle and JAX run in fewer worlds than numpy and torch: every (operator, variant) still
    runs with each of them, and numpy and torch run every setting of sync and group."""
    for library in JOINED:
        ran = {(c.op, c.variant) for w in JOINED_WORLDS for c in MATRIX["gloo", w] if c.library == library}
        whole = {(c.op, c.variant) for w in WORLD_SIZES for c in cases(FACTORIES["gloo"].capabilities, w)
                 if c.library == library}  # fmt: skip
        assert ran == whole, sorted(whole - ran)
    for backend in CPU_BACKENDS:
        for w in WORLD_SIZES:
            settings = {(c.sync, c.subgroup) for c in MATRIX[backend, w] if c.library == "torch"}
            assert settings == {(True, False), (False, True), (True, True), (False, False)}, (backend, w)


IN_SHARED_JOBS = {
    w: share("mpi", w, [Case(f"conformance: mpi W{w}", run_cases, (MATRIX["mpi", w],))], timeout=240)
    for w in (2, 3)
    if FACTORIES["mpi"].probe() is None
}
"""mpi's worlds of 2 and 3 run in the session's shared MPI worlds (helpers/several.py), which
every test of mpi starts anyway: two worlds fewer (each about 0.3 s and 0.5 CPU-s to start)."""


@pytest.fixture(scope="module")
def worlds() -> Worlds:
    """Every other usable world, started at once, two at a time, the largest first."""
    started = Worlds(parallel=2)
    for w in sorted(WORLD_SIZES, reverse=True):
        for backend in CPU_BACKENDS:
            if FACTORIES[backend].probe() is None and not (backend == "mpi" and w in IN_SHARED_JOBS):
                started.start((backend, w), run_cases, w, MATRIX[backend, w], **_spawn_kwargs(backend, w))
    return started


@pytest.mark.parametrize(("backend", "w", "group"), list(_params()))
def test_conformance(backend, w, group, worlds) -> None:
    """Every case of one operator on one world; a failure names each case that failed."""
    if backend == "mpi" and w in IN_SHARED_JOBS:
        per_rank = SESSION.results(IN_SHARED_JOBS[w], f"conformance: mpi W{w}")
    else:
        per_rank = worlds.results((backend, w), run_cases, w, MATRIX[backend, w], **_spawn_kwargs(backend, w))
    assert_all_passed(per_rank, group)
