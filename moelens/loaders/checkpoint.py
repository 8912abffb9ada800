"""Map checkpoint keys onto moelens parameters, following a family's site map, and fill them tensor by tensor.

The site map (moelens.sitemap) lists every parameter with the spellings of its checkpoint tensor; this
module picks the spelling the files use, layer by layer (the routed experts per-expert or in transformers'
fused layout), checks names and shapes against the headers, and copies.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from moelens.loaders.errors import CheckpointError, CheckpointWarning
from moelens.loaders.safetensors_files import SafetensorsFiles
from moelens.sitemap import AS_STORED, ExpertStack, Layout, SiteMap

# Buffers some exporters write that are recomputed from the config.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Stored dtypes cast to the model's without a warning (safetensors' names).
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


@dataclass(frozen=True)
class Target:
    """Where a checkpoint tensor goes: a parameter (or buffer), the index within it, and the layout the
    tensor is stored in (mapped onto the parameter's as it is read)."""

    param: str
    index: tuple = ()
    layout: Layout = AS_STORED


def _expert_keys(stack: ExpertStack, present: set[str] | SafetensorsFiles) -> dict[str, Target]:
    """The layer's expert keys in the spelling the files use (fused, or the first per-expert spelling whose
    expert 0 is there); the first per-expert spelling when none is (the fused one where the family has no
    per-expert spelling), so that they are reported missing."""
    fused = stack.fused.keys()
    if fused[0][0] in present or not stack.per_expert:
        return {key: Target(param, (), layout) for (key, layout), param in zip(fused, stack.params)}
    w_gate_up, w_down = stack.params
    spelling = next((k for k in stack.per_expert if k.gate.format(e=0) in present), stack.per_expert[0])
    gate, up = slice(0, stack.d_expert), slice(stack.d_expert, 2 * stack.d_expert)
    keys = {}
    for e in range(stack.n_experts):
        keys[spelling.gate.format(e=e)] = Target(w_gate_up, (e, gate))
        keys[spelling.up.format(e=e)] = Target(w_gate_up, (e, up))
        keys[spelling.down.format(e=e)] = Target(w_down, (e,))
    return keys


def expected_keys(site_map: SiteMap, present: set[str] | SafetensorsFiles = frozenset()) -> dict[str, Target]:
    """Every checkpoint key the model reads, with its target, in the spellings found in `present` (the
    first spelling of each where none is; optional weights only where present)."""
    keys: dict[str, Target] = {}
    for entry in site_map.weights:
        if isinstance(entry, ExpertStack):
            keys.update(_expert_keys(entry, present))
            continue
        found = next((k for k in entry.keys if k in present), None)
        if found is not None or entry.required:
            keys[found or entry.keys[0]] = Target(entry.param)
    return keys


def _list(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(k) for k in sorted(keys)[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def key_map(site_map: SiteMap, files: SafetensorsFiles) -> dict[str, Target]:
    """Check the checkpoint's keys against the site map (headers only); returns key -> target."""
    keys = expected_keys(site_map, files)
    present = [
        k for k in files.keys() if not k.endswith(IGNORED_SUFFIXES) and not k.startswith(site_map.ignored_prefixes or ("\0",))
    ]
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
    return keys


def slot_map(model: nn.Module, keys: dict[str, Target]) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of the model by name; each must be the target of some key."""
    slots = dict(model.named_parameters()) | dict(model.named_buffers())
    uncovered = set(slots) - {t.param for t in keys.values()}
    if uncovered:  # a bug in the key map, not in the checkpoint: these would stay uninitialised
        raise RuntimeError(f"the checkpoint key map leaves these parameters unfilled: {sorted(uncovered)}")
    return slots


def check_shapes(slots: dict[str, torch.Tensor], files: SafetensorsFiles, keys: dict[str, Target]) -> None:
    """Every checkpoint tensor's shape, from the headers, against its slot: fail before reading any data."""
    wrong = {key: t.layout.stored_shape(tuple(slots[t.param][t.index].shape)) for key, t in keys.items()}
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


def not_finite_count(t: torch.Tensor) -> int:
    """How many of t's values are NaN or +-Inf. The common all-finite case is one reduction that allocates
    nothing: aminmax propagates NaN and shows an Inf as the min or max. Only then is the count taken with a
    full-size boolean temporary, which on every tensor had raised from_pretrained's peak memory by a tenth."""
    if t.numel() == 0:
        return 0
    lo, hi = torch.aminmax(t)
    if bool(torch.isfinite(lo)) and bool(torch.isfinite(hi)):
        return 0
    return t.numel() - int(torch.isfinite(t).sum())


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
            slot.copy_(target.layout.load(tensor))
            if check_finite and (bad := not_finite_count(slot)):
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
