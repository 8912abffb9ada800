"""DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2, GLM-5): a cheap score of every key for each
query, from which attention keeps the top index_topk keys.

    q       = wq_b(q latent)                 [batch pos index_head head_dim]  (the q latent of latent attention)
    k       = LayerNorm(wk(x))               [batch pos head_dim]              (one key per position, every head's)
    q, k    : the rotary on their FIRST qk_rope_head_dim dims (half-split pairs for DeepSeek-V3.2, interleaved
              pairs for GLM-5; latent attention's own rotary layout is separate)
    score   = sum_h weights_proj(x)_h * n_heads**-0.5 * relu(q_h . k * head_dim**-0.5)   float32, [batch query key]

The keys of earlier positions come from the layer's IndexedKVState. The choice of keys (top_keys) and the
narrowing of the mask (narrowed) are separate functions, so an edit of the scores or of the choice re-selects.
"""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float, Int
from torch import nn

from moelens.models.components.layer_norm import LayerNorm
from moelens.models.components.rotary import apply_rotary, apply_rotary_interleaved
from moelens.models.terms import ParamTerm, linear, under
from moelens.state import IndexedKVState

# transformers builds the indexer's k_norm as nn.LayerNorm(index_head_dim, eps=1e-6), whatever rms_norm_eps says
INDEX_KEY_NORM_EPS = 1e-6


class LightningIndexer(nn.Module):
    @staticmethod
    def param_terms(cfg) -> tuple[ParamTerm, ...]:
        """All "attention", its key norm too: the indexer is a part of the attention."""
        n, d = cfg.index_n_heads, cfg.index_head_dim
        return (linear("wq_b", cfg.q_lora_rank, n * d, False, "attention") + linear("wk", cfg.d_model, d, False, "attention")
                + under("k_norm", LayerNorm.param_terms(d, "attention"))
                + linear("weights_proj", cfg.d_model, n, False, "attention"))

    def __init__(self, cfg) -> None:
        super().__init__()
        self.n_heads, self.d_head, self.d_rope = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
        if self.d_rope > self.d_head:
            raise ValueError(
                f"index_head_dim ({self.d_head}) must be at least qk_rope_head_dim ({self.d_rope}): the indexer "
                "turns the first qk_rope_head_dim dims of each of its heads"
            )
        self.rotate = apply_rotary_interleaved if cfg.index_rope_interleaved else apply_rotary
        self.softmax_scale = self.d_head**-0.5
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.d_head, bias=False)
        self.wk = nn.Linear(cfg.d_model, self.d_head, bias=False)
        self.k_norm = LayerNorm(self.d_head, INDEX_KEY_NORM_EPS)
        # in the model's dtype: transformers' _keep_in_fp32_modules keeps it float32 only in a float16 model
        self.weights_proj = nn.Linear(cfg.d_model, self.n_heads, bias=False)

    def forward(
        self,
        x: Float[torch.Tensor, "batch pos d_model"],
        q_latent: Float[torch.Tensor, "batch pos q_lora_rank"],
        cos: Float[torch.Tensor, "batch pos d_rot"],
        sin: Float[torch.Tensor, "batch pos d_rot"],
        state: IndexedKVState | None,
    ) -> Float[torch.Tensor, "batch query key"]:
        """Every key's score (cached keys first) for each new query, float32, unmasked; the new positions'
        keys are appended to `state`."""
        b, p, _ = x.shape
        q = self.wq_b(q_latent).view(b, p, self.n_heads, self.d_head)
        k = self.k_norm(self.wk(x))[:, :, None, :]
        q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)[:, :, 0]
        if state is not None:
            if not isinstance(state, IndexedKVState):
                raise TypeError(
                    f"a DeepSeek Sparse Attention layer needs an IndexedKVState in the cache (its indexer keys), got "
                    f"{type(state).__name__}: make the cache with KVCache.for_model(model)"
                )
            k = state.append_index_keys(k)
        # transformers' order of operations: float32 products, relu, then the heads weighted and summed
        scores = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * self.softmax_scale
        scores = torch.relu(scores)  # [batch query head key]
        weights = self.weights_proj(x).float() * self.n_heads**-0.5
        return torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rope, rest = torch.split(x, [self.d_rope, self.d_head - self.d_rope], dim=-1)
        return torch.cat((self.rotate(rope, cos, sin), rest), dim=-1)

    def extra_repr(self) -> str:
        rotary = "interleaved" if self.rotate is apply_rotary_interleaved else "half-split"
        return f"n_heads={self.n_heads}, head_dim={self.d_head}, rotary={rotary} on {self.d_rope} dims"


def top_keys(
    scores: Float[torch.Tensor, "batch query key"], allowed: Bool[torch.Tensor, "batch 1 query key"], index_topk: int,
    mask_dtype: torch.dtype,
) -> Int[torch.Tensor, "batch query k"]:
    """The min(index_topk, keys) best keys of each query, best first, the masked keys scored as transformers
    scores them (the finfo.min of the model's dtype, so ties fall as there). transformers adds that mask to the
    float32 scores, so a float64 model's scores are ranked in float64, where its finfo.min is representable."""
    scores = scores.to(torch.promote_types(scores.dtype, mask_dtype))
    masked = scores.masked_fill(~allowed[:, 0], torch.finfo(mask_dtype).min)
    return masked.topk(min(index_topk, scores.shape[-1]), dim=-1).indices


def narrowed(
    allowed: Bool[torch.Tensor, "batch 1 query key"], selection: Int[torch.Tensor, "batch query k"], edited_at: str | None
) -> Bool[torch.Tensor, "batch 1 query key"]:
    """`allowed` where the key is among the query's selection (a selected key that was masked stays masked).
    edited_at: the hook a selection may have been edited at (its indices are then checked, naming it)."""
    n_keys = allowed.shape[-1]
    site = edited_at
    if site is not None and selection.numel() and (int(selection.min()) < 0 or int(selection.max()) >= n_keys):
        raise ValueError(
            f"{site} holds key indices from {int(selection.min())} to {int(selection.max())}; each must be a key "
            f"position in [0, {n_keys})"
        )
    b, q = selection.shape[:2]
    selected = torch.zeros(b, q, n_keys, dtype=torch.bool, device=selection.device).scatter_(-1, selection, True)
    return allowed & selected[:, None]
