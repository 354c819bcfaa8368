"""The specs of the data operators and ``exchange_counts`` (:mod:`unicoll.spec`): the MoE
exchanges ``global_scatter`` and ``global_gather``, ``alltoall_single``, ``alltoall``,
``all_gather``, ``all_reduce``, ``reduce_scatter`` and ``broadcast``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..arrays import describe, kind_of
from ..backends.layout import MoePlan, moe_plan
from ..counts import even_split, total
from ..kinds import (
    ARRAY,
    COUNTS,
    FLAG,
    GATHER_OUTPUT,
    IN_PLACE,
    OPTIONAL_COUNTS,
    OPTIONAL_OUTPUT,
    RANK,
    REDUCE_OP,
    Kind,
)
from .language import GROUP_PARAM, OpSpec, Param, PreparedCall, Rule, Traced, known_total, rows_of

if TYPE_CHECKING:
    from ..backends.base import Capabilities


def _length_multiple(counts: Any, world: int) -> str | None:
    """None when ``counts`` has a positive length divisible by ``world``, else its length."""
    n = len(counts)
    return None if n > 0 and n % world == 0 else f"length {n}"


def _same_array_kind(out: Any, x: Any, what: str) -> str | None:
    """Library, dtype and trailing shape of ``out`` against ``x``; None when they agree."""
    kind_out, kind_x = kind_of(out), kind_of(x)
    if kind_out.library != kind_x.library or kind_out.dtype != kind_x.dtype or out.shape[1:] != x.shape[1:]:
        return f"{describe(out)} for {what} {describe(x)}"
    return None


def _stream_rule() -> Rule:
    return Rule(
        "use_calc_stream",
        "False when sync_op=False (the calculation stream is only for synchronous calls)",
        lambda c: "True with sync_op=False" if c.use_calc_stream and not c.sync_op else None,
    )


def _common_params(use_calc_stream: bool) -> tuple[Param, ...]:
    return (
        GROUP_PARAM,
        Param("sync_op", FLAG, "bool", "True returns the result; False returns a Task whose wait() returns it.", True),
        Param(
            "use_calc_stream",
            FLAG,
            "bool",
            "Run on the caller's current stream (only with sync_op=True); no effect on CPU backends.",
            use_calc_stream,
        ),
    )


_MOE_COUNTS = (
    Param(
        "local_count",
        COUNTS,
        "int array | Sequence[int]",
        "Length W*E: local_count[c*E+e] rows of x go to expert e of rank c, in that order.",
    ),
    Param(
        "global_count",
        COUNTS,
        "int array | Sequence[int]",
        "Length W*E: global_count[c*E+e] rows arrive from rank c for this rank's expert e.",
    ),
)

_MOE_COUNT_RULES = (
    Rule("local_count", "a length that is a positive multiple of the group size {W} (W * n_expert)",
         lambda c: _length_multiple(c.local_count, c.W)),
    Rule("global_count", "the same length as local_count",
         lambda c: None if len(c.global_count) == len(c.local_count)
         else f"length {len(c.global_count)} and local_count of length {len(c.local_count)}"),
)  # fmt: skip


def _moe_plan(c: PreparedCall) -> MoePlan:
    """The rows per rank and the reorder that global_scatter's and global_gather's counts give."""
    return moe_plan(c.local_count, c.global_count, c.W)


GLOBAL_SCATTER = OpSpec(
    name="global_scatter",
    summary=(
        "MoE dispatch: send each row of x to the expert it is routed to. The output holds "
        "sum(global_count) rows ordered expert-major, then source rank."
    ),
    params=(
        Param("x", ARRAY, "array", "Rows ordered by destination (rank, expert); rows are dimension 0."),
        *_MOE_COUNTS,
        *_common_params(use_calc_stream=True),
    ),
    rules=(
        *_MOE_COUNT_RULES,
        Rule("local_count", "sum(local_count) equal to the number of rows of x",
             lambda c: None if total(c.local_count) == rows_of(c.x)
             else f"sum(local_count)={total(c.local_count)} for x with {rows_of(c.x)} rows"),
        _stream_rule(),
    ),
    plan=_moe_plan,
    traced=Traced("x", rows=lambda a, w: known_total(a["global_count"]), backward=("plan",)),
)  # fmt: skip

GLOBAL_GATHER = OpSpec(
    name="global_gather",
    summary=(
        "MoE combine, the inverse of global_scatter: x is laid out as global_scatter's output; "
        "the output holds sum(local_count) rows in x's original order."
    ),
    params=(
        Param("x", ARRAY, "array", "Rows ordered expert-major, then source rank (global_scatter's output)."),
        *_MOE_COUNTS,
        *_common_params(use_calc_stream=True),
    ),
    rules=(
        *_MOE_COUNT_RULES,
        Rule("global_count", "sum(global_count) equal to the number of rows of x",
             lambda c: None if total(c.global_count) == rows_of(c.x)
             else f"sum(global_count)={total(c.global_count)} for x with {rows_of(c.x)} rows"),
        _stream_rule(),
    ),
    plan=_moe_plan,
    traced=Traced("x", rows=lambda a, w: known_total(a["local_count"]), backward=("plan",)),
)  # fmt: skip


def _splits_rules(splits: str, tensor: str) -> tuple[Rule, ...]:
    """Rules tying optional split sizes to the rows of their array (which may itself be None)."""

    def length(c: PreparedCall) -> str | None:
        s = getattr(c, splits)
        return None if s is None or len(s) == c.W else f"length {len(s)}"

    def total(c: PreparedCall) -> str | None:
        s, a = getattr(c, splits), getattr(c, tensor)
        if s is None or a is None or len(s) != c.W or int(s.sum()) == rows_of(a):
            return None
        return f"sum {int(s.sum())} for {tensor} with {rows_of(a)} rows"

    def even(c: PreparedCall) -> str | None:
        s, a = getattr(c, splits), getattr(c, tensor)
        if s is not None or a is None or rows_of(a) % c.W == 0:
            return None
        return f"{rows_of(a)} rows with {splits}=None"

    return (
        Rule(splits, "one size per rank of the group ({W} entries)", length),
        Rule(splits, f"sizes that sum to the number of rows of {tensor}", total),
        Rule(tensor, f"a number of rows divisible by the group size {{W}} when {splits} is None", even),
    )


def _rows_to_self(c: PreparedCall) -> str | None:
    """Whether the rows this rank receives from itself are the rows it sends itself (both
    split sizes known here: given, or an even split of a given array)."""
    if c.out_tensor is None and c.out_split_sizes is None:
        return None  # the receive sizes are exchanged: they match by construction
    me = c.group.rank
    sent = int(c.in_split_sizes[me]) if c.in_split_sizes is not None else rows_of(c.in_tensor) // c.W
    received = int(c.out_split_sizes[me]) if c.out_split_sizes is not None else rows_of(c.out_tensor) // c.W
    if sent == received:
        return None
    source = "" if c.out_split_sizes is not None else " (an even split of out_tensor)"
    return f"{received} rows from this rank (position {me}){source} while it sends itself {sent}"


def _alltoall_splits(c: PreparedCall) -> tuple[list[int], list[int] | None]:
    """alltoall_single's send and receive sizes as lists; the receive sizes None where they
    are exchanged (only in_split_sizes given, no out_tensor)."""
    sent = c.in_split_sizes.tolist() if c.in_split_sizes is not None else even_split(rows_of(c.in_tensor), c.W)
    if c.out_split_sizes is not None:
        return sent, c.out_split_sizes.tolist()
    if c.out_tensor is not None:
        return sent, even_split(rows_of(c.out_tensor), c.W)
    return sent, (sent if c.in_split_sizes is None else None)


def _alltoall_rows(a: dict[str, Any], world: int) -> Any:
    """alltoall_single's rows while tracing: out_split_sizes' total where given as ints, the
    input's rows for an even split both ways."""
    if a["out_split_sizes"] is None and a["in_split_sizes"] is None:
        return a["in_tensor"].shape[0]
    return known_total(a["out_split_sizes"])


