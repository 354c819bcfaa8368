"""Bad input: a clear TypeError/ValueError naming the parameter, on every rank, before any
communication (a correct call right after still lines up across ranks).

The cases of 2 ranks on gloo run in one spawned world of this module (helpers/several.py), in
this file's order: a world costs more to start than its cases take. The others run in the
session's shared worlds."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch

import unicoll as uc
from helpers.several import SESSION, Case, SharedWorlds, World, share

W = 2  # the world the table below is written for
X = np.arange(8, dtype=np.float32).reshape(4, 2)
IDS = np.array([[0, 1], [3, -1], [2, 2], [-1, -1]])  # top-2 expert ids for X's rows, E = 2
_STATIC_ROWS = (
    "moe.dispatch_static: capacity: expected at most 2147483647 rows in each rank's blocks "
    "(W * experts_per_rank * capacity, W = 2)"
)


def _static(capacity: object) -> object:
    """moe.dispatch_static of X with ``capacity`` (E = 2)."""
    return uc.moe.dispatch_static(X, IDS, experts_per_rank=2, capacity=capacity)


# (label, the bad call, exception type, words the message must contain)
BAD_CALLS = [
    ("rows != sum(local_count)", lambda: uc.global_scatter(X, [1, 1, 1, 0], [1, 1, 1, 1]),
     ValueError, ["global_scatter: local_count:", "sum(local_count)=3 for x with 4 rows"]),
    ("float counts (numpy)", lambda: uc.global_scatter(X, np.array([1.0, 1, 1, 1]), [1, 1, 1, 1]),
     TypeError, ["local_count:", "int32 or int64", "float64"]),
    ("float counts (list)", lambda: uc.global_gather(X, [1, 1, 1, 1], [1.0, 1.0, 1.0, 1.0]),
     TypeError, ["global_count:", "sequence of ints", "float"]),
    ("float counts (torch)", lambda: uc.global_scatter(X, torch.ones(4), [1, 1, 1, 1]),
     TypeError, ["local_count:", "float32"]),
    ("negative counts", lambda: uc.global_scatter(X, [2, 3, -1, 0], [1, 1, 1, 1]),
     ValueError, ["local_count:", "non-negative", "-1 at index 2"]),
    ("count length not W*E", lambda: uc.global_scatter(X, [1, 1, 2], [1, 1, 2]),
     ValueError, ["local_count:", "multiple of the group size 2", "length 3"]),
    ("count lengths differ", lambda: uc.global_scatter(X, [1, 1, 1, 1], [2, 2]),
     ValueError, ["global_count:", "same length as local_count", "length 2"]),
    ("global_count sum != rows", lambda: uc.global_gather(X, [1, 1, 1, 1], [1, 1, 1, 0]),
     ValueError, ["global_gather: global_count:", "sum(global_count)=3 for x with 4 rows"]),
    ("in splits do not sum", lambda: uc.alltoall_single(None, X, in_split_sizes=[1, 2]),
     ValueError, ["alltoall_single: in_split_sizes:", "sum 3 for in_tensor with 4 rows"]),
    ("splits of wrong length", lambda: uc.alltoall_single(None, X, [4], [4]),
     ValueError, ["in_split_sizes:", "2 entries", "length 1"]),
    ("uneven rows, no splits", lambda: uc.alltoall_single(None, X[:3]),
     ValueError, ["in_tensor:", "divisible by the group size 2", "3 rows"]),
    ("out_tensor rows", lambda: uc.alltoall_single(np.empty((3, 2), np.float32), X, [2, 2], [2, 2]),
     ValueError, ["out_split_sizes:", "sum 4 for out_tensor with 3 rows"]),
    ("rows to self differ", lambda: uc.alltoall_single(None, X, [1, 3], [2, 2]),
     ValueError, ["out_split_sizes:", "the rows it sends itself", "while it sends itself 2"]),
    ("even out, rows to self differ", lambda: uc.alltoall_single(np.empty((6, 2), np.float32), X),
     ValueError, ["out_split_sizes:", "3 rows from this rank", "(an even split of out_tensor) while it sends itself 2"]),
    ("out_tensor dtype", lambda: uc.alltoall_single(np.empty((4, 2), np.float64), X),
     TypeError, ["out_tensor:", "numpy float64 (4, 2)", "in_tensor numpy float32 (4, 2)"]),
    ("out_tensor trailing shape", lambda: uc.alltoall_single(np.empty((4, 3), np.float32), X),
     TypeError, ["out_tensor:", "trailing shape"]),
    ("out_tensor library", lambda: uc.alltoall_single(torch.empty(4, 2), X),
     TypeError, ["out_tensor:", "library"]),
    ("out_tensor not contiguous", lambda: uc.alltoall_single(np.empty((4, 4), np.float32)[:, :2], X),
     ValueError, ["out_tensor:", "C-contiguous"]),
    ("unsupported dtype", lambda: uc.all_gather(None, X.astype(np.complex64)),
     TypeError, ["all_gather: tensor:", "one of the dtypes", "complex64"]),
    ("not an array", lambda: uc.all_gather(None, [1, 2, 3]),
     TypeError, ["all_gather: tensor:", "a numpy array, a torch tensor", "list"]),
    ("0-d array", lambda: uc.all_gather(None, np.float32(1.0).reshape(())),
     ValueError, ["tensor:", "at least one dimension"]),
    ("gather into wrong rows", lambda: uc.all_gather(np.empty((5, 2), np.float32), X),
     ValueError, ["tensor_or_tensor_list:", "5 rows for 2 ranks of 4 rows"]),
    ("gather list length", lambda: uc.all_gather([np.empty((4, 2), np.float32)], X),
     ValueError, ["tensor_or_tensor_list:", "a list of length 1"]),
    ("gather list dtype", lambda: uc.all_gather([np.empty((4, 2), np.int64)] * 2, X),
     TypeError, ["tensor_or_tensor_list:", "int64"]),
    ("async on calc stream", lambda: uc.global_scatter(X, [1, 1, 1, 1], [1, 1, 1, 1], sync_op=False),
     ValueError, ["use_calc_stream:", "False when sync_op=False", "True with sync_op=False"]),
    ("sync_op not bool", lambda: uc.alltoall_single(None, X, sync_op="yes"),
     TypeError, ["sync_op:", "True or False", "str"]),
    ("group of wrong type", lambda: uc.all_gather(None, X, group=[0, 1]),
     TypeError, ["group:", "unicoll.Group", "list"]),
    ("counts whose int64 sum wraps (list)", lambda: uc.global_scatter(X, [2**63 - 1, 2**63 - 1, 3, 3], [1, 1, 1, 1]),
     ValueError, ["global_scatter: local_count:", "sum fits in int64", "a sum of 18446744073709551620"]),
    ("counts whose int64 sum wraps (numpy)", lambda: uc.global_gather(X, [1, 1, 1, 1], np.array([2**63 - 1, 2**63 - 1, 3, 3])),
     ValueError, ["global_gather: global_count:", "sum fits in int64", "a sum of 18446744073709551620"]),
    ("a count of 2**63", lambda: uc.alltoall_single(None, X, in_split_sizes=[2**63, 4]),
     ValueError, ["alltoall_single: in_split_sizes:", "sum fits in int64", "a sum of 9223372036854775812"]),
    ("uint64 counts (sequence)", lambda: uc.exchange_counts([np.uint64(2**63), np.uint64(0)]),
     ValueError, ["exchange_counts: local_count:", "sum fits in int64", "a sum of 9223372036854775808"]),
    ("uint64 counts (array)", lambda: uc.global_scatter(X, np.ones(4, np.uint64), [1, 1, 1, 1]),
     TypeError, ["global_scatter: local_count:", "int32 or int64", "uint64"]),
    ("counts on the meta device", lambda: uc.alltoall_single(None, X, torch.tensor([2, 2], device="meta")),
     ValueError, ["alltoall_single: out_split_sizes:", "on the host or a CUDA device", "on meta"]),
    ("big-endian input", lambda: uc.all_gather(None, X.astype(">f4")),
     TypeError, ["all_gather: tensor:", "native byte order", "non-native byte order"]),
    ("big-endian output", lambda: uc.alltoall_single(np.empty((4, 2), ">f4"), X),
     TypeError, ["alltoall_single: out_tensor:", "native byte order", "non-native byte order"]),
    ("unknown reduction", lambda: uc.all_reduce(X.copy(), op="mean"),
     ValueError, ["all_reduce: op:", "one of sum, avg, max, min, prod", "got 'mean'"]),
    ("reduction not a str", lambda: uc.all_reduce(X.copy(), op=None),
     TypeError, ["all_reduce: op:", "one of the strings", "NoneType"]),
    ("avg of integers", lambda: uc.all_reduce(np.arange(4), op="avg"),
     TypeError, ["all_reduce: op:", "avg needs a floating dtype", "got 'avg' on numpy int64 (4,) on cpu"]),
    ("avg of bools", lambda: uc.reduce_scatter(None, torch.ones(4, dtype=torch.bool), op="avg"),
     TypeError, ["reduce_scatter: op:", "'avg' on torch bool (4,) on cpu"]),
    ("all_reduce of a read-only array", lambda: uc.all_reduce(np.broadcast_to(X, (4, 2))),
     ValueError, ["all_reduce: tensor:", "C-contiguous, writable", "that is not"]),
    ("all_reduce of a strided view", lambda: uc.all_reduce(X.copy()[:, :1]),
     ValueError, ["all_reduce: tensor:", "C-contiguous"]),
    ("all_reduce async on calc stream", lambda: uc.all_reduce(X.copy(), sync_op=False, use_calc_stream=True),
     ValueError, ["all_reduce: use_calc_stream:", "True with sync_op=False"]),
    ("reduce_scatter, uneven rows, no splits", lambda: uc.reduce_scatter(None, X[:3]),
     ValueError, ["reduce_scatter: tensor:", "divisible by the group size 2", "3 rows with split_sizes=None"]),
    ("reduce_scatter splits do not sum", lambda: uc.reduce_scatter(None, X, split_sizes=[1, 2]),
     ValueError, ["reduce_scatter: split_sizes:", "sum 3 for tensor with 4 rows"]),
    ("reduce_scatter splits of wrong length", lambda: uc.reduce_scatter(None, X, split_sizes=[4]),
     ValueError, ["reduce_scatter: split_sizes:", "2 entries", "length 1"]),
    ("reduce_scatter out rows", lambda: uc.reduce_scatter(np.empty((3, 2), np.float32), X),
     ValueError, ["reduce_scatter: out:", "the rows of this rank's block", "3 rows for a block of 2 rows"]),
    ("reduce_scatter out dtype", lambda: uc.reduce_scatter(np.empty((2, 2), np.float64), X),
     TypeError, ["reduce_scatter: out:", "numpy float64 (2, 2)", "tensor numpy float32 (4, 2)"]),
    ("broadcast from outside the group", lambda: uc.broadcast(X.copy(), 2),
     ValueError, ["broadcast: src:", "a position in the group, 0 <= src < 2", "got 2"]),
    ("broadcast from a negative rank", lambda: uc.broadcast(X.copy(), -1),
     ValueError, ["broadcast: src:", "got -1"]),
    ("broadcast src not an int", lambda: uc.broadcast(X.copy(), 0.0),
     TypeError, ["broadcast: src:", "an int", "float 0.0"]),
    ("broadcast src a bool", lambda: uc.broadcast(X.copy(), True),
     TypeError, ["broadcast: src:", "an int", "bool"]),
    ("in place on a leaf that requires grad", lambda: uc.all_reduce(torch.ones(2, requires_grad=True)),
     ValueError, ["all_reduce: tensor:", "torch.no_grad()", "a leaf torch float32 (2,) on cpu that requires grad"]),
    ("in place on a view of a leaf", lambda: uc.all_reduce(torch.ones(4, 2, requires_grad=True)[1]),
     ValueError, ["all_reduce: tensor:", "a view of a leaf torch float32 (2,) on cpu that requires grad"]),
    ("broadcast of a leaf that requires grad", lambda: uc.broadcast(torch.ones(2, requires_grad=True), 0),
     ValueError, ["broadcast: tensor:", "a leaf torch float32 (2,) on cpu that requires grad"]),
    ("max of a tensor that requires grad", lambda: uc.all_reduce(torch.ones(2, requires_grad=True) * 2, op="max"),
     ValueError, ["all_reduce: op:", "'sum' or 'avg' for a tensor that requires grad", "got 'max'"]),
    ("prod reduce_scatter that requires grad", lambda: uc.reduce_scatter(None, torch.ones(4, requires_grad=True), op="prod"),
     ValueError, ["reduce_scatter: op:", "'sum' or 'avg'", "got 'prod'"]),
    ("expert id past the last", lambda: uc.moe.dispatch(X, IDS + 1, experts_per_rank=2),
     ValueError, ["moe.dispatch: topk_idx:", "expert ids from -1 (a dropped slot) to W * experts_per_rank - 1",
                  "got 4 at [1, 0] (W * experts_per_rank = 4)"]),
    ("too many experts", lambda: uc.moe.dispatch(X, IDS, experts_per_rank=2**40),
     ValueError, ["moe.dispatch: experts_per_rank:", "at most 16777216 experts in all", "got 1099511627776"]),
    ("far too many experts", lambda: uc.moe.dispatch(X, IDS, experts_per_rank=2**70),
     ValueError, ["moe.dispatch: experts_per_rank:", "got 1180591620717411303424"]),
    ("expert id below -1", lambda: uc.moe.dispatch(X, IDS - 1, experts_per_rank=2),
     ValueError, ["moe.dispatch: topk_idx:", "got -2 at [1, 1]"]),
    ("k of weights and ids differ", lambda: uc.moe.dispatch(X, IDS, np.ones((4, 3), np.float32), experts_per_rank=2),
     ValueError, ["moe.dispatch: topk_weights:", "the shape of topk_idx", "shape (4, 3) for topk_idx of shape (4, 2)"]),
    ("integer weights", lambda: uc.moe.dispatch(X, IDS, np.ones((4, 2), np.int64), experts_per_rank=2),
     TypeError, ["moe.dispatch: topk_weights:", "a floating dtype", "numpy int64 (4, 2)"]),
    ("weights of another library", lambda: uc.moe.dispatch(X, IDS, torch.ones(4, 2), experts_per_rank=2),
     TypeError, ["moe.dispatch: topk_weights:", "the library and device of x", "torch float32 (4, 2) on cpu for x numpy"]),
    ("fewer ids than tokens", lambda: uc.moe.dispatch(X, IDS[:3], experts_per_rank=2),
     ValueError, ["moe.dispatch: topk_idx:", "as many rows as x", "shape (3, 2) for x with 4 rows"]),
    ("float ids", lambda: uc.moe.dispatch(X, IDS.astype(np.float32), experts_per_rank=2),
     TypeError, ["moe.dispatch: topk_idx:", "int32 or int64", "float32"]),
    ("1-D ids", lambda: uc.moe.dispatch(X, IDS[:, 0], experts_per_rank=2),
     ValueError, ["moe.dispatch: topk_idx:", "2-D array (tokens, k)", "(4,)"]),
    ("no experts", lambda: uc.moe.dispatch(X, IDS, experts_per_rank=0),
     ValueError, ["moe.dispatch: experts_per_rank:", "at least 1", "got 0"]),
    ("experts_per_rank a bool", lambda: uc.moe.dispatch(X, IDS, experts_per_rank=True),
     TypeError, ["moe.dispatch: experts_per_rank:", "an int", "bool"]),
    ("negative capacity", lambda: uc.moe.dispatch(X, IDS, experts_per_rank=2, capacity=-1),
     ValueError, ["moe.dispatch: capacity:", "non-negative", "got -1"]),
    ("static capacity of 2**31 rows", lambda: _static(2**29),
     ValueError, [f"{_STATIC_ROWS}, got 536870912 (W * experts_per_rank * capacity = 2147483648)"]),
    ("static capacity 2**31", lambda: _static(2**31), ValueError, [f"{_STATIC_ROWS}, got 2147483648 ("]),
    ("static capacity 2**40", lambda: _static(2**40), ValueError, [f"{_STATIC_ROWS}, got 1099511627776 ("]),
    ("static capacity 2**63", lambda: _static(2**63), ValueError, [f"{_STATIC_ROWS}, got 9223372036854775808 ("]),
    ("static capacity 2**64", lambda: _static(2**64), ValueError, [f"{_STATIC_ROWS}, got 18446744073709551616 ("]),
    ("static capacity int64", lambda: _static(np.int64(2**40)), ValueError, [f"{_STATIC_ROWS}, got 1099511627776 ("]),
    ("static capacity uint64", lambda: _static(np.uint64(2**63)),
     ValueError, [f"{_STATIC_ROWS}, got 9223372036854775808 ("]),
    ("static capacity -1", lambda: _static(-1),
     ValueError, ["moe.dispatch_static: capacity: expected a non-negative int, got -1"]),
    ("static capacity 1.5", lambda: _static(1.5),
     TypeError, ["moe.dispatch_static: capacity: expected an int, got float 1.5"]),
    ("static capacity True", lambda: _static(True),
     TypeError, ["moe.dispatch_static: capacity: expected an int, got bool True"]),
    ("static capacity numpy bool", lambda: _static(np.bool_(True)),
     TypeError, ["moe.dispatch_static: capacity: expected an int, got numpy bool"]),
    ("static max_tokens_per_rank below x's rows",
     lambda: uc.moe.dispatch_static(X, IDS, experts_per_rank=2, capacity=2, max_tokens_per_rank=3),
     ValueError, ["moe.dispatch_static: x: expected at most max_tokens_per_rank rows, got 4 rows for "
                  "max_tokens_per_rank=3"]),
    ("static max_tokens_per_rank -1",
     lambda: uc.moe.dispatch_static(X, IDS, experts_per_rank=2, capacity=2, max_tokens_per_rank=-1),
     ValueError, ["moe.dispatch_static: max_tokens_per_rank: expected a non-negative int or None, got -1"]),
    ("static max_tokens_per_rank 4.0",
     lambda: uc.moe.dispatch_static(X, IDS, experts_per_rank=2, capacity=2, max_tokens_per_rank=4.0),
     TypeError, ["moe.dispatch_static: max_tokens_per_rank: expected an int or None, got float 4.0"]),
    ("combine without a handle", lambda: uc.moe.combine(X, "handle"),
     TypeError, ["moe.combine: handle:", "a handle returned by moe.dispatch", "str"]),
    ("redispatch without a handle", lambda: uc.moe.redispatch(X, None),
     TypeError, ["moe.redispatch: handle:", "a handle returned by moe.dispatch", "NoneType"]),
]  # fmt: skip


def run_bad_calls(rank: int) -> tuple[list[tuple[str, str, str]], list]:
    """Every bad call on this rank, then one good all-to-all that must still line up."""
    caught = []
    for label, call, _, _ in BAD_CALLS:
        try:
            call()
        except Exception as exc:  # recorded, asserted in the parent
            caught.append((label, type(exc).__name__, str(exc)))
        else:
            caught.append((label, "no error", ""))
    return caught, uc.alltoall_single(None, X + rank).tolist()


@pytest.fixture(scope="module", params=["gloo", "mpi"])
def bad_call_outcomes(request, worlds: SharedWorlds):
    if request.param == "gloo":
        return worlds.results("gloo", "bad calls")
    return SESSION.results(BAD_CALLS_ON_MPI, "validation: bad calls")


@pytest.mark.parametrize("index", range(len(BAD_CALLS)), ids=[b[0] for b in BAD_CALLS])
def test_bad_call_raises_on_every_rank(index, bad_call_outcomes) -> None:
    label, _, error, words = BAD_CALLS[index]
    for rank, (caught, _) in enumerate(bad_call_outcomes):
        got_label, got_type, message = caught[index]
        assert got_label == label
        assert got_type == error.__name__, f"rank {rank}: {got_type}: {message}"
        for word in words:
            assert word in message, f"rank {rank}: {word!r} not in {message!r}"


def test_no_communication_before_the_error(bad_call_outcomes) -> None:
    """A bad call sent nothing: the good all-to-all after them pairs up correctly."""
    expected = [np.concatenate([X[:2] + 0, X[:2] + 1]), np.concatenate([X[2:] + 0, X[2:] + 1])]
    for rank, (_, good) in enumerate(bad_call_outcomes):
        np.testing.assert_array_equal(np.array(good), expected[rank])


def rank_outside_group(rank: int) -> str:
    group = uc.new_group([1, 2])
    if rank != 0:
        return repr(uc.all_gather(None, X, group=group).shape)
    with pytest.raises(
        ValueError, match=r"all_gather: group: expected a group this rank belongs to, got Group\(ranks=\[1, 2\]\)"
    ):
        uc.all_gather(None, X, group=group)
    with pytest.raises(ValueError, match="group: expected a group this rank belongs to"):
        group.rank  # noqa: B018
    return "raised"


def test_group_this_rank_is_not_in() -> None:
    assert SESSION.results(OUTSIDE, "validation: rank outside its group") == ["raised", "(8, 2)", "(8, 2)"]


def test_operator_before_init() -> None:
    assert not uc.is_initialized()
    for name, call in (
        ("global_scatter", lambda: uc.global_scatter(X, [4], [4])),
        ("get_rank", lambda: uc.get_rank()),
        ("barrier", lambda: uc.barrier()),
    ):
        with pytest.raises(
            uc.NotInitializedError, match=rf"^{name}: unicoll is not initialized: call unicoll.init\(\) first"
        ):
            call()
    with pytest.raises(ValueError):  # also catchable as ValueError, as torch.distributed raises
        uc.all_gather(None, X)


@pytest.mark.usefixtures("clean_env")
def test_static_capacities_on_one_rank() -> None:
    """W = 1, E = 1: each rank's blocks are capacity rows, so 2**31 is one too many; refused
    before anything is allocated (before: MemoryError, OverflowError, or at 2**63 a
    CrossRankMismatchError between a rank and itself)."""
    uc.init("gloo")
    bound = "expected at most 2147483647 rows in each rank's blocks (W * experts_per_rank * capacity, W = 1)"
    for capacity, error, message in [
        (2**31, ValueError, f"{bound}, got 2147483648 (W * experts_per_rank * capacity = 2147483648)"),
        (2**40, ValueError, f"{bound}, got 1099511627776 ("),
        (2**63, ValueError, f"{bound}, got 9223372036854775808 ("),
        (2**64, ValueError, f"{bound}, got 18446744073709551616 ("),
        (np.int64(2**31), ValueError, f"{bound}, got 2147483648 ("),
        (np.uint64(2**64 - 1), ValueError, f"{bound}, got 18446744073709551615 ("),
        (-1, ValueError, "expected a non-negative int, got -1"),
        (1.5, TypeError, "expected an int, got float 1.5"),
        (True, TypeError, "expected an int, got bool True"),
    ]:
        with pytest.raises(error, match=re.escape(f"moe.dispatch_static: capacity: {message}")):
            uc.moe.dispatch_static(X, IDS, experts_per_rank=1, capacity=capacity)
    rows, _, _ = uc.moe.dispatch_static(X, IDS, experts_per_rank=1, capacity=0)
    assert rows.shape == (1, 0, 2)


def near_twins_of_accepted_calls(rank: int) -> list:
    """The validator remembers accepted calls by signature (unicoll.validate); each call below
    differs from an accepted one in one thing its checks read, and must still be refused."""
    lc, gc, changing = np.array([1, 1, 1, 1]), np.array([1, 1, 1, 1]), np.array([1, 1, 1, 1])
    out = np.empty_like(X)
    _, _, handle = uc.moe.dispatch(X, IDS, experts_per_rank=2)
    expert_rows = np.zeros((handle.received, 2), np.float32)
    accepted = [
        lambda: uc.moe.dispatch(X, IDS, experts_per_rank=2),
        lambda: uc.moe.combine(expert_rows, handle),
        lambda: uc.moe.redispatch(X, handle),
        lambda: uc.global_scatter(X, lc, gc),
        lambda: uc.global_scatter(X, changing, gc),
        lambda: uc.global_scatter(X, [1, 1, 1, 1], [1, 1, 1, 1]),
        lambda: uc.alltoall_single(out, X),
        lambda: uc.alltoall_single(out, X, sync_op=True),
        lambda: uc.all_reduce(np.arange(4)),
        lambda: uc.broadcast(np.arange(4), 1),
    ]
    for call in accepted:
        call()
    frozen = out.copy()
    frozen.flags.writeable = False
    twins = [
        (lambda: uc.moe.dispatch(X, IDS + 3, experts_per_rank=2), ValueError, "got 6 at [1, 0]"),
        (lambda: uc.moe.combine(expert_rows.astype(bool), handle), TypeError, "not bool"),
        (lambda: uc.moe.combine(expert_rows[1:], handle), ValueError, "as many rows as the handle's dispatch returned"),
        (lambda: uc.moe.redispatch(X[1:], handle), ValueError, "3 rows for 4 tokens"),
        (
            lambda: uc.moe.redispatch(torch.from_numpy(X), handle),
            TypeError,
            "the library and device of the dispatched x",
        ),
        (lambda: uc.global_scatter(X, [1.0, 1, 1, 1], [1, 1, 1, 1]), TypeError, "sequence of ints"),
        (lambda: uc.global_scatter(X, [1, 1, True, 1], [1, 1, 1, 1]), TypeError, "bool"),
        (lambda: uc.global_scatter(X, lc.astype(np.float64), gc), TypeError, "int32 or int64"),
        (lambda: uc.global_scatter(X, lc.reshape(2, 2), gc), ValueError, "1-D"),
        (lambda: uc.global_scatter(X[:3], lc, gc), ValueError, "sum(local_count)=4 for x with 3 rows"),
        (lambda: uc.alltoall_single(frozen, X), ValueError, "writable"),
        (lambda: uc.alltoall_single(out, X, sync_op=1), TypeError, "True or False"),
        (lambda: uc.alltoall_single(out.astype(np.float64), X), TypeError, "dtype"),
        (lambda: uc.all_reduce(np.arange(4), op="avg"), TypeError, "floating dtype"),
        (lambda: uc.broadcast(np.arange(4), 2), ValueError, "0 <= src < 2"),
        (lambda: uc.broadcast(np.arange(4), True), TypeError, "an int"),
    ]
    changing[2] = 2  # an accepted call's own array, changed in place: now sums to 5 for 4 rows
    twins.append((lambda: uc.global_scatter(X, changing, gc), ValueError, "sum(local_count)=5"))
    caught = []
    for call, error, words in twins:
        with pytest.raises(error, match=re.escape(words)):
            call()
        caught.append(words)
    return caught


def test_remembered_calls_are_no_loophole(worlds: SharedWorlds) -> None:
    assert worlds.results("gloo", "near twins")[0][-1] == "sum(local_count)=5"


def counts_changed_after_the_call(rank: int) -> list:
    """A remembered call keeps its own copy of the counts: changing the first call's array
    afterwards does not change what a later call with equal counts sends."""
    first = np.array([1, 3])
    uc.global_scatter(X + rank, first, np.array([1, 1] if rank == 0 else [3, 3]))
    first[:] = [3, 1]
    return uc.global_scatter(X + rank, np.array([1, 3]), np.array([1, 1] if rank == 0 else [3, 3])).tolist()


def test_remembered_counts_are_copies(worlds: SharedWorlds) -> None:
    results = worlds.results("gloo", "counts changed")
    expected = uc.reference.global_scatter([X, X + 1], [np.array([1, 3]), np.array([1, 3])])
    for got, want in zip(results, expected):
        np.testing.assert_array_equal(np.array(got), want)


def exchange_counts_remembered(rank: int) -> list:
    """exchange_counts remembers accepted calls like the operators: repeated and changed counts
    give the right result, and torch counts taken from memory raise no warning (the transport
    gets a writable copy of the remembered, read-only counts)."""
    counts = np.array([rank, 10 + rank])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        results = [uc.exchange_counts(counts).tolist() for _ in range(2)]
        counts[:] = [5 + rank, 15 + rank]
        results.append(uc.exchange_counts(counts).tolist())
        results += [uc.exchange_counts(torch.tensor([rank, 10 + rank])).tolist() for _ in range(2)]
        results.append(uc.exchange_counts([rank, 10 + rank]).tolist())
    return results


def test_exchange_counts_from_memory(worlds: SharedWorlds) -> None:
    results = worlds.results("gloo", "exchange_counts remembered")
    assert results == [
        [[0, 1], [0, 1], [5, 6], [0, 1], [0, 1], [0, 1]],
        [[10, 11], [10, 11], [15, 16], [10, 11], [10, 11], [10, 11]],
    ]


#: This module's world of W gloo ranks. No case's calls are remembered by an earlier one's (each
#: is refused, or has counts of other lengths or another operator), so each sees the memory
#: of accepted calls as on a fresh world.
WORLDS = {
    "gloo": World(
        W,
        [
            Case("bad calls", run_bad_calls),
            Case("near twins", near_twins_of_accepted_calls),
            Case("counts changed", counts_changed_after_the_call),
            Case("exchange_counts remembered", exchange_counts_remembered),
        ],
        {"backend": "gloo", "timeout": 60},
    ),
}
BAD_CALLS_ON_MPI = share("mpi", W, [Case("validation: bad calls", run_bad_calls)])  # refused whatever was remembered
OUTSIDE = share("gloo", 3, [Case("validation: rank outside its group", rank_outside_group)])


@pytest.fixture(scope="module")
def worlds() -> SharedWorlds:
    return SharedWorlds(WORLDS)
