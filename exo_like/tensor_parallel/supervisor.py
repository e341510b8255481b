"""A node's worker for its rank of a tensor-parallel group: started when a plan puts the node in a group, kept
while the group stays the same (same model, layers, members and addresses), killed when it changes, when it broke,
or when the node stops. Nothing else of the node talks to worker processes."""

from __future__ import annotations

import hashlib
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass

from exo_like.engines.base import Engine
from exo_like.tensor_parallel.messages import Ready
from exo_like.tensor_parallel.options import Address, WorkerOptions
from exo_like.tensor_parallel.process import GroupBroken, GroupMemberEngine, WorkerProcess

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupSpec:
    """One rank's view of a group: `members` are (node id, host, control port) in rank order."""

    model: str
    start_layer: int
    end_layer: int
    members: tuple[tuple[str, str, int], ...]
    rank: int

    @property
    def name(self) -> str:
        """The same on every member: the group's identity, which the control channel's proofs cover."""
        body = "|".join([self.model, str(self.start_layer), str(self.end_layer),
                         *(f"{node}@{host}:{port}" for node, host, port in self.members)])
        return hashlib.sha256(body.encode()).hexdigest()[:16]

    @property
    def member_ids(self) -> tuple[str, ...]:
        return tuple(node for node, _, _ in self.members)

    @property
    def control(self) -> list[Address]:
        return [(host, port) for _, host, port in self.members]


class GroupSupervisor:
    """`listener`: the node's control-channel socket (NodeInfo.tp_port), handed to every follower worker it starts;
    `local`: the node's own engine (its kind, device and dtype are the worker's; it measures layers)."""

    def __init__(self, node_id: str, key: bytes, bind: str, listener: socket.socket, local: Engine,
                 timeout: float = 60.0, on_formed: Callable[[GroupSpec, Ready], None] | None = None):
        """on_formed: called with each group this node's worker formed (its all-reduce time, for the planner)."""
        self.node_id, self.key, self.bind, self.listener, self.local = node_id, key, bind, listener, local
        self.timeout = timeout
        self.on_formed = on_formed
        self.spec: GroupSpec | None = None
        self.worker: WorkerProcess | None = None
        self.engine: GroupMemberEngine | None = None  # once the worker's group has formed
        self.formations = 0  # workers started so far: a new one holds nothing yet

    def engine_for(self, spec: GroupSpec) -> GroupMemberEngine:
        """The running worker for `spec`, or a new one once its group has formed (blocking: call off the event
        loop). Raises GroupBroken when the group does not form."""
        if self.spec == spec and self.engine is not None and not self.broken():
            return self.engine
        self.stop()
        options = WorkerOptions(spec.rank, len(spec.members), spec.name, self.local.name, self.bind, spec.control,
                                self.timeout, self.local.requested_device, self.local.requested_dtype,
                                listen_fd=self.listener.fileno() if spec.rank > 0 else -1, node_id=self.node_id)
        worker = WorkerProcess(options, self.key)
        log.info("node %s: started rank %d of group %s (%d members) as process %d", self.node_id, spec.rank,
                 spec.name, len(spec.members), worker.pid)
        self.spec, self.worker = spec, worker
        self.formations += 1
        ready = worker.wait_ready()  # GroupBroken if the others never come, or stop() killed it
        log.info("node %s: group %s formed; an all-reduce takes %.3f ms", self.node_id, spec.name,
                 ready.allreduce_ns / 1e6)
        if self.on_formed is not None:
            self.on_formed(spec, ready)
        self.engine = GroupMemberEngine(worker, ready, self.local)
        return self.engine

    def broken(self) -> bool:
        """Whether the running worker has exited (its group broke)."""
        return self.worker is not None and self.worker.process.poll() is not None

    def stop(self) -> None:
        """Kill the worker, if any (from any thread: a formation waiting on it ends with GroupBroken)."""
        worker, self.worker, self.engine, spec, self.spec = self.worker, None, None, self.spec, None
        if worker is not None:
            log.info("node %s: stopping rank %d of group %s", self.node_id, worker.rank, spec.name if spec else "?")
            worker.kill()


__all__ = ["GroupBroken", "GroupSpec", "GroupSupervisor"]
