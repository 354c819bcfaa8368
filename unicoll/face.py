"""The public face: every public operator, deciding in one frame per call whether it runs
eagerly or is traced.

A public operator is its eager function (:mod:`unicoll.eager`) run under the one-thread lock
(:mod:`unicoll.entry`). Once ``torch._dynamo`` is loaded (a program that uses torch.compile),
each call first asks whether Dynamo is tracing it: then the call goes to its traced form
(:func:`unicoll.compiled.traced.traced_call`, imported on the first traced call, which
registers the custom ops); else it runs eagerly behind
``torch.compiler.disable``, so that Dynamo, which watches every function that code it gave up
tracing calls, never traces unicoll's internals. A program that never imports
``torch._dynamo`` pays one lookup in ``sys.modules`` per call (:func:`unicoll.arrays.dynamo_imported`,
which Dynamo reads as a constant while it traces).

Once a joined array library is imported (Paddle, JAX: :mod:`unicoll.libraries`), a call whose
arguments hold its arrays goes to :func:`unicoll.carry.call`, which runs the operator on torch
tensors over their memory and hands the results back as the caller's arrays; a program that
imports neither pays one more lookup in ``sys.modules`` per library.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from . import carry
from .arrays import dynamo_imported
from .eager import moe, ops, static_moe
from .entry import enter, exclusive_as, leave
from .libraries import modules

F = TypeVar("F", bound=Callable)

__all__ = [
    "all_gather",
    "all_reduce",
    "alltoall",
    "alltoall_single",
    "broadcast",
    "exchange_counts",
    "global_gather",
    "global_scatter",
    "reduce",
    "reduce_scatter",
]
"""The public operators ``import unicoll`` exports (``unicoll.moe`` exports the MoE ones)."""

_JOINED_MODULES = modules()
"""The modules of the joined array libraries (:func:`unicoll.libraries.modules`): a list that
a library joining later is added to."""


def _holds_joined(args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether a call's arguments hold a joined library's arrays (asked only once one of those
    libraries is imported)."""
    for module in _JOINED_MODULES:
        if module in sys.modules:
            return carry.holds_joined(args, kwargs)
    return False


def _public(name: str, eager: F, module: str) -> F:
    """The public operator ``name`` (as users write it, ``"moe.dispatch"``), of module
    ``module``: ``eager`` under the lock, or its traced form while Dynamo traces the call."""
    locked = exclusive_as(name)(eager)
    untraced: Callable[..., Any] | None = None  # locked behind torch.compiler.disable, made on first use

    def under_dynamo(args: tuple, kwargs: dict[str, Any]) -> Any:
        nonlocal untraced
        import torch  # loaded: Dynamo is (an import statement costs Dynamo nothing, sys.modules does)

        if torch.compiler.is_compiling():
            from .compiled.traced import traced_call

            return traced_call(name, locked, args, kwargs)
        if _holds_joined(args, kwargs):
            return carry.call(name, eager, locked, args, kwargs)
        if untraced is None:
            untraced = torch.compiler.disable(locked, reason=f"unicoll.{name} runs eagerly here")
        return untraced(*args, **kwargs)

    @functools.wraps(eager)
    def operator(*args: Any, **kwargs: Any) -> Any:
        if dynamo_imported():
            return under_dynamo(args, kwargs)
        for joined_module in _JOINED_MODULES:  # _holds_joined(), inlined: one frame less on every call
            if joined_module in sys.modules:
                if carry.holds_joined(args, kwargs):
                    return carry.call(name, eager, locked, args, kwargs)
                break
        enter(name)  # locked(), inlined: one frame less on every call
        try:
            return eager(*args, **kwargs)
        finally:
            leave()

    operator.__module__ = module
    return operator  # type: ignore[return-value]


exchange_counts = _public("exchange_counts", ops.exchange_counts, "unicoll")
global_scatter = _public("global_scatter", ops.global_scatter, "unicoll")
global_gather = _public("global_gather", ops.global_gather, "unicoll")
alltoall_single = _public("alltoall_single", ops.alltoall_single, "unicoll")
alltoall = _public("alltoall", ops.alltoall, "unicoll")
all_gather = _public("all_gather", ops.all_gather, "unicoll")
all_reduce = _public("all_reduce", ops.all_reduce, "unicoll")
reduce = _public("reduce", ops.reduce, "unicoll")
reduce_scatter = _public("reduce_scatter", ops.reduce_scatter, "unicoll")
broadcast = _public("broadcast", ops.broadcast, "unicoll")
moe_dispatch = _public("moe.dispatch", moe.dispatch, "unicoll.moe")
moe_redispatch = _public("moe.redispatch", moe.redispatch, "unicoll.moe")
moe_combine = _public("moe.combine", moe.combine, "unicoll.moe")
moe_dispatch_static = _public("moe.dispatch_static", static_moe.dispatch_static, "unicoll.moe")
moe_redispatch_static = _public("moe.redispatch_static", static_moe.redispatch_static, "unicoll.moe")
moe_combine_static = _public("moe.combine_static", static_moe.combine_static, "unicoll.moe")
