"""Pre-norm transformer block: resid + attn(ln1(resid)), then + mlp(ln2(.)); every stream hooked."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from jaxtyping import Float
from torch import nn

from moelens.config import MoeConfig
from moelens.hooks import HookPoint
from moelens.kv_cache import LayerKV
from moelens.models.components.attention import Attention
from moelens.models.components.mlp import GatedMLP
from moelens.models.components.moe import SparseMoe
from moelens.models.components.norm import RMSNorm
from moelens.models.components.router import TopKRouter


@dataclass(frozen=True)
class Components:
    """The classes a family builds its blocks from: each behaviour is a class, not a flag."""

    attention: type[Attention]
    moe: type[SparseMoe]
    router: type[TopKRouter]
    dense_mlp: type[GatedMLP] = GatedMLP


class Block(nn.Module):
    def __init__(self, cfg: MoeConfig, layer: int, components: Components) -> None:
        super().__init__()
        self.is_moe = cfg.moe_layers[layer]
        self.ln1 = RMSNorm(cfg.d_model, cfg.norm_eps, feeds="attention")
        self.attn = components.attention(cfg)
        self.ln2 = RMSNorm(cfg.d_model, cfg.norm_eps, feeds="the MLP / mixture")
        self.mlp: nn.Module = (
            components.moe(cfg, layer, components.router) if self.is_moe
            else components.dense_mlp(cfg.d_model, cfg.d_mlp, cfg.act_fn)
        )
        self.hook_resid_pre = HookPoint("batch pos d_model", "residual stream entering the block")
        self.hook_attn_out = HookPoint("batch pos d_model", "what attention adds to the residual stream")
        self.hook_resid_mid = HookPoint("batch pos d_model", "residual stream after the attention add")
        self.hook_mlp_out = HookPoint("batch pos d_model", "what the MLP / mixture adds to the residual stream")
        self.hook_resid_post = HookPoint("batch pos d_model", "residual stream leaving the block")

    def forward(
        self,
        resid: Float[torch.Tensor, "batch pos d_model"],
        cos: torch.Tensor,
        sin: torch.Tensor,
        allowed: torch.Tensor,
        kv: LayerKV | None = None,
    ) -> Float[torch.Tensor, "batch pos d_model"]:
        resid = self.hook_resid_pre(resid)
        attn_out = self.hook_attn_out(self.attn(self.ln1(resid), cos, sin, allowed, kv))
        resid_mid = self.hook_resid_mid(resid + attn_out)
        mlp_out = self.hook_mlp_out(self.mlp(self.ln2(resid_mid)))
        return self.hook_resid_post(resid_mid + mlp_out)
