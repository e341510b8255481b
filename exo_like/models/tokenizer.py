"""Tokenizer of a Hugging Face model folder: encoding, chat templates and incremental decoding.

Follows Hugging Face's conventions so that token counts and prompts match `transformers` exactly:
- `tokenizer.json` is loaded with `tokenizers`; special tokens come from `tokenizer_config.json`.
- Chat templates are Jinja, rendered in a sandbox with trim_blocks/lstrip_blocks and HF's helpers
  (`raise_exception`, `strftime_now`, a `tojson` that does not HTML-escape).
- A rendered chat prompt already holds its special tokens (e.g. `{{ bos_token }}`), so it is encoded WITHOUT
  adding special tokens; a plain completion prompt is encoded WITH them (the post-processor adds BOS).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from exo_like.errors import InvalidRequestError, UnsupportedModelError

log = logging.getLogger(__name__)

# SentencePiece byte-fallback tokens, e.g. <0xE6>.
_BYTE_FALLBACK_TOKEN = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")

# Names HF passes to chat templates as the special-tokens map.
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant spans for HF's training masks; render the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes `<`, `>` and `&`, which changes prompts; HF replaces it with plain json.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _select_template(value: Any) -> str | None:
    """chat_template may be a string or a list of {name, template}; HF uses the one named 'default'."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {item.get("name"): item.get("template") for item in value if isinstance(item, dict)}
        return named.get("default")
    raise UnsupportedModelError(f"chat_template has unexpected type {type(value).__name__}")


def _find_chat_template(model_dir: Path, tokenizer_config: dict[str, Any]) -> str | None:
    """Newer checkpoints keep the template in its own file, which takes precedence (as in transformers)."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text()
    json_file = model_dir / "chat_template.json"
    if json_file.exists():
        return _select_template(json.loads(json_file.read_text()).get("chat_template"))
    return _select_template(tokenizer_config.get("chat_template"))


class ModelTokenizer:
    """Encoding, decoding and chat-template rendering for one model."""

    def __init__(self, tokenizer: Tokenizer, special_tokens: dict[str, str], chat_template: str | None):
        self.tokenizer = tokenizer
        self.special_tokens = special_tokens
        self.chat_template_source = chat_template
        self._template = compile_chat_template(chat_template) if chat_template else None
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        self.byte_fallback_ids = frozenset(i for t, i in vocab.items() if _BYTE_FALLBACK_TOKEN.match(t))
        self.special_ids = frozenset(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)

    @classmethod
    def from_dir(cls, model_dir: Path) -> "ModelTokenizer":
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise UnsupportedModelError(f"{model_dir} has no tokenizer.json (only fast tokenizers are supported)")
        tokenizer = Tokenizer.from_file(str(path))
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        special = {name: text for name in _SPECIAL_TOKEN_NAMES if (text := _token_text(config.get(name)))}
        template = _find_chat_template(model_dir, config)
        try:
            return cls(tokenizer, special, template)
        except jinja2.TemplateSyntaxError as e:
            raise UnsupportedModelError(f"the chat template of {model_dir} does not compile: {e}") from e

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None, switches: dict[str, Any] | None = None) -> str:
        """The prompt text for a conversation (offering `tools`, HF's function-tool objects; `switches`: the
        template's own variables a request sets, such as enable_thinking). A template's own complaints are the
        caller's fault: 400."""
        if self._template is None:
            raise InvalidRequestError(
                "this model has no chat template; use /v1/completions with a plain prompt", code="no_chat_template"
            )
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, tools=tools, documents=None,
                **{**self.special_tokens, **(switches or {})},
            )
        except jinja2.TemplateError as e:
            raise InvalidRequestError(f"the model's chat template rejected the messages: {e}",
                                      param="messages", code="chat_template_error") from e

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        return self.encode(self.render_chat(messages, tools=tools), add_special_tokens=False)

    def special_token_ids(self, texts: Iterable[str]) -> dict[str, int]:
        """Those of `texts` that are special tokens of this vocabulary, with their ids."""
        found = {text: self.tokenizer.token_to_id(text) for text in texts}
        return {text: token for text, token in found.items() if token is not None and token in self.special_ids}


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas, one token at a time.

    Byte-level BPE tokens can hold part of a UTF-8 character; decoding such a prefix yields U+FFFD. Text ending
    in U+FFFD is held back until a later token completes it (or until `flush`), so no delta ever has to be
    taken back. SentencePiece byte-fallback tokens (<0xNN>) are decoded a whole run at a time, and a run with
    an invalid byte turns entirely into U+FFFD, so a run is held back until a token of another kind ends it.

    Each step decodes a small window: a few already-emitted tokens (context, so decoders that strip a leading
    space see the same surroundings as a full decode) plus the new ones, and emits the part of the window's
    text beyond the context's text. Invariant: the concatenation of all deltas plus `flush()`
    equals `decode(all ids)`.
    """

    def __init__(self, tokenizer: ModelTokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # window start: tokens in [_prefix, _read) are context, already emitted
        self._read = 0  # tokens from here on have not been emitted yet

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        if self._skip_special and token_id in self._tokenizer.special_ids:
            return ""  # adds no text, and must not end a byte-fallback run the decoder will join across it
        context, text = self._window_texts()
        incomplete = text.endswith("\ufffd") or token_id in self._tokenizer.byte_fallback_ids
        if incomplete or len(text) <= len(context):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(context):]

    def flush(self) -> str:
        """Whatever is still held back (e.g. an incomplete UTF-8 sequence at the very end)."""
        context, text = self._window_texts()
        self._prefix = self._read = len(self._ids)
        return text[len(context):]

    def _window_texts(self) -> tuple[str, str]:
        decode = self._tokenizer.decode
        context = decode(self._ids[self._prefix:self._read], self._skip_special)
        text = decode(self._ids[self._prefix:], self._skip_special)
        return context, text
