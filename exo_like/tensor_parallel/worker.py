"""One rank of a tensor-parallel group, in a process of its own: `python -m exo_like.tensor_parallel.worker`,
spawned and supervised by the node (process.py). It forms the group with the other ranks' workers, then serves
its node's requests (load, allocate_kv, describe; on the leader, steps) over the socketpair it inherited, and on a
follower the leader's Follow frames. One thread does everything, one message at a time: a step's collectives
keep the ranks in lockstep, and a rank blocked in one cannot be interrupted — the node kills the process instead.

Crash-only: a broken group (a peer gone, a collective failed, the leader's channel closed) ends the process; the
node starts a new group. The worker also exits when its node's end of the socketpair closes (the node died).
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import sys
from pathlib import Path
from typing import Any

from exo_like.engines.base import Engine, create_engine
from exo_like.errors import ExoLikeError
from exo_like.tensor_parallel import control
from exo_like.tensor_parallel.messages import (AllocateKV, Describe, Done, Failed, Follow, Formation, Load, Message,
                                               Ready, Step, receive, send)
from exo_like.tensor_parallel.options import KEY_VARIABLE, WorkerOptions

log = logging.getLogger("exo_like.tensor_parallel.worker")


def form_group(options: WorkerOptions, key: bytes, device: Any) -> Any:
    """Meet the other ranks: the leader opens its rendezvous store, dials every follower's control channel and
    tells it where the store is; then all form the framework's group there."""
    if options.engine != "torch":
        raise ValueError(f"no tensor-parallel backend for the {options.engine} engine yet")
    from exo_like.tensor_parallel import torch_group
    if options.rank == 0:
        store = torch_group.leader_store(options.bind, options.size, options.timeout)
        followers = [control.dial_follower(address, key, options.name, rank)
                     for rank, address in enumerate(options.control) if rank > 0]
        for follower in followers:
            send(follower, Formation(options.bind, store.port))
        leader_channel = None
    else:
        leader_channel = accept_leader(options, key)
        formation = receive(leader_channel)
        if not isinstance(formation, Formation):
            raise SystemExit(f"the leader sent {formation.type} before formation")
        store = torch_group.follower_store((formation.store_host, formation.store_port), options.size,
                                           options.timeout)
        followers = []
    group = torch_group.TorchGroup(options.rank, options.size, store, options.bind, key, options.name,
                                   options.timeout, device)
    group.followers = followers
    return group, leader_channel


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
            "quantized": engine.weight_forms.quantized, "dequantized": engine.weight_forms.dequantized}


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
    selector = selectors.DefaultSelector()
    selector.register(node, selectors.EVENT_READ)
    if leader_channel is not None:
        selector.register(leader_channel, selectors.EVENT_READ)
    while True:
        for key, _ in selector.select():
            try:
                if key.fileobj is node:
                    answer(node, engine, leader_channel is None)
                else:
                    follow(leader_channel, engine)  # type: ignore[arg-type]
            except EOFError:
                side = "node" if key.fileobj is node else "leader"
                log.info("rank %d: the %s closed its channel; exiting", engine.group.rank, side)  # type: ignore
                return


def die_with(parent: int) -> None:
    """Linux: the kernel kills this process when its node's process ends, even a SIGKILLed node, even while this
    one is blocked in a collective: no orphan workers."""
    if sys.platform == "linux":
        import ctypes
        import signal
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it ended before the line above took effect
        raise SystemExit("the node that started this worker is gone")


def main(argv: list[str] | None = None) -> None:
    options = WorkerOptions.from_argv(argv if argv is not None else sys.argv[1:])
    die_with(options.parent)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s [{options.node_id or '-'} rank "
                        f"{options.rank}] %(name)s: %(message)s")
    key = bytes.fromhex(os.environ.pop(KEY_VARIABLE))
    node = socket.socket(fileno=options.fd)
    engine = create_engine(options.engine, device=options.device, dtype=options.dtype)
    if options.threads:
        import torch
        torch.set_num_threads(options.threads)
    engine.group, leader_channel = form_group(options, key, getattr(engine, "device", None))
    send(node, Ready(os.getpid(), engine.name, engine.device_name, engine.on_cpu, engine.numerics()))
    try:
        serve(node, engine, leader_channel)
    finally:
        engine.group.close()


if __name__ == "__main__":
    main()
