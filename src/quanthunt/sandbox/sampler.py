"""Sampling and teacher-forced scoring with real logprobs, batched continuously.

A ``Lane`` is one precision's running batch: requests join it (their prompts are prefilled
into free cache slots) and leave it (when they stop) between any two decode steps, so a
request never waits for another's whole completion. Each request draws its randomness from
its own ``torch.Generator`` seeded by the request, one uniform per sampled token, so a seeded
request gives the same text whatever else shares its steps (up to float rounding, which can
flip a near-tie: ``tests/sandbox/test_sampler.py`` measures it). Reported logprobs are the
model's raw distribution (``log_softmax`` of the logits, before temperature and top-p), as
vLLM reports them by default; ``Sampler.score`` computes the same quantity teacher-forced, so
the two agree.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from quanthunt.sandbox.decoder import Decoder, Past
from quanthunt.sandbox.engine import SamplingRequest


@dataclass
class TokenLogprob:
    """A token with its logprob and the ``top`` most likely alternatives at its position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Sample:
    """What one request produced. ``text`` is cut before a matched stop string; a stop token
    ends ``token_ids`` and ``logprobs`` but not the text (as vLLM answers)."""

    token_ids: list[int]
    logprobs: list[TokenLogprob]
    text: str
    finish_reason: str  # "stop" | "length"


def draw(logits: torch.Tensor, requests: Sequence[SamplingRequest], generators: Sequence[torch.Generator]) -> list[int]:
    """One token per row of ``logits`` [rows, vocab]: greedy where ``temperature == 0``, else
    an inverse-CDF draw (one fp64 uniform from the row's generator) from softmax(logits / T),
    restricted to the smallest top-p nucleus when ``top_p < 1``. All rows in fp64 together."""
    tokens = [0] * len(requests)
    greedy = [row for row, r in enumerate(requests) if r.temperature <= 0]
    if greedy:
        for row, token in zip(greedy, torch.argmax(logits[greedy], dim=-1).tolist(), strict=True):
            tokens[row] = int(token)
    for nucleus in (False, True):
        rows = [row for row, r in enumerate(requests) if r.temperature > 0 and (r.top_p < 1.0) == nucleus]
        if not rows:
            continue
        temperature = torch.tensor([requests[row].temperature for row in rows], dtype=torch.float64)
        probs = torch.softmax(logits[rows].double() / temperature[:, None], dim=-1)
        u = torch.stack([torch.rand((), generator=generators[row], dtype=torch.float64) for row in rows])
        if nucleus:
            probs, order = torch.sort(probs, dim=-1, descending=True)
        cumulative = torch.cumsum(probs, dim=-1)
        if nucleus:
            top_p = torch.tensor([[requests[row].top_p] for row in rows], dtype=torch.float64)
            last = torch.searchsorted(cumulative, top_p).clamp(max=probs.shape[1] - 1)
        else:
            last = torch.full((len(rows), 1), probs.shape[1] - 1, dtype=torch.long)
        target = u[:, None] * cumulative.gather(1, last)
        index = torch.minimum(torch.searchsorted(cumulative, target, right=True), last)
        picked = order.gather(1, index) if nucleus else index
        for row, token in zip(rows, picked[:, 0].tolist(), strict=True):
            tokens[row] = int(token)
    return tokens


PROCESSED_FLOOR = -9999.0
"""vLLM's floor for a reported logprob: a token the nucleus cut (``-inf``) is listed with it."""


def reported_logprobs(logits: torch.Tensor, requests: Sequence[SamplingRequest]) -> torch.Tensor:
    """The logprobs a reply reports for each row of ``logits`` [rows, vocab]: the model's raw
    ``log_softmax``, or for a request with ``processed_logprobs`` (and a temperature above 0)
    the distribution it was sampled from, after temperature and the top-p nucleus
    (renormalised; a cut token at ``PROCESSED_FLOOR``), as vLLM's ``processed_logprobs``."""
    logp = torch.log_softmax(logits, dim=-1)
    rows = [row for row, r in enumerate(requests) if r.processed_logprobs and r.temperature > 0]
    if not rows:
        return logp
    temperature = torch.tensor([requests[row].temperature for row in rows], dtype=logits.dtype)
    tempered = logits[rows] / temperature[:, None]
    top_p = torch.tensor([requests[row].top_p for row in rows], dtype=torch.float64)
    if bool((top_p < 1.0).any()):
        probs, order = torch.sort(torch.softmax(tempered.double(), dim=-1), dim=-1, descending=True)
        before = torch.cumsum(probs, dim=-1) - probs  # the mass ranked above each token
        cut = torch.zeros_like(probs, dtype=torch.bool)
        cut[:, 1:] = before[:, 1:] >= top_p[:, None]  # the nucleus keeps at least the top token
        tempered = tempered.masked_fill(torch.zeros_like(cut).scatter(1, order, cut), float("-inf"))
    logp[rows] = torch.log_softmax(tempered, dim=-1).clamp(min=PROCESSED_FLOOR)
    return logp


