"""A shard is the contiguous layer range [start_layer, end_layer) of one model that one stage runs; in a
tensor-parallel stage, one rank's slice of every layer of that range (`tp`)."""

from __future__ import annotations

from dataclasses import dataclass

from exo_like.models.tensor_split import TensorSplit


@dataclass(frozen=True)
class Shard:
    model_id: str
    start_layer: int
    end_layer: int
    n_layers: int
    tp: TensorSplit | None = None  # this rank's part of a tensor-parallel group; None: the whole layers

    def __post_init__(self) -> None:
        if not 0 <= self.start_layer < self.end_layer <= self.n_layers:
            raise ValueError(f"bad shard range [{self.start_layer}, {self.end_layer}) of {self.n_layers} layers")

    @classmethod
    def whole(cls, model_id: str, n_layers: int) -> "Shard":
        return cls(model_id, 0, n_layers, n_layers)

    @property
    def is_first(self) -> bool:
        """The first shard owns the token embedding (in a tensor-parallel stage, its leader does)."""
        return self.start_layer == 0 and (self.tp is None or self.tp.is_leader)

    @property
    def is_last(self) -> bool:
        """The last shard owns the final norm and the LM head, and its output is logits (in a tensor-parallel
        stage, its leader does)."""
        return self.end_layer == self.n_layers and (self.tp is None or self.tp.is_leader)

    @property
    def layer_count(self) -> int:
        return self.end_layer - self.start_layer

    def __str__(self) -> str:
        whole = f"{self.model_id}[{self.start_layer}:{self.end_layer}]/{self.n_layers}"
        return whole if self.tp is None else f"{whole} ({self.tp})"
