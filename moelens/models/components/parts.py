"""What a block's MLP is made of, as data: `block.mlp.parts()` lists its parts, each with its module, the hook
whose tensor is its term of hook_mlp_out, its gate if any, and the weights that read the MLP's input.

Code that works on every arrangement (weight folding, the residual and neuron decompositions, the weight
views, routing tables) iterates the parts instead of knowing the arrangement classes, so a new arrangement
(parts in another order, a gate elsewhere, other module names) only lists its parts. The parts' terms, as
their `out` hooks hold them, add up to what the MLP adds to the residual stream (the block's hook_mlp_out).

Three kinds of part:
- "routed": a router and its routed experts (RoutedPart); their term is the routing-weighted sum of the
  chosen experts' outputs;
- "shared": a gated MLP every token goes through beside the routed experts (a shared expert), optionally
  scaled by a per-position gate (GatedMlpPart);
- "dense": a dense block's MLP, the block's whole MLP (GatedMlpPart with no `out` hook of its own: its term is
  the block's hook_mlp_out).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
from jaxtyping import Float
from torch import nn

from moelens.hooks import HookPoint

if TYPE_CHECKING:
    from moelens.models.components.mlp import GatedMLP
    from moelens.models.components.moe import Experts
    from moelens.models.components.router import TopKRouter


@dataclass(frozen=True)
class PartGate:
    """A per-position scalar that multiplies a part's output: activation(logit), where logit = module(x) is a
    one-output linear map of the MLP's input, hooked (before the activation) by `hook`."""

    module: nn.Linear
    hook: HookPoint
    activation: Callable[[torch.Tensor], torch.Tensor] = torch.sigmoid

    def scale(self, logit: Float[torch.Tensor, "*rest 1"]) -> Float[torch.Tensor, "*rest 1"]:
        """The factor the part's output is multiplied by, from the gate's logit (as its hook holds it)."""
        return self.activation(logit)


@dataclass(frozen=True)
class GatedMlpPart:
    """A gated MLP (moelens.models.components.mlp.GatedMLP) every token goes through: a mixture's shared
    expert (kind "shared") or a dense block's MLP (kind "dense").

    out: the hook holding its term of hook_mlp_out as added (the gate's factor included); None for a dense
    block's MLP, whose term is the whole MLP output, the block's hook_mlp_out. label names it in the
    decompositions ("L{l}.{label}", "L{l}.{label}.N{i}"); a dense MLP has TransformerLens's labels instead.
    Its neurons are module.hook_post ([batch pos n]); neuron i writes module.down_proj.weight[:, i]."""

    kind: Literal["shared", "dense"]
    module: GatedMLP
    out: HookPoint | None
    gate: PartGate | None = None
    label: str = "shared"

    def __post_init__(self) -> None:
        if self.kind not in ("shared", "dense"):
            raise ValueError(f"GatedMlpPart kind must be 'shared' or 'dense', got {self.kind!r}")
        if self.kind == "shared" and self.out is None:
            raise ValueError("a shared GatedMlpPart needs the hook holding its term of hook_mlp_out (out)")
        if self.kind == "dense" and (self.out is not None or self.gate is not None):
            raise ValueError("a dense GatedMlpPart is the whole MLP: its term is hook_mlp_out (out=None), ungated")

    @property
    def neurons(self) -> HookPoint:
        return self.module.hook_post

    def input_weights(self) -> tuple[Float[torch.Tensor, "out d_model"], ...]:
        """Every weight that reads the MLP's input, [..., d_model] (gate and up projections, the gate's map)."""
        gate = getattr(self.module, "gate_proj", None)  # an ungated MLP (UngatedMLP) has none
        reads = (self.module.up_proj.weight,) if gate is None else (gate.weight, self.module.up_proj.weight)
        return reads + ((self.gate.module.weight,) if self.gate is not None else ())

    def write_weight(self) -> Float[torch.Tensor, "d_model n"]:
        """The down projection: neuron i writes column i (before the gate's factor)."""
        return self.module.down_proj.weight


@dataclass(frozen=True)
class RoutedPart:
    """A router and its routed experts (moelens.models.components.moe.Experts). out holds their term of
    hook_mlp_out (hook_routed_out); slot_outputs each routing slot's weighted output ([batch pos top_k
    d_model]), indices / weights each slot's expert and routing weight ([batch pos top_k]). Its neurons are
    per slot, module.hook_post ([batch pos top_k d_expert]); expert e's neuron i writes
    module.tensors().down[e, :, i], times the slot's routing weight."""

    router: TopKRouter
    module: Experts
    out: HookPoint
    slot_outputs: HookPoint
    indices: HookPoint
    weights: HookPoint
    kind: Literal["routed"] = "routed"
    gate: None = None  # the routing weights are the experts' gates; no part-wide factor
    # out = scale * the slots' outputs summed (a routed_scaling_factor applied to the experts' sum, Beam's)
    scale: float = 1.0

    @property
    def neurons(self) -> HookPoint:
        return self.module.hook_post

    def input_weights(self) -> tuple[Float[torch.Tensor, "... d_model"], ...]:
        """Every weight that reads the MLP's input: the router's, the experts' gate and up rows
        ([n_experts, 2 * d_expert, d_model]; a dequantized copy for experts kept stored)."""
        return (self.router.weight, self.module.tensors().gate_up)


MlpPart = RoutedPart | GatedMlpPart
