"""Sandwich-norm block (Gemma-2's arrangement; AFMoE): each sublayer reads its pre-norm of the stream and its
output is normed again before the add: resid + ln1_post(attn(ln1(resid))), then + ln2_post(mlp(ln2(.))).

The norms carry TransformerLens's names for them (its Gemma-2 blocks): blocks.L.ln1 / ln2 before the
sublayers, blocks.L.ln1_post / ln2_post after. hook_attn_out and hook_mlp_out hold the post-normed outputs,
what the stream adds, so resid_post = resid_pre + attn_out + mlp_out as in every block; attn_out is then not a
sum of per-head terms (the post-norm's scale depends on every head), and a post-norm's weight folds into nothing
(fold_ln moves only the pre-norms' weights)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from jaxtyping import Float

from moelens.config import MoeConfig
from moelens.models.components.block import Block, Sublayer
from moelens.models.context import LayerInputs
from moelens.models.terms import ParamTerm, under

if TYPE_CHECKING:
    from moelens.models.recipe import LayerSpec


class SandwichNormBlock(Block):
    """A token mixer and a feed-forward (both required), each between two norms of spec.norm's class."""

    @classmethod
    def param_terms(cls, cfg: MoeConfig, layer: int, spec: LayerSpec) -> tuple[ParamTerm, ...]:
        norm = spec.norm.param_terms(cfg.d_model)
        # in the order the module registers them (Block's, then the post-norms)
        return (under("ln1", norm) + under(f"{spec.mixer.block_attribute}", spec.mixer.param_terms(cfg, layer))
                + under("ln2", norm) + under("mlp", spec.ffn.param_terms(cfg, layer)) + under("ln1_post", norm)
                + under("ln2_post", norm))

    @classmethod
    def state_tensors(cls, cfg: MoeConfig, spec: LayerSpec):
        return spec.mixer.state_tensors(cfg)

    def __init__(self, cfg: MoeConfig, layer: int, spec: LayerSpec) -> None:
        if spec.mixer is None or spec.ffn is None:
            raise ValueError("a sandwich-norm block needs a token mixer and a feed-forward (LayerSpec with both)")
        super().__init__(cfg, layer, spec)
        self.ln1_post = spec.norm(cfg.d_model, cfg.norm_eps, site="blocks.L.ln1_post")
        self.ln2_post = spec.norm(cfg.d_model, cfg.norm_eps, site="blocks.L.ln2_post")

    def sublayers(self) -> list[Sublayer]:
        return [Sublayer("mixer", self.ln1, self.token_mixer, "hook_attn_out", post_norm=self.ln1_post),
                Sublayer("ffn", self.ln2, self.mlp, "hook_mlp_out", post_norm=self.ln2_post)]

    def forward(
        self, resid: Float[torch.Tensor, "batch pos d_model"], inputs: LayerInputs
    ) -> Float[torch.Tensor, "batch pos d_model"]:
        resid = self.hook_resid_pre(resid)
        attn_out = self.hook_attn_out(self.scaled(self.ln1_post(self.token_mixer(self.attn_input(resid), inputs))))
        resid = self.hook_resid_mid(resid + attn_out)
        # a copy, as TransformerLens: an edit of hook_mlp_in reaches the MLP, not the residual add
        mlp_in = self.hook_mlp_in(resid.clone()) if self.use_hook_mlp_in else resid
        mlp_out = self.hook_mlp_out(self.scaled(self.ln2_post(self.mlp(self.ln2(mlp_in)))))
        return self.hook_resid_post(resid + mlp_out)
