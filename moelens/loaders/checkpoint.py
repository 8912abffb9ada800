"""Map checkpoint keys onto moelens parameters and fill them tensor by tensor.

Families differ only in a few module names (router, shared expert, q/k norm); CheckpointNames holds them,
and `expected_keys` builds the whole map from a config. Experts are accepted in the Hub's per-expert
layout (`experts.E.{gate,up,down}_proj.weight`) and in transformers' fused one
(`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]), chosen per layer.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from moelens.config import MoeConfig
from moelens.loaders.errors import CheckpointError, CheckpointWarning
from moelens.loaders.safetensors_files import SafetensorsFiles

# Buffers some exporters write that are recomputed from the config.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Stored dtypes cast to the model's without a warning (safetensors' names).
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


@dataclass(frozen=True)
class CheckpointNames:
    """Checkpoint names (under model.layers.L.) of the parts that differ between families."""

    router: str = "mlp.gate.weight"
    correction_bias: str | None = None
    experts: str = "mlp.experts"
    shared_expert: str = "mlp.shared_expert"
    shared_gate: str | None = None
    q_norm: str | None = None
    k_norm: str | None = None


@dataclass(frozen=True)
class Target:
    """Where a checkpoint tensor goes: a parameter (or buffer), and the index within it."""

    param: str
    index: tuple = ()


def _mlp_keys(src: str, dst: str) -> dict[str, Target]:
    return {f"{src}.{p}_proj.weight": Target(f"{dst}.{p}_proj.weight") for p in ("gate", "up", "down")}


def expected_keys(cfg: MoeConfig, names: CheckpointNames, fused_layers: set[int], lm_head: bool) -> dict[str, Target]:
    """Every checkpoint key the model needs, with its target."""
    keys = {"model.embed_tokens.weight": Target("embed.weight"), "model.norm.weight": Target("ln_final.weight")}
    if lm_head:
        keys["lm_head.weight"] = Target("unembed.weight")
    for layer in range(cfg.n_layers):
        src, dst = f"model.layers.{layer}", f"blocks.{layer}"
        keys[f"{src}.input_layernorm.weight"] = Target(f"{dst}.ln1.weight")
        keys[f"{src}.post_attention_layernorm.weight"] = Target(f"{dst}.ln2.weight")
        for proj in "qkvo":
            keys[f"{src}.self_attn.{proj}_proj.weight"] = Target(f"{dst}.attn.{proj}_proj.weight")
            if (cfg.qkv_bias and proj != "o") or (cfg.o_bias and proj == "o"):
                keys[f"{src}.self_attn.{proj}_proj.bias"] = Target(f"{dst}.attn.{proj}_proj.bias")
        if cfg.qk_norm:
            keys[f"{src}.{names.q_norm}.weight"] = Target(f"{dst}.attn.q_norm.weight")
            keys[f"{src}.{names.k_norm}.weight"] = Target(f"{dst}.attn.k_norm.weight")
        if not cfg.moe_layers[layer]:
            keys.update(_mlp_keys(f"{src}.mlp", f"{dst}.mlp"))
            continue
        keys[f"{src}.{names.router}"] = Target(f"{dst}.mlp.router.weight")
        if cfg.correction_bias:
            keys[f"{src}.{names.correction_bias}"] = Target(f"{dst}.mlp.router.e_score_correction_bias")
        experts, w_gate_up, w_down = f"{src}.{names.experts}", f"{dst}.mlp.experts.W_gate_up", f"{dst}.mlp.experts.W_down"
        if layer in fused_layers:
            keys[f"{experts}.gate_up_proj"] = Target(w_gate_up)
            keys[f"{experts}.down_proj"] = Target(w_down)
        else:
            gate, up = slice(0, cfg.d_expert), slice(cfg.d_expert, 2 * cfg.d_expert)
            for e in range(cfg.n_experts):
                keys[f"{experts}.{e}.gate_proj.weight"] = Target(w_gate_up, (e, gate))
                keys[f"{experts}.{e}.up_proj.weight"] = Target(w_gate_up, (e, up))
                keys[f"{experts}.{e}.down_proj.weight"] = Target(w_down, (e,))
        if cfg.d_shared:
            keys.update(_mlp_keys(f"{src}.{names.shared_expert}", f"{dst}.mlp.shared_expert"))
        if cfg.shared_gate:
            keys[f"{src}.{names.shared_gate}"] = Target(f"{dst}.mlp.shared_gate.weight")
    return keys


def _list(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(k) for k in sorted(keys)[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def plan_load(cfg: MoeConfig, names: CheckpointNames, files: SafetensorsFiles) -> tuple[dict[str, Target], bool]:
    """Check the checkpoint's keys and shapes against the config (headers only); returns (key map, untie)."""
    fused = {
        layer
        for layer in range(cfg.n_layers)
        if f"model.layers.{layer}.{names.experts}.gate_up_proj" in files
    }
    lm_head = not cfg.tie_word_embeddings or "lm_head.weight" in files  # a stored head wins, as in transformers
    keys = expected_keys(cfg, names, fused, lm_head)
    present = [k for k in files.keys() if not k.endswith(IGNORED_SUFFIXES)]
    missing = [k for k in keys if k not in files]
    if missing:
        raise CheckpointError(f"checkpoint {files.folder} is missing {len(missing)} tensor(s): {_list(missing)}")
    unexpected = [k for k in present if k not in keys]
    if unexpected:
        where = sorted({files.location[k].name for k in unexpected})
        raise CheckpointError(
            f"checkpoint {files.folder} has {len(unexpected)} unexpected tensor(s) in {', '.join(where)}: "
            f"{_list(unexpected)} (does config.json describe these weights?)"
        )
    return keys, cfg.tie_word_embeddings and lm_head


