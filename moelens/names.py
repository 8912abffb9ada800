"""The hook vocabulary: every site's name, layout, meaning and the family notes' standard name.

Written once here so that support(), print(model), ActivationCache aliases and the docs agree.
Names are relative to the model root; ``L`` stands for a block index.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Site:
    name: str  # e.g. "blocks.L.mlp.hook_router_logits"
    layout: str
    meaning: str
    standard: str | None = None  # family notes' (nnterp) name
    short: str | None = None  # TransformerLens-style short name, as in cache["resid_post", 3]


SITES: tuple[Site, ...] = (
    Site("hook_embed", "batch pos d_model", "token embeddings", "token_embeddings", "embed"),
    Site("blocks.L.hook_resid_pre", "batch pos d_model", "residual stream entering the block", "layer_input", "resid_pre"),
    Site("blocks.L.ln1.hook_scale", "batch pos 1", "RMS of the block input (x / scale * w is the norm's output)", None, "scale"),
    Site("blocks.L.ln1.hook_normalized", "batch pos d_model", "normed stream entering attention", "attention_norm_output", "normalized"),
    Site("blocks.L.attn.hook_q", "batch pos head d_head", "query projection (bias included)", None, "q"),
    Site("blocks.L.attn.hook_k", "batch pos kv_head d_head", "key projection (bias included)", None, "k"),
    Site("blocks.L.attn.hook_v", "batch pos kv_head d_head", "value projection (bias included)", "attention_values", "v"),
    Site("blocks.L.attn.hook_rot_q", "batch pos head d_head", "queries entering attention (after rotary, and q norm where the family has one)", "attention_queries", "rot_q"),
    Site("blocks.L.attn.hook_rot_k", "batch pos kv_head d_head", "keys entering attention (after rotary, and k norm where the family has one)", "attention_keys", "rot_k"),
    Site("blocks.L.attn.hook_attn_scores", "batch head query key", "scaled, masked scores before the softmax", "attention_scores", "attn_scores"),
    Site("blocks.L.attn.hook_pattern", "batch head query key", "attention probabilities", "attention_probabilities", "pattern"),
    Site("blocks.L.attn.hook_z", "batch pos head d_head", "per-head outputs before the output projection", "attention_head_outputs", "z"),
    Site("blocks.L.hook_attn_out", "batch pos d_model", "what attention adds to the residual stream", "attention_output", "attn_out"),
    Site("blocks.L.hook_resid_mid", "batch pos d_model", "residual stream after the attention add", "layer_mid", "resid_mid"),
    Site("blocks.L.ln2.hook_scale", "batch pos 1", "RMS of the mid stream", None, None),
    Site("blocks.L.ln2.hook_normalized", "batch pos d_model", "normed stream entering the MLP", "mlp_norm_output", None),
    # dense MLP blocks
    Site("blocks.L.mlp.hook_pre", "batch pos d_mlp", "dense MLP gate pre-activation", None, "pre"),
    Site("blocks.L.mlp.hook_pre_linear", "batch pos d_mlp", "dense MLP up projection", None, "pre_linear"),
    Site("blocks.L.mlp.hook_post", "batch pos d_mlp", "dense MLP neurons: act(gate) * up", "mlp_neurons", "post"),
    # mixture blocks
    Site("blocks.L.mlp.hook_router_logits", "batch pos n_experts", "router logits, before scoring", "router_logits", "router_logits"),
    Site("blocks.L.mlp.hook_router_scores", "batch pos n_experts", "softmax / sigmoid scores of every expert (float32)", None, "router_scores"),
    Site("blocks.L.mlp.hook_choice_scores", "batch pos n_experts", "scores the top-k is taken on (scores + correction bias)", None, "choice_scores"),
    Site("blocks.L.mlp.hook_expert_indices", "batch pos top_k", "expert each routing slot sends the token to", "expert_indices", "expert_indices"),
    Site("blocks.L.mlp.hook_expert_weights", "batch pos top_k", "weight of each slot's expert output", "expert_weights", "expert_weights"),
    Site("blocks.L.mlp.experts.hook_pre", "batch pos top_k d_expert", "gate pre-activation per slot", None, "expert_pre"),
    Site("blocks.L.mlp.experts.hook_pre_linear", "batch pos top_k d_expert", "up projection per slot", None, "expert_pre_linear"),
    Site("blocks.L.mlp.experts.hook_post", "batch pos top_k d_expert", "expert neurons per slot: act(gate) * up", "mlp_neurons", "expert_post"),
    Site("blocks.L.mlp.hook_expert_outputs", "batch pos top_k d_model", "weighted output of each slot", "expert_outputs", "expert_outputs"),
    Site("blocks.L.mlp.hook_routed_out", "batch pos d_model", "routed experts' combined output", "routed_output", "routed_out"),
    Site("blocks.L.mlp.shared_expert.hook_pre", "batch pos d_shared", "shared expert gate pre-activation", None, "shared_pre"),
    Site("blocks.L.mlp.shared_expert.hook_pre_linear", "batch pos d_shared", "shared expert up projection", None, "shared_pre_linear"),
    Site("blocks.L.mlp.shared_expert.hook_post", "batch pos d_shared", "shared expert neurons", None, "shared_post"),
    Site("blocks.L.mlp.shared_expert.hook_out", "batch pos d_model", "shared expert output, ungated", None, "shared_expert_out"),
    Site("blocks.L.mlp.hook_shared_gate", "batch pos 1", "shared expert gate logit, before the sigmoid", None, "shared_gate"),
    Site("blocks.L.mlp.hook_shared_out", "batch pos d_model", "shared expert output as added to the routed sum", "shared_expert_output", "shared_out"),
    Site("blocks.L.hook_mlp_out", "batch pos d_model", "what the MLP / mixture adds to the residual stream", "mlp_output", "mlp_out"),
    Site("blocks.L.hook_resid_post", "batch pos d_model", "residual stream leaving the block", "layer_output", "resid_post"),
    Site("ln_final.hook_scale", "batch pos 1", "RMS of the final residual stream", None, None),
    Site("ln_final.hook_normalized", "batch pos d_model", "final normed stream, what the unembedding reads", "final_norm_output", None),
    Site("hook_logits", "batch pos d_vocab", "logits", "logits", "logits"),
)

_BY_PATTERN: dict[str, Site] = {s.name: s for s in SITES}
_ALIASES: dict[str, list[str]] = {}
for _s in SITES:
    for _alias in {_s.short, _s.standard} - {None}:
        _ALIASES.setdefault(_alias, []).append(_s.name)  # mlp_neurons: the dense MLP's, else the experts'
for _alias, _pattern in {
    "mlp_input": "blocks.L.ln2.hook_normalized",
    "ln1_normalized": "blocks.L.ln1.hook_normalized",
    "ln2_normalized": "blocks.L.ln2.hook_normalized",
    "ln_final_normalized": "ln_final.hook_normalized",
}.items():
    _ALIASES.setdefault(_alias, []).append(_pattern)

_LAYER_RE = re.compile(r"^blocks\.(\d+)\.")


def site_pattern(hook_name: str) -> str:
    """'blocks.3.mlp.hook_router_logits' -> 'blocks.L.mlp.hook_router_logits'."""
    return _LAYER_RE.sub("blocks.L.", hook_name)


def site_for(hook_name: str) -> Site | None:
    return _BY_PATTERN.get(site_pattern(hook_name))


def layer_of(hook_name: str) -> int | None:
    m = _LAYER_RE.match(hook_name)
    return int(m.group(1)) if m else None


def alias_candidates(name: str, layer: int | None = None) -> list[str]:
    """Full hook names an alias may stand for, in preference order.

    ('router_logits', 3) -> ['blocks.3.mlp.hook_router_logits']; ('layer_output', 0) ->
    ['blocks.0.hook_resid_post']; a name that is not an alias is returned as it is.
    """
    patterns = _ALIASES.get(name, [name])
    if any("blocks.L." in p for p in patterns):
        if layer is None:
            raise KeyError(f"{name!r} is a per-block site: give a layer, e.g. cache[{name!r}, 0]")
        return [p.replace("blocks.L.", f"blocks.{layer}.") for p in patterns]
    return patterns


def aliases() -> dict[str, list[str]]:
    return {k: list(v) for k, v in _ALIASES.items()}
