"""Sparse mixture-of-experts blocks: router and routed experts, and the shared-expert arrangements families use."""

from __future__ import annotations

from typing import ClassVar

import torch
from jaxtyping import Float, Int
from torch import nn

from moelens.config import MoeConfig
from moelens.hooks import HookPoint
from moelens.kernels import ExpertHooks, routed_experts
from moelens.kernels.expert_parallel import ExpertShard
from moelens.kernels.experts import VIEW_SITES, ExpertViewPoint, ViewGroup, check_indices
from moelens.kernels.offload import OffloadedExperts
from moelens.models.components.activations import activation
from moelens.models.components.mlp import GatedMLP
from moelens.models.components.router import TopKRouter


class ExpertSites(nn.Module):
    """TransformerLens's per-expert hook sites (its MoEGatedMLP's), blocks.L.mlp.experts.E.hook_gate / hook_pre /
    hook_post: [routed, d_expert] views of the per-slot sites, the rows of the slots routed to expert E in TL's
    order (by slot, then by token; see moelens.kernels.experts.rows_by_expert). As in TL, hook_pre is the linear
    "up" projection (the per-slot experts.hook_pre_linear) and hook_gate the gate pre-activation (the per-slot
    experts.hook_pre)."""

    def __init__(self, group: ViewGroup, expert: int) -> None:
        super().__init__()
        for site in VIEW_SITES:
            setattr(self, site, ExpertViewPoint(group, expert, site))


class Experts(nn.Module):
    """Stacked expert weights: W_gate_up [E, 2*d_expert, d_model] (gate rows first), W_down [E, d_model, d_expert].

    Children "0" .. "E-1" hold each expert's TransformerLens sites (ExpertSites): blocks.L.mlp.experts.E.hook_*."""

    def __init__(self, cfg: MoeConfig) -> None:
        super().__init__()
        self.n_experts, self.d_expert = cfg.n_experts, cfg.d_expert
        self.W_gate_up = nn.Parameter(torch.empty(cfg.n_experts, 2 * cfg.d_expert, cfg.d_model))
        self.W_down = nn.Parameter(torch.empty(cfg.n_experts, cfg.d_model, cfg.d_expert))
        self.act = activation(cfg.act_fn)
        self.backend = "auto"  # "torch" | "triton" | "auto"; see moelens.kernels
        self.store: OffloadedExperts | None = None  # set when the weights live off the device (offload())
        self.shard: ExpertShard | None = None  # set when this rank holds only some experts (expert parallel)
        self.hook_pre = HookPoint("batch pos top_k d_expert", "gate pre-activation per slot")
        self.hook_pre_linear = HookPoint("batch pos top_k d_expert", "up projection per slot")
        self.hook_post = HookPoint("batch pos top_k d_expert", "expert neurons per slot: act(gate) * up")
        self.views = ViewGroup(cfg.n_experts)  # not a module: the per-expert sites below, for a cheap hooked test
        for e in range(cfg.n_experts):
            self.add_module(str(e), ExpertSites(self.views, e))

    def offload(self, store: OffloadedExperts, host_weights: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Hand the weights to an expert store: they stop being this module's parameters (model.to() and
        state_dict() no longer see them). host_weights: the full stacks where they stay readable (host memory),
        None when they live only on disk."""
        del self.W_gate_up, self.W_down
        self.store, self.host_weights = store, host_weights

    def keep_shard(self, shard: ExpertShard) -> None:
        """Expert parallelism: this rank holds only shard's experts, and the full stacks stop being this
        module's parameters (model.to() and state_dict() no longer see them)."""
        del self.W_gate_up, self.W_down
        self.shard = shard

    def weights_for(
        self, indices: Int[torch.Tensor, "T k"], x: torch.Tensor | None = None
    ) -> tuple[Float[torch.Tensor, "E 2I H"], Float[torch.Tensor, "E H I"], Int[torch.Tensor, "T k"]]:
        """(W_gate_up, W_down, expert ids into them): all experts when resident; when offloaded, only the
        routed ones, with the ids renumbered into that stack (see moelens.kernels.offload). x: the mixture's
        input, from which an offloaded model with prefetch on predicts the next layer's experts."""
        if self.store is None:
            return self.W_gate_up, self.W_down, indices
        return self.store.fetch(indices, x)

    def __getattr__(self, name: str):
        if name in ("W_gate_up", "W_down") and self.__dict__.get("shard") is not None:
            raise ValueError(
                f"{name}: with expert_parallel this rank holds only {self.shard}; its stack is .shard.{name} "
                f"(experts {self.shard.lo} to {self.shard.hi - 1})"
            )
        if name in ("W_gate_up", "W_down") and self.__dict__.get("store") is not None:
            if self.host_weights is None:
                # not AttributeError: a property reading this (model.W_out) would turn that into "no attribute"
                raise ValueError(
                    f"{name}: this model's routed experts are offloaded to disk and are not held in memory; read one "
                    "expert with .store.source(expert) or load with expert_offload='cpu' (or none)"
                )
            return self.host_weights[0 if name == "W_gate_up" else 1]
        return super().__getattr__(name)

    def extra_repr(self) -> str:
        where = "" if self.store is None else f", offloaded to {self.store.where}"
        where += "" if self.shard is None else f", {self.shard}"
        return f"n_experts={self.n_experts}, d_expert={self.d_expert}, backend={self.backend}{where}"


