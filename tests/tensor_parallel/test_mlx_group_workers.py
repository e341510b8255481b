"""An MLX tensor-parallel group as the nodes run it: one worker process per rank (mx.distributed's ring backend on
127.0.0.1, each rank on a CPU of its own when the host has enough), the leader handing each step to the followers
over the authenticated control channel. Greedy tokens and logits equal one MLX engine's; a bad request is refused
and the group goes on; a rank that dies breaks the leader's step with GroupBroken, from the closed connection; the
ring's sums are the same bits on every rank; the formation's frames are checked."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgpack
import numpy as np
import psutil
import pytest

pytest.importorskip("mlx.core", reason="mlx is not installed (install the 'mlx' extra)")

from exo_like.engines.mlx.engine import MLXEngine  # noqa: E402
from exo_like.errors import InvalidRequestError  # noqa: E402
from exo_like.models.config import ModelArgs  # noqa: E402
from exo_like.models.shard import Shard  # noqa: E402
from exo_like.tensor_parallel import mlx_group  # noqa: E402
from exo_like.tensor_parallel.messages import Formation, Offer, ProtocolError, receive, send  # noqa: E402
from exo_like.tensor_parallel.process import GroupBroken  # noqa: E402
from tests.checkpoints import make_checkpoint  # noqa: E402
from tests.engine_driver import Driver  # noqa: E402
from tests.tensor_parallel.local_group import (CASES, N_BLOCKS, PROMPT, close_group, greedy, load_group,  # noqa: E402
                                              rank_shard, start_group)

@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlx-tp-workers")
    return {name: make_checkpoint(root / name, arch, n_layers=3, seed=5, **overrides)
            for name, (arch, overrides) in CASES.items()}


@pytest.fixture(scope="module")
def expected(model_dirs):
    """One MLX engine's greedy tokens and logits for each model."""
    results = {}
    for name, model_dir in model_dirs.items():
        args = ModelArgs.from_dir(model_dir)
        engine = MLXEngine(device="cpu", dtype="float32")
        engine.load(model_dir, args, Shard.whole(model_dir.name, args.num_hidden_layers))
        results[name] = greedy(Driver([engine], n_blocks=N_BLOCKS))
    return results


HANG_SECONDS = 120.0  # only a guard against hanging: nothing asserted depends on how fast this machine is


def mlx_group_of(size: int, timeout: float = 30.0):
    return start_group(size, engine="mlx", threads=None, timeout=timeout, pin=True)


@pytest.mark.parametrize("size", [2, 3])
def test_mlx_worker_groups_decode_what_one_engine_does(model_dirs, expected, size):
    group = mlx_group_of(size)
    try:
        for name, model_dir in model_dirs.items():  # one group loads one model after another
            args = ModelArgs.from_dir(model_dir)
            load_group(group, model_dir, args, rank_shard(args, name, size), N_BLOCKS)
            driver = Driver(group[:1], n_blocks=N_BLOCKS)
            with pytest.raises(InvalidRequestError):  # refused by the leader; the group goes on
                driver.forward("bad", np.array([args.vocab_size + 5], dtype=np.int64))
            driver.release("bad")
            tokens, logits = greedy(driver)
            expected_tokens, expected_logits = expected[name]
            assert tokens == expected_tokens, name
            relative = np.abs(logits - expected_logits).max() / np.abs(expected_logits).max()
            assert relative < 1e-4, (name, relative)
    finally:
        close_group(group)
    assert not any(psutil.pid_exists(member.worker.pid) and
                   psutil.Process(member.worker.pid).status() != psutil.STATUS_ZOMBIE for member in group)


def test_a_dead_follower_breaks_the_leaders_step_at_once(model_dirs):
    """At once: from the closed connection (MLX's ring has no timeout: a peer it did not see go would block the
    step for good), which the error names; not timed against a clock a busy machine stretches."""
    group = mlx_group_of(2, timeout=600.0)
    steps = ThreadPoolExecutor(1)  # the step under a hang guard (closing the group below ends a blocked one)
    try:
        model_dir = model_dirs["llama"]
        args = ModelArgs.from_dir(model_dir)
        load_group(group, model_dir, args, rank_shard(args, "llama", 2), N_BLOCKS)
        driver = Driver(group[:1], n_blocks=N_BLOCKS)
        driver.forward("r", PROMPT)
        os.kill(group[1].worker.pid, signal.SIGKILL)
        step = steps.submit(driver.forward, "r", np.array([1], dtype=np.int64))
        # (MLX's ring notices it mid-step, or the leader's worker sees the follower's channel close first)
        with pytest.raises(GroupBroken, match=r"\[ring\] connection to a peer was lost|"
                                               r"a follower's worker closed its channel"):
            step.result(timeout=HANG_SECONDS)
        with pytest.raises(GroupBroken):  # the leader's worker has exited: nothing more runs there
            driver.forward("r", np.array([1], dtype=np.int64))
    finally:
        close_group(group)
        steps.shutdown(wait=False)


