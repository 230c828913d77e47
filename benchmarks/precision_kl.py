"""How far each sandbox precision is from the reference, per token position.

Usage: ``.venv/bin/python benchmarks/precision_kl.py [--prompts 16] [--tokens 100]``

The reference samples ``--tokens`` tokens (T=1, seeded) for each of ``--prompts`` prompts;
every precision then scores the same sequences teacher-forced. Per completion position we
compute KL(reference || precision) over the full vocabulary, whether the top-1 token
agrees, and |Δ logprob| of the sampled token. The noise floor is the reference scored
in one left-padded batch vs one sequence at a time (fp32).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch

from quanthunt.sandbox.decoder import Decoder
from quanthunt.sandbox.engine import SamplingRequest
from quanthunt.sandbox.model import PrecisionStore, kv_format, load_reference
from quanthunt.sandbox.roster import PRECISIONS
from quanthunt.sandbox.sampler import Sampler

PROMPTS = [
    "Explain how a refrigerator keeps food cold.",
    "Write a short poem about autumn leaves.",
    "What are the main causes of inflation?",
    "Describe the water cycle to a ten-year-old.",
    "Give three tips for writing clean Python code.",
    "Why is the sky blue?",
    "Summarise the plot of Romeo and Juliet.",
    "How do vaccines train the immune system?",
    "What is the difference between a list and a tuple in Python?",
    "Tell me about the history of the printing press.",
    "How should I prepare for a job interview?",
    "Explain recursion with an example.",
    "What makes a good cup of coffee?",
    "Describe how photosynthesis works.",
    "What is a black hole?",
    "Write a friendly email declining a meeting.",
]
ORIENTATION = {"int4-bf16act": 1.2e-3, "int8": 3.7e-3, "nvfp4": 0.26, "mxfp4": 0.68}
"""Mean KL the issue reports from an earlier measurement on the same model (int4 at group 32: 0.45)."""


@torch.inference_mode()
def logprobs_of(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)


@torch.inference_mode()
def cached_logprobs(decoder: Decoder, ids: list[int]) -> torch.Tensor:
    """Teacher-forced through the serving forward pass (for a precision whose KV cache
    format transformers cannot express)."""
    logits, _ = decoder.extend([None], [ids])
    return torch.log_softmax(logits[0], dim=-1)


@torch.inference_mode()
def batched_logprobs(model: torch.nn.Module, seqs: list[list[int]], pad: int) -> list[torch.Tensor]:
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, seq in enumerate(seqs):
        ids[i, width - len(seq) :] = torch.tensor(seq)
        mask[i, width - len(seq) :] = 1
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
    return [torch.log_softmax(logits[i, width - len(seq) :], dim=-1) for i, seq in enumerate(seqs)]


def compare(ref: torch.Tensor, other: torch.Tensor, ids: list[int], start: int) -> tuple[list[float], list[bool], list[float]]:
    """Per completion position: KL(ref||other), top-1 agreement, |Δ logprob| of the next token."""
    p, q = ref[start - 1 : -1], other[start - 1 : -1]
    kl = (p.exp() * (p - q)).sum(-1).clamp(min=0).tolist()
    agree = (p.argmax(-1) == q.argmax(-1)).tolist()
    nxt = torch.tensor(ids[start:])
    delta = (p.gather(1, nxt[:, None]) - q.gather(1, nxt[:, None])).abs().squeeze(1).tolist()
    return kl, agree, delta


def pooled(parts: list[tuple[list[float], list[bool], list[float]]]) -> tuple[list[float], list[bool], list[float]]:
    kl, agree, delta = zip(*parts, strict=True)
    return list(itertools.chain(*kl)), list(itertools.chain(*agree)), list(itertools.chain(*delta))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)

    reference, tokenizer = load_reference()
    store = PrecisionStore(reference)
    sampler = Sampler(reference, tokenizer, stop_token_ids=[])  # no EOS stop: exactly --tokens each
    prompts = [(PROMPTS * 4)[i] for i in range(args.prompts)]
    prompt_ids = [
        list(
            tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_dict=True)[
                "input_ids"
            ]
        )
        for p in prompts
    ]
    t0 = time.perf_counter()
    samples = sampler.sample(
        [SamplingRequest(tuple(ids), args.tokens, temperature=1.0, seed=args.seed + i) for i, ids in enumerate(prompt_ids)]
    )
    seqs = [ids + s.token_ids for ids, s in zip(prompt_ids, samples, strict=True)]
    print(f"sampled {sum(len(s.token_ids) for s in samples)} positions from the reference in {time.perf_counter() - t0:.1f} s")

    ref_scores = [logprobs_of(reference, seq) for seq in seqs]
    rows: list[tuple[str, list[float], list[bool], list[float]]] = []
    batched = batched_logprobs(reference, seqs, pad=int(tokenizer.eos_token_id))
    floor = [compare(r, b, seq, len(p)) for r, b, seq, p in zip(ref_scores, batched, seqs, prompt_ids, strict=True)]
    rows.append(("fp32 batch vs single", *pooled(floor)))
    for precision in PRECISIONS[1:]:
        model = store.get(precision)
        fmt = kv_format(precision)
        decoder = Decoder(model, kv_format=fmt) if fmt else None
        parts = [
            compare(r, cached_logprobs(decoder, seq) if decoder else logprobs_of(model, seq), seq, len(p))
            for r, seq, p in zip(ref_scores, seqs, prompt_ids, strict=True)
        ]
        rows.append((precision, *pooled(parts)))

    header = ["precision", "positions", "mean KL", "p99 KL", "top-1 disagree", "mean |Δlogp|", "issue (mean KL)"]
    widths = [22, 10, 12, 10, 16, 14, 17]
    print("\n" + "".join(f"{h:<{w}}" if i == 0 else f"{h:>{w}}" for i, (h, w) in enumerate(zip(header, widths, strict=True))))
    for name, kl, agree, delta in rows:
        p99 = statistics.quantiles(kl, n=100)[98]
        note = f"{ORIENTATION[name]:.2g}" if name in ORIENTATION else ("7e-10" if name.startswith("fp32") else "")
        disagree = 100 * (1 - sum(agree) / len(agree))
        print(
            f"{name:<22}{len(kl):>10}{statistics.fmean(kl):>12.3g}{p99:>10.3g}{disagree:>15.1f}%{statistics.fmean(delta):>14.3g}{note:>17}"
        )


if __name__ == "__main__":
    main()
