"""Host memory lent to one call at a time and kept for the next, bounded in bytes.

The MoE operators move each step's rows through intermediate buffers as large as the rows
themselves: the rows in send order, the rows received before they are reordered, the rows sent
back before they are summed. Fresh host memory of that size costs more than the copy that fills
it (glibc returns allocations of more than a few megabytes to the kernel on ``free``, and every
new page faults in once more), so a backend keeps the buffers of one call for the next
(:attr:`unicoll.backends.base.Backend.workspace`).

A buffer is *lent*: :meth:`Workspace.lend` takes one out of the workspace, and only
:meth:`Workspace.give_back` puts it back, once nothing will read or write it again (a transfer
completed, a sum done). A buffer never comes back while lent, so two calls in flight at once,
a Task not waited for yet or another thread, each hold their own; a buffer that is never given
back (a Task dropped) is simply freed with its last reference. A result handed to the caller is
never lent memory. The workspace keeps at most :data:`MAX_BYTES` of buffers that are not lent;
buffers are numpy ``uint8`` arrays, made by numpy, which asks the kernel for huge pages for
arrays this large, so even a first use faults in a fraction of the pages.
"""

from __future__ import annotations

import threading

import numpy as np

MAX_BYTES = 256 * 2**20
"""The most a workspace keeps of buffers not lent (docs/performance.md): a MoE step of 64 MiB of
dispatched rows keeps about 200 MiB (the rows sent, received, and sent back, and one row per token)."""

FROM_BYTES = 1 << 20
"""Calls move rows of fewer bytes through fresh memory: small arrays come from the allocator's
own free lists, which is as fast as the workspace's bookkeeping."""

_ALIGN = 1 << 16
"""Buffers are made in sizes rounded up to 1/16 of a power of two (and to this), so a buffer made
for one step serves the next, whose rows differ by a few percent as the routing changes."""


def _rounded(nbytes: int) -> int:
    """``nbytes`` rounded up to the size a new buffer gets (at most 1/16 more, at least :data:`_ALIGN`).

    >>> _rounded(1), _rounded(1_000_000), _rounded(2**26 + 1)
    (65536, 1048576, 71303168)
    """
    step = max(_ALIGN, (1 << max(0, nbytes.bit_length() - 1)) // 16)
    return -(-nbytes // step) * step


class Workspace:
    """Buffers of host memory lent one call at a time; at most ``max_bytes`` kept when not lent.

    >>> ws = Workspace(max_bytes=2**20)
    >>> a = ws.lend(1000)
    >>> a.dtype, a.nbytes >= 1000
    (dtype('uint8'), True)
    >>> ws.give_back(a); ws.lend(500) is a   # the smallest kept buffer that is large enough
    True
    """

    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._free: list[np.ndarray] = []  # oldest first
        self._lock = threading.Lock()

    @property
    def kept_bytes(self) -> int:
        """The bytes of the buffers kept, not lent."""
        return sum(buffer.nbytes for buffer in self._free)

    def lend(self, nbytes: int) -> np.ndarray:
        """A 1-D ``uint8`` buffer of at least ``nbytes`` bytes (contents undefined), the caller's
        alone until it gives it back: the smallest kept one that is large enough, else a new one."""
        with self._lock:
            fitting = [i for i, buffer in enumerate(self._free) if buffer.nbytes >= nbytes]
            if fitting:
                return self._free.pop(min(fitting, key=lambda i: self._free[i].nbytes))
        return np.empty(_rounded(nbytes), dtype=np.uint8)

    def give_back(self, buffer: np.ndarray) -> None:
        """Keep ``buffer`` (from :meth:`lend`, no longer read or written) for a later call;
        the oldest kept buffers go first when the workspace would hold more than its bound."""
        with self._lock:
            self._free.append(buffer)
            kept = self.kept_bytes
            while kept > self.max_bytes:
                kept -= self._free.pop(0).nbytes

    def clear(self) -> None:
        """Let go of every kept buffer (lent ones are their borrowers')."""
        with self._lock:
            self._free.clear()
