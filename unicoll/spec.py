"""Each operator described once: its parameters, its validation rules and its backward.

The front end validates calls from these specs (:mod:`unicoll.validate`), the API page of
the docs is generated from them (``tools/docgen.py``), check mode is keyed by them
(:mod:`unicoll.check`), and the conformance tests iterate over the data operators together
with each backend's capability table.

A parameter's kind (:mod:`unicoll.kinds`) says how it is read, remembered and documented. A
rule states what is expected of one parameter. Its check returns None when the call meets
it, else a description of what was given, and the error reads
``"<op>: <param>: expected <expected>, got <given>"``. ``{W}`` in ``expected`` is the
group size.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from .arrays import describe, kind_of, place_of
from .backends.layout import MoePlan, moe_plan
from .counts import even_split, on_host, total
from .kinds import (
    ARRAY,
    COUNTS,
    EXPERT_IDS,
    FLAG,
    GATHER_OUTPUT,
    GROUP,
    HANDLE,
    IN_PLACE,
    OPTIONAL_ARRAY,
    OPTIONAL_COUNTS,
    OPTIONAL_OUTPUT,
    OPTIONAL_SIZE,
    OVERFLOW,
    POSITIVE_INT,
    RANK,
    REDUCE_OP,
    ROUTER_IDS,
    SIZE,
    STATIC_HANDLE,
    Kind,
)

if TYPE_CHECKING:
    from .backends.base import Backend, Capabilities
    from .group import Group
    from .routing import Handle


@dataclass(slots=True, eq=False)
class Call:
    """The prepared arguments of one call, as :func:`unicoll.validate.prepare` returns them.

    Every call has the group size ``W``, the resolved ``group``, the running ``backend``, its
    ``timeout``, whether the ranks ``compare`` their calls before moving data (the handshake or
    check mode) and whether ``check`` mode is on; the other fields are the parameters of the
    entry points (counts as host int64 arrays), None where the entry point has no such parameter,
    and ``plan``: what the spec's :attr:`OpSpec.plan` derived from them.
    """

    W: int
    group: Group
    backend: Backend
    timeout: float
    compare: bool
    check: bool
    x: Any = None
    local_count: np.ndarray | None = None
    global_count: np.ndarray | None = None
    out_tensor: Any = None
    in_tensor: Any = None
    out_split_sizes: np.ndarray | None = None
    in_split_sizes: np.ndarray | None = None
    tensor_or_tensor_list: Any = None
    out_tensor_or_tensor_list: Any = None
    in_tensor_or_tensor_list: Any = None
    tensor: Any = None
    out: Any = None
    op: str | None = None
    split_sizes: np.ndarray | None = None
    src: int | None = None
    sync_op: bool | None = None
    use_calc_stream: bool | None = None
    topk_idx: Any = None
    topk_weights: Any = None
    experts_per_rank: int | None = None
    capacity: int | None = None
    max_tokens_per_rank: int | None = None
    y: Any = None
    handle: Handle | None = None
    overflow: str | None = None
    plan: Any = None

    def copy(self) -> Call:
        """A shallow copy: the same values in a new call (the calls the ranks compare, and each
        call the memory of accepted calls serves then, are copies)."""
        return Call(*_CALL_FIELDS(self))


_CALL_FIELDS = operator.attrgetter(*Call.__slots__)
"""Every field of a :class:`Call`, in the order its constructor takes them."""


REQUIRED = object()


@dataclass(frozen=True)
class Param:
    """One parameter: its ``kind`` says how the front end reads, remembers and documents it."""

    name: str
    kind: Kind
    annotation: str
    doc: str
    default: Any = REQUIRED
    keyword_only: bool = False


@dataclass(frozen=True)
class Rule:
    """What a parameter must satisfy once every parameter has been read."""

    param: str
    expected: str
    check: Callable[[Call], str | None]
    error: type[Exception] = ValueError


@dataclass(frozen=True, eq=False)
class OpSpec:
    """An entry point: what it does, its parameters and rules, how its gradient flows.

    ``in_capabilities``: whether backends list it in their capability table
    (:attr:`unicoll.backends.base.Capabilities.ops`); the data operators are, while
    ``exchange_counts`` runs on every backend's integer exchange. ``plan``: what the operator
    derives from a call that passed the rules, computed once and remembered with the call
    (:attr:`Call.plan`): a tuple of lists of ints (split sizes, say), an object that says
    what it holds in ``nbytes`` (the MoE operators' :class:`~unicoll.backends.layout.MoePlan`)
    or None, which nothing may change. ``checked_as``: the entry point whose cross-rank
    comparison check mode runs for this one's calls (None: its own, in
    :data:`unicoll.check.CHECKS`), for an operator that moves what another one moves.
    ``backward``: its gradient in words, for an operator without a backward function of its own
    (``<name>_backward`` in :mod:`unicoll.eager.ops`, whose docstring says it otherwise).
    ``reads_host``: whether a call reads array values on the host (a synchronization with a GPU);
    ``static_shapes``: whether every output shape follows from the arguments' shapes (what
    torch.compile needs to trace a call without dynamic shapes); the MoE modes' table on the API
    page is made from these two (:data:`MOE_MODES`). Specs compare by identity, as check mode
    keys its comparisons by them.
    """

    name: str
    summary: str
    params: tuple[Param, ...]
    rules: tuple[Rule, ...]
    backward: str = ""
    in_capabilities: bool = True
    plan: Callable[[Call], Any] | None = None
    checked_as: OpSpec | None = None
    reads_host: bool = False
    static_shapes: bool = True

    kinds: dict[str, Kind] = field(init=False, repr=False)
    """Each parameter's kind by its name."""
    signed: tuple[tuple[str, Callable[[Any], Any]], ...] = field(init=False, repr=False)
    """``(name, signature function)`` of each parameter that goes into the key of an accepted
    call (every one but the group)."""
    readers: tuple[tuple[str, Callable[..., Any]], ...] = field(init=False, repr=False)
    """``(name, reader)`` of each parameter that has a reader (every one but the group)."""
    passed_through: tuple[str, ...] = field(init=False, repr=False)
    """Names of the parameters whose value the call carries as given."""
    counted: tuple[str, ...] = field(init=False, repr=False)
    """Names of the parameters whose read value is a counts array."""

    def __post_init__(self) -> None:
        """The tables every call reads, derived from the parameters once, here (not on first
        use: torch.compile traces the validation of the static MoE operators, and cannot enter
        the lock a lazily computed attribute takes)."""
        derived = {
            "kinds": {p.name: p.kind for p in self.params},
            "signed": tuple((p.name, p.kind.sign) for p in self.params if p.kind.sign is not None),
            "readers": tuple((p.name, p.kind.read) for p in self.params if p.kind.read is not None),
            "passed_through": tuple(p.name for p in self.params if p.kind.passed_through),
            "counted": tuple(p.name for p in self.params if p.kind.holds_counts),
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)


