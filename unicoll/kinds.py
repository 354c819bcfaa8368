"""The kinds of parameter an operator takes, each one object: how the front end reads it, how
it remembers it, and how the API page documents it.

A :class:`Kind` holds

- ``read``: the reader, which checks a value and returns it as the call carries it (counts
  become host int64 arrays); it raises naming the operator and the parameter;
- ``sign``: the signature of a value for the memory of accepted calls
  (:mod:`unicoll.validate`);
- ``passed_through``: whether the call carries the caller's value itself (arrays), which the
  memory therefore never keeps;
- ``holds_counts``: whether the read value is a counts array, which the memory copies;
- ``fills``, ``in_place``: whether the operator writes into the value, and whether that value
  is also an input (:mod:`unicoll.carry` carries such arrays of a joined library);
- ``doc``: what the API page says is checked.

A call whose arguments have the signatures of a call accepted before is accepted again
without reading them: every reader and rule depends only on what a signature holds (library,
dtype, device, shape and fillability of arrays; the type, shape and values of counts; the
type and value of flags). A signature of None marks a value that is not remembered (a list
of outputs, counts on a GPU, anything unexpected): the call is then read in full.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .arrays import describe, description_of, device_kind, is_fillable, kind_of, library_of, named_type
from .backends.base import REDUCE_OPS
from .counts import as_counts, expert_ids, on_host
from .errors import bad_input
from .libraries import NON_NATIVE, array_types
from .libraries.native import NativeLibrary
from .routing import Handle
from .static_layout import StaticHandle

if TYPE_CHECKING:
    from .backends.base import Capabilities

    #: ``read(op, param, value, capabilities, backend_name)``: the value as the call carries it.
    Reader = Callable[[str, str, Any, Capabilities, str], Any]


@dataclass(frozen=True, eq=False)
class Kind:
    """One kind of parameter (see the module's docstring).

    The group is the one kind without a reader or a signature: :func:`unicoll.validate.prepare`
    resolves it before anything else, and the memory's key holds the resolved group.
    """

    doc: str
    read: Reader | None
    sign: Callable[[Any], Any] | None
    passed_through: bool = False
    holds_counts: bool = False
    fills: bool = False
    """Whether the operator writes into the value (an output to fill, or an array changed in place)."""
    in_place: bool = False
    """Whether the value is an input the operator changes in place (for an immutable library's
    array, the operator hands back a new one instead)."""
    schema: str | None = None
    """The type a traced call's custom op takes a value of this kind as (``torch.library``
    schema syntax; the group as its number); None for a kind no custom op takes: an output
    filled in place (a traced call returns new tensors), or one of unicoll.moe's."""


# -- readers -----------------------------------------------------------------------------------


def _read_array(op: str, param: str, x: Any, caps: Capabilities, backend: str) -> Any:
    if library_of(x) not in caps.libraries:
        raise bad_input(op, param, f"{array_types(caps.libraries)} (backend {backend!r})", describe(x), TypeError)
    if x.ndim < 1:
        raise bad_input(op, param, "an array with at least one dimension (rows are dimension 0)", describe(x))
    kind = kind_of(x)
    if kind.dtype.endswith(NON_NATIVE):
        expected = "an array in native byte order (convert it with x.astype(x.dtype.newbyteorder('=')))"
        raise bad_input(op, param, expected, describe(x), TypeError)
    if kind.dtype not in caps.dtypes:
        raise bad_input(op, param, f"one of the dtypes {', '.join(sorted(caps.dtypes))}", describe(x), TypeError)
    if kind.device not in caps.devices:
        raise bad_input(
            op, param, f"an array on {' or '.join(sorted(caps.devices))} (backend {backend!r})", describe(x)
        )
    return x


def _read_output(op: str, param: str, x: Any, caps: Capabilities, backend: str) -> Any:
    _read_array(op, param, x, caps, backend)
    if not is_fillable(x):
        raise bad_input(op, param, "a C-contiguous, writable array to fill in place", f"{describe(x)} that is not")
    return x


