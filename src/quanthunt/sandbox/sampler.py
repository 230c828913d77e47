"""Batched sampling and teacher-forced scoring on a causal LM, with real logprobs.

``sample`` runs one static batch: prompts are left-padded, prefilled once, then decoded
with a KV cache until every row has stopped. Each row draws its randomness from its own
``torch.Generator`` seeded by the request, so a seeded request gives the same text
whatever else shares its batch. Reported logprobs are the model's raw distribution
(``log_softmax`` of the logits, before temperature and top-p), as vLLM reports them by
default; ``score`` computes the same quantity teacher-forced, so the two agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from quanthunt.sandbox.engine import SamplingRequest


@dataclass
class TokenLogprob:
    """A token with its logprob and the ``top`` most likely alternatives at its position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Sample:
    """What one request produced. ``text`` is cut before a matched stop string."""

    token_ids: list[int]
    logprobs: list[TokenLogprob]
    text: str
    finish_reason: str  # "stop" | "length"


def _top(logp: torch.Tensor, k: int) -> list[tuple[int, float]]:
    if k <= 0:
        return []
    values, indices = torch.topk(logp, k)
    return [(int(i), float(v)) for i, v in zip(indices.tolist(), values.tolist(), strict=True)]


def _draw(logits: torch.Tensor, request: SamplingRequest, generator: torch.Generator) -> int:
    """Inverse-CDF draw from softmax(logits / T) restricted to the top-p nucleus."""
    if request.temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.double() / request.temperature, dim=-1)
    u = float(torch.rand((), generator=generator, dtype=torch.float64))
    if request.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        keep = int(torch.searchsorted(cumulative, torch.tensor(request.top_p, dtype=torch.float64))) + 1
        nucleus = cumulative[:keep]
        index = int(torch.searchsorted(nucleus, torch.tensor(u * float(nucleus[-1]), dtype=torch.float64), right=True))
        return int(order[min(index, keep - 1)])
    cumulative = torch.cumsum(probs, dim=-1)
    index = int(torch.searchsorted(cumulative, torch.tensor(u * float(cumulative[-1]), dtype=torch.float64), right=True))
    return min(index, probs.shape[0] - 1)


class Sampler:
    """Samples and scores with one model (one precision) and its tokenizer."""

    def __init__(self, model: nn.Module, tokenizer: object, *, stop_token_ids: Sequence[int]) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.stop_token_ids = frozenset(stop_token_ids)
        self.pad_id = min(self.stop_token_ids) if self.stop_token_ids else 0

    def _decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))  # type: ignore[attr-defined]

    @torch.inference_mode()
    def sample(self, requests: Sequence[SamplingRequest]) -> list[Sample]:
        """Sample every request in one left-padded batch.

        Rows that stop leave the batch (their KV-cache rows are dropped), so a batch
        costs what its still-running rows cost.
        """
        from transformers import DynamicCache

        rows = len(requests)
        width = max(len(r.prompt_ids) for r in requests)
        step_ids = torch.full((rows, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((rows, width), dtype=torch.long)
        for i, request in enumerate(requests):
            n = len(request.prompt_ids)
            step_ids[i, width - n :] = torch.tensor(request.prompt_ids, dtype=torch.long)
            mask[i, width - n :] = 1
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        generators = [torch.Generator().manual_seed(r.seed) for r in requests]
        tokens: list[list[int]] = [[] for _ in requests]
        logprobs: list[list[TokenLogprob]] = [[] for _ in requests]
        texts: list[str | None] = [None for _ in requests]
        finish: list[str | None] = [None if r.max_tokens > 0 else "length" for r in requests]
        active = [i for i in range(rows) if finish[i] is None]
        if len(active) < rows:
            step_ids, mask, positions = step_ids[active], mask[active], positions[active]
        cache = DynamicCache()
        while active:
            logits = (
                self.model(
                    input_ids=step_ids,
                    attention_mask=mask,
                    position_ids=positions,
                    cache=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
                .logits[:, -1, :]
                .float()
            )
            logp = torch.log_softmax(logits, dim=-1)
            keep: list[int] = []
            next_tokens: list[int] = []
            for row, i in enumerate(active):
                request = requests[i]
                token = _draw(logits[row], request, generators[i])
                if token in self.stop_token_ids:
                    finish[i] = "stop"
                    continue
                tokens[i].append(token)
                logprobs[i].append(TokenLogprob(token, float(logp[row, token]), _top(logp[row], request.top_logprobs)))
                if request.stop:
                    text = self._decode(tokens[i])
                    at = min((text.find(s) for s in request.stop if s in text), default=-1)
                    if at >= 0:
                        texts[i], finish[i] = text[:at], "stop"
                        continue
                if len(tokens[i]) >= request.max_tokens:
                    finish[i] = "length"
                    continue
                keep.append(row)
                next_tokens.append(token)
            if not keep:
                break
            if len(keep) < len(active):
                index = torch.tensor(keep, dtype=torch.long)
                cache.batch_select_indices(index)
                mask, positions = mask[index], positions[index]
                active = [active[row] for row in keep]
            step_ids = torch.tensor(next_tokens, dtype=torch.long).unsqueeze(1)
            mask = torch.cat([mask, torch.ones((len(active), 1), dtype=torch.long)], dim=1)
            positions = positions[:, -1:] + 1
        results = []
        for i in range(rows):
            cut = texts[i]
            final = self._decode(tokens[i]) if cut is None else cut
            results.append(Sample(tokens[i], logprobs[i], final, finish[i] or "length"))
        return results

    @torch.inference_mode()
    def score(self, ids: Sequence[int], *, top_logprobs: int = 0) -> list[TokenLogprob | None]:
        """Teacher-forced logprob of every token given the ones before it.

        The first token has no context and scores ``None`` (as vLLM's ``echo`` does).
        """
        return self.score_many([(ids, top_logprobs)])[0]

    @torch.inference_mode()
    def score_many(self, jobs: Sequence[tuple[Sequence[int], int]]) -> list[list[TokenLogprob | None]]:
        """``score`` for several sequences in one right-padded forward pass (causal
        attention keeps padding from touching the real positions)."""
        width = max((len(ids) for ids, _ in jobs), default=0)
        if width == 0:
            return [[] for _ in jobs]
        input_ids = torch.full((len(jobs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(jobs), width), dtype=torch.long)
        for row, (ids, _) in enumerate(jobs):
            input_ids[row, : len(ids)] = torch.tensor(list(ids), dtype=torch.long)
            mask[row, : len(ids)] = 1
        logits = self.model(input_ids=input_ids, attention_mask=mask, use_cache=False).logits.float()
        results: list[list[TokenLogprob | None]] = []
        for row, (ids, top) in enumerate(jobs):
            if not ids:
                results.append([])
                continue
            logp = torch.log_softmax(logits[row, : len(ids) - 1], dim=-1)
            targets = torch.tensor(list(ids[1:]), dtype=torch.long)
            picked = logp.gather(1, targets[:, None]).squeeze(1).tolist()
            scored: list[TokenLogprob | None] = [None]
            scored += [
                TokenLogprob(int(t), float(lp), _top(logp[i], top)) for i, (t, lp) in enumerate(zip(ids[1:], picked, strict=True))
            ]
            results.append(scored)
        return results