def _rows(a: Any) -> int:
    return int(a.shape[0])


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


_GROUP = Param("group", GROUP, "Group | None", "The ranks taking part; None is the whole world.", None)


def _common_params(use_calc_stream: bool) -> tuple[Param, ...]:
    return (
        _GROUP,
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


def _moe_plan(c: Call) -> MoePlan:
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
             lambda c: None if total(c.local_count) == _rows(c.x)
             else f"sum(local_count)={total(c.local_count)} for x with {_rows(c.x)} rows"),
        _stream_rule(),
    ),
    plan=_moe_plan,
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
             lambda c: None if total(c.global_count) == _rows(c.x)
             else f"sum(global_count)={total(c.global_count)} for x with {_rows(c.x)} rows"),
        _stream_rule(),
    ),
    plan=_moe_plan,
)  # fmt: skip


def _splits_rules(splits: str, tensor: str) -> tuple[Rule, ...]:
    """Rules tying optional split sizes to the rows of their array (which may itself be None)."""

    def length(c: Call) -> str | None:
        s = getattr(c, splits)
        return None if s is None or len(s) == c.W else f"length {len(s)}"

    def total(c: Call) -> str | None:
        s, a = getattr(c, splits), getattr(c, tensor)
        if s is None or a is None or len(s) != c.W or int(s.sum()) == _rows(a):
            return None
        return f"sum {int(s.sum())} for {tensor} with {_rows(a)} rows"

    def even(c: Call) -> str | None:
        s, a = getattr(c, splits), getattr(c, tensor)
        if s is not None or a is None or _rows(a) % c.W == 0:
            return None
        return f"{_rows(a)} rows with {splits}=None"

    return (
        Rule(splits, "one size per rank of the group ({W} entries)", length),
        Rule(splits, f"sizes that sum to the number of rows of {tensor}", total),
        Rule(tensor, f"a number of rows divisible by the group size {{W}} when {splits} is None", even),
    )


