"""Gated DeltaNet: the linear-attention token mixer of Qwen3-Next (model_type qwen3_next) and Qwen3.5-MoE
(qwen3_5_moe_text), as transformers computes it with its torch fallback.

    x -> projections: q, k, v (one stream of conv_dim = 2 * k_head * d_k + v_head * d_v channels), the output
         gate z, b and a (one each per value head)
      -> causal depthwise convolution over q|k|v (kernel linear_conv_kernel) and SiLU -> hook_q, hook_k, hook_v
      -> beta = sigmoid(b) (hook_beta), log decay g = -exp(A_log) * softplus(a + dt_bias) (hook_log_decay)
      -> the gated delta rule (moelens.models.mixers.delta_rule) from the state hook_state_in, giving the
         read-out (hook_core_out) and the state after the last token (hook_state_out)
      -> gated RMSNorm of the read-out times silu(z) (hook_z) -> out_proj

The two families differ only in how the projections are stored: Qwen3.5 has one linear per part
(SeparateProjectionsGatedDeltaNet: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a); Qwen3-Next fuses them into
in_proj_qkvz and in_proj_ba, whose output rows are grouped per key head (FusedProjectionsGatedDeltaNet). The
parameters carry transformers' names (conv1d, A_log, dt_bias, norm, out_proj and the projections above), so
a family's site map maps checkpoint keys one to one.

The state (moelens.state.RecurrentState): `conv`, the last linear_conv_kernel inputs of the convolution
[batch conv_dim kernel] in the model's dtype (as transformers' cache keeps them: zeros before the first
token), and `recurrent`, the delta rule's state [batch v_head d_k d_v], float32 whatever the model's dtype.
A forward of several tokens runs the chunked form, from the cached state and convolution window when there
is one (a prefill, or a multi-token forward after a cached prefix, as transformers 5's cache does too); a
forward of one token after a cached state runs the token-by-token form (transformers' decode step).

Padding: as transformers does, the mixer multiplies its input by `inputs.mask` (0 for padding), so a padding
position has zero q, k, v, z, b and a. Left padding before a row's first real token therefore leaves the state
at zero and the convolution window at zeros (the real tokens see exactly what they would alone, up to the
rounding of where the chunks fall), and the padding's own outputs are zero. A padding position after real
tokens (or with a nonzero state to start from) is not a no-op: its log decay -exp(A_log) * softplus(dt_bias)
still shrinks the state, as in transformers.
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
from moelens.models.mixers.causal_conv import silu_causal_conv
from moelens.models.mixers.recurrent_checks import check_recurrent_inputs, state_entering
from moelens.models.mixers.delta_rule import chunked_delta_rule, recurrent_delta_rule
from moelens.models.mixers.gated_norm import GatedRMSNorm
from moelens.models.terms import ParamTerm, depthwise_conv, linear, under, vector
from moelens.state import RecurrentState


@dataclass(frozen=True)
class GatedDeltaNetSizes:
    """What a Gated DeltaNet mixer reads from its config. The mixer takes any object with these attributes (a
    family's MoeConfig subclass, or this dataclass); the config.json field each comes from is in brackets.

    d_model [hidden_size], linear_n_key_heads [linear_num_key_heads], linear_n_value_heads
    [linear_num_value_heads], linear_d_key [linear_key_head_dim], linear_d_value [linear_value_head_dim],
    linear_conv_kernel [linear_conv_kernel_dim], norm_eps [rms_norm_eps] (the gated norm's eps), act_fn
    [hidden_act] (the convolution's activation: transformers applies hidden_act there; only "silu" exists)."""

    d_model: int
    linear_n_key_heads: int
    linear_n_value_heads: int
    linear_d_key: int
    linear_d_value: int
    linear_conv_kernel: int
    norm_eps: float
    act_fn: str = "silu"


_SIZE_FIELDS = ("d_model", "linear_n_key_heads", "linear_n_value_heads", "linear_d_key", "linear_d_value",
                "linear_conv_kernel")


def _check_sizes(cfg: object) -> None:
    missing = [f for f in (*_SIZE_FIELDS, "norm_eps", "act_fn") if not hasattr(cfg, f)]
    if missing:
        raise AttributeError(
            f"Gated DeltaNet config {type(cfg).__name__} lacks {missing} (see moelens.models.mixers.gated_deltanet."
            "GatedDeltaNetSizes for the attributes it reads)"
        )
    for name in _SIZE_FIELDS:
        if not isinstance(getattr(cfg, name), int) or getattr(cfg, name) < 1:
            raise ValueError(f"Gated DeltaNet config: {name} must be a positive int, got {getattr(cfg, name)!r}")
    if cfg.linear_n_value_heads % cfg.linear_n_key_heads:
        raise ValueError(
            f"Gated DeltaNet config: linear_n_value_heads ({cfg.linear_n_value_heads}) must be a multiple of "
            f"linear_n_key_heads ({cfg.linear_n_key_heads}): each key head serves a group of value heads"
        )
    if cfg.act_fn != "silu":
        raise ValueError(f"Gated DeltaNet config: act_fn (hidden_act) {cfg.act_fn!r}: only 'silu' is implemented")


class GatedDeltaNet(nn.Module):
    """The mixer, less its input projections (a subclass's `project`). Built as Cls(cfg, layer) from any object
    with GatedDeltaNetSizes' attributes."""

    block_attribute: ClassVar[str] = "mixer"
    norm_class: ClassVar[type[GatedRMSNorm]] = GatedRMSNorm  # the output's gated norm (its weight's rounding order)

    @classmethod
    def param_terms(cls, cfg: object, layer: int) -> tuple[ParamTerm, ...]:
        """The convolution, decay and gated norm (all "attention": the token mixer's), the output projection and
        the input projections (a subclass's: in_projections)."""
        key_dim, value_dim = cfg.linear_n_key_heads * cfg.linear_d_key, cfg.linear_n_value_heads * cfg.linear_d_value
        return (cls.in_projections(cfg)
                + depthwise_conv("conv1d", 2 * key_dim + value_dim, cfg.linear_conv_kernel, False, "attention")
                + vector("dt_bias", cfg.linear_n_value_heads, "attention") + vector("A_log", cfg.linear_n_value_heads, "attention")
                + under("norm", cls.norm_class.param_terms(cfg.linear_d_value, "attention"))
                + linear("out_proj", value_dim, cfg.d_model, False, "attention"))

    @staticmethod
    def in_projections(cfg: object) -> tuple[ParamTerm, ...]:
        raise NotImplementedError

    def __init__(self, cfg: object, layer: int) -> None:
        super().__init__()
        _check_sizes(cfg)
        self.layer = layer
        self.d_model = cfg.d_model
        self.n_k_heads, self.n_v_heads = cfg.linear_n_key_heads, cfg.linear_n_value_heads
        self.d_k, self.d_v = cfg.linear_d_key, cfg.linear_d_value
        self.key_dim, self.value_dim = self.n_k_heads * self.d_k, self.n_v_heads * self.d_v
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = cfg.linear_conv_kernel
        # depthwise over q|k|v; an nn.Conv1d only to hold the weight [conv_dim 1 kernel] under transformers' name
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.conv_kernel, groups=self.conv_dim, bias=False,
                                padding=self.conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.n_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.n_v_heads))
        self.norm = self.norm_class(self.d_v, cfg.norm_eps)
        self.out_proj = nn.Linear(self.value_dim, self.d_model, bias=False)
        self.hook_q = site_hook("blocks.L.mixer.hook_q")
        self.hook_k = site_hook("blocks.L.mixer.hook_k")
        self.hook_v = site_hook("blocks.L.mixer.hook_v")
        self.hook_gate = site_hook("blocks.L.mixer.hook_gate")
        self.hook_beta = site_hook("blocks.L.mixer.hook_beta")
        self.hook_log_decay = site_hook("blocks.L.mixer.hook_log_decay")
        self.hook_state_in = site_hook("blocks.L.mixer.hook_state_in")
        self.hook_core_out = site_hook("blocks.L.mixer.hook_core_out")
        self.hook_state_out = site_hook("blocks.L.mixer.hook_state_out")
        self.hook_z = site_hook("blocks.L.mixer.hook_z")

    # ---- what a subclass provides -------------------------------------------------------------------------
    def project(self, x: Float[torch.Tensor, "batch pos d_model"]) -> tuple[
        Float[torch.Tensor, "batch pos conv_dim"],
        Float[torch.Tensor, "batch pos v_head d_v"],
        Float[torch.Tensor, "batch pos v_head"],
        Float[torch.Tensor, "batch pos v_head"],
    ]:
        """(q|k|v in the convolution's channel order: every key head's q, every key head's k, every value head's
        v; the output gate z; b; a)."""
        raise NotImplementedError

    def input_projections(self) -> list[nn.Linear]:
        """The linear maps that read the normed stream (what fold_ln scales)."""
        raise NotImplementedError

    # ---- the Mixer protocol -------------------------------------------------------------------------------
    def new_state(self, reserve: int = 0) -> RecurrentState:
        """An empty state (its size does not grow with the sequence, so `reserve` changes nothing)."""
        return RecurrentState()

    @classmethod
    def state_tensors(cls, cfg: object) -> tuple[StateTensor, ...]:
        """Per sequence: the convolution window (conv_dim x kernel, the model's dtype) and the recurrent state
        (v_head x d_k x d_v), float32 whatever the model's dtype (the delta rule computes and returns it so,
        and transformers' cache keeps it as returned)."""
        conv_dim = 2 * cfg.linear_n_key_heads * cfg.linear_d_key + cfg.linear_n_value_heads * cfg.linear_d_value
        recurrent = cfg.linear_n_value_heads * cfg.linear_d_key * cfg.linear_d_value
        return (
            StateTensor("conv", conv_dim * cfg.linear_conv_kernel, "sequence"),
            StateTensor("recurrent", recurrent, "sequence", torch.float32),
        )

    @classmethod
    def state_bytes(cls, cfg: object) -> StateBytes:
        return values_of(cls.state_tensors(cfg))

    def forward(
        self, x: Float[torch.Tensor, "batch pos d_model"], inputs: LayerInputs
    ) -> Float[torch.Tensor, "batch pos d_model"]:
        state = inputs.state
        self._check_inputs(x, inputs)
        batch, n_pos, _ = x.shape
        if inputs.mask is not None:  # padding positions contribute zero inputs (transformers' handling)
            x = x * inputs.mask[:, :, None].to(x.dtype)

        mixed_qkv, gate, b, a = self.project(x)
        window = None if state is None else state.conv
        conv_out, new_window = silu_causal_conv(self.conv1d.weight, mixed_qkv.transpose(1, 2), window,
                                                 caching=state is not None)
        q, k, v = torch.split(conv_out.transpose(1, 2), [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = self.hook_q(q.reshape(batch, n_pos, self.n_k_heads, self.d_k))
        k = self.hook_k(k.reshape(batch, n_pos, self.n_k_heads, self.d_k))
        v = self.hook_v(v.reshape(batch, n_pos, self.n_v_heads, self.d_v))
        gate = self.hook_gate(gate)
        beta = self.hook_beta(b.sigmoid())
        # float32 before the exp: A_log in half precision could make the decay -inf (transformers' order)
        log_decay = self.hook_log_decay(-self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias))

        cached = None if state is None else state.recurrent
        state_in = state_entering(cached, self.hook_state_in, (batch, self.n_v_heads, self.d_k, self.d_v), x)
        # transformers' choice of form: token by token for one token after a cached state, else chunked
        rule = recurrent_delta_rule if cached is not None and n_pos == 1 else chunked_delta_rule
        core, state_out = rule(q, k, v, log_decay, beta, state_in)
        core = self.hook_core_out(core)
        state_out = self.hook_state_out(state_out)
        if state is not None:
            state.update(new_window, state_out, n_pos)

        z = self.hook_z(self.norm(core, gate))
        return self.out_proj(z.reshape(batch, n_pos, self.value_dim))

    def _check_inputs(self, x: torch.Tensor, inputs: LayerInputs) -> None:
        check_recurrent_inputs("Gated DeltaNet", self.layer, self.d_model, x, inputs,
                               {"conv": (x.shape[0], self.conv_dim, self.conv_kernel),
                                "recurrent": (x.shape[0], self.n_v_heads, self.d_k, self.d_v)})


class SeparateProjectionsGatedDeltaNet(GatedDeltaNet):
    """Qwen3.5's projections: in_proj_qkv (q|k|v, in the convolution's order), in_proj_z, in_proj_b, in_proj_a."""

    @staticmethod
    def in_projections(cfg: object) -> tuple[ParamTerm, ...]:
        key_dim, value_dim = cfg.linear_n_key_heads * cfg.linear_d_key, cfg.linear_n_value_heads * cfg.linear_d_value
        d, v = cfg.d_model, cfg.linear_n_value_heads
        return (linear("in_proj_qkv", d, 2 * key_dim + value_dim, False, "attention")
                + linear("in_proj_z", d, value_dim, False, "attention") + linear("in_proj_b", d, v, False, "attention")
                + linear("in_proj_a", d, v, False, "attention"))

    def __init__(self, cfg: object, layer: int) -> None:
        super().__init__(cfg, layer)
        self.in_proj_qkv = nn.Linear(self.d_model, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(self.d_model, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(self.d_model, self.n_v_heads, bias=False)
        self.in_proj_a = nn.Linear(self.d_model, self.n_v_heads, bias=False)

    def project(self, x):
        batch, n_pos, _ = x.shape
        mixed_qkv = self.in_proj_qkv(x)  # in transformers' order: the input's gradient sums in reverse order
        gate = self.in_proj_z(x).reshape(batch, n_pos, self.n_v_heads, self.d_v)
        return mixed_qkv, gate, self.in_proj_b(x), self.in_proj_a(x)

    def input_projections(self) -> list[nn.Linear]:
        return [self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a]


class FusedProjectionsGatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next's projections: in_proj_qkvz and in_proj_ba, their output rows grouped per key head. Key head
    i's group holds [q_i (d_k) | k_i (d_k) | v of its value heads (group x d_v) | z of its value heads] in
    in_proj_qkvz and [b of its value heads (group) | a of its value heads (group)] in in_proj_ba, where group =
    v_head / k_head; they are regrouped into the convolution's order (every q, every k, every v)."""

    @staticmethod
    def in_projections(cfg: object) -> tuple[ParamTerm, ...]:
        key_dim, value_dim = cfg.linear_n_key_heads * cfg.linear_d_key, cfg.linear_n_value_heads * cfg.linear_d_value
        return (linear("in_proj_qkvz", cfg.d_model, 2 * key_dim + 2 * value_dim, False, "attention")
                + linear("in_proj_ba", cfg.d_model, 2 * cfg.linear_n_value_heads, False, "attention"))

    def __init__(self, cfg: object, layer: int) -> None:
        super().__init__(cfg, layer)
        self.in_proj_qkvz = nn.Linear(self.d_model, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(self.d_model, 2 * self.n_v_heads, bias=False)

    def project(self, x):
        batch, n_pos, _ = x.shape
        group = self.n_v_heads // self.n_k_heads
        qkvz = self.in_proj_qkvz(x).view(batch, n_pos, self.n_k_heads, -1)
        q, k, v, gate = torch.split(qkvz, [self.d_k, self.d_k, group * self.d_v, group * self.d_v], dim=-1)
        b, a = torch.split(self.in_proj_ba(x).view(batch, n_pos, self.n_k_heads, 2 * group), [group, group], dim=-1)
        mixed_qkv = torch.cat([t.reshape(batch, n_pos, -1) for t in (q, k, v)], dim=-1)
        gate = gate.reshape(batch, n_pos, self.n_v_heads, self.d_v)
        return mixed_qkv, gate, b.reshape(batch, n_pos, self.n_v_heads), a.reshape(batch, n_pos, self.n_v_heads)

    def input_projections(self) -> list[nn.Linear]:
        return [self.in_proj_qkvz, self.in_proj_ba]