# Each rank sums arrays of its own (seeded by rank) and prints a digest of every sum: a slice summed by one rank
# and copied to the others is the same everywhere; sums of the same numbers in another order would not be.
RANK_SUMS = """
import hashlib, json, sys
import mlx.core as mx
import numpy as np
from exo_like.tensor_parallel.mlx_group import join_ring
rank, ring = int(sys.argv[1]), json.loads(sys.argv[2])
group = join_ring(rank, ring)
shapes = [(1,), (2,), (1, 64), (12, 96), (7, 1000), (4, 100_000)]  # the last, in float32: half of it each way round
def part(r, shape, dtype):
    scales = 10.0 ** np.random.default_rng(r + 9).integers(-3, 4, shape)  # a wide range: the order of a sum shows
    values = np.random.default_rng(r).standard_normal(shape) * scales
    return mx.array(values.astype(np.float32)).astype(dtype)
digests = []
for dtype in (mx.float32, mx.bfloat16):
    for shape in shapes:
        total = mx.distributed.all_sum(part(rank, shape, dtype), group=group)
        mx.eval(total)
        parts = [np.array(part(r, shape, dtype).astype(mx.float32), dtype=np.float64) for r in range(len(ring))]
        error = np.abs(np.array(total.astype(mx.float32)) - sum(parts))
        assert (error <= 2e-2 * sum(np.abs(p) for p in parts)).all(), shape
        bits = np.array(total.view(mx.uint16) if dtype == mx.bfloat16 else total)
        digests.append(hashlib.sha1(bits.tobytes()).hexdigest()[:12])
print(json.dumps(digests), flush=True)
"""


def test_ring_sums_are_the_same_bits_on_every_rank():
    size = 3  # two ranks' sums a + b and b + a are equal anyway
    reservations = [mlx_group.reserve_port("127.0.0.1") for _ in range(size)]
    ring = [f"127.0.0.1:{sock.getsockname()[1]}" for sock in reservations]
    ranks = [subprocess.Popen([sys.executable, "-c", RANK_SUMS, str(rank), json.dumps(ring)], stdout=subprocess.PIPE,
                              text=True, cwd=Path(__file__).resolve().parents[2])
             for rank in range(size)]
    try:
        outputs = [rank.communicate(timeout=60)[0] for rank in ranks]
    finally:
        for sock in reservations:
            sock.close()
        for rank in ranks:
            rank.kill()
            rank.wait()
    assert [rank.returncode for rank in ranks] == [0] * size, outputs
    digests = [json.loads(output) for output in outputs]
    assert digests[0] == digests[1] == digests[2]
    assert len(set(digests[0])) == len(digests[0])  # every sum its own (no rank summed nothing)


def crossed(frame) -> object:
    """`frame` sent and received over a socketpair (a Message, or a raw map packed as a frame)."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        if isinstance(frame, dict):
            data = msgpack.packb(frame, use_bin_type=True)
            ours.sendall(len(data).to_bytes(4, "big") + data)
        else:
            send(ours, frame)
        return receive(theirs)


def test_formation_frames_are_checked():
    ring = ("10.0.0.1:40001", "node-b.local:40002", "10.0.0.3:1")
    assert crossed(Formation(ring=ring)) == Formation(ring=ring)
    assert crossed(Formation("10.0.0.1", 29500)) == Formation("10.0.0.1", 29500)  # torch's store, as before
    assert crossed({"type": "formation", "store_host": "10.0.0.1", "store_port": 29500}) == \
        Formation("10.0.0.1", 29500)  # a frame without a ring
    assert crossed(Offer("10.0.0.2", 40002)) == Offer("10.0.0.2", 40002)
    for bad in (["10.0.0.1:40001"], ["10.0.0.1:40001", "::1:5"], ["a:1", "b:0"], ["a:1", "b:65536"], ["a:1", 5],
                ["a:1", " b:2"], ["a:1", "b:+2"], ["a:1", "b"], ["a:1", ":2"], ["a:1"] * 300, "a:1,b:2"):
        with pytest.raises(ProtocolError):
            crossed({"type": "formation", "store_host": "", "store_port": 0, "ring": bad})
    for host, port in (("::1", 5), ("", 5), ("h", 0), ("h", "5"), ("h" * 300, 5), ("h h", 5), (None, 5)):
        with pytest.raises(ProtocolError):
            crossed({"type": "offer", "host": host, "port": port})
