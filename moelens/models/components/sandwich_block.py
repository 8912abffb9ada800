"""Pre-norm blocks whose sublayer outputs are also RMS-normed before the add (sandwich norms).

- FeedForwardPostNormBlock: resid + mixer(ln1(resid)), then + ln2_post(ffn(ln2(.))): only the feed-forward's
  output is normed again (A.X K1's mixture blocks, whose post_mlp_layernorm ends the mixture);
- SandwichBlock: both outputs, resid + ln1_post(mixer(ln1(resid))), then + ln2_post(ffn(ln2(.))) (Kolibri 1's
  post_self_attn_layernorm and post_mlp_layernorm).

The norms after the sublayers carry TransformerLens's names for them (its Gemma-2 blocks): blocks.L.ln1_post and
blocks.L.ln2_post. hook_attn_out and hook_mlp_out hold what the stream adds (the normed outputs), so resid_post =
resid_pre + attn_out + mlp_out as in every block; a normed output is not a sum of its parts (the norm's scale
depends on all of them), which the decompositions read from Sublayer.post_norm."""

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


class FeedForwardPostNormBlock(Block):
    """A pre-norm block with a token mixer and a feed-forward (both required) whose feed-forward output is normed
    by ln2_post (spec.norm's class) before the add."""

    @classmethod
    def param_terms(cls, cfg: MoeConfig, layer: int, spec: LayerSpec) -> tuple[ParamTerm, ...]:
        norm = spec.norm.param_terms(cfg.d_model)
        return (under("ln1", norm) + under(spec.mixer.block_attribute, spec.mixer.param_terms(cfg, layer))
                + under("ln2", norm) + under("mlp", spec.ffn.param_terms(cfg, layer)) + cls._post_norm_terms(norm))

    @classmethod
    def _post_norm_terms(cls, norm: tuple[ParamTerm, ...]) -> tuple[ParamTerm, ...]:
        return under("ln2_post", norm)

    @classmethod
    def state_tensors(cls, cfg: MoeConfig, spec: LayerSpec):
        return spec.mixer.state_tensors(cfg)

    def __init__(self, cfg: MoeConfig, layer: int, spec: LayerSpec) -> None:
        if spec.mixer is None or spec.ffn is None:
            raise ValueError(f"{type(self).__name__} needs a token mixer and a feed-forward (LayerSpec with both)")
        if spec.residual_multiplier != 1.0:  # the normed outputs enter the stream as they are
            raise ValueError(f"{type(self).__name__} adds its normed outputs unscaled (residual_multiplier must be 1)")
        super().__init__(cfg, layer, spec)
        self.ln2_post = spec.norm(cfg.d_model, cfg.norm_eps, site="blocks.L.ln2_post")

    def sublayers(self) -> list[Sublayer]:
        return [Sublayer("mixer", self.ln1, self.token_mixer, "hook_attn_out", post_norm=self.mixer_post_norm()),
                Sublayer("ffn", self.ln2, self.mlp, "hook_mlp_out", post_norm=self.ln2_post)]

    def mixer_post_norm(self):
        """The norm of the token mixer's output (None: added as it is)."""
        return None

    def forward(
        self, resid: Float[torch.Tensor, "batch pos d_model"], inputs: LayerInputs
    ) -> Float[torch.Tensor, "batch pos d_model"]:
        resid = self.hook_resid_pre(resid)
        attn_out = self.token_mixer(self.attn_input(resid), inputs)
        post = self.mixer_post_norm()
        attn_out = self.hook_attn_out(attn_out if post is None else post(attn_out))
        resid = self.hook_resid_mid(resid + attn_out)
        # a copy, as TransformerLens: an edit of hook_mlp_in reaches the MLP, not the residual add
        mlp_in = self.hook_mlp_in(resid.clone()) if self.use_hook_mlp_in else resid
        mlp_out = self.hook_mlp_out(self.ln2_post(self.mlp(self.ln2(mlp_in))))
        return self.hook_resid_post(resid + mlp_out)


class SandwichBlock(FeedForwardPostNormBlock):
    """Both sublayers' outputs normed before the add: ln1_post after the token mixer, ln2_post after the
    feed-forward."""

    @classmethod
    def _post_norm_terms(cls, norm: tuple[ParamTerm, ...]) -> tuple[ParamTerm, ...]:
        return under("ln1_post", norm) + under("ln2_post", norm)

    def __init__(self, cfg: MoeConfig, layer: int, spec: LayerSpec) -> None:
        super().__init__(cfg, layer, spec)
        self.ln1_post = spec.norm(cfg.d_model, cfg.norm_eps, site="blocks.L.ln1_post")

    def mixer_post_norm(self):
        return self.ln1_post
