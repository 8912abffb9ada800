"""HookedLfm2Moe: Liquid AI's LFM2-8B-A1B (model_type lfm2_moe).

What is special about the family:
- hybrid layers (layer_types, required: transformers builds nothing without it): "conv" layers mix tokens with
  a gated short convolution (moelens.models.mixers.short_conv: y = C * conv(B * x), its sites blocks.L.mixer.*,
  its state the convolution window), "full_attention" layers with softmax attention, a per-head RMSNorm of the
  queries and keys before the rotary (q_layernorm / k_layernorm);
- the first num_dense_layers layers have a dense SwiGLU MLP (w1 gate, w3 up, w2 down), the others a mixture
  without a shared expert;
- the router (Lfm2SigmoidTopK) takes the sigmoid of the logits in the model's dtype; the choice is the top-k of
  those scores plus the float32 expert_bias where use_expert_bias (Lfm2BiasedSigmoidTopK), and each chosen
  expert's weight is its unbiased score, divided by the chosen ones' sum + 1e-6 when norm_topk_prob, times
  routed_scaling_factor, in the model's dtype;
- the final norm is named embedding_norm; the norms are operator_norm (before the token mixer) and ffn_norm.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int

from moelens.config import HFConfig, MoeConfig, check_layer_kinds, routed_fields
from moelens.models.base import HookedTransformer
from moelens.models.components import SparseMoe
from moelens.models.components.qk_norm_attention import QKNormBeforeRotaryAttention
from moelens.models.components.router import TopKRouter
from moelens.models.mixers.short_conv import ShortConvMixer
from moelens.models.recipe import Dense, LayerSpec, Mixture, Recipe
from moelens.models.sites import Entry, router_references, routed_experts
from moelens.models.terms import ParamTerm
from moelens.sitemap import PerExpertKeys, Reference, SiteMap, Weight

LAYER_TYPES = ("conv", "full_attention")
W1_W3_W2 = PerExpertKeys("{e}.w1.weight", "{e}.w3.weight", "{e}.w2.weight")  # gate, up, down


@dataclass(frozen=True)
class Lfm2MoeConfig(MoeConfig):
    """MoeConfig plus each layer's kind (LAYER_TYPES) and the short convolution's sizes (ShortConvConfig's names)."""

    layer_types: tuple[str, ...] = ()
    conv_kernel: int = 3
    conv_bias: bool = False
    use_expert_bias: bool = True  # the router chooses on scores + expert_bias (Lfm2BiasedSigmoidTopK)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_layer_kinds(self.layer_types, self.n_layers, LAYER_TYPES)


class Lfm2SigmoidTopK(TopKRouter):
    """LFM2's rule without an expert bias: logits and their sigmoid in the weight's dtype (the model's); the top-k
    of the scores (sorted); each chosen expert's weight its score, divided by the chosen ones' sum + 1e-6 when
    norm_topk_prob, times routed_scaling_factor, in the scores' dtype."""

    scoring = "sigmoid"
    scores_form = "sigmoid_model_dtype"
    probs_form = "sigmoid"

    def __init__(self, cfg: MoeConfig, top_k: int) -> None:
        super().__init__(cfg, top_k)
        self.routed_scaling_factor = cfg.routed_scaling_factor

    def logits(self, x: Float[torch.Tensor, "... d_model"]) -> Float[torch.Tensor, "... n_experts"]:
        return F.linear(x.to(self.weight.dtype), self.weight)

    def scores(self, logits: torch.Tensor) -> Float[torch.Tensor, "... n_experts"]:
        return logits.sigmoid()

    def choose(self, choice_scores: Float[torch.Tensor, "... n_experts"]) -> Int[torch.Tensor, "... top_k"]:
        return torch.topk(choice_scores, self.top_k, dim=-1).indices

    def weights(
        self, scores: torch.Tensor, indices: torch.Tensor, logits_dtype: torch.dtype
    ) -> Float[torch.Tensor, "... top_k"]:
        w = scores.gather(-1, indices).to(logits_dtype)
        if self.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-6)
        return w * self.routed_scaling_factor

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, routed_scaling_factor={self.routed_scaling_factor}"


class Lfm2BiasedSigmoidTopK(Lfm2SigmoidTopK):
    """Lfm2SigmoidTopK choosing on scores + e_score_correction_bias (the checkpoint's expert_bias, a buffer kept
    float32, so the choice scores are float32); the weights are the unbiased scores, as without it."""

    choice_bias = True
    float32_buffers = ("e_score_correction_bias",)

    @classmethod
    def param_terms(cls, cfg: MoeConfig) -> tuple[ParamTerm, ...]:
        bias = ParamTerm("e_score_correction_bias", (cfg.n_experts,), "routers", True, buffer=True)
        return (*super().param_terms(cfg), bias)

    def __init__(self, cfg: MoeConfig, top_k: int) -> None:
        super().__init__(cfg, top_k)
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_experts))

    def choice_scores(self, scores: torch.Tensor) -> torch.Tensor:
        return scores + self.e_score_correction_bias


