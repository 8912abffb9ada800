"""Map checkpoint keys onto moelens parameters, following a family's site map, and fill them tensor by tensor.

The site map (moelens.sitemap) lists every parameter with the spellings of its checkpoint tensor; this
module picks the spelling the files use, layer by layer (the routed experts per-expert or in transformers'
fused layout), checks names and shapes against the headers, and copies. A quantized checkpoint's tensor
(moelens.loaders.quantized) keeps its key; its Target says how it is stored (the weight with its scale, or a
PackedWeight's blocks and scales), and the fill dequantizes it into the slot's dtype.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from moelens.loaders.errors import CheckpointError, CheckpointWarning
from moelens.loaders.quantized import Format, Fp8Blocks, ModelOptFp8, Stored
from moelens.loaders.safetensors_files import SafetensorsFiles
from moelens.sitemap import AS_STORED, ExpertStack, Layout, PackedWeight, SiteMap, SplitWeight

# Buffers some exporters write that are recomputed from the config.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Stored dtypes cast to the model's without a warning (safetensors' names).
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


@dataclass(frozen=True)
class Target:
    """Where a checkpoint tensor goes: a parameter (or buffer), the index within it, the layout the tensor is
    stored in (mapped onto the parameter's as it is read), and how a quantized tensor is stored.

    stored: its tensors, format and dense shape; None for a tensor read as it is. Kept here, not in fill(), so
    that a caller can read the stored tensors and keep them quantized."""

    param: str
    index: tuple = ()
    layout: Layout = AS_STORED
    stored: Stored | None = None

    @property
    def params(self) -> tuple[str, ...]:
        return (self.param,)

    @property
    def targets(self) -> tuple[Target, ...]:
        """The places the key's tensor fills (a SplitTarget's parts)."""
        return (self,)

    def stored_shape(self, slots: dict[str, torch.Tensor]) -> tuple[int, ...]:
        """The shape the checkpoint's tensor must have (dense, once read) to fill the target."""
        return self.layout.stored_shape(tuple(slots[self.param][self.index].shape))

    def load_into(self, slots: dict[str, torch.Tensor], tensor: torch.Tensor) -> None:
        slots[self.param][self.index].copy_(self.layout.load(tensor))


@dataclass(frozen=True)
class SplitTarget:
    """Where a SplitWeight's tensor goes: its rows, in order, `rows[i]` of them into `parts[i]` (moelens.sitemap
    .SplitWeight). Read dense only: a quantized split tensor is refused by key_map."""

    parts: tuple[Target, ...]
    rows: tuple[int, ...]
    stored: None = None

    @property
    def params(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(t.param for t in self.parts))

    @property
    def targets(self) -> tuple[Target, ...]:
        return self.parts

    def pieces(self, shape: tuple[int, ...]) -> list[tuple[Target, tuple[int, ...]]]:
        """Each part with its piece's stored shape (the stored tensor's rows, then its other axes)."""
        return [(t, (n, *shape[1:])) for t, n in zip(self.parts, self.rows)]

    def stored_shape(self, slots: dict[str, torch.Tensor]) -> tuple[int, ...]:
        """The parts' stored pieces stacked along the first axis (parts that do not stack are a bug in the site
        map)."""
        shapes = {t.stored_shape(slots)[1:] for t in self.parts}
        if len(shapes) != 1 or any(t.stored_shape(slots)[0] != n for t, n in zip(self.parts, self.rows)):
            raise RuntimeError(f"the site map's split parts {self.parts} do not stack along their rows {self.rows}")
        return (sum(self.rows), *shapes.pop())

    def load_into(self, slots: dict[str, torch.Tensor], tensor: torch.Tensor) -> None:
        for t, piece in zip(self.parts, tensor.split(self.rows, dim=0)):
            t.load_into(slots, piece)


Targets = Target | SplitTarget


