"""The sandbox model's forward pass, written for serving: a Llama decoder over the weights
of a Hugging Face model (any precision ``model.build_precision`` makes), with a KV cache
kept by slot so that requests join and leave a running batch between any two steps.

It computes what ``transformers``' Llama does, op for op and in the same dtypes (RMSNorm in
fp32, RoPE from fp32 frequencies cast to the compute dtype, scaled-dot-product attention,
tied embedding as the output head), so its logprobs agree with the Hugging Face model's and
with vLLM's within float rounding (``tests/sandbox/test_decoder.py`` holds it to that). What
differs is the work around the ops: the query/key/value and gate/up projections are each one
matrix product, a decode step runs one forward for every running row however long its
history, and only the logits a caller needs are computed.

fp32 weights are packed once into oneDNN's blocked layout (``pack``), which torch's own CPU
compiler uses for the same reason: every weight of the model at batch 8 took 36.6 ms through
``F.linear`` (MKL) and 26.3 ms packed, the output head 9.6 and 4.3 ms (2 cores; batch 1 is the
one place MKL wins, 16.9 against 24.9 ms, and is the rarer case in a sandbox serving many
requests). The packed copy replaces the plain one, so a precision costs its weights once.

bf16 weights are packed the same way, as fp32 holding their exact values, and a bf16 input
goes through the fp32 product with its result rounded to bf16 once (``linear``). That is
the arithmetic of a GPU's bf16 matrix product (products of bf16 numbers are exact in fp32,
summed in fp32, rounded at the end); against torch's bf16 ``F.linear`` only the order of the
sums differs (1 output in ~7,500 one bf16 step apart). Through the whole model that is bf16's
own noise drawn anew: each way's next-token distribution lies as far from fp32's (median KL
1.5e-3 nats, 90th percentile 2.4e-3 and 2.5e-3) as the two lie from each other (2.1e-3). On
a CPU without bf16 instructions (an AMD EPYC with AVX2 only) it is the faster way by far:
prefill of 8 x 96 tokens 3.5 s against 19.0 s, 32 decode steps 5.5 against 10.3 s
(``benchmarks/bf16_compute.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

CACHE_STEP = 128
"""Cache lengths grow in steps of this many positions (a copy per growth, not per token)."""


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A Linear weight ``[out, in]`` ready for ``linear``: fp32 or bf16 values as fp32 in
    oneDNN's layout (see the module docstring), other dtypes as they are."""
    weight = weight.detach().contiguous()
    if weight.dtype not in (torch.float32, torch.bfloat16):
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight.float(), None)  # type: ignore[no-any-return]


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for a weight from ``pack``, in ``x``'s dtype (a bf16 input: the
    product of its exact fp32 values, rounded to bf16 once)."""
    if weight.is_mkldnn:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x.float(), weight, None, "none", [], "")
        return out.to(x.dtype)
    return F.linear(x, weight)


@dataclass(frozen=True)
class _Layer:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [q + k + v, hidden]
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor


class SlotCache:
    """Keys and values of up to ``slots`` sequences, per layer ``[slots, kv_heads, capacity,
    head_dim]``. A sequence owns one slot; the running ones occupy slots ``0 .. n-1`` (see
    ``move``), so a step reads a prefix of the slots and no index."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        self._shape = (kv_heads, head_dim)
        self._dtype = dtype
        self.keys: list[torch.Tensor] = [self._empty(0, 0) for _ in range(layers)]
        self.values: list[torch.Tensor] = [self._empty(0, 0) for _ in range(layers)]

    def _empty(self, slots: int, capacity: int) -> torch.Tensor:
        kv_heads, head_dim = self._shape
        # zeros, not empty: a masked position weighs 0, and 0 x NaN garbage would still be NaN
        return torch.zeros((slots, kv_heads, capacity, head_dim), dtype=self._dtype)

    @property
    def slots(self) -> int:
        return self.keys[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def reserve(self, slots: int, capacity: int) -> None:
        """Make room for ``slots`` sequences of ``capacity`` positions, keeping what is held."""
        if slots <= self.slots and capacity <= self.capacity:
            return
        slots = max(slots, self.slots)
        capacity = max(self.capacity, -(-capacity // CACHE_STEP) * CACHE_STEP)
        held_slots, held = self.slots, self.capacity
        for store in (self.keys, self.values):
            for i, old in enumerate(store):
                grown = self._empty(slots, capacity)
                grown[:held_slots, :, :held] = old
                store[i] = grown

    def move(self, source: int, target: int, length: int) -> None:
        """Copy a sequence's first ``length`` positions from one slot to another."""
        for store in (self.keys, self.values):
            for tensor in store:
                tensor[target, :, :length] = tensor[source, :, :length]

    def release(self) -> None:
        """Free the memory (the next ``reserve`` allocates again)."""
        self.keys = [self._empty(0, 0) for _ in self.keys]
        self.values = [self._empty(0, 0) for _ in self.values]


class Decoder:
    """One precision of the model, ready to serve.

    Usage: ``decoder = Decoder(model); cache = decoder.new_cache()``, then
    ``decoder.prefill(cache, first_slot, prompts)`` and ``decoder.decode(cache, tokens,
    lengths)`` for sampling, ``decoder.extend(past, suffixes)`` for teacher-forced scoring
    (``past`` from a prefix cache, or ``None`` per row for a whole sequence).

    ``kv_format`` rounds every key and value as the serving engine's cache would store them
    (e.g. ``formats.fp8_kv``); attention reads them rounded, the current position's too, as
    vLLM's attention reads the cache it has just written.
    """

    def __init__(self, model: nn.Module, *, kv_format: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.kv_format = kv_format
        core: Any = model.model
        config: Any = model.config
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.heads)
        self.eps = float(config.rms_norm_eps)
        self.embedding: torch.Tensor = core.embed_tokens.weight.detach()
        self.dtype = self.embedding.dtype
        lm_head: Any = model.lm_head
        self.head = pack(lm_head.weight)
        self.norm: torch.Tensor = core.norm.weight.detach()
        self.intermediate = int(config.intermediate_size)
        self.layers = [
            _Layer(
                input_norm=layer.input_layernorm.weight.detach(),
                qkv=pack(torch.cat([getattr(layer.self_attn, f"{n}_proj").weight for n in "qkv"])),
                o=pack(layer.self_attn.o_proj.weight),
                post_norm=layer.post_attention_layernorm.weight.detach(),
                gate_up=pack(torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight])),
                down=pack(layer.mlp.down_proj.weight),
            )
            for layer in core.layers
        ]
        # RoPE exactly as transformers computes it: fp32 position x fp32 inverse frequency,
        # duplicated, cos/sin, then cast to the compute dtype (bf16 servers keep inv_freq fp32).
        inv_freq = core.rotary_emb.inv_freq.to(torch.float32)
        scaling = float(getattr(core.rotary_emb, "attention_scaling", 1.0))
        self.context_length = int(config.max_position_embeddings)
        positions = torch.arange(self.context_length, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        self.cos = (angles.cos() * scaling).to(self.dtype)
        self.sin = (angles.sin() * scaling).to(self.dtype)

    def new_cache(self) -> SlotCache:
        return SlotCache(len(self.layers), self.kv_heads, self.head_dim, self.dtype)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * h.to(x.dtype)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return (x * cos) + (rotated * sin)

    def _split(self, x: torch.Tensor, layer: _Layer, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Attention input of ``x`` [rows, positions, hidden]: q, k, v as [rows, heads, positions, head_dim]."""
        rows, positions, _ = x.shape
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        qkv = linear(self._rms(x, layer.input_norm), layer.qkv)
        q = qkv[..., :q_size].view(rows, positions, self.heads, self.head_dim).transpose(1, 2)
        k = qkv[..., q_size : q_size + kv_size].view(rows, positions, self.kv_heads, self.head_dim).transpose(1, 2)
        v = qkv[..., q_size + kv_size :].view(rows, positions, self.kv_heads, self.head_dim).transpose(1, 2)
        k = self._rotate(k, cos, sin)
        if self.kv_format is not None:
            k, v = self.kv_format(k), self.kv_format(v)
        return self._rotate(q, cos, sin), k, v

    def _finish(self, x: torch.Tensor, attended: torch.Tensor, layer: _Layer) -> torch.Tensor:
        """The rest of a block after attention: output projection, residual, MLP, residual."""
        rows, _, positions, _ = attended.shape
        x = x + linear(attended.transpose(1, 2).reshape(rows, positions, self.heads * self.head_dim), layer.o)
        gate, up = torch.split(linear(self._rms(x, layer.post_norm), layer.gate_up), self.intermediate, dim=-1)
        return x + linear(F.silu(gate) * up, layer.down)

    def _causal(self, ids: torch.Tensor, cache: SlotCache, first_slot: int, rows: torch.Tensor) -> torch.Tensor:
        """Hidden states after the last block for right-padded ``ids`` [rows, width] (causal
        attention keeps the padding out of every real position); the keys and values of row
        ``rows[j]`` go into the cache's slot ``first_slot + j``."""
        width = ids.shape[1]
        x = F.embedding(ids, self.embedding)
        cos, sin = self.cos[:width], self.sin[:width]
        for i, layer in enumerate(self.layers):
            q, k, v = self._split(x, layer, cos, sin)
            cache.keys[i][first_slot : first_slot + len(rows), :, :width] = k[rows]
            cache.values[i][first_slot : first_slot + len(rows), :, :width] = v[rows]
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = self._finish(x, attended, layer)
        return self._rms(x, self.norm)

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.head).float()

    @staticmethod
    def _padded(sequences: Sequence[Sequence[int]], pad: int) -> torch.Tensor:
        width = max(len(s) for s in sequences)
        ids = torch.full((len(sequences), width), pad, dtype=torch.long)
        for row, sequence in enumerate(sequences):
            ids[row, : len(sequence)] = torch.tensor(list(sequence), dtype=torch.long)
        return ids

    def prefill(self, cache: SlotCache, first_slot: int, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Run ``prompts`` (each non-empty) into slots ``first_slot ..``; the next-token logits
        of each, fp32 ``[rows, vocab]``. The caller has reserved the slots and the length.
        A prompt given several times (a probe's k completions join together) runs once and
        its keys and values are copied to each of its slots."""
        distinct: dict[tuple[int, ...], int] = {}
        slot_rows = torch.tensor([distinct.setdefault(tuple(p), len(distinct)) for p in prompts], dtype=torch.long)
        hidden = self._causal(self._padded(list(distinct), pad=0), cache, first_slot, slot_rows)
        last = torch.tensor([len(p) - 1 for p in distinct], dtype=torch.long)
        return self._head(hidden[torch.arange(len(distinct)), last])[slot_rows]

    def decode(self, cache: SlotCache, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """One step for the sequences in slots ``0 .. n-1``: ``tokens`` [n] go in at positions
        ``lengths`` [n] (what each slot holds so far); the next-token logits, fp32 ``[n, vocab]``."""
        rows = tokens.shape[0]
        span = int(lengths.max()) + 1
        slots = torch.arange(rows)
        x = F.embedding(tokens[:, None], self.embedding)
        cos, sin = self.cos[lengths][:, None, None, :], self.sin[lengths][:, None, None, :]
        visible = (torch.arange(span)[None, :] <= lengths[:, None])[:, None, None, :]
        group = self.heads // self.kv_heads
        for i, layer in enumerate(self.layers):
            q, k, v = self._split(x, layer, cos, sin)
            keys, values = cache.keys[i], cache.values[i]
            keys[slots, :, lengths] = k[:, :, 0]
            values[slots, :, lengths] = v[:, :, 0]
            # Grouped-query attention of one new position: the query heads that share a key
            # head stand in for positions of one query, so no key or value is copied per head.
            grouped = q.reshape(rows, self.kv_heads, group, self.head_dim)
            attended = F.scaled_dot_product_attention(grouped, keys[:rows, :, :span], values[:rows, :, :span], attn_mask=visible)
            x = self._finish(x, attended.reshape(rows, self.heads, 1, self.head_dim), layer)
        return self._head(self._rms(x, self.norm)[:, 0])

    def extend(self, past: Sequence[Past | None], suffixes: Sequence[Sequence[int]]) -> tuple[torch.Tensor, Past]:
        """Teacher-forced logits of each row's ``suffixes[row]`` (non-empty) after the positions
        whose keys and values ``past[row]`` holds (``None``: none), fp32 ``[rows, width,
        vocab]`` right-padded, and the suffixes' own keys and values (``[layers, rows,
        kv_heads, width, head_dim]``) for a prefix cache. With no past at all this is one
        causal pass, as ``prefill`` runs."""
        ids = self._padded(suffixes, pad=0)
        rows, width = ids.shape
        starts = torch.tensor([0 if p is None else p.length for p in past], dtype=torch.long)
        span = int(starts.max())
        keys = torch.zeros((len(self.layers), rows, self.kv_heads, span, self.head_dim), dtype=self.dtype)
        values = torch.zeros_like(keys)
        for row, held in enumerate(past):
            if held is not None:
                keys[:, row, :, : held.length] = held.keys
                values[:, row, :, : held.length] = held.values
        if span:
            positions = starts[:, None] + torch.arange(width)[None, :]
            cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]
            # a query sees its row's past (not the padding after it) and the suffix up to itself
            seen_past = torch.arange(span)[None, None, :] < starts[:, None, None]
            causal = torch.ones((width, width), dtype=torch.bool).tril()
            visible = torch.cat((seen_past.expand(rows, width, span), causal.expand(rows, width, width)), dim=-1)[:, None]
        else:
            cos, sin = self.cos[:width], self.sin[:width]
        new_keys = torch.empty((len(self.layers), rows, self.kv_heads, width, self.head_dim), dtype=self.dtype)
        new_values = torch.empty_like(new_keys)
        x = F.embedding(ids, self.embedding)
        for i, layer in enumerate(self.layers):
            q, k, v = self._split(x, layer, cos, sin)
            new_keys[i], new_values[i] = k, v
            if span:
                all_k, all_v = torch.cat((keys[i], k), dim=2), torch.cat((values[i], v), dim=2)
                attended = F.scaled_dot_product_attention(q, all_k, all_v, attn_mask=visible, enable_gqa=True)
            else:
                attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = self._finish(x, attended, layer)
        return self._head(self._rms(x, self.norm)), Past(new_keys, new_values, width)


@dataclass(frozen=True)
class Past:
    """Keys and values of a sequence's first ``length`` positions, ``[layers, kv_heads,
    length, head_dim]`` (or with a rows dimension after ``layers``, as ``extend`` returns)."""

    keys: torch.Tensor
    values: torch.Tensor
    length: int
