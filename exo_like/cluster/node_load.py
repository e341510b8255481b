"""What a node is doing right now, shared in its plan announcements so every node's dashboard shows the same
numbers for every member."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from exo_like.models.hub.progress import DownloadStatus


@dataclass(frozen=True)
class NodeLoad:
    tokens_per_second: float = 0.0  # generated tokens that recently passed through this node's layers
    generated_per_second: float = 0.0  # tokens recently streamed to this node's own clients
    in_flight: int = 0  # requests this node's API is serving
    busy: bool = False  # its layers hold at least one request
    download: DownloadStatus | None = None  # the download of its layers' weight files, if it had one
    step_seconds: float = 0.0  # how long its engine has been inside the step it is running (0: idle)
    # Median time its layers took per generated token over its recent decode steps (sampling included on the
    # last stage), None before its first: which node a ring's tokens spend their time on.
    decode_step_ms: float | None = None
    # KV cache: blocks of this node's pool, and blocks the ring's requests and prefix cache hold (as the first
    # stage counts them; every stage holds the same block ids).
    kv_blocks: int = 0
    kv_used: int = 0
    kv_window_blocks: int = 0  # blocks of its sliding-window layers' pool (0: it holds none)
    # The first stage's scheduler: requests batched and queued, and prompt tokens found in the prefix cache.
    running: int = 0
    waiting: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0  # requests the first stage put back to wait (their KV blocks went to others)
    # Speculative decoding (the first stage's): tokens proposed for verification since start, those kept, and the
    # verification steps (a pass yields 1 + accepted / drafts tokens on average).
    draft_tokens: int = 0
    accepted_tokens: int = 0
    drafts: int = 0
    # Of a quantized model: its layers' matrices run quantized (by stored type), and those its engine has no
    # kernel for, dequantized (by "type (reason)"): engines/base.WeightForms.
    quantized_weights: dict[str, int] = field(default_factory=dict)
    dequantized_weights: dict[str, int] = field(default_factory=dict)
    # How its engine computes where the CPU decides (engines/base.Engine.numerics): why two nodes' results differ.
    numerics: dict[str, str] = field(default_factory=dict)
    # Requests of this node's clients resumed on a re-formed ring since start, and those paused for it now (by the
    # name of the node whose loss broke their ring; "" when a re-plan did).
    replays: int = 0
    recovering: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        load = {"tokens_per_second": round(self.tokens_per_second, 2),
                "generated_per_second": round(self.generated_per_second, 2),
                "in_flight": self.in_flight, "busy": self.busy, "step_seconds": round(self.step_seconds, 1),
                "decode_step_ms": None if self.decode_step_ms is None else round(self.decode_step_ms, 2),
                "kv_blocks": self.kv_blocks, "kv_used": self.kv_used, "kv_window_blocks": self.kv_window_blocks,
                "running": self.running, "waiting": self.waiting,
                "prefix_queries": self.prefix_queries, "prefix_hits": self.prefix_hits,
                "preemptions": self.preemptions, "draft_tokens": self.draft_tokens,
                "accepted_tokens": self.accepted_tokens, "drafts": self.drafts,
                "quantized_weights": dict(self.quantized_weights),
                "dequantized_weights": dict(self.dequantized_weights), "numerics": dict(self.numerics),
                "replays": self.replays,
                "recovering": dict(self.recovering)}
        if self.download is not None:  # only nodes that fetched layers from the hub say anything about it
            load["download"] = self.download.to_json()
        return load

    @classmethod
    def from_json(cls, data: Any) -> "NodeLoad":
        """Tolerant: a peer of an older version announces no load at all."""
        if not isinstance(data, dict):
            return cls()
        decode_step_ms = data.get("decode_step_ms")
        counts = {key: int(data.get(key, 0)) for key in _COUNTS}
        forms = {key: {str(k): int(v) for k, v in (data.get(key) or {}).items()} for key in _FORMS}
        numerics = {str(k): str(v) for k, v in (data.get("numerics") or {}).items()}
        return cls(float(data.get("tokens_per_second", 0.0)), float(data.get("generated_per_second", 0.0)),
                   int(data.get("in_flight", 0)), bool(data.get("busy", False)),
                   DownloadStatus.from_json(data.get("download")), float(data.get("step_seconds", 0.0)),
                   None if decode_step_ms is None else float(decode_step_ms), **counts, **forms,
                   numerics=numerics)


_FORMS = ("quantized_weights", "dequantized_weights", "recovering")
_COUNTS = ("kv_blocks", "kv_used", "kv_window_blocks", "running", "waiting", "prefix_queries", "prefix_hits",
           "preemptions", "draft_tokens", "accepted_tokens", "drafts", "replays")
