"""The short causal depthwise convolution with SiLU that linear-attention mixers run over their q | k | v channels
(Gated DeltaNet, Kimi Delta Attention), with the window of past inputs a cache keeps for the next forward."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Float


def silu_causal_conv(
    weight: Float[torch.Tensor, "channels 1 kernel"],
    new: Float[torch.Tensor, "batch channels pos"],
    window: Float[torch.Tensor, "batch channels kernel"] | None,
    caching: bool,
) -> tuple[Float[torch.Tensor, "batch channels pos"], Float[torch.Tensor, "batch channels kernel"] | None]:
    """SiLU of the causal depthwise convolution of the new inputs, preceded by the cached window's inputs (or
    zeros), and with `caching` the window to cache: the last `kernel` inputs, zeros where there were fewer.

    Computed as transformers does in each case (a decode step, a forward with a cache, one without): the sums
    are the same, but SiLU rounds its last bit by where an element falls in memory. The convolution runs in the
    weight's dtype; the output is cast back to the input's."""
    channels, n_pos, kernel = weight.shape[0], new.shape[-1], weight.shape[-1]
    if window is not None and n_pos == 1:  # a decode step: the window and the token, unpadded
        seen = torch.cat([window, new], dim=-1)
        out = F.silu(F.conv1d(seen.to(weight.dtype), weight, groups=channels)[..., -1:])
    elif not caching:
        seen = None
        out = F.silu(F.conv1d(new.to(weight.dtype), weight, padding=kernel - 1, groups=channels)[..., :n_pos])
    else:
        if window is not None:
            seen = torch.cat([window, new], dim=-1)
        else:
            seen = F.pad(new, (kernel - n_pos, 0)) if n_pos < kernel else new
        out = F.conv1d(seen.to(weight.dtype), weight, padding=kernel - 1, groups=channels)
        out = F.silu(out[..., : seen.shape[-1]])[..., -n_pos:]
    # a copy: a view would keep the whole input alive in the cache
    kept = None if seen is None else seen[..., -kernel:].clone(memory_format=torch.contiguous_format)
    return out.to(new.dtype), kept
