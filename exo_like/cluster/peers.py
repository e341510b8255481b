"""Peer links: one long-lived websocket per pair of nodes, on the node's single HTTP port.

Set-up is a mutual HMAC challenge-response over the cluster key, so a node never learns anything about (or
accepts work from) a peer that does not hold the same key. Only then do both sides exchange NodeInfo.
Before that, both sides compare their peer protocol numbers (protocol.PROTOCOL): nodes of exo-like versions
that would misread each other's frames refuse the link and say which versions met (see handshake.py). Every
failed dial and refused peer is recorded, with its reason, in `problems` (shown in GET /v1/cluster and on the
dashboard). aiohttp's websocket heartbeat detects a silent peer (a frozen process) within --peer-timeout; a killed
process is noticed at once because its sockets close.

Frames are typed messages (protocol.py). A frame that does not decode is refused with a warning and the link
goes on: one bad frame (a bug, a peer of a slightly different build) must not fail every request on the link.

When two nodes dial each other at the same time, both keep the link dialed by the smaller node id, so they
always agree on which one survives. The other link is retired, not cut: each side sends a last `retire` frame on
it and reads it until the other's `retire` arrives, so no frame already on its way is lost (a peer that does not
retire it in time is cut off entirely and relinked, so nothing it sends can vanish unnoticed). A dial of an
address where a linked peer already listens makes no second link at all.

Peer exchange: whenever a node links with a new peer, it tells every linked peer where all its linked peers listen
(PeerAddresses, each as the peer advertises itself), and the finder dials those it is not linked with. So a node
given any one member of a cluster (a bootstrap address, as users give one across subnets and VPNs) links with all
of them, as the plan needs (cluster.py plans only over members linked with each other). The list is sent only on
authenticated links, so only holders of the cluster key can make a node dial anything.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from typing import Any, Awaitable, Callable

import aiohttp
from aiohttp import web

from exo_like.cluster.handshake import HANDSHAKE_TIMEOUT, Handshake, HandshakeRefused
from exo_like.cluster.link_problems import LinkProblems, dial_failure
from exo_like.cluster.node_info import NodeInfo
from exo_like.cluster.protocol import (DEFAULT_MAX_FRAME_BYTES, MAX_MEMBERS, PROTOCOL, Auth, Hello, Info, MemberAddress,
                               Message, PeerAddresses, Ping, Pong, ProtocolError, Refused, Retire, Welcome, decode,
                               encode)

log = logging.getLogger(__name__)

PEER_PATH = "/v1/peer"
# A peer silent this long is lost: its link closes and requests through it replay elsewhere (--peer-timeout).
# aiohttp pings after `heartbeat` seconds without a frame and closes if no pong follows within half that again.
DEFAULT_PEER_TIMEOUT = 1.5
# A dial to an address that drops packets (firewall, machine gone) would otherwise hang for aiohttp's default
# 30 s, holding up the finder's redial round for every other peer; a peer on a LAN or VPN answers well within this.
CONNECT_TIMEOUT = 3.0
CLOSE_REFUSED = 4001
# How long a retired duplicate link waits for the other side's `retire`. A peer that has not said it by then still
# sends on that link, and what it sends after the close would vanish: so the peer's current link is cut as well,
# both sides see the peer lost (requests through it fail at once, clearly) and the finder links them afresh.
RETIRE_GRACE_SECONDS = 5.0
# Refused frames are logged as warnings this many times per link, then at debug level (said once): a peer whose
# every frame is refused (another build, a bug) must not flood the log at its message rate.
REFUSALS_LOGGED_PER_LINK = 5
PING_SECONDS = 2.0  # how often each link's round-trip time is measured
# Every so many Pings one carries this many bytes: its round trip beyond a plain one is the link's transfer time
# (what a prefill's activations cost to send), for an average of 32 KiB/s on the link.
BULK_PING_EVERY = 4
BULK_PING_BYTES = 256 * 1024
_SET_UP = (Hello, Auth, Welcome, Info, Refused)  # link set-up messages: refused once the link is up


def websocket_limit(max_frame_bytes: int) -> int:
    """The websocket's own message size limit, somewhat above the protocol's. A frame between the two is read
    whole and refused by `decode` while the link goes on (a peer configured with a larger frame limit, say).
    One past this limit aiohttp does not read at all: it closes the connection (code 1009, logged by both
    sides), and the finder links the peers afresh. The margin bounds what an oversized frame costs to read."""
    return max_frame_bytes + max(max_frame_bytes // 4, 64 * 1024)


class LinkRetired(ConnectionError):
    """The link was replaced by a duplicate link to the same peer: send on the peer's current link instead."""


