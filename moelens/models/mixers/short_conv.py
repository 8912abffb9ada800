"""LFM2's gated short convolution (transformers' Lfm2MoeShortConv) as a token mixer: in_proj splits the normed
stream into three gates of d_model channels each, B, C and x (in that order); the input gate B multiplies x;
a causal depthwise convolution over the last conv_L_cache positions mixes B * x along the sequence (no
activation); the output gate C multiplies the result; out_proj maps it back to the stream.

    B, C, x = in_proj(h)            y = C * conv(B * x)            out = out_proj(y)

Its state is the convolution window: B * x at the last conv_L_cache positions (transformers' conv cache keeps
as many, one more than the kernel reads), so a decode step convolves the window and its new position.

Padding: as transformers does, a padded position's input is zeroed before in_proj, so without projection
biases its B * x is zero and a left-padded row computes what it computes alone. The mask is applied whenever
inputs.mask is given.

Precision follows transformers: the convolution runs in its weight's dtype and comes back in the stream's; the
gates multiply in the stream's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import nn

from moelens.hooks.sites import site_hook
from moelens.models.context import LayerInputs
from moelens.models.mixers.base import StateBytes, StateTensor, values_of
from moelens.models.mixers.recurrent_checks import padding_multiplier
from moelens.models.terms import ParamTerm, depthwise_conv, linear
from moelens.state import ConvWindowState


@dataclass(frozen=True)
class ShortConvConfig:
    """The sizes a ShortConvMixer reads (any object with these attributes will do: a MoeConfig subclass of a
    family). conv_kernel is LFM2's conv_L_cache; conv_bias puts biases on in_proj, the convolution and out_proj
    alike (transformers' conv_bias)."""

    d_model: int
    conv_kernel: int
    conv_bias: bool


class ShortConvMixer(nn.Module):
    """The gated short convolution as a token mixer (moelens.models.mixers.base.Mixer). Parameters carry
    transformers' names (in_proj, conv, out_proj), so a family's site map maps checkpoint keys one to one.

    Sites, in forward order: hook_x, hook_B, hook_C (in_proj's three thirds), hook_conv_in (B * x, what the
    convolution reads and its window caches), hook_conv_out (the convolution's output), hook_y (C times it:
    out_proj's input). An edit of hook_conv_in reaches the cached window, so later forwards see it too."""

    block_attribute: ClassVar[str] = "mixer"

    @classmethod
    def param_terms(cls, cfg: ShortConvConfig, layer: int) -> tuple[ParamTerm, ...]:
        """All "attention" (the token mixer's)."""
        d = cfg.d_model
        return (linear("in_proj", d, 3 * d, cfg.conv_bias, "attention")
                + depthwise_conv("conv", d, cfg.conv_kernel, cfg.conv_bias, "attention")
                + linear("out_proj", d, d, cfg.conv_bias, "attention"))

    def __init__(self, cfg: ShortConvConfig, layer: int) -> None:
        super().__init__()
        if cfg.conv_kernel < 1:
            raise ValueError(f"ShortConvMixer (layer {layer}): conv_L_cache = {cfg.conv_kernel}; the kernel needs at least 1 position")
        self.layer = layer
        self.d_model, self.kernel = cfg.d_model, cfg.conv_kernel
        d = cfg.d_model
        self.in_proj = nn.Linear(d, 3 * d, bias=cfg.conv_bias)
        self.conv = nn.Conv1d(d, d, cfg.conv_kernel, groups=d, bias=cfg.conv_bias)
        self.out_proj = nn.Linear(d, d, bias=cfg.conv_bias)
        self.hook_x = site_hook("blocks.L.mixer.hook_x", "short_conv")
        self.hook_B = site_hook("blocks.L.mixer.hook_B", "short_conv")
        self.hook_C = site_hook("blocks.L.mixer.hook_C", "short_conv")
        self.hook_conv_in = site_hook("blocks.L.mixer.hook_conv_in")
        self.hook_conv_out = site_hook("blocks.L.mixer.hook_conv_out")
        self.hook_y = site_hook("blocks.L.mixer.hook_y", "short_conv")

    def new_state(self, reserve: int = 0) -> ConvWindowState:
        return ConvWindowState()  # fixed size: nothing to reserve

    def input_projections(self) -> list[nn.Linear]:
        return [self.in_proj]

    @classmethod
    def state_tensors(cls, cfg: ShortConvConfig) -> tuple[StateTensor, ...]:
        """Per sequence: the convolution window, d_model channels by conv_L_cache positions, in the model's dtype."""
        return (StateTensor("conv", cfg.d_model * cfg.conv_kernel, "sequence"),)

    @classmethod
    def state_bytes(cls, cfg: ShortConvConfig) -> StateBytes:
        return values_of(cls.state_tensors(cfg))

    def forward(
        self, x: Float[torch.Tensor, "batch pos d_model"], inputs: LayerInputs
    ) -> Float[torch.Tensor, "batch pos d_model"]:
        b, t, _ = x.shape
        state = inputs.state
        if state is not None and not isinstance(state, ConvWindowState):
            raise TypeError(f"ShortConvMixer (layer {self.layer}): inputs.state is a {type(state).__name__}, expected "
                            "a ConvWindowState (mixer.new_state())")
        window = None if state is None else state.conv
        if window is not None:
            self._check_window(window, b, x.device)
        if inputs.mask is not None:
            x = x * padding_multiplier("ShortConvMixer", self.layer, inputs.mask, b, t, x.dtype)
        B, C, xs = self.in_proj(x).chunk(3, dim=-1)
        xs, B, C = self.hook_x(xs), self.hook_B(B), self.hook_C(C)  # the table's order
        gated = self.hook_conv_in(B * xs)
        convolved, seen = self._convolve(gated.transpose(1, 2), window, state is not None)
        convolved = self.hook_conv_out(convolved)
        if state is not None:
            state.update(seen, t)
        y = self.hook_y(C * convolved)
        return self.out_proj(y)

    def _convolve(
        self, gated: Float[torch.Tensor, "batch d_model pos"], window: Float[torch.Tensor, "batch d_model kernel"] | None,
        caching: bool,
    ) -> tuple[Float[torch.Tensor, "batch pos d_model"], Float[torch.Tensor, "batch d_model kernel"]]:
        """The causal depthwise convolution of the new positions, preceded by the cached window (zeros without
        one); and the window to cache: the last `kernel` inputs. Fed as transformers feeds it (the window
        concatenated in front, a first cached forward shorter than the kernel zero-padded to it; padded by the
        convolution, except a decode step's): the convolution's algorithm, and so its rounding, depends on the
        input's length."""
        k, t = self.kernel, gated.shape[-1]
        if window is not None:
            fed = torch.cat([window, gated], dim=-1)
        else:
            fed = F.pad(gated, (k - t, 0)) if caching and t < k else gated
        padding = 0 if window is not None and t == 1 else k - 1
        weight = self.conv.weight
        out = F.conv1d(fed.to(weight.dtype), weight, self.conv.bias, padding=padding, groups=self.d_model)
        out = out[..., : fed.shape[-1]][..., -t:].to(gated.dtype)
        seen = fed if fed.shape[-1] >= k else F.pad(fed, (k - fed.shape[-1], 0))
        return out.transpose(1, 2), seen[..., -k:].contiguous()

    def _check_window(self, window: torch.Tensor, batch: int, device: torch.device) -> None:
        expected = (batch, self.d_model, self.kernel)
        if tuple(window.shape) != expected:
            raise ValueError(f"ShortConvMixer (layer {self.layer}): cached state.conv has shape {tuple(window.shape)}, "
                             f"expected {expected} for a batch of {batch}")
        if window.device != device:
            raise ValueError(f"ShortConvMixer (layer {self.layer}): cached state.conv is on {window.device}, the input "
                             f"on {device}")

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, kernel={self.kernel}"
