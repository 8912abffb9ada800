"""A quantized checkpoint (block fp8, MXFP4): its bytes as stored, by component and layer, from config.json,
and the placements of its two run-time modes (dequantized at load; the routed experts kept as stored)."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moelens.dtypes import parse_dtype
from moelens.loaders.errors import CheckpointError
from moelens.loaders.quantized import MXFP4_GROUP, SUPPORTED, Format, Fp8Blocks, ModelOptFp8
from moelens.models.terms import COMPONENTS
from moelens.plan.fit import Device, Needs, expert_bytes_each, place
from moelens.plan.source import Source
from moelens.plan.terms import LINEAR_COMPONENTS, Count, meta_tensors, model_terms
from moelens.stored_size import scale_bytes, stored_tensors

# run-time modes of a quantized checkpoint: every weight dense in the dtype, or the routed experts as stored
EXPERT_STORAGE = ("dequantized", "stored")


def stored_dtype(raw: dict, where: str, fallback: torch.dtype) -> tuple[torch.dtype, str]:
    """The dtype a checkpoint stores its unquantized tensors in: config.json's dtype (transformers 5's name) or
    torch_dtype; where it names neither, `fallback`, and the second value says so."""
    for name in ("dtype", "torch_dtype"):
        value = raw.get(name)
        if value is not None:
            try:
                return parse_dtype(value), f"config.json's {name}"
            except ValueError as err:
                raise CheckpointError(f"{where}: config.json: {name}: {err}") from err
    return fallback, "the plan's dtype: config.json names no dtype"


def check_expert_storage(value: str | None, fmt: Format | None, unreadable: str | None, where: str) -> str:
    """The run-time mode a plan places: "dequantized" (None, the default) or "stored" (also spelt as the stored
    format's name, as from_pretrained's expert_storage is), which needs a format moelens reads."""
    if value is None or value == "dequantized":
        return "dequantized"
    if value != "stored" and value not in SUPPORTED:
        raise ValueError(
            f"expert_storage must be one of {', '.join(map(repr, EXPERT_STORAGE))} or a stored format's name "
            f"({', '.join(map(repr, SUPPORTED))}), got {value!r}"
        )
    if fmt is None:
        why = unreadable or "it has no quantization_config: its weights are stored dense"
        raise ValueError(f"expert_storage {value!r}: {where}'s config.json describes no stored format moelens reads ({why})")
    if value != "stored" and value != fmt.method:
        raise ValueError(f"expert_storage {value!r}, but {where}'s config.json stores the weights as {fmt.method!r}")
    if isinstance(fmt, ModelOptFp8):
        raise ValueError(f"expert_storage {value!r}: {where}'s ModelOpt FP8 weights are dequantized at load; moelens "
                         "keeps block fp8 and mxfp4 experts as stored, not per-tensor fp8")
    return "stored"


@dataclass(frozen=True)
class StoredCounts:
    """A checkpoint as stored: (dense values, bytes) by component (scales are in the bytes only), bytes per layer
    and its routed experts' bytes per layer, and every stored element (scales included)."""

    components: tuple[tuple[str, int, int], ...]
    layer_bytes: tuple[int, ...]
    expert_bytes: tuple[int, ...]
    values: int


@functools.lru_cache(maxsize=4)
def count_stored(family, stored_cfg, fmt: Format, scale_dtype: str) -> StoredCounts:
    """The checkpoint of stored_cfg (its dtype: what dense tensors are stored in) as fmt stores it; kept for the
    next plan of the same config (another device set)."""
    terms = {t.name: t for t in model_terms(family, stored_cfg)}
    params, buffers = meta_tensors(family, stored_cfg)
    tensors = stored_tensors(
        family.site_map(stored_cfg), params, buffers, fmt, stored_cfg.dtype,
        lambda name: terms[name].component in LINEAR_COMPONENTS, scale_dtype,
    )
    components = {name: Count() for name in COMPONENTS}
    layer_bytes, expert_bytes = [0] * stored_cfg.n_layers, [0] * stored_cfg.n_layers
    for param, stored in tensors.items():
        term = terms[param]
        for t in stored:
            components[term.component].add(math.prod(t.shape), t.bytes)
            if term.layer is not None:
                layer_bytes[term.layer] += t.bytes
                if term.component == "routed_experts":
                    expert_bytes[term.layer] += t.bytes
    return StoredCounts(
        tuple((name, c.parameters, c.bytes) for name, c in components.items()), tuple(layer_bytes), tuple(expert_bytes),
        sum(t.values for stored in tensors.values() for t in stored),
    )


