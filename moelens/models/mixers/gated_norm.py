"""Gated RMSNorm: an RMSNorm whose output is multiplied by SiLU of a gate (Gated DeltaNet's output norm, as in
Qwen3-Next / Qwen3.5 and the FLA library's "norm before gate")."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import nn

from moelens.models.terms import ParamTerm, vector


class GatedRMSNorm(nn.Module):
    """weight * x / sqrt(mean(x^2) + eps) * silu(gate), over the last axis.

    The order of transformers' Qwen3NextRMSNormGated: the norm in float32, cast back to x's dtype, times the
    weight (in that dtype), times silu of the float32 gate (a float32 product), cast back to x's dtype."""

    @staticmethod
    def param_terms(d: int, component: str) -> tuple[ParamTerm, ...]:
        return vector("weight", d, component)

    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(
        self, x: Float[torch.Tensor, "... d"], gate: Float[torch.Tensor, "... d"]
    ) -> Float[torch.Tensor, "... d"]:
        if gate.shape != x.shape:
            raise ValueError(f"GatedRMSNorm: gate shape {tuple(gate.shape)} differs from input shape {tuple(x.shape)}")
        dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        normed = self.apply_weight(x * torch.rsqrt(variance + self.eps), dtype)
        return (normed * F.silu(gate.to(torch.float32))).to(dtype)

    def apply_weight(self, normed: Float[torch.Tensor, "... d"], dtype: torch.dtype) -> Float[torch.Tensor, "... d"]:
        """The float32 normed input, back in the input's dtype, times the weight (Qwen3-Next's order)."""
        return self.weight * normed.to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class SigmoidGatedRMSNorm(nn.Module):
    """weight * x / sqrt(mean(x^2) + eps) * sigmoid(gate), over the last axis, all in float32 and cast back to x's
    dtype at the end (Kimi Delta Attention's output norm, transformers' KimiLinearRMSNormGated: the weight is
    upcast rather than the normed input cast down)."""

    @staticmethod
    def param_terms(d: int, component: str) -> tuple[ParamTerm, ...]:
        return vector("weight", d, component)

    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(
        self, x: Float[torch.Tensor, "... d"], gate: Float[torch.Tensor, "... d"]
    ) -> Float[torch.Tensor, "... d"]:
        if gate.shape != x.shape:
            raise ValueError(f"SigmoidGatedRMSNorm: gate shape {tuple(gate.shape)} differs from input shape {tuple(x.shape)}")
        dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        normed = self.weight.to(torch.float32) * (x * torch.rsqrt(variance + self.eps))
        return (normed * torch.sigmoid(gate.to(torch.float32))).to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
