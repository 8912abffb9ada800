"""MoeConfig: one frozen, family-neutral description of a model's sizes, built by each family from config.json.

Behaviour (how a family routes, where it norms q and k, how its shared expert is added) is not a flag here:
it is the component classes the family file picks. A family with sizes of its own subclasses MoeConfig."""

from __future__ import annotations

import difflib
import math
import reprlib
from dataclasses import FrozenInstanceError, dataclass, field, fields
from typing import Literal

import torch

from moelens.experts.spec import GLU, ExpertSpec


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: plain, YaRN, Llama 3's frequency-band scaling ("llama3"), LongRoPE (per-frequency
    factors, "longrope") or an NTK-alpha stretch (which only changes the base)."""

    theta: float
    kind: Literal["default", "yarn", "llama3", "longrope"] = "default"
    partial_rotary_factor: float = 1.0
    # YaRN
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    # llama3 (factor and original_max_position_embeddings above): wavelengths past original / low_freq_factor
    # are divided by factor, those below original / high_freq_factor kept, the band between blended
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # longrope (original_max_position_embeddings above): each frequency divided by its factor, the short ones
    # within original_max_position_embeddings, the long ones past it; cos and sin scaled by the mscale
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    short_mscale: float | None = None
    long_mscale: float | None = None
    # the rotated dims stored as interleaved pairs (x0, x1), (x2, x3), ... (config.json's rope_interleave)
    interleaved: bool = False


class FrozenConfigError(FrozenInstanceError):
    """An assignment to a field of a model's (frozen) config: the message names the field and what sets it."""


# fields the model sets itself, and the call that does it (the model replaces its cfg)
_FIELD_SETTERS = {
    "use_attn_result": "model.set_use_attn_result({value!r})",
    "use_split_qkv_input": "model.set_use_split_qkv_input({value!r})",
    "use_hook_mlp_in": "model.set_use_hook_mlp_in({value!r})",
    "use_attn_in": "model.set_use_attn_in({value!r})",
    "device": "model.to(device)",
    "dtype": "model.to(dtype)",
    "tokenizer_name": "model.set_tokenizer(tokenizer)",
    "tokenizer_prepends_bos": "model.set_tokenizer(tokenizer)",
    "default_prepend_bos": "from_pretrained(..., default_prepend_bos=...), or prepend_bos= per call",
}


def _frozen_message(cfg: object, name: str, value: object, deleting: bool = False) -> str:
    cls = type(cfg).__name__
    names = [f.name for f in fields(cfg)]  # type: ignore[arg-type]
    verb = "delete" if deleting else "set"
    if name not in names and isinstance(getattr(type(cfg), name, None), property):
        return f"cannot {verb} cfg.{name}: {cls} is frozen, and {name} is computed from its fields"
    if name not in names:
        close = difflib.get_close_matches(name, names, n=1)
        return f"cannot {verb} {cls}.{name}: the config is frozen, and {name!r} is not one of its fields" + (
            f" (did you mean {close[0]!r}?)" if close else ""
        )
    how = _FIELD_SETTERS.get(name, "dataclasses.replace(cfg, {name}=...) and a model built from that config")
    return f"cannot {verb} cfg.{name}: {cls} is frozen (the model replaces its cfg where it changes); use {how.format(name=name, value=value)}"


def _explain_frozen(cls: type) -> None:
    """Wrap cls's dataclass-made __setattr__ / __delattr__ so that assigning a field raises FrozenConfigError
    naming it, instead of the bare FrozenInstanceError. Done once per class (a family's config subclass is a
    dataclass of its own, with __setattr__ of its own)."""
    if cls.__dict__.get("_frozen_explained"):
        return
    frozen_setattr, frozen_delattr = cls.__setattr__, cls.__delattr__

    def __setattr__(self, name, value):
        try:
            frozen_setattr(self, name, value)
        except FrozenConfigError:
            raise
        except FrozenInstanceError:
            raise FrozenConfigError(_frozen_message(self, name, value)) from None

    def __delattr__(self, name):
        try:
            frozen_delattr(self, name)
        except FrozenConfigError:
            raise
        except FrozenInstanceError:
            raise FrozenConfigError(_frozen_message(self, name, None, deleting=True)) from None

    type.__setattr__(cls, "__setattr__", __setattr__)
    type.__setattr__(cls, "__delattr__", __delattr__)
    type.__setattr__(cls, "_frozen_explained", True)