def cluster_key_digest(cluster_key: str) -> str:
    """Public fingerprint of the key (for mDNS TXT records): tells clusters apart without revealing the key."""
    return hashlib.sha256(b"exo-like cluster id|" + cluster_key.encode()).hexdigest()[:16]


MessageHandler = Callable[["PeerLink", Message], Awaitable[None]]
AddressesHandler = Callable[[list[MemberAddress]], None]  # members a peer is linked with (never this node)


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
        self.refused_frames = 0  # frames from the peer refused as invalid (see PeerNetwork._message_in)
        self.broken = False  # this side's websocket failed (e.g. a frame past its size limit) and closed it
        self.rtt: float | None = None  # seconds of the last Ping's round trip (GET /metrics)
        self.min_rtt: float | None = None  # the lowest round trip seen: the link's own latency, without queueing
        self.rtt_samples = 0
        self.bulk_sent: set[float] = set()  # clocks of padded Pings not answered yet
        self.min_bulk_rtt: float | None = None  # the lowest round trip of a padded Ping

    @property
    def closed(self) -> bool:
        return self.ws.closed

    async def send(self, message: Message) -> None:
        """Send one message. Raises ConnectionError if the link is gone (LinkRetired if it was replaced),
        ProtocolError if its frame is too big."""
        data = encode(message, self.max_frame_bytes)
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
                await self.ws.send_bytes(encode(Retire()))

    async def close(self) -> None:
        await self.ws.close()


