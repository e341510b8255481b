"""Drive engines the way the ring does, for engine-level tests: requests keep KV blocks from a private pool, and
each call is one engine step (of one request, or of several at once) through every shard of a chain, with hidden
states crossing each boundary as wire-encoded Activations. `engine_greedy`: a GGUF file's greedy tokens over a
chain of engines."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Union

import numpy as np

from exo_like.engines.activations import Activations
from exo_like.engines.base import Engine
from exo_like.engines.choice import create_engine
from exo_like.models.config import ModelArgs
from exo_like.models.gguf.file import open_gguf
from exo_like.models.shard import Shard
from exo_like.engines.work import BLOCK_SIZE, SampleSpec, SamplingParams, WorkItem, blocks_for, window_start
from exo_like.serving.kv_blocks import BlockPool

SPEC = SampleSpec(SamplingParams(temperature=0.0, seed=0), max_tokens=1 << 20, eos=(), prompt_len=1)

Inputs = Union[np.ndarray, Activations]
# One entry of a step: (request id, its new rows), optionally with False for "do not sample" (a prompt chunk
# that is not the prompt's last); or (WorkItem, rows): an item sent to the engines exactly as given and not
# tracked (e.g. an invalid one).
Entry = Union[tuple[str, Inputs], tuple[str, Inputs, bool], tuple[WorkItem, Inputs]]



def engine_greedy(path: Path, engines: list[str], prompt: list[int], n_tokens: int = 16,
                  args: ModelArgs | None = None, dtype: str | None = "float32") -> list[int]:
    """Greedy tokens of the GGUF file at `path`, its layers split evenly over a chain of the named engines."""
    args = args or ModelArgs.from_dict(open_gguf(path).config())
    n = args.num_hidden_layers
    bounds = [round(i * n / len(engines)) for i in range(len(engines) + 1)]
    chain = []
    for name, start, end in zip(engines, bounds, bounds[1:]):
        engine = create_engine(name, device="cpu", dtype=dtype)
        engine.load(path, args, Shard(path.name, start, end, n))
        chain.append(engine)
    driver = Driver(chain)
    tokens, inputs = [], np.array(prompt, dtype=np.int64)
    for _ in range(n_tokens):
        token = int(np.argmax(driver.forward("r", inputs)))
        tokens.append(token)
        inputs = np.array([token], dtype=np.int64)
    return tokens


class Driver:
    def __init__(self, engines: Sequence[Engine], n_blocks: int = 256, first_block: int = 0,
                 block_ids: Sequence[int] | None = None):
        """`first_block`: requests get blocks from that id on, so tables need not begin at slot 0.
        `block_ids`: the engines' id of the driver pool's i-th block (a permutation, e.g. reversed, so tables
        are not ascending).

        A model with sliding-window layers gets window tables as the scheduler hands them out: from a pool of
        their own (its ids in reverse, so they differ from the full tables'), only the blocks each request's window
        still reaches, the others given back to the pool as the request moves on and reused by the next."""
        self.engines = list(engines)
        self.window = self.engines[0].kv_window
        window_blocks = n_blocks // 2  # a window pool smaller than the other: tables must not mix them up
        for engine in self.engines:
            if engine.kv_size is None or engine.kv_size.blocks < n_blocks or \
                    (engine.kv_size.window_blocks or window_blocks) < window_blocks:
                engine.allocate_kv(n_blocks, window_blocks)
        self.n_blocks = n_blocks
        self.pool = BlockPool(n_blocks)
        if first_block:
            self.pool.allocate(first_block)
        self.block_ids = list(range(n_blocks)) if block_ids is None else list(block_ids)
        assert sorted(self.block_ids) == list(range(n_blocks)), "block_ids must permute the pool's ids"
        self.tables: dict[str, list[int]] = {}
        self.lengths: dict[str, int] = {}
        self.window_pool = BlockPool(window_blocks)
        self.window_tables: dict[str, tuple[int, list[int]]] = {}  # rid -> (first block, pool ids)

    def forward(self, rid: str, inputs: Inputs) -> np.ndarray | Activations:
        """One request's next positions; the last engine's output for them (logits [vocab] of the last
        position on a last shard, else hidden states)."""
        out = self.step([(rid, inputs)])
        return out[0] if isinstance(out, np.ndarray) else out

    def step(self, batch: Sequence[Entry]) -> np.ndarray | Activations:
        """Several requests' next positions in one step: on a last shard the logits [sampled entries, vocab],
        in entry order. A request's length only advances once every engine has run the step."""
        items = [entry[0] if isinstance(entry[0], WorkItem) else
                 self._item(entry[0], _rows(entry[1]), entry[2] if len(entry) > 2 else True) for entry in batch]
        parts = [entry[1] for entry in batch]
        x: Inputs
        if isinstance(parts[0], Activations):
            x = _join(parts)  # type: ignore[arg-type]
        else:
            x = np.concatenate([np.asarray(p) for p in parts])  # dtype kept: engines must check it themselves
        for engine in self.engines:
            x = engine.step(items, x)
            if isinstance(x, Activations):
                x = Activations.from_wire(x.to_wire())
        for entry, item in zip(batch, items):
            if not isinstance(entry[0], WorkItem):
                self.lengths[item.rid] = item.end
        return x

    def release(self, rid: str) -> None:
        self.pool.release(self.tables.pop(rid, []))
        self.window_pool.release(self.window_tables.pop(rid, (0, []))[1])
        self.lengths.pop(rid, None)

    def cached_length(self, rid: str) -> int:
        return self.lengths.get(rid, 0)

    def blocks(self, rid: str) -> tuple[int, ...]:
        """The request's block table as the engines see it."""
        return tuple(self.block_ids[b] for b in self.tables.get(rid, []))

    def _item(self, rid: str, count: int, sample: bool = True) -> WorkItem:
        start = self.lengths.get(rid, 0)
        table = self.tables.setdefault(rid, [])
        new = self.pool.allocate(blocks_for(start + count) - len(table))
        if new is None:
            raise RuntimeError("the test driver's KV pool is full")
        table += new
        item = WorkItem(rid, "test", start, count, self.blocks(rid), SPEC if sample else None)
        return item if self.window is None else self._windowed(item)

    def _windowed(self, item: WorkItem) -> WorkItem:
        """`item` with the sliding-window table: blocks its window no longer reaches go back to the pool."""
        first, table = self.window_tables.get(item.rid, (0, []))
        reach = window_start(item.start, self.window) // BLOCK_SIZE
        if reach > first:
            self.window_pool.release(table[:reach - first])
            table, first = table[reach - first:], reach
        new = self.window_pool.allocate(blocks_for(item.end) - first - len(table))
        if new is None:
            raise RuntimeError("the test driver's sliding-window pool is full")
        table = table + new
        self.window_tables[item.rid] = first, table
        ids = tuple(self.window_pool.n_blocks - 1 - b for b in table)
        return replace(item, window_blocks=ids, window_first=first)


def _rows(inputs: Inputs) -> int:
    return inputs.shape[0]


def _join(parts: Sequence[Activations]) -> Activations:
    rows = sum(p.shape[0] for p in parts)
    return Activations(parts[0].dtype, (rows, parts[0].shape[1]), b"".join(p.data for p in parts))


class Together:
    """What `generate_together` produced: each request's greedy tokens and the logits that picked them, and how
    mixed its steps were."""

    def __init__(self, rids: Sequence[str]):
        self.tokens: dict[str, list[int]] = {rid: [] for rid in rids}
        self.logits: dict[str, list[np.ndarray]] = {rid: [] for rid in rids}
        self.steps = 0
        self.mixed_steps = 0  # steps holding a decode token and a prompt chunk of requests at distinct lengths
        self.widest = 0  # most items in one step

    def stacked(self, rid: str) -> np.ndarray:
        return np.stack(self.logits[rid])


def generate_together(driver: Driver, prompts: dict[str, np.ndarray], n_tokens: int, chunk: int,
                      joins: dict[str, int] | None = None) -> Together:
    """Greedy continuations of several prompts, every active request in each engine step as a scheduler runs
    them: request `rid` joins at step `joins[rid]`, feeds its prompt `chunk` tokens a step (only the last chunk
    samples) and then decodes one token a step; once it has `n_tokens` tokens it leaves and frees its blocks.
    So steps mix prompt chunks and decode tokens of requests at different cached lengths."""
    joins = joins or {}
    fed = {rid: 0 for rid in prompts}
    out = Together(list(prompts))
    while any(len(out.tokens[rid]) < n_tokens for rid in prompts):
        batch: list[Entry] = []
        sampled: list[str] = []
        decoding: list[bool] = []
        for rid, prompt in prompts.items():
            if out.steps < joins.get(rid, 0) or len(out.tokens[rid]) == n_tokens:
                continue
            decoding.append(fed[rid] == len(prompt))
            if decoding[-1]:
                sample = True
                batch.append((rid, np.array([out.tokens[rid][-1]], dtype=np.int64)))
            else:
                piece = prompt[fed[rid]:fed[rid] + chunk]
                fed[rid] += len(piece)
                sample = fed[rid] == len(prompt)
                batch.append((rid, piece, sample))
            if sample:
                sampled.append(rid)
        if not batch:  # nobody has joined yet
            out.steps += 1
            continue
        lengths = {driver.cached_length(str(entry[0])) for entry in batch}
        out.mixed_steps += set(decoding) == {True, False} and len(lengths) == len(batch)
        out.widest = max(out.widest, len(batch))
        logits = driver.step(batch)
        assert isinstance(logits, np.ndarray) and logits.dtype == np.float32 and logits.shape[0] == len(sampled)
        for rid, row in zip(sampled, logits):
            out.logits[rid].append(row)
            out.tokens[rid].append(int(np.argmax(row)))
            if len(out.tokens[rid]) == n_tokens:
                driver.release(rid)
        out.steps += 1
    return out


INVALID_ITEMS = ("block past every pool", "block past a later shard's pool", "negative block", "too few blocks",
                 "positions past the context")


def invalid_item(kind: str, n_blocks: int, context: int) -> WorkItem:
    """An item no engine with a pool of `n_blocks` (the first shard's: twice that) and this context may run."""
    if kind == "block past every pool":
        return WorkItem("bad", "test", 0, 3, (8 * n_blocks,), SPEC)
    if kind == "block past a later shard's pool":  # the first shard's pool is larger: it runs, the second refuses
        return WorkItem("bad", "test", 0, 3, (n_blocks + 1,), SPEC)
    if kind == "negative block":
        return WorkItem("bad", "test", 0, 3, (-1,), SPEC)
    if kind == "too few blocks":
        return WorkItem("bad", "test", 0, BLOCK_SIZE + 2, (0,), SPEC)
    assert kind == "positions past the context", kind
    return WorkItem("bad", "test", context - 1, 3, (0,) * blocks_for(context + 2), SPEC)


def steps_meeting(driver: Driver, prompts: dict[str, np.ndarray], bad: WorkItem | None, fail_at: int = 4,
                  n_steps: int = 10) -> dict[str, list[np.ndarray]]:
    """Three requests a, b, c in shared steps, and their logits: step 0 holds a's whole prompt and b's first 9
    tokens (not sampled), step 1 b's rest; c joins at step 3 with its prompt in chunks of 2; every other item is
    its request's next greedy token. With `bad`, step `fail_at` first runs with `bad` among its items, which must
    raise InvalidRequestError and advance nothing, and then runs again without it, as the ring would."""
    from exo_like.errors import InvalidRequestError

    logits: dict[str, list[np.ndarray]] = {rid: [] for rid in "abc"}
    pending = {"b": [prompts["b"][9:]], "c": [prompts["c"][i:i + 2] for i in range(0, len(prompts["c"]), 2)]}
    batch: list[Entry] = [("a", prompts["a"]), ("b", prompts["b"][:9], False)]
    for step in range(n_steps):
        if bad is not None and step == fail_at:
            before = {rid: driver.cached_length(rid) for rid in logits}
            try:
                driver.step([batch[0], (bad, _rows_for(bad, batch[0][1])), *batch[1:]])
            except InvalidRequestError:
                pass
            else:
                raise AssertionError(f"a step with the invalid item {bad} ran")
            assert {rid: driver.cached_length(rid) for rid in logits} == before
        out = driver.step(batch)
        sampled = [str(entry[0]) for entry in batch if len(entry) == 2 or entry[2]]  # type: ignore[misc]
        assert isinstance(out, np.ndarray) and out.shape[0] == len(sampled)
        for rid, row in zip(sampled, out):
            logits[rid].append(row)
        batch = []
        for rid in logits:
            if rid == "c" and step + 1 < 3:
                continue
            if pending.get(rid):
                batch.append((rid, pending[rid].pop(0), not pending[rid]))
            elif logits[rid]:
                batch.append((rid, np.array([int(np.argmax(logits[rid][-1]))])))
    return logits


def _rows_for(item: WorkItem, like: Inputs) -> Inputs:
    """`item.count` rows of the kind `like` is: token ids, or hidden states."""
    if isinstance(like, Activations):
        width = like.shape[1]
        return Activations(like.dtype, (item.count, width), like.data[:len(like.data) // like.shape[0]] * item.count)
    return np.full(item.count, 7, dtype=np.int64)


SEGMENTS = 10  # teacher-forced passages run side by side, a row each per step: decode reads every weight once a
# step whatever its rows, so ten rows cost about what one does (and batched decode is how a node serves); 500
# predicted tokens take 50 steps


def teacher_forced(path: Path, dtype: str | None, tokens: list[int], engine_name: str = "torch"
                   ) -> tuple[np.ndarray, float]:
    """Each position's top-1 prediction and the perplexity of `tokens` through one engine, a token per step: the
    text cut into SEGMENTS passages, each its own request (its own context), decoded as one batch. `path`: a
    GGUF file."""
    args = ModelArgs.from_dict(open_gguf(path).config())
    engine = create_engine(engine_name, device="cpu", dtype=dtype)
    engine.load(path, args, Shard(path.name, 0, args.num_hidden_layers, args.num_hidden_layers))
    driver = Driver([engine], n_blocks=64)
    predicted = len(tokens) - 1
    assert predicted % SEGMENTS == 0, "every passage as long as the others: one batch of SEGMENTS rows a step"
    passages = [tokens[i * predicted // SEGMENTS:(i + 1) * predicted // SEGMENTS + 1] for i in range(SEGMENTS)]
    top, nll = np.zeros((SEGMENTS, predicted // SEGMENTS), np.int64), np.zeros((SEGMENTS, predicted // SEGMENTS))
    for position in range(predicted // SEGMENTS):
        logits = np.asarray(driver.step([(f"text{i}", np.array([passage[position]], dtype=np.int64))
                                         for i, passage in enumerate(passages)]), np.float64)
        shifted = logits - logits.max(axis=1, keepdims=True)
        targets = [passage[position + 1] for passage in passages]
        top[:, position] = np.argmax(logits, axis=1)
        nll[:, position] = np.log(np.exp(shifted).sum(axis=1)) - shifted[np.arange(SEGMENTS), targets]
    return top.reshape(-1), float(np.exp(nll.mean()))


def agrees_where_clear(engine: Engine, reference: Engine, prompt: Sequence[int], n_tokens: int) -> None:
    """`engine` (a quantized kernel, another summation order) against `reference` on the same CPU, both fed the
    reference's greedy tokens: where the reference's two best logits are further apart than twice the two engines'
    largest difference at that step, the engine picks the same token; and most steps are that clear. (Greedy
    equality itself would depend on how near the random model's ties are to each kernel's rounding.)"""
    logits = {}
    tokens: list[int] = []
    for name, each in (("reference", reference), ("engine", engine)):
        driver, inputs, rows = Driver([each]), np.asarray(prompt, dtype=np.int64), []
        for step in range(n_tokens):
            rows.append(np.asarray(driver.forward("r", inputs), np.float64))
            if name == "reference":
                tokens.append(int(np.argmax(rows[-1])))
            inputs = np.array([tokens[step]], dtype=np.int64)
        logits[name] = np.stack(rows)
    difference = np.abs(logits["engine"] - logits["reference"]).max(axis=1)
    top2 = np.sort(logits["reference"], axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2 * difference
    assert clear.sum() >= n_tokens // 2, (clear, difference)
    assert (logits["engine"].argmax(axis=1) == logits["reference"].argmax(axis=1))[clear].all()