def with_stored_experts(needs: Needs, stored_expert_bytes: Sequence[int]) -> Needs:
    """The needs of a model whose routed experts stay as stored: each block's experts at their stored bytes;
    while a layer runs, its active experts (min(n_experts, batch*seq*top_k), those of the rank under expert
    parallelism) are dequantized in the dtype, as an offloaded layer stages them (a kernel that reads the
    stored format directly needs less): Needs.expert_working."""
    blocks = [
        dataclasses.replace(b, bytes=b.bytes - b.routed_experts_bytes + stored, routed_experts_bytes=stored)
        for b, stored in zip(needs.blocks, stored_expert_bytes, strict=True)
    ]
    each = max((expert_bytes_each(b) for b in needs.blocks if b.n_experts), default=0)
    return dataclasses.replace(needs, blocks=blocks, dequantized_each=each)


def format_of(fmt: Format, scale_dtype: str) -> dict:
    if isinstance(fmt, ModelOptFp8):  # one float32 scale per weight (and the activations' input_scale)
        return {"method": fmt.method, "block": None, "scales": "float32", "scale_bytes": 4,
                "not_converted": list(fmt.excluded)}
    if isinstance(fmt, Fp8Blocks):
        scales = "E8M0 (1 byte)" if fmt.scale_fmt == "ue8m0" else scale_dtype
        return {"method": fmt.method, "block": list(fmt.block), "scales": scales, "scale_bytes": scale_bytes(fmt, scale_dtype),
                "not_converted": list(fmt.not_converted)}
    return {"method": fmt.method, "block": [1, MXFP4_GROUP], "scales": "E8M0 (1 byte)", "scale_bytes": 1,
            "not_converted": list(fmt.not_converted)}


def plan_stored(
    source: Source, family, cfg, fmt: Format, needs: Needs, gpus: Sequence[Device], cpu: Device, scale_dtype: str,
    selected: str,
) -> dict:
    """The checkpoint as stored (by component and layer, from config.json) and the placements of both run-time
    modes: "dequantized" (needs, every weight dense in cfg.dtype) and "stored" (the routed experts as stored)."""
    dtype, dtype_from = stored_dtype(source.raw, source.where, cfg.dtype)
    counts = count_stored(family, dataclasses.replace(cfg, dtype=dtype), fmt, scale_dtype)
    kept = with_stored_experts(needs, counts.expert_bytes)
    tokens = f"batch {needs.batch} x seq {needs.seq}"
    return {
        "format": format_of(fmt, scale_dtype),
        "dtype": str(dtype).removeprefix("torch."),
        "dtype_from": dtype_from,
        "bytes": sum(nbytes for _, _, nbytes in counts.components),
        # every stored element, scales included: what the Hub reports as a checkpoint's parameter count
        "values": counts.values,
        "components": {name: {"parameters": n, "bytes": nbytes} for name, n, nbytes in counts.components},
        "per_layer": [
            {"layer": i, "bytes": b, "routed_experts_bytes": e}
            for i, (b, e) in enumerate(zip(counts.layer_bytes, counts.expert_bytes, strict=True))
        ],
        "expert_storage": selected,
        "modes": {
            "dequantized": {"weights": needs.weights, "routed_experts": needs.routed_experts, "placement": place(needs, gpus, cpu)},
        } | ({} if isinstance(fmt, ModelOptFp8) else {  # per-tensor fp8 is dequantized at load only
            "stored": {
                "weights": kept.weights,
                "routed_experts": kept.routed_experts,
                "dequantized_working": kept.expert_working(),
                "counts": f"the routed experts as stored, the rest dense; working memory adds one layer's active experts "
                f"dequantized in {str(cfg.dtype).removeprefix('torch.')}: min(n_experts, {tokens} x top_k) of them "
                "(under expert parallelism, of the rank's experts)",
                "placement": place(kept, gpus, cpu),
            },
        }),
    }
