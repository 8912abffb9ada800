"""HookedMiMoV2Flash: MiMo-V2-Flash (model_type mimo_v2_flash).

What is special about the family:
- two kinds of attention layer, set by layer_types (transformers' default: full attention on layer 0 and every
  sixth layer, sliding the others): a sliding layer has twice num_key_value_heads kv heads, a window of
  sliding_window positions and a learned sink per head joining the softmax (gpt-oss's in-softmax sink:
  hook_sink_scores, a pattern row summing to less than one); a full layer has num_key_value_heads kv heads and
  no sink. Both subtract each row's max in the scores' dtype and take the softmax in that dtype, as
  transformers' eager attention does;
- queries and keys head_dim wide, values and each head's output v_head_dim wide (narrower);
- the values scaled by attention_value_scale as projected: hook_v holds them scaled (what is cached and
  attended), so W_V / b_V are the scaled projection (copies: edit v_proj to change the model);
- a partial rotary (partial_rotary_factor of head_dim, halves rotated) with its own base per layer type
  (rope_parameters keyed by layer type);
- the first block(s) a dense MLP (mlp_layer_types), the others a mixture without shared expert: DeepSeek-V3's
  float32 sigmoid router (SigmoidGroupedTopK: e_score_correction_bias added only to choose, n_group /
  topk_group, norm_topk_prob, routed_scaling_factor, null meaning 1).

The published config.json is the Hub's own format, which transformers reads only in part (its layer and head
pattern fields are not read: it derives them). Those fields are checked against what transformers derives and a
config where they disagree is refused naming both, since the checkpoint's tensors follow one of them. Like
transformers, the model is the num_hidden_layers blocks: the checkpoint's multi-token-prediction weights
(model.mtp.*) are not part of it.
"""

from __future__ import annotations

import dataclasses
import reprlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import nn

from moelens.config import HFConfig, MoeConfig, RopeConfig, common_fields, routed_fields
from moelens.hooks.sites import site_hook
from moelens.models.base import HookedTransformer
from moelens.models.components import SigmoidGroupedTopK, SparseMoe
from moelens.models.components.attention import linear_per_head, split_inputs
from moelens.models.components.rotary import Rotary
from moelens.models.components.sliding_window_attention import SlidingWindowAttention
from moelens.models.gpt_oss import SinkAttention
from moelens.models.recipe import Dense, LayerSpec, Mixture, Recipe
from moelens.models.sites import Entry, decoder_site_map, dense_mlp, router_references, routed_experts
from moelens.models.terms import ParamTerm, linear, vector
from moelens.sitemap import Reference, SiteMap, Weight

LAYER_TYPES = ("full_attention", "sliding_attention")
MLP_LAYER_TYPES = ("dense", "sparse")
# transformers' MiMoV2FlashConfig defaults (MiMo-V2-Flash's own sizes)
DEFAULTS = dict(
    hidden_size=4096, intermediate_size=16384, num_key_value_heads=4, head_dim=192, v_head_dim=128,
    max_position_embeddings=131072, rms_norm_eps=1e-5, moe_intermediate_size=2048, num_experts_per_tok=8,
    n_routed_experts=256, sliding_window=129, attention_value_scale=0.707,
)
# rope_parameters where config.json has none: transformers' per-type defaults (the published thetas)
DEFAULT_ROPES = {
    "full_attention": RopeConfig(theta=5_000_000.0, partial_rotary_factor=0.334),
    "sliding_attention": RopeConfig(theta=10_000.0, partial_rotary_factor=0.334),
}
# Present in the Hub's config.json, unread by transformers and without effect on the arithmetic: the router's
# rule (always sigmoid / noaux_tc here), and sliding_window where sliding_window_size is given (which wins)
IGNORED_FIELDS = ("scoring_func", "topk_method", "rope_scaling", "sliding_window")


