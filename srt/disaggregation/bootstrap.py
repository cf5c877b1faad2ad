"""Rendezvous and control messages between the prefill and decode side, over TCP sockets.

Mechanism: each prefill PP stage listens on a TCP address (its *bootstrap address*, here always
``127.0.0.1:<port>``); a decode server connects to the bootstrap address of every stage that holds
layers it needs. Messages are JSON objects, each framed by a 4-byte big-endian length; bytes
(engine descriptors) travel base64-encoded. What the messages are is :mod:`.protocol`.

Every receive has a deadline, so a peer that stops answering is an error, not a hang; a peer that
closes its socket (or dies) is seen at once. A thread that waits for a socket to become readable
waits on a :class:`Wakeup` too, so closing wakes it at once (no polling).
"""

from __future__ import annotations

import base64
import json
import select
import socket
import struct
import threading
import time

from sparsekv.srt.disaggregation.messages import ProtocolError

LOOPBACK = "127.0.0.1"
#: The largest frame either side reads (the biggest real message, a 2^20-token room's index lists,
#: is a few MiB); a larger length prefix ends the connection before anything is allocated for it.
MAX_MESSAGE_BYTES = 16 << 20
_HEADER = struct.Struct(">I")


class PeerClosedError(ConnectionError):
    """The other side closed the connection (or its process died)."""


def b64(data: bytes) -> str:
    """``data`` as base64 text."""
    return base64.b64encode(data).decode("ascii")


def unb64(text: str) -> bytes:
    """Inverse of :func:`b64`."""
    return base64.b64decode(text.encode("ascii"))


class Channel:
    """A framed-JSON connection; sends are serialized by a lock, receives have deadlines."""

    def __init__(self, sock: socket.socket) -> None:
        # Both ends, the accepted one too: with Nagle on, a message sent while the previous one
        # is unacknowledged waits for the peer's delayed ACK (40 ms on Linux).
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self._send_lock = threading.Lock()
        self.closed = False

    @classmethod
    def connect(cls, address: tuple[str, int], timeout_s: float) -> Channel:
        """Connect to ``address`` within ``timeout_s``.

        Raises
        ------
        ConnectionError, TimeoutError
            Nobody listens there, or the connection does not open in time.
        """
        return cls(socket.create_connection(address, timeout=timeout_s))

    def send(self, message: dict) -> None:
        """Send one message.

        Raises
        ------
        PeerClosedError
            The connection is gone.
        """
        data = json.dumps(message).encode()
        with self._send_lock:
            try:
                self.sock.sendall(_HEADER.pack(len(data)) + data)
            except OSError as e:
                raise PeerClosedError(f"sparsekv: bootstrap peer is gone: {e}") from e

    def _recv_exact(self, n: int, deadline: float) -> bytes:
        chunks, got = [], 0
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("sparsekv: timed out waiting for the bootstrap peer")
            try:
                self.sock.settimeout(left)
                chunk = self.sock.recv(min(n - got, 1 << 20))
            except TimeoutError as e:
                raise TimeoutError("sparsekv: timed out waiting for the bootstrap peer") from e
            except OSError as e:
                raise PeerClosedError(f"sparsekv: bootstrap peer is gone: {e}") from e
            if not chunk:
                raise PeerClosedError("sparsekv: bootstrap peer closed the connection")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def recv(self, timeout_s: float) -> dict:
        """The next message, waiting at most ``timeout_s``.

        Raises
        ------
        TimeoutError
            Nothing (whole) arrived in time; the stream is then out of step, close it.
        PeerClosedError
            The peer closed the connection.
        ValueError
            A frame over :data:`MAX_MESSAGE_BYTES` (the stream is then out of step, close it).
        ProtocolError
            A whole frame that is not a JSON object (invalid UTF-8 or JSON, nested too deeply, or
            another JSON value); the stream is still in step.
        """
        deadline = time.monotonic() + timeout_s
        (size,) = _HEADER.unpack(self._recv_exact(_HEADER.size, deadline))
        if size > MAX_MESSAGE_BYTES:
            raise ValueError(f"sparsekv: bootstrap message of {size} B exceeds {MAX_MESSAGE_BYTES} B")
        frame = self._recv_exact(size, deadline)
        try:
            message = json.loads(frame)
        except (ValueError, RecursionError) as e:  # RecursionError: JSON nested deeper than the parser's stack
            raise ProtocolError(f"sparsekv: bootstrap message is not JSON: {type(e).__name__}: {str(e):.200}") from None
        if not isinstance(message, dict):
            raise ProtocolError("sparsekv: bootstrap message is not a JSON object")
        return message

    def close(self) -> None:
        """Close the connection (idempotent)."""
        if not self.closed:
            self.closed = True
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.sock.close()


def listen(host: str = LOOPBACK, port: int = 0) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: any free port; read it from ``getsockname()``)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(16)
    return sock


class Wakeup:
    """Wakes the threads that wait for sockets: a socketpair whose read end turns readable, for
    good, once :meth:`set` is called (e.g. on close). Pass it to ``select`` beside the sockets."""

    def __init__(self) -> None:
        self._read, self._write = socket.socketpair()
        self.is_set = False

    def fileno(self) -> int:
        return self._read.fileno()

    def set(self) -> None:
        """Wake every waiter, now and later (idempotent)."""
        if not self.is_set:
            self.is_set = True
            self._write.send(b"\0")

    def wait_readable(self, socks: list, timeout_s: float | None = None) -> list:
        """Block until one of ``socks`` is readable or this is set, at most ``timeout_s`` (None: no
        bound); the readable ones ([] once set, or when the time ran out).

        Raises
        ------
        OSError, ValueError
            A socket was closed under the wait.
        """
        readable, _, _ = select.select([*socks, self], [], [], timeout_s)
        return [] if self.is_set else readable

    def close(self) -> None:
        """Release both ends (after the waiters stopped)."""
        self._read.close()
        self._write.close()


class Doorbell:
    """Wakes one thread that waits for sockets, any number of times: a socketpair whose read end
    turns readable on :meth:`ring` until :meth:`clear`. Pass it to ``select`` beside the sockets."""

    def __init__(self) -> None:
        self._read, self._write = socket.socketpair()
        self._read.setblocking(False)
        self._write.setblocking(False)

    def fileno(self) -> int:
        return self._read.fileno()

    def ring(self) -> None:
        """Make the read end readable (a full pipe is already readable)."""
        try:
            self._write.send(b"\0")
        except (BlockingIOError, OSError):
            pass

    def clear(self) -> None:
        """Consume every ring so far."""
        try:
            while self._read.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        """Release both ends."""
        self._read.close()
        self._write.close()
