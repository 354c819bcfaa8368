"""Handing an operator's call to its traceable form while torch.compile traces it.

:func:`hand_off` makes what a public operator calls once Dynamo is loaded
(:func:`unicoll.entry.collective` checks for it first on every call). While torch.compile's
Dynamo traces the caller, that is the form of the same name in :mod:`unicoll.torch_ops`, which
records the call as one of unicoll's custom ops (:mod:`unicoll.custom_ops`; or runs it eagerly
behind one graph break where it cannot be traced). That module, and with it the registration of
the custom ops, is imported on the first traced call.

Called eagerly with Dynamo loaded, the operator runs through ``torch.compiler.disable``: code
that Dynamo gave up tracing runs with Dynamo still watching every function it calls, and
unicoll's internals must never be traced (they are not written for it). A program that never
imports ``torch._dynamo`` pays neither the import nor the wrapper.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


def compiling() -> bool:
    """Whether torch.compile is tracing the caller now (False where torch was never imported)."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.compiler.is_compiling()


def hand_off(fn: Callable, run: Callable) -> Callable:
    """What to call instead of ``fn`` (a public operator) once ``torch._dynamo`` is loaded:
    ``unicoll.torch_ops.<its name>`` while torch.compile traces (``moe_<its name>`` for
    ``unicoll.moe``'s), else ``run`` (``fn`` as a collective runs it) behind
    ``torch.compiler.disable``, so that it is never traced itself."""
    module = fn.__module__.rsplit(".", 1)[-1]
    name = fn.__name__ if module == "ops" else f"{module}_{fn.__name__}"
    public = fn.__name__ if module == "ops" else f"{module}.{fn.__name__}"
    untraced = None  # run behind torch.compiler.disable, made on the first eager call

    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal untraced
        if compiling():
            from . import torch_ops

            return getattr(torch_ops, name)(*args, **kwargs)
        if untraced is None:
            untraced = sys.modules["torch"].compiler.disable(run, reason=f"unicoll.{public} runs eagerly here")
        return untraced(*args, **kwargs)

    return call
