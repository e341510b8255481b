"""The instances the cluster is asked to serve, as every node knows them: one last-writer-wins register per model.

A request naming a model, `--model`, the dashboard or the load API writes the model's register (load, on chosen
nodes or not); an unload, `keep_alive` running out or making room writes it again (unloaded). Each write carries a
Lamport clock (a counter one past any this node has seen, then the writer's node id), so every node that has
seen the same writes holds the same registers whatever order they arrived in, and places the same instances.
Registers of unloaded models stay (a late, older write must not bring a model back).
"""

from __future__ import annotations

from exo_like.cluster.protocol import Wish

Clock = tuple[int, str]


class Wishes:
    """This node's copy of the registers."""

    def __init__(self, node_id: str):
        self.node_id = node_id
        self._registers: dict[str, Wish] = {}
        self._counter = 0

    def load(self, model: str, nodes: tuple[str, ...] = (), instance: str = "") -> Wish | None:
        """Ask for `model` (on `nodes`; `instance`: another instance of it than its first); None when it is asked
        for like that already (nothing to tell peers)."""
        key = instance or model
        current = self._registers.get(key)
        if current is not None and current.loaded and current.nodes == nodes:
            return None
        return self._write(Wish(model, self._next_clock(), True, nodes, instance))

    def unload(self, key: str) -> Wish | None:
        """Stop serving the instance `key` (a model's first instance: the model's key); None when it is not asked
        for."""
        current = self._registers.get(key)
        if current is None or not current.loaded:
            return None
        return self._write(Wish(current.model, self._next_clock(), False, current.nodes, current.instance))

    def merge(self, wishes: list[Wish]) -> bool:
        """A peer's registers: each newer one replaces ours. Whether anything changed."""
        changed = False
        for wish in wishes:
            self._counter = max(self._counter, wish.clock[0])
            current = self._registers.get(wish.key)
            if current is None or wish.clock > current.clock:
                self._registers[wish.key] = wish
                changed = True
        return changed

    def loaded(self) -> list[Wish]:
        """The models the cluster serves, in the order they were asked for (placement's order: oldest first)."""
        return sorted((w for w in self._registers.values() if w.loaded), key=lambda w: w.clock)

    def get(self, key: str) -> Wish | None:
        return self._registers.get(key)

    def all(self) -> list[Wish]:
        return sorted(self._registers.values(), key=lambda w: w.clock)

    def _next_clock(self) -> Clock:
        self._counter += 1
        return (self._counter, self.node_id)

    def _write(self, wish: Wish) -> Wish:
        self._registers[wish.key] = wish
        return wish
