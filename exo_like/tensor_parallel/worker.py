"""One rank of a tensor-parallel group, in a process of its own: `python -m exo_like.tensor_parallel.worker`,
spawned and supervised by the node (process.py). It forms the group with the other ranks' workers, then serves
its node's requests (load, allocate_kv, describe; on the leader, steps) over the socketpair it inherited, and on a
follower the leader's Follow frames. One thread does everything, one message at a time: a step's collectives
keep the ranks in lockstep, and a rank blocked in one cannot be interrupted — the node kills the process instead.

Crash-only: a broken group (a peer gone, a collective failed, the leader's channel closed) ends the process; the
node starts a new group. The worker also exits when its node's end of the socketpair closes (the node died).
"""

from __future__ import annotations

import gc
import logging
import os
import selectors
import socket
import sys
from functools import partial
from pathlib import Path
from typing import Any

from exo_like.engines.base import Engine
from exo_like.engines.choice import create_engine
from exo_like.errors import ExoLikeError
from exo_like.tensor_parallel import control
from exo_like.tensor_parallel.messages import (AllocateKV, Describe, Done, Failed, Follow, Formation, Load, M, Message,
                                               Offer, Ready, Step, receive, send)
from exo_like.tensor_parallel.options import KEY_VARIABLE, WorkerOptions

log = logging.getLogger("exo_like.tensor_parallel.worker")

ALLREDUCE_WIDTH = 4096
ALLREDUCE_TIMES = 50


def form_group(options: WorkerOptions, key: bytes, device: Any) -> Any:
    """Meet the other ranks: the leader dials every follower's control channel and tells it where the framework's
    group forms (Formation); then all form it there. Returns the group and, on a follower, the leader's channel."""
    if options.engine == "torch":
        return form_torch_group(options, key, device)
    if options.engine == "mlx":
        return form_mlx_group(options, key)
    raise ValueError(f"no tensor-parallel backend for the {options.engine} engine")


def form_torch_group(options: WorkerOptions, key: bytes, device: Any) -> Any:
    """The leader opens its rendezvous store on a free port and tells each follower where; all form the process
    group there."""
    from exo_like.tensor_parallel import torch_group
    if options.rank == 0:
        store = torch_group.leader_store(options.bind, options.size, options.timeout)
        followers = dial_followers(options, key)
        for follower in followers:
            send(follower, Formation(options.bind, store.port))
        leader_channel = None
    else:
        leader_channel = accept_leader(options, key)
        formation = expect(leader_channel, Formation)
        if formation.ring:
            raise SystemExit("the leader formed an MLX ring; this worker runs torch")
        store = torch_group.follower_store((formation.store_host, formation.store_port), options.size,
                                           options.timeout)
        followers = []
    group = torch_group.TorchGroup(options.rank, options.size, store, options.bind, key, options.name,
                                   options.timeout, device)
    group.followers = followers
    return group, leader_channel


def form_mlx_group(options: WorkerOptions, key: bytes) -> Any:
    """Every rank holds a free port on its `bind` address (mlx_group.reserve_port) until the ring has formed; each
    follower offers its own to the leader once the control channel is up (Offer); the leader sends every follower
    the whole ring (Formation.ring) right before it joins the ring itself, and each follower joins on receipt.
    (The last rank connects to the leader first, and a connection that finds no listener retries only a second
    later.)"""
    from exo_like.tensor_parallel import mlx_group
    reservation = mlx_group.reserve_port(options.bind)
    mine = f"{options.bind}:{reservation.getsockname()[1]}"
    announce = None
    try:
        if options.rank == 0:
            followers = dial_followers(options, key)
            ring = [mine]
            for follower in followers:
                follower.settimeout(options.timeout)
                offer = expect(follower, Offer)
                follower.settimeout(None)
                ring.append(f"{offer.host}:{offer.port}")
            leader_channel = None
            announce = partial(send_all, followers, Formation(ring=tuple(ring)))
        else:
            leader_channel = accept_leader(options, key)
            send(leader_channel, Offer(options.bind, reservation.getsockname()[1]))
            leader_channel.settimeout(options.timeout)
            formation = expect(leader_channel, Formation)
            leader_channel.settimeout(None)
            ring = list(formation.ring)
            if len(ring) != options.size or ring[options.rank] != mine:
                raise SystemExit(f"the leader's ring {ring} does not hold rank {options.rank} of {options.size} at "
                                 f"{mine}")
            followers = []
        group = mlx_group.MlxGroup(options.rank, options.size, ring, options.name, announce)
    finally:
        reservation.close()
    group.followers = followers
    return group, leader_channel


