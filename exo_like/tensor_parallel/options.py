"""What a worker process is told at spawn: its rank, its group and where the group meets (one JSON argument; the
cluster key comes in the environment, so that `ps` does not show it)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

KEY_VARIABLE = "EXO_LIKE_GROUP_KEY"
Address = tuple[str, int]


@dataclass
class WorkerOptions:
    """name: the group's name (its plan's; the control channel's proofs cover it); engine: torch or mlx; bind: this
    rank's address on the group's network; control: every rank's control-channel address (the leader dials the
    followers'; a follower listens on its own, or on `listen_fd`, a listening socket its node holds open for
    every worker it starts); timeout: seconds a collective waits for a silent peer (torch; MLX's ring waits for
    good); fd: the worker's end of its node's socketpair; cpus: the CPUs the worker's threads may run on (None:
    any), set at its start. A rank of an MLX ring on a CPU of its own sums in ~0.1 ms; left to the scheduler on a
    busy host, ~8 ms (the ring's threads wait to be woken)."""

    rank: int
    size: int
    name: str
    engine: str
    bind: str
    control: list[Address]
    timeout: float = 60.0
    device: str | None = None
    dtype: str | None = None
    threads: int | None = None
    fd: int = -1
    listen_fd: int = -1
    parent: int = 0  # the node's pid: the worker dies with it
    node_id: str = ""  # the node's id, in the worker's log lines
    cpus: list[int] | None = None

    def to_argv(self) -> list[str]:
        return ["--options", json.dumps(asdict(self))]

    @classmethod
    def from_argv(cls, argv: list[str]) -> "WorkerOptions":
        if len(argv) != 2 or argv[0] != "--options":
            raise SystemExit("usage: python -m exo_like.tensor_parallel.worker --options JSON (the node starts it)")
        values = json.loads(argv[1])
        values["control"] = [tuple(address) for address in values["control"]]
        return cls(**values)
