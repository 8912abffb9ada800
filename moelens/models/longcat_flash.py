"""HookedLongcatFlash: LongCat-Flash (model_type longcat_flash).

What is special about the family:
- a block of several sublayers (LongcatBlock): two attention + dense-MLP pairs, and a "shortcut" mixture fed
  from the first pair's normed stream (ln2's output, the first dense MLP's input) and added at the block's end:

      r = resid_pre + attn(ln1(resid_pre))                      hook_attn_out,   then hook_resid_mid
      m = mlp(ln2(r))          (the mixture)                    hook_mlp_out
      r = r + dense_0(ln2(r))                                   hook_dense_0_out, then hook_resid_mid_1
      r = r + attn_1(ln1_1(r))                                  hook_attn_1_out,  then hook_resid_mid_2
      resid_post = r + dense_1(ln2_1(r)) + m                    hook_dense_1_out, hook_resid_post

  so resid_post = resid_pre + the five sublayers' output hooks (block.sublayers(), in that order of adding: attn,
  dense_0, attn_1, dense_1, the mixture). The mixture keeps the name
  blocks.L.mlp (router and expert sites as in every family); transformers' self_attn.0 / .1, mlps.0 / .1,
  input_layernorm.0 / .1 and post_attention_layernorm.0 / .1 are attn / attn_1, dense_0 / dense_1, ln1 /
  ln1_1 and ln2 / ln2_1. Each attention has its own cache (transformers' cache layers 2L and 2L + 1).
- identity ("zero-computation") experts: the router scores n_routed_experts real experts and zero_expert_num
  identity ones together (softmax over all, float32, the choice on scores + e_score_correction_bias, the
  weights the unbiased scores of the chosen times routed_scaling_factor, not renormalised); a slot routed to an
  identity expert adds weight * x (ExpertSpec.n_identity: no GEMM, nothing stored or fetched for it).
- multi-head latent attention (DeepSeek-V3's, rotary dims always interleaved) with LoRA scaling: the queries
  times sqrt(hidden_size / q_lora_rank), the normed kv latent times sqrt(hidden_size / kv_lora_rank).
The Hub checkpoint's multi-token-prediction weights (model.mtp.*) are not run, as in transformers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import nn

from moelens.config import HFConfig, MoeConfig, common_fields
from moelens.experts.spec import ExpertSpec
from moelens.hooks.sites import site_hook
from moelens.models.base import HookedTransformer
from moelens.models.components.block import Block, Sublayer
from moelens.models.components.latent_attention import MultiHeadLatentAttention
from moelens.models.components.mlp import GatedMLP
from moelens.models.components.moe import SparseMoe
from moelens.models.components.norm import RMSNorm
from moelens.models.components.router import SoftmaxTopK
from moelens.models.context import LayerInputs
from moelens.models.mixers.base import StateTensor
from moelens.models.recipe import LayerSpec, Mixture, Recipe
from moelens.models.sites import Entry, gated_mlp, router_references, routed_experts
from moelens.models.terms import ParamTerm, under
from moelens.sitemap import Reference, SiteMap, Weight

# config.json fields transformers' model does not read (the MTP layers it does not build, training settings)
IGNORED_FIELDS = ("num_nextn_predict_layers", "mla_scale_q_lora", "mla_scale_kv_lora", "router_dtype", "zero_expert_type")


@dataclass(frozen=True)
class LongcatFlashConfig(MoeConfig):
    """MoeConfig plus MLA's sizes and the identity experts. n_experts counts the real experts; the router scores
    n_experts + n_identity_experts. d_mlp is the dense MLPs' width (ffn_hidden_size)."""

    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    n_identity_experts: int = 0

    @property
    def d_rot(self) -> int:
        return self.qk_rope_head_dim

    def expert_spec(self) -> ExpertSpec:
        # transformers' LongcatFlashExperts adds each expert's weighted output, cast to the stream's dtype, in
        # ascending expert order
        return dataclasses.replace(super().expert_spec(), n_identity=self.n_identity_experts, combine="experts")


