"""numpy, torch and cupy described (:class:`NativeLibrary`): the libraries whose arrays the
transports move, told apart, named, read, compared, copied, moved and summed by their descriptions here, as Paddle's
and JAX's are by theirs. None of them is imported here: a description reads its library from
``sys.modules``, which holds it once the caller has one of its arrays."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .description import Library

NON_NATIVE = " (non-native byte order)"
"""Appended to the dtype name of a numpy or cupy array whose bytes are not in this machine's
order, so that no check or cache takes it for its native twin."""


@dataclass(frozen=True, eq=False, kw_only=True)
class NativeLibrary(Library):
    """One library whose arrays the transports move (numpy, torch, cupy): beside what every
    :class:`~unicoll.libraries.description.Library` tells, what the front end reads of an
    array on every call."""

    cache_key: Callable[[Any], Any]
    """The part of an array's kind (beside its type and dtype) that tells its device apart, hashable."""
    fillable: Callable[[Any], bool]
    """Whether an array can receive data in place (C-contiguous, and writable where the library says)."""
    signature: Callable[[Any], tuple]
    """What the memory of accepted calls keys an array on beside its library: its dtype (byte
    order included), device and shape, all that a check of an input array reads (hashable)."""
    host_bytes: Callable[[Any], bytes | None]
    """A counts array's bytes where the host holds them: what the memory keys counts on. None
    for an array on a device (reading it would wait for the device) and for torch's floats
    (bfloat16 has no numpy twin); the reader refuses floats, so no call with them is kept."""
    overlaps: Callable[[Any, Any], bool]
    """Whether two of its arrays may share memory (their byte spans intersect)."""
    copy: Callable[[Any], Any]
    """A copy of an array, of its own memory."""
    to_host: Callable[[Any], np.ndarray]
    """An array as a numpy array on the host (copied off a device, which waits for the work
    queued before it; detached from autograd)."""
    from_host: Callable[[np.ndarray, Any, Any], Any]
    """``from_host(a, place, dtype)``: the numpy array ``a`` as this library's array at
    ``place`` (a :attr:`place` of one of its arrays), of ``dtype`` (the library's kind of
    dtype; None keeps ``a``'s), sharing ``a``'s memory where no copy is needed."""
    from_dlpack: Callable[[Any, Any], Any]
    """``from_dlpack(a, place)``: a device array of another library as this library's, over the
    same memory, at ``place``."""
    take_rows: Callable[[Any, Any], Any]
    """``take_rows(a, index)``: the rows of ``a`` at ``index`` (an int array of the library on
    a's device), recorded by the library's autograd where it has one."""
    astype: Callable[[Any, Any], Any]
    """``astype(a, dtype)``: ``a`` as ``dtype`` (a new array), recorded by the autograd."""
    matmul: Callable[[Any, Any], Any]
    """``matmul(a, b)``: the batched product ``a @ b`` in the promoted dtype of the two."""
    accumulate: Callable[[Any, Any, Any, bool], None]
    """``accumulate(out, rows, column, first)``: ``out = rows * column`` (``first``) or
    ``out += rows * column``, in place, in out's dtype; ``column`` None is 1, and ``rows`` may
    be overwritten."""
    row_words: Callable[[Any], Any]
    """``row_words(a)``: the rows of a C-contiguous array (along its first axis) as a 2-D array
    of signed integer words over the same memory: int64 where a row's bytes allow, else the
    widest of int32, int16, int8 that divides them (the bits as they are, NaN payloads included)."""

    def device_key(self, x: Any) -> Any:
        """The array's :attr:`cache_key` (a cupy ``Device`` is unhashable: its place cannot be one)."""
        return self.cache_key(x)


def _numpy_dtype(x: Any) -> str:
    """A numpy or cupy array's dtype name, marked where its bytes are not in this machine's order."""
    dtype = x.dtype
    return dtype.name if dtype.isnative else dtype.name + NON_NATIVE


def _span(shape: tuple[int, ...], strides: Any, itemsize: int) -> tuple[int, int]:
    """Byte offsets ``[low, high)`` of an array's elements from its first element; empty for no elements."""
    if 0 in shape:
        return 0, 0
    low = sum((n - 1) * s for n, s in zip(shape, strides) if s < 0)
    high = sum((n - 1) * s for n, s in zip(shape, strides) if s > 0)
    return low, high + itemsize


def _spans_meet(start_a: int, span_a: tuple[int, int], start_b: int, span_b: tuple[int, int]) -> bool:
    """Whether two byte spans, each ``[low, high)`` from its start, intersect."""
    return start_a + span_a[0] < start_b + span_b[1] and start_b + span_b[0] < start_a + span_a[1]


