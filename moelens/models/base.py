"""HookedTransformer: the model every family shares; a family adds its config mapping, its components and its
site map."""

from __future__ import annotations

import contextlib
import warnings
from typing import TYPE_CHECKING, ClassVar, Literal

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import nn

from moelens import families, generation, pretrained
from moelens.cache import ActivationCache
from moelens.config import MoeConfig
from moelens.hooks import HookedRootModule, HookPoint
from moelens.kernels import BACKENDS
from moelens.kernels.offload import ExpertCacheStats
from moelens.kv_cache import KVCache
from moelens.models.components import Block, Components, Embed, RMSNorm, Rotary, TopKRouter
from moelens.names import alias_candidates
from moelens.positions import check_attention_mask, positions_from_mask
from moelens.sitemap import SiteMap
from moelens.support import SupportTable, support_table
from moelens.tokenizer import MoeTokenizer
from moelens.weights import WeightViews

ReturnType = Literal["logits", "loss", "both"] | None


class HookedTransformer(WeightViews, HookedRootModule):
    """A decoder-only MoE language model with a HookPoint at every site (see model.support()).

    Layout conventions: tensors crossing the API are [batch pos ...]; per-expert data is dense per routing
    slot ([batch pos top_k ...]); weights keep the checkpoint's [out, in] layout.
    """

    model_type: ClassVar[str] = ""  # config.json's model_type; a family class with one registers itself
    components: ClassVar[Components]
    cache_class = ActivationCache

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("model_type"):
            families.register(cls)

    def __init__(self, cfg: MoeConfig, tokenizer: MoeTokenizer | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.embed = Embed(cfg.d_vocab, cfg.d_model)
        self.hook_embed = HookPoint("batch pos d_model", "token embeddings")
        self.rotary = Rotary(cfg)
        self.blocks = nn.ModuleList(Block(cfg, layer, self.components) for layer in range(cfg.n_layers))
        self.ln_final = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.unembed = nn.Linear(cfg.d_model, cfg.d_vocab, bias=False)
        self.hook_logits = HookPoint("batch pos d_vocab", "logits")
        self.tie_weights()
        self.setup()
        self._warned_too_long = False

    # ---- construction helpers used by the loader ---------------------------------------------------
    def tie_weights(self) -> None:
        if self.cfg.tie_word_embeddings:
            self.unembed.weight = self.embed.weight

    @classmethod
    def config_from_hf(cls, hf: dict) -> MoeConfig:  # pragma: no cover - every family overrides
        raise NotImplementedError(f"{cls.__name__} does not define config_from_hf")

    @classmethod
    def site_map(cls, cfg: MoeConfig) -> SiteMap:  # pragma: no cover - every family overrides
        """Each parameter's checkpoint key(s) and each hook's transformers module, for this config."""
        raise NotImplementedError(f"{cls.__name__} does not define site_map")

    @classmethod
    def build(cls, cfg: MoeConfig) -> HookedTransformer:
        """The model on the meta device, in cfg.dtype, routers float32 where the family keeps them so:
        what loading fills and what `moelens plan` counts."""
        with torch.device("meta"):
            model = cls(cfg)
        model.to(cfg.dtype)
        for module in model.modules():
            if isinstance(module, TopKRouter) and module.float32_weight:
                module.float()
        return model

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        dtype: torch.dtype | str = torch.float32,
        device: torch.device | str = "cpu",
        revision: str | None = None,
        progress: bool | None = None,
        experts_backend: str = "auto",
        device_map: Literal["auto"] | dict[str, str | torch.device] | None = None,
        max_memory: dict[str, int | str] | None = None,
        fold_ln: bool = False,
        center_unembed: bool = False,
        check_finite: bool = True,
        expert_offload: Literal["cpu", "disk"] | None = None,
        expert_cache_bytes: int | None = None,
        expert_parallel: bool = False,
    ) -> HookedTransformer:
        """Load a checkpoint (local folder or Hub id); the family is chosen from config.json's model_type.

        dtype: a torch dtype or its name ("float32"/"fp32"/"float", "bfloat16"/"bf16", "float16"/"fp16"/"half",
        "float64"). device="meta" builds the model for inspection only (cfg, modules, support(); no forward):
        the checkpoint's headers are checked, its weights are not read. check_finite: warn about weights that
        hold NaN or Inf (one pass over each tensor as it loads). Every problem with the checkpoint is a
        CheckpointError raised here, naming the file and the field or tensor at fault.
        experts_backend: "auto" (the torch path, except on CUDA GPU architectures where the Triton kernels'
        tests have passed on real hardware: moelens.kernels.experts.VERIFIED_TRITON_ARCHS), "torch" or "triton".
        fold_ln: fold every RMSNorm weight into the weights that read it and set the norms' weights to 1
        (logits unchanged; Hunyuan's per-head q/k norms stay, see moelens.fold). center_unembed: subtract
        the vocabulary mean from W_U (logits move by a per-position constant; probabilities unchanged).
        expert_offload: keep the routed experts off `device` ("cpu": in host memory, pinned for CUDA;
        "disk": read from the checkpoint's files when routed to) and fetch those a batch routes to through
        a cache of at most expert_cache_bytes on `device` (default: one layer's experts), least recently
        used out first. Logits and every hook are bit for bit those of the resident model;
        model.expert_cache_stats() counts hits, misses and bytes moved. Not with fold_ln.
        device_map: whole blocks per device, in place of `device` (see moelens.placement): a mapping of
        "embed", "blocks.A-B", "ln_final", "unembed" to devices, or "auto" to fill max_memory ({device:
        bytes or "80GB"}; default 90% of each visible GPU) in order. Each tensor is loaded straight to its
        device; the residual stream moves between blocks; every hook sees a whole tensor on its block's
        device. Combines with expert_offload (each layer's cached experts on its block's device).
        expert_parallel: under torchrun (or any initialised default process group), rank r of N reads and
        holds only experts [r*E//N, (r+1)*E//N) of each layer; the rest is replicated, and every rank's
        logits, hooks and caches are bit for bit one process's (see moelens.kernels.expert_parallel). Torch
        experts backend only; not with fold_ln, device_map or expert_offload; no backward through experts.
        """
        if expert_parallel and experts_backend == "triton":
            raise ValueError("expert_parallel runs the routed experts on the torch path: use experts_backend='torch' or 'auto'")

        model = pretrained.load(
            cls, name_or_path, dtype=dtype, device=device, revision=revision, progress=progress,
            fold_ln=fold_ln, center_unembed=center_unembed, check_finite=check_finite,
            expert_offload=expert_offload, expert_cache_bytes=expert_cache_bytes, device_map=device_map,
            max_memory=max_memory, expert_parallel=expert_parallel,
        )
        model.set_experts_backend(experts_backend)
        return model

    # ---- tokens -----------------------------------------------------------------------------------
    def _require_tokenizer(self) -> MoeTokenizer:
        if self.tokenizer is None:
            raise ValueError(
                "this model has no tokenizer (the checkpoint has no tokenizer.json): pass token ids "
                "as a LongTensor [batch pos] instead of text"
            )
        return self.tokenizer

    def to_tokens(
        self, text: str | list[str], prepend_bos: bool = False, padding_side: str | None = None
    ) -> Int[torch.Tensor, "batch pos"]:
        """Token ids [batch pos]. A list of texts is padded on padding_side (default: the tokenizer's,
        "right", as in TransformerLens: every row's real tokens then keep positions 0.. and their logits
        in a plain forward). With "left" padding the forward infers the mask from the leading pad tokens
        only when model.tokenizer.padding_side is "left"; otherwise use tokenize() for the mask."""
        side = padding_side or self._require_tokenizer().padding_side
        return self.tokenize(text, prepend_bos, padding_side=side)[0]

    def tokenize(
        self, text: str | list[str], prepend_bos: bool = False, padding_side: str = "left"
    ) -> tuple[Int[torch.Tensor, "batch pos"], Int[torch.Tensor, "batch pos"]]:
        """(tokens, attention_mask); left-padded by default, as generation needs."""
        tokens, mask = self._require_tokenizer().batch(text, prepend_bos, padding_side)
        return tokens.to(self.device), mask.to(self.device)

    def to_str_tokens(self, text: str | torch.Tensor | list[int]) -> list[str]:
        tok = self._require_tokenizer()
        if isinstance(text, str):
            return [tok.id_to_str(i) for i in tok.encode(text)]
        if isinstance(text, list):
            if not all(type(i) is int for i in text):
                found = type(next(i for i in text if type(i) is not int)).__name__
                raise TypeError(
                    f"to_str_tokens takes one sequence of token ids, got a list holding {found} (one call per row)"
                )
            text = torch.tensor(text, dtype=torch.long)
        if not isinstance(text, torch.Tensor):
            raise TypeError(
                f"to_str_tokens takes a text, a tensor of token ids or a list of ints, got {type(text).__name__}"
            )
        if text.dim() > 2 or (text.dim() == 2 and text.shape[0] != 1):
            raise ValueError(f"to_str_tokens takes one sequence, got tokens of shape {tuple(text.shape)}")
        if text.numel() == 0:  # nothing to show, not an error
            return []
        return [tok.id_to_str(i) for i in self._check_tokens(text.reshape(1, -1))[0].tolist()]

    def to_string(self, tokens: torch.Tensor | list[int]) -> str | list[str]:
        tok = self._require_tokenizer()
        if isinstance(tokens, torch.Tensor) and tokens.dim() == 2:
            return [tok.decode(row.tolist()) for row in tokens]
        return tok.decode(tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens))

    def set_experts_backend(self, backend: str) -> None:
        """Routed experts: "torch" (reference path), "triton" (kernels; CUDA, or CPU under TRITON_INTERPRET=1)
        or "auto" (triton on CUDA architectures where the kernels were verified on hardware, torch otherwise).
        Both give the same hook tensors."""
        if backend not in BACKENDS:
            raise ValueError(f"experts backend must be one of {BACKENDS}, got {backend!r}")
        for block in self.blocks:
            if block.is_moe:
                block.mlp.experts.backend = backend

    def set_attention_backend(self, backend: Literal["eager", "fused"]) -> None:
        """"eager" (default) computes scores and pattern explicitly, bit for bit the reference's eager attention
        (also in bfloat16), whatever hooks are on. "fused" uses SDPA wherever no hook reads the scores or
        pattern: faster, but a run with those hooks and one without then differ by rounding."""
        if backend not in ("eager", "fused"):
            raise ValueError(f"attention backend must be 'eager' or 'fused', got {backend!r}")
        for block in self.blocks:
            block.attn.backend = backend

    def expert_cache_stats(self) -> ExpertCacheStats:
        """Hits, misses, bytes moved and seconds spent moving, of the offloaded experts' cache."""
        cache = getattr(self, "expert_cache", None)
        if cache is None:
            raise ValueError("this model's experts are resident: load with expert_offload='cpu' or 'disk' to cache them")
        return cache.stats

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    # ---- forward ----------------------------------------------------------------------------------
    def forward(
        self,
        input: str | list[str] | Int[torch.Tensor, "batch pos"] | Float[torch.Tensor, "batch pos d_model"],
        return_type: ReturnType = "logits",
        attention_mask: Int[torch.Tensor, "batch pos"] | None = None,
        start_at_layer: int | None = None,
        stop_at_layer: int | None = None,
        loss_per_token: bool = False,
        position_ids: Int[torch.Tensor, "batch pos"] | None = None,
        past_kv_cache: KVCache | None = None,
    ):
        """Logits / loss / both / None, or the residual stream when stop_at_layer is given.

        With left padding (zeros on the left of attention_mask) positions count from each row's first real
        token, so each row gives the logits it would give alone. start_at_layer takes the residual stream
        [batch pos d_model] entering that block.

        With past_kv_cache (moelens.kv_cache.KVCache), the input holds only the new tokens (attention_mask,
        if given, covers only them): they continue each row's positions, attend to the cached keys and to
        each other causally, and are appended to the cache. Hooks see only the new positions.
        """
        if return_type not in ("logits", "loss", "both", None):
            raise ValueError(f"return_type must be 'logits', 'loss', 'both' or None, got {return_type!r}")
        tokens = None
        if isinstance(input, (str, list)):
            input, text_mask = self.tokenize(input)
            attention_mask = text_mask if attention_mask is None else attention_mask
        if start_at_layer is None:
            tokens = self._check_tokens(input)
            if attention_mask is None and past_kv_cache is None:
                attention_mask = self._mask_of_left_padding(tokens)
            resid = self.hook_embed(self.embed(tokens))
        else:
            if return_type in ("loss", "both"):
                raise ValueError("a loss needs token ids: it cannot be computed with start_at_layer")
            resid = input
            if resid.dim() != 3 or resid.shape[-1] != self.cfg.d_model:
                raise ValueError(
                    f"with start_at_layer the input is the residual stream [batch pos {self.cfg.d_model}], "
                    f"got shape {tuple(resid.shape)}"
                )
        b, p = resid.shape[:2]
        if attention_mask is not None:
            attention_mask = check_attention_mask(attention_mask, (b, p)).to(self.device)
        kvs: list = [None] * len(self.blocks)
        key_mask, extending = attention_mask, contextlib.nullcontext()
        if past_kv_cache is not None:
            if start_at_layer is not None or stop_at_layer is not None:
                raise ValueError("past_kv_cache needs every layer to run: it cannot go with start_at_layer / stop_at_layer")
            past_kv_cache.check_fits(self.cfg.n_layers, b)
            if attention_mask is None:  # the cache keeps a mask history whatever the input
                attention_mask = torch.ones(b, p, dtype=torch.long, device=self.device)
            kvs, key_mask = past_kv_cache.layers, past_kv_cache.full_mask(attention_mask)
            extending = past_kv_cache.extending(attention_mask)
        self._warn_if_too_long(p + (0 if past_kv_cache is None else len(past_kv_cache)))
        positions = self._positions(b, p, attention_mask, position_ids, past_kv_cache)
        cos, sin = self.rotary(positions, resid.dtype)
        allowed = self._allowed(p, key_mask)
        with extending:
            for block, kv in zip(self.blocks[start_at_layer:stop_at_layer], kvs[start_at_layer:stop_at_layer]):
                device = block.ln1.weight.device
                if resid.device != device:  # a device map: the stream moves between whole blocks
                    resid, cos, sin, allowed = (t.to(device) for t in (resid, cos, sin, allowed))
                resid = block(resid, cos, sin, allowed, kv)
        if stop_at_layer is not None:
            return resid
        if return_type is None:
            return None
        logits = self.hook_logits(self.unembed(self.ln_final(resid.to(self.ln_final.weight.device))))
        if return_type == "logits":
            return logits
        loss = self.loss(logits, tokens, attention_mask, per_token=loss_per_token)
        return loss if return_type == "loss" else (logits, loss)

    def _mask_of_left_padding(self, tokens: Int[torch.Tensor, "batch pos"]) -> Int[torch.Tensor, "batch pos"] | None:
        """With model.tokenizer.padding_side == "left" (as TransformerLens): leading pad tokens are padding."""
        tok = self.tokenizer
        if tok is None or tok.padding_side != "left" or tok.pad_token_id is None:
            return None
        real = (tokens != tok.pad_token_id).long().cummax(-1).values
        return real if not bool(real.all()) else None

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

    # ---- names and documentation -----------------------------------------------------------------
    def canonical_hook_name(self, name: str, layer: int | None = None) -> str:
        """Full hook name for an alias or standard name ("router_logits", "layer_output", ...)."""
        try:
            candidates = alias_candidates(name, layer)
        except KeyError:  # a per-block alias given without a layer: left for the caller to report
            return name
        return next((c for c in candidates if c in self.hook_dict), name)

    def hook_names_for_alias(self, name: str) -> list[str]:
        found = (self.canonical_hook_name(name, layer) for layer in range(self.cfg.n_layers))
        return [n for n in found if n in self.hook_dict]

    def support(self, print_table: bool = True) -> SupportTable:
        """Every hook point: name, layout, shape for this model, meaning, standard name (and absent sites)."""
        table = support_table(self)
        if print_table:
            print(table)
        return table