ALLTOALL_SINGLE = OpSpec(
    name="alltoall_single",
    summary=(
        "Uneven all-to-all of rows: rank r sends in_split_sizes[c] consecutive rows of in_tensor to rank c "
        "and receives out_split_sizes[c] rows from each rank c, in rank order."
    ),
    params=(
        Param("out_tensor", OPTIONAL_OUTPUT, "array | None",
              "Filled in place when given; None allocates the output (receive sizes are exchanged first "
              "when only in_split_sizes is given)."),
        Param("in_tensor", ARRAY, "array", "The rows to send."),
        Param("out_split_sizes", OPTIONAL_COUNTS, "int array | Sequence[int] | None",
              "Rows received from each rank; None means an even split of out_tensor.", None),
        Param("in_split_sizes", OPTIONAL_COUNTS, "int array | Sequence[int] | None",
              "Rows sent to each rank; None means an even split of in_tensor.", None),
        *_common_params(use_calc_stream=False),
    ),
    rules=(
        *_splits_rules("in_split_sizes", "in_tensor"),
        *_splits_rules("out_split_sizes", "out_tensor"),
        Rule("out_split_sizes", "to receive from this rank the rows it sends itself", _rows_to_self),
        Rule("out_tensor", "the library, dtype and trailing shape of in_tensor",
             lambda c: None if c.out_tensor is None else _same_array_kind(c.out_tensor, c.in_tensor, "in_tensor"),
             TypeError),
        _stream_rule(),
    ),
    plan=_alltoall_splits,
    traced=Traced("in_tensor", rows=_alltoall_rows, learns=("sent", "received"), backward=("sent", "received")),
)  # fmt: skip


