"""The Mamba (v1) mixer of Jamba, as transformers' torch path computes it (JambaMambaMixer with its sequential
scan): in_proj splits the normed stream into the channels x and the gate z; a causal depthwise convolution
with SiLU runs over x; x_proj gives a low-rank time step and the input-dependent B and C, each through its own
RMSNorm (what Jamba adds to Mamba); dt_proj lifts the time step to one per channel, softplus(dt + bias); the
selective scan h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t, y_t = h_t C_t + D x_t runs one position at a time,
each channel with its own state [d_state]; y * silu(z) goes through out_proj.

Padding: as transformers, a padded position's input is zeroed before in_proj and its x after the convolution,
so it adds nothing to the state; with no projection biases a left-padded row computes what it computes alone.

Precision follows transformers: the time step in the model's dtype up to its softplus; the scan in float32
(the state float32, read by C after a cast to the model's dtype); in a multi-token forward y + D x and the
gating in float32, in a decode step in the model's dtype. Tensors are kept in transformers' layouts
([batch channel pos]) where its op order depends on them; the hooks see [batch pos ...].

Unlike transformers 5.24, a multi-token forward after a cached one starts its scan from the cached state
(transformers restarts it from zeros there, which is not the continuation of the sequence); prefill followed
by one-token steps, what generation does, is the same in both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import nn

from moelens.hooks.sites import site_hook
from moelens.models.components.norm import RMSNorm
from moelens.models.context import LayerInputs
from moelens.models.mixers.base import StateBytes, StateTensor, values_of
from moelens.models.mixers.recurrent_checks import check_cached_state, padding_multiplier
from moelens.models.terms import ParamTerm, depthwise_conv, linear, under
from moelens.state import RecurrentState


@dataclass(frozen=True)
class Mamba1Config:
    """The sizes a Mamba1Mixer reads; any object with these attributes will do (a family's MoeConfig)."""

    d_model: int
    mamba_d_inner: int
    mamba_d_state: int
    mamba_d_conv: int
    mamba_dt_rank: int
    mamba_conv_bias: bool
    mamba_proj_bias: bool
    mamba_norm_eps: float


def selective_scan(
    x: Float[torch.Tensor, "batch channel pos"],
    dt: Float[torch.Tensor, "batch channel pos"],
    A: Float[torch.Tensor, "channel d_state"],
    B: Float[torch.Tensor, "batch pos d_state"],
    C: Float[torch.Tensor, "batch pos d_state"],
    initial: Float[torch.Tensor, "batch channel d_state"],
) -> tuple[Float[torch.Tensor, "batch channel pos"], Float[torch.Tensor, "batch channel d_state"]]:
    """The state read by C at each position (without the D skip), and the state after the last one, in
    transformers' order: the whole sequence's decays and inputs first (float32), then one position at a time."""
    dtype = x.dtype
    decay = torch.exp(A[None, :, None, :] * dt[:, :, :, None])  # [b d t n]
    update = dt[:, :, :, None] * B[:, None, :, :].float() * x[:, :, :, None].float()
    state = initial
    outs = []
    for t in range(x.shape[-1]):
        state = decay[:, :, t] * state + update[:, :, t]
        outs.append(torch.matmul(state.to(dtype), C[:, t, :].unsqueeze(-1))[:, :, 0])
    return torch.stack(outs, dim=-1), state


def selective_step(
    x: Float[torch.Tensor, "batch channel"],
    dt: Float[torch.Tensor, "batch channel"],
    A: Float[torch.Tensor, "channel d_state"],
    B: Float[torch.Tensor, "batch d_state"],
    C: Float[torch.Tensor, "batch d_state"],
    state: Float[torch.Tensor, "batch channel d_state"],
) -> tuple[Float[torch.Tensor, "batch channel"], Float[torch.Tensor, "batch channel d_state"]]:
    """One position of the scan (transformers' decode step): the update in float32, the new state read by C in
    C's dtype. Returns (the read-out, without the D skip; the new state)."""
    decay = torch.exp(dt.float()[..., None] * A.float())
    update = dt.float()[..., None] * B.float()[:, None, :] * x.float()[..., None]
    new_state = state.float() * decay + update
    return torch.matmul(new_state.to(C.dtype), C.unsqueeze(-1)).squeeze(-1), new_state


class Mamba1Mixer(nn.Module):
    """Mamba-1 with Jamba's time-step, B and C norms as a token mixer (moelens.models.mixers.base.Mixer).
    Parameters carry transformers' names (in_proj, conv1d, x_proj, dt_proj, A_log, D, dt_layernorm,
    b_layernorm, c_layernorm, out_proj).

    A forward of several positions runs the sequential scan from the cached state and convolution window
    (zeros without a cache); a one-position forward after a cached one runs the decode step, as transformers
    does. hook_state_in holds the state the forward starts from (an edit changes this forward and the later
    ones); hook_state_out the state after the last position, what the cache keeps (an edit changes later
    forwards only)."""

    block_attribute: ClassVar[str] = "mixer"

    @classmethod
    def param_terms(cls, cfg: Mamba1Config, layer: int) -> tuple[ParamTerm, ...]:
        """All "attention" (the token mixer's)."""
        d, n, r = cfg.mamba_d_inner, cfg.mamba_d_state, cfg.mamba_dt_rank
        return (linear("in_proj", cfg.d_model, 2 * d, cfg.mamba_proj_bias, "attention")
                + depthwise_conv("conv1d", d, cfg.mamba_d_conv, cfg.mamba_conv_bias, "attention")
                + linear("x_proj", d, r + 2 * n, False, "attention")
                + linear("dt_proj", r, d, True, "attention")
                + (ParamTerm("A_log", (d, n), "attention"), ParamTerm("D", (d,), "attention"))
                + under("dt_layernorm", RMSNorm.param_terms(r, "attention"))
                + under("b_layernorm", RMSNorm.param_terms(n, "attention"))
                + under("c_layernorm", RMSNorm.param_terms(n, "attention"))
                + linear("out_proj", d, cfg.d_model, cfg.mamba_proj_bias, "attention"))

    def __init__(self, cfg: Mamba1Config, layer: int) -> None:
        super().__init__()
        self.layer = layer
        d, n, r = cfg.mamba_d_inner, cfg.mamba_d_state, cfg.mamba_dt_rank
        self.d_inner, self.d_state, self.dt_rank, self.d_conv = d, n, r, cfg.mamba_d_conv
        self.in_proj = nn.Linear(cfg.d_model, 2 * d, bias=cfg.mamba_proj_bias)
        self.conv1d = nn.Conv1d(d, d, self.d_conv, groups=d, bias=cfg.mamba_conv_bias)
        self.x_proj = nn.Linear(d, r + 2 * n, bias=False)
        self.dt_proj = nn.Linear(r, d, bias=True)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, n + 1, dtype=torch.float32)).expand(d, n).clone())
        self.D = nn.Parameter(torch.ones(d))
        self.dt_layernorm = RMSNorm(r, cfg.mamba_norm_eps, hooked=False)
        self.b_layernorm = RMSNorm(n, cfg.mamba_norm_eps, hooked=False)
        self.c_layernorm = RMSNorm(n, cfg.mamba_norm_eps, hooked=False)
        self.out_proj = nn.Linear(d, cfg.d_model, bias=cfg.mamba_proj_bias)
        self.hook_gate = site_hook("blocks.L.mixer.hook_gate", "mamba")
        self.hook_x = site_hook("blocks.L.mixer.hook_x", "mamba")
        self.hook_dt_low_rank = site_hook("blocks.L.mixer.hook_dt_low_rank")
        self.hook_B = site_hook("blocks.L.mixer.hook_B", "mamba")
        self.hook_C = site_hook("blocks.L.mixer.hook_C", "mamba")
        self.hook_dt = site_hook("blocks.L.mixer.hook_dt", "mamba")
        self.hook_state_in = site_hook("blocks.L.mixer.hook_state_in", "mamba")
        self.hook_y = site_hook("blocks.L.mixer.hook_y", "mamba")
        self.hook_state_out = site_hook("blocks.L.mixer.hook_state_out", "mamba")
        self.hook_z = site_hook("blocks.L.mixer.hook_z", "mamba")

    def new_state(self, reserve: int = 0) -> RecurrentState:
        return RecurrentState()  # fixed size: nothing to reserve

    def input_projections(self) -> list[nn.Linear]:
        return [self.in_proj]

    @classmethod
    def state_tensors(cls, cfg: Mamba1Config) -> tuple[StateTensor, ...]:
        """Per sequence: the convolution window [d_inner d_conv] (the model's dtype) and the recurrent state
        [d_inner d_state], float32 whatever the model's dtype (as the scan leaves it)."""
        return (
            StateTensor("conv", cfg.mamba_d_inner * cfg.mamba_d_conv, "sequence"),
            StateTensor("recurrent", cfg.mamba_d_inner * cfg.mamba_d_state, "sequence", torch.float32),
        )

    @classmethod
    def state_bytes(cls, cfg: Mamba1Config) -> StateBytes:
        return values_of(cls.state_tensors(cfg))

    def forward(
        self, x: Float[torch.Tensor, "batch pos d_model"], inputs: LayerInputs
    ) -> Float[torch.Tensor, "batch pos d_model"]:
        b, t, _ = x.shape
        d, n = self.d_inner, self.d_state
        dtype = x.dtype
        state = inputs.state
        if state is not None and not isinstance(state, RecurrentState):
            raise TypeError(f"Mamba1Mixer (layer {self.layer}): inputs.state is a {type(state).__name__}, expected a "
                            "RecurrentState (mixer.new_state())")
        cached = state is not None and state.recurrent is not None
        if cached:
            check_cached_state("Mamba1Mixer", self.layer, state, x.device, self._state_shapes(b))
        mask = padding_multiplier("Mamba1Mixer", self.layer, inputs.mask, b, t, dtype)

        if mask is not None:
            x = x * mask
        xs, z = self.in_proj(x).transpose(1, 2).chunk(2, dim=1)  # [b d t] each, transformers' layout
        z = self.hook_gate(z.transpose(1, 2)).transpose(1, 2)

        xs, window = self._convolve(xs, state.conv if cached else None, state is not None)
        if mask is not None:
            xs = xs * mask
        xs = self.hook_x(xs)  # [b t d]
        dt, B, C = self.x_proj(xs).split([self.dt_rank, n, n], dim=-1)
        dt = self.hook_dt_low_rank(self.dt_layernorm(dt))
        B = self.hook_B(self.b_layernorm(B))
        C = self.hook_C(self.c_layernorm(C))
        dt = self.dt_proj.weight @ dt.transpose(1, 2)  # [b d t]: transformers' product, not F.linear's
        dt = F.softplus(dt + self.dt_proj.bias.float().to(dt.dtype)[:, None])
        dt = self.hook_dt(dt.transpose(1, 2)).transpose(1, 2)

        if cached:  # a hook editing in place must not edit the cache's tensor (snapshots hold it)
            start = state.recurrent.clone() if self.hook_state_in.has_hooks else state.recurrent
        else:
            start = torch.zeros(b, d, n, dtype=torch.float32, device=x.device)
        start = self.hook_state_in(start)
        A = -torch.exp(self.A_log.float())
        x_ch = xs.transpose(1, 2)  # [b d t]
        if cached and t == 1:
            read, end = selective_step(x_ch[..., 0], dt[..., 0], A, B[:, 0], C[:, 0], start)
            y = (read + x_ch[..., 0] * self.D)[..., None]  # D in the model's dtype here, as transformers
        else:
            read, end = selective_scan(x_ch, dt, A, B, C, start)
            y = read + x_ch * self.D.float()[None, :, None]
        y = self.hook_y(y.transpose(1, 2)).transpose(1, 2)
        end = self.hook_state_out(end)
        if state is not None:
            state.update(window, end, t)

        gated = (y * F.silu(z)).to(dtype)
        gated = self.hook_z(gated.transpose(1, 2))
        return self.out_proj(gated)

    def _convolve(
        self, xs: Float[torch.Tensor, "batch channel pos"], window: Float[torch.Tensor, "batch channel d_conv"] | None,
        caching: bool,
    ) -> tuple[Float[torch.Tensor, "batch pos channel"], Float[torch.Tensor, "batch channel d_conv"]]:
        """SiLU of the causal depthwise convolution of the new positions after the cached window (zeros without
        one), and the window to cache: the last d_conv inputs. Fed as transformers feeds it (a first cached
        forward shorter than the kernel padded to it, the window concatenated in front, a decode step unpadded):
        the convolution's float32 rounding depends on the input's length."""
        k, t = self.d_conv, xs.shape[-1]
        if window is not None:
            fed = torch.cat([window, xs], dim=-1)
        else:
            fed = F.pad(xs, (k - t, 0)) if caching and t < k else xs
        padding = 0 if window is not None and t == 1 else k - 1
        weight = self.conv1d.weight
        out = F.conv1d(fed.to(weight.dtype), weight, self.conv1d.bias, padding=padding, groups=self.d_inner)
        out = F.silu(out[..., : fed.shape[-1]][..., -t:]).to(xs.dtype)
        seen = fed if fed.shape[-1] >= k else F.pad(fed, (k - fed.shape[-1], 0))
        return out.transpose(1, 2), seen[..., -k:].contiguous()

    def _state_shapes(self, batch: int) -> dict[str, tuple[int, ...]]:
        return {"conv": (batch, self.d_inner, self.d_conv), "recurrent": (batch, self.d_inner, self.d_state)}

    def extra_repr(self) -> str:
        return f"d_inner={self.d_inner}, d_state={self.d_state}, dt_rank={self.dt_rank}, d_conv={self.d_conv}"
