"""Handing an operator's call to its traceable form while torch.compile traces it.

:func:`traceable` wraps a public operator. Called eagerly, the wrapper only asks whether torch
is compiling and calls the operator itself (torch is never imported for that). While
torch.compile's Dynamo traces the caller, it calls the form of the same name in
:mod:`unicoll.torch_ops` instead, which records the call as one of unicoll's custom ops (or
runs it eagerly behind one graph break where it cannot be traced). That module, and with it
the registration of the custom ops, is imported on the first traced call.
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
    """``fn`` (a public operator), called as ``unicoll.torch_ops.<its name>`` while torch.compile traces."""
    name = fn.__name__

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if compiling():
            from . import torch_ops

            return getattr(torch_ops, name)(*args, **kwargs)
        return fn(*args, **kwargs)

    return call  # type: ignore[return-value]
