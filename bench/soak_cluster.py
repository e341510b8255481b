"""Soak a four-node loopback cluster: random kills, SIGTERMs, freezes and (re)starts under streaming requests.

Each round starts one to three requests (streamed or not) on random live nodes, then kills, stops, freezes
(SIGSTOP for 3 s, as a machine that sleeps or stalls) or starts a node. Every request must end within the
client's timeout, with its tokens or with a clear error, and the ring must re-form within 30 s. A request that
times out is a hang: the script says so and exits 1.

Node 0 is never stopped, so there is always a ring to serve. Nodes restart on their own port and home, so a
restarted node comes back with the same id, as after a crash.

Usage: python bench/soak_cluster.py [--rounds 30] [--seed 1]
"""

from __future__ import annotations

import argparse
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.api_server import NodeProcess, start_node  # noqa: E402
from tests.checkpoints import make_checkpoint  # noqa: E402
from tests.cluster_harness import cluster_of, free_ports  # noqa: E402

MEMORY_GB = [6, 3, 2, 1]
CLIENT_TIMEOUT = 45.0


class Soak:
    def __init__(self, root: Path, rng: random.Random):
        self.root = root
        self.rng = rng
        self.model = make_checkpoint(root / "llama7", "llama", n_layers=7, max_shard_size="200KB")
        self.ports = free_ports(len(MEMORY_GB))
        self.nodes: list[NodeProcess | None] = [None] * len(MEMORY_GB)
        self.outcomes: list[tuple[str, str]] = []  # (ok | error | HANG, detail)
        self._lock = threading.Lock()

    def start(self, i: int) -> None:
        peers = ",".join(f"127.0.0.1:{port}" for port in self.ports)
        self.nodes[i] = start_node(self.root / f"home{i}", str(self.model), "--no-mdns", "--peers", peers,
                                   "--memory-gb", str(MEMORY_GB[i]), "--node-name", f"n{i}", "--engine", "torch",
                                   "--dtype", "float32", port=self.ports[i])

    def live(self) -> list[int]:
        return [i for i, node in enumerate(self.nodes) if node is not None and node.process.poll() is None]

    def ready(self, timeout: float = 30) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                views = [cluster_of(self.nodes[i]) for i in self.live()]  # type: ignore[arg-type]
                if all(v["ready"] and v["agreed"] and len(v["nodes"]) == len(views) for v in views) and \
                        len({v["plan"]["digest"] for v in views}) == 1:
                    return True
            except (AssertionError, OSError):
                pass  # a node between states: ask again
            time.sleep(0.1)
        return False

    def request(self, i: int, max_tokens: int, stream: bool) -> None:
        node = self.nodes[i]
        assert node is not None
        client = openai.OpenAI(base_url=node.base_url + "/v1", api_key="unused", max_retries=0,
                               timeout=CLIENT_TIMEOUT)
        arguments = dict(model=self.model.name, max_tokens=max_tokens, extra_body={"ignore_eos": True},
                         messages=[{"role": "user", "content": "hello"}])
        try:
            if stream:
                chunks = sum(1 for _ in client.chat.completions.create(stream=True, **arguments))
                outcome = ("ok", f"n{i}: {chunks} chunks")
            else:
                answer = client.chat.completions.create(**arguments)
                outcome = ("ok", f"n{i}: {answer.usage.completion_tokens} tokens")
        except openai.APITimeoutError:
            outcome = ("HANG", f"n{i}: no end within {CLIENT_TIMEOUT:.0f} s")
        except openai.APIError as exc:
            outcome = ("error", f"n{i}: {type(exc).__name__}: {str(exc)[:110]}")
        with self._lock:
            self.outcomes.append(outcome)

    def disturb(self) -> str:
        action = self.rng.choice(["kill", "term", "freeze", "start", "start", "none"])
        others = [i for i in self.live() if i != 0]
        down = [i for i in range(len(self.nodes)) if i not in self.live()]
        if action in ("kill", "term") and others:
            i = self.rng.choice(others)
            node = self.nodes[i]
            assert node is not None
            node.process.send_signal(signal.SIGKILL if action == "kill" else signal.SIGTERM)
            node.process.wait(30)
            self.nodes[i] = None
            return f"{action} n{i}"
        if action == "freeze" and others:
            i = self.rng.choice(others)
            node = self.nodes[i]
            assert node is not None
            node.process.send_signal(signal.SIGSTOP)
            time.sleep(3)
            node.process.send_signal(signal.SIGCONT)
            return f"freeze n{i}"
        if action == "start" and down:
            i = self.rng.choice(down)
            self.start(i)
            return f"start n{i}"
        return "none"

    def round(self) -> tuple[str, list[tuple[str, str]], bool]:
        before = len(self.outcomes)
        threads = [threading.Thread(target=self.request, args=(self.rng.choice(self.live()),
                                                               self.rng.randint(30, 600), self.rng.random() < 0.7))
                   for _ in range(self.rng.randint(1, 3))]
        for thread in threads:
            thread.start()
        time.sleep(self.rng.uniform(0.05, 1.5))
        what = self.disturb()
        for thread in threads:
            thread.join(CLIENT_TIMEOUT + 15)
        return what, self.outcomes[before:], self.ready()

    def stop(self) -> None:
        for node in self.nodes:
            if node is not None:
                node.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="exo-like-soak-") as tmp:
        soak = Soak(Path(tmp), random.Random(args.seed))
        unready = 0
        try:
            for i in range(3):
                soak.start(i)
            if not soak.ready(60):
                print("the first ring never formed")
                return 1
            for number in range(args.rounds):
                what, outcomes, ready = soak.round()
                unready += not ready
                print(f"round {number:3d}: {what:8s} live={soak.live()} re-formed={ready} | "
                      + " | ".join(f"{kind} {detail}" for kind, detail in outcomes), flush=True)
        finally:
            soak.stop()
    counts = Counter(kind for kind, _ in soak.outcomes)
    print(f"requests: {counts['ok']} completed, {counts['error']} ended with an error, {counts['HANG']} hung; "
          f"rounds where the ring did not re-form within 30 s: {unready}")
    return 1 if counts["HANG"] or unready else 0


if __name__ == "__main__":
    sys.exit(main())
