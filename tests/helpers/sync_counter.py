"""A count of the host reads a piece of torch code would make on a GPU, taken on CPU tensors.

On a GPU, reading device memory on the host waits for the device: ``.item()``, ``.tolist()``,
a conversion to numpy, a copy to the CPU, and the operations whose output size depends on
the values (``nonzero``, ``bincount``, ``repeat_interleave`` without ``output_size``,
``masked_select``, indexing with a boolean mask, ``unique``). :class:`SyncCounter` counts each
of them as it happens, whatever device the tensors are on, so the device path of the MoE
operators run on CPU tensors (the GPU backends' code driving gloo) shows the reads it would
make on a GPU. torch.compile runs no dispatch mode: compiled code is counted from a profile
(tests/frontend/test_moe_device.py).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_VALUE_SIZED = {
    "aten.nonzero.default", "aten.nonzero_static.default", "aten.bincount.default", "aten.masked_select.default",
    "aten._unique.default", "aten._unique2.default", "aten.unique_dim.default", "aten.unique_consecutive.default",
    "aten.equal.default", "aten.is_nonzero.default", "aten._local_scalar_dense.default",
}  # fmt: skip
"""Operations that read the device on the host whatever their arguments."""

_INDEXING = {"aten.index.Tensor", "aten.index_put.default", "aten.index_put_.default", "aten._index_put_impl_.default"}
"""Operations that read the device when one of their indices is a boolean mask."""

_TO_NUMPY = {torch.Tensor.numpy, torch.Tensor.tolist, torch.Tensor.__array__}
"""Conversions that read a tensor's values without a dispatched operation."""

_FROM_HOST = {torch.asarray, torch.tensor, torch.as_tensor}
"""Tensors made from host data: on a GPU an upload from pageable memory, which waits for the
device (counted with ``uploads=True``; a transport's uploads of an index go through
``torch.from_numpy(...).to(device, non_blocking=True)``, which does not wait)."""


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


class _Functions(TorchFunctionMode):
    def __init__(self, counter: SyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func in _TO_NUMPY:
            self.counter.note(f"Tensor.{func.__name__}")
        elif self.counter.uploads and func in _FROM_HOST and not _tensors(list(args[:1])):
            self.counter.note(f"upload: torch.{func.__name__}")
        return func(*args, **(kwargs or {}))


class SyncCounter(TorchDispatchMode):
    """``with SyncCounter() as reads:`` counts the host reads made inside (``reads.total``,
    and by kind in ``reads.kinds``); with ``uploads``, the tensors made from host data too."""

    def __init__(self, uploads: bool = False) -> None:
        super().__init__()
        self.uploads = uploads
        self.kinds: Counter[str] = Counter()
        self._functions = _Functions(self)

    @property
    def total(self) -> int:
        return sum(self.kinds.values())

    def note(self, kind: str) -> None:
        self.kinds[kind] += 1

    def __enter__(self) -> SyncCounter:
        self._functions.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._functions.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        name = str(func)
        if name in _VALUE_SIZED:
            self.note(name)
        elif name == "aten.repeat_interleave.Tensor" and kwargs.get("output_size") is None:
            self.note(name)
        elif name in _INDEXING and any(t.dtype == torch.bool for t in _tensors(list(args[1:2]))):
            self.note(f"{name} with a boolean mask")
        elif name in ("aten._to_copy.default", "aten.copy_.default") and _to_cpu(func, args, kwargs):
            self.note(f"{name} to the CPU")
        return func(*args, **kwargs)


def _to_cpu(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether a copy moves a tensor off a device to the CPU."""
    if str(func) == "aten.copy_.default":
        destination, source = args[0], args[1]
        return destination.device.type == "cpu" and source.device.type != "cpu"
    device = kwargs.get("device")
    return device is not None and torch.device(device).type == "cpu" and args[0].device.type != "cpu"
