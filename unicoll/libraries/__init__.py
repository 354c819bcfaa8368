"""The array libraries unicoll takes, each described once: numpy, torch and cupy, whose arrays
the transports move (:mod:`unicoll.libraries.native`), and the libraries that join beside them
through torch tensors: Paddle and JAX, and any other that tells the same few things.

Every library is a :class:`Library` (how its arrays are recognized and named, their dtype,
device and place), found by name with :func:`described`. Another library joins by describing
its arrays once, as an :class:`ArrayLibrary`: how to recognize them, their dtype
and device, how to read one as a torch tensor over the same memory (DLPack in) and how to
hand a torch tensor back as its own type (DLPack out), whether its arrays can be filled in
place, and how to attach a backward to its autograd. From there the capability tables
(:func:`carried_by`), the validation messages, the conformance matrix and the API page take
it up, and every operator takes and returns its arrays (:mod:`unicoll.carry`).

A library is recognized only once its module is imported by the caller: ``import unicoll``
imports none of them.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .description import ArrayLibrary, Library
from .native import NATIVE, NON_NATIVE

__all__ = [
    "NATIVE",
    "NON_NATIVE",
    "ArrayLibrary",
    "Library",
    "array_type",
    "array_types",
    "carried_by",
    "carried_origin",
    "carrying",
    "described",
    "join",
    "joined",
    "modules",
]


_JOINED: dict[str, ArrayLibrary] = {}

_MODULES: list[str] = ["paddle", "jax"]
"""The modules of the joined libraries (Paddle's and JAX's, known before their descriptions load)."""


def join(library: ArrayLibrary) -> None:
    """Make ``library``'s arrays acceptable wherever torch tensors are (the registry of
    :func:`joined`); the built-in ones are Paddle's and JAX's."""
    _JOINED[library.name] = library
    if library.module not in _MODULES:
        _MODULES.append(library.module)


def modules() -> list[str]:
    """The top-level modules of the joined libraries: a call's arrays can be one of theirs only
    once one of these is imported. The list itself, which :func:`join` extends."""
    return _MODULES


def joined() -> dict[str, ArrayLibrary]:
    """Every library that joined, by name (Paddle's and JAX's descriptions are loaded here, on
    first use, without importing Paddle or JAX)."""
    if not _JOINED:
        from . import jax, paddle

        join(paddle.PADDLE)
        join(jax.JAX)
    return _JOINED


def library_of_type(kind: type) -> str | None:
    """The name of the library whose array type ``kind`` is (numpy, torch and cupy first, then
    the joined ones), or None; a library whose module is not imported has no arrays yet and is
    not asked."""
    for library in (*NATIVE.values(), *joined().values()):
        if library.module in sys.modules and library.is_array(kind):
            return library.name
    return None


def described(name: str) -> Library:
    """The description of the library ``name`` (one :func:`library_of_type` answered)."""
    native = NATIVE.get(name)
    return native if native is not None else joined()[name]


def carried_by(libraries: frozenset[str]) -> frozenset[str]:
    """``libraries`` (a transport's) and every joined library, which travels as torch tensors
    where torch does: the libraries of a backend's capability table."""
    return libraries | frozenset(joined()) if "torch" in libraries else libraries


def array_types(libraries: frozenset[str]) -> str:
    """How messages name the arrays of ``libraries``: ``"a numpy array, a torch tensor or a
    paddle.Tensor"`` (unicoll's own libraries first, then the joined ones)."""
    order = [*NATIVE, *sorted(libraries - NATIVE.keys())]
    names = [array_type(library) for library in order if library in libraries]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def array_type(library: str | None) -> str:
    """How messages name an array of ``library``: ``"a paddle.Tensor"``, ``"a torch tensor"``."""
    if library in NATIVE or library in joined():
        return f"a {described(library).array_type}"
    return "an array"


_carrying = threading.local()


@contextmanager
def carrying(origins: dict[int, Any]) -> Iterator[None]:
    """While a call runs on torch tensors that carry a joined library's arrays: ``origins``
    maps each carrier's ``id`` to the caller's array, so messages name what the caller passed
    (:func:`carried_origin`). The caller keeps the carriers alive meanwhile."""
    outer = getattr(_carrying, "origins", None)
    _carrying.origins = origins
    try:
        yield
    finally:
        _carrying.origins = outer


def carried_origin(tensor: Any) -> Any | None:
    """The caller's array that ``tensor`` carries through the running call, or None."""
    origins = getattr(_carrying, "origins", None)
    return None if origins is None else origins.get(id(tensor))
