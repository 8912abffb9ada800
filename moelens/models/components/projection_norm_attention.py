"""Attention whose queries and keys are RMS-normed over the whole projection (every head together), before the
split into heads and the rotary, and optionally clamped with the values to [-clip_qkv, clip_qkv] (OLMoE;
MiniMax-M2 without the clamp).

The norm's statistics mix the heads: a query head's normed value depends on every other head's raw projection,
so the norm weight [n_heads * d_head] multiplies coordinates of the flat projection and does not fold into
q_proj / k_proj (ln1's weight, before q_proj, still does)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from jaxtyping import Float

from moelens.config import MoeConfig
from moelens.hooks.sites import site_hook
from moelens.models.components.attention import Attention, SplitInputs, linear_per_head, split_inputs
from moelens.models.components.norm import RMSNorm
from moelens.models.terms import ParamTerm, under


@dataclass(frozen=True)
class ClipQKVConfig(MoeConfig):
    """MoeConfig plus the bound that q, k and v are clamped to after the projections (and their norms);
    None: no clamp."""

    clip_qkv: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.clip_qkv is not None and not self.clip_qkv > 0:
            raise ValueError(f"clip_qkv must be positive (or null for no clamp), got {self.clip_qkv}")


class ProjectionQKNormAttention(Attention):
    """q = clamp(q_norm(q_proj(x))), k = clamp(k_norm(k_proj(x))), v = clamp(v_proj(x)): one RMSNorm over each
    token's whole query projection (weight [n_heads * d_head]) and one over its whole key projection (weight
    [n_kv_heads * d_head]), float32 inside as the other norms; then, where cfg.clip_qkv is set, q, k and v
    clamped to [-clip_qkv, clip_qkv]; then the heads split and the rotary applied to q and k (OLMoE, MiniMax-M2)."""

    # hook_q and hook_k are after the norms: W_Q / W_K are the projections before them
    linear_hooks = ("v",)

    @classmethod
    def param_terms(cls, cfg: ClipQKVConfig, layer: int) -> tuple[ParamTerm, ...]:
        return (super().param_terms(cfg, layer) + under("q_norm", RMSNorm.param_terms(cfg.n_heads * cfg.d_head))
                + under("k_norm", RMSNorm.param_terms(cfg.n_kv_heads * cfg.d_head)))

    def __init__(self, cfg: ClipQKVConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        self.clip_qkv = cfg.clip_qkv
        self.q_norm = RMSNorm(cfg.n_heads * cfg.d_head, cfg.norm_eps, hooked=False)
        self.k_norm = RMSNorm(cfg.n_kv_heads * cfg.d_head, cfg.norm_eps, hooked=False)
        clamped = cfg.clip_qkv is not None
        self.hook_q = site_hook("blocks.L.attn.hook_q", "qk_norm_clamped" if clamped else "qk_norm")
        self.hook_k = site_hook("blocks.L.attn.hook_k", "qk_norm_clamped" if clamped else "qk_norm")
        self.hook_v = site_hook("blocks.L.attn.hook_v", "clamped" if clamped else "default")

    def project(
        self, x: Float[torch.Tensor, "batch pos d_model"] | SplitInputs
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As Attention.project. With SplitInputs each head's raw projection reads its own input, but the
        norms still mix the heads: hook_q and hook_k of every head move when one head's input does."""
        xq, xk, xv = split_inputs(x)
        b, p = xq.shape[:2]
        q = self.q_norm(linear_per_head(self.q_proj, xq))
        k = self.k_norm(linear_per_head(self.k_proj, xk))
        v = linear_per_head(self.v_proj, xv)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = self.hook_q(q.view(b, p, self.n_heads, self.d_head))
        k = self.hook_k(k.view(b, p, self.n_kv_heads, self.d_head))
        v = self.hook_v(v.view(b, p, self.n_kv_heads, self.d_head))
        return q, k, v

    def extra_repr(self) -> str:
        return f"clip_qkv={self.clip_qkv}"
