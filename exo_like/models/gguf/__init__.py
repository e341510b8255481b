"""GGUF files: header, tensor table and quantized blocks (file.py, header.py, blocks.py), the metadata in config
terms (metadata.py; DeepSeek's latent-attention layout: deepseek.py), tokenizer, which file of a repo a tag picks,
Range reads.

May import: models (config, checkpoint, footprint, affine, shard), models.hub (repo, sparse files), errors."""
