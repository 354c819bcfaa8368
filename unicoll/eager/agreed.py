"""An all_reduce whose calls the ranks compared once, ahead of time: issued without the
per-call handshake, so issuing it never waits for the peers. For gradient buckets issued from
backward hooks (:class:`unicoll.nn.GradientReducer`), where a call that waited for its peers at
issue could wait on a rank that is inside another collective."""

from __future__ import annotations

from typing import Any

from ..entry import exclusive_as
from ..group import Group
from ..runtime import resolve_group, state
from ..task import Task
from .ops import issued_task


@exclusive_as("all_reduce")
def all_reduce_agreed(tensor: Any, op: str, group: Group) -> Task:
    """``all_reduce(tensor, op, group, sync_op=False)`` on a torch tensor or numpy array the
    caller made (no autograd), in place, issued at once: no handshake and no check mode
    comparison, so every rank must issue the same sequence of these calls on ``group``, of
    the same shapes and dtypes, which the caller has made sure of (and no other operator may
    run on ``group``: its calls pair up in issue order). ``Task.wait()`` raises a
    :class:`~unicoll.CommunicationError` naming ``all_reduce`` within the timeout where a peer
    fails."""
    resolved = resolve_group(group, "all_reduce")
    current = state("all_reduce")

    def issue() -> Any:
        return current.backend.all_reduce(tensor, op, resolved, True)

    return issued_task("all_reduce", resolved, current.timeout, issue, _as_it_is)


def _as_it_is(result: Any) -> Any:
    """The finished transfer's result itself."""
    return result
