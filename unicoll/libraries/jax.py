"""JAX's arrays: read and handed back through DLPack, gradients through ``jax.custom_vjp``.
JAX is imported only by a caller who passed a ``jax.Array``.

JAX's arrays are immutable: an operator that fills an array in place hands back a new one
instead. Under ``jax.grad`` (outside ``jax.jit``) a call's arrays are tracers over concrete
values; :func:`_differentiate` wraps the call in a ``custom_vjp`` whose forward rule runs it on
those values and whose backward rule runs the operator's backward.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from .description import ArrayLibrary


def _jax() -> Any:
    return sys.modules["jax"]  # imported: the caller passed a jax.Array


def _is_array(kind: type) -> bool:
    jax = _jax()
    return issubclass(kind, (jax.Array, jax.core.Tracer))  # a tracer: under jax.grad or jax.jit


def _dtype(x: Any) -> str:
    return str(x.dtype)


def _device(x: Any) -> str:
    return "cpu" if _place(x) == "cpu" else "cuda"


def _place(x: Any) -> str:
    devices = x.devices() if not isinstance(x, _jax().core.Tracer) else None
    if not devices:
        return "cpu"  # a tracer's arrays are placed when the traced function runs
    (device,) = devices
    return "cpu" if device.platform == "cpu" else f"cuda:{device.id}"


def _to_torch(x: Any) -> Any:
    import torch

    return torch.from_dlpack(x)


def _from_torch(t: Any) -> Any:
    return _jax().dlpack.from_dlpack(t.detach())


def _needs_grad(x: Any) -> bool:
    return isinstance(x, _jax().core.Tracer)


def _is_leaf(x: Any) -> bool:
    return False  # JAX's arrays never change in place: an in-place operator hands back a new array


def _differentiate(run: Callable[[list[Any]], tuple[list[Any], Callable]], inputs: list[Any]) -> list[Any]:
    """``run`` in a ``jax.custom_vjp``: its forward rule runs it on the concrete values of
    ``inputs`` (tracers under ``jax.grad``) and keeps its backward for the backward rule."""
    jax = _jax()
    saved: dict[str, Any] = {}

    @jax.custom_vjp
    def call(*values: Any) -> tuple[Any, ...]:
        return tuple(run(list(values))[0])

    def forward(*values: Any) -> tuple[tuple[Any, ...], None]:
        outputs, saved["backward"] = run(list(values))
        return tuple(outputs), None

    def backward(_: None, grads: tuple[Any, ...]) -> tuple[Any, ...]:
        given = saved.pop("backward")(list(grads))
        return tuple(_zero_like(x) if g is None else g for x, g in zip(inputs, given))

    call.defvjp(forward, backward)
    return list(call(*inputs))


def _zero_like(x: Any) -> Any:
    """The gradient of an input that gets none: zeros, of dtype float0 for an integer array."""
    import numpy as np

    jax = _jax()
    if jax.numpy.issubdtype(x.dtype, jax.numpy.inexact):
        return jax.device_put(np.zeros(x.shape, x.dtype))  # placed, not made by jnp.zeros: that compiles per shape
    return np.zeros(x.shape, dtype=jax.dtypes.float0)


JAX = ArrayLibrary(
    name="jax",
    array_type="jax.Array",
    module="jax",
    package="jax",
    is_array=_is_array,
    dtype=_dtype,
    device=_device,
    place=_place,
    to_torch=_to_torch,
    from_torch=_from_torch,
    writable=False,
    needs_grad=_needs_grad,
    is_leaf=_is_leaf,
    differentiate=_differentiate,
    grad_hint="outside jax.grad",
)
"""JAX's ``jax.Array``, eagerly and under ``jax.grad``; inside ``jax.jit``, the static-shape MoE
operators (:mod:`unicoll.compiled.jax_static`)."""
