"""What kind of array a value is: its library, dtype name, device and shape.

Every library is recognized and read by its description (:mod:`unicoll.libraries`: numpy,
torch and cupy, and the libraries that join through torch, Paddle and JAX), which never
imports a library the caller has not imported, so ``import unicoll`` stays light and
numpy-only users never load cupy.
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

from .libraries import Library, array_type, carried_origin, described, library_of_type
from .libraries.native import TORCH

#: Every dtype unicoll knows, by its canonical name (numpy's spelling, plus torch's bfloat16).
DTYPES: tuple[str, ...] = (
    "float16", "bfloat16", "float32", "float64",
    "int8", "uint8", "int32", "int64", "bool",
)  # fmt: skip


CARRIER = "torch"
"""The library whose tensors carry a joined library's arrays through a call."""


class ArrayKind(NamedTuple):
    """What the front end checks of an array: its library, canonical dtype name and device kind."""

    library: str
    dtype: str
    device: str


_kinds: dict[tuple[type, Any, Any], ArrayKind] = {}

_DYNAMO = "torch._dynamo"


def dynamo_imported() -> bool:
    """Whether ``torch._dynamo`` is imported: whether torch.compile may be tracing this call.

    While Dynamo traces, the answer is a constant (True): :mod:`unicoll.compiled.traced` marks
    this function so, because Dynamo reads ``sys.modules`` by wrapping each of its keys (tracing
    each operator took about a third longer). The public face asks it once per call; the
    functions here, asked of every array, ask :data:`_traced_forms` instead.
    """
    return _DYNAMO in sys.modules


_traced_forms = False
"""Whether :mod:`unicoll.compiled.traced` is loaded (:func:`traced_forms_loaded`). Dynamo traces
the functions here only once it is: the public face loads it before a traced call reads
anything here. Dynamo reads a module global as a constant, where each read of ``sys.modules``
cost it 40 to 90 ms (it wraps every key); an eager call reads it faster than that lookup too."""


def traced_forms_loaded() -> None:
    """From now on, :func:`library_of` and :func:`description_of` answer a tensor that Dynamo
    traces without reading their caches (:func:`_traced`). Called by
    :mod:`unicoll.compiled.traced` as it loads."""
    global _traced_forms
    _traced_forms = True


def place(a: Any) -> Any:
    """An array's device, as the array API names it; None where the array has none to give
    (numpy before 2.0, a tracer of jax.jit): the namespace's default. Read directly, not through
    array-api-compat's ``device()``, whose cached type checks torch.compile would warn about
    while tracing."""
    return getattr(a, "device", None)


def library_of(x: Any) -> str | None:
    """Return ``"numpy"``, ``"torch"`` or ``"cupy"`` for an array of that library, a joined
    library's name (``"paddle"``, ``"jax"``) for one of its arrays, else None.

    The answer is read from the descriptions cached per type (:func:`description_of`'s): the
    front end asks on every call. While torch.compile traces, the cache is not read
    (:func:`_traced`).
    """
    if _traced_forms and _traced(x):
        return TORCH.name
    try:
        description = _description_by_type[type(x)]
    except KeyError:
        description = _learned(type(x))
    return None if description is None else description.name


def _traced(x: Any) -> bool:
    """Whether Dynamo is tracing and ``x`` is a torch tensor: then :func:`library_of` answers
    without its cache, whose contents a traced read would guard on (a later eager call that
    adds a type to it would make the next call compile again)."""
    import torch  # loaded: the traced forms import it (an import statement costs Dynamo nothing)

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
    description = description_of(x)
    if description is None:
        return None
    key = (type(x), x.dtype, description.device_key(x))
    try:
        return _kinds[key]
    except KeyError:
        pass
    kind = ArrayKind(description.name, description.dtype(x), description.device(x))
    _kinds[key] = kind
    return kind


def place_of(x: Any) -> Any:
    """Where an array of a known library lives, precisely enough to tell two devices apart:
    None on the host for numpy, a torch or cupy array's ``device``, a joined library's place."""
    return description_of(x).place(x)


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
    origin = carried_origin(x) if lib == CARRIER else None
    if origin is not None:
        return describe(origin)
    return f"{described(lib).label()} {dtype_name(x)} {tuple(x.shape)} on {device_kind(x)}"


def named_type(x: Any) -> str:
    """What messages call the kind of array ``x`` is: ``"a torch tensor"``, ``"a paddle.Tensor"``
    (for a tensor that carries a Paddle tensor through a call too)."""
    lib = library_of(x)
    origin = carried_origin(x) if lib == CARRIER else None
    return array_type(lib if origin is None else library_of(origin))


def is_fillable(x: Any) -> bool:
    """Whether ``x`` can receive data in place: C-contiguous, and writable for numpy."""
    return description_of(x).fillable(x)


def overlaps(a: Any, b: Any) -> bool:
    """Whether two arrays of one library may share memory (their byte spans intersect).

    >>> x = np.arange(8)
    >>> overlaps(x[:4], x[2:]), overlaps(x[:4], x[4:])
    (True, False)
    """
    return description_of(a).overlaps(a, b)


_description_by_type: dict[type, Library | None] = {}


def description_of(x: Any) -> Library | None:
    """The description of the library of ``x`` (:mod:`unicoll.libraries`), None for a value of
    no known library. Cached per type (the front end asks it, or :func:`library_of`, of every
    array, on every call), and not read while torch.compile traces a tensor."""
    if _traced_forms and _traced(x):
        return TORCH
    try:
        return _description_by_type[type(x)]
    except KeyError:
        return _learned(type(x))


def _learned(kind: type) -> Library | None:
    """The description of the library whose array type ``kind`` is (None for none), now cached."""
    library = library_of_type(kind)
    description = _description_by_type[kind] = None if library is None else described(library)
    return description
