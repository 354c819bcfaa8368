"""PaddlePaddle's tensors: read and handed back through DLPack, gradients through
``paddle.autograd.PyLayer``. Paddle is imported only by a caller who passed a Paddle tensor."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from .description import ArrayLibrary


def _paddle() -> Any:
    return sys.modules["paddle"]  # imported: the caller passed a paddle.Tensor


def _is_array(kind: type) -> bool:
    return issubclass(kind, _paddle().Tensor)


def _dtype(x: Any) -> str:
    return str(x.dtype).removeprefix("paddle.")


def _device(x: Any) -> str:
    return "cpu" if x.place.is_cpu_place() else "cuda"


def _place(x: Any) -> str:
    return str(x.place)


def _to_torch(x: Any) -> Any:
    import torch

    return torch.from_dlpack(x.detach() if not x.stop_gradient else x)


def _from_torch(t: Any) -> Any:
    return _paddle().from_dlpack(t.detach())


def _needs_grad(x: Any) -> bool:
    return not x.stop_gradient and _paddle().is_grad_enabled()


def _is_leaf(x: Any) -> bool:
    return bool(x.is_leaf)


_Attach: Any = None


def _layer() -> Any:
    """The PyLayer that links precomputed outputs to their inputs (made on first use)."""
    global _Attach
    if _Attach is None:
        from paddle.autograd import PyLayer

        class Attach(PyLayer):
            @staticmethod
            def forward(ctx: Any, *args: Any) -> Any:
                outputs, backward = args[-1]
                ctx.backward_collective = backward
                return outputs[0] if len(outputs) == 1 else tuple(outputs)

            @staticmethod
            def backward(ctx: Any, *grads: Any) -> Any:
                given = ctx.backward_collective(list(grads))
                return given[0] if len(given) == 1 else tuple(given)

        _Attach = Attach
    return _Attach


def _differentiate(run: Callable[[list[Any]], tuple[list[Any], Callable]], inputs: list[Any]) -> list[Any]:
    """``run(inputs)``'s outputs recorded by a PyLayer whose backward is the one ``run``
    returns (an input among the outputs, changed in place, is recorded in place, as Paddle's
    in-place operators are)."""
    outputs, backward = run(inputs)
    if not outputs:  # nothing autograd records (a Task's outputs are linked when it is waited for)
        return []
    linked = _layer().apply(*inputs, (list(outputs), backward))
    return [linked] if len(outputs) == 1 else list(linked)


PADDLE = ArrayLibrary(
    name="paddle",
    array_type="paddle.Tensor",
    module="paddle",
    package="paddlepaddle",
    is_array=_is_array,
    dtype=_dtype,
    device=_device,
    place=_place,
    to_torch=_to_torch,
    from_torch=_from_torch,
    writable=True,
    needs_grad=_needs_grad,
    is_leaf=_is_leaf,
    differentiate=_differentiate,
    grad_hint="under paddle.no_grad()",
)
"""PaddlePaddle 3's ``paddle.Tensor`` (parameters included), on the CPU or a CUDA device."""
