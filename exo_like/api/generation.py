"""One choice's text generation (TextGeneration): from a validated request's prompt tokens to its stream of text
pieces (Piece: text, reasoning, tool calls), with the checks before it starts (prompt token ids, max_tokens against
the context) and how a reasoning model's output is read (ReasoningPlan).

Shared by every dialect and by both response shapes (one JSON body, or a stream): the only difference between
streamed and non-streamed output is whether the pieces are sent as they come or joined.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Collection
from contextlib import aclosing
from dataclasses import dataclass, field, replace

from exo_like.api.reasoning import ReasoningFormat, split
from exo_like.api.requests import GenerationOptions
from exo_like.api.tool_calls import ToolCall, ToolFormat
from exo_like.errors import InvalidRequestError
from exo_like.models.tokenizer import IncrementalDetokenizer, ModelTokenizer
from exo_like.serving.generation import TokenGenerator
from exo_like.serving.sampling import Choice
from exo_like.serving.stop_strings import StopStringFilter


def completion_prompt_tokens(tokenizer: ModelTokenizer, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        tokens = tokenizer.encode(prompt, add_special_tokens=True)
        if not tokens:
            raise InvalidRequestError("the prompt is empty", param="prompt", code="empty_prompt")
        return tokens
    vocab = tokenizer.vocab_size
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab}); got {bad[0]}", param="prompt",
                                  code="invalid_value")
    return list(prompt)


def check_token_ids(vocab: int, options: GenerationOptions) -> None:
    """Token ids a request names (logit_bias) must be the model's: below `vocab`, the smaller of the tokenizer's
    and the model's logits (the sampler indexes the logits with them)."""
    bad = [token for token, _ in options.sampling.logit_bias if token >= vocab]
    if bad:
        raise InvalidRequestError(f"logit_bias token ids must be in [0, {vocab}); got {bad[0]}", param="logit_bias",
                                  code="invalid_value")


@dataclass(frozen=True)
class Piece:
    """A text delta and the tokens it came from since the previous one (with log-probabilities when asked), the
    tool calls completed since (when the request's tools are parsed; the text is then the content around them),
    and the reasoning since (a reasoning model's: the text is then the answer)."""

    text: str
    tokens: tuple[Choice, ...] = ()
    calls: tuple[ToolCall, ...] = ()
    reasoning: str = ""


@dataclass(frozen=True)
class ReasoningPlan:
    """How a request's output is read for reasoning: the model's format, whether the prompt opened the block, the
    budget of reasoning tokens (None: max_tokens alone), and the tokens of the text that closes it."""

    format: ReasoningFormat
    inside: bool
    budget: int | None
    close_tokens: tuple[int, ...]
    keep_special: bool  # the format's markers are special tokens the text must keep


def resolve_max_tokens(prompt_length: int, requested: int | None, context_length: int, prompt_param: str,
                       cap: bool = False) -> int:
    """How many tokens may be generated; the prompt plus the completion must fit in the context (with `cap`, a
    request for more gets what fits)."""
    if prompt_length >= context_length:
        raise InvalidRequestError(
            f"this model's maximum context length is {context_length} tokens, but the prompt has "
            f"{prompt_length} tokens", param=prompt_param, code="context_length_exceeded")
    room = context_length - prompt_length
    if requested is None or (cap and requested > room):
        return room
    if requested > room:
        raise InvalidRequestError(
            f"this model's maximum context length is {context_length} tokens, but you requested "
            f"{prompt_length + requested} tokens ({prompt_length} in the prompt, {requested} for the completion); "
            f"reduce the prompt or max_tokens", param="max_tokens", code="context_length_exceeded")
    return requested


