"""RMSNorm with a hook on its scale and on its output."""

from __future__ import annotations

from typing import ClassVar

import torch
from jaxtyping import Float
from torch import nn

from moelens.hooks.sites import site_hook
from moelens.models.terms import ParamTerm, kept_float32, vector


class RMSNorm(nn.Module):
    """weight * x / sqrt(mean(x^2) + eps), computed in float32 and cast back before the weight (as HF does).

    hook_scale holds sqrt(mean(x^2) + eps) and the norm divides by what it holds (a hook that edits or
    replaces it changes the output; its gradient flows). Where the scale is the computed one, the output
    is the reference's x * rsqrt(...) bit for bit (x / scale differs from it in the last bit).
    """

    float32_weight: ClassVar[bool] = False  # kept float32 whatever the model's dtype (HookedTransformer.build)
    centres: ClassVar[bool] = False  # subtracts no mean (a LayerNorm does)

    @classmethod
    def param_terms(cls, d: int, component: str = "norms") -> tuple[ParamTerm, ...]:
        return kept_float32(vector("weight", d, component), cls.float32_weight)

    def __init__(self, d: int, eps: float, hooked: bool = True, site: str = "ln_final") -> None:
        """site: the norm's name in the table of hook sites (blocks.L.ln1, blocks.L.ln2, ln_final), for its hooks."""
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps
        self.hooked = hooked
        if hooked:
            self.hook_scale = site_hook(f"{site}.hook_scale")
            self.hook_normalized = site_hook(f"{site}.hook_normalized")

    def forward(self, x: Float[torch.Tensor, "... d"]) -> Float[torch.Tensor, "... d"]:
        dtype = x.dtype
        x = x.float()
        variance = x.pow(2).mean(-1, keepdim=True)
        if not self.hooked:
            return self.apply_weight(x * torch.rsqrt(variance + self.eps), dtype)
        if not self.hook_scale.has_hooks:
            return self.hook_normalized(self.apply_weight(x * torch.rsqrt(variance + self.eps), dtype))
        scale = self.hook_scale(torch.sqrt(variance + self.eps))
        return self.hook_normalized(self.apply_weight(x * _inverse(scale, variance, self.eps), dtype))

    def apply_weight(self, normed: Float[torch.Tensor, "... d"], dtype: torch.dtype) -> Float[torch.Tensor, "... d"]:
        """The float32 normed input, back in the input's dtype, times the weight (Llama's order)."""
        return self.weight * normed.to(dtype)

    def effective_weight(self) -> Float[torch.Tensor, " d"]:
        """The per-dimension factor the norm multiplies the normed input by (what fold_ln moves into the
        weights that read it; the cache's analyses apply it): here the weight itself."""
        return self.weight

    @torch.no_grad()
    def make_identity(self) -> None:
        """Set the weight so the effective factor is 1 (after fold_ln moved it into the readers)."""
        self.weight.fill_(1.0)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class ZeroCenteredRMSNorm(RMSNorm):
    """(1 + weight) applied to the float32 normed input, then cast back (Qwen3-Next, Qwen3.5): the stored weight
    is centred on zero, so fold_ln and the analyses read effective_weight(), never the raw weight."""

    def __init__(self, d: int, eps: float, hooked: bool = True, site: str = "ln_final") -> None:
        super().__init__(d, eps, hooked, site)
        nn.init.zeros_(self.weight)

    def apply_weight(self, normed: Float[torch.Tensor, "... d"], dtype: torch.dtype) -> Float[torch.Tensor, "... d"]:
        return (normed * (1.0 + self.weight.float())).to(dtype)

    def effective_weight(self) -> Float[torch.Tensor, " d"]:
        return 1.0 + self.weight

    @torch.no_grad()
    def make_identity(self) -> None:
        self.weight.zero_()


class CastAfterWeightRMSNorm(RMSNorm):
    """The weight applied to the float32 normed input, then the cast back to the input's dtype (gpt-oss):
    in bfloat16 the product rounds once, where Llama's order rounds before and after the weight."""

    def apply_weight(self, normed: Float[torch.Tensor, "... d"], dtype: torch.dtype) -> Float[torch.Tensor, "... d"]:
        return (self.weight * normed).to(dtype)


def _inverse(scale: torch.Tensor, variance: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / scale, where an element still equal to the computed sqrt(variance + eps) takes the reference's
    rsqrt(variance + eps) instead; the gradient is that of 1 / scale with respect to scale throughout."""
    with torch.no_grad():
        computed = torch.sqrt(variance + eps)
        value = torch.where(scale == computed, torch.rsqrt(variance + eps), scale.reciprocal())
    return _ValueWithReciprocalGrad.apply(scale, value)


class _ValueWithReciprocalGrad(torch.autograd.Function):
    """Forward: `value` (1 / scale up to the last bit); backward: d(1 / scale) / d scale = -1 / scale^2."""

    @staticmethod
    def forward(ctx, scale: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(scale)
        return value.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (scale,) = ctx.saved_tensors
        return -grad / scale.square(), None
