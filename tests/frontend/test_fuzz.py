"""Property-based test: hypothesis draws operators, array libraries, dtypes, trailing shapes,
counts and split sizes, valid and invalid; each valid draw must match unicoll.reference and
each invalid one must raise its documented error, on every rank of a real 3-rank world.

Every rank runs the same derandomized hypothesis search, so all ranks draw the same cases in
the same order; check mode is on, so a draw that is wrong only across ranks raises too. The
world is the session's shared one of 3 gloo ranks in check mode (helpers/several.py).
"""

from __future__ import annotations

import numpy as np
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import unicoll as uc
from helpers.conformance import MISSING_DTYPES, to_library, to_numpy
from helpers.several import SESSION, Case, share
from unicoll import reference
from unicoll.arrays import DTYPES

WORLD = 3
EXAMPLES = 150

# invalid draws: the mutation, the operators it applies to, the error and words of its message
FAULTS = {
    "float_counts": (("global_scatter", "global_gather", "alltoall_single"), TypeError, "of dtype int32 or int64"),
    "negative_count": (("global_scatter", "global_gather", "alltoall_single"), ValueError, "expected non-negative"),
    "count_length": (("global_scatter", "global_gather", "alltoall_single"), ValueError, "expected "),
    "extra_row": (("global_scatter", "global_gather", "alltoall_single"), ValueError, "number of rows"),
    "complex_dtype": (("global_scatter", "global_gather", "alltoall_single", "all_gather"), TypeError, "one of the dtypes"),
    "async_on_calc_stream": (("global_scatter", "global_gather"), ValueError, "use_calc_stream: expected False"),
    "cross_rank": (("global_scatter", "global_gather", "alltoall_single", "all_gather"), uc.CrossRankMismatchError, "ranks disagree"),
}  # fmt: skip


@st.composite
def draws(draw: st.DrawFn) -> dict:
    op = draw(st.sampled_from(["global_scatter", "global_gather", "alltoall_single", "all_gather"]))
    library = draw(st.sampled_from(["numpy", "torch"]))
    dtype = draw(st.sampled_from([d for d in DTYPES if d not in MISSING_DTYPES[library]]))
    trailing = tuple(draw(st.lists(st.integers(0, 3), max_size=2)))
    experts = draw(st.integers(1, 3))
    counts = draw(
        st.lists(
            st.lists(st.integers(0, 3), min_size=WORLD * experts, max_size=WORLD * experts),
            min_size=WORLD,
            max_size=WORLD,
        )
    )
    fault = draw(st.sampled_from([None, None, None, *[f for f, (ops, _, _) in FAULTS.items() if op in ops]]))
    sync = draw(st.booleans())
    return dict(op=op, library=library, dtype=dtype, trailing=trailing, counts=np.array(counts), fault=fault, sync=sync)


def _values(rows: int, trailing: tuple, dtype: str, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    values = rng.integers(0, 50, (rows, *trailing))
    return values.astype("float32" if dtype == "bfloat16" else dtype)


def _run(d: dict, rank: int) -> tuple[object, np.ndarray | None]:
    """Call the drawn operator on this rank; returns (result, the expected result or None)."""
    op, counts, fault, world = d["op"], d["counts"].copy(), d["fault"], WORLD
    if op == "alltoall_single":
        counts = counts[:, :world]
    if fault == "cross_rank" and rank == 1 and counts[1].sum() > 0:  # move one row to another destination
        source = int(np.flatnonzero(counts[1])[0])
        counts[1, source] -= 1
        counts[1, (source + 1) % counts.shape[1]] += 1
    elif fault == "cross_rank" and rank == 1:
        counts[1, 0] += 1
    lib = lambda a: to_library(a, d["library"], d["dtype"], "cpu")  # noqa: E731
    kw = dict(sync_op=d["sync"], use_calc_stream=False) if fault != "async_on_calc_stream" else dict(sync_op=False)
    glob = np.stack(reference.global_counts(list(counts))) if op != "all_gather" else None
    if op == "all_gather":
        rows = [int(c.sum()) for c in counts]
        xs = [_values(n, d["trailing"], d["dtype"], seed=r) for r, n in enumerate(rows)]
        if fault == "cross_rank":  # rank 1 sends one row more than the others expect
            xs[1] = _values(rows[1] + 1, d["trailing"], d["dtype"], seed=1) if rank == 1 else xs[1]
        x = xs[rank].astype(np.complex64) if fault == "complex_dtype" else lib(xs[rank])
        target = [lib(np.zeros_like(xs[c])) for c in range(world)]
        return uc.all_gather(target, x, **kw), np.concatenate(xs) if fault is None else None
    local, mine_glob = counts[rank], glob[rank] if op != "alltoall_single" else counts[:, rank]
    sent = local if op != "global_gather" else mine_glob
    x_np = _values(int(sent.sum()), d["trailing"], d["dtype"], seed=rank)
    local_arg, glob_arg = local.copy(), mine_glob.copy()
    if fault == "float_counts":
        local_arg = local_arg.astype(np.float64)
    elif fault == "negative_count":
        glob_arg[0] = -1
    elif fault == "count_length":
        local_arg = np.append(local_arg, 0)
    elif fault == "extra_row":
        x_np = _values(int(sent.sum()) + 1, d["trailing"], d["dtype"], seed=rank)
    x = x_np.astype(np.complex64) if fault == "complex_dtype" else lib(x_np)
    if op == "alltoall_single":
        result = uc.alltoall_single(None, x, glob_arg, local_arg, **kw)
        xs = [_values(int(c.sum()), d["trailing"], d["dtype"], seed=r) for r, c in enumerate(counts)]
        return result, reference.alltoall_single(xs, list(counts))[rank]
    fn = uc.global_scatter if op == "global_scatter" else uc.global_gather
    xs = [
        _values(int(c.sum()), d["trailing"], d["dtype"], seed=r)
        for r, c in enumerate(counts if op == "global_scatter" else glob)
    ]
    ref = (reference.global_scatter if op == "global_scatter" else reference.global_gather)(xs, list(counts))
    return fn(x, local_arg, glob_arg, **kw), ref[rank]


def fuzz(rank: int) -> int:
    seen = {"valid": 0, "invalid": 0}

    @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None, phases=[Phase.generate])
    @given(draws())
    def one(d: dict) -> None:
        fault = d["fault"]
        try:
            result, expected = _run(d, rank)
            if isinstance(result, uc.Task):
                result = result.wait()
        except Exception as exc:
            if fault is None:
                raise
            _, error, words = FAULTS[fault]
            assert isinstance(exc, error), f"{fault}: {type(exc).__name__}: {exc}"
            assert words in str(exc), f"{fault}: {exc}"
            seen["invalid"] += 1
            return
        assert fault is None, f"{fault} on {d['op']} raised nothing"
        got = np.concatenate([to_numpy(r) for r in result]) if isinstance(result, list) else to_numpy(result)
        np.testing.assert_array_equal(got, expected.astype(got.dtype) if d["dtype"] == "bfloat16" else expected)
        seen["valid"] += 1

    one()
    return seen["valid"], seen["invalid"]


FUZZ = share("gloo", WORLD, [Case("fuzz", fuzz)], check=True, timeout=240)


def test_fuzzed_calls_match_the_reference_or_raise_their_error() -> None:
    outcomes = SESSION.results(FUZZ, "fuzz")
    assert len(set(outcomes)) == 1, f"ranks saw different outcomes: {outcomes}"
    valid, invalid = outcomes[0]
    assert valid + invalid == EXAMPLES and valid > EXAMPLES // 4 and invalid > EXAMPLES // 4, outcomes
