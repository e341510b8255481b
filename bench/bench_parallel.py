"""Tensor parallelism against the layer pipeline and one node, on two hosts of one core each, and what a slow link
does to the choice between them.

Two hosts are network namespaces on a private bridge (tests/netns.py), each node process pinned to a CPU of its
own (host 0: the first CPU this process may use, host 1: the second; the node's torch threads = 1, and its
tensor-parallel worker process inherits both). On them, side by side and measured in alternating rounds:
  - one node (host 0),
  - a 2-node pipeline (--parallel pipeline --placement memory: 12 layers each),
  - a 2-node tensor-parallel group (--parallel tensor --placement memory: each rank half of every layer, the
    leader also the embedding and the LM head; two gloo all-reduces a layer).
For each, decode tokens/s by difference through the HTTP API (prefill and HTTP overhead cancel): batch 1:
N / (T(1 + N) - T(1)) of a greedy request (ignore_eos); S streams: S requests at once,
S N' / (T_S(1 + N') - T_S(1)). Medians over the rounds.

The ceiling (engine level, no HTTP, no node): what two cores of this host can give one model's decode at most.
One process runs the whole model on one core, then two processes at once, one per core, each holding one rank's
slice of every layer (models/tensor_split.py, the leader's with the embedding and the head) with a no-op group
(its all-reduce returns its input: no communication), released together by a barrier after their prefill; the
slower one's decode time counts. ceiling = T_one / T_two_halves. Both "hosts" share one memory bus: where one core
already saturates it, a step bound by memory bandwidth has a ceiling near 1x, and one bound by compute (bfloat16
on AVX2, widened to float32 in the kernels) near 2x; float32 is the first kind, bfloat16 the second (on this
project's 2-core EPYC VM one float32 thread reads only ~11 GB/s, so float32's measured ceiling is ~1.5x there).
TP speedup = TP batch-1 tok/s / one node's (per round); ratio = speedup / ceiling: what the collectives, the
leader's Follow frame and the node<->worker hop cost (acceptance: >= 0.8 for both kinds).
Printed too: the per-token time beyond the ceiling's, for TP and for one node, and the median latency of one
all-reduce of a hidden-state row between the two hosts (a token makes 2 a layer), by gloo as the group's workers
run it and by a direct exchange on one socket (each side sends its row, reads the other's, adds: one thread).

Model (--shape): by default 12 of the 28 layers of Qwen2.5-1.5B (hidden 1536, 12 heads over 2 KV heads, MLP 8960,
q/k/v biases, tied embeddings); --shape qwen2.5-0.5b: Qwen2.5-0.5B's 24 layers (hidden 896, MLP 4864). Random
weights, and a 32,768-token vocabulary instead of 151,936 (--vocab): tensor parallelism does not split the LM head
(the leader runs it), and at Qwen's vocabulary the head would be a quarter of the weights a 0.5B decode step reads,
making the comparison mostly about the head; at 32k it is ~8 %, about its share in a 7-8B model. float32 and
bfloat16 are the same checkpoint (--dtype). A layer's all-reduces cost the same whatever its size, so the smaller
the layer the larger their share: on one-core hosts they cost ~0.45 ms each (gloo), a 0.5B layer's half ~4.4 ms of
bfloat16 compute, a 1.5B layer's ~12 ms.

Then the link gets slower: --delay-ms added one way, in each direction (so the round trip grows by twice that):
tc netem on each host's veth leg when the kernel has it; otherwise (this project's VMs: no sch_netem) each host's
route to the other goes through a TUN device, and a process of this bench's carries every packet across after the
delay (userspace: a round trip with 5 ms each way measured 10.4 ms; a little CPU). The pipeline and the group are
measured again (one node is not affected). A cluster with the default --parallel auto (and --placement compute,
the default: the planner may use measured speeds) is started once without and once with the delay: printed is
what its planner picked (a plan stage with a "group" is tensor-parallel) and whether that was the faster of the
two at batch 1.

Needs root (namespaces), `ip`, and at least 2 CPUs. The machine may be shared: printed are the load average and,
for each round, the share of the CPUs that processes other than this bench's used (and the hypervisor's steal).
Usage:
    python bench/bench_parallel.py [--kinds float32,bfloat16] [--rounds 3] [--new-tokens 32] [--streams 8]
                                   [--stream-tokens 8] [--ceiling-steps 32] [--delay-ms 5] [--delay-rounds 1]
                                   [--delay-tokens 8] [--vocab 32768] [--auto-placement compute]
                                   [--no-delay] [--no-auto]
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import fcntl
import http.client
import json
import multiprocessing
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_torch_vs_hf import QWEN25_05B, peaky_state  # noqa: E402
from rates import Request, decode_rate, together  # noqa: E402

from tests.api_server import exo_like_command  # noqa: E402
from tests.netns import NetnsHost, netns_hosts, netns_unavailable_reason  # noqa: E402

PROMPT = "Tell me about the rings of Saturn."
SUBNET = "10.231.79"
MEMORY_GB = "8"  # each node offers the same: the pipeline splits 12/12, the group gets all 24 layers
KV_CACHE_GB = "0.25"
READY_TIMEOUT = 900.0  # several nodes load a 1.5 GB checkpoint on two shared cores
HTTP_TIMEOUT = 900.0
# Model geometries. The bigger a layer, the more compute an all-reduce pays for: the collectives' fixed cost a
# token is 2 x layers x (one all-reduce), its compute layers x (a layer's half).
SHAPES = {"qwen2.5-0.5b": QWEN25_05B,
          "qwen2.5-1.5b-12": {**QWEN25_05B, "hidden_size": 1536, "intermediate_size": 8960, "num_attention_heads": 12,
                              "num_key_value_heads": 2, "num_hidden_layers": 12}}
SHAPE_NOTES = {"qwen2.5-0.5b": "24 layers of Qwen2.5-0.5B: hidden 896, MLP 4864",
               "qwen2.5-1.5b-12": "12 of the 28 layers of Qwen2.5-1.5B: hidden 1536, MLP 8960"}
PORTS = {"single": 52600, "pipeline": 52610, "tensor": 52620, "auto": 52630, "auto-delayed": 52640}


# -- networking: a thread inside a host, a slower link --------------------------------------------------------

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def enter(namespace: str) -> None:
    """Move the calling thread (only it) into `namespace`'s network: sockets it opens from now on live there."""
    fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into {namespace}: {os.strerror(errno)}")
    finally:
        os.close(fd)


