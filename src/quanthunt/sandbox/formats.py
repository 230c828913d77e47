"""Weight formats a provider may really serve, as fake-quantisation of fp32 weights.

Each function takes a 2-D weight ``[out_features, in_features]`` and returns a tensor of
the same shape and dtype whose values are exactly representable in the format (the
dequantised result), so a model built from them computes what a provider serving that
format computes, up to the provider's kernels. Blocks and groups run along the input
dimension, as in every inference engine; a ragged last block is zero-padded.

- ``int8``: per-output-channel symmetric, ``scale = amax / 127``, codes in [-127, 127].
- ``int4-g128``: symmetric groups of 128, ``scale = amax / 7``, codes in [-7, 7].
- ``nvfp4``: FP4 E2M1 values in 16-element blocks; each block scale is FP8 E4M3, and the
  whole tensor has an fp32 scale ``amax / (6 * 448)`` so block scales use E4M3's range
  (NVIDIA's NVFP4 recipe).
- ``mxfp4``: FP4 E2M1 values in 32-element blocks with a shared power-of-two (E8M0) scale
  ``2 ** (floor(log2(amax)) - 2)`` (OCP Microscaling spec v1.0, §6.3); values that land
  above 6 saturate.

And one cache format: ``fp8_kv`` rounds keys and values to FP8 E4M3 with a per-tensor scale
of 1.0, what vLLM's ``--kv-cache-dtype fp8`` stores when the checkpoint carries no scales
and none are calculated (its documented default).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

E2M1_MAX = 6.0
E4M3_MAX = 448.0
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The non-negative values FP4 E2M1 can hold (1 sign, 2 exponent, 1 mantissa bit)."""


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest FP4 E2M1 value, ties to even mantissa, saturating at ±6.

    Between 0 and 2 the grid step is 0.5, between 2 and 4 it is 1, above 4 it is 2, so
    rounding ``|x| / step`` half-to-even (``torch.round``) is round-to-nearest-even.
    """
    mag = x.abs()
    step = torch.where(mag < 2.0, 0.5, torch.where(mag < 4.0, 1.0, 2.0))
    q = torch.clamp(torch.round(mag / step) * step, max=E2M1_MAX)
    return torch.copysign(q, x)


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest FP8 E4M3 (``e4m3fn``) value, saturating at ±448."""
    return torch.clamp(x, -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(x.dtype)


def fp8_kv(x: torch.Tensor) -> torch.Tensor:
    """Keys or values as an FP8 E4M3 KV cache with scale 1.0 holds them (saturating at ±448;
    below 2**-6 E4M3 is subnormal, so small values keep fewer bits)."""
    return round_e4m3(x)


def _blocks(w: torch.Tensor, size: int) -> tuple[torch.Tensor, int]:
    """View ``w`` as ``[out, n_blocks, size]``, zero-padding the input dimension."""
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(w.shape)}")
    pad = (-w.shape[1]) % size
    padded = torch.nn.functional.pad(w, (0, pad)) if pad else w
    return padded.reshape(w.shape[0], -1, size), pad


def _unblock(blocks: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return blocks.reshape(like.shape[0], -1)[:, : like.shape[1]].to(like.dtype)


def _safe_divide(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale > 0, x / torch.where(scale > 0, scale, 1.0), 0.0)


def int8_per_channel(w: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 with one scale per output channel."""
    scale = w.abs().amax(dim=1, keepdim=True) / 127.0
    codes = torch.clamp(torch.round(_safe_divide(w, scale)), -127, 127)
    return (codes * scale).to(w.dtype)


def int4_groupwise(w: torch.Tensor, group: int = 128) -> torch.Tensor:
    """Symmetric int4 with one scale per ``group`` input elements."""
    blocks, _ = _blocks(w, group)
    scale = blocks.abs().amax(dim=2, keepdim=True) / 7.0
    codes = torch.clamp(torch.round(_safe_divide(blocks, scale)), -7, 7)
    return _unblock(codes * scale, w)


@dataclass(frozen=True)
class BlockScaled:
    """An FP4 tensor as stored: E2M1 ``codes`` (their real values, ``[out, blocks, size]``),
    one ``scales`` entry per block (``[out, blocks, 1]``) and a tensor-wide ``tensor_scale``.
    ``decode`` gives ``codes * scales * tensor_scale``, trimmed to ``columns``."""

    codes: torch.Tensor
    scales: torch.Tensor
    tensor_scale: float
    columns: int

    def decode(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        flat = (self.codes * self.scales * self.tensor_scale).reshape(self.codes.shape[0], -1)
        return flat[:, : self.columns].to(dtype)


def nvfp4_encode(w: torch.Tensor) -> BlockScaled:
    """NVFP4: E2M1 codes in 16-element blocks, E4M3 block scales, fp32 tensor scale."""
    blocks, _ = _blocks(w.float(), 16)
    amax = float(blocks.abs().amax())
    tensor_scale = amax / (E2M1_MAX * E4M3_MAX) if amax > 0 else 1.0
    block_amax = blocks.abs().amax(dim=2, keepdim=True)
    scales = round_e4m3(block_amax / E2M1_MAX / tensor_scale)
    codes = round_e2m1(_safe_divide(blocks, scales * tensor_scale))
    return BlockScaled(codes, scales, tensor_scale, w.shape[1])


def nvfp4(w: torch.Tensor) -> torch.Tensor:
    """NVFP4 fake-quantisation (see ``nvfp4_encode``)."""
    return nvfp4_encode(w).decode(w.dtype)


def mxfp4_encode(w: torch.Tensor) -> BlockScaled:
    """MXFP4: E2M1 codes in 32-element blocks with shared E8M0 (power-of-two) scales."""
    blocks, _ = _blocks(w.float(), 32)
    block_amax = blocks.abs().amax(dim=2, keepdim=True)
    exponent = torch.floor(torch.log2(torch.where(block_amax > 0, block_amax, 1.0))) - 2.0
    scales = torch.where(block_amax > 0, torch.exp2(torch.clamp(exponent, -127, 127)), 0.0)
    codes = round_e2m1(_safe_divide(blocks, scales))
    return BlockScaled(codes, scales, 1.0, w.shape[1])


def mxfp4(w: torch.Tensor) -> torch.Tensor:
    """MXFP4 fake-quantisation (see ``mxfp4_encode``)."""
    return mxfp4_encode(w).decode(w.dtype)
