"""Tokenizer: HF-compatible chat templates and encoding, and the incremental detokenizer's no-loss guarantee."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers

from exo_like.errors import InvalidRequestError
from exo_like.models.demo import BOS, CHAT_TEMPLATE, EOT, build_tokenizer, write_tokenizer_files
from exo_like.models.tokenizer import IncrementalDetokenizer, ModelTokenizer

MESSAGES = [
    {"role": "system", "content": "  Be brief. "},
    {"role": "user", "content": "Hello 日本語 🙂 <b>&</b>"},
    {"role": "assistant", "content": "Hi!"},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer_files(path, build_tokenizer())
    return path


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> ModelTokenizer:
    return ModelTokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def test_chat_prompt_matches_transformers(tokenizer: ModelTokenizer, hf_tokenizer) -> None:
    expected = hf_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert tokenizer.render_chat(MESSAGES) == expected
    # The template writes BOS itself, so encoding must not add another one.
    expected_ids = hf_tokenizer(expected, add_special_tokens=False).input_ids
    assert tokenizer.encode_chat(MESSAGES) == expected_ids
    assert expected_ids.count(tokenizer.tokenizer.token_to_id(BOS)) == 1


def test_completion_prompt_gets_special_tokens_like_transformers(tokenizer: ModelTokenizer, hf_tokenizer) -> None:
    text = "Hello, world! café"
    assert tokenizer.encode(text, add_special_tokens=True) == hf_tokenizer(text).input_ids
    assert tokenizer.encode(text, add_special_tokens=True)[0] == tokenizer.tokenizer.token_to_id(BOS)


def test_template_list_form_and_added_token_dicts(model_dir: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json",):
        (tmp_path / name).write_bytes((model_dir / name).read_bytes())
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["bos_token"] = {"content": BOS, "lstrip": False, "normalized": False, "__type": "AddedToken"}
    config["eos_token"] = {"content": EOT, "lstrip": False}
    config["chat_template"] = [{"name": "tool_use", "template": "TOOLS"},
                               {"name": "default", "template": "{{ bos_token }}[{{ messages[0]['content'] }}]"
                                                               "{{ eos_token }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = ModelTokenizer.from_dir(tmp_path)
    assert tokenizer.render_chat([{"role": "user", "content": "x"}]) == f"{BOS}[x]{EOT}"


def test_chat_template_jinja_file_takes_precedence(model_dir: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((model_dir / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text("FILE:{{ messages | length }}")
    assert ModelTokenizer.from_dir(tmp_path).render_chat(MESSAGES) == "FILE:4"


def _with_template(tokenizer: ModelTokenizer, template: str) -> ModelTokenizer:
    return ModelTokenizer(tokenizer.tokenizer, tokenizer.special_tokens, template)


def test_template_environment_follows_hf_conventions(tokenizer: ModelTokenizer, hf_tokenizer) -> None:
    template = (
        "{% for m in messages %}\n"
        "    {% if loop.index > 2 %}{% break %}{% endif %}\n"
        "    {{ m | tojson }}\n"
        "{% endfor %}\n"
        "{% generation %}{{ add_generation_prompt }}{% endgeneration %}"
        "{{ strftime_now('%Y') | length }}"
    )
    ours = _with_template(tokenizer, template).render_chat(MESSAGES)
    theirs = hf_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True,
                                              chat_template=template)
    assert ours == theirs
    assert "<b>&</b>" in ours and "日本語" in ours  # tojson neither HTML-escapes nor ASCII-escapes
    assert ours.endswith("True4")


def test_raise_exception_is_a_client_error(tokenizer: ModelTokenizer) -> None:
    with pytest.raises(InvalidRequestError, match="Unknown role: robot"):
        tokenizer.render_chat([{"role": "robot", "content": "beep"}])


def test_template_is_sandboxed(tokenizer: ModelTokenizer) -> None:
    evil = _with_template(tokenizer, "{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(InvalidRequestError):
        evil.render_chat(MESSAGES)


def test_no_chat_template_is_a_clear_error(tokenizer: ModelTokenizer) -> None:
    with pytest.raises(InvalidRequestError, match="no chat template"):
        _with_template(tokenizer, None).render_chat(MESSAGES)  # type: ignore[arg-type]


def test_demo_template_is_the_one_written(tokenizer: ModelTokenizer) -> None:
    assert tokenizer.chat_template_source == CHAT_TEMPLATE


# --- incremental detokenizer ---------------------------------------------------------------------------------


def stream(tokenizer: ModelTokenizer, ids: list[int]) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.add(token) for token in ids]
    return deltas + [detokenizer.flush()]


def byte_token_ids(tokenizer: ModelTokenizer, data: bytes) -> list[int]:
    """One token per byte, using byte-level BPE's byte alphabet."""
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())
    # GPT-2's byte -> unicode table, as the ByteLevel pre-tokenizer uses it.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    assert set(table.values()) == set(alphabet)
    return [tokenizer.tokenizer.token_to_id(table[b]) for b in data]