def _expert_keys(stack: ExpertStack, present: set[str] | SafetensorsFiles) -> dict[str, Target]:
    """The layer's expert keys in the spelling the files use (fused, or the first per-expert spelling whose
    expert 0 is there); the first per-expert spelling when none is (the fused one where the family has no
    per-expert spelling or puts it first, stack.fused_first), so that they are reported missing."""
    found = stack.fused_in(present)
    fused = (found or stack.fused).keys()
    per_expert_present = any(k.first.format(e=0) in present for k in stack.per_expert)
    if found is not None or not stack.per_expert or (stack.fused_first and not per_expert_present):
        return {key: Target(param, (), layout) for (key, layout), param in zip(fused, stack.params)}
    w_gate_up, w_down = stack.params
    spelling = next((k for k in stack.per_expert if k.first.format(e=0) in present), stack.per_expert[0])
    gate, up = slice(0, stack.d_expert), slice(stack.d_expert, 2 * stack.d_expert)
    keys = {}
    if spelling.gate is None:  # ungated: the up tensor is the whole W_gate_up row block
        up = slice(0, stack.d_expert)
    for e in range(stack.n_experts):
        if spelling.gate is not None:
            keys[spelling.gate.format(e=e)] = Target(w_gate_up, (e, gate))
        keys[spelling.up.format(e=e)] = Target(w_gate_up, (e, up))
        keys[spelling.down.format(e=e)] = Target(w_down, (e,))
    return keys


def expected_keys(site_map: SiteMap, present: set[str] | SafetensorsFiles = frozenset()) -> dict[str, Targets]:
    """Every checkpoint key the model reads, with its target, in the spellings found in `present` (the
    first spelling of each where none is; optional weights only where present)."""
    keys: dict[str, Targets] = {}
    for entry in site_map.weights:
        if isinstance(entry, ExpertStack):
            keys.update(_expert_keys(entry, present))
            continue
        if isinstance(entry, PackedWeight):  # its first key; key_map adds how the rest combine with it
            keys[entry.keys[0]] = Target(entry.param, layout=entry.layout)
            continue
        if isinstance(entry, SplitWeight):
            found = next((k for k in entry.keys if k in present), entry.keys[0])
            parts = tuple(Target(p.param, p.index, p.layout) for p in entry.parts)
            keys[found] = SplitTarget(parts, tuple(p.rows for p in entry.parts))
            continue
        found = next((k for k in entry.keys if k in present), None)
        if found is not None or entry.required:
            keys[found or entry.keys[0]] = Target(entry.param, layout=entry.layout)
    return keys


