"""The logit lens of each routed expert (MoE Lens): what each chosen expert's output says through the final
norm and the unembedding, and how close the top-1 expert's output is to the whole mixture's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from jaxtyping import Bool, Float, Int

from moelens.analysis.data import Mask, _one_batch, resolve_layers
from moelens.hooks.points import HookPoint

Mixture = Literal["routed", "mlp"]
MIXTURE_SITE = {"routed": "blocks.{layer}.mlp.hook_routed_out", "mlp": "blocks.{layer}.hook_mlp_out"}


@dataclass(frozen=True)
class ExpertLens:
    """Slots are sorted by routing weight, largest first: slot 0 is the top-1 expert.

    experts, weights [batch pos top_k]: each slot's expert and routing weight; top_ids, top_logits
    [batch pos top_k top]: the slot's weighted output (hook_expert_outputs) through ln_final and the
    unembedding, its ``top`` tokens (highest logit first); mixture_top_ids / mixture_top_logits
    [batch pos top]: the same of the mixture's output (``mixture``); cosine [batch pos]: cosine similarity
    of the top-1 slot's output with the mixture's output, in the residual stream; valid: the real tokens
    (padding's numbers are computed but mean nothing)."""

    layer: int
    mixture: Mixture
    tokens: Int[torch.Tensor, "batch pos"]
    valid: Bool[torch.Tensor, "batch pos"]
    experts: Int[torch.Tensor, "batch pos top_k"]
    weights: Float[torch.Tensor, "batch pos top_k"]
    top_ids: Int[torch.Tensor, "batch pos top_k top"]
    top_logits: Float[torch.Tensor, "batch pos top_k top"]
    mixture_top_ids: Int[torch.Tensor, "batch pos top"]
    mixture_top_logits: Float[torch.Tensor, "batch pos top"]
    cosine: Float[torch.Tensor, "batch pos"]

    def __str__(self) -> str:
        real = self.cosine[self.valid]
        lines = [f"logit lens of layer {self.layer}'s experts; cosine(top-1 expert, {self.mixture} output): "
                 f"mean {float(real.mean()):.3f}, min {float(real.min()):.3f} over {real.numel()} tokens"]
        for b in range(self.tokens.shape[0]):
            for p in range(self.tokens.shape[1]):
                if not self.valid[b, p]:
                    continue
                slots = "  ".join(f"E{int(self.experts[b, p, k])} {self.top_ids[b, p, k].tolist()}" for k in range(self.experts.shape[-1]))
                lines.append(f"  [{b},{p}] token {int(self.tokens[b, p])} cos {float(self.cosine[b, p]):.3f}  "
                             f"mixture {self.mixture_top_ids[b, p].tolist()}  {slots}")
        return "\n".join(lines)


def lens_logits(model, x: Float[torch.Tensor, "... d_model"]) -> Float[torch.Tensor, "... d_vocab"]:
    """The logit lens of vectors: the model's own ln_final (each vector normed on its own, as if it were the
    residual stream) and unembedding, in the forward's arithmetic. A hook left on ln_final's sites would edit
    these vectors as if they were the stream: refused, naming it."""
    norm = model.ln_final
    hooked = [p.name for p in norm.modules() if isinstance(p, HookPoint) and p.has_hooks]
    if hooked:
        raise ValueError(f"the logit lens runs ln_final on expert outputs: remove the hooks on {hooked} first (or run it outside model.hooks())")
    return model.unembed(norm(x.to(norm.weight.device)).to(model.unembed.weight.device))


@torch.no_grad()
def expert_logit_lens(
    model,
    tokens: Int[torch.Tensor, "batch pos"] | str | list[str],
    layer: int,
    top: int = 10,
    mixture: Mixture = "routed",
    attention_mask: Mask | None = None,
) -> ExpertLens:
    """MoE Lens (Chaudhari et al., "MoE Lens - An Expert Is All You Need"): the logit lens (nostalgebraist
    2020) applied to each routed expert's output at ``layer``: per (token, slot), the top tokens of
    unembed(ln_final(weighted expert output)), and the cosine similarity between the top-1 expert's output and
    the whole mixture's, which the paper finds high (up to 0.95 in DeepSeekMoE's layers: the top-weighted expert
    carries most of the layer's contribution).

    The expert output is hook_expert_outputs (each slot's output times its routing weight: they sum to
    hook_routed_out; the weight does not change the cosine, and changes the logits only through the norm's
    epsilon). mixture: "routed" (hook_routed_out, the routed experts' sum) or "mlp" (hook_mlp_out: with the
    shared expert, and the post-norm where the block has one). ln_final norms each vector on its own, as the
    logit lens does a residual stream (not the stream's own scale: that is direct logit attribution,
    ``cache.apply_ln_to_stack``)."""
    if mixture not in MIXTURE_SITE:
        raise ValueError(f"mixture must be 'routed' or 'mlp', got {mixture!r}")
    (layer,) = resolve_layers(model, layer)
    tokens, valid = _one_batch(model, tokens, attention_mask)
    slot_site, mix_site = f"blocks.{layer}.mlp.hook_expert_outputs", MIXTURE_SITE[mixture].format(layer=layer)
    idx_site, w_site = f"blocks.{layer}.mlp.hook_expert_indices", f"blocks.{layer}.mlp.hook_expert_weights"
    mask = None if bool(valid.all()) else valid.long()
    _, cache = model.run_with_cache(tokens, names_filter=[slot_site, mix_site, idx_site, w_site], attention_mask=mask,
                                    stop_at_layer=layer + 1)
    weights = cache[w_site]
    order = weights.float().argsort(dim=-1, descending=True, stable=True)
    outs = cache[slot_site].gather(2, order[..., None].expand(-1, -1, -1, cache[slot_site].shape[-1]))
    mix = cache[mix_site]
    k = min(top, model.cfg.d_vocab)
    slot_top = lens_logits(model, outs).topk(k, -1)
    mix_top = lens_logits(model, mix).topk(k, -1)
    cosine = torch.nn.functional.cosine_similarity(outs[:, :, 0].float(), mix.float().to(outs.device), dim=-1)
    return ExpertLens(
        layer=layer, mixture=mixture, tokens=tokens, valid=valid,
        experts=cache[idx_site].gather(-1, order), weights=weights.gather(-1, order),
        top_ids=slot_top.indices, top_logits=slot_top.values,
        mixture_top_ids=mix_top.indices, mixture_top_logits=mix_top.values, cosine=cosine,
    )