def _torch_overlaps(a: Any, b: Any) -> bool:
    """Whether two torch tensors' bytes meet."""
    if a.is_contiguous() and b.is_contiguous():  # the usual case: one span each, no strides to read
        start_a, start_b = a.data_ptr(), b.data_ptr()
        return start_a < start_b + b.nbytes and start_b < start_a + a.nbytes  # an empty span meets none
    spans = [_span(t.shape, [s * t.element_size() for s in t.stride()], t.element_size()) for t in (a, b)]
    return _spans_meet(a.data_ptr(), spans[0], b.data_ptr(), spans[1])


def _cupy_overlaps(a: Any, b: Any) -> bool:
    """Whether two cupy arrays' bytes meet (strides in bytes, as numpy's)."""
    spans = [_span(t.shape, t.strides, t.itemsize) for t in (a, b)]
    return _spans_meet(a.data.ptr, spans[0], b.data.ptr, spans[1])


def _torch_to_host(x: Any) -> np.ndarray:
    """A torch tensor on the host, as numpy (copied off a CUDA device)."""
    return x.detach().cpu().numpy() if x.device.type != "cpu" else x.detach().numpy()


def _torch_from_host(a: np.ndarray, place: Any, dtype: Any) -> Any:
    """A numpy array as a torch tensor on the device ``place``, of ``dtype`` (None: a's)."""
    return sys.modules["torch"].from_numpy(a).to(device=place, dtype=dtype)


def _cupy_from_host(a: np.ndarray, place: Any, dtype: Any) -> Any:
    """A numpy array as a cupy array on the device ``place``, of ``dtype`` (None: a's)."""
    with place:
        return sys.modules["cupy"].asarray(a, dtype=dtype)


def _cupy_from_dlpack(a: Any, place: Any) -> Any:
    """A device array of another library as a cupy array, on the device ``place``."""
    with place:
        return sys.modules["cupy"].from_dlpack(a)


def _torch_host_bytes(x: Any) -> bytes | None:
    """A host integer tensor's bytes; None for one on a device or of floats (bfloat16 has no numpy twin)."""
    return x.numpy().tobytes() if x.device.type == "cpu" and not x.dtype.is_floating_point else None


def _torch_needs_grad(x: Any) -> bool:
    """Whether torch records a gradient for a result computed from the tensor now."""
    if not x.requires_grad:
        return False
    import torch  # loaded: x is a tensor (an import costs torch.compile nothing, sys.modules does)

    return torch.is_grad_enabled()


def _torch_mark_written(x: Any) -> None:
    """Move the tensor's version counter, as torch's own in-place operators do."""
    sys.modules["torch"].autograd.graph.increment_version(x)


def _torch_matmul(a: Any, b: Any) -> Any:
    """Batched ``a @ b`` in the promoted dtype (torch's bmm does not promote by itself)."""
    import torch  # loaded: a is a tensor (an import costs torch.compile nothing, sys.modules does)

    common = torch.promote_types(a.dtype, b.dtype)
    return torch.bmm(a.to(common), b.to(common))


def _torch_accumulate(out: Any, rows: Any, column: Any, first: bool) -> None:
    """:attr:`NativeLibrary.accumulate` by torch's operators with ``out=`` and in place."""
    if first:
        sys.modules["torch"].mul(rows, column, out=out)
    elif column is None:
        out.add_(rows)
    else:
        out.addcmul_(rows, column)


def _ufunc_accumulate(module: str) -> Callable[[Any, Any, Any, bool], None]:
    """:attr:`NativeLibrary.accumulate` by the ufuncs of ``module`` (numpy's, cupy's)."""

    def accumulate(out: Any, rows: Any, column: Any, first: bool) -> None:
        ufuncs = sys.modules[module]
        if first:
            ufuncs.multiply(rows, column, out=out)
            return
        if column is not None:
            if rows.dtype == out.dtype:
                ufuncs.multiply(rows, column, out=rows)
            else:
                rows = rows * column
        ufuncs.add(out, rows, out=out)

    return accumulate


def _word_bytes(row_bytes: int) -> int:
    """The widest word, up to 8 bytes, that divides a row of ``row_bytes`` bytes (1 for none)."""
    return next(word for word in (8, 4, 2, 1) if row_bytes % word == 0)


def _ndarray_row_words(a: Any) -> Any:
    """:attr:`NativeLibrary.row_words` of a numpy or cupy array."""
    rows, per_row = (a.shape[0], math.prod(a.shape[1:])) if a.ndim else (1, 1)
    word = _word_bytes(a.itemsize * per_row)
    return a.reshape(rows, per_row).view(np.uint8).view(np.dtype(f"int{8 * word}"))


