"""A tensor-parallel group of worker processes on this host (127.0.0.1), as the nodes of a cluster would start
them, for engine-level tests and benches."""

from __future__ import annotations

import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np

from exo_like.engines.choice import create_engine
from exo_like.models.config import ModelArgs
from exo_like.models.shard import Shard
from exo_like.models.tensor_split import TensorSplit
from exo_like.tensor_parallel.options import WorkerOptions
from exo_like.tensor_parallel.process import GroupMemberEngine, WorkerProcess
from tests.cluster_harness import free_ports
from tests.engine_driver import Driver

KEY = os.urandom(32)
# What the worker-group tests of both engines decode, and on which models.
N_TOKENS = 48
PROMPT = np.array([3, 17, 29, 5, 11, 42, 7, 19, 23, 2, 31, 13], dtype=np.int64)
N_BLOCKS = 32
# dense with GQA, one KV head (replicated on every rank), a mixture of experts beside a dense layer
CASES = {"llama": ("llama", {}), "qwen3-one-kv-head": ("qwen3", {"num_key_value_heads": 1}),
         "qwen3_moe": ("qwen3_moe", {}), "deepseek_v3": ("deepseek_v3", {})}


def greedy(driver: Driver, rid: str = "r") -> tuple[list[int], np.ndarray]:
    """N_TOKENS greedy tokens after PROMPT, and the logits of each step."""
    tokens, logits, inputs = [], [], PROMPT
    for _ in range(N_TOKENS):
        out = driver.forward(rid, inputs)
        logits.append(out)
        tokens.append(int(np.argmax(out)))
        inputs = np.array([tokens[-1]], dtype=np.int64)
    return tokens, np.stack(logits)


def rank_shard(args: ModelArgs, name: str, size: int):
    """Rank -> its shard of the whole model in a group of `size`."""
    return lambda rank: replace(Shard.whole(name, args.num_hidden_layers), tp=TensorSplit(rank, size))


def start_group(size: int, engine: str = "torch", dtype: str | None = "float32", threads: int | None = 1,
                timeout: float = 30.0, key: bytes = KEY, pin: bool = False,
                devices: list[str] | None = None) -> list[GroupMemberEngine]:
    """Ranks 0..size-1, each a worker process; returned once the group has formed (leader first). `pin`: each rank
    on a CPU of its own when this process may use enough of them (else left to the scheduler); `devices`: each
    rank's (default CPU; CUDA ones form an NCCL group, see bench/cuda_check.py)."""
    devices = devices or ["cpu"] * size
    ports = free_ports(size)
    name = f"test-{uuid.uuid4().hex[:8]}"
    cpus = rank_cpus(size) if pin else None
    workers = [WorkerProcess(WorkerOptions(rank, size, name, engine, "127.0.0.1",
                                           [("127.0.0.1", port) for port in ports], timeout, devices[rank], dtype,
                                           threads, cpus=None if cpus is None else [cpus[rank]]), key)
               for rank in range(size)]
    try:
        with ThreadPoolExecutor(size) as pool:
            ready = list(pool.map(lambda worker: worker.wait_ready(), workers))
    except BaseException:
        for worker in workers:
            worker.kill()
        raise
    return [GroupMemberEngine(worker, info, create_engine(engine, device=device, dtype=dtype))
            for worker, info, device in zip(workers, ready, devices)]


def rank_cpus(size: int) -> list[int] | None:
    """A CPU for each of `size` ranks, distinct, from those this process may use; None when there are too few."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return allowed[:size] if len(allowed) >= size else None


def load_group(members: list[GroupMemberEngine], model_dir, args, shard_of, n_blocks: int) -> None:
    """Every rank loads its part (`shard_of(rank)`) at once and makes its pool `n_blocks` blocks."""
    def load(member: GroupMemberEngine) -> None:
        member.load(model_dir, args, shard_of(member.worker.rank))
        member.allocate_kv(n_blocks, n_blocks // 2)
    with ThreadPoolExecutor(len(members)) as pool:
        list(pool.map(load, members))


def close_group(members: list[GroupMemberEngine]) -> None:
    for member in members:
        member.close()
