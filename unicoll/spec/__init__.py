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
from .language import REQUIRED, Call, OpSpec, Param, Rule
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
