"""What unicoll knows of an array library (:class:`Library`): numpy's, torch's and cupy's,
which the transports move (:mod:`unicoll.libraries.native`), and those that join through torch
tensors (:class:`ArrayLibrary`: Paddle's, JAX's), described alike."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def _on_one_device(x: Any) -> int:
    """One: the device count of an array of a library whose arrays never span several."""
    return 1


def _never_written(x: Any) -> None:
    """Nothing to record: the library's arrays are never written in place, or it has no autograd."""


def _none_traced(arrays: list[Any]) -> bool:
    """False: the library has no compiler whose tracing a call could meet."""
    return False


def _never(x: Any) -> bool:
    """False: the library has no autograd (numpy, cupy)."""
    return False


@dataclass(frozen=True, eq=False)
class Library:
    """One array library: how its arrays are recognized and named, and their dtype, device
    and place."""

    name: str
    """The library's name in capability tables, e.g. ``"torch"``, ``"paddle"``."""
    array_type: str
    """Its array type as its users write it, for messages: ``"torch tensor"``, ``"paddle.Tensor"``."""
    module: str
    """The top-level module whose import makes its arrays recognizable."""
    is_array: Callable[[type], bool]
    """Whether a type is this library's array type (asked once its module is imported)."""
    dtype: Callable[[Any], str]
    """An array's dtype by unicoll's canonical name (``"float32"``, ``"bfloat16"``)."""
    device: Callable[[Any], str]
    """``"cpu"`` or ``"cuda"``: where an array's memory lives."""
    place: Callable[[Any], Any]
    """Where an array lives, precisely enough to tell two devices apart (None on the host)."""
    autograd: bool = False
    """Whether the library records gradients (torch, Paddle, JAX): where it does not, the
    front end asks none of the three questions below (a check of a flag on every call, not a call)."""
    needs_grad: Callable[[Any], bool] = _never
    """Whether a result computed from an array joins the library's autograd now (a torch
    tensor that requires grad with grad mode on; for JAX: a tracer, under ``jax.grad``)."""
    is_leaf: Callable[[Any], bool] = _never
    """Whether an array that needs a gradient is a leaf (which its autograd never lets change in place)."""
    mark_written: Callable[[Any], None] = _never_written
    """Record in the library's autograd that an operator writes the array in place (its
    version counter, as the library's own in-place operators move it), so a backward pass
    that saved the array raises instead of using the new values."""

    def label(self) -> str:
        """How messages name an array of the library before its dtype and shape
        (``"torch float32 (4, 3) on cpu"``)."""
        return self.name

    def device_key(self, x: Any) -> Any:
        """What tells an array's device apart in a cache key beside its type and dtype
        (hashable): its place."""
        return self.place(x)


@dataclass(frozen=True, eq=False, kw_only=True)
class ArrayLibrary(Library):
    """One array library that joins through torch tensors (see the module's docstring).

    ``differentiate(run, inputs, op)`` runs a call of the operator ``op`` in the library's
    autograd: ``run(values)`` computes the call's outputs from the values of ``inputs`` (this
    library's arrays) and returns them with their backward, which maps a list of output
    gradients (None for an output that got none) to one gradient per input (None for none);
    ``differentiate`` returns the outputs linked to ``inputs`` (the same objects where the
    library records an input changed in place).
    """

    package: str
    """The distribution that installs it (``"paddlepaddle"``), which ``unicoll info`` looks for."""
    to_torch: Callable[[Any], Any]
    """A torch tensor over an array's memory (DLPack), detached from this library's autograd."""
    from_torch: Callable[[Any, Any], Any]
    """``from_torch(t, like)``: the torch tensor ``t`` as this library's array, on the device of
    ``like`` (one of the call's arrays of this library), sharing memory where the library allows."""
    writable: bool
    """Whether its arrays can be filled in place (JAX's cannot: operators hand back new ones)."""
    differentiate: Callable[[Callable[[list[Any]], tuple[list[Any], Callable]], list[Any], str], list[Any]]
    """Run a call in the library's autograd (see the class docstring)."""
    grad_hint: str
    """How a user of this library computes without gradients, for messages."""
    device_count: Callable[[Any], int] = _on_one_device
    """How many devices an array's memory spans: more than one (a sharded JAX array) is refused,
    since one torch tensor cannot carry it."""
    is_traced: Callable[[list[Any]], bool] = _none_traced
    """Whether any of a call's arrays is abstract, traced by the library's compiler (a tracer of
    ``jax.jit``): the call then runs as that compiler's form (for JAX, :mod:`unicoll.compiled.jax_static`)."""
    grad_transform: str | None = None
    """The transformation that traces the library's gradients (``"jax.grad"``), whose traced
    values cannot wait in a Task: a call that records a gradient must be synchronous. None where
    the library records gradients as the call runs (Paddle)."""

    def label(self) -> str:
        """Messages name a joined library's array by its type: ``"paddle.Tensor int64 (4,) on cpu"``."""
        return self.array_type
