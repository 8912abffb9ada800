"""RMSNorm with a hook on its scale and on its output."""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import nn

from moelens.hooks import HookPoint


class RMSNorm(nn.Module):
    """weight * x / sqrt(mean(x^2) + eps), computed in float32 and cast back before the weight (as HF does)."""

    def __init__(self, d: int, eps: float, hooked: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps
        self.hooked = hooked
        if hooked:
            self.hook_scale = HookPoint("batch pos 1", "RMS of the input")
            self.hook_normalized = HookPoint("batch pos d_model", "the norm's output")

    def forward(self, x: Float[torch.Tensor, "... d"]) -> Float[torch.Tensor, "... d"]:
        dtype = x.dtype
        x = x.float()
        variance = x.pow(2).mean(-1, keepdim=True)
        if not self.hooked:
            return self.weight * (x * torch.rsqrt(variance + self.eps)).to(dtype)
        rms = torch.sqrt(variance + self.eps)
        scale = self.hook_scale(rms)
        # x * rsqrt(...) is what the reference computes; it differs from x / rms in the last bit, so keep it
        # unless a hook replaced the scale.
        inv = torch.rsqrt(variance + self.eps) if scale is rms else scale.reciprocal()
        return self.hook_normalized(self.weight * (x * inv).to(dtype))

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
