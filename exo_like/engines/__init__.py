"""Inference engines: one small interface (base.Engine), one implementation per framework."""

from exo_like.engines.base import Engine, EngineUnavailableError, available_engines, create_engine

__all__ = ["Engine", "EngineUnavailableError", "available_engines", "create_engine"]
