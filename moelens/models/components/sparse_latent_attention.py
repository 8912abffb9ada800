"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): multi-head latent attention whose queries see only the keys
a lightning indexer selects (moelens.models.components.indexer).

IndexedLatentAttention runs its own indexer: hook_index_scores (every key's score), then hook_index_topk (the
chosen keys), which narrow the causal mask; the indexer's keys are cached beside MLA's (IndexedKVState).
SharedSelectionLatentAttention (GLM-5's "shared" layers) has no indexer: it reuses the selection of the layer
before it in the same forward (carried in LayerInputs.carried), hooked again at its own hook_index_topk, and
hands what that hook holds on to the next layer, as transformers passes each layer's top-k to the next.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from jaxtyping import Bool, Float
from torch import nn

from moelens.hooks.sites import site_hook
from moelens.models.components.indexer import LightningIndexer, narrowed, top_keys
from moelens.models.components.latent_attention import MultiHeadLatentAttention
from moelens.models.context import LayerInputs
from moelens.models.terms import ParamTerm, under
from moelens.state import IndexedKVState

# the name under which a layer's key selection is carried to the layers after it (LayerInputs.carried)
SELECTION = "dsa_selection"


class IndexedLatentAttention(MultiHeadLatentAttention):
    @classmethod
    def param_terms(cls, cfg, layer: int) -> tuple[ParamTerm, ...]:
        return super().param_terms(cfg, layer) + under("indexer", LightningIndexer.param_terms(cfg))

    def __init__(self, cfg, layer: int) -> None:
        super().__init__(cfg, layer)
        if self.q_lora_rank is None:
            raise ValueError("DeepSeek Sparse Attention's indexer reads the q latent: q_lora_rank must be set")
        self.index_topk = cfg.index_topk
        self.indexer = LightningIndexer(cfg)
        self.hook_index_scores = site_hook("blocks.L.attn.hook_index_scores")
        self.hook_index_topk = site_hook("blocks.L.attn.hook_index_topk")

    def allowed(
        self, x: Float[torch.Tensor, "batch pos d_model"], q_latent: torch.Tensor | None, inputs: LayerInputs
    ) -> Bool[torch.Tensor, "batch 1 query key"]:
        scores = self.hook_index_scores(self.indexer(x, q_latent, inputs.cos, inputs.sin, inputs.state))
        selection = self.hook_index_topk(top_keys(scores, inputs.allowed, self.index_topk, x.dtype))
        inputs.carried[SELECTION] = selection
        edited_at = self.hook_index_topk.name if self.hook_index_topk.has_hooks else None
        return narrowed(inputs.allowed, selection, edited_at)

    def new_state(self, reserve: int = 0) -> IndexedKVState:
        return IndexedKVState(reserve)

    @staticmethod
    def cached_per_token(cfg) -> int:
        """MLA's keys and values, and the indexer's key (index_head_dim values)."""
        return MultiHeadLatentAttention.cached_per_token(cfg) + cfg.index_head_dim

    def input_projections(self) -> list[nn.Linear]:
        return super().input_projections() + [self.indexer.wk, self.indexer.weights_proj]

    def extra_repr(self) -> str:
        return super().extra_repr() + f", index_topk={self.index_topk}"


class SharedSelectionLatentAttention(MultiHeadLatentAttention):
    # reads what an earlier layer of the same forward carried (its selection): no forward can start here
    reads_carried: ClassVar[bool] = True

    def __init__(self, cfg, layer: int) -> None:
        super().__init__(cfg, layer)
        self.hook_index_topk = site_hook("blocks.L.attn.hook_index_topk", "shared")

    def allowed(
        self, x: Float[torch.Tensor, "batch pos d_model"], q_latent: torch.Tensor | None, inputs: LayerInputs
    ) -> Bool[torch.Tensor, "batch 1 query key"]:
        carried = inputs.carried.get(SELECTION)
        if carried is None:
            raise ValueError(
                f"layer {self.layer} reuses the key selection of the DSA layer before it, and none ran in this "
                "forward (start_at_layer cannot start at a layer that shares its selection)"
            )
        # a copy: an in-place edit here must not reach the earlier layer's tensor (nor its cached value)
        selection = self.hook_index_topk(carried.to(x.device).clone())
        inputs.carried[SELECTION] = selection
        edited_at = self.hook_index_topk.name if self.hook_index_topk.has_hooks else None
        return narrowed(inputs.allowed, selection, edited_at)
