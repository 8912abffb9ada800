"""Gated (SwiGLU) MLP: dense blocks and shared experts; and the ungated up / act / down MLP (Nemotron-H)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from jaxtyping import Float
from torch import nn

from moelens.experts.activations import activation
from moelens.hooks.sites import site_hook
from moelens.models.components.parts import GatedMlpPart
from moelens.models.terms import ParamTerm, linear

# the table's sites of a gated MLP, by its width's name: a dense block's MLP or a shared expert
_SITE_OF_WIDTH = {"d_mlp": "blocks.L.mlp", "d_shared": "blocks.L.mlp.shared_expert"}


class GatedMLP(nn.Module):
    @staticmethod
    def param_terms(d_model: int, d_mlp: int, component: str) -> tuple[ParamTerm, ...]:
        return (linear("gate_proj", d_model, d_mlp, False, component) + linear("up_proj", d_model, d_mlp, False, component)
                + linear("down_proj", d_mlp, d_model, False, component))

    def __init__(self, d_model: int, d_mlp: int, act_fn: str, width_name: str = "d_mlp", hook_out: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, d_mlp, bias=False)
        self.up_proj = nn.Linear(d_model, d_mlp, bias=False)
        self.down_proj = nn.Linear(d_mlp, d_model, bias=False)
        self.act = activation(act_fn)
        self._add_hooks(width_name, hook_out)

    def _add_hooks(self, width_name: str, hook_out: bool) -> None:
        if width_name not in _SITE_OF_WIDTH:
            raise ValueError(f"{type(self).__name__} width_name must be one of {sorted(_SITE_OF_WIDTH)}, got {width_name!r}")
        site = _SITE_OF_WIDTH[width_name]
        self.hook_pre = site_hook(f"{site}.hook_pre")
        self.hook_pre_linear = site_hook(f"{site}.hook_pre_linear")
        self.hook_post = site_hook(f"{site}.hook_post")
        self.has_hook_out = hook_out  # a shared expert's output is a site of its own; a dense MLP's is hook_mlp_out
        if hook_out:
            self.hook_out = site_hook(f"{site}.hook_out")

    # TransformerLens's names of a gated MLP's weights, as [in, out] views of the checkpoint's [out, in] ones
    @property
    def W_gate(self) -> Float[torch.Tensor, "d_model d_mlp"]:
        return self.gate_proj.weight.T

    @property
    def W_in(self) -> Float[torch.Tensor, "d_model d_mlp"]:
        return self.up_proj.weight.T

    @property
    def W_out(self) -> Float[torch.Tensor, "d_mlp d_model"]:
        return self.down_proj.weight.T

    @property
    def b_in(self) -> Float[torch.Tensor, "d_mlp"]:
        """Zeros: the projections have no bias."""
        return self.up_proj.weight.new_zeros(self.up_proj.weight.shape[0])

    @property
    def b_out(self) -> Float[torch.Tensor, "d_model"]:
        """Zeros: the projections have no bias."""
        return self.down_proj.weight.new_zeros(self.down_proj.weight.shape[0])

    def parts(self) -> tuple[GatedMlpPart]:
        """As a dense block's MLP: one part, the whole MLP (its term is the block's hook_mlp_out); see
        moelens.models.components.parts."""
        return (GatedMlpPart("dense", self, out=None),)

    def forward(self, x: Float[torch.Tensor, "batch pos d_model"]) -> Float[torch.Tensor, "batch pos d_model"]:
        pre = self.hook_pre(self.gate_proj(x))
        pre_linear = self.hook_pre_linear(self.up_proj(x))
        out = self.down_proj(self.hook_post(self.act(pre) * pre_linear))
        return self.hook_out(out) if self.has_hook_out else out


class RowBlock(NamedTuple):
    """A view of some rows of a fused projection's weight, read as a projection's own weight ([out, in])."""

    weight: Float[torch.Tensor, "out d_in"]


class FusedGateUpMLP(GatedMLP):
    """A gated MLP whose gate and up projections are one linear map, gate rows first ([2 * d_mlp, d_model]),
    computed in one matmul and split (Granite's shared_mlp.input_linear). gate_proj and up_proj are views of its
    rows, so the weight views, fold_ln and the decompositions read them as a GatedMLP's."""

    @staticmethod
    def param_terms(d_model: int, d_mlp: int, component: str) -> tuple[ParamTerm, ...]:
        return linear("gate_up_proj", d_model, 2 * d_mlp, False, component) + linear("down_proj", d_mlp, d_model, False, component)

    def __init__(self, d_model: int, d_mlp: int, act_fn: str, width_name: str = "d_mlp", hook_out: bool = False):
        nn.Module.__init__(self)
        self.d_mlp = d_mlp
        self.gate_up_proj = nn.Linear(d_model, 2 * d_mlp, bias=False)
        self.down_proj = nn.Linear(d_mlp, d_model, bias=False)
        self.act = activation(act_fn)
        self._add_hooks(width_name, hook_out)

    @property
    def gate_proj(self) -> RowBlock:
        return RowBlock(self.gate_up_proj.weight[: self.d_mlp])

    @property
    def up_proj(self) -> RowBlock:
        return RowBlock(self.gate_up_proj.weight[self.d_mlp :])

    def forward(self, x: Float[torch.Tensor, "batch pos d_model"]) -> Float[torch.Tensor, "batch pos d_model"]:
        # each half contiguous: the activation's rounding then never depends on whether a hook edited the half in
        # place (a strided view of the fused output) or returned an edited copy (contiguous)
        gate, up = (half.contiguous() for half in self.gate_up_proj(x).chunk(2, dim=-1))
        out = self.down_proj(self.hook_post(self.act(self.hook_pre(gate)) * self.hook_pre_linear(up)))
        return self.hook_out(out) if self.has_hook_out else out


class UngatedMLP(GatedMLP):
    """down(act(up(x))), no gate (Nemotron-H's relu2 MLP and shared expert). hook_pre holds up(x), as
    TransformerLens's hook_pre of a non-gated MLP (routed ungated experts hook it at experts.hook_pre_linear,
    TransformerLens's per-expert hook_pre); there is no hook_pre_linear. `bias`: up and down have biases."""

    @staticmethod
    def param_terms(d_model: int, d_mlp: int, component: str) -> tuple[ParamTerm, ...]:
        return linear("up_proj", d_model, d_mlp, False, component) + linear("down_proj", d_mlp, d_model, False, component)

    def __init__(self, d_model: int, d_mlp: int, act_fn: str, width_name: str = "d_mlp", hook_out: bool = False,
                 bias: bool = False):
        nn.Module.__init__(self)
        self.up_proj = nn.Linear(d_model, d_mlp, bias=bias)
        self.down_proj = nn.Linear(d_mlp, d_model, bias=bias)
        self.act = activation(act_fn)
        if width_name not in _SITE_OF_WIDTH:
            raise ValueError(f"UngatedMLP width_name must be one of {sorted(_SITE_OF_WIDTH)}, got {width_name!r}")
        site = _SITE_OF_WIDTH[width_name]
        self.hook_pre = site_hook(f"{site}.hook_pre", "ungated")
        self.hook_post = site_hook(f"{site}.hook_post", "ungated")
        self.has_hook_out = hook_out
        if hook_out:
            self.hook_out = site_hook(f"{site}.hook_out")

    @property
    def W_gate(self):
        raise ValueError("W_gate: an UngatedMLP has no gate projection (down(act(up(x)))); its up projection is W_in")

    @property
    def b_in(self) -> Float[torch.Tensor, "d_mlp"]:
        bias = self.up_proj.bias
        return self.up_proj.weight.new_zeros(self.up_proj.weight.shape[0]) if bias is None else bias

    @property
    def b_out(self) -> Float[torch.Tensor, "d_model"]:
        bias = self.down_proj.bias
        return self.down_proj.weight.new_zeros(self.down_proj.weight.shape[0]) if bias is None else bias

    def forward(self, x: Float[torch.Tensor, "batch pos d_model"]) -> Float[torch.Tensor, "batch pos d_model"]:
        out = self.down_proj(self.hook_post(self.act(self.hook_pre(self.up_proj(x)))))
        return self.hook_out(out) if self.has_hook_out else out
