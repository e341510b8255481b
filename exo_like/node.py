"""The node wires its parts: identity, engine, model registry and downloads, peer links and discovery, membership,
the instances (exo_like/instances/: plans, parts, keep_alive, the router of ring messages), its reports and
watchdogs. It does none of their work.

One node alone is a ring of one; with peers, the same code runs a stage of a ring that spans machines.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import platform
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import psutil
from huggingface_hub.utils import disable_progress_bars

from discovery import MdnsDiscovery, PeerAddress, PeerFinder
from discovery.mdns import local_ipv4_addresses
from exo_like import __version__
from exo_like.cluster.identity import claim_identity, default_node_name
from exo_like.cluster.membership import Cluster
from exo_like.cluster.node_info import NodeInfo
from exo_like.cluster.peers import DEFAULT_PEER_TIMEOUT, PeerLink, PeerNetwork, cluster_key_digest
from exo_like.cluster.protocol import (
    DEFAULT_MAX_FRAME_BYTES,
    Error,
    Forward,
    MemberAddress,
    Message,
    PlanState,
    Sampled,
    Submit,
)
from exo_like.cluster.speed import SpeedProbe
from exo_like.cluster.view import cluster_picture
from exo_like.engines.base import Engine
from exo_like.engines.choice import create_engine
from exo_like.instances.instance import Instance
from exo_like.instances.model_lifecycle import ModelLifecycle
from exo_like.instances.reports import NodeReports
from exo_like.instances.watchdogs import Watchdogs
from exo_like.instances.manager import DEFAULT_KEEP_ALIVE, Instances
from exo_like.instances.router import Router
from exo_like.instances.runtime import InstancePart, NodeServices
from exo_like.models.hub.download import ShardDownloader
from exo_like.models.hub.peer_files import PeerSource
from exo_like.models.hub.progress import DownloadProgress, show_progress
from exo_like.models.hub.repo import default_cache_dir
from exo_like.models.names.model_registry import ModelRegistry
from exo_like.models.names.resolver import LoadedModel
from exo_like.models.shard import Shard
from exo_like.serving.metrics import Metrics
from exo_like.serving.scheduler import SchedulerLimits
from exo_like.serving.grammar import GrammarVocabularies
from exo_like.tensor_parallel import control as group_control
from exo_like.tensor_parallel.messages import Ready
from exo_like.tensor_parallel.supervisor import GroupSpec, GroupSupervisor
from partitioning.tensor import group_key
from partitioning.plan import Plan
from partitioning.speed_figures import RTT_SAMPLES

log = logging.getLogger(__name__)

# Zero-config default: every node without --cluster-key joins the same cluster. Set a key to keep clusters apart.
DEFAULT_CLUSTER_KEY = "exo-like-default-cluster-key"
# A stage inside one engine step (a decode token, or one prefill chunk) for this long is taken to be hung. Generous:
# a big model's prefill chunk on a slow CPU takes minutes, and a false alarm kills a healthy request.
DEFAULT_STEP_TIMEOUT = 300.0


def default_home() -> Path:
    return Path(os.environ.get("EXO_LIKE_HOME") or Path.home() / ".cache" / "exo-like")


@dataclass
class NodeOptions:
    home: Path
    engine: str = "auto"
    device: str | None = None
    dtype: str | None = None
    node_name: str | None = None
    memory_gb: float | None = None
    peers: list[PeerAddress] = field(default_factory=list)
    mdns: bool = True
    cluster_key: str = DEFAULT_CLUSTER_KEY
    model: str | None = None
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    hub_cache: Path | None = None  # default: $HF_HUB_CACHE, else <home>/hub
    request_wait: float | None = None  # seconds a request waits for the cluster to be ready (default: the cluster's)
    step_timeout: float = DEFAULT_STEP_TIMEOUT  # seconds in one engine step after which a stage counts as hung
    peer_timeout: float = DEFAULT_PEER_TIMEOUT  # seconds of silence after which a peer counts as lost
    kv_cache_gb: float | None = None  # KV cache budget for this node's layers (default: kv_blocks.kv_budget_bytes)
    limits: SchedulerLimits = field(default_factory=SchedulerLimits)  # used when this node is the first stage
    placement: str = "compute"  # place layers by measured speed ("compute") or by memory alone ("memory")
    parallel: str = "auto"  # --parallel: tensor-parallel groups where every member asks ("tensor"), or not
    remeasure: bool = False  # measure this node's speed again instead of reading it from <home>
    keep_alive: float = DEFAULT_KEEP_ALIVE  # --keep-alive: seconds a model stays loaded after its last request


@dataclass(frozen=True)
class Joined:
    """What a node builds once its port is bound: its address in the cluster and every part that needs it."""

    info: NodeInfo
    groups: GroupSupervisor  # its tensor-parallel rank's worker (the listening socket workers take a leader on)
    peers: PeerNetwork
    speed: SpeedProbe
    cluster: Cluster
    instances: Instances
    router: Router
    finder: PeerFinder


class Node:
    def __init__(self, options: NodeOptions):
        self.options = options
        self.home = options.home
        self.identity = claim_identity(options.home)
        self.node_id = self.identity.node_id
        # This node's engine for what is not an instance's: measuring its speed, naming its device. Each
        # instance's part has an engine of its own (instances/runtime.py); all share the one engine thread.
        self.engine: Engine = create_engine(options.engine, options.device, options.dtype)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self.cache_dir = default_cache_dir(options.home, options.hub_cache)
        self.models = ModelRegistry(options.home, self.cache_dir, self.node_id, self._model_prepared,
                                    self._peer_sources)
        self.download_progress = DownloadProgress()
        self.downloader = ShardDownloader(self.cache_dir, self.node_id, self.download_progress, self._peer_sources)
        disable_progress_bars()  # huggingface_hub's per-file bars: the node draws one bar of its own
        self._tasks: set[asyncio.Task] = set()
        self.started = time.time()
        self.stopping = False  # set when shutdown begins: requests cancelled from then on are not the client's doing
        self.joined: Joined | None = None  # the parts built once the port is bound (start)
        self.lifecycle = ModelLifecycle(self.node_id, self.models, self.downloader, self.cache_dir,
                                        lambda: self.instances, lambda: self.stopping, int(self.started))
        self.reports = NodeReports(self.node_id, self.engine, self.download_progress, self._parts,
                                   self.lifecycle.served, self.started)
        self.metrics = Metrics(self.reports.current_load, self._peer_rtts)
        self.grammars = GrammarVocabularies()

    # -- models -------------------------------------------------------------------------------------------

    def resolve(self, spec: str) -> LoadedModel:
        """The model a name refers to. Blocking (a hub model's description may be fetched): call it before the
        event loop runs, as the CLI does for --model; inside the loop, use prepare()."""
        return self.models.resolve(spec)

    def _model_prepared(self, spec: str) -> None:
        if self.instances is not None and self.instances.get(spec) is not None:
            self.instances.replan()  # the plan, or the problem, can be worked out now

    # -- start and stop -----------------------------------------------------------------------------------

    async def start(self, host: str, port: int) -> None:
        """Join the cluster: identity, peer links, discovery and plan agreement (call once the port is bound)."""
        self.joined = joined = self._join(host, port)
        self._spawn(show_progress(self.download_progress, self.node_id))
        watchdogs = Watchdogs(self.node_id, joined.cluster, joined.instances, joined.groups, self._parts,
                              self.options.step_timeout)
        self._spawn(watchdogs.watch_steps())
        self._spawn(watchdogs.watch_group())
        log.info("node %s (%s): %s engine on %s, %.1f GiB for layers, cluster key %s", self.node_id,
                 joined.info.name, self.engine.name, self.engine.device_name, joined.info.memory_bytes / 2**30,
                 "set" if self.options.cluster_key != DEFAULT_CLUSTER_KEY else "default")
        joined.cluster.start()
        joined.instances.start()
        await joined.finder.start()
        if self.options.model:
            joined.instances.pin(self.resolve(self.options.model).key, admit=False)
        else:
            joined.instances.replan()

    def _join(self, host: str, port: int) -> Joined:
        """Every part that needs the node's address, built whole (the callbacks reach the others through
        self.joined, set before any of them runs)."""
        info = self._node_info(host, port)
        listener = group_control.listen((info.host, 0))
        info = replace(info, tp_port=listener.getsockname()[1])
        key = hashlib.sha256(b"exo-like tensor-parallel|" + self.options.cluster_key.encode()).digest()
        groups = GroupSupervisor(self.node_id, key, info.host, listener, self.engine, self.options.step_timeout,
                                 self._group_formed)
        peers = PeerNetwork(info, self.options.cluster_key, self._on_peer_message, self._links_changed,
                            self.options.max_frame_bytes, self.options.peer_timeout, self._peers_of_peers)
        speed = SpeedProbe(self.node_id, self.engine, self.executor, self.home, self.options.placement,
                           self.options.remeasure, self.models.files, lambda: peers.lowest_round_trips(RTT_SAMPLES),
                           lambda: self.instances and self.instances.replan(), self.options.parallel,
                           peers.bandwidths)
        cluster = Cluster(info, peers, self.reports.current_load)
        instances = Instances(cluster, self.models.describe, self._make_part, speed, self.options.keep_alive,
                              self.options.request_wait)
        router = Router(self.node_id, instances, lambda message: self._spawn(self._refuse(message)))
        mdns = None
        if self.options.mdns:
            mdns = MdnsDiscovery(self.node_id, port, cluster_key_digest(self.options.cluster_key), __version__,
                                 lambda peer: self.finder and self.finder.found_on_mdns(peer),
                                 on_other_cluster=lambda peer: self.finder and self.finder.found_other_cluster(peer),
                                 on_removed=lambda node_id: self.finder and self.finder.gone_from_mdns(node_id))
        finder = PeerFinder(self.node_id, self._dial, peers.linked, self.options.peers, mdns, self._report_unlinked)
        return Joined(info, groups, peers, speed, cluster, instances, router, finder)

    # The joined parts by name (None until start): what the API and the watchdogs read.

    @property
    def info(self) -> NodeInfo | None:
        return self.joined.info if self.joined is not None else None

    @property
    def groups(self) -> GroupSupervisor | None:
        return self.joined.groups if self.joined is not None else None

    @property
    def peers(self) -> PeerNetwork | None:
        return self.joined.peers if self.joined is not None else None

    @property
    def speed(self) -> SpeedProbe | None:
        return self.joined.speed if self.joined is not None else None

    @property
    def cluster(self) -> Cluster | None:
        return self.joined.cluster if self.joined is not None else None

    @property
    def instances(self) -> Instances | None:
        return self.joined.instances if self.joined is not None else None

    @property
    def router(self) -> Router | None:
        return self.joined.router if self.joined is not None else None

    @property
    def finder(self) -> PeerFinder | None:
        return self.joined.finder if self.joined is not None else None

    def _make_part(self, instance: Instance) -> InstancePart:
        """This node's part of an instance: an engine, a stage and a generator of its own."""
        assert self.cluster is not None
        services = NodeServices(self.node_id, self, self.executor, self.models, self.downloader, self.grammars,
                                (self.options.engine, self.options.device, self.options.dtype),
                                self.options.kv_cache_gb, self.options.limits, self.cluster.name_of,
                                instance.plan_wait_seconds if self.options.request_wait is None
                                else self.options.request_wait,
                                self.metrics.observe_step, self._replayed, self.groups, self._group_spec)
        return InstancePart(instance, services)

    def _replayed(self) -> None:
        self.reports.replays += 1
        self.metrics.request_replays.inc()

    def _group_formed(self, spec: GroupSpec, ready: Ready) -> None:
        """A group's leader announces the group's measured all-reduce: the planner weighs it from then on."""
        if spec.rank == 0 and self.speed is not None and ready.allreduce_ns > 0:
            self.speed.allreduce_ns[group_key(spec.member_ids)] = ready.allreduce_ns

    def _group_spec(self, plan: Plan, shard: Shard) -> GroupSpec:
        """This node's rank of the plan's group that holds `shard`, with every member's control address."""
        assert self.cluster is not None and shard.tp is not None
        stage = plan.group_of(self.node_id)
        assert stage is not None
        infos = {m.node_id: m for m in self.cluster.members()}
        members = tuple((node_id, infos[node_id].host, infos[node_id].tp_port) for node_id in stage.members)
        return GroupSpec(plan.model_id, stage.start_layer, stage.end_layer, members, shard.tp.rank)

    def _node_info(self, host: str, port: int) -> NodeInfo:
        memory = (int(self.options.memory_gb * 2**30) if self.options.memory_gb is not None
                  else psutil.virtual_memory().available)
        advertised = host if host not in ("", "0.0.0.0", "::") else (local_ipv4_addresses() or ["127.0.0.1"])[0]
        return NodeInfo(node_id=self.node_id, name=self.options.node_name or default_node_name(), host=advertised,
                        port=port, engine=self.engine.name, device=self.engine.device_name,
                        chip=platform.processor() or platform.machine(), memory_bytes=memory, version=__version__,
                        dtype=self.options.dtype)

    async def close(self) -> None:
        self.stopping = True
        if self.instances is not None:
            await self.instances.close()
        if self.finder is not None:
            await self.finder.stop()
        if self.cluster is not None:
            await self.cluster.stop()
        if self.speed is not None:
            await self.speed.close()
        if self.peers is not None:
            await self.peers.close()
        for task in list(self._tasks):
            task.cancel()
        self.downloader.close()
        loop = asyncio.get_running_loop()
        if self.groups is not None:
            self.groups.stop()  # this node's group worker, if any
        await loop.run_in_executor(self.executor, self.engine.close)
        await loop.run_in_executor(None, self.executor.shutdown, True)
        self.identity.release()
        log.info("node stopped")

    # -- messages -----------------------------------------------------------------------------------------

    async def send(self, node_id: str, message: Message) -> None:
        """The ring's router: deliver to a peer, or to ourselves without touching the network."""
        if node_id == self.node_id:
            self._deliver(message)
            return
        assert self.peers is not None
        await self.peers.send(node_id, message)

    async def _on_peer_message(self, link: PeerLink, message: Message) -> None:
        if isinstance(message, PlanState):
            assert self.cluster is not None and self.instances is not None
            self.cluster.receive(link.remote.node_id, message)
            for instance in self.instances.instances.values():
                instance.part.stage.wake()  # a stage's KV pool may have become known: the first stage can schedule
        else:
            # Not awaited: a stage's compute must not stop this link from reading (tasks start in arrival
            # order, and each submits to the single engine thread first, so per-request order is kept).
            self._spawn(self._dispatch(link.remote.node_id, message))

    async def _dispatch(self, sender: str, message: Message) -> None:
        self._deliver(message, sender)

    def _deliver(self, message: Message, sender: str | None = None) -> None:
        assert self.router is not None
        self.router.deliver(message, sender)

    async def _refuse(self, message: Submit | Forward | Sampled) -> None:
        """Work for a plan no instance here has (any more): its requests' origins replay them."""
        requests = {(message.rid, message.origin)} if isinstance(message, Submit) else \
            {(item.rid, item.origin) for item in message.items} if isinstance(message, Forward) else set()
        for rid, origin in requests:
            try:
                await self.send(origin, Error(rid, f"node {self.node_id} holds no plan {message.digest} (the "
                                               "cluster re-planned); retry once the ring is ready", "plan_changed"))
            except (ConnectionError, OSError):
                pass  # the origin is gone, and its request with it

    async def _dial(self, host: str, port: int) -> str | None:
        assert self.peers is not None
        link = await self.peers.dial(host, port)
        return link.remote.node_id if link else None

    def _peers_of_peers(self, addresses: list[MemberAddress]) -> None:
        """Members a linked peer is linked with: dial them too (peer exchange, see peers.py)."""
        if self.finder is not None:
            for member in addresses:
                self.finder.found_by_peer(PeerAddress(member.host, member.port, member.node_id))

    def _report_unlinked(self, peer: PeerAddress, code: str, reason: str) -> None:
        assert self.peers is not None
        self.peers.problems.note(peer.host, peer.port, code, reason, peer.node_id)

    def _links_changed(self) -> None:
        if self.cluster is not None:
            self.cluster.links_changed()

    def _parts(self) -> list[InstancePart]:
        if self.instances is None:
            return []
        return [instance.part for instance in self.instances.instances.values()]  # type: ignore[misc]

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- reporting ----------------------------------------------------------------------------------------

    def status(self) -> dict[str, object]:
        """What /health reports."""
        ready = self.instances is not None and any(i.ready for i in self.instances.instances.values())
        return self.reports.status(self.stopping, ready)

    def _peer_sources(self) -> list[PeerSource]:
        """The linked peers, as sources of the models their caches hold (asked before the hub). Called from download
        threads too: the links are copied first (one step for the interpreter)."""
        if self.peers is None:
            return []
        return [PeerSource(node_id, f"http://{link.remote.host}:{link.remote.port}", self.node_id,
                           self.options.cluster_key)
                for node_id, link in sorted(list(self.peers.links.items())) if not link.closed]

    def _peer_rtts(self) -> dict[str, float]:
        """Seconds of the last measured round trip on each peer link (by peer node id)."""
        if self.peers is None:
            return {}
        return {node_id: link.rtt for node_id, link in self.peers.links.items() if link.rtt is not None}

    def cluster_json(self) -> dict[str, object] | None:
        """GET /v1/cluster and the dashboard's picture: the cluster, plus what only this node knows about it."""
        if self.cluster is None or self.instances is None:
            return None  # still starting
        served = {model.key: model.model_id for model in self.lifecycle.served()}
        return {**cluster_picture(self.cluster, self.instances, served),
                # Whether the key is set, never the key: with the default, anyone on the network can join.
                "cluster_key": "default" if self.options.cluster_key == DEFAULT_CLUSTER_KEY else "set"}

    async def wait_cluster_change(self, timeout: float) -> None:
        if self.cluster is None:
            await asyncio.sleep(timeout)
        else:
            await self.cluster.wait_change(timeout)

