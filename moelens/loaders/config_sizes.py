"""config.json's sizes against the checkpoint's own tensors, read from the safetensors headers only, before
anything per layer or per expert is built from them: a wrong size is an error naming the field, its value and
the tensor (or the count of tensors) that contradicts it, instead of minutes of building and gigabytes
allocated first.

check_raw_sizes runs on config.json as read, before the family turns it into a config (which builds per-layer
tables, and refuses a size past moelens's bound without the checkpoint at hand): a size past its bound is
shown against what the checkpoint holds. check_sizes runs on that config and the family's site map, before
the per-expert key map: the embedding's shape, the last layer, each layer's experts. Every other shape is
checked against the model built on the meta device, before any memory is allocated (pretrained.load).
"""

from __future__ import annotations

from pathlib import Path

from moelens.config import SIZE_BOUNDS, MoeConfig
from moelens.loaders.errors import CheckpointError
from moelens.loaders.safetensors_files import SafetensorsFiles
from moelens.sitemap import ExpertStack, SiteMap, Weight

# widths every family stores as a dimension of the embedding ([vocab_size, hidden_size])
WIDTH_FIELDS = ("hidden_size", "vocab_size")
# counts: every layer and every expert has tensors of its own (or the experts one dimension of a fused tensor)
LAYER_FIELD = "num_hidden_layers"
EXPERT_FIELDS = ("num_experts", "n_routed_experts", "num_local_experts")


def check_raw_sizes(raw: dict, files: SafetensorsFiles, config: Path) -> None:
    """A width or count past its bound (moelens.config.SIZE_BOUNDS), against what the checkpoint could hold:
    its widest tensor dimension for a width, its number of tensors (and widest dimension, for fused experts)
    for a count of layers or experts."""
    largest = max(files.shapes, key=lambda k: max(files.shapes[k], default=0), default=None)
    largest_dim = max(files.shapes[largest], default=0) if largest is not None else 0
    biggest = f"the largest dimension is {largest_dim:,} ({largest!r} {files.shapes.get(largest, ())})"
    n_tensors = len(files.shapes)
    for field in WIDTH_FIELDS:
        for value in _ints(raw.get(field)):
            if value > SIZE_BOUNDS[field] and value > largest_dim:
                raise CheckpointError(
                    f"{config}: {field} = {value:,}, but no tensor of the checkpoint ({files.folder}) is that wide: {biggest}"
                )
    for field in (LAYER_FIELD, *EXPERT_FIELDS):
        limit = n_tensors if field == LAYER_FIELD else max(n_tensors, largest_dim)
        for value in _ints(raw.get(field)):
            if value > SIZE_BOUNDS[field] and value > limit:
                what = "layers" if field == LAYER_FIELD else "experts"
                raise CheckpointError(
                    f"{config}: {field} = {value:,}, but the checkpoint ({files.folder}) holds {n_tensors:,} tensors "
                    f"and {biggest}: too few for {value:,} {what}"
                )


def _ints(value) -> list[int]:
    """The integers of a field (Hunyuan gives some per layer, as a list); anything else is left to the
    family's typed reads, which name it."""
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def check_sizes(cfg: MoeConfig, site_map: SiteMap, files: SafetensorsFiles, config: Path) -> None:
    """vocab_size and hidden_size against the embedding, num_hidden_layers against the last layer's tensors,
    the expert count against each mixture layer's stored experts. A key stored in none of the map's spellings
    is left to the key map, which lists what is missing."""
    weights = list(site_map.weight_entries())
    embed = next((w for w in weights if w.param == "embed.weight"), None)
    key = _stored(embed, files)
    if key is not None:
        shape = files.shapes[key]
        for field, value, dim in (("vocab_size", cfg.d_vocab, 0), ("hidden_size", cfg.d_model, 1)):
            if len(shape) == 2 and shape[dim] != value:
                raise CheckpointError(
                    f"{config}: {field} = {value:,}, but the checkpoint's embedding {key!r} has shape {shape} "
                    f"({files.location[key].name}), where the config needs {(cfg.d_vocab, cfg.d_model)}"
                )
    _check_layers(cfg, weights, files, config)
    for stack in site_map.expert_stacks():
        _check_experts(cfg, stack, files, config, site_map.ignored_prefixes)


def _stored(entry: Weight | None, files: SafetensorsFiles) -> str | None:
    return None if entry is None else next((k for k in entry.keys if k in files), None)


def _check_layers(cfg: MoeConfig, weights: list[Weight], files: SafetensorsFiles, config: Path) -> None:
    """Each layer's first required tensor stands for the layer: the last layer's must be there."""
    first: dict[int, Weight] = {}
    for w in weights:
        parts = w.param.split(".")
        if parts[0] == "blocks" and w.required:
            first.setdefault(int(parts[1]), w)
    last = first.get(cfg.n_layers - 1)
    if last is None or _stored(last, files) is not None:
        return
    stored = [layer for layer, w in sorted(first.items()) if _stored(w, files) is not None]
    held = f"layers 0 to {stored[-1]}" if stored else "no layer"
    raise CheckpointError(
        f"{config}: num_hidden_layers = {cfg.n_layers:,}, but the checkpoint ({files.folder}) holds {held} "
        f"(no {last.keys[0]!r})"
    )


def _check_experts(
    cfg: MoeConfig, stack: ExpertStack, files: SafetensorsFiles, config: Path, ignored: tuple[str, ...] = ()
) -> None:
    field = next((f for f in EXPERT_FIELDS if f in cfg.fields_read), "the expert count")
    layer = stack.prefix.split(".")[1]
    fused = stack.fused_in(files)
    if fused is not None:
        stored = files.shapes[fused.gate_up][0] if files.shapes[fused.gate_up] else 0
        if stored != stack.n_experts:
            raise CheckpointError(
                f"{config}: {field} = {stack.n_experts:,}, but layer {layer}'s {fused.gate_up!r} has shape "
                f"{files.shapes[fused.gate_up]} ({stored} experts)"
            )
        return
    spelling = next((k for k in stack.per_expert if k.first.format(e=0) in files), None)
    if spelling is None:
        return
    stored = 0
    # at most as many steps as the files hold tensors; keys the family ignores are not experts (LongCat-Flash's
    # identity experts' rows, which transformers saves)
    while spelling.first.format(e=stored) in files and not spelling.first.format(e=stored).startswith(ignored or ("\0",)):
        stored += 1
    if stored != stack.n_experts:
        beyond = spelling.first.format(e=stored) if stored < stack.n_experts else spelling.first.format(e=stack.n_experts)
        raise CheckpointError(
            f"{config}: {field} = {stack.n_experts:,}, but layer {layer} of the checkpoint stores {stored} experts "
            f"(experts 0 to {stored - 1}; {'no' if stored < stack.n_experts else 'also'} {beyond!r})"
        )