def _rows_to_self(c: Call) -> str | None:
    """Whether the rows this rank receives from itself are the rows it sends itself (both
    split sizes known here: given, or an even split of a given array)."""
    if c.out_tensor is None and c.out_split_sizes is None:
        return None  # the receive sizes are exchanged: they match by construction
    me = c.group.rank
    sent = int(c.in_split_sizes[me]) if c.in_split_sizes is not None else _rows(c.in_tensor) // c.W
    received = int(c.out_split_sizes[me]) if c.out_split_sizes is not None else _rows(c.out_tensor) // c.W
    if sent == received:
        return None
    source = "" if c.out_split_sizes is not None else " (an even split of out_tensor)"
    return f"{received} rows from this rank (position {me}){source} while it sends itself {sent}"


def _alltoall_splits(c: Call) -> tuple[list[int], list[int] | None]:
    """alltoall_single's send and receive sizes as lists; the receive sizes None where they
    are exchanged (only in_split_sizes given, no out_tensor)."""
    sent = c.in_split_sizes.tolist() if c.in_split_sizes is not None else even_split(_rows(c.in_tensor), c.W)
    if c.out_split_sizes is not None:
        return sent, c.out_split_sizes.tolist()
    if c.out_tensor is not None:
        return sent, even_split(_rows(c.out_tensor), c.W)
    return sent, (sent if c.in_split_sizes is None else None)


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
        return [_rows(a) for a in value] if value else None
    return even_split(_rows(value), world)


def _alltoall_lists(c: Call) -> str | None:
    """Inputs: a list of {W} arrays, or one array of a multiple of {W} rows; outputs the same,
    or an empty list."""
    for name in ("in_tensor_or_tensor_list", "out_tensor_or_tensor_list"):
        value = getattr(c, name)
        if isinstance(value, list):
            if len(value) != c.W and (value or name.startswith("in")):
                return f"{name} as a list of length {len(value)}"
        elif _rows(value) % c.W:
            return f"{name} as an array of {_rows(value)} rows"
    return None


def _alltoall_kinds(c: Call) -> str | None:
    """Every array of the library, dtype and trailing shape of the first input."""
    given, out = c.in_tensor_or_tensor_list, c.out_tensor_or_tensor_list
    arrays = given if isinstance(given, list) else [given]
    if not arrays:
        return None
    first = arrays[0]
    others = [*arrays[1:], *(out if isinstance(out, list) else [out])]
    return next((m for a in others if (m := _same_array_kind(a, first, "in_tensor_or_tensor_list[0]"))), None)


def _alltoall_to_self(c: Call) -> str | None:
    """This rank receives from itself the rows it sends itself (where the output says)."""
    sent = _peer_rows(c.in_tensor_or_tensor_list, c.W)
    received = _peer_rows(c.out_tensor_or_tensor_list, c.W)
    me = c.group.rank
    if sent is None or received is None or sent[me] == received[me]:
        return None
    return f"{received[me]} rows from this rank (position {me}) while it sends itself {sent[me]}"


def _alltoall_plan(c: Call) -> tuple[list[int], list[int] | None]:
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


def _gather_output_kind(c: Call) -> str | None:
    out, x = c.tensor_or_tensor_list, c.tensor
    if isinstance(out, list):
        return next((f"a list holding {m}" for o in out if (m := _same_array_kind(o, x, "tensor"))), None)
    return None if out is None else _same_array_kind(out, x, "tensor")


def _gather_output_rows(c: Call) -> str | None:
    out, x, world = c.tensor_or_tensor_list, c.tensor, c.W
    if out is None:
        return None
    if isinstance(out, list):
        if len(out) not in (0, world):
            return f"a list of length {len(out)}"
        mine = _rows(out[c.group.rank]) if out else _rows(x)
        return (
            None if mine == _rows(x) else f"{mine} rows in entry {c.group.rank} (this rank) for tensor with {_rows(x)}"
        )
    return None if _rows(out) == world * _rows(x) else f"{_rows(out)} rows for {world} ranks of {_rows(x)} rows"


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
        _GROUP,
    ),
    rules=(
        Rule("local_count", "a length that is a positive multiple of the group size {W}",
             lambda c: _length_multiple(c.local_count, c.W)),
    ),
    backward="none (counts are integers, outside autograd)",
    in_capabilities=False,
)  # fmt: skip

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


