"""Weight processing: fold RMSNorm weights into their readers, center the unembedding (in place).

fold_layer_norm: an RMSNorm computes w * n with n = x / rms(x), and every reader is linear in its input,
so W @ (w * n) = (W * w) @ n. The weight of ln1 goes into q/k/v projections, of ln2 into every weight the
MLP's parts read their input with (block.mlp.parts(), input_weights: the router, the experts' gate and up
rows, a shared expert's gate and up projections and its gate's map where it has one, a dense block's gate and
up), of ln_final into the unembedding; then each norm's weight is set to 1.
Biases are added after the projection and do not change. Everything linear is unchanged up to rounding.

Routing is not linear: the top-k choice is discontinuous, so a rounding-sized change of a router logit can
swap two near-tied experts, and then a token's mixture output (and everything after it) changes by far more
than rounding. No weight processing can promise the same routing. fold_layer_norm therefore measures it:
it runs a probe batch before and after folding and reports, per mixture layer, how many probe tokens'
chosen experts changed (RoutingChanges; from_pretrained(fold_ln=True) warns when any did and keeps the
report as model.routing_changes).

Not folded: Hunyuan's per-head q/k norms. They normalise each head *after* the rotary, so their weight
multiplies rotated coordinates (the rotary mixes pairs of dimensions) and their scale depends on the rotated
vector; neither commutes into q_proj / k_proj. They are left as they are.

center_unembed: subtracting from every vocabulary row of the unembedding the mean row changes each logit by
the same amount at a position (n . mean_row), so the softmax, the loss and logit differences are unchanged.

Both untie a tied unembedding first (the embedding must not change) and record that in model.cfg.
Each product is computed in float32 and written back in the parameter's own dtype (Hunyuan's and Solar's
routers stay float32 in a bfloat16 model).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from moelens.models.base import HookedTransformer


def _scale_inputs(param: torch.Tensor, w: torch.Tensor) -> None:
    """param [..., d_in] <- param * w over its input (last) axis."""
    param.copy_(param.float() * w)


PROBE_SHAPE = (4, 64)  # batch, positions of random token ids (seeded) run before and after folding
PROBE_SEED = 0


@dataclass(frozen=True)
class RoutingChanges:
    """Of `probe_tokens` tokens, how many had a different set of chosen experts after weight processing,
    per mixture layer. Routing is discontinuous, so near-tied choices can flip under any re-rounding."""

    probe_tokens: int
    per_layer: dict[int, int]

    @property
    def total(self) -> int:
        return sum(self.per_layer.values())

    def __str__(self) -> str:
        changed = ", ".join(f"layer {layer}: {n}" for layer, n in self.per_layer.items() if n) or "none"
        return f"routing changed for {self.total} of {self.probe_tokens} probe token-layers ({changed})"


def probe_tokens(model: HookedTransformer) -> torch.Tensor:
    batch, pos = PROBE_SHAPE
    pos = min(pos, model.cfg.max_position_embeddings)
    gen = torch.Generator().manual_seed(PROBE_SEED)
    return torch.randint(0, model.cfg.d_vocab, (batch, pos), generator=gen).to(model.device)


def chosen_experts(model: HookedTransformer, tokens: torch.Tensor) -> dict[int, torch.Tensor]:
    """Per mixture layer, each token's chosen experts as a sorted set ([batch pos top_k])."""
    names = [f"blocks.{layer}.mlp.hook_expert_indices" for layer in model.cfg.moe_layer_indices]
    _, cache = model.run_with_cache(tokens, names_filter=names, return_type=None)
    return {layer: cache[name].sort(-1).values for layer, name in zip(model.cfg.moe_layer_indices, names)}