@dataclass(frozen=True)
class MiMoV2FlashConfig(MoeConfig):
    """MoeConfig plus the values' width, the sliding layers' kv heads and rotary, and the value scale. n_kv_heads
    and rope are the full-attention layers'; attention_windows says which layers slide (None: full)."""

    d_head_v: int = 0  # v_head_dim: each head's value and output width
    sliding_kv_heads: int = 0  # the sliding layers' kv heads (twice num_key_value_heads)
    sliding_rope: RopeConfig | None = None
    value_scale: float = 1.0  # attention_value_scale

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.d_head_v < 1 or self.sliding_kv_heads < 1:
            raise ValueError(f"d_head_v ({self.d_head_v}) and sliding_kv_heads ({self.sliding_kv_heads}) must be at least 1")
        if self.n_heads % self.sliding_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.n_heads}) must be a multiple of the sliding layers' kv heads "
                f"({self.sliding_kv_heads}, twice num_key_value_heads)"
            )
        if self.sliding_rope is not None and int(self.d_head * self.sliding_rope.partial_rotary_factor) % 2:
            raise ValueError(
                f"head_dim {self.d_head} x the sliding layers' partial_rotary_factor "
                f"{self.sliding_rope.partial_rotary_factor} gives an odd number of rotated dimensions"
            )

    def layer_rope(self, layer: int) -> RopeConfig:
        return self.rope if self.window(layer) is None else self.sliding_rope or self.rope


class MiMoAttention(SlidingWindowAttention):
    """A full-attention layer: num_key_value_heads kv heads, values v_head_dim wide and scaled as projected, the
    softmax after subtracting each row's max, both in the scores' dtype (transformers' eager order), and the
    layer type's own rotary."""

    @classmethod
    def kv_heads(cls, cfg: MiMoV2FlashConfig) -> int:
        return cfg.n_kv_heads

    @classmethod
    def param_terms(cls, cfg: MiMoV2FlashConfig, layer: int) -> tuple[ParamTerm, ...]:
        kv = cls.kv_heads(cfg)
        return (linear("q_proj", cfg.d_model, cfg.n_heads * cfg.d_head, cfg.qkv_bias, "attention")
                + linear("k_proj", cfg.d_model, kv * cfg.d_head, cfg.qkv_bias, "attention")
                + linear("v_proj", cfg.d_model, kv * cfg.d_head_v, cfg.qkv_bias, "attention")
                + linear("o_proj", cfg.n_heads * cfg.d_head_v, cfg.d_model, False, "attention"))

    @classmethod
    def cached_per_token(cls, cfg: MiMoV2FlashConfig) -> int:
        return cls.kv_heads(cfg) * (cfg.d_head + cfg.d_head_v)

    def __init__(self, cfg: MiMoV2FlashConfig, layer: int) -> None:
        super().__init__(dataclasses.replace(cfg, n_kv_heads=self.kv_heads(cfg)), layer)
        self.d_v, self.value_scale = cfg.d_head_v, cfg.value_scale
        self.v_proj = nn.Linear(cfg.d_model, self.n_kv_heads * self.d_v, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_heads * self.d_v, cfg.d_model, bias=False)
        self.hook_v = site_hook("blocks.L.attn.hook_v", "scaled")
        self.hook_z = site_hook("blocks.L.attn.hook_z", "narrow")
        rope = cfg.layer_rope(layer)
        # the model's table serves the full layers' rotary; the other layer type gets its own
        self.layer_rotary = None if rope == cfg.rope else Rotary(dataclasses.replace(cfg, rope=rope))

    def project(self, x):
        xq, xk, xv = split_inputs(x)
        b, p = xq.shape[:2]
        q = self.hook_q(linear_per_head(self.q_proj, xq).view(b, p, self.n_heads, self.d_head))
        k = self.hook_k(linear_per_head(self.k_proj, xk).view(b, p, self.n_kv_heads, self.d_head))
        # scaled as projected, before the cache (transformers' value_states * v_scale)
        v = linear_per_head(self.v_proj, xv).view(b, p, self.n_kv_heads, self.d_v) * self.value_scale
        return q, k, self.hook_v(v)

    def position_at(self, q, k, inputs):
        if self.layer_rotary is None:
            return super().position_at(q, k, inputs)
        cos, sin = self.layer_rotary(inputs.positions, q.dtype)
        return self.position(q, k, cos, sin)

    def softmax(self, scores: Float[torch.Tensor, "batch head query key"]) -> Float[torch.Tensor, "batch head query key"]:
        scores = scores - scores.max(dim=-1, keepdim=True).values
        return F.softmax(scores, dim=-1, dtype=scores.dtype)

    # the value views: the scaled projection, so that x @ W_V + b_V is hook_v (new tensors, not views)
    @property
    def W_V_grouped(self) -> Float[torch.Tensor, "n_kv_heads d_model d_v"]:
        return super().W_V_grouped * self.value_scale

    @property
    def b_V(self) -> Float[torch.Tensor, "n_heads d_v"]:
        return self._repeat_kv(self._bias(self.v_proj, self.n_kv_heads, self.d_v)) * self.value_scale

    def extra_repr(self) -> str:
        return (f"n_kv_heads={self.n_kv_heads}, d_v={self.d_v}, value_scale={self.value_scale}, "
                f"sliding_window={self.sliding_window}")


