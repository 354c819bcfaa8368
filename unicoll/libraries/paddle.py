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


def _from_torch(t: Any, like: Any) -> Any:
    return _paddle().from_dlpack(t.detach())  # on t's device, which is like's


def _needs_grad(x: Any) -> bool:
    return not x.stop_gradient and _paddle().is_grad_enabled()


def _is_leaf(x: Any) -> bool:
    return bool(x.is_leaf)


def _mark_written(x: Any) -> None:
    x._bump_inplace_version()  # Paddle's in-place operators move it so; no public call does


_Attach: Any = None


def _layer() -> Any:
    """The PyLayer that links precomputed outputs to their inputs (made on first use)."""
    global _Attach
    if _Attach is None:
        from paddle.autograd import PyLayer

        class Attach(PyLayer):
            @staticmethod
            def forward(ctx: Any, *args: Any) -> Any:
                outputs, once = args[-1]
                ctx.backward_collective = once
                return outputs[0] if len(outputs) == 1 else tuple(outputs)

            @staticmethod
            def backward(ctx: Any, *grads: Any) -> Any:
                given = ctx.backward_collective(list(grads))
                return given[0] if len(given) == 1 else tuple(given)

        _Attach = Attach
    return _Attach


class _Once:
    """The backward of one recorded call, which runs once. Paddle 3.3.1's PyLayer frees its
    context after the first backward, even under ``retain_graph=True``, and a second backward
    through the node crashes the process (SIGSEGV) before calling Python; but it calls the
    hooks of the node's outputs first, and :meth:`refuse_again` raises there instead."""

    def __init__(self, backward: Callable[[list[Any]], list[Any]], op: str) -> None:
        self.backward: Callable[[list[Any]], list[Any]] | None = backward
        self.op = op

    def __call__(self, grads: list[Any]) -> list[Any]:
        self.refuse_again(None)
        backward, self.backward = self.backward, None  # what it holds is freed once it ran
        return backward(grads)

    def refuse_again(self, grad: Any) -> None:
        """A hook of each output: RuntimeError once the backward ran (else the gradient passes)."""
        if self.backward is None:
            raise RuntimeError(
                f"{self.op}: backward through it ran already: a second backward() through the same graph "
                "(retain_graph=True) is not supported by Paddle's PyLayer, which records every unicoll "
                "operator on Paddle tensors and frees its context after the first (Paddle 3.3.1 then crashes "
                "the process); run the forward again"
            )


def _differentiate(run: Callable[[list[Any]], tuple[list[Any], Callable]], inputs: list[Any], op: str) -> list[Any]:
    """``run(inputs)``'s outputs recorded by a PyLayer whose backward is the one ``run``
    returns, refused a second time (:class:`_Once`); an input among the outputs, changed in
    place, is recorded in place, as Paddle's in-place operators are."""
    outputs, backward = run(inputs)
    if not outputs:  # nothing autograd records (a Task's outputs are linked when it is waited for)
        return []
    once = _Once(backward, op)
    linked = _layer().apply(*inputs, (list(outputs), once))
    linked = [linked] if len(outputs) == 1 else list(linked)
    for output in linked:
        output.register_hook(once.refuse_again)
    return linked


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
    autograd=True,
    needs_grad=_needs_grad,
    is_leaf=_is_leaf,
    mark_written=_mark_written,
    differentiate=_differentiate,
    grad_hint="under paddle.no_grad()",
)
"""PaddlePaddle 3's ``paddle.Tensor`` (parameters included), on the CPU or a CUDA device."""
