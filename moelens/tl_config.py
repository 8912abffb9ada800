"""HookedTransformerConfig: TransformerLens's config constructor for models built from scratch, giving the MoeConfig
of a registered family's architecture (HookedTransformer(cfg) then builds it with random weights).

TransformerLens users write HookedTransformerConfig(n_layers=..., d_model=..., n_ctx=..., d_head=..., ...) and
HookedTransformer(cfg) to make a toy model to train. Here the fields name a family too (family="qwen2_moe",
"mixtral", ...: an architecture moelens loads), and the config is made as a checkpoint's would be: the family's
config.json fields are written from the TransformerLens ones over the family's tiny default
(moelens/defaults/tiny_<family>.json: every field TransformerLens has no name for, such as a shared expert's
width or a hybrid's layer pattern, repeated to n_layers), the family reads them (config_from_hf, with all its
checks), and the result is checked to have every size that was asked for: a field the family does not read as
asked (a fixed activation, a latent attention's own head size) is an error naming it, never a silent change.
`hf_config` gives any of the family's own config.json fields, over all of that.

A MoeConfig itself (from a checkpoint, or MoeConfig(...)) is an instance of HookedTransformerConfig."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from pathlib import Path

import torch

from moelens import families
from moelens.config import MoeConfig
from moelens.defaults import CONFIGS

# TransformerLens's fields moelens reads (and its own family / hf_config); the values TL fields must keep
# where moelens has one architecture only
_REQUIRED = ("n_layers", "d_model", "n_ctx", "d_head")
_FIXED = {
    "normalization_type": ("RMS", "RMSPre"),  # every family norms with RMSNorm
    "positional_embedding_type": ("rotary",),  # every family is rotary
    "gated_mlp": (True,),  # every expert and MLP is gated
    "attn_only": (False,),
    "final_rms": (True,),
    "init_mode": ("gpt2",),  # TransformerLens's default: normal(0, initializer_range) for the weight matrices
    "n_devices": (1,),
    "use_local_attn": (False,),
    "parallel_attn_mlp": (False,),
    "original_architecture": None,  # any value: recorded
}
_TL_FIELDS = {
    "n_layers", "d_model", "n_ctx", "d_head", "n_heads", "d_mlp", "d_vocab", "d_vocab_out", "act_fn", "eps",
    "n_key_value_heads", "num_experts", "n_experts", "experts_per_token", "rotary_base", "rotary_dim",
    "norm_topk_prob", "initializer_range", "seed", "dtype", "device", "default_prepend_bos", "model_name",
    "tokenizer_name", "use_attn_result", "use_split_qkv_input", "use_hook_mlp_in", "use_attn_in", *_FIXED,
}
_ARGS = {"family", "hf_config"} | _TL_FIELDS

# the config.json names families give the same thing (each is written where the family's tiny default has it)
_EXPERT_COUNT = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_TOP_K = ("num_experts_per_tok", "moe_k", "moe_topk", "moe_top_k")
_EXPERT_WIDTH = ("moe_intermediate_size", "expert_ffn_hidden_size", "shared_expert_intermediate_size")
_DENSE_WIDTH = ("intermediate_size", "ffn_hidden_size")  # the dense MLPs' (and Mixtral-style experts') width
_LAYER_PATTERNS = ("layer_types", "hybrid_override_pattern", "layer_rope_theta", "mlp_layer_types")  # one entry per layer: repeated to n_layers
_LAYER_COUNT = ("num_hidden_layers", "num_layers")


def _integer(args: dict, name: str, at_least: int = 1) -> int:
    value = args[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < at_least:
        raise ValueError(f"HookedTransformerConfig: {name} = {value!r}; expected an integer >= {at_least}")
    return value


def _number(args: dict, name: str) -> float:
    value = args[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"HookedTransformerConfig: {name} = {value!r}; expected a finite number > 0")
    return float(value)


def _base_config(family: str) -> dict:
    """The family's tiny default config.json: the fields TransformerLens has no name for."""
    for file in CONFIGS.values():
        config = json.loads((Path(__file__).parent / "defaults" / file).read_text())
        if config.get("model_type") == family:
            return config
    raise ValueError(f"HookedTransformerConfig(family={family!r}): the family has no tiny default config to start from")


