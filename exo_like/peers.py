"""Peer links: one long-lived websocket per pair of nodes, on the node's single HTTP port.

Set-up is a mutual HMAC challenge-response over the cluster key, so a node never learns anything about (or
accepts work from) a peer that does not hold the same key. Only then do both sides exchange NodeInfo.
Frames are msgpack maps (see wire.py). aiohttp's websocket heartbeat detects a silent peer in ~1.5 s; a
killed process is noticed at once because its sockets close.

Before that, both sides compare their peer protocol numbers (wire.PROTOCOL): nodes of exo-like versions that
would misread each other's frames refuse the link and say which versions met. Every failed dial and refused
peer is recorded, with its reason, in `problems` (shown in GET /v1/cluster and on the dashboard).

When two nodes dial each other at the same time, both keep the link dialed by the smaller node id, so they
always agree on which one survives. The other link is retired, not cut: each side sends a last `retire` frame on
it and reads it until the other's `retire` arrives, so no frame already on its way is lost (a peer that does not
retire it in time is cut off entirely and relinked, so nothing it sends can vanish unnoticed). A dial of an
address where a linked peer already listens makes no second link at all.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
from typing import Any, Awaitable, Callable

import aiohttp
from aiohttp import web

from exo_like import __version__
from exo_like.link_problems import LinkProblems
from exo_like.node_info import NodeInfo
from exo_like.wire import DEFAULT_MAX_FRAME_BYTES, PROTOCOL, FrameError, decode_frame, encode_frame

log = logging.getLogger(__name__)

PEER_PATH = "/v1/peer"
HEARTBEAT_SECONDS = 1.0
HANDSHAKE_TIMEOUT = 5.0
# A dial to an address that drops packets (firewall, machine gone) would otherwise hang for aiohttp's default
# 30 s, holding up the finder's redial round for every other peer; a peer on a LAN or VPN answers well within this.
CONNECT_TIMEOUT = 3.0
CLOSE_REFUSED = 4001
# How long a retired duplicate link waits for the other side's `retire`. A peer that has not said it by then still
# sends on that link, and what it sends after the close would vanish: so the peer's current link is cut as well,
# both sides see the peer lost (requests through it fail at once, clearly) and the finder links them afresh.
RETIRE_GRACE_SECONDS = 5.0


class LinkRetired(ConnectionError):
    """The link was replaced by a duplicate link to the same peer: send on the peer's current link instead."""


def cluster_key_digest(cluster_key: str) -> str:
    """Public fingerprint of the key (for mDNS TXT records): tells clusters apart without revealing the key."""
    return hashlib.sha256(b"exo-like cluster id|" + cluster_key.encode()).hexdigest()[:16]


