"""A node's membership and instances without processes, sockets or engines, serving one model: what the unit
tests of plan agreement drive (links and announcements made by the test, a part that loads nothing)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

from exo_like.cluster.link_problems import LinkProblems
from exo_like.cluster.membership import Cluster
from exo_like.cluster.node_info import NodeInfo
from exo_like.cluster.node_load import NodeLoad
from exo_like.cluster.protocol import InstanceState, PlanState, Wish
from exo_like.engines.work import KVPoolSize
from exo_like.instances.instance import Instance
from exo_like.instances.manager import Instances
from exo_like.models.footprint import ModelDescription
from exo_like.models.shard import Shard
from partitioning.plan import Plan
from partitioning.speed_figures import SpeedFigures, SpeedSource

MODEL = "m"


class FakeLink:
    def __init__(self, remote: NodeInfo):
        self.remote, self.closed, self.sent = remote, False, []

    async def send(self, message: PlanState) -> None:
        self.sent.append(message)


async def no_load(plan: Plan, shard: Shard | None) -> None:
    pass


class FakePart:
    """A part that holds nothing: `load` is called with each plan's shard; its KV pool is what the test says."""

    def __init__(self, load: Callable[[Plan, Shard | None], Awaitable[None]], kv: KVPoolSize | None):
        self._load, self._kv = load, kv
        self.generator = SimpleNamespace(in_flight={}, requests_total=0, members_changed=lambda live: None,
                                         expects=lambda rid: False)
        self.stage = SimpleNamespace(wake=lambda: None)
        self.closed: str | None = None

    async def hold(self, plan: Plan, shard: Shard | None) -> None:
        await self._load(plan, shard)

    def kv_size(self) -> KVPoolSize | None:
        return self._kv

    async def close(self, reason: str, code: str) -> None:
        self.closed = code


class OneModel:
    """One node's Cluster and Instances; the instance of MODEL, once asked for, read through the old names."""

    def __init__(self, me: NodeInfo, describe: Callable[[str], ModelDescription],
                 load: Callable[[Plan, Shard | None], Awaitable[None]] = no_load, speed: SpeedSource | None = None,
                 current_load: Callable[[], NodeLoad] = NodeLoad, kv: KVPoolSize | None = None):
        self.peers = SimpleNamespace(links={}, problems=LinkProblems(me.node_id))
        self.cluster = Cluster(me, self.peers, current_load)  # type: ignore[arg-type]
        self.instances = Instances(self.cluster, describe, lambda instance: FakePart(load, kv), speed)

    def set_model(self, model: str = MODEL) -> None:
        self.instances.pin(model, admit=False)

    @property
    def instance(self) -> Instance | None:
        return self.instances.get(MODEL)

    def __getattr__(self, name: str) -> Any:
        """plan, agreed, ready, placement, problem, pending, why_not_ready: the instance's (None before it)."""
        if name in ("plan", "agreed", "ready", "placement", "problem", "pending", "why_not_ready", "node_status"):
            instance = self.instances.get(MODEL)
            if instance is None:
                return {"agreed": False, "ready": False}.get(name)
            return getattr(instance, name)
        raise AttributeError(name)

    @property
    def unsettled(self) -> str | None:
        return self.instances.unsettled

    @property
    def model_id(self) -> str | None:
        wish = self.instances.wishes.get(MODEL)
        return MODEL if wish is not None and wish.loaded else None

    def member_ids(self) -> set[str]:
        return self.cluster.member_ids()

    def links_changed(self) -> None:
        self.cluster.links_changed()

    def receive(self, node_id: str, message: PlanState) -> None:
        self.cluster.receive(node_id, message)

    def wishes(self) -> tuple[Wish, ...]:
        return tuple(self.instances.wishes.all())

    def announcement(self) -> PlanState:
        return self.cluster.my_announcement().to_message()


def peer_state(wishes: tuple[Wish, ...], digest: str | None, ready: bool, linked: tuple[str, ...],
               figures: SpeedFigures | None = None, load: NodeLoad | None = None, kv_blocks: int | None = None,
               problem: str | None = None, model: str = MODEL, instance: str = "") -> PlanState:
    """A peer's announcement of one instance of `model` (`instance`: its key, if not the model's first)."""
    state = InstanceState(model, digest, ready, problem, kv_blocks, instance=instance)
    return PlanState(wishes, (state,), (load or NodeLoad()).to_json(),
                     () if figures is None else (figures.to_json(),), linked)
