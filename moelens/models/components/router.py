"""Top-k routers, one class per routing rule.

Each step is a method so that the mixture block can put a hook between any two of them: logits ->
scores -> choice scores -> indices -> weights. Class attributes say what the loader and the analyses need
to know about a rule (float32 weights, a choice bias) without asking which family it is.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import nn

from moelens.config import MoeConfig
from moelens.models.terms import ParamTerm


class TopKRouter(nn.Module):
    """What every router has: a linear map to one logit per expert, and top_k slots per token."""

    float32_weight: ClassVar[bool] = False  # kept float32 whatever the model's dtype (set at load)
    choice_bias: ClassVar[bool] = False  # a bias added to the scores for the choice only (hook_choice_scores)
    scoring: ClassVar[str] = ""
    scores_form: ClassVar[str] = "default"  # hook_router_scores' form in the table of hook sites
    probs_form: ClassVar[str] = "default"  # hook_router_probs' form: how probabilities() makes a distribution
    # the dtype weights() casts the top-k weights to: the logits' (False) or the block input's, the model dtype
    # (True: a float32 router whose reference casts its weights back to the stream's dtype, ERNIE-4.5)
    weights_in_stream_dtype: ClassVar[bool] = False
    # buffers that stay float32 whatever dtype the router is moved to (following the device only), beside a weight
    # in the model's dtype: a choice bias transformers keeps float32 (AFMoE, Kolibri 1)
    float32_buffers: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def param_terms(cls, cfg: MoeConfig) -> tuple[ParamTerm, ...]:
        """The weight [n_experts, d_model] (a subclass adds its bias); float32 where the class keeps it so."""
        return (ParamTerm("weight", (cfg.n_experts, cfg.d_model), "routers", cls.float32_weight,
                          flops=2 * cfg.n_experts * cfg.d_model),)

    def __init__(self, cfg: MoeConfig, top_k: int) -> None:
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, top_k
        self.norm_topk_prob = cfg.norm_topk_prob
        self.topk_norm_p = cfg.topk_norm_p
        self.weight = nn.Parameter(torch.zeros(cfg.n_experts, cfg.d_model))

    def _apply(self, fn, recurse: bool = True):
        kept = {name: self._buffers.pop(name) for name in self.float32_buffers}
        try:
            return super()._apply(fn, recurse)
        finally:
            for name, tensor in kept.items():  # its values never rounded by a dtype move
                probe = fn(torch.empty(0, dtype=tensor.dtype, device=tensor.device))
                self._buffers[name] = tensor.to(probe.device)

    def choice_scores(self, scores: torch.Tensor) -> torch.Tensor:
        return scores

    def probabilities(self, scores: Float[torch.Tensor, "... n_experts"]) -> Float[torch.Tensor, "... n_experts"]:
        """hook_router_probs: a distribution over the experts from hook_router_scores, for the analyses
        (entropy, usage): the scores normalised to sum to one (softmax scores up to rounding, sigmoid scores
        rescaled), float32; a rule whose scores are not probabilities (logits) overrides this. Always a new
        tensor, so that an in-place edit of it cannot reach the scores."""
        scores = scores.float()
        return scores / scores.sum(-1, keepdim=True)

    def p_normalised(self, w: Float[torch.Tensor, "... top_k"]) -> Float[torch.Tensor, "... top_k"]:
        """The k weights divided by their topk_norm_p-norm (torch.norm, in their dtype, as DBRX's reference), or
        as they are where topk_norm_p is None."""
        if self.topk_norm_p is None:
            return w
        return w / torch.norm(w, p=self.topk_norm_p, dim=-1, keepdim=True)

    def extra_repr(self) -> str:
        p = "" if self.topk_norm_p is None else f", topk_norm_p={self.topk_norm_p}"
        return f"n_experts={self.n_experts}, top_k={self.top_k}, norm_topk_prob={self.norm_topk_prob}{p}"


class SoftmaxTopK(TopKRouter):
    """Softmax over all experts, top-k of the scores; the k weights renormalised when norm_topk_prob, divided by
    their p-norm where topk_norm_p is set, then cast to the logits' dtype (Qwen2-MoE, Qwen3-MoE, OLMoE; DBRX's p
    norm). The logits are computed in the weight's dtype, float32 where the weight is float32."""

    scoring = "softmax"

    def logits(self, x: Float[torch.Tensor, "... d_model"]) -> Float[torch.Tensor, "... n_experts"]:
        if self.weight.dtype == torch.float32:
            return F.linear(x.float(), self.weight)
        return F.linear(x.to(self.weight.dtype), self.weight)

    def scores(self, logits: torch.Tensor) -> Float[torch.Tensor, "... n_experts"]:
        return F.softmax(logits, dim=-1, dtype=torch.float32)

    def choose(self, choice_scores: Float[torch.Tensor, "... n_experts"]) -> Int[torch.Tensor, "... top_k"]:
        return torch.topk(choice_scores, self.top_k, dim=-1).indices

    def weights(
        self, scores: torch.Tensor, indices: torch.Tensor, logits_dtype: torch.dtype
    ) -> Float[torch.Tensor, "... top_k"]:
        w = scores.gather(-1, indices)
        if self.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return self.p_normalised(w).to(logits_dtype)