def _read_optional_output(op: str, param: str, value: Any, caps: Capabilities, backend: str) -> Any:
    return None if value is None else _read_output(op, param, value, caps, backend)


def _read_gather_output(op: str, param: str, value: Any, caps: Capabilities, backend: str) -> Any:
    if isinstance(value, list):
        return [_read_output(op, f"{param}[{i}]", v, caps, backend) for i, v in enumerate(value)]
    return _read_optional_output(op, param, value, caps, backend)


def _read_counts(op: str, param: str, value: Any, caps: Capabilities, backend: str) -> Any:
    return as_counts(value, op, param)


def _read_optional_counts(op: str, param: str, value: Any, caps: Capabilities, backend: str) -> Any:
    return None if value is None else as_counts(value, op, param)


def _read_optional_array(op: str, param: str, value: Any, caps: Capabilities, backend: str) -> Any:
    return None if value is None else _read_array(op, param, value, caps, backend)


def _read_expert_ids(op: str, param: str, value: Any, caps: Capabilities, backend: str) -> Any:
    ids = expert_ids(value, op, param)
    if device_kind(ids) == "cuda" and "cuda" not in caps.devices:  # a host backend routes them on the host:
        return np.asarray(on_host(ids), dtype=np.int64)  # read once, here, for its rule and its routing
    return ids


def _read_router_ids(op: str, param: str, value: Any, caps: Capabilities, backend: str) -> Any:
    if library_of(value) not in caps.libraries:
        raise bad_input(op, param, "an integer array (int32 or int64) of x's library", describe(value), TypeError)
    if kind_of(value).dtype not in ("int32", "int64"):
        raise bad_input(op, param, f"{named_type(value)} of dtype int32 or int64", describe(value), TypeError)
    if value.ndim != 2 or value.shape[1] < 1:
        raise bad_input(op, param, "a 2-D array (tokens, k) with k >= 1", describe(value))
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _read_positive_int(op: str, param: str, value: Any, caps: Capabilities, backend: str) -> Any:
    if not _is_int(value):
        raise bad_input(op, param, "an int", describe(value), TypeError)
    if value < 1:
        raise bad_input(op, param, "an int of at least 1", int(value))
    return int(value)


def _read_optional_size(op: str, param: str, value: Any, caps: Capabilities, backend: str) -> Any:
    if value is None:
        return None
    if not _is_int(value):
        raise bad_input(op, param, "an int or None", describe(value), TypeError)
    if value < 0:
        raise bad_input(op, param, "a non-negative int or None", int(value))
    return int(value)


def _read_size(op: str, param: str, value: Any, caps: Capabilities, backend: str) -> Any:
    if not _is_int(value):
        raise bad_input(op, param, "an int", describe(value), TypeError)
    if value < 0:
        raise bad_input(op, param, "a non-negative int", int(value))
    return int(value)


def _read_overflow(op: str, param: str, value: Any, caps: Capabilities, backend: str) -> Any:
    if type(value) is not str:
        raise bad_input(op, param, f"one of the strings {', '.join(map(repr, OVERFLOWS))}", describe(value), TypeError)
    if value not in OVERFLOWS:
        raise bad_input(op, param, f"one of {', '.join(map(repr, OVERFLOWS))}", repr(value))
    return value


def _read_handle(op: str, param: str, value: Any, caps: Capabilities, backend: str) -> Any:
    return value  # a handle is checked against the call by the operator's rules (unicoll.spec): its group is the call's


def _read_reduce_op(op: str, param: str, value: Any, caps: Capabilities, backend: str) -> Any:
    if type(value) is not str:
        raise bad_input(op, param, f"one of the strings {', '.join(REDUCE_OPS)}", describe(value), TypeError)
    if value not in REDUCE_OPS:
        raise bad_input(op, param, f"one of {', '.join(REDUCE_OPS)}", repr(value))
    return value


def _read_rank(op: str, param: str, value: Any, caps: Capabilities, backend: str) -> Any:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise bad_input(op, param, "an int (a position in the group)", describe(value), TypeError)
    return int(value)


