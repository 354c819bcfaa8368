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
    before reuses what was read then, so the steady state of a training loop costs a few
    dictionary lookups. The memory of accepted calls keeps copies of counts, never the
    caller's arrays, and is bounded by :data:`unicoll.runtime.ACCEPTED_CACHE_BYTES`.

    Raises NotInitializedError before ``init``, TypeError/ValueError for a bad argument.
    """
    state = runtime.state(spec.name)
    given = arguments["group"]
    group = state.world if given is None else runtime.resolve_group(given, spec.name)
    if state.check:
        count_call(group)
    key = (spec, group, *[sign(arguments[name]) for name, sign in spec.signed])
    try:
        accepted = None if None in key else state.accepted.get(key)
    except TypeError:  # an unhashable argument, such as counts given as a list of lists
        return _read_call(spec, arguments, state, group)
    if accepted is None:
        call = _read_call(spec, arguments, state, group)
        if None not in key:
            kept = _frozen(call, spec)
            state.accepted.put(key, kept, _remembered_bytes(kept, spec))
        return call
    call = accepted.copy()
    call.backend = state.backend  # the memory keeps none: the running one may be wrapped (transport_stubbed)
    for name in spec.passed_through:
        setattr(call, name, arguments[name])
    return call


def _frozen(call: Call, spec: OpSpec) -> Call:
    """A copy of ``call`` to remember: counts copied and read-only, as the caller's may change;
    the caller's arrays and the backend left out (a call taken from memory gets the new call's
    arrays and the running backend)."""
    kept = call.copy()
    kept.backend = None
    for name in spec.passed_through:
        setattr(kept, name, None)
    for name in spec.counted:
        value = getattr(call, name)
        if value is not None:
            value = value.copy()
            value.flags.writeable = False
            setattr(kept, name, value)
    return kept


_BYTES_PER_COUNT = 72
"""Bytes counted per count remembered: its int64 copy in the call and, in the key, its bytes
or, for counts given as a list, a tuple of ints and one of their types."""


def _remembered_bytes(kept: Call, spec: OpSpec) -> int:
    """What remembering ``kept`` (and its key) costs, counted from its counts."""
    remembered = 0
    for name in spec.counted:
        counts = getattr(kept, name)
        if counts is not None:
            remembered += counts.size
    return _BYTES_PER_COUNT * remembered + _ENTRY_OVERHEAD


def _read_call(spec: OpSpec, arguments: dict[str, Any], state: Any, group: Any) -> Call:
    """Every parameter read by its kind's reader (the group is resolved already), then every
    rule of ``spec`` checked."""
    backend = state.backend
    if spec.in_capabilities and spec.name not in backend.capabilities.ops:
        raise NotImplementedError(f"{spec.name}: backend {backend.name!r} does not provide this operator")
    caps, op = backend.capabilities, spec.name
    call = Call(W=group.world_size, group=group, backend=backend, timeout=state.timeout, check=state.check)
    for param in spec.params:
        if param.kind.read is not None:
            setattr(call, param.name, param.kind.read(op, param.name, arguments[param.name], caps, backend.name))
    for rule in spec.rules:
        given = rule.check(call)
        if given is not None:
            raise bad_input(spec.name, rule.param, rule.expected.replace("{W}", str(call.W)), given, rule.error)
    return call
