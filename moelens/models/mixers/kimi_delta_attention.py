"""Kimi Delta Attention (KDA): the linear-attention token mixer of Kimi-Linear (model_type kimi_linear), as
transformers computes it with its torch fallback. Gated DeltaNet with a decay per key channel, and as many key
heads as value heads, all linear_d_head wide.

    x -> q_proj, k_proj, v_proj (concatenated q | k | v, the convolution's channel order)
      -> causal depthwise convolution (kernel linear_conv_kernel) and SiLU -> hook_q, hook_k, hook_v
      -> the forget gate's log decay per key channel (hook_log_decay, float32), beta = sigmoid(b_proj(x))
         (hook_beta)
      -> the Kimi delta rule (moelens.models.mixers.kda_rule) from the state hook_state_in, giving the read-out
         (hook_core_out) and the state after the last token (hook_state_out)
      -> RMSNorm of the read-out times sigmoid of the output gate (hook_gate; the product hook_z) -> o_proj

The families differ in their gates (a subclass's): Kimi-Linear's forget and output gates go through a rank-d_head
bottleneck (f_a_proj -> f_b_proj, g_a_proj -> g_b_proj) and its log decay is -exp(A_log) * softplus(f + dt_bias)
per channel, in float32, with dt_bias kept float32 in any model dtype (KimiLinearDeltaAttention); Ling's
(bailing_hybrid) are full-rank (f_proj, g_proj), its log decay bounded, lower_bound * sigmoid(exp(A_log) * (f +
dt_bias)), and cast to the model's dtype, with A_log, dt_bias and the convolution kept float32
(BailingDeltaAttention). Both as transformers keeps them (its _keep_in_fp32_modules_strict).

The state (moelens.state.RecurrentState) and the padding rule are Gated DeltaNet's (moelens.models.mixers.
gated_deltanet): the convolution window [batch 3*n_heads*d_head kernel] in the model's dtype and the recurrent
state [batch head d_head d_head] in float32; padding positions' inputs are zeroed, so left padding leaves the
state at zero, while a padding position after real tokens still decays the state by its softplus(dt_bias).
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
from moelens.models.mixers.gated_norm import SigmoidGatedRMSNorm
from moelens.models.mixers.kda_rule import chunked_kda_rule, recurrent_kda_rule
from moelens.models.terms import ParamTerm, depthwise_conv, kept_float32, linear, under, vector
from moelens.state import RecurrentState


@dataclass(frozen=True)
class KimiDeltaSizes:
    """What a KDA mixer reads from its config (a family's MoeConfig subclass, or this dataclass); the config.json
    field each comes from is in brackets: d_model [hidden_size], linear_n_heads [linear_attn_config.num_heads],
    linear_d_head [linear_attn_config.head_dim], linear_conv_kernel [linear_attn_config.short_conv_kernel_size],
    norm_eps [rms_norm_eps] (the output norm's eps), act_fn [hidden_act] (the convolution's activation)."""

    d_model: int
    linear_n_heads: int
    linear_d_head: int
    linear_conv_kernel: int
    norm_eps: float
    act_fn: str = "silu"


_SIZE_FIELDS = ("d_model", "linear_n_heads", "linear_d_head", "linear_conv_kernel")


def _check_sizes(cfg: object) -> None:
    missing = [f for f in (*_SIZE_FIELDS, "norm_eps", "act_fn") if not hasattr(cfg, f)]
    if missing:
        raise AttributeError(f"Kimi Delta Attention config {type(cfg).__name__} lacks {missing} (see moelens.models."
                             "mixers.kimi_delta_attention.KimiDeltaSizes for the attributes it reads)")
    for name in _SIZE_FIELDS:
        if not isinstance(getattr(cfg, name), int) or getattr(cfg, name) < 1:
            raise ValueError(f"Kimi Delta Attention config: {name} must be a positive int, got {getattr(cfg, name)!r}")
    if cfg.act_fn != "silu":
        raise ValueError(f"Kimi Delta Attention config: act_fn (hidden_act) {cfg.act_fn!r}: the convolution's "
                         "activation is SiLU (only 'silu' is implemented)")


class Float32Vector(nn.Module):
    """One vector kept float32 in any model dtype (keep_float32 reads float32_weight)."""

    float32_weight: ClassVar[bool] = True

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d))


class KimiDeltaAttention(nn.Module):
    """The mixer less its gates (a subclass's: gate_terms, the gate modules, log_decay, output_gate,
    gate_projections). Built as Cls(cfg, layer) from any object with KimiDeltaSizes' attributes."""

    block_attribute: ClassVar[str] = "mixer"
    float32_conv: ClassVar[bool] = False  # the convolution's weight kept float32 in any model dtype

    @classmethod
    def param_terms(cls, cfg: object, layer: int) -> tuple[ParamTerm, ...]:
        n, d, width = cfg.linear_n_heads, cfg.linear_d_head, cfg.linear_n_heads * cfg.linear_d_head
        return (linear("q_proj", cfg.d_model, width, False, "attention")
                + linear("k_proj", cfg.d_model, width, False, "attention")
                + linear("v_proj", cfg.d_model, width, False, "attention")
                + kept_float32(depthwise_conv("conv1d", 3 * width, cfg.linear_conv_kernel, False, "attention"),
                               cls.float32_conv)
                + cls.gate_terms(cfg)
                + linear("b_proj", cfg.d_model, n, False, "attention")
                + under("o_norm", SigmoidGatedRMSNorm.param_terms(d, "attention"))
                + linear("o_proj", width, cfg.d_model, False, "attention"))

    @classmethod
    def gate_terms(cls, cfg: object) -> tuple[ParamTerm, ...]:
        raise NotImplementedError

    def __init__(self, cfg: object, layer: int) -> None:
        super().__init__()
        _check_sizes(cfg)
        self.layer = layer
        self.d_model = cfg.d_model
        self.n_heads, self.d_head = cfg.linear_n_heads, cfg.linear_d_head
        self.width = self.n_heads * self.d_head
        self.conv_dim = 3 * self.width
        self.conv_kernel = cfg.linear_conv_kernel
        self.q_proj = nn.Linear(self.d_model, self.width, bias=False)
        self.k_proj = nn.Linear(self.d_model, self.width, bias=False)
        self.v_proj = nn.Linear(self.d_model, self.width, bias=False)
        # depthwise over q|k|v; an nn.Conv1d only to hold the weight [conv_dim 1 kernel]
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.conv_kernel, groups=self.conv_dim, bias=False,
                                padding=self.conv_kernel - 1)
        self.conv1d.float32_weight = self.float32_conv  # keep_float32 reads it
        self.b_proj = nn.Linear(self.d_model, self.n_heads, bias=False)
        self.o_norm = SigmoidGatedRMSNorm(self.d_head, cfg.norm_eps)
        self.o_proj = nn.Linear(self.width, self.d_model, bias=False)
        self.hook_q = site_hook("blocks.L.mixer.hook_q")
        self.hook_k = site_hook("blocks.L.mixer.hook_k")
        self.hook_v = site_hook("blocks.L.mixer.hook_v")
        self.hook_log_decay = site_hook("blocks.L.mixer.hook_log_decay", "kda")
        self.hook_beta = site_hook("blocks.L.mixer.hook_beta")
        self.hook_state_in = site_hook("blocks.L.mixer.hook_state_in")
        self.hook_core_out = site_hook("blocks.L.mixer.hook_core_out")
        self.hook_state_out = site_hook("blocks.L.mixer.hook_state_out")
        self.hook_gate = site_hook("blocks.L.mixer.hook_gate", "kda")
        self.hook_z = site_hook("blocks.L.mixer.hook_z", "kda")

    # ---- what a subclass provides -------------------------------------------------------------------------
    def log_decay(self, x: Float[torch.Tensor, "batch pos d_model"]) -> Float[torch.Tensor, "batch pos head d_head"]:
        """The forget gate's log decay per key channel (<= 0)."""
        raise NotImplementedError

    def output_gate(self, x: Float[torch.Tensor, "batch pos d_model"]) -> Float[torch.Tensor, "batch pos head d_head"]:
        """The output gate before its sigmoid."""
        raise NotImplementedError

    def gate_projections(self) -> list[nn.Linear]:
        """The gates' linear maps that read the normed stream."""
        raise NotImplementedError

    def input_projections(self) -> list[nn.Linear]:
        """The linear maps that read the normed stream (what fold_ln scales)."""
        return [self.q_proj, self.k_proj, self.v_proj, self.b_proj, *self.gate_projections()]

    # ---- the Mixer protocol -------------------------------------------------------------------------------
    def new_state(self, reserve: int = 0) -> RecurrentState:
        """An empty state (its size does not grow with the sequence, so `reserve` changes nothing)."""
        return RecurrentState()

    @classmethod
    def state_tensors(cls, cfg: object) -> tuple[StateTensor, ...]:
        """Per sequence: the convolution window (3 * head * d_head x kernel, the model's dtype) and the recurrent
        state (head x d_head x d_head), float32 whatever the model's dtype (as transformers' cache keeps it)."""
        width = cfg.linear_n_heads * cfg.linear_d_head
        return (
            StateTensor("conv", 3 * width * cfg.linear_conv_kernel, "sequence"),
            StateTensor("recurrent", width * cfg.linear_d_head, "sequence", torch.float32),
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

        mixed_qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        window = None if state is None else state.conv
        conv_out, new_window = silu_causal_conv(self.conv1d.weight, mixed_qkv.transpose(1, 2), window,
                                                caching=state is not None)
        heads = (batch, n_pos, self.n_heads, self.d_head)
        q, k, v = (t.reshape(heads) for t in torch.split(conv_out.transpose(1, 2), [self.width] * 3, dim=-1))
        q, k, v = self.hook_q(q), self.hook_k(k), self.hook_v(v)
        log_decay = self.hook_log_decay(self.log_decay(x))
        beta = self.hook_beta(torch.sigmoid(self.b_proj(x)))

        cached = None if state is None else state.recurrent
        state_in = state_entering(cached, self.hook_state_in, (batch, self.n_heads, self.d_head, self.d_head), x)
        # transformers' choice of form: token by token for one token after a cached state, else chunked
        rule = recurrent_kda_rule if cached is not None and n_pos == 1 else chunked_kda_rule
        core, state_out = rule(q, k, v, log_decay, beta, state_in)
        core = self.hook_core_out(core)
        state_out = self.hook_state_out(state_out)
        if state is not None:
            state.update(new_window, state_out, n_pos)

        gate = self.hook_gate(self.output_gate(x))
        z = self.hook_z(self.o_norm(core, gate))
        return self.o_proj(z.reshape(batch, n_pos, self.width))

    def _check_inputs(self, x: torch.Tensor, inputs: LayerInputs) -> None:
        check_recurrent_inputs("Kimi Delta Attention", self.layer, self.d_model, x, inputs,
                               {"conv": (x.shape[0], self.conv_dim, self.conv_kernel),
                                "recurrent": (x.shape[0], self.n_heads, self.d_head, self.d_head)})


class KimiLinearDeltaAttention(KimiDeltaAttention):
    """Kimi-Linear's gates: low-rank forget and output gates (f_a_proj -> f_b_proj, g_a_proj -> g_b_proj), the log
    decay -exp(A_log) * softplus(f + dt_bias) in float32, dt_bias kept float32."""

    @classmethod
    def gate_terms(cls, cfg: object) -> tuple[ParamTerm, ...]:
        n, d, width = cfg.linear_n_heads, cfg.linear_d_head, cfg.linear_n_heads * cfg.linear_d_head
        return (linear("f_a_proj", cfg.d_model, d, False, "attention") + linear("f_b_proj", d, width, False, "attention")
                + (ParamTerm("A_log", (1, 1, n, 1), "attention"),)
                + kept_float32(under("dt_bias", vector("weight", width, "attention")), True)
                + linear("g_a_proj", cfg.d_model, d, False, "attention") + linear("g_b_proj", d, width, False, "attention"))

    def __init__(self, cfg: object, layer: int) -> None:
        super().__init__(cfg, layer)
        self.f_a_proj = nn.Linear(self.d_model, self.d_head, bias=False)
        self.f_b_proj = nn.Linear(self.d_head, self.width, bias=False)
        self.A_log = nn.Parameter(torch.zeros(1, 1, self.n_heads, 1))
        self.dt_bias = Float32Vector(self.width)
        self.g_a_proj = nn.Linear(self.d_model, self.d_head, bias=False)
        self.g_b_proj = nn.Linear(self.d_head, self.width, bias=False)

    def log_decay(self, x):
        """-exp(A_log) * softplus(f_b_proj(f_a_proj(x)) + dt_bias) per key channel, float32 (transformers'
        KimiLinearForgetGate: its softplus is log(1 + exp(f)), f itself above 20)."""
        f = self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.weight.float().view(1, 1, -1)
        f = f.view(*x.shape[:2], self.n_heads, self.d_head)
        softplus = torch.where(f > 20.0, f, torch.log(1.0 + torch.exp(f)))
        return -self.A_log.float().exp() * softplus

    def output_gate(self, x):
        return self.g_b_proj(self.g_a_proj(x)).view(*x.shape[:2], self.n_heads, self.d_head)

    def gate_projections(self) -> list[nn.Linear]:
        return [self.f_a_proj, self.g_a_proj]


class BailingDeltaAttention(KimiDeltaAttention):
    """Ling's gates (bailing_hybrid): full-rank f_proj and g_proj; the log decay lower_bound * sigmoid(exp(A_log) *
    (f + dt_bias)) with kda_safe_gate (bounded below by lower_bound), else -exp(A_log) * softplus(f + dt_bias),
    computed in float32 and cast to the model's dtype; A_log [head], dt_bias and the convolution kept float32. The
    config supplies kda_safe_gate and kda_lower_bound besides KimiDeltaSizes'."""

    float32_conv: ClassVar[bool] = True

    @classmethod
    def gate_terms(cls, cfg: object) -> tuple[ParamTerm, ...]:
        n, width = cfg.linear_n_heads, cfg.linear_n_heads * cfg.linear_d_head
        return (linear("f_proj", cfg.d_model, width, False, "attention")
                + kept_float32(under("A_log", vector("weight", n, "attention")), True)
                + kept_float32(under("dt_bias", vector("weight", width, "attention")), True)
                + linear("g_proj", cfg.d_model, width, False, "attention"))

    def __init__(self, cfg: object, layer: int) -> None:
        super().__init__(cfg, layer)
        self.safe_gate, self.lower_bound = cfg.kda_safe_gate, cfg.kda_lower_bound
        self.f_proj = nn.Linear(self.d_model, self.width, bias=False)
        self.A_log = Float32Vector(self.n_heads)
        self.dt_bias = Float32Vector(self.width)
        self.g_proj = nn.Linear(self.d_model, self.width, bias=False)

    def log_decay(self, x):
        f = self.f_proj(x).float().view(*x.shape[:2], self.n_heads, self.d_head)
        f = f + self.dt_bias.weight.view(1, 1, self.n_heads, self.d_head)
        rate = self.A_log.weight.exp().view(1, 1, self.n_heads, 1)
        decay = self.lower_bound * torch.sigmoid(rate * f) if self.safe_gate else -rate * F.softplus(f)
        return decay.to(x.dtype)

    def output_gate(self, x):
        return self.g_proj(x).view(*x.shape[:2], self.n_heads, self.d_head)

    def gate_projections(self) -> list[nn.Linear]:
        return [self.f_proj, self.g_proj]
