"""The specs of :mod:`unicoll.moe` (:mod:`unicoll.spec`): top-k dispatch, redispatch and
combine, in the dynamic and the static-shape mode."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from ..arrays import describe, kind_of, place_of
from ..counts import on_host
from ..kinds import (
    ARRAY,
    EXPERT_IDS,
    FLAG,
    HANDLE,
    OPTIONAL_ARRAY,
    OPTIONAL_SIZE,
    OVERFLOW,
    POSITIVE_INT,
    ROUTER_IDS,
    SIZE,
    STATIC_HANDLE,
)
from .language import GROUP_PARAM, OpSpec, Param, PreparedCall, Rule, rows_of

_FLOATING = ("float16", "bfloat16", "float32", "float64")

MAX_EXPERTS = 2**24
"""The most experts a top-k dispatch routes to (W * experts_per_rank): every rank counts its
rows for each expert in an int64 array and exchanges it every step."""


IDS_EXPECTED = "expert ids from -1 (a dropped slot) to W * experts_per_rank - 1"
"""What moe.dispatch's rule for the values of topk_idx expects."""


def ids_out_of_range(lowest: int, highest: int, at_lowest: int, at_highest: int, k: int, experts: int) -> str | None:
    """What moe.dispatch's rule for topk_idx reports for ids whose lowest and highest values
    sit at flat slots ``at_lowest`` and ``at_highest`` of a ``(T, k)`` array, for ``experts``
    global experts: None where every id is in range; else the lowest id where it is below -1,
    or the highest, and its place."""
    if lowest >= -1 and highest < experts:
        return None
    value, at = (lowest, at_lowest) if lowest < -1 else (highest, at_highest)
    t, j = divmod(at, k)
    return f"{value} at [{t}, {j}] (W * experts_per_rank = {experts})"


def _expert_ids_in_range(c: PreparedCall) -> str | None:
    """moe.dispatch's ids against the experts, on a host backend; a device backend checks them
    where they are and reports them with the counts' exchange (the same message), since reading
    them here would wait for the device."""
    if not c.backend.host_memory:
        return None
    ids = np.asarray(on_host(c.topk_idx))
    if ids.size == 0:
        return None
    lowest, highest = int(ids.argmin()), int(ids.argmax())
    return ids_out_of_range(int(ids.flat[lowest]), int(ids.flat[highest]), lowest, highest, ids.shape[1],
                            c.W * c.experts_per_rank)  # fmt: skip


def _same_place(a: Any, x: Any, what: str) -> str | None:
    """Library and device of ``a`` against ``x``'s; None when they agree."""
    kind_a, kind_x = kind_of(a), kind_of(x)
    if kind_a.library == kind_x.library and place_of(a) == place_of(x):
        return None
    return f"{describe(a)} for {what} {describe(x)}"


def _same_place_as_x(param: str) -> Callable[[PreparedCall], str | None]:
    """The library and device of parameter ``param`` against x's (None passes)."""
    return lambda c: None if getattr(c, param) is None else _same_place(getattr(c, param), c.x, "x")


_EXPERTS_RULE = Rule(
    "experts_per_rank", f"at most {MAX_EXPERTS} experts in all (W * experts_per_rank, W = {{W}})",
    lambda c: None if c.W * c.experts_per_rank <= MAX_EXPERTS else str(c.experts_per_rank),
)  # fmt: skip
_IDS_ROWS_RULE = Rule("topk_idx", "as many rows as x (one row of expert ids per token)",
                      lambda c: None if rows_of(c.topk_idx) == rows_of(c.x)
                      else f"shape {tuple(c.topk_idx.shape)} for x with {rows_of(c.x)} rows")  # fmt: skip
_WEIGHTS_RULES = (
    Rule("topk_weights", "a floating dtype (" + ", ".join(_FLOATING) + ")",
         lambda c: None if c.topk_weights is None or kind_of(c.topk_weights).dtype in _FLOATING
         else describe(c.topk_weights), TypeError),
    Rule("topk_weights", "the library and device of x", _same_place_as_x("topk_weights"), TypeError),
    Rule("topk_weights", "the shape of topk_idx (one weight per slot)",
         lambda c: None if c.topk_weights is None or tuple(c.topk_weights.shape) == tuple(c.topk_idx.shape)
         else f"shape {tuple(c.topk_weights.shape)} for topk_idx of shape {tuple(c.topk_idx.shape)}"),
)  # fmt: skip
"""The rules both top-k dispatches share (beside each one's own rule for topk_idx)."""


