"""MoeConfig: one frozen, family-neutral description of a model, built by each family from config.json."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: plain, YaRN or Hunyuan's alpha-NTK (which only changes the base)."""

    theta: float
    kind: Literal["default", "yarn"] = "default"
    partial_rotary_factor: float = 1.0
    # YaRN
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class MoeConfig:
    family: str  # model_type in config.json
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_vocab: int
    norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    # attention
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm of rotated queries and keys (Hunyuan)
    # MLP / mixture
    act_fn: str = "silu"
    d_mlp: int = 0  # dense MLP width (blocks that are not mixtures)
    moe_layers: tuple[bool, ...] = ()  # per block: mixture or dense
    n_experts: int = 0
    top_k: tuple[int, ...] = ()  # per block
    d_expert: int = 0
    d_shared: int = 0  # 0: no shared expert
    shared_gate: bool = False  # sigmoid-gated shared expert (Qwen2-MoE)
    shared_first: bool = True  # hooks fire in the family's order
    router_scoring: Literal["softmax", "sigmoid"] = "softmax"
    router_in_float32: bool = False  # router weight kept float32 at load (and applied in float32 while it is)
    router_compute_float32: bool = False  # router always applied in float32, whatever the weight's dtype (Solar)
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    correction_bias: bool = False  # Solar: e_score_correction_bias, used only for the choice
    n_group: int = 1
    topk_group: int = 1
    # embeddings
    tie_word_embeddings: bool = False
    # bookkeeping: which config.json fields the family reads, for the printout
    fields_read: tuple[str, ...] = field(default=(), compare=False)
    fields_ignored: tuple[str, ...] = field(default=(), compare=False)  # present, but unused (as in transformers)
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.n_heads}) must be a multiple of num_key_value_heads ({self.n_kv_heads})"
            )
        if len(self.moe_layers) != self.n_layers or len(self.top_k) != self.n_layers:
            raise ValueError(
                f"moe_layers ({len(self.moe_layers)}) and top_k ({len(self.top_k)}) need one entry per layer "
                f"({self.n_layers})"
            )
        for layer, (is_moe, k) in enumerate(zip(self.moe_layers, self.top_k, strict=True)):
            if is_moe and not 1 <= k <= self.n_experts:
                raise ValueError(f"layer {layer}: top_k {k} must be between 1 and n_experts ({self.n_experts})")

    @property
    def moe_layer_indices(self) -> list[int]:
        """Indices of the mixture blocks (the others are dense MLPs)."""
        return [i for i, moe in enumerate(self.moe_layers) if moe]

    @property
    def dense_layer_indices(self) -> list[int]:
        return [i for i, moe in enumerate(self.moe_layers) if not moe]

    @property
    def d_rot(self) -> int:
        """Rotated dimensions per head (the rest pass through)."""
        return int(self.d_head * self.rope.partial_rotary_factor)


class HFConfig:
    """config.json, read field by field: records what was read, and names a missing field clearly."""

    def __init__(self, raw: dict) -> None:
        self.raw = raw
        self.read: list[str] = []

    def __contains__(self, name: str) -> bool:
        return name in self.raw

    def req(self, name: str):
        if name not in self.raw:
            raise KeyError(name)
        return self.opt(name)

    def opt(self, name: str, default=None):
        if name not in self.read:
            self.read.append(name)
        value = self.raw.get(name)
        return default if value is None else value

    def head_dim(self) -> int:
        return self.opt("head_dim") or self.req("hidden_size") // self.req("num_attention_heads")

    def rope(self) -> RopeConfig:
        """Rotary settings from either spelling: rope_theta + rope_scaling (Hub) or rope_parameters (transformers)."""
        params = dict(self.opt("rope_parameters") or {})
        scaling = dict(self.opt("rope_scaling") or {})
        merged = {**scaling, **params}
        theta = merged.get("rope_theta", self.opt("rope_theta", 10000.0))
        kind = merged.get("rope_type", merged.get("type", "default"))
        partial = merged.get("partial_rotary_factor", self.opt("partial_rotary_factor", 1.0))
        if kind == "default":
            return RopeConfig(theta=float(theta), partial_rotary_factor=float(partial))
        if kind == "yarn":
            factor = merged.get("factor")
            original_max = merged.get("original_max_position_embeddings") or self.req("max_position_embeddings")
            return RopeConfig(
                theta=float(theta),
                kind="yarn",
                partial_rotary_factor=float(partial),
                factor=float(factor) if factor is not None else self.req("max_position_embeddings") / original_max,
                original_max_position_embeddings=int(original_max),
                beta_fast=float(merged.get("beta_fast") or 32.0),
                beta_slow=float(merged.get("beta_slow") or 1.0),
                mscale=merged.get("mscale"),
                mscale_all_dim=merged.get("mscale_all_dim"),
                attention_factor=merged.get("attention_factor"),
                truncate=bool(merged.get("truncate", True)),
            )
        raise ValueError(f"rope type {kind!r} is not supported by this family (rope settings: {merged})")
