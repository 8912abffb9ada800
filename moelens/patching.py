"""Activation patching, with TransformerLens's API (transformer_lens.patching), plus the mixture's sites.

Run the model on corrupted tokens, replace one piece of one activation by the same piece from a clean run's
cache, and record a metric of the logits; repeat for every index (layer, position, head, expert, ...).
`generic_activation_patch` does the loop; a patch setter writes the clean piece for one index; the
get_act_patch_* functions are the usual combinations, with TransformerLens's names, shapes and index order.

What differs from TransformerLens, and why:
- The runs are made under torch.no_grad() (the metric is read with .item(); no graph is needed).
- A progress bar (tqdm) over the runs, as TransformerLens shows; it writes to stderr only where that is a
  terminal (tqdm's disable=None), so that logs and captured output stay clean.
- index_df / return_index_df need pandas, which is not a moelens dependency: they raise an ImportError
  saying so when it is missing. index_axis_names needs nothing.
- A layer that lacks the site (a dense block has no hook_routed_out; a block without a shared expert no
  hook_shared_out) is not run: its entries are NaN.
- k / v patches: the head axis is the site's own: kv heads ("batch pos kv_head d_head") where keys and values
  are grouped (n_kv_heads, as TransformerLens's n_key_value_heads), query heads for multi-head latent
  attention, whose hook_k / hook_v are per query head.
- MoE sites: get_act_patch_routed_out, get_act_patch_shared_out ([n_layers, pos]) and
  get_act_patch_expert_weights ([n_layers, n_experts]); see their docs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

import torch
from jaxtyping import Float, Int
from tqdm.auto import tqdm

from moelens.hooks import HookPoint
from moelens.utils import get_act_name

if TYPE_CHECKING:
    from moelens.cache import ActivationCache
    from moelens.models.base import HookedTransformer

AxisNames = Literal["layer", "pos", "head_index", "head", "src_pos", "dest_pos", "expert"]
CorruptedActivation = torch.Tensor
PatchedActivation = torch.Tensor
PatchSetter = Callable[[CorruptedActivation, Sequence[int], torch.Tensor], PatchedActivation]
Metric = Callable[[Float[torch.Tensor, "batch pos d_vocab"]], Float[torch.Tensor, ""]]


def _pandas():
    try:
        import pandas
    except ImportError:
        raise ImportError(
            "index_df / return_index_df need pandas, which moelens does not install: `pip install pandas`, "
            "or pass index_axis_names and leave return_index_df=False"
        ) from None
    return pandas


def make_df_from_ranges(column_max_ranges: Sequence[int], column_names: Sequence[str]):
    """TransformerLens's helper: a pandas DataFrame of every index combination, the last column fastest."""
    rows = list(itertools.product(*[range(n) for n in column_max_ranges]))
    return _pandas().DataFrame(rows, columns=list(column_names))


def _site(model: HookedTransformer, activation_name: str, layer: int) -> str:
    """The full hook name of `activation_name` in block `layer` (TransformerLens's get_act_name)."""
    return activation_name if activation_name in model.hook_dict else get_act_name(activation_name, layer)


def _first_site(model: HookedTransformer, activation_name: str) -> HookPoint:
    for layer in range(model.cfg.n_layers):
        name = _site(model, activation_name, layer)
        if name in model.hook_dict:
            return model.hook_dict[name]
    raise ValueError(f"activation_name {activation_name!r}: no block of this {type(model).__name__} has that site")


def _axis_ranges(
    model: HookedTransformer, corrupted_tokens: torch.Tensor, activation_name: str, axis_names: Sequence[str]
) -> list[int]:
    site = _first_site(model, activation_name)
    n_heads = model.cfg.n_kv_heads if "kv_head" in site.layout.split() else model.cfg.n_heads
    n_pos = corrupted_tokens.shape[-1]
    ranges = {
        "layer": model.cfg.n_layers, "pos": n_pos, "src_pos": n_pos, "dest_pos": n_pos,
        "head_index": n_heads, "head": n_heads, "expert": model.cfg.n_experts,
    }
    unknown = [a for a in axis_names if a not in ranges]
    if unknown:
        raise ValueError(f"index_axis_names: unknown axis names {unknown}; known: {sorted(ranges)}")
    if not axis_names or axis_names[0] != "layer":
        raise ValueError(f"index_axis_names must start with 'layer' (the block of each patch), got {list(axis_names)}")
    return [ranges[a] for a in axis_names]