def _torch_row_words(a: Any) -> Any:
    """:attr:`NativeLibrary.row_words` of a torch tensor."""
    torch = sys.modules["torch"]
    rows, per_row = (a.shape[0], math.prod(a.shape[1:])) if a.dim() else (1, 1)
    if a.numel() == 0:  # no bytes to view (torch refuses a view of empty rows with other strides)
        return torch.zeros((rows, 0), dtype=torch.int64, device=a.device)
    words = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[_word_bytes(a.element_size() * per_row)]
    return a.detach().reshape(rows, per_row).view(torch.uint8).view(words)


def _is_instance_of(module: str, attribute: str) -> Callable[[type], bool]:
    """Whether a type is ``module.attribute`` or a subclass, once ``module`` is imported."""

    def is_array(kind: type) -> bool:
        found = sys.modules.get(module)
        return found is not None and issubclass(kind, getattr(found, attribute))

    return is_array


NUMPY = NativeLibrary(
    name="numpy",
    array_type="numpy array",
    module="numpy",
    is_array=lambda kind: issubclass(kind, (np.ndarray, np.generic)),
    dtype=_numpy_dtype,
    device=lambda x: "cpu",
    place=lambda x: None,
    cache_key=lambda x: None,
    fillable=lambda x: bool(x.flags.c_contiguous and x.flags.writeable),
    signature=lambda x: (x.dtype, x.shape),
    host_bytes=lambda x: x.tobytes(),
    overlaps=lambda a, b: bool(np.may_share_memory(a, b)),
    copy=lambda x: x.copy(),
    to_host=lambda x: x,
    from_host=lambda a, place, dtype: a if dtype is None else a.astype(dtype, copy=False),
    from_dlpack=lambda a, place: np.from_dlpack(a),
    take_rows=lambda a, index: a.take(index, axis=0),
    astype=lambda a, dtype: a.astype(dtype),
    matmul=lambda a, b: a @ b,
    accumulate=_ufunc_accumulate("numpy"),
    row_words=_ndarray_row_words,
)
"""numpy's ``ndarray`` (and its scalars), on the host."""

TORCH = NativeLibrary(
    name="torch",
    array_type="torch tensor",
    module="torch",
    is_array=_is_instance_of("torch", "Tensor"),
    dtype=lambda x: str(x.dtype).removeprefix("torch."),
    device=lambda x: x.device.type,
    place=lambda x: x.device,
    cache_key=lambda x: x.device,
    fillable=lambda x: x.is_contiguous(),
    signature=lambda x: (x.dtype, x.device, x.shape),
    host_bytes=_torch_host_bytes,
    overlaps=_torch_overlaps,
    copy=lambda x: x.clone(),
    to_host=_torch_to_host,
    from_host=_torch_from_host,
    from_dlpack=lambda a, place: sys.modules["torch"].from_dlpack(a),
    take_rows=lambda a, index: a.index_select(0, index),
    astype=lambda a, dtype: a.to(dtype),
    matmul=_torch_matmul,
    accumulate=_torch_accumulate,
    row_words=_torch_row_words,
    autograd=True,
    needs_grad=_torch_needs_grad,
    is_leaf=lambda x: x.is_leaf,
    mark_written=_torch_mark_written,
)
"""torch's ``Tensor``, on the CPU or a CUDA device."""

CUPY = NativeLibrary(
    name="cupy",
    array_type="cupy array",
    module="cupy",
    is_array=_is_instance_of("cupy", "ndarray"),
    dtype=_numpy_dtype,
    device=lambda x: "cuda",
    place=lambda x: x.device,
    cache_key=lambda x: None,  # cupy's Device is unhashable; the dtype and type tell the kind
    fillable=lambda x: bool(x.flags.c_contiguous),
    signature=lambda x: (x.dtype, x.shape),  # its Device does not hash; the check reads the kind "cuda"
    host_bytes=lambda x: None,
    overlaps=_cupy_overlaps,
    copy=lambda x: x.copy(),
    to_host=lambda x: x.get(),
    from_host=_cupy_from_host,
    from_dlpack=_cupy_from_dlpack,
    take_rows=lambda a, index: a.take(index, axis=0),
    astype=lambda a, dtype: a.astype(dtype),
    matmul=lambda a, b: a @ b,
    accumulate=_ufunc_accumulate("cupy"),
    row_words=_ndarray_row_words,
)
"""cupy's ``ndarray``, on a CUDA device."""

NATIVE: dict[str, NativeLibrary] = {library.name: library for library in (NUMPY, TORCH, CUPY)}
"""The libraries the transports move, by name, in the order they are looked for."""
