"""Names of hook sites: a full name's pattern and block, and the aliases (the table's standard and short names)
that cache["router_logits", 3] and get_act_name resolve. The sites themselves are moelens.hooks.sites' table.

Names are relative to the model root; ``L`` stands for a block index.
"""

from __future__ import annotations

import re

from moelens.hooks.sites import OPTIONAL_SITE_SWITCHES, SITE_BY_NAME, SITES, Site

__all__ = [
    "OPTIONAL_SITE_SWITCHES", "SITES", "Site", "alias_candidates", "aliases", "layer_of", "site_for", "site_pattern",
]

_ALIASES: dict[str, list[str]] = {}
for _s in SITES:
    for _alias in ({_s.short, _s.standard} - {None}) | set(_s.aliases):
        _ALIASES.setdefault(_alias, []).append(_s.name)  # mlp_neurons: the dense MLP's, else the experts'

_LAYER_RE = re.compile(r"^blocks\.(\d+)\.")


def site_pattern(hook_name: str) -> str:
    """'blocks.3.mlp.hook_router_logits' -> 'blocks.L.mlp.hook_router_logits'."""
    return _LAYER_RE.sub("blocks.L.", hook_name)


def site_for(hook_name: str) -> Site | None:
    return SITE_BY_NAME.get(site_pattern(hook_name))


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
