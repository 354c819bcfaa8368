"""The eager operators under the one-thread lock, as the compile floor calls them: from a custom
op's implementation when the compiled code runs, or behind one graph break where a call is not
traced. Never the public face (:mod:`unicoll.face`), which would ask torch.compile again."""

from __future__ import annotations

from ..eager import moe, ops, static_moe
from ..entry import exclusive_as

exchange_counts = exclusive_as("exchange_counts")(ops.exchange_counts)
global_scatter = exclusive_as("global_scatter")(ops.global_scatter)
global_gather = exclusive_as("global_gather")(ops.global_gather)
alltoall_single = exclusive_as("alltoall_single")(ops.alltoall_single)
alltoall_single_and_splits = exclusive_as("alltoall_single")(ops.alltoall_single_and_splits)
all_gather = exclusive_as("all_gather")(ops.all_gather)
all_gather_and_rows = exclusive_as("all_gather")(ops.all_gather_and_rows)
all_reduce = exclusive_as("all_reduce")(ops.all_reduce)
all_reduce_copy = exclusive_as("all_reduce")(ops.all_reduce_copy)
reduce_scatter = exclusive_as("reduce_scatter")(ops.reduce_scatter)
reduce_scatter_of = exclusive_as("reduce_scatter")(ops.reduce_scatter_of)
broadcast = exclusive_as("broadcast")(ops.broadcast)
broadcast_copy = exclusive_as("broadcast")(ops.broadcast_copy)
moe_dispatch = exclusive_as("moe.dispatch")(moe.dispatch)
moe_layout = exclusive_as("moe.dispatch")(moe.layout)
moe_redispatch = exclusive_as("moe.redispatch")(moe.redispatch)
moe_combine = exclusive_as("moe.combine")(moe.combine)
moe_dispatch_static = exclusive_as("moe.dispatch_static")(static_moe.dispatch_static)
moe_redispatch_static = exclusive_as("moe.redispatch_static")(static_moe.redispatch_static)
moe_combine_static = exclusive_as("moe.combine_static")(static_moe.combine_static)