def generic_activation_patch(
    model: HookedTransformer,
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    clean_cache: ActivationCache,
    patching_metric: Metric,
    patch_setter: PatchSetter,
    activation_name: str,
    index_axis_names: Sequence[AxisNames] | None = None,
    index_df: Any = None,
    return_index_df: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, Any]:
    """TransformerLens's generic_activation_patch: for every index (a row of index_df, or every combination
    of index_axis_names' ranges), run the model on corrupted_tokens with the site `activation_name` of block
    index[0] patched by patch_setter(corrupted_activation, index, clean_activation), and record
    patching_metric(logits).item().

    index_axis_names: axes to iterate over, the first "layer": "layer" (n_layers), "pos" / "src_pos" /
    "dest_pos" (corrupted_tokens' length), "head" / "head_index" (the site's heads: n_kv_heads for grouped
    k / v), "expert" (n_experts). The result then has one axis per name. index_df (pandas DataFrame, columns
    as those names; not together with index_axis_names): one entry per row, flattened. return_index_df:
    also return the DataFrame of indices (pandas needed). Entries of layers without the site are NaN.
    """
    if index_df is None:
        if index_axis_names is None:
            raise ValueError("generic_activation_patch: give index_axis_names (e.g. ('layer', 'pos')) or index_df")
        ranges = _axis_ranges(model, corrupted_tokens, activation_name, index_axis_names)
        rows: list[list[int]] = [list(r) for r in itertools.product(*[range(n) for n in ranges])]
        out = torch.zeros(ranges)
        if return_index_df:
            index_df = make_df_from_ranges(ranges, index_axis_names)
    else:
        if index_axis_names is not None:
            raise ValueError("generic_activation_patch: give index_axis_names or index_df, not both")
        _pandas()
        rows = [[int(v) for v in row] for row in index_df.itertuples(index=False)]
        out = torch.zeros(len(rows))
    flat = out.view(-1) if index_axis_names is not None else out

    for c, index in enumerate(tqdm(rows, desc="patching", disable=None)):
        name = _site(model, activation_name, index[0])
        if name not in model.hook_dict:
            flat[c] = float("nan")
            continue
        clean = clean_cache[name]

        def patch(corrupted: torch.Tensor, hook: HookPoint, index=index, clean=clean) -> torch.Tensor:
            return patch_setter(corrupted, index, clean.to(corrupted.device))

        with torch.no_grad():
            logits = model.run_with_hooks(corrupted_tokens, fwd_hooks=[(name, patch)])
            flat[c] = float(patching_metric(logits))
    return (out, index_df) if return_index_df else out


# ---- patch setters (TransformerLens's) --------------------------------------------------------------------
def _check_index(index: Sequence[int], n: int, what: str) -> None:
    if len(index) != n:
        raise ValueError(f"{what} takes an index of {n} entries, got {list(index)}")


def layer_pos_patch_setter(corrupted_activation, index, clean_activation):
    """index = [layer, pos], activation [batch pos ...] (everything but attention patterns)."""
    _check_index(index, 2, "layer_pos_patch_setter")
    _, pos = index
    corrupted_activation[:, pos, ...] = clean_activation[:, pos, ...]
    return corrupted_activation


def layer_pos_head_vector_patch_setter(corrupted_activation, index, clean_activation):
    """index = [layer, pos, head_index], activation [batch pos head ...] (q, k, v, z)."""
    _check_index(index, 3, "layer_pos_head_vector_patch_setter")
    _, pos, head_index = index
    corrupted_activation[:, pos, head_index] = clean_activation[:, pos, head_index]
    return corrupted_activation