def _check_args(args: dict) -> str:
    unknown = sorted(set(args) - _ARGS)
    if unknown:
        close = {name: difflib.get_close_matches(name, sorted(_ARGS), n=1) for name in unknown}
        hints = ", ".join(f"{n!r}" + (f" (did you mean {c[0]!r}?)" if c else "") for n, c in close.items())
        raise TypeError(
            f"HookedTransformerConfig: unknown field(s) {hints}; a family's own config.json fields go in hf_config={{...}}"
        )
    missing = [name for name in ("family", *_REQUIRED) if args.get(name) is None]
    if missing:
        raise TypeError(f"HookedTransformerConfig: missing required field(s) {missing}")
    family = args["family"]
    if family not in families.FAMILIES:
        raise ValueError(
            f"HookedTransformerConfig: family = {family!r} is not a registered family; the families are "
            f"{sorted(families.FAMILIES)} (TransformerLens's own MoE is 'mixtral')"
        )
    for name, allowed in _FIXED.items():
        if allowed is not None and name in args and args[name] not in allowed:
            raise ValueError(
                f"HookedTransformerConfig: {name} = {args[name]!r} is not supported; moelens builds "
                f"{' or '.join(map(repr, allowed))} only"
            )
    if args.get("n_experts") is not None and args.get("num_experts") is not None and args["n_experts"] != args["num_experts"]:
        raise ValueError(f"HookedTransformerConfig: n_experts = {args['n_experts']} and num_experts = {args['num_experts']} differ")
    return family


