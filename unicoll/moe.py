"""Top-k token dispatch and combine: the step every MoE layer takes around its experts.

``dispatch`` sends each token to the experts the router picked (``topk_idx``, global ids
``rank * E + e``, ``-1`` to drop a slot) and hands back the rows each local expert receives,
grouped by expert, with a handle; ``combine`` sends the experts' outputs back and sums each
token's slots, weighted by ``topk_weights``. Built on the backends' ``global_scatter`` and
``global_gather``, so every backend and array library runs it; the layout, capacity and the
handle are in docs/semantics.md ("`moe.dispatch` and `moe.combine`").

``dispatch_static``, ``redispatch_static`` and ``combine_static`` are the static-shape mode:
blocks of a fixed capacity per (expert, source rank), the valid counts as an array on x's
device, no value of a device array read to the host, so a step needs no synchronization and
torch.compile (or a CUDA graph) captures it without dynamic shapes; on gloo and mpi only the
valid rows travel (docs/semantics.md, "The static-shape mode"). Inside ``jax.jit`` they run as
host callbacks, and ``jit_errors()`` makes a step that failed in one raise unicoll's own
exception in place of JAX's ``JaxRuntimeError``.

>>> import unicoll as uc
>>> rows, rows_per_expert, handle = uc.moe.dispatch(x, topk_idx, topk_weights, experts_per_rank=2)  # doctest: +SKIP
>>> outputs = [expert(part) for expert, part in zip(experts, split(rows, rows_per_expert))]       # doctest: +SKIP
>>> y = uc.moe.combine(concat(outputs), handle)                                                   # doctest: +SKIP
"""

from __future__ import annotations

from .face import moe_combine as combine
from .face import moe_combine_static as combine_static
from .face import moe_dispatch as dispatch
from .face import moe_dispatch_static as dispatch_static
from .face import moe_redispatch as redispatch
from .face import moe_redispatch_static as redispatch_static
from .libraries.jax import jit_errors
from .routing import Handle
from .static_layout import StaticHandle

__all__ = [
    "Handle",
    "StaticHandle",
    "combine",
    "combine_static",
    "dispatch",
    "dispatch_static",
    "jit_errors",
    "redispatch",
    "redispatch_static",
]
