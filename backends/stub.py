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

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from unicoll.backends.base import Backend, Work

if TYPE_CHECKING:
    from unicoll.group import Group


class StubTransport(Backend):
    """``inner`` with its byte-moving primitives replaced by ones that do nothing.

    >>> stub = StubTransport(backend)  # doctest: +SKIP
    >>> stub.alltoallv(out, x, [4], [4], group, False) is None  # out is left as it was  # doctest: +SKIP
    True
    """

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.name = inner.name
        self.capabilities = inner.capabilities
        self.rank = inner.rank
        self.world_size = inner.world_size
        self.workspace = inner.workspace

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

    def to_native(self, x: Any) -> Any:
        return self.inner.to_native(x)

    def from_native(self, t: Any, library: str) -> Any:
        return self.inner.from_native(t, library)

    def empty_rows(self, like: Any, rows: int) -> Any:
        return self.inner.empty_rows(like, rows)

    def take_rows(self, x: Any, index: np.ndarray, out: Any | None = None) -> Any:
        return self.inner.take_rows(x, index, out)

    def new_group(self, ranks: Sequence[int]) -> Any:
        return self.inner.new_group(ranks)

    def barrier(self, group: Group) -> None:
        self.inner.barrier(group)

    @property
    def host_memory(self) -> bool:
        return self.inner.host_memory

    def exchange_ints(self, values: np.ndarray, group: Group) -> np.ndarray:
        return self.inner.exchange_ints(values, group)

    def exchange_native_ints(self, values: Any, group: Group) -> Any:
        return self.inner.exchange_native_ints(values, group)

    def read_ints(self, values: Any) -> np.ndarray:
        return self.inner.read_ints(values)

    def gather_ints(self, values: np.ndarray, group: Group) -> np.ndarray:
        return self.inner.gather_ints(values, group)

    def finalize(self) -> None:
        self.inner.finalize()
