"""ActivationCache: the tensors of a run_with_cache call, looked up by full name or by alias."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

from moelens.cache_analysis import CacheAnalysis
from moelens.hooks import SliceInput, slice_pos, unwrap_slice
from moelens.names import alias_candidates


class ActivationCache(CacheAnalysis):
    """Dict-like cache of hook tensors.

    Look-ups: ``cache["blocks.3.mlp.hook_router_logits"]``, ``cache["router_logits", 3]``,
    ``cache["layer_output", 0]`` (the family notes' standard names), ``cache["normalized", 2, "ln2"]``,
    and gradients as ``cache["blocks.0.hook_resid_pre_grad"]``. Negative layers count from the end.

    Dict-like as TransformerLens's: keys(), values(), items(), len(), iteration over names, `in` (which
    also accepts aliases and (name, layer) keys), to(device, move_model), toggle_autodiff,
    apply_slice_to_batch_dim, remove_batch_dim (in place).

    Analyses (moelens.cache_analysis): accumulated_resid, decompose_resid, stack_activation,
    apply_ln_to_stack, logit_attrs, compute_head_results / stack_head_results, get_neuron_results /
    stack_neuron_results, get_full_resid_decomposition (heads, dense neurons, shared and routed experts)
    and expert_logit_attribution.
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

    def to(self, device: torch.device | str, move_model: bool = False) -> ActivationCache:
        """Move every tensor to `device`, in place, and return the cache (TransformerLens's semantics);
        move_model=True moves the model too (methods such as compute_head_results read its weights)."""
        self.cache_dict = {k: v.to(device) for k, v in self.cache_dict.items()}
        if move_model:
            self.model.to(device)
        return self

    def toggle_autodiff(self, mode: bool = False) -> None:
        """TransformerLens's toggle_autodiff: torch.set_grad_enabled(mode) for the whole process (global
        state, not only this cache's); a logged warning says so. torch.inference_mode() is the local way."""
        logging.warning("Changed the global state, set autodiff to %s", mode)
        torch.set_grad_enabled(mode)

    def _batch_size(self) -> int | None:
        sizes = [v.shape[0] for v in self.cache_dict.values() if v.ndim > 0]
        return max(set(sizes), key=sizes.count) if sizes else None

    def apply_slice_to_batch_dim(self, batch_slice: SliceInput) -> ActivationCache:
        """A new cache with `batch_slice` (TransformerLens's Slice: int, tuple, slice, list / tensor of
        indices) applied to every tensor's batch axis; an int drops it (has_batch_dim becomes False).
        The tensors are views where torch gives them; this cache is unchanged."""
        batch_slice = unwrap_slice(batch_slice)
        if not self.has_batch_dim:
            if batch_slice is None:
                return ActivationCache(dict(self.cache_dict), self.model, has_batch_dim=False)
            raise ValueError("apply_slice_to_batch_dim: this cache has no batch axis (remove_batch_dim was applied)")
        batch = self._batch_size()
        # entries whose leading axis is not the batch (none in moelens today) are left as they are
        sliced = {
            k: slice_pos(v, batch_slice, 0) if v.ndim > 0 and v.shape[0] == batch else v
            for k, v in self.cache_dict.items()
        }
        keeps_batch = not (isinstance(batch_slice, int) and not isinstance(batch_slice, bool))
        return ActivationCache(sliced, self.model, has_batch_dim=keeps_batch)

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
