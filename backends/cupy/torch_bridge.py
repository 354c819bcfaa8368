"""CUDA torch tensors on ``cupy-nccl``, crossed without the DLPack protocol's per-call costs.

``cupy.from_dlpack`` and ``torch.from_dlpack`` each set the device twice, build a capsule and
run the producer's stream handshake in Python: together about 100 µs per call on an H100
against 10 µs for the whole front end of ``torch-nccl``. Here a contiguous tensor is viewed as
a cupy array over the same memory (the tensor kept alive as the memory's owner), and an array
that views a whole tensor goes back as that tensor, detached. The order DLPack would establish
is kept by hand: where torch's current stream is not cupy's, the stream that reads waits for
the one that wrote on an event. Arrays over memory that cupy owns still go back through
``torch.from_dlpack``.

torch is imported by the caller that holds tensors, never here at import time.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import cupy
import numpy as np


@functools.cache
def _dtypes() -> dict[Any, np.dtype]:
    """numpy's dtype of each torch dtype cupy has (bfloat16 has none: it takes DLPack's path)."""
    import torch

    names = (
        "float16",
        "float32",
        "float64",
        "int8",
        "uint8",
        "int16",
        "int32",
        "int64",
        "bool",
        "complex64",
        "complex128",
    )
    return {getattr(torch, name): np.dtype(name) for name in names}


@functools.cache
def _torch_dtypes() -> dict[np.dtype, Any]:
    """torch's dtype of each numpy dtype in :func:`_dtypes`."""
    return {numpy_dtype: torch_dtype for torch_dtype, numpy_dtype in _dtypes().items()}


def _torch_stream(device_index: int) -> int:
    """The handle of torch's current stream on ``device_index``, as cupy numbers streams (the
    legacy default stream is 0 in both)."""
    return _raw_stream()(device_index)


@functools.cache
def _raw_stream() -> Callable[[int], int]:
    """torch's reader of the current stream's handle: the one its compiled kernels use
    (``torch._C._cuda_getCurrentRawStream``, a C call), else ``torch.cuda.current_stream``'s,
    which builds a Stream object each call."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw if raw is not None else lambda index: torch.cuda.current_stream(index).cuda_stream


def _wait(consumer: int, producer: int) -> None:
    """Make stream ``consumer`` wait for the work queued so far on stream ``producer``."""
    done = cupy.cuda.Event(block=False, disable_timing=True)
    done.record(cupy.cuda.ExternalStream(producer))
    cupy.cuda.ExternalStream(consumer).wait_event(done)


def _view(tensor: Any, dtype: np.dtype, device_index: int) -> cupy.ndarray:
    """A cupy array of ``dtype`` over a contiguous CUDA tensor's memory, which keeps the tensor alive."""
    memory = cupy.cuda.UnownedMemory(tensor.data_ptr(), tensor.nbytes, tensor, device_index)
    return cupy.ndarray(tuple(tensor.shape), dtype, cupy.cuda.MemoryPointer(memory, 0))


def as_cupy(tensor: Any) -> cupy.ndarray:
    """A cupy array over a CUDA tensor's memory (a contiguous copy first where it is not),
    ordered after the work torch's current stream has queued, as DLPack's handshake orders it."""
    contiguous = tensor.detach().contiguous()
    dtype = _dtypes().get(contiguous.dtype)
    if dtype is None:
        return cupy.from_dlpack(contiguous)
    index = contiguous.get_device()
    ours, theirs = cupy.cuda.get_current_stream().ptr, _torch_stream(index)
    if ours != theirs:
        _wait(ours, theirs)
    return _view(contiguous, dtype, index)


def as_torch(a: cupy.ndarray) -> Any:
    """The torch tensor of a cupy array: the tensor ``a`` views whole (:func:`as_cupy`,
    :func:`empty_like`), detached; else through DLPack. torch's current stream waits for cupy's
    where they differ."""
    import torch

    memory = a.data.mem
    owner = getattr(memory, "_owner", None)
    if not (
        isinstance(owner, torch.Tensor)
        and a.data.ptr == owner.data_ptr()
        and a.shape == tuple(owner.shape)
        and a.dtype == _dtypes().get(owner.dtype)
        and a.flags.c_contiguous
    ):
        return torch.from_dlpack(a)
    ours, theirs = cupy.cuda.get_current_stream().ptr, _torch_stream(owner.get_device())
    if ours != theirs:
        _wait(theirs, ours)
    return owner.detach()


def empty_like(like: cupy.ndarray, rows: int) -> cupy.ndarray | None:
    """``rows`` uninitialized rows like ``like``'s, allocated by torch where ``like`` views a
    torch tensor and both libraries queue on the same stream (the result then goes back to the
    caller as that tensor, :func:`as_torch`); None otherwise, for cupy to allocate."""
    owner = getattr(like.data.mem, "_owner", None)
    if owner is None or type(owner).__module__ != "torch" or like.dtype not in _torch_dtypes():
        return None
    index = owner.get_device()
    if cupy.cuda.get_current_stream().ptr != _torch_stream(index):
        return None  # torch's allocator would hand the memory to its own stream's work
    import torch

    made = torch.empty((rows, *like.shape[1:]), dtype=_torch_dtypes()[like.dtype], device=owner.device)
    return _view(made, like.dtype, index)