def slot_map(model: nn.Module, keys: dict[str, Target]) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of the model by name; each must be the target of some key."""
    slots = dict(model.named_parameters()) | dict(model.named_buffers())
    uncovered = set(slots) - {t.param for t in keys.values()}
    if uncovered:  # a bug in the key map, not in the checkpoint: these would stay uninitialised
        raise RuntimeError(f"the checkpoint key map leaves these parameters unfilled: {sorted(uncovered)}")
    return slots


def check_shapes(slots: dict[str, torch.Tensor], files: SafetensorsFiles, keys: dict[str, Target]) -> None:
    """Every checkpoint tensor's shape, from the headers, against its slot: fail before reading any data."""
    wrong = {key: tuple(slots[t.param][t.index].shape) for key, t in keys.items()}
    wrong = {key: shape for key, shape in wrong.items() if files.shapes[key] != shape}
    if wrong:
        key, expected = next(iter(wrong.items()))
        more = f" ({len(wrong) - 1} more tensor(s) mismatch too: {_list(list(wrong)[1:], 3)})" if len(wrong) > 1 else ""
        raise CheckpointError(
            f"{files.location[key].name}: tensor {key!r} has shape {files.shapes[key]}, but the config "
            f"({files.folder / 'config.json'}) needs {expected} for {keys[key].param}{more}"
        )


def warn_cast_dtypes(slots: dict[str, torch.Tensor], files: SafetensorsFiles, keys: dict[str, Target]) -> None:
    """One warning per file and stored dtype that is not a float type: its values are cast, maybe changed."""
    groups: dict[tuple[str, str], list[str]] = {}
    for key in keys:
        if files.dtypes[key] not in FLOAT_DTYPES:
            groups.setdefault((files.location[key].name, files.dtypes[key]), []).append(key)
    for (name, stored), group in groups.items():
        cast_to = slots[keys[group[0]].param].dtype
        warnings.warn(
            f"{files.folder / name} stores {len(group)} tensor(s) as {stored}, not a float type; moelens casts "
            f"them to {cast_to} as they are (quantised weights are not dequantised): {_list(group)}",
            CheckpointWarning,
            stacklevel=3,
        )


def fill(
    model: nn.Module,
    files: SafetensorsFiles,
    keys: dict[str, Target],
    progress: bool | None = None,
    check_finite: bool = True,
    offloaded: dict[str, torch.Tensor] | None = None,
) -> None:
    """Copy each checkpoint tensor into its slot, one tensor in memory at a time.

    check_finite: count the NaN and Inf values of each tensor once in its slot (after the cast, so that an
    overflow shows too) and warn, once, about every tensor that holds any.
    offloaded: slots that are no longer the model's parameters (offloaded routed experts): host tensors are
    filled like the rest; meta tensors (experts left on disk) are only checked for shape.
    """
    slots = slot_map(model, keys) | (offloaded or {})
    check_shapes(slots, files, keys)
    warn_cast_dtypes(slots, files, keys)
    to_read = [k for k, t in keys.items() if not slots[t.param].is_meta]
    not_finite: list[str] = []
    bar = tqdm(total=len(to_read), desc="loading", unit="tensor", disable=None if progress is None else not progress)
    with torch.no_grad():
        for key, tensor in files.read(to_read):
            target = keys[key]
            slot = slots[target.param][target.index]
            slot.copy_(tensor)
            if check_finite and (bad := slot.numel() - int(torch.isfinite(slot).sum())):
                nan = int(torch.isnan(slot).sum())
                not_finite.append(
                    f"{key!r} in {files.location[key].name}: {nan} NaN and {bad - nan} Inf of {slot.numel()} "
                    f"values as {slot.dtype}"
                )
            bar.update()
    bar.close()
    if not_finite:
        more = f"; and {len(not_finite) - 8} more" if len(not_finite) > 8 else ""
        warnings.warn(
            f"{len(not_finite)} tensor(s) of {files.folder} hold NaN or Inf values: {'; '.join(not_finite[:8])}{more} "
            "(from_pretrained(check_finite=False) skips this check)",
            CheckpointWarning,
            stacklevel=3,
        )
