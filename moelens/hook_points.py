"""TransformerLens's `transformer_lens.hook_points` under moelens's name.

`from moelens.hook_points import HookPoint, HookedRootModule` works where TransformerLens code imports them
from transformer_lens.hook_points: HookPoint and LensHandle (a hook's record) are moelens.hooks', and
HookedRootModule is moelens.hooks' with run_with_cache returning an ActivationCache, as TransformerLens's
does, also for a module of your own built from HookPoints (call self.setup() at the end of its __init__).
"""

from __future__ import annotations

from moelens import hooks
from moelens.cache import ActivationCache
from moelens.hooks import Hook as LensHandle
from moelens.hooks import HookPoint
from moelens.hooks import NameFilter as NamesFilter

__all__ = ["HookPoint", "HookedRootModule", "LensHandle", "NamesFilter"]


class HookedRootModule(hooks.HookedRootModule):
    """The root of a hooked model (TransformerLens's HookedRootModule): names its HookPoints in setup() and
    offers run_with_hooks, run_with_cache (an ActivationCache), hooks(), add_hook, reset_hooks. Every moelens
    model is one."""

    cache_class = ActivationCache
