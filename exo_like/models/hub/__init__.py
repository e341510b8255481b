"""Models from the Hugging Face hub: repo manifests, shard-only downloads, progress, partly held (sparse) files.

May import: models (config, checkpoint, footprint, quantization, shard), models.gguf, errors, meter."""