class SparseMoe(nn.Module):
    """A router and routed experts, nothing else (Mixtral, OLMoE, Qwen3-MoE). Subclasses add a shared expert;
    each one's forward runs its parts in the family's order, which is the order its hooks fire in."""

    has_shared_expert: ClassVar[bool] = False
    shared_expert_gated: ClassVar[bool] = False  # the shared expert scaled by sigmoid(shared_gate(x))

    def __init__(self, cfg: MoeConfig, layer: int, router: type[TopKRouter]) -> None:
        super().__init__()
        self.router = router(cfg, cfg.top_k[layer])
        self.experts = Experts(cfg)
        self.hook_router_logits = HookPoint("batch pos n_experts", "router logits, before scoring")
        self.hook_router_scores = HookPoint("batch pos n_experts", "softmax / sigmoid scores of every expert (float32)")
        if self.router.choice_bias:
            self.hook_choice_scores = HookPoint(
                "batch pos n_experts", "scores the top-k is taken on (scores + correction bias)"
            )
        self.hook_expert_indices = HookPoint("batch pos top_k", "expert each routing slot sends the token to")
        self.hook_expert_weights = HookPoint("batch pos top_k", "weight of each slot's expert output")
        self.hook_expert_outputs = HookPoint("batch pos top_k d_model", "weighted output of each slot")
        self.hook_routed_out = HookPoint("batch pos d_model", "routed experts' combined output")
        self._expert_hooks = ExpertHooks(
            self.experts.hook_pre, self.experts.hook_pre_linear, self.experts.hook_post, self.hook_expert_outputs
        )

    def forward(self, x: Float[torch.Tensor, "batch pos d_model"]) -> Float[torch.Tensor, "batch pos d_model"]:
        return self._routed(x)

    # TransformerLens's dense-MLP weights (block.mlp.W_in [d_model, d_mlp], ...): a mixture has one per expert
    _DENSE_WEIGHTS: ClassVar[dict[str, str]] = {
        "W_in": "the routed experts' up projections are experts.W_gate_up[:, d_expert:] ([n_experts, d_expert, "
        "d_model]); model.W_in[L] ([n_experts, d_model, d_expert]) when every block is a mixture",
        "W_gate": "the routed experts' gate projections are experts.W_gate_up[:, :d_expert] ([n_experts, d_expert, "
        "d_model]); model.W_gate[L] ([n_experts, d_model, d_expert]) when every block is a mixture",
        "W_out": "the routed experts' down projections are experts.W_down ([n_experts, d_model, d_expert]); "
        "model.W_out[L] ([n_experts, d_expert, d_model]) when every block is a mixture",
        "b_in": "the routed experts have no biases",
        "b_out": "the routed experts have no biases",
    }

    def __getattr__(self, name: str):
        if name in SparseMoe._DENSE_WEIGHTS:
            # AttributeError, so hasattr() stays False; the message says what to read instead
            raise AttributeError(
                f"{type(self).__name__}.{name}: a mixture layer has no dense MLP {name}; "
                f"{SparseMoe._DENSE_WEIGHTS[name]}. A shared expert's weights, if any, are in shared_expert"
            )
        return super().__getattr__(name)

    def _routed(self, x: torch.Tensor) -> torch.Tensor:
        b, p, d = x.shape
        router = self.router
        logits = self.hook_router_logits(router.logits(x))
        scores = self.hook_router_scores(router.scores(logits))
        choice = router.choice_scores(scores)
        if router.choice_bias:
            choice = self.hook_choice_scores(choice)
        indices = self.hook_expert_indices(router.choose(choice))
        if self.hook_expert_indices.has_hooks:  # a replacement must name existing experts
            check_indices(indices, router.n_experts, self.hook_expert_indices.name)
        weights = self.hook_expert_weights(router.weights(scores, indices, logits.dtype))
        hooks = self._expert_hooks
        if self.experts.views.any_hooked():  # the per-expert views take the real ids (before offload renumbers)
            hooks = self.experts.views.bind(hooks, indices.reshape(b * p, -1), (b, p))
        if self.experts.shard is not None:  # expert parallel: this rank's experts, the others' gathered
            routed = self.experts.shard(
                x.reshape(b * p, d), indices.reshape(b * p, -1), weights.reshape(b * p, -1), self.experts.act,
                hooks, (b, p), self.experts.backend,
            )
            return self.hook_routed_out(routed.view(b, p, d))
        W_gate_up, W_down, expert_ids = self.experts.weights_for(indices.reshape(b * p, -1), x)
        routed = routed_experts(
            x.reshape(b * p, d),
            expert_ids,
            weights.reshape(b * p, -1),
            W_gate_up,
            W_down,
            self.experts.act,
            hooks,
            (b, p),
            self.experts.backend,
        )
        return self.hook_routed_out(routed.view(b, p, d))