def _proof(key: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(key, role + b"|" + first + b"|" + second, hashlib.sha256).digest()


class HandshakeRefused(Exception):
    def __init__(self, message: str, code: str = "handshake_failed"):
        super().__init__(message)
        self.code = code  # as in LinkProblem.code


KEY_ADVICE = "set the same --cluster-key (or EXO_LIKE_CLUSTER_KEY) on every node"


def _protocol_mismatch(theirs: Any, their_version: Any, ours: int) -> HandshakeRefused:
    spoken = f"peer protocol {theirs} (exo-like {their_version})" if theirs is not None else \
        "no peer protocol number (an older exo-like)"
    return HandshakeRefused(f"different exo-like versions: it speaks {spoken}, this node peer protocol "
                            f"{ours} (exo-like {__version__}); run the same exo-like version on every node",
                            "version_mismatch")


def _dial_failure(exc: BaseException) -> tuple[str, str]:
    """Why a dial failed, in words a user can act on: (code, reason)."""
    if isinstance(exc, aiohttp.WSServerHandshakeError):
        return "not_exo_like", f"not an exo-like node (HTTP {exc.status} where its peer link should be)"
    if isinstance(exc, aiohttp.ClientConnectorError):
        errno = exc.os_error.errno
        detail = os.strerror(errno) if errno else str(exc.os_error)  # "Connection refused", "No route to host"
        return "unreachable", f"cannot connect ({detail}): check that exo-like runs there and that its port is " \
                              "open in the firewall"
    if isinstance(exc, asyncio.TimeoutError):
        return "unreachable", "no answer in time: a firewall dropping the traffic, or the machine is down"
    return "handshake_failed", f"link set-up failed: {exc or type(exc).__name__}"


MessageHandler = Callable[["PeerLink", dict[str, Any]], Awaitable[None]]


class PeerLink:
    def __init__(self, remote: NodeInfo, ws: web.WebSocketResponse | aiohttp.ClientWebSocketResponse,
                 dialer_id: str, address: str, max_frame_bytes: int):
        self.remote = remote
        self.ws = ws
        self.dialer_id = dialer_id
        self.address = address  # host:port as seen from this side
        self.max_frame_bytes = max_frame_bytes
        self._send_lock = asyncio.Lock()
        self.retired = False  # this side sends nothing more on it: a duplicate link to the same peer is kept
        self.peer_retired = False  # the other side said the same: nothing more will arrive on it
        self.read_ended = asyncio.Event()  # its read loop is over: the peer's retire came, or the link closed

    @property
    def closed(self) -> bool:
        return self.ws.closed

    async def send(self, message: dict[str, Any]) -> None:
        """Send one frame. Raises ConnectionError if the link is gone (LinkRetired if it was replaced),
        FrameError if the frame is too big."""
        data = encode_frame(message, self.max_frame_bytes)
        async with self._send_lock:
            if self.retired:
                raise LinkRetired(f"link to {self.remote.node_id} was replaced")
            if self.ws.closed:
                raise ConnectionError(f"link to {self.remote.node_id} is closed")
            await self.ws.send_bytes(data)

    async def send_retire(self) -> None:
        """The last frame this side sends on the link (after every frame whose send began before it was retired)."""
        async with self._send_lock:
            if not self.ws.closed:
                await self.ws.send_bytes(encode_frame({"type": "retire"}))

    async def close(self) -> None:
        await self.ws.close()


class PeerNetwork:
    """All links of this node: accepts on PEER_PATH, dials on request, routes frames to one handler."""

    def __init__(self, me: NodeInfo, cluster_key: str, handler: MessageHandler,
                 on_change: Callable[[], None], max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES):
        self.me = me
        self._key = hashlib.sha256(cluster_key.encode()).digest()
        self._handler = handler
        self._on_change = on_change
        self.max_frame_bytes = max_frame_bytes
        self.links: dict[str, PeerLink] = {}
        self.problems = LinkProblems(me.node_id)
        self.protocol = PROTOCOL
        self._dialing: set[str] = set()
        self._retired: set[PeerLink] = set()  # duplicates being drained before they close
        self._own_addresses: set[str] = set()  # addresses that turned out to reach this node itself
        self._tasks: set[asyncio.Task] = set()
        self._session: aiohttp.ClientSession | None = None

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get(PEER_PATH, self.accept)

    def linked(self, node_id: str) -> bool:
        link = self.links.get(node_id)
        return link is not None and not link.closed

    async def send(self, node_id: str, message: dict[str, Any]) -> None:
        link = self.links.get(node_id)
        if link is None:
            raise ConnectionError(f"no link to node {node_id}")
        try:
            await link.send(message)
        except LinkRetired:  # replaced while this send waited for its turn: the frame goes on the new link
            current = self.links.get(node_id)
            if current is None or current is link:
                raise
            await current.send(message)

    # -- dialing ------------------------------------------------------------------------------------------

    async def dial(self, host: str, port: int) -> PeerLink | None:
        """Connect and authenticate; returns the live link, or None if refused, unreachable or to ourselves."""
        address = f"{host}:{port}"
        if address in self._dialing or address in self._own_addresses:
            return None  # a `--peers` list shared by every node names this node too: dial it once, not forever
        already = self._link_listening_at(host, port)
        if already is not None:
            return already  # it dialed in first: a second link would only replace this one
        self._dialing.add(address)
        try:
            return await self._dial(host, port, address)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, FrameError, KeyError, ValueError) as exc:
            self.problems.note(host, port, *_dial_failure(exc))
            return None
        except HandshakeRefused as exc:
            self.problems.note(host, port, exc.code, str(exc))
            return None
        finally:
            self._dialing.discard(address)

    async def _dial(self, host: str, port: int, address: str) -> PeerLink | None:
        session = await self._client_session()
        ws = await session.ws_connect(f"http://{address}{PEER_PATH}", heartbeat=HEARTBEAT_SECONDS,
                                      max_msg_size=self.max_frame_bytes,
                                      timeout=aiohttp.ClientWSTimeout(ws_close=2.0))
        try:
            remote = await self._dialer_handshake(ws)
        except BaseException:
            await ws.close()
            raise
        link = PeerLink(remote, ws, self.me.node_id, address, self.max_frame_bytes)
        if remote.node_id == self.me.node_id:
            self._own_addresses.add(address)
            await ws.close()
            return None
        self._spawn(self._read_loop(link))
        if not self._register(link):
            self._retire(link)  # the other side may have kept this one for a moment and sent on it
            return self.links.get(remote.node_id)
        self.problems.clear(remote.node_id, (host, port))
        return link

    def _link_listening_at(self, host: str, port: int) -> PeerLink | None:
        for link in self.links.values():
            if not link.closed and not link.retired and (link.remote.host, link.remote.port) == (host, port):
                return link
        return None

    async def _dialer_handshake(self, ws: aiohttp.ClientWebSocketResponse) -> NodeInfo:
        hello = await self._receive(ws)
        if hello.get("protocol") != self.protocol:
            await self._refuse(ws, "different exo-like versions")
            raise _protocol_mismatch(hello.get("protocol"), hello.get("version"), self.protocol)
        nonce = os.urandom(16)
        await ws.send_bytes(encode_frame({"type": "auth", "nonce": nonce, "protocol": self.protocol,
                                          "version": __version__,
                                          "proof": _proof(self._key, b"dialer", hello["nonce"], nonce)}))
        welcome = await self._receive(ws)
        if welcome["type"] == "refused":
            if "protocol" in welcome:
                raise _protocol_mismatch(welcome["protocol"], welcome.get("version"), self.protocol)
            if welcome.get("reason") == "cluster key mismatch":
                raise HandshakeRefused(f"refused: it holds a different cluster key ({KEY_ADVICE})", "key_mismatch")
            raise HandshakeRefused(f"refused: the peer says {welcome.get('reason')}")
        if not hmac.compare_digest(welcome["proof"], _proof(self._key, b"acceptor", nonce, hello["nonce"])):
            raise HandshakeRefused(f"it does not hold this cluster's key ({KEY_ADVICE})", "key_mismatch")
        await ws.send_bytes(encode_frame({"type": "info", "info": self.me.to_dict()}))
        return NodeInfo.from_dict(welcome["info"])

    # -- accepting ----------------------------------------------------------------------------------------

    async def accept(self, request: web.Request) -> web.StreamResponse:
        ws = web.WebSocketResponse(heartbeat=HEARTBEAT_SECONDS, max_msg_size=self.max_frame_bytes)
        await ws.prepare(request)
        address = f"{request.remote}"
        try:
            remote = await self._acceptor_handshake(ws, address)
        except HandshakeRefused as exc:
            log.warning("node %s: refused peer at %s: %s", self.me.node_id, address, exc)
            self.problems.note(address, None, exc.code, f"it dialed this node and was refused: {exc}")
            await ws.close(code=CLOSE_REFUSED, message=b"refused")
            return ws
        except (asyncio.TimeoutError, FrameError, KeyError, ValueError, TypeError, ConnectionError) as exc:
            log.info("node %s: handshake with %s failed: %s", self.me.node_id, address, exc)
            await ws.close()
            return ws
        link = PeerLink(remote, ws, remote.node_id, address, self.max_frame_bytes)
        if remote.node_id == self.me.node_id:
            await ws.close()
            return ws
        if self._register(link):
            # A failed dial of this peer (e.g. made before it started) is recorded under the address dialed,
            # which is its listening port at the host it advertises or at the host it dialed in from.
            self.problems.clear(remote.node_id, (address, None), (remote.host, remote.port), (address, remote.port))
        else:
            self._retire(link)  # the other side may have kept this one for a moment and sent on it
        await self._read_loop(link)
        return ws

    async def _acceptor_handshake(self, ws: web.WebSocketResponse, address: str) -> NodeInfo:
        nonce = os.urandom(16)
        await ws.send_bytes(encode_frame({"type": "hello", "nonce": nonce, "protocol": self.protocol,
                                          "version": __version__}))
        auth = await self._receive(ws)
        if auth.get("type") == "refused" and "protocol" in auth:
            raise _protocol_mismatch(auth["protocol"], auth.get("version"), self.protocol)
        if auth.get("protocol") != self.protocol:  # a dialer too old to check the hello's protocol itself
            await self._refuse(ws, "different exo-like versions")
            raise _protocol_mismatch(auth.get("protocol"), auth.get("version"), self.protocol)
        if auth.get("type") != "auth" or not isinstance(auth.get("proof"), bytes):
            raise HandshakeRefused("no authentication offered")
        if not hmac.compare_digest(auth["proof"], _proof(self._key, b"dialer", nonce, auth["nonce"])):
            await ws.send_bytes(encode_frame({"type": "refused", "reason": "cluster key mismatch"}))
            raise HandshakeRefused(f"cluster key mismatch: it holds a different cluster key ({KEY_ADVICE})",
                                   "key_mismatch")
        await ws.send_bytes(encode_frame({"type": "welcome", "info": self.me.to_dict(),
                                          "proof": _proof(self._key, b"acceptor", auth["nonce"], nonce)}))
        info = await self._receive(ws)
        return NodeInfo.from_dict(info["info"])

    async def _refuse(self, ws: web.WebSocketResponse | aiohttp.ClientWebSocketResponse, reason: str) -> None:
        """Tell the other side why (with our protocol and version, so it can say which versions met)."""
        await ws.send_bytes(encode_frame({"type": "refused", "reason": f"{reason}: this node speaks peer protocol "
                                          f"{self.protocol} (exo-like {__version__})", "protocol": self.protocol,
                                          "version": __version__}))

    async def _receive(self, ws: web.WebSocketResponse | aiohttp.ClientWebSocketResponse) -> dict[str, Any]:
        msg = await ws.receive(timeout=HANDSHAKE_TIMEOUT)
        if msg.type != aiohttp.WSMsgType.BINARY:
            raise ConnectionError(f"handshake interrupted ({msg.type.name})")
        return decode_frame(msg.data, self.max_frame_bytes)

    # -- link lifetime ------------------------------------------------------------------------------------

    def _register(self, link: PeerLink) -> bool:
        """Make a new authenticated link the peer's current one; False if it is the losing duplicate."""
        remote_id = link.remote.node_id
        existing = self.links.get(remote_id)
        if existing is not None and not existing.closed:
            preferred_dialer = min(self.me.node_id, remote_id)
            if link.dialer_id != preferred_dialer or existing.dialer_id == preferred_dialer:
                return False
            self._retire(existing)
        self.links[remote_id] = link
        log.info("node %s: linked with %s (%s) at %s", self.me.node_id, remote_id, link.remote.name, link.address)
        self._on_change()
        return True

    def _retire(self, link: PeerLink) -> None:
        """Stop sending on a duplicate link; close it once the other side has said it sends nothing more."""
        if link.retired:
            return
        link.retired = True
        self._retired.add(link)
        self._spawn(self._drain_and_close(link))

    async def _drain_and_close(self, link: PeerLink) -> None:
        try:
            await link.send_retire()
            if not link.peer_retired:
                await asyncio.wait_for(link.read_ended.wait(), RETIRE_GRACE_SECONDS)
        except asyncio.TimeoutError:
            log.warning("node %s: %s did not retire a duplicate link in %.0f s; relinking", self.me.node_id,
                        link.remote.node_id, RETIRE_GRACE_SECONDS)
            current = self.links.get(link.remote.node_id)
            if current is not None:
                self._spawn(current.close())
        except (ConnectionError, OSError):
            pass  # closed under us: the peer went away, and its current link with it
        finally:
            self._retired.discard(link)
            await link.close()

    async def _read_loop(self, link: PeerLink) -> None:
        try:
            async for msg in link.ws:
                if msg.type != aiohttp.WSMsgType.BINARY:
                    continue
                try:
                    message = decode_frame(msg.data, self.max_frame_bytes)
                except FrameError as exc:
                    log.warning("node %s: bad frame from %s: %s", self.me.node_id, link.remote.node_id, exc)
                    break
                if message["type"] == "retire":
                    link.peer_retired = True
                    if link.retired:
                        break  # both sides are done with it
                    continue  # this side still uses it until its duplicate registers here
                try:
                    await self._handler(link, message)
                except Exception:  # a bug in one handler must not cut the link for every request on it
                    log.exception("node %s: error handling %s from %s", self.me.node_id, message.get("type"),
                                  link.remote.node_id)
        finally:
            link.read_ended.set()
            await link.close()
            if self.links.get(link.remote.node_id) is link:
                del self.links[link.remote.node_id]
                log.info("node %s: lost link with %s (%s)", self.me.node_id, link.remote.node_id,
                         link.ws.exception() or "closed")
                self._on_change()

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)  # strong reference until done
        task.add_done_callback(self._tasks.discard)

    async def _client_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # The timeouts bound the connect and the websocket upgrade only, not the link's life afterwards.
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(
                total=CONNECT_TIMEOUT + HANDSHAKE_TIMEOUT, sock_connect=CONNECT_TIMEOUT))
        return self._session

    async def close(self) -> None:
        for link in [*self.links.values(), *self._retired]:
            await link.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
