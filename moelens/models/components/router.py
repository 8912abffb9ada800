"""Top-k router: softmax (Qwen2-MoE, Hunyuan) or sigmoid with choice bias and groups (Solar).

Each step is a method so that the mixture block can put a hook between any two of them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import nn

from moelens.config import MoeConfig


class Router(nn.Module):
    def __init__(self, cfg: MoeConfig, top_k: int) -> None:
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, top_k
        self.scoring = cfg.router_scoring
        self.norm_topk_prob = cfg.norm_topk_prob
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.compute_float32 = cfg.router_compute_float32
        self.weight = nn.Parameter(torch.zeros(cfg.n_experts, cfg.d_model))
        if cfg.correction_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_experts))

    def logits(self, x: Float[torch.Tensor, "... d_model"]) -> Float[torch.Tensor, "... n_experts"]:
        if self.compute_float32 or self.weight.dtype == torch.float32:
            return F.linear(x.float(), self.weight.float())
        return F.linear(x.to(self.weight.dtype), self.weight)

    def scores(self, logits: torch.Tensor) -> Float[torch.Tensor, "... n_experts"]:
        if self.scoring == "softmax":
            return F.softmax(logits, dim=-1, dtype=torch.float32)
        return logits.float().sigmoid()

    def choice_scores(self, scores: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "e_score_correction_bias"):
            return scores + self.e_score_correction_bias
        return scores

    def choose(self, choice_scores: Float[torch.Tensor, "... n_experts"]) -> Int[torch.Tensor, "... top_k"]:
        if self.scoring == "softmax":
            return torch.topk(choice_scores, self.top_k, dim=-1).indices
        if self.n_group > 1:
            choice_scores = self._mask_groups(choice_scores)
        # sorted=False as the reference: slot order then follows the kernel, as it does there
        return torch.topk(choice_scores, self.top_k, dim=-1, sorted=False).indices

    def _mask_groups(self, choice_scores: torch.Tensor) -> torch.Tensor:
        """Keep the topk_group groups whose two best scores sum highest; the rest get -inf."""
        grouped = choice_scores.unflatten(-1, (self.n_group, self.n_experts // self.n_group))
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        best = torch.topk(group_scores, self.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(-1, best, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(-2)

    def weights(
        self, scores: torch.Tensor, indices: torch.Tensor, logits_dtype: torch.dtype
    ) -> Float[torch.Tensor, "... top_k"]:
        w = scores.gather(-1, indices)
        if self.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        if self.routed_scaling_factor != 1.0:
            w = w * self.routed_scaling_factor
        return w.to(logits_dtype)

    def extra_repr(self) -> str:
        return (
            f"n_experts={self.n_experts}, top_k={self.top_k}, scoring={self.scoring}, "
            f"norm_topk_prob={self.norm_topk_prob}"
        )