def _top(values: list[float], indices: list[int], k: int) -> list[tuple[int, float]]:
    return [(int(i), float(v)) for i, v in zip(indices[:k], values[:k], strict=True)]


@dataclass
class _Row:
    request: SamplingRequest
    done: Callable[[Sample], None]
    generator: torch.Generator
    length: int = 0
    """Positions of this row in the cache (the prompt and every token fed back so far)."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)


class Lane:
    """One precision's running batch (see the module docstring).

    Usage: ``lane.admit([(request, on_done)])`` then ``while lane.running: lane.step()``;
    ``on_done(sample)`` is called when a request stops.
    """

    def __init__(
        self, decoder: Decoder, decode_text: Callable[[list[int]], str], *, stop_token_ids: Sequence[int], max_batch: int
    ) -> None:
        self.decoder = decoder
        self._decode_text = decode_text
        self._stop_ids = frozenset(stop_token_ids)
        self.max_batch = max_batch
        self._cache = decoder.new_cache()
        self._rows: list[_Row] = []

    @property
    def running(self) -> int:
        return len(self._rows)

    @property
    def free(self) -> int:
        return self.max_batch - len(self._rows)

    def admit(self, jobs: Sequence[tuple[SamplingRequest, Callable[[Sample], None]]]) -> int:
        """Prefill ``jobs`` into free slots and draw their first tokens; the prompt tokens run."""
        new = [_Row(request, done, torch.Generator().manual_seed(request.seed)) for request, done in jobs]
        for row in [row for row in new if row.request.max_tokens <= 0]:
            row.done(Sample([], [], "", "length"))
        new = [row for row in new if row.request.max_tokens > 0]
        if not new:
            return 0
        first = len(self._rows)
        need = max(len(row.request.prompt_ids) + row.request.max_tokens for row in new)
        self._cache.reserve(first + len(new), min(need, self.decoder.context_length))
        logits = self.decoder.prefill(self._cache, first, [row.request.prompt_ids for row in new])
        for row in new:
            row.length = len(row.request.prompt_ids)
        self._rows.extend(new)
        self._advance(list(range(first, first + len(new))), logits)
        return sum(len(row.request.prompt_ids) for row in new)

    def step(self) -> int:
        """One decode step for every running row; the tokens it produced."""
        rows = len(self._rows)
        if not rows:
            return 0
        tokens = torch.tensor([row.tokens[-1] for row in self._rows], dtype=torch.long)
        lengths = torch.tensor([row.length for row in self._rows], dtype=torch.long)
        logits = self.decoder.decode(self._cache, tokens, lengths)
        for row in self._rows:
            row.length += 1
        self._advance(list(range(rows)), logits)
        return rows

    def _advance(self, indices: list[int], logits: torch.Tensor) -> None:
        """Draw the next token of the rows at ``indices`` (one logits row each), then retire
        the rows that stopped, keeping the running ones in the slots' prefix."""
        rows = [self._rows[i] for i in indices]
        requests = [row.request for row in rows]
        drawn = draw(logits, requests, [row.generator for row in rows])
        logp = reported_logprobs(logits, requests)
        picked = logp.gather(1, torch.tensor(drawn, dtype=torch.long)[:, None])[:, 0].tolist()
        k = max(r.top_logprobs for r in requests)
        top_values, top_indices = torch.topk(logp, k) if k > 0 else (logp[:, :0], logp[:, :0].long())
        values, ids = top_values.tolist(), top_indices.tolist()
        finished: list[tuple[int, Sample]] = []
        for n, (index, row, token) in enumerate(zip(indices, rows, drawn, strict=True)):
            sample = self._accept(row, token, picked[n], _top(values[n], ids[n], row.request.top_logprobs))
            if sample is not None:
                finished.append((index, sample))
        for index, sample in sorted(finished, key=lambda f: f[0], reverse=True):
            done = self._rows[index].done
            last = len(self._rows) - 1
            if index != last:  # the last running row takes the freed slot
                self._cache.move(last, index, self._rows[last].length)
                self._rows[index] = self._rows[last]
            self._rows.pop()
            done(sample)
        if not self._rows:
            self._cache.release()

    def _accept(self, row: _Row, token: int, logprob: float, top: list[tuple[int, float]]) -> Sample | None:
        """Add a drawn token to its row; the finished sample when the row stops."""
        request = row.request
        row.tokens.append(token)
        row.logprobs.append(TokenLogprob(token, logprob, top))
        if token in self._stop_ids and not request.ignore_eos:
            # kept with its logprob, counted, left out of the text: as vLLM 0.32 answers
            # (tests/contracts/replies/vllm/chat-stop.json)
            return Sample(row.tokens, row.logprobs, self._decode_text(row.tokens), "stop")
        if request.stop:
            text = self._decode_text(row.tokens)
            at = min((text.find(s) for s in request.stop if s in text), default=-1)
            if at >= 0:
                return Sample(row.tokens, row.logprobs, text[:at], "stop")
        if len(row.tokens) >= request.max_tokens or row.length + 1 >= self.decoder.context_length:
            return Sample(row.tokens, row.logprobs, self._decode_text(row.tokens), "length")
        return None