MOE_DISPATCH = OpSpec(
    name="moe.dispatch",
    summary=(
        "Top-k token dispatch: every kept slot (t, j) of topk_idx sends row t of x to global expert "
        "topk_idx[t, j] = rank * experts_per_rank + e. Returns (rows, rows_per_expert, handle): the rows this "
        "rank's experts receive, expert-major, then source rank, then slot t * k + j (global_scatter's "
        "layout); rows_per_expert, host ints; and the handle that moe.combine, the backward passes and later "
        "layers with the same routing reuse (no new count exchange). -1 drops a slot; with capacity, each rank "
        "sends each expert at most capacity rows, the lowest slots t * k + j first."
    ),
    params=(
        Param("x", ARRAY, "array", "The tokens, one per row (rows are dimension 0)."),
        Param("topk_idx", EXPERT_IDS, "int array", "(tokens, k) global expert ids; -1 drops that slot."),
        Param("topk_weights", OPTIONAL_ARRAY, "array | None",
              "(tokens, k) weights that moe.combine applies to each slot; kept by the handle. None: unweighted.",
              None),
        Param("experts_per_rank", POSITIVE_INT, "int", "E, the experts each rank holds (the same on every rank).",
              keyword_only=True),
        replace(GROUP_PARAM, keyword_only=True),
        Param("sync_op", FLAG, "bool",
              "True returns the result; False returns a Task whose wait() returns it (the counts are "
              "exchanged before it returns, the rows in flight).", True, keyword_only=True),
        Param("capacity", OPTIONAL_SIZE, "int | None",
              "The most rows this rank sends to each expert (the same on every rank); None: no limit.", None,
              keyword_only=True),
    ),
    rules=(
        _EXPERTS_RULE,
        _IDS_ROWS_RULE,
        Rule("topk_idx", IDS_EXPECTED, _expert_ids_in_range),
        *_WEIGHTS_RULES,
    ),
    backward="to x: the rows' gradients sent back (global_gather with the handle's counts) and summed over "
    "each token's slots",
    in_capabilities=False,
    reads_host=True,
    static_shapes=False,
)  # fmt: skip


def _handle_place(rows: str) -> Callable[[PreparedCall], str | None]:
    """The library and device of parameter ``rows`` against the dispatched x's (the handle's)."""

    def check(c: PreparedCall) -> str | None:
        given, handle = getattr(c, rows), c.handle
        if kind_of(given).library == handle.library and place_of(given) == handle.device:
            return None
        return f"{describe(given)} for x of {handle.library} on {handle.device or 'cpu'}"

    return check


_HANDLE = Param("handle", HANDLE, "moe.Handle", "What moe.dispatch returned with the rows.")

_REDISPATCHED_X = Param("x", ARRAY, "array",
                        "One row per token of the handle's dispatch (the trailing shape may differ).")  # fmt: skip
_MOE_SYNC_OP = Param("sync_op", FLAG, "bool", "True returns the result; False returns a Task whose wait() returns it.",
                     True, keyword_only=True)  # fmt: skip

_COMBINE_Y_RULES = (
    Rule("y", "the library and device of the dispatched x", _handle_place("y"), TypeError),
    Rule("y", "a dtype that sums (not bool)",
         lambda c: describe(c.y) if kind_of(c.y).dtype == "bool" else None, TypeError),
    Rule("y", "a floating dtype (" + ", ".join(_FLOATING) + ") when dispatch was given topk_weights",
         lambda c: describe(c.y) if c.handle.weighted and kind_of(c.y).dtype not in _FLOATING else None,
         TypeError),
)  # fmt: skip
"""The rules both top-k combines share (beside each one's own rule for y's rows)."""

_REDISPATCH_RULES = (
    Rule("x", "one row per token of the handle's dispatch",
         lambda c: None if rows_of(c.x) == c.handle.tokens else f"{rows_of(c.x)} rows for {c.handle.tokens} tokens"),
    Rule("x", "the library and device of the dispatched x", _handle_place("x"), TypeError),
)  # fmt: skip
"""moe.redispatch's and moe.redispatch_static's rules: x against the handle."""

