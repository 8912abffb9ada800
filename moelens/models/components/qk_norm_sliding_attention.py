"""Attention with a per-head RMSNorm of the queries and keys before the rotary, on sliding-window and full layers,
and its no-rotary (NoPE) counterpart for the full layers of families that turn positions on the sliding layers only."""

from __future__ import annotations

from moelens.models.components.qk_norm_attention import QKNormBeforeRotaryAttention
from moelens.models.components.sliding_window_attention import SlidingWindowAttention


class QKNormSlidingWindowAttention(QKNormBeforeRotaryAttention, SlidingWindowAttention):
    """Each query and key head RMS-normed, then rotated (QKNormBeforeRotaryAttention), within the layer's
    cfg.window(layer) (SlidingWindowAttention; None: full causal attention)."""


class QKNormNoRotaryAttention(QKNormSlidingWindowAttention):
    """The same without the rotary: the normed heads enter the scores as they are (hook_rot_q / hook_rot_k hold
    them), no position information but the causal mask (Kolibri 1's full layers)."""

    def position(self, q, k, cos, sin):
        return self.q_norm(q), self.k_norm(k)
