"""A GGUF model's tokenizer, rebuilt on the `tokenizers` library from the file's metadata.

A GGUF carries no tokenizer.json: it lists the vocabulary, merges, token kinds, special token ids and chat
template under llama.cpp's keys (`tokenizer.ggml.*`, `tokenizer.chat_template`). Two kinds of vocabulary are
rebuilt, as llama.cpp runs them:
- `gpt2`: byte-level BPE (Llama 3, Qwen2, SmolLM, ...). How text is split before merging is named by
  `tokenizer.ggml.pre`; the splits of the common families are here, and an unknown name falls back to GPT-2's
  (with a warning: digits or spaces may then tokenize differently from the original model).
- `llama`: SentencePiece BPE with byte fallback (Llama 2, Mistral, Phi-3, Gemma); merges are derived from the
  token scores when the file has none. A space is put before the text unless `tokenizer.ggml.add_space_prefix`
  says not (Gemma's files).
"""

from __future__ import annotations

import logging
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from exo_like.errors import UnsupportedModelError
from exo_like.models.tokenizer import ModelTokenizer

log = logging.getLogger(__name__)

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the regex that splits text before BPE (None: GPT-2's own, inside ByteLevel).
_SPLITS: dict[str, str | None] = {
    "default": None, "gpt-2": None, "gpt2": None,
    "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
_DIGIT_SPLIT = {"smollm"}  # GPT-2's split after every digit on its own (SmolLM's tokenizer.json)


def gguf_tokenizer(metadata: dict[str, Any], name: str) -> ModelTokenizer:
    kind = metadata.get("tokenizer.ggml.model")
    tokens: list[str] = list(metadata.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise UnsupportedModelError(f"{name} has no tokenizer in its metadata")
    if kind == "gpt2":
        tokenizer = _byte_level(tokens, metadata)
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
    elif kind == "llama":
        tokenizer = _sentencepiece(tokens, metadata)
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", True))
    else:
        raise UnsupportedModelError(f"{name}: GGUF tokenizer {kind!r} is not supported; supported: gpt2, llama")
    _add_special_tokens(tokenizer, tokens, metadata.get("tokenizer.ggml.token_type") or [])
    special = _special_tokens(tokens, metadata)
    bos = special.get("bos_token")
    if add_bos and bos is not None:
        bos_id = tokens.index(bos) if bos in tokens else None
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    return ModelTokenizer(tokenizer, special, metadata.get("tokenizer.chat_template"))


def _byte_level(tokens: list[str], metadata: dict[str, Any]) -> Tokenizer:
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges") or []]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in _SPLITS and pre not in _DIGIT_SPLIT:
        log.warning("GGUF pre-tokenizer %r is not known here: splitting text as GPT-2 does", pre)
    split = _SPLITS.get(pre)
    if split is not None:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre in _DIGIT_SPLIT:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece(tokens: list[str], metadata: dict[str, Any]) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    if metadata.get("tokenizer.ggml.merges"):
        merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    else:
        merges = _merges_from_scores(tokens, list(metadata.get("tokenizer.ggml.scores") or [0.0] * len(tokens)))
    unk = metadata.get("tokenizer.ggml.unknown_token_id")
    model = models.BPE(vocab=vocab, merges=merges, unk_token=tokens[unk] if unk is not None else None,
                       byte_fallback=True, fuse_unk=True)
    tokenizer = Tokenizer(model)
    prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first" if prefix else
                                                       "never", split=False)
    # The space put before the text is taken off again when decoding; none was put, none is taken.
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tokenizer


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges implied by the vocabulary: every token that splits into two tokens is a merge of
    them, and a token with a higher score is merged first."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found = []
    for token, score in zip(tokens, scores):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                found.append((-score, vocab[left], vocab[right], left, right))
    found.sort()
    return [(left, right) for _, _, _, left, right in found]


def _add_special_tokens(tokenizer: Tokenizer, tokens: list[str], token_types: list[int]) -> None:
    """Control tokens (`<|im_start|>`, ...) are matched whole and are special; user-defined ones are matched
    whole too (llama.cpp does), as plain text."""
    control = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, token_types) if k == CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, token_types) if k == USER_DEFINED]
    if control:
        tokenizer.add_special_tokens(control)
    if user:
        tokenizer.add_tokens(user)


def _special_tokens(tokens: list[str], metadata: dict[str, Any]) -> dict[str, str]:
    """bos/eos/unk/pad token texts, for chat templates."""
    keys = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
            "pad_token": "padding_token_id"}
    special = {}
    for name, key in keys.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            special[name] = tokens[int(token_id)]
    return special