def layer_head_vector_patch_setter(corrupted_activation, index, clean_activation):
    """index = [layer, head_index], activation [batch pos head ...], every position."""
    _check_index(index, 2, "layer_head_vector_patch_setter")
    _, head_index = index
    corrupted_activation[:, :, head_index] = clean_activation[:, :, head_index]
    return corrupted_activation


def layer_head_pattern_patch_setter(corrupted_activation, index, clean_activation):
    """index = [layer, head_index], activation [batch head dest_pos src_pos] (scores, patterns)."""
    _check_index(index, 2, "layer_head_pattern_patch_setter")
    _, head_index = index
    corrupted_activation[:, head_index, :, :] = clean_activation[:, head_index, :, :]
    return corrupted_activation


def layer_head_pos_pattern_patch_setter(corrupted_activation, index, clean_activation):
    """index = [layer, head_index, dest_pos], activation [batch head dest_pos src_pos]."""
    _check_index(index, 3, "layer_head_pos_pattern_patch_setter")
    _, head_index, dest_pos = index
    corrupted_activation[:, head_index, dest_pos, :] = clean_activation[:, head_index, dest_pos, :]
    return corrupted_activation


def layer_head_dest_src_pos_pattern_patch_setter(corrupted_activation, index, clean_activation):
    """index = [layer, head_index, dest_pos, src_pos], activation [batch head dest_pos src_pos]."""
    _check_index(index, 4, "layer_head_dest_src_pos_pattern_patch_setter")
    _, head_index, dest_pos, src_pos = index
    corrupted_activation[:, head_index, dest_pos, src_pos] = clean_activation[:, head_index, dest_pos, src_pos]
    return corrupted_activation


# ---- the usual patches (TransformerLens's) ------------------------------------------------------------------
def _wrapper(name: str, setter: PatchSetter, activation_name: str, axes: tuple[str, ...], doc: str):
    fn = partial(generic_activation_patch, patch_setter=setter, activation_name=activation_name, index_axis_names=axes)
    fn.__doc__ = (
        f"{doc} Returns a tensor of shape [{', '.join('n_layers' if a == 'layer' else a for a in axes)}].\n\n"
        "Arguments (model, corrupted_tokens, clean_cache, patching_metric): see generic_activation_patch."
    )
    return fn


get_act_patch_resid_pre = _wrapper("get_act_patch_resid_pre", layer_pos_patch_setter, "resid_pre", ("layer", "pos"),
                                   "The residual stream entering each block, by position.")
get_act_patch_resid_mid = _wrapper("get_act_patch_resid_mid", layer_pos_patch_setter, "resid_mid", ("layer", "pos"),
                                   "The residual stream between attention and MLP, by position.")
get_act_patch_attn_out = _wrapper("get_act_patch_attn_out", layer_pos_patch_setter, "attn_out", ("layer", "pos"),
                                  "Each attention layer's output, by position.")
get_act_patch_mlp_out = _wrapper("get_act_patch_mlp_out", layer_pos_patch_setter, "mlp_out", ("layer", "pos"),
                                 "Each MLP / mixture's output (routed experts plus shared expert), by position.")
get_act_patch_attn_head_out_by_pos = _wrapper(
    "get_act_patch_attn_head_out_by_pos", layer_pos_head_vector_patch_setter, "z", ("layer", "pos", "head"),
    "Each head's output (hook_z), by position.")
get_act_patch_attn_head_q_by_pos = _wrapper(
    "get_act_patch_attn_head_q_by_pos", layer_pos_head_vector_patch_setter, "q", ("layer", "pos", "head"),
    "Each head's queries, by position.")
get_act_patch_attn_head_k_by_pos = _wrapper(
    "get_act_patch_attn_head_k_by_pos", layer_pos_head_vector_patch_setter, "k", ("layer", "pos", "head"),
    "Each kv head's keys, by position (head axis n_kv_heads where keys are grouped).")
