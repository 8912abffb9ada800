"""The Mamba-2 mixer of Nemotron-H (and, with other config names, Granite-4.0's hybrid layers), as transformers'
torch path computes it (NemotronHMamba2Mixer / GraniteMoeHybridMambaLayer): in_proj splits the normed stream
into the gate z, the convolved channels x | B | C and the time step dt; a causal depthwise convolution with
SiLU runs over x | B | C; the selective state-space scan (chunked SSD for a multi-token forward, the
one-step recurrence for a decode step) with the D skip gives y; a grouped gated RMSNorm and out_proj give the
output.

Padding: a recurrent mixer cannot ignore a position, so, as transformers does, a padded position's input is
zeroed before in_proj and its x, B and C are zeroed after the convolution: it adds nothing to the state
(dt still decays it, which before a left-padded row's first real token is a decay of zeros), and, without
projection biases, a left-padded row computes what it computes alone. Its outputs are meaningless. The mask is
applied whenever inputs.mask is given, a one-position forward included (transformers' model passes none there).

Precision follows transformers: dt (softplus, clamp) in the model's dtype; the chunked scan in float32, its
y float32 into the gated norm; the decode step's update in the model's dtype where transformers keeps it
there (dt * B * x, the state cast to the model's dtype before it meets C), its y in the model's dtype. The
recurrent state is float32 in either form.
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
from moelens.models.mixers.recurrent_checks import check_cached_state, padding_multiplier
from moelens.models.terms import ParamTerm, depthwise_conv, linear, under, vector
from moelens.state import RecurrentState


@dataclass(frozen=True)
class Mamba2Config:
    """The sizes a Mamba2Mixer reads. Any object with these attributes will do (a MoeConfig subclass of a
    family); the names are Granite-4.0's config names where it has one.

    time_step_limit clamps dt in the chunked form, decode_time_step_limit in the one-step recurrence: they are
    a family's reference's values, which need not agree. transformers 5.24's nemotron_h clamps the chunked
    form to (time_step_min, inf) and the decode step not at all, (0, inf) (NVIDIA's own code reads
    config.time_step_limit, [0, inf], for both); granitemoehybrid uses config.time_step_limit in the chunked
    form and no clamp in the decode step. Where the two differ and the clamp bites, a prefill followed by
    decode steps is not the whole sequence's forward (as in the reference)."""

    d_model: int
    mamba_n_heads: int
    mamba_d_head: int
    mamba_n_groups: int
    mamba_d_state: int
    mamba_d_conv: int
    mamba_chunk_size: int
    mamba_conv_bias: bool
    mamba_proj_bias: bool
    mamba_norm_eps: float
    mamba_time_step_limit: tuple[float, float]
    mamba_decode_time_step_limit: tuple[float, float]