def in_host(host: NetnsHost, function: Callable[[], Any]) -> Any:
    """function() run on a new thread inside `host` (this process's main thread stays where it is, so that the
    namespaces' clean-up never counts this process as one of theirs)."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            enter(host.namespace)
            outcome["value"] = function()
        except BaseException as exc:  # noqa: BLE001 (raised again on the caller's thread)
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def device_of(host: NetnsHost) -> str:
    """The host's interface holding its address (its veth leg)."""
    listing = subprocess.run(["ip", "-n", host.namespace, "-o", "-4", "addr", "show"], capture_output=True,
                             text=True, check=True).stdout
    for line in listing.splitlines():
        parts = line.split()
        if len(parts) > 3 and parts[3].split("/")[0] == host.address:
            return parts[1].split("@")[0]
    raise RuntimeError(f"no interface holds {host.address} in {host.namespace}")


TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000


def open_tun(name: str) -> int:
    """A TUN device `name` in the calling thread's namespace; it lives as long as the descriptor."""
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def delay_link_process(namespaces: list[str], addresses: list[str], names: list[str], delay: float, control: Any) -> None:
    """Child process: a TUN device in each namespace; a packet one host sends through its device comes out of its
    destination host's device `delay` seconds later (order kept per source)."""
    fds = []
    for namespace, name in zip(namespaces, names):
        enter(namespace)
        fds.append(open_tun(name))
    by_address = {bytes(int(part) for part in address.split(".")): fd for address, fd in zip(addresses, fds)}

    def carry(source: int) -> None:
        pending: collections.deque[tuple[float, bytes]] = collections.deque()
        ready = threading.Condition()

        def send_when_due() -> None:
            while True:
                with ready:
                    while not pending:
                        ready.wait()
                    due, packet = pending.popleft()
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                target = by_address.get(packet[16:20]) if packet[:1] == b"\x45" else None  # IPv4 destination
                if target is not None:
                    try:
                        os.write(target, packet)
                    except OSError:
                        pass

        threading.Thread(target=send_when_due, daemon=True).start()
        while True:
            packet = os.read(source, 65536)
            with ready:
                pending.append((time.monotonic() + delay, packet))
                ready.notify()

    for fd in fds:
        threading.Thread(target=carry, args=(fd,), daemon=True).start()
    control.send("ready")
    try:
        control.recv()
    except EOFError:
        pass
    os._exit(0)


def netem_available() -> bool:
    probe = f"exlnetem{os.getpid()}"
    subprocess.run(["ip", "netns", "add", probe], capture_output=True)
    try:
        result = subprocess.run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                                 "delay", "1ms"], capture_output=True, text=True)
        return result.returncode == 0
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)


@contextmanager
def slower_link(hosts: list[NetnsHost], delay_ms: float) -> Iterator[str]:
    """`delay_ms` added to every packet from any host to another (one way, each direction). Yields how."""
    if shutil.which("tc") and netem_available():
        legs = [device_of(h) for h in hosts]
        try:
            for host, leg in zip(hosts, legs):
                subprocess.run(["ip", "netns", "exec", host.namespace, "tc", "qdisc", "add", "dev", leg, "root",
                                "netem", "delay", f"{delay_ms}ms"], check=True, capture_output=True)
            yield f"tc netem delay {delay_ms:g}ms on each host's veth leg (its egress)"
        finally:
            for host, leg in zip(hosts, legs):
                subprocess.run(["ip", "netns", "exec", host.namespace, "tc", "qdisc", "del", "dev", leg, "root"],
                               capture_output=True)
        return
    names = [f"exldly{i}" for i in range(len(hosts))]
    ours, theirs = multiprocessing.get_context("spawn").Pipe()
    carrier = multiprocessing.get_context("spawn").Process(
        target=delay_link_process, args=([h.namespace for h in hosts], [h.address for h in hosts], names,
                                         delay_ms / 1000, theirs), daemon=True)
    carrier.start()
    pairs = [(host, name, other) for host, name in zip(hosts, names) for other in hosts if other is not host]
    try:
        if not ours.poll(60) or ours.recv() != "ready":
            raise RuntimeError("the delay link's process did not start")
        for name, host in zip(names, hosts):
            subprocess.run(["ip", "-n", host.namespace, "link", "set", name, "up"], check=True, capture_output=True)
        for host, name, other in pairs:
            subprocess.run(["ip", "-n", host.namespace, "route", "add", f"{other.address}/32", "dev", name, "src",
                            host.address], check=True, capture_output=True)
        yield (f"no tc netem in this kernel: each host's routes to the others through a TUN device, every packet "
               f"carried to its destination's {delay_ms:g} ms later by a userspace process")
    finally:
        for host, _, other in pairs:  # gone with the devices anyway; at once is cleaner
            subprocess.run(["ip", "-n", host.namespace, "route", "del", f"{other.address}/32"], capture_output=True)
        ours.close()
        carrier.join(10)
        if carrier.is_alive():
            carrier.kill()