get_act_patch_attn_head_v_by_pos = _wrapper(
    "get_act_patch_attn_head_v_by_pos", layer_pos_head_vector_patch_setter, "v", ("layer", "pos", "head"),
    "Each kv head's values, by position (head axis n_kv_heads where values are grouped).")
get_act_patch_attn_head_pattern_by_pos = _wrapper(
    "get_act_patch_attn_head_pattern_by_pos", layer_head_pos_pattern_patch_setter, "pattern",
    ("layer", "head_index", "dest_pos"), "Each head's attention pattern, by destination position.")
get_act_patch_attn_head_pattern_dest_src_pos = _wrapper(
    "get_act_patch_attn_head_pattern_dest_src_pos", layer_head_dest_src_pos_pattern_patch_setter, "pattern",
    ("layer", "head_index", "dest_pos", "src_pos"), "Each (destination, source) entry of each head's pattern.")
get_act_patch_attn_head_out_all_pos = _wrapper(
    "get_act_patch_attn_head_out_all_pos", layer_head_vector_patch_setter, "z", ("layer", "head"),
    "Each head's output (hook_z), all positions at once.")
get_act_patch_attn_head_q_all_pos = _wrapper(
    "get_act_patch_attn_head_q_all_pos", layer_head_vector_patch_setter, "q", ("layer", "head"),
    "Each head's queries, all positions at once.")
get_act_patch_attn_head_k_all_pos = _wrapper(
    "get_act_patch_attn_head_k_all_pos", layer_head_vector_patch_setter, "k", ("layer", "head"),
    "Each kv head's keys, all positions at once.")
get_act_patch_attn_head_v_all_pos = _wrapper(
    "get_act_patch_attn_head_v_all_pos", layer_head_vector_patch_setter, "v", ("layer", "head"),
    "Each kv head's values, all positions at once.")
get_act_patch_attn_head_pattern_all_pos = _wrapper(
    "get_act_patch_attn_head_pattern_all_pos", layer_head_pattern_patch_setter, "pattern", ("layer", "head_index"),
    "Each head's whole attention pattern.")
# the mixture's outputs
get_act_patch_routed_out = _wrapper(
    "get_act_patch_routed_out", layer_pos_patch_setter, "routed_out", ("layer", "pos"),
    "Each mixture's routed experts' combined output (hook_routed_out, before the shared expert is added), by "
    "position; NaN for dense blocks.")
get_act_patch_shared_out = _wrapper(
    "get_act_patch_shared_out", layer_pos_patch_setter, "shared_out", ("layer", "pos"),
    "Each mixture's shared expert output as added (hook_shared_out, Qwen2-MoE's gate included), by position; "
    "NaN for blocks without one. ValueError for a model with no shared expert.")


def _pad_heads(results: torch.Tensor, n_heads: int) -> torch.Tensor:
    """k / v results over kv heads, zero-padded to n_heads on the last axis (TransformerLens's choice)."""
    return torch.nn.functional.pad(results, (0, n_heads - results.shape[-1]))


def get_act_patch_attn_head_all_pos_every(model, corrupted_tokens, clean_cache, metric) -> Float[torch.Tensor, "5 layer head"]:
    """Output, query, key, value, pattern of every head, all positions: [5, n_layers, n_heads] (k / v
    zero-padded from n_kv_heads to n_heads, as TransformerLens)."""
    n = model.cfg.n_heads
    return torch.stack([
        get_act_patch_attn_head_out_all_pos(model, corrupted_tokens, clean_cache, metric),
        get_act_patch_attn_head_q_all_pos(model, corrupted_tokens, clean_cache, metric),
        _pad_heads(get_act_patch_attn_head_k_all_pos(model, corrupted_tokens, clean_cache, metric), n),
        _pad_heads(get_act_patch_attn_head_v_all_pos(model, corrupted_tokens, clean_cache, metric), n),
        get_act_patch_attn_head_pattern_all_pos(model, corrupted_tokens, clean_cache, metric),
    ])


