"""Where a ring message goes on this node: a small router keyed on the message's type.

Work for a stage (Submit, Forward, Sampled) goes by its plan's digest to the instance of that plan (one this node no
longer has is refused, so its requests' origins replay them); a request's tokens and errors to the generator running
it; a Release to every stage (whichever holds the request frees it). None of them blocks: each queues work or wakes
a loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from exo_like.cluster.protocol import Error, Forward, Message, Release, Sampled, Submit, Tokens
from exo_like.instances.manager import Instances

log = logging.getLogger(__name__)

class Router:
    def __init__(self, node_id: str, instances: Instances, refuse: Callable[[Submit | Forward | Sampled], None]):
        self.node_id = node_id
        self.instances = instances
        self._refuse = refuse  # reply plan_changed to the origins of work for a plan no instance here has
        # Tokens first: it is a kind of Sampled (the lookup is by exact type).
        self._routes: dict[type, Callable[[Any], None]] = {
            Tokens: self._tokens, Error: self._error, Release: self._release,
            Submit: self._work, Forward: self._work, Sampled: self._work}

    def deliver(self, message: Message, sender: str | None = None) -> None:
        route = self._routes.get(type(message))
        if route is None:
            log.warning("node %s: unexpected %s message from %s", self.node_id, message.type, sender or "itself")
            return
        route(message)

    def _parts(self) -> list[Any]:
        return [instance.part for instance in self.instances.instances.values()]

    def _tokens(self, message: Tokens) -> None:
        for part in self._parts():
            if any(part.generator.expects(token.rid) for token in message.tokens[:1]):
                part.generator.handle(message)

    def _error(self, message: Error) -> None:
        for part in self._parts():
            if part.generator.expects(message.rid):
                part.generator.handle(message)

    def _release(self, message: Release) -> None:
        for part in self._parts():
            part.stage.handle(message)

    def _work(self, message: Submit | Forward | Sampled) -> None:
        instance = self.instances.by_digest(message.digest)
        if instance is not None:
            instance.part.stage.handle(message)
        else:
            self._refuse(message)