def hf_config_from_tl(args: dict) -> dict:
    """The family's config.json for TransformerLens's fields (see the module's docstring)."""
    family = _check_args(args)
    n_layers, d_model, d_head = (_integer(args, name) for name in ("n_layers", "d_model", "d_head"))
    n_ctx = _integer(args, "n_ctx")
    n_heads = args.get("n_heads", -1)
    n_heads = d_model // d_head if n_heads in (None, -1) else _integer(args, "n_heads")  # TransformerLens's default
    if n_heads < 1:
        raise ValueError(f"HookedTransformerConfig: d_model {d_model} // d_head {d_head} leaves no head; give n_heads")
    if args.get("d_vocab") in (None, -1):
        raise ValueError("HookedTransformerConfig: d_vocab is required (there is no tokenizer to take it from)")
    d_vocab = _integer(args, "d_vocab")
    if args.get("d_vocab_out", -1) not in (-1, d_vocab):
        raise ValueError(f"HookedTransformerConfig: d_vocab_out = {args['d_vocab_out']!r}; the unembedding's width is d_vocab ({d_vocab})")
    d_mlp = 4 * d_model if args.get("d_mlp") is None else _integer(args, "d_mlp")  # TransformerLens's default
    expert_field = "n_experts" if args.get("n_experts") is not None else "num_experts"
    n_experts = args.get(expert_field)
    family_class = families.FAMILIES[family]
    base = family_class.flat_config_json(_base_config(family))
    # the tiny default's special token ids are its byte-level tokenizer's; a model made here has no tokenizer
    hf = {**base, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    base_layers = next((hf[name] for name in _LAYER_COUNT if name in hf), None)
    for name in _LAYER_PATTERNS:  # the tiny default's per-layer pattern, repeated to n_layers
        if name in hf and base_layers:
            hf[name] = (hf[name] * n_layers)[:n_layers]
    # the layer count where the family keeps it (LongCat-Flash's num_layers: its num_hidden_layers is twice that)
    hf[next((name for name in _LAYER_COUNT if name in hf), "num_hidden_layers")] = n_layers
    hf.update(
        hidden_size=d_model, num_attention_heads=n_heads, head_dim=d_head, vocab_size=d_vocab,
        max_position_embeddings=n_ctx, tie_word_embeddings=False,
        num_key_value_heads=n_heads if args.get("n_key_value_heads") is None else _integer(args, "n_key_value_heads"),
    )
    for name in [name for name in _DENSE_WIDTH if name in base] or ["intermediate_size"]:
        hf[name] = d_mlp
    # latent attention (DeepSeek-V2's and its kin's): a head is qk_nope_head_dim + qk_rope_head_dim wide and its
    # value v_head_dim; d_head sets the first and the last, the rotated part staying the tiny default's
    # (LongCat-Flash's head_dim is its rotated part: not this)
    if "qk_nope_head_dim" in base and base.get("head_dim") != base.get("qk_rope_head_dim"):
        rope = base["qk_rope_head_dim"]
        if d_head <= rope:
            raise ValueError(
                f"HookedTransformerConfig: d_head = {d_head}; the {family} family's heads are qk_nope_head_dim + "
                f"qk_rope_head_dim ({rope}) wide, so d_head must be above {rope}"
            )
        hf.update(qk_nope_head_dim=d_head - rope, v_head_dim=d_head)
        del hf["head_dim"]  # transformers reads it as qk_rope_head_dim in some of these families (GLM-4.7-Flash's)
    hf.pop("rope_scaling", None)
    hf["rope_parameters"] = {"rope_type": "default", "rope_theta": _number(args, "rotary_base") if "rotary_base" in args else 10000.0}
    if args.get("rotary_dim") is not None:
        hf["rope_parameters"]["partial_rotary_factor"] = _integer(args, "rotary_dim") / d_head
    hf.pop("rope_theta", None)
    hf.pop("partial_rotary_factor", None)
    if "act_fn" in args:
        hf["hidden_act"] = args["act_fn"]
    hf["rms_norm_eps"] = _number(args, "eps") if "eps" in args else 1e-5  # TransformerLens's default
    if "norm_topk_prob" in args:
        hf["norm_topk_prob"] = args["norm_topk_prob"]
    if n_experts is not None:
        n_experts = _integer(args, expert_field, at_least=0)
        for name in _EXPERT_COUNT:
            if name in hf:
                hf[name] = n_experts
        for name in _EXPERT_WIDTH:
            if name in hf:
                hf[name] = d_mlp
    if args.get("experts_per_token") is not None:
        k = _integer(args, "experts_per_token")
        for name in _TOP_K:
            if name in hf:
                hf[name] = [k] * n_layers if isinstance(hf[name], list) else k
    hf = family_class.nested_config_json(hf)
    hf.update(args.get("hf_config") or {})
    return hf


def _check_taken(cfg: MoeConfig, args: dict, hf: dict) -> None:
    """Every size asked for is the family's: a field it reads otherwise is named, never changed silently."""
    asked = {
        "d_model": (args["d_model"], cfg.d_model), "n_layers": (args["n_layers"], cfg.n_layers),
        "d_head": (args["d_head"], cfg.d_head), "n_heads": (hf["num_attention_heads"], cfg.n_heads),
        "n_key_value_heads": (hf["num_key_value_heads"], cfg.n_kv_heads), "d_vocab": (hf["vocab_size"], cfg.d_vocab),
        "n_ctx": (args["n_ctx"], cfg.n_ctx),
    }
    if "act_fn" in args:
        asked["act_fn"] = (args["act_fn"], cfg.act_fn)
    if "eps" in args:
        asked["eps"] = (float(args["eps"]), cfg.norm_eps)
    if "rotary_base" in args:
        asked["rotary_base"] = (float(args["rotary_base"]), cfg.rope.theta)
    if args.get("rotary_dim") is not None:
        asked["rotary_dim"] = (args["rotary_dim"], cfg.d_rot)
    n_experts = args.get("n_experts", args.get("num_experts"))
    if n_experts is not None:
        asked["n_experts"] = (n_experts, cfg.n_experts)
    if n_experts and args.get("experts_per_token") is not None:
        ks = {cfg.top_k_per_layer[layer] for layer in cfg.moe_layer_indices}
        asked["experts_per_token"] = (args["experts_per_token"], ks.pop() if len(ks) == 1 else sorted(ks))
    if n_experts:
        asked["d_mlp (each expert's width)"] = (4 * args["d_model"] if args.get("d_mlp") is None else args["d_mlp"], cfg.d_expert)
    wrong = {name: pair for name, pair in asked.items() if pair[0] != pair[1]}
    if wrong:
        described = "; ".join(f"{name} = {want!r} gives {got!r}" for name, (want, got) in wrong.items())
        raise ValueError(
            f"HookedTransformerConfig(family={cfg.family!r}): the family does not read these fields as asked: "
            f"{described}. Give the family's own config.json fields with hf_config={{...}}, and these fields the "
            "values the family makes of them"
        )


def config_from_tl(**args) -> MoeConfig:
    """TransformerLens's fields (and family, hf_config) -> the family's MoeConfig; see the module's docstring."""
    hf = hf_config_from_tl(args)
    family = families.FAMILIES[args["family"]]
    try:
        cfg = family.config_from_hf(hf)
    except (KeyError, ValueError) as e:
        what = f"missing field {e}" if isinstance(e, KeyError) else str(e)
        raise ValueError(
            f"HookedTransformerConfig(family={args['family']!r}): the family refused the config.json made from these "
            f"fields ({what}); give the family's own fields with hf_config={{...}}"
        ) from e
    _check_taken(cfg, args, family.flat_config_json(hf))  # read in the flat spelling it was written in
    d_model = cfg.d_model
    initializer_range = args.get("initializer_range", -1.0)
    if initializer_range is None or initializer_range < 0:
        initializer_range = 0.8 / math.sqrt(d_model)  # TransformerLens's default for init_mode "gpt2"
    else:
        initializer_range = _number(args, "initializer_range")
    seed = args.get("seed")
    if seed is not None:
        seed = _integer(args, "seed", at_least=0)
    passed = {
        name: args[name]
        for name in ("device", "default_prepend_bos", "model_name", "tokenizer_name", "use_attn_result",
                     "use_split_qkv_input", "use_hook_mlp_in", "use_attn_in", "original_architecture")
        if args.get(name) is not None
    }
    dtype = args.get("dtype", torch.float32)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"HookedTransformerConfig: dtype = {dtype!r}; expected a torch.dtype")
    if "device" in passed:
        passed["device"] = str(torch.device(passed["device"]))
    return dataclasses.replace(cfg, dtype=dtype, initializer_range=initializer_range, seed=seed, **passed)