class GroupedGatedRMSNorm(nn.Module):
    """weight * RMSNorm(y * silu(z)) with the norm taken over each of n_groups equal slices of the channels
    (Mamba-2's norm_before_gate=False), computed in float32; the result comes back in y's dtype before the
    weight multiplies it (transformers' NemotronHRMSNormGated), so the product is in the wider of the two."""

    @staticmethod
    def param_terms(d: int, component: str) -> tuple[ParamTerm, ...]:
        return vector("weight", d, component)

    def __init__(self, d: int, n_groups: int, eps: float) -> None:
        super().__init__()
        if d % n_groups:
            raise ValueError(f"GroupedGatedRMSNorm: {d} channels do not split into {n_groups} equal groups")
        self.weight = nn.Parameter(torch.ones(d))
        self.n_groups = n_groups
        self.eps = eps

    def forward(
        self, y: Float[torch.Tensor, "... d"], gate: Float[torch.Tensor, "... d"]
    ) -> Float[torch.Tensor, "... d"]:
        gated = y.float() * F.silu(gate.float())
        grouped = gated.unflatten(-1, (self.n_groups, -1))
        variance = grouped.pow(2).mean(-1, keepdim=True)
        normed = (grouped * torch.rsqrt(variance + self.eps)).flatten(-2)
        return self.weight * normed.to(y.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, groups={self.n_groups}, eps={self.eps}"


def segment_sum(a: Float[torch.Tensor, "... n"]) -> Float[torch.Tensor, "... n n"]:
    """out[..., i, j] = a[j+1] + ... + a[i] for j <= i (0 on the diagonal), -inf above it: log-decays from
    position j to position i. Summed by a masked cumulative sum rather than differences of one cumulative
    sum, which cancel badly (transformers' and mamba_ssm's form)."""
    n = a.shape[-1]
    ones = torch.ones(n, n, dtype=torch.bool, device=a.device)
    terms = a[..., :, None].expand(*a.shape, n).masked_fill(~ones.tril(-1), 0)  # [..., k, j] = a[k] for k > j
    return terms.cumsum(-2).masked_fill(~ones.tril(0), -torch.inf)


def chunked_scan(
    x: Float[torch.Tensor, "batch pos head d_head"],
    dt: Float[torch.Tensor, "batch pos head"],
    A: Float[torch.Tensor, "head"],
    B: Float[torch.Tensor, "batch pos group d_state"],
    C: Float[torch.Tensor, "batch pos group d_state"],
    D: Float[torch.Tensor, "head"],
    initial: Float[torch.Tensor, "batch head d_head d_state"],
    chunk: int,
) -> tuple[Float[torch.Tensor, "batch pos head d_head"], Float[torch.Tensor, "batch head d_head d_state"]]:
    """The state-space scan h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t + D x_t, from `initial`,
    by Mamba-2's chunked form (SSD) in float32: within a chunk as a masked attention-like product, across
    chunks through the states at the chunk boundaries. Returns (y, the state after the last position).

    Written in transformers' order, product by product and in its layouts (B and C repeated per head, the
    decay to a chunk's end applied to B): float32 sums in another order differ in the last bits, and later
    Mamba-2 layers amplify those bits (to 2e-5 in the stream after a few layers)."""
    b, t, h, p = x.shape
    n = B.shape[3]
    r = h // B.shape[2]
    pad = (-t) % chunk
    c = (t + pad) // chunk
    x = x.float()
    B = B.float().repeat_interleave(r, dim=2, output_size=h)  # [b t h n]
    C = C.float().repeat_interleave(r, dim=2, output_size=h)

    def chunks(u: torch.Tensor) -> torch.Tensor:  # [b t ...] -> [b c chunk ...], zero-padded at the end
        u = F.pad(u, (0, 0) * (u.dim() - 2) + (0, pad))
        return u.reshape(b, c, chunk, *u.shape[2:])

    skip = D[..., None] * F.pad(x, (0, 0, 0, 0, 0, pad))  # [b t+pad h p]
    x_dt = x * dt[..., None].float()
    log_decay = A.to(x_dt.dtype) * dt.float()  # [b t h]
    x_dt, log_decay, B, C = chunks(x_dt), chunks(log_decay), chunks(B), chunks(C)
    log_decay = log_decay.permute(0, 3, 1, 2)  # [b h c l]
    cum = log_decay.cumsum(-1)

    # within each chunk: y_l += sum_{s<=l} (C_l . B_s) exp(sum_{s<k<=l} dt_k A) dt_s x_s
    decay_within = torch.exp(segment_sum(log_decay))  # [b h c l s]
    scores = torch.einsum("bclhn,bcshn->bclsh", C, B)
    mixed = scores * decay_within.permute(0, 2, 3, 4, 1)
    y = torch.einsum("bclsh,bcshp->bclhp", mixed, x_dt)

    # each chunk's own contribution to the state at its end
    to_end = torch.exp(cum[:, :, :, -1:] - cum)  # [b h c l]
    B_to_end = B * to_end.permute(0, -2, -1, 1)[..., None]
    own = torch.einsum("bclhn,bclhp->bchpn", B_to_end, x_dt)
    own = torch.cat([initial[:, None].to(own.dtype), own], dim=1)  # [b c+1 h p n]
    # the state entering each chunk (and after the last): decayed sums of the earlier chunks' contributions
    across = torch.exp(segment_sum(F.pad(cum[:, :, :, -1], (1, 0)))).transpose(1, 3)  # [b z c+1 h]
    states = torch.einsum("bzch,bzhpn->bchpn", across, own)
    entering, final = states[:, :-1], states[:, -1].clone()  # clone: the cache must not hold all chunks' states

    # what the state entering each chunk gives its positions
    from_start = torch.exp(cum)  # [b h c l]
    y_entering = torch.einsum("bclhn,bchpn->bclhp", C, entering) * from_start.permute(0, 2, 3, 1)[..., None]
    y = (y + y_entering).contiguous().reshape(b, c * chunk, h, p) + skip
    return y[:, :t], final


def recurrent_step(
    x: Float[torch.Tensor, "batch head d_head"],
    dt: Float[torch.Tensor, "batch head"],
    A: Float[torch.Tensor, "head"],
    B: Float[torch.Tensor, "batch group d_state"],
    C: Float[torch.Tensor, "batch group d_state"],
    D: Float[torch.Tensor, "head"],
    state: Float[torch.Tensor, "batch head d_head d_state"],
) -> tuple[Float[torch.Tensor, "batch head d_head"], Float[torch.Tensor, "batch head d_head d_state"]]:
    """One position of the scan, in transformers' dtypes: the decay in float32, dt * B * x in x's dtype, the
    new state in the state's (float32), read by C after a cast to x's dtype. Returns (y, the new state)."""
    r = x.shape[1] // B.shape[1]
    decay = torch.exp(dt.float()[..., None, None] * A.float()[:, None, None])  # [b h 1 1]
    B, C = B.repeat_interleave(r, dim=1), C.repeat_interleave(r, dim=1)  # [b h n]
    new_state = state * decay + (dt[..., None] * B)[:, :, None, :] * x[..., None]
    y = torch.matmul(new_state.to(x.dtype), C[..., None]).squeeze(-1)
    return (y + x * D[:, None]).to(y.dtype), new_state


class Mamba2Mixer(nn.Module):
    """Mamba-2 as a token mixer (moelens.models.mixers.base.Mixer). Parameters carry transformers' names
    (in_proj, conv1d, dt_bias, A_log, D, norm, out_proj), so a family's site map maps checkpoint keys one
    to one.

    A forward of several positions runs the chunked form from the cached state and convolution window (zeros
    without a cache); a one-position forward after a cached one runs the recurrence, as transformers does.
    Either way hook_state_out holds the state after the last position, computed (and hookable) with or
    without a cache; it is what the cache keeps, so an edit there changes every later forward and not this
    one. hook_state_in holds the state the forward starts from (zeros before the first position); an edit
    changes this forward and, through it, the later ones. The convolution window is cached as it was fed
    (pre-convolution channels, the last mamba_d_conv positions), not hooked."""

    block_attribute: ClassVar[str] = "mixer"

    @classmethod
    def param_terms(cls, cfg: Mamba2Config, layer: int) -> tuple[ParamTerm, ...]:
        """All "attention" (the token mixer's)."""
        h, p, g, n = cfg.mamba_n_heads, cfg.mamba_d_head, cfg.mamba_n_groups, cfg.mamba_d_state
        conv_dim = h * p + 2 * g * n
        return (linear("in_proj", cfg.d_model, h * p + conv_dim + h, cfg.mamba_proj_bias, "attention")
                + depthwise_conv("conv1d", conv_dim, cfg.mamba_d_conv, cfg.mamba_conv_bias, "attention")
                + vector("dt_bias", h, "attention") + vector("A_log", h, "attention") + vector("D", h, "attention")
                + under("norm", GroupedGatedRMSNorm.param_terms(h * p, "attention"))
                + linear("out_proj", h * p, cfg.d_model, cfg.mamba_proj_bias, "attention"))

    def __init__(self, cfg: Mamba2Config, layer: int) -> None:
        super().__init__()
        self.layer = layer
        h, p, g, n = cfg.mamba_n_heads, cfg.mamba_d_head, cfg.mamba_n_groups, cfg.mamba_d_state
        if h % g:
            raise ValueError(f"Mamba2Mixer (layer {layer}): mamba_n_heads={h} is not a multiple of mamba_n_groups={g}")
        for field in ("mamba_time_step_limit", "mamba_decode_time_step_limit"):
            low, high = getattr(cfg, field)
            if not 0 <= low <= high:
                raise ValueError(f"Mamba2Mixer (layer {layer}): {field}={(low, high)} is not a range 0 <= min <= max")
        self.n_heads, self.d_head, self.n_groups, self.d_state = h, p, g, n
        self.d_conv, self.chunk_size = cfg.mamba_d_conv, cfg.mamba_chunk_size
        self.time_step_limit = tuple(cfg.mamba_time_step_limit)
        self.decode_time_step_limit = tuple(cfg.mamba_decode_time_step_limit)
        self.d_inner = h * p
        self.conv_dim = self.d_inner + 2 * g * n
        self.in_proj = nn.Linear(cfg.d_model, self.d_inner + self.conv_dim + h, bias=cfg.mamba_proj_bias)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, self.d_conv, groups=self.conv_dim, bias=cfg.mamba_conv_bias
        )
        self.dt_bias = nn.Parameter(torch.ones(h))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, h + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(h))
        self.norm = GroupedGatedRMSNorm(self.d_inner, g, cfg.mamba_norm_eps)
        self.out_proj = nn.Linear(self.d_inner, cfg.d_model, bias=cfg.mamba_proj_bias)
        self.hook_gate = site_hook("blocks.L.mixer.hook_gate", "mamba2")
        self.hook_x = site_hook("blocks.L.mixer.hook_x")
        self.hook_B = site_hook("blocks.L.mixer.hook_B")
        self.hook_C = site_hook("blocks.L.mixer.hook_C")
        self.hook_dt = site_hook("blocks.L.mixer.hook_dt")
        self.hook_state_in = site_hook("blocks.L.mixer.hook_state_in", "mamba2")
        self.hook_y = site_hook("blocks.L.mixer.hook_y")
        self.hook_state_out = site_hook("blocks.L.mixer.hook_state_out", "mamba2")
        self.hook_normed = site_hook("blocks.L.mixer.hook_normed")

    def new_state(self, reserve: int = 0) -> RecurrentState:
        return RecurrentState()  # fixed size: nothing to reserve

    def input_projections(self) -> list[nn.Linear]:
        return [self.in_proj]

    @classmethod
    def state_tensors(cls, cfg: Mamba2Config) -> tuple[StateTensor, ...]:
        """Per sequence: the convolution window (the model's dtype) and the recurrent state [head d_head
        d_state], float32 whatever the model's dtype (the scan's, kept as transformers' cache keeps it)."""
        h, p, g, n = cfg.mamba_n_heads, cfg.mamba_d_head, cfg.mamba_n_groups, cfg.mamba_d_state
        conv_dim = h * p + 2 * g * n
        return (
            StateTensor("conv", conv_dim * cfg.mamba_d_conv, "sequence"),
            StateTensor("recurrent", h * p * n, "sequence", torch.float32),
        )

    @classmethod
    def state_bytes(cls, cfg: Mamba2Config) -> StateBytes:
        return values_of(cls.state_tensors(cfg))

    def forward(
        self, x: Float[torch.Tensor, "batch pos d_model"], inputs: LayerInputs
    ) -> Float[torch.Tensor, "batch pos d_model"]:
        b, t, _ = x.shape
        h, p, g, n = self.n_heads, self.d_head, self.n_groups, self.d_state
        dtype = x.dtype
        state = inputs.state
        if state is not None and not isinstance(state, RecurrentState):
            raise TypeError(f"Mamba2Mixer (layer {self.layer}): inputs.state is a {type(state).__name__}, expected a "
                            "RecurrentState (mixer.new_state())")
        cached = state is not None and state.recurrent is not None
        if cached:
            check_cached_state("Mamba2Mixer", self.layer, state, x.device, self._state_shapes(b))
        mask = padding_multiplier("Mamba2Mixer", self.layer, inputs.mask, b, t, dtype)

        if mask is not None:
            x = x * mask
        z, xbc, dt = self.in_proj(x).split([self.d_inner, self.conv_dim, h], dim=-1)
        z = self.hook_gate(z.unflatten(-1, (h, p)))

        xbc, window = self._convolve(xbc.transpose(1, 2), state.conv if cached else None)
        if mask is not None:
            xbc = xbc * mask
        xs, B, C = xbc.split([self.d_inner, g * n, g * n], dim=-1)
        xs = self.hook_x(xs.unflatten(-1, (h, p)))
        B = self.hook_B(B.unflatten(-1, (g, n)))
        C = self.hook_C(C.unflatten(-1, (g, n)))

        step = cached and t == 1  # transformers' choice of form
        low, high = self.decode_time_step_limit if step else self.time_step_limit
        if step:
            # transformers' decode step takes the softplus over [batch, head, d_head] (dt repeated along d_head):
            # on CPU its rounding depends on the tensor's size (vectorised or not), so the same shape is fed here
            wide = dt[:, 0, :, None].expand(-1, -1, p) + self.dt_bias.to(dt.dtype)[:, None].expand(-1, p)
            dt = F.softplus(wide)[:, None, :, 0].contiguous()
        else:
            dt = F.softplus(dt + self.dt_bias.to(dt.dtype))
        dt = self.hook_dt(dt.clamp(low, high))

        if cached:  # a hook editing in place must not edit the cache's tensor (snapshots hold it)
            start = state.recurrent.clone() if self.hook_state_in.has_hooks else state.recurrent
        else:
            start = torch.zeros(b, h, p, n, dtype=torch.float32, device=x.device)
        start = self.hook_state_in(start)
        A = -torch.exp(self.A_log.float())
        if step:
            y, end = recurrent_step(xs[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], self.D, start)
            y = y[:, None]
        else:
            y, end = chunked_scan(xs, dt, A, B, C, self.D, start, self.chunk_size)
        y = self.hook_y(y)
        end = self.hook_state_out(end)
        if state is not None:
            state.update(window, end, t)

        normed = self.norm(y.flatten(-2), z.flatten(-2)).to(dtype)
        normed = self.hook_normed(normed.unflatten(-1, (h, p)))
        return self.out_proj(normed.flatten(-2))

    def _convolve(
        self, xbc: Float[torch.Tensor, "batch channel pos"], window: Float[torch.Tensor, "batch channel d_conv"] | None
    ) -> tuple[Float[torch.Tensor, "batch pos channel"], Float[torch.Tensor, "batch channel d_conv"]]:
        """SiLU of the causal depthwise convolution of the new positions, preceded by the cached window (zeros
        without one); and the window to cache: the last d_conv inputs. Fed as transformers feeds it (zero
        padding by the convolution, the window concatenated in front, a decode step unpadded): the convolution's
        algorithm, and so its float32 rounding, depends on the input's length."""
        k, t = self.d_conv, xbc.shape[-1]
        fed = xbc if window is None else torch.cat([window, xbc], dim=-1)
        padding = 0 if window is not None and t == 1 else k - 1
        weight = self.conv1d.weight
        out = F.conv1d(fed.to(weight.dtype), weight, self.conv1d.bias, padding=padding, groups=self.conv_dim)
        out = out[..., : fed.shape[-1]][..., -t:]
        out = F.silu(out).to(xbc.dtype)
        seen = fed if window is not None else F.pad(xbc, (k, 0))
        return out.transpose(1, 2), seen[..., -k:].contiguous()

    def _state_shapes(self, batch: int) -> dict[str, tuple[int, ...]]:
        return {
            "conv": (batch, self.conv_dim, self.d_conv),
            "recurrent": (batch, self.n_heads, self.d_head, self.d_state),
        }

    def extra_repr(self) -> str:
        return (f"heads={self.n_heads}, d_head={self.d_head}, groups={self.n_groups}, d_state={self.d_state}, "
                f"d_conv={self.d_conv}, chunk={self.chunk_size}")
