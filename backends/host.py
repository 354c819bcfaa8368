"""Rows in host memory for the CPU transports (gloo, mpi): numpy arrays and torch CPU tensors.

New rows are made by numpy, also for a torch caller (handed over by ``torch.from_numpy``,
zero-copy): numpy asks the kernel for huge pages for large arrays, so 64 MiB of new rows fault
in several times faster than a tensor of torch's allocator (4 ms against 24 ms here,
docs/performance.md); large ones come from the backend's :class:`~unicoll.workspace.Workspace`,
whose memory faults in once, not every step. :func:`rows_over` lays rows over a buffer it lends.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from unicoll.workspace import FROM_BYTES, Workspace

_HOST_DTYPES: dict[Any, np.dtype] = {}
"""The numpy dtype of each torch dtype's :func:`host_view` (a dozen at most)."""


def host_view(a: Any) -> np.ndarray:
    """A numpy array over ``a``'s memory (a contiguous numpy array or torch CPU tensor;
    bfloat16, which numpy lacks, as 16-bit words)."""
    if isinstance(a, np.ndarray):
        return a
    import torch

    return (a.view(torch.int16) if a.dtype == torch.bfloat16 else a).numpy()


def host_dtype(like: Any) -> np.dtype:
    """The numpy dtype of :func:`host_view` of ``like``'s dtype."""
    if isinstance(like, np.ndarray):
        return like.dtype
    dtype = _HOST_DTYPES.get(like.dtype)
    if dtype is None:
        import torch

        dtype = _HOST_DTYPES[like.dtype] = host_view(torch.empty(0, dtype=like.dtype)).dtype
    return dtype


def host_rows(like: Any, rows: int, workspace: Workspace | None = None) -> np.ndarray:
    """An uninitialized numpy array of ``rows`` rows like ``like``'s (a numpy array or torch CPU
    tensor, whose rows it holds as :func:`host_view` would): 0.15 us, where a tensor's
    ``new_empty`` takes 1 us and its numpy view 0.6 us more. From
    :data:`~unicoll.workspace.FROM_BYTES` up, memory that ``workspace`` lends until the rows
    are garbage, where one is given (:meth:`~unicoll.workspace.Workspace.lend_until_freed`);
    fewer bytes are counted there as a loan all the same."""
    dtype = host_dtype(like)
    shape = (rows, *like.shape[1:])
    if workspace is None:
        return np.empty(shape, dtype=dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < FROM_BYTES:
        workspace.count_fresh(nbytes)
        return np.empty(shape, dtype=dtype)
    return workspace.lend_until_freed(nbytes).view(dtype).reshape(shape)


def rows_as(rows: np.ndarray, like: Any) -> Any:
    """Host ``rows`` (as :func:`host_rows` makes them) as an array of ``like``'s kind, sharing memory."""
    if isinstance(like, np.ndarray):
        return rows
    import torch

    tensor = torch.from_numpy(rows)
    return tensor if tensor.dtype == like.dtype else tensor.view(like.dtype)


def rows_over(buffer: np.ndarray, like: Any, rows: int) -> Any:
    """``rows`` rows like ``like``'s (dtype, trailing shape, kind) over the start of ``buffer``,
    a 1-D ``uint8`` array of at least their bytes."""
    dtype = host_dtype(like)
    shape = (rows, *like.shape[1:])
    view = buffer[: math.prod(shape) * dtype.itemsize].view(dtype).reshape(shape)
    return rows_as(view, like)


def row_bytes(a: Any) -> int:
    """The bytes of one row of ``a`` (a numpy array or torch tensor)."""
    return a.itemsize * math.prod(a.shape[1:])
