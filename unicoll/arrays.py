"""What kind of array a value is: its library, dtype name, device and shape.

Detection goes through array-api-compat, which never imports a library the caller has not
imported, so ``import unicoll`` stays light and numpy-only users never load cupy.
"""

from __future__ import annotations

from typing import Any

import array_api_compat as aac

#: Every dtype unicoll knows, by its canonical name (numpy's spelling, plus torch's bfloat16).
DTYPES: tuple[str, ...] = (
    "float16", "bfloat16", "float32", "float64",
    "int8", "uint8", "int32", "int64", "bool",
)  # fmt: skip

#: The array libraries unicoll accepts.
LIBRARIES: tuple[str, ...] = ("numpy", "torch", "cupy")


_library_by_type: dict[type, str | None] = {}
_dtype_names: dict[Any, str] = {}


def library_of(x: Any) -> str | None:
    """Return ``"numpy"``, ``"torch"`` or ``"cupy"`` for an array of that library, else None.

    The answer is cached per type: the front end asks on every call.
    """
    kind = type(x)
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
        library = None
    _library_by_type[kind] = library
    return library


def dtype_name(x: Any) -> str:
    """Canonical dtype name of a numpy, torch or cupy array, e.g. ``"float32"``, ``"bfloat16"``."""
    dtype = x.dtype
    try:
        return _dtype_names[dtype]
    except KeyError:
        pass
    name = getattr(dtype, "name", None)  # numpy and cupy dtypes have .name; torch dtypes do not
    name = name if isinstance(name, str) else str(dtype).removeprefix("torch.")
    _dtype_names[dtype] = name
    return name


def device_kind(x: Any) -> str:
    """``"cpu"`` or ``"cuda"``: where the array's memory lives."""
    library = library_of(x)
    if library == "numpy":
        return "cpu"
    if library == "cupy":
        return "cuda"
    return x.device.type


def describe(x: Any) -> str:
    """A short description of any value for error messages, e.g. ``"torch float32 (4, 3) on cpu"``."""
    lib = library_of(x)
    if lib is None:
        return f"{type(x).__name__} {x!r}" if isinstance(x, (int, float, str)) else type(x).__name__
    return f"{lib} {dtype_name(x)} {tuple(x.shape)} on {device_kind(x)}"


def is_fillable(x: Any) -> bool:
    """Whether ``x`` can receive data in place: C-contiguous, and writable for numpy."""
    if aac.is_numpy_array(x):
        return bool(x.flags.c_contiguous and x.flags.writeable)
    if aac.is_torch_array(x):
        return bool(x.is_contiguous())
    return bool(x.flags.c_contiguous)