class SharedExpertMoe(SparseMoe):
    """Routed experts, then a shared expert (d_shared wide) that every token goes through, added ungated
    (Solar-Open, DeepSeek-V3)."""

    has_shared_expert = True

    def __init__(self, cfg: MoeConfig, layer: int, router: type[TopKRouter]) -> None:
        super().__init__(cfg, layer, router)
        self.shared_expert = GatedMLP(cfg.d_model, cfg.d_shared, cfg.act_fn, "d_shared", hook_out=True)
        self.hook_shared_out = HookPoint("batch pos d_model", "shared expert output as added to the routed sum")

    def forward(self, x: Float[torch.Tensor, "batch pos d_model"]) -> Float[torch.Tensor, "batch pos d_model"]:
        routed = self._routed(x)
        return routed + self.hook_shared_out(self.shared_expert(x))


class SharedFirstMoe(SharedExpertMoe):
    """The shared expert first, ungated, then the routed experts (Hunyuan)."""

    def forward(self, x: Float[torch.Tensor, "batch pos d_model"]) -> Float[torch.Tensor, "batch pos d_model"]:
        shared = self.hook_shared_out(self.shared_expert(x))
        return self._routed(x) + shared


class GatedSharedExpertMoe(SharedExpertMoe):
    """The shared expert first; after the routed experts it is scaled by sigmoid(shared_gate(x)), a
    one-output linear map of the block input (Qwen2-MoE)."""

    shared_expert_gated = True

    def __init__(self, cfg: MoeConfig, layer: int, router: type[TopKRouter]) -> None:
        super().__init__(cfg, layer, router)
        self.shared_gate = nn.Linear(cfg.d_model, 1, bias=False)
        self.hook_shared_gate = HookPoint("batch pos 1", "shared expert gate logit, before the sigmoid")

    def forward(self, x: Float[torch.Tensor, "batch pos d_model"]) -> Float[torch.Tensor, "batch pos d_model"]:
        ungated = self.shared_expert(x)
        routed = self._routed(x)
        gate = torch.sigmoid(self.hook_shared_gate(self.shared_gate(x)))
        return routed + self.hook_shared_out(gate * ungated)
