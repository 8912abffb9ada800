"""HookedPhimoe: Phi-3.5-MoE (model_type phimoe).

What is special about the family:
- the router is the sparsemixer (moelens.models.components.router.SparseMixer): two slots, the largest logit
  and the largest of the rest, each weighted by a softmax over the logits near its own (router_jitter_noise);
  transformers routes every token to 2 experts whatever num_experts_per_tok says, so any other value is
  refused. Its training-only parts (Gumbel sampling, input jitter, the gradient estimator) are left out;
- LayerNorms with a bias (eps from rms_norm_eps) before attention, before the mixture and at the end; biases
  on q, k, v and o (attention_bias) and on the head (lm_head_bias); an optional sliding window;
- LongRoPE as transformers' PhimoeRotaryEmbedding computes it: the frequencies always divided by the
  short_factor (its forward recomputes them without a sequence length), cos and sin scaled by short_mscale,
  or by long_mscale when a forward's largest position + 1 passes original_max_position_embeddings.
The Hub's checkpoints spell the mixture block_sparse_moe with gate and experts w1 (gate), w3 (up), w2
(down); transformers 5 calls it mlp, with router and fused experts.
"""

from __future__ import annotations

import dataclasses

import torch
from jaxtyping import Float, Int

from moelens.config import HFConfig, MoeConfig, RopeConfig, common_fields, routed_fields
from moelens.models.base import HookedTransformer
from moelens.models.components import SparseMoe
from moelens.models.components.layer_norm import HookedLayerNorm
from moelens.models.components.rotary import Rotary
from moelens.models.components.router import SparseMixer
from moelens.models.components.sliding_window_attention import SlidingWindowAttention
from moelens.models.mixtral import block_sparse_experts
from moelens.models.recipe import Recipe, decoder_recipe
from moelens.models.sites import Entry, attention_projections, decoder_site_map, router_references
from moelens.sitemap import Reference, SiteMap, Weight

DEFAULT_ROPE_THETA = 1e6  # transformers' PhimoeConfig default
SPARSEMIXER_SLOTS = 2  # transformers' sparsemixer makes two slots whatever num_experts_per_tok says
ROPE_KINDS = ("default", "longrope")
# present in the Hub's config.json, read by transformers only in training
TRAINING_FIELDS = ("input_jitter_noise", "router_aux_loss_coef", "attention_dropout")


class LongRopeMscaleRotary(Rotary):
    """cos and sin from the short LongRoPE frequencies, scaled by short_mscale, or long_mscale when the forward's
    largest position + 1 is past original_max_position_embeddings (transformers' PhimoeRotaryEmbedding; one
    scale for the whole batch, as there). A plain rotary where the config has no LongRoPE."""

    def forward(
        self, positions: Int[torch.Tensor, "batch pos"], dtype: torch.dtype
    ) -> tuple[Float[torch.Tensor, "batch pos d_rot"], Float[torch.Tensor, "batch pos d_rot"]]:
        freqs = positions[..., None].float() * self.inv_freq(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = self.mscale(positions)
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)

    def mscale(self, positions: Int[torch.Tensor, "batch pos"]) -> float:
        rope = self.rope
        if rope.kind != "longrope":
            return self.attention_scaling
        past_original = positions.numel() and int(positions.max()) + 1 > rope.original_max_position_embeddings
        return rope.long_mscale if past_original else rope.short_mscale


class HookedPhimoe(HookedTransformer):
    model_type = "phimoe"
    rotary_class = LongRopeMscaleRotary

    @classmethod
    def recipe(cls, cfg: MoeConfig) -> Recipe:
        return decoder_recipe(cfg, SlidingWindowAttention, SparseMoe, SparseMixer, norm=HookedLayerNorm)

    @classmethod
    def site_map(cls, cfg: MoeConfig) -> SiteMap:
        skeleton = decoder_site_map(cfg, _layer_sites)
        extra = [Weight("ln_final.bias", ("model.norm.bias",))]
        if cfg.unembed_bias:
            extra.append(Weight("unembed.bias", ("lm_head.bias",)))
        return dataclasses.replace(skeleton, weights=skeleton.weights + tuple(extra))

    @classmethod
    def config_from_hf(cls, raw: dict) -> MoeConfig:
        hf = HFConfig(raw)
        fields = common_fields(
            hf, rms_norm_eps=1e-5, max_position_embeddings=4096 * 32, num_key_value_heads=8, hidden_size=4096,
            rope=phimoe_rope(hf),
        )
        n_layers = fields["n_layers"]
        n_experts = hf.integer("num_local_experts", 16, at_least=SPARSEMIXER_SLOTS)
        top_k = hf.integer("num_experts_per_tok", SPARSEMIXER_SLOTS, at_least=1)
        if top_k != SPARSEMIXER_SLOTS:
            raise ValueError(
                f"num_experts_per_tok = {top_k}: Phi-3.5-MoE's sparsemixer routes every token to exactly "
                f"{SPARSEMIXER_SLOTS} experts (transformers ignores other values); set it to {SPARSEMIXER_SLOTS}"
            )
        window = hf.integer("sliding_window", None, at_least=1)
        bias = hf.flag("attention_bias", False)
        return MoeConfig(
            **fields,
            **routed_fields(
                hf, (True,) * n_layers, n_experts, hf.integer("intermediate_size", 6400, at_least=1),
                num_experts_per_tok=SPARSEMIXER_SLOTS,
            ),
            family=cls.model_type,
            qkv_bias=bias,
            o_bias=bias,
            attention_windows=(window,) * n_layers,
            router_jitter_noise=hf.number("router_jitter_noise", 0.01, at_least=0),
            unembed_bias=hf.flag("lm_head_bias", False),
            fields_read=tuple(hf.read),
            fields_ignored=tuple(f for f in TRAINING_FIELDS if f in raw),
        )


def phimoe_rope(hf: HFConfig) -> RopeConfig:
    """The rotary as transformers' PhimoeRotaryEmbedding reads it: plain or LongRoPE (which needs both mscales);
    any other kind is refused, since its forward would read the LongRoPE mscales."""
    rope = hf.rope(theta=DEFAULT_ROPE_THETA)
    if rope.kind not in ROPE_KINDS:
        raise ValueError(f"rope type {rope.kind!r}: Phi-3.5-MoE's rotary is one of {list(ROPE_KINDS)}")
    return rope


def _layer_sites(cfg: MoeConfig, layer: int, src: str, dst: str) -> list[Entry]:
    hub, ours = f"{src}.block_sparse_moe", f"{src}.mlp"  # the Hub's spelling, transformers 5's
    norms = [
        Weight(f"{dst}.{moelens}.bias", (f"{src}.{theirs}.bias",))
        for moelens, theirs in (("ln1", "input_layernorm"), ("ln2", "post_attention_layernorm"))
    ]
    return attention_projections(cfg, src, dst) + norms + [
        Reference(f"{dst}.attn.hook_z", f"{src}.self_attn.o_proj", "in"),
        Weight(f"{dst}.mlp.router.weight", (f"{hub}.gate.weight", f"{ours}.router.weight")),
        block_sparse_experts(cfg, hub, ours, dst),
        *router_references(dst, f"{ours}.router"),
        Reference(f"{dst}.mlp.hook_routed_out", f"{ours}.experts"),
    ]

