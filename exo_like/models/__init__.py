"""What a model is: its config, tokenizer, checkpoint tensors, quantized forms and per-layer bytes. `names/` turns a
name into a model (what a name says, the catalog, the node's registry, GET /v1/models); `families/` says what each
architecture is; `hub/` fetches Hugging Face repos shard-only; `gguf/` reads llama.cpp's single-file format.

May import: errors, meter; nothing above it."""
