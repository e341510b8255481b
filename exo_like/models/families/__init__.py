"""Model families: what each architecture on the Hub is, in framework-free terms.

One module per family: how its `config.json` reads (the fields beyond the common ones), how its checkpoint names
its tensors when they differ from the shared names the engines use, and one line on what sets it apart. The
engines build every family from the parsed ModelArgs and shared blocks (attention, MLP, mixture of experts).

`family_for(model_type)` finds a family; an architecture outside the registry is refused by name."""

from exo_like.models.families.base import Family, MlaArgs, MoeArgs, Router
from exo_like.models.families.by_model_type import FAMILIES, family_for, supported_model_types

__all__ = ["FAMILIES", "Family", "MlaArgs", "MoeArgs", "Router", "family_for", "supported_model_types"]