def _read_arrays(op: str, param: str, value: Any, caps: Capabilities, backend: str) -> Any:
    """An input array, or a list of them (each read as an input array)."""
    if isinstance(value, list):
        return [ARRAY.read(op, f"{param}[{i}]", v, caps, backend) for i, v in enumerate(value)]
    return ARRAY.read(op, param, value, caps, backend)


_ARRAYS = Kind(
    doc="each array as an input array.",
    read=_read_arrays,
    sign=lambda value: None if isinstance(value, list) else ARRAY.sign(value),  # lists are not remembered
    passed_through=True,
)
"""alltoall's input: one array, or a list of one array per rank."""


def _peer_rows(value: Any, world: int) -> list[int] | None:
    """The rows for (or from) each rank that an array (an even split) or a list of W arrays
    holds; None for an empty list."""
    if isinstance(value, list):
        return [rows_of(a) for a in value] if value else None
    return even_split(rows_of(value), world)


def _alltoall_lists(c: PreparedCall) -> str | None:
    """Inputs: a list of {W} arrays, or one array of a multiple of {W} rows; outputs the same,
    or an empty list."""
    for name in ("in_tensor_or_tensor_list", "out_tensor_or_tensor_list"):
        value = getattr(c, name)
        if isinstance(value, list):
            if len(value) != c.W and (value or name.startswith("in")):
                return f"{name} as a list of length {len(value)}"
        elif rows_of(value) % c.W:
            return f"{name} as an array of {rows_of(value)} rows"
    return None


def _alltoall_kinds(c: PreparedCall) -> str | None:
    """Every array of the library, dtype and trailing shape of the first input."""
    given, out = c.in_tensor_or_tensor_list, c.out_tensor_or_tensor_list
    arrays = given if isinstance(given, list) else [given]
    if not arrays:
        return None
    first = arrays[0]
    others = [*arrays[1:], *(out if isinstance(out, list) else [out])]
    return next((m for a in others if (m := _same_array_kind(a, first, "in_tensor_or_tensor_list[0]"))), None)


def _alltoall_to_self(c: PreparedCall) -> str | None:
    """This rank receives from itself the rows it sends itself (where the output says)."""
    sent = _peer_rows(c.in_tensor_or_tensor_list, c.W)
    received = _peer_rows(c.out_tensor_or_tensor_list, c.W)
    me = c.group.rank
    if sent is None or received is None or sent[me] == received[me]:
        return None
    return f"{received[me]} rows from this rank (position {me}) while it sends itself {sent[me]}"


def _alltoall_plan(c: PreparedCall) -> tuple[list[int], list[int] | None]:
    """alltoall's send and receive sizes; the receive sizes None where they are exchanged (an
    empty output list)."""
    return _peer_rows(c.in_tensor_or_tensor_list, c.W), _peer_rows(c.out_tensor_or_tensor_list, c.W)


ALLTOALL = OpSpec(
    name="alltoall",
    summary=(
        "All-to-all of arrays, PaddlePaddle's stream alltoall: rank r sends its entry c (or block c of an array "
        "split evenly) to rank c, and receives from each rank c its entry r into entry c of the output, in rank "
        "order. Entries for different ranks may differ in rows."
    ),
    params=(
        Param("out_tensor_or_tensor_list", GATHER_OUTPUT, "array | list",
              "A list of W arrays, filled in place (entry c from rank c); an empty list, which gets W arrays "
              "appended (their rows are exchanged first); or one array, split evenly into W blocks, filled in "
              "place."),
        Param("in_tensor_or_tensor_list", _ARRAYS, "array | list",
              "A list of W arrays (entry c goes to rank c), or one array split evenly into W blocks."),
        *_common_params(use_calc_stream=False),
    ),
    rules=(
        Rule("out_tensor_or_tensor_list", "an array or a list", lambda c: (
            "None" if c.out_tensor_or_tensor_list is None else None), TypeError),
        Rule("in_tensor_or_tensor_list",
             "a list of {W} arrays or an array of a multiple of {W} rows, and an output list of {W} arrays, "
             "empty, or an array of a multiple of {W} rows", _alltoall_lists),
        Rule("in_tensor_or_tensor_list", "arrays of one library, dtype and trailing shape, the output's too",
             _alltoall_kinds, TypeError),
        Rule("out_tensor_or_tensor_list", "to receive from this rank the rows it sends itself", _alltoall_to_self),
        _stream_rule(),
    ),
    backward="each input entry's gradient is what its rank receives of the output gradient (the all-to-all back)",
    plan=_alltoall_plan,
    checked_as=ALLTOALL_SINGLE,
)  # fmt: skip


