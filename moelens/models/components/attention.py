"""Causal self-attention with grouped kv heads and optional biases, hooked everywhere; subclasses for the
families that norm queries and keys.

A subclass changes one step: `project` (x -> q, k, v per head), `position` (rotary, and whatever the
family does around it), `allowed` (narrowing the mask: a sliding window) or `softmax` (a sink); the scores,
pattern and output are `attend`, which every softmax attention here shares (latent attention too)."""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float
from torch import nn

from moelens.config import MoeConfig
from moelens.hooks.sites import site_hook
from moelens.models.components.attention_views import AttentionWeightViews
from moelens.models.components.norm import RMSNorm
from moelens.models.components.rotary import apply_rotary
from moelens.models.context import LayerInputs
from moelens.models.mixers.base import StateBytes, StateTensor, values_of
from moelens.models.terms import ParamTerm, linear, under
from moelens.state import KVState


class SplitInputs(NamedTuple):
    """Each head's own copy of the normed stream (TransformerLens's use_split_qkv_input / use_attn_in): queries
    [batch pos head d_model], keys and values [batch pos kv_head d_model]. Head h's projection reads only its
    row, so an edit of one head's input changes that head's q, k or v alone."""

    q: Float[torch.Tensor, "batch pos head d_model"]
    k: Float[torch.Tensor, "batch pos kv_head d_model"]
    v: Float[torch.Tensor, "batch pos kv_head d_model"]