def read_layer_types(hf: HFConfig, n_layers: int) -> tuple[str, ...]:
    kinds = hf.opt("layer_types")
    if kinds is None:
        raise ValueError("layer_types is missing: each layer's kind ('conv' or 'full_attention') must be listed "
                         "(transformers' Lfm2MoeConfig has no default for it)")
    if not isinstance(kinds, list) or not all(isinstance(k, str) for k in kinds):
        raise ValueError(f"layer_types = {kinds!r}; expected a list of layer kinds ({', '.join(LAYER_TYPES)})")
    if len(kinds) != n_layers:
        raise ValueError(f"layer_types has {len(kinds)} entries, num_hidden_layers is {n_layers}")
    return tuple(kinds)


class HookedLfm2Moe(HookedTransformer):
    model_type = "lfm2_moe"

    @classmethod
    def recipe(cls, cfg: Lfm2MoeConfig) -> Recipe:
        router = Lfm2BiasedSigmoidTopK if cfg.use_expert_bias else Lfm2SigmoidTopK
        mixture = Mixture(SparseMoe, router)
        layers = tuple(
            LayerSpec(ShortConvMixer if kind == "conv" else QKNormBeforeRotaryAttention, mixture if is_moe else Dense())
            for kind, is_moe in zip(cfg.layer_types, cfg.moe_layers, strict=True)
        )
        return Recipe(layers)

    @classmethod
    def config_from_hf(cls, raw: dict) -> Lfm2MoeConfig:
        hf = HFConfig(raw)
        n_layers = hf.integer("num_hidden_layers", 32, at_least=1)
        kinds = read_layer_types(hf, n_layers)
        n_dense = hf.integer("num_dense_layers", 2, at_least=0)
        moe_layers = tuple(layer >= n_dense for layer in range(n_layers))
        any_moe, any_dense = any(moe_layers), not all(moe_layers)
        n_experts = hf.integer("num_experts", 32, at_least=1) if any_moe else 0
        d_expert = hf.integer("moe_intermediate_size", 1792, at_least=1) if any_moe else 0
        rope = hf.rope(1.0, 1000000.0)
        if rope.partial_rotary_factor != 1.0:
            raise ValueError(f"partial_rotary_factor = {rope.partial_rotary_factor}: transformers' Lfm2Moe rotary "
                             "turns every dimension of the head (it reads no partial_rotary_factor)")
        # the Hub's first configs spell tie_word_embeddings tie_embedding, which wins where given (as in transformers)
        tie = hf.flag("tie_embedding") if hf.opt("tie_embedding") is not None else hf.flag("tie_word_embeddings", True)
        d_model, n_heads = hf.integer("hidden_size", 2048, at_least=1), hf.integer("num_attention_heads", 32, at_least=1)
        # transformers reads a head_dim config.json gives, else hidden_size // num_attention_heads
        d_head = hf.integer("head_dim", None, at_least=1) or d_model // n_heads
        if d_head < 1:
            raise ValueError(f"hidden_size ({d_model}) / num_attention_heads ({n_heads}) leaves no dimension per head")
        return Lfm2MoeConfig(
            family=cls.model_type,
            d_model=d_model,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=hf.integer("num_key_value_heads", 8, at_least=1),
            d_head=d_head,
            d_vocab=hf.integer("vocab_size", 65536, at_least=1),
            norm_eps=hf.number("norm_eps", 1e-5, at_least=0),
            rope=rope,
            max_position_embeddings=hf.integer("max_position_embeddings", 128000, at_least=1),
            act_fn="silu",  # transformers' Lfm2Moe MLPs and experts compute SiLU (the config has no hidden_act)
            d_mlp=hf.integer("intermediate_size", 7168, at_least=1) if any_dense else 0,
            **routed_fields(hf, moe_layers, n_experts, d_expert, num_experts_per_tok=4),
            norm_topk_prob=hf.flag("norm_topk_prob", True) if any_moe else True,
            routed_scaling_factor=hf.number("routed_scaling_factor", 1.0) if any_moe else 1.0,
            use_expert_bias=hf.flag("use_expert_bias", True) if any_moe else False,
            tie_word_embeddings=tie,
            layer_types=kinds,
            conv_kernel=hf.integer("conv_L_cache", 3, at_least=1) if "conv" in kinds else 3,
            conv_bias=hf.flag("conv_bias", False) if "conv" in kinds else False,
            fields_read=tuple(hf.read),
        )

    @classmethod
    def site_map(cls, cfg: Lfm2MoeConfig) -> SiteMap:
        entries: list[Entry] = [
            Weight("embed.weight", ("model.embed_tokens.weight",)),
            Weight("ln_final.weight", ("model.embedding_norm.weight",)),
            Weight("unembed.weight", ("lm_head.weight",), required=not cfg.tie_word_embeddings),
            Reference("ln_final.hook_normalized", "model.embedding_norm"),
            Reference("hook_logits", "lm_head"),
        ]
        for layer in range(cfg.n_layers):
            src, dst = f"model.layers.{layer}", f"blocks.{layer}"
            conv = cfg.layer_types[layer] == "conv"
            entries += [
                Weight(f"{dst}.ln1.weight", (f"{src}.operator_norm.weight",)),
                Weight(f"{dst}.ln2.weight", (f"{src}.ffn_norm.weight",)),
                Reference(f"{dst}.hook_resid_pre", src, "in"),
                Reference(f"{dst}.ln1.hook_normalized", f"{src}.operator_norm"),
                Reference(f"{dst}.hook_attn_out", f"{src}.conv" if conv else f"{src}.self_attn", "out" if conv else "out.0"),
                Reference(f"{dst}.ln2.hook_normalized", f"{src}.ffn_norm"),
                Reference(f"{dst}.hook_mlp_out", f"{src}.feed_forward"),
                Reference(f"{dst}.hook_resid_post", src),
                *(_conv_sites(cfg, src, dst) if conv else _attention_sites(src, dst)),
                *_feed_forward_sites(cfg, layer, src, dst),
            ]
        return SiteMap(
            tuple(e for e in entries if not isinstance(e, Reference)), tuple(e for e in entries if isinstance(e, Reference))
        )


