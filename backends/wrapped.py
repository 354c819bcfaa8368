"""A backend over another one: what every wrapper of a running backend delegates.

:class:`Wrapped` takes the wrapped backend's name, capability table, rank, size and workspace,
and hands it the conversion of arrays, new rows, groups, the barrier and the small integer
exchanges and reads. A wrapper subclasses it and says only what it changes: the transport that
moves nothing (:class:`~unicoll.backends.stub.StubTransport`), verification
(:class:`~unicoll.verify.VerifiedBackend`), a test's corrupting transport.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from unicoll.backends.base import Backend

if TYPE_CHECKING:
    from unicoll.group import Group


class Wrapped(Backend):
    """A backend that delegates all but what a subclass overrides to ``inner``."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.name = inner.name
        self.capabilities = inner.capabilities
        self.rank = inner.rank
        self.world_size = inner.world_size
        self.workspace = inner.workspace

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