class PeerNetwork:
    """All links of this node: accepts on PEER_PATH, dials on request, routes frames to one handler."""

    def __init__(self, me: NodeInfo, cluster_key: str, handler: MessageHandler,
                 on_change: Callable[[], None], max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                 peer_timeout: float = DEFAULT_PEER_TIMEOUT,
                 on_addresses: AddressesHandler = lambda addresses: None):
        self.me = me
        self.heartbeat = peer_timeout / 1.5
        self._key = hashlib.sha256(cluster_key.encode()).digest()
        self._handler = handler
        self._on_change = on_change
        self._on_addresses = on_addresses
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

    async def send(self, node_id: str, message: Message) -> None:
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
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ProtocolError) as exc:
            self.problems.note(host, port, *dial_failure(exc))
            return None
        except HandshakeRefused as exc:
            self.problems.note(host, port, exc.code, str(exc))
            return None
        finally:
            self._dialing.discard(address)

    async def _dial(self, host: str, port: int, address: str) -> PeerLink | None:
        session = await self._client_session()
        ws = await session.ws_connect(f"http://{address}{PEER_PATH}", heartbeat=self.heartbeat,
                                      max_msg_size=websocket_limit(self.max_frame_bytes),
                                      timeout=aiohttp.ClientWSTimeout(ws_close=2.0))
        try:
            remote = await self._handshake().dial(ws)
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

    # -- accepting ----------------------------------------------------------------------------------------

    async def accept(self, request: web.Request) -> web.StreamResponse:
        ws = web.WebSocketResponse(heartbeat=self.heartbeat, max_msg_size=websocket_limit(self.max_frame_bytes))
        await ws.prepare(request)
        address = f"{request.remote}"
        try:
            remote = await self._handshake().accept(ws)
        except HandshakeRefused as exc:
            log.warning("node %s: refused peer at %s: %s", self.me.node_id, address, exc)
            self.problems.note(address, None, exc.code, f"it dialed this node and was refused: {exc}")
            await ws.close(code=CLOSE_REFUSED, message=b"refused")
            return ws
        except (asyncio.TimeoutError, ProtocolError, ConnectionError) as exc:
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

    def _handshake(self) -> Handshake:
        return Handshake(self.me, self._key, self.protocol, self.max_frame_bytes)

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
        self._spawn(self._ping_forever(link))
        self._share_addresses()
        self._on_change()
        return True

    def member_addresses(self) -> list[MemberAddress]:
        """Where each linked peer listens, as it advertises itself (at most MAX_MEMBERS of them)."""
        remotes = sorted((link.remote for link in self.links.values() if not link.closed and not link.retired),
                         key=lambda remote: remote.node_id)
        return [MemberAddress(r.node_id, r.host, r.port) for r in remotes[:MAX_MEMBERS]]

    def _share_addresses(self) -> None:
        """Tell every linked peer where the others listen (a new peer learns of all of them, they of it)."""
        message = PeerAddresses(tuple(self.member_addresses()))
        for link in list(self.links.values()):
            self._spawn(self._send_quietly(link, message))

    @staticmethod
    async def _send_quietly(link: PeerLink, message: Message) -> None:
        try:
            await link.send(message)
        except (ConnectionError, OSError, ProtocolError):
            pass  # the link is gone or replaced: its successor's registration shares the addresses again

    def _addresses_in(self, link: PeerLink, message: PeerAddresses) -> None:
        """Members a peer is linked with: the finder dials those this node is not linked with."""
        others = [m for m in message.members if m.node_id not in (self.me.node_id, link.remote.node_id)]
        unlinked = [m for m in others if not self.linked(m.node_id)]
        if unlinked:
            log.info("node %s: %s is linked with %s", self.me.node_id, link.remote.node_id,
                     ", ".join(f"{m.node_id} at {m.host}:{m.port}" for m in unlinked))
            self._on_addresses(unlinked)

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
                message = self._message_in(link, msg)
                if message is None:
                    continue
                if isinstance(message, Retire):
                    link.peer_retired = True
                    if link.retired:
                        break  # both sides are done with it
                    continue  # this side still uses it until its duplicate registers here
                if isinstance(message, Ping):
                    self._answer_ping(link, message)
                    continue
                if isinstance(message, PeerAddresses):
                    self._addresses_in(link, message)
                    continue
                try:
                    await self._handler(link, message)
                except Exception:  # a bug in one handler must not cut the link for every request on it
                    log.exception("node %s: error handling %s from %s", self.me.node_id, message.type,
                                  link.remote.node_id)
        finally:
            link.read_ended.set()
            await link.close()
            if self.links.get(link.remote.node_id) is link:
                del self.links[link.remote.node_id]
                self._log_lost(link)
                self._on_change()

    def _answer_ping(self, link: PeerLink, message: Ping) -> None:
        if isinstance(message, Pong):
            rtt = max(0.0, time.monotonic() - message.sent)
            if message.sent in link.bulk_sent:
                link.bulk_sent.discard(message.sent)
                link.min_bulk_rtt = rtt if link.min_bulk_rtt is None else min(link.min_bulk_rtt, rtt)
                return
            link.rtt = rtt
            link.min_rtt = link.rtt if link.min_rtt is None else min(link.min_rtt, link.rtt)
            link.rtt_samples += 1
        elif not link.retired:
            # Quietly: the link may be retired or closed while the Pong waits for its turn (the new link's pings
            # measure it afresh), and nothing awaits this task to hear of it.
            self._spawn(self._send_quietly(link, Pong(message.sent)))

    def bandwidths(self) -> dict[str, float]:
        """Bytes per second each open link carried its fastest padded Ping at, beyond its plain round trip."""
        return {node_id: BULK_PING_BYTES / max(1e-6, link.min_bulk_rtt - link.min_rtt)
                for node_id, link in self.links.items()
                if not link.closed and link.min_bulk_rtt is not None and link.min_rtt is not None}

    def lowest_round_trips(self, samples: int = 1) -> dict[str, float | None]:
        """Each open link's lowest round trip so far (None before `samples` of them), by peer node id."""
        return {node_id: link.min_rtt if link.rtt_samples >= samples else None
                for node_id, link in self.links.items() if not link.closed}

    async def _ping_forever(self, link: PeerLink) -> None:
        """Measure the link's round-trip time every few seconds, for as long as it is this peer's link."""
        pings = 0
        while self.links.get(link.remote.node_id) is link and not link.closed:
            pings += 1
            sent = time.monotonic()
            bulk = pings % BULK_PING_EVERY == 0
            if bulk:
                link.bulk_sent = {sent}  # an older one unanswered is lost with its link, or late: not counted
            try:
                await link.send(Ping(sent, b"\0" * BULK_PING_BYTES if bulk else b""))
            except (ConnectionError, OSError):
                return
            await asyncio.sleep(PING_SECONDS)

    def _message_in(self, link: PeerLink, msg: aiohttp.WSMessage) -> Message | None:
        """The message a websocket message carries; None for one refused (and logged) or that is no frame."""
        if msg.type == aiohttp.WSMsgType.ERROR:
            self._log_broken(link, msg.data)  # aiohttp closes the link itself: the read loop ends next
            return None
        if msg.type == aiohttp.WSMsgType.TEXT:
            self._refuse_frame(link, "a text frame (frames are binary msgpack)")
            return None
        if msg.type != aiohttp.WSMsgType.BINARY:
            return None
        try:
            message = decode(msg.data, self.max_frame_bytes)
        except ProtocolError as exc:
            self._refuse_frame(link, str(exc))
            return None
        if isinstance(message, _SET_UP):
            self._refuse_frame(link, f"a {message.type} frame on a link already set up")
            return None
        return message

    def _refuse_frame(self, link: PeerLink, reason: str) -> None:
        link.refused_frames += 1
        count = link.refused_frames
        level = logging.WARNING if count <= REFUSALS_LOGGED_PER_LINK else logging.DEBUG
        more = " (further refused frames on this link are logged at debug level)" \
            if count == REFUSALS_LOGGED_PER_LINK else ""
        log.log(level, "node %s: refused a frame from %s at %s: %s%s", self.me.node_id, link.remote.node_id,
                link.address, _one_line(reason), more)

    def _log_broken(self, link: PeerLink, exc: BaseException) -> None:
        link.broken = True
        if getattr(exc, "code", None) == aiohttp.WSCloseCode.MESSAGE_TOO_BIG:
            log.warning("node %s: closing the link with %s at %s: it sent a frame past this node's %d-byte "
                        "websocket limit (%s; peer protocol limit %d bytes); the peers link again",
                        self.me.node_id, link.remote.node_id, link.address, websocket_limit(self.max_frame_bytes),
                        _one_line(str(exc)), self.max_frame_bytes)
        else:
            log.warning("node %s: closing the link with %s at %s: %s", self.me.node_id, link.remote.node_id,
                        link.address, _one_line(str(exc) or type(exc).__name__))

    def _log_lost(self, link: PeerLink) -> None:
        refused = f"; {link.refused_frames} frames from it refused" if link.refused_frames else ""
        if not link.broken and link.ws.close_code == aiohttp.WSCloseCode.MESSAGE_TOO_BIG:
            log.warning("node %s: lost link with %s: it closed the link because a frame from this node was past its "
                        "websocket size limit (peer protocol limit here %d bytes); the peers link again%s",
                        self.me.node_id, link.remote.node_id, self.max_frame_bytes, refused)
        else:
            log.info("node %s: lost link with %s (%s)%s", self.me.node_id, link.remote.node_id,
                     link.ws.exception() or "closed", refused)

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


def _one_line(text: str, limit: int = 500) -> str:
    """A reason as one bounded log line, whatever a peer put in the frame."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."
