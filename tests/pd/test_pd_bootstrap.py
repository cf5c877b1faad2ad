"""The rendezvous channel: framed JSON over real sockets on 127.0.0.1, every wait bounded, a closed
peer seen at once; and the package's lazy names."""

from __future__ import annotations

import importlib
import socket
import struct

import pytest

import sparsekv.srt.disaggregation as disaggregation
from sparsekv.srt.disaggregation.bootstrap import Channel, PeerClosedError, b64, listen, unb64


@pytest.fixture
def pair():
    server = listen()
    client = Channel.connect(server.getsockname(), timeout_s=5)
    accepted, _ = server.accept()
    peer = Channel(accepted)
    yield client, peer
    client.close()
    peer.close()
    server.close()


def test_messages_round_trip_in_order(pair):
    client, peer = pair
    blob = bytes(range(256)) * 3
    client.send({"op": "hello", "agent": b64(blob)})
    client.send({"op": "transfer", "room": 7, "kv_indices": list(range(1000))})
    first, second = peer.recv(5), peer.recv(5)
    assert unb64(first["agent"]) == blob
    assert second == {"op": "transfer", "room": 7, "kv_indices": list(range(1000))}


def test_both_ends_send_at_once(pair):
    # Nagle on either end holds a message back until the previous one is acknowledged: a stream
    # of status messages then waits for delayed ACKs (40 ms each on Linux).
    assert all(ch.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for ch in pair)


def test_waits_are_bounded_and_a_closed_peer_is_seen(pair):
    client, peer = pair
    with pytest.raises(TimeoutError):
        peer.recv(0.05)
    client.close()
    with pytest.raises(PeerClosedError):
        peer.recv(5)


def test_an_oversized_or_non_object_frame_is_refused(pair):
    client, peer = pair
    client.sock.sendall(struct.pack(">I", 1 << 30))
    with pytest.raises(ValueError, match="exceeds"):
        peer.recv(5)


def test_nobody_listening_is_a_connection_error():
    server = listen()
    address = server.getsockname()
    server.close()
    with pytest.raises(ConnectionError):
        Channel.connect(address, timeout_s=2)


def test_every_lazy_name_resolves():
    for name in disaggregation.__all__:
        value = getattr(disaggregation, name)
        # A class or function keeps its own name; a table (ENGINES) is the module's object of that name.
        assert getattr(value, "__name__", name) == name
        module = importlib.import_module(f"sparsekv.srt.disaggregation.{disaggregation._LAZY[name]}")
        assert value is getattr(module, name)
    with pytest.raises(AttributeError):
        disaggregation.no_such_name  # noqa: B018
