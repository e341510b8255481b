"""The control channel from a group's leader to each follower: one TCP connection per follower, opened by the
leader's worker first thing (the group's formation goes through it: where the rendezvous store listens, or MLX's
ring addresses), both sides proving they hold the cluster key (an HMAC over both sides' fresh nonces, the group's
name and the follower's rank) before anything else crosses it.

The collective backends' own connections (gloo's store and pairs, MLX's ring) are not authenticated: see
docs/tensor-parallel.md."""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import time

NONCE_BYTES = 16
CONNECT_TIMEOUT = 60.0  # the follower may still be importing its framework


class ControlRefused(ConnectionError):
    pass


def _proof(key: bytes, role: bytes, group: str, rank: int, first: bytes, second: bytes) -> bytes:
    return hmac.new(key, b"|".join((role, group.encode(), str(rank).encode(), first, second)), hashlib.sha256).digest()


def _exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ControlRefused("the other side closed the control channel during set-up")
        data += chunk
    return data


def _authenticate(sock: socket.socket, key: bytes, group: str, rank: int, role: bytes, other: bytes) -> None:
    mine = os.urandom(NONCE_BYTES)
    sock.sendall(mine)
    theirs = _exactly(sock, NONCE_BYTES)
    sock.sendall(_proof(key, role, group, rank, theirs, mine))
    expected = _proof(key, other, group, rank, mine, theirs)
    if not hmac.compare_digest(_exactly(sock, len(expected)), expected):
        raise ControlRefused(f"the other side of group {group}'s control channel does not hold the cluster key")


def dial_follower(address: tuple[str, int], key: bytes, group: str, rank: int,
                  timeout: float = CONNECT_TIMEOUT) -> socket.socket:
    """The leader's side: connect (retrying until the follower listens) and authenticate."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection(address, timeout=max(0.1, deadline - time.monotonic()))
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    try:
        _authenticate(sock, key, group, rank, b"leader", b"follower")
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def listen(address: tuple[str, int]) -> socket.socket:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(address)
    server.listen(4)
    return server


def accept_leader(server: socket.socket, key: bytes, group: str, rank: int,
                  timeout: float = CONNECT_TIMEOUT) -> socket.socket:
    """A follower's side: the first connection that proves the key (others are dropped) until `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        server.settimeout(max(0.1, deadline - time.monotonic()))
        sock, _ = server.accept()  # socket.timeout (an OSError) once the deadline passes
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            _authenticate(sock, key, group, rank, b"follower", b"leader")
        except (ControlRefused, OSError):
            sock.close()
            if time.monotonic() > deadline:
                raise
            continue
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
