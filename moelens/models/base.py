"""HookedTransformer: the model every family shares; a family adds its config mapping, its components and its
site map."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import ClassVar, Literal

import numpy as np
import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import nn

from moelens import families, generation, pretrained
from moelens.config import MoeConfig
from moelens.hook_points import HookedRootModule
from moelens.hooks.names import OPTIONAL_SITE_SWITCHES, alias_candidates
from moelens.hooks.sites import site_hook
from moelens.hooks.support import SupportTable, support_table
from moelens.kernels import BACKENDS
from moelens.kernels.offload import ExpertCacheStats
from moelens.kv_cache import KVCache
from moelens.load_options import load_options
from moelens.models.components import Block, Embed, Rotary
from moelens.models.components.attention import set_use_attn_result
from moelens.models.components.embed import Unembed
from moelens.models.context import LayerInputs
from moelens.models.recipe import Recipe
from moelens.positions import check_attention_mask, positions_from_mask
from moelens.sae import HookedSAEMixin
from moelens.sitemap import SiteMap
from moelens.tokenizer import MoeTokenizer, TokenizationError, check_padding_side
from moelens.utils import get_attention_mask
from moelens.weights import WeightViews, hidden_weight_count

ReturnType = Literal["logits", "loss", "both"] | None


class OptionalHookOffError(KeyError, AssertionError):
    """A hook of TransformerLens's set_use_* switches named while the switch is off: a KeyError as every unknown
    name, and an AssertionError as TransformerLens raises there."""


class GroupedQueryAttentionError(ValueError, AssertionError):
    """set_use_attn_in on grouped-query attention: a ValueError, and an AssertionError as TransformerLens
    raises there (with its message first)."""


def _optional_switch(name: str) -> tuple[str, str] | None:
    """(hook tail, the set_use_* method that creates it) for one of the optional sites, else None."""
    tail = name.rsplit(".", 1)[-1]
    tail = tail if tail.startswith("hook_") else f"hook_{tail}"  # an alias: "result" -> "hook_result"
    switch = OPTIONAL_SITE_SWITCHES.get(tail)
    return None if switch is None else (tail, switch)


def _switch_value(value: bool, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


class _BuildsFromConfig(type):
    """HookedTransformer(cfg), as in TransformerLens: the cfg's family with random weights
    (HookedTransformer.from_config); a family's class called directly builds it unfilled, for a load to fill."""

    def __call__(cls, *args, **kwargs):
        if cls.recipe.__func__ is HookedTransformer.recipe.__func__:  # not a family's class
            return cls.from_config(*args, **kwargs)
        return super().__call__(*args, **kwargs)


# leaves that take the constructor's value however the model is initialised are the other 1-D ones: norm weights
# (1) and the state-space mixers' decay and step parameters (transformers' values); these are drawn as weights
_DRAWN_1D = ("sinks",)


def keep_float32(model: nn.Module) -> None:
    """Back to float32, whatever the model's dtype: every tensor of a module whose class says float32_weight (some
    routers and norms), and the parameters a class names in float32_params (Flint's attention sinks), as
    transformers keeps them."""
    for module in model.modules():
        if getattr(module, "float32_weight", False):
            module.float()
        for name in getattr(module, "float32_params", ()):
            param = module._parameters[name]
            module._parameters[name] = nn.Parameter(param.detach().float(), requires_grad=param.requires_grad)


