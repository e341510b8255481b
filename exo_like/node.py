"""The node: identity, peers, the agreed plan, this node's shard, and the generator the HTTP API serves.

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
from exo_like.cluster.node_load import NodeLoad
from exo_like.cluster.peers import DEFAULT_PEER_TIMEOUT, PeerLink, PeerNetwork, cluster_key_digest
from exo_like.cluster.protocol import (
    DEFAULT_MAX_FRAME_BYTES,
    Error,
    Forward,
    Message,
    PlanState,
    Release,
    Sampled,
    Submit,
    Tokens,
)
from exo_like.cluster.speed import SpeedProbe
from exo_like.cluster.view import cluster_picture
from exo_like.engines.base import Engine
from exo_like.engines.choice import create_engine
from exo_like.errors import ExoLikeError, ModelNotFoundError, ServiceUnavailableError
from exo_like.models.hub.download import ShardDownloader
from exo_like.models.hub.progress import DownloadProgress, show_progress
from exo_like.models.hub.repo import default_cache_dir
from exo_like.models.names.registry import ModelRegistry
from exo_like.models.names.resolver import LoadedModel
from exo_like.models.shard import Shard
from exo_like.serving.generation import TokenGenerator
from exo_like.serving.metrics import Metrics
from exo_like.serving.ring import RingGenerator
from exo_like.serving.scheduler import SchedulerLimits
from exo_like.serving.shard_holder import ShardHolder
from exo_like.serving.grammar import GrammarVocabularies, GrammarVocabulary
from exo_like.serving.stage import StageWorker
from exo_like.tensor_parallel import control as group_control
from exo_like.tensor_parallel.messages import Ready
from exo_like.tensor_parallel.supervisor import GroupSpec, GroupSupervisor
from partitioning.tensor import group_key
from partitioning.plan import Plan
from partitioning.speed_figures import RTT_SAMPLES
from exo_like.cluster.protocol import MemberAddress

log = logging.getLogger(__name__)

# Zero-config default: every node without --cluster-key joins the same cluster. Set a key to keep clusters apart.
DEFAULT_CLUSTER_KEY = "exo-like-default-cluster-key"
# A stage inside one engine step (a decode token, or one prefill chunk) for this long is taken to be hung. Generous:
# a big model's prefill chunk on a slow CPU takes minutes, and a false alarm kills a healthy request.
DEFAULT_STEP_TIMEOUT = 300.0
STEP_WATCH_SECONDS = 1.0
GROUP_WATCH_SECONDS = 0.2


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


class Node:
    def __init__(self, options: NodeOptions):
        self.options = options
        self.home = options.home
        self.identity = claim_identity(options.home)
        self.node_id = self.identity.node_id
        self.engine: Engine = create_engine(options.engine, options.device, options.dtype)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self.cache_dir = default_cache_dir(options.home, options.hub_cache)
        self.models = ModelRegistry(options.home, self.cache_dir, self.node_id, self._model_prepared)
        self.download_progress = DownloadProgress()
        self.downloader = ShardDownloader(self.cache_dir, self.node_id, self.download_progress)
        self.shards = ShardHolder(self.node_id, self.engine, self.executor, self.models, self.downloader,
                                  options.kv_cache_gb, options.limits)
        disable_progress_bars()  # huggingface_hub's per-file bars: the node draws one bar of its own
        self._tasks: set[asyncio.Task] = set()
        self.started = time.time()
        self.stopping = False  # set when shutdown begins: requests cancelled from then on are not the client's doing
        self.info: NodeInfo | None = None
        self.peers: PeerNetwork | None = None
        self.cluster: Cluster | None = None
        self.stage: StageWorker | None = None
        self.generator: TokenGenerator | None = None
        self.finder: PeerFinder | None = None
        self.speed: SpeedProbe | None = None
        self.metrics = Metrics(self.current_load, self._peer_rtts)
        self.grammars = GrammarVocabularies()

    # -- models -------------------------------------------------------------------------------------------

    def resolve(self, spec: str) -> LoadedModel:
        """The model a name refers to. Blocking (a hub model's description may be fetched): call it before the
        event loop runs, as the CLI does for --model; inside the loop, use prepare()."""
        return self.models.resolve(spec)

    def _model_prepared(self, spec: str) -> None:
        if self.cluster is not None and self.cluster.model_id == spec:
            self.cluster.replan()  # the plan, or the problem, can be worked out now

    @property
    def model(self) -> LoadedModel | None:
        """The model the cluster serves, if any (and if this node has its description)."""
        if self.cluster is None or self.cluster.model_id is None:
            return None
        return self.models.known(self.cluster.model_id)

    def grammar_vocabulary(self) -> GrammarVocabulary | None:
        """The served model's tokens as the grammar engine sees them (built on first use: call it off the loop)."""
        model = self.model
        return None if model is None else self.grammars.get(model)

    async def require_model(self, name: str) -> tuple[LoadedModel, TokenGenerator]:
        """The served model a request names, with the generator that runs it; 404 for any other name.

        With no model chosen yet, the first request's model becomes the cluster's model."""
        if self.cluster is None or self.generator is None:
            raise ModelNotFoundError(f"the model {name!r} does not exist: the node is still starting")
        if self.stopping:
            raise ServiceUnavailableError("the node is shutting down; send the request to another node of the "
                                          "cluster", code="shutting_down")
        if self.cluster.model_id is None:
            current = await self.models.prepare(name)
            if self.cluster.model_id is None:  # still: no other request chose while this one was fetching
                self.cluster.set_model(current.key)
        else:
            current = await self.models.prepare(self.cluster.model_id)
        served = self.cluster.model_id
        if current.key != served:
            known = self.models.known(served)  # named as /v1/models lists it, not by its key (a path, repo@commit)
            raise ModelNotFoundError(f"the model {name!r} is not served here; this cluster serves "
                                     f"{known.model_id if known is not None else served!r}")
        return await self.models.by_name(name, current), self.generator

    async def _load_shard(self, plan: Plan, shard: Shard | None) -> None:
        assert self.stage is not None
        await self.shards.hold(plan, shard, self.stage)

    # -- start and stop -----------------------------------------------------------------------------------

    async def start(self, host: str, port: int) -> None:
        """Join the cluster: identity, peer links, discovery and plan agreement (call once the port is bound)."""
        self.info = self._node_info(host, port)
        self._start_groups()
        self.peers = PeerNetwork(self.info, self.options.cluster_key, self._on_peer_message, self._links_changed,
                                 self.options.max_frame_bytes, self.options.peer_timeout, self._peers_of_peers)
        self.speed = SpeedProbe(self.node_id, self.engine, self.executor, self.home, self.options.placement,
                                self.options.remeasure, self.models.files,
                                lambda: self.peers.lowest_round_trips(RTT_SAMPLES),
                                lambda: self.cluster and self.cluster.replan(), self.options.parallel,
                                self.peers.bandwidths)
        self.cluster = Cluster(self.info, self.peers, self.models.describe, self._load_shard, self._members_changed,
                               self.current_load, lambda: self.shards.serving.kv_size, self.speed)
        self.stage = StageWorker(self.node_id, self, self.executor, self.cluster.ring_resources, self.options.limits,
                                 self.metrics.observe_step, self.grammar_vocabulary)
        if self.options.request_wait is not None:
            self.cluster.plan_wait_seconds = self.options.request_wait
        self.generator = RingGenerator(self.node_id, self, self.cluster.wait_ready, self.stage, self.cluster.name_of,
                                       self.cluster.plan_wait_seconds, self.metrics.request_replays.inc)
        self._spawn(show_progress(self.download_progress, self.node_id))
        self._spawn(self._watch_steps())
        self._spawn(self._watch_group())
        mdns = None
        if self.options.mdns:
            mdns = MdnsDiscovery(self.node_id, port, cluster_key_digest(self.options.cluster_key), __version__,
                                 lambda peer: self.finder and self.finder.found_on_mdns(peer),
                                 on_other_cluster=lambda peer: self.finder and self.finder.found_other_cluster(peer),
                                 on_removed=lambda node_id: self.finder and self.finder.gone_from_mdns(node_id))
        self.finder = PeerFinder(self.node_id, self._dial, self.peers.linked, self.options.peers, mdns,
                                 self._report_unlinked)
        log.info("node %s (%s): %s engine on %s, %.1f GiB for layers, cluster key %s", self.node_id,
                 self.info.name, self.engine.name, self.engine.device_name, self.info.memory_bytes / 2**30,
                 "set" if self.options.cluster_key != DEFAULT_CLUSTER_KEY else "default")
        self.cluster.start()
        await self.finder.start()
        if self.options.model:
            self.cluster.set_model(self.resolve(self.options.model).key)
        else:
            self.cluster.replan()

    def _start_groups(self) -> None:
        """Where this node's tensor-parallel workers take a leader's control channel: one listening socket for the
        node's life, handed to each worker it starts (tensor_parallel/supervisor.py)."""
        assert self.info is not None
        listener = group_control.listen((self.info.host, 0))
        self.info = replace(self.info, tp_port=listener.getsockname()[1])
        key = hashlib.sha256(b"exo-like tensor-parallel|" + self.options.cluster_key.encode()).digest()
        self.shards.groups = GroupSupervisor(self.node_id, key, self.info.host, listener, self.engine,
                                             self.options.step_timeout, self._group_formed)
        self.shards.group_spec = self._group_spec

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
        if self.generator is not None:
            await self.generator.close()
        if self.stage is not None:
            await self.stage.close()
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
        self.shards.close()  # this node's group worker, if any
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
            assert self.cluster is not None
            self.cluster.receive(link.remote.node_id, message)
            if self.stage is not None:
                self.stage.wake()  # a stage's KV pool may have become known: the first stage can schedule
        else:
            # Not awaited: a stage's compute must not stop this link from reading (tasks start in arrival
            # order, and each submits to the single engine thread first, so per-request order is kept).
            self._spawn(self._dispatch(link.remote.node_id, message))

    async def _dispatch(self, sender: str, message: Message) -> None:
        self._deliver(message, sender)

    def _deliver(self, message: Message, sender: str | None = None) -> None:
        """The one place a ring message goes to the part of this node that handles it (all of them queue work or
        wake a loop, none blocks)."""
        assert self.stage is not None and self.generator is not None
        if isinstance(message, (Tokens, Error)):  # Tokens first: it is a kind of Sampled
            self.generator.handle(message)
        elif isinstance(message, (Submit, Forward, Sampled, Release)):
            self.stage.handle(message)
        else:
            log.warning("node %s: unexpected %s message from %s", self.node_id, message.type, sender or "itself")

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

    async def _watch_steps(self) -> None:
        """Stop requests whose ring has a hung stage: one whose node is alive (so its link stays up) while its
        engine has been inside one step for longer than --step-timeout."""
        while True:
            await asyncio.sleep(STEP_WATCH_SECONDS)
            if isinstance(self.generator, RingGenerator):
                self.generator.fail_stalled(self._step_seconds, self.options.step_timeout)

    async def _watch_group(self) -> None:
        """Re-form this node's tensor-parallel group when its worker exits while the plan stands (a crash, or the
        group broke because another member's did): the others' workers exit too, and every member starts anew."""
        handled: int | None = None  # the exited worker already acted on
        while True:
            await asyncio.sleep(GROUP_WATCH_SECONDS)
            groups = self.shards.groups
            worker = groups.worker if groups is not None else None
            if worker is None or worker.pid == handled or not groups.broken() or self.cluster is None:
                continue
            handled = worker.pid
            log.warning("node %s: the worker of its tensor-parallel rank (process %d) exited with code %s; the "
                        "group forms anew", self.node_id, worker.pid, worker.process.returncode)
            self.cluster.reload()

    def _step_seconds(self, node_id: str) -> float:
        """How long a member's engine has been inside its current step: ours now, a peer's as last announced."""
        if node_id == self.node_id:
            return self.stage.step_seconds() if self.stage is not None else 0.0
        announcement = self.cluster.announcement_of(node_id) if self.cluster is not None else None
        return announcement.load.step_seconds if announcement is not None else 0.0

    def _members_changed(self, live: set[str]) -> None:
        if isinstance(self.generator, RingGenerator):
            self.generator.members_changed(live)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- reporting ----------------------------------------------------------------------------------------

    def generation_stats(self) -> dict[str, object]:
        if self.generator is None:
            return {"in_flight_requests": 0, "active_kv_caches": 0, "requests_total": 0, "tokens_generated_total": 0}
        return self.generator.stats()

    def status(self) -> dict[str, object]:
        """What /health reports (and what a dashboard shows about this node)."""
        model = self.model
        engine = self.shards.serving
        return {
            "status": "stopping" if self.stopping else "ok",
            "node_id": self.node_id,
            "model": model.model_id if model else None,
            "engine": engine.name,
            "device": engine.device_name,
            "dtype": engine.dtype_name,
            # The bytes this node's layers hold; of a quantized model, the matrices run quantized and those
            # dequantized for want of a kernel.
            "weights": {"parameter_bytes": engine.parameter_bytes(),
                        "quantized": engine.weight_forms.quantized,
                        "dequantized": engine.weight_forms.dequantized},
            "uptime_seconds": round(time.time() - self.started, 1),
            "cluster_ready": bool(self.cluster and self.cluster.ready),
            **self.generation_stats(),
        }

    def current_load(self) -> NodeLoad:
        """What this node is doing now (shared with peers in its announcements)."""
        engine = self.shards.serving
        forms = engine.weight_forms
        weights = {"quantized_weights": forms.quantized, "dequantized_weights": forms.dequantized,
                   "numerics": engine.numerics()}
        if self.generator is None or self.stage is None:
            return NodeLoad(download=self.download_progress.status(), **weights)
        decode_step = self.stage.decode_step_seconds.median()
        replays = {"replays": self.generator.replays_total, "recovering": self.generator.recovering()} \
            if isinstance(self.generator, RingGenerator) else {}
        return NodeLoad(self.stage.throughput.rate(), self.generator.throughput.rate(),
                        len(self.generator.in_flight), self.stage.busy(),
                        self.download_progress.status(), self.stage.step_seconds(),
                        None if decode_step is None else decode_step * 1000, engine.kv_blocks,
                        kv_window_blocks=(engine.kv_size and engine.kv_size.window_blocks) or 0,
                        **self.stage.scheduler_counts(), **weights, **replays)

    def _peer_rtts(self) -> dict[str, float]:
        """Seconds of the last measured round trip on each peer link (by peer node id)."""
        if self.peers is None:
            return {}
        return {node_id: link.rtt for node_id, link in self.peers.links.items() if link.rtt is not None}

    def models_json(self) -> list[dict[str, object]]:
        """GET /v1/models: the served model first, then local folders, downloaded repos and the catalog."""
        return self.models.listing(self._served_or_none(), int(self.started))

    def model_entry(self, name: str) -> dict[str, object]:
        return self.models.entry(name, self._served_or_none(), int(self.started))

    def _served_or_none(self) -> LoadedModel | None:
        try:
            return self.model
        except ExoLikeError:
            return None  # the model cannot be read here: the cluster's `problem` says why

    def cluster_json(self) -> dict[str, object] | None:
        """GET /v1/cluster and the dashboard's picture: the cluster, plus what only this node knows about it."""
        if self.cluster is None:
            return None  # still starting
        try:
            model = self.model
            model_name = model.model_id if model else None
        except ExoLikeError:
            model_name = None  # the model cannot be read here: the cluster's `problem` says why
        return {**cluster_picture(self.cluster), "model_name": model_name,
                # Whether the key is set, never the key: with the default, anyone on the network can join.
                "cluster_key": "default" if self.options.cluster_key == DEFAULT_CLUSTER_KEY else "set"}

    async def wait_cluster_change(self, timeout: float) -> None:
        if self.cluster is None:
            await asyncio.sleep(timeout)
        else:
            await self.cluster.wait_change(timeout)

    def in_flight(self) -> list[dict[str, object]]:
        if self.generator is None:
            return []
        return [progress.to_json() for progress in self.generator.in_flight.values()]