MOE_REDISPATCH = OpSpec(
    name="moe.redispatch",
    summary=(
        "Top-k dispatch along a handle's routing, for a second layer with the same routing: row t of x goes "
        "where moe.dispatch sent token t's slots, with no sort and no count exchange. Returns the rows in "
        "moe.dispatch's layout (handle.rows_per_expert rows per local expert)."
    ),
    params=(
        _REDISPATCHED_X,
        _HANDLE,
        _MOE_SYNC_OP,
    ),
    rules=_REDISPATCH_RULES,
    backward="to x: the rows' gradients sent back (global_gather with the handle's counts) and summed over "
    "each token's slots",
    in_capabilities=False,
    static_shapes=False,
)  # fmt: skip


MOE_COMBINE = OpSpec(
    name="moe.combine",
    summary=(
        "Top-k combine: y holds the expert outputs in moe.dispatch's layout; each row goes back to the rank it "
        "came from, and token t's result is the sum over its slots j of the output for slot (t, j) times "
        "topk_weights[t, j] (unweighted without weights); dropped slots contribute zero. The result has "
        "tokens rows, y's dtype and trailing shape."
    ),
    params=(
        Param("y", ARRAY, "array", "Expert outputs: as many rows as the handle's dispatch returned, in its order."),
        _HANDLE,
        _MOE_SYNC_OP,
    ),
    rules=(
        Rule("y", "as many rows as the handle's dispatch returned",
             lambda c: None if rows_of(c.y) == c.handle.received else f"{rows_of(c.y)} rows for {c.handle.received}"),
        *_COMBINE_Y_RULES,
    ),
    backward="to y: the result's gradient times each slot's weight, sent to the experts (global_scatter with "
    "the handle's counts); to topk_weights: the gradient's dot product with each slot's expert output",
    in_capabilities=False,
)  # fmt: skip


# -- the static-shape MoE operators: shapes known from (tokens, k, C, W, E, hidden) alone ----------

MAX_STATIC_ROWS = 2**31 - 1
"""The most rows a static-shape dispatch's blocks hold on each rank (W * experts_per_rank *
capacity), checked before anything is allocated or sent: each is indexed in the layout (int32
under JAX without ``jax_enable_x64``), and MPI counts rows in C ints."""

_STATIC_ROWS_RULE = Rule(
    "capacity", f"at most {MAX_STATIC_ROWS} rows in each rank's blocks (W * experts_per_rank * capacity, W = {{W}})",
    lambda c: None if c.W * c.experts_per_rank * c.capacity <= MAX_STATIC_ROWS
    else f"{c.capacity} (W * experts_per_rank * capacity = {c.W * c.experts_per_rank * c.capacity})",
)  # fmt: skip


MOE_DISPATCH_STATIC = OpSpec(
    name="moe.dispatch_static",
    summary=(
        "Static-shape top-k dispatch: every output shape depends only on (tokens, k, capacity, W, "
        "experts_per_rank, x's trailing shape) and, on a device, nothing is read to the host. Returns (rows, counts, "
        "handle): rows of shape (experts_per_rank, W * capacity, *x.shape[1:]), block [e, c * capacity:(c + 1) "
        "* capacity] holding what rank c sent expert e, its kept slots in slot order t * k + j, then zeros; "
        "counts, the valid rows of each block as an (experts_per_rank, W) int64 array on x's device; and the "
        "handle that moe.combine_static and moe.redispatch_static reuse. Each rank sends each expert at most "
        "capacity rows, the lowest slots first; -1 (or an id outside 0 .. W * experts_per_rank - 1) drops a "
        "slot; the handle reports the counts before the capacity dropped any."
    ),
    params=(
        Param("x", ARRAY, "array", "The tokens, one per row (rows are dimension 0)."),
        Param("topk_idx", ROUTER_IDS, "int array",
              "(tokens, k) global expert ids, in x's library and on its device; -1 drops that slot."),
        Param("topk_weights", OPTIONAL_ARRAY, "array | None",
              "(tokens, k) weights that moe.combine_static applies to each slot; kept by the handle. None: "
              "unweighted.", None),
        Param("experts_per_rank", POSITIVE_INT, "int", "E, the experts each rank holds (the same on every rank).",
              keyword_only=True),
        Param("capacity", SIZE, "int",
              "C, the rows each rank sends each expert at most, and each block's rows (the same on every rank).",
              keyword_only=True),
        replace(GROUP_PARAM, keyword_only=True),
        _MOE_SYNC_OP,
        Param("overflow", OVERFLOW, "str",
              "'drop': slots beyond the capacity are dropped; 'error': a ValueError on every rank when any rank "
              "drops one (this reads the counts on the host: one synchronization).", "drop", keyword_only=True),
        Param("max_tokens_per_rank", OPTIONAL_SIZE, "int | None",
              "The most tokens any rank dispatches (the same on every rank, as are k and x's row): on a device "
              "backend and in compiled code each token then travels once to each rank holding one of its kept "
              "slots, min(max_tokens_per_rank, experts_per_rank * capacity) rows per rank, where that is fewer "
              "bytes than the whole blocks. None: the whole blocks travel there.", None, keyword_only=True),
    ),
    rules=(
        _EXPERTS_RULE,
        _IDS_ROWS_RULE,
        Rule("topk_idx", "the library and device of x", _same_place_as_x("topk_idx"), TypeError),
        *_WEIGHTS_RULES,
        _STATIC_ROWS_RULE,
        Rule("x", "at most max_tokens_per_rank rows",
             lambda c: None if c.max_tokens_per_rank is None or rows_of(c.x) <= c.max_tokens_per_rank
             else f"{rows_of(c.x)} rows for max_tokens_per_rank={c.max_tokens_per_rank}"),
    ),
    backward="to x: the rows' gradients sent back (the even all-to-all back, alltoall_single's backward) and "
    "summed over each token's kept slots; padding rows and dropped slots get none",
    in_capabilities=False,
)  # fmt: skip