class HookedTransformer(HookedSAEMixin, WeightViews, HookedRootModule, metaclass=_BuildsFromConfig):
    """A decoder-only MoE language model with a HookPoint at every site (see model.support()).

    Layout conventions: tensors crossing the API are [batch pos ...]; per-expert data is dense per routing
    slot ([batch pos top_k ...]); weights keep the checkpoint's [out, in] layout.
    """

    model_type: ClassVar[str] = ""  # config.json's model_type; a family class with one registers itself
    rotary_class: ClassVar[type[Rotary]] = Rotary  # a family whose rotary tables differ names its own

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("model_type"):
            families.register(cls)

    def __init__(self, cfg: MoeConfig, tokenizer: MoeTokenizer | None = None) -> None:
        """A family's model for cfg, its weights unfilled (a load fills them; init_weights() draws them).
        HookedTransformer(cfg) itself is TransformerLens's: see from_config."""
        super().__init__()
        self.cfg = cfg
        self.tokenizer = tokenizer
        recipe = self.recipe(cfg)
        recipe.check(cfg)
        self.embed = Embed(cfg.d_vocab, cfg.d_model, recipe.embedding_multiplier)
        self.hook_embed = site_hook("hook_embed")
        self.rotary = self.rotary_class(cfg)
        self.blocks = nn.ModuleList((spec.block or Block)(cfg, layer, spec) for layer, spec in enumerate(recipe.layers))
        self.ln_final = recipe.final_norm(cfg.d_model, cfg.norm_eps)
        self.unembed = Unembed(cfg.d_model, cfg.d_vocab, cfg.unembed_bias, recipe.logits_divisor, recipe.logits_softcap)
        self.hook_logits = site_hook("hook_logits", "default" if recipe.logits_softcap is None else "softcapped")
        self.tie_weights()
        self.setup()
        self._warned_too_long = False
        # TransformerLens's cfg.n_params, counted once from the modules as built (offloading or sharding the
        # experts later does not change the model's size), and cfg.device / cfg.dtype as they are
        self.cfg = dataclasses.replace(self.cfg, n_params=self._count_weight_matrices())
        self._sync_cfg()
        self._apply_cfg_switches()

    # ---- construction helpers used by the loader ---------------------------------------------------
    def tie_weights(self) -> None:
        """Share the embedding's weight with the unembedding where config.json ties them."""
        if self.cfg.tie_word_embeddings:
            self.unembed.weight = self.embed.weight

    @classmethod
    def config_from_hf(cls, hf: dict) -> MoeConfig:  # pragma: no cover - every family overrides
        raise NotImplementedError(f"{cls.__name__} does not define config_from_hf")

    @classmethod
    def flat_config_json(cls, config: dict) -> dict:
        """The family's config.json in the flat spelling moelens.tl_config fills (hidden_size, num_experts, ...);
        a family whose config.json nests or renames those (DBRX) overrides this and nested_config_json."""
        return dict(config)

    @classmethod
    def nested_config_json(cls, flat: dict) -> dict:
        """flat_config_json's inverse: the flat spelling back in the family's own."""
        return dict(flat)

    @classmethod
    def recipe(cls, cfg: MoeConfig) -> Recipe:  # pragma: no cover - every family overrides
        """Each layer's token mixer, feed-forward and norm for this config (moelens.models.recipe)."""
        raise NotImplementedError(f"{cls.__name__} does not define recipe")

    @classmethod
    def site_map(cls, cfg: MoeConfig) -> SiteMap:  # pragma: no cover - every family overrides
        """Each parameter's checkpoint key(s) and each hook's transformers module, for this config."""
        raise NotImplementedError(f"{cls.__name__} does not define site_map")

    @classmethod
    def build(cls, cfg: MoeConfig) -> HookedTransformer:
        """The model on the meta device, in cfg.dtype, what the family keeps float32 float32 (keep_float32):
        what loading fills and what `moelens plan` counts."""
        with torch.device("meta"):
            model = cls(cfg)
        model.to(cfg.dtype)
        keep_float32(model)
        return model

    @classmethod
    def from_config(
        cls,
        cfg: MoeConfig,
        tokenizer=None,
        move_to_device: bool = True,
        default_padding_side: Literal["left", "right"] = "right",
    ) -> HookedTransformer:
        """TransformerLens's HookedTransformer(cfg, tokenizer, move_to_device, default_padding_side): a model of
        cfg's family (cfg from moelens.HookedTransformerConfig(..., family=...), or any model's cfg) with random
        weights, as init_weights() draws them, in cfg.dtype (the modules the family keeps float32 in float32),
        on cfg.device (move_to_device), with the tokenizer given, if any (the model needs none to run tokens)."""
        if not isinstance(cfg, MoeConfig):
            raise TypeError(
                f"HookedTransformer(cfg): cfg must be a config (moelens.HookedTransformerConfig(...)), got {type(cfg).__name__}"
            )
        family = families.FAMILIES.get(cfg.family)
        if family is None:
            raise ValueError(f"HookedTransformer(cfg): cfg.family = {cfg.family!r} is not one of {sorted(families.FAMILIES)}")
        if cfg.expert_placement != "resident" or cfg.expert_storage is not None:
            raise ValueError(
                f"HookedTransformer(cfg): a random model's experts are parameters of the model; cfg has expert_placement "
                f"{cfg.expert_placement!r} and expert_storage {cfg.expert_storage!r} (use dataclasses.replace(cfg, "
                "expert_placement='resident', expert_storage=None))"
            )
        dtype = cfg.dtype
        model = family(cfg)
        model.init_weights()
        model.to(dtype)
        keep_float32(model)
        if move_to_device:
            model.to(cfg.device)
        if tokenizer is not None:
            model.set_tokenizer(tokenizer, default_padding_side=default_padding_side)
        return model

    def init_weights(self) -> None:
        """TransformerLens's init_weights (its default init_mode, "gpt2"): every weight matrix (embedding,
        projections, routers, expert stacks, convolutions; and gpt-oss's attention sinks) drawn from
        normal(0, cfg.initializer_range), default 0.8 / sqrt(d_model) as TransformerLens's; biases 0; norm weights
        1 and the state-space mixers' own parameters as their constructor sets them (transformers' values). The
        draws come from a generator seeded with cfg.seed, in the order of named_parameters(), else from torch's
        global one. Refused for experts that are not parameters (stored or offloaded)."""
        held = [layer for layer, block in enumerate(self.blocks) if block.is_moe and block.mlp.experts.stacks_held_elsewhere(torch.float32)]
        if held:
            raise ValueError(f"init_weights: the routed experts of layers {held} are not parameters of the model (stored or offloaded)")
        std = self.cfg.initializer_range
        std = 0.8 / float(np.sqrt(self.cfg.d_model)) if std is None else std
        generator = None
        if self.cfg.seed is not None:
            generator = torch.Generator(device=self.embed.weight.device).manual_seed(self.cfg.seed)
        with torch.no_grad():
            for name, param in self.named_parameters():
                leaf = name.rsplit(".", 1)[-1]
                if leaf == "bias" or leaf.startswith("b_"):
                    param.zero_()
                elif param.ndim >= 2 or leaf in _DRAWN_1D:
                    param.normal_(0.0, std, generator=generator)

    @classmethod
    def from_pretrained(
        cls,
        model_name: str,
        fold_ln: bool = False,
        center_writing_weights: bool = False,
        center_unembed: bool = False,
        refactor_factored_attn_matrices: bool = False,
        checkpoint_index: int | None = None,
        checkpoint_value: int | None = None,
        hf_model=None,
        device: torch.device | str | None = "cpu",
        n_devices: int = 1,
        tokenizer=None,
        move_to_device: bool = True,
        fold_value_biases: bool = False,
        default_prepend_bos: bool | None = None,
        default_padding_side: Literal["left", "right"] = "right",
        dtype: torch.dtype | str = torch.float32,
        first_n_layers: int | None = None,
        *,
        revision: str | None = None,
        progress: bool | None = None,
        experts_backend: str = "auto",
        device_map: Literal["auto"] | dict[str, str | torch.device] | None = None,
        max_memory: dict[str, int | str] | None = None,
        check_finite: bool = True,
        expert_offload: Literal["cpu", "disk"] | None = None,
        expert_cache_bytes: int | str | None = None,
        expert_parallel: bool = False,
        expert_prefetch: bool | None = None,
        expert_parallel_timeout: float | None = None,
        expert_storage: Literal["fp8", "mxfp4", "dense"] | None = None,
        plan_batch: int | None = None,
        plan_seq: int | None = None,
        **from_pretrained_kwargs,
    ) -> HookedTransformer:
        """Load a checkpoint (local folder, Hub id or embedded default name); the family is chosen from
        config.json's model_type. TransformerLens's arguments come first, in its order, with its meaning;
        moelens's own follow, by keyword only.

        Where moelens's defaults differ from TransformerLens's (from_pretrained_no_processing is the same in both):
        - fold_ln=False, center_unembed=False (TL: True). Routing is discontinuous, so folding can flip
          near-tied expert choices (see moelens.fold); TL itself skips fold_ln on MoE models.
        - center_writing_weights=False (TL: True): True is refused, see below.
        - fold_value_biases=False (TL: True): True is refused, see below.
        - device="cpu" (TL: the GPU if there is one; pass device=None for that).
        - default_prepend_bos=None means: prepend a BOS exactly when the checkpoint's tokenizer adds one itself
          (so text gives the ids transformers gives; Llama/Mixtral-style tokenizers do, Qwen's do not). TL's
          default is True for most models; pass default_prepend_bos=True for that. A tokenizer without a BOS
          token then prepends its eos token, as TransformerLens does (it sets bos_token = eos_token).

        TransformerLens's arguments:
        fold_ln: fold every RMSNorm weight into the weights that read it and set the norms' weights to 1
            (logits unchanged; Hunyuan's per-head q/k norms stay, see moelens.fold); counts the probe tokens
            whose experts changed in model.routing_changes and warns when any did.
        center_writing_weights: refused when True: an RMSNorm subtracts no mean, so there is no mean for
            centered writing weights to leave unchanged (TL skips it on RMS models); not done on the LayerNorm
            models (Phi-3.5-MoE, DBRX) either.
        center_unembed: subtract the vocabulary mean from W_U (logits move by a per-position constant;
            probabilities unchanged).
        refactor_factored_attn_matrices: refused when True: with rotary embeddings the QK circuit depends on
            positions (TransformerLens refuses rotary models too).
        checkpoint_index, checkpoint_value, hf_model, first_n_layers: refused unless None (TL's training
            checkpoints, an already-loaded transformers model, loading part of the layers).
        device: where the weights go (None: "cuda" if available, else "cpu"). device="meta" builds the model
            for inspection only (cfg, modules, support(); no forward): headers are checked, weights not read.
        n_devices: split whole blocks over CUDA devices device, device+1, ... as TransformerLens did: block i on
            device i // (n_layers // n_devices) (the remainder on the last), the embedding with block 0, the
            final norm and unembedding with the last block. Needs that many visible CUDA devices; not with
            device_map (it is one).
        tokenizer: use this tokenizer (a Hugging Face fast tokenizer, a tokenizers.Tokenizer or a MoeTokenizer)
            instead of the checkpoint's; see set_tokenizer.
        move_to_device: False loads the weights onto the CPU whatever `device` says (cfg.device then says "cpu").
        fold_value_biases: refused when True: moelens keeps b_V where the checkpoint has it.
        default_prepend_bos: cfg.default_prepend_bos, what to_tokens and friends do when prepend_bos is None.
        default_padding_side: the tokenizer's padding side, "right" or "left".
        dtype: a torch dtype or its name ("float32"/"fp32"/"float", "bfloat16"/"bf16", "float16"/"fp16"/"half",
            "float64"); the keyword torch_dtype, as in TransformerLens, overrides it.
        Other keywords (TransformerLens passes them to Hugging Face's from_pretrained) are a TypeError naming them.

        moelens's arguments:
        revision: the Hub revision. progress: show a progress bar. check_finite: warn about weights that hold
        NaN or Inf (one pass over each tensor as it loads). Every problem with the checkpoint is a
        CheckpointError raised here, naming the file and the field or tensor at fault.
        experts_backend: "auto" (the torch path, except on CUDA GPU architectures where the Triton kernels'
        tests have passed on real hardware: moelens.kernels.experts.VERIFIED_TRITON_ARCHS), "torch" or "triton";
        resolved here for the device the experts are on, and again when the model moves.
        expert_offload: keep the routed experts off `device` ("cpu": in host memory, pinned for CUDA;
        "disk": read from the checkpoint's files when routed to) and fetch those a batch routes to through
        a cache of at most expert_cache_bytes on `device` (bytes, or a size like "20GB"; default: one layer's
        experts; at least one expert), least recently used out first: all the routed experts take there, as the
        kernels read them from the cache and a layer routing to more runs in groups that fit (moelens.kernels.
        offload). Logits and every hook are bit for bit those of the resident model, at every cache size;
        model.expert_cache_stats() counts hits, misses and bytes moved. Not with fold_ln.
        device_map: whole blocks per device, in place of `device` (see moelens.placement): a mapping of
        "embed", "blocks.A-B", "ln_final", "unembed" to devices, or "auto" to fill max_memory ({device:
        bytes or "80GB"}; default 90% of each visible GPU) in order. Each tensor is loaded straight to its
        device; the residual stream moves between blocks; every hook sees a whole tensor on its block's
        device. Combines with expert_offload (each layer's cached experts on its block's device).
        The map used is model.device_map ({"embed" | "blocks.L" | "ln_final" | "unembed": device}).
        "auto" is the placement `moelens plan` recommends (moelens.plan.auto_device_map): it leaves room on each
        device for a forward of plan_batch x plan_seq tokens (default 1 x 2048, as `moelens plan`) and its
        KV cache; with expert_offload it counts the mapped (non-expert) weights and the expert cache.
        expert_prefetch: with expert_offload, once a layer has routed, a background thread loads the experts
        the next layer's router picks for this layer's input, so that loading overlaps compute; results are
        unchanged (the layer still loads whatever it routes to). None (default): on for "disk", where it
        paid in benchmarks/bench_offload.py, off for "cpu". expert_cache_stats() counts prefetch hits and waste.
        expert_parallel: under torchrun (or any initialised default process group), rank r of N reads and
        holds only experts [r*E//N, (r+1)*E//N) of each layer; the rest is replicated, and every rank's
        logits, hooks and caches are bit for bit one process's (see moelens.kernels.expert_parallel). Torch
        experts backend only; not with fold_ln, device_map or expert_offload; no backward through experts.
        expert_parallel=G (an int): one model per group of G consecutive ranks instead of over all of them.
        The ranks must run the same forwards on the same inputs with hooks that change the same values: each
        expert exchange is checked first, and a difference is an ExpertParallelError on every rank naming it.
        expert_parallel_timeout: seconds a rank waits for the others at an expert exchange before raising
        ExpertParallelError naming the layer (None: 300; torch's own default would be 30 minutes).
        expert_storage: None (or "dense"): a quantized checkpoint's experts are dequantized at load. "fp8" /
        "mxfp4": every mixture layer's routed experts stay as the checkpoint stores them (fp8 codes and block
        scales; MXFP4 blocks and scales) and each routed expert is dequantized when a forward uses it, by the
        load's own function, so logits and every hook are bit for bit those of dequantizing at load. With
        expert_offload the cache holds and moves the stored bytes; with expert_parallel each rank holds its
        experts as stored. experts.tensors() returns dequantized copies; refused with fold_ln, for a checkpoint not
        stored that way, and "mxfp4" with experts_backend="triton" (the kernels dequantize fp8 in their tiles,
        to the same bits).
        """
        options = load_options(  # every argument checked here, before anything is read
            model_name, fold_ln=fold_ln, center_writing_weights=center_writing_weights, center_unembed=center_unembed,
            refactor_factored_attn_matrices=refactor_factored_attn_matrices, checkpoint_index=checkpoint_index,
            checkpoint_value=checkpoint_value, hf_model=hf_model, device=device, n_devices=n_devices,
            tokenizer=tokenizer, move_to_device=move_to_device, fold_value_biases=fold_value_biases,
            default_prepend_bos=default_prepend_bos, default_padding_side=default_padding_side, dtype=dtype,
            first_n_layers=first_n_layers, revision=revision, progress=progress, experts_backend=experts_backend,
            device_map=device_map, max_memory=max_memory, check_finite=check_finite, expert_offload=expert_offload,
            expert_cache_bytes=expert_cache_bytes, expert_parallel=expert_parallel, expert_prefetch=expert_prefetch,
            plan_batch=plan_batch, plan_seq=plan_seq, expert_parallel_timeout=expert_parallel_timeout,
            expert_storage=expert_storage,
            **from_pretrained_kwargs,
        )
        model = pretrained.load(cls, options)
        model.set_experts_backend(options.experts_backend)
        model._set_pretrained_cfg(model_name, options.tokenizer, options.default_prepend_bos, options.default_padding_side)
        return model

    @classmethod
    def from_pretrained_no_processing(
        cls,
        model_name: str,
        fold_ln: bool = False,
        center_writing_weights: bool = False,
        center_unembed: bool = False,
        refactor_factored_attn_matrices: bool = False,
        fold_value_biases: bool = False,
        dtype: torch.dtype | str = torch.float32,
        default_prepend_bos: bool | None = None,
        default_padding_side: Literal["left", "right"] = "right",
        **from_pretrained_kwargs,
    ) -> HookedTransformer:
        """from_pretrained with every weight processing off (TransformerLens's from_pretrained_no_processing):
        the checkpoint's weights as stored. In moelens that is also from_pretrained's default."""
        return cls.from_pretrained(
            model_name, fold_ln=fold_ln, center_writing_weights=center_writing_weights, center_unembed=center_unembed,
            refactor_factored_attn_matrices=refactor_factored_attn_matrices, fold_value_biases=fold_value_biases,
            dtype=dtype, default_prepend_bos=default_prepend_bos, default_padding_side=default_padding_side,
            **from_pretrained_kwargs,
        )

    def _set_pretrained_cfg(self, model_name, tokenizer, default_prepend_bos, default_padding_side) -> None:
        """After loading: the tokenizer's settings and TransformerLens's bookkeeping names in cfg."""
        if tokenizer is not None:
            self.set_tokenizer(tokenizer, default_padding_side=default_padding_side)
        elif self.tokenizer is not None:
            self.tokenizer.padding_side = default_padding_side
            self.tokenizer.name_or_path = str(model_name)  # as Hugging Face names a tokenizer: what was asked for
        tok = self.tokenizer
        prepends = None if tok is None else tok.prepends_bos
        self.cfg = dataclasses.replace(
            self.cfg,
            default_prepend_bos=bool(prepends) if default_prepend_bos is None else default_prepend_bos,
            tokenizer_prepends_bos=prepends,
            model_name=str(model_name).rstrip("/").split("/")[-1],  # TL drops the organisation
            tokenizer_name=None if tok is None else tok.name_or_path,
        )
        self._sync_cfg()

    # ---- tokens (TransformerLens's signatures and meaning) -----------------------------------------
    def _require_tokenizer(self) -> MoeTokenizer:
        if self.tokenizer is None:
            raise ValueError(
                "this model has no tokenizer (the checkpoint has no tokenizer.json): pass token ids "
                "as a LongTensor [batch pos] instead of text, or give it one with model.set_tokenizer(...)"
            )
        return self.tokenizer

    def _prepend_bos(self, prepend_bos: bool | None) -> bool:
        """TransformerLens's rule: None means cfg.default_prepend_bos."""
        return self.cfg.default_prepend_bos if prepend_bos is None else bool(prepend_bos)

    def set_tokenizer(self, tokenizer, default_padding_side: Literal["left", "right"] = "right") -> None:
        """Use `tokenizer` for text (TransformerLens's set_tokenizer): a Hugging Face *fast* tokenizer (its
        backend and special tokens are taken over; transformers is not needed by moelens), a
        tokenizers.Tokenizer (no special tokens known) or a MoeTokenizer. A missing pad token, and a missing
        BOS token, become the eos token, as in TransformerLens. It pads on default_padding_side."""
        check_padding_side(default_padding_side, "default_padding_side")
        tok = MoeTokenizer.coerce(tokenizer)
        tok.padding_side = default_padding_side
        self.tokenizer = tok
        self.cfg = dataclasses.replace(self.cfg, tokenizer_prepends_bos=tok.prepends_bos, tokenizer_name=tok.name_or_path or None)

    def to_tokens(
        self,
        input: str | list[str],
        prepend_bos: bool | None = None,
        padding_side: Literal["left", "right"] | None = None,
        move_to_device: bool = True,
        truncate: bool = True,
    ) -> Int[torch.Tensor, "batch pos"]:
        """Token ids [batch pos] of a text or a list of texts (TransformerLens's to_tokens).

        prepend_bos: one BOS first (None: cfg.default_prepend_bos); a tokenizer that adds its own BOS gets no
        second one, and False removes it. padding_side: where shorter texts are padded (None: the tokenizer's,
        "right" unless set, as in TransformerLens: every row's real tokens then keep positions 0.. and their
        logits in a plain forward; with "left" the forward infers the mask from the leading pad tokens only
        when model.tokenizer.padding_side is "left", otherwise use tokenize() for the mask). move_to_device:
        put the tokens on the model's device. truncate: keep at most cfg.n_ctx tokens per text, the first."""
        tok = self._require_tokenizer()
        side = check_padding_side(padding_side if padding_side is not None else tok.padding_side)
        limit = self.cfg.n_ctx if truncate else None
        tokens = tok.batch(input, self._prepend_bos(prepend_bos), side, max_length=limit)[0]
        return tokens.to(self.device) if move_to_device else tokens

    def tokenize(
        self, text: str | list[str], prepend_bos: bool | None = None, padding_side: str = "left"
    ) -> tuple[Int[torch.Tensor, "batch pos"], Int[torch.Tensor, "batch pos"]]:
        """(tokens, attention_mask); left-padded by default, as generation needs; prepend_bos None means
        cfg.default_prepend_bos. Nothing is truncated (the forward warns past max_position_embeddings)."""
        tokens, mask = self._require_tokenizer().batch(text, self._prepend_bos(prepend_bos), padding_side)
        return tokens.to(self.device), mask.to(self.device)

    def to_str_tokens(
        self,
        input: str | list | Int[torch.Tensor, "..."] | np.ndarray,
        prepend_bos: bool | None = None,
        padding_side: Literal["left", "right"] | None = None,
    ) -> list[str] | list[list[str]]:
        """Each token as its string (TransformerLens's to_str_tokens).

        A text: the tokens to_tokens gives it (with prepend_bos, truncated to n_ctx). A list of texts or of
        id tensors: one list per element. Ids (tensor or array) of shape [pos] or [1 pos]: one list; moelens
        also takes [batch pos] (a list per row) and a plain list of ints."""
        tok = self._require_tokenizer()
        if isinstance(input, list) and input and all(type(i) is int for i in input):
            input = torch.tensor(input, dtype=torch.long)  # moelens: a list of ids is one sequence
        if isinstance(input, list):
            if not all(isinstance(i, (str, torch.Tensor, np.ndarray)) for i in input):
                found = type(next(i for i in input if not isinstance(i, (str, torch.Tensor, np.ndarray)))).__name__
                raise TypeError(
                    f"to_str_tokens takes a list of texts or of id tensors (or one list of ints), got a list holding "
                    f"{found} (one call per row)"
                )
            return [self.to_str_tokens(i, prepend_bos, padding_side) for i in input]
        if isinstance(input, str):
            ids = self.to_tokens(input, prepend_bos, padding_side)[0]
            return [tok.id_to_str(i) for i in ids.tolist()]
        if isinstance(input, np.ndarray):
            input = torch.from_numpy(np.asarray(input))
        if not isinstance(input, torch.Tensor):
            raise TypeError(
                "to_str_tokens takes a text, a list of texts, or token ids (tensor, array or list of ints), "
                f"got {type(input).__name__}"
            )
        if input.dim() > 2:
            raise ValueError(f"to_str_tokens takes one sequence [pos] or [batch pos], got tokens of shape {tuple(input.shape)}")
        if input.numel() == 0:  # nothing to show, not an error
            return []
        ids = self._check_tokens(input.reshape(-1, input.shape[-1] if input.dim() else 1))  # [rows pos], checked
        rows = [[tok.id_to_str(i) for i in row] for row in ids.tolist()]
        return rows if input.dim() == 2 and input.shape[0] > 1 else rows[0]

    def to_string(
        self, tokens: Int[torch.Tensor, "..."] | np.ndarray | list[int] | list[torch.Tensor]
    ) -> str | list[str]:
        """Text of token ids (TransformerLens's to_string): [pos] (tensor, array, list) or a single id -> a str,
        [batch pos] -> a list of str."""
        tok = self._require_tokenizer()
        if isinstance(tokens, list) and tokens and all(isinstance(t, torch.Tensor) for t in tokens):
            tokens = torch.stack(tokens)
        tokens = torch.as_tensor(tokens)
        if tokens.dim() == 2:
            return tok.batch_decode(tokens)
        if tokens.dim() <= 1:
            return tok.decode(tokens)
        raise ValueError(f"to_string takes ids of shape [pos] or [batch pos], got shape {tuple(tokens.shape)}")

    def to_single_token(self, string: str) -> int:
        """The id of a string that is exactly one token, encoded without a BOS (TransformerLens's
        to_single_token); otherwise a TokenizationError (a ValueError and an AssertionError)."""
        ids = self._require_tokenizer().rows([string], prepend_bos=False)[0]
        if len(ids) != 1:
            raise TokenizationError(f"{string!r} is not a single token: it encodes to {len(ids)} tokens {ids}")
        return ids[0]

    def to_single_str_token(self, int_token: int) -> str:
        """The string of one token id (TransformerLens's to_single_str_token)."""
        if isinstance(int_token, bool) or not isinstance(int_token, int):
            raise TypeError(f"to_single_str_token takes an int token id, got {type(int_token).__name__}")
        return self.to_str_tokens(torch.tensor([int_token]))[0]

    def get_token_position(
        self,
        single_token: str | int | Int[torch.Tensor, ""],
        input: str | Int[torch.Tensor, "pos"] | Int[torch.Tensor, "1 pos"],
        mode: Literal["first", "last"] = "first",
        prepend_bos: bool | None = None,
        padding_side: Literal["left", "right"] | None = None,
    ) -> int:
        """Position of a token in a text or in ids [pos] / [1 pos] (TransformerLens's get_token_position).

        single_token: an id or a string that is one token. A text is tokenized with prepend_bos (None:
        cfg.default_prepend_bos), which shifts every position by one. mode: the "first" or "last" match.
        A token that does not occur is a TokenizationError (a ValueError and an AssertionError)."""
        if mode not in ("first", "last"):
            raise ValueError(f"mode must be 'first' or 'last', got {mode!r}")
        tokens = self.to_tokens(input, prepend_bos, padding_side) if isinstance(input, str) else torch.as_tensor(input)
        if tokens.dim() == 2:
            if tokens.shape[0] != 1:
                raise ValueError(f"ids of rank two must have shape [1, seq_len], got {tuple(tokens.shape)}")
            tokens = tokens[0]
        if isinstance(single_token, str):
            single_token = self.to_single_token(single_token)
        elif isinstance(single_token, torch.Tensor):
            single_token = int(single_token.item())
        found = (tokens == single_token).nonzero().flatten()
        if found.numel() == 0:
            # TransformerLens's message, word for word (code compares it); the note says which token and input
            error = TokenizationError("The token does not occur in the prompt")
            if hasattr(error, "add_note"):  # Python 3.11+
                error.add_note(f"token id {single_token} is not among the {tokens.numel()} tokens of the input")
            raise error
        return int(found[0] if mode == "first" else found[-1])

    def tokens_to_residual_directions(
        self, tokens: str | int | Int[torch.Tensor, "..."]
    ) -> Float[torch.Tensor, "... d_model"]:
        """TransformerLens's shapes around WeightViews.tokens_to_residual_directions (which says what the
        direction is here): a str goes through to_single_token (never with a BOS), and one token, as an int,
        a str or a one-element tensor of any shape, gives [d_model]; a tensor of more ids, shape S, gives
        [*S, d_model]."""
        if isinstance(tokens, str):
            tokens = self.to_single_token(tokens)
        elif isinstance(tokens, torch.Tensor) and tokens.numel() == 1:
            tokens = int(tokens.item())
        return super().tokens_to_residual_directions(tokens)

    def set_experts_backend(self, backend: str) -> None:
        """Routed experts: "torch" (reference path), "triton" (kernels; CUDA, or CPU under TRITON_INTERPRET=1)
        or "auto" (triton on CUDA architectures where the kernels were verified on hardware, torch otherwise).
        Both give the same hook tensors. Resolved here, for the device each layer's experts are on, and again
        when the model moves (experts.executor is the path a forward takes); a backend that cannot run there
        is refused here, for every layer, before any layer changes."""
        if backend not in BACKENDS:
            raise ValueError(f"experts backend must be one of {BACKENDS}, got {backend!r}")
        experts = [block.mlp.experts for block in self.blocks if block.is_moe]
        for module in experts:
            module.resolve(backend)
        for module in experts:
            module.backend = backend

    def set_attention_backend(self, backend: Literal["eager", "fused"]) -> None:
        """"eager" (default) computes scores and pattern explicitly, bit for bit the reference's eager attention
        (also in bfloat16), whatever hooks are on. "fused" uses SDPA wherever no hook reads the scores or
        pattern: faster, but a run with those hooks and one without then differ by rounding."""
        if backend not in ("eager", "fused"):
            raise ValueError(f"attention backend must be 'eager' or 'fused', got {backend!r}")
        for block in self.attention_blocks():
            for sub in block.attention_sublayers():
                sub.module.backend = backend

    def attention_blocks(self) -> list[Block]:
        """The blocks whose token mixer is softmax attention: every block, except a hybrid's linear-attention or
        state-space layers and layers without a token mixer. The attention switches (attn_result, split inputs,
        attn_in) and the attention backend apply to these; the other blocks have no heads in that sense."""
        return [block for block in self.blocks if block.has_attention]

    # ---- TransformerLens's optional hooks (cfg.use_attn_result and friends say which are on) ----------
    def set_use_attn_result(self, use_attn_result: bool) -> None:
        """On: each head's output is computed and hooked, blocks.L.attn.hook_result [batch pos head_index d_model]
        (the head's z times its slice of W_O, without b_O), and the attention output is their sum plus b_O:
        the plain forward's up to rounding. Off (the default): the hook point does not exist. As
        TransformerLens's; it costs a [batch pos head d_model] tensor per layer."""
        on = _switch_value(use_attn_result, "use_attn_result")
        for block in self.attention_blocks():
            for sub in block.attention_sublayers():
                set_use_attn_result(sub.module, on)
        self._switched("use_attn_result", on)

    def set_use_split_qkv_input(self, use_split_qkv_input: bool) -> None:
        """On: blocks.L.hook_q_input [batch pos head_index d_model] and hook_k_input / hook_v_input
        [batch pos kv_head d_model] hold each head's own copy of the residual stream entering the block; ln1
        is applied to each copy and head h's projection reads only its copy, so editing one head's input
        changes that head's q, k or v alone (TransformerLens's use_split_qkv_input; ln1's hooks then fire once
        per input, with the head axis). Refused for latent attention (DeepSeek-V3), which has no per-head map."""
        on = _switch_value(use_split_qkv_input, "use_split_qkv_input")
        if on:
            self._require_per_head_projections("set_use_split_qkv_input")
        for block in self.attention_blocks():
            block.set_optional_hooks("split_qkv_input", on)
        self._switched("use_split_qkv_input", on)

    def set_use_attn_in(self, use_attn_in: bool) -> None:
        """On: blocks.L.hook_attn_in [batch pos head_index d_model], each head's copy of the residual stream, read
        by that head's q, k and v (TransformerLens's use_attn_in). As in TransformerLens, refused with grouped
        kv heads (a key head serves several query heads): use set_use_split_qkv_input there."""
        on = _switch_value(use_attn_in, "use_attn_in")
        if on:
            self._require_per_head_projections("set_use_attn_in")
            if self.cfg.n_kv_heads != self.cfg.n_heads:
                raise GroupedQueryAttentionError(
                    "Can't use attn_in with GroupedQueryAttention, please use split_qkv_input instead: this model "
                    f"groups its {self.cfg.n_heads} query heads over {self.cfg.n_kv_heads} kv heads, so one head's "
                    "input cannot feed its own key and value (model.set_use_split_qkv_input(True))"
                )
        for block in self.attention_blocks():
            block.set_optional_hooks("attn_in", on)
        self._switched("use_attn_in", on)

    def set_use_hook_mlp_in(self, use_hook_mlp_in: bool) -> None:
        """On: blocks.L.hook_mlp_in [batch pos d_model], a copy of the residual stream entering ln2 and the MLP /
        mixture (editing it changes what the MLP reads, not the residual add), as TransformerLens's."""
        on = _switch_value(use_hook_mlp_in, "use_hook_mlp_in")
        for block in self.blocks:
            if block.has_ffn:
                block.set_optional_hooks("hook_mlp_in", on)
        self._switched("use_hook_mlp_in", on)

    def _require_per_head_projections(self, method: str) -> None:
        blocks = self.attention_blocks()
        attn = blocks[0].attn if blocks else None
        if attn is not None and not attn.per_head_projections:
            raise ValueError(
                f"{method}: {self.cfg.family}'s {type(attn).__name__} has no per-head linear map of the stream (its "
                "keys and values come out of one shared, normed latent), so a head's own input cannot mean what it "
                "does in TransformerLens. Hook the input every head reads, blocks.L.ln1.hook_normalized, or the "
                "latents (blocks.L.attn.hook_q_latent / hook_kv_latent) instead"
            )

    def _switched(self, field: str, on: bool) -> None:
        """After a switch: cfg says so (frozen: replaced) and the added or removed hook points are (un)named."""
        self.cfg = dataclasses.replace(self.cfg, **{field: on})
        self.setup()

    def _apply_cfg_switches(self) -> None:
        """A cfg built with a switch on gives a model with it on, as TransformerLens's config does."""
        switches = {
            "use_attn_result": self.set_use_attn_result,
            "use_split_qkv_input": self.set_use_split_qkv_input,
            "use_attn_in": self.set_use_attn_in,
            "use_hook_mlp_in": self.set_use_hook_mlp_in,
        }
        for field, setter in switches.items():
            if getattr(self.cfg, field):
                setter(True)

    def expert_cache_stats(self) -> ExpertCacheStats:
        """Hits, misses, bytes moved and seconds spent moving, of the offloaded experts' cache."""
        cache = getattr(self, "expert_cache", None)
        if cache is None:
            raise ValueError("this model's experts are resident: load with expert_offload='cpu' or 'disk' to cache them")
        return cache.stats

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    # ---- cfg in step with the model (TransformerLens code reads cfg.device and cfg.dtype) ------------
    def _count_weight_matrices(self) -> int:
        """TransformerLens's n_params: the weight-matrix parameters outside the embedding and unembedding (routed
        experts held off the model, offloaded or sharded, counted too: where they live is not the model's size)."""
        params = dict(self.named_parameters())
        for layer, block in enumerate(self.blocks):
            if block.is_moe:
                stacks = block.mlp.experts.stacks_held_elsewhere(self.cfg.dtype)
                params |= {f"blocks.{layer}.mlp.experts.{name}": t for name, t in stacks.items()}
        return hidden_weight_count(params)

    def _sync_cfg(self) -> None:
        """cfg.device / cfg.dtype: where the model is (its embedding's device: the first of a device map) and
        in what. MoeConfig is frozen, so a changed one is replaced."""
        weight = self.embed.weight
        device, dtype = str(weight.device), weight.dtype
        if (self.cfg.device, self.cfg.dtype) != (device, dtype):
            self.cfg = dataclasses.replace(self.cfg, device=device, dtype=dtype)

    def _apply(self, fn, recurse: bool = True):
        # .to(), .cuda(), .cpu(), .half(), .bfloat16(), .float(), .double() all come through here. An experts
        # backend that cannot run where the experts go is refused before anything moves (each layer's experts
        # resolve it again once moved)
        for block in getattr(self, "blocks", ()):
            if block.is_moe:
                block.mlp.experts.resolve(block.mlp.experts.backend, block.mlp.experts.home_after(fn))
        out = super()._apply(fn, recurse)
        self._sync_cfg()
        return out

    def to(self, *args, print_details: bool = False, **kwargs) -> HookedTransformer:
        """nn.Module.to, with cfg.device and cfg.dtype following (TransformerLens's model.to(device_or_dtype,
        print_details)); print_details prints where the model now is (TransformerLens prints by default)."""
        model = super().to(*args, **kwargs)
        if print_details:
            print(f"Moved model to device {self.cfg.device}, dtype {self.cfg.dtype}")
        return model

    def _check_not_on_meta(self) -> None:
        """A clear error for a forward of a model whose weights are on the meta device (torch's own, from deep
        in the forward, says only that .item() cannot be called on meta tensors)."""
        if self.embed.weight.is_meta:
            raise RuntimeError(
                "this model's weights are on the meta device (model.to('meta'), or from_pretrained(device='meta')): "
                "they have shapes but no values, so it cannot run. Load it again with from_pretrained(..., device=...) "
                "on a real device (moving it off meta cannot bring the values back)"
            )

    # ---- forward ----------------------------------------------------------------------------------
    def forward(
        self,
        input: str | list[str] | Int[torch.Tensor, "batch pos"] | Float[torch.Tensor, "batch pos d_model"],
        return_type: ReturnType = "logits",
        loss_per_token: bool = False,
        prepend_bos: bool | None = None,
        padding_side: Literal["left", "right"] | None = None,
        start_at_layer: int | None = None,
        tokens: Int[torch.Tensor, "batch pos"] | None = None,
        shortformer_pos_embed: None = None,
        attention_mask: Int[torch.Tensor, "batch pos"] | None = None,
        stop_at_layer: int | None = None,
        past_kv_cache: KVCache | None = None,
        *,
        position_ids: Int[torch.Tensor, "batch pos"] | None = None,
    ):
        """Logits / loss / both / None, or the residual stream when stop_at_layer is given.

        The arguments come in TransformerLens's order, so a positional call means what it means there;
        position_ids (moelens's own) is keyword only.

        The input goes through input_to_embed (TransformerLens's rules): text is tokenized with prepend_bos
        (None: cfg.default_prepend_bos) and, for a list, padded on padding_side (None: model.tokenizer.padding_side,
        "right" unless set). Padding on the left (padding_side, else the tokenizer's) masks the leading pad
        tokens, of text or of token ids, when no attention_mask is given; right padding needs no mask for the
        logits (each row's real tokens come first and attention is causal), and, as in TransformerLens, none is
        made, so a loss then counts the pad positions too (pass attention_mask to leave them out).

        With left padding (zeros on the left of attention_mask) positions count from each row's first real
        token, so each row gives the logits it would give alone. start_at_layer takes the residual stream
        [batch pos d_model] entering that block; `tokens` (TransformerLens's keyword) are then the ids a loss
        is computed against. shortformer_pos_embed is TransformerLens's too: rotary models have none, so only
        None is taken.

        With past_kv_cache (moelens.kv_cache.KVCache), the input holds only the new tokens (attention_mask,
        if given, covers only them): they continue each row's positions, attend to the cached keys and to
        each other causally, and are appended to the cache. Hooks see only the new positions.
        """
        self._check_not_on_meta()
        if return_type not in ("logits", "loss", "both", None):
            raise ValueError(f"return_type must be 'logits', 'loss', 'both' or None, got {return_type!r}")
        if shortformer_pos_embed is not None:
            raise ValueError("shortformer_pos_embed: this model's positions are rotary; it has no position embedding")
        if start_at_layer is None:
            if tokens is not None:
                raise ValueError("tokens goes with start_at_layer (the ids of a loss); otherwise pass them as the input")
            resid, tokens, attention_mask = self._embed_input(input, prepend_bos, padding_side, attention_mask, past_kv_cache)
        else:
            if return_type in ("loss", "both") and tokens is None:
                raise ValueError("a loss with start_at_layer needs the token ids: pass tokens=")
            tokens = None if tokens is None else self._check_tokens(tokens)
            resid = input
            if resid.dim() != 3 or resid.shape[-1] != self.cfg.d_model:
                raise ValueError(
                    f"with start_at_layer the input is the residual stream [batch pos {self.cfg.d_model}], "
                    f"got shape {tuple(resid.shape)}"
                )
        b, p = resid.shape[:2]
        if attention_mask is not None:
            attention_mask = check_attention_mask(attention_mask, (b, p)).to(self.device)
        states: list = [None] * len(self.blocks)
        key_mask, extending = attention_mask, contextlib.nullcontext()
        if past_kv_cache is not None:
            if start_at_layer is not None or stop_at_layer is not None:
                raise ValueError("past_kv_cache needs every layer to run: it cannot go with start_at_layer / stop_at_layer")
            past_kv_cache.check_fits(self.cfg.n_layers, b)
            if attention_mask is None:  # the cache keeps a mask history whatever the input
                attention_mask = torch.ones(b, p, dtype=torch.long, device=self.device)
            states, key_mask = past_kv_cache.layers, past_kv_cache.full_mask(attention_mask)
            extending = past_kv_cache.extending(attention_mask)
        self._warn_if_too_long(p + (0 if past_kv_cache is None else len(past_kv_cache)))
        positions = self._positions(b, p, attention_mask, position_ids, past_kv_cache)
        cos, sin = self.rotary(positions, resid.dtype)
        inputs = LayerInputs(positions, cos, sin, self._allowed(p, key_mask), attention_mask)
        with extending:
            for block, state in zip(self.blocks[start_at_layer:stop_at_layer], states[start_at_layer:stop_at_layer]):
                device = block.first_norm.weight.device
                if resid.device != device:  # a device map: the stream moves between whole blocks
                    resid, inputs = resid.to(device), inputs.to(device)
                resid = block(resid, inputs.for_layer(state))
        if stop_at_layer is not None:
            return resid
        normalized = self.ln_final(resid.to(self.ln_final.weight.device))
        if return_type is None:  # as TransformerLens: the final norm (and its hooks) still runs, not the unembedding
            return None
        logits = self.hook_logits(self.unembed(normalized))
        if return_type == "logits":
            return logits
        loss = self.loss(logits, tokens, attention_mask, per_token=loss_per_token)
        return loss if return_type == "loss" else (logits, loss)

    def input_to_embed(
        self,
        input: str | list[str] | Int[torch.Tensor, "batch pos"],
        prepend_bos: bool | None = None,
        padding_side: Literal["left", "right"] | None = None,
        attention_mask: Int[torch.Tensor, "batch pos"] | None = None,
        past_kv_cache: KVCache | None = None,
    ) -> tuple[
        Float[torch.Tensor, "batch pos d_model"],
        Int[torch.Tensor, "batch pos"],
        None,
        Int[torch.Tensor, "batch pos"] | None,
    ]:
        """The first residual stream of an input (TransformerLens's input_to_embed): (residual, tokens,
        shortformer_pos_embed, attention_mask).

        residual: hook_embed's output [batch pos d_model] (rotary models add no position embedding to it, so
        shortformer_pos_embed is always None). tokens: the ids [batch pos] (text tokenized with prepend_bos and
        padding_side as in to_tokens; ids of shape [pos] get a batch axis). attention_mask: the one given, else
        with left padding (padding_side, else model.tokenizer.padding_side) the mask of the leading pad tokens
        (a BOS that is the pad token stays real when prepend_bos; all ones where nothing is padded), else
        None, as TransformerLens. With
        past_kv_cache: the mask over the cached positions and these (ones where none is known); unlike
        TransformerLens's the cache is not changed here (the forward appends to it)."""
        resid, tokens, mask = self._embed_input(input, prepend_bos, padding_side, attention_mask, past_kv_cache)
        left = (padding_side or getattr(self.tokenizer, "padding_side", None)) == "left"
        if mask is None and left:  # TransformerLens returns the mask it inferred, even with no padding
            mask = torch.ones_like(tokens)
        if past_kv_cache is not None:
            new = mask if mask is not None else torch.ones_like(tokens)
            mask = past_kv_cache.full_mask(check_attention_mask(new, tuple(tokens.shape)).to(self.device))
        return resid, tokens, None, mask

    def _embed_input(self, input, prepend_bos, padding_side, attention_mask, past_kv_cache):
        """(hook_embed's output, tokens, the mask of these positions or None): input_to_embed before the cache."""
        side = None if padding_side is None else check_padding_side(padding_side)
        if side is None and self.tokenizer is not None:
            side = self.tokenizer.padding_side
        if isinstance(input, (str, list)):
            tokens, text_mask = self.tokenize(input, prepend_bos, side or "right")
            # the tokenizer's own mask where TransformerLens infers one (left padding): exact even for a text
            # that starts with the pad token's string
            if attention_mask is None and side == "left":
                attention_mask = text_mask if not bool(text_mask.all()) else None
        else:
            tokens = self._check_tokens(input)
            # new tokens after a cache are not searched for pads: generate's finished rows continue with them
            if attention_mask is None and side == "left" and past_kv_cache is None:
                attention_mask = self._mask_of_left_padding(tokens, prepend_bos)
        return self.hook_embed(self.embed(tokens)), tokens, attention_mask

    def _mask_of_left_padding(
        self, tokens: Int[torch.Tensor, "batch pos"], prepend_bos: bool | None = None
    ) -> Int[torch.Tensor, "batch pos"] | None:
        """Leading pad tokens are padding (TransformerLens's get_attention_mask, left side); None: no padding."""
        tok = self.tokenizer
        if tok is None or tok.pad_token_id is None:
            return None
        mask = get_attention_mask(tok, tokens, self._prepend_bos(prepend_bos), padding_side="left")
        return mask if not bool(mask.all()) else None

    def _check_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        if not isinstance(tokens, torch.Tensor) or tokens.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"input must be text or integer token ids [batch pos], got {getattr(tokens, 'dtype', type(tokens))}")
        if tokens.dim() == 1:
            tokens = tokens.unsqueeze(0)
        if tokens.dim() != 2:
            raise ValueError(f"token ids must be [batch pos], got shape {tuple(tokens.shape)}")
        if tokens.numel() == 0:
            raise ValueError(f"the input has no tokens: token ids of shape {tuple(tokens.shape)}")
        bad = (tokens < 0) | (tokens >= self.cfg.d_vocab)
        if bad.any():
            row, pos = (int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"token id {int(tokens[row, pos])} at [{row}, {pos}] is outside the vocabulary [0, {self.cfg.d_vocab})"
            )
        return tokens.to(self.device)

    def _positions(
        self, b: int, p: int, mask: torch.Tensor | None, position_ids: torch.Tensor | None, cache: KVCache | None = None
    ) -> torch.Tensor:
        if position_ids is not None:
            if not isinstance(position_ids, torch.Tensor) or position_ids.dtype not in (torch.int64, torch.int32):
                found = getattr(position_ids, "dtype", type(position_ids).__name__)
                raise TypeError(f"position_ids must be integer ids [batch pos], got {found}")
            # [batch 1] and the like would also broadcast, giving every position the same rotary angle
            if tuple(position_ids.shape) not in ((b, p), (1, p), (p,)):
                raise ValueError(
                    f"position_ids has shape {tuple(position_ids.shape)}, expected [batch pos] = {(b, p)}, "
                    f"or [1 pos] = {(1, p)} to give every row the same positions"
                )
            return position_ids.to(self.device).expand(b, p)
        if cache is not None:
            return cache.positions(mask)
        if mask is None:
            return torch.arange(p, device=self.device).expand(b, p)
        return positions_from_mask(mask.to(self.device))

    def _warn_if_too_long(self, length: int) -> None:
        """Once per model: past max_position_embeddings the model runs on positions it was not trained for."""
        limit = self.cfg.max_position_embeddings
        if length > limit and not self._warned_too_long:
            self._warned_too_long = True
            warnings.warn(
                f"the input is {length} positions long (KV cache included), longer than this model's "
                f"max_position_embeddings {limit}: its outputs past position {limit - 1} are unreliable "
                "(warned once per model)",
                stacklevel=3,
            )

    def _allowed(self, p: int, mask: torch.Tensor | None) -> torch.Tensor:
        """[batch|1, 1, query, key] bool: causal, padding keys masked, a padded query sees itself.

        The queries are the last p of the mask's positions (with a KV cache the keys start earlier)."""
        n_keys = p if mask is None else mask.shape[1]
        query = torch.arange(n_keys - p, n_keys, device=self.device)[:, None]
        key = torch.arange(n_keys, device=self.device)[None, :]
        causal = key <= query
        if mask is None:
            return causal[None, None]
        keys = mask.to(self.device).bool()[:, None, None, :]
        return (causal & keys) | (key == query)

    # greedy or sampled continuation, hooks active at every step (the function, so signature and docs show)
    generate = generation.generate

    @staticmethod
    def loss(
        logits: Float[torch.Tensor, "batch pos d_vocab"],
        tokens: Int[torch.Tensor, "batch pos"],
        attention_mask: torch.Tensor | None = None,
        per_token: bool = False,
    ) -> torch.Tensor:
        """Next-token cross entropy; predictions of or from padding tokens are left out."""
        if tokens.shape[1] < 2:
            raise ValueError("a loss needs at least two positions")
        log_probs = F.log_softmax(logits[:, :-1].float(), dim=-1)
        tokens = tokens.to(logits.device)
        if attention_mask is not None:
            attention_mask = attention_mask.to(logits.device)
        nll = -log_probs.gather(-1, tokens[:, 1:, None]).squeeze(-1)
        keep = torch.ones_like(nll) if attention_mask is None else (attention_mask[:, 1:] * attention_mask[:, :-1]).to(nll)
        nll = nll * keep
        return nll if per_token else nll.sum() / keep.sum()

    loss_fn = loss  # TransformerLens's name: loss_fn(logits, tokens, attention_mask=None, per_token=False)

    # ---- names and documentation -----------------------------------------------------------------
    def canonical_hook_name(self, name: str, layer: int | None = None) -> str:
        """Full hook name for an alias or standard name ("router_logits", "layer_output", ...)."""
        try:
            candidates = alias_candidates(name, layer)
        except KeyError:  # a per-block alias given without a layer: left for the caller to report
            return name
        return next((c for c in candidates if c in self.hook_dict), name)

    def hook_names_for_alias(self, name: str) -> list[str]:
        """The hook points a short or standard name selects, one per block that has the site."""
        found = (self.canonical_hook_name(name, layer) for layer in range(self.cfg.n_layers))
        return [n for n in found if n in self.hook_dict]

    def _resolve_one(self, name: str) -> list[str]:
        try:
            return super()._resolve_one(name)
        except KeyError as err:
            if _optional_switch(name) is not None:
                raise OptionalHookOffError(err.args[0]) from None
            raise

    def _unknown_hook_message(self, name: str) -> str:
        message = super()._unknown_hook_message(name)
        switch = _optional_switch(name)
        return message if switch is None else f"{message}; {switch[0]} exists only after model.{switch[1]}(True)"

    def support(self, print_table: bool = True) -> SupportTable:
        """Every hook point: name, layout, shape for this model, meaning, standard name (and absent sites)."""
        table = support_table(self)
        if print_table:
            print(table)
        return table