def _gather_output_kind(c: PreparedCall) -> str | None:
    out, x = c.tensor_or_tensor_list, c.tensor
    if isinstance(out, list):
        return next((f"a list holding {m}" for o in out if (m := _same_array_kind(o, x, "tensor"))), None)
    return None if out is None else _same_array_kind(out, x, "tensor")


def _gather_output_rows(c: PreparedCall) -> str | None:
    out, x, world = c.tensor_or_tensor_list, c.tensor, c.W
    if out is None:
        return None
    if isinstance(out, list):
        if len(out) not in (0, world):
            return f"a list of length {len(out)}"
        mine = rows_of(out[c.group.rank]) if out else rows_of(x)
        return (
            None
            if mine == rows_of(x)
            else f"{mine} rows in entry {c.group.rank} (this rank) for tensor with {rows_of(x)}"
        )
    return None if rows_of(out) == world * rows_of(x) else f"{rows_of(out)} rows for {world} ranks of {rows_of(x)} rows"


ALL_GATHER = OpSpec(
    name="all_gather",
    summary=(
        "Every rank receives every rank's tensor, in rank order. Ranks may hold different numbers of rows "
        "(with a None or list output)."
    ),
    params=(
        Param("tensor_or_tensor_list", GATHER_OUTPUT, "array | list | None",
              "None returns all ranks' rows concatenated; an array of W * rows rows is filled in place; "
              "an empty list gets W arrays appended; a list of W arrays is filled in place."),
        Param("tensor", ARRAY, "array", "This rank's rows."),
        *_common_params(use_calc_stream=False),
    ),
    rules=(
        Rule("tensor_or_tensor_list", "arrays of the library, dtype and trailing shape of tensor",
             _gather_output_kind, TypeError),
        Rule("tensor_or_tensor_list",
             "an array of {W} * (rows of tensor) rows, an empty list, or a list of {W} arrays whose entry "
             "for this rank has the rows of tensor", _gather_output_rows),
        _stream_rule(),
    ),
    traced=Traced("tensor", rows=lambda a, w: None, learns=("blocks",), backward=("blocks",)),
)  # fmt: skip

EXCHANGE_COUNTS = OpSpec(
    name="exchange_counts",
    summary=(
        "The global_count that goes with local_count, by one all-to-all of the counts: on rank r the result is "
        "[local_count on rank c][r*E+e] for every rank c and expert e, the same kind of array as local_count "
        "(numpy for a sequence)."
    ),
    params=(
        Param("local_count", COUNTS, "int array | Sequence[int]",
              "Length W*E: local_count[c*E+e] rows go from this rank to expert e of rank c."),
        GROUP_PARAM,
    ),
    rules=(
        Rule("local_count", "a length that is a positive multiple of the group size {W}",
             lambda c: _length_multiple(c.local_count, c.W)),
    ),
    backward="none (counts are integers, outside autograd)",
    in_capabilities=False,
    traced=Traced("local_count", backward=None),
)  # fmt: skip


def _reduces(c: PreparedCall) -> str | None:
    """Whether the backend reduces the dtype of ``tensor`` with ``op``."""
    dtype = kind_of(c.tensor).dtype
    return None if dtype in c.backend.capabilities.reductions.get(c.op, ()) else f"{c.op!r} on {describe(c.tensor)}"


def _reduction_rule() -> Rule:
    return Rule(
        "op",
        "a reduction the backend runs on the dtype of tensor (the API page lists them per backend; avg needs a "
        "floating dtype)",
        _reduces,
        TypeError,
    )


_OP = Param("op", REDUCE_OP, "str", "The reduction: 'sum', 'avg' (sum / W), 'max', 'min' or 'prod'.", "sum")

ALL_REDUCE = OpSpec(
    name="all_reduce",
    summary=(
        "Every rank's tensor reduced elementwise with op, in place on every rank; returns the tensor. "
        "Every rank passes the same shape and dtype."
    ),
    params=(
        Param(
            "tensor",
            IN_PLACE,
            "array",
            "This rank's values, of any shape (a 0-d loss too); holds the reduction afterwards.",
        ),
        _OP,
        *_common_params(use_calc_stream=False),
    ),
    rules=(_reduction_rule(), _stream_rule()),
    traced=Traced("tensor", backward=("op",)),
)