class TopKLogitsSoftmax(TopKRouter):
    """The top-k of the logits (computed in the weight's dtype, then float32), the k weights a float32 softmax
    over the chosen logits, cast to the weight's dtype (Granite). hook_router_scores holds the float32 logits
    the top-k is taken on."""

    scoring = "top-k logits, softmax over the k"
    scores_form = "top_k_logits"
    probs_form = "softmax_of_logits"

    def logits(self, x: Float[torch.Tensor, "... d_model"]) -> Float[torch.Tensor, "... n_experts"]:
        return F.linear(x.to(self.weight.dtype), self.weight).float()

    def scores(self, logits: torch.Tensor) -> Float[torch.Tensor, "... n_experts"]:
        return logits.float().clone()  # its own tensor: an in-place edit of the scores must not reach the logits

    def choose(self, choice_scores: Float[torch.Tensor, "... n_experts"]) -> Int[torch.Tensor, "... top_k"]:
        return torch.topk(choice_scores, self.top_k, dim=-1).indices

    def weights(
        self, scores: torch.Tensor, indices: torch.Tensor, logits_dtype: torch.dtype
    ) -> Float[torch.Tensor, "... top_k"]:
        return F.softmax(scores.gather(-1, indices), dim=-1, dtype=torch.float32).to(self.weight.dtype)

    def probabilities(self, scores: Float[torch.Tensor, "... n_experts"]) -> Float[torch.Tensor, "... n_experts"]:
        """The softmax of the logits over all experts, float32 (the weights are a softmax over the chosen k)."""
        return F.softmax(scores, dim=-1, dtype=torch.float32)


class Float32SoftmaxTopK(SoftmaxTopK):
    """SoftmaxTopK with a float32 weight: logits, scores and weights float32 in any model dtype (Hunyuan)."""

    float32_weight = True


class GroupedTopK(TopKRouter):
    """The top-k of the choice scores among the topk_group best of n_group expert groups (a group scores as its two
    best experts; the other groups' scores set to masked_group_score for the choice); the weights the chosen
    experts' scores, renormalised (+ 1e-20) when norm_topk_prob, times routed_scaling_factor, in the logits'
    dtype. A subclass says how logits, scores and choice scores are made."""

    # what a group left out scores for the choice (-inf: DeepSeek-V3's; Mistral Small 4's is 0)
    masked_group_score: ClassVar[float] = float("-inf")

    def __init__(self, cfg: MoeConfig, top_k: int) -> None:
        super().__init__(cfg, top_k)
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group

    @staticmethod
    def check_groups(n_experts: int, top_k: int, n_group: int, topk_group: int) -> None:
        """Refuse the groupings this rule cannot run (config.json's field names in the messages): each group is
        scored by its two best experts (n_group 1 included), the topk_group best groups are kept and top_k
        experts are picked among theirs only."""
        if topk_group > n_group:
            raise ValueError(f"topk_group ({topk_group}) must be at most n_group ({n_group})")
        if n_experts % n_group:
            raise ValueError(f"n_routed_experts ({n_experts}) must be a multiple of n_group ({n_group})")
        per_group = n_experts // n_group
        if per_group < 2:
            raise ValueError(
                f"n_routed_experts / n_group = {n_experts} / {n_group} = {per_group} expert per group; a group is "
                "scored by its 2 best experts, so each needs at least 2"
            )
        if topk_group * per_group < top_k:
            raise ValueError(
                f"num_experts_per_tok ({top_k}) is more than the {topk_group * per_group} experts in the topk_group "
                f"({topk_group}) groups of {per_group} (n_routed_experts {n_experts} / n_group {n_group}) kept per token"
            )

    def choose(self, choice_scores: Float[torch.Tensor, "... n_experts"]) -> Int[torch.Tensor, "... top_k"]:
        if self.n_group > 1:
            choice_scores = self._mask_groups(choice_scores)
        # sorted=False as the reference: slot order then follows the kernel, as it does there
        return torch.topk(choice_scores, self.top_k, dim=-1, sorted=False).indices

    def _mask_groups(self, choice_scores: torch.Tensor) -> torch.Tensor:
        """Keep the topk_group groups whose two best scores sum highest; the rest get masked_group_score."""
        grouped = choice_scores.unflatten(-1, (self.n_group, self.n_experts // self.n_group))
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        best = torch.topk(group_scores, self.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(-1, best, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), self.masked_group_score).flatten(-2)

    def weights(
        self, scores: torch.Tensor, indices: torch.Tensor, logits_dtype: torch.dtype
    ) -> Float[torch.Tensor, "... top_k"]:
        w = scores.gather(-1, indices)
        if self.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return (w * self.routed_scaling_factor).to(logits_dtype)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, n_group={self.n_group}, topk_group={self.topk_group}, "
            f"routed_scaling_factor={self.routed_scaling_factor}"
        )


class SigmoidGroupedTopK(GroupedTopK):
    """Sigmoid scores from float32 logits; the choice is taken on scores + e_score_correction_bias, among
    the topk_group best of n_group expert groups (a group scores as its two best experts); the weights are
    the unbiased scores of the chosen experts, renormalised when norm_topk_prob, times
    routed_scaling_factor, float32 (Solar-Open, DeepSeek-V3)."""

    float32_weight = True
    choice_bias = True
    scoring = "sigmoid"
    scores_form = probs_form = "sigmoid"

    @classmethod
    def param_terms(cls, cfg: MoeConfig) -> tuple[ParamTerm, ...]:
        bias = ParamTerm("e_score_correction_bias", (cfg.n_experts,), "routers", cls.float32_weight, buffer=True)
        return (*super().param_terms(cfg), bias)

    def __init__(self, cfg: MoeConfig, top_k: int) -> None:
        super().__init__(cfg, top_k)
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_experts))

    def logits(self, x: Float[torch.Tensor, "... d_model"]) -> Float[torch.Tensor, "... n_experts"]:
        return F.linear(x.float(), self.weight.float())

    def scores(self, logits: torch.Tensor) -> Float[torch.Tensor, "... n_experts"]:
        return logits.float().sigmoid()

    def choice_scores(self, scores: torch.Tensor) -> torch.Tensor:
        return scores + self.e_score_correction_bias


