"""JAX's arrays: read and handed back through DLPack, gradients through ``jax.custom_vjp``.
JAX is imported only by a caller who passed a ``jax.Array``.

JAX's arrays are immutable: an operator that fills an array in place hands back a new one
instead. Under ``jax.grad`` (outside ``jax.jit``) a call's arrays are tracers over concrete
values; :func:`_differentiate` wraps the call in a ``custom_vjp`` whose forward rule runs it on
those values and whose backward rule runs the operator's backward. Results come back on the
device of the call's arrays (DLPack alone would put them on JAX's default device).

Inside ``jax.jit``, JAX turns an exception raised by one of unicoll's host callbacks into a
``JaxRuntimeError`` that carries only its text; :func:`jit_errors` raises unicoll's own
exception again.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from .description import ArrayLibrary


def _jax() -> Any:
    return sys.modules["jax"]  # imported: the caller passed a jax.Array


def _is_array(kind: type) -> bool:
    jax = _jax()
    return issubclass(kind, (jax.Array, jax.core.Tracer))  # a tracer: under jax.grad or jax.jit


def _dtype(x: Any) -> str:
    return str(x.dtype)


def _devices(x: Any) -> set[Any]:
    """The devices ``x`` lives on; none for a tracer, whose arrays are placed when the traced
    function runs."""
    return set() if isinstance(x, _jax().core.Tracer) else x.devices()


def _device(x: Any) -> str:
    return "cpu" if all(device.platform == "cpu" for device in _placement(x)) else "cuda"


def _placement(x: Any) -> set[Any]:
    """The devices ``x`` lives on, or for a tracer, JAX's default device, where the traced
    function's arrays are placed unless the caller puts them elsewhere."""
    return _devices(x) or {_default_device()}


def _default_device() -> Any:
    """The device JAX places new arrays on: ``jax_default_device`` where set (a device or a
    platform's name), else the first device of its default backend."""
    jax = _jax()
    chosen = jax.config.jax_default_device
    if isinstance(chosen, str):
        return jax.devices(chosen)[0]
    return chosen or jax.devices()[0]


def _place(x: Any) -> str:
    """``"cpu"`` (torch, which carries the arrays, has one host device) or ``"cuda:N"``
    (comma-separated for an array sharded over several GPUs)."""
    return ",".join(sorted({"cpu" if d.platform == "cpu" else f"cuda:{d.id}" for d in _placement(x)}))


def _device_count(x: Any) -> int:
    return len(_devices(x))


def _to_torch(x: Any) -> Any:
    import torch

    return torch.from_dlpack(x)


#: The byte alignment XLA needs of a GPU buffer it is handed: a tensor that starts elsewhere (a
#: view into a larger buffer) is copied before JAX takes it.
XLA_ALIGNMENT = 16


def _from_torch(t: Any, like: Any) -> Any:
    """``t`` as a jax.Array on ``like``'s device: DLPack places a host tensor on JAX's default
    device, which ``like`` (on ``cpu:1``, say) may not be on. A tensor not aligned as XLA needs
    is copied first."""
    jax = _jax()
    t = t.detach()
    array = jax.dlpack.from_dlpack(t if t.data_ptr() % XLA_ALIGNMENT == 0 else t.clone())
    devices = _devices(like)
    return array if not devices or array.devices() == devices else jax.device_put(array, next(iter(devices)))


def _needs_grad(x: Any) -> bool:
    return isinstance(x, _jax().core.Tracer)


def _is_leaf(x: Any) -> bool:
    return False  # JAX's arrays never change in place: an in-place operator hands back a new array


def _is_traced(arrays: list[Any]) -> bool:
    """Whether any of ``arrays`` is a tracer of ``jax.jit`` (abstract: no value to read)."""
    jax = _jax()
    return any(isinstance(a, jax.core.Tracer) and _abstract(a) for a in arrays)


def _abstract(tracer: Any) -> bool:
    """Whether ``tracer`` has no concrete value (jax.jit's, not jax.grad's over an array)."""
    import jax.extend.core

    try:
        jax.extend.core.concrete_or_error(None, tracer)
    except _jax().errors.ConcretizationTypeError:
        return True
    return False


def _differentiate(run: Callable[[list[Any]], tuple[list[Any], Callable]], inputs: list[Any], op: str) -> list[Any]:
    """``run`` in a ``jax.custom_vjp``: its forward rule runs it on the concrete values of
    ``inputs`` (tracers under ``jax.grad``) and keeps its backward for the backward rule, which
    gives an input that gets no gradient zeros on its device (``op`` is not needed here)."""
    jax = _jax()
    saved: dict[str, Any] = {}

    @jax.custom_vjp
    def call(*values: Any) -> tuple[Any, ...]:
        return tuple(run(list(values))[0])

    def forward(*values: Any) -> tuple[tuple[Any, ...], None]:
        outputs, saved["backward"] = run(list(values))
        saved["values"] = values
        return tuple(outputs), None

    def backward(_: None, grads: tuple[Any, ...]) -> tuple[Any, ...]:
        given = saved.pop("backward")(list(grads))
        return tuple(_zero_like(x) if g is None else g for x, g in zip(saved.pop("values"), given))

    call.defvjp(forward, backward)
    return list(call(*inputs))


def _zero_like(x: Any) -> Any:
    """The gradient of an input that gets none: zeros on ``x``'s device, of dtype float0 for an
    integer array."""
    import numpy as np

    jax = _jax()
    if jax.numpy.issubdtype(x.dtype, jax.numpy.inexact):  # placed, not made by jnp.zeros: that compiles per shape
        return jax.device_put(np.zeros(x.shape, x.dtype), next(iter(_devices(x)), None))
    return np.zeros(x.shape, dtype=jax.dtypes.float0)


_callback_failure = threading.local()


def failed_in_callback(error: Exception | None) -> None:
    """Remember ``error`` as what the last of unicoll's host callbacks in this thread raised
    (None: it raised nothing), for :func:`jit_errors`."""
    _callback_failure.error = error


@contextmanager
def jit_errors() -> Iterator[None]:
    """Inside the block, a ``jax.jit`` step that failed in one of unicoll's host callbacks (the
    static-shape MoE operators) raises unicoll's own exception, the one the eager operator
    raises (:class:`~unicoll.PeerLostError`, :class:`~unicoll.CollectiveTimeoutError`, the
    ValueError of ``overflow="error"`` or of an ended session...), with JAX's
    ``JaxRuntimeError`` as its ``__cause__``, in place of that ``JaxRuntimeError``.

    JAX keeps only the text of an exception raised in a host callback; the callback, which runs
    in the thread that called the step, remembers the exception itself for this block.

    >>> with uc.moe.jit_errors():          # doctest: +SKIP
    ...     loss, grads = step(params, x)  # a jax.jit function that calls uc.moe.dispatch_static
    """
    failed_in_callback(None)
    try:
        yield
    except Exception as exc:
        error = getattr(_callback_failure, "error", None)
        failed_in_callback(None)
        if error is None or not isinstance(exc, _jax().errors.JaxRuntimeError):
            raise
        raise error from exc


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
    autograd=True,
    needs_grad=_needs_grad,
    is_leaf=_is_leaf,
    differentiate=_differentiate,
    grad_hint="outside jax.grad",
    device_count=_device_count,
    is_traced=_is_traced,
    grad_transform="jax.grad",
)
"""JAX's ``jax.Array``, eagerly and under ``jax.grad``; inside ``jax.jit``, the static-shape MoE
operators (:mod:`unicoll.compiled.jax_static`)."""
