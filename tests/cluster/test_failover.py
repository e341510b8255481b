"""A node lost mid-request costs the request nothing: real nodes on loopback, a streaming request of 200 tokens,
and a stage killed (SIGKILL), stopped (SIGTERM), frozen (SIGSTOP) or joined by a new node (given every member's
address, or only one) in the middle of it. The stream must go on to the same text as an uninterrupted run of the
same request, and with no stall that the cluster does not explain: between two tokens the stream may wait only while
the origin reports its cluster not ready (a ring re-forming: a newcomer loading, stages reloading), plus the
time a lost peer may stay silent before it counts as lost (--peer-timeout) and the replay's own cost, measured
against the uninterrupted run's first token and longest gap in the same test. No wall-clock threshold: a busy
machine lengthens both sides alike.

In-process tests of the same logic, with every ordering under control: tests/serving/test_replay.py.

Starting nodes is most of what these cost: one cluster of three serves the tests that use it in turn (each starts
again, as it was started, a member the test before killed; a test that adds a node stops it again), and two of them
the last test.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest

from exo_like.cluster.peers import DEFAULT_PEER_TIMEOUT
from tests.api_server import NodeProcess, launch_node, start_node, stop_nodes
from tests.checkpoints import make_checkpoint
from tests.cluster_harness import BY_MEMORY, LateRelay, cluster_of, launch_member, start_cluster, wait_until_ready

PROMPT = "Tell me a long story about a lighthouse."
TOKENS = 200
BREAK_AT = 20  # tokens streamed before the ring breaks
POLL_SECONDS = 0.05
Span = tuple[float, float]  # (start, end), time.monotonic() seconds


@dataclass
class Streamed:
    text: str
    tokens: int
    first_token: float  # seconds from the request to its first streamed piece
    max_gap: float  # seconds: the longest wait between two streamed pieces after the first
    unexplained: float  # seconds: the longest such wait less the time it overlapped an explained span
    explained: list[Span] = field(default_factory=list)  # the test acting, the origin's cluster not ready


class ReadinessWatch:
    """Polls a node's /health in a thread and keeps the spans in which it said its cluster was not ready. A span
    runs from the last poll sent that still said ready to the first answer that says ready again, so a change
    between two polls falls inside it."""

    def __init__(self, node: NodeProcess):
        self.node = node
        self.spans: list[Span] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> "ReadinessWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        last_ready = time.monotonic()
        opened: float | None = None
        while not self._stop.is_set():
            sent = time.monotonic()
            try:
                ready = bool(self.node.get_json("/health")["cluster_ready"])
            except Exception:  # the origin not answering explains nothing: leave the state as it was
                ready = opened is None
            if ready:
                if opened is not None:
                    self.spans.append((opened, time.monotonic()))
                    opened = None
                last_ready = sent
            elif opened is None:
                opened = last_ready
            self._stop.wait(POLL_SECONDS)
        if opened is not None:
            self.spans.append((opened, time.monotonic()))


def uncovered(start: float, end: float, spans: list[Span]) -> float:
    """How much of [start, end] lies outside every span."""
    covered, cursor = 0.0, start
    for low, high in sorted(spans):
        low, high = max(low, cursor), min(high, end)
        if high > low:
            covered += high - low
            cursor = high
    return (end - start) - covered


@pytest.fixture(scope="module")
def seven_layers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama7", "llama", n_layers=7, max_shard_size="200KB")


# Placed by memory (4, 2 and 1 layers): every node a stage, so a kill always costs the ring one. By measured speed
# one fast node may rightly hold all seven tiny layers.
THREE_MEMORIES = [6, 3, 1]


class SharedThree:
    """The module's three nodes; a member lost (killed by a test) can be started again as it was started: its home,
    so its node id, its port and its memory, so the ring and its split are those of a cluster started afresh."""

    def __init__(self, root: Path, model_dir: Path):
        self.root, self.model_dir = root, model_dir
        self.nodes = start_cluster(root, str(model_dir), THREE_MEMORIES, extra=BY_MEMORY)

    def restart_lost(self) -> None:
        ports = [node.port for node in self.nodes]
        lost = [i for i, node in enumerate(self.nodes) if node.process.poll() is not None]
        launched = {i: launch_member(self.root, str(self.model_dir), ports, i, THREE_MEMORIES[i], extra=BY_MEMORY)
                    for i in lost}
        try:
            for i, started in launched.items():
                self.nodes[i] = started.serving()
        except BaseException:
            for started in launched.values():
                started.stop()
            raise


@pytest.fixture(scope="module")
def shared_three(seven_layers: Path, tmp_path_factory: pytest.TempPathFactory):
    cluster = SharedThree(tmp_path_factory.mktemp("three"), seven_layers)
    try:
        yield cluster
    finally:
        stop_nodes(cluster.nodes)


@pytest.fixture
def three_nodes(shared_three: SharedThree):
    """The shared three nodes, every one running and the ring of three ready, as a cluster started for the test."""
    shared_three.restart_lost()
    try:
        wait_until_ready(shared_three.nodes, members=3)
        yield list(shared_three.nodes)
    finally:
        for node in shared_three.nodes:
            node.signal(signal.SIGCONT)  # a test that failed while a node was stopped


def stream(node: NodeProcess, model: str, at: int = BREAK_AT, action: Callable[[], Any] | None = None,
           tokens: int = TOKENS, **sampling: Any) -> Streamed:
    """A streamed chat completion of `tokens` tokens (ignore_eos); `action` runs after `at` streamed pieces."""
    import openai

    client = openai.OpenAI(base_url=node.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    pieces, counted, times = [], 0, []
    explained: list[Span] = []  # the test acting (starting a node, say: the client read nothing meanwhile)
    with ReadinessWatch(node) as watch:
        asked = time.monotonic()
        chunks = client.chat.completions.create(
            model=model, stream=True, max_tokens=tokens, temperature=sampling.pop("temperature", 0),
            extra_body={"ignore_eos": True, **sampling}, stream_options={"include_usage": True},
            messages=[{"role": "user", "content": PROMPT}])
        for chunk in chunks:
            if chunk.usage is not None:
                counted = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
                times.append(time.monotonic())
                if len(pieces) == at and action is not None:
                    started = time.monotonic()
                    action()
                    explained.append((started, time.monotonic()))
    explained += watch.spans
    pairs = list(zip(times, times[1:]))
    return Streamed("".join(pieces), counted, times[0] - asked if times else 0.0,
                    max((after - before for before, after in pairs), default=0.0),
                    max((uncovered(before, after, explained) for before, after in pairs), default=0.0), explained)


def check_against(reference: Streamed, got: Streamed, what: str, tokens: int = TOKENS) -> None:
    """Same tokens, same text, and no stall the cluster does not explain. Beyond the spans it reported not ready
    in, a wait may hold a lost peer's silence (--peer-timeout, before the loss is known) and the replay: the
    prompt and the tokens so far prefilled again on the new ring, then a step. Their like in the uninterrupted run
    of the same request: its first token and its longest gap, each allowed twice over."""
    allowed = DEFAULT_PEER_TIMEOUT + 2 * (reference.first_token + reference.max_gap)
    not_ready = sum(end - start for start, end in got.explained)
    print(f"{what}: {got.tokens} tokens, longest gap between two tokens {got.max_gap:.2f} s, "
          f"{got.unexplained:.2f} s of it unexplained (allowed {allowed:.2f} s; reference: first token "
          f"{reference.first_token:.2f} s, longest gap {reference.max_gap:.2f} s; explained spans {not_ready:.2f} s)")
    assert got.tokens == reference.tokens == tokens
    assert got.text == reference.text
    assert got.unexplained <= allowed, f"the stream stalled for {got.unexplained:.2f} s with the cluster ready"


def kill(node: NodeProcess) -> Callable[[], None]:
    def act() -> None:
        node.process.send_signal(signal.SIGKILL)
        node.process.wait()
    return act


def replays(node: NodeProcess) -> int:
    return int(node.get_json("/health")["replays_total"])


def stage_ids(node: NodeProcess) -> set[str]:
    return {s["node_id"] for s in cluster_of(node)["plan"]["stages"]}


def steps_run(node: NodeProcess) -> float:
    """Engine steps this node's layers have run (from its /metrics)."""
    _, _, raw = node.request("GET", "/metrics")
    line = next(line for line in raw.decode().splitlines() if line.startswith("exo_like:stage_step_seconds_count"))
    return float(line.split()[-1])


