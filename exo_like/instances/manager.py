"""The instances of this node's cluster: which models it serves (the replicated registers, wishes.py), where each
runs (partitioning/instances.py places them all, oldest first, from state every node shares), this node's part in
each, and when an idle one goes (its keep_alive ran out, or a model that needs its memory came).

A request names a model; require() makes the cluster serve it if it does not yet (writing its register, after
unloading idle instances if it does not fit beside them), and returns its instance, whose generator runs the
request. Every node then places it alike, and the nodes its plan names load their parts.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from typing import Any
from dataclasses import dataclass

from exo_like.cluster.membership import Announcement, Cluster
from exo_like.cluster.node_load import NodeLoad
from exo_like.cluster.protocol import KEEP_FOREVER, Wish
from exo_like.errors import ExoLikeError, InsufficientMemoryError, ModelPendingError
from exo_like.instances.instance import Instance, Part
from exo_like.instances.keep_alive import FOREVER
from exo_like.instances.wishes import Wishes
from exo_like.models.footprint import ModelDescription
from partitioning.decision import Decision, Member, Placer
from partitioning.instances import InstanceAsk, NodeFigures, Placed, place_instances, to_unload
from partitioning.speed_figures import SpeedFigures, SpeedSource

log = logging.getLogger(__name__)

DEFAULT_KEEP_ALIVE = 300.0  # Ollama's: an instance stays loaded 5 minutes after its last request
KEEP_WATCH_SECONDS = 0.25
# A request counts as running from the moment it named its model until its generation starts (its prompt is being
# rendered): an instance is not unloaded under it meanwhile.
STARTING_SECONDS = 5.0


@dataclass
class Use:
    """This node's clients' use of one instance."""

    keep_for: float = DEFAULT_KEEP_ALIVE  # the last request's keep_alive
    ran: float = -math.inf  # monotonic time a request last ran (named the model, or was generating)
    started: float = -math.inf  # when a request last named the model
    seen: int = 0  # the generator's requests by then: one more means that request began generating


class Instances:
    def __init__(self, cluster: Cluster, describe: Callable[[str], ModelDescription],
                 make_part: Callable[[Instance], Part], speed: SpeedSource | None = None,
                 keep_alive: float = DEFAULT_KEEP_ALIVE, plan_wait: float | None = None):
        self.cluster = cluster
        self.me = cluster.me.node_id
        self._describe = describe
        self._make_part = make_part
        self._speed = speed or SpeedSource()
        self.keep_alive = keep_alive  # --keep-alive: a request's, unless it says otherwise
        self.plan_wait = plan_wait
        self.wishes = Wishes(self.me)
        self.instances: dict[str, Instance] = {}  # by key (a model's, "<model>#<n>" for another instance of it)
        self.pinned: set[str] = set()  # instances this node keeps loaded whatever keep_alive says (--model, load API)
        self._uses: dict[str, Use] = {}  # by instance key
        self._placer = Placer(self.me)
        self._placed: dict[str, Placed] = {}
        self.unsettled: str | None = None  # why this node's view of the members is not one they all see yet
        self._closing: set[asyncio.Task] = set()
        self._watch: asyncio.Task | None = None
        self._closed = False
        cluster.state = self.announcement
        cluster.on_announcement = self._announced
        cluster.on_members = self._members_changed

    def start(self) -> None:
        self._watch = asyncio.ensure_future(self._watch_keep_alive())

    async def close(self) -> None:
        self._closed = True  # no plan made from here on (a speed measurement ending would make one)
        if self._watch is not None:
            self._watch.cancel()
        for instance in list(self.instances.values()):
            instance.stop()
            await instance.part.close("the node is shutting down", "shutting_down")
        self.instances.clear()

    # -- what requests see --------------------------------------------------------------------------------

    def get(self, key: str) -> Instance | None:
        """The instance of that key, or the first instance of the model of that key."""
        return self.instances.get(key) or next(iter(self.of(key)), None)

    def of(self, model: str) -> list[Instance]:
        """The instances serving `model`, oldest first."""
        return [instance for instance in self.instances.values() if instance.model == model]

    def oldest(self) -> Instance:
        """The instance asked for first (a cluster serving one model: that one)."""
        if not self.instances:
            raise LookupError("the cluster serves no model")
        return next(iter(self.instances.values()))

    def require(self, model: str, keep_alive: float | None = None) -> Instance:
        """An instance serving `model` (described on this node already; of several, the ready one with the fewest
        requests), asked for now if there is none; a model that does not fit beside the busy instances raises
        InsufficientMemoryError and changes nothing."""
        serving = self.of(model)
        if not serving:
            for victim in self._make_room(model):
                log.info("node %s: unloading idle %s to make room for %s", self.me, victim, model)
                self.wishes.unload(victim)
            self.wishes.load(model)
            log.info("node %s: %s asked for", self.me, model)
            self.replan()
            serving = self.of(model)
        instance = min(serving, key=lambda i: (not i.ready, self.in_flight(i.key), i.key))
        use = self._uses.setdefault(instance.key, Use())
        use.keep_for = self.keep_alive if keep_alive is None else keep_alive
        use.started = use.ran = time.monotonic()
        use.seen = instance.part.generator.requests_total
        return instance

    def pin(self, model: str, nodes: tuple[str, ...] = (), admit: bool = True) -> Instance:
        """Serve `model` (on `nodes`) until it is unloaded by name: the load API, or --model (admit=False: it waits
        for nodes with the memory it lacks to join, its instance saying what it lacks meanwhile). Asked for on
        other nodes than its instances run on, it gets another instance there (data parallel: each request goes to
        one of them)."""
        serving = self.of(model)
        same = next((i for i in serving if not nodes or self._nodes_of(i.key) == nodes), None)
        key = same.key if same is not None else self._new_key(model)
        if same is None:
            try:
                victims = self._make_room(model, nodes, key)
            except InsufficientMemoryError:
                if admit:
                    raise
                victims = []
            for victim in victims:
                log.info("node %s: unloading idle %s to make room for %s", self.me, victim, key)
                self.wishes.unload(victim)
        self.pinned.add(key)
        if self.wishes.load(model, nodes, "" if key == model else key) is not None:
            log.info("node %s: %s asked for%s", self.me, key, f" on {', '.join(nodes)}" if nodes else "")
        self.replan()
        return self.instances[key]

    def _nodes_of(self, key: str) -> tuple[str, ...]:
        wish = self.wishes.get(key)
        return wish.nodes if wish is not None else ()

    def _new_key(self, model: str) -> str:
        """The key of a model's next instance: the model's own for its first, else "<model>#<n>"."""
        keys = [model, *(f"{model}#{n}" for n in range(2, 2 + len(self.instances) + 1))]
        return next(key for key in keys if key not in self.instances)

    def unload(self, name: str) -> bool:
        """Stop serving an instance (by its key), or every instance of a model (by the model's key), on every node
        (their running requests end); whether any was served."""
        keys = [name] if "#" in name and name in self.instances else [i.key for i in self.of(name)]
        gone = [key for key in keys if self.wishes.unload(key) is not None]
        for key in gone:
            self.pinned.discard(key)
            log.info("node %s: %s unloaded", self.me, key)
        if gone:
            self.replan()
        return bool(gone)

    def _make_room(self, model: str, nodes: tuple[str, ...] = (), key: str = "") -> list[str]:
        """The idle instances to unload, least recently used first, so that `model` fits beside the rest. Judged on
        the memory split (the most any split fits): a model waiting for speed figures is placed by them later."""
        key = key or model
        ask = self._ask(model, self._describe(model), first=not self.instances, nodes=nodes,
                        instance="" if key == model else key)
        loaded = [self._placed[k].ask for k in self.instances if k in self._placed]
        members = self.cluster.members()
        figures = {**self._figures(), model: {m.node_id: SpeedFigures("memory") for m in members}}
        idle = self._idle()
        gone = to_unload(ask, loaded, idle, members, figures, self._decide, self._placed)
        if gone is not None:
            return gone
        busy = [a for a in loaded if a.key not in idle]
        problem = place_instances([*busy, ask], members, figures, self._decide, self._placed)[ask.key].problem
        beside = f" beside {', '.join(a.key for a in busy)} (serving requests)" if busy else ""
        raise InsufficientMemoryError(f"{model} cannot be loaded{beside}: {problem}; free memory (unload other "
                                      "models, give the nodes more with --memory-gb) or add a node")

    def _idle(self) -> list[str]:
        """The instances no node has a request for, the soonest to expire first (the least recently used)."""
        idle = [k for k in self.instances if self.in_flight(k) == 0 and not self._starting(k)]
        return sorted(idle, key=lambda k: (self._deadline(k), k))

    # -- placement ----------------------------------------------------------------------------------------

    def replan(self) -> None:
        if self._closed:
            return
        wished = self.wishes.loaded()
        keys = [wish.key for wish in wished]
        for key in [k for k in self.instances if k not in keys]:
            self._remove(key)
        for wish in wished:
            if wish.key not in self.instances:
                instance = Instance(wish.model, self.cluster, self._make_part, self.cluster.announce_soon, wish.key)
                self.instances[wish.key] = instance
                if self.plan_wait is not None:  # --request-wait: every wait of its requests
                    instance.plan_wait_seconds = instance.load_wait_seconds = self.plan_wait
        self.instances = {wish.key: self.instances[wish.key] for wish in wished}  # every node's order: the asking
        self._check_membership(bool(wished))
        if self.unsettled is not None:
            for instance in self.instances.values():
                if instance.plan is None or not self.cluster.meshed(instance.plan.member_ids):
                    instance.settle(None, None, f"waiting for the members to link with each other "
                                    f"({self.unsettled})", None)
            self.cluster.announce_soon()
            return
        asks = []
        for index, wish in enumerate(wished):
            instance = self.instances[wish.key]
            try:
                asks.append(self._ask(wish.model, self._describe(wish.model), first=index == 0, nodes=wish.nodes,
                                      instance=wish.instance))
            except ModelPendingError as exc:
                instance.settle(None, None, exc.message, None)  # re-planned once the description is here
            except ExoLikeError as exc:
                instance.settle(None, f"cannot serve {wish.model}: {exc.message}", None, None)
        self._placed = place_instances(asks, self.cluster.members(), self._figures(), self._decide, self._placed)
        for key, placed in self._placed.items():
            decision = placed.decision
            self.instances[key].settle(placed.plan, placed.problem, decision.pending if decision else None,
                                       decision.report if decision else None)
        self.cluster.announce_soon()

    def _ask(self, model: str, description: ModelDescription, first: bool, nodes: tuple[str, ...] = (),
             instance: str = "") -> InstanceAsk:
        # Tensor-parallel groups for the oldest instance only: a node runs one group worker at a time.
        return InstanceAsk(model, description.n_layers, description.footprint, nodes,
                           description.tensor_sizes if first else (), description.tensor_engines, instance)

    def _figures(self) -> dict[str, dict[str, SpeedFigures | None]]:
        """Each member's announced figures for each instance's model (this node's measured as it goes)."""
        members = self.cluster.members()
        figures: dict[str, dict[str, SpeedFigures | None]] = {}
        for model in dict.fromkeys(wish.model for wish in self.wishes.loaded()):
            mine = {m.node_id: self._figures_of(m.node_id, model) for m in members}
            # Slices for tensor-parallel groups only once every member has its layer figure: nodes of one host
            # measure one at a time, and the plan waits for those figures, not for the slices.
            everyone = all(f is not None and f.measured_for(model) for f in mine.values())
            same_engine = sum(m.engine == self.cluster.me.engine for m in members) if everyone else 1
            self._speed.measure(model, same_engine)  # a no-op once measured (or when placing by memory)
            mine[self.me] = self._speed.figures(model)
            figures[model] = mine
        return figures

    def _figures_of(self, node_id: str, model: str | None) -> SpeedFigures | None:
        if node_id == self.me:
            return self._speed.figures(model)
        announcement = self.cluster.announcements.get(node_id)
        return announcement.figures_for(model) if announcement is not None else None

    def description(self, model: str) -> ModelDescription | None:
        """A model's layer count and bytes, if this node has them (else its instance's problem says why)."""
        try:
            return self._describe(model)
        except ExoLikeError:
            return None

    def figures_of(self, node_id: str, model: str | None) -> SpeedFigures | None:
        """A member's figures for `model` as announced (this node's: as it announces them)."""
        return self._figures_of(node_id, model)

    def _decide(self, ask: InstanceAsk, members: list[Member], figures: NodeFigures) -> Decision:
        instance = self.instances.get(ask.key)
        return self._placer.decide(ask.model, ask.n_layers, ask.footprint, members, figures,
                                   instance.plan if instance is not None else None, ask.tensor_sizes,
                                   ask.tensor_engines)

    def _check_membership(self, wanted: bool) -> None:
        """Note whether some linked peer is linked with other members than this node is (see settled.py)."""
        before = self.unsettled
        self.unsettled = self.cluster.unsettled() if wanted else None
        if self.unsettled != before:
            if self.unsettled is None:
                log.info("node %s: every member is linked with every other", self.me)
            else:
                log.info("node %s: waiting for the members to link with each other: %s", self.me, self.unsettled)

    def _remove(self, model: str) -> None:
        instance = self.instances.pop(model)
        self._placed.pop(model, None)
        instance.stop()
        task = asyncio.ensure_future(instance.part.close(f"{model} was unloaded during the request",
                                                         "model_unloaded"))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    # -- announcements ------------------------------------------------------------------------------------

    def announcement(self, load: NodeLoad) -> Announcement:
        """What this node announces (its links aside): the registers, each instance, its figures."""
        states = {key: instance.state(self.local_in_flight(key), **self._use_state(key))
                  for key, instance in self.instances.items()}
        models = [wish.model for wish in self.wishes.loaded()] or [None]
        figures = {model: self._speed.figures(model) for model in models}
        return Announcement(tuple(self.wishes.all()), states, load, figures)

    def _announced(self, node_id: str, before: Announcement | None) -> None:
        """A peer's announcement arrived (or this node's own state changed: node_id is this node's)."""
        after = self.cluster.announcement_of(node_id)
        if after is None:
            return
        if node_id != self.me and self._merge(after.wishes):
            self.replan()
        elif before is None or before.figures != after.figures or before.linked != after.linked:
            self.replan()  # plans are made from every member's announced figures and links
        for instance in self.instances.values():
            instance.wake()

    def _merge(self, wishes: tuple[Wish, ...]) -> bool:
        """A peer's registers; a model this node's clients still use that a peer unloaded is asked for again."""
        changed = self.wishes.merge(list(wishes))
        for key in self.instances:
            wish = self.wishes.get(key)
            if wish is not None and not wish.loaded and (self.local_in_flight(key) or key in self.pinned):
                log.info("node %s: %s was unloaded while this node's requests use it; asking for it again",
                         self.me, key)
                self.wishes.load(wish.model, wish.nodes, wish.instance)
                changed = True
        return changed

    def _members_changed(self, live: set[str]) -> None:
        for instance in self.instances.values():
            instance.part.generator.members_changed(live)
        self.replan()

    # -- keep_alive ---------------------------------------------------------------------------------------

    def local_in_flight(self, key: str) -> int:
        """This node's requests for `key`: generating, waiting for it, or about to."""
        instance = self.instances.get(key)
        running = len(instance.part.generator.in_flight) if instance is not None else 0
        return running + (1 if self._starting(key) and not running else 0)

    def _starting(self, key: str) -> bool:
        """Whether a request named `key` moments ago and has not begun generating yet."""
        use, instance = self._uses.get(key), self.instances.get(key)
        return (use is not None and instance is not None and time.monotonic() - use.started < STARTING_SECONDS
                and instance.part.generator.requests_total == use.seen)

    def in_flight(self, key: str) -> int:
        """Requests for `key` on every node, as announced."""
        total = self.local_in_flight(key)
        for announcement in self.cluster.announcements.values():
            state = announcement.instance(key)
            total += state.in_flight if state is not None else 0
        return total

    def _use_state(self, key: str) -> dict[str, Any]:
        """This node's use of `key` as it announces it: its last request's keep_alive and how long ago it ran."""
        use = self._uses.get(key)
        return {"pinned": key in self.pinned,
                "keep_alive": None if use is None else KEEP_FOREVER if use.keep_for == FOREVER else use.keep_for,
                "idle_seconds": None if use is None else round(max(0.0, time.monotonic() - use.ran), 1)}

    def _deadline(self, key: str) -> float:
        """When `key`'s keep_alive runs out (monotonic; inf: kept). A node that keeps it loaded keeps it; else the
        cluster's last request for it decides, as in Ollama: its keep_alive, counted from when it ran."""
        now = time.monotonic()
        states = [self.instances[key].state(**self._use_state(key))] if key in self.instances else []
        states += [state for a in self.cluster.announcements.values() if (state := a.instance(key)) is not None]
        if any(state.pinned for state in states):
            return math.inf
        used = [state for state in states if state.keep_alive is not None and state.idle_seconds is not None]
        if not used:
            return math.inf  # asked for by no request (the load API of a node gone since): kept
        last = min(used, key=lambda state: state.idle_seconds)  # type: ignore[arg-type, return-value]
        if last.keep_alive == KEEP_FOREVER:
            return math.inf
        return now - last.idle_seconds + last.keep_alive  # type: ignore[operator]

    def expires_in(self, key: str) -> float | None:
        """Seconds until `key` is unloaded if no request comes (None: kept until unloaded by name)."""
        deadline = self._deadline(key)
        return None if deadline == math.inf else max(0.0, deadline - time.monotonic())

    async def _watch_keep_alive(self) -> None:
        while True:
            await asyncio.sleep(KEEP_WATCH_SECONDS)
            self._expire()

    def _expire(self) -> None:
        now = time.monotonic()
        for key, use in self._uses.items():
            if key in self.instances and self.local_in_flight(key):
                use.ran = now  # keep_alive counts from the last moment a request ran
        gone = [k for k in self.instances if self.in_flight(k) == 0 and self._deadline(k) <= now]
        for key in gone:
            log.info("node %s: %s idle past its keep_alive: unloading it", self.me, key)
            self.wishes.unload(key)
        if gone:
            self.replan()

    # -- routing --------------------------------------------------------------------------------------------

    def by_digest(self, digest: str) -> Instance | None:
        """The instance whose plan (current or recent) has this digest."""
        for instance in self.instances.values():
            if digest in instance.digests:
                return instance
        return None

