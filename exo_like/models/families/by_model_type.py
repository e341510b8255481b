"""model_type -> Family, for every family the engines run."""

from __future__ import annotations

from exo_like.errors import UnsupportedModelError
from exo_like.models.families.base import Family
from exo_like.models.families.deepseek import DEEPSEEK
from exo_like.models.families.gemma import GEMMA
from exo_like.models.families.gpt_oss import GPT_OSS
from exo_like.models.families.llama import LLAMA
from exo_like.models.families.mixtral import MIXTRAL
from exo_like.models.families.phi3 import PHI3
from exo_like.models.families.qwen_moe import QWEN_MOE

FAMILIES: tuple[Family, ...] = (LLAMA, QWEN_MOE, MIXTRAL, PHI3, GEMMA, GPT_OSS, DEEPSEEK)
_BY_MODEL_TYPE = {model_type: family for family in FAMILIES for model_type in family.model_types}


def supported_model_types() -> tuple[str, ...]:
    return tuple(_BY_MODEL_TYPE)


def family_for(model_type: str | None, architecture: str | None = None) -> Family:
    """The family of a model type; an unknown one is refused naming its architecture and what is supported."""
    family = _BY_MODEL_TYPE.get(model_type or "")
    if family is None:
        raise UnsupportedModelError(
            f"unsupported architecture {architecture or model_type!r} (model_type {model_type!r}); "
            f"supported model types: {', '.join(supported_model_types())}",
            code="unsupported_architecture",
        )
    return family
