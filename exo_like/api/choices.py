"""A request's `n` choices: `n` generations of one prompt. The first runs alone until its first token (its prompt's
keys and values are then in the prefix cache), then the others start and find the prompt there; their text
pieces are merged in the order they arrive. A request with n=1 is a set of one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing, suppress
from dataclasses import dataclass
from typing import Any

from exo_like.api.generation import Piece, TextGeneration, joined


@dataclass
class ChoiceSet:
    generations: list[TextGeneration]

    @property
    def request_id(self) -> str:
        return self.generations[0].request_id

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage: the prompt counted once (its keys and values are computed once), every choice's
        completion, and the prompt tokens the first choice found in the prefix cache (as OpenAI and vLLM report
        them; the other choices find the whole prompt there by design)."""
        prompt = len(self.generations[0].prompt_tokens)
        completion = sum(g.completion_tokens for g in self.generations)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": self.generations[0].cached_tokens},
                "completion_tokens_details": {"reasoning_tokens": sum(g.reasoning_tokens for g in self.generations)}}

    async def pieces(self) -> AsyncIterator[tuple[int, Piece | None]]:
        """(choice index, piece) as they come; (index, None) once that choice has ended (its finish_reason set).
        Whatever ends a choice with an error ends the set with it."""
        queue: asyncio.Queue[tuple[int, Piece | BaseException | None]] = asyncio.Queue()
        tasks = [asyncio.ensure_future(self._pump(0, queue))]

        async def start_the_others() -> None:
            await self.generations[0].first_token.wait()
            tasks.extend(asyncio.ensure_future(self._pump(i, queue)) for i in range(1, len(self.generations)))

        starter = asyncio.ensure_future(start_the_others())
        ended = 0
        try:
            while ended < len(self.generations):
                index, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                ended += item is None
                yield index, item
        finally:
            starter.cancel()
            for task in tasks:
                task.cancel()
            for task in [starter, *tasks]:
                with suppress(asyncio.CancelledError, Exception):
                    await task

    async def wholes(self) -> list[Piece]:
        """Each choice's whole text and tokens."""
        texts: list[list[Piece]] = [[] for _ in self.generations]
        async with aclosing(self.pieces()) as pieces:
            async for index, piece in pieces:
                if piece is not None:
                    texts[index].append(piece)
        return [joined(own) for own in texts]

    async def _pump(self, index: int, queue: asyncio.Queue) -> None:
        try:
            async with aclosing(self.generations[index].deltas()) as deltas:
                async for piece in deltas:
                    queue.put_nowait((index, piece))
            queue.put_nowait((index, None))
        except Exception as exc:  # noqa: BLE001 (raised again by pieces(), on the request's task)
            queue.put_nowait((index, exc))
        finally:
            self.generations[index].first_token.set()  # ended without a token: the others need not wait
