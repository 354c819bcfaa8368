"""Handing an operator's call to its traceable form while torch.compile traces it.

:func:`traceable` wraps a public operator. While torch.compile's Dynamo traces the caller, the
wrapper calls the form of the same name in :mod:`unicoll.torch_ops` instead, which records the
call as one of unicoll's custom ops (or runs it eagerly behind one graph break where it cannot
be traced). That module, and with it the registration of the custom ops, is imported on the
first traced call.

Called eagerly, the wrapper runs the operator. Where Dynamo is loaded, it runs it through
``torch.compiler.disable``: code that Dynamo gave up tracing runs with Dynamo still watching
every function it calls, and unicoll's internals must never be traced (they are not written
for it). A program that never imports ``torch._dynamo`` pays neither the import nor the wrapper.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)


def compiling() -> bool:
    """Whether torch.compile is tracing the caller now (False where torch was never imported)."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.compiler.is_compiling()


def traceable(fn: F) -> F:
    """``fn`` (a public operator), called as ``unicoll.torch_ops.<its name>`` while torch.compile
    traces (``moe_<its name>`` for ``unicoll.moe``'s), and never traced itself."""
    module = fn.__module__.rsplit(".", 1)[-1]
    name = fn.__name__ if module == "ops" else f"{module}_{fn.__name__}"
    public = fn.__name__ if module == "ops" else f"{module}.{fn.__name__}"
    untraced = None  # fn behind torch.compiler.disable, made once Dynamo is loaded

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal untraced
        if "torch._dynamo" not in sys.modules:
            return fn(*args, **kwargs)
        if compiling():
            from . import torch_ops

            return getattr(torch_ops, name)(*args, **kwargs)
        if untraced is None:
            untraced = sys.modules["torch"].compiler.disable(fn, reason=f"unicoll.{public} runs eagerly here")
        return untraced(*args, **kwargs)

    return call  # type: ignore[return-value]
