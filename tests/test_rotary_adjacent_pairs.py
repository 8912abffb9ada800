"""apply_rotary_adjacent_pairs and Float32Rotary against a hand-written reference: each interleaved pair (x[2i],
x[2i+1]) of a head turned in place by angle position * inv_freq[i], as a complex product in float64."""

import pytest
import torch

from moelens.config import MoeConfig, RopeConfig
from moelens.models.components.rotary import Float32Rotary, Rotary, apply_rotary, apply_rotary_adjacent_pairs


def config(d_head: int = 8) -> MoeConfig:
    return MoeConfig(family="test", d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, d_head=d_head, d_vocab=8,
                     norm_eps=1e-6, rope=RopeConfig(theta=100.0, interleaved=True), max_position_embeddings=64,
                     moe_layers=(False,), top_k_per_layer=(0,))


def turned_by_hand(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = positions[..., None].double() * inv_freq  # [batch pos d/2]
    pairs = torch.complex(x[..., 0::2].double(), x[..., 1::2].double())
    turned = pairs * torch.polar(torch.ones_like(angle), angle)[:, :, None, :]
    return torch.stack((turned.real, turned.imag), dim=-1).flatten(-2)


def test_pairs_turn_in_place_as_complex_products():
    cfg = config()
    x = torch.randn(2, 5, 3, cfg.d_head, generator=torch.Generator().manual_seed(0))
    positions = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])
    cos, sin = Float32Rotary(cfg)(positions, torch.bfloat16)
    assert cos.dtype == sin.dtype == torch.float32  # kept full precision whatever the stream's dtype
    torch.testing.assert_close(apply_rotary_adjacent_pairs(x, cos, sin).double(), turned_by_hand(x, positions, 100.0),
                               rtol=0, atol=1e-5)
    # the half-split rotary on the same tables turns other pairs (x[i], x[i + d/2]): a different result
    assert not torch.allclose(apply_rotary_adjacent_pairs(x, cos, sin), apply_rotary(x, cos, sin))


def test_bfloat16_heads_turn_in_float32_and_cast_back():
    cfg = config()
    x = torch.randn(1, 4, 2, cfg.d_head, generator=torch.Generator().manual_seed(1)).bfloat16()
    positions = torch.arange(4)[None]
    cos, sin = Float32Rotary(cfg)(positions, torch.bfloat16)
    out = apply_rotary_adjacent_pairs(x, cos, sin)
    assert out.dtype == torch.bfloat16
    # one bfloat16 rounding of the float32 result: within half an ulp (2**-8 relative) of the exact turn, plus float32's
    torch.testing.assert_close(out.double(), turned_by_hand(x, positions, 100.0), rtol=2**-8, atol=1e-6)
    cos16, _ = Rotary(cfg)(positions, torch.bfloat16)
    assert cos16.dtype == torch.bfloat16  # the plain rotary casts its tables to the stream's dtype


def test_a_partial_table_is_refused():
    cfg = config()
    cos, sin = Float32Rotary(cfg)(torch.arange(3)[None], torch.float32)
    x = torch.randn(1, 3, 2, 2 * cfg.d_head)
    with pytest.raises(ValueError, match="turns whole heads"):
        apply_rotary_adjacent_pairs(x, cos, sin)
