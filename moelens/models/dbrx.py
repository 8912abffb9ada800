"""HookedDbrx: DBRX (databricks/dbrx-base, dbrx-instruct; model_type dbrx).

What is special about the family:
- nested config: the attention's fields under attn_config (kv_n_heads, clip_qkv), the mixture's under
  ffn_config (moe_num_experts, moe_top_k, ffn_hidden_size, moe_normalize_expert_weights, ffn_act_fn); errors
  name the nested field (`ffn_config.moe_num_experts`); the top level spells the sizes d_model, n_heads,
  n_layers, max_seq_len;
- a fused Wqkv [d_model + 2 * kv_heads * d_head, d_model] read into q_proj, k_proj and v_proj
  (moelens.sitemap.SplitWeight); where attn_config.clip_qkv is set, q, k and v clamped to [-clip_qkv, clip_qkv]
  (ClampedQKVAttention; null: no clamp, where transformers' clamp(min=None, max=None) raises);
- LayerNorms without a bias (eps 1e-5, transformers' nn.LayerNorm(bias=False)) before attention, before the
  mixture and at the end (BiasFreeLayerNorm): fold_ln folds their weights; the analyses that divide a stack
  of components by a norm's scale refuse them, since they centre their input;
- a router whose softmax runs in the logits' dtype (the model's), whose top-k weights are divided by their
  p-norm, p = ffn_config.moe_normalize_expert_weights (1 by default: they sum to one; null: not normalised);
- experts stored flat, ffn.experts.mlp.w1 (gate), v1 (up) and w2 (down, transposed) each one tensor
  [n_experts * ffn_hidden_size, d_model], read into the stacked experts through the same SplitWeight; their
  weighted outputs added in ascending expert order in the model's dtype (ExpertSpec.combine "experts"), as
  transformers' loop over experts does, which the Triton backend (a sum over slots) cannot: it is refused.
- the rotary's theta is config.json's top-level rope_theta / rope_parameters (10000 where absent), as
  transformers 5 reads it: attn_config.rope_theta (500000 in the published configs) is ignored, as there, and a
  different value is warned about.
Training-only fields (dropouts, moe_jitter_eps, moe_loss_weight) are ignored, as in inference.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from jaxtyping import Float

from moelens.config import HFConfig, MoeConfig
from moelens.experts.activations import activation
from moelens.experts.spec import GLU, ExpertSpec
from moelens.hooks.sites import site_hook
from moelens.models.base import HookedTransformer
from moelens.models.components import SoftmaxTopK, SparseMoe
from moelens.models.components.attention import Attention, SplitInputs, linear_per_head, split_inputs
from moelens.models.components.layer_norm import BiasFreeLayerNorm
from moelens.models.components.projection_norm_attention import ClipQKVConfig
from moelens.models.recipe import Recipe, decoder_recipe
from moelens.sitemap import Part, Reference, SiteMap, SplitWeight, Transposed, Weight

LAYER_NORM_EPS = 1e-5  # transformers' nn.LayerNorm default: DBRX's config has no eps
# transformers' attribute_map: config.json's spelling of the fields common_fields would name
SPELLINGS = {"d_model": "hidden_size", "n_heads": "num_attention_heads", "n_layers": "num_hidden_layers",
             "max_seq_len": "max_position_embeddings"}
# the sections' fields, as moelens.tl_config's flat spelling names them (HookedDbrx.flat_config_json)
ATTN_NAMES = {"num_key_value_heads": "kv_n_heads"}
ATTN_FIELDS = ("num_key_value_heads",)
FFN_FIELDS = ("ffn_hidden_size", "moe_num_experts", "moe_top_k", "moe_normalize_expert_weights", "hidden_act",
              "moe_jitter_eps", "moe_loss_weight")
TRAINING_FIELDS = ("resid_pdrop", "emb_pdrop", "attn_config.attn_pdrop", "ffn_config.moe_jitter_eps",
                   "ffn_config.moe_loss_weight")


@dataclass(frozen=True)
class SeparateGLU(GLU):
    """act(gate) * up with gate and up each contiguous, as a reference that computes them by separate GEMMs
    (DBRX's w1, v1) has them: torch's elementwise kernels can round differently (gelu's, by a float32 ulp) on
    the strided halves of a fused gate_up."""

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return super().__call__(gate.contiguous(), up.contiguous())


@dataclass(frozen=True)
class DbrxConfig(ClipQKVConfig):
    def expert_spec(self) -> ExpertSpec:
        # transformers' DbrxExperts adds each expert's weighted output into the model-dtype stream with
        # index_add_, in ascending expert order; each expert's rows by slot, then token (torch.where on its [top_k,
        # tokens] mask); its down projection is x @ w2 with w2 [d_expert, d_model]
        return dataclasses.replace(
            super().expert_spec(), activation=SeparateGLU(self.act_fn), combine="experts", down_layout="in_out",
            rows_by="slot",
        )


class ClampedQKVAttention(Attention):
    """q, k, v = clamp(x @ W_Q), clamp(x @ W_K), clamp(x @ W_V) to [-clip_qkv, clip_qkv], then the heads split
    and the rotary (DBRX, clip_qkv set). The hooks hold the clamped tensors, so no weight view describes them."""

    linear_hooks = ()

    def __init__(self, cfg: ClipQKVConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        self.clip_qkv = cfg.clip_qkv
        self.hook_q = site_hook("blocks.L.attn.hook_q", "clamped")
        self.hook_k = site_hook("blocks.L.attn.hook_k", "clamped")
        self.hook_v = site_hook("blocks.L.attn.hook_v", "clamped")

    def project(
        self, x: Float[torch.Tensor, "batch pos d_model"] | SplitInputs
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from_heads = self._projections(x)
        b, p = from_heads[0].shape[:2]
        q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in from_heads)
        return (self.hook_q(q.view(b, p, self.n_heads, self.d_head)),
                self.hook_k(k.view(b, p, self.n_kv_heads, self.d_head)),
                self.hook_v(v.view(b, p, self.n_kv_heads, self.d_head)))

    def _projections(self, x) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The flat q, k, v projections, unhooked."""
        xq, xk, xv = split_inputs(x)
        return linear_per_head(self.q_proj, xq), linear_per_head(self.k_proj, xk), linear_per_head(self.v_proj, xv)

    def extra_repr(self) -> str:
        return f"clip_qkv={self.clip_qkv}"


class LogitsDtypeSoftmaxTopK(SoftmaxTopK):
    """DBRX's router: logits in the weight's dtype (the model's), the softmax over all experts in that dtype
    too (transformers' softmax(dtype=logits.dtype)), top-k, the k weights divided by their p-norm
    (topk_norm_p), in that dtype."""

    def scores(self, logits: torch.Tensor) -> Float[torch.Tensor, "... n_experts"]:
        return F.softmax(logits, dim=-1, dtype=logits.dtype)


class HookedDbrx(HookedTransformer):
    model_type = "dbrx"

    @classmethod
    def recipe(cls, cfg: DbrxConfig) -> Recipe:
        attention = Attention if cfg.clip_qkv is None else ClampedQKVAttention
        return decoder_recipe(cfg, attention, SparseMoe, LogitsDtypeSoftmaxTopK, norm=BiasFreeLayerNorm)

    @classmethod
    def site_map(cls, cfg: DbrxConfig) -> SiteMap:
        weights: list = [
            Weight("embed.weight", ("transformer.wte.weight",)),
            Weight("ln_final.weight", ("transformer.norm_f.weight",)),
            Weight("unembed.weight", ("lm_head.weight",)),
        ]
        references = [Reference("ln_final.hook_normalized", "transformer.norm_f"), Reference("hook_logits", "lm_head")]
        for layer in range(cfg.n_layers):
            w, r = _layer_sites(cfg, f"transformer.blocks.{layer}", f"blocks.{layer}")
            weights += w
            references += r
        return SiteMap(tuple(weights), tuple(references))

    @classmethod
    def flat_config_json(cls, config: dict) -> dict:
        """The top level's and the sections' fields under the flat names (hidden_size, num_key_value_heads,
        moe_num_experts, moe_top_k, ffn_hidden_size, hidden_act, ...)."""
        flat = {SPELLINGS.get(k, k): v for k, v in config.items() if k not in ("attn_config", "ffn_config")}
        attn, ffn = dict(config.get("attn_config") or {}), dict(config.get("ffn_config") or {})
        if "kv_n_heads" in attn:
            flat["num_key_value_heads"] = attn.pop("kv_n_heads")
        act = ffn.pop("ffn_act_fn", None) or {}
        if "name" in act:
            flat["hidden_act"] = act["name"]
        flat.update(ffn)
        flat["attn_config"] = attn  # what has no flat name stays in its section
        return flat

    @classmethod
    def nested_config_json(cls, flat: dict) -> dict:
        """DBRX's spelling of a flat config.json: the sizes as d_model, n_heads, n_layers, max_seq_len; the
        attention's and the mixture's fields in their sections. head_dim is kept where it is not d_model / n_heads
        (so that config_from_hf names it); rms_norm_eps, which DBRX has no field for, is kept where it is not its
        LayerNorms' 1e-5; norm_topk_prob is dropped (the p-norm, 1 by default, makes the weights sum to one)."""
        flat = dict(flat)
        spelt = {name: other for other, name in SPELLINGS.items()}
        config = {spelt.get(k, k): v for k, v in flat.items() if k not in FFN_FIELDS + ATTN_FIELDS}
        attn = dict(config.pop("attn_config", None) or {})
        attn.update({ATTN_NAMES.get(k, k): flat[k] for k in ATTN_FIELDS if k in flat})
        ffn = {k: flat[k] for k in FFN_FIELDS if k in flat and k != "hidden_act"}
        if "hidden_act" in flat:
            ffn["ffn_act_fn"] = {"name": flat["hidden_act"]}
        theta = (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta"))
        if "rope_theta" in attn and theta is not None:  # transformers needs it there, reads the top level's
            attn["rope_theta"] = theta
        config.update(attn_config=attn, ffn_config=ffn)
        if config.get("head_dim") == config["d_model"] // config["n_heads"]:
            del config["head_dim"]
        if config.get("rms_norm_eps") == LAYER_NORM_EPS:
            del config["rms_norm_eps"]
        config.pop("norm_topk_prob", None)
        return config

    @classmethod
    def config_from_hf(cls, raw: dict) -> DbrxConfig:
        hf = HFConfig.with_spellings(raw, SPELLINGS)
        attn, ffn = hf.section("attn_config"), hf.section("ffn_config")
        d_model = hf.integer("hidden_size", 2048, at_least=1)
        n_heads = hf.integer("num_attention_heads", 16, at_least=1, at_most=d_model)
        if d_model % n_heads:
            raise ValueError(
                f"d_model ({d_model}) must be a multiple of n_heads ({n_heads}): transformers' DBRX splits Wqkv's "
                "query rows into heads of d_model // n_heads"
            )
        d_head = d_model // n_heads
        if hf.integer("head_dim", d_head, at_least=1) != d_head:
            raise ValueError(
                f"head_dim = {raw['head_dim']}: DBRX's heads are d_model / n_heads = {d_head} wide (transformers' "
                "rotary would read head_dim, its attention d_model / n_heads)"
            )
        n_kv = attn.integer("kv_n_heads", 1, at_least=1, at_most=n_heads)
        if n_heads % n_kv:
            raise ValueError(f"n_heads ({n_heads}) must be a multiple of attn_config.kv_n_heads ({n_kv})")
        if hf.flag("tie_word_embeddings", False):
            raise ValueError("tie_word_embeddings = true: transformers' DBRX refuses a tied head; DBRX stores lm_head")
        rope = hf.rope(theta=10000.0)
        if rope.partial_rotary_factor != 1.0:
            raise ValueError(
                f"partial_rotary_factor = {rope.partial_rotary_factor}: transformers' DBRX rotary turns the whole head"
            )
        attn_theta = attn.number("rope_theta", None, above=0)
        attn.read.remove("rope_theta")  # checked, then ignored (as transformers): fields_ignored lists it
        _warn_ignored_theta(attn_theta, rope.theta)
        n_layers = hf.integer("num_hidden_layers", 24, at_least=1)
        n_experts = ffn.integer("moe_num_experts", 4, at_least=1)
        top_k = ffn.integer("moe_top_k", 1, at_least=1, at_most=n_experts)
        act_fn = ffn.section("ffn_act_fn").text("name", "silu")
        try:
            activation(act_fn)
        except ValueError:
            raise ValueError(f"ffn_config.ffn_act_fn.name = {act_fn!r} is not supported") from None
        sizes = dict(
            d_vocab=hf.integer("vocab_size", 32000, at_least=1),
            max_position_embeddings=hf.integer("max_position_embeddings", 2048, at_least=1),
            d_expert=ffn.integer("ffn_hidden_size", 3584, at_least=1),
            topk_norm_p=_p_norm(ffn),
            clip_qkv=attn.number("clip_qkv", None, above=0),
        )
        # config.json's spellings: d_model, n_heads, ..., attn_config.kv_n_heads
        spelt = {name: other for other, name in SPELLINGS.items()}
        fields_read = (*(spelt.get(n, n) for n in hf.read), *(f"attn_config.{n}" for n in attn.read),
                       *(f"ffn_config.{n}" for n in ffn.read))
        return DbrxConfig(
            family=cls.model_type,
            d_model=d_model,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=n_kv,
            d_head=d_head,
            norm_eps=LAYER_NORM_EPS,
            rope=rope,
            act_fn=act_fn,
            moe_layers=(True,) * n_layers,
            n_experts=n_experts,
            top_k_per_layer=(top_k,) * n_layers,
            **sizes,
            fields_read=fields_read,
            fields_ignored=tuple(f for f in (*TRAINING_FIELDS, "attn_config.rope_theta") if _present(raw, f)),
        )


def _p_norm(ffn: HFConfig) -> float | None:
    """ffn_config.moe_normalize_expert_weights: 1.0 where absent (transformers' default), None where null
    (transformers then leaves the top-k weights as they are)."""
    if "moe_normalize_expert_weights" in ffn.raw and ffn.raw["moe_normalize_expert_weights"] is None:
        ffn.opt("moe_normalize_expert_weights")
        return None
    return ffn.number("moe_normalize_expert_weights", 1.0, above=0)


def _warn_ignored_theta(attn_theta: float | None, theta: float) -> None:
    if attn_theta is not None and attn_theta != theta:
        warnings.warn(
            f"attn_config.rope_theta = {attn_theta:g} is ignored, as transformers' DBRX ignores it: the rotary uses "
            f"the top-level rope_theta / rope_parameters, {theta:g}. Set rope_theta at the top level to use it",
            UserWarning,
            stacklevel=3,
        )


def _present(raw: dict, dotted: str) -> bool:
    *section, name = dotted.split(".")
    where = raw.get(section[0]) if section else raw
    return isinstance(where, dict) and where.get(name) is not None  # null counts as absent, as in HFConfig


def _layer_sites(cfg: DbrxConfig, src: str, dst: str) -> tuple[list, list[Reference]]:
    """(weights, references) of one block: transformers' norm_attn_norm (norm_1, attn, norm_2) and ffn."""
    block, attn, ffn = f"{src}.norm_attn_norm", f"{src}.norm_attn_norm.attn", f"{src}.ffn"
    q_rows, kv_rows = cfg.n_heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head
    weights = [
        Weight(f"{dst}.ln1.weight", (f"{block}.norm_1.weight",)),
        Weight(f"{dst}.ln2.weight", (f"{block}.norm_2.weight",)),
        SplitWeight((f"{attn}.Wqkv.weight",), (
            Part(f"{dst}.attn.q_proj.weight", q_rows), Part(f"{dst}.attn.k_proj.weight", kv_rows),
            Part(f"{dst}.attn.v_proj.weight", kv_rows),
        )),
        Weight(f"{dst}.attn.o_proj.weight", (f"{attn}.out_proj.weight",)),
        Weight(f"{dst}.mlp.router.weight", (f"{ffn}.router.layer.weight",)),
        *flat_experts(cfg, f"{ffn}.experts.mlp", f"{dst}.mlp.experts"),
    ]
    references = [
        Reference(f"{dst}.hook_resid_pre", src, "in"),
        Reference(f"{dst}.ln1.hook_normalized", f"{block}.norm_1"),
        Reference(f"{dst}.attn.hook_z", f"{attn}.out_proj", "in"),
        Reference(f"{dst}.hook_attn_out", attn, "out.0"),
        Reference(f"{dst}.ln2.hook_normalized", f"{block}.norm_2"),
        Reference(f"{dst}.mlp.hook_router_logits", f"{ffn}.router"),
        # transformers' experts module is called with the hidden states, the chosen experts and their weights
        Reference(f"{dst}.mlp.hook_expert_indices", f"{ffn}.experts", "in.1"),
        Reference(f"{dst}.mlp.hook_expert_weights", f"{ffn}.experts", "in.2"),
        Reference(f"{dst}.mlp.hook_routed_out", f"{ffn}.experts"),
        Reference(f"{dst}.hook_mlp_out", ffn),
        Reference(f"{dst}.hook_resid_post", src),
    ]
    return weights, references


def flat_experts(cfg: MoeConfig, src: str, dst: str) -> list[SplitWeight]:
    """Experts stored flat: `src`.w1 (gate) and .v1 (up), [n_experts * d_expert, d_model], each expert's rows in
    turn, into W_gate_up's gate and up rows; .w2 (down, [n_experts * d_expert, d_model], x @ w2) into W_down
    [n_experts, d_model, d_expert], transposed."""
    E, I = cfg.n_experts, cfg.d_expert
    gate, up = slice(0, I), slice(I, 2 * I)
    return [
        SplitWeight((f"{src}.w1",), tuple(Part(f"{dst}.W_gate_up", I, (e, gate)) for e in range(E))),
        SplitWeight((f"{src}.v1",), tuple(Part(f"{dst}.W_gate_up", I, (e, up)) for e in range(E))),
        SplitWeight((f"{src}.w2",), tuple(Part(f"{dst}.W_down", I, (e,), Transposed()) for e in range(E))),
    ]