def get_act_patch_attn_head_by_pos_every(model, corrupted_tokens, clean_cache, metric) -> Float[torch.Tensor, "5 layer pos head"]:
    """Output, query, key, value, pattern of every head, by position: [5, n_layers, pos, n_heads] (the
    pattern by destination position; k / v zero-padded to n_heads, as TransformerLens)."""
    n = model.cfg.n_heads
    return torch.stack([
        get_act_patch_attn_head_out_by_pos(model, corrupted_tokens, clean_cache, metric),
        get_act_patch_attn_head_q_by_pos(model, corrupted_tokens, clean_cache, metric),
        _pad_heads(get_act_patch_attn_head_k_by_pos(model, corrupted_tokens, clean_cache, metric), n),
        _pad_heads(get_act_patch_attn_head_v_by_pos(model, corrupted_tokens, clean_cache, metric), n),
        get_act_patch_attn_head_pattern_by_pos(model, corrupted_tokens, clean_cache, metric).transpose(-1, -2),
    ])


def get_act_patch_block_every(model, corrupted_tokens, clean_cache, metric) -> Float[torch.Tensor, "3 layer pos"]:
    """resid_pre, attn_out, mlp_out by position: [3, n_layers, pos]."""
    return torch.stack([
        get_act_patch_resid_pre(model, corrupted_tokens, clean_cache, metric),
        get_act_patch_attn_out(model, corrupted_tokens, clean_cache, metric),
        get_act_patch_mlp_out(model, corrupted_tokens, clean_cache, metric),
    ])


def get_act_patch_expert_weights(
    model: HookedTransformer,
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    clean_cache: ActivationCache,
    patching_metric: Metric,
) -> Float[torch.Tensor, "n_layers n_experts"]:
    """For each (layer, expert e): the corrupted run with e's routing weight set to its clean value at every
    token, the metric of that run. [n_layers, n_experts]; NaN for dense blocks.

    Only the corrupted run's own choice is re-weighted (hook_expert_weights; the experts stay those the
    corrupted router chose, and no renormalisation follows):
    - a token whose corrupted slot went to e: that slot's weight becomes e's weight in the clean run at the
      same (batch, pos), or 0 if the clean run did not choose e there (e contributed nothing to it);
    - a token whose corrupted run did not choose e: unchanged, even where the clean run chose e (adding e
      would re-route the token: patch hook_expert_indices for that).
    clean_cache needs hook_expert_indices and hook_expert_weights of every mixture layer, and the clean and
    corrupted inputs the same shape.
    """
    cfg = model.cfg
    out = torch.full((cfg.n_layers, cfg.n_experts), float("nan"))
    for layer in cfg.moe_layer_indices:
        pre = f"blocks.{layer}.mlp"
        clean_idx, clean_w = clean_cache[f"{pre}.hook_expert_indices"], clean_cache[f"{pre}.hook_expert_weights"]
        for e in range(cfg.n_experts):
            # e's clean weight per token: the sum of its clean slots (at most one), 0 where not chosen
            clean_e = (clean_w * (clean_idx == e)).sum(-1, keepdim=True)
            seen: dict[str, torch.Tensor] = {}

            def read_indices(idx: torch.Tensor, hook: HookPoint) -> None:
                seen["idx"] = idx

            def set_weight(w: torch.Tensor, hook: HookPoint, clean_e=clean_e, seen=seen, e=e) -> torch.Tensor:
                if clean_e.shape[:-1] != w.shape[:-1]:
                    raise ValueError(
                        f"get_act_patch_expert_weights: the clean cache's {hook.name} is {tuple(clean_e.shape[:-1])} "
                        f"tokens, the corrupted run's {tuple(w.shape[:-1])}: use inputs of the same shape"
                    )
                mine = seen["idx"] == e
                return torch.where(mine, clean_e.to(w.device, w.dtype).expand_as(w), w)

            with torch.no_grad():
                logits = model.run_with_hooks(
                    corrupted_tokens,
                    fwd_hooks=[(f"{pre}.hook_expert_indices", read_indices), (f"{pre}.hook_expert_weights", set_weight)],
                )
                out[layer, e] = float(patching_metric(logits))
    return out