# First the test with a cluster of its own, so the shared one is not started (idle) beside it.

def test_when_the_rest_cannot_hold_the_model_the_request_ends_saying_why(seven_layers: Path, tmp_path: Path) -> None:
    import openai

    nodes = start_cluster(tmp_path, str(seven_layers), [0.0012, 0.0012])  # ~1.3 MB each: the model needs both
    try:
        wait_until_ready(nodes, members=2)
        with pytest.raises(openai.APIError) as failure:  # in the stream: the response had begun
            stream(nodes[0], seven_layers.name, action=kill(nodes[1]))
        assert failure.value.code == "plan_unavailable"
        message = str(failure.value)
        assert "node node1 (" in message and "left the cluster during the request" in message
        assert "could not be resumed on the remaining nodes: the model does not fit" in message
    finally:
        stop_nodes(nodes)


@pytest.mark.parametrize("origin, lost", [(0, 1), (0, 2), (2, 0)], ids=["middle", "last", "first-not-origin"])
def test_a_stage_killed_mid_stream_costs_the_request_nothing(three_nodes, seven_layers: Path, origin: int,
                                                             lost: int) -> None:
    lost_id = three_nodes[lost].get_json("/health")["node_id"]
    # The origin's counts from earlier tests on the shared cluster: exactly one replay more, none in the reference.
    before = replays(three_nodes[origin])
    reference = stream(three_nodes[origin], seven_layers.name)
    got = stream(three_nodes[origin], seven_layers.name, action=kill(three_nodes[lost]))
    check_against(reference, got, f"stage {lost} killed")
    assert replays(three_nodes[origin]) == before + 1
    _, _, metrics = three_nodes[origin].request("GET", "/metrics")
    assert f"exo_like:request_replays_total {float(before + 1)}" in metrics.decode().splitlines()
    assert lost_id not in stage_ids(three_nodes[origin])


