"""`exo-like`: start a node that serves the OpenAI-compatible API on every interface."""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import gc
import logging
import os
import signal
import sys
from pathlib import Path

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from discovery import parse_peers
from exo_like.api.routes import create_app, finish_generations
from exo_like.cluster.peers import DEFAULT_PEER_TIMEOUT
from exo_like.cluster.protocol import MAX_DRAFT
from exo_like.engines.torch.openmp import limit_worker_spin
from exo_like.errors import ExoLikeError
from exo_like.models.hub.repo import refuse_downloads
from exo_like.instances.keep_alive import parse_keep_alive
from exo_like.node import DEFAULT_CLUSTER_KEY, DEFAULT_STEP_TIMEOUT, Node, NodeOptions, default_home
from partitioning.speed_figures import PARALLEL_MODES
from exo_like.serving.scheduler import (
    DEFAULT_INTERLEAVE_TOKENS,
    DEFAULT_MAX_BATCH_TOKENS,
    DEFAULT_MAX_RUNNING,
    SchedulerLimits,
)

log = logging.getLogger("exo_like")

DEFAULT_PORT = 52415
# aiohttp's own wait for handlers at shutdown; the API's on_shutdown hook has already given generating requests
# their grace period and cancelled the rest, so this only bounds what is left (e.g. a slow health check).
SHUTDOWN_TIMEOUT = 1.0


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be 0..65535, got {port}")
    return port


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="exo-like", description=__doc__)
    parser.add_argument("--port", type=_port, default=DEFAULT_PORT, help="API port (0 picks a free one)")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on")
    parser.add_argument("--home", type=Path, default=None,
                        help="folder for models and state (default: $EXO_LIKE_HOME or ~/.cache/exo-like)")
    parser.add_argument("--model", default=None,
                        help="a Hugging Face repo id (org/name, org/name@revision, or org/name-GGUF:Q4_K_M for "
                             "a GGUF file of a repo), a catalog name (e.g. "
                             "qwen2.5-7b, llama-3.2-3b), a local Hugging Face model folder, or 'demo'")
    parser.add_argument("--hub-cache", type=Path, default=None,
                        help="folder for models downloaded from the hub (default: $HF_HUB_CACHE if set, "
                             "else <home>/hub); HF_ENDPOINT, HF_TOKEN and HF_HUB_OFFLINE are honoured")
    parser.add_argument("--request-wait", type=float, default=None,
                        help="seconds a request waits for its model to be ready (e.g. while layers download) before "
                             "a 503 that says what it waits for (default: 30 for a ring re-forming under running "
                             "requests; a model's first load: as long as it takes for a streamed request, 120 for "
                             "one not streamed, then a 503 with Retry-After)")
    parser.add_argument("--keep-alive", default="5m", type=_keep_alive,
                        help="how long a model stays loaded after its last request, as Ollama's keep_alive: seconds "
                             "or a duration (\"10m\", \"1h\"); 0 unloads it at once, a negative value keeps it "
                             "(default: 5m; a request's keep_alive overrides it; --model's model stays)")
    parser.add_argument("--step-timeout", type=float, default=DEFAULT_STEP_TIMEOUT,
                        help="seconds a stage may spend in one engine step (a token, or a prefill chunk) before "
                             "requests through it fail with a 504: a hung engine (default: %(default)g)")
    parser.add_argument("--peer-timeout", type=float, default=DEFAULT_PEER_TIMEOUT,
                        help="seconds a linked peer may stay silent (a frozen process, a dead link) before it "
                             "counts as lost and requests through it replay on the re-formed ring "
                             "(default: %(default)g)")
    parser.add_argument("--engine", choices=("auto", "torch", "mlx"), default="auto")
    parser.add_argument("--device", default=None, help="e.g. cpu, cuda, cuda:1, mps (default: best available)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="default: the checkpoint's")
    parser.add_argument("--node-name", default=None, help="human name shown to peers (default: hostname)")
    parser.add_argument("--memory-gb", type=float, default=None,
                        help="memory this node offers for layers (default: available RAM)")
    parser.add_argument("--peers", default=None,
                        help="static peers host:port,... where multicast (mDNS) cannot reach (one member of a cluster "
                             "is enough: linked peers exchange addresses)")
    parser.add_argument("--no-mdns", action="store_true", help="do not advertise or browse on mDNS")
    parser.add_argument("--cluster-key", default=os.environ.get("EXO_LIKE_CLUSTER_KEY"),
                        help="shared secret peers must hold (env EXO_LIKE_CLUSTER_KEY; default: a built-in key)")
    parser.add_argument("--no-downloads", action="store_true",
                        help="never fetch from the hub: serve what this node's cache or its peers hold (as "
                             "HF_HUB_OFFLINE=1, with errors that name this option)")
    parser.add_argument("--api-key", default=os.environ.get("EXO_LIKE_API_KEY") or None,
                        help="require this key of every API client and the dashboard (Authorization: Bearer, or "
                             "x-api-key; env EXO_LIKE_API_KEY; default: none, anyone who reaches the port may use it)")
    parser.add_argument("--kv-cache-gb", type=float, default=None,
                        help="memory for the KV cache of this node's layers (default: 30%% of the memory left after "
                             "loading them, at most 2 GiB, and never more than --max-running whole contexts need); "
                             "requests wait for room when it is full")
    parser.add_argument("--max-batch-tokens", type=int, default=None,
                        help="positions one engine step may compute: prompt chunks when no request is streaming "
                             f"(default: {DEFAULT_MAX_BATCH_TOKENS['cpu']} when the first stage runs on a CPU, "
                             f"else {DEFAULT_MAX_BATCH_TOKENS['accelerator']})")
    parser.add_argument("--interleave-tokens", type=int, default=None,
                        help="positions one engine step may compute while requests are streaming: their tokens "
                             "first, then prompt chunks; smaller keeps streams smooth while long prompts arrive "
                             f"(default: {DEFAULT_INTERLEAVE_TOKENS['cpu']} on a CPU, else "
                             f"{DEFAULT_INTERLEAVE_TOKENS['accelerator']})")
    parser.add_argument("--speculative-ngram", type=int, default=0, metavar="K",
                        help="speculative decoding by prompt lookup: up to K tokens a step proposed from the "
                             "request's own text and checked by the ring in one pass (the same tokens, fewer "
                             "trips round the ring where answers repeat their input; docs/speculative.md); "
                             "used while few requests run (default: 0, off)")
    parser.add_argument("--max-running", type=int, default=DEFAULT_MAX_RUNNING,
                        help="requests batched at once; more wait in a queue (default: %(default)d)")
    parser.add_argument("--no-prefix-cache", action="store_true",
                        help="do not reuse the KV cache of a prompt's start that an earlier request computed")
    parser.add_argument("--placement", choices=("compute", "memory"), default="compute",
                        help="split the layers by each node's measured speed (compute: the slowest stage as fast as "
                             "it can be) or by memory alone (memory); one node asking for memory makes the cluster "
                             "split by memory (default: %(default)s)")
    parser.add_argument("--parallel", choices=PARALLEL_MODES, default="auto",
                        help="tensor: nodes of one engine run every layer of a stage together, each a slice of it "
                             "(tensor parallelism: batch-1 decode up to N times faster over fast links; needs "
                             "every node to ask for it); pipeline: each node runs whole layers; auto: groups where "
                             "the measured speeds and links predict them 10%% faster than the pipeline "
                             "(default: %(default)s)")
    parser.add_argument("--remeasure", action="store_true",
                        help="measure this node's speed on the model again instead of reading it from the cache "
                             "in <home> (after a hardware or load change)")
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    args = parser.parse_args(argv)
    try:
        args.peers = parse_peers(args.peers)
    except ValueError as exc:
        parser.error(str(exc))
    if args.memory_gb is not None and args.memory_gb <= 0:
        parser.error("--memory-gb must be positive")
    if args.request_wait is not None and args.request_wait <= 0:
        parser.error("--request-wait must be positive")
    if not args.step_timeout > 0:  # also refuses nan
        parser.error("--step-timeout must be positive")
    if not args.peer_timeout > 0:
        parser.error("--peer-timeout must be positive")
    if args.api_key is not None and (not args.api_key.strip() or not args.api_key.isprintable()):
        parser.error("--api-key must be printable text, not empty")
    if args.kv_cache_gb is not None and not args.kv_cache_gb > 0:
        parser.error("--kv-cache-gb must be positive")
    if any(n is not None and n < 1 for n in (args.max_batch_tokens, args.interleave_tokens, args.max_running)):
        parser.error("--max-batch-tokens, --interleave-tokens and --max-running must be at least 1")
    if not 0 <= args.speculative_ngram <= MAX_DRAFT:
        parser.error(f"--speculative-ngram must be from 0 to {MAX_DRAFT}")
    return args


def _keep_alive(text: str) -> float:
    try:
        return parse_keep_alive(text, "--keep-alive")
    except ExoLikeError as e:
        raise argparse.ArgumentTypeError(e.message) from None


class NodeIdFilter(logging.Filter):
    """Stamps every record with the node id, so logs of several nodes on one machine stay apart."""

    def __init__(self, node_id: str):
        super().__init__()
        self.node_id = node_id

    def filter(self, record: logging.LogRecord) -> bool:
        record.node_id = self.node_id
        return True


class MalformedHttpFilter(logging.Filter):
    """aiohttp logs a request its HTTP parser rejects (a bad request line, URL or header) as an error with a
    traceback, though it answers 400 and nothing on this node failed: log one warning line instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            record.msg, record.args = "malformed HTTP request from %s, answered %d: %s", \
                (record.args[0] if record.args else "?", exc.code, _clip(" ".join(exc.message.split())))
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.exc_info = record.exc_text = None
        return True


def _clip(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def setup_logging(level: str, node_id: str) -> NodeIdFilter:
    handler = logging.StreamHandler()
    node_filter = NodeIdFilter(node_id)
    handler.addFilter(node_filter)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s [%(node_id)s] %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)  # one line per request is logged by the API
    logging.getLogger("aiohttp.server").addFilter(MalformedHttpFilter())
    logging.getLogger("httpx2").setLevel(logging.WARNING)  # huggingface_hub's client: one line per HTTP request
    hub_logger = logging.getLogger("huggingface_hub")  # its warnings get our format (and node id), not its own
    hub_logger.handlers.clear()
    hub_logger.propagate = True
    return node_filter


async def serve(node: Node, host: str, port: int, api_key: str | None = None) -> None:
    """Serve until SIGINT or SIGTERM, then stop accepting, let requests finish briefly, and shut down."""
    # handler_cancellation: a client that disconnects cancels its handler, which stops its generation.
    runner = web.AppRunner(create_app(node, api_key), handler_cancellation=True, shutdown_timeout=SHUTDOWN_TIMEOUT,
                           access_log=None)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound_port = runner.addresses[0][1] if runner.addresses else port
        await node.start(host, bound_port)
        log.info("serving the OpenAI API on http://%s:%d/v1 (model: %s)", host, bound_port,
                 ", ".join(model.model_id for model in node.lifecycle.served()) or "none")
        await stop.wait()
        node.stopping = True  # before the log line: from here on, new requests are refused (503 shutting_down)
        log.info("shutting down (press Ctrl-C again to stop at once)")
        loop.remove_signal_handler(signal.SIGINT)  # a second Ctrl-C interrupts the graceful shutdown
        for site in list(runner.sites):
            await site.stop()  # no new connections; open ones (running requests, peer links) carry on
        await finish_generations(runner.app)
    finally:
        await runner.cleanup()
        await node.close()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    faulthandler.enable()  # a native crash (an engine's abort, a segfault) leaves each thread's Python stack in the log
    home = (args.home or default_home()).expanduser()
    node_filter = setup_logging(args.log_level, "-")  # the node id is stamped once the node has claimed it
    limit_worker_spin()  # before anything imports torch: idle stages must not spin on the cores others need
    if args.no_downloads:
        refuse_downloads()  # before --model is resolved: it, too, may only come from the cache
    options = NodeOptions(home=home, engine=args.engine, device=args.device, dtype=args.dtype,
                          node_name=args.node_name, memory_gb=args.memory_gb, peers=args.peers,
                          mdns=not args.no_mdns, cluster_key=args.cluster_key or DEFAULT_CLUSTER_KEY, model=args.model,
                          hub_cache=args.hub_cache, request_wait=args.request_wait, step_timeout=args.step_timeout,
                          keep_alive=args.keep_alive,
                          peer_timeout=args.peer_timeout, kv_cache_gb=args.kv_cache_gb,
                          limits=SchedulerLimits(args.max_batch_tokens, args.max_running, not args.no_prefix_cache,
                                                 args.interleave_tokens, args.speculative_ngram),
                          placement=args.placement, remeasure=args.remeasure, parallel=args.parallel)
    try:
        node = Node(options)
        node_filter.node_id = node.node_id
        if args.model:
            node.resolve(args.model)  # fail fast on a bad --model, before joining anything
        else:
            log.warning("no --model given: the first request chooses the model")
    except ExoLikeError as e:
        log.error("cannot use model %r: %s", args.model, e.message)
        sys.exit(1)
    except (OSError, ValueError) as e:
        log.error("cannot use model %r: %s", args.model, e)
        sys.exit(1)
    keep_imports_out_of_collections()
    try:
        asyncio.run(serve(node, args.host, args.port, args.api_key))
    except KeyboardInterrupt:
        log.warning("interrupted during shutdown")
        sys.exit(130)
    except OSError as e:  # typically: the port is taken
        log.error("cannot serve on %s:%d: %s", args.host, args.port, e)
        sys.exit(1)
    finally:
        exit_soon()


def keep_imports_out_of_collections() -> None:
    """What is imported by now (torch's and the libraries' hundreds of thousands of objects) lives as long as the
    process. Frozen, the collector's full passes walk only what serving makes: each shard load runs one so that a
    replaced shard is freed at once (engines/base.py), and it took about half a second walking the imports."""
    gc.collect()
    gc.freeze()


def exit_soon() -> None:
    """The node has closed what it holds: what is left of exiting is the interpreter's last collections over every
    object torch made (about a second here). Frozen, the collector skips them, so a stopped node is gone at once."""
    logging.shutdown()
    gc.freeze()
