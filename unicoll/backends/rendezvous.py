"""Where the ranks of a multi-process world meet: ``MASTER_ADDR:MASTER_PORT``, read once.

Shared by the torch.distributed backends (whose TCPStore binds there) and ``cupy-nccl``
(whose own key-value store does); neither imports a framework here.
"""

from __future__ import annotations

import ipaddress
import os
import socket


def master_address(world_size: int) -> tuple[str, int]:
    """``(MASTER_ADDR, MASTER_PORT)``; RuntimeError naming the missing variable."""
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"unicoll.init: environment variable {missing[0]} is not set; with WORLD_SIZE={world_size} "
            "every rank needs MASTER_ADDR and MASTER_PORT (`unicoll run` and torchrun set them)"
        )
    raw = os.environ["MASTER_PORT"]
    try:
        port = int(raw)
    except ValueError:
        raise RuntimeError(f"unicoll.init: $MASTER_PORT: expected a port number, got {raw!r}") from None
    return os.environ["MASTER_ADDR"], port


def listen(addr: str, port: int) -> socket.socket:
    """A listening socket bound to ``addr:port`` itself, so a loopback address (the launcher's
    default) is never reachable from another machine."""
    return socket.create_server((addr, port))


def is_loopback(addr: str) -> bool:
    """Whether ``addr`` (a name or an IP address) resolves to a loopback address."""
    try:
        return ipaddress.ip_address(socket.gethostbyname(addr)).is_loopback
    except (OSError, ValueError):
        return False
