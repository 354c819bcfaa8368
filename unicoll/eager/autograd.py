"""Attaching a collective's result to torch's autograd graph.

The communication runs outside autograd (on detached tensors); :func:`attach` then links
the finished result to the input with a Function whose backward runs the operator's
backward collective, and :func:`attach_in_place` records an in-place operator's change of its
tensor, as torch records ``x.add_(1)``. The same path serves ``sync_op=True`` and
``Task.wait()``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.function import once_differentiable


@dataclass(frozen=True)
class _Payload:
    """Carried past Function.apply as a non-tensor, so ``result`` is not treated as an input."""

    result: torch.Tensor
    backward: Callable[[torch.Tensor], torch.Tensor]


class _Collective(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, payload: _Payload) -> torch.Tensor:
        ctx.backward_collective = payload.backward
        return payload.result

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.backward_collective(grad.contiguous()), None


@dataclass(frozen=True)
class _ManyPayload:
    """:class:`_Payload` for a result of several inputs: ``backward`` returns one gradient per
    input (None for one that needs none)."""

    result: torch.Tensor
    backward: Callable[[torch.Tensor], tuple[torch.Tensor | None, ...]]


class _ManyCollective(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, payload: _ManyPayload, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.backward_collective = payload.backward
        return payload.result

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return None, *ctx.backward_collective(grad.contiguous())


class _LinkedCollective(torch.autograd.Function):
    """:class:`_Collective` with a second output: an empty tensor from the same node."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, payload: _Payload) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.backward_collective = payload.backward
        return payload.result, x.new_empty(0)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor, link: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.backward_collective(grad.contiguous()), None


class _Joined(torch.autograd.Function):
    """``y`` as it is, from a node that also takes a link (:func:`joined`)."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, link: torch.Tensor) -> torch.Tensor:
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _InPlaceCollective(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, backward: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        ctx.mark_dirty(x)
        ctx.backward_collective = backward
        return x

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.backward_collective(grad.contiguous()), None


def recorded_state(x: torch.Tensor) -> str:
    """How autograd records a tensor that needs a gradient: ``"a leaf"``, ``"a view of a leaf"``
    (neither may change in place), else ``"recorded"``."""
    if x.is_leaf:
        return "a leaf"
    return "a view of a leaf" if x._base is not None and x._base.is_leaf else "recorded"


def needs_grad(x: Any) -> bool:
    """Whether a result computed from ``x`` should join the autograd graph now."""
    return isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled()


def attach(x: torch.Tensor, result: torch.Tensor, backward: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``result`` with a ``grad_fn`` whose backward is ``backward(grad_of_result)``."""
    return _Collective.apply(x, _Payload(result, backward))


def attach_linked(
    x: torch.Tensor, result: torch.Tensor, backward: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attach`, and a link: an empty tensor whose ``grad_fn`` is the same node. A later
    result :func:`joined` to the link reaches that node in every backward pass through it, so
    the backward collective runs even where nothing else of the result was used (it then gets
    zeros: torch materializes the gradient no path gave)."""
    return _LinkedCollective.apply(x, _Payload(result, backward))


def joined(y: torch.Tensor, link: torch.Tensor) -> torch.Tensor:
    """``y`` (a view of it) as the output of a node that also takes ``link``
    (:func:`attach_linked`), which it passes no gradient: whatever ``y`` came from, a backward
    pass through it reaches the link's node."""
    return _Joined.apply(y, link)


def attach_many(
    inputs: tuple[Any, ...], result: torch.Tensor, backward: Callable[[torch.Tensor], tuple[Any, ...]]
) -> torch.Tensor:
    """:func:`attach` for a result of several ``inputs`` (tensors, or None for an absent one):
    ``backward(grad_of_result)`` returns one gradient per input (None where it needs none)."""
    present = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor)]

    def each(grad: torch.Tensor) -> tuple[Any, ...]:
        grads = backward(grad)
        return tuple(grads[i] for i in present)

    return _ManyCollective.apply(_ManyPayload(result, each), *(inputs[i] for i in present))


def attach_in_place(x: torch.Tensor, backward: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Record that ``x`` (a non-leaf, already changed in place by a collective) now comes from
    its old value through a collective whose backward is ``backward(grad_of_x)``; returns ``x``."""
    return _InPlaceCollective.apply(x, backward)
