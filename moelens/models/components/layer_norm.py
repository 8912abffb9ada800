"""LayerNorm with a weight and a bias (the norm kind of DeepSeek Sparse Attention's indexer keys)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import nn

from moelens.models.terms import ParamTerm, vector


class LayerNorm(nn.Module):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last dim: torch's layer_norm, as transformers'
    nn.LayerNorm computes it (in the input's dtype)."""

    @staticmethod
    def param_terms(d: int, component: str = "norms") -> tuple[ParamTerm, ...]:
        return vector("weight", d, component) + vector("bias", d, component)

    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))
        self.eps = eps

    def forward(self, x: Float[torch.Tensor, "... d"]) -> Float[torch.Tensor, "... d"]:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
