"""The rendezvous store of cupy-nccl: set/get across clients, waiting, timeouts, bad frames."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from unicoll.backends.store import StoreClient, StoreServer


@pytest.fixture
def server():
    started = StoreServer("127.0.0.1", 0)
    yield started
    started.close()


def test_a_value_set_by_one_client_is_read_by_another(server) -> None:
    a, b = StoreClient("127.0.0.1", server.port, 5), StoreClient("127.0.0.1", server.port, 5)
    a.set("id/0", bytes(range(128)))
    assert b.get("id/0") == bytes(range(128))
    b.set("id/0", b"")  # replaced, and empty values are fine
    assert a.get("id/0") == b""
    a.close(), b.close()


def test_get_waits_until_the_key_is_set(server) -> None:
    reader, writer = StoreClient("127.0.0.1", server.port, 5), StoreClient("127.0.0.1", server.port, 5)
    got = []
    thread = threading.Thread(target=lambda: got.append(reader.get("late")))
    thread.start()
    time.sleep(0.2)
    assert not got, "get returned before the key was set"
    writer.set("late", b"now")
    thread.join(5)
    assert got == [b"now"]


def test_get_times_out_naming_the_key(server) -> None:
    client = StoreClient("127.0.0.1", server.port, 0.3)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"waiting for 'never' timed out after 0.3 s"):
        client.get("never")
    assert time.monotonic() - start < 3


def test_a_client_waits_for_the_server_to_listen() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    servers = []
    threading.Timer(0.3, lambda: servers.append(StoreServer("127.0.0.1", port))).start()
    client = StoreClient("127.0.0.1", port, 5)
    client.set("k", b"v")
    assert client.get("k") == b"v"
    servers[0].close()


def test_connecting_to_nobody_times_out() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(RuntimeError, match="timed out after 0.3 s: rank 0 is not listening"):
        StoreClient("127.0.0.1", port, 0.3)


def test_the_server_listens_on_the_address_it_is_given(server) -> None:
    assert server._listener.getsockname()[0] == "127.0.0.1"


def test_a_foreign_or_oversized_frame_drops_only_that_connection(server) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as raw:
        raw.sendall(b"S" + (10**9).to_bytes(4, "big"))  # a key length far over the limit
        assert raw.recv(1) == b"", "the server should close the connection"
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as raw:
        raw.sendall(b"X")
        assert raw.recv(1) == b""
    client = StoreClient("127.0.0.1", server.port, 5)
    client.set("still", b"works")
    assert client.get("still") == b"works"


def test_a_closed_server_fails_a_waiting_get(server) -> None:
    client = StoreClient("127.0.0.1", server.port, 5)
    threading.Timer(0.2, server.close).start()
    with pytest.raises(RuntimeError, match="rendezvous store: 'gone'"):
        client.get("gone")
