"""The validator's memory of accepted calls (unicoll.validate), on a world of one rank: what a
remembered call keeps, that calls taken from it still compute the right thing, and how it
admits calls when every call brings new counts."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

import unicoll as uc
from unicoll import runtime, validate
from unicoll.cache import BoundedCache
from unicoll.spec import GLOBAL_SCATTER

pytestmark = pytest.mark.usefixtures("clean_env")


def _memory() -> BoundedCache:
    return runtime.state("test").memory.accepted


def test_remembered_calls_keep_no_caller_array_and_serve_new_arrays() -> None:
    """Each call below is remembered (its signature repeats); the caller's arrays and counts
    die with the caller's last reference, and the calls taken from memory use the new
    call's arrays, never the remembered one's."""
    uc.init("gloo")
    refs = []
    for step in range(3):
        x, out = torch.arange(6.0) + step, torch.empty(6)
        counts = np.array([2, 1, 3])
        assert uc.alltoall_single(out, x) is out and torch.equal(out, x)
        y = uc.global_scatter(x.numpy(), counts, counts)  # one rank, three experts: the rows as they are
        np.testing.assert_array_equal(y, x.numpy())
        np.testing.assert_array_equal(uc.global_gather(y, counts, counts.copy()), x.numpy())
        assert torch.equal(uc.all_reduce(x.clone()), x)
        refs += [weakref.ref(a) for a in (x, out, counts)]
        del x, out, counts, y
    gc.collect()
    assert len(_memory()) >= 4
    assert all(ref() is None for ref in refs)


def test_a_remembered_call_is_not_changed_by_the_calls_it_serves() -> None:
    """A call taken from memory with counts of the same values but another array object, and
    the caller's counts changed in place after a call: the remembered counts stay the ones read."""
    uc.init("gloo")
    counts = np.array([1, 2])
    x = np.arange(3.0)
    uc.global_scatter(x, counts, counts)
    counts[:] = [2, 1]  # the remembered call copied the counts it read
    np.testing.assert_array_equal(uc.global_scatter(x, counts, counts), x)
    with pytest.raises(ValueError, match="sum\\(local_count\\)=3 for x with 4 rows"):
        uc.global_scatter(np.arange(4.0), counts, counts)


def test_after_a_streak_of_new_counts_one_call_in_streak_is_remembered() -> None:
    """Counts that never repeat (a training loop's router): the first calls of the streak are
    remembered, then one in ``_STREAK``; once counts repeat, the memory serves them again, each
    call served takes ``_CREDIT`` off the count, and every call is remembered again."""
    uc.init("gloo")
    streak, x = validate._STREAK, np.arange(40.0)
    fresh = iter([np.array([a, 40 - a - b, b]) for a in range(41) for b in range(41 - a)])  # 861, all distinct
    for _ in range(streak - 1):
        uc.global_scatter(x, (c := next(fresh)), c)
    remembered = len(_memory())
    assert remembered == streak - 1
    for _ in range(3 * streak):
        uc.global_scatter(x, (c := next(fresh)), c)
    assert len(_memory()) == remembered + 3  # the streak's 64th, 128th and 192nd call
    assert runtime.state("test").memory.missed[GLOBAL_SCATTER] >= streak
    repeated, missed = np.array([20, 0, 20]), runtime.state("test").memory.missed
    before = len(_memory())
    for _ in range(streak):  # remembered at the count's next multiple of 64 at the latest
        np.testing.assert_array_equal(uc.global_scatter(x, repeated, repeated), x)
        if len(_memory()) > before:
            break
    count = missed[GLOBAL_SCATTER]
    np.testing.assert_array_equal(uc.global_scatter(x, repeated, repeated), x)  # served
    assert missed[GLOBAL_SCATTER] == count - validate._CREDIT
    for _ in range(count // validate._CREDIT):
        uc.global_scatter(x, repeated, repeated)
    assert GLOBAL_SCATTER not in missed
    before = len(_memory())
    uc.global_scatter(x, (c := np.array([40, 0, 0])), c)  # not yet in the stream above
    assert len(_memory()) == before + 1  # remembered at once again


def test_counts_that_come_back_now_and_then_do_not_restart_the_streak() -> None:
    """A router whose counts repeat once in a while (here one call in 20 is served): each served
    call takes only ``_CREDIT`` off the count, so the memory keeps remembering about one new call
    in ``_STREAK`` instead of starting over at every call it serves."""
    uc.init("gloo")
    streak, x = validate._STREAK, np.arange(40.0)
    fresh = iter(
        [np.array([a, b, c, 40 - a - b - c]) for a in range(41) for b in range(41 - a) for c in range(41 - a - b)]
    )
    repeated = np.array([10, 10, 10, 10])
    uc.global_scatter(x, repeated, repeated)
    for _ in range(streak):
        uc.global_scatter(x, (c := next(fresh)), c)
    before, calls = len(_memory()), 20 * streak
    for i in range(calls):
        counts = repeated if i % 20 == 0 else next(fresh)
        uc.global_scatter(x, counts, counts)
    assert len(_memory()) - before <= 2 * calls // streak  # a served call can bring a multiple of 64 back once


def test_the_memory_counts_a_plans_lists() -> None:
    """alltoall_single remembers its split sizes as lists (its plan): counted in the bytes."""
    uc.init("gloo")
    x = np.arange(4.0)
    uc.alltoall_single(None, x, in_split_sizes=[4], out_split_sizes=[4])
    kept = _memory().nbytes
    assert kept == validate._ENTRY_OVERHEAD + 2 * validate._BYTES_PER_COUNT + 2 * validate._BYTES_PER_PLANNED


def test_transport_stubbed_forgets_the_calls_remembered_with_the_real_transport() -> None:
    """Remembered calls carry the backend they ran on: the stub's must not move bytes after the
    block, nor the real one's run inside it."""
    uc.init("gloo")
    x, out = np.arange(4.0), np.zeros(4)
    uc.alltoall_single(out, x)
    with runtime.transport_stubbed():
        out[:] = -1
        uc.alltoall_single(out, x)
        assert out.tolist() == [-1.0] * 4
    uc.alltoall_single(out, x)
    assert out.tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_float_tensor_counts_get_the_counts_error(dtype: torch.dtype) -> None:
    """Counts of a floating torch dtype are refused by the reader with the usual message,
    bfloat16 too (which numpy, where signatures read counts' bytes, does not have)."""
    uc.init("gloo")
    counts = torch.tensor([4], dtype=dtype)
    with pytest.raises(TypeError, match="global_scatter: local_count: expected a torch tensor of dtype int32 or int64"):
        uc.global_scatter(np.arange(4.0), counts, counts)


def test_a_remembered_static_dispatch_keeps_no_router_ids() -> None:
    """moe.dispatch_static's topk_idx stays the caller's array (never read into a copy): the
    remembered call, and the call the memory serves, let it go with the caller's last reference."""
    uc.init("gloo")
    x = torch.ones(4, 3)
    for _ in range(2):  # remembered, then served
        ids = torch.zeros(4, 2, dtype=torch.int64)
        uc.moe.dispatch_static(x, ids, experts_per_rank=1, capacity=8)
        dead = weakref.ref(ids)
        del ids
        gc.collect()
        assert dead() is None
    assert len(_memory()) == 1
