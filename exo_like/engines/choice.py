"""Which engine a node runs: the engines installed here, the automatic pick, and creating one by name.

Each engine's module is imported only when it is created (its framework is an optional extra), by name from
ENGINE_MODULES; the engines import base.py, never this module."""

from __future__ import annotations

import importlib
import importlib.util

from exo_like.engines.base import Engine, EngineUnavailableError

ENGINE_MODULES = {"torch": "exo_like.engines.torch.engine", "mlx": "exo_like.engines.mlx.engine"}


def engine_importable(name: str) -> bool:
    package = {"torch": "torch", "mlx": "mlx"}[name]
    return importlib.util.find_spec(package) is not None


def available_engines() -> list[str]:
    return [name for name in ENGINE_MODULES if engine_importable(name)]


def auto_engine_name() -> str:
    """MLX on Apple Silicon, else torch (CUDA or CPU), else MLX on CPU."""
    import platform
    import sys

    if sys.platform == "darwin" and platform.machine() == "arm64" and engine_importable("mlx"):
        return "mlx"
    if engine_importable("torch"):
        return "torch"
    if engine_importable("mlx"):
        return "mlx"
    raise EngineUnavailableError("no inference engine installed: install the 'torch' or 'mlx' extra")


def create_engine(name: str = "auto", device: str | None = None, dtype: str | None = None) -> Engine:
    if name == "auto":
        name = auto_engine_name()
    if name not in ENGINE_MODULES:
        raise EngineUnavailableError(f"unknown engine {name!r}; choose one of auto, {', '.join(ENGINE_MODULES)}")
    if not engine_importable(name):
        raise EngineUnavailableError(f"engine {name!r} is not installed on this node")
    module = importlib.import_module(ENGINE_MODULES[name])
    return module.ENGINE_CLASS(device=device, dtype=dtype)
