"""A training loop's worth of calls with new routing every step: results stay right and
resident memory stays flat (every cache is bounded in bytes and holds no caller array).

The ranks pin glibc's mmap threshold first (``mallopt(M_MMAP_THRESHOLD)``, what
``MALLOC_MMAP_THRESHOLD_`` sets as a process starts), so every allocation of 128 KiB or more is
its own mapping, returned to the system when freed, and the resident size shows what is still
held. With glibc's default, the threshold rises to the size of the first large block freed, and
activations of a slightly different size every step then fragment the heap: the same loop
written with raw torch.distributed calls drifts by about 0.3 MiB per step that way
(docs/reliability.md), which would hide what this test looks for.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
import torch

import unicoll as uc
from unicoll import memory, runtime

STEPS, WARMUP = 100, 20
TOKENS, HIDDEN, EXPERTS = 4096, 256, 4
GROWTH_LIMIT = 64 * 2**20


M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter for the mmap threshold (malloc.h); setting it also stops the
threshold from rising."""


def _rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


def _pin_mmap_threshold(nbytes: int) -> None:
    """Every allocation of ``nbytes`` or more its own mapping, from now on in this process."""
    assert ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, nbytes) == 1, "glibc refused the mmap threshold"


def soak(rank: int) -> dict[str, int]:
    """New activations and new counts every step through exchange_counts, global_scatter and
    global_gather, beside alltoall_single and all_gather of sizes that change every step."""
    _pin_mmap_threshold(128 * 2**10)
    world = uc.get_world_size()
    rng = np.random.default_rng(100 + rank)
    baseline = peak = 0
    for step in range(STEPS):
        x = torch.randn(TOKENS, HIDDEN)
        local = rng.multinomial(TOKENS, np.full(world * EXPERTS, 1 / (world * EXPERTS)))
        glob = uc.exchange_counts(local)
        y = uc.global_scatter(x, local, glob)
        assert y.shape == (int(glob.sum()), HIDDEN)
        assert torch.equal(uc.global_gather(y, local, glob), x), step
        rows = int(rng.integers(0, 512))
        splits = rng.multinomial(rows, np.full(world, 1 / world))
        sent = x[:rows]
        received = uc.alltoall_single(None, sent, in_split_sizes=splits)
        width = 1 + step % 80  # rows of a new size in bytes most steps (mpi keeps a datatype per size)
        gathered = uc.all_gather(None, sent[: rows % 97, :width])
        assert received.shape[1:] == (HIDDEN,) and gathered.shape[1:] == (width,)
        if rank == 0:  # rank 0's rows come first
            assert torch.equal(gathered[: rows % 97], sent[: rows % 97, :width]), step
        if step == WARMUP:
            baseline = _rss_bytes()
        elif step > WARMUP:
            peak = max(peak, _rss_bytes())
    backend = runtime.state("soak").backend
    kept = None
    if backend.name == "mpi":
        from unicoll.backends.mpi import transport as mpi_comm  # imports mpi4py, which starts MPI: only in an MPI rank

        kept = mpi_comm._ROW_TYPES_KEPT
    return {
        "growth": peak - baseline,
        "accepted_bytes": runtime.state("soak").memory.accepted.nbytes,
        "row_types": len(getattr(backend, "_row_types", ())),
        "row_types_kept": kept,
    }


@pytest.mark.skipif(
    not Path("/proc/self/statm").exists() or not hasattr(ctypes.CDLL(None), "mallopt"),
    reason="reads the resident size from /proc and sets glibc's mmap threshold",
)
@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_memory_stays_flat_when_counts_change_every_step(backend: str) -> None:
    ranks = uc.testing.spawn(soak, 2, backend=backend, timeout=240)
    for rank, figures in enumerate(ranks):
        assert figures["growth"] < GROWTH_LIMIT, (
            f"rank {rank}: resident memory grew by {figures['growth'] / 2**20:.1f} MiB over {STEPS - WARMUP} steps"
        )
        assert 0 < figures["accepted_bytes"] <= memory.MAX_BYTES, figures
        if backend == "mpi":  # one MPI datatype per row size, and 80 sizes went by
            assert 0 < figures["row_types"] <= figures["row_types_kept"] < 80, figures
