"""Where the ranks of a gloo world listen for one another, and how they connect within
``init``'s deadline (the ``gloo`` backend's, :mod:`~unicoll.backends.torch.gloo`).

Left to itself, gloo listens on the address that this machine's host name resolves to, which
is a loopback address in many containers and clouds: its peers on other machines then try to
reach their own loopback and fail. unicoll makes gloo listen on the interface that holds
:func:`route_source` of ``MASTER_ADDR`` instead, the address this machine reaches rank 0 from:
loopback when ``MASTER_ADDR`` is loopback (so a local job stays unreachable from elsewhere), the
interface that leads to rank 0 otherwise (gloo takes that interface's first address).
``GLOO_SOCKET_IFNAME``, when set, still chooses.

gloo connects every pair of ranks when the world's process group is made, and waits up to five
times the group's timeout for a peer's first connection (``Pair::waitUntil`` in
gloo/transport/tcp/pair.h): a peer that cannot reach this rank's address kept ``init`` waiting
far past its timeout. So the ranks first meet at rank 0's store (each leaves the address it
listens on, :func:`~unicoll.backends.rendezvous.arrive`), and the group is then made with a fifth
of the time left; a failure names the address that was not reached and where every rank listens.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from unicoll.backends.torch.errors import torch_boundary, torch_failure
from unicoll.errors import TransportError, TransportTimeoutError

_FIRST_CONNECT_FACTOR = 5
"""How many times its timeout gloo waits for a peer's first connection (see the module)."""


def listen_interface(master_addr: str) -> tuple[str | None, str]:
    """The interface that holds :func:`route_source` of ``master_addr``, for
    :func:`listening_on`, and where gloo will listen, for messages; with ``GLOO_SOCKET_IFNAME``
    set, None (the interfaces it names stay) and those; where no interface holds that address
    (psutil lists none), None: gloo's own choice. TransportError when no route reaches
    ``master_addr``."""
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return None, f"interface {os.environ['GLOO_SOCKET_IFNAME']} (GLOO_SOCKET_IFNAME)"
    import psutil

    from unicoll.backends.rendezvous import route_source  # socket: loaded when a job starts, not with unicoll

    try:
        address = route_source(master_addr)
    except OSError as exc:
        raise TransportError(f"gloo: no route from this machine to MASTER_ADDR {master_addr}: {exc}") from exc
    for interface, addresses in psutil.net_if_addrs().items():
        if any(entry.address == address for entry in addresses):
            return interface, f"{address} (interface {interface})"
    return None, f"gloo's own choice (no interface holds {address}, this machine's address towards {master_addr})"


@contextmanager
def listening_on(interface: str | None) -> Iterator[None]:
    """gloo's groups made in the block listen on ``interface`` (None: where the environment
    says). torch ignores the options given for a gloo group and reads ``GLOO_SOCKET_IFNAME`` as
    it makes each, so that variable is set for the block."""
    if interface is None:
        yield
        return
    os.environ["GLOO_SOCKET_IFNAME"] = interface
    try:
        yield
    finally:
        del os.environ["GLOO_SOCKET_IFNAME"]


@torch_boundary
def connect_world(store: Any, master_addr: str, rank: int, world_size: int, deadline: float) -> str | None:
    """Make torch's default group on gloo from rank 0's ``store`` by ``deadline`` (a
    ``time.monotonic()`` value), listening where :func:`listen_interface` says; return that
    interface, for the groups made later. Every rank must call this. A failure to connect is a
    TransportError (TransportTimeoutError when gloo timed out) that names gloo's own account of it
    (the peer's address it could not reach) and where every rank listens."""
    import torch.distributed as dist

    from unicoll.backends.rendezvous import arrive, remaining

    interface, where = listen_interface(master_addr)
    listening = arrive(store, rank, world_size, where, deadline)
    creation = timedelta(seconds=remaining(deadline) / _FIRST_CONNECT_FACTOR)
    try:
        with listening_on(interface):
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=creation)
    except RuntimeError as exc:
        failure = torch_failure(exc)
        if failure is None:
            raise
        kind = TransportTimeoutError if isinstance(failure, TransportTimeoutError) else TransportError
        text = str(failure).splitlines()[0]
        raise kind(
            f"gloo: rank {rank}, listening on {where}, could not connect with every peer ({text}); "
            f"{_listening_text(listening)}: each rank must reach every other's address (a loopback address "
            "only from its own machine; GLOO_SOCKET_IFNAME names the interface to listen on)"
        ) from exc
    return interface


def _listening_text(listening: list[str]) -> str:
    """Where the ranks listen, by place: ``ranks 0-3 on 10.0.0.1 (interface eth0), rank 4 on ...``."""
    ranks: dict[str, list[int]] = {}
    for rank, where in enumerate(listening):
        ranks.setdefault(where, []).append(rank)
    return ", ".join(
        f"rank{'s' if len(members) > 1 else ''} {_runs(members)} on {where}" for where, members in ranks.items()
    )


def _runs(ranks: list[int]) -> str:
    """Ascending ``ranks`` as runs: ``[0, 1, 2, 5]`` -> ``0-2, 5``."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    return ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)
