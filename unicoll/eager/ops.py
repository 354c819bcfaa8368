"""The operators and exchange_counts, eagerly: validate from the spec, run on the backend, hand
back the caller's kind. Plain functions, which the floors above run under the lock.

Every operator follows the same path: :func:`unicoll.validate.prepare` checks the call on
this rank before anything is sent, the handshake (or check mode) compares the ranks' calls, the
backend issues the transfer on its native arrays,
and :func:`_run` returns the result (``sync_op=True``) or a :class:`~unicoll.Task`,
converting back to the caller's array library and, for torch tensors that require grad,
linking the result into autograd (the in-place operators record their change of the tensor).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from array_api_compat import array_namespace

from ..arrays import describe, description_of, library_of, overlaps
from ..backends.base import Backend, Pending
from ..backends.layout import MoePlan
from ..check import call_number, verify, verify_backward
from ..counts import Counts, even_split
from ..entry import enter, leave
from ..errors import TransportError, bad_input, reported, translated
from ..group import Group
from ..libraries.native import NATIVE
from ..spec import (
    ALL_GATHER,
    ALL_REDUCE,
    ALLTOALL,
    ALLTOALL_SINGLE,
    BROADCAST,
    EXCHANGE_COUNTS,
    GLOBAL_GATHER,
    GLOBAL_SCATTER,
    REDUCE_SCATTER,
    Call,
    OpSpec,
)
from ..spec.collectives import REDUCE
from ..task import Task
from ..validate import prepare


def _run(op: str, call: Call, issue: Callable[[], Pending], finish: Callable[[Any], Any]) -> Any:
    """Issue the transfers, then run ``finish(native_result)`` now (``sync_op=True``) or at
    ``Task.wait()``; transport failures become :class:`~unicoll.CommunicationError` naming
    ``op`` and the group."""
    if call.sync_op:
        return finish(_now(op, call, issue))
    return issued_task(op, call.group, call.timeout, issue, finish)


def issued_task(
    op: str, group: Group, timeout: float, issue: Callable[[], Pending], finish: Callable[[Any], Any]
) -> Task:
    """Issue the transfers and return the :class:`~unicoll.Task` whose ``wait()`` runs
    ``finish(native_result)``; transport failures, at issue and in ``wait()``, become
    :class:`~unicoll.CommunicationError` naming ``op`` and ``group``."""
    try:
        pending = issue()
    except TransportError as exc:
        raise reported(exc, op, group, timeout) from exc
    return Task(pending.works, lambda: finish(pending.finish()), timeout, op, group)


def _now(op: str, call: Call, issue: Callable[..., Pending], *args: Any) -> Any:
    """``issue(*args)`` completed: its native result; transport failures become
    :class:`~unicoll.CommunicationError` naming ``op`` and the group. The synchronous calls'
    path (:func:`_run`, and the operators' steady state, which calls it without closures)."""
    try:  # translated() inlined: this is every call's hot path
        return issue(*args).finish()
    except TransportError as exc:
        raise reported(exc, op, call.group, call.timeout) from exc


def _functional(op: str, call: Call, x: Any, backward: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """How to finish an operator that allocated its output: back to x's library, with autograd
    whose backward collective reports failures like the forward one (the eager floor's autograd
    is torch's: a joined library's arrays arrive as torch tensors, :mod:`unicoll.carry`)."""
    description = description_of(x)
    library = description.name
    if description.autograd and description.needs_grad(x):
        from .autograd import attach  # autograd (and torch) only imported when needed

        backend, guarded = call.backend, _guarded(op, call, backward)
        return lambda result: attach(x, backend.from_native(result, library), guarded)
    return lambda result: call.backend.from_native(result, library)


def _functional_linked(op: str, call: Call, x: Any, backward: Callable[[Any], Any]) -> Callable[[Any], tuple[Any, Any]]:
    """:func:`_functional` for a dispatch, whose handle later joins combine's rows to it:
    finishes as ``(result, link)``, the link (:func:`~unicoll.eager.autograd.attach_linked`)
    None where no gradient is recorded."""
    description = description_of(x)
    library = description.name
    if description.autograd and description.needs_grad(x):
        from .autograd import attach_linked

        backend, guarded = call.backend, _guarded(op, call, backward)
        return lambda result: attach_linked(x, backend.from_native(result, library), guarded)
    return lambda result: (call.backend.from_native(result, library), None)


def _guarded(op: str, call: Call, backward: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """:func:`guarded` for the forward call ``call`` (numbered where the ranks compare their calls:
    prepare counted it)."""
    forward = call_number(call.group) if call.compare else None
    return guarded(op, call.backend, call.group, call.timeout, forward, backward)


def guarded(
    op: str, backend: Backend, group: Group, timeout: float, forward: int | None, backward: Callable[[Any], Any]
) -> Callable[[Any], Any]:
    """``backward`` (one of the ``*_backward`` functions below, bound to what its forward call
    saved) on native arrays, as torch calls it with a tensor: one thread at a time, its
    transport failures reported like the forward's, and, where ``forward`` (the forward call's
    number on ``group``) is given, counted and compared across the ranks like a forward call
    (:func:`unicoll.check.verify_backward`). Every caller of an operator's backward runs it
    through here (eager autograd and the floor above alike). ``backward`` returns the input's
    gradient, or a tuple of one per input (None for one that gets none), each returned as torch's.
    """
    name = f"{op} (backward)"

    def guarded_backward(grad: Any) -> Any:
        enter(name)
        try:
            with translated(name, group, timeout):
                native = backend.to_native(grad)
                if forward is not None:
                    verify_backward(name, backend, group, native, forward)
                computed = backward(native)
                if isinstance(computed, tuple):
                    return tuple(None if g is None else backend.from_native(g, "torch") for g in computed)
                return backend.from_native(computed, "torch")
        finally:
            leave()

    return guarded_backward


# -- each differentiable operator's backward, on native arrays: the one place it is written --


def global_scatter_backward(backend: Backend, group: Group, grad: Any, plan: MoePlan, out: Any | None = None) -> Any:
    """global_gather of the output gradient with the same counts (the same plan).

    ``out``: native rows to fill instead of new ones (moe.dispatch's backward sums them per token)."""
    return backend.global_gather(grad, plan, group, False, out=out).finish()


def global_gather_backward(backend: Backend, group: Group, grad: Any, plan: MoePlan) -> Any:
    """global_scatter of the output gradient with the same counts (the same plan)."""
    return backend.global_scatter(grad, plan, group, False).finish()


def alltoall_single_backward(backend: Backend, group: Group, grad: Any, sent: list[int], received: list[int]) -> Any:
    """alltoall_single of the output gradient with the split sizes swapped: back the way the
    rows came, ``received[c]`` rows to rank c and ``sent[c]`` rows from it."""
    return backend.alltoall_single(None, grad, sent, received, group, False).finish()


def all_gather_backward(backend: Backend, group: Group, grad: Any, rows: list[int]) -> Any:
    """Each rank's gradient is the sum of every rank's output gradient for its rows: a
    reduce_scatter by the rows each rank sent."""
    return backend.reduce_scatter(None, grad, "sum", rows, group, False).finish()


def all_reduce_backward(backend: Backend, group: Group, grad: Any, op: str) -> Any:
    """all_reduce of the output gradient with the same op, sum or avg (max, min and prod
    record none), into a copy: torch may use the gradient elsewhere."""
    return backend.all_reduce(_copy(grad), op, group, False).finish()


def reduce_scatter_backward(backend: Backend, group: Group, grad: Any, op: str, rows: list[int]) -> Any:
    """all_gather of the output gradient: every rank's block gradient in rank order (block c
    has ``rows[c]`` rows), divided by W for avg (max, min and prod record none)."""
    gathered = backend.all_gather(None, grad, rows, group, False).finish()
    return gathered / group.world_size if op == "avg" else gathered


def reduce_backward(backend: Backend, group: Group, grad: Any, op: str, dst: int) -> Any:
    """dst's output gradient on every rank (a broadcast from dst, in which every rank takes
    part), divided by W for avg (max, min and prod record none); a rank other than dst adds its
    own output's gradient, since its output is its input."""
    position = group.ranks.index(dst)
    total = backend.broadcast(_copy(grad), position, group, False).finish()
    if op == "avg":
        total = total / group.world_size
    if group.rank != position:
        total += grad
    return total


def broadcast_backward(backend: Backend, group: Group, grad: Any, src: int) -> Any:
    """The sum of every rank's output gradient on src, zero elsewhere (a reduce to src, in
    which every rank takes part)."""
    total = backend.all_reduce(_copy(grad), "sum", group, False).finish()
    if group.rank != src:
        total[...] = 0
    return total


_CHANGEABLE = "a tensor autograd lets change in place (for a leaf that requires grad: under torch.no_grad())"
"""What an operator that writes a tensor in place expects of it under autograd."""

_DIFFERENTIABLE = ("sum", "avg")
"""The reductions whose result has a gradient here."""


def _recorded(op: str, x: Any, reduction: str | None, in_place: bool, compiled: CompiledCall | None) -> bool:
    """Whether the result computed from ``x`` joins autograd; raises, before anything is sent,
    for what autograd cannot record: a reduction without a gradient, or (``in_place``) a leaf
    that requires grad, which torch never lets change in place. A compiled call is judged by
    how autograd saw the caller's array, and records nothing itself (its op's backward does)."""
    state = autograd_state(x) if compiled is None else compiled.autograd
    if state == "none":
        return False
    if reduction is not None and reduction not in _DIFFERENTIABLE:
        expected = "'sum' or 'avg' for a tensor that requires grad (max, min and prod have no gradient here)"
        raise bad_input(op, "op", expected, repr(reduction))
    if in_place and state != "recorded":
        raise bad_input(op, "tensor", _CHANGEABLE, f"{state} {describe(x)} that requires grad")
    return True


def autograd_state(x: Any) -> str:
    """How autograd sees a result computed from ``x``: ``"none"`` (not recorded: not a tensor
    that requires grad, or grad mode off), ``"a leaf"`` or ``"a view of a leaf"`` (which
    cannot change in place), else ``"recorded"``."""
    description = description_of(x)
    if description is None or not (description.autograd and description.needs_grad(x)):
        return "none"
    from .autograd import recorded_state

    return recorded_state(x)


def _written(op: str, param: str, out: Any) -> None:
    """Before anything is sent: refuse an output array autograd would have to record (a torch
    tensor that requires grad, with grad mode on: an output filled in place records no
    gradient), and move the version counter of a tensor this call will write, as torch's
    own in-place operators do, so that a backward pass that saved it raises instead of reading
    the new values."""
    description = description_of(out)
    if not description.autograd:
        return
    if description.needs_grad(out):
        expected = (
            "a tensor that does not require grad (an output filled in place records no gradient; "
            "pass None for a result that does)"
        )
        raise bad_input(op, param, expected, f"{describe(out)} that requires grad")
    description.mark_written(out)


def _fillable_list(op: str, param: str, entries: list) -> None:
    """Before anything is sent: refuse a list of outputs that autograd could not fill (a leaf
    that requires grad, with grad mode on) or whose entries overlap (one would overwrite
    another's rows). Entries that autograd records are filled by copies it records."""
    for i, entry in enumerate(entries):
        if autograd_state(entry) == "a leaf":
            raise bad_input(op, f"{param}[{i}]", _CHANGEABLE, f"a leaf {describe(entry)} that requires grad")
        for j in range(i):
            if overlaps(entry, entries[j]):
                expected = f"arrays that do not share memory with each other (entry {j} does)"
                raise bad_input(op, f"{param}[{i}]", expected, f"{describe(entry)} overlapping entry {j}")


def _in_place(op: str, call: Call, x: Any, recorded: bool, backward: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """How to finish an in-place operator: return ``x``, recorded in autograd when ``recorded``."""
    if not recorded:
        return lambda _: x
    from .autograd import attach_in_place

    guarded = _guarded(op, call, backward)
    return lambda _: attach_in_place(x, guarded)


def _scatter_or_gather(spec: OpSpec, arguments: dict[str, Any], compiled: CompiledCall | None = None) -> Any:
    """global_scatter or global_gather (``spec``), whose backward is the other one (``compiled``:
    :class:`CompiledCall`; these learn nothing)."""
    call = prepare(spec, arguments)
    backend, x, plan, grp = call.backend, arguments["x"], call.plan, call.group
    forward, backward = getattr(backend, spec.name), _MOE_BACKWARD[spec.name]

    finish = _functional(spec.name, call, x, lambda g: backward(backend, grp, g, plan))
    if call.sync_op and not call.compare:  # the steady state of a loop: no closure to issue, no Task
        return finish(_now(spec.name, call, forward, backend.to_native(x), plan, grp, False, call.use_calc_stream))

    def issue() -> Pending:
        if call.compare:
            verify(spec, call)
        return forward(backend.to_native(x), plan, grp, not call.sync_op, call.use_calc_stream)

    return _run(spec.name, call, issue, finish)


_MOE_BACKWARD = {"global_scatter": global_scatter_backward, "global_gather": global_gather_backward}


def _native_input(backend: Backend, x: Any, out: Any | None) -> Any:
    """``x`` as the backend's native array, staged through a copy when it overlaps the output
    array ``out``: the transfer would otherwise read rows it has already overwritten."""
    native = backend.to_native(x)
    if out is None or not overlaps(out, x):
        return native
    staged = backend.empty_rows(native, native.shape[0])
    staged[...] = native
    return staged


def _copy(x: Any) -> Any:
    """A copy of a native array (torch tensors clone, numpy and cupy arrays copy)."""
    return NATIVE[library_of(x)].copy(x)


def global_scatter(
    x: Any,
    local_count: Counts,
    global_count: Counts,
    group: Group | None = None,
    sync_op: bool = True,
    use_calc_stream: bool = True,
) -> Any:
    """MoE dispatch: route rows of ``x`` to experts across ranks (see docs/semantics.md).

    Rows of ``x`` are ordered by ``i = rank * E + expert`` with ``local_count[i]`` rows each;
    the result holds ``sum(global_count)`` rows, expert-major, then source rank.

    >>> # W=2, E=2, rank 0: x=[0,1,2,3], local_count=[1,0,2,1], global_count=[1,0,0,2]
    >>> uc.global_scatter(x, [1, 0, 2, 1], [1, 0, 0, 2])   # doctest: +SKIP
    array([ 0, 10, 11])
    """
    arguments = dict(x=x, local_count=local_count, global_count=global_count, group=group, sync_op=sync_op,
                     use_calc_stream=use_calc_stream)  # fmt: skip
    return _scatter_or_gather(GLOBAL_SCATTER, arguments)


def global_gather(
    x: Any,
    local_count: Counts,
    global_count: Counts,
    group: Group | None = None,
    sync_op: bool = True,
    use_calc_stream: bool = True,
) -> Any:
    """MoE combine: send expert outputs back to the ranks their rows came from.

    ``x`` is laid out as global_scatter's output; the result holds ``sum(local_count)``
    rows in the original order, so ``global_gather(global_scatter(x, lc, gc), lc, gc) == x``.
    """
    arguments = dict(x=x, local_count=local_count, global_count=global_count, group=group, sync_op=sync_op,
                     use_calc_stream=use_calc_stream)  # fmt: skip
    return _scatter_or_gather(GLOBAL_GATHER, arguments)


def alltoall_single(
    out_tensor: Any | None,
    in_tensor: Any,
    out_split_sizes: Counts | None = None,
    in_split_sizes: Counts | None = None,
    group: Group | None = None,
    sync_op: bool = True,
    use_calc_stream: bool = False,
) -> Any:
    """Uneven all-to-all of rows; returns ``out_tensor`` filled, or a new array when it is None.

    Rank r sends ``in_split_sizes[c]`` consecutive rows to rank c and receives
    ``out_split_sizes[c]`` rows from rank c, in rank order. Split sizes that are None mean an
    even split. With ``out_tensor=None`` and only ``in_split_sizes`` given, the receive sizes
    are exchanged first (one small extra all-to-all).

    >>> y = uc.alltoall_single(None, x, in_split_sizes=[1, 3])   # doctest: +SKIP
    """
    arguments = dict(out_tensor=out_tensor, in_tensor=in_tensor, out_split_sizes=out_split_sizes,
                     in_split_sizes=in_split_sizes, group=group, sync_op=sync_op,
                     use_calc_stream=use_calc_stream)  # fmt: skip
    return _alltoall_single(arguments)


def alltoall(
    out_tensor_or_tensor_list: Any | list,
    in_tensor_or_tensor_list: Any | list,
    group: Group | None = None,
    sync_op: bool = True,
    use_calc_stream: bool = False,
) -> Any:
    """All-to-all of arrays (PaddlePaddle's stream ``alltoall``): rank r sends entry c of
    ``in_tensor_or_tensor_list`` to rank c and receives rank c's entry r into entry c of
    ``out_tensor_or_tensor_list``. Returns the output, filled (or a Task whose ``wait()`` does).

    Either side may be one array split evenly into W blocks; the entries of a list may differ in
    rows; an empty output list gets W arrays appended (their rows are exchanged first). Gradients
    flow from the outputs of a new list, or of arrays autograd records a copy into, back to the
    inputs (the all-to-all back: alltoall_single's backward).

    >>> received = []
    >>> uc.alltoall(received, [x[:1], x[1:]])   # W=2: x[:1] to rank 0, x[1:] to rank 1  # doctest: +SKIP
    """
    arguments = dict(out_tensor_or_tensor_list=out_tensor_or_tensor_list,
                     in_tensor_or_tensor_list=in_tensor_or_tensor_list, group=group, sync_op=sync_op,
                     use_calc_stream=use_calc_stream)  # fmt: skip
    call = prepare(ALLTOALL, arguments)
    out, given = out_tensor_or_tensor_list, in_tensor_or_tensor_list
    sent = array_namespace(*given).concat(given, axis=0) if isinstance(given, list) else given
    if call.compare:  # a call of its own (prepare copies a compared one): compared as alltoall_single's rows
        call.in_tensor = sent
    if not isinstance(out, list):
        _written(ALLTOALL.name, "out_tensor_or_tensor_list", out)
        return _rows_to_peers(ALLTOALL, call, out, sent, sync_op, use_calc_stream)[0]
    _fillable_list(ALLTOALL.name, "out_tensor_or_tensor_list", out)
    into_list = lambda result, rows: _fill_list(out, result, rows)  # noqa: E731
    return _rows_to_peers(ALLTOALL, call, None, sent, sync_op, use_calc_stream, into_list)[0]


def _alltoall_single(arguments: dict[str, Any], compiled: CompiledCall | None = None) -> Any:
    """alltoall_single's result (or Task); a compiled call (:class:`CompiledCall`) learns the
    split sizes sent and received."""
    call = prepare(ALLTOALL_SINGLE, arguments)
    out_tensor, in_tensor = arguments["out_tensor"], arguments["in_tensor"]
    sync_op, use_calc_stream = arguments["sync_op"], arguments["use_calc_stream"]
    if out_tensor is not None:
        _written(ALLTOALL_SINGLE.name, "out_tensor", out_tensor)
    if out_tensor is not None and sync_op and not call.compare:  # the steady state of a loop: no closures, no Task
        backend, grp = call.backend, call.group
        in_splits, out_splits = call.plan
        try:  # into a given output, base.Backend.alltoall_single is the alltoallv primitive: called directly
            backend.alltoallv(
                backend.to_native(out_tensor), _native_input(backend, in_tensor, out_tensor),
                out_splits, in_splits, grp, False, use_calc_stream,
            )  # fmt: skip
        except TransportError as exc:
            raise reported(exc, ALLTOALL_SINGLE.name, grp, call.timeout) from exc
        return out_tensor
    result, received = _rows_to_peers(ALLTOALL_SINGLE, call, out_tensor, in_tensor, sync_op, use_calc_stream)
    if compiled is not None:
        compiled.learned.update(sent=call.plan[0], received=received)
    return result


def _rows_to_peers(
    spec: OpSpec,
    call: Call,
    out_tensor: Any | None,
    in_tensor: Any,
    sync_op: bool,
    use_calc_stream: bool,
    then: Callable[[Any, list[int]], Any] | None = None,
) -> tuple[Any, list[int] | None]:
    """The all-to-all of ``in_tensor``'s rows by the split sizes of ``call.plan`` (the receive
    sizes exchanged first where they are None), for alltoall_single or alltoall (``spec``): the
    result (``out_tensor`` filled, or a new array with alltoall_single's backward), passed
    through ``then(result, received)`` where given, or a Task; and the split sizes received
    (None while a Task has not exchanged them yet)."""
    backend, grp = call.backend, call.group
    in_splits, out_splits = call.plan

    def issue() -> Pending:
        nonlocal out_splits
        if call.compare:  # the ranks' records carry the split sizes each rank sends
            received = verify(spec, call, in_splits=in_splits, out_splits=out_splits)
            out_splits = received if out_splits is None else out_splits
        elif out_splits is None:
            out_splits = backend.exchange_ints(np.array(in_splits, dtype=np.int64), grp).tolist()
        return _issue_alltoall(backend, out_tensor, in_tensor, out_splits, in_splits, grp, not sync_op, use_calc_stream)

    if out_tensor is not None:
        finish = lambda _: out_tensor  # noqa: E731
    else:
        backward = lambda g: alltoall_single_backward(backend, grp, g, in_splits, out_splits)  # noqa: E731
        finish = _functional(spec.name, call, in_tensor, backward)
    if then is not None:
        functional = finish
        finish = lambda result: then(functional(result), out_splits)  # noqa: E731
    result = _run(spec.name, call, issue, finish)  # issues: out_splits known from here on
    return result, out_splits


def _issue_alltoall(
    backend: Backend,
    out_tensor: Any | None,
    in_tensor: Any,
    out_splits: list[int],
    in_splits: list[int],
    grp: Group,
    async_op: bool,
    use_calc_stream: bool,
) -> Pending:
    """The backend's alltoall_single on the caller's arrays (the input staged where it overlaps the output)."""
    out_native = None if out_tensor is None else backend.to_native(out_tensor)
    native_in = _native_input(backend, in_tensor, out_tensor)
    return backend.alltoall_single(out_native, native_in, out_splits, in_splits, grp, async_op, use_calc_stream)


def all_gather(
    tensor_or_tensor_list: Any | list | None,
    tensor: Any,
    group: Group | None = None,
    sync_op: bool = True,
    use_calc_stream: bool = False,
) -> Any:
    """Every rank's ``tensor``, in rank order, on every rank.

    ``tensor_or_tensor_list``: None returns all ranks' rows concatenated (row counts may
    differ between ranks; they are exchanged first); an array of ``W * rows`` rows is filled
    in place; an empty list gets ``W`` arrays appended; a list of ``W`` arrays is filled in
    place (their row counts say how many rows each rank sends).

    >>> parts = []
    >>> uc.all_gather(parts, x)        # doctest: +SKIP
    """
    arguments = dict(tensor_or_tensor_list=tensor_or_tensor_list, tensor=tensor, group=group, sync_op=sync_op,
                     use_calc_stream=use_calc_stream)  # fmt: skip
    return _all_gather(arguments)


def _all_gather(arguments: dict[str, Any], compiled: CompiledCall | None = None) -> Any:
    """all_gather's result (or Task); a compiled call (:class:`CompiledCall`) learns the rows of
    each rank's block."""
    call = prepare(ALL_GATHER, arguments)
    backend = call.backend
    grp, target, tensor = call.group, arguments["tensor_or_tensor_list"], arguments["tensor"]
    sync_op, use_calc_stream = arguments["sync_op"], arguments["use_calc_stream"]
    rows_here = int(tensor.shape[0])
    if isinstance(target, list):
        _fillable_list(ALL_GATHER.name, "tensor_or_tensor_list", target)
    elif target is not None:
        _written(ALL_GATHER.name, "tensor_or_tensor_list", target)
    if isinstance(target, list) and target:
        rows = [int(t.shape[0]) for t in target]
    elif target is None or isinstance(target, list):
        rows = None  # exchanged when the call is issued
    else:
        rows = [rows_here] * call.W

    def issue() -> Pending:
        nonlocal rows
        if call.compare:  # the ranks' records carry the rows each rank sends
            rows = verify(ALL_GATHER, call, rows=rows)
        elif rows is None:
            rows = backend.gather_ints(np.array([rows_here], dtype=np.int64), grp)[:, 0].tolist()
        out = target if target is not None and not isinstance(target, list) else None
        out_native = None if out is None else backend.to_native(out)
        return backend.all_gather(
            out_native, _native_input(backend, tensor, out), rows, grp, not sync_op, use_calc_stream
        )

    if target is None:
        finish = _functional(ALL_GATHER.name, call, tensor, lambda g: all_gather_backward(backend, grp, g, rows))
    elif not isinstance(target, list):
        finish = lambda _: target  # noqa: E731
    else:
        finish = lambda result: _fill_list(target, backend.from_native(result, library_of(tensor)), rows)  # noqa: E731
    result = _run(ALL_GATHER.name, call, issue, finish)  # issues: rows known from here on
    if compiled is not None:
        compiled.learned["blocks"] = rows
    return result


def _fill_list(target: list, rows_of_peers: Any, rows: list[int]) -> list:
    """Split ``rows_of_peers`` (the caller's library) per rank, ``rows[c]`` rows from rank c,
    into ``target``: appended when empty, else copied into its arrays."""
    offsets = np.concatenate([[0], np.cumsum(rows)]).tolist()
    parts = [rows_of_peers[offsets[c] : offsets[c + 1]] for c in range(len(rows))]
    if not target:
        target.extend(parts)
    else:
        for slot, part in zip(target, parts):
            slot[...] = part
    return target


def all_reduce(
    tensor: Any,
    op: str = "sum",
    group: Group | None = None,
    sync_op: bool = True,
    use_calc_stream: bool = False,
) -> Any:
    """Reduce ``tensor`` elementwise over every rank of the group with ``op``, in place;
    returns ``tensor`` (or a Task whose ``wait()`` does).

    ``op``: ``"sum"``, ``"avg"`` (the sum divided by the group size, in the tensor's dtype;
    floating dtypes only), ``"max"``, ``"min"`` or ``"prod"``. Integer sums and products wrap
    around as numpy's do; on bool, ``sum`` and ``max`` are logical or, ``prod`` and ``min``
    logical and. A torch tensor inside autograd records the change (sum and avg).

    >>> g = uc.all_reduce(param.grad, op="avg")   # data-parallel gradients  # doctest: +SKIP
    """
    arguments = dict(tensor=tensor, op=op, group=group, sync_op=sync_op, use_calc_stream=use_calc_stream)
    return _all_reduce(arguments)


def _all_reduce(arguments: dict[str, Any], compiled: CompiledCall | None = None) -> Any:
    """all_reduce in place (``compiled``: :class:`CompiledCall`; it learns nothing)."""
    op, use_calc_stream = arguments["op"], arguments["use_calc_stream"]

    def transfer(call: Call, native: Any, async_op: bool) -> Pending:
        return call.backend.all_reduce(native, op, call.group, async_op, use_calc_stream)

    def backward(call: Call, g: Any) -> Any:
        return all_reduce_backward(call.backend, call.group, g, op)

    return _in_place_collective(ALL_REDUCE, arguments, op, transfer, backward, compiled)


def _in_place_collective(
    spec: OpSpec,
    arguments: dict[str, Any],
    reduction: str | None,
    transfer: Callable[[Call, Any, bool], Pending],
    backward: Callable[[Call, Any], Any],
    compiled: CompiledCall | None,
) -> Any:
    """An operator (``spec``) that changes ``arguments["tensor"]`` in place (``compiled``:
    :class:`CompiledCall`).
    ``transfer(call, native, async_op)`` issues it; ``backward(call, grad)`` is its gradient's
    collective (``reduction``: the one :func:`_recorded` checks; an operator that reduces takes a
    0-d array too)."""
    scalar = arguments["tensor"]
    if reduction is not None and getattr(scalar, "ndim", None) == 0:
        # a 0-d array (a loss) is reduced as the one row of a view of it, which the change reaches
        # (autograd records it on the view, and so on the array); the caller gets the array back
        one_row = {**arguments, "tensor": scalar.reshape(1)}
        result = _in_place_collective(spec, one_row, reduction, transfer, backward, compiled)
        return result._then(lambda _: scalar) if isinstance(result, Task) else scalar
    call = prepare(spec, arguments)
    tensor = arguments["tensor"]
    recorded = _recorded(spec.name, tensor, reduction, True, compiled) and compiled is None
    if not recorded:  # a recorded change moves the version counter as autograd records it
        description = description_of(tensor)  # no gradient: _recorded said so, or this is the op's copy
        if description.autograd:
            description.mark_written(tensor)

    def issue() -> Pending:
        if call.compare:
            verify(spec, call)
        return transfer(call, call.backend.to_native(tensor), not arguments["sync_op"])

    return _run(spec.name, call, issue, _in_place(spec.name, call, tensor, recorded, lambda g: backward(call, g)))


def reduce(
    tensor: Any,
    dst: int,
    op: str = "sum",
    group: Group | None = None,
    sync_op: bool = True,
    use_calc_stream: bool = False,
) -> Any:
    """PaddlePaddle's ``reduce``: every rank's ``tensor`` reduced elementwise with ``op`` into
    ``tensor`` on the rank ``dst``; on the other ranks ``tensor`` keeps its values. Returns
    ``tensor`` (or a Task whose ``wait()`` does).

    ``dst`` is a global rank, a member of the group, as Paddle's is (``broadcast``'s ``src`` is
    a position in the group instead). ``op`` as for :func:`all_reduce`; the transfer is an
    all_reduce, into a copy of ``tensor`` on the ranks other than ``dst``.

    >>> uc.reduce(loss, dst=0, op="avg")   # the mean loss on rank 0  # doctest: +SKIP
    """
    arguments = dict(tensor=tensor, dst=dst, op=op, group=group, sync_op=sync_op, use_calc_stream=use_calc_stream)
    return _reduce(arguments)


def _reduce(arguments: dict[str, Any], compiled: CompiledCall | None = None) -> Any:
    """reduce in place on dst (``compiled``: :class:`CompiledCall`; it learns nothing)."""
    op, use_calc_stream = arguments["op"], arguments["use_calc_stream"]

    def transfer(call: Call, native: Any, async_op: bool) -> Pending:
        into = native if call.group.ranks[call.group.rank] == call.dst else _copy(native)
        return call.backend.all_reduce(into, op, call.group, async_op, use_calc_stream)

    def backward(call: Call, g: Any) -> Any:
        return reduce_backward(call.backend, call.group, g, op, call.dst)

    return _in_place_collective(REDUCE, arguments, op, transfer, backward, compiled)


def reduce_scatter(
    out: Any | None,
    tensor: Any,
    op: str = "sum",
    split_sizes: Counts | None = None,
    group: Group | None = None,
    sync_op: bool = True,
    use_calc_stream: bool = False,
) -> Any:
    """The dual of all_gather: block c of ``tensor``'s rows, reduced with ``op`` over every
    rank, lands on position c. Returns ``out`` filled, or a new array when it is None.

    The blocks are ``split_sizes[c]`` consecutive rows (the same sizes on every rank), or an
    even split when None; ``op`` as for :func:`all_reduce`.

    >>> # W=2, tensor=[1, 2, 3] on rank 0 and [10, 20, 30] on rank 1, split_sizes=[1, 2]
    >>> uc.reduce_scatter(None, tensor, split_sizes=[1, 2])   # doctest: +SKIP
    array([11])   # rank 1: array([22, 33])
    """
    arguments = dict(out=out, tensor=tensor, op=op, split_sizes=split_sizes, group=group, sync_op=sync_op,
                     use_calc_stream=use_calc_stream)  # fmt: skip
    return _reduce_scatter(arguments)


def _reduce_scatter(arguments: dict[str, Any], compiled: CompiledCall | None = None) -> Any:
    """reduce_scatter; a compiled call (:class:`CompiledCall`) learns the rows of each
    position's block."""
    call = prepare(REDUCE_SCATTER, arguments)
    out, tensor, op, sync_op = arguments["out"], arguments["tensor"], arguments["op"], arguments["sync_op"]
    backend, grp = call.backend, call.group
    rows = call.split_sizes.tolist() if call.split_sizes is not None else even_split(tensor.shape[0], call.W)
    if compiled is not None:
        compiled.learned["blocks"] = rows
    if out is not None:
        _written(REDUCE_SCATTER.name, "out", out)

    def issue() -> Pending:
        if call.compare:
            verify(REDUCE_SCATTER, call, rows=rows)
        out_native = None if out is None else backend.to_native(out)
        return backend.reduce_scatter(
            out_native, _native_input(backend, tensor, out), op, rows, grp, not sync_op, arguments["use_calc_stream"]
        )

    if out is not None:
        return _run(REDUCE_SCATTER.name, call, issue, lambda _: out)
    _recorded(REDUCE_SCATTER.name, tensor, op, False, compiled)

    def backward(g: Any) -> Any:
        return reduce_scatter_backward(backend, grp, g, op, rows)

    return _run(REDUCE_SCATTER.name, call, issue, _functional(REDUCE_SCATTER.name, call, tensor, backward))


def broadcast(
    tensor: Any,
    src: int,
    group: Group | None = None,
    sync_op: bool = True,
    use_calc_stream: bool = False,
) -> Any:
    """Overwrite ``tensor`` on every rank of the group with its value on position ``src``, in
    place; returns ``tensor`` (or a Task whose ``wait()`` does).

    ``src`` is a position in the group, as ``uc.get_rank(group)`` numbers it: the world rank
    for ``group=None`` (torch.distributed's ``group_src``, not its world-rank ``src``).

    >>> for p in model.parameters():                 # the same initial weights everywhere
    ...     with torch.no_grad():
    ...         uc.broadcast(p, src=0)               # doctest: +SKIP
    """
    arguments = dict(tensor=tensor, src=src, group=group, sync_op=sync_op, use_calc_stream=use_calc_stream)
    return _broadcast(arguments)


def _broadcast(arguments: dict[str, Any], compiled: CompiledCall | None = None) -> Any:
    """broadcast in place (``compiled``: :class:`CompiledCall`; it learns nothing)."""
    use_calc_stream = arguments["use_calc_stream"]

    def transfer(call: Call, native: Any, async_op: bool) -> Pending:
        return call.backend.broadcast(native, call.src, call.group, async_op, use_calc_stream)

    def backward(call: Call, g: Any) -> Any:
        return broadcast_backward(call.backend, call.group, g, call.src)

    return _in_place_collective(BROADCAST, arguments, None, transfer, backward, compiled)


def exchange_counts(local_count: Counts, group: Group | None = None) -> Any:
    """The ``global_count`` that goes with ``local_count``: one all-to-all of the counts.

    On rank r the result is ``[local_count on rank c][r*E + e]`` for every rank c and expert
    e, the same kind of array as ``local_count`` (numpy for a sequence).

    >>> global_count = uc.exchange_counts(local_count)   # doctest: +SKIP
    """
    call = prepare(EXCHANGE_COUNTS, dict(local_count=local_count, group=group))
    backend, grp = call.backend, call.group
    with translated(EXCHANGE_COUNTS.name, grp, call.timeout):
        if call.compare:
            verify(EXCHANGE_COUNTS, call)
        # a copy: a remembered call's counts are read-only, and a transport may wrap them in a tensor
        received = backend.exchange_ints(call.local_count.copy(), grp)
    description = NATIVE.get(library_of(local_count))  # a sequence of ints: the numpy array
    if description is None:
        return received
    return description.from_host(received, description.place(local_count), local_count.dtype)


@dataclass
class CompiledCall:
    """How the compile floor's custom op calls an operator (:func:`call_compiled`): on a copy of
    the caller's array that autograd does not see, judged by ``autograd``, how autograd saw the
    caller's array while tracing (:func:`autograd_state`); the call fills ``learned`` with what
    its backward needs, by the names of the spec's :attr:`~unicoll.spec.Traced.learns`."""

    autograd: str
    learned: dict[str, list[int]] = field(default_factory=dict)


_CORES: dict[str, Callable[[dict[str, Any], CompiledCall | None], Any]] = {
    GLOBAL_SCATTER.name: functools.partial(_scatter_or_gather, GLOBAL_SCATTER),
    GLOBAL_GATHER.name: functools.partial(_scatter_or_gather, GLOBAL_GATHER),
    ALLTOALL_SINGLE.name: _alltoall_single,
    ALL_GATHER.name: _all_gather,
    ALL_REDUCE.name: _all_reduce,
    REDUCE.name: _reduce,
    REDUCE_SCATTER.name: _reduce_scatter,
    BROADCAST.name: _broadcast,
    EXCHANGE_COUNTS.name: lambda arguments, compiled: exchange_counts(**arguments),
}
"""The operator of each spec that traces (:attr:`unicoll.spec.OpSpec.traced`), taking its
arguments by name and the compiled call's record (:func:`call_compiled`)."""


def call_compiled(spec: OpSpec, arguments: dict[str, Any], autograd: str) -> tuple[Any, dict[str, list[int]]]:
    """The call of ``spec``'s operator with ``arguments`` (every parameter, by name) from compiled
    code (:class:`CompiledCall`: ``autograd`` is how autograd saw the caller's array), and what it
    learned that its backward needs: the lists of one int per rank named by the spec's
    :attr:`~unicoll.spec.Traced.learns` (split sizes an exchange brought, say). The compile
    floor's custom ops call their operators through here."""
    compiled = CompiledCall(autograd)
    return _CORES[spec.name](arguments, compiled), compiled.learned
