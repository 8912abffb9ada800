"""Multi-head latent attention (MLA, DeepSeek-V2/V3): queries through an optional low-rank bottleneck, keys and
values decompressed from one shared latent, the rotary on a part of each head only.

    q latent  = RMSNorm(q_a_proj(x))                        [batch pos q_lora_rank]  (when q_lora_rank is set)
    q         = q_b_proj(q latent) (or q_proj(x))           [batch pos head nope+rope]
    kv latent, k_rope = split(kv_a_proj_with_mqa(x))        [batch pos kv_lora_rank], [batch pos rope]
    k_nope, v = split(kv_b_proj(RMSNorm(kv latent)))        per head: [nope], [v_head_dim]
    k         = [k_nope | k_rope (shared by every head)]
    q, k      : the rotary on their last qk_rope_head_dim dims; scores scaled by qk_head_dim**-0.5 (times YaRN's
                mscale(factor, mscale_all_dim)**2 where the rotary is YaRN with mscale_all_dim)

The config needs (beyond MoeConfig): q_lora_rank (None: a plain q_proj), kv_lora_rank, qk_nope_head_dim,
qk_rope_head_dim, v_head_dim; cfg.d_head is qk_nope_head_dim + qk_rope_head_dim.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import nn

from moelens.config import RopeConfig
from moelens.hooks.sites import site_hook
from moelens.models.components.attention import attend, project_out, rows_contiguous
from moelens.models.components.attention_views import AttentionWeightViews
from moelens.models.context import LayerInputs
from moelens.models.mixers.base import StateBytes, StateTensor, values_of
from moelens.models.terms import ParamTerm, linear, under
from moelens.state import KVState
from moelens.models.components.norm import RMSNorm
from moelens.models.components.rotary import apply_rotary, apply_rotary_interleaved

# transformers builds q_a_layernorm and kv_a_layernorm with its RMSNorm's default eps, not rms_norm_eps
LATENT_NORM_EPS = 1e-6


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def latent_softmax_scale(rope: RopeConfig, qk_head_dim: int) -> float:
    """qk_head_dim**-0.5, times mscale(factor, mscale_all_dim) twice for a scaled rotary with mscale_all_dim
    (transformers' yarn_apply_mscale, in its order of operations)."""
    scale = qk_head_dim ** (-0.5)
    if rope.kind != "default" and rope.mscale_all_dim:
        mscale = yarn_mscale(rope.factor, rope.mscale_all_dim)
        scale = scale * mscale * mscale
    return scale


class MultiHeadLatentAttention(AttentionWeightViews, nn.Module):
    """MLA with TransformerLens's sites at their per-head meaning (q, k after decompression and before the
    rotary; rot_q, rot_k what enters the scores; v and z v_head_dim wide) plus the latents.

    With rope_interleave (cfg.rope.interleaved) the rotated dims are stored as interleaved pairs: hook_q,
    hook_k and hook_k_rope hold them in the checkpoint's interleaved order, hook_rot_q and hook_rot_k in
    transformers' de-interleaved order (the same permutation of q and k: the scores do not change).
    The KV cache holds hook_rot_k and hook_v (every head's decompressed keys and values)."""

    # keys and values come out of a normed latent: no per-head linear map of the stream (no W_K, W_V views)
    linear_hooks: ClassVar[tuple[str, ...]] = ()
    per_head_projections: ClassVar[bool] = False
    use_attn_result = False  # model.set_use_attn_result switches it per instance (o_proj is per head here too)

    @classmethod
    def param_terms(cls, cfg, layer: int) -> tuple[ParamTerm, ...]:
        d_model, n_heads, d_head = cfg.d_model, cfg.n_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        if cfg.q_lora_rank is None:
            q = linear("q_proj", d_model, n_heads * d_head, False, "attention")
        else:
            q = (linear("q_a_proj", d_model, cfg.q_lora_rank, cfg.qkv_bias, "attention")
                 + under("q_a_layernorm", RMSNorm.param_terms(cfg.q_lora_rank))
                 + linear("q_b_proj", cfg.q_lora_rank, n_heads * d_head, False, "attention"))
        return (q + linear("kv_a_proj_with_mqa", d_model, cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.qkv_bias, "attention")
                + under("kv_a_layernorm", RMSNorm.param_terms(cfg.kv_lora_rank))
                + linear("kv_b_proj", cfg.kv_lora_rank, n_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), False, "attention")
                + linear("o_proj", n_heads * cfg.v_head_dim, d_model, cfg.o_bias, "attention"))

    def __init__(self, cfg, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads = cfg.n_heads
        self.d_nope, self.d_rope, self.d_v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.d_head = self.d_nope + self.d_rope
        self.q_lora_rank, self.kv_lora_rank = cfg.q_lora_rank, cfg.kv_lora_rank
        self.scale = latent_softmax_scale(cfg.rope, self.d_head)
        self.rotate = apply_rotary_interleaved if cfg.rope.interleaved else apply_rotary
        self.backend = "eager"  # as Attention: "fused" uses SDPA where no hook reads the scores or pattern
        d_model, n_heads = cfg.d_model, cfg.n_heads
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(d_model, n_heads * self.d_head, bias=False)
        else:
            self.q_a_proj = nn.Linear(d_model, self.q_lora_rank, bias=cfg.qkv_bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS, hooked=False)
            self.q_b_proj = nn.Linear(self.q_lora_rank, n_heads * self.d_head, bias=False)
            self.hook_q_latent = site_hook("blocks.L.attn.hook_q_latent")
        self.kv_a_proj_with_mqa = nn.Linear(d_model, self.kv_lora_rank + self.d_rope, bias=cfg.qkv_bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS, hooked=False)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, n_heads * (self.d_nope + self.d_v), bias=False)
        self.o_proj = nn.Linear(n_heads * self.d_v, d_model, bias=cfg.o_bias)
        self.hook_q = site_hook("blocks.L.attn.hook_q", "latent")
        self.hook_kv_latent = site_hook("blocks.L.attn.hook_kv_latent")
        self.hook_k_rope = site_hook("blocks.L.attn.hook_k_rope")
        self.hook_k = site_hook("blocks.L.attn.hook_k", "latent")
        self.hook_v = site_hook("blocks.L.attn.hook_v", "latent")
        self.hook_rot_q = site_hook("blocks.L.attn.hook_rot_q", "latent")
        self.hook_rot_k = site_hook("blocks.L.attn.hook_rot_k", "latent")
        self.hook_attn_scores = site_hook("blocks.L.attn.hook_attn_scores")
        self.hook_pattern = site_hook("blocks.L.attn.hook_pattern")
        self.hook_z = site_hook("blocks.L.attn.hook_z", "latent")

    block_attribute: ClassVar[str] = "attn"
    fusable: ClassVar[bool] = True
    float32_scores: ClassVar[bool] = False  # scores in the model's dtype (attend reads it)

    def forward(
        self, x: Float[torch.Tensor, "batch pos d_model"], inputs: LayerInputs
    ) -> Float[torch.Tensor, "batch pos d_model"]:
        """As Attention.forward: with a state, x holds only the new positions and the cached ones are attended to."""
        q_latent, q = self.project_query(x)
        k, v = self.project_key_value(x)
        q, k = self.position(q, k, inputs.cos, inputs.sin)
        q, k = self.hook_rot_q(self.scale_queries(q, inputs.positions)), self.hook_rot_k(k)
        if inputs.state is not None:  # cached after the hooks, so an edit of hook_rot_k / hook_v also holds later
            k, v = inputs.state.append(k, v)
        allowed = self.allowed(x, q_latent, inputs)
        # laid out as transformers' (q and k [batch head pos d] row by row, v a view): the same matmuls, bit for bit
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = (t if rows_contiguous(t) else t.contiguous() for t in (q, k))
        return project_out(self, self.hook_z(self.gate_heads(x, attend(self, q, k, v, allowed))))

    def allowed(
        self, x: Float[torch.Tensor, "batch pos d_model"], q_latent: Float[torch.Tensor, "batch pos q_lora_rank"] | None,
        inputs: LayerInputs,
    ) -> Bool[torch.Tensor, "batch 1 query key"]:
        """The keys each query may attend to: causal, padding masked. A subclass narrows it and may read the
        normed stream and the q latent (DeepSeek Sparse Attention's indexer); called after the cache append."""
        return inputs.allowed

    def softmax(self, scores: Float[torch.Tensor, "batch head query key"]) -> Float[torch.Tensor, "batch head query key"]:
        return F.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)

    def gate_heads(
        self, x: Float[torch.Tensor, "batch pos d_model"], z: Float[torch.Tensor, "batch pos head v_head_dim"]
    ) -> Float[torch.Tensor, "batch pos head v_head_dim"]:
        """The heads' outputs as o_proj reads them: unchanged here; a subclass gates them by the stream (Ling)."""
        return z

    def rescale_heads(self, z: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return z  # no sink on the output

    def new_state(self, reserve: int = 0) -> KVState:
        return KVState(reserve)

    @classmethod
    def state_tensors(cls, cfg) -> tuple[StateTensor, ...]:
        """Decompressed keys and values (and an indexer's keys), per token, in the model's dtype."""
        return (StateTensor("kv", cls.cached_per_token(cfg), "token"),)

    @classmethod
    def state_bytes(cls, cfg) -> StateBytes:
        return values_of(cls.state_tensors(cfg))

    @staticmethod
    def cached_per_token(cfg) -> int:
        """Values the KV cache holds per token and layer: every head's decompressed key and value."""
        return cfg.n_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)

    def input_projections(self) -> list[nn.Linear]:
        """The linear maps that read the block's normed input (what fold_ln scales)."""
        first_q = self.q_proj if self.q_lora_rank is None else self.q_a_proj
        return [first_q, self.kv_a_proj_with_mqa]

    def project(self, x: Float[torch.Tensor, "batch pos d_model"]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries and keys [batch pos head d_head], values [batch pos head v_head_dim], each hooked."""
        q = self.project_query(x)[1]
        return (q, *self.project_key_value(x))

    def project_query(
        self, x: Float[torch.Tensor, "batch pos d_model"]
    ) -> tuple[Float[torch.Tensor, "batch pos q_lora_rank"] | None, Float[torch.Tensor, "batch pos head d_head"]]:
        """(the hooked q latent, None without the bottleneck; the hooked queries)."""
        b, p, _ = x.shape
        latent = None
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            latent = self.hook_q_latent(self.q_a_layernorm(self.q_a_proj(x)))
            q = self.q_b_proj(latent)
        return latent, self.hook_q(q.view(b, p, self.n_heads, self.d_head))

    def project_key_value(self, x: Float[torch.Tensor, "batch pos d_model"]) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys [batch pos head d_head] and values [batch pos head v_head_dim], each hooked."""
        b, p, _ = x.shape
        kv_latent, k_rope = torch.split(self.kv_a_proj_with_mqa(x), [self.kv_lora_rank, self.d_rope], dim=-1)
        kv_latent = self.hook_kv_latent(self.kv_a_layernorm(kv_latent))
        k_rope = self.hook_k_rope(k_rope)
        kv = self.kv_b_proj(kv_latent).view(b, p, self.n_heads, self.d_nope + self.d_v)
        k_nope, v = torch.split(kv, [self.d_nope, self.d_v], dim=-1)
        k = torch.cat((k_nope, k_rope[:, :, None, :].expand(b, p, self.n_heads, self.d_rope)), dim=-1)
        return self.hook_k(k), self.hook_v(v)

    def position(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary on the last qk_rope_head_dim dims of each query and key head; the nope dims pass."""
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def scale_queries(
        self, q: Float[torch.Tensor, "batch pos head d_head"], positions: Int[torch.Tensor, "batch pos"]
    ) -> Float[torch.Tensor, "batch pos head d_head"]:
        """The rotated queries as they enter the scores: unchanged here; a subclass scales them by position
        (Mistral Small 4)."""
        return q

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        nope, rope = torch.split(x, [self.d_nope, self.d_rope], dim=-1)
        return torch.cat((nope, self.rotate(rope, cos, sin)), dim=-1)

    def extra_repr(self) -> str:
        return (
            f"n_heads={self.n_heads}, q_lora_rank={self.q_lora_rank}, kv_lora_rank={self.kv_lora_rank}, "
            f"qk_nope_head_dim={self.d_nope}, qk_rope_head_dim={self.d_rope}, v_head_dim={self.d_v}, "
            f"scale={self.scale:.6g}, backend={self.backend}"
        )