_STATIC_HANDLE = Param("handle", STATIC_HANDLE, "moe.StaticHandle", "What moe.dispatch_static returned with the rows.")


def _blocks(c: PreparedCall) -> str | None:
    """y's leading shape against the handle's (experts_per_rank, W * capacity)."""
    h = c.handle
    wanted = (h.experts_per_rank, h.world * h.capacity)
    return None if tuple(c.y.shape[:2]) == wanted else f"shape {tuple(c.y.shape)} for blocks of shape {wanted}"


MOE_REDISPATCH_STATIC = OpSpec(
    name="moe.redispatch_static",
    summary=(
        "Static-shape dispatch along a handle's routing, for a second layer with the same routing: row t of x "
        "goes where moe.dispatch_static sent token t's slots, with no routing and no count exchange. Returns "
        "the rows in moe.dispatch_static's layout, (experts_per_rank, W * capacity, *x.shape[1:])."
    ),
    params=(
        _REDISPATCHED_X,
        _STATIC_HANDLE,
        _MOE_SYNC_OP,
    ),
    rules=_REDISPATCH_RULES,
    backward="to x: as moe.dispatch_static's",
    in_capabilities=False,
)  # fmt: skip

MOE_COMBINE_STATIC = OpSpec(
    name="moe.combine_static",
    summary=(
        "Static-shape top-k combine: y holds the expert outputs in moe.dispatch_static's layout; each block "
        "goes back to the rank it came from (padding rows are sent but never read), and token t's result is "
        "the sum over its kept slots j of the output for slot (t, j) times topk_weights[t, j] (unweighted "
        "without weights); dropped slots contribute exactly zero. The result has tokens rows, y's dtype and "
        "trailing shape."
    ),
    params=(
        Param("y", ARRAY, "array",
              "Expert outputs of shape (experts_per_rank, W * capacity, ...), in the handle's dispatch layout."),
        _STATIC_HANDLE,
        _MOE_SYNC_OP,
    ),
    rules=(
        Rule("y", "at least 2 dimensions, the first two those of the handle's blocks (experts_per_rank, "
             "W * capacity)", lambda c: f"shape {tuple(c.y.shape)}" if c.y.ndim < 2 else _blocks(c)),
        *_COMBINE_Y_RULES,
    ),
    backward="to y: the result's gradient times each kept slot's weight, sent to the experts (the even "
    "all-to-all, alltoall_single's backward), zero on padding rows; to topk_weights: the gradient's dot "
    "product with each kept slot's expert output, zero for dropped slots",
    in_capabilities=False,
)  # fmt: skip

MOE: tuple[OpSpec, ...] = (
    MOE_DISPATCH,
    MOE_REDISPATCH,
    MOE_COMBINE,
    MOE_DISPATCH_STATIC,
    MOE_REDISPATCH_STATIC,
    MOE_COMBINE_STATIC,
)
"""unicoll.moe's operators, in the order the docs list them."""
