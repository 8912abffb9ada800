"""Sparse mixture-of-experts blocks: router and routed experts, and the shared-expert arrangements families use."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import torch
from jaxtyping import Float, Int
from torch import nn

from moelens.config import MoeConfig
from moelens.experts.rounding import after_move, cast_through
from moelens.experts.spec import ExpertSpec, ExpertTensors
from moelens.experts.stored import StoredExperts
from moelens.hooks.expert_views import VIEW_SITES, ExpertViewPoint, ViewGroup
from moelens.hooks.sites import site_hook
from moelens.kernels import ExpertHooks, routed_experts
from moelens.kernels.expert_parallel import ExpertShard
from moelens.kernels.experts import Backend, Executor, check_indices, resolve_backend, routed_subset
from moelens.kernels.offload import OffloadedExperts, offloaded_routed_experts
from moelens.models.components.mlp import GatedMLP
from moelens.models.components.parts import GatedMlpPart, MlpPart, PartGate, RoutedPart
from moelens.models.components.router import TopKRouter
from moelens.models.terms import ParamTerm, linear, under


def weight_form(spec: ExpertSpec) -> str:
    """The form of the routed sites (hook sites table) for where the spec applies the routing weight, or for
    experts with identity experts beside them."""
    if spec.n_identity:  # identity experts' slots: zeros for the neurons, the input as the output
        return "identity"
    return "weighted_input" if spec.weight_at == "input" else "default"


class ExpertSites(nn.Module):
    """TransformerLens's per-expert hook sites (its MoEGatedMLP's), blocks.L.mlp.experts.E.hook_gate / hook_pre /
    hook_post: [routed, d_expert] views of the per-slot sites, the rows of the slots routed to expert E in TL's
    order (by slot, then by token; see moelens.hooks.expert_views.rows_by_expert). As in TL, hook_pre is the linear
    "up" projection (the per-slot experts.hook_pre_linear) and hook_gate the gate pre-activation (the per-slot
    experts.hook_pre)."""

    def __init__(self, group: ViewGroup, expert: int) -> None:
        super().__init__()
        for site in VIEW_SITES:
            setattr(self, site, ExpertViewPoint(group, expert, site))


class Experts(nn.Module):
    """One mixture layer's routed experts, as the config's ExpertSpec says (moelens.experts.spec), and where
    they live, fixed when the model is built (cfg.expert_placement):

    - "resident": the stacks are this module's parameters, named and shaped as spec.shapes() says
      (W_gate_up [E, 2*d_expert, d_model], gate rows first; W_down [E, d_model, d_expert]; b_gate_up, b_down
      where the spec has biases);
    - "offloaded": an OffloadedExperts store (moelens.kernels.offload) fetches the routed experts when a
      forward needs them; the full stacks are kept in host memory where they are readable (expert_offload
      "cpu"), not at all for "disk";
    - "sharded": this rank's ExpertShard (moelens.kernels.expert_parallel) holds a range of the experts.
    Offloaded and sharded experts are not parameters of the model (model.to() and state_dict() do not see
    them); tensors() reads the stacks wherever they are readable and says why where they are not.

    Where the spec has a storage (cfg.expert_storage: "fp8", "mxfp4"), the experts are kept as the checkpoint
    stores them (moelens.experts.stored.StoredExperts: resident in `stored`, or in the store or shard) and a
    forward dequantizes the routed ones only, into its input's dtype; tensors() then returns dequantized
    copies, and so does reading W_gate_up / W_down / the biases as attributes (a fresh tensor per read: writing
    to one does not change the model). Resident stored experts are not parameters or buffers either
    (state_dict() does not see them);
    model.to(device) moves them, model.to(dtype) changes the dtype they are dequantized to, never them.
    Experts made after a dtype move (dequantized, or read from an offload store's slots) are made through the
    roundings the dense model's weights went through (`rounding`, moelens.experts.rounding), so a model with
    stored or offloaded experts keeps the dense resident model's bits under every move.

    `backend` is what was asked for ("auto", "torch", "triton"); `executor` the path it resolved to ("torch" or
    "triton") for `resolved_for`, the device the experts are computed on. Resolution runs when the backend is
    set, when the experts move (model.to()) and when they are attached, never per forward; a forward whose
    input is on another device raises (see check_device).

    Children "0" .. "E-1" hold each expert's TransformerLens sites (ExpertSites): blocks.L.mlp.experts.E.hook_*."""

    def __init__(self, cfg: MoeConfig) -> None:
        super().__init__()
        self.spec = cfg.expert_spec()
        self.n_experts, self.d_expert = self.spec.n_experts, self.spec.d_expert
        self.placement = cfg.expert_placement
        if self.spec.storage != cfg.expert_storage:  # a family's expert_spec() must pass it on
            raise ValueError(f"{type(cfg).__name__}.expert_spec() has storage {self.spec.storage!r}, cfg.expert_storage is {cfg.expert_storage!r}")
        if self.placement == "resident" and self.spec.storage is None:
            for name in self.spec.shapes():
                self.register_parameter(name, nn.Parameter(self.spec.empty(name)))
        self.stored: StoredExperts | None = None  # resident experts kept as stored: attach_stored()
        self.dtype = cfg.dtype  # what tensors() dequantizes stored experts to; follows model.to()
        self.rounding = (cfg.dtype,)  # the load's dtype, then each rounding dtype move's
        self.store: OffloadedExperts | None = None  # placement "offloaded": attach_store()
        self.host: ExpertTensors | StoredExperts | None = None  # placement "offloaded" to host memory: the full stacks
        self.shard: ExpertShard | None = None  # placement "sharded": attach_shard()
        self.executor: Executor = "torch"
        self.resolved_for: torch.device | None = None
        self.backend = "auto"  # resolves executor for resolved_for (the property below)
        form = weight_form(self.spec)
        self.hook_pre = site_hook("blocks.L.mlp.experts.hook_pre", form if self.spec.activation.gated else "ungated")
        self.hook_pre_linear = site_hook("blocks.L.mlp.experts.hook_pre_linear", form)
        self.hook_post = site_hook("blocks.L.mlp.experts.hook_post", form, formula=self.spec.activation.formula)
        self.hook_out = site_hook("blocks.L.mlp.experts.hook_out", "identity" if form == "identity" else "default")
        self.views = ViewGroup(cfg.n_experts)  # not a module: the per-expert sites below, for a cheap hooked test
        for e in range(cfg.n_experts):
            self.add_module(str(e), ExpertSites(self.views, e))

    def attach_stored(self, stored: StoredExperts) -> None:
        """Placement "resident" with a storage: the layer's experts as stored."""
        self._expect("resident")
        if self.spec.storage is None or stored.n_experts != self.n_experts:
            raise ValueError(f"these experts are {self.spec.describe()}; got {stored!r}")
        self.stored = stored
        self.backend = self.backend  # computed where they are now

    def attach_store(self, store: OffloadedExperts, host: ExpertTensors | StoredExperts | None = None) -> None:
        """Placement "offloaded": the store the forward fetches routed experts from. host: the full stacks where
        they stay readable (host memory), None when they live only on disk."""
        self._expect("offloaded")
        self.store, self.host = store, host
        self.backend = self.backend

    def attach_shard(self, shard: ExpertShard) -> None:
        """Placement "sharded": this rank's experts."""
        self._expect("sharded")
        self.shard = shard
        self.backend = self.backend

    @property
    def backend(self) -> Backend:
        return self._backend

    @backend.setter
    def backend(self, backend: Backend) -> None:
        """Resolve `backend` for where the experts are computed now; errors (naming experts_backend) leave the
        previous backend in place."""
        self.executor, self.resolved_for = self.resolve(backend), self.home()
        self._backend = backend

    def resolve(self, backend: Backend, device: torch.device | None = None) -> Executor:
        """The executor `backend` gives for these experts computed on `device` (default: where they are)."""
        device = self.home() if device is None else device
        if self.placement == "sharded":  # each rank runs its experts with the torch path's exchanges
            if backend == "triton":
                raise ValueError(
                    "experts_backend='triton': expert_parallel runs the routed experts on the torch path; use "
                    "experts_backend='torch' or 'auto'"
                )
            return resolve_backend(backend, torch.device("cpu"))  # checks the name; "auto" is torch here
        return resolve_backend(backend, torch.device("meta") if device is None else device, self.spec)

    def home(self) -> torch.device | None:
        """The device the experts are computed on: their parameters' or stored tensors', the offload store's
        compute device, the shard's; None where nothing is attached yet."""
        if self.placement == "offloaded":  # a device as tensors report it ("cpu:1" is "cpu", "cuda" has its index)
            return None if self.store is None else torch.empty(0, device=self.store.device).device
        if self.placement == "sharded":
            if self.shard is None:
                return None
            held = self.shard.tensors
            return held.device if isinstance(held, StoredExperts) else held.gate_up.device
        if self.spec.storage is not None:
            return None if self.stored is None else self.stored.device
        return getattr(self, self.spec.param_names[0]).device

    def home_after(self, fn) -> torch.device | None:
        """Where the experts will be computed once model._apply(fn) has run: resident experts follow fn,
        offloaded and sharded ones stay where their store or shard is."""
        home = self.home()
        if self.placement != "resident" or home is None:
            return home
        return fn(torch.empty(0, device=home)).device

    def check_device(self, x: torch.Tensor) -> None:
        """A clear error for an input on another device than the executor was resolved for. Raised, not
        re-resolved: the experts' weights are on resolved_for (a move re-resolves), so any path would fail on
        such an input or move weights per call, and re-resolving would put the lookup back in every forward.
        Experts resolved before they were placed (on meta, or with nothing attached: a load materializes the
        parameters in place) are resolved once, at their first forward off meta; experts still with nothing
        attached are left to the forward's own error."""
        unplaced = self.resolved_for is None or self.resolved_for.type == "meta"
        if unplaced and x.device.type != "meta":
            self.backend = self._backend
        if self.resolved_for is not None and x.device != self.resolved_for:
            raise RuntimeError(
                f"{self.hook_pre.name.removesuffix('.hook_pre') or 'experts'}: experts_backend={self.backend!r} was "
                f"resolved to {self.executor!r} for experts on {self.resolved_for}, but the input is on {x.device}; "
                "move the input there (or the model with model.to(), which resolves the backend again)"
            )

    def _expect(self, placement: str) -> None:
        if self.placement != placement:
            raise ValueError(f"these experts were built {self.placement}, not {placement}")

    def tensors(self) -> ExpertTensors:
        """All of the layer's stacked experts, in the spec's parameter order: the parameters themselves, or,
        for experts kept as stored, a dequantized copy (editing it does not change the model)."""
        if self.placement == "resident" and self.spec.storage is not None:
            if self.stored is None:
                raise ValueError("these experts are kept as stored and none are attached yet (a model on device='meta')")
            return self.stored.dequantize(self.dtype)
        if self.placement == "resident":
            return ExpertTensors(*(getattr(self, name) for name in self.spec.param_names))
        if self.placement == "sharded":
            where = "not attached yet" if self.shard is None else str(self.shard)
            raise ValueError(
                f"with expert_parallel this rank holds only some experts ({where}); read its stacks with "
                ".shard.tensors"
            )
        if self.host is None:
            raise ValueError(
                "this model's routed experts are offloaded to disk and are not held in memory; read one expert with "
                ".store.source(expert) or load with expert_offload='cpu' (or none)"
            )
        if isinstance(self.host, StoredExperts):
            return self.host.dequantize(self.dtype)
        return ExpertTensors(*(None if t is None else cast_through(t, self.rounding, self.dtype) for t in self.host))

    def __getattr__(self, name: str):
        # W_gate_up, W_down (and the biases) of experts that are not parameters here (kept as stored, or
        # offloaded to host memory): the dequantized stacks, as tensors() gives them. Each read is a fresh
        # tensor: writing to it does not change the model.
        spec = self.__dict__.get("spec")
        held_elsewhere = spec is not None and (spec.storage is not None or self.placement != "resident")
        if held_elsewhere and name in spec.param_names:
            try:
                stacks = self.tensors()
            except ValueError as e:  # disk-offloaded or sharded: AttributeError, so hasattr() stays False
                raise AttributeError(f"experts.{name}: {e}") from None
            return stacks[spec.param_names.index(name)]
        return super().__getattr__(name)

    def stacks_held_elsewhere(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The full stacks, as meta tensors of the spec's (dequantized) shapes, where they are not this module's
        parameters (offloaded, sharded or kept stored): what loading checks and fills and what a plan counts."""
        if dict(self.named_parameters(recurse=False)):
            return {}
        return {name: torch.empty(shape, dtype=dtype, device="meta") for name, shape in self.spec.shapes().items()}

    def forward(
        self, x: Float[torch.Tensor, "T H"], indices: Int[torch.Tensor, "T k"], weights: Float[torch.Tensor, "T k"],
        hooks: ExpertHooks, batch_pos: tuple[int, int],
    ) -> Float[torch.Tensor, "T H"]:
        """sum over each token's slots of weight * expert(x), wherever the experts live."""
        self.check_device(x)
        if self.placement == "sharded":  # this rank's experts, the others' gathered
            return self.shard(x, indices, weights, self.spec, hooks, batch_pos, self.executor)
        if self.placement == "offloaded":  # read from the expert cache's slots, loaded as routed to
            return offloaded_routed_experts(self.store, x, indices, weights, self.spec, hooks, batch_pos, self.executor)
        if self.stored is not None:  # only the routed experts are dequantized
            used, indices = routed_subset(indices, self.n_experts, self.spec.n_identity)
            tensors = self.stored.select(used)
        else:
            tensors = self.tensors()
        # stored experts are dequantized by routed_experts, in the kernels' tiles on the triton path
        return routed_experts(x, indices, weights, tensors, self.spec, hooks, batch_pos, self.executor)

    def _apply(self, fn, recurse: bool = True):
        # model.to() / .cuda() / .half() ...: stored experts follow the device only (their codes and scales
        # are never cast); a probe says where and in what dtype the float parameters now are
        out = super()._apply(fn, recurse)
        probe = fn(torch.empty(0, dtype=self.dtype, device=self.stored.device if self.stored is not None else "cpu"))
        if probe.dtype != self.dtype:
            self._follow_dtype(probe.dtype)
        if self.stored is not None and probe.device != self.stored.device:
            self.stored = self.stored.to(probe.device)
        self.backend = self.backend  # resolved again for where the experts are now
        return out

    def _follow_dtype(self, dtype: torch.dtype) -> None:
        """A model.to(dtype) for the experts that are not parameters: stored ones dequantize, and offloaded
        ones are cast, through the dense weights' roundings; a rank's dense shard is cast as parameters are."""
        self.dtype, self.rounding = dtype, after_move(self.rounding, dtype)
        if self.stored is not None:
            self.stored = self.stored.with_rounding(self.rounding)
        if isinstance(self.host, StoredExperts):
            self.host = self.host.with_rounding(self.rounding)
        if self.store is not None:
            self.store.rounding = self.rounding
        if self.shard is not None:
            self.shard.follow_dtype(dtype, self.rounding)

    def extra_repr(self) -> str:
        where = "" if self.store is None else f", offloaded to {self.store.where}"
        where += "" if self.stored is None else f", {self.stored.nbytes:,} bytes as stored"
        where += "" if self.shard is None else f", {self.shard}"
        return f"{self.spec.describe()}, backend={self.backend} ({self.executor}){where}"


class SparseMoe(nn.Module):
    """A router and routed experts, nothing else (Mixtral, OLMoE, Qwen3-MoE). Subclasses add a shared expert;
    each one's forward runs its parts in the family's order, which is the order its hooks fire in, and parts()
    lists them as data (moelens.models.components.parts) for the code that works on every arrangement."""

    @classmethod
    def param_terms(cls, cfg: MoeConfig, layer: int, router: type[TopKRouter]) -> tuple[ParamTerm, ...]:
        """The router's and the routed experts' stacks (cfg.expert_spec(): dense, as if resident, wherever a
        placement keeps them; a token multiplies top_k of the n_experts matrices of a stack [n_experts out in],
        and only adds its biases); a subclass adds its shared expert."""
        top_k = cfg.top_k_per_layer[layer]
        experts = tuple(
            ParamTerm(name, shape, "routed_experts", flops=2 * math.prod(shape[1:]) * top_k if len(shape) == 3 else 0)
            for name, shape in cfg.expert_spec().shapes().items()
        )
        return under("router", router.param_terms(cfg)) + under("experts", experts)

    def __init__(self, cfg: MoeConfig, layer: int, router: type[TopKRouter]) -> None:
        super().__init__()
        self.router = router(cfg, cfg.top_k_per_layer[layer])
        self.experts = Experts(cfg)
        self.hook_router_logits = site_hook("blocks.L.mlp.hook_router_logits")
        self.hook_router_scores = site_hook("blocks.L.mlp.hook_router_scores", self.router.scores_form)
        self.hook_router_probs = site_hook("blocks.L.mlp.hook_router_probs", self.router.probs_form)
        if self.router.choice_bias:
            self.hook_choice_scores = site_hook("blocks.L.mlp.hook_choice_scores")
        self.hook_expert_indices = site_hook("blocks.L.mlp.hook_expert_indices")
        form = weight_form(self.experts.spec)
        self.hook_expert_weights = site_hook("blocks.L.mlp.hook_expert_weights", form)
        self.hook_expert_outputs = site_hook("blocks.L.mlp.hook_expert_outputs", form)
        self.hook_routed_out = site_hook("blocks.L.mlp.hook_routed_out")
        self._expert_hooks = ExpertHooks(
            self.experts.hook_pre, self.experts.hook_pre_linear, self.experts.hook_post, self.experts.hook_out,
            self.hook_expert_outputs,
        )

    def forward(self, x: Float[torch.Tensor, "batch pos d_model"]) -> Float[torch.Tensor, "batch pos d_model"]:
        return self._routed(x)

    def parts(self) -> tuple[MlpPart, ...]:
        """What this mixture adds to the stream, part by part (moelens.models.components.parts), in the order
        the decompositions list them: a shared expert before the routed experts, whichever the forward runs
        first. The parts' `out` terms sum to the block's hook_mlp_out."""
        return (self._routed_part(),)

    def _routed_part(self) -> RoutedPart:
        return RoutedPart(
            self.router, self.experts, out=self.hook_routed_out, slot_outputs=self.hook_expert_outputs,
            indices=self.hook_expert_indices, weights=self.hook_expert_weights,
        )

    # TransformerLens's dense-MLP weights (block.mlp.W_in [d_model, d_mlp], ...): a mixture has one per expert
    _DENSE_WEIGHTS: ClassVar[dict[str, str]] = {
        "W_in": "the routed experts' up projections are experts.W_gate_up[:, d_expert:] ([n_experts, d_expert, "
        "d_model]); model.W_in[L] ([n_experts, d_model, d_expert])",
        "W_gate": "the routed experts' gate projections are experts.W_gate_up[:, :d_expert] ([n_experts, d_expert, "
        "d_model]); model.W_gate[L] ([n_experts, d_model, d_expert])",
        "W_out": "the routed experts' down projections are experts.W_down ([n_experts, d_model, d_expert]); "
        "model.W_out[L] ([n_experts, d_expert, d_model])",
        "b_in": "the routed experts' biases, where the family has them, are experts.b_gate_up ([n_experts, "
        "2 * d_expert], gate first)",
        "b_out": "the routed experts' output biases, where the family has them, are experts.b_down ([n_experts, d_model])",
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
        if self.hook_router_probs.has_hooks:  # an observation site: computed for its hooks only, read by nothing
            self.hook_router_probs(router.probabilities(scores))
        choice = router.choice_scores(scores)
        if router.choice_bias:
            choice = self.hook_choice_scores(choice)
        indices = self.hook_expert_indices(router.choose(choice))
        if self.hook_expert_indices.has_hooks:  # a replacement must name existing experts
            check_indices(indices, router.n_experts, self.hook_expert_indices.name)
        weights_dtype = x.dtype if router.weights_in_stream_dtype else logits.dtype
        weights = self.hook_expert_weights(router.weights(scores, indices, weights_dtype))
        hooks = self._expert_hooks
        if self.experts.views.any_hooked():  # the per-expert views take the real ids (before offload renumbers)
            hooks = dataclasses.replace(hooks, views=self.experts.views.bind(indices.reshape(b * p, -1), (b, p)))
        rows = self.expert_input(x)
        routed = self.experts(rows.reshape(b * p, -1), indices.reshape(b * p, -1), weights.reshape(b * p, -1), hooks, (b, p))
        return self.hook_routed_out(self.expert_output(routed.view(b, p, -1)))

    def expert_input(self, x: Float[torch.Tensor, "batch pos d_model"]) -> torch.Tensor:
        """What the routed experts read: the block's normed input (a family with a latent projection maps it)."""
        return x

    def expert_output(self, routed: torch.Tensor) -> Float[torch.Tensor, "batch pos d_model"]:
        """The routed experts' weighted sum as added to the stream (a latent family projects it back)."""
        return routed


class ScaledSum:
    """A mixin for a SparseMoe: the routed experts' weighted sum times cfg.routed_scaling_factor, in the stream's
    dtype (Beam: the routing weights exclude the factor); hook_routed_out holds the product, and the routed part
    says so (RoutedPart.scale), so the slots' outputs times it sum to what the mixture adds."""

    def __init__(self, cfg: MoeConfig, layer: int, router: type[TopKRouter]) -> None:
        super().__init__(cfg, layer, router)
        self.routed_scale = cfg.routed_scaling_factor
        self.hook_routed_out = site_hook("blocks.L.mlp.hook_routed_out", "scaled")

    def expert_output(self, routed: torch.Tensor) -> Float[torch.Tensor, "batch pos d_model"]:
        return super().expert_output(routed) * self.routed_scale

    def _routed_part(self) -> RoutedPart:
        return dataclasses.replace(super()._routed_part(), scale=self.routed_scale)

    def extra_repr(self) -> str:
        return f"routed_scale={self.routed_scale}"


class ScaledSumMoe(ScaledSum, SparseMoe):
    """Routed experts alone, their sum scaled (Beam)."""


class SharedExpertMoe(SparseMoe):
    """Routed experts, then a shared expert (d_shared wide) that every token goes through, added ungated
    (Solar-Open, DeepSeek-V3)."""

    shared_mlp: ClassVar[type[GatedMLP]] = GatedMLP  # the shared expert's class (its weights' arrangement)

    @classmethod
    def param_terms(cls, cfg: MoeConfig, layer: int, router: type[TopKRouter]) -> tuple[ParamTerm, ...]:
        return super().param_terms(cfg, layer, router) + under(
            "shared_expert", cls.shared_mlp.param_terms(cfg.d_model, cfg.d_shared, "shared_experts"))

    def __init__(self, cfg: MoeConfig, layer: int, router: type[TopKRouter]) -> None:
        super().__init__(cfg, layer, router)
        self.shared_expert = self.shared_mlp(cfg.d_model, cfg.d_shared, cfg.act_fn, "d_shared", hook_out=True)
        self.hook_shared_out = site_hook("blocks.L.mlp.hook_shared_out")

    def forward(self, x: Float[torch.Tensor, "batch pos d_model"]) -> Float[torch.Tensor, "batch pos d_model"]:
        routed = self._routed(x)
        return routed + self.hook_shared_out(self.shared_expert(x))

    def parts(self) -> tuple[MlpPart, ...]:
        return (GatedMlpPart("shared", self.shared_expert, out=self.hook_shared_out), self._routed_part())


class SharedFirstMoe(SharedExpertMoe):
    """The shared expert first, ungated, then the routed experts (Hunyuan)."""

    def forward(self, x: Float[torch.Tensor, "batch pos d_model"]) -> Float[torch.Tensor, "batch pos d_model"]:
        shared = self.hook_shared_out(self.shared_expert(x))
        return self._routed(x) + shared


class GatedSharedExpertMoe(SharedExpertMoe):
    """The shared expert first; after the routed experts it is scaled by sigmoid(shared_gate(x)), a
    one-output linear map of the block input (Qwen2-MoE)."""

    @classmethod
    def param_terms(cls, cfg: MoeConfig, layer: int, router: type[TopKRouter]) -> tuple[ParamTerm, ...]:
        return super().param_terms(cfg, layer, router) + linear("shared_gate", cfg.d_model, 1, False, "shared_experts")

    def __init__(self, cfg: MoeConfig, layer: int, router: type[TopKRouter]) -> None:
        super().__init__(cfg, layer, router)
        self.shared_gate = nn.Linear(cfg.d_model, 1, bias=False)
        self.hook_shared_gate = site_hook("blocks.L.mlp.hook_shared_gate")

    def forward(self, x: Float[torch.Tensor, "batch pos d_model"]) -> Float[torch.Tensor, "batch pos d_model"]:
        ungated = self.shared_expert(x)
        routed = self._routed(x)
        gate = torch.sigmoid(self.hook_shared_gate(self.shared_gate(x)))
        return routed + self.hook_shared_out(gate * ungated)

    def parts(self) -> tuple[MlpPart, ...]:
        gate = PartGate(self.shared_gate, self.hook_shared_gate, torch.sigmoid)
        return (GatedMlpPart("shared", self.shared_expert, out=self.hook_shared_out, gate=gate), self._routed_part())