# -- nodes in hosts ------------------------------------------------------------------------------------------

@dataclass
class Node:
    host: NetnsHost
    cpu: int
    port: int
    process: subprocess.Popen
    log_path: Path
    node_id: str = ""

    def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        def call() -> tuple[int, bytes]:
            connection = http.client.HTTPConnection(self.host.address, self.port, timeout=HTTP_TIMEOUT)
            try:
                connection.request(method, path, body=body, headers={"Content-Type": "application/json"})
                response = connection.getresponse()
                return response.status, response.read()
            finally:
                connection.close()
        return in_host(self.host, call)

    def get_json(self, path: str) -> Any:
        status, body = self.request("GET", path)
        if status != 200:
            raise RuntimeError(f"GET {path}: {status} {body[:300]!r}")
        return json.loads(body)

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def chat_body(model: str, max_tokens: int, prompt: str) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True}).encode()


def timed_chat(node: Node, model: str, max_tokens: int, prompt: str = PROMPT) -> float:
    """Seconds for one greedy request of `max_tokens` tokens, timed inside the host."""
    return timed_reply(node, model, max_tokens, prompt)[0]


def timed_reply(node: Node, model: str, max_tokens: int, prompt: str = PROMPT) -> tuple[float, dict[str, Any]]:
    """Seconds for one greedy request of `max_tokens` tokens, timed inside the host, and its reply."""
    body = chat_body(model, max_tokens, prompt)

    def call() -> tuple[float, dict[str, Any]]:
        connection = http.client.HTTPConnection(node.host.address, node.port, timeout=HTTP_TIMEOUT)
        try:
            started = time.perf_counter()
            connection.request("POST", "/v1/chat/completions", body=body,
                               headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            raw = response.read()
            elapsed = time.perf_counter() - started
        finally:
            connection.close()
        if response.status != 200:
            raise RuntimeError(f"chat: {response.status} {raw[:300]!r}")
        reply = json.loads(raw)
        if reply["usage"]["completion_tokens"] != max_tokens:
            raise RuntimeError(f"chat: expected {max_tokens} tokens: {raw[:300]!r}")
        return elapsed, reply
    return in_host(node.host, call)


def sender(node: Node, model: str) -> Request:
    """The i-th of several requests to `node` (distinct prompts)."""
    return lambda i, max_tokens: timed_chat(node, model, max_tokens, f"{PROMPT} ({i})")


def pin_to(cpu: int) -> Callable[[], None]:
    def pin() -> None:
        os.sched_setaffinity(0, {cpu})
    return pin


def launch(root: Path, name: str, host: NetnsHost, cpu: int, port: int, model_dir: Path, dtype: str,
           peers: list[tuple[NetnsHost, int]], extra: tuple[str, ...], key: str) -> Node:
    """An `exo-like` node inside `host`, on `cpu` alone (its worker processes too), one torch thread."""
    home = root / name
    home.mkdir(parents=True, exist_ok=True)
    log_path = home / "node.log"
    command = [*exo_like_command(), "--model", str(model_dir), "--home", str(home), "--host", host.address,
               "--port", str(port), "--no-mdns", "--node-name", name, "--engine", "torch", "--dtype", dtype,
               "--memory-gb", MEMORY_GB, "--kv-cache-gb", KV_CACHE_GB, "--cluster-key", key,
               *(("--peers", ",".join(f"{h.address}:{p}" for h, p in peers)) if peers else ()), *extra]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(host.command(*command), stdout=log_file, stderr=subprocess.STDOUT,
                                   env=environment, preexec_fn=pin_to(cpu))
    return Node(host, cpu, port, process, log_path)


@dataclass
class Setup:
    """One node or a cluster of two, `entry` the node requests go to (the first stage's, the group's leader)."""

    name: str
    nodes: list[Node]
    entry: Node | None = None
    plan: dict[str, Any] = field(default_factory=dict)
    placement: dict[str, Any] = field(default_factory=dict)

    def stop(self) -> None:
        for node in self.nodes:
            if node.process.poll() is None:
                node.process.terminate()
        for node in self.nodes:
            node.stop()


def start_setup(root: Path, name: str, hosts: list[NetnsHost], cpus: list[int], model_dir: Path, dtype: str,
                extra: tuple[str, ...], port: int) -> Setup:
    peers = [(h, port) for h in hosts] if len(hosts) > 1 else []
    return Setup(name, [launch(root, f"{name}-{i}", host, cpu, port, model_dir, dtype, peers, extra,
                               f"bench-parallel-{name}")
                        for i, (host, cpu) in enumerate(zip(hosts, cpus))])


def wait_ready(setup: Setup, timeout: float = READY_TIMEOUT) -> None:
    """Until every node of `setup` reports one agreed, ready plan over all of them; then its entry node."""
    deadline = time.monotonic() + timeout
    views: list[Any] = []
    while time.monotonic() < deadline:
        for node in setup.nodes:
            if node.process.poll() is not None:
                raise RuntimeError(f"{setup.name}: a node exited ({node.process.returncode}):\n{node.log_tail()}")
        views = []
        for node in setup.nodes:
            try:
                views.append(node.get_json("/v1/cluster"))
            except (OSError, RuntimeError, ValueError):
                views.append(None)
        if all(v and v["ready"] and v["agreed"] and len(v["nodes"]) == len(setup.nodes) for v in views) and \
                len({v["plan"]["digest"] for v in views}) == 1:
            for node, view in zip(setup.nodes, views):
                node.node_id = view["node_id"]
            setup.plan, setup.placement = views[0]["plan"], views[0]["placement"] or {}
            first = setup.plan["stages"][0]["node_id"]
            setup.entry = next(n for n in setup.nodes if n.node_id == first)
            return
        time.sleep(0.25)
    tails = "\n".join(f"--- {n.log_path}\n{n.log_tail()}" for n in setup.nodes)
    raise RuntimeError(f"{setup.name} not ready in {timeout:.0f} s: {views}\n{tails}")


def plan_kind(plan: dict[str, Any]) -> str:
    stages = plan["stages"]
    if any(s.get("group") for s in stages):
        return "tensor"
    return "pipeline" if len(stages) > 1 else "one node"


def describe_plan(setup: Setup) -> str:
    names = {n.node_id: f"{n.host.namespace[-2:]}" for n in setup.nodes}
    parts = []
    for stage in setup.plan["stages"]:
        members = stage.get("group") or [stage["node_id"]]
        parts.append(f"[{stage['start_layer']},{stage['end_layer']}) on {'+'.join(names.get(m, m) for m in members)}")
    return ", ".join(parts)


# -- the ceiling: the same decode work, no communication -----------------------------------------------------

def ceiling_process(model_dir: str, dtype: str, cpu: int, rank: int | None, prompt_tokens: int, control: Any,
                    barrier: Any) -> None:
    """Child process on `cpu`, one torch thread: the whole model (rank None) or rank `rank`'s slice of 2 with a
    no-op group. Each number received: prefill `prompt_tokens`, wait at `barrier` (if any), time that many decode
    steps, send the seconds back. None: exit."""
    os.sched_setaffinity(0, {cpu})
    import numpy as np
    import torch

    from exo_like.engines.tensor_group import TensorGroup
    from exo_like.engines.torch.engine import TorchEngine, tensor_to_activations
    from exo_like.engines.work import SampleSpec, SamplingParams, WorkItem, blocks_for
    from exo_like.models.config import ModelArgs
    from exo_like.models.shard import Shard
    from exo_like.models.tensor_split import TensorSplit

    class NoGroup(TensorGroup):
        """A rank whose collectives cost nothing: its all-reduce returns its own partial sum."""

        def __init__(self, rank: int, size: int):
            self.rank, self.size = rank, size

        def all_reduce(self, tensor: Any) -> Any:
            return tensor

        def share_step(self, items: Any, hidden: Any) -> None:
            pass

    torch.set_num_threads(1)
    path = Path(model_dir)
    args = ModelArgs.from_dir(path)
    layers = args.num_hidden_layers
    engine = TorchEngine(device="cpu", dtype=dtype)
    if rank is None:
        shard = Shard.whole(path.name, layers)
    else:
        engine.group = NoGroup(rank, 2)
        shard = Shard(path.name, 0, layers, layers, TensorSplit(rank, 2))
    engine.load(path, args, shard)
    prompt = np.random.default_rng(0).integers(0, args.vocab_size, prompt_tokens, dtype=np.int64)
    generator = torch.Generator().manual_seed(rank or 0)

    def hidden(rows: int) -> Any:
        return tensor_to_activations((torch.randn(rows, args.hidden_size, generator=generator) * 0.5).to(engine.dtype))

    control.send(engine.parameter_bytes())
    while True:
        steps = control.recv()
        if steps is None:
            return
        blocks = tuple(range(blocks_for(prompt_tokens + steps + 1)))
        if engine.kv_blocks < len(blocks):
            engine.allocate_kv(len(blocks))
        spec = SampleSpec(SamplingParams(0.0, seed=0), steps + 1, (), prompt_tokens)
        position, inputs = 0, prompt
        elapsed = 0.0
        for step in range(steps + 1):
            if step == 1 and barrier is not None:
                barrier.wait()
            if step == 1:
                started = time.perf_counter()
            item = WorkItem("ceiling", "ceiling", position, len(inputs), blocks, spec)
            if shard.is_first:
                token = int(np.argmax(engine.step([item], inputs)[0]))
            else:
                engine.follow([item], hidden(len(inputs)))
                token = 0
            position += len(inputs)
            inputs = np.array([token], dtype=np.int64)
        elapsed = time.perf_counter() - started
        control.send(elapsed)


class Ceiling:
    """Three processes: the whole model on the first CPU, and rank 0's and rank 1's halves on the first and the
    second (the halves run at the same time, the whole one alone)."""

    def __init__(self, model_dir: Path, dtype: str, cpus: list[int], prompt_tokens: int = 16):
        context = multiprocessing.get_context("spawn")
        barrier = context.Barrier(2)
        self.pipes, self.processes = [], []
        for cpu, rank in ((cpus[0], None), (cpus[0], 0), (cpus[1], 1)):
            ours, theirs = context.Pipe()
            process = context.Process(target=ceiling_process, daemon=True,
                                      args=(str(model_dir), dtype, cpu, rank, prompt_tokens, theirs,
                                            None if rank is None else barrier))
            process.start()
            self.pipes.append(ours)
            self.processes.append(process)
        self.parameter_bytes = [pipe.recv() for pipe in self.pipes]

    def one(self, steps: int) -> float:
        self.pipes[0].send(steps)
        return self.pipes[0].recv()

    def two(self, steps: int) -> float:
        for pipe in self.pipes[1:]:
            pipe.send(steps)
        return max(pipe.recv() for pipe in self.pipes[1:])

    def close(self) -> None:
        for pipe, process in zip(self.pipes, self.processes):
            try:
                pipe.send(None)
            except OSError:
                pass
            process.join(10)
            if process.is_alive():
                process.kill()


# -- one all-reduce between the hosts ------------------------------------------------------------------------

def allreduce_process(namespace: str, device: str, cpu: int, rank: int, store: tuple[str, int], dtype: str,
                      width: int, count: int, control: Any) -> None:
    """Child process inside host `rank`: the median seconds of one gloo all-reduce of a 1 x `width` row (as the
    group's workers run it), then of the same sum by a direct exchange on one TCP connection (both send their
    row, then read the other's and add: one thread, no hand-offs)."""
    enter(namespace)
    os.sched_setaffinity(0, {cpu})
    os.environ["GLOO_SOCKET_IFNAME"] = device
    import socket
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from exo_like.tensor_parallel.torch_group import GLOO_POLLING_THREAD, lower_priority
    torch.set_num_threads(1)
    tcp = dist.TCPStore(store[0], store[1], 2, rank == 0, timedelta(seconds=60))
    dist.init_process_group("gloo", store=tcp, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    lower_priority(GLOO_POLLING_THREAD)  # as TorchGroup does
    tensor = torch.ones(1, width, dtype=getattr(torch, dtype))
    for _ in range(10):
        dist.all_reduce(tensor)
    gloo = []
    for _ in range(count):
        started = time.perf_counter()
        dist.all_reduce(tensor)
        gloo.append(time.perf_counter() - started)
    if rank == 0:
        server = socket.create_server((store[0], store[1] + 1))
        tcp.set("direct", "listening")
        connection, _ = server.accept()
        server.close()
    else:
        tcp.wait(["direct"])
        connection = socket.create_connection((store[0], store[1] + 1))
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    mine = tensor.view(torch.uint8).numpy()
    theirs = torch.empty_like(tensor)
    buffer = memoryview(theirs.view(torch.uint8).numpy()).cast("B")
    direct = []
    for index in range(count + 10):
        started = time.perf_counter()
        connection.sendall(mine)
        got = 0
        while got < len(buffer):
            got += connection.recv_into(buffer[got:], len(buffer) - got)
        total = tensor + theirs if rank == 0 else theirs + tensor  # the same order on both: the same bits
        if index >= 10:
            direct.append(time.perf_counter() - started)
    del total
    connection.close()
    control.send((statistics.median(gloo), statistics.median(direct)))
    dist.destroy_process_group()


def allreduce_seconds(hosts: list[NetnsHost], devices: list[str], cpus: list[int], dtype: str, width: int,
                      count: int, port: int) -> tuple[float, float]:
    """Median seconds of one all-reduce of a 1 x `width` row between the two hosts: gloo's (as the group runs
    it), and a direct exchange's."""
    context = multiprocessing.get_context("spawn")
    pipes, processes = [], []
    for rank, (host, device, cpu) in enumerate(zip(hosts, devices, cpus)):
        ours, theirs = context.Pipe()
        process = context.Process(target=allreduce_process, daemon=True,
                                  args=(host.namespace, device, cpu, rank, (hosts[0].address, port), dtype, width,
                                        count, theirs))
        process.start()
        pipes.append(ours)
        processes.append(process)
    try:
        if not all(pipe.poll(120 + count * 0.1) for pipe in pipes):
            raise RuntimeError("the all-reduce probe did not finish")
        results = [pipe.recv() for pipe in pipes]
        return max(r[0] for r in results), max(r[1] for r in results)
    finally:
        for process in processes:
            process.join(10)
            if process.is_alive():
                process.kill()


# -- the model -------------------------------------------------------------------------------------------------

def build_model(path: Path, vocab: int, shape: dict[str, Any] = QWEN25_05B) -> Path:
    """A Qwen2 model of `shape` with a `vocab`-token vocabulary, random peaky weights, saved in float32."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from exo_like.models.demo import build_tokenizer, write_tokenizer_files

    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**{**shape, "vocab_size": vocab}))
    model.load_state_dict(peaky_state(model), strict=False, assign=True)
    model.tie_weights()
    model.save_pretrained(path)
    write_tokenizer_files(path, build_tokenizer())
    return path


# -- one model kind, all set-ups -------------------------------------------------------------------------------

@dataclass
class KindResult:
    kind: str
    rounds: int = 0
    rates: dict[tuple[str, bool, int], list[float]] = field(default_factory=dict)  # (setup, delayed, streams)
    ceiling_one: list[float] = field(default_factory=list)  # seconds for `ceiling_steps` decode steps
    ceiling_two: list[float] = field(default_factory=list)
    speedups: list[float] = field(default_factory=list)  # TP / one node, per round
    ceilings: list[float] = field(default_factory=list)
    allreduce: dict[bool, tuple[float, float]] = field(default_factory=dict)  # delayed -> (gloo, direct)
    plans: dict[str, str] = field(default_factory=dict)
    auto: dict[bool, tuple[str, str, str]] = field(default_factory=dict)  # delayed -> (kind, layout, why)
    delay_how: str = ""
    load: list[str] = field(default_factory=list)
    others: list[float] = field(default_factory=list)  # per round: other processes' share of the CPUs

    def add(self, setup: str, delayed: bool, streams: int, rate: float) -> None:
        self.rates.setdefault((setup, delayed, streams), []).append(rate)

    def median(self, setup: str, delayed: bool, streams: int) -> float | None:
        values = self.rates.get((setup, delayed, streams))
        return statistics.median(values) if values else None


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


STARTED = time.monotonic()


class CpuShare:
    """The share of the machine's CPUs that processes other than this bench's (and its nodes', workers') used,
    and the share the hypervisor stole, between start() and stop()."""

    def __init__(self) -> None:
        self.start()

    @staticmethod
    def sample() -> tuple[float, float, float, float]:
        values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
        tick = os.sysconf("SC_CLK_TCK")
        user, nice, system, _idle, _iowait, irq, softirq, steal = values
        ours = 0.0
        me = psutil.Process()
        for process in [me, *me.children(recursive=True)]:
            try:
                times = process.cpu_times()
                ours += times.user + times.system
            except psutil.Error:
                pass
        return time.monotonic(), (user + nice + system + irq + softirq) / tick, steal / tick, ours

    def start(self) -> None:
        self.first = self.sample()

    def stop(self) -> tuple[float, float]:
        """(others' share, stolen share) of all CPUs since start()."""
        last = self.sample()
        capacity = (last[0] - self.first[0]) * (os.cpu_count() or 1)
        others = (last[1] - self.first[1]) - (last[3] - self.first[3])
        return max(0.0, others / capacity), (last[2] - self.first[2]) / capacity


def progress(line: str) -> None:
    print(f"[{time.monotonic() - STARTED:4.0f} s] {line}", flush=True)


def auto_pick(root: Path, label: str, hosts: list[NetnsHost], cpus: list[int], model_dir: Path, dtype: str,
              placement: str, port: int) -> tuple[str, str, str]:
    setup = start_setup(root, label, hosts, cpus, model_dir, dtype, ("--parallel", "auto", "--placement", placement),
                        port)
    try:
        wait_ready(setup)
        return plan_kind(setup.plan), describe_plan(setup), str(setup.placement.get("why", ""))
    finally:
        setup.stop()


def measure_round(result: KindResult, setups: list[Setup], model: str, opts: argparse.Namespace,
                  delayed: bool) -> None:
    tokens, stream_tokens = (opts.delay_tokens, opts.delay_tokens) if delayed else \
        (opts.new_tokens, opts.stream_tokens)
    for setup in setups:
        assert setup.entry is not None
        result.add(setup.name, delayed, 1, decode_rate(sender(setup.entry, model), 1, tokens))
    for setup in setups:
        assert setup.entry is not None
        rate = decode_rate(sender(setup.entry, model), opts.streams, stream_tokens)
        result.add(setup.name, delayed, opts.streams, rate)


def bench_kind(kind: str, root: Path, hosts: list[NetnsHost], devices: list[str], cpus: list[int],
               model_dir: Path, opts: argparse.Namespace) -> KindResult:
    result = KindResult(kind)
    model = model_dir.name
    work = root / kind
    result.load.append(f"start {loadavg()}")
    setups: list[Setup] = []
    ceiling: Ceiling | None = None
    try:
        started = time.monotonic()
        setups = [start_setup(work, "single", hosts[:1], cpus[:1], model_dir, kind,
                              ("--parallel", "pipeline", "--placement", "memory"),
                              PORTS["single"]),
                  start_setup(work, "pipeline", hosts, cpus, model_dir, kind,
                              ("--parallel", "pipeline", "--placement", "memory"), PORTS["pipeline"]),
                  start_setup(work, "tensor", hosts, cpus, model_dir, kind,
                              ("--parallel", "tensor", "--placement", "memory"), PORTS["tensor"])]
        ceiling = Ceiling(model_dir, kind, cpus)
        for setup in setups:
            wait_ready(setup)
            result.plans[setup.name] = describe_plan(setup)
        expected = {"single": "one node", "pipeline": "pipeline", "tensor": "tensor"}
        for setup in setups:
            if plan_kind(setup.plan) != expected[setup.name]:
                raise RuntimeError(f"{setup.name}: planned {setup.plan}")
        progress(f"[{kind}] ready in {time.monotonic() - started:.0f} s: "
                 + "; ".join(f"{s.name} {result.plans[s.name]}" for s in setups))
        for setup in setups:  # warm-up: allocator, kernels, prefix cache of the prompts
            assert setup.entry is not None
            timed_chat(setup.entry, model, 4)
            together(sender(setup.entry, model), opts.streams, 2)
        ceiling.one(4)
        ceiling.two(4)
        for round_ in range(opts.rounds):
            share = CpuShare()
            one, two = ceiling.one(opts.ceiling_steps), ceiling.two(opts.ceiling_steps)
            result.ceiling_one.append(one)
            result.ceiling_two.append(two)
            measure_round(result, setups, model, opts, False)
            result.speedups.append(result.rates[("tensor", False, 1)][-1] / result.rates[("single", False, 1)][-1])
            result.ceilings.append(one / two)
            others, stolen = share.stop()
            result.others.append(others)
            progress(f"[{kind}] round {round_ + 1}: ceiling {one / two:.2f} (one {opts.ceiling_steps / one:.2f}, two "
                     f"halves {opts.ceiling_steps / two:.2f} tok/s); batch-1 "
                     + ", ".join(f"{s.name} {result.rates[(s.name, False, 1)][-1]:.2f}" for s in setups)
                     + f"; {opts.streams} streams "
                     + ", ".join(f"{s.name} {result.rates[(s.name, False, opts.streams)][-1]:.2f}" for s in setups)
                     + f" (load {loadavg()}; other processes {others:.0%} of the CPUs, stolen {stolen:.0%})")
        ceiling.close()
        ceiling = None
        result.rounds = opts.rounds
        result.allreduce[False] = allreduce_seconds(hosts, devices, cpus, kind, opts.shape_config["hidden_size"], 300,
                                                    29500)
        if not opts.no_auto:
            result.auto[False] = auto_pick(work, "auto", hosts, cpus, model_dir, kind, opts.auto_placement,
                                           PORTS["auto"])
            progress(f"[{kind}] --parallel auto, no delay: {result.auto[False][0]} ({result.auto[False][1]})")
        if not opts.no_delay:
            links = setups[1:]
            with slower_link(hosts, opts.delay_ms) as how:
                result.delay_how = how
                for setup in links:
                    wait_ready(setup)
                for setup in links:  # the new link's first packets, connections' windows
                    assert setup.entry is not None
                    timed_chat(setup.entry, model, 2)
                for round_ in range(opts.delay_rounds):
                    share = CpuShare()
                    measure_round(result, links, model, opts, True)
                    others, stolen = share.stop()
                    progress(f"[{kind}] delayed round {round_ + 1}: batch-1 "
                             + ", ".join(f"{s.name} {result.rates[(s.name, True, 1)][-1]:.2f}" for s in links)
                             + f"; {opts.streams} streams "
                             + ", ".join(f"{s.name} {result.rates[(s.name, True, opts.streams)][-1]:.2f}"
                                      for s in links)
                             + f" (load {loadavg()}; other processes {others:.0%} of the CPUs, stolen {stolen:.0%})")
                result.allreduce[True] = allreduce_seconds(hosts, devices, cpus, kind, opts.shape_config["hidden_size"],
                                                           60, 29501)
                if not opts.no_auto:
                    result.auto[True] = auto_pick(work, "auto-delayed", hosts, cpus, model_dir, kind,
                                                  opts.auto_placement, PORTS["auto-delayed"])
                    progress(f"[{kind}] --parallel auto, {opts.delay_ms:g} ms delay: {result.auto[True][0]} "
                             f"({result.auto[True][1]})")
    finally:
        if ceiling is not None:
            ceiling.close()
        for setup in setups:
            setup.stop()
    result.load.append(f"end {loadavg()}")
    return result


# -- the report ------------------------------------------------------------------------------------------------

def report(result: KindResult, opts: argparse.Namespace, layers: int) -> list[str]:
    bound = {"float32": "memory-bound", "bfloat16": "compute-bound on AVX2"}.get(result.kind, "")
    quiet = statistics.median(result.others) <= 0.05
    s = opts.streams
    lines = [f"{result.kind} ({bound}); {result.rounds} alternating rounds; load average {', '.join(result.load)}"
             + f"; other processes used {statistics.median(result.others):.0%} of the CPUs in the median round, "
             f"{max(result.others):.0%} in the busiest"
             + ("" if quiet else "\n  (more than 5 % in the median round: the ceiling and speedups are not this "
                "host's own, and the ratio is not judged)"),
             f"  {'':34}{'batch-1 tok/s':>15}{f'{s}-stream tok/s':>17}"]
    rows = [("one node (1 core)", "single", False), ("2-node pipeline", "pipeline", False),
            ("2-node tensor parallel", "tensor", False)]
    if result.delay_how:
        rows += [(f"2-node pipeline, +{opts.delay_ms:g} ms", "pipeline", True),
                 (f"2-node tensor parallel, +{opts.delay_ms:g} ms", "tensor", True)]
    for label, name, delayed in rows:
        b1, bs = result.median(name, delayed, 1), result.median(name, delayed, s)
        lines.append(f"  {label:34}{b1 or 0:15.2f}{bs or 0:17.2f}")
    for name in ("single", "pipeline", "tensor"):
        lines.append(f"  plan {name}: {result.plans.get(name, '?')}")
    steps = opts.ceiling_steps
    one, two = statistics.median(result.ceiling_one), statistics.median(result.ceiling_two)
    ceiling, speedup = statistics.median(result.ceilings), statistics.median(result.speedups)
    ratio = speedup / ceiling
    lines.append(f"  ceiling (engine, no communication): one process {steps / one:.2f} tok/s, two halves at once "
                 f"{steps / two:.2f} tok/s (the slower) -> ceiling {ceiling:.2f}x "
                 f"(rounds {' '.join(f'{c:.2f}' for c in result.ceilings)})")
    lines.append(f"  TP speedup over one node {speedup:.2f}x (rounds {' '.join(f'{x:.2f}' for x in result.speedups)})"
                 f"; ratio speedup / ceiling {ratio:.2f} -> "
                 + (("PASS" if ratio >= 0.8 else "FAIL") if quiet else "not judged (a busy machine)") + " (>= 0.8)")
    single, tensor = result.median("single", False, 1), result.median("tensor", False, 1)
    assert single and tensor
    tp_ms, two_ms, single_ms, one_ms = 1e3 / tensor, 1e3 * two / steps, 1e3 / single, 1e3 * one / steps
    lines.append(f"  per token: TP {tp_ms:.1f} ms vs the slower half's {two_ms:.1f} ms: +{tp_ms - two_ms:.1f} ms; "
                 f"one node {single_ms:.1f} ms vs one process {one_ms:.1f} ms: +{single_ms - one_ms:.1f} ms")
    for delayed, (gloo, direct) in result.allreduce.items():
        where = f"+{opts.delay_ms:g} ms link" if delayed else "no delay"
        width = opts.shape_config["hidden_size"]
        lines.append(f"  all-reduce of a 1x{width} {result.kind} row host to host ({where}), "
                     f"median: gloo {gloo * 1e6:.0f} us -> x{2 * layers} a token: {2 * layers * gloo * 1e3:.1f} ms; "
                     f"a direct exchange on one socket {direct * 1e6:.0f} us -> {2 * layers * direct * 1e3:.1f} ms")
    if result.delay_how:
        lines.append(f"  delay: {result.delay_how}")
    for delayed, (picked, layout, why) in result.auto.items():
        if picked not in ("pipeline", "tensor"):
            verdict = "neither of the two"
        else:
            b1 = {name: result.median(name, delayed, 1) or 0 for name in ("pipeline", "tensor")}
            faster = max(b1, key=lambda name: b1[name])
            verdict = (f"the faster at batch 1 is {faster} ({b1['pipeline']:.2f} vs {b1['tensor']:.2f} tok/s "
                       f"pipeline vs tensor): {'the faster' if picked == faster else 'NOT the faster'}")
        where = f"{opts.delay_ms:g} ms delay" if delayed else "no delay"
        lines.append(f"  --parallel auto ({where}): picked {picked} ({layout}); {verdict}")
        lines.append(f"    planner: {why}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", default="float32,bfloat16", help="model dtypes, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32, help="batch-1 decode tokens measured a request")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--stream-tokens", type=int, default=8, help="decode tokens measured a stream")
    parser.add_argument("--ceiling-steps", type=int, default=32)
    parser.add_argument("--delay-ms", type=float, default=5.0, help="added one way, each direction")
    parser.add_argument("--delay-rounds", type=int, default=1)
    parser.add_argument("--delay-tokens", type=int, default=8,
                        help="decode tokens measured a request (and a stream) with the delay")
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--shape", default="qwen2.5-1.5b-12", choices=sorted(SHAPES),
                        help="the model's layers (a random checkpoint of that geometry)")
    parser.add_argument("--auto-placement", default="compute", choices=("compute", "memory"),
                        help="--placement of the --parallel auto clusters")
    parser.add_argument("--no-delay", action="store_true", help="skip the slower link")
    parser.add_argument("--no-auto", action="store_true", help="skip the --parallel auto clusters")
    opts = parser.parse_args()
    opts.shape_config = SHAPES[opts.shape]
    reason = netns_unavailable_reason()
    if reason:
        sys.exit(f"bench_parallel needs separate hosts: {reason}")
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        sys.exit(f"bench_parallel needs 2 CPUs, one a host; this process may use {allowed}")
    cpus = allowed[:2]
    import torch
    print(f"torch {torch.__version__}; {os.cpu_count()} CPUs, hosts on CPUs {cpus[0]} and {cpus[1]}; load average "
          f"{loadavg()}", flush=True)
    started = time.monotonic()
    results: list[KindResult] = []
    with tempfile.TemporaryDirectory(prefix="bench-parallel-") as tmp, netns_hosts(2, subnet=SUBNET) as hosts:
        root = Path(tmp)
        model_dir = build_model(root / f"{opts.shape}-shape-v{opts.vocab // 1024}k", opts.vocab, opts.shape_config)
        devices = [device_of(h) for h in hosts]
        for kind in opts.kinds.split(","):
            results.append(bench_kind(kind, root, hosts, devices, cpus, model_dir, opts))
    print(f"\n{opts.shape}-shaped random model ({SHAPE_NOTES[opts.shape]}), vocabulary {opts.vocab}; "
          f"two namespace hosts, one core each, one torch thread a node; batch 1: {opts.new_tokens} tokens a request, "
          f"{opts.streams} streams: "
          f"{opts.stream_tokens} tokens each (with the delay: {opts.delay_tokens} both); ceiling: "
          f"{opts.ceiling_steps} decode steps; "
          f"{time.monotonic() - started:.0f} s in all")
    for result in results:
        print("\n".join(report(result, opts, opts.shape_config["num_hidden_layers"])))


if __name__ == "__main__":
    main()