def test_partial_utf8_is_held_back_until_complete(tokenizer: ModelTokenizer) -> None:
    ids = byte_token_ids(tokenizer, "a日🙂".encode())  # 1 + 3 + 4 bytes
    deltas = stream(tokenizer, ids)
    assert deltas == ["a", "", "", "日", "", "", "", "🙂", ""]


def test_incomplete_tail_is_flushed_not_lost(tokenizer: ModelTokenizer) -> None:
    ids = byte_token_ids(tokenizer, "x".encode() + "日".encode()[:2])
    deltas = stream(tokenizer, ids)
    assert deltas[:-1] == ["x", "", ""]
    assert "".join(deltas) == tokenizer.decode(ids) == "x\ufffd"


def assert_deltas_are_the_full_decode(tokenizer: ModelTokenizer, ids: list[int]) -> None:
    deltas = stream(tokenizer, ids)
    full = tokenizer.decode(ids)
    assert "".join(deltas) == full
    emitted = ""
    for delta in deltas[:-1]:
        emitted += delta
        assert full.startswith(emitted)  # nothing emitted is ever taken back


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=1023), max_size=40))
def test_deltas_concatenate_to_the_full_decode(ids: list[int]) -> None:
    assert_deltas_are_the_full_decode(_demo_tokenizer(), ids)


_CACHE: dict[str, ModelTokenizer] = {}


def _demo_tokenizer() -> ModelTokenizer:
    if "demo" not in _CACHE:
        _CACHE["demo"] = ModelTokenizer(build_tokenizer(), {"bos_token": BOS}, None)
    return _CACHE["demo"]


def _sentencepiece_style_tokenizer() -> ModelTokenizer:
    """Llama-2 style: '▁' for spaces, <0xNN> byte fallback, and a decoder that strips the leading space."""
    if "sp" not in _CACHE:
        vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
        for b in range(256):
            vocab[f"<0x{b:02X}>"] = len(vocab)
        for piece in ["▁", "▁hello", "▁world", "h", "e", "l", "o", "w", "r", "d", "▁a", "a", "!"]:
            vocab[piece] = len(vocab)
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
        tok.add_special_tokens(["<s>", "</s>"])
        _CACHE["sp"] = ModelTokenizer(tok, {"bos_token": "<s>"}, None)
    return _CACHE["sp"]


def test_sentencepiece_style_spaces_and_byte_fallback() -> None:
    tokenizer = _sentencepiece_style_tokenizer()
    ids = tokenizer.encode("hello world 日!", add_special_tokens=False)
    assert tokenizer.decode(ids) == "hello world 日!"
    deltas = stream(tokenizer, ids)
    assert "".join(deltas) == "hello world 日!"
    # The space before a word is kept although the decoder strips the leading space of what it decodes.
    assert any(delta.startswith(" ") for delta in deltas)
    # Three <0xNN> tokens become one character, emitted when the run ends; never a replacement character.
    assert "日!" in deltas
    assert not any("\ufffd" in delta for delta in deltas)


def test_byte_fallback_group_that_turns_invalid_is_not_emitted_early() -> None:
    """ByteFallback decodes a run of <0xNN> tokens together: a valid b"\\x00" becomes U+FFFD once an invalid
    byte follows it, so no byte of a run may be emitted before the run ends."""
    tokenizer = _sentencepiece_style_tokenizer()
    ids = [tokenizer.tokenizer.token_to_id(t) for t in ("<0x00>", "<0x80>", "a")]
    assert tokenizer.decode(ids[:1]) == "\x00"
    assert stream(tokenizer, ids) == ["", "", "\ufffd\ufffda", ""]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=271), max_size=30))
@example([3, 1, 131])  # <0x00> <s> <0x80>: the skipped special token does not end the byte run
def test_sentencepiece_style_deltas_concatenate_to_the_full_decode(ids: list[int]) -> None:
    assert_deltas_are_the_full_decode(_sentencepiece_style_tokenizer(), ids)


@pytest.mark.parametrize("prefix", [True, False])
def test_a_gguf_sentencepiece_vocabulary_puts_a_space_before_the_text_only_if_it_says_so(prefix: bool) -> None:
    """Llama 2's files put one (the default); Gemma's say `add_space_prefix: false`."""
    from exo_like.models.gguf.tokenizer import gguf_tokenizer

    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)],
              "\u2581", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "hell", "hello", "\u2581w", "\u2581wo",
              "\u2581wor", "\u2581worl", "\u2581world", "\u2581h", "\u2581he", "\u2581hell", "\u2581hello"]
    metadata = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
                "tokenizer.ggml.scores": [0.0] * 259 + [-float(len(t)) for t in tokens[259:]],
                "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * (len(tokens) - 259),
                "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.bos_token_id": 1,
                "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.add_bos_token": False,
                "tokenizer.ggml.add_space_prefix": prefix}
    tokenizer = gguf_tokenizer(metadata, "test.gguf")
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    assert [tokens[i] for i in ids] == (["\u2581hello", "\u2581world"] if prefix else ["hello", "\u2581world"])
    assert tokenizer.decode(ids) == "hello world"
