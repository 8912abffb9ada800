"""Attention with an output gate (Qwen3-Next, Qwen3.5): q_proj is twice as wide and gives each head its query
and a gate; the heads' outputs are multiplied by sigmoid(gate) before the output projection. Queries and keys
are normed per head before the rotary by zero-centred RMSNorms (weight 1 + w)."""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import nn

from moelens.config import MoeConfig
from moelens.hooks.sites import site_hook
from moelens.models.components.attention import Attention, SplitInputs, linear_per_head, project_out, split_inputs
from moelens.models.components.norm import ZeroCenteredRMSNorm
from moelens.models.context import LayerInputs
from moelens.models.terms import ParamTerm, under


class OutputGatedAttention(Attention):
    """hook_q: each head's query half of q_proj (before the norm); hook_attn_gate: its gate half, before the
    sigmoid; hook_z: the heads' outputs after the gate (what o_proj reads, so head results and W_O views
    describe it)."""

    q_proj_factor = 2

    @classmethod
    def param_terms(cls, cfg: MoeConfig, layer: int) -> tuple[ParamTerm, ...]:
        return (super().param_terms(cfg, layer) + under("q_norm", ZeroCenteredRMSNorm.param_terms(cfg.d_head))
                + under("k_norm", ZeroCenteredRMSNorm.param_terms(cfg.d_head)))

    def __init__(self, cfg: MoeConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        self.q_proj = nn.Linear(cfg.d_model, 2 * cfg.n_heads * cfg.d_head, bias=cfg.qkv_bias)
        self.q_norm = ZeroCenteredRMSNorm(cfg.d_head, cfg.norm_eps, hooked=False)
        self.k_norm = ZeroCenteredRMSNorm(cfg.d_head, cfg.norm_eps, hooked=False)
        self.hook_attn_gate = site_hook("blocks.L.attn.hook_attn_gate")
        self.hook_z = site_hook("blocks.L.attn.hook_z", "gated")

    def forward(
        self, x: Float[torch.Tensor, "batch pos d_model"] | SplitInputs, inputs: LayerInputs
    ) -> Float[torch.Tensor, "batch pos d_model"]:
        q, gate, k, v = self.project_gated(x)
        z = self.heads(q, k, v, inputs)
        return project_out(self, self.hook_z(z * torch.sigmoid(gate)))

    def project(self, x: Float[torch.Tensor, "batch pos d_model"] | SplitInputs):
        q, _, k, v = self.project_gated(x)
        return q, k, v

    def project_gated(self, x: Float[torch.Tensor, "batch pos d_model"] | SplitInputs):
        """Queries, gates [batch pos head d_head], keys and values [batch pos kv_head d_head], each hooked."""
        xq, xk, xv = split_inputs(x)
        b, p = xq.shape[:2]
        q_and_gate = linear_per_head(self.q_proj, xq).view(b, p, self.n_heads, 2 * self.d_head)
        q, gate = torch.chunk(q_and_gate, 2, dim=-1)
        # the gate contiguous, as transformers reshapes it: the sigmoid's rounding then never depends on whether a
        # hook edited the chunk in place (a strided view) or returned an edited copy (contiguous)
        q, gate = self.hook_q(q), self.hook_attn_gate(gate.contiguous())
        k = self.hook_k(linear_per_head(self.k_proj, xk).view(b, p, self.n_kv_heads, self.d_head))
        v = self.hook_v(linear_per_head(self.v_proj, xv).view(b, p, self.n_kv_heads, self.d_head))
        return q, gate, k, v

    # TransformerLens's views read only the query half of each head's rows of q_proj (the other half is the gate)
    @property
    def W_Q(self) -> Float[torch.Tensor, "n_heads d_model d_head"]:
        self._require_per_head("W_Q")
        return self._query_and_gate_rows()[:, : self.d_head].transpose(-2, -1)

    @property
    def b_Q(self) -> Float[torch.Tensor, "n_heads d_head"]:
        self._require_per_head("b_Q")
        return self._bias(self.q_proj, self.n_heads, 2 * self.d_head)[:, : self.d_head]

    @property
    def W_attn_gate(self) -> Float[torch.Tensor, "n_heads d_model d_head"]:
        """Each head's gate projection (hook_attn_gate = normed stream @ W_attn_gate + b_attn_gate)."""
        return self._query_and_gate_rows()[:, self.d_head :].transpose(-2, -1)

    @property
    def b_attn_gate(self) -> Float[torch.Tensor, "n_heads d_head"]:
        return self._bias(self.q_proj, self.n_heads, 2 * self.d_head)[:, self.d_head :]

    def _query_and_gate_rows(self) -> Float[torch.Tensor, "n_heads two_d_head d_model"]:
        """q_proj's weight per head: its query rows then its gate rows (a view: editing it edits q_proj)."""
        return self.q_proj.weight.view(self.n_heads, 2 * self.d_head, -1)

    def position(self, q, k, cos, sin):
        return super().position(self.q_norm(q), self.k_norm(k), cos, sin)