def _expert_ids_in_range(c: Call) -> str | None:
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


def _same_place_as_x(param: str) -> Callable[[Call], str | None]:
    """The library and device of parameter ``param`` against x's (None passes)."""
    return lambda c: None if getattr(c, param) is None else _same_place(getattr(c, param), c.x, "x")


_EXPERTS_RULE = Rule(
    "experts_per_rank", f"at most {MAX_EXPERTS} experts in all (W * experts_per_rank, W = {{W}})",
    lambda c: None if c.W * c.experts_per_rank <= MAX_EXPERTS else str(c.experts_per_rank),
)  # fmt: skip
_IDS_ROWS_RULE = Rule("topk_idx", "as many rows as x (one row of expert ids per token)",
                      lambda c: None if _rows(c.topk_idx) == _rows(c.x)
                      else f"shape {tuple(c.topk_idx.shape)} for x with {_rows(c.x)} rows")  # fmt: skip
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
        replace(_GROUP, keyword_only=True),
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


def _handle_place(rows: str) -> Callable[[Call], str | None]:
    """The library and device of parameter ``rows`` against the dispatched x's (the handle's)."""

    def check(c: Call) -> str | None:
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
         lambda c: None if _rows(c.x) == c.handle.tokens else f"{_rows(c.x)} rows for {c.handle.tokens} tokens"),
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
             lambda c: None if _rows(c.y) == c.handle.received else f"{_rows(c.y)} rows for {c.handle.received}"),
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
        replace(_GROUP, keyword_only=True),
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
             lambda c: None if c.max_tokens_per_rank is None or _rows(c.x) <= c.max_tokens_per_rank
             else f"{_rows(c.x)} rows for max_tokens_per_rank={c.max_tokens_per_rank}"),
    ),
    backward="to x: the rows' gradients sent back (the even all-to-all back, alltoall_single's backward) and "
    "summed over each token's kept slots; padding rows and dropped slots get none",
    in_capabilities=False,
)  # fmt: skip

_STATIC_HANDLE = Param("handle", STATIC_HANDLE, "moe.StaticHandle", "What moe.dispatch_static returned with the rows.")


def _blocks(c: Call) -> str | None:
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


def _reduces(c: Call) -> str | None:
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
)


def _scatter_output(c: Call) -> str | None:
    """Rows of ``out`` against this rank's block of ``tensor``."""
    if c.out is None or (c.split_sizes is not None and len(c.split_sizes) != c.W):
        return None
    mine = int(c.split_sizes[c.group.rank]) if c.split_sizes is not None else _rows(c.tensor) // c.W
    if _rows(c.out) == mine:
        return None
    return f"{_rows(c.out)} rows for a block of {mine} rows (position {c.group.rank})"


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
)  # fmt: skip

#: Every entry point with a spec, by name, in the order the docs list them.
SPECS: dict[str, OpSpec] = {
    op.name: op
    for op in (
        GLOBAL_SCATTER, GLOBAL_GATHER, ALLTOALL_SINGLE, ALLTOALL, ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, BROADCAST,
        EXCHANGE_COUNTS, MOE_DISPATCH, MOE_REDISPATCH, MOE_COMBINE, MOE_DISPATCH_STATIC, MOE_REDISPATCH_STATIC,
        MOE_COMBINE_STATIC,
    )
}  # fmt: skip

#: The modes of unicoll.moe, each its dispatch, redispatch and combine, for the API page's table of
#: what a mode offers on each backend.
MOE_MODES: dict[str, tuple[OpSpec, OpSpec, OpSpec]] = {
    "dynamic": (MOE_DISPATCH, MOE_REDISPATCH, MOE_COMBINE),
    "static": (MOE_DISPATCH_STATIC, MOE_REDISPATCH_STATIC, MOE_COMBINE_STATIC),
}

#: The data operators, which backends list in their capability tables, by name.
OPS: dict[str, OpSpec] = {name: op for name, op in SPECS.items() if op.in_capabilities}
