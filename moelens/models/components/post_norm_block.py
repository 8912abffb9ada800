"""Post-norm block (OLMo-2's arrangement; FlexOlmo): each sublayer reads the residual stream itself, unnormed, and
its output is RMS-normed before the add: resid + ln1_post(attn(resid)), then + ln2_post(mlp(.)).

The norms after the sublayers carry TransformerLens's names for them (its Gemma-2 blocks): blocks.L.ln1_post and
blocks.L.ln2_post. hook_attn_out and hook_mlp_out hold the normed outputs, what the stream adds, so resid_post =
resid_pre + attn_out + mlp_out as in every block; but attn_out is not a sum of per-head terms (the norm's scale
depends on every head) and a post-norm's weight folds into nothing (fold_ln leaves it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from jaxtyping import Float
from torch import nn

from moelens.config import MoeConfig
from moelens.hooks.sites import site_hook
from moelens.models.components.attention import SplitInputs
from moelens.models.components.block import Block, Sublayer, per_head
from moelens.models.context import LayerInputs
from moelens.models.terms import ParamTerm, under

if TYPE_CHECKING:
    from moelens.models.recipe import LayerSpec


class PostNormBlock(Block):
    """A token mixer and a feed-forward (both required), each output normed by its post-norm (spec.norm's class)
    before the add; no norm before either."""

    @classmethod
    def param_terms(cls, cfg: MoeConfig, layer: int, spec: LayerSpec) -> tuple[ParamTerm, ...]:
        return (under(f"{spec.mixer.block_attribute}", spec.mixer.param_terms(cfg, layer))
                + under("ln1_post", spec.norm.param_terms(cfg.d_model))
                + under("mlp", spec.ffn.param_terms(cfg, layer))
                + under("ln2_post", spec.norm.param_terms(cfg.d_model)))

    @classmethod
    def state_tensors(cls, cfg: MoeConfig, spec: LayerSpec):
        return spec.mixer.state_tensors(cfg)

    def __init__(self, cfg: MoeConfig, layer: int, spec: LayerSpec) -> None:
        if spec.mixer is None or spec.ffn is None:
            raise ValueError("a post-norm block needs a token mixer and a feed-forward (LayerSpec with both)")
        nn.Module.__init__(self)
        self.is_moe = spec.is_moe
        self.residual_multiplier = 1.0  # its post-normed outputs enter the stream unscaled
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        mixer = spec.mixer(cfg, layer)
        self.mixer_attribute = mixer.block_attribute
        setattr(self, self.mixer_attribute, mixer)
        self.ln1_post = spec.norm(cfg.d_model, cfg.norm_eps, site="blocks.L.ln1_post")
        self.mlp: nn.Module = spec.ffn.build(cfg, layer)
        self.ln2_post = spec.norm(cfg.d_model, cfg.norm_eps, site="blocks.L.ln2_post")
        self.hook_resid_pre = site_hook("blocks.L.hook_resid_pre")
        self.hook_attn_out = site_hook("blocks.L.hook_attn_out")
        self.hook_resid_mid = site_hook("blocks.L.hook_resid_mid")
        self.hook_mlp_out = site_hook("blocks.L.hook_mlp_out")
        self.hook_resid_post = site_hook("blocks.L.hook_resid_post")

    def sublayers(self) -> list[Sublayer]:
        """The sublayers read the stream unnormed (no norm before either); ln1_post / ln2_post norm their outputs."""
        return [Sublayer("mixer", None, self.token_mixer, "hook_attn_out", post_norm=self.ln1_post),
                Sublayer("ffn", None, self.mlp, "hook_mlp_out", post_norm=self.ln2_post)]

    @property
    def first_norm(self) -> nn.Module:
        """The first norm the block runs (its weight's device is where the block runs): ln1_post."""
        return self.ln1_post

    def forward(
        self, resid: Float[torch.Tensor, "batch pos d_model"], inputs: LayerInputs
    ) -> Float[torch.Tensor, "batch pos d_model"]:
        resid = self.hook_resid_pre(resid)
        attn_out = self.hook_attn_out(self.ln1_post(self.token_mixer(self.attn_input(resid), inputs)))
        resid = self.hook_resid_mid(resid + attn_out)
        # a copy, as TransformerLens: an edit of hook_mlp_in reaches the MLP, not the residual add
        mlp_in = self.hook_mlp_in(resid.clone()) if self.use_hook_mlp_in else resid
        mlp_out = self.hook_mlp_out(self.ln2_post(self.mlp(mlp_in)))
        return self.hook_resid_post(resid + mlp_out)

    def attn_input(self, resid: Float[torch.Tensor, "batch pos d_model"]) -> torch.Tensor | SplitInputs:
        """The stream itself; with split inputs each head's hooked copy of it (as Block's, without ln1)."""
        attn_in = self.hook_attn_in(per_head(resid, self.n_heads)) if self.use_attn_in else None
        if self.use_split_qkv_input:
            return SplitInputs(self.hook_q_input(per_head(resid, self.n_heads)),
                               self.hook_k_input(per_head(resid, self.n_kv_heads)),
                               self.hook_v_input(per_head(resid, self.n_kv_heads)))
        if attn_in is not None:
            return SplitInputs(attn_in, attn_in, attn_in)
        return resid
