"""Exceptions raised by unicoll, and the one helper that formats their messages."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


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


class CrossRankMismatchError(ValueError):
    """Check mode found arguments that disagree between ranks (raised on every rank)."""


class TransportError(RuntimeError):
    """What a backend raises for a failure of its transport (a timeout, a lost peer, an error
    of the library underneath). Not raised to users: the front end reports it as the
    :class:`CommunicationError` its message calls for."""


_PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "connection refused")
_TIMED_OUT = ("timed out", "timeout")


def transport_error(exc: Exception, op: str, group: object, timeout: float) -> CommunicationError:
    """The unicoll error for an exception the transport raised while running ``op`` on ``group``."""
    text = str(exc)
    first_line = text.splitlines()[0] if text else type(exc).__name__
    lowered = text.lower()
    if any(marker in lowered for marker in _PEER_LOST):
        return PeerLostError(
            f"{op} on {group}: a peer is gone (its process exited or closed the connection): {first_line}"
        )
    if any(marker in lowered for marker in _TIMED_OUT):
        return CollectiveTimeoutError(
            f"{op} on {group}: did not complete within the timeout of {timeout:g} s "
            f"(init(timeout=...) or $UNICOLL_TIMEOUT); a peer may not have called it: {first_line}"
        )
    return CommunicationError(f"{op} on {group}: the transport failed: {first_line}")


def init_error(exc: RuntimeError, backend: str, rank: int, world_size: int, timeout: float, hint: str) -> Exception:
    """What ``init`` raises for ``exc``, raised while rank ``rank`` of ``world_size`` started
    ``backend``: the :class:`CommunicationError` naming ``init``, the backend and ``hint`` (what
    to check) when ``exc`` is a transport failure, else ``exc`` itself.

    >>> str(init_error(TransportError("store: timed out"), "gloo", 1, 2, 5.0, "check rank 0"))[:80]
    "init on backend 'gloo' (rank 1 of 2): did not complete within the timeout of 5 s"
    """
    error = reported(exc, "init", f"backend {backend!r} (rank {rank} of {world_size})", timeout)
    if error is exc:
        return exc
    return type(error)(f"{error}; {hint}")


@contextmanager
def translated(op: str, group: object, timeout: float) -> Iterator[None]:
    """Turn a transport failure inside the block into the matching :class:`CommunicationError`.

    Exceptions that are not transport failures (bugs, bad input) pass through unchanged.
    """
    try:
        yield
    except RuntimeError as exc:
        raise reported(exc, op, group, timeout) from exc


def reported(exc: RuntimeError, op: str, group: object, timeout: float) -> Exception:
    """What to raise for ``exc``: its :class:`CommunicationError` when it is a transport
    failure, else ``exc`` itself (bugs and bad input pass through unchanged)."""
    if isinstance(exc, CommunicationError) or not is_transport_failure(exc):
        return exc
    return transport_error(exc, op, group, timeout)


def is_transport_failure(exc: BaseException) -> bool:
    """Whether ``exc`` came from the transport: a backend's :class:`TransportError`,
    torch.distributed's and cupy's NCCL errors, or gloo's messages."""
    if isinstance(exc, TransportError) or any(cls.__name__ in ("DistError", "NcclError") for cls in type(exc).__mro__):
        return True
    text = str(exc).lower()
    return "gloo" in text or any(marker in text for marker in _PEER_LOST + _TIMED_OUT)
