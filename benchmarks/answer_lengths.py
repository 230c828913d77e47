"""How long the sandbox model's answers to the shipped prompts are, and what share of
assistant turns each ``generate.sampling.max_tokens`` would cut off (``finish_reason:
length``) and at what cost in completion tokens.

Usage: ``.venv/bin/python benchmarks/answer_lengths.py [--records 20] [--max-tokens 1024]
[--provider moonshotai/int4] [--datasets chat,code] [--temperature 0.8] [--longest 12] [--dump turns.jsonl]``

Starts the sandbox in model mode and regenerates every assistant turn of the first
``--records`` records of each dataset in ``params.yaml`` the way ``generate`` does
(``prompts.skeleton``/``next_request``: system and user turns kept, earlier assistant turns
replaced by the regenerated replies; each request's seed ``Sampling.request_seed(record id,
turn)``), pinned to one provider that serves the reference weights, at params.yaml's
``generate.sampling`` except ``max_tokens``, which is ``--max-tokens`` (and the temperature,
with ``--temperature``). Records run
concurrently, their turns in order.

Prints per dataset and overall: turns; completion-token percentiles (nearest rank: the
smallest count at least p % of turns do not exceed) p50, p90, p95 and max; turns still
cut at ``--max-tokens``; and, per candidate ``max_tokens`` m, the share of turns cut at m
and the completion tokens generation would spend at m (sum of min(tokens, m), the proxy
for the sandbox's generation time); then the longest turns and the wall time.

The rule for "cut at m": a turn is cut iff its completion_tokens >= m (a turn that
finished ``length`` at ``--max-tokens`` has completion_tokens = ``--max-tokens`` >= m).
The sandbox samples each request with a generator seeded by the request alone, so the
first m tokens at ``max_tokens`` m are this reply's first m; it stops with ``length``
once m tokens are out without drawing the stop token after them, so a reply of exactly m
tokens is cut at m too. It is an estimate all the same: a later turn of a multi-turn
record would at m see the earlier replies cut at m, and the left-padded batch is not
bit-for-bit invariant to its company (two runs of the same seeded requests gave 69 of 73
turns the same text; a diverged turn changes the record's later turns too).

Cut shares for m <= ``--max-tokens`` need nothing above it: ``--max-tokens 512`` measures
the m <= 512 columns at half the cost of looping replies. ``--seed`` re-draws every turn
(the shipped seed's outcome is one draw; another seed shows how much of it is luck).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from quanthunt.gateway import Routing, chat_body
from quanthunt.params import Sampling, load_params
from quanthunt.prompts import PromptRecord, iter_prompts, next_request, skeleton
from quanthunt.sandbox.server import SandboxProcess

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-bench-answer-lengths"
CUTS = (48, 64, 96, 128, 192, 256, 384, 512)
PERCENTILES = (50, 90, 95)


@dataclass(frozen=True)
class TurnResult:
    dataset: str
    record_id: str
    turn: int
    turns: int
    completion_tokens: int
    finish_reason: str
    prompt: str
    """The last user message of the request (what this reply answers)."""
    reply: str


def nearest_rank(values: list[int], p: float) -> int:
    ordered = sorted(values)
    return ordered[max(math.ceil(p / 100 * len(ordered)), 1) - 1]


async def regenerate(
    client: httpx.AsyncClient, dataset: str, record: PromptRecord, model: str, sampling: Sampling, routing: Routing
) -> list[TurnResult]:
    results: list[TurnResult] = []
    replies: list[str] = []
    segments = skeleton(record)
    for turn in range(len(segments)):
        messages = [t.to_json() for t in next_request(record, replies)]
        body = chat_body(model=model, messages=messages, max_tokens=sampling.max_tokens, temperature=sampling.temperature,
                         top_p=sampling.top_p, seed=sampling.request_seed(record.id, turn), routing=routing)  # fmt: skip
        response = await client.post("/chat/completions", json=body)
        response.raise_for_status()
        reply = response.json()
        choice = reply["choices"][0]
        content = choice["message"]["content"] or ""
        prompt = next(t.content for t in reversed(segments[turn]) if t.role == "user")
        results.append(TurnResult(dataset, record.id, turn, len(segments), int(reply["usage"]["completion_tokens"]),
                                  str(choice["finish_reason"]), prompt, content))  # fmt: skip
        replies.append(content)
    return results


async def run_all(url: str, work: list[tuple[str, PromptRecord]], model: str, sampling: Sampling, tag: str) -> list[TurnResult]:
    routing = Routing.pinned(tag)
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=3600) as client:
        done = await asyncio.gather(*(regenerate(client, ds, record, model, sampling, routing) for ds, record in work))
    return [turn for record in done for turn in record]


def row(name: str, turns: list[TurnResult], cuts: tuple[int, ...]) -> tuple[str, str]:
    tokens = [t.completion_tokens for t in turns]
    still = sum(t.finish_reason == "length" for t in turns)
    shares = "".join(f"{100 * sum(n >= m for n in tokens) / len(tokens):>7.1f}" for m in cuts)
    pct = "".join(f"{nearest_rank(tokens, p):>6}" for p in PERCENTILES)
    lengths = f"{name:<14}{len(tokens):>6}{pct}{max(tokens):>6}{still:>8}   {shares}"
    spend = f"{name:<14}" + "".join(f"{sum(min(n, m) for n in tokens):>8}" for m in cuts) + f"{sum(tokens):>9}"
    return lengths, spend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=20, help="first N records of each dataset (generate.max_records)")
    parser.add_argument("--max-tokens", type=int, default=1024, help="max_tokens of the measuring requests")
    parser.add_argument("--provider", default="moonshotai/int4", help="endpoint tag (one serving the reference weights)")
    parser.add_argument("--params", type=Path, default=ROOT / "params.yaml", help="datasets, prompt paths, sampling")
    parser.add_argument("--datasets", help="comma-separated subset of params.yaml's datasets")
    parser.add_argument("--seed", type=int, help="generate.sampling.seed for the request seeds (default: params.yaml's)")
    parser.add_argument("--temperature", type=float, help="generate.sampling.temperature (default: params.yaml's)")
    parser.add_argument("--cuts", default=",".join(map(str, CUTS)), help="candidate max_tokens values")
    parser.add_argument("--longest", type=int, default=12, help="list this many longest turns")
    parser.add_argument("--dump", type=Path, help="write every turn (with its prompt and reply) here as JSON Lines")
    args = parser.parse_args()
    cuts = tuple(int(m) for m in args.cuts.split(","))

    params = load_params(args.params)
    s = params.generate.sampling
    seed = s.seed if args.seed is None else args.seed
    temperature = s.temperature if args.temperature is None else args.temperature
    sampling = Sampling(temperature=temperature, top_p=s.top_p, max_tokens=args.max_tokens, seed=seed)
    datasets = args.datasets.split(",") if args.datasets else list(params.datasets)
    work: list[tuple[str, PromptRecord]] = []
    for dataset in datasets:
        path = params.paths.prompt_file(args.params.parent, dataset)
        for index, record in enumerate(iter_prompts(path)):
            if index >= args.records:
                break
            work.append((dataset, record))
    print(f"{len(work)} records ({args.records} per dataset), model {params.survey.model} on {args.provider}; "
          f"temperature {temperature}, top_p {s.top_p}, seed {seed} (per request: Sampling.request_seed), "
          f"max_tokens {args.max_tokens}")  # fmt: skip

    t0 = time.perf_counter()
    with SandboxProcess(mode="model", roster=None, log_path=None) as sandbox:
        started = time.perf_counter() - t0
        t1 = time.perf_counter()
        turns = asyncio.run(run_all(sandbox.api_url, work, params.survey.model, sampling, args.provider))
        sampled = time.perf_counter() - t1
    if args.dump:
        with args.dump.open("w", encoding="utf-8") as out:
            for turn in turns:
                out.write(json.dumps(asdict(turn), ensure_ascii=False) + "\n")

    print(f"\nassistant turns and completion tokens at max_tokens {args.max_tokens}; "
          f"cut at m: % of turns with completion_tokens >= m")  # fmt: skip
    pct_head = "".join(f"{'p' + str(p):>6}" for p in PERCENTILES)
    print(f"{'dataset':<14}{'turns':>6}{pct_head}{'max':>6}{'length':>8}   " + "".join(f"{'m=' + str(m):>7}" for m in cuts))
    spend_rows = []
    for name in [*datasets, "all"]:
        subset = turns if name == "all" else [t for t in turns if t.dataset == name]
        lengths, spend = row(name, subset, cuts)
        print(lengths)
        spend_rows.append(spend)
    print(f"\ncompletion tokens generated at max_tokens m (sum of min(tokens, m)); last column: at {args.max_tokens}")
    print(f"{'dataset':<14}" + "".join(f"{'m=' + str(m):>8}" for m in cuts) + f"{'m=' + str(args.max_tokens):>9}")
    print("\n".join(spend_rows))

    if args.longest:
        print(f"\nthe {args.longest} longest turns (tokens, finish, dataset, id, turn k of n: the user message)")
        for t in sorted(turns, key=lambda t: -t.completion_tokens)[: args.longest]:
            prompt = " ".join(t.prompt.split())
            print(f"{t.completion_tokens:>5} {t.finish_reason:<7}{t.dataset:<13}{t.record_id:<20} {t.turn + 1}/{t.turns}: "
                  f"{prompt[:70] + ('...' if len(prompt) > 70 else '')}")  # fmt: skip
    print(f"\nwall time: {started:.1f} s sandbox start, {sampled:.1f} s sampling {len(turns)} turns "
          f"({sum(t.completion_tokens for t in turns) / sampled:.0f} completion tokens/s)")  # fmt: skip


if __name__ == "__main__":
    main()
