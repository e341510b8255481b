"""GET /metrics in Prometheus text format (prometheus_client), with vLLM's metric names prefixed `exo_like:`.

A Grafana board built for vLLM needs only the prefix changed. Per-request numbers (tokens, time to first token,
inter-token latency, end-to-end latency, finished requests) are counted by the node that served the request,
from what its response reported. Scheduler and KV numbers are this node's stage: a ring's first stage batches
its requests and keeps its prefix cache, so those move there. One registry per node, so several nodes in one
process (tests) keep their numbers apart.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from exo_like.cluster.node_load import NodeLoad

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "exo_like:"

# vLLM's buckets: requests on a CPU cluster sit at their slow end.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0, 10.0,
                30.0)
ITERATION_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 1024, 2048, 4096)


@dataclass(frozen=True)
class FinishedRequest:
    """What one response reported, with when its tokens arrived (monotonic seconds)."""

    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # stop, length, or abort (client gone, error)
    started: float
    token_times: tuple[float, ...]
    ended: float


class Metrics:
    def __init__(self, load: Callable[[], NodeLoad], peer_rtts: Callable[[], dict[str, float]] = dict):
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self.prompt_tokens = Counter(f"{PREFIX}prompt_tokens", "Prefill tokens processed.", registry=registry)
        self.generation_tokens = Counter(f"{PREFIX}generation_tokens", "Generation tokens processed.",
                                         registry=registry)
        self.request_success = Counter(f"{PREFIX}request_success", "Count of successfully processed requests.",
                                       ["finished_reason"], registry=registry)
        self.request_replays = Counter(f"{PREFIX}request_replays", "Requests of this node's clients resumed on a "
                                       "re-formed ring (each pause counted once).", registry=registry)
        self.ttft = Histogram(f"{PREFIX}time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              buckets=TTFT_BUCKETS, registry=registry)
        self.itl = Histogram(f"{PREFIX}inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             buckets=ITL_BUCKETS, registry=registry)
        self.e2e = Histogram(f"{PREFIX}e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             buckets=E2E_BUCKETS, registry=registry)
        self.step_seconds = Histogram(f"{PREFIX}stage_step_seconds", "Time this node's layers took per engine step "
                                      "(a batch), sampling included on the last stage.", buckets=STEP_BUCKETS,
                                      registry=registry)
        self.iteration_tokens = Histogram(f"{PREFIX}iteration_tokens_total", "Histogram of positions (batch rows) "
                                          "per engine step of this node's layers.", buckets=ITERATION_TOKEN_BUCKETS,
                                          registry=registry)
        registry.register(_StateCollector(load, peer_rtts))

    def observe_request(self, done: FinishedRequest) -> None:
        self.prompt_tokens.inc(done.prompt_tokens)
        self.generation_tokens.inc(done.completion_tokens)
        if done.finish_reason in ("stop", "length"):
            self.request_success.labels(done.finish_reason).inc()
        self.e2e.observe(done.ended - done.started)
        if done.token_times:
            self.ttft.observe(done.token_times[0] - done.started)
        for before, after in zip(done.token_times, done.token_times[1:]):
            self.itl.observe(after - before)

    def observe_step(self, seconds: float, rows: int) -> None:
        self.step_seconds.observe(seconds)
        self.iteration_tokens.observe(rows)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StateCollector(Collector):
    """Numbers read from the node's state at scrape time."""

    def __init__(self, load: Callable[[], NodeLoad], peer_rtts: Callable[[], dict[str, float]]):
        self._load = load
        self._peer_rtts = peer_rtts

    def collect(self) -> Iterator[Metric]:
        load = self._load()
        yield _gauge("num_requests_running", "Number of requests in model execution batches.", load.running)
        yield _gauge("num_requests_waiting", "Number of requests waiting to be processed.", load.waiting)
        usage = load.kv_used / load.kv_blocks if load.kv_blocks else 0.0
        yield _gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage)
        yield _gauge("kv_cache_blocks", "KV-cache blocks of this node's pool (16 positions each).", load.kv_blocks)
        yield _gauge("kv_cache_window_blocks", "KV-cache blocks of this node's sliding-window layers' pool (0: it "
                     "holds no such layer).", load.kv_window_blocks)
        yield _counter("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                       load.prefix_queries)
        yield _counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                       load.prefix_hits)
        yield _counter("spec_decode_num_draft_tokens", "Tokens proposed for verification (speculative decoding).",
                       load.draft_tokens)
        yield _counter("spec_decode_num_accepted_tokens", "Proposed tokens the model kept.", load.accepted_tokens)
        yield _counter("spec_decode_num_drafts", "Verification steps (a request's draft checked in one pass).",
                       load.drafts)
        yield _counter("num_preemptions", "Cumulative number of preemption from the engine.", load.preemptions)
        yield _gauge("api_requests_in_flight", "Requests this node's API is serving.", load.in_flight)
        rtt = GaugeMetricFamily(f"{PREFIX}peer_rtt_seconds", "Round-trip time of the link to each peer.",
                                labels=["peer"])
        for peer, seconds in sorted(self._peer_rtts().items()):
            rtt.add_metric([peer], seconds)
        yield rtt


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{PREFIX}{name}", documentation, value=value)


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"{PREFIX}{name}", documentation, value=value)
