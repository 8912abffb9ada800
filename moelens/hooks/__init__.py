"""Hooks: HookPoint and the hook API (points.py), the table of hook sites (sites.py) and their names and
aliases (names.py), TransformerLens's per-expert views (expert_views.py), and support() (support.py)."""

from moelens.hooks.points import (
    Direction,
    Directions,
    Hook,
    HookedRootModule,
    HookFn,
    HookPoint,
    HookPresence,
    HookShapeError,
    NameFilter,
    SliceInput,
    call_hooked_points,
    slice_pos,
    unwrap_cache_slice,
    unwrap_slice,
)

__all__ = [
    "Direction",
    "Directions",
    "Hook",
    "HookFn",
    "HookPoint",
    "HookPresence",
    "HookShapeError",
    "HookedRootModule",
    "NameFilter",
    "SliceInput",
    "call_hooked_points",
    "slice_pos",
    "unwrap_cache_slice",
    "unwrap_slice",
]