class MiMoSinkAttention(MiMoAttention, SinkAttention):
    """A sliding layer: twice num_key_value_heads kv heads and a learned sink per head in the softmax
    (gpt-oss's)."""

    softmax = SinkAttention.softmax

    @classmethod
    def kv_heads(cls, cfg: MiMoV2FlashConfig) -> int:
        return cfg.sliding_kv_heads

    @classmethod
    def param_terms(cls, cfg: MiMoV2FlashConfig, layer: int) -> tuple[ParamTerm, ...]:
        return super().param_terms(cfg, layer) + vector("sinks", cfg.n_heads, "attention")


class HookedMiMoV2Flash(HookedTransformer):
    model_type = "mimo_v2_flash"

    @classmethod
    def recipe(cls, cfg: MiMoV2FlashConfig) -> Recipe:
        mixture, dense = Mixture(SparseMoe, SigmoidGroupedTopK), Dense()
        return Recipe(tuple(
            LayerSpec(MiMoAttention if cfg.window(layer) is None else MiMoSinkAttention, mixture if moe else dense)
            for layer, moe in enumerate(cfg.moe_layers)
        ))

    @classmethod
    def site_map(cls, cfg: MiMoV2FlashConfig) -> SiteMap:
        return decoder_site_map(cfg, _layer_sites, ignored_prefixes=("model.mtp.",))

    @classmethod
    def config_from_hf(cls, raw: dict) -> MiMoV2FlashConfig:
        hf = HFConfig(raw)
        d = DEFAULTS
        fields = common_fields(
            hf, rms_norm_eps=d["rms_norm_eps"], max_position_embeddings=d["max_position_embeddings"],
            num_key_value_heads=d["num_key_value_heads"], hidden_size=d["hidden_size"],
            d_head=hf.integer("head_dim", d["head_dim"], at_least=1), rope=DEFAULT_ROPES["full_attention"],
        )
        n_layers = fields["n_layers"]
        types = _layer_types(hf, n_layers)
        moe_layers = _moe_layers(hf, n_layers)
        ropes = _ropes(hf)
        window = _window(hf, raw) if "sliding_attention" in types else None
        kv, d_v = fields["n_kv_heads"], hf.integer("v_head_dim", d["v_head_dim"], at_least=1)
        _check_hub_fields(hf, fields, types, moe_layers, d_v, ropes)
        n_experts = hf.integer("n_routed_experts", d["n_routed_experts"], at_least=1)
        routed = routed_fields(
            hf, moe_layers, n_experts, hf.integer("moe_intermediate_size", d["moe_intermediate_size"], at_least=1),
            num_experts_per_tok=d["num_experts_per_tok"],
        )
        n_group, topk_group = hf.integer("n_group", 1, at_least=1), hf.integer("topk_group", 1, at_least=1)
        SigmoidGroupedTopK.check_groups(n_experts, max(routed["top_k_per_layer"]), n_group, topk_group)
        scale = hf.number("attention_value_scale", None, above=0)
        if "attention_value_scale" not in raw:  # absent: transformers' default; null: no scaling
            scale = d["attention_value_scale"]
        return MiMoV2FlashConfig(
            **{**fields, "rope": ropes["full_attention"]},
            **routed,
            d_mlp=hf.integer("intermediate_size", d["intermediate_size"], at_least=1) if not all(moe_layers) else 0,
            norm_topk_prob=hf.flag("norm_topk_prob", True),
            routed_scaling_factor=hf.number("routed_scaling_factor", 1.0),  # null: 1, as transformers
            n_group=n_group,
            topk_group=topk_group,
            qkv_bias=hf.flag("attention_bias", False),
            attention_windows=tuple(window if t == "sliding_attention" else None for t in types),
            d_head_v=d_v,
            sliding_kv_heads=2 * kv,
            sliding_rope=ropes["sliding_attention"],
            value_scale=1.0 if scale is None else scale,
            family=cls.model_type,
            fields_read=tuple(hf.read),
            fields_ignored=tuple(f for f in IGNORED_FIELDS if f in raw and f not in hf.read),
        )


