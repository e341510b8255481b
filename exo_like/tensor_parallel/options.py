"""What a worker process is told at spawn: its rank, its group and where the group meets (one JSON argument; the
cluster key comes in the environment, so that `ps` does not show it)."""

from __future__ import annotations

import json
import socket
from dataclasses import asdict, dataclass, field

KEY_VARIABLE = "EXO_LIKE_GROUP_KEY"
Address = tuple[str, int]


@dataclass
class WorkerOptions:
    """name: the group's name, unique per formation (a new membership is a new group); engine: torch or mlx;
    rendezvous: where the leader's worker hosts the collective's store; bind: this rank's address on the group's
    network; control: every rank's control-channel address (followers listen on theirs, the leader dials them);
    timeout: seconds a collective waits for a silent peer; fd: the worker's end of its node's socketpair."""

    rank: int
    size: int
    name: str
    engine: str
    rendezvous: Address
    bind: str
    control: list[Address]
    timeout: float = 60.0
    device: str | None = None
    dtype: str | None = None
    threads: int | None = None
    fd: int = -1
    parent: int = 0  # the node's pid: the worker dies with it
    listening: socket.socket | None = field(default=None, repr=False)  # a follower's control listener

    def to_argv(self) -> list[str]:
        values = asdict(self)
        values.pop("listening")
        return ["--options", json.dumps(values)]

    @classmethod
    def from_argv(cls, argv: list[str]) -> "WorkerOptions":
        if len(argv) != 2 or argv[0] != "--options":
            raise SystemExit("usage: python -m exo_like.tensor_parallel.worker --options JSON (the node starts it)")
        values = json.loads(argv[1])
        values["rendezvous"] = tuple(values["rendezvous"])
        values["control"] = [tuple(address) for address in values["control"]]
        return cls(**values)
