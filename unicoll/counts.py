"""Reading counts and split sizes (any array library or a sequence of ints), and the router's
expert ids, into host int64 arrays."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, Union

import numpy as np

from .arrays import describe, device_kind, dtype_name, library_of, named_type
from .errors import bad_input
from .libraries.native import NATIVE, NUMPY


class IntArray(Protocol):
    """An integer array of numpy, torch or cupy, as counts are read: a dtype and a shape."""

    @property
    def dtype(self) -> Any: ...

    @property
    def shape(self) -> Sequence[int]: ...


#: What a count or split argument may be: an int array of any supported library or a sequence.
Counts = Union[Sequence[int], IntArray]  # noqa: UP007 (a runtime alias, kept valid on Python 3.10)

INT_DTYPES = ("int32", "int64")
"""The dtypes an array of counts or of expert ids may have."""
_HOST_OR_CUDA = ("cpu", "cuda")
INT64_MAX = 2**63 - 1

_FEW = 32
"""Up to this many counts, their checks run on a Python list: a numpy reduction costs about a
microsecond whatever its size, which is most of a call of the training loop's steady state."""


def as_counts(value: Counts, op: str, param: str) -> np.ndarray:
    """Return ``value`` as a 1-D, non-negative, host ``int64`` numpy array.

    Arrays must have dtype int32 or int64 and live on the host or a CUDA device. A CUDA array
    (torch or cupy) is copied to the host once per call, which waits for the work queued
    before it on the current stream (a device synchronization); sequences and numpy arrays
    cost no device work at all. The counts and their sum must fit in int64, so every sum
    taken of them later is exact. Raises TypeError/ValueError naming ``op`` and ``param``.

    >>> as_counts([1, 0, 2], "global_scatter", "local_count")
    array([1, 0, 2])
    """
    if type(value) is np.ndarray and value.dtype == np.int64 and value.ndim == 1 and value.size <= _FEW:
        values = value.tolist()  # the usual case, read as below but faster (refused by _check_values)
        if values and (min(values) < 0 or max(values) > INT64_MAX // len(values)):
            _check_values(values, op, param)
        return value
    lib = library_of(value)
    if lib is None:
        return _from_sequence(value, op, param)
    name = dtype_name(value)
    if name not in INT_DTYPES:
        raise bad_input(op, param, f"{named_type(value)} of dtype int32 or int64", describe(value), TypeError)
    if device_kind(value) not in _HOST_OR_CUDA:
        raise bad_input(op, param, "counts on the host or a CUDA device", describe(value))
    counts = np.asarray(on_host(value), dtype=np.int64)
    if counts.ndim != 1:
        raise bad_input(op, param, "a 1-D array", f"shape {counts.shape}")
    if counts.size and counts.min() < 0:
        raise bad_input(op, param, "non-negative counts", f"{int(counts.min())} at index {int(counts.argmin())}")
    if counts.size and counts.max() > INT64_MAX // counts.size:  # the int64 sum might wrap: add exactly
        _check_total(sum(counts.tolist()), op, param)
    return counts


def total(counts: np.ndarray) -> int:
    """The sum of validated counts (host int64, whose sum fits in int64)."""
    return sum(counts.tolist()) if counts.size <= _FEW else int(counts.sum())


def even_split(rows: int, world: int) -> list[int]:
    """The split sizes of ``rows`` rows shared evenly by ``world`` ranks (``rows`` divisible by it).

    >>> even_split(6, 3)
    [2, 2, 2]
    """
    return [rows // world] * world


def rank_totals(counts: np.ndarray, world: int) -> list[int]:
    """The sums of the ``world`` consecutive blocks of validated counts (one per rank).

    >>> rank_totals(np.array([1, 0, 2, 1]), 2)
    [1, 3]
    """
    if counts.size > _FEW:
        return counts.reshape(world, -1).sum(axis=1).tolist()
    values, per_rank, totals = counts.tolist(), counts.size // world, []
    for rank in range(world):  # a loop: a comprehension costs a call more (Python 3.11)
        totals.append(sum(values[rank * per_rank : (rank + 1) * per_rank]))
    return totals


def _check_total(total: int, op: str, param: str) -> None:
    if total > INT64_MAX:
        raise bad_input(op, param, "counts whose sum fits in int64 (at most 2**63 - 1)", f"a sum of {total}")


def _is_int_type(kind: type) -> bool:
    return kind is int or (issubclass(kind, (int, np.integer)) and kind is not bool)


def _from_sequence(value: Any, op: str, param: str) -> np.ndarray:
    """A list, tuple or other sequence of Python or numpy ints, checked in Python (faster
    than numpy for the few values counts hold)."""
    if not isinstance(value, (list, tuple)) and (not isinstance(value, Sequence) or isinstance(value, (str, bytes))):
        raise bad_input(op, param, "an integer array or a sequence of ints", describe(value), TypeError)
    kinds = set(map(type, value))
    if not all(map(_is_int_type, kinds)):
        names = ", ".join(sorted(kind.__name__ for kind in kinds))
        raise bad_input(op, param, "a sequence of ints", f"a sequence holding {names}", TypeError)
    _check_values(value, op, param)
    return np.array(value, dtype=np.int64)


def _check_values(values: Sequence[int], op: str, param: str) -> None:
    """Counts that are ints, checked in Python: non-negative, and each count and their sum
    within int64."""
    if values and min(values) < 0:
        smallest = min(values)
        raise bad_input(op, param, "non-negative counts", f"{int(smallest)} at index {list(values).index(smallest)}")
    if values and max(values) > INT64_MAX // len(values):  # a count or the sum might not fit in int64
        _check_total(sum(map(int, values)), op, param)


def expert_ids(value: Any, op: str, param: str) -> Any:
    """The router's expert ids, checked without reading them: an int32/int64 array of numpy,
    torch or cupy, on the host or a CUDA device, of shape ``(tokens, k)``, ``k >= 1``; returned
    as given. Their values are checked against the number of experts by the caller, which
    knows it (where they are: on the host, or on the device with the counts' exchange).
    Raises TypeError/ValueError naming ``op`` and ``param``.

    >>> expert_ids(np.array([[0, 3], [-1, 1]], dtype=np.int32), "moe.dispatch", "topk_idx").shape
    (2, 2)
    """
    if library_of(value) is None:
        raise bad_input(op, param, "an integer array (int32 or int64)", describe(value), TypeError)
    if dtype_name(value) not in INT_DTYPES:
        raise bad_input(op, param, f"{named_type(value)} of dtype int32 or int64", describe(value), TypeError)
    if device_kind(value) not in _HOST_OR_CUDA:
        raise bad_input(op, param, "expert ids on the host or a CUDA device", describe(value))
    if value.ndim != 2 or value.shape[1] < 1:
        raise bad_input(op, param, "a 2-D array (tokens, k) with k >= 1", describe(value))
    return value


def on_host(value: Any) -> Any:
    """An int array of any library on the host (numpy; a CUDA array is copied, which waits for
    the work queued before it)."""
    description = NATIVE.get(library_of(value))
    return value if description is None else description.to_host(value)


def host_as(host: Any, x: Any) -> Any:
    """An array of a routing or layout (indices, a mask, counts) as an array of ``x``'s library on
    ``x``'s device: a host array copied there, a device array of the other GPU library (a cupy
    routing for a torch ``x``, say) shared through DLPack; one already of x's library, or for a
    numpy ``x``, as it is."""
    library = library_of(x)
    if library == library_of(host) or library == NUMPY.name:
        return host
    description = NATIVE[library]
    if isinstance(host, np.ndarray):
        return description.from_host(host, description.place(x), None)
    return description.from_dlpack(host, description.place(x))
