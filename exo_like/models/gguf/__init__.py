"""GGUF files: header, tensor table and quantized blocks, tokenizer, which file of a repo a tag picks, Range reads.

May import: models (config, checkpoint, footprint, affine, shard), models.hub (repo, sparse files), errors."""