class SparseMixer(TopKRouter):
    """Phi-3.5-MoE's sparsemixer as it runs at inference. Logits in the weight's dtype (the model's); slot 1 takes
    the expert of the largest logit, each later slot the largest of those not yet taken (torch.max's choice, as
    the reference). A slot's weight is a softmax, in the logits' dtype, over the experts it keeps: not those of
    earlier slots, nor those whose logit l falls short of the slot's chosen logit c by more than
    2 * router_jitter_noise relative to max(|l|, c), i.e. (c - l) / max(|l|, c) > 2 * router_jitter_noise; the
    slot's weight is its chosen expert's share. Not renormalised across slots. Computed from whatever indices
    it is given, so a replaced hook_expert_indices is weighted the same way.

    Training-only parts are left out (the model is never in training mode here): the Gumbel sampling of the
    choices, the input jitter noise and the custom gradient (Heun's third-order estimator)."""

    scoring = "sparsemixer"
    scores_form = probs_form = "sparsemixer"

    def __init__(self, cfg: MoeConfig, top_k: int) -> None:
        super().__init__(cfg, top_k)
        self.jitter_eps = cfg.router_jitter_noise

    def logits(self, x: Float[torch.Tensor, "... d_model"]) -> Float[torch.Tensor, "... n_experts"]:
        return F.linear(x.to(self.weight.dtype), self.weight)

    def scores(self, logits: torch.Tensor) -> Float[torch.Tensor, "... n_experts"]:
        return logits.clone()  # its own tensor: an in-place edit of the scores must not reach the cached logits

    def choose(self, choice_scores: Float[torch.Tensor, "... n_experts"]) -> Int[torch.Tensor, "... top_k"]:
        remaining, chosen = choice_scores, []
        for _ in range(self.top_k):
            index = remaining.max(dim=-1, keepdim=True).indices
            chosen.append(index)
            remaining = torch.scatter(remaining, -1, index, float("-inf"))
        return torch.cat(chosen, dim=-1)

    def weights(
        self, scores: torch.Tensor, indices: torch.Tensor, logits_dtype: torch.dtype
    ) -> Float[torch.Tensor, "... top_k"]:
        remaining, weights = scores, []
        for slot in range(indices.shape[-1]):
            index = indices[..., slot : slot + 1]
            threshold = remaining.gather(-1, index)  # the slot's chosen logit (-inf for an expert taken before)
            with torch.no_grad():
                factor = scores.abs().clamp(min=threshold)
                far = ((threshold - scores) / factor) > (2 * self.jitter_eps)
            kept = remaining.masked_fill(far, float("-inf"))
            weights.append(torch.softmax(kept, dim=-1).gather(-1, index))
            remaining = torch.scatter(remaining, -1, index, float("-inf"))
        return torch.cat(weights, dim=-1).to(logits_dtype)

    def probabilities(self, scores: Float[torch.Tensor, "... n_experts"]) -> Float[torch.Tensor, "... n_experts"]:
        """The softmax of the logits over all experts, float32 (each slot's weight is a softmax over fewer)."""
        return F.softmax(scores, dim=-1, dtype=torch.float32)

    def extra_repr(self) -> str:
        return f"n_experts={self.n_experts}, top_k={self.top_k}, router_jitter_noise={self.jitter_eps}"
