"""ActivationCache: the tensors of a run_with_cache call, looked up by full name or by alias."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

from moelens.cache_analysis import CacheAnalysis
from moelens.names import alias_candidates


class ActivationCache(CacheAnalysis):
    """Dict-like cache of hook tensors.

    Look-ups: ``cache["blocks.3.mlp.hook_router_logits"]``, ``cache["router_logits", 3]``,
    ``cache["layer_output", 0]`` (the family notes' standard names), ``cache["normalized", 2, "ln2"]``,
    and gradients as ``cache["blocks.0.hook_resid_pre_grad"]``. Negative layers count from the end.

    Analyses (moelens.cache_analysis): accumulated_resid, decompose_resid, stack_activation,
    apply_ln_to_stack, logit_attrs, compute_head_results / stack_head_results,
    get_full_resid_decomposition (heads, shared expert and each routed expert) and expert_logit_attribution.
    """

    def __init__(self, cache_dict: dict[str, torch.Tensor], model, has_batch_dim: bool = True) -> None:
        self.cache_dict = cache_dict
        self.model = model
        self.has_batch_dim = has_batch_dim

    def _full_name(self, key) -> str:
        if isinstance(key, str):
            if key in self.cache_dict:
                return key
            name, layer, sub = key, None, None
        elif isinstance(key, tuple) and 2 <= len(key) <= 3:
            name, layer, sub = key[0], key[1], key[2] if len(key) == 3 else None
            if layer is not None and layer < 0:
                layer += self.model.cfg.n_layers
        else:
            raise KeyError(f"cache keys are a hook name or (name, layer[, sublayer]), got {key!r}")
        grad = name.endswith("_grad")
        base = name[: -len("_grad")] if grad else name
        suffix = "_grad" if grad else ""
        if sub is not None:
            candidates = [f"blocks.{layer}.{sub}.hook_{base}"]
        else:
            try:
                candidates = alias_candidates(base, layer)
            except KeyError as err:
                raise KeyError(str(err)) from None
        for candidate in candidates:
            if candidate + suffix in self.cache_dict:
                return candidate + suffix
        cached = [k for k in self.cache_dict if base in k][:5]
        raise KeyError(
            f"{key!r} (-> {candidates[0] + suffix}) is not in this cache"
            + (f"; cached names like it: {cached}" if cached else "; was it left out by names_filter?")
        )

    def __getitem__(self, key) -> torch.Tensor:
        return self.cache_dict[self._full_name(key)]

    def __contains__(self, key) -> bool:
        try:
            self._full_name(key)
        except KeyError:
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(self.cache_dict)

    def __len__(self) -> int:
        return len(self.cache_dict)

    def keys(self):
        return self.cache_dict.keys()

    def values(self):
        return self.cache_dict.values()

    def items(self):
        return self.cache_dict.items()

    def to(self, device: torch.device | str) -> ActivationCache:
        return ActivationCache({k: v.to(device) for k, v in self.cache_dict.items()}, self.model, self.has_batch_dim)

    def remove_batch_dim(self) -> ActivationCache:
        """Drop the batch axis of a batch-of-one cache, in place, and return the cache (TransformerLens's
        semantics: every tensor loses its leading axis of size 1 and has_batch_dim becomes False). A cache
        whose batch axis is already gone is returned unchanged, with a logged warning."""
        if not self.has_batch_dim:
            logging.warning("Tried removing batch dimension after already having removed it.")
            return self
        sizes = {v.shape[0] for v in self.cache_dict.values() if v.ndim > 0}
        if sizes - {1}:
            raise ValueError(f"remove_batch_dim needs a batch of one, the cache has batch sizes {sorted(sizes)}")
        for key, value in self.cache_dict.items():
            if value.ndim > 0:
                self.cache_dict[key] = value[0]
        self.has_batch_dim = False
        return self

    def __repr__(self) -> str:
        return f"ActivationCache({len(self)} tensors: {list(self.cache_dict)[:4]}{' ...' if len(self) > 4 else ''})"
