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

import torch
from jaxtyping import Float

from moelens.config import HFConfig, MoeConfig, common_fields, routed_fields
from moelens.models.base import HookedTransformer
from moelens.models.components import SoftmaxTopK, SparseMoe
from moelens.models.components.sliding_window_attention import SlidingWindowAttention
from moelens.models.recipe import Recipe, decoder_recipe
from moelens.models.sites import Entry, attention_projections, decoder_site_map, router_references, routed_experts
from moelens.sitemap import ExpertStack, PerExpertKeys, Reference, SiteMap, Weight

# the Hub's per-expert names (Mistral's): w1 gate, w3 up, w2 down
W1_W3_W2 = PerExpertKeys("{e}.w1.weight", "{e}.w3.weight", "{e}.w2.weight")
DEFAULT_ROPE_THETA = 1e6  # transformers' MixtralConfig default


@dataclass(frozen=True)
class MixtralConfig(MoeConfig):
    sliding_window: int | None = None  # attend to the last this many positions (None: all)


class SoftmaxTopKFloat32Weights(SoftmaxTopK):
    """Mixtral's router: logits in the weight's dtype (the model's), softmax in float32 over all experts, top-k,
    the k weights renormalised to sum to 1 when norm_topk_prob (always, in Mixtral) and kept float32: in a
    bfloat16 model the expert outputs are scaled by float32 weights and the slot sum runs in float32."""

    def weights(
        self, scores: torch.Tensor, indices: torch.Tensor, logits_dtype: torch.dtype
    ) -> Float[torch.Tensor, "... top_k"]:
        w = scores.gather(-1, indices)
        if self.norm_topk_prob:  # as the reference: the plain sum, no epsilon
            w = w / w.sum(-1, keepdim=True)
        return w


class HookedMixtral(HookedTransformer):
    model_type = "mixtral"

    @classmethod
    def recipe(cls, cfg: MoeConfig) -> Recipe:
        return decoder_recipe(cfg, SlidingWindowAttention, SparseMoe, SoftmaxTopKFloat32Weights)

    @classmethod
    def site_map(cls, cfg: MoeConfig) -> SiteMap:
        return decoder_site_map(cfg, _layer_sites)

    @classmethod
    def config_from_hf(cls, raw: dict) -> MixtralConfig:
        hf = HFConfig(raw)
        fields = common_fields(hf, rms_norm_eps=1e-5, max_position_embeddings=4096 * 32, rope_theta=DEFAULT_ROPE_THETA)
        n_layers = fields["n_layers"]
        n_experts = hf.integer("num_local_experts", 8, at_least=1)
        window = hf.integer("sliding_window", None, at_least=1)
        return MixtralConfig(
            **fields,
            **routed_fields(
                hf, (True,) * n_layers, n_experts, hf.integer("intermediate_size", at_least=1), num_experts_per_tok=2
            ),
            family=cls.model_type,
            norm_topk_prob=True,
            sliding_window=window,
            attention_windows=(window,) * n_layers,
            fields_read=tuple(hf.read),
        )


def _layer_sites(cfg: MoeConfig, layer: int, src: str, dst: str) -> list[Entry]:
    hub, ours = f"{src}.block_sparse_moe", f"{src}.mlp"  # the Hub's spelling, transformers 5's
    return attention_projections(cfg, src, dst) + [
        Reference(f"{dst}.attn.hook_z", f"{src}.self_attn.o_proj", "in"),
        Weight(f"{dst}.mlp.router.weight", (f"{hub}.gate.weight", f"{ours}.gate.weight")),
        block_sparse_experts(cfg, hub, ours, dst),
        *router_references(dst, f"{ours}.gate"),
        Reference(f"{dst}.mlp.hook_routed_out", f"{ours}.experts"),
    ]


def block_sparse_experts(cfg: MoeConfig, hub: str, ours: str, dst: str) -> ExpertStack:
    """Per-expert w1/w3/w2 under either prefix, the Hub's first (what a new checkpoint is written in);
    transformers 5's fused pair under mlp.experts."""
    stack = routed_experts(cfg, (f"{ours}.experts", f"{hub}.experts"), dst, (W1_W3_W2,))
    return dataclasses.replace(stack, per_expert=stack.per_expert[::-1])
