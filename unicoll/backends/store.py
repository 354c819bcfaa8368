"""A small TCP key-value store for the rendezvous of backends that do not use torch's.

Rank 0 serves it on a socket bound to ``MASTER_ADDR:MASTER_PORT`` (loopback unless another
address is named); every rank, rank 0 included, talks to it through a :class:`StoreClient`.
It carries a few small values (NCCL unique ids), never array data. Keys and values are
raw bytes in length-prefixed frames: nothing received is unpickled or evaluated.

Frames (lengths are 4-byte big-endian): a request is ``b"S"`` + key + value (set) or
``b"G"`` + key (get, which waits until the key is set); the answer to a set is ``b"K"``,
to a get the value.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from .rendezvous import listen

MAX_KEY = 1024
MAX_VALUE = 1 << 20
_LENGTH = struct.Struct(">I")


def _read_exact(conn: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("connection closed by peer")
        data += chunk
    return bytes(data)


def _read_frame(conn: socket.socket, limit: int) -> bytes:
    (n,) = _LENGTH.unpack(_read_exact(conn, _LENGTH.size))
    if n > limit:
        raise ValueError(f"a frame of {n} bytes, over the limit of {limit}")
    return _read_exact(conn, n)


def _frame(data: bytes) -> bytes:
    return _LENGTH.pack(len(data)) + data


class StoreServer:
    """Serves the store on ``addr:port`` from background threads until :meth:`close`."""

    def __init__(self, addr: str, port: int) -> None:
        self._listener = listen(addr, port)
        self._values: dict[bytes, bytes] = {}
        self._changed = threading.Condition()
        self._closed = False
        self._connections: list[socket.socket] = []
        threading.Thread(target=self._accept, name="unicoll-store", daemon=True).start()

    @property
    def port(self) -> int:
        """The port it listens on (useful when it was started on port 0)."""
        return self._listener.getsockname()[1]

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed
                return
            with self._changed:
                if self._closed:
                    conn.close()
                    return
                self._connections.append(conn)
            threading.Thread(target=self._serve, args=(conn,), name="unicoll-store-client", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                op = _read_exact(conn, 1)
                if op not in (b"S", b"G"):
                    return  # not our protocol: drop the connection
                key = _read_frame(conn, MAX_KEY)
                if op == b"S":
                    value = _read_frame(conn, MAX_VALUE)
                    with self._changed:
                        self._values[key] = value
                        self._changed.notify_all()
                    conn.sendall(b"K")
                else:
                    value = self._wait_for(key)
                    if value is None:
                        return
                    conn.sendall(_frame(value))
        except (OSError, ValueError):
            return
        finally:
            conn.close()

    def _wait_for(self, key: bytes) -> bytes | None:
        """The value under ``key`` once it is set; None when the server closes first."""
        with self._changed:
            self._changed.wait_for(lambda: key in self._values or self._closed)
            return None if self._closed else self._values[key]

    def close(self) -> None:
        """Stop serving: the listening socket and every connection are closed."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
            connections, self._connections = self._connections, []
        self._listener.close()
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()


class StoreClient:
    """One connection to the store; ``timeout`` (seconds) bounds connecting and every get."""

    def __init__(self, addr: str, port: int, timeout: float) -> None:
        self._timeout = timeout
        deadline = time.monotonic() + timeout
        while True:  # rank 0 may not be listening yet
            try:
                self._conn = socket.create_connection((addr, port), timeout=max(0.01, deadline - time.monotonic()))
                break
            except (ConnectionRefusedError, TimeoutError) as exc:
                if time.monotonic() >= deadline:
                    raise RuntimeError(
                        f"rendezvous at {addr}:{port} timed out after {timeout:g} s: rank 0 is not listening ({exc})"
                    ) from None
                time.sleep(0.05)
        self._conn.settimeout(timeout)
        self._lock = threading.Lock()

    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key`` (replacing any earlier value)."""
        with self._lock, self._failures(key):
            self._conn.sendall(b"S" + _frame(key.encode()) + _frame(value))
            if _read_exact(self._conn, 1) != b"K":
                raise ConnectionError("unexpected answer to a set")

    def get(self, key: str) -> bytes:
        """The value under ``key``, waiting until some rank sets it (at most the timeout)."""
        with self._lock, self._failures(key):
            self._conn.sendall(b"G" + _frame(key.encode()))
            return _read_frame(self._conn, MAX_VALUE)

    @contextmanager
    def _failures(self, key: str) -> Iterator[None]:
        """Socket errors as RuntimeErrors that say what failed; the connection is closed after
        one, since an answer may still be on its way."""
        try:
            yield
        except TimeoutError:
            self._conn.close()
            raise RuntimeError(
                f"rendezvous store: waiting for {key!r} timed out after {self._timeout:g} s; "
                "a rank may not have reached the same call"
            ) from None
        except (OSError, ValueError) as exc:
            self._conn.close()
            raise RuntimeError(f"rendezvous store: {key!r}: {exc}") from exc

    def close(self) -> None:
        """Close the connection."""
        self._conn.close()
