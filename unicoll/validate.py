"""Checking a call against its operator's spec, on every rank, before any communication.

Each parameter is read by its kind's reader (:mod:`unicoll.kinds`: an input array, counts,
a group, ...) and then every rule of the spec is checked; the first one that fails raises,
naming the operator, the parameter, what was expected and what was given. A call whose
arguments have the signatures of a call accepted before is taken from memory instead.
"""

from __future__ import annotations

from typing import Any

from . import runtime
from .check import count_call
from .errors import bad_input
from .spec import Call, OpSpec

_ENTRY_OVERHEAD = 1024
"""Bytes counted per remembered call beside its counts: the key's and the call's objects."""


def prepare(spec: OpSpec, arguments: dict[str, Any]) -> Call:
    """Read and check ``arguments`` (by parameter name) for ``spec``; returns the call, which
    also carries the running ``backend``, the ``group`` resolved, its size ``W`` and ``timeout``.

    A call whose arguments have the signatures (:mod:`unicoll.kinds`) of a call accepted
    before is the call remembered then, so the steady state of a training loop costs a few
    dictionary lookups. The memory of accepted calls keeps copies of counts, never the
    caller's arrays, and is bounded by :data:`unicoll.memory.MAX_BYTES`. A
    remembered call is shared and must not be changed, and it carries no arrays: operators
    read their arrays from ``arguments`` (where the ranks compare their calls, the call carries
    them, for :mod:`unicoll.check`).

    Raises NotInitializedError before ``init``, TypeError/ValueError for a bad argument.
    """
    state = runtime.state(spec.name)
    given = arguments["group"]
    group = state.world if given is None else runtime.resolve_group(given, spec.name)
    if state.compare:
        count_call(group)
    parts = [spec, group, state.check, state.handshake]  # a remembered call carries the settings it was read with
    for name, sign in spec.signed:  # a loop: a comprehension costs a call more (Python 3.11)
        parts.append(sign(arguments[name]))
    key = tuple(parts)
    memory = state.memory
    try:
        accepted = memory.accepted.get(key)  # never holds a key with a None signature (not remembered)
    except TypeError:  # an unhashable argument, such as counts given as a list of lists
        return _read_call(spec, arguments, state, group)
    if accepted is None:
        call = _read_call(spec, arguments, state, group)
        missed = memory.missed[spec] = memory.missed.get(spec, 0) + 1
        if None not in key and (missed < _STREAK or missed % _STREAK == 0):
            kept = _frozen(call.copy() if state.compare else call, spec)  # a compared call returns the arrays too
            memory.accepted.put(key, kept, _remembered_bytes(kept, spec))
        return call
    missed = memory.missed.get(spec)
    if missed is not None:  # absent in a loop the memory serves: one lookup
        if missed > _CREDIT:
            memory.missed[spec] = missed - _CREDIT
        else:
            del memory.missed[spec]
    if not state.compare:
        return accepted
    call = accepted.copy()
    for name in spec.passed_through:
        setattr(call, name, arguments[name])
    return call


def read_only(spec: OpSpec, arguments: dict[str, Any]) -> Call:
    """``arguments`` read and checked for ``spec`` as :func:`prepare` reads them, for a call
    that is traced, not run now (``jax.jit``): not counted, not remembered."""
    state = runtime.state(spec.name)
    given = arguments["group"]
    group = state.world if given is None else runtime.resolve_group(given, spec.name)
    return _read_call(spec, arguments, state, group)


_STREAK = 64
"""Once an operator's count of missed calls reaches this many (new counts every call, as a
training loop's router makes them), only about one call in this many is remembered: keeping
the others costs a microsecond or more each, serves no later call and pushes out calls that
come back; one in this many notices when the arguments start to repeat."""

_CREDIT = 8
"""What a call the memory served takes off its operator's count of missed calls. Counts that
come back now and then (one call in ten or fewer served) still let the count grow to
:data:`_STREAK`; a loop whose calls mostly repeat brings it back down (the operator is then
absent from the counts), and every call is remembered again."""


def _frozen(call: Call, spec: OpSpec) -> Call:
    """``call`` made fit to remember, and returned: counts copied and read-only, as the
    caller's may change; the caller's arrays left out."""
    for name in spec.passed_through:
        setattr(call, name, None)
    for name in spec.counted:
        value = getattr(call, name)
        if value is not None:
            value = value.copy()
            value.flags.writeable = False
            setattr(call, name, value)
    return call


_BYTES_PER_COUNT = 72
"""Bytes counted per count remembered: its int64 copy in the call and, in the key, its bytes
or, for counts given as a list, a tuple of ints and one of their types."""


_BYTES_PER_PLANNED = 40
"""Bytes counted per entry of a list in a call's plan: the list's pointer and an int."""


def _remembered_bytes(kept: Call, spec: OpSpec) -> int:
    """What remembering ``kept`` (and its key) costs, counted from its counts and its plan."""
    remembered = 0
    for name in spec.counted:
        counts = getattr(kept, name)
        if counts is not None:
            remembered += counts.size
    return _BYTES_PER_COUNT * remembered + _plan_bytes(kept.plan) + _ENTRY_OVERHEAD


def _plan_bytes(plan: Any) -> int:
    """What a call's plan holds: a tuple of lists counted per entry, or an object's ``nbytes``."""
    if plan is None:
        return 0
    if isinstance(plan, tuple):
        return _BYTES_PER_PLANNED * sum(len(part) for part in plan if part is not None)
    return plan.nbytes


def _read_call(spec: OpSpec, arguments: dict[str, Any], state: Any, group: Any) -> Call:
    """Every parameter read by its kind's reader (the group is resolved already), then every
    rule of ``spec`` checked."""
    backend = state.backend
    if spec.in_capabilities and not backend.capabilities.provides(spec.name):
        raise NotImplementedError(f"{spec.name}: backend {backend.name!r} does not provide this operator")
    caps, op, name = backend.capabilities, spec.name, backend.name
    call = Call(W=group.world_size, group=group, backend=backend, timeout=state.timeout, compare=state.compare,
                check=state.check)  # fmt: skip
    for param, read in spec.readers:
        setattr(call, param, read(op, param, arguments[param], caps, name))
    for rule in spec.rules:
        given = rule.check(call)
        if given is not None:
            raise bad_input(spec.name, rule.param, rule.expected.replace("{W}", str(call.W)), given, rule.error)
    if spec.plan is not None:
        call.plan = spec.plan(call)
    return call
