"""LayerNorm with a weight and a bias: plain (DeepSeek Sparse Attention's indexer keys), or hooked as a block's
norm (Phi-3.5-MoE); and hooked without a bias (DBRX). Each centres its input, which an RMSNorm does not: the
analyses that divide a stack of components by the cached scale refuse them (moelens.cache_analysis)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from typing import ClassVar

from jaxtyping import Float
from torch import nn

from moelens.hooks.sites import site_hook

from moelens.models.terms import ParamTerm, vector


class LayerNorm(nn.Module):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last dim: torch's layer_norm, as transformers'
    nn.LayerNorm computes it (in the input's dtype)."""

    centres: ClassVar[bool] = True  # subtracts the mean (RMSNorm: False)

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


class HookedLayerNorm(LayerNorm):
    """A block's or the final LayerNorm (Phi-3.5-MoE), with RMSNorm's hooks: hook_scale holds sqrt(var + eps)
    and the norm divides the centred input by what it holds; hook_normalized its output (bias included).
    Its value is torch's layer_norm, as transformers' nn.LayerNorm, bit for bit, wherever the scale is the
    computed one (hooked or not: caching hook_scale changes nothing); where a hook changed it, the centring,
    division, weight and bias run in float32 and are cast back once. The gradient is that of the float32
    formula throughout, so it reaches hook_scale."""

    def __init__(self, d: int, eps: float, hooked: bool = True, site: str = "ln_final") -> None:
        super().__init__(d, eps)
        self.hooked = hooked
        if hooked:
            self.hook_scale = site_hook(f"{site}.hook_scale")
            self.hook_normalized = site_hook(f"{site}.hook_normalized")

    def unhooked(self, x: Float[torch.Tensor, "... d"]) -> Float[torch.Tensor, "... d"]:
        """The norm's value where no hook changed the scale: torch's layer_norm (a subclass whose reference
        orders the ops otherwise gives its own, so that it matches that reference bit for bit)."""
        return LayerNorm.forward(self, x)

    def forward(self, x: Float[torch.Tensor, "... d"]) -> Float[torch.Tensor, "... d"]:
        if not self.hooked:
            return self.unhooked(x)
        if not self.hook_scale.has_hooks:
            return self.hook_normalized(self.unhooked(x))
        x32 = x.float()
        centred = x32 - x32.mean(-1, keepdim=True)
        computed = torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + self.eps)
        scale = self.hook_scale(computed.clone())  # its own tensor: an in-place edit shows against `computed`
        formula = centred / scale * self.weight.float()
        formula = (formula if self.bias is None else formula + self.bias.float()).to(x.dtype)
        with torch.no_grad():
            value = torch.where(scale == computed, self.unhooked(x), formula)
        return self.hook_normalized(_ValueWithGradOf.apply(formula, value))

    def effective_weight(self) -> Float[torch.Tensor, " d"]:
        """The per-dimension factor applied to the normed input (the bias is added after it)."""
        return self.weight

    @torch.no_grad()
    def make_identity(self) -> None:
        self.weight.fill_(1.0)


class BiasFreeLayerNorm(HookedLayerNorm):
    """A block's or the final LayerNorm with a weight and no bias (DBRX: transformers' nn.LayerNorm(d,
    bias=False), eps 1e-5): (x - mean) / sqrt(var + eps) * weight, with HookedLayerNorm's hooks. Without a bias,
    fold_ln folds its weight into the readers as an RMSNorm's; it still centres its input."""

    @staticmethod
    def param_terms(d: int, component: str = "norms") -> tuple[ParamTerm, ...]:
        return vector("weight", d, component)

    def __init__(self, d: int, eps: float, hooked: bool = True, site: str = "ln_final") -> None:
        super().__init__(d, eps, hooked, site)
        self.bias = None  # F.layer_norm adds none


class _ValueWithGradOf(torch.autograd.Function):
    """Forward: `value`; backward: the gradient flows to `formula` (the same function up to rounding)."""

    @staticmethod
    def forward(ctx, formula: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return value.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None