def send_all(channels: list[socket.socket], message: Message) -> None:
    for channel in channels:
        send(channel, message)


def dial_followers(options: WorkerOptions, key: bytes) -> list[socket.socket]:
    return [control.dial_follower(address, key, options.name, rank)
            for rank, address in enumerate(options.control) if rank > 0]


def expect(channel: socket.socket, kind: type[M]) -> M:
    """The next frame on a control channel during formation, which must be a `kind`."""
    message = receive(channel)
    if not isinstance(message, kind):
        raise SystemExit(f"the other side sent {message.type}, not {kind.type}, during formation")
    return message


def accept_leader(options: WorkerOptions, key: bytes) -> socket.socket:
    server = socket.socket(fileno=options.listen_fd) if options.listen_fd >= 0 else \
        control.listen(options.control[options.rank])
    try:
        return control.accept_leader(server, key, options.name, options.rank)
    finally:
        if options.listen_fd < 0:
            server.close()
        else:
            server.detach()  # the node's socket: it stays open for the next worker


def describe(engine: Engine) -> dict[str, Any]:
    size = engine.kv_size
    return {"parameter_bytes": engine.parameter_bytes(), "dtype_name": engine.dtype_name,
            "kv_block_bytes": list(engine.kv_block_bytes()) if engine.shard is not None else None,
            "kv_size": None if size is None else [size.blocks, size.window_blocks],
            "quantized": engine.weight_forms.quantized, "dequantized": engine.weight_forms.dequantized,
            "numerics": engine.numerics()}


def handle(engine: Engine, message: Message, leader: bool) -> Done:
    """A node request's answer (raises what the engine raises)."""
    if isinstance(message, Load):
        engine.load(Path(message.model_dir), message.args, message.shard)
        engine.place_threads()
    elif isinstance(message, AllocateKV):
        engine.allocate_kv(message.n_blocks, message.n_window_blocks)
    elif isinstance(message, Step):
        if not leader:
            raise ExoLikeError("a follower runs only its leader's steps")
        return Done({}, engine.step(message.items, message.inputs))
    elif not isinstance(message, Describe):
        raise ExoLikeError(f"a worker takes no {message.type} from its node")
    return Done(describe(engine))


def answer(node: socket.socket, engine: Engine, leader: bool) -> None:
    """Serve one request of the node; SystemExit when the worker cannot go on."""
    message = receive(node)
    try:
        send(node, handle(engine, message, leader))
    except ExoLikeError as exc:  # the request's fault (a bad item, a missing file): the group is intact
        send(node, Failed(type(exc).__name__, str(exc), exc.status, fatal=False))
    except Exception as exc:  # a collective or the engine failed mid-step: the ranks are out of step for good
        log.exception("rank %s: %s failed; the group is broken", engine.group and engine.group.rank, message.type)
        send(node, Failed(type(exc).__name__, str(exc), 500, fatal=True))
        raise SystemExit(1) from exc


def follow(leader: socket.socket, engine: Engine) -> None:
    message = receive(leader)
    if not isinstance(message, Follow):
        raise SystemExit(f"the leader sent {message.type}, not a step")
    engine.follow(message.items, message.hidden)


