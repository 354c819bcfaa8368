"""What kind of array a value is: its library, dtype name, device and shape.

Detection goes through array-api-compat, which never imports a library the caller has not
imported, so ``import unicoll`` stays light and numpy-only users never load cupy; the
libraries that join through torch (Paddle, JAX: :mod:`unicoll.libraries`) are recognized by
their descriptions, once the caller has imported them.
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

import array_api_compat as aac
import numpy as np

from .libraries import array_type, carried_origin, joined, library_of_type

#: Every dtype unicoll knows, by its canonical name (numpy's spelling, plus torch's bfloat16).
DTYPES: tuple[str, ...] = (
    "float16", "bfloat16", "float32", "float64",
    "int8", "uint8", "int32", "int64", "bool",
)  # fmt: skip


_library_by_type: dict[type, str | None] = {}


class ArrayKind(NamedTuple):
    """What the front end checks of an array: its library, canonical dtype name and device kind."""

    library: str
    dtype: str
    device: str


_kinds: dict[tuple[type, Any, Any], ArrayKind] = {}


def place(a: Any) -> Any:
    """An array's device, as the array API names it; None where the array has none to give
    (numpy before 2.0, a tracer of jax.jit): the namespace's default. Read directly, not through
    array-api-compat's ``device()``, whose cached type checks torch.compile would warn about
    while tracing."""
    return getattr(a, "device", None)


def library_of(x: Any) -> str | None:
    """Return ``"numpy"``, ``"torch"`` or ``"cupy"`` for an array of that library, a joined
    library's name (``"paddle"``, ``"jax"``) for one of its arrays, else None.

    The answer is cached per type: the front end asks on every call. While torch.compile
    traces, the cache is not read (:func:`_traced`).
    """
    kind = type(x)
    if _DYNAMO in sys.modules and _traced(x):
        return "torch"
    try:
        return _library_by_type[kind]
    except KeyError:
        pass
    if aac.is_numpy_array(x):
        library = "numpy"
    elif aac.is_torch_array(x):
        library = "torch"
    elif aac.is_cupy_array(x):
        library = "cupy"
    else:
        library = library_of_type(kind)
    _library_by_type[kind] = library
    return library


_DYNAMO = "torch._dynamo"


def _traced(x: Any) -> bool:
    """Whether Dynamo is tracing and ``x`` is a torch tensor: then :func:`library_of` answers
    without its cache, whose contents a traced read would guard on (a later eager call that
    adds a type to it would make the next call compile again), and without array-api-compat's
    cached type checks, which Dynamo warns about."""
    torch = sys.modules["torch"]
    return torch.compiler.is_compiling() and isinstance(x, torch.Tensor)


def kind_of(x: Any) -> ArrayKind:
    """The :class:`ArrayKind` of an array of a known library (see :func:`library_of`).

    Cached per (type, dtype, device), so a call on arrays seen before costs a dict lookup.

    >>> kind_of(np.zeros(3, dtype=np.int8))
    ArrayKind(library='numpy', dtype='int8', device='cpu')
    """
    kind = known_kind(x)
    if kind is None:
        raise TypeError(f"kind_of: x: expected an array of a known library, got {type(x).__name__}")
    return kind


def known_kind(x: Any) -> ArrayKind | None:
    """:func:`kind_of` for an array of a known library, None for any other value (the front
    end's signatures ask this of every array argument, on every call)."""
    library = library_of(x)
    if library is None:
        return None
    if library == "torch":
        key = (type(x), x.dtype, x.device)
    elif library in ("numpy", "cupy"):
        key = (type(x), x.dtype, None)  # cupy's Device is unhashable
    else:
        key = (type(x), x.dtype, joined()[library].place(x))
    try:
        return _kinds[key]
    except KeyError:
        pass
    kind = ArrayKind(library, _dtype_name(x, library), _device_kind(x, library))
    _kinds[key] = kind
    return kind


NON_NATIVE = " (non-native byte order)"
"""Appended to the dtype name of a numpy or cupy array whose bytes are not in this machine's
order, so that no check or cache takes it for its native twin."""


def _dtype_name(x: Any, library: str) -> str:
    if library not in ("numpy", "torch", "cupy"):
        return joined()[library].dtype(x)
    dtype = x.dtype
    name = getattr(dtype, "name", None)  # numpy and cupy dtypes have .name; torch dtypes do not
    if not isinstance(name, str):
        return str(dtype).removeprefix("torch.")
    return name if dtype.isnative else name + NON_NATIVE


def _device_kind(x: Any, library: str) -> str:
    if library == "numpy":
        return "cpu"
    if library == "cupy":
        return "cuda"
    if library == "torch":
        return x.device.type
    return joined()[library].device(x)


def place_of(x: Any) -> Any:
    """Where an array of a known library lives, precisely enough to tell two devices apart:
    None on the host for numpy, a torch or cupy array's ``device``, a joined library's place."""
    library = library_of(x)
    if library == "numpy":
        return None
    if library in ("torch", "cupy"):
        return x.device
    return joined()[library].place(x)


def dtype_name(x: Any) -> str:
    """Canonical dtype name of a numpy, torch or cupy array, e.g. ``"float32"``, ``"bfloat16"``."""
    return kind_of(x).dtype


def device_kind(x: Any) -> str:
    """``"cpu"`` or ``"cuda"``: where the array's memory lives."""
    return kind_of(x).device


def describe(x: Any) -> str:
    """A short description of any value for error messages, e.g. ``"torch float32 (4, 3) on cpu"``,
    ``"paddle.Tensor int64 (4,) on cpu"``; a tensor that carries a joined library's array
    through a call is described as that array (:func:`unicoll.libraries.carried_origin`)."""
    lib = library_of(x)
    if lib is None:
        return f"{type(x).__name__} {x!r}" if isinstance(x, (int, float, str)) else type(x).__name__
    origin = carried_origin(x) if lib == "torch" else None
    if origin is not None:
        return describe(origin)
    name = joined()[lib].array_type if lib in joined() else lib
    return f"{name} {dtype_name(x)} {tuple(x.shape)} on {device_kind(x)}"


def named_type(x: Any) -> str:
    """What messages call the kind of array ``x`` is: ``"a torch tensor"``, ``"a paddle.Tensor"``
    (for a tensor that carries a Paddle tensor through a call too)."""
    lib = library_of(x)
    origin = carried_origin(x) if lib == "torch" else None
    return array_type(lib if origin is None else library_of(origin))


def is_fillable(x: Any, library: str | None = None) -> bool:
    """Whether ``x`` can receive data in place: C-contiguous, and writable for numpy.
    ``library``: ``x``'s, where the caller knows it already."""
    library = library or library_of(x)
    if library == "numpy":
        return bool(x.flags.c_contiguous and x.flags.writeable)
    if library == "torch":
        return bool(x.is_contiguous())
    return bool(x.flags.c_contiguous)


def overlaps(a: Any, b: Any) -> bool:
    """Whether two arrays of one library may share memory (their byte spans intersect).

    >>> x = np.arange(8)
    >>> overlaps(x[:4], x[2:]), overlaps(x[:4], x[4:])
    (True, False)
    """
    library = library_of(a)
    if library == "numpy":
        return bool(np.may_share_memory(a, b))
    if library == "torch":
        if a.is_contiguous() and b.is_contiguous():  # the usual case: one span each, no strides to read
            start_a, start_b = a.data_ptr(), b.data_ptr()
            return start_a < start_b + b.nbytes and start_b < start_a + a.nbytes  # an empty span meets none
        starts = (a.data_ptr(), b.data_ptr())
        spans = [_span(t.shape, [s * t.element_size() for s in t.stride()], t.element_size()) for t in (a, b)]
    else:  # cupy: strides in bytes, like numpy
        starts = (a.data.ptr, b.data.ptr)
        spans = [_span(t.shape, t.strides, t.itemsize) for t in (a, b)]
    (low_a, high_a), (low_b, high_b) = ((start + lo, start + hi) for start, (lo, hi) in zip(starts, spans))
    return low_a < high_b and low_b < high_a


def _span(shape: tuple[int, ...], strides: Any, itemsize: int) -> tuple[int, int]:
    """Byte offsets ``[low, high)`` of an array's elements from its first element; empty for no elements."""
    if 0 in shape:
        return 0, 0
    low = sum((n - 1) * s for n, s in zip(shape, strides) if s < 0)
    high = sum((n - 1) * s for n, s in zip(shape, strides) if s > 0)
    return low, high + itemsize
