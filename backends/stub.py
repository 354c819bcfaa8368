"""A backend that runs everything of a call except the transfer: for timing the front end.

:class:`StubTransport` wraps a running backend. Its ``alltoallv``, ``all_gather_even``,
``allreduce``, ``reduce_scatter_even`` and ``bcast`` move nothing (the output keeps what it
held); every other primitive (the small int exchanges and reads included), and the conversion
of arrays, is the wrapped backend's. The
operators are the ones :class:`~unicoll.backends.base.Backend` composes from the primitives,
so a backend's own fused operators are not run. The front end installs it only through
:func:`unicoll.runtime.transport_stubbed`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from unicoll.backends.base import Work
from unicoll.backends.wrapped import Wrapped

if TYPE_CHECKING:
    from unicoll.group import Group


class StubTransport(Wrapped):
    """``inner`` with its byte-moving primitives replaced by ones that do nothing.

    >>> stub = StubTransport(backend)  # doctest: +SKIP
    >>> stub.alltoallv(out, x, [4], [4], group, False) is None  # out is left as it was  # doctest: +SKIP
    True
    """

    def alltoallv(
        self,
        out: Any,
        x: Any,
        out_splits: list[int],
        in_splits: list[int],
        group: Group,
        async_op: bool,
        calc_stream: bool = False,
    ) -> Work | None:
        return None

    def all_gather_even(self, out: Any, x: Any, group: Group, async_op: bool, calc_stream: bool = False) -> Work | None:
        return None

    def allreduce(self, x: Any, op: str, group: Group, async_op: bool, calc_stream: bool = False) -> Work | None:
        return None

    def reduce_scatter_even(
        self, out: Any, x: Any, op: str, group: Group, async_op: bool, calc_stream: bool = False
    ) -> Work | None:
        return None

    def bcast(self, x: Any, src: int, group: Group, async_op: bool, calc_stream: bool = False) -> Work | None:
        return None