def serve(node: socket.socket, engine: Engine, leader_channel: socket.socket | None) -> None:
    """Until the node, the leader or a follower closes its channel. A leader reads nothing from its followers:
    their channels becoming readable means they closed (the follower's worker died), and the group with it."""
    selector = selectors.DefaultSelector()
    selector.register(node, selectors.EVENT_READ, "node")
    if leader_channel is not None:
        selector.register(leader_channel, selectors.EVENT_READ, "leader")
    for follower in getattr(engine.group, "followers", []):
        selector.register(follower, selectors.EVENT_READ, "a follower")
    while True:
        for key, _ in selector.select():
            try:
                if key.data == "node":
                    answer(node, engine, leader_channel is None)
                elif key.data == "leader":
                    follow(leader_channel, engine)  # type: ignore[arg-type]
                else:
                    raise EOFError
            except EOFError:
                log.info("rank %d: %s closed its channel; exiting", engine.group.rank, key.data)  # type: ignore
                if key.data != "node":
                    refuse_waiting_request(node, f"the group is broken: {key.data}'s worker closed its channel")
                return


REFUSE_WAIT_SECONDS = 1.0  # how long an exiting worker waits for a request on its way (its node sends at once)


def refuse_waiting_request(node: socket.socket, why: str) -> None:
    """A request of the node's waiting (or on its way) when the group broke gets `why` (fatal) rather than a
    reset connection: exiting with it unread would make the kernel reset the channel, and the node would see only
    that. (A step the node sends just after a follower died reaches the leader's worker a moment after it saw
    the follower's channel close.)"""
    waiting = selectors.DefaultSelector()
    waiting.register(node, selectors.EVENT_READ)
    if not waiting.select(timeout=REFUSE_WAIT_SECONDS):
        return
    try:
        message = receive(node)
        send(node, Failed("GroupBroken", f"{why} ({message.type} not run)", 500, fatal=True))
    except (EOFError, OSError, ValueError):
        pass  # the node has gone too, or sent what cannot be read: the worker exits either way


def die_with(parent: int) -> None:
    """Linux: the kernel kills this process when its node's process ends, even a SIGKILLed node, even while this
    one is blocked in a collective: no orphan workers."""
    if sys.platform == "linux":
        import ctypes
        import signal
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it ended before the line above took effect
        raise SystemExit("the node that started this worker is gone")


def pin(cpus: list[int]) -> None:
    """Keep every thread of this process, and so every thread it starts later (the framework's), on `cpus`."""
    if not hasattr(os, "sched_setaffinity"):
        log.warning("this system cannot pin a process's threads to CPUs: cpus %s ignored", cpus)
        return
    try:
        threads = [int(task) for task in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]
    for thread in threads:
        try:
            os.sched_setaffinity(thread, cpus)
        except ProcessLookupError:  # a thread that has ended since
            pass
    log.info("threads pinned to cpus %s", ",".join(map(str, sorted(cpus))))


def main(argv: list[str] | None = None) -> None:
    options = WorkerOptions.from_argv(argv if argv is not None else sys.argv[1:])
    die_with(options.parent)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s [{options.node_id or '-'} rank "
                        f"{options.rank}] %(name)s: %(message)s")
    if options.cpus:
        pin(options.cpus)
    key = bytes.fromhex(os.environ.pop(KEY_VARIABLE))
    node = socket.socket(fileno=options.fd)
    engine = create_engine(options.engine, device=options.device, dtype=options.dtype)
    if options.threads and options.engine == "torch":
        import torch
        torch.set_num_threads(options.threads)
    gc.collect()  # the imports live as long as the worker: frozen, a load's collection does not walk them
    gc.freeze()
    engine.group, leader_channel = form_group(options, key, getattr(engine, "device", None))
    # The group's all-reduce as the planner weighs it (every rank in step, right after forming): a decode step's
    # hidden state of a typical width (the time hardly depends on it at these sizes).
    allreduce_ns = engine.group.time_all_reduce(ALLREDUCE_WIDTH, ALLREDUCE_TIMES)
    log.info("rank %d: an all-reduce of %d values takes %.3f ms", options.rank, ALLREDUCE_WIDTH, allreduce_ns / 1e6)
    send(node, Ready(os.getpid(), engine.name, engine.device_name, engine.on_cpu, allreduce_ns))
    try:
        serve(node, engine, leader_channel)
    finally:
        engine.group.close()
        gc.freeze()  # the interpreter's last collections over torch's objects would take a second: skipped


if __name__ == "__main__":
    main()
