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
back (a Task dropped) is simply freed with its last reference.

A result handed to the caller is memory lent too, through :meth:`Workspace.lend_until_freed`:
an array that gives its buffer back by itself once it, and every array and tensor made from
it, is garbage (a ``weakref.finalize``; numpy keeps such an array as the base of every view of
it, and a tensor made by ``torch.from_numpy`` keeps the array). The caller holds its result as
long as it likes; the step after, its memory serves the next result without faulting in again.

The workspace keeps buffers that are not lent up to its bound, the oldest dropped first, and
never one of the caller's arrays. The bound is the larger of :data:`MAX_BYTES` and the most it
had lent at once over its last :data:`WINDOW` loans: a step whose rows need more than
:data:`MAX_BYTES` at once keeps them for the next step, as a step does again and again in a
training loop, and a workspace never keeps more than what was in use at its recent peak (a
loan dropped unreturned, a Task never waited for, stops counting once it is garbage); after
:data:`WINDOW` loans of smaller steps, the bound is back to :data:`MAX_BYTES`, and so are the
buffers kept; and a kept buffer that no loan took over the last :data:`IDLE_LOANS` loans
goes, whatever the bound, so the buffers of one large step leave once smaller steps follow (a
large buffer serves no small loan, see below). Every loan counts, one of fewer than
:data:`FROM_BYTES` too, which the caller makes from fresh memory and only reports
(:meth:`Workspace.count_fresh`); and a kept buffer serves only a loan of at least about half
its size, so a large step's buffers never serve a smaller step's loans, which would keep them
lent, counted at the peak, step after step.

Buffers are numpy ``uint8`` arrays, made by numpy, which asks the kernel for huge pages for
arrays this large, so even a first use faults in a fraction of the pages.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque

import numpy as np

MAX_BYTES = 256 * 2**20
"""The least a workspace may keep of buffers not lent, whatever its recent peak
(docs/performance.md): a MoE step of 64 MiB of dispatched rows keeps about 200 MiB (the rows
sent, received, and sent back, and one row per token)."""

WINDOW = 64
"""The loans over which a workspace remembers the most it had lent at once (its bound above
:data:`MAX_BYTES`): a MoE step lends a few buffers, so this spans several steps."""