@dataclass(frozen=True)
class MoeConfig:
    """A model's sizes, under moelens's names and, where TransformerLens code reads them, TransformerLens's
    (HookedTransformerConfig): d_model, n_layers, n_heads, d_head, d_vocab, d_vocab_out, n_ctx,
    n_key_value_heads, act_fn, eps, normalization_type ("RMS"), positional_embedding_type ("rotary"),
    rotary_dim, rotary_base, num_experts, experts_per_token, gated_mlp, n_params, device, dtype,
    default_prepend_bos, original_architecture, model_name, tokenizer_name, use_attn_result,
    use_split_qkv_input, use_hook_mlp_in, use_attn_in.

    d_mlp is the width of the *dense* MLPs (the blocks that are not mixtures; 0 when every block is one).
    TransformerLens's MoE configs put each expert's width in d_mlp; here that is d_expert, and a
    shared expert's width is d_shared. Code that sizes per-neuron buffers from cfg.d_mlp on an MoE layer wants
    d_expert.

    Frozen: the model replaces its cfg where it changes (device and dtype on .to(), the tokenizer's fields on
    set_tokenizer); TransformerLens code that assigns to cfg fields fails with FrozenConfigError (a
    FrozenInstanceError) naming the field and what sets it (model.set_use_attn_result(True), model.to(...)).
    """

    family: str  # model_type in config.json
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_vocab: int
    norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    # attention
    qkv_bias: bool = False
    o_bias: bool = False
    # per layer, the sliding window a query attends within (None: every earlier position); empty: all None
    attention_windows: tuple[int | None, ...] = ()
    # MLP / mixture
    act_fn: str = "silu"
    d_mlp: int = 0  # dense MLP width (blocks that are not mixtures)
    moe_layers: tuple[bool, ...] = ()  # per block: mixture or dense
    n_experts: int = 0
    # experts per token, per block (0 for a dense block); cfg.top_k is the mixture layers' one k
    top_k_per_layer: tuple[int, ...] = ()
    d_expert: int = 0
    d_shared: int = 0  # shared expert width, where the family's mixture block has one
    # sizes and constants the routers read; how a family routes is its router class (models/components)
    norm_topk_prob: bool = False
    # the k weights divided by their p-norm, this p (None: not; DBRX's moe_normalize_expert_weights), by the
    # softmax routers (SoftmaxTopK and its subclasses)
    topk_norm_p: float | None = None
    routed_scaling_factor: float = 1.0
    router_jitter_noise: float = 0.0  # sparsemixer: the relative distance within which experts share a slot's weight
    n_group: int = 1
    topk_group: int = 1
    # embeddings
    tie_word_embeddings: bool = False
    unembed_bias: bool = False  # the unembedding adds a bias [d_vocab] (config.json's lm_head_bias)
    # bookkeeping: which config.json fields the family reads, for the printout
    fields_read: tuple[str, ...] = field(default=(), compare=False)
    fields_ignored: tuple[str, ...] = field(default=(), compare=False)  # present, but unused (as in transformers)
    dtype: torch.dtype = torch.float32
    # where the routed experts live, fixed when the model is built (moelens.models.components.moe.Experts):
    # "resident" (parameters of the model), "offloaded" (fetched from host memory or disk when routed to) or
    # "sharded" (expert parallelism: each rank its own range)
    expert_placement: Literal["resident", "offloaded", "sharded"] = field(default="resident", compare=False)
    # how the routed experts are held, fixed when the model is built: None (dense, the model's dtype) or the
    # checkpoint's stored format, "fp8" / "mxfp4", dequantized when routed to (ExpertSpec.storage)
    expert_storage: Literal["fp8", "mxfp4"] | None = field(default=None, compare=False)
    # ---- TransformerLens's bookkeeping (HookedTransformerConfig's names); not the model's identity ----------
    # where the model is: kept in step with it by HookedTransformer (its .to / .half / ... replace cfg), the
    # first device of a device map, as TransformerLens's cfg.device is with n_devices
    device: str = field(default="cpu", compare=False)
    # what to_tokens and friends do when prepend_bos is None (from_pretrained: whether the checkpoint's tokenizer
    # adds a BOS itself, unless given)
    default_prepend_bos: bool = field(default=False, compare=False)
    tokenizer_prepends_bos: bool | None = field(default=None, compare=False)  # None: no tokenizer
    original_architecture: str | None = field(default=None, compare=False)  # config.json's architectures[0]
    model_name: str = field(default="custom", compare=False)  # the name loaded, without its organisation
    tokenizer_name: str | None = field(default=None, compare=False)
    # the weight-matrix parameters outside the embedding and unembedding (TransformerLens's n_params, which
    # leaves out biases and norms; exact here, where TL's formula assumes n_kv_heads == n_heads); set by the model
    n_params: int | None = field(default=None, compare=False)
    # TransformerLens's switches of optional hooks (model.set_use_attn_result and friends set them; a cfg built
    # with one on gives a model with it on)
    use_attn_result: bool = field(default=False, compare=False)
    use_split_qkv_input: bool = field(default=False, compare=False)
    use_hook_mlp_in: bool = field(default=False, compare=False)
    use_attn_in: bool = field(default=False, compare=False)
    # TransformerLens's random initialisation (HookedTransformer(cfg), model.init_weights()): every weight matrix
    # normal(0, initializer_range), drawn from a generator seeded with seed (None: torch's global one)
    initializer_range: float | None = field(default=None, compare=False)
    seed: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        _explain_frozen(type(self))  # this class's and each family subclass's dataclass-made __setattr__
        sizes = ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_head", "d_vocab", "max_position_embeddings")
        for name in sizes:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.n_heads}) must be a multiple of num_key_value_heads ({self.n_kv_heads})"
            )
        if self.d_rot % 2:  # the rotary turns dimensions in pairs
            raise ValueError(
                f"head dimension {self.d_head} x partial_rotary_factor {self.rope.partial_rotary_factor} gives "
                f"{self.d_rot} rotated dimensions; the rotary needs an even number"
            )
        if not 1 <= self.topk_group <= self.n_group or (self.n_experts and self.n_experts % self.n_group):
            raise ValueError(
                f"{self.n_experts} experts in n_group {self.n_group} groups, topk_group {self.topk_group}: need "
                "1 <= topk_group <= n_group and the experts evenly split into the groups"
            )
        if self.topk_norm_p is not None and not self.topk_norm_p > 0:
            raise ValueError(f"topk_norm_p must be positive (or None: no p-norm), got {self.topk_norm_p}")
        if self.attention_windows and len(self.attention_windows) != self.n_layers:
            raise ValueError(f"attention_windows ({len(self.attention_windows)}) needs one entry per layer ({self.n_layers})")
        if len(self.moe_layers) != self.n_layers or len(self.top_k_per_layer) != self.n_layers:
            raise ValueError(
                f"moe_layers ({len(self.moe_layers)}) and top_k_per_layer ({len(self.top_k_per_layer)}) need one "
                f"entry per layer ({self.n_layers})"
            )
        for layer, (is_moe, k) in enumerate(zip(self.moe_layers, self.top_k_per_layer, strict=True)):
            if is_moe and not 1 <= k <= self.n_experts:
                raise ValueError(f"layer {layer}: top_k {k} must be between 1 and n_experts ({self.n_experts})")

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer`'s attention (None: full causal attention)."""
        return self.attention_windows[layer] if self.attention_windows else None

    def expert_spec(self) -> ExpertSpec:
        """The routed experts' contract: act_fn(gate) * up without biases, unless the family's config says
        otherwise (a subclass overrides this)."""
        return ExpertSpec(self.n_experts, self.d_model, self.d_expert, GLU(self.act_fn), storage=self.expert_storage)

    @property
    def n_routable_experts(self) -> int:
        """The router's axis: every expert id a slot may name, the real experts then the identity
        (zero-computation) ones (LongCat-Flash's); n_experts where there are none."""
        return self.expert_spec().n_routable if self.n_experts else self.n_experts

    @property
    def moe_layer_indices(self) -> list[int]:
        """Indices of the mixture blocks (the others are dense MLPs)."""
        return [i for i, moe in enumerate(self.moe_layers) if moe]

    @property
    def dense_layer_indices(self) -> list[int]:
        return [i for i, moe in enumerate(self.moe_layers) if not moe]

    # TransformerLens's config names, with its meaning, for code written against HookedTransformerConfig
    @property
    def n_ctx(self) -> int:
        """Longest input the model was configured for (max_position_embeddings)."""
        return self.max_position_embeddings

    @property
    def n_key_value_heads(self) -> int:
        return self.n_kv_heads

    @property
    def normalization_type(self) -> str:
        return "RMS"

    @property
    def positional_embedding_type(self) -> str:
        return "rotary"

    @property
    def d_rot(self) -> int:
        """Rotated dimensions per head (the rest pass through)."""
        return int(self.d_head * self.rope.partial_rotary_factor)

    @property
    def eps(self) -> float:
        """The norms' epsilon."""
        return self.norm_eps

    @property
    def d_vocab_out(self) -> int:
        """Logits per position (the unembedding's width): d_vocab."""
        return self.d_vocab

    @property
    def rotary_dim(self) -> int:
        """Rotated dimensions per head: d_rot."""
        return self.d_rot

    @property
    def rotary_base(self) -> float:
        """The rotary's theta (YaRN and alpha-NTK settings are in rope)."""
        return self.rope.theta

    @property
    def rotary_adjacent_pairs(self) -> bool:
        """True where the rotated dims are interleaved pairs (config.json's rope_interleave)."""
        return self.rope.interleaved

    @property
    def num_experts(self) -> int | None:
        """Routed experts per mixture layer; None for a model without any (TransformerLens's convention)."""
        return self.n_experts or None

    @property
    def top_k(self) -> int:
        """Experts each token is routed to in every mixture layer, one int (TransformerLens code does arithmetic
        with it). A ValueError where the mixture layers differ (Hunyuan's moe_topk may) or there are none:
        top_k_per_layer[L] holds each block's (0 for a dense one)."""
        ks = {self.top_k_per_layer[layer] for layer in self.moe_layer_indices}
        if len(ks) != 1:
            per_layer = {layer: self.top_k_per_layer[layer] for layer in self.moe_layer_indices}
            what = f"its mixture layers route to different numbers of experts ({per_layer})" if ks else "it has no mixture layer"
            raise ValueError(f"cfg.top_k is one int for the whole model, but {what}; read cfg.top_k_per_layer[L] for block L's")
        return ks.pop()

    @property
    def experts_per_token(self) -> int | None:
        """Experts each token is routed to, in the first mixture layer (top_k_per_layer holds every layer's);
        None without mixture layers."""
        moe = self.moe_layer_indices
        return self.top_k_per_layer[moe[0]] if moe else None

    @property
    def gated_mlp(self) -> bool:
        """Every MLP and expert here is gated: act(x W_gate) * (x W_in), then W_out."""
        return True

    @property
    def final_rms(self) -> bool:
        return True

    @property
    def attn_only(self) -> bool:
        return False

    @property
    def parallel_attn_mlp(self) -> bool:
        return False

    @property
    def attention_dir(self) -> str:
        return "causal"


REQUIRED = object()  # default of the typed reads (and of a family's defaults): the field must be present

# The most moelens accepts for config.json's size fields: ten times and more what the largest published
# models use (~100 layers, 512 experts, d_model 7168, 262k tokens), and low enough that reading a config and
# building its model on the meta device (`moelens plan` does), per layer and per expert, stays within
# seconds to a minute or two. A value past its bound is a mistake in config.json: 10**9 layers would cost
# minutes and gigabytes before any other check could run.
SIZE_BOUNDS = {
    "num_hidden_layers": 2**10,
    "num_experts": 2**14, "n_routed_experts": 2**14, "num_local_experts": 2**14, "n_shared_experts": 2**10,
    "hidden_size": 2**17, "vocab_size": 2**22,
    "intermediate_size": 2**20, "moe_intermediate_size": 2**20, "shared_expert_intermediate_size": 2**20,
    "num_attention_heads": 2**12, "num_key_value_heads": 2**12,
    "head_dim": 2**14, "attention_head_dim": 2**14, "v_head_dim": 2**14, "qk_rope_head_dim": 2**14,
    "qk_nope_head_dim": 2**14, "q_lora_rank": 2**17, "kv_lora_rank": 2**17,
}



def check_layer_kinds(layer_types: tuple[str, ...], n_layers: int, kinds: tuple[str, ...]) -> None:
    """A hybrid family's per-layer kinds (its config's layer_types): one per layer, each one of `kinds`."""
    if len(layer_types) != n_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries, expected one per layer ({n_layers})")
    unknown = sorted({kind for kind in layer_types if kind not in kinds})
    if unknown:
        raise ValueError(f"layer_types: unknown layer kinds {unknown}; expected {' or '.join(kinds)}")

def refuse_unread_fields(raw: dict, spellings: dict[str, str], config_class: str) -> None:
    """Refuse, naming the name to use, each field that config.json gives under moelens's name where the family's
    transformers config class reads only its own spelling ({its name: moelens's}): transformers would leave the
    value unread, so reading it would make a model transformers does not."""
    for name in sorted(set(spellings.values()) & set(raw)):
        theirs = next(other for other, field in spellings.items() if field == name)
        raise ValueError(
            f"config.json gives {name}, which transformers' {config_class} does not read (it reads {theirs}); "
            f"spell it {theirs}"
        )


def canonical_spellings(raw: dict, spellings: dict[str, str]) -> tuple[dict, dict[str, str]]:
    """raw with each other spelling ({other name: field}, as transformers' attribute_map) renamed to its field, and
    {field: the other name} for those renamed. A config.json giving both names different values is refused,
    naming both: which one the checkpoint was saved for cannot be told."""
    canonical, spelled = dict(raw), {}
    for other, name in spellings.items():
        if raw.get(other) is None:
            continue
        given = spelled.get(name, name)  # the field itself, or another spelling of it read before
        if canonical.get(name) is not None and canonical[name] != raw[other]:
            raise ValueError(
                f"config.json gives both {other} = {raw[other]!r} and {given} = {canonical[name]!r}: they are two "
                "names of one field; keep one"
            )
        canonical[name] = canonical.pop(other)
        spelled[name] = other
    return canonical, spelled


class HFConfig:
    """config.json, read field by field: records what was read, and names a missing or bad field clearly.

    The typed reads (integer, number, flag, text, integers, per_layer, section) refuse a value of the wrong
    type or out of range with a ValueError naming the field, the value and what was expected. JSON ints are
    ints: 3.0 is not accepted where an integer is needed, nor true (a bool) anywhere a number is.
    A field that is null counts as absent, as in transformers.
    """

    def __init__(self, raw: dict, parents: dict[str, str] | None = None, spelled: dict[str, str] | None = None) -> None:
        self.raw = raw
        self.parents = parents or {}  # field -> the section it sits in, for the messages of nested fields
        self.spelled = spelled or {}  # field -> the other spelling config.json used for it (canonical_spellings)
        self.read: list[str] = []

    @classmethod
    def with_spellings(cls, raw: dict, spellings: dict[str, str]) -> HFConfig:
        """config.json where a family's config class accepts other names for some fields (transformers'
        attribute_map: {other name: field}); messages name the field as config.json spells it."""
        canonical, spelled = canonical_spellings(raw, spellings)
        return cls(canonical, spelled=spelled)

    def __contains__(self, name: str) -> bool:
        return name in self.raw

    def label(self, name: str) -> str:
        name_in_file = self.spelled.get(name, name)
        return f"{self.parents[name]}.{name_in_file}" if name in self.parents else name_in_file

    def req(self, name: str):
        if name not in self.raw:
            raise KeyError(self.label(name))
        return self.opt(name)

    def opt(self, name: str, default=None):
        if name not in self.read:
            self.read.append(name)
        value = self.raw.get(name)
        return default if value is None else value

    def _value(self, name: str, default):
        value = self.opt(name)
        if value is None:
            if default is REQUIRED:
                raise KeyError(self.label(name))
            return default, False
        return value, True

    def integer(self, name: str, default=REQUIRED, *, at_least: int | None = None, at_most: int | None = None):
        value, present = self._value(name, default)
        if present:
            _check_integer(value, self.label(name), at_least, at_most)
            _check_bound(value, name, self.label(name))
        return value

    def number(
        self, name: str, default=REQUIRED, *, at_least: float | None = None, above: float | None = None,
        at_most: float | None = None,
    ):
        """A finite number (a JSON int is a fine float); at_least and at_most inclusive, above exclusive."""
        value, present = self._value(name, default)
        if not present:
            return value
        number = not isinstance(value, bool) and isinstance(value, (int, float)) and _finite(value)
        if not number or not _within(value, at_least, above, at_most):
            raise _bad(self.label(name), value, _expected("a finite number", at_least, above, at_most))
        return float(value)

    def flag(self, name: str, default=REQUIRED):
        value, present = self._value(name, default)
        if present and not isinstance(value, bool):
            raise _bad(self.label(name), value, "true or false")
        return value

    def text(self, name: str, default=REQUIRED):
        value, present = self._value(name, default)
        if present and not isinstance(value, str):
            raise _bad(self.label(name), value, "a string")
        return value

    def integers(self, name: str, default=REQUIRED, *, at_least: int | None = None, at_most: int | None = None):
        """A list of integers, each checked as integer() checks one."""
        value, present = self._value(name, default)
        if not present:
            return value
        if not isinstance(value, list):
            raise _bad(self.label(name), value, "a list of integers")
        for i, item in enumerate(value):
            _check_integer(item, f"{self.label(name)}[{i}]", at_least, at_most)
            _check_bound(item, name, f"{self.label(name)}[{i}]")
        return list(value)

    def per_layer(self, name: str, n_layers: int, *, at_least: int | None = None, at_most: int | None = None):
        """One integer for every layer, or a list with one per layer."""
        if isinstance(self.raw.get(name), list):
            values = self.integers(name, at_least=at_least, at_most=at_most)
            if len(values) != n_layers:
                raise ValueError(f"{self.label(name)} has {len(values)} entries, expected one per layer ({n_layers})")
            return tuple(values)
        return (self.integer(name, at_least=at_least, at_most=at_most),) * n_layers

    def section(self, name: str) -> HFConfig:
        """A nested object (rope_scaling, ...), read the same way; absent or null reads as empty."""
        value, present = self._value(name, {})
        if present and not isinstance(value, dict):
            raise _bad(self.label(name), value, "a JSON object")
        return HFConfig(value, {key: self.label(name) for key in value})

    def head_dim(self, names: tuple[str, ...] = ("head_dim",), hidden_size: int = REQUIRED) -> int:
        """The first of `names` present, else hidden_size // num_attention_heads (transformers' default);
        hidden_size: the family's default for it, where config.json has none."""
        for name in names:
            d_head = self.integer(name, None, at_least=1)
            if d_head is not None:
                return d_head
        hidden, heads = self.integer("hidden_size", hidden_size, at_least=1), self.integer("num_attention_heads", at_least=1)
        if hidden < heads:
            raise ValueError(
                f"hidden_size ({hidden}) / num_attention_heads ({heads}) leaves no dimension per head "
                f"(and the config has no {' or '.join(names)})"
            )
        return hidden // heads

    def rope_section(self) -> HFConfig:
        """Rotary settings in either spelling, rope_parameters (transformers) over rope_scaling (Hub)."""
        params, scaling = self.section("rope_parameters"), self.section("rope_scaling")
        return HFConfig({**scaling.raw, **params.raw}, {**scaling.parents, **params.parents})

    def rope(self, partial_rotary_factor: float = 1.0, theta: float = 10000.0) -> RopeConfig:
        """Rotary settings from either spelling: rope_theta + rope_scaling (Hub) or rope_parameters (transformers).
        partial_rotary_factor, theta: the family's defaults where config.json gives none (in either place)."""
        rope = self.rope_section()
        theta = rope.number("rope_theta", self.number("rope_theta", theta, above=0), above=0)
        kind = rope.text("rope_type", rope.text("type", "default"))
        partial = rope.number(
            "partial_rotary_factor",
            self.number("partial_rotary_factor", partial_rotary_factor, above=0, at_most=1),
            above=0,
            at_most=1,
        )
        if kind == "default":
            return RopeConfig(theta=theta, partial_rotary_factor=partial)
        if kind == "yarn":
            original_max = rope.integer("original_max_position_embeddings", None, at_least=1)
            original_max = original_max or self.integer("max_position_embeddings", at_least=1)
            factor = rope.number("factor", None, above=0)
            if factor is None:  # transformers' implicit factor
                factor = self.integer("max_position_embeddings", at_least=1) / original_max
            return RopeConfig(
                theta=theta,
                kind="yarn",
                partial_rotary_factor=partial,
                factor=factor,
                original_max_position_embeddings=original_max,
                beta_fast=rope.number("beta_fast", 32.0, above=0),
                beta_slow=rope.number("beta_slow", 1.0, above=0),
                mscale=rope.number("mscale", None),
                mscale_all_dim=rope.number("mscale_all_dim", None),
                attention_factor=rope.number("attention_factor", None, above=0),
                truncate=rope.flag("truncate", True),
            )
        if kind == "llama3":
            return self.llama3_rope(rope, theta, partial)
        if kind == "longrope":
            return self.longrope(rope, theta, partial)
        raise ValueError(f"rope type {kind!r} is not supported by this family (rope settings: {rope.raw})")

    def longrope(self, rope: HFConfig, theta: float, partial: float) -> RopeConfig:
        """LongRoPE: short_factor and long_factor (one per rotated frequency) and the two mscales are required;
        original_max_position_embeddings in the rope settings, else config.json's top level (Phi-3.5-MoE has
        both); factor and attention_factor as transformers reads them."""
        half = int(self.head_dim() * partial) // 2
        factors = {}
        for name in ("short_factor", "long_factor"):
            value = rope.req(name)
            if not isinstance(value, list) or len(value) != half or not all(
                not isinstance(v, bool) and isinstance(v, (int, float)) and _finite(v) and v > 0 for v in value
            ):
                raise _bad(rope.label(name), value, f"a list of {half} positive numbers (one per rotated frequency)")
            factors[name] = tuple(float(v) for v in value)
        original_max = rope.integer("original_max_position_embeddings", None, at_least=1)
        original_max = original_max or self.integer("original_max_position_embeddings", at_least=1)
        return RopeConfig(
            theta=theta, kind="longrope", partial_rotary_factor=partial, original_max_position_embeddings=original_max,
            factor=rope.number("factor", self.integer("max_position_embeddings", at_least=1) / original_max, above=0),
            attention_factor=rope.number("attention_factor", None, above=0), **factors,
            short_mscale=rope.number("short_mscale"), long_mscale=rope.number("long_mscale"),
        )

    def llama3_rope(self, rope: HFConfig, theta: float, partial: float) -> RopeConfig:
        """Llama 3's rotary scaling: factor, low_freq_factor, high_freq_factor and
        original_max_position_embeddings are required, as transformers reads them. Equal low and high factors
        (Llama 4 Scout's) leave no band to blend: every frequency is kept or divided."""
        low = rope.number("low_freq_factor", above=0)
        high = rope.number("high_freq_factor", above=0)
        return RopeConfig(
            theta=theta, kind="llama3", partial_rotary_factor=partial, factor=rope.number("factor", above=0),
            original_max_position_embeddings=rope.integer("original_max_position_embeddings", at_least=1),
            low_freq_factor=low, high_freq_factor=high,
        )


def common_fields(
    hf: HFConfig,
    *,
    rms_norm_eps: float,
    max_position_embeddings: int,
    num_key_value_heads: int | None = None,
    hidden_size: int = REQUIRED,
    rope_theta: float = 10000.0,
    partial_rotary_factor: float = 1.0,
    d_head: int | None = None,
    rope: RopeConfig | None = None,
    act_fn: str | None = None,
) -> dict:
    """The MoeConfig fields every family reads from the same config.json fields: d_model (hidden_size),
    n_layers (num_hidden_layers), n_heads (num_attention_heads), n_kv_heads (num_key_value_heads), d_head
    (head_dim, else hidden_size // num_attention_heads), d_vocab (vocab_size), norm_eps (rms_norm_eps), rope
    (HFConfig.rope), max_position_embeddings, act_fn (hidden_act, "silu" where absent) and tie_word_embeddings
    (false where absent).

    The keywords named as config.json's fields are the family's defaults for them where config.json has none
    (transformers' config class's): hidden_size is required unless given one, num_key_value_heads None means
    num_attention_heads. d_head, rope: the family's own reading of them, where it has one. act_fn: the family's
    fixed activation, where config.json's hidden_act does not choose it (then hidden_act is not read)."""
    n_heads = hf.integer("num_attention_heads", at_least=1)
    kv_default = n_heads if num_key_value_heads is None else num_key_value_heads
    return dict(
        d_model=hf.integer("hidden_size", hidden_size, at_least=1),
        n_layers=hf.integer("num_hidden_layers", at_least=1),
        n_heads=n_heads,
        n_kv_heads=hf.integer("num_key_value_heads", kv_default, at_least=1),
        d_head=hf.head_dim(hidden_size=hidden_size) if d_head is None else d_head,
        d_vocab=hf.integer("vocab_size", at_least=1),
        norm_eps=hf.number("rms_norm_eps", rms_norm_eps, at_least=0),
        rope=hf.rope(partial_rotary_factor, rope_theta) if rope is None else rope,
        max_position_embeddings=hf.integer("max_position_embeddings", max_position_embeddings, at_least=1),
        act_fn=hf.text("hidden_act", "silu") if act_fn is None else act_fn,
        tie_word_embeddings=hf.flag("tie_word_embeddings", False),
    )


def routed_fields(
    hf: HFConfig, moe_layers: tuple[bool, ...], n_experts: int, d_expert: int, *, num_experts_per_tok: int = REQUIRED
) -> dict:
    """moe_layers, n_experts, d_expert as the family read them, and top_k: num_experts_per_tok (between 1 and
    n_experts; the family's default where absent) on every mixture block, 0 on the dense ones, and not read
    where no block is a mixture."""
    top_k = 0
    if any(moe_layers):
        top_k = hf.integer("num_experts_per_tok", num_experts_per_tok, at_least=1, at_most=n_experts)
    top_ks = tuple(top_k if moe else 0 for moe in moe_layers)
    return dict(moe_layers=moe_layers, n_experts=n_experts, top_k_per_layer=top_ks, d_expert=d_expert)


def _bad(label: str, value, expected: str) -> ValueError:
    # reprlib: a bad value may be a large or deeply nested structure
    return ValueError(f"{label} = {reprlib.repr(value)} ({type(value).__name__}); expected {expected}")


def _check_integer(value, label: str, at_least: int | None, at_most: int | None) -> None:
    """Refuse anything but an int (a bool or a float is not one) within the bounds."""
    if isinstance(value, bool) or not isinstance(value, int) or not _within(value, at_least, None, at_most):
        raise _bad(label, value, _expected("an integer", at_least, None, at_most))


def _check_bound(value: int, name: str, label: str) -> None:
    """A size field past SIZE_BOUNDS: refused before anything is built from it."""
    bound = SIZE_BOUNDS.get(name)
    if bound is not None and value > bound:
        raise ValueError(
            f"{label} = {value:,}: more than moelens accepts for it ({bound:,}, far above any published model); "
            "is config.json right?"
        )


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def _within(value, at_least, above, at_most) -> bool:
    return not (
        (at_least is not None and value < at_least)
        or (above is not None and value <= above)
        or (at_most is not None and value > at_most)
    )


def _expected(kind: str, at_least, above, at_most) -> str:
    if at_least is not None and at_most is not None and above is None:
        return f"{kind} between {at_least} and {at_most}"
    limits = [f"{op} {bound}" for op, bound in ((">=", at_least), (">", above), ("<=", at_most)) if bound is not None]
    return " ".join([kind, " and ".join(limits)]) if limits else kind
