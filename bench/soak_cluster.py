"""Soak a loopback cluster for a set time: random kill -9, SIGSTOP, restarts and joins under 8 concurrent streams.

Four node slots; nodes 0-2 start, node 3 joins later. Eight client threads each stream greedy requests
(ignore_eos, 60 to 240 tokens, one of a few prompts) one after another, to a random running node. Every few
seconds a disturber picks one of:
  - kill: SIGKILL a running node other than node 0 (node 0 always serves, so some ring can always form);
  - freeze: SIGSTOP a running node other than node 0 for 2-8 s (past --peer-timeout: it is dropped, then rejoins);
  - start: start a node that is down (node 3 the first time: a join; later a restart on the same home and port,
    so it comes back with the same id, as after a crash).
Every greedy output must equal the reference taken on the intact ring at the start (same prompt, same length).

Printed at the end: requests sent, completed, failed by cause, and those whose origin was killed or frozen during
the request (counted apart: their client's connection is what died); replays (from the nodes' logs); the longest
stall between two streamed tokens (of requests whose origin stayed up); greedy outputs that differ from the
reference (must be 0); resident memory growth per node process that lived from the first ready ring to the end.
Exit 1 on a hang, a lost request, or a differing output.

Usage: python bench/soak_cluster.py [--minutes 10] [--seed 1] [--streams 8]
"""

from __future__ import annotations

import argparse
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import openai
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.api_server import NodeProcess, start_node  # noqa: E402
from tests.checkpoints import make_checkpoint  # noqa: E402
from tests.cluster_harness import cluster_of, free_ports  # noqa: E402

MEMORY_GB = [6, 3, 2, 1]
CLIENT_TIMEOUT = 60.0  # a request without an end by then is a hang
PROMPTS = ["Tell me a story.", "What is the capital of France?", "List some colours.", "hello"]
LENGTHS = [60, 120, 240]
DISTURB_EVERY = (3.0, 9.0)  # seconds between two disturbances
FREEZE_SECONDS = (2.0, 8.0)


@dataclass
class Event:
    node: int
    kind: str  # kill | freeze
    start: float
    end: float  # when it was running again (a freeze), or = start (a kill)


@dataclass
class Outcome:
    kind: str  # ok | differs | failed | origin_lost | hang
    origin: int
    detail: str = ""
    max_gap: float = 0.0
    origin_disturbed: bool = False  # its origin was killed or frozen while it ran