class IdentityExpertsRouter(SoftmaxTopK):
    """LongCat-Flash's rule over real + identity experts: float32 logits, softmax over all of them, the top-k
    chosen on scores + e_score_correction_bias (sorted=False, as the reference), the weights the unbiased scores
    of the chosen times routed_scaling_factor (no renormalisation), float32. The classifier weight and the
    correction bias are held in the model's dtype as transformers' model holds them (its _keep_in_fp32_modules
    entry "classifier.weight" names no module, so it keeps nothing float32), and cast up for the logits."""

    choice_bias = True

    @classmethod
    def param_terms(cls, cfg: LongcatFlashConfig) -> tuple[ParamTerm, ...]:
        n = cfg.n_experts + cfg.n_identity_experts  # a row per real and per identity expert
        return (ParamTerm("weight", (n, cfg.d_model), "routers", flops=2 * n * cfg.d_model),
                ParamTerm("e_score_correction_bias", (n,), "routers", buffer=True))

    def __init__(self, cfg: LongcatFlashConfig, top_k: int) -> None:
        super().__init__(cfg, top_k)
        self.n_experts = cfg.n_experts + cfg.n_identity_experts
        self.weight = nn.Parameter(torch.zeros(self.n_experts, cfg.d_model))
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.register_buffer("e_score_correction_bias", torch.zeros(self.n_experts))

    def logits(self, x: Float[torch.Tensor, "... d_model"]) -> Float[torch.Tensor, "... n_experts"]:
        return F.linear(x.float(), self.weight.float())

    def choice_scores(self, scores: torch.Tensor) -> torch.Tensor:
        return scores + self.e_score_correction_bias.to(self.weight.dtype)

    def choose(self, choice_scores: torch.Tensor) -> torch.Tensor:
        return torch.topk(choice_scores, self.top_k, dim=-1, sorted=False).indices

    def weights(self, scores: torch.Tensor, indices: torch.Tensor, logits_dtype: torch.dtype) -> torch.Tensor:
        return (scores.gather(-1, indices) * self.routed_scaling_factor).to(logits_dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, routed_scaling_factor={self.routed_scaling_factor}"


class ScaledLatentAttention(MultiHeadLatentAttention):
    """MLA whose queries (hook_q) are scaled by sqrt(d_model / q_lora_rank) and whose normed kv latent
    (hook_kv_latent, what kv_b_proj decompresses) by sqrt(d_model / kv_lora_rank), as transformers does before
    the rotary; k_rope is not scaled. The hooks hold the scaled tensors."""

    def __init__(self, cfg: LongcatFlashConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        self.q_scale = (cfg.d_model / cfg.q_lora_rank) ** 0.5
        self.kv_scale = (cfg.d_model / cfg.kv_lora_rank) ** 0.5

    def project_query(self, x):
        b, p, _ = x.shape
        latent = self.hook_q_latent(self.q_a_layernorm(self.q_a_proj(x)))
        q = self.q_b_proj(latent).view(b, p, self.n_heads, self.d_head) * self.q_scale
        return latent, self.hook_q(q)

    def project_key_value(self, x):
        b, p, _ = x.shape
        kv_latent, k_rope = torch.split(self.kv_a_proj_with_mqa(x), [self.kv_lora_rank, self.d_rope], dim=-1)
        kv_latent = self.hook_kv_latent(self.kv_a_layernorm(kv_latent) * self.kv_scale)
        k_rope = self.hook_k_rope(k_rope)
        kv = self.kv_b_proj(kv_latent).view(b, p, self.n_heads, self.d_nope + self.d_v)
        k_nope, v = torch.split(kv, [self.d_nope, self.d_v], dim=-1)
        k = torch.cat((k_nope, k_rope[:, :, None, :].expand(b, p, self.n_heads, self.d_rope)), dim=-1)
        return self.hook_k(k), self.hook_v(v)


class SublayerStates:
    """A block's state when it has several token mixers: one state per mixer, in order."""

    def __init__(self, parts: list) -> None:
        self.parts = parts

    def snapshot(self) -> object:
        return [s.snapshot() for s in self.parts]

    def rollback(self, snapshot) -> None:
        for s, snap in zip(self.parts, snapshot, strict=True):
            s.rollback(snap)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.parts)

    def __repr__(self) -> str:
        return f"SublayerStates({self.parts})"


class LongcatBlock(Block):
    """Two attention + dense-MLP pairs and the shortcut mixture (module docstring)."""

    @classmethod
    def param_terms(cls, cfg: LongcatFlashConfig, layer: int, spec: LayerSpec) -> tuple[ParamTerm, ...]:
        """What the block holds, under the names __init__ gives (the plan counts it without building it)."""
        norm, attention = spec.norm.param_terms(cfg.d_model), spec.mixer.param_terms(cfg, layer)
        dense = GatedMLP.param_terms(cfg.d_model, cfg.d_mlp, "dense_mlp")
        return (under("ln1", norm) + under("attn", attention) + under("ln2", norm)
                + under("mlp", spec.ffn.param_terms(cfg, layer)) + under("dense_0", dense) + under("ln1_1", norm)
                + under("attn_1", attention) + under("ln2_1", norm) + under("dense_1", dense))

    @classmethod
    def state_tensors(cls, cfg: LongcatFlashConfig, spec: LayerSpec) -> tuple[StateTensor, ...]:
        return spec.mixer.state_tensors(cfg) * 2  # attn's and attn_1's keys and values

    def __init__(self, cfg: LongcatFlashConfig, layer: int, spec: LayerSpec) -> None:
        nn.Module.__init__(self)
        self.is_moe = True
        self.residual_multiplier = 1.0  # its sublayers' outputs enter the stream as they are
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.mixer_attribute = "attn"
        norm = spec.norm
        self.ln1 = norm(cfg.d_model, cfg.norm_eps, site="blocks.L.ln1")
        self.attn = spec.mixer(cfg, layer)
        self.ln2 = norm(cfg.d_model, cfg.norm_eps, site="blocks.L.ln2")
        self.mlp: nn.Module = spec.ffn.build(cfg, layer)
        self.dense_0 = GatedMLP(cfg.d_model, cfg.d_mlp, cfg.act_fn)
        self.ln1_1 = norm(cfg.d_model, cfg.norm_eps, site="blocks.L.ln1")
        self.attn_1 = spec.mixer(cfg, layer)
        self.ln2_1 = norm(cfg.d_model, cfg.norm_eps, site="blocks.L.ln2")
        self.dense_1 = GatedMLP(cfg.d_model, cfg.d_mlp, cfg.act_fn)
        self.hook_resid_pre = site_hook("blocks.L.hook_resid_pre")
        self.hook_attn_out = site_hook("blocks.L.hook_attn_out")
        self.hook_resid_mid = site_hook("blocks.L.hook_resid_mid")
        self.hook_mlp_out = site_hook("blocks.L.hook_mlp_out")
        self.hook_dense_0_out = site_hook("blocks.L.hook_dense_0_out")
        self.hook_resid_mid_1 = site_hook("blocks.L.hook_resid_mid_1")
        self.hook_attn_1_out = site_hook("blocks.L.hook_attn_1_out")
        self.hook_resid_mid_2 = site_hook("blocks.L.hook_resid_mid_2")
        self.hook_dense_1_out = site_hook("blocks.L.hook_dense_1_out")
        self.hook_resid_post = site_hook("blocks.L.hook_resid_post")

    def sublayers(self) -> list[Sublayer]:
        # in the order the forward adds them (the shortcut mixture last), so that resid_pre plus the outputs in
        # this order is resid_post bit for bit
        return [
            Sublayer("mixer", self.ln1, self.attn, "hook_attn_out"),
            Sublayer("ffn", self.ln2, self.dense_0, "hook_dense_0_out"),
            Sublayer("mixer", self.ln1_1, self.attn_1, "hook_attn_1_out"),
            Sublayer("ffn", self.ln2_1, self.dense_1, "hook_dense_1_out"),
            Sublayer("ffn", self.ln2, self.mlp, "hook_mlp_out"),
        ]

    def new_state(self, reserve: int = 0) -> SublayerStates:
        return SublayerStates([self.attn.new_state(reserve), self.attn_1.new_state(reserve)])

    def forward(
        self, resid: Float[torch.Tensor, "batch pos d_model"], inputs: LayerInputs
    ) -> Float[torch.Tensor, "batch pos d_model"]:
        states = [None, None] if inputs.state is None else inputs.state.parts
        resid = self.hook_resid_pre(resid)
        resid = self.hook_resid_mid(resid + self.hook_attn_out(self.attn(self.attn_input(resid), inputs.for_layer(states[0]))))
        mlp_in = self.hook_mlp_in(resid.clone()) if self.use_hook_mlp_in else resid
        normed = self.ln2(mlp_in)
        shortcut = self.hook_mlp_out(self.mlp(normed))  # computed first, as transformers does
        resid = self.hook_resid_mid_1(resid + self.hook_dense_0_out(self.dense_0(normed)))
        attn_1 = self.hook_attn_1_out(self.attn_1(self.ln1_1(resid), inputs.for_layer(states[1])))
        resid = self.hook_resid_mid_2(resid + attn_1)
        dense_1 = self.hook_dense_1_out(self.dense_1(self.ln2_1(resid)))
        return self.hook_resid_post(resid + dense_1 + shortcut)


class HookedLongcatFlash(HookedTransformer):
    model_type = "longcat_flash"

    @classmethod
    def recipe(cls, cfg: LongcatFlashConfig) -> Recipe:
        spec = LayerSpec(ScaledLatentAttention, Mixture(SparseMoe, IdentityExpertsRouter), RMSNorm, block=LongcatBlock)
        return Recipe((spec,) * cfg.n_layers, RMSNorm)

    @classmethod
    def site_map(cls, cfg: LongcatFlashConfig) -> SiteMap:
        # transformers' saved checkpoints carry gate / up rows for the identity experts (its fused gate_up_proj
        # has a row per routable expert); they have no weights to load, and the Hub's mtp.* layers are not run
        identity = tuple(
            f"model.layers.{layer}.mlp.experts.{e}."
            for layer in range(cfg.n_layers) for e in range(cfg.n_experts, cfg.n_experts + cfg.n_identity_experts)
        )
        return _site_map(cfg, ("model.mtp.", *identity))

    @classmethod
    def config_from_hf(cls, raw: dict) -> LongcatFlashConfig:
        hf = HFConfig(raw)
        n_layers = hf.integer("num_layers", 28, at_least=1)
        d_nope = hf.integer("qk_nope_head_dim", 128, at_least=0)
        d_rope = hf.integer("qk_rope_head_dim", 64, at_least=2)
        head_dim = hf.integer("head_dim", 64, at_least=1)
        if head_dim != d_rope:  # transformers' rotary is head_dim wide and turns the qk_rope_head_dim dims
            raise ValueError(
                f"head_dim ({head_dim}) must equal qk_rope_head_dim ({d_rope}): LongCat-Flash's rotary tables are "
                "head_dim wide and rotate the qk_rope_head_dim dims of each head"
            )
        if "qk_head_dim" in raw and raw["qk_head_dim"] is not None and raw["qk_head_dim"] != d_nope + d_rope:
            raise ValueError(f"qk_head_dim ({raw['qk_head_dim']}) must be qk_nope_head_dim + qk_rope_head_dim ({d_nope + d_rope})")
        hf.opt("qk_head_dim")
        if hf.flag("router_bias", False):
            raise ValueError("router_bias: true is not supported (LongCat-Flash's router classifier has no bias)")
        fields = common_fields(
            # transformers' defaults (LongCat-Flash-Chat's) where config.json has none; its layer count is num_layers
            HFConfig({"num_attention_heads": 64, "vocab_size": 131072, **raw, "num_hidden_layers": n_layers}),
            rms_norm_eps=1e-5, max_position_embeddings=131072,
            hidden_size=6144, d_head=d_nope + d_rope, rope_theta=10000000.0,
        )
        rope = fields.pop("rope")
        if rope.partial_rotary_factor != 1.0:
            raise ValueError(f"partial_rotary_factor {rope.partial_rotary_factor}: LongCat-Flash rotates qk_rope_head_dim dims")
        for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size", "rms_norm_eps",
                     "max_position_embeddings", "hidden_act", "tie_word_embeddings", "rope_parameters", "rope_theta",
                     "rope_scaling", "partial_rotary_factor"):
            hf.opt(name)  # read through the copy above: recorded here
        if fields["n_kv_heads"] != fields["n_heads"]:
            raise ValueError(
                f"num_key_value_heads ({fields['n_kv_heads']}) must equal num_attention_heads ({fields['n_heads']}): "
                "latent attention decompresses a key and a value for every head"
            )
        n_experts = hf.integer("n_routed_experts", 512, at_least=1)
        n_identity = hf.opt("zero_expert_num", 256)
        n_identity = 0 if n_identity is None else hf.integer("zero_expert_num", 256, at_least=0)
        top_k = hf.integer("moe_topk", 12, at_least=1, at_most=n_experts)
        fields["n_layers"] = n_layers
        attention_bias = hf.flag("attention_bias", False)
        return LongcatFlashConfig(
            **fields,
            rope=dataclasses.replace(rope, interleaved=True),
            moe_layers=(True,) * n_layers,
            n_experts=n_experts,
            top_k_per_layer=(top_k,) * n_layers,
            d_expert=hf.integer("expert_ffn_hidden_size", 2048, at_least=1),
            family=cls.model_type,
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            d_mlp=hf.integer("ffn_hidden_size", 12288, at_least=1),
            routed_scaling_factor=hf.number("routed_scaling_factor", 6.0),
            q_lora_rank=hf.integer("q_lora_rank", 1536, at_least=1),
            kv_lora_rank=hf.integer("kv_lora_rank", 512, at_least=1),
            qk_nope_head_dim=d_nope,
            qk_rope_head_dim=d_rope,
            v_head_dim=hf.integer("v_head_dim", 128, at_least=1),
            n_identity_experts=n_identity,
            fields_read=tuple(hf.read),
            fields_ignored=tuple(f for f in IGNORED_FIELDS if f in raw),
        )