REDUCE = OpSpec(
    name="reduce",
    summary=(
        "PaddlePaddle's reduce: every rank's tensor reduced elementwise with op into the tensor of the rank dst, in "
        "place; the other ranks' tensors keep their values. Returns the tensor. dst is a global rank (as Paddle's), "
        "a member of the group. Every rank passes the same shape and dtype."
    ),
    params=(
        Param("tensor", IN_PLACE, "array",
              "This rank's values, of any shape (a 0-d loss too); holds the reduction afterwards on dst only."),
        Param("dst", RANK, "int", "The global rank, a member of the group, whose tensor receives the reduction."),
        _OP,
        *_common_params(use_calc_stream=False),
    ),
    rules=(
        Rule("dst", "a global rank that is a member of the group (Paddle's dst)",
             lambda c: None if c.dst in c.group.ranks else f"{c.dst}, not one of the group's {list(c.group.ranks)}"),
        _reduction_rule(),
        _stream_rule(),
    ),
    traced=Traced("tensor", backward=("op", "dst")),
    agree=("tensor", "op", "dst"),
)  # fmt: skip


def _scatter_output(c: PreparedCall) -> str | None:
    """Rows of ``out`` against this rank's block of ``tensor``."""
    if c.out is None or (c.split_sizes is not None and len(c.split_sizes) != c.W):
        return None
    mine = int(c.split_sizes[c.group.rank]) if c.split_sizes is not None else rows_of(c.tensor) // c.W
    if rows_of(c.out) == mine:
        return None
    return f"{rows_of(c.out)} rows for a block of {mine} rows (position {c.group.rank})"


def _scattered_rows(a: dict[str, Any], world: int) -> Any:
    """reduce_scatter's rows while tracing: an even share of tensor's without split sizes."""
    return a["tensor"].shape[0] // world if a["split_sizes"] is None else None


REDUCE_SCATTER = OpSpec(
    name="reduce_scatter",
    summary=(
        "The dual of all_gather: tensor's rows are split into W consecutive blocks (split_sizes[c] rows for "
        "position c, or an even split); block c, reduced elementwise with op over every rank, goes to position c."
    ),
    params=(
        Param("out", OPTIONAL_OUTPUT, "array | None",
              "Filled in place with this rank's block when given; None allocates it."),
        Param("tensor", ARRAY, "array", "The rows to reduce: the same shape and dtype on every rank."),
        _OP,
        Param("split_sizes", OPTIONAL_COUNTS, "int array | Sequence[int] | None",
              "Rows of each position's block, the same on every rank; None means an even split of tensor.", None),
        *_common_params(use_calc_stream=False),
    ),
    rules=(
        *_splits_rules("split_sizes", "tensor"),
        Rule("out", "the library, dtype and trailing shape of tensor",
             lambda c: None if c.out is None else _same_array_kind(c.out, c.tensor, "tensor"), TypeError),
        Rule("out", "the rows of this rank's block of tensor", _scatter_output),
        _reduction_rule(),
        _stream_rule(),
    ),
    traced=Traced("tensor", rows=_scattered_rows, learns=("blocks",), backward=("op", "blocks")),
)  # fmt: skip

BROADCAST = OpSpec(
    name="broadcast",
    summary=(
        "Position src's tensor on every rank, in place; returns the tensor. src is a position in the group "
        "(the world rank for group=None). Every rank passes the same shape and dtype."
    ),
    params=(
        Param("tensor", IN_PLACE, "array", "The rows to send on src; overwritten with them on the other ranks."),
        Param("src", RANK, "int", "The position in the group of the rank whose tensor is sent."),
        *_common_params(use_calc_stream=False),
    ),
    rules=(
        Rule("src", "a position in the group, 0 <= src < {W}",
             lambda c: None if 0 <= c.src < c.W else str(c.src)),
        _stream_rule(),
    ),
    traced=Traced("tensor", backward=("src",)),
)  # fmt: skip

COLLECTIVES: tuple[OpSpec, ...] = (
    GLOBAL_SCATTER, GLOBAL_GATHER, ALLTOALL_SINGLE, ALLTOALL, ALL_GATHER, ALL_REDUCE, REDUCE, REDUCE_SCATTER,
    BROADCAST, EXCHANGE_COUNTS,
)  # fmt: skip
"""The data operators and exchange_counts, in the order the docs list them."""