def split_inputs(x: torch.Tensor | SplitInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(query input, key input, value input): the one stream three times, or each head's own."""
    return tuple(x) if isinstance(x, SplitInputs) else (x, x, x)


def linear_per_head(proj: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """proj(x) for a stream [batch pos d_model]; for per-head inputs [batch pos head d_model] head h's rows of
    the weight read head h's input only. Either way the flat [batch pos head*d_head] layout of proj(x)."""
    if x.dim() == 3:  # the plain path stays proj(x), bit for bit
        return proj(x)
    n_heads = x.shape[-2]
    weight = proj.weight.view(n_heads, -1, x.shape[-1])  # [head d_head d_model]
    out = torch.einsum("bphm,hdm->bphd", x, weight)
    if proj.bias is not None:
        out = out + proj.bias.view(n_heads, -1)
    return out.flatten(-2)


def project_out(attn: nn.Module, z: Float[torch.Tensor, "batch pos head d_head"]) -> Float[torch.Tensor, "batch pos d_model"]:
    """o_proj of the heads' outputs; with attn.use_attn_result, each head's share [batch pos head d_model]
    goes through attn.hook_result first and the output is their sum plus the bias (TransformerLens's
    use_attn_result: equal to the plain projection up to rounding)."""
    b, p, n_heads, d_head = z.shape
    if not attn.use_attn_result:
        return attn.o_proj(z.reshape(b, p, n_heads * d_head))
    weight = attn.o_proj.weight.view(-1, n_heads, d_head)  # [d_model head d_head]
    result = attn.hook_result(torch.einsum("bphd,mhd->bphm", z, weight))
    out = result.sum(-2)
    return out if attn.o_proj.bias is None else out + attn.o_proj.bias


def set_use_attn_result(attn: nn.Module, on: bool) -> None:
    """Switch hook_result on (the HookPoint exists and fires) or off (it is removed)."""
    attn.use_attn_result = on
    if on and not hasattr(attn, "hook_result"):
        attn.hook_result = site_hook("blocks.L.attn.hook_result")
    elif not on and hasattr(attn, "hook_result"):
        del attn.hook_result


def rows_contiguous(t: torch.Tensor) -> bool:
    """Each [.., n, d] matrix of t laid out row by row (a view of a KV buffer is, along its position axis)."""
    return t.stride(-1) == 1 and t.stride(-2) == t.shape[-1]


def attend(
    attn: nn.Module,
    q: Float[torch.Tensor, "batch head query d_head"],
    k: Float[torch.Tensor, "batch kv_head key d_head"],
    v: Float[torch.Tensor, "batch kv_head key d_v"],
    allowed: Bool[torch.Tensor, "batch 1 query key"],
) -> Float[torch.Tensor, "batch query head d_v"]:
    """Softmax attention of q over k and v under `allowed`, the heads of a kv group sharing its keys: the
    scores (attn.hook_attn_scores), the pattern (attn.softmax, then attn.hook_pattern) and the heads' outputs.

    With attn.backend "fused", a fusable attention and no hook on the scores or pattern, SDPA computes the
    same thing (rounding differently)."""
    b, n_heads, n_q, d = q.shape
    n_kv, n_k = k.shape[1], k.shape[2]
    group = n_heads // n_kv
    fused = attn.backend != "eager" and attn.fusable
    if not fused or attn.hook_attn_scores.has_hooks or attn.hook_pattern.has_hooks:
        # The heads of a kv group share its keys: fold them into the query axis instead of repeating keys and
        # values ([b, kv, group*q, d] @ [b, kv, d, k]); laid out row by row as transformers' repeat_kv leaves
        # them (bf16 GEMMs round by memory layout; a KV buffer's view already is)
        if group > 1 and not rows_contiguous(k):
            k, v = k.contiguous(), v.contiguous()
        q_grouped = q.reshape(b, n_kv, group * n_q, d)
        if attn.float32_scores:
            q_grouped, k = q_grouped.float(), k.float()
        scores = torch.matmul(q_grouped, k.transpose(2, 3)).mul_(attn.scale).view(b, n_heads, n_q, n_k)
        # in place: these are the largest tensors of the block. finfo.min, not -inf: a row with nothing
        # allowed must not turn into NaN
        scores = attn.hook_attn_scores(scores.masked_fill_(~allowed, torch.finfo(scores.dtype).min))
        # in the values' dtype (a no-op unless the scores are float32 in a half-precision model)
        pattern = attn.hook_pattern(attn.softmax(scores).to(v.dtype))
        z = torch.matmul(pattern.reshape(b, n_kv, group * n_q, n_k), v).view(b, n_heads, n_q, v.shape[-1])
        z = attn.rescale_heads(z, scores)
    else:  # nothing reads the pattern: the fused kernel gives the same result
        z = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=attn.scale, enable_gqa=group > 1)
    return z.transpose(1, 2)


class Attention(AttentionWeightViews, nn.Module):
    """Grouped-query attention with the rotary on q and k (Qwen2-MoE, Solar-Open, Mixtral)."""

    # hook_q / hook_k / hook_v are x @ W + b of the normed stream, so the weight views W_Q, W_K, W_V (and the
    # QK / OV circuits built on them) describe what the hooks hold; a subclass that norms a projection
    # before its hook lists only the others
    linear_hooks: ClassVar[tuple[str, ...]] = ("q", "k", "v")
    # q_proj, k_proj, v_proj map the normed stream to heads: the W_Q / W_K / W_V views exist
    per_head_projections: ClassVar[bool] = True
    use_attn_result = False  # model.set_use_attn_result switches it per instance
    # whether SDPA computes the same thing when nothing reads the scores or pattern (backend "fused")
    fusable: ClassVar[bool] = True
    # scores and softmax in float32 whatever the model's dtype, the pattern cast back to the values' (Flint)
    float32_scores: ClassVar[bool] = False

    q_proj_factor: ClassVar[int] = 1  # q_proj's rows per head and d_head (2: a query and an output gate)

    @classmethod
    def param_terms(cls, cfg: MoeConfig, layer: int) -> tuple[ParamTerm, ...]:
        """q, k, v, o (biases where the config has them); a subclass adds its own."""
        q, kv = cfg.n_heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head
        return (linear("q_proj", cfg.d_model, q * cls.q_proj_factor, cfg.qkv_bias, "attention")
                + linear("k_proj", cfg.d_model, kv, cfg.qkv_bias, "attention")
                + linear("v_proj", cfg.d_model, kv, cfg.qkv_bias, "attention")
                + linear("o_proj", q, cfg.d_model, cfg.o_bias, "attention"))

    def __init__(self, cfg: MoeConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv_heads, self.d_head = cfg.n_heads, cfg.n_kv_heads, cfg.d_head
        self.scale = cfg.d_head**-0.5
        # "eager" (default): explicit scores and pattern, so results do not depend on which hooks are on;
        # "fused": SDPA whenever no hook reads the scores or pattern (faster, rounds differently).
        self.backend = "eager"
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * cfg.d_head, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.d_head, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.d_head, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.d_head, cfg.d_model, bias=cfg.o_bias)
        self.hook_q = site_hook("blocks.L.attn.hook_q")
        self.hook_k = site_hook("blocks.L.attn.hook_k")
        self.hook_v = site_hook("blocks.L.attn.hook_v")
        self.hook_rot_q = site_hook("blocks.L.attn.hook_rot_q")
        self.hook_rot_k = site_hook("blocks.L.attn.hook_rot_k")
        self.hook_attn_scores = site_hook("blocks.L.attn.hook_attn_scores")
        self.hook_pattern = site_hook("blocks.L.attn.hook_pattern")
        self.hook_z = site_hook("blocks.L.attn.hook_z")

    block_attribute: ClassVar[str] = "attn"  # TransformerLens's blocks.L.attn.*

    def forward(
        self, x: Float[torch.Tensor, "batch pos d_model"] | SplitInputs, inputs: LayerInputs
    ) -> Float[torch.Tensor, "batch pos d_model"]:
        """With a state in `inputs`, x holds only the new positions: their keys and values are appended to it
        and the queries attend to every cached position too (so scores and pattern are [batch head new all]).
        x is the normed stream, or SplitInputs (each head's own copy of it)."""
        q, k, v = self.project(x)
        return project_out(self, self.hook_z(self.heads(q, k, v, inputs)))

    def heads(
        self,
        q: Float[torch.Tensor, "batch pos head d_head"],
        k: Float[torch.Tensor, "batch pos kv_head d_head"],
        v: Float[torch.Tensor, "batch pos kv_head d_head"],
        inputs: LayerInputs,
    ) -> Float[torch.Tensor, "batch pos head d_head"]:
        """The heads' outputs from the projections: position (and its hooks), the cache, attend."""
        q, k = self.position_at(q, k, inputs)
        q, k = self.hook_rot_q(q), self.hook_rot_k(k)
        if inputs.state is not None:  # cached after the hooks, so an edit of hook_rot_k / hook_v also holds later
            k, v = inputs.state.append(k, v)
        return attend(self, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.allowed(inputs))

    def allowed(self, inputs: LayerInputs) -> Bool[torch.Tensor, "batch 1 query key"]:
        """The keys each query may attend to: causal, padding masked (a subclass narrows it)."""
        return inputs.allowed

    def new_state(self, reserve: int = 0) -> KVState:
        return KVState(reserve)

    @classmethod
    def state_tensors(cls, cfg: MoeConfig) -> tuple[StateTensor, ...]:
        """Keys and values, per token, in the model's dtype."""
        return (StateTensor("kv", cls.cached_per_token(cfg), "token"),)

    @classmethod
    def state_bytes(cls, cfg: MoeConfig) -> StateBytes:
        return values_of(cls.state_tensors(cfg))

    def softmax(self, scores: Float[torch.Tensor, "batch head query key"]) -> Float[torch.Tensor, "batch head query key"]:
        """The pattern from the masked scores: a float32 softmax over the keys, in the scores' dtype."""
        return F.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)

    def rescale_heads(
        self, z: Float[torch.Tensor, "batch head query d_v"], scores: Float[torch.Tensor, "batch head query key"]
    ) -> Float[torch.Tensor, "batch head query d_v"]:
        """The heads' outputs after pattern @ v, given the masked scores; a sink applied to the output rather
        than inside the softmax (GraniteMoeSWA) scales them here."""
        return z

    @staticmethod
    def cached_per_token(cfg: MoeConfig) -> int:
        """Values the KV cache holds per token and layer: keys and values of every kv head."""
        return 2 * cfg.n_kv_heads * cfg.d_head

    def input_projections(self) -> list[nn.Linear]:
        """The linear maps that read the block's normed input (what fold_ln scales)."""
        return [self.q_proj, self.k_proj, self.v_proj]

    def project(
        self, x: Float[torch.Tensor, "batch pos d_model"] | SplitInputs
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries [batch pos head d_head], keys and values [batch pos kv_head d_head], each hooked."""
        xq, xk, xv = split_inputs(x)
        b, p = xq.shape[:2]
        q = self.hook_q(linear_per_head(self.q_proj, xq).view(b, p, self.n_heads, self.d_head))
        k = self.hook_k(linear_per_head(self.k_proj, xk).view(b, p, self.n_kv_heads, self.d_head))
        v = self.hook_v(linear_per_head(self.v_proj, xv).view(b, p, self.n_kv_heads, self.d_head))
        return q, k, v

    def position_at(self, q: torch.Tensor, k: torch.Tensor, inputs: LayerInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """`position` with the layer's inputs' rotary tables; a family whose step reads more of the inputs (a
        query's index, as Llama 4's attention temperature) overrides this."""
        return self.position(q, k, inputs.cos, inputs.sin)

    def position(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What enters the scores: the rotated queries and keys."""
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


class NoPositionAttention(Attention):
    """Grouped-query attention without positional encoding (Nemotron-H's attention layers, Granite-4.0-H's
    "nope"): hook_rot_q and hook_rot_k hold q and k as projected."""

    def position(self, q, k, cos, sin):
        return q, k


class QKNormAfterRotaryAttention(Attention):
    """RMSNorm of each rotated query and key head, one weight [d_head] shared by the heads (Hunyuan)."""

    @classmethod
    def param_terms(cls, cfg: MoeConfig, layer: int) -> tuple[ParamTerm, ...]:
        return (super().param_terms(cfg, layer) + under("q_norm", RMSNorm.param_terms(cfg.d_head))
                + under("k_norm", RMSNorm.param_terms(cfg.d_head)))

    def __init__(self, cfg: MoeConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        self.q_norm = RMSNorm(cfg.d_head, cfg.norm_eps, hooked=False)
        self.k_norm = RMSNorm(cfg.d_head, cfg.norm_eps, hooked=False)

    def position(self, q, k, cos, sin):
        q, k = super().position(q, k, cos, sin)
        return self.q_norm(q), self.k_norm(k)
