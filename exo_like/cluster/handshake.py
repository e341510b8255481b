"""Link set-up: the first frames on a new peer websocket, before either side trusts the other.

The acceptor says Hello (a nonce and its peer protocol number); the dialer checks the number first, then proves
it holds the cluster key (Auth: an HMAC over both nonces); the acceptor proves the same back with its NodeInfo
(Welcome); the dialer answers with its own (Info). Either side sends Refused, with a reason, instead.

The protocol number is read from each frame before the frame is decoded (protocol.handshake_protocol): a peer
of another exo-like version may send frames this one cannot decode, and is told which versions met rather than
that its frame is malformed. Versions before protocol numbers send none and are refused the same way.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass
from typing import TypeVar

import aiohttp
from aiohttp import web

from exo_like import __version__
from exo_like.cluster.node_info import NodeInfo
from exo_like.cluster.protocol import Auth, Hello, Info, Message, Refused, Welcome, decode, encode, handshake_protocol

HANDSHAKE_TIMEOUT = 5.0
KEY_ADVICE = "set the same --cluster-key (or EXO_LIKE_CLUSTER_KEY) on every node"
KEY_MISMATCH = "cluster key mismatch"  # the reason an acceptor gives; dialers of every version look for it
VERSION_MISMATCH = "different exo-like versions"

WebSocket = web.WebSocketResponse | aiohttp.ClientWebSocketResponse
M = TypeVar("M", bound=Message)


class HandshakeRefused(Exception):
    def __init__(self, message: str, code: str = "handshake_failed"):
        super().__init__(message)
        self.code = code  # as in LinkProblem.code


def _proof(key: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(key, role + b"|" + first + b"|" + second, hashlib.sha256).digest()


def _protocol_mismatch(theirs: int | None, their_version: str | None, ours: int) -> HandshakeRefused:
    spoken = f"peer protocol {theirs} (exo-like {their_version})" if theirs is not None else \
        "no peer protocol number (an older exo-like)"
    return HandshakeRefused(f"different exo-like versions: it speaks {spoken}, this node peer protocol "
                            f"{ours} (exo-like {__version__}); run the same exo-like version on every node",
                            "version_mismatch")


@dataclass(frozen=True)
class Handshake:
    """One side's credentials for link set-up. Raises HandshakeRefused (with a LinkProblem code) when the peer
    is refused or refuses; ProtocolError, ConnectionError or asyncio.TimeoutError when set-up breaks down."""

    me: NodeInfo
    key: bytes  # sha256 of the cluster key
    protocol: int
    max_frame_bytes: int

    async def dial(self, ws: aiohttp.ClientWebSocketResponse) -> NodeInfo:
        """The dialer's side: returns the acceptor's NodeInfo once both hold the key."""
        data = await self._receive(ws)
        _, theirs, their_version = handshake_protocol(data, self.max_frame_bytes)
        if theirs != self.protocol:
            await self._refuse(ws)
            raise _protocol_mismatch(theirs, their_version, self.protocol)
        hello = self._expect(decode(data, self.max_frame_bytes), Hello)
        nonce = os.urandom(16)
        await self._send(ws, Auth(nonce, self.protocol, __version__, _proof(self.key, b"dialer", hello.nonce, nonce)))
        answer = decode(await self._receive(ws), self.max_frame_bytes)
        if isinstance(answer, Refused):
            raise self._refusal(answer)
        welcome = self._expect(answer, Welcome)
        if not hmac.compare_digest(welcome.proof, _proof(self.key, b"acceptor", nonce, hello.nonce)):
            raise HandshakeRefused(f"it does not hold this cluster's key ({KEY_ADVICE})", "key_mismatch")
        await self._send(ws, Info(self.me.to_dict()))
        return NodeInfo.from_dict(welcome.info)

    async def accept(self, ws: web.WebSocketResponse) -> NodeInfo:
        """The acceptor's side: returns the dialer's NodeInfo once both hold the key."""
        nonce = os.urandom(16)
        await self._send(ws, Hello(nonce, self.protocol, __version__))
        data = await self._receive(ws)
        kind, theirs, their_version = handshake_protocol(data, self.max_frame_bytes)
        if theirs != self.protocol:
            if kind != Refused.type:  # a dialer too old to check the hello's number itself: tell it why
                await self._refuse(ws)
            raise _protocol_mismatch(theirs, their_version, self.protocol)
        auth = decode(data, self.max_frame_bytes)
        if not isinstance(auth, Auth):
            raise HandshakeRefused("no authentication offered")
        if not hmac.compare_digest(auth.proof, _proof(self.key, b"dialer", nonce, auth.nonce)):
            await self._send(ws, Refused(KEY_MISMATCH))
            raise HandshakeRefused(f"{KEY_MISMATCH}: it holds a different cluster key ({KEY_ADVICE})", "key_mismatch")
        await self._send(ws, Welcome(self.me.to_dict(), _proof(self.key, b"acceptor", auth.nonce, nonce)))
        info = self._expect(decode(await self._receive(ws), self.max_frame_bytes), Info)
        return NodeInfo.from_dict(info.info)

    def _refusal(self, refused: Refused) -> HandshakeRefused:
        """What the acceptor's Refused means for this side."""
        if refused.protocol is not None:
            return _protocol_mismatch(refused.protocol, refused.version, self.protocol)
        if refused.reason == KEY_MISMATCH:
            return HandshakeRefused(f"refused: it holds a different cluster key ({KEY_ADVICE})", "key_mismatch")
        return HandshakeRefused(f"refused: the peer says {refused.reason}")

    @staticmethod
    def _expect(message: Message, kind: type[M]) -> M:
        if not isinstance(message, kind):
            raise HandshakeRefused(f"link set-up went wrong: a {message.type} frame where a {kind.type} belongs")
        return message

    async def _refuse(self, ws: WebSocket) -> None:
        """Tell the other side why (with our protocol and version, so it can say which versions met)."""
        await self._send(ws, Refused(f"{VERSION_MISMATCH}: this node speaks peer protocol {self.protocol} "
                                     f"(exo-like {__version__})", self.protocol, __version__))

    async def _send(self, ws: WebSocket, message: Message) -> None:
        await ws.send_bytes(encode(message, self.max_frame_bytes))

    @staticmethod
    async def _receive(ws: WebSocket) -> bytes:
        msg = await ws.receive(timeout=HANDSHAKE_TIMEOUT)
        if msg.type != aiohttp.WSMsgType.BINARY:
            raise ConnectionError(f"handshake interrupted ({msg.type.name})")
        return msg.data