def _conv_sites(cfg: Lfm2MoeConfig, src: str, dst: str) -> list[Entry]:
    names = ["in_proj.weight", "conv.weight", "out_proj.weight"]
    names += ["in_proj.bias", "conv.bias", "out_proj.bias"] if cfg.conv_bias else []
    return [Weight(f"{dst}.mixer.{n}", (f"{src}.conv.{n}",)) for n in names] + [
        Reference(f"{dst}.mixer.hook_y", f"{src}.conv.out_proj", "in"),
    ]


def _attention_sites(src: str, dst: str) -> list[Entry]:
    attn = f"{src}.self_attn"
    entries: list[Entry] = [Weight(f"{dst}.attn.{p}_proj.weight", (f"{attn}.{p}_proj.weight",)) for p in "qkv"]
    entries += [
        Weight(f"{dst}.attn.o_proj.weight", (f"{attn}.out_proj.weight",)),
        Weight(f"{dst}.attn.q_norm.weight", (f"{attn}.q_layernorm.weight",)),
        Weight(f"{dst}.attn.k_norm.weight", (f"{attn}.k_layernorm.weight",)),
        Reference(f"{dst}.attn.hook_q", f"{attn}.q_proj"),
        Reference(f"{dst}.attn.hook_k", f"{attn}.k_proj"),
        Reference(f"{dst}.attn.hook_v", f"{attn}.v_proj"),
        Reference(f"{dst}.attn.hook_z", f"{attn}.out_proj", "in"),
    ]
    return entries


def _feed_forward_sites(cfg: Lfm2MoeConfig, layer: int, src: str, dst: str) -> list[Entry]:
    ff = f"{src}.feed_forward"
    if not cfg.moe_layers[layer]:
        return [
            Weight(f"{dst}.mlp.gate_proj.weight", (f"{ff}.w1.weight",)),
            Weight(f"{dst}.mlp.up_proj.weight", (f"{ff}.w3.weight",)),
            Weight(f"{dst}.mlp.down_proj.weight", (f"{ff}.w2.weight",)),
            Reference(f"{dst}.mlp.hook_post", f"{ff}.w2", "in"),
        ]
    entries: list[Entry] = [
        Weight(f"{dst}.mlp.router.weight", (f"{ff}.gate.weight",)),
        routed_experts(cfg, (f"{ff}.experts",), dst, (W1_W3_W2,)),
        *router_references(dst, f"{ff}.gate"),
        Reference(f"{dst}.mlp.hook_routed_out", f"{ff}.experts"),
    ]
    if cfg.use_expert_bias:
        entries.append(Weight(f"{dst}.mlp.router.e_score_correction_bias", (f"{ff}.expert_bias",)))
    return entries
