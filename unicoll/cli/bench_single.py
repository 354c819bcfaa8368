"""The one-rank world of ``unicoll bench`` (:mod:`unicoll.cli.bench`): the front end on its
own (the backend's transfers stubbed out) and a single-process memory copy of each size."""

from __future__ import annotations

import itertools
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..launch.process import write_atomically
from .bench_cases import CASES, World
from .bench_config import Config
from .bench_sweep import BLOCK_BYTES, FRONTEND_BYTES, MAX_BLOCK, time_calls

_FRONTEND_PER_ITER = 100
"""Calls of the front-end measurement per ``--iters``: 2000 at the default 20, with a tenth as
many warm-up calls; a quick run (``--iters 1``) times 100."""


def single(config: Config, result_path: str) -> None:
    """On a world of one: the front end (:func:`_frontend`) and the memory copy (:func:`_copy`)."""
    w = World(config)
    write_atomically(result_path, json.dumps({"frontend": _frontend(w), "copy": _copy(config)}))


def _copy(config: Config) -> list[dict[str, float]]:
    """A single-process memory copy (``numpy.copyto``, one thread) of each size of the sweep,
    timed as the sweep times a call: the median of blocks of back-to-back copies."""
    rows = []
    for size in config.sizes():
        src, dst = np.ones(size, dtype=np.uint8), np.zeros(size, dtype=np.uint8)
        block = min(MAX_BLOCK, max(1, BLOCK_BYTES // size))
        for _ in range(config.warmup + 1):
            np.copyto(dst, src)
        samples = []
        for _ in range(config.iters):
            start = time.perf_counter_ns()
            for _ in range(block):
                np.copyto(dst, src)
            samples.append((time.perf_counter_ns() - start) / block)
        ns = statistics.median(samples)
        rows.append({"size_bytes": size, "time_us": ns / 1e3, "gbps": size / ns})
    return rows


def _frontend(w: World) -> dict[str, Any]:
    """Per operator: the front end alone (``frontend_us``: the call with the backend's transfer
    primitives stubbed out, less an empty call), and the whole call beside the raw transfer it
    issues (``unicoll_us``, ``raw_us`` and their ``difference_us``). For the MoE operators also
    ``frontend_fresh_counts_us``: the front end when every call brings new counts, so that
    neither the validator's memory nor a plan made for earlier counts can help."""
    from unicoll.runtime import transport_stubbed

    figures, calls = {}, _FRONTEND_PER_ITER * w.config.iters
    for op in w.config.ops:
        case = CASES[op](w, FRONTEND_BYTES, False)
        uc_us, raw_us = time_calls(w, [case.unicoll, case.raw], calls, calls // 10, 1, _none)
        with transport_stubbed():
            stubbed_us, empty_us = time_calls(w, [case.unicoll, _none], calls, calls // 10, 1, _none)
        figures[op] = {
            "frontend_us": stubbed_us - empty_us,
            "unicoll_us": uc_us,
            "raw_us": raw_us,
            "difference_us": uc_us - raw_us,
        }
        if op in ("global_scatter", "global_gather"):
            fresh = _with_fresh_counts(op, w, calls)
            with transport_stubbed():
                fresh_us, _ = time_calls(w, [fresh, _none], calls, 0, 1, _none)
            figures[op]["frontend_fresh_counts_us"] = fresh_us - empty_us
    return {"bytes": FRONTEND_BYTES, "iters": calls, "ops": figures}


def _none() -> None:
    return None


def _with_fresh_counts(op: str, w: World, calls: int) -> Callable[[], Any]:
    """A one-rank ``op`` call whose counts differ from every recent call's (as in training,
    where the router's counts change every step), so nothing derived from them is reused in
    ``calls`` calls.
    Rows of one element, at least 4 experts (one expert leaves one way to count 64 rows)."""
    import unicoll as uc

    rows = 64  # rows of one element: enough ways to split them that no counts come back soon
    x = w.tensor(w.bits(0, op, rows * w.itemsize, rows, 1))
    rng, slots = np.random.default_rng(w.config.seed), max(4, w.config.experts)  # one expert: one way
    distinct = {tuple(rng.multinomial(rows, np.full(slots, 1 / slots))) for _ in range(4 * calls)}
    pool = itertools.cycle([np.array(c, dtype=np.int64) for c in distinct])  # one rank: global = local
    call = getattr(uc, op)

    def fresh() -> Any:
        counts = next(pool)
        return call(x, counts, counts)

    return fresh
