"""What a model needs before its weights are downloaded: parameters, bytes, activations, KV cache, placement.

`plan(name_or_path_or_config, dtype=..., ...)` reads config.json only (a local folder, a config file, an
embedded default name, a Hub id fetched as that one file, or a config dict). Where safetensors files are
present their headers are read, never their data, to show what is stored next to what is computed.

Parameters are counted from the recipe's parts, each class saying what it holds for a config
(moelens.models.terms; no model is built, so 671B plans as fast as a tiny one); tests hold those terms to the
model loading builds, name by name: routers kept float32 in low-precision models count 4 bytes, tied
embeddings count once. The cache is counted from each mixer's state tensors in their own dtypes.

A config with a quantization_config (block fp8, MXFP4) is also counted as the checkpoint stores it
(moelens.stored_size), and placed under both run-time modes: dequantized at load (every weight dense in the
dtype, from_pretrained's default) and with the routed experts kept as stored (the rest dense).

The modules, one job each: source (config.json and the files' headers), terms (counts by component and
layer, activations, the cache), fit (needs and placements), stored (a quantized checkpoint), report (the
printout), planner (plan() putting them together). The Hub is asked in moelens.plan.source only.
"""

from moelens.placement import parse_size
from moelens.plan.fit import (
    DEFAULT_BATCH,
    DEFAULT_SEQ,
    HEADROOM,
    MAX_GPUS,
    PREFERENCE,
    Device,
    Needs,
    assign_parts,
    auto_device_map,
    check_tokens,
    device_map,
    expert_offload,
    expert_parallel,
    gpu_devices,
    map_of,
    needs_of,
    one_device,
    place,
    system_memory,
    with_experts_offloaded,
)
from moelens.plan.planner import MAX_EXPERT_MODULES, Plan, plan
from moelens.plan.report import to_json_text
from moelens.plan.source import Source, hub_config, read_source, stored_weights
from moelens.plan.stored import EXPERT_STORAGE, plan_stored, with_stored_experts
from moelens.plan.terms import (
    COMPONENTS,
    Count,
    LayerCount,
    activation_terms,
    build_meta_model,
    cache_bytes,
    count_model,
    count_terms,
    forward_flops,
    layer_cache_bytes,
    model_terms,
)
from moelens.plan.units import human, human_count

__all__ = [
    "COMPONENTS", "DEFAULT_BATCH", "DEFAULT_SEQ", "EXPERT_STORAGE", "HEADROOM", "MAX_EXPERT_MODULES", "MAX_GPUS",
    "PREFERENCE", "Count", "Device", "LayerCount", "Needs", "Plan", "Source", "activation_terms", "assign_parts",
    "auto_device_map", "build_meta_model", "cache_bytes", "check_tokens", "count_model", "count_terms", "device_map",
    "expert_offload", "expert_parallel", "forward_flops", "gpu_devices", "hub_config", "human",
    "human_count", "layer_cache_bytes", "map_of", "model_terms", "needs_of", "one_device", "parse_size", "place",
    "plan", "plan_stored", "read_source", "stored_weights", "system_memory", "to_json_text",
    "with_experts_offloaded", "with_stored_experts",
]
