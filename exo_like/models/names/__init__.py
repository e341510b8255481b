"""From a model's name to the model: what a name says (name.py), the catalog of short names and packaged models
(catalog.py), resolving a name once into a LoadedModel (resolver.py), the node's cache of resolved models by every
name met (model_registry.py), and what GET /v1/models lists (listing.py).

May import: models (config, checkpoint, demo, footprint, parameters, shard, tensor_split, tokenizer), models.gguf,
models.hub, errors."""
