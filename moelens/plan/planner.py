"""plan(): a model planned from its config alone, the steps of the other modules put together."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moelens.dtypes import parse_dtype
from moelens.families import family_for
from moelens.loaders.errors import CheckpointError
from moelens.loaders.quantized import stored_format
from moelens.placement import parse_size
from moelens.plan.fit import (
    DEFAULT_BATCH, DEFAULT_SEQ, Device, check_tokens, gpu_devices, needs_of, place, system_memory,
)
from moelens.plan.report import plan_text
from moelens.plan.source import read_source, stored_weights
from moelens.plan.stored import check_expert_storage, plan_stored
from moelens.plan.terms import (
    Count, LayerCount, activation_terms, cache_bytes, count_terms, float32_router, forward_flops, meta_tensors,
    model_terms,
)
from moelens.weights import hidden_weight_count

# Beyond this a plan measures nothing real: the largest published models have ~15k (mixture layer, expert)
# pairs (DeepSeek-V3 58 x 256, Kimi K2 60 x 384)
MAX_EXPERT_MODULES = 2**17


@dataclass
class Plan:
    where: str
    family: str
    model_class: str
    dtype: str
    parameters: int
    bytes: int
    components: dict[str, Count]
    per_layer: list[LayerCount]
    activations: dict
    kv_cache: dict
    placement: dict
    on_disk: dict | None
    config: dict = field(repr=False)  # a few MoeConfig fields, for the printout
    # a config with a quantization_config: the checkpoint as stored, and the placements of both run-time modes
    # (plan_stored); {"error": ...} for a format moelens does not read; None for an unquantized config
    stored: dict | None = None
    # TransformerLens's n_params (the loaded model's cfg.n_params): the weight matrices outside the embedding and
    # unembedding, no norms or biases; `parameters` counts everything, embeddings included
    n_params: int = 0
    # forward FLOPs in the weights' matmuls, from the parts' terms (terms.forward_flops)
    flops: dict | None = None

    def to_json(self) -> dict:
        out = {
            "model": self.where,
            "family": self.family,
            "model_class": self.model_class,
            "dtype": self.dtype,
            "parameters": self.parameters,
            "n_params": self.n_params,
            "bytes": self.bytes,
            "components": {k: dataclasses.asdict(v) for k, v in self.components.items()},
            "per_layer": [dataclasses.asdict(layer) for layer in self.per_layer],
            "activations": self.activations,
            "kv_cache": self.kv_cache,
            "placement": self.placement,
            "on_disk": self.on_disk,
            "config": self.config,
            "flops": self.flops,
        }
        return out if self.stored is None else out | {"stored": self.stored}

    def __str__(self) -> str:
        return "\n".join(plan_text(self))


def plan(
    model: str | Path | dict,
    dtype: str | torch.dtype = "bfloat16",
    devices: Sequence[str] | str | None = None,
    gpus: int | None = None,
    gpu_memory: int | str | None = None,
    cpu_memory: int | str | None = None,
    batch: int = DEFAULT_BATCH,
    seq: int = DEFAULT_SEQ,
    revision: str | None = None,
    expert_storage: str | None = None,
    fp8_scale_dtype: str = "float32",
) -> Plan:
    """Plan a model from its config: counts, memory of a forward, KV cache and placements that fit.

    model: a checkpoint folder, a config.json path, an embedded default name, a Hub id (only config.json
    is fetched) or a config.json dict. devices: ["cuda:0", ...] (memory from torch.cuda, or gpu_memory);
    gpus: N GPUs of gpu_memory each; neither: the CPU only. cpu_memory: default this machine's memory.
    Sizes are bytes or strings like "141GB", "80GiB".

    A quantized config (quantization_config) is also counted as stored (Plan.stored) and placed both ways;
    expert_storage says which of the two Plan.placement is: "dequantized" (None: every weight dense in dtype,
    from_pretrained's default) or "stored" (the routed experts kept as stored; also spelt "fp8" / "mxfp4").
    fp8_scale_dtype: what a block fp8 checkpoint stores its scales in (config.json does not say; float32
    unless scale_fmt is "ue8m0")."""
    dtype = parse_dtype(dtype)
    check_tokens(batch=batch, seq=seq)
    gpu_list = gpu_devices(devices, gpus, gpu_memory)
    cpu = Device("cpu", parse_size(cpu_memory) if cpu_memory is not None else system_memory())
    source = read_source(model, revision)
    model_type = source.raw.get("model_type")
    family = family_for(model_type if isinstance(model_type, str) else None, f"{source.where}: config.json")
    try:
        cfg = family.config_from_hf(source.raw)
    except KeyError as err:
        raise CheckpointError(f"{source.where}: config.json lacks the field {err.args[0]!r} that {family.__name__} needs") from err
    except ValueError as err:
        raise CheckpointError(f"{source.where}: config.json: {err}") from err
    expert_modules = len(cfg.moe_layer_indices) * cfg.n_experts
    if expert_modules > MAX_EXPERT_MODULES:
        raise CheckpointError(
            f"{source.where}: config.json: {len(cfg.moe_layer_indices):,} mixture layers x {cfg.n_experts:,} experts = "
            f"{expert_modules:,} experts in all, more than moelens plans for ({MAX_EXPERT_MODULES:,}, far above any "
            "published model); is config.json right?"
        )
    try:
        fmt, unreadable = stored_format(source.raw, Path(source.where)), None
    except CheckpointError as err:  # a format moelens does not read: still planned dense, and said so
        fmt, unreadable = None, str(err)
    selected = check_expert_storage(expert_storage, fmt, unreadable, source.where)
    on_disk = stored_weights(source.folder)
    if cfg.tie_word_embeddings and on_disk and on_disk.get("has_lm_head"):
        cfg = dataclasses.replace(cfg, tie_word_embeddings=False)  # a stored head wins, as the loader does
    cfg = dataclasses.replace(cfg, dtype=dtype)
    components, layers = count_terms(cfg, model_terms(family, cfg))
    recipe = family.recipe(cfg)
    router_in_float32 = float32_router(recipe)
    acts = activation_terms(cfg, batch, seq, router_in_float32)
    needs = needs_of(cfg, family, components, layers, batch, seq)
    stored = None if unreadable is None else {"error": unreadable}
    if fmt is not None:
        stored = plan_stored(source, family, cfg, fmt, needs, gpu_list, cpu, fp8_scale_dtype, selected)
    return Plan(
        where=source.where,
        family=cfg.family,
        model_class=family.__name__,
        dtype=str(dtype).removeprefix("torch."),
        parameters=sum(c.parameters for c in components.values()),
        n_params=hidden_weight_count(meta_tensors(family, cfg)[0]),
        bytes=sum(c.bytes for c in components.values()),
        components=components,
        per_layer=layers,
        activations={"batch": batch, "seq": seq, "terms": acts, "peak": acts["peak"]["bytes"]},
        kv_cache=dict(zip(("bytes", "counts"), cache_bytes(recipe, cfg, batch, seq))),
        placement=place(needs, gpu_list, cpu) if fmt is None else stored["modes"][selected]["placement"],
        on_disk=on_disk,
        config={
            "n_layers": cfg.n_layers, "d_model": cfg.d_model, "n_experts": cfg.n_experts,
            "top_k": max(cfg.top_k_per_layer, default=0), "d_expert": cfg.d_expert, "d_vocab": cfg.d_vocab,
            "tie_word_embeddings": cfg.tie_word_embeddings, "router_in_float32": router_in_float32,
        },
        stored=stored,
        flops=forward_flops(model_terms(family, cfg), batch, seq),
    )
