"""A tensor-parallel group as the nodes run it: one worker process per rank (torch.distributed over gloo on
127.0.0.1), the leader handing each step to the followers over the authenticated control channel. Greedy tokens
and logits equal one engine's; a bad request is refused and the group goes on; a rank that dies breaks the
leader's step with GroupBroken, never a hang."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import psutil
import pytest

from exo_like.engines.torch.engine import TorchEngine
from exo_like.errors import InvalidRequestError
from exo_like.models.config import ModelArgs
from exo_like.models.shard import Shard
from exo_like.tensor_parallel.process import GroupBroken
from exo_like.tensor_parallel.torch_group import GLOO_POLLING_THREAD, LOWEST_PRIORITY
from tests.checkpoints import make_checkpoint
from tests.engine_driver import Driver
from tests.tensor_parallel.local_group import (CASES, N_BLOCKS, PROMPT, close_group, greedy, load_group, rank_shard,
                                              start_group)

@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-workers")
    return {name: make_checkpoint(root / name, arch, n_layers=3, seed=5, **overrides)
            for name, (arch, overrides) in CASES.items()}


def whole_model(model_dir) -> tuple[list[int], np.ndarray]:
    args = ModelArgs.from_dir(model_dir)
    engine = TorchEngine(device="cpu", dtype="float32")
    engine.load(model_dir, args, Shard.whole(model_dir.name, args.num_hidden_layers))
    return greedy(Driver([engine], n_blocks=N_BLOCKS))


def gloo_polling_priorities(pid: int) -> list[int]:
    """The priority (nice) of each of gloo's polling threads in process `pid`."""
    priorities = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/comm") as comm:
            if comm.read().strip() == GLOO_POLLING_THREAD:
                priorities.append(os.getpriority(os.PRIO_PROCESS, int(tid)))
    return priorities


# Each case once, on worker processes: two ranks load two models, one after the other; three, the model whose heads
# split unevenly over them (by KV group, one KV head on two ranks), and DeepSeek V3's latent attention (4 heads split
# 2, 1, 1, the latent cache on every rank). Every family and group size decodes alike in one
# process (tests/engines/test_tensor_split.py): these are about the worker processes and their channels.
SIZES = {2: ["qwen3-one-kv-head", "qwen3_moe"], 3: ["llama", "deepseek_v3"]}


@pytest.mark.parametrize("size", list(SIZES))
def test_worker_groups_decode_what_one_engine_does(model_dirs, size):
    group = start_group(size)
    try:
        for member in group:  # gloo's busily polling thread yields to the engine's on a host short of cores
            priorities = gloo_polling_priorities(member.worker.pid)
            assert priorities and set(priorities) == {LOWEST_PRIORITY}
        for name in SIZES[size]:  # one group loads one model after another
            model_dir = model_dirs[name]
            args = ModelArgs.from_dir(model_dir)
            load_group(group, model_dir, args, rank_shard(args, name, size), N_BLOCKS)
            driver = Driver(group[:1], n_blocks=N_BLOCKS)
            with pytest.raises(InvalidRequestError):  # refused by the leader; the group goes on
                driver.forward("bad", np.array([args.vocab_size + 5], dtype=np.int64))
            driver.release("bad")
            tokens, logits = greedy(driver)
            expected_tokens, expected_logits = whole_model(model_dir)
            assert tokens == expected_tokens, name
            relative = np.abs(logits - expected_logits).max() / np.abs(expected_logits).max()
            assert relative < 1e-4, (name, relative)
    finally:
        close_group(group)
    assert not any(psutil.pid_exists(member.worker.pid) and
                   psutil.Process(member.worker.pid).status() != psutil.STATUS_ZOMBIE for member in group)


def test_a_dead_follower_breaks_the_leaders_step_at_once(model_dirs):
    group = start_group(2, timeout=600.0)  # a hang would wait this long; a dead peer must not
    try:
        model_dir = model_dirs["llama"]
        args = ModelArgs.from_dir(model_dir)
        load_group(group, model_dir, args, rank_shard(args, "llama", 2), N_BLOCKS)
        driver = Driver(group[:1], n_blocks=N_BLOCKS)
        driver.forward("r", PROMPT)
        os.kill(group[1].worker.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(GroupBroken):
            driver.forward("r", np.array([1], dtype=np.int64))
        assert time.monotonic() - started < 30
        with pytest.raises(GroupBroken):  # the leader's worker has exited: nothing more runs there
            driver.forward("r", np.array([1], dtype=np.int64))
    finally:
        close_group(group)
