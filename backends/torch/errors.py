"""torch.distributed's exceptions as unicoll's transport errors, for the code that calls torch:
the ``gloo`` and ``torch-nccl`` backends and the rendezvous store (``cupy-nccl``'s too).

What torch 2.13 raises, measured with real processes (``tests/backends/test_torch_errors.py``):

- its TCPStore: ``DistStoreError`` when a wait runs out (a key nobody sets, ranks that never
  join), ``DistNetworkError`` for its sockets, both when connecting times out (``The client
  socket has timed out ...``) and when the other end is gone (``Failed to recv, got 0 bytes.
  Connection was likely closed ...``);
- gloo's process group: a plain ``RuntimeError`` whose text starts with gloo's source location
  (``[.../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer ...`` when
  a peer is gone, ``[.../unbound_buffer.cc:129] Timed out waiting 2000ms ...`` at gloo's
  timeout), then ``Application timeout caused pair closure`` for every later call on a pair
  that timed out; torch's ``Work.wait(timeout)``: ``Operation timed out!`` when the time runs
  out before the work completes;
- NCCL's process group: ``DistBackendError`` (torch's documented type; not measured here,
  without a GPU).

So the type says that an exception is a transport failure where torch gives one, gloo's source
location where it does not, and the text says its kind where one type covers several: that text
is read here, once, and nowhere else in unicoll. Nothing here imports torch until an exception
is classified, by which time torch is loaded.
"""

from __future__ import annotations

from unicoll.errors import TransportError, TransportPeerLostError, TransportTimeoutError, converting

_GLOO_SOURCE = "gloo/"
"""What the text of every exception that gloo raises contains: its source file's path."""

_UNLOCATED = ("Application timeout caused pair closure", "Operation timed out")
"""How the plain RuntimeErrors of the transport that carry no gloo source location start:
gloo's after its timeout, and torch's ``Work.wait(timeout)`` when the time runs out."""

_PEER_GONE = (
    "closed by peer",
    "reset by peer",
    "broken pipe",
    "connection refused",
    "connection was likely closed",
    "remote process exit",
)
"""Words of torch's, gloo's and NCCL's texts for a peer that is gone."""

_TIMED_OUT = ("timed out", "timeout")
"""Words of their texts for a wait that ran out."""


def torch_failure(exc: Exception) -> TransportError | None:
    """The :class:`~unicoll.errors.TransportError` of the kind that ``exc``, raised by
    torch.distributed, reports; None when ``exc`` is not a transport failure (a bug, bad input)."""
    import torch.distributed as dist

    if isinstance(exc, dist.DistStoreError):
        return TransportTimeoutError(str(exc))
    if not isinstance(exc, dist.DistError) and not _from_gloo(exc):
        return None
    text = str(exc)
    lowered = text.lower()
    if any(words in lowered for words in _PEER_GONE):
        return TransportPeerLostError(text)
    if any(words in lowered for words in _TIMED_OUT):
        return TransportTimeoutError(text)
    return TransportError(text)


def _from_gloo(exc: Exception) -> bool:
    """Whether ``exc`` is one of the plain RuntimeErrors of gloo's process group (see the module)."""
    text = str(exc)
    return type(exc) is RuntimeError and (_GLOO_SOURCE in text or text.startswith(_UNLOCATED))


torch_boundary = converting(torch_failure)
"""The decorator of every function that calls torch.distributed on behalf of a backend: torch's
transport failures leave it as :class:`~unicoll.errors.TransportError` kinds."""