class _ConfigClass(type):
    """isinstance(cfg, HookedTransformerConfig) holds for every MoeConfig; calling the class builds one."""

    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, MoeConfig)

    def __subclasscheck__(cls, sub) -> bool:
        return issubclass(sub, MoeConfig)

    def __call__(cls, **fields) -> MoeConfig:
        return config_from_tl(**fields)


class HookedTransformerConfig(metaclass=_ConfigClass):
    """TransformerLens's HookedTransformerConfig(n_layers=..., d_model=..., n_ctx=..., d_head=..., ...), with a
    registered family's architecture named by `family` (see moelens.tl_config): gives that family's MoeConfig,
    and HookedTransformer(cfg) builds the model with random weights (TransformerLens's init: every weight
    matrix normal(0, initializer_range), default 0.8 / sqrt(d_model); norms 1, biases 0; seeded by `seed`).

    Read: n_layers, d_model, n_ctx, d_head (required), n_heads (default d_model // d_head), d_vocab (required),
    d_mlp (default 4 * d_model; with experts, each expert's width), num_experts (or n_experts),
    experts_per_token, n_key_value_heads, act_fn, eps, rotary_base, rotary_dim, norm_topk_prob,
    initializer_range, seed, dtype, device, default_prepend_bos, the use_* switches. Refused unless they
    have the one value moelens builds: normalization_type ("RMS"), positional_embedding_type ("rotary"),
    gated_mlp (True), attn_only (False), init_mode ("gpt2"). hf_config: the family's own config.json fields.
    Every MoeConfig is an instance of this class."""

    @classmethod
    def from_dict(cls, config_dict: dict) -> MoeConfig:
        """TransformerLens's from_dict: the same fields as a dict."""
        return config_from_tl(**config_dict)
