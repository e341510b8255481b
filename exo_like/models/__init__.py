"""What a model is: its name and catalog entry, config, tokenizer, checkpoint tensors, quantized forms and per-layer
bytes. `hub/` fetches Hugging Face repos shard-only; `gguf/` reads llama.cpp's single-file format.

May import: errors, meter; nothing above it."""
