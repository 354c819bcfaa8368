"""The static-shape MoE operators inside ``jax.jit``: the layout in ``jax.numpy``, the transfers
as ordered host callbacks.

Every shape of ``moe.dispatch_static``, ``redispatch_static`` and ``combine_static`` follows
from the arguments' shapes, so inside ``jax.jit`` they run as the device path of
:mod:`unicoll.eager.static_moe` runs on NCCL: the layout (:mod:`unicoll.static_layout`), the
gathers, the padding and the weighted sum are ``jax.numpy`` operations that JAX traces and
differentiates itself, and the rows and counts travel in even all-to-alls, each an ordered
``io_callback`` into the eager ``alltoall_single`` on host arrays, whose ``custom_vjp`` sends the
gradient back the same way (alltoall_single's backward with W equal blocks). The ranks run their
callbacks in program order, so every rank must run the same jitted steps; ``jax.grad`` through
them equals the eager operators' gradients.

A callback that fails raises what the eager operator raises (a lost peer's PeerLostError naming
the operator, the ended session's ValueError); JAX hands the caller a ``JaxRuntimeError`` with
its text, and :func:`unicoll.libraries.jax.jit_errors` raises the exception itself again.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import runtime
from ..backends.base import Backend
from ..eager import ops
from ..eager.static_moe import refuse_drops
from ..entry import exclusive_as
from ..errors import CommunicationError, TransportError, bad_input, reported, translated
from ..group import Group
from ..libraries.jax import failed_in_callback
from ..spec import OpSpec
from ..static_layout import (
    StaticHandle,
    combine_blocks,
    dispatch_arrived,
    dispatch_outgoing,
    redispatch_blocks,
)
from ..validate import read_only

_STATIC = ("moe.dispatch_static", "moe.redispatch_static", "moe.combine_static")


def call(name: str, spec: OpSpec, arguments: dict[str, Any]) -> Any:
    """The operator ``name`` inside ``jax.jit``: a static-shape MoE operator, traced."""
    if name not in _STATIC:
        raise TypeError(
            f"{name}: inside jax.jit only {', '.join(_STATIC)} run (their shapes follow from their "
            f"arguments'); call {name} outside jax.jit"
        )
    if arguments.get("sync_op") is False:
        raise TypeError(f"{name}: sync_op: expected True inside jax.jit (a Task cannot be traced), got False")
    handle = arguments.get("handle")
    if handle is not None and not (isinstance(handle, StaticHandle) and handle.library == "jax"):
        raise TypeError(f"{name}: handle: expected a handle moe.dispatch_static returned inside the same jax.jit")
    if handle is not None:
        arguments["group"] = handle.group
    call = read_only(spec, arguments)
    xp = sys.modules["jax"].numpy
    if name == "moe.dispatch_static":
        return _dispatch(xp, call, arguments)
    exchange = _exchange(name, call.group)
    if name == "moe.redispatch_static":
        return redispatch_blocks(xp, arguments["x"], handle.layout, handle.world, handle.experts_per_rank, exchange)
    return combine_blocks(xp, arguments["y"], handle.layout, handle.weights, handle.world, handle.experts_per_rank,
                          exchange)  # fmt: skip


def _dispatch(xp: Any, call: Any, arguments: dict[str, Any]) -> tuple[Any, Any, StaticHandle]:
    world, experts, capacity, name = call.W, call.experts_per_rank, call.capacity, "moe.dispatch_static"
    x, weights = arguments["x"], arguments["topk_weights"]
    out = dispatch_outgoing(xp, x, arguments["topk_idx"], world, experts, capacity)
    if call.overflow == "error":
        _refuse_drops(out.layout.demand, call.group, capacity)
    exchange = _exchange(name, call.group)
    arrived = dispatch_arrived(xp, exchange(out.rows), exchange(out.counts), world, experts)
    handle = StaticHandle.of_blocks(call.group, experts, capacity, weights, x, out.layout, arrived)
    return arrived.rows, arrived.counts, handle


def _host(name: str, group: Group, body: Callable[..., Any]) -> Callable[..., Any]:
    """``body(backend, *arrays)`` as a host callback of the operator ``name`` on ``group``: under
    the lock, refused once the session the step was traced in ended, a lost peer or a timeout
    reported as the eager operator reports it; what it raises is remembered for
    :func:`~unicoll.libraries.jax.jit_errors`."""

    @exclusive_as(name)
    def run(*arrays: Any) -> Any:
        state = runtime.state(name)
        if group.ended is not None:
            expected = "a group of the running session (jax.clear_caches() traces a jax.jit step again)"
            raise bad_input(name, "group", expected, f"the one the step was traced with: {group.ended}")
        try:
            with translated(name, group, state.timeout):
                return body(state.backend, *arrays)
        except CommunicationError as exc:  # alltoall_single's: named after the operator, as eager calls are
            if not isinstance(exc.__cause__, TransportError):
                raise
            raise reported(exc.__cause__, name, group, state.timeout) from exc.__cause__

    def host(*arrays: Any) -> Any:
        failed_in_callback(None)
        try:
            return run(*arrays)
        except Exception as exc:
            failed_in_callback(exc)
            raise

    return host


def _exchange(name: str, group: Group) -> Callable[[Any], Any]:
    """The exchange of the operator ``name`` on ``group``: the even all-to-all of an array's
    rows (W equal blocks), as an ordered host callback, whose gradient travels back the same way."""
    jax = sys.modules["jax"]

    def exchanged(backend: Backend, block: np.ndarray) -> np.ndarray:
        block = np.ascontiguousarray(block)
        bits = block.view(np.float16) if block.dtype.name == "bfloat16" else block  # numpy has no bfloat16: bits
        if backend.host_memory:
            return ops.alltoall_single(None, bits, group=group).view(block.dtype)
        import torch  # a device transport moves device arrays: the block goes to this rank's GPU and back

        sent = torch.from_numpy(np.require(bits, requirements="W")).to(f"cuda:{torch.cuda.current_device()}")
        return ops.alltoall_single(None, sent, group=group).cpu().numpy().view(block.dtype)

    host = _host(name, group, exchanged)

    def transfer(a: Any) -> Any:
        return jax.experimental.io_callback(host, jax.ShapeDtypeStruct(a.shape, a.dtype), a, ordered=True)

    @jax.custom_vjp
    def exchange(a: Any) -> Any:
        return transfer(a)

    def forward(a: Any) -> tuple[Any, None]:
        return transfer(a), None

    def backward(_: None, grad: Any) -> tuple[Any]:
        if grad.dtype == jax.dtypes.float0:  # integer rows (the counts) have no gradient
            return (grad,)
        return (transfer(grad),)

    exchange.defvjp(forward, backward)
    return exchange


def _refuse_drops(demand: Any, group: Group, capacity: int) -> None:
    """``overflow="error"`` inside jax.jit: an ordered callback that raises the eager mode's
    ValueError on every rank when any rank routes more than ``capacity`` slots to an expert."""
    jax = sys.modules["jax"]

    def refused(backend: Backend, wanted: np.ndarray) -> None:
        refuse_drops(backend, group, np.asarray(wanted, dtype=np.int64), capacity)

    jax.experimental.io_callback(_host("moe.dispatch_static", group, refused), None, demand, ordered=True)
