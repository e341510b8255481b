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
from exo_like.errors import ExoLikeError, InvalidRequestError, ModelNotFoundError, ServiceUnavailableError
from exo_like.instances.instance import Instance
from exo_like.instances.manager import DEFAULT_KEEP_ALIVE, Instances
from exo_like.instances.router import Router
from exo_like.instances.runtime import InstancePart, NodeServices
from exo_like.models.hub.download import ShardDownloader
from exo_like.models.hub.progress import DownloadProgress, show_progress
from exo_like.models.hub.repo import default_cache_dir, delete_revision
from exo_like.models.names.registry import ModelRegistry
from exo_like.models.names.resolver import LoadedModel
from exo_like.models.shard import Shard
from exo_like.serving.generation import TokenGenerator
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
    keep_alive: float = DEFAULT_KEEP_ALIVE  # --keep-alive: seconds a model stays loaded after its last request


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
        self.models = ModelRegistry(options.home, self.cache_dir, self.node_id, self._model_prepared)
        self.download_progress = DownloadProgress()
        self.downloader = ShardDownloader(self.cache_dir, self.node_id, self.download_progress)
        self.groups: GroupSupervisor | None = None
        disable_progress_bars()  # huggingface_hub's per-file bars: the node draws one bar of its own
        self._tasks: set[asyncio.Task] = set()
        self.started = time.time()
        self.stopping = False  # set when shutdown begins: requests cancelled from then on are not the client's doing
        self.info: NodeInfo | None = None
        self.peers: PeerNetwork | None = None
        self.cluster: Cluster | None = None
        self.instances: Instances | None = None
        self.router: Router | None = None
        self.finder: PeerFinder | None = None
        self.speed: SpeedProbe | None = None
        self.metrics = Metrics(self.current_load, self._peer_rtts)
        self.grammars = GrammarVocabularies()
        self._replays = 0

    # -- models -------------------------------------------------------------------------------------------

    def resolve(self, spec: str) -> LoadedModel:
        """The model a name refers to. Blocking (a hub model's description may be fetched): call it before the
        event loop runs, as the CLI does for --model; inside the loop, use prepare()."""
        return self.models.resolve(spec)

    def _model_prepared(self, spec: str) -> None:
        if self.instances is not None and self.instances.get(spec) is not None:
            self.instances.replan()  # the plan, or the problem, can be worked out now

    def served(self) -> list[LoadedModel]:
        """The models the cluster serves (those this node has the description of), oldest first."""
        if self.instances is None:
            return []
        models = []
        for key in dict.fromkeys(instance.model for instance in self.instances.instances.values()):
            try:
                model = self.models.known(key)
            except ExoLikeError:
                continue  # the model cannot be read here: its instance's problem says why
            if model is not None:
                models.append(model)
        return models

    async def require_model(self, name: str, keep_alive: float | None = None,
                            streamed: bool = True) -> tuple[LoadedModel, TokenGenerator]:
        """The model a request names, with the generator that runs it: the cluster serves it from now on if it did
        not (placed, fetched and loaded while the request waits: a streamed one as long as the load takes, its
        connection open; a non-streamed one up to a limit, then a 503 with Retry-After)."""
        if self.instances is None:
            raise ServiceUnavailableError("the node is still starting", code="starting")
        if self.stopping:
            raise ServiceUnavailableError("the node is shutting down; send the request to another node of the "
                                          "cluster", code="shutting_down")
        model = await self.models.prepare(name)
        instance = self.instances.require(model.key, keep_alive)
        if not streamed and not instance.ever_ready:
            await instance.wait_loaded()
        return model, instance.part.generator

    async def load_model(self, name: str, keep_alive: float | None = None) -> LoadedModel:
        """The model a name refers to, once the cluster has loaded it (asked for now if it was not)."""
        if self.instances is None:
            raise ServiceUnavailableError("the node is still starting", code="starting")
        model = await self.models.prepare(name)
        await self.instances.require(model.key, keep_alive).wait_ready()
        return model

    async def pin_model(self, name: str, nodes: tuple[str, ...] = ()) -> tuple[LoadedModel, str]:
        """Serve the model a name refers to (on `nodes`) until it is unloaded by name: the load API. The model and
        its instance's key. A model that cannot fit beside the busy ones is refused (InsufficientMemoryError),
        nothing else disturbed."""
        if self.instances is None:
            raise ServiceUnavailableError("the node is still starting", code="starting")
        model = await self.models.prepare(name)
        return model, self.instances.pin(model.key, nodes).key

    async def pull_model(self, model: LoadedModel) -> None:
        """Every weight file of a hub model in this node's cache (Ollama's pull); a model on disk has nothing to
        fetch."""
        if model.manifest is not None:
            whole = Shard.whole(model.key, model.args.num_hidden_layers)
            try:
                await self.downloader.ensure(model.manifest, model.path, whole, model.args.tie_word_embeddings,
                                             f"pull:{model.key}")
            finally:
                self.downloader.forget(f"pull:{model.key}")

    async def delete_model(self, name: str) -> None:
        """Remove a downloaded model from this node's cache (unloaded first, on every node, if it is served)."""
        model = self.models.known(name)
        if model is None or model.manifest is None:
            if model is not None:
                raise InvalidRequestError(f"{model.model_id} is a folder on this node's disk ({model.path}), not a "
                                          "download: remove it yourself", param="model", code="not_downloaded")
            raise ModelNotFoundError(f"the model {name!r} is not downloaded on this node")
        await self.unload_model(model.key)
        removed = await asyncio.to_thread(delete_revision, self.cache_dir, model.manifest.repo_id,
                                          model.manifest.commit)
        if not removed:
            raise ModelNotFoundError(f"{model.model_id} has no files in this node's cache {self.cache_dir}")
        log.info("node %s: deleted %s@%s from its cache", self.node_id, model.manifest.repo_id, model.manifest.commit)

    async def unload_model(self, name: str) -> bool:
        """Stop serving an instance (by its key, as GET /v1/instances lists it), or every instance of the model a
        name refers to, on every node; whether any was served."""
        if self.instances is None:
            return False
        if name in self.instances.instances:
            return self.instances.unload(name)
        model = await self.models.prepare(name)
        return self.instances.unload(model.key)

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
                                lambda: self.instances and self.instances.replan(), self.options.parallel,
                                self.peers.bandwidths)
        self.cluster = Cluster(self.info, self.peers, self.current_load)
        self.instances = Instances(self.cluster, self.models.describe, self._make_part, self.speed,
                                   self.options.keep_alive, self.options.request_wait)
        self.router = Router(self.node_id, self.instances, lambda message: self._spawn(self._refuse(message)))
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
        self.instances.start()
        await self.finder.start()
        if self.options.model:
            self.instances.pin(self.resolve(self.options.model).key, admit=False)
        else:
            self.instances.replan()

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
        self._replays += 1
        self.metrics.request_replays.inc()

    def _start_groups(self) -> None:
        """Where this node's tensor-parallel workers take a leader's control channel: one listening socket for the
        node's life, handed to each worker it starts (tensor_parallel/supervisor.py)."""
        assert self.info is not None
        listener = group_control.listen((self.info.host, 0))
        self.info = replace(self.info, tp_port=listener.getsockname()[1])
        key = hashlib.sha256(b"exo-like tensor-parallel|" + self.options.cluster_key.encode()).digest()
        self.groups = GroupSupervisor(self.node_id, key, self.info.host, listener, self.engine,
                                      self.options.step_timeout, self._group_formed)

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

    async def _watch_steps(self) -> None:
        """Stop requests whose ring has a hung stage: one whose node is alive (so its link stays up) while its
        engine has been inside one step for longer than --step-timeout."""
        while True:
            await asyncio.sleep(STEP_WATCH_SECONDS)
            for part in self._parts():
                part.generator.fail_stalled(self._step_seconds, self.options.step_timeout)

    async def _watch_group(self) -> None:
        """Re-form this node's tensor-parallel group when its worker exits while the plan stands (a crash, or the
        group broke because another member's did): the others' workers exit too, and every member starts anew."""
        handled: int | None = None  # the exited worker already acted on
        while True:
            await asyncio.sleep(GROUP_WATCH_SECONDS)
            groups = self.groups
            worker = groups.worker if groups is not None else None
            if worker is None or worker.pid == handled or not groups.broken() or self.instances is None:
                continue
            handled = worker.pid
            log.warning("node %s: the worker of its tensor-parallel rank (process %d) exited with code %s; the "
                        "group forms anew", self.node_id, worker.pid, worker.process.returncode)
            for instance in self.instances.instances.values():
                if instance.part.shards.grouped:  # type: ignore[attr-defined]
                    instance.reload()

    def _step_seconds(self, node_id: str) -> float:
        """How long a member's engine has been inside its current step: ours now, a peer's as last announced."""
        if node_id == self.node_id:
            return max((part.stage.step_seconds() for part in self._parts()), default=0.0)
        announcement = self.cluster.announcements.get(node_id) if self.cluster is not None else None
        return announcement.load.step_seconds if announcement is not None else 0.0

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- reporting ----------------------------------------------------------------------------------------

    def generation_stats(self) -> dict[str, object]:
        totals = {"in_flight_requests": 0, "active_kv_caches": 0, "requests_total": 0, "tokens_generated_total": 0,
                  "replays_total": self._replays}
        for part in self._parts():
            for key, value in part.generator.stats().items():
                if key != "replays_total":
                    totals[key] += int(value)  # type: ignore[call-overload]
        return totals

    def status(self) -> dict[str, object]:
        """What /health reports (and what a dashboard shows about this node)."""
        served = self.served()
        engines = [part.serving for part in self._parts()]
        return {
            "status": "stopping" if self.stopping else "ok",
            "node_id": self.node_id,
            "model": served[0].model_id if served else None,
            "models": [model.model_id for model in served],
            "engine": self.engine.name,
            "device": self.engine.device_name,
            "dtype": engines[0].dtype_name if engines else self.engine.dtype_name,
            # The bytes this node's layers hold; of a quantized model, the matrices run quantized and those
            # dequantized for want of a kernel.
            "weights": {"parameter_bytes": sum(engine.parameter_bytes() for engine in engines),
                        "quantized": _added(engine.weight_forms.quantized for engine in engines),
                        "dequantized": _added(engine.weight_forms.dequantized for engine in engines)},
            "uptime_seconds": round(time.time() - self.started, 1),
            "cluster_ready": bool(self.instances and any(i.ready for i in self.instances.instances.values())),
            **self.generation_stats(),
        }

    def current_load(self) -> NodeLoad:
        """What this node is doing now (shared with peers in its announcements)."""
        parts = self._parts()
        engines = [part.serving for part in parts]
        numerics = next((engine.numerics() for engine in engines if engine.shard is not None), None)
        weights = {"quantized_weights": _added(engine.weight_forms.quantized for engine in engines),
                   "dequantized_weights": _added(engine.weight_forms.dequantized for engine in engines),
                   "numerics": numerics if numerics is not None else self.engine.numerics()}
        if not parts:
            return NodeLoad(download=self.download_progress.status(), **weights)
        steps = [s for part in parts if (s := part.stage.decode_step_seconds.median()) is not None]
        counts: dict[str, int] = {}
        for part in parts:
            for key, value in part.stage.scheduler_counts().items():
                counts[key] = counts.get(key, 0) + value
        return NodeLoad(sum(p.stage.throughput.rate() for p in parts),
                        sum(p.generator.throughput.rate() for p in parts),
                        sum(len(p.generator.in_flight) for p in parts), any(p.stage.busy() for p in parts),
                        self.download_progress.status(), max(p.stage.step_seconds() for p in parts),
                        max(steps) * 1000 if steps else None, sum(engine.kv_blocks for engine in engines),
                        kv_window_blocks=sum((e.kv_size and e.kv_size.window_blocks) or 0 for e in engines),
                        **counts, **weights, replays=self._replays,
                        recovering=_added(p.generator.recovering() for p in parts))

    def _peer_rtts(self) -> dict[str, float]:
        """Seconds of the last measured round trip on each peer link (by peer node id)."""
        if self.peers is None:
            return {}
        return {node_id: link.rtt for node_id, link in self.peers.links.items() if link.rtt is not None}

    def models_json(self) -> list[dict[str, object]]:
        """GET /v1/models: the served models first, then local folders, downloaded repos and the catalog."""
        return self.models.listing(self._served_states(), int(self.started))

    def model_entry(self, name: str) -> dict[str, object]:
        return self.models.entry(name, self._served_states(), int(self.started))

    def _served_states(self) -> list[tuple[LoadedModel, str]]:
        """Each served model with its state: serving once its instance is ready, loading until then."""
        assert self.instances is not None or not self.served()
        return [(model, "serving" if any(i.ready for i in self.instances.of(model.key))  # type: ignore[union-attr]
                 else "loading") for model in self.served()]

    def cluster_json(self) -> dict[str, object] | None:
        """GET /v1/cluster and the dashboard's picture: the cluster, plus what only this node knows about it."""
        if self.cluster is None or self.instances is None:
            return None  # still starting
        served = {model.key: model.model_id for model in self.served()}
        return {**cluster_picture(self.cluster, self.instances, served),
                # Whether the key is set, never the key: with the default, anyone on the network can join.
                "cluster_key": "default" if self.options.cluster_key == DEFAULT_CLUSTER_KEY else "set"}

    async def wait_cluster_change(self, timeout: float) -> None:
        if self.cluster is None:
            await asyncio.sleep(timeout)
        else:
            await self.cluster.wait_change(timeout)

    def in_flight(self) -> list[dict[str, object]]:
        return [progress.to_json() for part in self._parts() for progress in part.generator.in_flight.values()]


def _added(counts: Any) -> dict[str, int]:
    """Maps of counts added key by key."""
    total: dict[str, int] = {}
    for each in counts:
        for key, value in each.items():
            total[key] = total.get(key, 0) + value
    return total
