"""Pre-norm transformer block: resid + attn(ln1(resid)), then + mlp(ln2(.)); every stream hooked."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from jaxtyping import Float
from torch import nn

from moelens.config import MoeConfig
from moelens.hooks.sites import site_hook, switched_sites
from moelens.kv_cache import LayerKV
from moelens.models.components.attention import Attention, SplitInputs
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
    norm: type[RMSNorm] = RMSNorm  # ln1, ln2 and ln_final


# TransformerLens's optional per-block hooks, by switch: the table's block sites each exists only while its
# switch (model.set_use_split_qkv_input / set_use_attn_in / set_use_hook_mlp_in) is on
OPTIONAL_HOOKS: dict[str, tuple[str, ...]] = {
    switch: tuple(s.name for s in switched_sites(f"set_use_{switch}") if s.name.startswith("blocks.L.hook_"))
    for switch in ("split_qkv_input", "attn_in", "hook_mlp_in")
}


def per_head(x: Float[torch.Tensor, "batch pos d_model"], n_heads: int) -> Float[torch.Tensor, "batch pos head d_model"]:
    """n_heads copies of the stream, each its own memory (an edit of one head's copy leaves the others)."""
    return x[:, :, None, :].expand(-1, -1, n_heads, -1).clone()


class Block(nn.Module):
    # the switches of OPTIONAL_HOOKS, off by default (set per instance by set_optional_hooks)
    use_split_qkv_input = False
    use_attn_in = False
    use_hook_mlp_in = False

    def __init__(self, cfg: MoeConfig, layer: int, components: Components) -> None:
        super().__init__()
        self.is_moe = cfg.moe_layers[layer]
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.ln1 = components.norm(cfg.d_model, cfg.norm_eps, site="blocks.L.ln1")
        self.attn = components.attention(cfg, layer)
        self.ln2 = components.norm(cfg.d_model, cfg.norm_eps, site="blocks.L.ln2")
        self.mlp: nn.Module = (
            components.moe(cfg, layer, components.router) if self.is_moe
            else components.dense_mlp(cfg.d_model, cfg.d_mlp, cfg.act_fn)
        )
        self.hook_resid_pre = site_hook("blocks.L.hook_resid_pre")
        self.hook_attn_out = site_hook("blocks.L.hook_attn_out")
        self.hook_resid_mid = site_hook("blocks.L.hook_resid_mid")
        self.hook_mlp_out = site_hook("blocks.L.hook_mlp_out")
        self.hook_resid_post = site_hook("blocks.L.hook_resid_post")

    def forward(
        self,
        resid: Float[torch.Tensor, "batch pos d_model"],
        cos: torch.Tensor,
        sin: torch.Tensor,
        allowed: torch.Tensor,
        kv: LayerKV | None = None,
    ) -> Float[torch.Tensor, "batch pos d_model"]:
        resid = self.hook_resid_pre(resid)
        attn_out = self.hook_attn_out(self.attn(self.attn_input(resid), cos, sin, allowed, kv))
        resid_mid = self.hook_resid_mid(resid + attn_out)
        # a copy, as TransformerLens: an edit of hook_mlp_in reaches the MLP, not the residual add
        mlp_in = self.hook_mlp_in(resid_mid.clone()) if self.use_hook_mlp_in else resid_mid
        mlp_out = self.hook_mlp_out(self.mlp(self.ln2(mlp_in)))
        return self.hook_resid_post(resid_mid + mlp_out)

    def attn_input(self, resid: Float[torch.Tensor, "batch pos d_model"]) -> torch.Tensor | SplitInputs:
        """ln1(resid); with split inputs each head's hooked copy of resid, then ln1 of each (TransformerLens
        hooks the copies before ln1, so ln1's hooks then see [batch pos head d_model] and fire per input)."""
        # as TransformerLens: with both switches on hook_attn_in fires, but the split inputs are what attention reads
        attn_in = self.hook_attn_in(per_head(resid, self.n_heads)) if self.use_attn_in else None
        if self.use_split_qkv_input:
            q = self.hook_q_input(per_head(resid, self.n_heads))
            k = self.hook_k_input(per_head(resid, self.n_kv_heads))
            v = self.hook_v_input(per_head(resid, self.n_kv_heads))
            return SplitInputs(self.ln1(q), self.ln1(k), self.ln1(v))
        if attn_in is not None:
            x = self.ln1(attn_in)
            return SplitInputs(x, x, x)
        return self.ln1(resid)

    def set_optional_hooks(self, switch: str, on: bool) -> None:
        """Turn one of OPTIONAL_HOOKS' switches on (its HookPoints are added and fire) or off (removed); the
        model renames its hook points afterwards (setup)."""
        setattr(self, f"use_{switch}", on)
        for site in OPTIONAL_HOOKS[switch]:
            name = site.rsplit(".", 1)[-1]
            if on and not hasattr(self, name):
                setattr(self, name, site_hook(site))
            elif not on and hasattr(self, name):
                delattr(self, name)
