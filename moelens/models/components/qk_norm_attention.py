"""Attention with a per-head RMSNorm of the queries and keys before the rotary (or in place of it)."""

from __future__ import annotations

from typing import ClassVar

from moelens.config import MoeConfig
from moelens.models.components.attention import Attention
from moelens.models.components.norm import RMSNorm
from moelens.models.components.sliding_window_attention import SlidingWindowAttention
from moelens.models.terms import ParamTerm, under


class QKNormBeforeRotaryAttention(Attention):
    """RMSNorm of each query and key head (one weight [d_head] shared by the heads), then the rotary
    (Qwen3-MoE). hook_q / hook_k hold the projections before the norm; hook_rot_q / hook_rot_k what enters
    the scores, after the norm and the rotary. The normed, not yet rotated heads have no hook."""

    qk_norm: ClassVar[type[RMSNorm]] = RMSNorm  # the q/k norms' class (where their weight is applied)

    @classmethod
    def param_terms(cls, cfg: MoeConfig, layer: int) -> tuple[ParamTerm, ...]:
        return (super().param_terms(cfg, layer) + under("q_norm", RMSNorm.param_terms(cfg.d_head))
                + under("k_norm", RMSNorm.param_terms(cfg.d_head)))

    def __init__(self, cfg: MoeConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        self.q_norm = self.qk_norm(cfg.d_head, cfg.norm_eps, hooked=False)
        self.k_norm = self.qk_norm(cfg.d_head, cfg.norm_eps, hooked=False)

    def position(self, q, k, cos, sin):
        return super().position(self.q_norm(q), self.k_norm(k), cos, sin)


class QKNormSlidingWindowAttention(QKNormBeforeRotaryAttention, SlidingWindowAttention):
    """QKNormBeforeRotaryAttention whose keys are narrowed to the layer's sliding window where cfg.window(layer)
    gives one (dots.llm1's and K-EXAONE's sliding layers); a layer without one attends to every earlier position."""


class QKNormNoRotaryAttention(QKNormSlidingWindowAttention):
    """RMSNorm of each query and key head and no rotary at all (NoPE: K-EXAONE's global layers, Kolibri 1's full
    layers), within the layer's window where it has one; hook_rot_q / hook_rot_k hold the normed heads that enter
    the scores."""

    def position(self, q, k, cos, sin):
        return self.q_norm(q), self.k_norm(k)
