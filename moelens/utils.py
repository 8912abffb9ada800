"""TransformerLens-style helpers for code written against its `utils` module."""

from __future__ import annotations

from moelens.names import alias_candidates


def get_act_name(name: str, layer: int | None = None, layer_type: str | None = None) -> str:
    """Full hook name of a short or standard name: get_act_name("resid_pre", 3) -> "blocks.3.hook_resid_pre",
    get_act_name("normalized", 1, "ln2") -> "blocks.1.ln2.hook_normalized". Where a name could be either a
    dense MLP's or the experts' site ("mlp_neurons"), the first is returned; models resolve it themselves."""
    if layer_type is not None:
        return f"blocks.{layer}.{layer_type}.hook_{name}"
    return alias_candidates(name, layer)[0]