def fold_ln_refusal(model: HookedTransformer) -> str | None:
    """Why fold_ln cannot fold this model's norms (fold_layer_norm raises it as a ValueError), or None."""
    routed = [part.module for block in model.blocks for sub in block.sublayers() if sub.kind == "ffn"
              for part in sub.module.parts() if part.kind == "routed"]
    identity = next((experts.spec for experts in routed if experts.spec.n_identity), None)
    if identity is not None:  # weight * ln2(x) reads the normed stream itself: no weight to fold ln2's into
        return (f"fold_ln cannot fold the mixtures' norms: their experts include identity experts ({identity.describe()}), "
                "whose output is the normed stream itself; load with fold_ln=False")
    kept = next((layer for layer, block in enumerate(model.blocks) if block.keeps_normed_stream), None)
    if kept is not None:  # the block keeps its norms' outputs (weight included) as its stream: nothing to fold into
        return (f"fold_ln cannot fold block {kept}'s norms: {type(model.blocks[kept]).__name__} keeps their outputs, "
                "weights included, as its residual stream; load with fold_ln=False")
    stored = next((experts.spec.storage for experts in routed if experts.spec.storage), None)
    if stored is not None:  # their tensors() are dequantized copies: scaling those would fold nothing
        return (f"fold_ln rewrites the routed experts' gate and up rows, which this model keeps stored as {stored!r} "
                "(from_pretrained(expert_storage=...)): load with expert_storage=None to fold")
    biased = next((name for name, norm in _norms(model) if getattr(norm, "bias", None) is not None), None)
    if biased is not None:  # W (w * n + b) = (W * w) n + W b: the router and experts have no bias to take W b
        return (f"fold_ln cannot fold {biased}: it is a LayerNorm with a bias, and the router and experts that read it "
                "have no bias to take it; load with fold_ln=False")
    return None


@torch.no_grad()
def fold_layer_norm(model: HookedTransformer) -> RoutingChanges:
    """Fold every RMSNorm weight (every sublayer's norm, ln_final) into its readers and set the norm weights to 1;
    return how many tokens of a probe batch had their routing changed by it."""
    refusal = fold_ln_refusal(model)
    if refusal is not None:
        raise ValueError(refusal)
    probe = probe_tokens(model)
    before = chosen_experts(model, probe)
    for block in model.blocks:
        # each sublayer's norm into everything that reads its output; the weights read before any norm is made
        # the identity, since a norm may feed several sublayers (LongCat-Flash's ln2: the mixture and dense_0)
        # (a post-norm block's sublayers read the stream unnormed: nothing to fold, and its post-norms stay)
        subs = [(sub, sub.norm.effective_weight().float()) for sub in block.sublayers() if sub.norm is not None]
        for sub, w in subs:
            for weight in _readers(sub):  # biases are added after the weight and do not change
                _scale_inputs(weight, w)
        for sub, _ in subs:
            sub.norm.make_identity()
    untie(model)
    _scale_inputs(model.unembed.weight, model.ln_final.effective_weight().float())
    model.ln_final.make_identity()
    after = chosen_experts(model, probe)
    per_layer = {layer: int((before[layer] != after[layer]).any(-1).sum()) for layer in before}
    return RoutingChanges(probe.numel(), per_layer)


def _norms(model: HookedTransformer) -> list[tuple[str, nn.Module]]:
    """Every norm fold_layer_norm folds (each sublayer's input norm, where it has one, and ln_final), with its
    module name."""
    names = {module: name for name, module in model.named_modules()}
    return [(names[sub.norm], sub.norm) for block in model.blocks for sub in block.sublayers()
            if sub.norm is not None] + [("ln_final", model.ln_final)]


def _readers(sub) -> list[torch.Tensor]:
    """The weights that read a sublayer's normed input: a mixer's input projections, a feed-forward's parts'."""
    if sub.kind == "mixer":
        return [proj.weight for proj in sub.module.input_projections()]
    return [weight for part in sub.module.parts() for weight in part.input_weights()]


@torch.no_grad()
def center_unembed(model: HookedTransformer) -> None:
    """Subtract the mean over the vocabulary from W_U (each logit moves by a per-position constant)."""
    if model.unembed.softcap is not None:  # a constant shift before the cap is no constant shift after it
        raise ValueError(f"center_unembed: the logits are softcapped (cap {model.unembed.softcap}): shifting the "
                         "unembedding's output by a per-position constant would change the probabilities")
    untie(model)
    W = model.unembed.weight  # [d_vocab, d_model]: the mean row over the vocabulary
    W.copy_(W.float() - W.float().mean(0, keepdim=True))


def untie(model: HookedTransformer, device: torch.device | None = None) -> None:
    """Give the unembedding its own copy of a tied embedding matrix (on `device`, default the embedding's),
    so that editing it leaves W_E alone, or so that it can live on another device."""
    if model.unembed.weight is model.embed.weight:
        tied = model.embed.weight
        copy = tied.detach().to(device or tied.device, copy=True)
        model.unembed.weight = nn.Parameter(copy, requires_grad=tied.requires_grad)
    if model.cfg.tie_word_embeddings:
        model.cfg = dataclasses.replace(model.cfg, tie_word_embeddings=False)
