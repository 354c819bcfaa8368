"""The memory of accepted calls never stands in for a rule: for each rule of each spec, a call
that passes it and calls that differ only in what that rule reads (and fail it) never share a
memory entry. After the passing call was accepted (and remembered), each failing one still
raises that rule's error, the same error it raises with an empty memory.

Before, a handle's signature left out its number of tokens: after a valid ``moe.redispatch``
with handle A (6 tokens, 12 rows), one with handle B (4 tokens, 12 rows) and x of 6 rows was
accepted from memory and silently sent x's first rows.

Run on a world of 2 ranks (rules about the group size cannot fail on one), calling the
validator itself: nothing but the handles' dispatches is sent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import unicoll as uc
from unicoll import runtime, validate
from unicoll.spec import REQUIRED, SPECS, OpSpec


def _rows(n: int, dtype: Any = np.float32, width: int = 2) -> np.ndarray:
    return np.zeros((n, width), dtype)


def _blocks(rows: int, dtype: Any = np.float32) -> np.ndarray:
    """Expert outputs of one expert per rank: (1, rows, 2)."""
    return np.zeros((1, rows, 2), dtype)


def _handles() -> dict[str, Any]:
    """Handles whose signatures once matched: every rank sends every slot to its own expert, so
    A (6 tokens, top-2) and B (4 tokens, top-3) each receive 12 rows; C receives 10 and W
    (weighted) 12. Static ones: SA (6 tokens) and SB (4 tokens) have blocks of (1, 12) rows, SC
    of (1, 10), SW is weighted."""
    rank = uc.get_rank()

    def dispatch(tokens: int, k: int, weighted: bool = False) -> uc.moe.Handle:
        ids = np.full((tokens, k), rank, np.int64)
        weights = np.ones((tokens, k), np.float32) if weighted else None
        return uc.moe.dispatch(_rows(tokens), ids, weights, experts_per_rank=1)[2]

    def static(tokens: int, k: int, capacity: int, weighted: bool = False) -> uc.moe.StaticHandle:
        ids = np.full((tokens, k), rank, np.int64)
        weights = np.ones((tokens, k), np.float32) if weighted else None
        return uc.moe.dispatch_static(_rows(tokens), ids, weights, experts_per_rank=1, capacity=capacity)[2]

    return {
        "A": dispatch(6, 2),
        "B": dispatch(4, 3),
        "C": dispatch(5, 2),
        "W": dispatch(6, 2, weighted=True),
        "SA": static(6, 2, 6),
        "SB": static(4, 3, 6),
        "SC": static(6, 2, 5),
        "SW": static(6, 2, 6, weighted=True),
    }


def _cases(h: dict[str, uc.moe.Handle]) -> list[tuple[str, int, dict[str, Any], list[dict[str, Any]]]]:
    """(operator, the rule's index in its spec, a call that passes every rule, changes to it
    that touch only what that rule reads and make it fail) on rank 0 of 2."""
    ids, weights = np.zeros((3, 1), np.int64), np.ones((3, 1), np.float32)
    dispatch = dict(x=_rows(3), topk_idx=ids, topk_weights=weights, experts_per_rank=1)
    static = {**dispatch, "capacity": 2}
    scatter = dict(x=_rows(3), local_count=[1, 2, 0, 0], global_count=[1, 2, 0, 0])
    gather = dict(x=_rows(3), local_count=[0, 0, 1, 2], global_count=[1, 2, 0, 0])
    splits = dict(out_tensor=None, in_tensor=_rows(4), in_split_sizes=[1, 3])
    peers = dict(out_tensor_or_tensor_list=_rows(4), in_tensor_or_tensor_list=_rows(4))  # lists are not remembered
    return [
        ("global_scatter", 0, scatter, [dict(local_count=[1, 2, 0])]),
        ("global_scatter", 1, scatter, [dict(global_count=[1, 2])]),
        ("global_scatter", 2, scatter, [dict(x=_rows(4)), dict(local_count=[1, 1, 0, 0])]),
        ("global_scatter", 3, scatter, [dict(sync_op=False)]),
        ("global_gather", 0, gather, [dict(local_count=[0, 1, 2])]),
        ("global_gather", 1, gather, [dict(global_count=[1, 2])]),
        ("global_gather", 2, gather, [dict(x=_rows(4)), dict(global_count=[1, 1, 0, 0])]),
        ("global_gather", 3, gather, [dict(sync_op=False)]),
        ("alltoall", 0, peers, [dict(out_tensor_or_tensor_list=None)]),
        ("alltoall", 1, peers, [dict(in_tensor_or_tensor_list=_rows(3)), dict(out_tensor_or_tensor_list=_rows(5))]),
        ("alltoall", 2, peers, [dict(in_tensor_or_tensor_list=_rows(4, np.float64))]),
        ("alltoall", 3, peers, [dict(out_tensor_or_tensor_list=_rows(6))]),
        ("alltoall", 4, {**peers, "use_calc_stream": True}, [dict(sync_op=False)]),
        ("alltoall_single", 0, splits, [dict(in_split_sizes=[4])]),
        ("alltoall_single", 1, splits, [dict(in_split_sizes=[1, 2]), dict(in_tensor=_rows(5))]),
        ("alltoall_single", 2, dict(out_tensor=None, in_tensor=_rows(4)), [dict(in_tensor=_rows(3))]),
        ("alltoall_single", 3, {**splits, "out_split_sizes": [1, 3]}, [dict(out_split_sizes=[1, 3, 0])]),
        ("alltoall_single", 4, {**splits, "out_split_sizes": [1, 3], "out_tensor": _rows(4)},
         [dict(out_tensor=_rows(5)), dict(out_split_sizes=[1, 4])]),
        ("alltoall_single", 5, dict(in_tensor=_rows(4), out_tensor=_rows(4)), [dict(out_tensor=_rows(3))]),
        ("alltoall_single", 6, {**splits, "out_split_sizes": [1, 3]}, [dict(out_split_sizes=[2, 2])]),
        ("alltoall_single", 7, dict(in_tensor=_rows(4), out_tensor=_rows(4)),
         [dict(out_tensor=_rows(4, np.float64)), dict(out_tensor=torch.zeros(4, 2)), dict(out_tensor=_rows(4, width=3))]),
        ("alltoall_single", 8, dict(out_tensor=None, in_tensor=_rows(4), use_calc_stream=True), [dict(sync_op=False)]),
        ("all_gather", 0, dict(tensor_or_tensor_list=_rows(6), tensor=_rows(3)),
         [dict(tensor_or_tensor_list=_rows(6, np.int64)), dict(tensor_or_tensor_list=[_rows(3), _rows(3, np.int64)])]),
        ("all_gather", 1, dict(tensor_or_tensor_list=_rows(6), tensor=_rows(3)),
         [dict(tensor_or_tensor_list=_rows(5)), dict(tensor=_rows(2)), dict(tensor_or_tensor_list=[_rows(2), _rows(3)])]),
        ("all_gather", 2, dict(tensor_or_tensor_list=None, tensor=_rows(3), use_calc_stream=True), [dict(sync_op=False)]),
        ("exchange_counts", 0, dict(local_count=[1, 2]), [dict(local_count=[1, 2, 3])]),
        ("moe.dispatch", 0, dispatch, [dict(experts_per_rank=2**40), dict(experts_per_rank=2**70)]),
        ("moe.dispatch", 1, dispatch, [dict(topk_idx=np.zeros((2, 1), np.int64))]),
        ("moe.dispatch", 2, dispatch, [dict(topk_idx=np.full((3, 1), 2, np.int64))]),
        ("moe.dispatch", 3, dispatch, [dict(topk_weights=np.ones((3, 1), np.int64))]),
        ("moe.dispatch", 4, dispatch, [dict(topk_weights=torch.ones(3, 1))]),
        ("moe.dispatch", 5, dispatch, [dict(topk_weights=np.ones((3, 2), np.float32))]),
        ("moe.redispatch", 0, dict(x=_rows(6), handle=h["A"]), [dict(handle=h["B"]), dict(x=_rows(4))]),
        ("moe.redispatch", 1, dict(x=_rows(6), handle=h["A"]), [dict(x=torch.zeros(6, 2))]),
        ("moe.combine", 0, dict(y=_rows(12), handle=h["A"]), [dict(handle=h["C"]), dict(y=_rows(10))]),
        ("moe.combine", 1, dict(y=_rows(12), handle=h["A"]), [dict(y=torch.zeros(12, 2))]),
        ("moe.combine", 2, dict(y=_rows(12), handle=h["A"]), [dict(y=_rows(12, bool))]),
        ("moe.combine", 3, dict(y=_rows(12, np.int64), handle=h["A"]), [dict(handle=h["W"])]),
        ("moe.dispatch_static", 0, static, [dict(experts_per_rank=2**40), dict(experts_per_rank=2**70)]),
        ("moe.dispatch_static", 1, static, [dict(topk_idx=np.zeros((2, 1), np.int64))]),
        ("moe.dispatch_static", 2, static, [dict(topk_idx=torch.zeros((3, 1), dtype=torch.int64))]),
        ("moe.dispatch_static", 3, static, [dict(topk_weights=np.ones((3, 1), np.int64))]),
        ("moe.dispatch_static", 4, static, [dict(topk_weights=torch.ones(3, 1))]),
        ("moe.dispatch_static", 5, static, [dict(topk_weights=np.ones((3, 2), np.float32))]),
        ("moe.dispatch_static", 6, static, [dict(capacity=2**30), dict(capacity=2**64),
                                           dict(experts_per_rank=2**23, capacity=2**7)]),
        ("moe.dispatch_static", 7, {**static, "max_tokens_per_rank": 3}, [
            dict(max_tokens_per_rank=2),
            dict(x=_rows(4), topk_idx=np.zeros((4, 1), np.int64), topk_weights=np.ones((4, 1), np.float32)),
        ]),
        ("moe.redispatch_static", 0, dict(x=_rows(6), handle=h["SA"]), [dict(handle=h["SB"]), dict(x=_rows(4))]),
        ("moe.redispatch_static", 1, dict(x=_rows(6), handle=h["SA"]), [dict(x=torch.zeros(6, 2))]),
        ("moe.combine_static", 0, dict(y=_blocks(12), handle=h["SA"]), [dict(handle=h["SC"]), dict(y=_rows(12))]),
        ("moe.combine_static", 1, dict(y=_blocks(12), handle=h["SA"]), [dict(y=torch.zeros(1, 12, 2))]),
        ("moe.combine_static", 2, dict(y=_blocks(12), handle=h["SA"]), [dict(y=_blocks(12, bool))]),
        ("moe.combine_static", 3, dict(y=_blocks(12, np.int64), handle=h["SA"]), [dict(handle=h["SW"])]),
        ("all_reduce", 0, dict(tensor=_rows(3), op="avg"), [dict(tensor=_rows(3, np.int64))]),
        ("all_reduce", 0, dict(tensor=_rows(3, np.int64), op="sum"), [dict(op="avg")]),
        ("all_reduce", 1, dict(tensor=_rows(3), use_calc_stream=True), [dict(sync_op=False)]),
        ("reduce_scatter", 0, dict(out=None, tensor=_rows(4), split_sizes=[1, 3]), [dict(split_sizes=[4])]),
        ("reduce_scatter", 1, dict(out=None, tensor=_rows(4), split_sizes=[1, 3]), [dict(split_sizes=[1, 2]), dict(tensor=_rows(5))]),
        ("reduce_scatter", 2, dict(out=None, tensor=_rows(4)), [dict(tensor=_rows(3))]),
        ("reduce_scatter", 3, dict(out=_rows(2), tensor=_rows(4)), [dict(out=_rows(2, np.float64))]),
        ("reduce_scatter", 4, dict(out=_rows(2), tensor=_rows(4)), [dict(out=_rows(3))]),
        ("reduce_scatter", 5, dict(out=None, tensor=_rows(4), op="avg"), [dict(tensor=_rows(4, np.int64))]),
        ("reduce_scatter", 6, dict(out=None, tensor=_rows(4), use_calc_stream=True), [dict(sync_op=False)]),
        ("broadcast", 0, dict(tensor=_rows(2), src=1), [dict(src=2), dict(src=-1)]),
        ("broadcast", 1, dict(tensor=_rows(2), src=0, use_calc_stream=True), [dict(sync_op=False)]),
        ("reduce", 0, dict(tensor=_rows(2), dst=1), [dict(dst=2), dict(dst=-1)]),
        ("reduce", 1, dict(tensor=_rows(3, np.int64), dst=0, op="max"), [dict(op="avg")]),
        ("reduce", 2, dict(tensor=_rows(2), dst=0, use_calc_stream=True), [dict(sync_op=False)]),
    ]  # fmt: skip


def _arguments(spec: OpSpec, given: dict[str, Any]) -> dict[str, Any]:
    """Every parameter of ``spec`` by name, as the public function hands them to the validator
    (which takes moe.redispatch's and moe.combine's group from their handle)."""
    arguments = {p.name: p.default for p in spec.params if p.default is not REQUIRED}
    arguments.update(given)
    arguments.setdefault("group", given["handle"].group if "handle" in given else None)
    return arguments


def _outcome(spec: OpSpec, arguments: dict[str, Any]) -> str | None:
    """The validator's error for ``arguments``, or None when it accepts them."""
    try:
        validate.prepare(spec, arguments)
    except (TypeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _key(spec: OpSpec, arguments: dict[str, Any]) -> tuple:
    """The memory's key of a call, built as the validator builds it."""
    return (spec, *(sign(arguments[name]) for name, sign in spec.signed))


def every_rule_against_the_memory(rank: int) -> list[tuple[str, int, str | None, str | None, bool, bool]]:
    """For each case: the error with the passing call remembered, the error with an empty
    memory, whether the passing call was remembered, whether the keys differ."""
    memory = runtime.state("test").memory.accepted
    seen = []
    for name, index, base, changes in _cases(_handles()):
        spec = SPECS[name]
        passing = _arguments(spec, base)
        for change in changes:
            failing = _arguments(spec, {**base, **change})
            memory.clear()
            fresh = _outcome(spec, failing)
            assert _outcome(spec, passing) is None, (name, index, base)
            remembered = len(memory) == 1
            after = _outcome(spec, failing)
            seen.append((name, index, after, fresh, remembered, _key(spec, passing) != _key(spec, failing)))
    return seen


def _expected(name: str, index: int) -> Callable[[str], bool]:
    rule = SPECS[name].rules[index]
    prefix = f"{rule.error.__name__}: {name}: {rule.param}: expected {rule.expected.replace('{W}', '2')}, got "
    return lambda message: message.startswith(prefix)


def test_no_memory_entry_stands_in_for_a_rule() -> None:
    seen = uc.testing.spawn(every_rule_against_the_memory, 2)[0]
    covered = {(name, index) for name, index, *_ in seen}
    every_rule = {(name, index) for name, spec in SPECS.items() for index in range(len(spec.rules))}
    assert covered == every_rule, f"rules without a case: {sorted(every_rule - covered)}"
    for name, index, after, fresh, remembered, distinct in seen:
        assert fresh is not None and _expected(name, index)(fresh), (name, index, fresh)
        assert after == fresh, (name, index, after, fresh)
        if name == "moe.dispatch":  # its expert ids are never remembered: every call is read in full
            assert not remembered, (name, index)
        else:
            assert remembered and distinct, (name, index, remembered, distinct)