def _read_flag(op: str, param: str, value: Any, caps: Capabilities, backend: str) -> Any:
    if value is not True and value is not False:
        raise bad_input(op, param, "True or False", describe(value), TypeError)
    return value


# -- signatures: what a reader's verdict depends on --------------------------------------------


_native_by_type: dict[type, NativeLibrary] = {}


def _native(x: Any) -> NativeLibrary | None:
    """The description of the library of ``x`` where the transports move its arrays (numpy,
    torch, cupy), else None; learned once per type, which the signatures then look up inline
    (they run on every call)."""
    description = description_of(x)
    if not isinstance(description, NativeLibrary):
        return None
    _native_by_type[type(x)] = description
    return description


def _sign_array(x: Any) -> Any:
    description = _native_by_type.get(type(x)) or _native(x)
    return None if description is None else (description.name, description.signature(x))


def _sign_optional_output(x: Any) -> Any:
    if x is None:
        return ()
    description = _native_by_type.get(type(x)) or _native(x)
    return None if description is None else (description.name, description.signature(x), description.fillable(x))


def _sign_gather_output(value: Any) -> Any:
    return None if isinstance(value, list) else _sign_optional_output(value)


def _sign_counts(value: Any) -> Any:
    if value is None:
        return ()
    kind = type(value)
    if kind is list or kind is tuple:
        return (kind, tuple(value), tuple(map(type, value)))
    description = _native_by_type.get(kind) or _native(value)
    held = None if description is None else description.host_bytes(value)
    if held is None:
        return None  # counts on a GPU (reading them waits for it), torch floats, or not an array
    return (description.name, value.dtype, value.shape, held)


def _sign_flag(value: Any) -> Any:
    return value if type(value) is bool else None


def _unremembered(value: Any) -> None:
    """No signature: the rules check the values, which change every step, so the call is read in full."""
    return None


def _sign_optional_array(x: Any) -> Any:
    return () if x is None else _sign_array(x)


def _sign_int(value: Any) -> Any:
    if value is None:
        return ()
    return (type(value), int(value)) if _is_int(value) else None


def _sign_handle(handle: Any) -> Any:
    """What the rules of moe.redispatch and moe.combine read of a handle: its tokens (the rows
    redispatch's x has), the rows it received (combine's y), its arrays' place, its weights."""
    if not isinstance(handle, Handle):
        return None
    return (handle.tokens, handle.received, handle.library, handle.device, handle.weighted)


def _sign_static_handle(handle: Any) -> Any:
    """What the rules of moe.redispatch_static and moe.combine_static read of a handle: its
    tokens, its block shape, its arrays' place, its weights."""
    if not isinstance(handle, StaticHandle):
        return None
    return (handle.tokens, handle.experts_per_rank, handle.world, handle.capacity, handle.library, handle.device,
            handle.weighted)  # fmt: skip


def _sign_value(value: Any) -> Any:
    """A string or an int, remembered with its type (``1`` and ``True`` differ)."""
    return (type(value), value) if type(value) in (str, int) else None


# -- the kinds ---------------------------------------------------------------------------------

ARRAY = Kind(
    doc="TypeError unless an array of a library the backend moves, of one of its dtypes; "
    "ValueError if 0-d or on a device the backend does not serve.",
    read=_read_array,
    sign=_sign_array,
    passed_through=True,
    schema="Tensor",
)
"""An input array."""

OPTIONAL_OUTPUT = Kind(
    doc="as an input array, and ValueError unless C-contiguous and writable.",
    read=_read_optional_output,
    sign=_sign_optional_output,
    passed_through=True,
    fills=True,
)
"""An array to fill in place, or None."""

IN_PLACE = Kind(
    doc="as an input array, and ValueError unless C-contiguous and writable (it is changed in place).",
    read=_read_output,
    sign=_sign_optional_output,
    passed_through=True,
    fills=True,
    in_place=True,
    schema="Tensor",
)
"""An array the operator changes in place."""

