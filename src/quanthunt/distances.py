"""How far the tokens a provider serves are from the reference's: the two distribution
distances of precision verification.

* **Logprob mode**: :func:`kl_topk_with_tail` compares the two sides' top-k next-token
  distributions at one position (approximate KL divergence, in nats).
* **Sample mode**: :func:`mmd_hamming_test` is the kernel two-sample test on the token
  sequences themselves (Gao, Liang & Guestrin, "Model Equality Testing: Which Model Is This
  API Serving?", ICLR 2025), permuting within prompt; :func:`hamming_kernel_matrix` is its
  kernel, for inspection.

Conventions (those of :mod:`quanthunt.stats`, whose input checks and permutation p-value
this module shares): every function is pure, and the permutation test takes a
``numpy.random.Generator`` so that a seed reproduces it exactly. Invalid input (empty or NaN
top-k dicts, negative token ids, too few samples, labels that do not match the samples)
raises ``ValueError``. The permutation p-value is ``(b + 1) / (m + 1)``: never 0, and exact
under exchangeability within prompt. Probabilities are floored at :data:`PROB_FLOOR`, so a
KL divergence is always finite.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TypeVar

import numpy as np

from quanthunt.stats import (
    PERMUTATION_BATCH_CELLS,
    FloatArray,
    IntArray,
    Labels,
    PermutationTest,
    label_codes,
    label_list,
    permutation_pvalue,
)

__all__ = ["PROB_FLOOR", "hamming_kernel_matrix", "kl_topk_with_tail", "mmd_hamming_test"]

TokenT = TypeVar("TokenT", str, int)
"""Token keys of a top-logprob dict: token strings or token ids (both dicts use the same kind)."""

PROB_FLOOR = 1e-12
"""Smallest probability :func:`kl_topk_with_tail` uses (clipping floor and tail-bucket floor)."""


# --------------------------------------------------------------------------------------------
# MMD with a Hamming kernel (Gao, Liang & Guestrin, ICLR 2025)
# --------------------------------------------------------------------------------------------


def _hamming_block(seqs: Sequence[Sequence[int]]) -> FloatArray:
    """Position-wise match counts ``K[a, b] = #{i < min(len_a, len_b): s_a[i] == s_b[i]}``."""
    n = len(seqs)
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    width = int(lengths.max()) if n else 0
    tokens = np.full((n, width), -1, dtype=np.int64)
    for i, s in enumerate(seqs):
        if len(s):
            tokens[i, : len(s)] = np.asarray(s, dtype=np.int64)
    if (tokens[np.arange(width)[None, :] < lengths[:, None]] < 0).any():
        raise ValueError("token ids must be non-negative integers")
    # Padding is -1 and real tokens are ≥ 0, so a pad never matches a token; pad–pad matches are
    # removed by requiring position i to be valid in the first sequence.
    valid = np.arange(width)[None, :] < lengths[:, None]
    kernel = np.zeros((n, n))
    chunk = max(1, (1 << 24) // max(1, n * n))
    for start in range(0, width, chunk):
        sl = slice(start, start + chunk)
        eq = (tokens[:, None, sl] == tokens[None, :, sl]) & valid[:, None, sl]
        kernel += eq.sum(axis=2)
    return kernel


def _prompt_blocks(samples: Sequence[Sequence[int]], prompts: Labels) -> tuple[list[IntArray], list[FloatArray]]:
    codes, k = label_codes(prompts, "prompts")
    if codes.size != len(samples):
        raise ValueError(f"{codes.size} prompt labels for {len(samples)} samples")
    members = [np.flatnonzero(codes == c) for c in range(k)]
    return members, [_hamming_block([samples[int(i)] for i in idx]) for idx in members]


def hamming_kernel_matrix(samples: Sequence[Sequence[int]], prompts: Labels) -> FloatArray:
    """The full kernel matrix :func:`mmd_hamming_test` uses, for inspection.

    ``K[a, b] = 0`` if the prompts differ, else the number of positions ``i < min(len_a, len_b)``
    with equal token ids (longer tails are ignored).

    Usage: ``hamming_kernel_matrix([[1, 2, 3], [1, 5]], ["p", "p"])  # -> [[3, 1], [1, 2]]``
    """
    members, blocks = _prompt_blocks(samples, prompts)
    kernel = np.zeros((len(samples), len(samples)))
    for idx, block in zip(members, blocks, strict=True):
        kernel[np.ix_(idx, idx)] = block
    return kernel


def mmd_hamming_test(
    samples_x: Sequence[Sequence[int]],
    samples_y: Sequence[Sequence[int]],
    prompts_x: Labels,
    prompts_y: Labels,
    *,
    n_permutations: int = 1000,
    rng: np.random.Generator,
) -> PermutationTest:
    """MMD two-sample test with a Hamming kernel on (prompt, completion) pairs (Gao et al., ICLR 2025).

    Kernel: ``k((a, s), (b, t)) = 1[a == b] · #{i < min(len s, len t): s[i] == t[i]}`` — token-id
    sequences are compared position by position and the longer sequence's tail is ignored (the
    paper pads to a fixed length instead, which also counts agreement on where completions end;
    here a length difference only shows up through fewer comparable positions). The statistic is
    the unbiased U-statistic

        MMD²_u = Σ_{i≠j∈X} k / (n(n−1)) + Σ_{i≠j∈Y} k / (m(m−1)) − 2 Σ_{i∈X, j∈Y} k / (nm),

    in units of matching positions. The kernel is computed once (one block per prompt; entries
    across prompts are zero); each permutation reshuffles the x/y labels *within* each prompt,
    keeping per-prompt counts, so the test is valid when prompts are sampled unequally. One-sided
    (large MMD² = different distributions); p-value ``(b + 1) / (m + 1)``. Needs ≥ 2 samples per side.

    Power comes only from prompts with several completions on at least one side: because the kernel
    is zero across prompts, a design with exactly one x and one y completion per prompt leaves the
    statistic permutation-invariant (p = 1). Sample several completions per prompt (sample mode).

    Usage: ``mmd_hamming_test(provider_ids, reference_ids, provider_prompts, reference_prompts, rng=rng).pvalue``
    """
    if n_permutations < 1:
        raise ValueError(f"n_permutations must be ≥ 1, got {n_permutations}")
    n, m = len(samples_x), len(samples_y)
    if n < 2 or m < 2:
        raise ValueError(f"mmd_hamming_test needs at least 2 samples per side, got {n} and {m}")
    if len(prompts_x) != n or len(prompts_y) != m:
        raise ValueError("prompts_x / prompts_y must have one label per sample")
    members, blocks = _prompt_blocks([*samples_x, *samples_y], [*label_list(prompts_x), *label_list(prompts_y)])
    for block in blocks:
        np.fill_diagonal(block, 0.0)
    rowsums = [block.sum(axis=1) for block in blocks]
    total = float(sum(r.sum() for r in rowsums))

    def mmd2(labels: Sequence[FloatArray]) -> FloatArray:
        """MMD²_u for a batch of label matrices (one (rows, n_b) 0/1 matrix per prompt block)."""
        sxx = sum((((lab @ block) * lab).sum(axis=1) for lab, block in zip(labels, blocks, strict=True)), np.zeros(1))
        lr = sum((lab @ r for lab, r in zip(labels, rowsums, strict=True)), np.zeros(1))
        sxy = lr - sxx
        syy = total - sxx - 2.0 * sxy
        return np.asarray(sxx / (n * (n - 1)) + syy / (m * (m - 1)) - 2.0 * sxy / (n * m), dtype=np.float64)

    observed_labels = [(idx < n).astype(np.float64)[None, :] for idx in members]
    observed = float(mmd2(observed_labels)[0])
    null_parts = []
    n_total = n + m
    batch = max(1, PERMUTATION_BATCH_CELLS // n_total)
    for start in range(0, n_permutations, batch):
        rows = min(batch, n_permutations - start)
        labels = []
        for obs in observed_labels:
            size, n_x = obs.shape[1], int(obs.sum())
            if n_x in (0, size):
                labels.append(np.repeat(obs, rows, axis=0))
                continue
            lab = np.zeros((rows, size))
            np.put_along_axis(lab, np.argsort(rng.random((rows, size)), axis=1)[:, :n_x], 1.0, axis=1)
            labels.append(lab)
        null_parts.append(mmd2(labels))
    null = np.concatenate(null_parts)
    tol = 1e-9 * max(1.0, abs(observed))
    return PermutationTest(observed, permutation_pvalue(null, observed, "greater", tol), n_permutations)


# --------------------------------------------------------------------------------------------
# KL divergence between top-k logprob distributions
# --------------------------------------------------------------------------------------------


def _fill_distribution(top: Mapping[TokenT, float], union: list[TokenT], name: str) -> FloatArray:
    """One side on ``union`` + tail bucket: filled, floored, clipped and renormalised (see :func:`kl_topk_with_tail`)."""
    if not top:
        raise ValueError(f"{name} must list at least one token")
    listed = np.array([math.exp(lp) for lp in top.values()])
    if np.isnan(listed).any():
        raise ValueError(f"{name} contains NaN logprobs")
    missing = [tok for tok in union if tok not in top]
    fill = 0.0
    if missing:
        leftover = max(0.0, 1.0 - float(listed.sum()))
        fill = min(float(listed.min()), leftover / len(missing))
    probs = np.array([math.exp(top[tok]) if tok in top else fill for tok in union])
    tail = max(PROB_FLOOR, 1.0 - float(probs.sum()))
    full = np.clip(np.append(probs, tail), PROB_FLOOR, None)
    return np.asarray(full / full.sum(), dtype=np.float64)


def kl_topk_with_tail(p_top: Mapping[TokenT, float], q_top: Mapping[TokenT, float]) -> float:
    """Approximate KL(P‖Q) in nats from two top-k logprob dicts (token → logprob).

    Approximation: both distributions are placed on the union of listed tokens plus one "tail"
    bucket for everything else.

    * A token in the union that a side did not list gets, on that side, ``min(smallest listed
      probability, leftover / #missing)`` where ``leftover = max(0, 1 − Σ listed)`` — it cannot
      be likelier than anything in that side's top-k, and the unlisted tokens share the leftover.
    * The tail bucket is ``max(1e-12, 1 − Σ union)``; every probability is clipped at 1e-12 and
      each side is then renormalised to sum to 1 (which only matters when the listed logprobs
      round to more than 1).

    Identical dicts give exactly 0; the error vanishes as the top-k covers the mass (the tail
    bucket merges the unlisted tokens, which can only lower the KL — data processing).

    Usage: ``kl_topk_with_tail(provider_top_logprobs[t], reference_top_logprobs[t])``
    """
    union: list[TokenT] = list(p_top) + [tok for tok in q_top if tok not in p_top]
    p = _fill_distribution(p_top, union, "p_top")
    q = _fill_distribution(q_top, union, "q_top")
    return max(0.0, float(np.sum(p * (np.log(p) - np.log(q)))))
