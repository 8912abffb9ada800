"""HookedMixtral: Mixtral-8x7B, Mixtral-8x22B (model_type mixtral).

What is special about the family: no shared expert and no q/k/v bias; a router whose logits are in the
model's dtype and whose softmax top-k weights are always renormalised and stay float32
(SoftmaxTopKFloat32Weights); an optional sliding window (`sliding_window`: a query attends to the last
`sliding_window` positions only; null in the released checkpoints). The Hub's checkpoints spell the mixture
`block_sparse_moe` with experts w1 (gate), w3 (up), w2 (down); transformers 5 calls it `mlp`, with fused
experts. Like transformers, it reads no norm_topk_prob; router_jitter_noise only matters in training.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moelens.config import HFConfig, MoeConfig
from moelens.models.base import HookedTransformer
from moelens.models.components import Components, SparseMoe
from moelens.models.components.router_float32_weights import SoftmaxTopKFloat32Weights
from moelens.models.components.sliding_window_attention import SlidingWindowAttention
from moelens.models.sites import Entry, attention_projections, decoder_site_map, router_references, routed_experts
from moelens.sitemap import ExpertStack, PerExpertKeys, Reference, SiteMap, Weight

# the Hub's per-expert names (Mistral's): w1 gate, w3 up, w2 down
W1_W3_W2 = PerExpertKeys("{e}.w1.weight", "{e}.w3.weight", "{e}.w2.weight")
DEFAULT_ROPE_THETA = 1e6  # transformers' MixtralConfig default


@dataclass(frozen=True)
class MixtralConfig(MoeConfig):
    sliding_window: int | None = None  # attend to the last this many positions (None: all)


class HookedMixtral(HookedTransformer):
    model_type = "mixtral"
    components = Components(attention=SlidingWindowAttention, moe=SparseMoe, router=SoftmaxTopKFloat32Weights)

    @classmethod
    def site_map(cls, cfg: MoeConfig) -> SiteMap:
        return decoder_site_map(cfg, _layer_sites)

    @classmethod
    def config_from_hf(cls, raw: dict) -> MixtralConfig:
        hf = HFConfig(raw)
        n_layers = hf.integer("num_hidden_layers", at_least=1)
        n_heads = hf.integer("num_attention_heads", at_least=1)
        n_experts = hf.integer("num_local_experts", 8, at_least=1)
        top_k = hf.integer("num_experts_per_tok", 2, at_least=1, at_most=n_experts)
        window = hf.integer("sliding_window", None, at_least=1)
        rope = hf.rope()
        if hf.rope_section().opt("rope_theta") is None and raw.get("rope_theta") is None:
            rope = dataclasses.replace(rope, theta=DEFAULT_ROPE_THETA)
        return MixtralConfig(
            family=cls.model_type,
            d_model=hf.integer("hidden_size", at_least=1),
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=hf.integer("num_key_value_heads", n_heads, at_least=1),
            d_head=hf.head_dim(),
            d_vocab=hf.integer("vocab_size", at_least=1),
            norm_eps=hf.number("rms_norm_eps", 1e-5, at_least=0),
            rope=rope,
            max_position_embeddings=hf.integer("max_position_embeddings", 4096 * 32, at_least=1),
            act_fn=hf.text("hidden_act", "silu"),
            moe_layers=(True,) * n_layers,
            n_experts=n_experts,
            top_k=(top_k,) * n_layers,
            d_expert=hf.integer("intermediate_size", at_least=1),
            norm_topk_prob=True,
            sliding_window=window,
            attention_windows=(window,) * n_layers,
            tie_word_embeddings=hf.flag("tie_word_embeddings", False),
            fields_read=tuple(hf.read),
        )


def _layer_sites(cfg: MoeConfig, layer: int, src: str, dst: str) -> list[Entry]:
    hub, ours = f"{src}.block_sparse_moe", f"{src}.mlp"  # the Hub's spelling, transformers 5's
    return attention_projections(cfg, src, dst) + [
        Reference(f"{dst}.attn.hook_z", f"{src}.self_attn.o_proj", "in"),
        Weight(f"{dst}.mlp.router.weight", (f"{hub}.gate.weight", f"{ours}.gate.weight")),
        _experts(cfg, hub, ours, dst),
        *router_references(dst, f"{ours}.gate"),
        Reference(f"{dst}.mlp.hook_routed_out", f"{ours}.experts"),
    ]


def _experts(cfg: MoeConfig, hub: str, ours: str, dst: str) -> ExpertStack:
    """Per-expert w1/w3/w2 under either prefix, the Hub's first (what a new checkpoint is written in);
    transformers 5's fused pair under mlp.experts."""
    stack = routed_experts(cfg, (f"{ours}.experts", f"{hub}.experts"), dst, (W1_W3_W2,))
    return dataclasses.replace(stack, per_expert=stack.per_expert[::-1])