@dataclass
class Soak:
    root: Path
    rng: random.Random
    model: Path = field(init=False)
    ports: list[int] = field(init=False)
    nodes: list[NodeProcess | None] = field(init=False)
    events: list[Event] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)
    reference: dict[tuple[str, int], str] = field(default_factory=dict)
    frozen: set[int] = field(default_factory=set)
    started: list[str] = field(default_factory=list)  # join | restart, in order
    first_rss: dict[int, tuple[int, int]] = field(default_factory=dict)  # node -> (pid, RSS once the ring formed)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.model = make_checkpoint(self.root / "llama7", "llama", n_layers=7, max_shard_size="200KB")
        self.ports = free_ports(len(MEMORY_GB))
        self.nodes = [None] * len(MEMORY_GB)

    # -- nodes ----------------------------------------------------------------------------------------------

    def start(self, i: int) -> None:
        peers = ",".join(f"127.0.0.1:{port}" for port in self.ports)
        self.nodes[i] = start_node(self.root / f"home{i}", str(self.model), "--no-mdns", "--peers", peers,
                                   "--memory-gb", str(MEMORY_GB[i]), "--node-name", f"n{i}", "--engine", "torch",
                                   "--dtype", "float32", port=self.ports[i])

    def running(self) -> list[int]:
        with self.lock:
            return [i for i, node in enumerate(self.nodes)
                    if node is not None and node.process.poll() is None and i not in self.frozen]

    def ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                views = [cluster_of(self.nodes[i]) for i in self.running()]  # type: ignore[arg-type]
                if all(v["ready"] and v["agreed"] and len(v["nodes"]) == len(views) for v in views) and \
                        len({v["plan"]["digest"] for v in views}) == 1:
                    return True
            except (AssertionError, OSError):
                pass  # a node between states: ask again
            time.sleep(0.1)
        return False

    def rss(self, i: int) -> tuple[int, int]:
        node = self.nodes[i]
        assert node is not None
        return node.process.pid, psutil.Process(node.process.pid).memory_info().rss

    # -- requests -------------------------------------------------------------------------------------------

    def stream(self, i: int, prompt: str, tokens: int) -> tuple[str, float]:
        """The streamed text and the longest gap between two of its pieces."""
        node = self.nodes[i]
        assert node is not None
        client = openai.OpenAI(base_url=node.base_url + "/v1", api_key="unused", max_retries=0,
                               timeout=CLIENT_TIMEOUT)
        chunks = client.chat.completions.create(model=self.model.name, stream=True, max_tokens=tokens,
                                                temperature=0, extra_body={"ignore_eos": True},
                                                messages=[{"role": "user", "content": prompt}])
        pieces, last, gap = [], None, 0.0
        for chunk in chunks:
            if chunk.choices and chunk.choices[0].delta.content:
                now = time.monotonic()
                gap = max(gap, now - last) if last is not None else 0.0
                last = now
                pieces.append(chunk.choices[0].delta.content)
        return "".join(pieces), gap

    def take_reference(self) -> None:
        for prompt in PROMPTS:
            for tokens in LENGTHS:
                self.reference[(prompt, tokens)] = self.stream(0, prompt, tokens)[0]

    def client(self, stop: threading.Event) -> None:
        while not stop.is_set():
            choices = self.running()
            if not choices:
                time.sleep(0.2)
                continue
            origin, prompt, tokens = self.rng.choice(choices), self.rng.choice(PROMPTS), self.rng.choice(LENGTHS)
            started = time.monotonic()
            outcome = self.one_request(origin, prompt, tokens)
            outcome.origin_disturbed = self.origin_disturbed(origin, started, time.monotonic())
            if outcome.kind in ("failed", "hang") and outcome.origin_disturbed:
                outcome.kind = "origin_lost"
            with self.lock:
                self.outcomes.append(outcome)

    def one_request(self, origin: int, prompt: str, tokens: int) -> Outcome:
        try:
            text, gap = self.stream(origin, prompt, tokens)
        except openai.APITimeoutError:
            return Outcome("hang", origin, f"no end within {CLIENT_TIMEOUT:.0f} s")
        except openai.APIError as exc:
            cause = getattr(exc, "code", None) or type(exc).__name__
            return Outcome("failed", origin, f"{cause}: {str(exc)[:160]}")
        if text != self.reference[(prompt, tokens)]:
            return Outcome("differs", origin, f"{prompt!r} x {tokens}", gap)
        return Outcome("ok", origin, "", gap)

    def origin_disturbed(self, origin: int, started: float, ended: float) -> bool:
        with self.lock:
            return any(e.node == origin and e.start <= ended and e.end >= started for e in self.events)

    # -- disturbances ---------------------------------------------------------------------------------------

    def disturb(self) -> str:
        others = [i for i in self.running() if i != 0]
        down = [i for i, node in enumerate(self.nodes) if node is None]
        if not self.started:  # first, a node the cluster has never seen joins
            self.start(3)
            self.started.append("join")
            return "join n3"
        actions = (["kill", "freeze"] if others else []) + (["start"] if down else [])
        action = self.rng.choice(actions)
        if action == "start":
            i = self.rng.choice(down)
            self.start(i)
            self.started.append("restart")
            return f"restart n{i}"
        i = self.rng.choice(others)
        node = self.nodes[i]
        assert node is not None
        now = time.monotonic()
        if action == "kill":
            event = Event(i, "kill", now, now)  # requests that ran across this instant lost their origin
            with self.lock:
                self.events.append(event)
                self.nodes[i] = None
            node.process.send_signal(signal.SIGKILL)
            node.process.wait(30)
            return f"kill n{i}"
        seconds = self.rng.uniform(*FREEZE_SECONDS)
        event = Event(i, "freeze", now, float("inf"))
        with self.lock:
            self.events.append(event)
            self.frozen.add(i)
        node.process.send_signal(signal.SIGSTOP)
        time.sleep(seconds)
        node.process.send_signal(signal.SIGCONT)
        with self.lock:
            self.frozen.discard(i)
            event.end = time.monotonic()
        return f"freeze n{i} {seconds:.1f}s"

    def stop(self) -> None:
        for node in self.nodes:
            if node is not None:
                node.process.send_signal(signal.SIGCONT)
                node.stop()

    def replays(self) -> int:
        """Pauses for a replay logged by every node process that ran (killed ones included)."""
        return sum(log.read_text(errors="replace").count("paused after") for log in self.root.glob("home*/node-*.log"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--streams", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="exo-like-soak-") as tmp:
        soak = Soak(Path(tmp), random.Random(args.seed))
        try:
            code = run(soak, args)
        finally:
            soak.stop()
        if code:  # keep the nodes' logs, which say why
            kept = Path(tempfile.mkdtemp(prefix="exo-like-soak-logs-"))
            for log in Path(tmp).glob("home*/node-*.log"):
                shutil.copy(log, kept / f"{log.parent.name}-{log.name}")
            print(f"node logs kept in {kept}")
        return code


def run(soak: Soak, args: argparse.Namespace) -> int:
    for i in range(3):
        soak.start(i)
    if not soak.ready(60):
        print("the first ring never formed")
        return 1
    soak.take_reference()
    soak.first_rss = {i: soak.rss(i) for i in soak.running()}
    stop = threading.Event()
    clients = [threading.Thread(target=soak.client, args=(stop,), daemon=True) for _ in range(args.streams)]
    for thread in clients:
        thread.start()
    ends = time.monotonic() + args.minutes * 60
    while time.monotonic() < ends:
        time.sleep(soak.rng.uniform(*DISTURB_EVERY))
        print(f"{time.strftime('%H:%M:%S')} {soak.disturb():16s} running={soak.running()} "
              f"requests so far={len(soak.outcomes)} n0 RSS {soak.rss(0)[1] / 2**20:.0f} MB", flush=True)
    stop.set()
    for thread in clients:
        thread.join(CLIENT_TIMEOUT + 15)
    return report(soak)


def report(soak: Soak) -> int:
    counts = Counter(o.kind for o in soak.outcomes)
    causes = Counter(o.detail.split(":")[0] for o in soak.outcomes if o.kind == "failed")
    survived = [o for o in soak.outcomes if o.kind in ("ok", "differs") and not o.origin_disturbed]
    frozen_origin = [o for o in soak.outcomes if o.kind in ("ok", "differs") and o.origin_disturbed]
    print(f"\nrequests sent: {len(soak.outcomes)}; completed: {counts['ok'] + counts['differs']}; failed: "
          f"{counts['failed']} {dict(causes) or ''}; origin killed or frozen during the request (apart): "
          f"{counts['origin_lost']}; hung: {counts['hang']}")
    disturbances = Counter([e.kind for e in soak.events] + soak.started)
    print(f"disturbances: {dict(disturbances)}; replays (paused requests, from the logs): {soak.replays()}")
    print(f"longest stall between two tokens: {max((o.max_gap for o in survived), default=0):.2f} s "
          f"(requests whose origin was frozen and woke up: {len(frozen_origin)}, longest stall "
          f"{max((o.max_gap for o in frozen_origin), default=0):.2f} s)")
    print(f"greedy outputs that differ from the reference: {counts['differs']}")
    for o in soak.outcomes:
        if o.kind in ("failed", "differs", "hang"):
            print(f"  {o.kind} at n{o.origin}: {o.detail}")
    for i, (pid, before) in sorted(soak.first_rss.items()):
        node = soak.nodes[i]
        if node is not None and node.process.pid == pid and node.process.poll() is None:
            after = psutil.Process(pid).memory_info().rss
            print(f"n{i} (pid {pid}, up all along): RSS {before / 2**20:.0f} -> {after / 2**20:.0f} MB "
                  f"({(after - before) / 2**20:+.0f} MB)")
    return 1 if counts["hang"] or counts["failed"] or counts["differs"] else 0


if __name__ == "__main__":
    sys.exit(main())
