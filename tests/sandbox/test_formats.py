"""Each weight format against its definition, on hand-made and random weights."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from quanthunt.sandbox import formats

GRID = torch.tensor(formats.E2M1_GRID)


def on_e2m1_grid(values: torch.Tensor) -> bool:
    return bool(torch.isin(values.abs(), GRID).all())


def e4m3_representable(values: torch.Tensor) -> bool:
    return bool(torch.equal(values.to(torch.float8_e4m3fn).float(), values.float())) and bool((values.abs() <= 448).all())


@pytest.fixture
def weight() -> torch.Tensor:
    # 576 input columns, like SmolLM2's attention projections: not a multiple of 128.
    return torch.randn(48, 576, generator=torch.Generator().manual_seed(0)) * 0.05


class TestE2M1:
    def test_grid_values_are_fixed_points(self) -> None:
        values = torch.tensor([*formats.E2M1_GRID, *(-v for v in formats.E2M1_GRID)])
        assert torch.equal(formats.round_e2m1(values), values)

    @pytest.mark.parametrize(
        ("x", "expected"),
        [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0), (-2.5, -2.0)],
    )
    def test_ties_round_to_even_mantissa(self, x: float, expected: float) -> None:
        assert formats.round_e2m1(torch.tensor([x])).item() == expected

    def test_saturates_at_six(self) -> None:
        assert formats.round_e2m1(torch.tensor([7.0, 100.0, -9.0])).tolist() == [6.0, 6.0, -6.0]

    def test_rounds_to_nearest(self) -> None:
        x = torch.linspace(-6, 6, 2001)
        q = formats.round_e2m1(x)
        nearest = (x.abs().unsqueeze(1) - GRID).abs().min(dim=1).values
        assert torch.allclose((q.abs() - x.abs()).abs(), nearest)


def test_e4m3_rounding_saturates_and_is_representable() -> None:
    x = torch.tensor([0.0, 1.0, 1.0625, 500.0, -1000.0, 0.013])
    q = formats.round_e4m3(x)
    assert q[:5].tolist() == [0.0, 1.0, 1.0, 448.0, -448.0]  # 1.0625 ties to even mantissa 1.0
    assert e4m3_representable(q)


def test_fp8_kv_cache_keeps_the_compute_dtype_and_loses_bits_below_the_normal_range() -> None:
    keys = torch.tensor([[[[3.3, -0.7, 600.0, 0.003]]]], dtype=torch.bfloat16)  # [rows, heads, positions, head_dim]
    stored = formats.fp8_kv(keys)
    assert stored.dtype == torch.bfloat16 and stored.shape == keys.shape
    assert e4m3_representable(stored.float()) and stored[0, 0, 0, 2].item() == 448.0  # scale 1.0 saturates
    relative = ((stored.float() - keys.float()).abs() / keys.float().abs())[0, 0, 0]
    assert relative[0] <= 1 / 16 and relative[1] <= 1 / 16  # 3 mantissa bits: within half a step
    assert relative[3] > 1 / 4  # 0.003 is subnormal in E4M3 (steps of 2**-9): scale 1.0 costs small values


def test_int8_per_channel(weight: torch.Tensor) -> None:
    q = formats.int8_per_channel(weight)
    scale = weight.abs().amax(dim=1, keepdim=True) / 127
    codes = q / scale
    assert torch.allclose(codes, codes.round(), atol=1e-4)
    assert codes.abs().max() <= 127 + 1e-4
    assert torch.allclose(q.abs().amax(dim=1), weight.abs().amax(dim=1))
    assert ((q - weight).abs() <= scale / 2 + 1e-7).all()


def test_int4_groupwise_handles_ragged_groups(weight: torch.Tensor) -> None:
    q = formats.int4_groupwise(weight, group=128)
    assert q.shape == weight.shape
    for start in range(0, 576, 128):  # 4 full groups and one of 64
        block, original = q[:, start : start + 128], weight[:, start : start + 128]
        scale = original.abs().amax(dim=1, keepdim=True) / 7
        codes = block / scale
        assert torch.allclose(codes, codes.round(), atol=1e-4)
        assert codes.abs().max() <= 7 + 1e-4
        assert ((block - original).abs() <= scale / 2 + 1e-7).all()


class TestNVFP4:
    def test_encoding_follows_the_format(self, weight: torch.Tensor) -> None:
        enc = formats.nvfp4_encode(weight)
        assert enc.codes.shape == (48, 36, 16)
        assert on_e2m1_grid(enc.codes)
        assert e4m3_representable(enc.scales)
        assert enc.tensor_scale == pytest.approx(float(weight.abs().max()) / (6 * 448))
        assert torch.equal(enc.decode(), formats.nvfp4(weight))

    def test_values_on_the_grid_survive_exactly(self) -> None:
        x = torch.tensor([[0, 0.5, 1, 1.5, 2, 3, 4, 6, -6, -4, -3, -2, -1.5, -1, -0.5, 0]])
        # exact up to fp32 rounding of the two-level scale (448 * 6/2688 != 1 in binary)
        assert torch.allclose(formats.nvfp4(x), x, rtol=1e-6, atol=0)

    def test_error_is_bounded_by_half_a_grid_step(self, weight: torch.Tensor) -> None:
        enc = formats.nvfp4_encode(weight)
        step = enc.scales * enc.tensor_scale  # largest E2M1 gap is 2 units of the scale
        blocks = torch.nn.functional.pad(weight, (0, 0)).reshape(48, 36, 16)
        assert ((enc.codes * step - blocks).abs() <= step + 1e-7).all()

    def test_differs_from_the_reference_weights(self, weight: torch.Tensor) -> None:
        rel = (formats.nvfp4(weight) - weight).norm() / weight.norm()
        assert 0.01 < rel < 0.2


class TestMXFP4:
    def test_encoding_follows_the_format(self, weight: torch.Tensor) -> None:
        enc = formats.mxfp4_encode(weight)
        assert enc.codes.shape == (48, 18, 32)
        assert on_e2m1_grid(enc.codes)
        exponents = torch.log2(enc.scales)
        assert torch.equal(exponents, exponents.round())  # E8M0: powers of two only
        amax = weight.reshape(48, 18, 32).abs().amax(dim=2, keepdim=True)
        assert torch.equal(exponents, torch.floor(torch.log2(amax)) - 2)

    def test_matches_ggml_reference_implementation(self, weight: torch.Tensor) -> None:
        packed = gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType.MXFP4)
        theirs = gguf.quants.dequantize(packed, gguf.GGMLQuantizationType.MXFP4)
        np.testing.assert_array_equal(formats.mxfp4(weight).numpy(), theirs)

    def test_zero_block_stays_zero(self) -> None:
        assert torch.equal(formats.mxfp4(torch.zeros(2, 64)), torch.zeros(2, 64))


def test_formats_reject_non_matrices() -> None:
    with pytest.raises(ValueError, match="2-D"):
        formats.nvfp4(torch.zeros(16))


def test_formats_order_by_coarseness(weight: torch.Tensor) -> None:
    """More bits, less error: the ordering the verification stage relies on."""
    err = {
        name: float((fn(weight) - weight).norm() / weight.norm())
        for name, fn in [
            ("int8", formats.int8_per_channel),
            ("int4-g128", formats.int4_groupwise),
            ("nvfp4", formats.nvfp4),
            ("mxfp4", formats.mxfp4),
        ]
    }
    assert err["int8"] < err["nvfp4"] < err["mxfp4"]
    assert err["int8"] < err["int4-g128"]
