"""Each operator described once: its parameters, its validation rules and its backward.

The language the specs are written in is :mod:`~unicoll.spec.language`; the data operators'
specs are in :mod:`~unicoll.spec.collectives`, unicoll.moe's in :mod:`~unicoll.spec.moe`; this
module holds the tables of them all.

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
from dataclasses import make_dataclass
from typing import Any

from .collectives import (
    ALL_GATHER,
    ALL_REDUCE,
    ALLTOALL,
    ALLTOALL_SINGLE,
    BROADCAST,
    COLLECTIVES,
    EXCHANGE_COUNTS,
    GLOBAL_GATHER,
    GLOBAL_SCATTER,
    REDUCE_SCATTER,
)
from .language import REQUIRED, OpSpec, Param, PreparedCall, Rule
from .moe import (
    IDS_EXPECTED,
    MAX_EXPERTS,
    MAX_STATIC_ROWS,
    MOE,
    MOE_COMBINE,
    MOE_COMBINE_STATIC,
    MOE_DISPATCH,
    MOE_DISPATCH_STATIC,
    MOE_REDISPATCH,
    MOE_REDISPATCH_STATIC,
    ids_out_of_range,
)

__all__ = [
    "ALLTOALL", "ALLTOALL_SINGLE", "ALL_GATHER", "ALL_REDUCE", "BROADCAST", "EXCHANGE_COUNTS", "GLOBAL_GATHER",
    "GLOBAL_SCATTER", "IDS_EXPECTED", "MAX_EXPERTS", "MAX_STATIC_ROWS", "MOE_COMBINE", "MOE_COMBINE_STATIC",
    "MOE_DISPATCH", "MOE_DISPATCH_STATIC", "MOE_MODES", "MOE_REDISPATCH", "MOE_REDISPATCH_STATIC", "OPS",
    "REDUCE_SCATTER", "REQUIRED", "SPECS", "Call", "OpSpec", "Param", "Rule", "ids_out_of_range",
]  # fmt: skip

#: Every entry point with a spec, by name, in the order the docs list them: a data operator joins
#: by its entry in :data:`~unicoll.spec.collectives.COLLECTIVES`, a MoE one in :data:`~unicoll.spec.moe.MOE`.
SPECS: dict[str, OpSpec] = {op.name: op for op in (*COLLECTIVES, *MOE)}

#: The modes of unicoll.moe, each its dispatch, redispatch and combine, for the API page's table of
#: what a mode offers on each backend.
MOE_MODES: dict[str, tuple[OpSpec, OpSpec, OpSpec]] = {
    "dynamic": (MOE_DISPATCH, MOE_REDISPATCH, MOE_COMBINE),
    "static": (MOE_DISPATCH_STATIC, MOE_REDISPATCH_STATIC, MOE_COMBINE_STATIC),
}

#: The data operators, which backends list in their capability tables, by name.
OPS: dict[str, OpSpec] = {name: op for name, op in SPECS.items() if op.in_capabilities}


_COMMON = ("W", "group", "backend", "timeout", "compare", "check")
"""The fields every prepared call has, first (positional)."""

_PARAMETERS = sorted({p.name for op in SPECS.values() for p in op.params} - set(_COMMON))
"""Every other parameter name of the specs: a field of :class:`Call` each."""


def _copy(call: Call) -> Call:
    """A shallow copy: the same values in a new call (the calls the ranks compare, and each
    call the memory of accepted calls serves then, are copies)."""
    return Call(*_FIELDS(call))


Call = make_dataclass(
    "Call",
    [*((name, Any) for name in _COMMON), *((name, Any, None) for name in _PARAMETERS), ("plan", Any, None)],
    bases=(PreparedCall,),
    slots=True,
    eq=False,
    namespace={"copy": _copy},
)
Call.__module__ = __name__
Call.__doc__ = """The prepared arguments of one call, as :func:`unicoll.validate.prepare` returns them.

Every call has the group size ``W``, the resolved ``group``, the running ``backend``, its
``timeout``, whether the ranks ``compare`` their calls before moving data (the handshake or
check mode), whether ``check`` mode is on, and ``plan``: what the spec's :attr:`OpSpec.plan`
derived from the call. Every parameter name of the specs is a field (None where the call's
operator has no such parameter; counts as host int64 arrays), made here from the specs, so a
new parameter name needs nothing written for it. The fields are slots: every call reads them,
and a slot reads faster than an instance dictionary. Calls compare by identity."""

_FIELDS = operator.attrgetter(*Call.__slots__)
"""Every field of a :class:`Call`, in the order its constructor takes them."""
