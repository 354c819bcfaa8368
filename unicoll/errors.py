"""Exceptions raised by unicoll, and the one helper that formats their messages."""

from __future__ import annotations


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
