"""bf16 compute in the sandbox (``int4-bf16act``, the faithful-on-other-hardware provider):
its matrix products as ``sandbox/decoder.py`` runs them (fp32 products of the exact bf16
values, rounded to bf16 once) beside torch's bf16 ``F.linear``, on the same decoder, in one run.

Usage: ``.venv/bin/python benchmarks/bf16_compute.py [--repeats 5]``

For each way: a prefill of 8 prompts of 96 tokens, then 32 decode steps of the 8 rows
(milliseconds, the median of ``--repeats``), and the largest difference between the two
ways' next-token logprobs over every step (the same tokens are fed to both). Prints the
machine's CPU flags that matter: without ``avx512_bf16``/``amx_bf16`` torch emulates bf16.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

from quanthunt.sandbox import decoder as decoder_module
from quanthunt.sandbox.decoder import Decoder
from quanthunt.sandbox.model import build_precision, load_reference

ROWS, PROMPT_TOKENS, STEPS = 8, 96, 32


@contextmanager
def torch_bf16_linear() -> Iterator[None]:
    """The decoder as it was: bf16 weights left as they are, products through ``F.linear``."""
    pack, linear = decoder_module.pack, decoder_module.linear

    def keep_bf16(weight: torch.Tensor) -> torch.Tensor:
        return weight.detach().contiguous() if weight.dtype == torch.bfloat16 else pack(weight)

    def plain(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight) if not weight.is_mkldnn else linear(x, weight)

    decoder_module.pack, decoder_module.linear = keep_bf16, plain  # type: ignore[assignment]
    try:
        yield
    finally:
        decoder_module.pack, decoder_module.linear = pack, linear  # type: ignore[assignment]


def run(decoder: Decoder, prompts: list[list[int]]) -> tuple[float, float, torch.Tensor]:
    """Prefill and decode ms, and every step's logprobs [STEPS + 1, ROWS, vocab]."""
    cache = decoder.new_cache()
    cache.reserve(ROWS, PROMPT_TOKENS + STEPS + 1)
    started = time.perf_counter()
    logits = decoder.prefill(cache, 0, prompts)
    prefilled = time.perf_counter()
    steps = [logits.log_softmax(-1)]
    lengths = torch.full((ROWS,), PROMPT_TOKENS, dtype=torch.long)
    for step in range(STEPS):
        tokens = torch.tensor([(7 * row + 13 * step) % 1000 + 100 for row in range(ROWS)])  # fixed, so both ways see the same
        logits = decoder.decode(cache, tokens, lengths)
        steps.append(logits.log_softmax(-1))
        lengths += 1
    done = time.perf_counter()
    return (prefilled - started) * 1e3, (done - prefilled) * 1e3, torch.stack(steps)


def measure(build: Callable[[], Decoder], prompts: list[list[int]], repeats: int) -> tuple[float, float, torch.Tensor]:
    decoder = build()
    run(decoder, prompts)  # warm-up
    results = [run(decoder, prompts) for _ in range(repeats)]
    return statistics.median(r[0] for r in results), statistics.median(r[1] for r in results), results[-1][2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    flags = Path("/proc/cpuinfo").read_text().split("flags")[1].split("\n")[0].split()
    bf16 = ", ".join(f for f in ("avx512_bf16", "amx_bf16") if f in flags) or "none"
    print(f"bf16 instructions: {bf16} | threads {torch.get_num_threads()}")
    reference, _ = load_reference()
    model = build_precision(reference, "int4-bf16act")
    prompts = [torch.randint(100, 40_000, (PROMPT_TOKENS,)).tolist() for _ in range(ROWS)]
    with torch.no_grad():
        ours = measure(lambda: Decoder(model), prompts, args.repeats)
        with torch_bf16_linear():
            torch_way = measure(lambda: Decoder(model), prompts, args.repeats)
    print(f"{'way':<34}{'prefill ms':>12}{'32 steps ms':>13}")
    print(f"{'torch bf16 F.linear (before)':<34}{torch_way[0]:>12.0f}{torch_way[1]:>13.0f}")
    print(f"{'fp32 products, rounded (now)':<34}{ours[0]:>12.0f}{ours[1]:>13.0f}")
    print(f"ratio (before / now): prefill {torch_way[0] / ours[0]:.2f}x, decode {torch_way[1] / ours[1]:.2f}x")
    with torch.no_grad():
        fp32 = run(Decoder(reference), prompts)[2]
    print("KL(fp32 || way) of each step's next-token distribution, nats (what verify's margins see):")
    for name, steps in (("torch bf16 F.linear (before)", torch_way[2]), ("fp32 products, rounded (now)", ours[2])):
        kl = kl_div(fp32, steps)
        print(f"  {name:<32} median {kl.median():.2e}  90th pct {kl.quantile(0.9):.2e}  max {kl.max():.2e}")
    between = kl_div(torch_way[2], ours[2])
    print(f"  {'before vs now':<32} median {between.median():.2e}  90th pct {between.quantile(0.9):.2e}  max {between.max():.2e}")


def kl_div(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per step and row, from logprobs [steps, rows, vocab]."""
    return (p_log.exp() * (p_log - q_log)).sum(-1).flatten()


if __name__ == "__main__":
    main()
