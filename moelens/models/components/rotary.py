"""Rotary position embedding: inverse frequencies (default, YaRN, Llama 3, LongRoPE) and their application to q
and k."""

from __future__ import annotations

import math

import torch
from jaxtyping import Float, Int
from torch import nn

from moelens.config import MoeConfig, RopeConfig


def inverse_frequencies(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim/2], attention scaling applied to cos and sin), as transformers computes them."""
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    if rope.kind == "default":
        return 1.0 / pos_freqs, 1.0
    if rope.kind == "yarn":
        return _yarn(rope, dim, pos_freqs)
    if rope.kind == "llama3":
        return _llama3(rope, 1.0 / pos_freqs), 1.0
    if rope.kind == "longrope":
        return _longrope(rope, pos_freqs)
    raise ValueError(f"unsupported rotary kind {rope.kind!r}")


def _yarn(rope: RopeConfig, dim: int, pos_freqs: torch.Tensor) -> tuple[torch.Tensor, float]:
    """YaRN: blend interpolated (/factor) and extrapolated frequencies over a linear ramp of dimensions
    between the beta_fast and beta_slow rotation counts; cos and sin are scaled by the attention factor."""
    factor, original_max = rope.factor, rope.original_max_position_embeddings
    if original_max is None:
        raise ValueError("YaRN rotary needs original_max_position_embeddings")

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    if rope.attention_factor is not None:
        attention_factor = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        attention_factor = float(get_mscale(factor, rope.mscale) / get_mscale(factor, rope.mscale_all_dim))
    else:
        attention_factor = get_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    interpolation, extrapolation = 1.0 / (factor * pos_freqs), 1.0 / pos_freqs
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    return inv_freq, attention_factor


def _longrope(rope: RopeConfig, pos_freqs: torch.Tensor) -> tuple[torch.Tensor, float]:
    """LongRoPE's short frequencies (transformers' _compute_longrope_parameters without a sequence length: each
    frequency divided by its short_factor) and its attention factor (attention_factor, else from factor)."""
    factor, original_max = rope.factor, rope.original_max_position_embeddings
    attention_factor = rope.attention_factor
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original_max))
    ext_factors = torch.tensor(rope.short_factor, dtype=torch.float32)
    return 1.0 / (ext_factors * pos_freqs), attention_factor


def _llama3(rope: RopeConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    """Llama 3's scaling (transformers' _compute_llama3_parameters, step for step): frequencies whose wavelength
    is longer than original_max / low_freq_factor are divided by factor, those shorter than original_max /
    high_freq_factor kept, and the band between blended linearly in original_max / wavelength."""
    factor, old_context = rope.factor, rope.original_max_position_embeddings
    if old_context is None:
        raise ValueError("the llama3 rotary needs original_max_position_embeddings")
    low_freq_wavelen = old_context / rope.low_freq_factor
    high_freq_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


class Rotary(nn.Module):
    """cos and sin for given positions; rotates the first d_rot dims of each head, passes the rest."""

    def __init__(self, cfg: MoeConfig) -> None:
        super().__init__()
        self.d_rot, self.rope = cfg.d_rot, cfg.rope
        with torch.device("cpu"):  # tensor math on meta would import torch._dynamo (150 MB) for a float
            self.attention_scaling = inverse_frequencies(cfg.rope, self.d_rot)[1]
        # Not a buffer: it is derived from the config, must stay float32 whatever model.to(dtype) does, and
        # must not be built on the meta device when the loader builds the model there.
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        if device not in self._inv_freq:
            with torch.device("cpu"):
                self._inv_freq[device] = inverse_frequencies(self.rope, self.d_rot)[0].to(device)
        return self._inv_freq[device]

    def forward(
        self, positions: Int[torch.Tensor, "batch pos"], dtype: torch.dtype
    ) -> tuple[Float[torch.Tensor, "batch pos d_rot"], Float[torch.Tensor, "batch pos d_rot"]]:
        freqs = positions[..., None].float() * self.inv_freq(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)

    def extra_repr(self) -> str:
        return f"d_rot={self.d_rot}, attention_scaling={self.attention_scaling:.4f}"


class Float32Rotary(Rotary):
    """cos and sin kept float32 whatever the stream's dtype (transformers' ERNIE-4.5 and OLMo-2-style rotaries
    return them in full precision): the attention turns its queries and keys in float32 and casts back."""

    def forward(
        self, positions: Int[torch.Tensor, "batch pos"], dtype: torch.dtype
    ) -> tuple[Float[torch.Tensor, "batch pos d_rot"], Float[torch.Tensor, "batch pos d_rot"]]:
        return super().forward(positions, torch.float32)


class PolarRotary(Rotary):
    """cos and sin as torch.polar gives them, kept float32 whatever the stream's dtype: what Llama 4 turns its
    queries and keys by (transformers' Llama4TextRotaryEmbedding; torch.cos can differ from polar's by an ulp)."""

    def forward(
        self, positions: Int[torch.Tensor, "batch pos"], dtype: torch.dtype
    ) -> tuple[Float[torch.Tensor, "batch pos d_rot"], Float[torch.Tensor, "batch pos d_rot"]]:
        freqs = positions[..., None].float() * self.inv_freq(positions.device)
        turn = torch.polar(torch.ones_like(freqs), freqs)
        cos, sin = turn.real * self.attention_scaling, turn.imag * self.attention_scaling
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)


def apply_rotary_pairs(
    x: Float[torch.Tensor, "batch pos head d_head"],
    cos: Float[torch.Tensor, "batch pos d_rot"],
    sin: Float[torch.Tensor, "batch pos d_rot"],
) -> Float[torch.Tensor, "batch pos head d_head"]:
    """Rotary on a head's dims as interleaved pairs (x0, x1), (x2, x3), ..., pair i turned by frequency i and
    left in place (not de-interleaved), computed as complex products in float32 and cast back to x's dtype, as
    transformers' Llama 4 apply_rotary_emb. cos and sin are cat(angles, angles) (Rotary's layout), float32."""
    half = cos.shape[-1] // 2
    if 2 * half != x.shape[-1]:
        raise ValueError(f"apply_rotary_pairs turns whole heads: d_head {x.shape[-1]}, rotary width {cos.shape[-1]}")
    turn = torch.complex(cos[..., :half].float(), sin[..., :half].float())[:, :, None, :]
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], half, 2))
    return torch.view_as_real(pairs * turn).flatten(-2).type_as(x)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(
    x: Float[torch.Tensor, "batch pos head d_head"],
    cos: Float[torch.Tensor, "batch pos d_rot"],
    sin: Float[torch.Tensor, "batch pos d_rot"],
) -> Float[torch.Tensor, "batch pos head d_head"]:
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    d_rot = cos.shape[-1]
    if d_rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, rest = x[..., :d_rot], x[..., d_rot:]
    return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)


def apply_rotary_interleaved(
    x: Float[torch.Tensor, "batch pos head d_rot"],
    cos: Float[torch.Tensor, "batch pos d_rot"],
    sin: Float[torch.Tensor, "batch pos d_rot"],
) -> Float[torch.Tensor, "batch pos head d_rot"]:
    """Rotary on dims stored as interleaved pairs (x0, x1), (x2, x3), ..., each pair turned by one frequency;
    the result is laid out de-interleaved (the pairs' first elements, then their second), as transformers'
    apply_rotary_pos_emb_interleave returns it (DeepSeek). x holds only the rotated dims."""
    half = cos.shape[-1] // 2  # cos and sin are cat(freqs, freqs): the first half holds each pair's angle
    cos, sin = cos[..., :half].unsqueeze(2), sin[..., :half].unsqueeze(2)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def apply_rotary_adjacent_pairs(
    x: Float[torch.Tensor, "batch pos head d_head"],
    cos: Float[torch.Tensor, "batch pos d_rot"],
    sin: Float[torch.Tensor, "batch pos d_rot"],
) -> Float[torch.Tensor, "batch pos head d_head"]:
    """Rotary on a whole head's dims as interleaved pairs (x0, x1), (x2, x3), ..., pair i turned by frequency i
    and left in place, in real arithmetic: x * cos + rotate_pairs(x) * sin in float32 with each pair's angle
    repeated over its two dims, cast back to x's dtype (transformers' ERNIE-4.5 apply_rotary_pos_emb, op for op).
    cos and sin are cat(angles, angles) (Rotary's layout)."""
    if cos.shape[-1] != x.shape[-1]:
        raise ValueError(f"apply_rotary_adjacent_pairs turns whole heads: d_head {x.shape[-1]}, rotary width {cos.shape[-1]}")
    half = cos.shape[-1] // 2
    cos = cos.unsqueeze(2)[..., :half].repeat_interleave(2, dim=-1)
    sin = sin.unsqueeze(2)[..., :half].repeat_interleave(2, dim=-1)
    pairs_turned = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    return ((x.float() * cos) + (pairs_turned.float() * sin)).to(x.dtype)