def _layer_types(hf: HFConfig, n_layers: int) -> list[str]:
    """layer_types; absent or null: transformers' default, full attention on layer 0 and every sixth layer."""
    types = hf.opt("layer_types")
    if types is None:
        return [LAYER_TYPES[not (i == 0 or (i + 1) % 6 == 0)] for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers or not set(types) <= set(LAYER_TYPES):
        raise ValueError(f"layer_types must list {n_layers} entries (num_hidden_layers), each one of "
                         f"{list(LAYER_TYPES)}; got {types!r}")
    return types


def _moe_layers(hf: HFConfig, n_layers: int) -> tuple[bool, ...]:
    """mlp_layer_types; absent or null: transformers' default, the first block dense, the others mixtures."""
    types = hf.opt("mlp_layer_types")
    if types is None:
        types = ["dense"] + ["sparse"] * (n_layers - 1)
    elif not isinstance(types, list) or len(types) != n_layers or not set(types) <= set(MLP_LAYER_TYPES):
        raise ValueError(f"mlp_layer_types must list {n_layers} entries (num_hidden_layers), each one of "
                         f"{list(MLP_LAYER_TYPES)}; got {types!r}")
    if "sparse" not in types:
        raise ValueError("mlp_layer_types makes every block a dense MLP, leaving no mixture block")
    return tuple(t == "sparse" for t in types)


def _ropes(hf: HFConfig) -> dict[str, RopeConfig]:
    """rope_parameters, one entry per layer type ({"full_attention": {...}, "sliding_attention": {...}});
    absent or null: transformers' defaults. Each is the plain rotary (rope_type "default"), its
    partial_rotary_factor 0.334 where it gives none, as transformers' rotary reads it."""
    params = hf.opt("rope_parameters")
    if params is None:
        return dict(DEFAULT_ROPES)
    if not isinstance(params, dict) or set(params) != set(LAYER_TYPES):
        got = f"the keys {sorted(params)}" if isinstance(params, dict) else reprlib.repr(params)
        raise ValueError(f"rope_parameters must map each of {list(LAYER_TYPES)} to its rotary settings (this "
                         f"family's rotary differs per layer type); got {got}")
    ropes = {}
    for kind in LAYER_TYPES:
        if not isinstance(params[kind], dict):
            raise ValueError(f"rope_parameters.{kind} = {reprlib.repr(params[kind])}; expected a JSON object")
        section = HFConfig(params[kind], {key: f"rope_parameters.{kind}" for key in params[kind]})
        rope_type = section.text("rope_type", "default")
        if rope_type != "default":
            raise ValueError(f"rope_parameters.{kind}.rope_type = {rope_type!r}: this family supports the plain "
                             "rotary (\"default\") only")
        ropes[kind] = RopeConfig(
            theta=section.number("rope_theta", above=0),
            partial_rotary_factor=section.number("partial_rotary_factor", 0.334, above=0, at_most=1),
        )
    return ropes


def _window(hf: HFConfig, raw: dict) -> int:
    """sliding_window; a Hub config's sliding_window_size (the previous tokens a query sees besides itself)
    wins, plus one, as transformers reads it."""
    size = hf.integer("sliding_window_size", None, at_least=0)
    if size is not None:
        return size + 1
    if "sliding_window" in raw and raw["sliding_window"] is None:
        raise ValueError("sliding_window = null: the sliding layers need a window length (transformers' default, "
                         f"{DEFAULTS['sliding_window']}, is for an absent field)")
    return hf.integer("sliding_window", DEFAULTS["sliding_window"], at_least=1)


def _check_hub_fields(
    hf: HFConfig, fields: dict, types: list[str], moe_layers: tuple[bool, ...], d_v: int,
    ropes: dict[str, RopeConfig],
) -> None:
    """The Hub config.json's pattern and head fields, which transformers does not read: each must agree with what
    transformers derives (else which one the checkpoint's tensors follow cannot be told)."""
    sliding = [t == "sliding_attention" for t in types]
    expected = {
        "hybrid_layer_pattern": ([int(s) for s in sliding], "layer_types"),
        "moe_layer_freq": ([int(m) for m in moe_layers], "mlp_layer_types"),
        "swa_num_attention_heads": (fields["n_heads"], "num_attention_heads"),
        "swa_num_key_value_heads": (2 * fields["n_kv_heads"], "twice num_key_value_heads"),
        "swa_head_dim": (fields["d_head"], "head_dim"),
        "swa_v_head_dim": (d_v, "v_head_dim"),
        "add_swa_attention_sink_bias": (True, "a sink on every sliding layer"),
        "add_full_attention_sink_bias": (False, "no sink on the full layers"),
        "rope_theta": (ropes["full_attention"].theta, "rope_parameters.full_attention.rope_theta"),
        "swa_rope_theta": (ropes["sliding_attention"].theta, "rope_parameters.sliding_attention.rope_theta"),
        "layernorm_epsilon": (fields["norm_eps"], "rms_norm_eps"),
        "n_shared_experts": (0, "no shared expert (transformers builds none)"),
    }
    partials = {rope.partial_rotary_factor for rope in ropes.values()}
    if len(partials) == 1:
        expected["partial_rotary_factor"] = (partials.pop(), "rope_parameters' partial_rotary_factor")
    for name, (want, source) in expected.items():
        value = hf.opt(name)
        if value is None:
            continue
        if value != want or isinstance(value, bool) != isinstance(want, bool):  # 1 == True: a bool is no count
            raise ValueError(
                f"{name} = {value!r} disagrees with {source} ({want!r}), which transformers builds the model from "
                f"(it does not read {name}); make them agree"
            )


def _layer_sites(cfg: MiMoV2FlashConfig, layer: int, src: str, dst: str) -> list[Entry]:
    attn, ours = f"{src}.self_attn", f"{dst}.attn"
    entries: list[Entry] = [Weight(f"{ours}.{p}_proj.weight", (f"{attn}.{p}_proj.weight",)) for p in "qkvo"]
    if cfg.qkv_bias:
        entries += [Weight(f"{ours}.{p}_proj.bias", (f"{attn}.{p}_proj.bias",)) for p in "qkv"]
    entries += [
        Reference(f"{ours}.hook_q", f"{attn}.q_proj"),
        Reference(f"{ours}.hook_k", f"{attn}.k_proj"),
        Reference(f"{ours}.hook_v", f"{attn}.v_proj", multiplier=cfg.value_scale),
        Reference(f"{ours}.hook_z", f"{attn}.o_proj", "in"),
    ]
    if cfg.window(layer) is not None:  # the Hub's name first, transformers' own second
        entries.append(Weight(f"{ours}.sinks", (f"{attn}.attention_sink_bias", f"{attn}.sinks")))
    if not cfg.moe_layers[layer]:
        return entries + dense_mlp(src, dst)
    return entries + [
        Weight(f"{dst}.mlp.router.weight", (f"{src}.mlp.gate.weight",)),
        Weight(f"{dst}.mlp.router.e_score_correction_bias", (f"{src}.mlp.gate.e_score_correction_bias",)),
        routed_experts(cfg, (f"{src}.mlp.experts",), dst),
        *router_references(dst, f"{src}.mlp.gate"),
        Reference(f"{dst}.mlp.hook_routed_out", f"{src}.mlp.experts"),
    ]