GATHER_OUTPUT = Kind(
    doc="each array as an input array, and ValueError unless C-contiguous and writable.",
    read=_read_gather_output,
    sign=_sign_gather_output,
    passed_through=True,
    fills=True,
)
"""An array to fill in place, a list of them, or None."""

COUNTS = Kind(
    doc="TypeError unless an int32/int64 array or a sequence of ints; ValueError unless 1-D, non-negative, "
    "on the host or a CUDA device, and summing to at most 2**63 - 1.",
    read=_read_counts,
    sign=_sign_counts,
    holds_counts=True,
    schema="Tensor",
)
"""Counts or split sizes: an int array of any library or a sequence of ints."""

OPTIONAL_COUNTS = Kind(
    doc="as counts, when given.",
    read=_read_optional_counts,
    sign=_sign_counts,
    holds_counts=True,
    schema="Tensor?",
)
"""Counts, or None."""

GROUP = Kind(
    doc="TypeError unless a Group or None; ValueError if this rank is not a member or it predates init().",
    read=None,
    sign=None,
    schema="int",
)
"""A :class:`~unicoll.Group` or None (the world)."""

REDUCE_OP = Kind(
    doc=f"TypeError unless a str; ValueError unless one of {', '.join(REDUCE_OPS)}.",
    read=_read_reduce_op,
    sign=_sign_value,
    schema="str",
)
"""The name of a reduction."""

RANK = Kind(doc="TypeError unless an int (not a bool).", read=_read_rank, sign=_sign_value, schema="int")
"""A position in the group."""

FLAG = Kind(doc="TypeError unless True or False.", read=_read_flag, sign=_sign_flag, schema="bool")
"""True or False."""

OPTIONAL_ARRAY = Kind(
    doc="as an input array, when given.",
    read=_read_optional_array,
    sign=_sign_optional_array,
    passed_through=True,
)
"""An input array, or None."""

EXPERT_IDS = Kind(
    doc="TypeError unless an int32/int64 array (numpy, torch or cupy); ValueError unless 2-D (tokens, k) "
    "with k >= 1, on the host or a CUDA device (read on the host by a host backend; a device backend "
    "routes them where they are).",
    read=_read_expert_ids,
    sign=_unremembered,
)
"""The router's global expert ids, ``(tokens, k)``, checked and left as given (never remembered)."""

ROUTER_IDS = Kind(
    doc="TypeError unless an int32/int64 array of a library the backend moves; ValueError unless 2-D "
    "(tokens, k) with k >= 1. Never read on the host.",
    read=_read_router_ids,
    sign=_sign_array,
    passed_through=True,
)
"""The router's global expert ids, ``(tokens, k)``, left where they are (the static-shape MoE operators)."""

SIZE = Kind(doc="TypeError unless an int; ValueError if negative.", read=_read_size, sign=_sign_int)
"""A non-negative int."""

OVERFLOWS = ("drop", "error")
"""What the static-shape dispatch does with slots beyond the capacity."""

OVERFLOW = Kind(doc="TypeError unless a string; ValueError unless 'drop' or 'error'.", read=_read_overflow,
                sign=_sign_value)  # fmt: skip
"""``'drop'`` or ``'error'``."""

STATIC_HANDLE = Kind(
    doc="TypeError unless a handle returned by moe.dispatch_static; ValueError once its session ended (finalize()).",
    read=_read_handle,
    sign=_sign_static_handle,
    passed_through=True,
)
"""A :class:`~unicoll.static_layout.StaticHandle`."""

POSITIVE_INT = Kind(
    doc="TypeError unless an int; ValueError unless at least 1.", read=_read_positive_int, sign=_sign_int
)
"""A positive int."""

OPTIONAL_SIZE = Kind(
    doc="TypeError unless an int or None; ValueError if negative.", read=_read_optional_size, sign=_sign_int
)
"""A non-negative int, or None."""

HANDLE = Kind(
    doc="TypeError unless a handle returned by moe.dispatch; ValueError once its session ended (finalize()).",
    read=_read_handle,
    sign=_sign_handle,
    passed_through=True,
)
"""A :class:`~unicoll.routing.Handle`."""
