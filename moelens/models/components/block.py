"""Pre-norm transformer block, built from its layer's recipe (moelens.models.recipe.LayerSpec): resid + mixer(ln1(resid)),
then + ffn(ln2(.)); every stream hooked. A layer without a mixer or without a feed-forward has only the other
sublayer (and no hook_resid_mid).

With a residual multiplier m (Granite's muP), each sublayer adds m * its module's output: hook_attn_out and
hook_mlp_out hold that product, so resid_pre + attn_out = resid_mid and resid_mid + mlp_out = resid_post still
hold exactly; the sites inside a sublayer (hook_z, hook_result, hook_routed_out, hook_shared_out, ...) hold the
module's own tensors, before m (the decompositions read it as block.residual_multiplier)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, NamedTuple

import torch
from jaxtyping import Float
from torch import nn

from moelens.config import MoeConfig
from moelens.hooks.sites import site_hook, switched_sites
from moelens.models.components.attention import SplitInputs
from moelens.models.context import LayerInputs

if TYPE_CHECKING:
    from moelens.models.recipe import LayerSpec


# TransformerLens's optional per-block hooks, by switch: the table's block sites each exists only while its
# switch (model.set_use_split_qkv_input / set_use_attn_in / set_use_hook_mlp_in) is on
OPTIONAL_HOOKS: dict[str, tuple[str, ...]] = {
    switch: tuple(s.name for s in switched_sites(f"set_use_{switch}") if s.name.startswith("blocks.L.hook_"))
    for switch in ("split_qkv_input", "attn_in", "hook_mlp_in")
}


def per_head(x: Float[torch.Tensor, "batch pos d_model"], n_heads: int) -> Float[torch.Tensor, "batch pos head d_model"]:
    """n_heads copies of the stream, each its own memory (an edit of one head's copy leaves the others)."""
    return x[:, :, None, :].expand(-1, -1, n_heads, -1).clone()


class Sublayer(NamedTuple):
    """One term a block adds to its residual stream: the norm that reads the stream, the module, and the hook
    holding what it adds (hook_attn_out for the token mixer, hook_mlp_out for the feed-forward); post_norm, the
    norm applied to the module's output before the add (a post-norm block), or None: the output is added as is."""

    kind: str  # "mixer" or "ffn"
    norm: nn.Module | None  # None: the sublayer reads the stream unnormed (a post-norm block)
    module: nn.Module
    out_hook: str  # the block's attribute name of the output hook
    post_norm: nn.Module | None = None

    @property
    def name(self) -> str:
        """What the output hook names the sublayer: "attn", "mlp" (LongCat-Flash's also "dense_0", "attn_1", ...);
        a softmax attention sublayer is the block's attribute of that name."""
        return self.out_hook.removeprefix("hook_").removesuffix("_out")

    @property
    def is_attention(self) -> bool:
        """A token mixer that is softmax attention (heads, W_Q, patterns; blocks.L.<name>.hook_z)."""
        return self.kind == "mixer" and self.module.block_attribute == "attn"


class Block(nn.Module):
    # the switches of OPTIONAL_HOOKS, off by default (set per instance by set_optional_hooks)
    use_split_qkv_input = False
    use_attn_in = False
    use_hook_mlp_in = False

    def __init__(self, cfg: MoeConfig, layer: int, spec: LayerSpec) -> None:
        super().__init__()
        self.is_moe = spec.is_moe
        self.residual_multiplier = spec.residual_multiplier
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.mixer_attribute: str | None = None  # "attn" (softmax attention) or "mixer"; None: no token mixer
        # registered in this order (modules, then the block's hooks) so names, parameters and hooks keep it
        if spec.mixer is not None:
            self.ln1 = spec.norm(cfg.d_model, cfg.norm_eps, site="blocks.L.ln1")
            mixer = spec.mixer(cfg, layer)
            # the split key / value inputs are one per kv head of this attention (they may differ by layer type)
            self.n_kv_heads = getattr(mixer, "n_kv_heads", cfg.n_kv_heads)
            self.mixer_attribute = mixer.block_attribute
            setattr(self, self.mixer_attribute, mixer)
        if spec.ffn is not None:
            self.ln2 = spec.norm(cfg.d_model, cfg.norm_eps, site="blocks.L.ln2")
            self.mlp: nn.Module = spec.ffn.build(cfg, layer)
        self.hook_resid_pre = site_hook("blocks.L.hook_resid_pre")
        if spec.mixer is not None:
            self.hook_attn_out = site_hook("blocks.L.hook_attn_out")
        if spec.mixer is not None and spec.ffn is not None:
            self.hook_resid_mid = site_hook("blocks.L.hook_resid_mid")
        if spec.ffn is not None:
            self.hook_mlp_out = site_hook("blocks.L.hook_mlp_out")
        self.hook_resid_post = site_hook("blocks.L.hook_resid_post")

    @property
    def has_attention(self) -> bool:
        """Its token mixer is softmax attention (blocks.L.attn: heads, W_Q, patterns); False for a linear or
        state-space mixer (blocks.L.mixer) and for a layer without a token mixer."""
        return self.mixer_attribute == "attn"

    @property
    def has_ffn(self) -> bool:
        """It has a feed-forward sublayer (dense MLP or mixture: blocks.L.mlp, hook_mlp_out)."""
        return hasattr(self, "mlp")

    def post_norm(self, kind: str) -> nn.Module | None:
        """The norm applied to the output of the block's `kind` sublayer ("mixer" or "ffn") before the add, or
        None where the output is added as it is (then it is linear in its parts: heads, experts, neurons)."""
        return next((sub.post_norm for sub in self.sublayers() if sub.kind == kind), None)

    @property
    def token_mixer(self) -> nn.Module | None:
        """The layer's token mixer (softmax attention as block.attn, another kind as block.mixer), or None."""
        return None if self.mixer_attribute is None else getattr(self, self.mixer_attribute)

    def output_multiplier(self, kind: str) -> float:
        """What the `kind` sublayer's ("mixer" / "ffn") output is multiplied by as the stream receives it, after
        its post-norm where it has one (the residual multiplier)."""
        return self.residual_multiplier

    # resid_post = resid_pre + the sublayers' outputs (False: the block also rescales the stream it carries, as
    # Beam's depth-scaled residual adds, or keeps another one, as MiniMax's; the decompositions into sublayer
    # outputs refuse it)
    stream_is_sum: ClassVar[bool] = True
    # the block's stream is its norms' outputs (weights included), scaled, plus the sublayers' (MiniMax's): fold_ln
    # has no linear map to fold those norms into
    keeps_normed_stream: ClassVar[bool] = False

    def sublayers(self) -> list[Sublayer]:
        """What the block adds to its stream, in order: resid_post = resid_pre + the sublayers' outputs."""
        out = []
        if self.mixer_attribute is not None:
            out.append(Sublayer("mixer", self.ln1, self.token_mixer, "hook_attn_out"))
        if hasattr(self, "mlp"):
            out.append(Sublayer("ffn", self.ln2, self.mlp, "hook_mlp_out"))
        return out

    def ffn_input_sublayers(self) -> list[Sublayer]:
        """The block's own sublayers whose outputs are in the stream its first feed-forward reads: those before
        it (resid_mid = resid_pre + attn_out); none in a block whose sublayers all read resid_pre (a parallel one)."""
        out = []
        for sub in self.sublayers():
            if sub.kind == "ffn":
                break
            out.append(sub)
        return out

    def new_state(self, reserve: int = 0):
        """The block's empty state for a cache: its token mixer's (a block of several mixers holds one each)."""
        return self.token_mixer.new_state(reserve)

    def attention_sublayers(self) -> list[Sublayer]:
        """The sublayers that are softmax attention, in order: none, "attn", or several (LongCat-Flash's "attn",
        "attn_1"). The attention switches and backend reach each of them."""
        return [s for s in self.sublayers() if s.is_attention]

    def norm_name(self, norm: nn.Module) -> str:
        """The block's attribute name of one of its norms ("ln1", "ln2", "ln1_1", ...)."""
        for name, child in self.named_children():
            if child is norm:
                return name
        raise ValueError(f"{type(norm).__name__} is not one of this block's norms")

    @property
    def first_norm(self) -> nn.Module:
        """The norm of the first sublayer (its weight's device is where the block runs)."""
        return self.sublayers()[0].norm

    @property
    def first_norm_name(self) -> str:
        """The name of the norm reading resid_pre: "ln1", or "ln2" in a block whose only sublayer is its
        feed-forward."""
        return self.norm_name(self.first_norm)

    @property
    def has_resid_mid(self) -> bool:
        """Whether the block hooks hook_resid_mid, the stream its feed-forward (ln2, the mixture) reads after a
        token mixer; a block of one sublayer has none (its feed-forward, if any, reads resid_pre)."""
        return hasattr(self, "hook_resid_mid")

    def forward(
        self, resid: Float[torch.Tensor, "batch pos d_model"], inputs: LayerInputs
    ) -> Float[torch.Tensor, "batch pos d_model"]:
        resid = self.hook_resid_pre(resid)
        if self.mixer_attribute is not None:
            attn_out = self.hook_attn_out(self.scaled(self.token_mixer(self.attn_input(resid), inputs)))
            resid = resid + attn_out
            if not hasattr(self, "mlp"):
                return self.hook_resid_post(resid)
            resid = self.hook_resid_mid(resid)
        # a copy, as TransformerLens: an edit of hook_mlp_in reaches the MLP, not the residual add
        mlp_in = self.hook_mlp_in(resid.clone()) if self.use_hook_mlp_in else resid
        mlp_out = self.hook_mlp_out(self.scaled(self.mlp(self.ln2(mlp_in))))
        return self.hook_resid_post(resid + mlp_out)

    def scaled(self, out: Float[torch.Tensor, "batch pos d_model"]) -> Float[torch.Tensor, "batch pos d_model"]:
        """A sublayer's output as the stream receives it: times the residual multiplier (in the output's dtype,
        as the reference multiplies); untouched where it is 1."""
        return out if self.residual_multiplier == 1.0 else out * self.residual_multiplier

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
