"""Exceptions raised by unicoll, the transport errors that backends raise, and how the front end
reports those: by their type (:func:`reported`, :func:`translated`), never by their words."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ParamSpec, TypeVar

_P = ParamSpec("_P")
_R = TypeVar("_R")


class NotInitializedError(RuntimeError, ValueError):
    """An operator or query was called before :func:`unicoll.init` (or after ``finalize``).

    It is a ``RuntimeError`` (a state problem) and a ``ValueError`` (what torch.distributed
    raises in the same situation), so either ``except`` clause catches it.
    """


class BackendUnavailableError(RuntimeError):
    """The requested backend is unknown or cannot run on this machine."""


def bad_input(op: str, param: str, expected: str, given: object, error: type[Exception] = ValueError) -> Exception:
    """Build the exception for a bad argument: ``"<op>: <param>: expected <...>, got <...>"``.

    >>> str(bad_input("all_gather", "tensor", "an array", 3, TypeError))
    'all_gather: tensor: expected an array, got 3'
    """
    return error(f"{op}: {param}: expected {expected}, got {given}")


class CommunicationError(RuntimeError):
    """A collective failed in the transport; the message names the operator and the group."""


class PeerLostError(CommunicationError):
    """A rank of the group is gone (its process died or closed its connections)."""


class CollectiveTimeoutError(CommunicationError, TimeoutError):
    """A collective did not complete within the configured timeout."""


class IntegrityError(CommunicationError):
    """Verification (``init(verify=...)``) found that a block arrived different from what its
    sender sent, or a reduction's result inconsistent with its inputs; the message names the
    operator, the group, the call, and the sending and receiving ranks. Raised on every rank
    of the group alike."""


class CrossRankMismatchError(ValueError):
    """Check mode found arguments that disagree between ranks (raised on every rank)."""


class TransportError(RuntimeError):
    """What a backend raises for a failure of its transport. Every backend converts its
    library's exceptions into this class (a failure of no particular kind) or one of its
    subclasses (a kind) where it calls the library (:func:`converting`), so that the front end
    tells the kinds apart by type (:func:`reported`). Not raised to users: the front end
    reports it as the :class:`CommunicationError` of its kind."""


class TransportPeerLostError(TransportError):
    """What a backend raises when a peer is gone: its process exited or closed the connection
    (reported as :class:`PeerLostError`)."""


class TransportTimeoutError(TransportError):
    """What a backend raises when a transfer or the rendezvous did not complete in time
    (reported as :class:`CollectiveTimeoutError`)."""


def reported(exc: TransportError, op: str, group: object, timeout: float) -> CommunicationError:
    """The :class:`CommunicationError` that reports ``exc``, raised by a backend while running
    ``op`` on ``group``: its kind by ``exc``'s type, followed by the first line of its message.

    >>> str(reported(TransportTimeoutError("gloo: timed out"), "barrier", "Group(ranks=[0, 1])", 5.0))[:60]
    'barrier on Group(ranks=[0, 1]): did not complete within the '
    """
    text = str(exc)
    first_line = text.splitlines()[0] if text else type(exc).__name__
    if isinstance(exc, TransportPeerLostError):
        return PeerLostError(
            f"{op} on {group}: a peer is gone (its process exited or closed the connection): {first_line}"
        )
    if isinstance(exc, TransportTimeoutError):
        return CollectiveTimeoutError(
            f"{op} on {group}: did not complete within the timeout of {timeout:g} s "
            f"(init(timeout=...) or $UNICOLL_TIMEOUT); a peer may not have called it: {first_line}"
        )
    return CommunicationError(f"{op} on {group}: the transport failed: {first_line}")


@contextmanager
def translated(op: str, group: object, timeout: float) -> Iterator[None]:
    """A :class:`TransportError` inside the block leaves it as the :class:`CommunicationError`
    that :func:`reported` makes of it (``exc`` chained as its ``__cause__``); every other
    exception (bugs, bad input, unicoll's own errors) passes through unchanged."""
    try:
        yield
    except TransportError as exc:
        raise reported(exc, op, group, timeout) from exc


def init_error(
    exc: TransportError, backend: str, rank: int, world_size: int, timeout: float, hint: str
) -> CommunicationError:
    """What ``init`` raises for ``exc``, raised while rank ``rank`` of ``world_size`` started
    ``backend``: the :class:`CommunicationError` naming ``init`` and the backend, and ``hint``
    (what to check).

    >>> str(init_error(TransportTimeoutError("store: timed out"), "gloo", 1, 2, 5.0, "check rank 0"))[:80]
    "init on backend 'gloo' (rank 1 of 2): did not complete within the timeout of 5 s"
    """
    error = reported(exc, "init", f"backend {backend!r} (rank {rank} of {world_size})", timeout)
    return type(error)(f"{error}; {hint}")


def converting(convert: Callable[[Exception], TransportError | None]) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """A decorator for the functions at a backend's boundary: an exception raised inside that
    ``convert`` (the backend's knowledge of its library) turns into a :class:`TransportError`
    leaves as that error, chained to it; a :class:`TransportError` and every exception that
    ``convert`` maps to None pass through unchanged."""

    def decorate(fn: Callable[_P, _R]) -> Callable[_P, _R]:
        @functools.wraps(fn)
        def converted(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            try:
                return fn(*args, **kwargs)
            except TransportError:
                raise
            except Exception as exc:
                error = convert(exc)
                if error is None:
                    raise
                raise error from exc

        return converted

    return decorate