IDLE_LOANS = 4 * WINDOW
"""The loans after which a kept buffer that none of them took is dropped, however little the
workspace keeps: long enough for a buffer that one layer of a deep model uses once a step to
serve the next step, short enough that a large step's buffers, which no smaller loan takes,
leave within a few dozen steps of a MoE layer."""

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
        self._free: list[tuple[np.ndarray, int]] = []  # (buffer, loans made before it was kept), oldest first
        self._loans = 0  # loans made so far, count_fresh's included
        self._freed: deque[np.ndarray] = deque()  # given back by results that became garbage
        self._lent: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()
        """The buffers lent now, by id: one dropped unreturned leaves by itself once garbage."""
        self._peaks: deque[int] = deque(maxlen=WINDOW)  # the bytes lent at once after each loan
        self._closed = False
        self._lock = threading.Lock()

    @property
    def kept_bytes(self) -> int:
        """The bytes of the buffers kept, not lent."""
        return sum(buffer.nbytes for buffer, _ in self._free) + sum(buffer.nbytes for buffer in self._freed)

    @property
    def bound(self) -> int:
        """The most the workspace keeps: :attr:`max_bytes`, or more where it had more lent at
        once over its last :data:`WINDOW` loans (0 once cleared).

        >>> ws = Workspace(max_bytes=2**20)
        >>> loans = [ws.lend(2**20) for _ in range(3)]
        >>> ws.bound == sum(loan.nbytes for loan in loans)
        True
        """
        return 0 if self._closed else max(self.max_bytes, max(self._peaks, default=0))

    def lend(self, nbytes: int) -> np.ndarray:
        """A 1-D ``uint8`` buffer of at least ``nbytes`` bytes (contents undefined), the caller's
        alone until it gives it back: the smallest kept one that is large enough and at most
        twice the size of a new one, else a new one.

        >>> ws = Workspace(max_bytes=2**30)
        >>> large = ws.lend(2**24); ws.give_back(large)
        >>> ws.lend(2**22) is large, ws.lend(2**23 + 1) is large   # not for a loan of a quarter
        (False, True)
        """
        largest = 2 * _rounded(nbytes)
        with self._lock:
            self._take_freed()
            fitting = [i for i, (buffer, _) in enumerate(self._free) if nbytes <= buffer.nbytes <= largest]
            buffer = self._free.pop(min(fitting, key=lambda i: self._free[i][0].nbytes))[0] if fitting else None
        if buffer is None:
            buffer = np.empty(_rounded(nbytes), dtype=np.uint8)
        with self._lock:
            self._lent[id(buffer)] = buffer
            self._counted(0)
        return buffer

    def count_fresh(self, nbytes: int) -> None:
        """Count a loan of ``nbytes`` that the caller makes from fresh memory instead (fewer than
        :data:`FROM_BYTES`): it takes its place in the window all the same, so that steps too
        small to borrow bring the bound, and the buffers kept, back down.

        >>> ws = Workspace(max_bytes=2**20)
        >>> ws.give_back(ws.lend(2**24))
        >>> for _ in range(WINDOW):
        ...     ws.count_fresh(1000)
        >>> ws.bound, ws.kept_bytes
        (1048576, 0)
        """
        with self._lock:
            self._counted(nbytes)

    def lend_until_freed(self, nbytes: int) -> np.ndarray:
        """A 1-D ``uint8`` array of ``nbytes`` bytes (contents undefined) for a result: its
        buffer comes back to the workspace once the array, and everything made from it, is
        garbage. Its base is a memoryview, not the buffer, so that numpy makes every view of it
        a view of the array itself.

        >>> ws = Workspace(max_bytes=2**20)
        >>> result = ws.lend_until_freed(1000)
        >>> part = result[:10]; del result; ws.kept_bytes   # a view still uses the memory
        0
        >>> del part; ws.lend(1000).nbytes, ws.kept_bytes   # gone: the next call gets the buffer
        (65536, 0)
        """
        buffer = self.lend(nbytes)
        array = np.frombuffer(memoryview(buffer)[:nbytes], dtype=np.uint8)
        weakref.finalize(array, self._freed_by_result, buffer).atexit = False
        return array

    def _freed_by_result(self, buffer: np.ndarray) -> None:
        """Take back a result's buffer, unless the workspace was cleared for good."""
        if not self._closed:
            self._freed.append(buffer)

    def give_back(self, buffer: np.ndarray) -> None:
        """Keep ``buffer`` (from :meth:`lend`, no longer read or written) for a later call;
        the oldest kept buffers go first when the workspace would hold more than its bound."""
        with self._lock:
            self._lent.pop(id(buffer), None)
            self._free.append((buffer, self._loans))
            self._take_freed()
            self._trim()

    def _counted(self, nbytes: int) -> None:
        """Record the bytes lent at once after a loan (``nbytes`` more than the buffers lent
        now), then keep to the bound."""
        self._take_freed()
        lent = sum(buffer.nbytes for buffer in self._lent.values()) if self._lent else 0
        self._peaks.append(nbytes + lent)
        self._loans += 1
        self._trim()

    def _take_freed(self) -> None:
        """Keep the buffers that results gave back. The results' finalizers only append to a
        deque: they may run in any thread, at any allocation, this one's included."""
        while self._freed:
            buffer = self._freed.popleft()
            self._lent.pop(id(buffer), None)
            self._free.append((buffer, self._loans))

    def _trim(self) -> None:
        """Drop the kept buffers that no loan took over the last :data:`IDLE_LOANS` loans, then the
        oldest while the workspace holds more than its bound (which is at least
        :attr:`max_bytes`: the window is read only past that)."""
        idle_since = self._loans - IDLE_LOANS
        if self._free and self._free[0][1] < idle_since:  # the oldest first: is any idle that long?
            self._free = [(buffer, kept_at) for buffer, kept_at in self._free if kept_at >= idle_since]
        kept = sum(buffer.nbytes for buffer, _ in self._free)
        if kept <= self.max_bytes:
            return
        bound = self.bound
        while kept > bound:
            kept -= self._free.pop(0)[0].nbytes

    def clear(self) -> None:
        """Let go of every kept buffer, for good: buffers given back later are dropped (lent
        ones are their borrowers' until then). The backend's ``finalize`` calls this."""
        with self._lock:
            self._closed = True
            self.max_bytes = 0
            self._free.clear()
            self._freed.clear()
