"""Floating-point max and min that every rank computes alike: reduced as integer keys.

A transport reduces floats with max and min in the order its algorithm meets the values, and
IEEE comparisons leave two cases to that order: a NaN (``max(nan, 1)`` is NaN or 1 by which
comes first) and the sign of zero (``max(-0.0, 0.0)``). MPI's recursive doubling meets them in
a different order on each rank, so ranks got different answers; gloo dropped the NaN.

Here each float becomes an integer key in the float's total order: its bits, with the
magnitude bits of negative numbers flipped, so that -inf < ... < -0 < +0 < ... < +inf. Every
NaN becomes the largest key for ``max`` and the smallest for ``min``, so a NaN on any rank
wins. The transport then reduces exact integers, the same on every rank whatever the order,
and the keys turn back into floats: the canonical NaN of the dtype where any rank had a NaN,
else the largest (smallest) value, with -0 < +0 (IEEE 754-2019's ``maximum`` and
``minimum``). 16-bit floats travel as 32-bit keys: no transport reduces 16-bit integers.

Works on any array library the backends take (numpy, torch, cupy), through the array API.
"""

from __future__ import annotations

from typing import Any

from array_api_compat import array_namespace

from unicoll.arrays import dtype_name

_BITS = {"float16": 16, "bfloat16": 16, "float32": 32, "float64": 64}
"""The width of each floating dtype."""


def applies(op: str, x: Any) -> bool:
    """Whether the transport reduction ``op`` on ``x`` goes through keys: max and min of floats."""
    return op in ("max", "min") and dtype_name(x) in _BITS


def to_keys(x: Any, op: str) -> Any:
    """A new integer array of ``x``'s shape whose ``op`` (``"max"`` or ``"min"``) across ranks,
    turned back by :func:`from_keys`, is the floats' ``op`` with NaN propagated."""
    xp = array_namespace(x)
    bits = _BITS[dtype_name(x)]
    words = x.view(getattr(xp, f"int{bits}"))
    if bits == 16:
        words = xp.astype(words, xp.int32)
    keys = xp.where(words < 0, words ^ ((1 << (bits - 1)) - 1), words)
    return xp.where(xp.isnan(x), _nan_key(xp, keys.dtype, op), keys)


def from_keys(keys: Any, out: Any, op: str) -> Any:
    """Write the floats of reduced ``keys`` (made by :func:`to_keys` with the same ``op``) into
    ``out``, a float array of their shape; returns ``out``."""
    xp = array_namespace(out)
    bits = _BITS[dtype_name(out)]
    nan = keys == _nan_key(xp, keys.dtype, op)
    words = xp.where(keys < 0, keys ^ ((1 << (bits - 1)) - 1), keys)
    if bits == 16:
        words = xp.astype(words, xp.int16)
    out[...] = xp.where(nan, xp.nan, words.view(out.dtype))
    return out


def _nan_key(xp: Any, dtype: Any, op: str) -> int:
    """The key every NaN takes: beyond every float's key on the side ``op`` picks (the bits of
    a NaN themselves, so no number has it)."""
    limits = xp.iinfo(dtype)
    return limits.max if op == "max" else limits.min
