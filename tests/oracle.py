"""Hugging Face transformers as the oracle: its tokenizer for prompts and usage, its greedy `generate` for outputs."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import torch


class Oracle:
    def __init__(self, model_dir: Path):
        from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

        # Not AutoTokenizer: for model_type qwen2, transformers 5 rebuilds Qwen2's own pre-tokenizer and ignores
        # the one in tokenizer.json (identical for real Qwen checkpoints, not for these synthetic ones).
        self.tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.eos_ids = set(self.model.generation_config.eos_token_id)
        self.generate = cache(self._generate)

    def chat_ids(self, content: str) -> tuple[int, ...]:
        text = self.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                  add_generation_prompt=True)
        return tuple(self.tokenizer(text, add_special_tokens=False).input_ids)

    def completion_ids(self, prompt: str) -> tuple[int, ...]:
        return tuple(self.tokenizer(prompt).input_ids)

    def _generate(self, prompt_ids: tuple[int, ...], max_new_tokens: int) -> list[int]:
        inputs = torch.tensor([prompt_ids])
        with torch.no_grad():
            out = self.model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=max_new_tokens,
                                      do_sample=False, pad_token_id=0)
        return out[0, len(prompt_ids):].tolist()

    def expected(self, prompt_ids: tuple[int, ...], max_new_tokens: int) -> tuple[str, str, int]:
        """(text, finish_reason, completion_tokens) as the API must report them; EOS is counted, not shown."""
        tokens = self.generate(prompt_ids, max_new_tokens)
        if tokens and tokens[-1] in self.eos_ids:
            return self.decode(tokens[:-1]), "stop", len(tokens)
        return self.decode(tokens), "length", len(tokens)

    def expected_batch(self, prompts_ids: Sequence[tuple[int, ...]],
                       max_new_tokens: Sequence[int]) -> list[tuple[str, str, int]]:
        """expected() for each prompt with its own max_new_tokens, from one batched greedy `generate` (left-padded:
        the attention mask hides each row's padding and generate positions each row from its first real token, so
        every row is computed as if alone; rows stop at their first end-of-sequence token or their own limit,
        greedy being causal). Several times faster than a `generate` a prompt: the small test models' forward costs
        little more for 64 rows than for one."""
        width = max(map(len, prompts_ids))
        inputs = torch.tensor([[0] * (width - len(ids)) + list(ids) for ids in prompts_ids])
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts_ids])
        with torch.no_grad():
            out = self.model.generate(inputs, attention_mask=mask, max_new_tokens=max(max_new_tokens),
                                      do_sample=False, pad_token_id=0)
        results = []
        for row, limit in zip(out[:, width:].tolist(), max_new_tokens):
            tokens = row[:limit]
            stop = next((i for i, token in enumerate(tokens) if token in self.eos_ids), None)
            if stop is not None:  # the row's EOS (generate pads a finished row after it)
                results.append((self.decode(tokens[:stop]), "stop", stop + 1))
            else:
                results.append((self.decode(tokens), "length", len(tokens)))
        return results

    def ignoring_eos(self, prompt_ids: tuple[int, ...], max_new_tokens: int) -> str:
        """The text of exactly `max_new_tokens` greedy tokens, generated past any end-of-sequence token (the API's
        `ignore_eos`), special tokens not shown."""
        inputs = torch.tensor([prompt_ids])
        with torch.no_grad():
            out = self.model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=max_new_tokens,
                                      min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                                      eos_token_id=None)
        return self.decode(out[0, len(prompt_ids):].tolist())

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def splits_a_character(self, tokens: list[int]) -> bool:
        """Whether decoding some prefix gives text that is not a prefix of the whole (partial UTF-8)."""
        full = self.decode(tokens)
        return any(not full.startswith(self.decode(tokens[:k])) for k in range(1, len(tokens)))


def gguf_greedy(path: Path, prompt: list[int], n_tokens: int = 16, stop_at_eos: bool = False,
                config_dir: Path | None = None) -> list[int]:
    """transformers' greedy tokens from a GGUF file (it dequantizes to float32); all `n_tokens` unless
    `stop_at_eos` (then up to and including the model's first end-of-sequence token).

    `config_dir`: a Hugging Face folder whose config.json to use instead of the one transformers makes from the
    file's metadata. Its GGUF loader ignores llama.cpp's `rope_freqs` tensor (how the converter stores Llama
    3.1's llama3 rope scaling) and runs such a file with unscaled rope; the checkpoint's own config has it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = {"config": AutoConfig.from_pretrained(config_dir)} if config_dir is not None else {}
    with gguf_reads_memoized():
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32, **config)
    inputs = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=n_tokens,
                             do_sample=False, min_new_tokens=0 if stop_at_eos else n_tokens, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@contextmanager
def gguf_reads_memoized() -> Iterator[None]:
    """While transformers loads a GGUF file, the `gguf` package's reader made once per file and its tensor-name map
    once per architecture: transformers' loader opens the file twice (for the config, then for the tensors; for
    SmolLM2 each parse of its 49k-token vocabulary takes seconds) and builds the name map anew for every module
    (about 400 for SmolLM2). The same objects, read the same way: only the repeats are saved."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple, object] = {}

    def memoized_reader(*args: object, **kwargs: object) -> object:
        key = (*map(str, args), *sorted(kwargs.items()))
        if key not in readers:
            readers[key] = reader(*args, **kwargs)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = memoized_reader, cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def gguf_dequantized_greedy(path: Path, config_dir: Path, prompt: list[int], n_tokens: int) -> list[int]:
    """transformers' greedy tokens from the values a GGUF file holds, for architectures its GGUF loader cannot read
    (Mixtral's experts in a `llama` file; Qwen2-MoE's shared-expert gate as llama.cpp's converter writes it): every
    tensor read and dequantized with gguf's own reader, put back under its Hugging Face name (experts unstacked,
    llama's rotary rows un-permuted, the inverse of tests/gguf_checkpoints.py, which mirrors llama.cpp's converter)
    and run with the checkpoint's config."""
    import tempfile

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from tests.gguf_checkpoints import hf_tensors_from_gguf

    with tempfile.TemporaryDirectory() as folder:
        for name in ("config.json", "generation_config.json"):
            (Path(folder) / name).write_bytes((config_dir / name).read_bytes())
        save_file(hf_tensors_from_gguf(path, config_dir), str(Path(folder) / "model.safetensors"))
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    inputs = torch.tensor([prompt])
    with torch.no_grad():
        # No end-of-sequence token: all n tokens, none suppressed (the engines' greedy tokens are compared as is).
        out = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=n_tokens,
                             min_new_tokens=n_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()