@dataclass
class TextGeneration:
    """One request's generated text, delivered as deltas. After iterating: finish_reason and usage are set."""

    generator: TokenGenerator
    tokenizer: ModelTokenizer
    prompt_tokens: list[int]
    options: GenerationOptions
    max_tokens: int
    eos_ids: Collection[int]
    request_id: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (known with the first token)
    started: float = field(default_factory=time.monotonic)
    token_times: list[float] = field(default_factory=list)  # when each token arrived (monotonic), for /metrics
    recorded: bool = False  # counted in /metrics already
    first_token: asyncio.Event = field(default_factory=asyncio.Event)  # set once a token arrived, or it ended
    tool_format: ToolFormat | None = None  # set when the output is read for tool calls
    called: bool = False  # a tool call was made (finish_reason tool_calls)
    one_call: bool = False  # at most one call: the first ends the generation
    named_call: bool = False  # tool_choice named the tool: finish_reason stays "stop" (OpenAI's, vLLM's)
    stop_sequence: str | None = None  # the stop string that ended the text (finish_reason stop; None: EOS)
    reasoning: ReasoningPlan | None = None  # set when the output is read for reasoning
    reasoning_tokens: int = 0  # tokens generated inside the reasoning (what a budget counts)

    def __post_init__(self) -> None:
        self.request_id = self.request_id or uuid.uuid4().hex

    async def deltas(self) -> AsyncIterator[Piece]:
        """Pieces of text (content and tool calls when the output is read for them), non-empty unless they only
        bring tokens' log-probabilities. Iterate inside `aclosing` so an abandoned request frees its cache at once."""
        if self.tool_format is None:
            async with aclosing(self._text_deltas()) as pieces:
                async for piece in pieces:
                    yield piece
            return
        parser = self.tool_format.parser()
        held: list[Choice] = []  # tokens of text the parser holds back (a possible call's beginning)
        async with aclosing(self._text_deltas()) as pieces:
            async for piece in pieces:
                held.extend(piece.tokens)
                events = parser.feed(piece.text)
                ended = self.one_call and _cut_after_first_call(events)
                if (out := self._parsed(events, held, piece.reasoning)) is not None:
                    yield out
                if ended:  # (closing `pieces` ends the request's generation)
                    self.finish_reason = "stop"
                    break
            else:
                if (out := self._parsed(parser.flush(), held)) is not None:
                    yield out
        if self.called and self.finish_reason == "stop" and not self.named_call:
            self.finish_reason = "tool_calls"

    def _parsed(self, events: list[str | ToolCall], held: list[Choice], reasoning: str = "") -> Piece | None:
        """One piece of what the parser gave back (None when it gave nothing), with the tokens held so far and the
        reasoning that came with the text."""
        text = "".join(e for e in events if isinstance(e, str))
        calls = tuple(e for e in events if isinstance(e, ToolCall))
        if not text and not calls and not reasoning and not (held and self.options.sampling.logprobs is not None):
            return None
        self.called = self.called or bool(calls)
        tokens = tuple(held)
        held.clear()
        return Piece(text, tokens, calls, reasoning)

    async def _text_deltas(self) -> AsyncIterator[Piece]:
        """The generated text as pieces (answer and reasoning apart for a reasoning model). A reasoning budget spent
        ends the generation there, closes the reasoning with the format's own marker, and goes on with the answer
        in a second generation (its prompt: the first's, what was generated, the marker; the prefix cache holds
        most of it)."""
        consumed: list[Choice] = []  # tokens since the last piece
        reasoner = self.reasoning.format.parser(self.reasoning.inside) if self.reasoning else None

        def piece(text: str) -> Piece:
            taken = tuple(consumed)
            consumed.clear()
            if reasoner is None:
                return Piece(text, taken)
            answer, thought = split(reasoner.feed(text))
            return Piece(answer, taken, reasoning=thought)

        wants_logprobs = self.options.sampling.logprobs is not None
        keep_special = (self.tool_format is not None and not self.tool_format.skip_special_tokens) or \
            (self.reasoning is not None and self.reasoning.keep_special)
        detokenizer = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=not keep_special)
        stops = StopStringFilter(self.options.stop)
        eos = () if self.options.ignore_eos else self.eos_ids
        generated: list[int] = []
        budget = self.reasoning.budget if self.reasoning else None
        for segment in itertools.count():
            tokens = self.generator.generate(self.request_id if segment == 0 else f"{self.request_id}-{segment}",
                                             self.prompt_tokens + generated, self.options.sampling,
                                             self.max_tokens - len(generated), eos)
            spent = False  # the reasoning budget ran out: the reasoning is closed and the answer follows
            async with aclosing(tokens):
                async for choice in tokens:
                    self._arrived()
                    token = choice.token
                    self.completion_tokens += 1
                    generated.append(token)
                    if token in eos:  # the EOS token counts as generated but is not part of the text
                        self.finish_reason = "stop"
                        break
                    consumed.append(choice)
                    thinking = reasoner is not None and reasoner.thinking
                    self.reasoning_tokens += thinking
                    text = stops.feed(detokenizer.add(token))
                    if text:
                        yield piece(text)
                    if stops.stopped:
                        self.finish_reason = "stop"
                        self.stop_sequence = stops.matched
                        if consumed and wants_logprobs:
                            yield piece("")
                        return
                    spent = reasoner is not None and reasoner.thinking and budget is not None and \
                        self.reasoning_tokens >= budget
                    if spent:
                        break
            if not spent:
                break
            assert self.reasoning is not None
            closing = list(self.reasoning.close_tokens)[:self.max_tokens - len(generated)]
            generated += closing
            self.completion_tokens += len(closing)
            yield piece("".join(detokenizer.add(token) for token in closing))
            if len(generated) >= self.max_tokens:
                break
        # Out of tokens (EOS or max_tokens): release what the detokenizer and the stop filter held back.
        tail = stops.feed(detokenizer.flush())
        tail += stops.flush()
        if stops.stopped:
            self.finish_reason = "stop"
            self.stop_sequence = stops.matched
        self.finish_reason = self.finish_reason or "length"
        last = piece(tail)
        if reasoner is not None:
            answer, thought = split(reasoner.flush())
            last = replace(last, text=last.text + answer, reasoning=last.reasoning + thought)
        if last.text or last.reasoning or (last.tokens and wants_logprobs):
            yield last

    def _arrived(self) -> None:
        """A token came (when, for /metrics); the first one tells how much of the prompt the prefix cache held."""
        if not self.first_token.is_set():
            self.cached_tokens = self.generator.cached_tokens(self.request_id)
        self.first_token.set()
        self.token_times.append(time.monotonic())

    async def whole(self) -> Piece:
        """All the text, every token it came from, and every call."""
        async with aclosing(self.deltas()) as deltas:
            return joined([piece async for piece in deltas])


def _cut_after_first_call(events: list[str | ToolCall]) -> bool:
    """Drop what follows the first call among `events`; whether there was one."""
    first = next((i for i, event in enumerate(events) if isinstance(event, ToolCall)), None)
    if first is not None:
        del events[first + 1:]
    return first is not None


def joined(pieces: list[Piece]) -> Piece:
    return Piece("".join(p.text for p in pieces), tuple(t for p in pieces for t in p.tokens),
                 tuple(c for p in pieces for c in p.calls), "".join(p.reasoning for p in pieces))
