"""torch.distributed's collectives under the names that the running torch has.

torch 2.13 named the all-gather into one tensor ``all_gather_single`` and the reduce-scatter from
one tensor ``reduce_scatter_single``, and the names they replace (``all_gather_into_tensor``,
``reduce_scatter_tensor``) warn that they are deprecated there; torch 2.11, which the lent GPU
machines run, has only the old names. Both take the same arguments.
"""

from __future__ import annotations

import torch.distributed as dist

#: ``all_gather_single(output_tensor, input_tensor, group=None, async_op=False)``.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

#: ``reduce_scatter_single(output, input, op=ReduceOp.SUM, group=None, async_op=False)``.
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