def _list(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(k) for k in sorted(keys)[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def key_map(site_map: SiteMap, files: SafetensorsFiles, fmt: Format | None = None) -> dict[str, Targets]:
    """Check the checkpoint's keys against the site map (headers only); returns key -> target.

    fmt: the stored format config.json's quantization_config describes (moelens.loaders.quantized.stored_format);
    with it, each quantized tensor's target carries how it is stored, its companions checked and expected."""
    keys = expected_keys(site_map, files)
    packed = [e for e in site_map.weights if isinstance(e, PackedWeight)]
    present = [
        k for k in files.keys() if not k.endswith(IGNORED_SUFFIXES) and not k.startswith(site_map.ignored_prefixes or ("\0",))
    ]
    missing = [k for k in [*keys, *(k for e in packed for k in e.keys[1:])] if k not in files]
    if missing:
        raise CheckpointError(f"checkpoint {files.folder} is missing {len(missing)} tensor(s): {_list(missing)}")
    keys = _with_storage(site_map, files, keys, fmt)
    companions = {k for t in keys.values() if t.stored is not None for k in t.stored.keys[1:]}
    unexpected = [k for k in present if k not in keys and k not in companions]
    if unexpected:
        where = sorted({files.location[k].name for k in unexpected})
        hint = "does config.json describe these weights?"
        if fmt is None and any(k.endswith("_scale_inv") for k in unexpected):
            hint = "fp8 scales, but config.json has no quantization_config saying how they are stored"
        raise CheckpointError(
            f"checkpoint {files.folder} has {len(unexpected)} unexpected tensor(s) in {', '.join(where)}: "
            f"{_list(unexpected)} ({hint})"
        )
    return keys


def _with_storage(site_map: SiteMap, files: SafetensorsFiles, keys: dict[str, Targets], fmt: Format | None) -> dict[str, Targets]:
    """keys, each quantized one's target carrying how it is stored (checked from the headers)."""
    stored: dict[str, Stored] = {}
    for entry in site_map.weights:
        if isinstance(entry, PackedWeight):
            if fmt is None or fmt.method != entry.method:
                said = "has no quantization_config" if fmt is None else f"says quant_method {fmt.method!r}"
                raise CheckpointError(
                    f"{files.folder / 'config.json'} {said}, but {entry.param} is stored as {entry.method} "
                    f"({', '.join(map(repr, entry.keys))})"
                )
            stored[entry.keys[0]] = fmt.packed(entry.keys, files)
    if isinstance(fmt, (Fp8Blocks, ModelOptFp8)):
        for key in keys:
            if key not in stored and (found := fmt.stored(key, files)) is not None:
                if isinstance(keys[key], SplitTarget):  # a block grid over rows that several parameters share
                    raise CheckpointError(
                        f"{files.location[key].name}: {key!r} is stored as {fmt.method} and split into "
                        f"{', '.join(keys[key].params)}; a quantized tensor read into several parameters is not supported"
                    )
                stored[key] = found
    if isinstance(fmt, Fp8Blocks):
        _check_fused_blocks(site_map, stored, files)
    return {k: dataclasses.replace(t, stored=stored[k]) if k in stored else t for k, t in keys.items()}


def _check_fused_blocks(site_map: SiteMap, stored: dict[str, Stored], files: SafetensorsFiles) -> None:
    """A fused fp8 gate_up [E, 2 * d_expert, d_model] whose d_expert the block does not divide has two readings
    (a block grid over the fused rows, or gate's and up's grids stacked, as transformers' fused fp8 experts hold
    them): refused rather than guessed. Per-expert keys, and every published checkpoint (d_expert a multiple of
    128), have one."""
    for stack in site_map.expert_stacks():
        gate_up = (stack.fused_in(files) or stack.fused).gate_up
        found = stored.get(gate_up)
        if found is not None and isinstance(found.format, Fp8Blocks) and stack.d_expert % found.format.block[0]:
            raise CheckpointError(
                f"{files.location[gate_up].name}: fused fp8 {gate_up!r} stacks gate and up "
                f"rows of {stack.d_expert} each, which blocks of {found.format.block[0]} rows do not divide: its scale "
                f"{found.keys[1]!r} {files.shapes[found.keys[1]]} could be a grid over the fused rows or gate's and "
                "up's grids stacked. Store the experts per expert (the Hub's layout), where each is unambiguous"
            )


def slot_map(model: nn.Module, keys: dict[str, Targets]) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of the model by name; each must be the target of some key."""
    slots = dict(model.named_parameters()) | dict(model.named_buffers())
    uncovered = set(slots) - {p for t in keys.values() for p in t.params}
    if uncovered:  # a bug in the key map, not in the checkpoint: these would stay uninitialised
        raise RuntimeError(f"the checkpoint key map leaves these parameters unfilled: {sorted(uncovered)}")
    return slots


def check_shapes(slots: dict[str, torch.Tensor], files: SafetensorsFiles, keys: dict[str, Targets]) -> None:
    """Every checkpoint tensor's shape, from the headers, against its slot: fail before reading any data."""
    wrong = {key: t.stored_shape(slots) for key, t in keys.items()}
    wrong = {key: shape for key, shape in wrong.items() if dense_shape(files, key, keys[key]) != shape}
    if wrong:
        key, expected = next(iter(wrong.items()))
        more = f" ({len(wrong) - 1} more tensor(s) mismatch too: {_list(list(wrong)[1:], 3)})" if len(wrong) > 1 else ""
        stored = keys[key].stored
        how = "" if stored is None else f" (dequantized from {stored.format.method}: {', '.join(map(repr, stored.keys))})"
        raise CheckpointError(
            f"{files.location[key].name}: tensor {key!r} has shape {dense_shape(files, key, keys[key])}{how}, but the "
            f"config ({files.folder / 'config.json'}) needs {expected} for {' + '.join(keys[key].params)}{more}"
        )


def dense_shape(files: SafetensorsFiles, key: str, target: Targets) -> tuple[int, ...]:
    """The shape a key's tensor has once read: as stored, or dequantized."""
    return files.shapes[key] if target.stored is None else target.stored.shape


def warn_cast_dtypes(slots: dict[str, torch.Tensor], files: SafetensorsFiles, keys: dict[str, Targets]) -> None:
    """One warning per file and stored dtype that is not a float type: its values are cast, maybe changed."""
    groups: dict[tuple[str, str], list[str]] = {}
    for key, target in keys.items():
        if target.stored is None and files.dtypes[key] not in FLOAT_DTYPES:
            groups.setdefault((files.location[key].name, files.dtypes[key]), []).append(key)
    for (name, stored), group in groups.items():
        cast_to = slots[keys[group[0]].params[0]].dtype
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
    keys: dict[str, Targets],
    progress: bool | None = None,
    check_finite: bool = True,
    offloaded: dict[str, torch.Tensor] | None = None,
) -> None:
    """Copy each checkpoint tensor into its slot, one tensor in memory at a time (a quantized one with its
    companions, dequantized into the slot's dtype).

    check_finite: count the NaN and Inf values of each tensor once in its slot (after the cast, so that an
    overflow shows too) and warn, once, about every tensor that holds any.
    offloaded: slots that are no longer the model's parameters (offloaded routed experts): host tensors are
    filled like the rest; meta tensors (experts left on disk) are only checked for shape.
    """
    slots = slot_map(model, keys) | (offloaded or {})
    check_shapes(slots, files, keys)
    warn_cast_dtypes(slots, files, keys)
    to_read = [k for k, t in keys.items() if not any(slots[p].is_meta for p in t.params)]
    plain = [k for k in to_read if keys[k].stored is None]
    quantized = [keys[k].stored.keys for k in to_read if keys[k].stored is not None]
    not_finite: list[str] = []
    bar = tqdm(total=len(to_read), desc="loading", unit="tensor", disable=None if progress is None else not progress)

    def settle(key: str, tensor: torch.Tensor) -> None:
        target = keys[key]
        if target.stored is not None:  # on the slot's device: the same bits anywhere (float32 products, one cast)
            slot = slots[target.param][target.index]
            tensor = target.stored.dequantize(tuple(t.to(slot.device) for t in tensor), slot.dtype)
        target.load_into(slots, tensor)
        for slot in (slots[t.param][t.index] for t in target.targets):
            if check_finite and (bad := not_finite_count(slot)):
                nan = int(torch.isnan(slot).sum())
                not_finite.append(
                    f"{key!r} in {files.location[key].name}: {nan} NaN and {bad - nan} Inf of {slot.numel()} "
                    f"values as {slot.dtype}"
                )
        bar.update()

    with torch.no_grad():
        for key, tensor in files.read(plain):
            settle(key, tensor)
        for group, tensors in files.read_groups(quantized):
            settle(group[0], tensors)
    bar.close()
    if not_finite:
        more = f"; and {len(not_finite) - 8} more" if len(not_finite) > 8 else ""
        warnings.warn(
            f"{len(not_finite)} tensor(s) of {files.folder} hold NaN or Inf values: {'; '.join(not_finite[:8])}{more} "
            "(from_pretrained(check_finite=False) skips this check)",
            CheckpointWarning,
            stacklevel=3,
        )