PREFIX_BLOCK = 8
"""Positions per block of ``ScoreCache``: a sequence reuses the longest run of whole blocks
it shares with one scored before (a default-roster probe prompt is ~46 tokens, 5 blocks)."""
SCORE_CACHE_BYTES = 512 * 2**20
"""Most bytes of keys and values a ``ScoreCache`` holds (SmolLM2: 46 KB a position in fp32,
so ~11,000 positions; an audit round's prompts take a few hundred)."""


@dataclass(frozen=True)
class _Block:
    """``PREFIX_BLOCK`` positions of a scored sequence: their keys and values ``[layers,
    kv_heads, PREFIX_BLOCK, head_dim]`` and their scores, all determined by the tokens up to
    the block's end; ``number`` names it as a parent in the cache's keys."""

    number: int
    keys: torch.Tensor
    values: torch.Tensor
    scored: list[TokenLogprob | None]


class ScoreCache:
    """Teacher-forced scores of sequence prefixes, kept so that sequences sharing a prefix
    compute it once: verify scores every completion of a probe as prompt + completion under
    the reference, so one prompt is scored by every provider's every completion (and all
    prompts share the chat template's system header). A block is found by its tokens and its
    parent block's number, so a hit is an exact match of the whole prefix, never a hash's.
    Least recently used blocks go first once ``budget`` bytes are held.

    The positions after a hit are computed with the past's keys and values as attention
    context instead of in one causal pass, which moves their logprobs by float rounding only
    (``tests/sandbox/test_sampler.py`` holds them to the uncached scores).
    """

    def __init__(self, budget: int = SCORE_CACHE_BYTES) -> None:
        self._blocks: OrderedDict[tuple[int, int, tuple[int, ...]], _Block] = OrderedDict()
        self._budget = budget
        self._bytes = 0
        self._numbers = itertools.count()

    @property
    def nbytes(self) -> int:
        return self._bytes

    def _key(self, top: int, parent: _Block | None, ids: Sequence[int], block: int) -> tuple[int, int, tuple[int, ...]]:
        return (top, -1 if parent is None else parent.number, tuple(ids[block * PREFIX_BLOCK : (block + 1) * PREFIX_BLOCK]))

    def lookup(self, ids: Sequence[int], top: int) -> list[_Block]:
        """The longest run of cached blocks that starts ``ids`` (scored with ``top`` alternatives)."""
        held: list[_Block] = []
        for block in range(len(ids) // PREFIX_BLOCK):
            key = self._key(top, held[-1] if held else None, ids, block)
            found = self._blocks.get(key)
            if found is None:
                break
            self._blocks.move_to_end(key)
            held.append(found)
        return held

    def cached_length(self, ids: Sequence[int], top: int) -> int:
        """Positions of ``ids`` that ``score_batch`` will not compute (0 without a hit)."""
        held = len(self.lookup(ids, top))
        return held * PREFIX_BLOCK - 1 if held else 0

    def first_missing(self, ids: Sequence[int], top: int) -> tuple[int, ...]:
        """The prefix up to the end of the first block of ``ids`` not cached (all of ``ids``
        when every whole block is): sequences that agree on it can share what one computes."""
        end = (len(self.lookup(ids, top)) + 1) * PREFIX_BLOCK
        return (top, *ids[:end])

    def store(self, ids: Sequence[int], top: int, held: list[_Block], past: Past, scored: list[TokenLogprob | None]) -> None:
        """Cache the whole blocks of ``ids`` after ``held``; ``past`` holds the keys and values
        of positions ``past_start .. len(ids) - 1`` (``past_start = len(ids) - past.length``)."""
        first = len(ids) - past.length
        parent = held[-1] if held else None
        for block in range(len(held), len(ids) // PREFIX_BLOCK):
            key = self._key(top, parent, ids, block)
            if (known := self._blocks.get(key)) is not None:
                parent = known
                continue
            start, end = block * PREFIX_BLOCK - first, (block + 1) * PREFIX_BLOCK - first
            keys, values = past.keys[:, :, start:end].clone(), past.values[:, :, start:end].clone()
            parent = _Block(next(self._numbers), keys, values, scored[block * PREFIX_BLOCK : (block + 1) * PREFIX_BLOCK])
            self._blocks[key] = parent
            self._bytes += keys.nbytes + values.nbytes
        while self._bytes > self._budget and self._blocks:
            _, evicted = self._blocks.popitem(last=False)
            self._bytes -= evicted.keys.nbytes + evicted.values.nbytes


def _context(held: list[_Block]) -> Past | None:
    """What ``held`` gives a sequence: the keys and values of every position but the last
    (whose logits score the next token, so it is computed again)."""
    if not held:
        return None
    length = len(held) * PREFIX_BLOCK - 1
    keys = torch.cat([block.keys for block in held], dim=2)[:, :, :length]
    values = torch.cat([block.values for block in held], dim=2)[:, :, :length]
    return Past(keys, values, length)


def score_batch(
    decoder: Decoder, jobs: Sequence[tuple[Sequence[int], int]], cache: ScoreCache | None = None
) -> list[list[TokenLogprob | None]]:
    """Teacher-forced logprob of every token of each sequence given the ones before it, with
    its ``top`` alternatives, all sequences in one right-padded forward pass (each from where
    ``cache`` leaves off, when given). The first token has no context and scores ``None`` (as
    vLLM's ``echo`` does)."""
    filled = [(ids, top) for ids, top in jobs if ids]
    if not filled:
        return [[] for _ in jobs]
    held = [cache.lookup(ids, top) if cache is not None else [] for ids, top in filled]
    past = [_context(blocks) for blocks in held]
    starts = [0 if p is None else p.length for p in past]
    logits, computed = decoder.extend(past, [ids[start:] for (ids, _), start in zip(filled, starts, strict=True)])
    scored_rows = iter(range(len(filled)))
    results: list[list[TokenLogprob | None]] = []
    for ids, top in jobs:
        if not ids:
            results.append([])
            continue
        row = next(scored_rows)
        start, blocks = starts[row], held[row]
        logp = torch.log_softmax(logits[row, : len(ids) - start - 1], dim=-1)
        targets = torch.tensor(list(ids[start + 1 :]), dtype=torch.long)
        picked = logp.gather(1, targets[:, None])[:, 0].tolist()
        values, indices = torch.topk(logp, top) if top > 0 else (logp[:, :0], logp[:, :0].long())
        top_values, top_ids = values.tolist(), indices.tolist()
        scored: list[TokenLogprob | None] = [s for block in blocks for s in block.scored] if blocks else [None]
        for i, (token, logprob) in enumerate(zip(ids[start + 1 :], picked, strict=True)):
            scored.append(TokenLogprob(int(token), logprob, _top(top_values[i], top_ids[i], top)))
        if cache is not None:
            width = len(ids) - start
            own = Past(computed.keys[:, row, :, :width], computed.values[:, row, :, :width], width)
            cache.store(ids, top, blocks, own, scored)
        results.append(scored)
    return results


class Sampler:
    """Samples and scores with one model (one precision) and its tokenizer, all requests of a
    call admitted together (benchmarks and tests; the server's engine feeds a ``Lane`` as
    requests arrive)."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: object,
        *,
        stop_token_ids: Sequence[int],
        kv_format: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.decoder = Decoder(model, kv_format=kv_format)
        self.tokenizer = tokenizer
        self.stop_token_ids = list(stop_token_ids)

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))  # type: ignore[attr-defined]

    @torch.inference_mode()
    def sample(self, requests: Sequence[SamplingRequest]) -> list[Sample]:
        """Sample every request; rows that stop leave the batch."""
        results: list[Sample | None] = [None] * len(requests)

        def keep(i: int) -> Callable[[Sample], None]:
            def done(sample: Sample) -> None:
                results[i] = sample

            return done

        lane = Lane(self.decoder, self._decode, stop_token_ids=self.stop_token_ids, max_batch=max(len(requests), 1))
        lane.admit([(request, keep(i)) for i, request in enumerate(requests)])
        while lane.running:
            lane.step()
        return [r for r in results if r is not None]

    @torch.inference_mode()
    def score(self, ids: Sequence[int], *, top_logprobs: int = 0) -> list[TokenLogprob | None]:
        """Teacher-forced logprob of every token given the ones before it (first: ``None``)."""
        return score_batch(self.decoder, [(ids, top_logprobs)])[0]

    @torch.inference_mode()
    def score_many(self, jobs: Sequence[tuple[Sequence[int], int]]) -> list[list[TokenLogprob | None]]:
        """``score`` for several sequences in one forward pass."""
        return score_batch(self.decoder, jobs)
