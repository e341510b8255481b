"""Speculative decoding across a ring: three nodes in network namespaces, with 5 ms added to every packet each way
and with none; the same greedy requests with --speculative-ngram on and off, side by side; ratios printed.

Target: SmolLM2-135M-Instruct as float32 (`--dtype float32`: the wheel's Q4_1 file dequantized), its 30 layers
split over the three nodes by memory (10 each). Hosts: three network namespaces on a private bridge
(tests/netns.py), each node pinned to one of this machine's CPUs in turn. The delay: tc netem where the kernel has
it; otherwise (these VMs) every host's routes to the others go through a TUN device, and a process of this bench's
carries each packet to its destination's device after the delay (the userspace delay bench/bench_parallel.py
builds, for any number of hosts).

Measured, per setting, in alternating rounds (medians): decode tok/s by difference through the HTTP API,
N / (T(1 + N) - T(1)) of a greedy request (ignore_eos), on
  - a "repeat this paragraph with one word changed" prompt (prompt lookup's case),
  - a plain question (little to look up),
  - 8 streams at once (speculation allowed against not: under load it must cost nothing);
the texts with and without speculation compared (they must be identical), and the first stage's proposed and
kept tokens (/v1/cluster). A draft model (issue 47's other draft source) is not built yet: not measured.

Needs root (namespaces), `ip`, and 2 CPUs.
Usage: python bench/bench_speculative.py [--rounds 3] [--new-tokens 48] [--delays 5,0] [--speculative 8]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_parallel import Node, Setup, launch, slower_link, timed_reply, wait_ready  # noqa: E402
from rates import together  # noqa: E402

from exo_like.models.names.catalog import PACKAGED  # noqa: E402
from tests.netns import NetnsHost, netns_hosts, netns_unavailable_reason  # noqa: E402

PARAGRAPH = ("The old lighthouse stood at the edge of the cliff, its white walls worn by a century of wind and salt. "
             "Every evening the keeper climbed the narrow stairs, lit the great lamp and watched the blue sea until "
             "the morning came.")
REPEAT = f"Repeat this paragraph exactly, changing only the word 'blue' to 'grey':\n\n{PARAGRAPH}"
QUESTION = "Tell me about the rings of Saturn."
SUBNET = "10.231.83"
PORT = 52700


def chat(node: Node, prompt: str, max_tokens: int) -> tuple[float, str]:
    """Seconds and text of one greedy request of exactly `max_tokens` tokens, timed inside the host."""
    elapsed, reply = timed_reply(node, "smollm2-135m", max_tokens, prompt)
    return elapsed, reply["choices"][0]["message"]["content"]


def rate(node: Node, prompt: str, new_tokens: int) -> tuple[float, str]:
    """Decode tok/s by difference, and the text."""
    long, text = chat(node, prompt, 1 + new_tokens)
    short, _ = chat(node, prompt, 1)
    return new_tokens / (long - short), text


def streams_rate(node: Node, streams: int, new_tokens: int) -> float:
    def request(i: int, max_tokens: int) -> float:
        return chat(node, f"{QUESTION} ({i})", max_tokens)[0]
    return streams * new_tokens / (together(request, streams, 1 + new_tokens) - together(request, streams, 1))


@contextmanager
def delayed(hosts: list[NetnsHost], delay_ms: float) -> Iterator[str]:
    """`delay_ms` added one way to every packet between any two of the hosts (bench_parallel.slower_link)."""
    if delay_ms <= 0:
        yield "no added delay"
        return
    with slower_link(hosts, delay_ms) as how:
        yield how


def start(root: Path, name: str, hosts: list[NetnsHost], model: Path, speculative: int, port: int) -> Setup:
    cpus = [i % 2 for i in range(len(hosts))]
    peers = [(h, port) for h in hosts]
    extra = ("--placement", "memory", "--speculative-ngram", str(speculative))
    setup = Setup(name, [launch(root, f"{name}-{i}", host, cpu, port, model, "float32", peers, extra,
                                f"bench-speculative-{name}") for i, (host, cpu) in enumerate(zip(hosts, cpus))])
    wait_ready(setup)
    return setup


def counts(setup: Setup) -> tuple[int, int]:
    """The ring's proposed and kept tokens so far (its first stage's counts, in /v1/cluster)."""
    nodes = setup.entry.get_json("/v1/cluster")["nodes"]
    return sum(n.get("draft_tokens", 0) for n in nodes), sum(n.get("accepted_tokens", 0) for n in nodes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--delays", default="5,0", help="ms added each way, one setting per value")
    parser.add_argument("--speculative", type=int, default=8, help="--speculative-ngram of the speculating ring")
    parser.add_argument("--streams", type=int, default=8)
    opts = parser.parse_args()
    reason = netns_unavailable_reason()
    if reason:
        sys.exit(f"cannot run: {reason}")
    model = PACKAGED["smollm2-135m"].path()
    print(f"load average {os.getloadavg()[0]:.2f}; target {model.name} as float32 on 3 nodes; "
          f"--speculative-ngram {opts.speculative}")
    with tempfile.TemporaryDirectory(prefix="bench-speculative-") as folder, \
            netns_hosts(3, SUBNET) as hosts:
        root = Path(folder)
        setups = {"off": start(root, "off", hosts, model, 0, PORT),
                  "on": start(root, "on", hosts, model, opts.speculative, PORT + 1)}
        try:
            for delay in (float(d) for d in opts.delays.split(",")):
                with delayed(hosts, delay) as how:
                    print(f"\n== {delay:g} ms each way ({how})")
                    figures: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
                    texts: dict[tuple[str, str], str] = {}
                    for _ in range(opts.rounds):
                        for name in ("off", "on"):
                            entry = setups[name].entry
                            for prompt_name, prompt in (("repeat", REPEAT), ("question", QUESTION)):
                                tok_s, text = rate(entry, prompt, opts.new_tokens)
                                figures[name, prompt_name].append(tok_s)
                                texts[name, prompt_name] = text
                            figures[name, "streams"].append(streams_rate(entry, opts.streams, opts.new_tokens))
                    for prompt_name in ("repeat", "question", "streams"):
                        off = statistics.median(figures["off", prompt_name])
                        on = statistics.median(figures["on", prompt_name])
                        same = "" if prompt_name == "streams" else \
                            f", text identical: {texts['off', prompt_name] == texts['on', prompt_name]}"
                        label = f"{opts.streams} streams" if prompt_name == "streams" else f"{prompt_name} prompt"
                        print(f"{label:>16}: without {off:7.1f} tok/s, with {on:7.1f} tok/s: {on / off:.2f}x{same}")
                    proposed, kept = counts(setups["on"])
                    print(f"{'so far':>16}: {proposed} tokens proposed, {kept} kept "
                          f"({100 * kept / max(proposed, 1):.0f} %)")
        finally:
            for setup in setups.values():
                setup.stop()


if __name__ == "__main__":
    main()