def _site_map(cfg: LongcatFlashConfig, ignored: tuple[str, ...]) -> SiteMap:
    entries: list[Entry] = [
        Weight("embed.weight", ("model.embed_tokens.weight",)),
        Weight("ln_final.weight", ("model.norm.weight",)),
        Weight("unembed.weight", ("lm_head.weight",), required=not cfg.tie_word_embeddings),
        Reference("ln_final.hook_normalized", "model.norm"),
        Reference("hook_logits", "lm_head"),
    ]
    for layer in range(cfg.n_layers):
        src, dst = f"model.layers.{layer}", f"blocks.{layer}"
        entries += [Reference(f"{dst}.hook_resid_pre", src, "in"), Reference(f"{dst}.hook_resid_post", src)]
        for i, (attn, ln1, ln2, dense) in enumerate((("attn", "ln1", "ln2", "dense_0"), ("attn_1", "ln1_1", "ln2_1", "dense_1"))):
            entries += [
                Weight(f"{dst}.{ln1}.weight", (f"{src}.input_layernorm.{i}.weight",)),
                Weight(f"{dst}.{ln2}.weight", (f"{src}.post_attention_layernorm.{i}.weight",)),
                Reference(f"{dst}.{ln1}.hook_normalized", f"{src}.input_layernorm.{i}"),
                Reference(f"{dst}.{ln2}.hook_normalized", f"{src}.post_attention_layernorm.{i}"),
                Reference(f"{dst}.hook_{attn}_out", f"{src}.self_attn.{i}", "out.0"),
                *_attention_sites(cfg, f"{src}.self_attn.{i}", f"{dst}.{attn}"),
                *gated_mlp(f"{src}.mlps.{i}", f"{dst}.{dense}"),
                Reference(f"{dst}.hook_{dense}_out", f"{src}.mlps.{i}"),
                Reference(f"{dst}.{dense}.hook_post", f"{src}.mlps.{i}.down_proj", "in"),
            ]
        router = f"{src}.mlp.router"
        entries += [
            Weight(f"{dst}.mlp.router.weight", (f"{router}.classifier.weight",)),
            Weight(f"{dst}.mlp.router.e_score_correction_bias", (f"{router}.e_score_correction_bias",)),
            routed_experts(cfg, (f"{src}.mlp.experts",), dst),
            *router_references(dst, router),
            Reference(f"{dst}.mlp.hook_routed_out", f"{src}.mlp.experts"),
            Reference(f"{dst}.hook_mlp_out", f"{src}.mlp"),
        ]
    return SiteMap(
        tuple(e for e in entries if not isinstance(e, Reference)), tuple(e for e in entries if isinstance(e, Reference)),
        ignored,
    )


def _attention_sites(cfg: LongcatFlashConfig, attn: str, ours: str) -> list[Entry]:
    modules = ["q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]
    biased = (["q_a_proj", "kv_a_proj_with_mqa"] if cfg.qkv_bias else []) + (["o_proj"] if cfg.o_bias else [])
    tensors = [f"{m}.weight" for m in modules] + [f"{m}.bias" for m in biased]
    return [Weight(f"{ours}.{t}", (f"{attn}.{t}",)) for t in tensors] + [
        Reference(f"{ours}.hook_q_latent", f"{attn}.q_a_layernorm"),
        Reference(f"{ours}.hook_z", f"{attn}.o_proj", "in"),
    ]
