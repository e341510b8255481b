"""An MLX rank's group: mx.distributed over its ring backend (TCP between ring neighbours; no MPI), one group per
worker process (MLX forms its global group once per process: a new membership needs a new worker).

The ring takes its members from the environment at `mx.distributed.init`: MLX_RANK, and MLX_HOSTFILE, a JSON file
listing one list of "host:port" per rank (IPv4 or host names). Each rank listens on its own address; rank r
connects to rank r+1 (the last rank first, to rank 0; each other one once its left neighbour has connected),
retrying a refused connection after 1, 2, 4, 8 s, then failing. The worker's formation (worker.py) gives every
rank the same list: each follower offers a port it holds (Offer), the leader sends the whole ring (Formation.ring).
A second's retry is sometimes unavoidable: the last rank may connect to the leader before the leader listens (the
leader's last Python step is announcing the ring), and it listens only once its own connection is made, which its
left neighbour may not wait for. Both seen here only with more ranks than CPUs (a 3-rank group on 2 CPUs: about
one formation in two).

What the rest relies on, read in mlx's `distributed/ring/ring.cpp` (0.32) and measured here:
- all_sum is a ring reduce-scatter then all-gather: each slice is summed by one rank and copied to the others, so
  every rank holds the same bits (the MoE routers of every rank choose the same experts).
- all_sum is lazy, an op of the step's graph on the CPU stream; the engine's two sums a layer depend on each other
  through the residual stream, so one mx.eval of the step runs them in the same order on every rank.
- A peer that exits fails the sum under way within ~0.2 s ("[ring] connection to a peer was lost", a
  RuntimeError out of mx.eval); a frozen one blocks it for good (the ring has no timeout): the node kills the
  worker then.
- `init` holds the GIL until the ring has formed, and blocks for good while a peer never connects.
- The ring's connections are not authenticated (see docs/tensor-parallel.md).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import tempfile
import time
from collections.abc import Callable, Sequence

import mlx.core as mx

from exo_like.tensor_parallel.steps import SharedSteps

log = logging.getLogger(__name__)


def reserve_port(host: str) -> socket.socket:
    """A port of the system's choosing on `host`, held by a socket bound to it but not listening, with
    SO_REUSEPORT: MLX's listening socket binds the same port beside it, and meanwhile no other socket (another
    process's outgoing connection, say) can take it. Close it once the ring has formed."""
    if ":" in host:
        raise ValueError(f"MLX's ring takes IPv4 addresses or host names, not {host!r}")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, 0))
    except BaseException:
        sock.close()
        raise
    return sock


def join_ring(rank: int, ring: Sequence[str], announce: Callable[[], None] | None = None) -> mx.distributed.Group:
    """This process's rank of the ring `ring` (every rank's "host:port", in rank order). `announce`: called at the
    last moment before joining (the leader tells its followers the ring there: the last rank connects to the
    leader as soon as it knows the ring, and should find it listening)."""
    fd, path = tempfile.mkstemp(prefix="exo-like-ring-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as hostfile:
            json.dump([[address] for address in ring], hostfile)
        os.environ["MLX_RANK"], os.environ["MLX_HOSTFILE"] = str(rank), path
        if announce is not None:
            announce()
        group = mx.distributed.init(strict=True, backend="ring")
    finally:
        os.environ.pop("MLX_RANK", None)
        os.environ.pop("MLX_HOSTFILE", None)
        os.unlink(path)  # read by init
    if (group.rank(), group.size()) != (rank, len(ring)):  # this process had formed another group before
        raise RuntimeError(f"MLX's group is rank {group.rank()} of {group.size()}, not {rank} of {len(ring)}: "
                           "one group per process")
    return group


class MlxGroup(SharedSteps):
    """Rank `rank` of `size`, a member of the MLX ring `ring`. Formed once the ring has connected and a first sum
    has shown that every rank holds a distinct rank of the same ring. `announce`: see join_ring."""

    def __init__(self, rank: int, size: int, ring: Sequence[str], name: str,
                 announce: Callable[[], None] | None = None):
        if len(ring) != size or not 0 <= rank < size:
            raise ValueError(f"rank {rank} of {size} cannot join a ring of {len(ring)}")
        self.rank, self.size = rank, size
        self.followers: list[socket.socket] = []
        started = time.perf_counter()
        self.group = join_ring(rank, ring, announce)
        one_hot = mx.array([float(r == rank) for r in range(size)])
        check = mx.distributed.all_sum(one_hot, group=self.group)
        if not bool(mx.all(check == 1.0).item()):
            raise RuntimeError(f"the ring's ranks are not 0..{size - 1} once each: {check.tolist()}")
        log.info("tensor-parallel group %s: rank %d of %d formed over MLX's ring (%s) in %.2f s", name, rank, size,
                 " ".join(ring), time.perf_counter() - started)

    def all_reduce(self, tensor: mx.array) -> mx.array:
        """Lazy, like any op of the step's graph: evaluated with the step (mx.eval in the engine)."""
        return mx.distributed.all_sum(tensor, group=self.group)

    def zeros(self, width: int) -> mx.array:
        return mx.zeros((1, width), dtype=mx.float32)

    def wait(self, array: mx.array) -> None:
        mx.eval(array)