def test_a_seeded_sampled_request_gives_the_same_text_with_a_kill_in_the_middle(three_nodes,
                                                                               seven_layers: Path) -> None:
    reference = stream(three_nodes[0], seven_layers.name, temperature=0.8, seed=2024)
    got = stream(three_nodes[0], seven_layers.name, temperature=0.8, seed=2024, action=kill(three_nodes[1]))
    check_against(reference, got, "seeded, middle stage killed")


def test_a_node_joining_mid_stream_reforms_the_ring_under_the_request(three_nodes, seven_layers: Path,
                                                                     tmp_path: Path) -> None:
    reference = stream(three_nodes[0], seven_layers.name)
    peers = ",".join(f"127.0.0.1:{node.port}" for node in three_nodes)
    late: list[NodeProcess] = []

    def join() -> None:
        late.append(start_node(tmp_path / "home-late", str(seven_layers), "--no-mdns", "--peers", peers,
                               "--memory-gb", "2", "--node-name", "late", "--engine", "torch", "--dtype", "float32",
                               *BY_MEMORY))

    try:
        got = stream(three_nodes[0], seven_layers.name, action=join)
        check_against(reference, got, "a fourth node joined")
        wait_until_ready([*three_nodes, *late], members=4)
        assert late[0].get_json("/health")["node_id"] in stage_ids(three_nodes[0])
    finally:
        for node in late:
            node.stop()


