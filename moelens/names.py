"""The hook vocabulary's names: every site's full name, the family notes' standard name and the short
TransformerLens-style alias, so that cache["router_logits", 3] and get_act_name agree.

Layouts and meanings are not here: each is written once, where its HookPoint is declared.
Names are relative to the model root; ``L`` stands for a block index.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Site:
    """A hook site's names; its layout and meaning are declared on its HookPoint (see model.support())."""

    name: str  # e.g. "blocks.L.mlp.hook_router_logits"
    standard: str | None = None  # family notes' (nnterp) name
    short: str | None = None  # TransformerLens-style short name, as in cache["resid_post", 3]


# Every site some family has, in forward order.
SITES: tuple[Site, ...] = (
    Site("hook_embed", "token_embeddings", "embed"),
    Site("blocks.L.hook_resid_pre", "layer_input", "resid_pre"),
    Site("blocks.L.ln1.hook_scale", None, "scale"),
    Site("blocks.L.ln1.hook_normalized", "attention_norm_output", "normalized"),
    Site("blocks.L.attn.hook_q_latent", None, "q_latent"),
    Site("blocks.L.attn.hook_q", None, "q"),
    Site("blocks.L.attn.hook_kv_latent", None, "kv_latent"),
    Site("blocks.L.attn.hook_k_rope", None, "k_rope"),
    Site("blocks.L.attn.hook_k", None, "k"),
    Site("blocks.L.attn.hook_v", "attention_values", "v"),
    Site("blocks.L.attn.hook_rot_q", "attention_queries", "rot_q"),
    Site("blocks.L.attn.hook_rot_k", "attention_keys", "rot_k"),
    Site("blocks.L.attn.hook_attn_scores", "attention_scores", "attn_scores"),
    Site("blocks.L.attn.hook_pattern", "attention_probabilities", "pattern"),
    Site("blocks.L.attn.hook_z", "attention_head_outputs", "z"),
    Site("blocks.L.hook_attn_out", "attention_output", "attn_out"),
    Site("blocks.L.hook_resid_mid", "layer_mid", "resid_mid"),
    Site("blocks.L.ln2.hook_scale", None, None),
    Site("blocks.L.ln2.hook_normalized", "mlp_norm_output", None),
    Site("blocks.L.mlp.hook_pre", None, "pre"),
    Site("blocks.L.mlp.hook_pre_linear", None, "pre_linear"),
    Site("blocks.L.mlp.hook_post", "mlp_neurons", "post"),
    Site("blocks.L.mlp.hook_router_logits", "router_logits", "router_logits"),
    Site("blocks.L.mlp.hook_router_scores", None, "router_scores"),
    Site("blocks.L.mlp.hook_choice_scores", None, "choice_scores"),
    Site("blocks.L.mlp.hook_expert_indices", "expert_indices", "expert_indices"),
    Site("blocks.L.mlp.hook_expert_weights", "expert_weights", "expert_weights"),
    Site("blocks.L.mlp.experts.hook_pre", None, "expert_pre"),
    Site("blocks.L.mlp.experts.hook_pre_linear", None, "expert_pre_linear"),
    Site("blocks.L.mlp.experts.hook_post", "mlp_neurons", "expert_post"),
    Site("blocks.L.mlp.hook_expert_outputs", "expert_outputs", "expert_outputs"),
    Site("blocks.L.mlp.hook_routed_out", "routed_output", "routed_out"),
    Site("blocks.L.mlp.shared_expert.hook_pre", None, "shared_pre"),
    Site("blocks.L.mlp.shared_expert.hook_pre_linear", None, "shared_pre_linear"),
    Site("blocks.L.mlp.shared_expert.hook_post", None, "shared_post"),
    Site("blocks.L.mlp.shared_expert.hook_out", None, "shared_expert_out"),
    Site("blocks.L.mlp.hook_shared_gate", None, "shared_gate"),
    Site("blocks.L.mlp.hook_shared_out", "shared_expert_output", "shared_out"),
    Site("blocks.L.hook_mlp_out", "mlp_output", "mlp_out"),
    Site("blocks.L.hook_resid_post", "layer_output", "resid_post"),
    Site("ln_final.hook_scale", None, None),
    Site("ln_final.hook_normalized", "final_norm_output", None),
    Site("hook_logits", "logits", "logits"),
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
    # TransformerLens's optional sites: hook points only while the model's set_use_* switch is on, so not SITES
    # (support() lists what a model has)
    "result": "blocks.L.attn.hook_result",
    "attn_in": "blocks.L.hook_attn_in",
    "q_input": "blocks.L.hook_q_input",
    "k_input": "blocks.L.hook_k_input",
    "v_input": "blocks.L.hook_v_input",
    "mlp_in": "blocks.L.hook_mlp_in",
}.items():
    _ALIASES.setdefault(_alias, []).append(_pattern)

# the switch that creates each optional site, for the error that names a site the model lacks
OPTIONAL_SITE_SWITCHES: dict[str, str] = {
    "hook_result": "set_use_attn_result",
    "hook_attn_in": "set_use_attn_in",
    "hook_q_input": "set_use_split_qkv_input",
    "hook_k_input": "set_use_split_qkv_input",
    "hook_v_input": "set_use_split_qkv_input",
    "hook_mlp_in": "set_use_hook_mlp_in",
}

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
