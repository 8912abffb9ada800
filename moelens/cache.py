"""ActivationCache: the tensors of a run_with_cache call, looked up by full name or by alias."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

from moelens.cache_analysis import CacheAnalysis
from moelens.hooks import SliceInput, slice_pos, unwrap_slice
from moelens.hooks.names import OPTIONAL_SITE_SWITCHES, alias_candidates
from moelens.utils import get_act_name


class BatchSizeError(ValueError, AssertionError):
    """remove_batch_dim on a batch of more than one: a ValueError, and an AssertionError as TransformerLens's
    (it asserts the batch size)."""


class ActivationCache(CacheAnalysis):
    """Dict-like cache of hook tensors.

    Look-ups: ``cache["blocks.3.mlp.hook_router_logits"]``, ``cache["router_logits", 3]``,
    ``cache["layer_output", 0]`` (the family notes' standard names), ``cache["normalized", 2, "ln2"]``,
    and gradients as ``cache["blocks.0.hook_resid_pre_grad"]``. Negative layers count from the end.
    Every key TransformerLens's cache takes means the same (its get_act_name rules): ``cache["k6"]``,
    ``cache["scale4ln1"]``, ``cache["embed"]``, ``cache["scale"]`` (ln_final's), ``cache["q", 2, "a"]``,
    ``cache["attn", 0]`` (the pattern), ``cache["resid_pre", -1]``, ``cache[("embed",)]``.

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
        elif isinstance(key, tuple) and 1 <= len(key) <= 3 and isinstance(key[0], str):
            name, layer, sub = key[0], key[1] if len(key) > 1 else None, key[2] if len(key) == 3 else None
            if isinstance(layer, int) and layer < 0:
                layer += self.model.cfg.n_layers
        else:
            raise KeyError(f"cache keys are a hook name or (name, layer[, layer_type]), got {key!r}")
        grad = name.endswith("_grad")
        base = name[: -len("_grad")] if grad else name
        suffix = "_grad" if grad else ""
        candidates = self._candidates(base, layer, sub)
        for candidate in candidates:
            if candidate + suffix in self.cache_dict:
                return candidate + suffix
        full = candidates[0]
        cached = self._cached_like(base, full)
        switch = OPTIONAL_SITE_SWITCHES.get(full.rsplit(".", 1)[-1])
        is_site = full in getattr(self.model, "hook_dict", {})
        raise KeyError(
            f"{key!r} (-> {full + suffix}) is not in this cache"
            + ("; was it left out by names_filter?" if is_site else "")
            + ("" if is_site or switch else "; this model has no hook site of that name")
            + (f"; cached names like it: {cached}" if cached else "")
            + (f" (the site exists only after model.{switch}(True))" if switch else "")
        )

    def _cached_like(self, base: str, full: str) -> list[str]:
        """Up to five cached names containing the key's site name ("pre" for "pre", "mlp_pre" or
        "blocks.1.mlp.hook_pre"), those of the key's block first."""
        needle = full.rsplit(".", 1)[-1].removeprefix("hook_") if "." in base or base not in full else base
        block = ".".join(full.split(".")[:2]) + "." if full.startswith("blocks.") else None
        like = [k for k in self.cache_dict if needle in k]
        like.sort(key=lambda k: not (block and k.startswith(block)))  # stable: cache order within each group
        return like[:5]

    @staticmethod
    def _candidates(name: str, layer, layer_type) -> list[str]:
        """Full names a key may stand for, in order: TransformerLens's reading (get_act_name(name, layer,
        layer_type), as its ActivationCache.__getitem__: "k6", "scale4ln1", ("q", 2, "a"), ("attn", 0) for
        the pattern, ...), then moelens's aliases ("router_logits", "layer_output", ...)."""
        candidates = []
        try:
            candidates.append(get_act_name(name, layer, layer_type))
        except (ValueError, TypeError):  # no hook site by TransformerLens's rules: a moelens alias may be one
            pass
        if layer_type is not None:
            candidates.append(f"blocks.{layer}.{layer_type}.hook_{name}")
            return candidates
        try:
            candidates.extend(alias_candidates(name, layer))
        except KeyError as err:  # a per-block name without a layer: TL's reading stands only if it names a site
            if not any("." in c for c in candidates):  # ("resid_pre" -> TL's tail "hook_resid_pre" is none)
                raise KeyError(err.args[0]) from None
        return candidates

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
        """The cached hook names, as a dict's keys."""
        return self.cache_dict.keys()

    def values(self):
        """The cached tensors, as a dict's values."""
        return self.cache_dict.values()

    def items(self):
        """(hook name, tensor) pairs, as a dict's items."""
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

    def _ragged(self, key: str) -> bool:
        """A per-expert view (blocks.L.mlp.experts.E.hook_*): rows routed to one expert, no batch axis."""
        hook_dict = getattr(self.model, "hook_dict", {})
        return getattr(hook_dict.get(key.removesuffix("_grad")), "ragged", False)

    def _batch_size(self) -> int | None:
        sizes = [v.shape[0] for k, v in self.cache_dict.items() if v.ndim > 0 and not self._ragged(k)]
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
        ragged = [k for k in self.cache_dict if self._ragged(k)]
        if ragged and batch_slice is not None:
            raise ValueError(
                f"apply_slice_to_batch_dim: {ragged[0]} (and {len(ragged) - 1} more) hold the rows routed to one "
                "expert, with no batch axis; slice the per-slot sites (blocks.L.mlp.experts.hook_pre / "
                "hook_pre_linear / hook_post) instead, or leave the per-expert names out of names_filter"
            )
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
        # per-expert views have no batch axis: their rows, all of the one batch row, stay as they are
        sizes = {v.shape[0] for k, v in self.cache_dict.items() if v.ndim > 0 and not self._ragged(k)}
        if sizes - {1}:
            raise BatchSizeError(f"remove_batch_dim needs a batch of one, the cache has batch sizes {sorted(sizes)}")
        for key, value in self.cache_dict.items():
            if value.ndim > 0 and not self._ragged(key):
                self.cache_dict[key] = value[0]
        self.has_batch_dim = False
        return self

    def __repr__(self) -> str:
        return f"ActivationCache({len(self)} tensors: {list(self.cache_dict)[:4]}{' ...' if len(self) > 4 else ''})"