@pytest.mark.slow
def test_a_frozen_stage_is_dropped_and_rejoins_once_it_wakes(three_nodes, seven_layers: Path) -> None:
    """SIGSTOP until the request has finished on the other two nodes (so it did not wait for the frozen one); after
    SIGCONT the node links again, the ring re-forms with it, and the next request runs through its layers."""
    frozen = three_nodes[1]
    frozen_id = frozen.get_json("/health")["node_id"]
    reference = stream(three_nodes[0], seven_layers.name)
    got = stream(three_nodes[0], seven_layers.name, action=lambda: frozen.process.send_signal(signal.SIGSTOP))
    check_against(reference, got, "middle stage frozen")
    assert frozen_id not in stage_ids(three_nodes[0])
    frozen.process.send_signal(signal.SIGCONT)
    wait_until_ready(three_nodes, members=3, timeout=60)
    assert frozen_id in stage_ids(three_nodes[0])
    steps_before = steps_run(frozen)
    after = stream(three_nodes[0], seven_layers.name)
    assert after.text == reference.text
    assert steps_run(frozen) > steps_before  # its layers ran the request


@pytest.mark.slow
def test_a_node_joining_through_one_member_and_members_leaving_cost_the_stream_nothing(shared_three: SharedThree,
                                                                                      seven_layers: Path,
                                                                                      tmp_path: Path) -> None:
    """Two nodes with each other in --peers; a third given only the first's address (a bootstrap address, as users
    give one across subnets and VPNs) links with it in the middle of a stream. Peer exchange must link it with the
    second node too, and all three must plan over the same membership: the stream ends as on a cluster that did not
    change, and all agree. (Before, the second node never heard of the third: three plans over three memberships,
    and the stream ended with 503 plan_unavailable.) Then the second node, which the third knows only from the
    first, stops (SIGTERM), and the third is killed, each in the middle of a stream.

    The two are the module's node0 and node1 (6 and 3 GiB), last: its node2 stopped first (their --peers still
    name its address, where nothing answers now)."""
    shared_three.restart_lost()
    first, second, gone = shared_three.nodes
    for node in shared_three.nodes:
        node.signal(signal.SIGCONT)  # a test before that failed while a node was stopped
    relay = LateRelay(first.port)  # the newcomer's one peer address: it reaches the first node once opened
    # Started while node2 stops (its dials wait at the relay, unanswered, until it opens).
    launched = launch_node(tmp_path / "home-newcomer", str(seven_layers), "--no-mdns", "--peers",
                           f"127.0.0.1:{relay.port}", "--memory-gb", "2", "--node-name", "newcomer",
                           "--engine", "torch", "--dtype", "float32", *BY_MEMORY)
    try:
        assert stop_nodes([gone]) == [0], gone.log()
        wait_until_ready([first, second], members=2)
        newcomer = launched.serving()
        nodes = [first, second, newcomer]
        reference = stream(first, seven_layers.name)
        relay.wait_for_dial()  # the newcomer's dial waits at the relay: opening it links them at that moment
        before = replays(first)
        got = stream(first, seven_layers.name, action=relay.open)
        print(f"the join replayed the request {replays(first) - before} time(s)")
        check_against(reference, got, "a third node joined through the first")
        wait_until_ready(nodes, members=3)
        views = [cluster_of(node) for node in nodes]
        assert len({frozenset(n["id"] for n in view["nodes"]) for view in views}) == 1
        assert len({view["plan"]["digest"] for view in views}) == 1 and all(view["agreed"] for view in views)

        got = stream(first, seven_layers.name, action=lambda: second.process.send_signal(signal.SIGTERM))
        check_against(reference, got, "the second node stopped")
        assert second.process.wait(timeout=30) == 0
        wait_until_ready([first, newcomer], members=2)

        got = stream(first, seven_layers.name, action=kill(newcomer))
        check_against(reference, got, "the third node killed")
        wait_until_ready([first], members=1)
    finally:
        relay.close()
        launched.stop()  # (the module's nodes: stopped with the module)
