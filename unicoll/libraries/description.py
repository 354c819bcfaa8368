"""What an array library tells to join unicoll (:class:`ArrayLibrary`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, eq=False)
class ArrayLibrary:
    """One array library that joins through torch tensors (see the module's docstring).

    ``differentiate(run, inputs)`` runs a call in the library's autograd: ``run(values)``
    computes the call's outputs from the values of ``inputs`` (this library's arrays) and
    returns them with their backward, which maps a list of output gradients (None for an
    output that got none) to one gradient per input (None for none); ``differentiate``
    returns the outputs linked to ``inputs`` (the same objects where the library records an
    input changed in place).
    """

    name: str
    """The library's name in capability tables, e.g. ``"paddle"``."""
    array_type: str
    """Its array type as its users write it, for messages: ``"paddle.Tensor"``."""
    module: str
    package: str
    """The distribution that installs it (``"paddlepaddle"``), which ``unicoll info`` looks for."""
    """The top-level module whose import makes its arrays recognizable."""
    is_array: Callable[[type], bool]
    """Whether a type is this library's array type (called once its module is imported)."""
    dtype: Callable[[Any], str]
    """An array's dtype by unicoll's canonical name (``"float32"``, ``"bfloat16"``)."""
    device: Callable[[Any], str]
    """``"cpu"`` or ``"cuda"``: where an array's memory lives."""
    place: Callable[[Any], Any]
    """A hashable value that tells an array's device apart from another (index included)."""
    to_torch: Callable[[Any], Any]
    """A torch tensor over an array's memory (DLPack), detached from this library's autograd."""
    from_torch: Callable[[Any], Any]
    """A torch tensor as this library's array, sharing memory where the library allows."""
    writable: bool
    """Whether its arrays can be filled in place (JAX's cannot: operators hand back new ones)."""
    needs_grad: Callable[[Any], bool]
    """Whether a result computed from an array joins this library's autograd now (for JAX: it
    is a tracer, under ``jax.grad``)."""
    is_leaf: Callable[[Any], bool]
    """Whether an array that needs a gradient is a leaf (which its autograd never lets change in place)."""
    differentiate: Callable[[Callable[[list[Any]], tuple[list[Any], Callable]], list[Any]], list[Any]]
    """Run a call in the library's autograd (see the class docstring)."""
    grad_hint: str
    """How a user of this library computes without gradients, for messages."""
