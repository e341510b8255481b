"""Inference engines: one small interface (base.Engine), one implementation per framework (torch/, mlx/) and the
pick of one (choice.create_engine), the work items a step runs, activations and one-layer timing.

May import: models, errors."""

from exo_like.engines.base import Engine, EngineUnavailableError
from exo_like.engines.choice import available_engines, create_engine

__all__ = ["Engine", "EngineUnavailableError", "available_engines", "create_engine"]
