"""What a model needs before its weights are downloaded: parameters, bytes, activations, KV cache, placement.

`plan(name_or_path_or_config, dtype=..., ...)` reads config.json only (a local folder, a config file, an
embedded default name, a Hub id fetched as that one file, or a config dict). Where safetensors files are
present their headers are read, never their data, to show what is stored next to what is computed.

Parameters are counted on the moelens model itself, built on the meta device as the loader builds it, so the
count cannot drift from what loading allocates: routers kept float32 in low-precision models count 4 bytes,
tied embeddings count once.

A config with a quantization_config (block fp8, MXFP4) is also counted as the checkpoint stores it
(moelens.stored_size), and placed under both run-time modes: dequantized at load (every weight dense in the
dtype, from_pretrained's default) and with the routed experts kept as stored (the rest dense).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from huggingface_hub import hf_hub_download, snapshot_download

from moelens import defaults
from moelens.dtypes import parse_dtype
from moelens.families import family_for
from moelens.loaders import read_config
from moelens.loaders.errors import CheckpointError
from moelens.loaders.files import CONFIG_MAX_BYTES, read_json_object
from moelens.loaders.quantized import MXFP4_GROUP, SUPPORTED, Format, Fp8Blocks, stored_format
from moelens.loaders.safetensors_files import INDEX_FILE, SafetensorsFiles
from moelens.placement import parse_size
from moelens.locate import check_hub_id, check_not_empty, resolve
from moelens.stored_size import scale_bytes, stored_tensors
from moelens.weights import hidden_weight_count

COMPONENTS = (
    "embeddings", "attention", "norms", "routers", "routed_experts", "shared_experts", "dense_mlp", "unembedding",
)
HEADROOM = 0.10  # of each device's memory, left free: allocator fragmentation, CUDA context, kernels' workspace
# preferred first: one device (no transfers), then a device map (only hidden states cross devices), then
# expert parallel (all-to-all of tokens per layer), then offload (expert weights cross PCIe every forward)
PREFERENCE = ("one_device", "device_map", "expert_parallel", "expert_offload")
DEFAULT_BATCH, DEFAULT_SEQ = 1, 2048  # the forward a plan reserves working memory and KV cache for
# Beyond these a plan measures nothing real and building it costs minutes: the largest published models have
# ~15k (mixture layer, expert) pairs (DeepSeek-V3 58 x 256, Kimi K2 60 x 384), each a module of the meta model
MAX_GPUS = 2**12
MAX_EXPERT_MODULES = 2**17
# the parts whose matrices block fp8 stores quantized (transformers' fp8 quantizer converts linear layers only)
LINEAR_COMPONENTS = ("attention", "routed_experts", "shared_experts", "dense_mlp")
# run-time modes of a quantized checkpoint: every weight dense in the dtype, or the routed experts as stored
EXPERT_STORAGE = ("dequantized", "stored")


# ---- sizes -----------------------------------------------------------------------------------------

def human(n: float) -> str:
    """Bytes in decimal units, as disks and GPU spec sheets print them."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def human_count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


# ---- the config --------------------------------------------------------------------------------------


@dataclass
class Source:
    raw: dict  # config.json
    where: str  # for the printout
    folder: Path | None  # where weights may sit next to the config


def read_source(model: str | Path | dict, revision: str | None = None) -> Source:
    """config.json from a dict, a local folder or file, an embedded default name or a Hub id (that file only)."""
    if isinstance(model, dict):
        return Source(model, "config dict", None)
    name = str(model)
    check_not_empty(name)
    path = Path(name).expanduser()
    if name in defaults.NAMES and not path.exists():  # a shipped default, or a tiny one built (a few kB of weights)
        folder = resolve(name)
        return Source(read_config(folder), name, folder)
    if path.is_dir():
        return Source(read_config(path), str(path), path)
    if path.is_file():  # a config.json on its own
        return Source(read_json_object(path, CONFIG_MAX_BYTES), str(path), None)
    check_hub_id(name, "no checkpoint folder or config file")  # a mistyped name or path never goes to the Hub
    config = hub_config(name, revision)
    # the snapshot folder the config sits in: weights already in the cache for that commit are there too
    return Source(read_json_object(config, CONFIG_MAX_BYTES), f"{name} (Hub)", config.parent)


def hub_config(repo: str, revision: str | None = None) -> Path:
    """config.json of a Hub repo: from the local cache if there, else downloaded (that file only, never weights).

    resolve() is not used: it downloads the safetensors files, which is what planning should avoid.
    """
    try:
        return Path(hf_hub_download(repo, "config.json", revision=revision, local_files_only=True))
    except Exception:  # not cached: fetch it
        pass
    try:
        # snapshot_download, as loading does (moelens.loaders.hub): offline or with the Hub unreachable it fails at
        # once, where hf_hub_download retries its HEAD request for some 25 s
        config = Path(snapshot_download(repo, revision=revision, allow_patterns=["config.json"])) / "config.json"
    except Exception as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise FileNotFoundError(
            f"{repo!r} is not a local folder or file, and its config.json could not be fetched from the Hub nor "
            f"found in the local cache ({first})"
        ) from err
    if not config.is_file():
        raise FileNotFoundError(f"Hub repo {repo!r} has no config.json")
    return config


def stored_weights(folder: Path | None) -> dict | None:
    """What the safetensors files hold, from their headers only; None where there are none.

    A broken or partial set of files (a download in progress) is reported, not raised: the plan needs only
    the config."""
    if folder is None or not (any(folder.glob("*.safetensors")) or (folder / INDEX_FILE).exists()):
        return None
    try:
        files = SafetensorsFiles(folder)
    except CheckpointError as err:
        return {"error": str(err)}
    by_dtype: dict[str, int] = {}
    for key, nbytes in files.nbytes.items():
        by_dtype[files.dtypes[key]] = by_dtype.get(files.dtypes[key], 0) + nbytes
    return {
        "files": len(files.files),
        "file_bytes": sum(p.stat().st_size for p in files.files),  # tensors plus headers
        "tensor_bytes": sum(files.nbytes.values()),
        "parameters": sum(math.prod(s) for s in files.shapes.values()),
        "dtypes": by_dtype,
        "has_lm_head": "lm_head.weight" in files,
    }


# ---- parameter counts -----------------------------------------------------------------------------------


@dataclass
class Count:
    parameters: int = 0
    bytes: int = 0

    def add(self, parameters: int, nbytes: int) -> None:
        self.parameters += parameters
        self.bytes += nbytes


@dataclass
class LayerCount:
    layer: int
    kind: str  # "moe" | "dense"
    parameters: int = 0
    bytes: int = 0
    routed_experts_bytes: int = 0
    n_experts: int = 0
    top_k: int = 0


def build_meta_model(cfg, family):
    """The model exactly as loading allocates it (family.build): on the meta device (no memory, no weights),
    in the dtype, float32 routers where the family keeps them (Hunyuan, Solar) so they count 4 bytes each."""
    return family.build(cfg)


def component_of(name: str) -> tuple[str, int | None]:
    """(component, layer or None) of a moelens parameter or buffer name.

    An unknown name is a RuntimeError: a new module must be given a component, not silently dropped."""
    if name == "embed.weight":
        return "embeddings", None
    if name == "unembed.weight":
        return "unembedding", None
    if name == "ln_final.weight":
        return "norms", None
    match = re.fullmatch(r"blocks\.(\d+)\.(.+)", name)
    if match:
        layer, rest = int(match.group(1)), match.group(2)
        # a block of several sublayers (LongCat-Flash) numbers its second ones: ln1_1, attn_1, dense_0, dense_1
        if re.match(r"(ln[12](_\d+)?|attn(_\d+)?\.(q_norm|k_norm|q_a_layernorm|kv_a_layernorm))\.", rest):
            return "norms", layer
        if re.match(r"(attn(_\d+)?|mixer)\.", rest):  # the token mixer, whatever its kind
            return "attention", layer
        if re.match(r"dense_\d+\.(gate_proj|up_proj|down_proj)\.", rest):
            return "dense_mlp", layer
        if rest.startswith("mlp.router."):
            return "routers", layer  # weight and Solar's e_score_correction_bias (a buffer)
        if rest.startswith("mlp.experts."):
            return "routed_experts", layer
        if rest.startswith(("mlp.shared_expert.", "mlp.shared_gate.")):
            return "shared_experts", layer
        if rest.startswith(("mlp.gate_proj.", "mlp.up_proj.", "mlp.down_proj.")):
            return "dense_mlp", layer
    raise RuntimeError(f"moelens.plan does not know which component {name!r} belongs to")


@functools.lru_cache(maxsize=4)
def meta_tensors(family, cfg) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The parameters (tied ones once) and buffers of build_meta_model(cfg, family), kept for the next plan of
    the same config (another device set, the stored dtype): building the model's per-expert modules is most
    of a plan's time, while its meta tensors hold no memory."""
    model = build_meta_model(cfg, family)
    return dict(model.named_parameters()), dict(model.named_buffers())


def count_model(model) -> tuple[dict[str, Count], list[LayerCount]]:
    """Sum every parameter and buffer (tied ones once: named_parameters drops duplicates) by component and layer;
    routed experts held off the model (offloaded, sharded) at their full stacks' size, as if resident."""
    params = dict(model.named_parameters())
    for layer, block in enumerate(model.blocks):
        if block.is_moe:
            stacks = block.mlp.experts.stacks_held_elsewhere(model.cfg.dtype)
            params |= {f"blocks.{layer}.mlp.experts.{name}": t for name, t in stacks.items()}
    return count_tensors(model.cfg, params, dict(model.named_buffers()))


def count_tensors(
    cfg, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]
) -> tuple[dict[str, Count], list[LayerCount]]:
    """count_model of a model's parameters and buffers."""
    components = {name: Count() for name in COMPONENTS}
    layers = [
        LayerCount(i, "moe" if moe else "dense", n_experts=cfg.n_experts if moe else 0, top_k=cfg.top_k_per_layer[i])
        for i, moe in enumerate(cfg.moe_layers)
    ]
    for name, tensor in [*params.items(), *buffers.items()]:
        numel, nbytes = tensor.numel(), tensor.numel() * tensor.element_size()
        component, layer = component_of(name)
        components[component].add(numel, nbytes)
        if layer is not None:
            layers[layer].parameters += numel
            layers[layer].bytes += nbytes
            if component == "routed_experts":
                layers[layer].routed_experts_bytes += nbytes
    return components, layers


# ---- activations and KV cache ---------------------------------------------------------------------------


def activation_terms(cfg, batch: int, seq: int, float32_router: bool = False) -> dict[str, dict]:
    """Bytes of the largest tensors alive at once in a forward of batch x seq tokens, without caching hooks.

    Each term names its shapes; `peak` = residual + the largest of (attention, mlp, logits), since only one
    sublayer's temporaries are alive at a time (no gradients, no run_with_cache: that stores every hook)."""
    b = torch.tensor([], dtype=cfg.dtype).element_size()
    tokens = batch * seq
    # Hunyuan and Solar weigh the slot outputs with float32 router weights, which promotes them to float32
    slot_bytes = max(b, 4) if float32_router else b
    moe_k = [k for k, moe in zip(cfg.top_k_per_layer, cfg.moe_layers, strict=True) if moe]
    k = max(moe_k, default=0)
    terms = {
        "residual": (
            4 * tokens * cfg.d_model * b,
            "4 x [batch seq d_model]: the stream, the norm's output, the sublayer's output, the new stream",
        ),
        "attention": (
            batch * cfg.n_heads * seq * seq * (2 * b + 4)
            + tokens * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.d_head * b,
            "eager: scores and pattern [batch heads seq seq] in the dtype plus the float32 softmax between them; "
            "q, k, v, z [batch seq heads d_head]",
        ),
        "routed_experts": (
            tokens * k * (3 * cfg.d_expert * b + cfg.d_model * (b + 2 * slot_bytes)) + 3 * tokens * cfg.n_experts * 4
            if moe_k else 0,
            "largest layer: [batch*seq*top_k, 2*d_expert] gate/up and [.., d_expert] act*up, [.., d_model] gathered "
            "inputs, outputs and their unsorted copy; float32 router logits, scores, choice [batch seq n_experts]",
        ),
        "shared_or_dense_mlp": (
            3 * tokens * max(cfg.d_shared, cfg.d_mlp if cfg.dense_layer_indices else 0) * b,
            "gate, up and act*up [batch seq d_shared or d_mlp]",
        ),
        "logits": (
            tokens * cfg.d_vocab * (b + (4 if b != 4 else 0)),
            "[batch seq vocab] in the dtype and its float32 copy (the loss and most callers upcast)",
        ),
    }
    out = {name: {"bytes": int(nbytes), "counts": what} for name, (nbytes, what) in terms.items()}
    # the shared expert's intermediates are freed before the routed experts run (or the other way round)
    mlp = max(out["routed_experts"]["bytes"], out["shared_or_dense_mlp"]["bytes"])
    layer = max(out["attention"]["bytes"], mlp)
    out["layer_peak"] = {"bytes": out["residual"]["bytes"] + layer, "counts": "residual + max(attention, mlp)"}
    out["peak"] = {
        "bytes": out["residual"]["bytes"] + max(layer, out["logits"]["bytes"]),
        "counts": "residual + max(attention, mlp, logits)",
    }
    return out


def float32_router(recipe) -> bool:
    """Whether the mixture layers' routers keep float32 weights (their logits are then float32)."""
    return any(router.float32_weight for router in recipe.routers())


def cache_bytes(recipe, cfg, batch: int, seq: int) -> tuple[int, str]:
    """What a cache of batch x seq positions holds, in the model dtype, and how it was counted: per layer, its
    mixer's values per token times seq (keys and values; MLA caches decompressed ones of every head) plus its
    values per sequence (a recurrent state)."""
    states = recipe.state_bytes(cfg)
    per_token, per_sequence = sum(s.per_token for s in states), sum(s.per_sequence for s in states)
    b = torch.tensor([], dtype=cfg.dtype).element_size()
    counts = (f"batch {batch} x (seq {seq} x {per_token} values per token + {per_sequence} per sequence), summed over "
              f"{cfg.n_layers} layers, x {b} bytes")
    return batch * (seq * per_token + per_sequence) * b, counts


# ---- placement -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Device:
    name: str
    memory: int  # bytes
    headroom: float = HEADROOM  # 0 where memory is already what may be used (from_pretrained's max_memory)

    @property
    def budget(self) -> int:
        return int(self.memory * (1 - self.headroom))


@dataclass
class Needs:
    """What the placement options weigh: weights by part, per-forward working memory and the KV cache."""

    embedding: int  # embed weight
    final: int  # ln_final + unembed (0 for the unembed when tied: it is the embedding)
    tied_unembed: int  # bytes of the tied matrix a last device other than the first would need a copy of
    blocks: list[LayerCount]
    layer_peak: int  # residual + one sublayer's temporaries, on every device that runs blocks
    peak: int  # layer_peak, or residual + logits where larger
    kv_per_layer: int
    batch: int
    seq: int
    # held on every device that runs blocks, besides layer_peak: with the experts offloaded, their cache's
    # slots (see with_experts_offloaded)
    per_device: int = 0
    # the routed experts kept as stored (see with_stored_experts): the dense bytes of one expert, which a layer
    # dequantizes for each of its active experts while it runs; 0 where the experts are dense
    dequantized_each: int = 0

    @property
    def weights(self) -> int:
        return self.embedding + self.final + sum(b.bytes for b in self.blocks)

    @property
    def kv(self) -> int:
        return self.kv_per_layer * len(self.blocks)

    @property
    def routed_experts(self) -> int:
        return sum(b.routed_experts_bytes for b in self.blocks)

    @property
    def total(self) -> int:
        return self.weights + self.run_peak + self.kv

    def expert_working(self, experts_here: int | None = None) -> int:
        """Bytes of the active experts a layer dequantizes while it runs (experts kept stored): min(experts on
        this device, batch*seq*top_k) of them in the largest layer; experts_here None: all of a layer's."""
        tokens = self.batch * self.seq
        return max(
            (min(b.n_experts if experts_here is None else min(experts_here, b.n_experts), tokens * b.top_k)
             for b in self.blocks if b.n_experts),
            default=0,
        ) * self.dequantized_each

    @property
    def run_layer_peak(self) -> int:
        """layer_peak and, experts kept stored, a layer's dequantized active experts."""
        return self.layer_peak + self.expert_working()

    @property
    def run_peak(self) -> int:
        return max(self.peak, self.run_layer_peak)


def one_device(needs: Needs, devices: Sequence[Device]) -> tuple[dict | None, str]:
    """(a) everything on the first device whose budget holds weights + activations + KV cache."""
    for device in devices:
        if needs.total <= device.budget:
            return {"kind": "one_device", "device": device.name, "bytes": needs.total, "budget": device.budget}, ""
    best = max(devices, key=lambda d: d.budget)
    return None, f"needs {human(needs.total)}, more than the largest budget ({best.name}: {human(best.budget)})"


def assign_parts(needs: Needs, devices: Sequence[Device]) -> list[dict]:
    """Whole blocks per device, in the devices' order: each block goes on the current device if it still
    fits there, else on the next device that holds it (a device that cannot is skipped). The embedding goes
    with block 0, the final norm and unembedding (and the logits, where they outgrow a layer's temporaries)
    with the last block, so the residual stream crosses devices only between blocks.

    Every device used holds one layer's working memory (layer_peak), needs.per_device and its blocks' KV
    cache. Returns one entry per device used: device, blocks (layer numbers), embedding, unembedding, bytes,
    budget. A ValueError names the part that does not fit and how many bytes the last device is short."""
    if not devices:
        raise ValueError("no device to place the model on")
    fixed = needs.run_layer_peak + needs.per_device
    parts: list[dict] = []
    d = 0
    for i, block in enumerate(needs.blocks):
        while True:
            opening = not parts or parts[-1]["device"] != devices[d].name
            used = fixed if opening else parts[-1]["bytes"]
            cost = part_cost(needs, i, with_embedding=not parts or parts[0]["device"] == devices[d].name)
            if used + cost <= devices[d].budget:
                break
            if d == len(devices) - 1:
                raise ValueError(_short(needs, i, devices[d], used, cost))
            d += 1
        if opening:
            parts.append({"device": devices[d].name, "blocks": [], "embedding": i == 0, "unembedding": False,
                          "bytes": fixed, "budget": devices[d].budget})
        parts[-1]["bytes"] += cost
        parts[-1]["blocks"].append(block.layer)
    parts[-1]["unembedding"] = True
    return parts


def part_cost(needs: Needs, i: int, with_embedding: bool) -> int:
    """Bytes block i brings to a device: its weights and KV cache; block 0 the embedding; the last block the
    final norm, unembedding, the logits beyond a layer's temporaries and, when tied and on a device other
    than the embedding's, a copy of the embedding matrix."""
    cost = needs.blocks[i].bytes + needs.kv_per_layer
    if i == 0:
        cost += needs.embedding
    if i == len(needs.blocks) - 1:
        cost += needs.final + (needs.run_peak - needs.run_layer_peak) + (0 if with_embedding else needs.tied_unembed)
    return cost


def _short(needs: Needs, i: int, last: Device, used: int, cost: int) -> str:
    what = f"block {needs.blocks[i].layer}"
    what += " with the embedding" * (i == 0) + " with the final norm and unembedding" * (i == len(needs.blocks) - 1)
    return (
        f"{what} ({human(cost)}, {cost:,} bytes with its KV cache) does not fit on any device: on {last.name}, "
        f"the last, it would need {used + cost:,} of {last.budget:,} bytes, {used + cost - last.budget:,} bytes short"
    )


def device_map(needs: Needs, devices: Sequence[Device]) -> tuple[dict | None, str]:
    """(b) whole blocks per device (assign_parts): the placement from_pretrained(device_map="auto") loads."""
    try:
        placed = assign_parts(needs, devices)
    except ValueError as err:
        return None, str(err)
    if len(placed) < 2:  # all on one device: that is option (a)
        return None, "everything fits on one device (see one_device)"
    for part in placed:  # block ranges, first and last, inclusive
        blocks = part["blocks"]
        part["blocks"] = [blocks[0], blocks[-1]] if blocks else []
    return {"kind": "device_map", "devices": placed, "bytes": sum(p["bytes"] for p in placed)}, ""


def map_of(parts: list[dict]) -> dict[str, str]:
    """assign_parts' entries as a device map in moelens.placement's spelling."""
    spec = {"embed": parts[0]["device"]}
    for part in parts:
        spec[f"blocks.{part['blocks'][0]}-{part['blocks'][-1]}"] = part["device"]
    return spec | {"ln_final": parts[-1]["device"], "unembed": parts[-1]["device"]}


def with_experts_offloaded(needs: Needs, cache_bytes: int) -> Needs:
    """The needs of the mapped part of a model whose routed experts are offloaded: blocks without their
    experts (bytes only; parameters still count them), and on every device that runs blocks the expert
    cache's slots (offload_cache_bytes): all the routed experts take there, since the kernels read them
    from the slots and a layer routing to more runs in groups that fit (moelens.kernels.offload)."""
    blocks = [dataclasses.replace(b, bytes=b.bytes - b.routed_experts_bytes, routed_experts_bytes=0) for b in needs.blocks]
    return dataclasses.replace(needs, blocks=blocks, per_device=needs.per_device + offload_cache_bytes(needs, cache_bytes))


def offload_cache_bytes(needs: Needs, cache_bytes: int) -> int:
    """Bytes of the expert cache's slots for expert_cache_bytes=cache_bytes: whole experts, at least one, at
    most every routed expert (kernels.offload.ExpertCache.n_slots)."""
    moe = [b for b in needs.blocks if b.n_experts]
    if not moe:
        return 0
    each = max(expert_bytes_each(b) for b in moe)
    total = sum(b.n_experts for b in moe)
    return max(1, min(cache_bytes // max(1, each), total)) * each


def expert_bytes_each(block: LayerCount) -> int:
    return block.routed_experts_bytes // block.n_experts if block.n_experts else 0


def expert_offload(needs: Needs, device: Device, cpu: Device, cpu_only: bool) -> tuple[dict | None, str]:
    """(c) everything but the routed experts on `device`; the experts in CPU memory, or on disk where they do
    not fit there (or where the device is the CPU itself). What is left on the device caches experts.

    The device must at least hold one expert besides the rest (a layer routing to more experts than the
    cache holds runs in groups of what it holds). peak_bytes: what the device then holds at most, the rest
    (non-expert weights, activations, KV cache) and the cache's slots: the routed experts take nothing else."""
    moe = [b for b in needs.blocks if b.kind == "moe" and b.n_experts]
    if not moe:
        return None, "no routed experts to offload"
    experts = needs.routed_experts
    resident = needs.weights - experts + needs.run_peak + needs.kv
    tokens = needs.batch * needs.seq
    one = max(expert_bytes_each(b) for b in moe)
    if resident + one > device.budget:
        return None, (
            f"{device.name} cannot hold the rest of the model, activations and KV cache ({human(resident)}) plus "
            f"one routed expert ({human(one)}) within its budget {human(device.budget)}"
        )
    to = "disk" if cpu_only or experts > cpu.budget else "cpu"
    each = max(expert_bytes_each(b) for b in moe)
    total_experts = sum(b.n_experts for b in moe)
    cached = min(total_experts, (device.budget - resident) // each)
    fraction = cached / total_experts
    prefill = sum(min(b.n_experts, tokens * b.top_k) * expert_bytes_each(b) for b in moe)
    decode_max = sum(min(b.n_experts, needs.batch * b.top_k) * expert_bytes_each(b) for b in moe)
    # uniform routing: each expert is picked by a token with probability top_k/n_experts
    decode_expected = sum(
        (1 - fraction) * b.n_experts * (1 - (1 - b.top_k / b.n_experts) ** needs.batch) * expert_bytes_each(b)
        for b in moe
    )
    return {
        "kind": "expert_offload",
        "device": device.name,
        "experts_on": to,
        "device_bytes": resident,
        "offloaded_bytes": experts,
        "budget": device.budget,
        "expert_cache": {"experts": int(cached), "of": total_experts, "bytes": int(cached * each),
                         "fraction": round(fraction, 4)},
        "peak_bytes": resident + int(cached * each),
        "moved_per_forward": {
            "prefill_max": prefill,
            "decode_step_max": decode_max,
            "decode_step_expected": int(decode_expected),
        },
        "assumptions": (
            "prefill: every expert a layer's batch*seq*top_k slots choose is moved once per layer, none assumed "
            "cached; decode step (one new token per sequence): worst case batch*top_k experts per layer all "
            "missing the cache; expected: routing uniform over experts and the cache holding a random "
            f"{fraction:.0%} of each layer's experts"
        ),
    }, ""


def expert_parallel(needs: Needs, devices: Sequence[Device]) -> tuple[dict | None, str]:
    """(d) routed experts split by expert id over the ranks (rank r holds experts r*E/N ...), everything else
    replicated; each rank also holds the activations and KV cache of the whole batch (conservative)."""
    ranks = len(devices)
    if ranks < 2:
        return None, "needs two or more GPUs"
    moe = [b for b in needs.blocks if b.kind == "moe" and b.n_experts]
    if not moe:
        return None, "no routed experts to split"
    replicated = needs.weights - needs.routed_experts
    # the rank with the most experts: ceil(E / N) per layer
    experts_on_rank = sum(math.ceil(b.n_experts / ranks) * expert_bytes_each(b) for b in moe)
    # experts kept stored: a rank dequantizes only its own experts' active ones
    working = needs.expert_working(max(math.ceil(b.n_experts / ranks) for b in moe))
    per_rank = replicated + experts_on_rank + max(needs.peak, needs.layer_peak + working) + needs.kv
    short = [d for d in devices if per_rank > d.budget]
    option = {
        "kind": "expert_parallel",
        "ranks": ranks,
        "devices": [d.name for d in devices],
        "experts_per_rank": max(math.ceil(b.n_experts / ranks) for b in moe),
        "replicated_bytes": replicated,
        "expert_bytes_per_rank": experts_on_rank,
        "per_rank_weight_bytes": replicated + experts_on_rank,
        "per_rank_bytes": per_rank,
        "budget": min(d.budget for d in devices),
    }
    if short:
        return None, f"needs {human(per_rank)} per rank, more than {short[0].name}'s budget {human(short[0].budget)}"
    return option, ""


def place(needs: Needs, gpus: Sequence[Device], cpu: Device) -> dict:
    """Every option that fits, the preferred first; and why the others do not."""
    cpu_only = not gpus
    devices = list(gpus) or [cpu]
    tries = {
        "one_device": lambda: one_device(needs, devices),
        "device_map": lambda: device_map(needs, devices) if len(devices) > 1 else (None, "needs two or more GPUs"),
        "expert_parallel": lambda: expert_parallel(needs, gpus),
        "expert_offload": lambda: expert_offload(needs, devices[0], cpu, cpu_only),
    }
    options, rejected = [], []
    for kind in PREFERENCE:
        option, why = tries[kind]()
        if option is not None:
            options.append(option)
        else:
            rejected.append({"kind": kind, "reason": why})
    message = "" if options else (
        f"nothing fits on {', '.join(f'{d.name} ({human(d.memory)})' for d in devices)}: "
        + "; ".join(f"{r['kind']}: {r['reason']}" for r in rejected)
    )
    return {
        "recommended": options[0] if options else None,
        "options": options,
        "rejected": rejected,
        "message": message,
        "devices": [{"device": d.name, "memory": d.memory, "budget": d.budget} for d in devices],
        "cpu": {"memory": cpu.memory, "budget": cpu.budget},
        "headroom": HEADROOM,
    }


def system_memory() -> int:
    """This machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def gpu_devices(devices: Sequence[str] | str | None, gpus: int | None, gpu_memory: int | str | None) -> list[Device]:
    """The GPUs to plan for: named devices (memory from torch.cuda where present, else gpu_memory), or N of
    gpu_memory each; gpu_memory alone means one GPU."""
    if isinstance(devices, str):
        devices = [d.strip() for d in devices.split(",") if d.strip()]
    memory = None if gpu_memory is None else parse_size(gpu_memory)
    if devices and gpus is not None:
        raise ValueError("give either devices (--devices) or a GPU count (--gpus), not both")
    if gpus is not None and gpus > MAX_GPUS:
        raise ValueError(f"gpus = {gpus:,}: moelens plans for at most {MAX_GPUS:,} GPUs")
    if devices and len(devices) > MAX_GPUS:
        raise ValueError(f"{len(devices):,} devices: moelens plans for at most {MAX_GPUS:,} GPUs")
    if not devices:
        if gpus is None and memory is None:
            return []
        devices = [f"cuda:{i}" for i in range(gpus or 1)]
    out = []
    for name in devices:
        try:
            device = torch.device(name)
        except (RuntimeError, TypeError) as err:
            raise ValueError(f"device {name!r} is not a torch device ({err})") from err
        if memory is not None:
            out.append(Device(name, memory))
        elif device.type == "cuda" and torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count():
            out.append(Device(name, torch.cuda.get_device_properties(device.index or 0).total_memory))
        else:
            raise ValueError(f"device {name}: no such CUDA device here to read its memory from; give --gpu-memory")
    return out


def check_tokens(**sizes: int) -> None:
    """batch and seq (under the caller's names for them) are positive integers."""
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def needs_of(cfg, family, components: dict[str, Count], layers: list[LayerCount], batch: int, seq: int) -> Needs:
    """What the placements weigh, from the model's counts (count_model) and a forward of batch x seq tokens."""
    recipe = family.recipe(cfg)
    acts = activation_terms(cfg, batch, seq, float32_router(recipe))
    kv, _ = cache_bytes(recipe, cfg, batch, seq)
    embed_bytes = components["embeddings"].bytes
    final_norm = cfg.d_model * torch.tensor([], dtype=cfg.dtype).element_size()
    return Needs(
        embedding=embed_bytes,
        final=final_norm + components["unembedding"].bytes,
        tied_unembed=embed_bytes if cfg.tie_word_embeddings else 0,
        blocks=layers,
        layer_peak=acts["layer_peak"]["bytes"],
        peak=acts["peak"]["bytes"],
        kv_per_layer=kv // cfg.n_layers,
        batch=batch,
        seq=seq,
    )


def auto_device_map(
    model, family, max_memory: dict[str, int], batch: int, seq: int, expert_cache_bytes: int | None = None
) -> dict[str, str]:
    """from_pretrained(device_map="auto"): the device map `moelens plan` recommends (assign_parts), for the
    model as loading builds it (on meta), within max_memory ({device: bytes}, used whole: no headroom is
    taken off what the caller allows), with working memory and KV cache for batch x seq tokens.
    expert_cache_bytes: the routed experts are offloaded, and this is their cache (see with_experts_offloaded)."""
    components, layers = count_model(model)
    needs = needs_of(model.cfg, family, components, layers, batch, seq)
    if expert_cache_bytes is not None:
        needs = with_experts_offloaded(needs, expert_cache_bytes)
    devices = [Device(name, memory, headroom=0.0) for name, memory in max_memory.items()]
    try:
        return map_of(assign_parts(needs, devices))
    except ValueError as err:
        raise ValueError(
            f"device_map='auto' cannot place the model within max_memory ({', '.join(f'{d.name}: {d.memory:,} bytes' for d in devices)}) "
            f"with working memory for a forward of batch {batch} x seq {seq}: {err}"
        ) from err


# ---- a quantized checkpoint ------------------------------------------------------------------------------


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
    """The checkpoint of stored_cfg (its dtype: what dense tensors are stored in) as fmt stores it; kept, as
    meta_tensors, for the next plan of the same config."""
    params, buffers = meta_tensors(family, stored_cfg)
    tensors = stored_tensors(
        family.site_map(stored_cfg), params, buffers, fmt, stored_cfg.dtype,
        lambda name: component_of(name)[0] in LINEAR_COMPONENTS, scale_dtype,
    )
    components = {name: Count() for name in COMPONENTS}
    layer_bytes, expert_bytes = [0] * stored_cfg.n_layers, [0] * stored_cfg.n_layers
    for param, stored in tensors.items():
        component, layer = component_of(param)
        for t in stored:
            components[component].add(math.prod(t.shape), t.bytes)
            if layer is not None:
                layer_bytes[layer] += t.bytes
                if component == "routed_experts":
                    expert_bytes[layer] += t.bytes
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
            "stored": {
                "weights": kept.weights,
                "routed_experts": kept.routed_experts,
                "dequantized_working": kept.expert_working(),
                "counts": f"the routed experts as stored, the rest dense; working memory adds one layer's active experts "
                f"dequantized in {str(cfg.dtype).removeprefix('torch.')}: min(n_experts, {tokens} x top_k) of them "
                "(under expert parallelism, of the rank's experts)",
                "placement": place(kept, gpus, cpu),
            },
        },
    }


# ---- the plan --------------------------------------------------------------------------------------------


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
        }
        return out if self.stored is None else out | {"stored": self.stored}

    def __str__(self) -> str:
        return "\n".join(_text(self))


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
    components, layers = count_tensors(cfg, *meta_tensors(family, cfg))
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
    )


# ---- the printout ----------------------------------------------------------------------------------------


def _text(p: Plan) -> list[str]:
    c = p.config
    lines = [
        f"{p.where}: {p.model_class} ({p.family}), {c['n_layers']} layers, {c['n_experts']} experts, top-{c['top_k']}",
        f"{p.parameters:,} parameters in all ({human_count(p.parameters)}, embeddings included), {human(p.bytes)} in {p.dtype}"
        + (" (routers kept float32)" if c["router_in_float32"] and p.dtype != "float32" else "")
        + (" (embedding tied to the unembedding, counted once)" if c["tie_word_embeddings"] else ""),
        f"cfg.n_params {p.n_params:,} ({human_count(p.n_params)}): TransformerLens's count, the weight matrices "
        "without the embedding, unembedding, norms and biases",
    ]
    if p.on_disk is None:
        lines.append("on disk: no safetensors files here (counts are from config.json)")
    elif "error" in p.on_disk:
        lines.append(f"on disk: weights present but unreadable: {p.on_disk['error']}")
    else:
        d = p.on_disk
        dtypes = ", ".join(f"{k} {human(v)}" for k, v in sorted(d["dtypes"].items(), key=lambda kv: -kv[1]))
        lines.append(
            f"on disk: {human(d['file_bytes'])} in {d['files']} safetensors file(s), {d['parameters']:,} parameters "
            f"stored ({dtypes})"
        )
    lines += ["", f"{'component':<16}{'parameters':>18}{'bytes':>12}{'share':>8}"]
    for name, count in p.components.items():
        if count.parameters:
            lines.append(
                f"{name:<16}{count.parameters:>18,}{human(count.bytes):>12}{count.bytes / p.bytes:>8.1%}"
            )
    lines.append(f"{'total':<16}{p.parameters:>18,}{human(p.bytes):>12}")
    lines += _stored_text(p)
    lines += ["", f"{'layers':<16}{'kind':>6}{'parameters each':>18}{'bytes each':>12}{'experts':>12}"]
    for first, last, layer in _runs(p.per_layer):
        span = f"{first}" if first == last else f"{first}-{last}"
        lines.append(
            f"{span:<16}{layer.kind:>6}{layer.parameters:>18,}{human(layer.bytes):>12}"
            f"{human(layer.routed_experts_bytes):>12}"
        )
    a = p.activations
    lines += ["", f"activations, one forward of batch {a['batch']} x seq {a['seq']} (no hooks caching):"]
    for name, term in a["terms"].items():
        lines.append(f"  {name:<20}{human(term['bytes']):>11}  {term['counts']}")
    lines.append(f"kv cache             {human(p.kv_cache['bytes']):>11}  {p.kv_cache['counts']}")
    if p.stored is None or "error" in p.stored:
        return [*lines, "", *_placement_text(p.placement)]
    return lines + _modes_text(p)


def _stored_text(p: Plan) -> list[str]:
    """The checkpoint as stored, by component, next to the dense bytes in the plan's dtype."""
    s = p.stored
    if s is None:
        return []
    if "error" in s:
        return ["", f"stored format not read ({s['error']}): the counts and placements are of dense weights"]
    f = s["format"]
    how = f"{f['block'][0]}x{f['block'][1]} blocks" if f["method"] == "fp8" else f"groups of {f['block'][1]}"
    lines = [
        "",
        f"as stored: {human(s['bytes'])} ({f['method']}, {how}, {f['scales']} scales; the rest {s['dtype']}, "
        f"from {s['dtype_from']})",
        f"{'component':<16}{'stored':>12}{'in ' + p.dtype:>14}",
    ]
    for name, count in s["components"].items():
        if count["parameters"]:
            lines.append(f"{name:<16}{human(count['bytes']):>12}{human(p.components[name].bytes):>14}")
    return [*lines, f"{'total':<16}{human(s['bytes']):>12}{human(p.bytes):>14}"]


def _modes_text(p: Plan) -> list[str]:
    """The placements of both run-time modes of a quantized checkpoint; the plan's own (expert_storage) marked."""
    s = p.stored
    method = s["format"]["method"]
    titles = {
        "dequantized": f"every weight dense in {p.dtype} (dequantized at load; expert_storage 'dequantized', the default)",
        "stored": f"the routed experts kept as stored ({method}; expert_storage 'stored'), the rest in {p.dtype}",
    }
    stored_experts = human(s["components"]["routed_experts"]["bytes"])
    experts_are = {  # what the offloaded experts' bytes are, beside what the files hold
        "dequantized": f"dequantized in {p.dtype}; {stored_experts} as stored in the files",
        "stored": f"as stored in the files, {method}",
    }
    lines = []
    for mode, title in titles.items():
        m = s["modes"][mode]
        extra = (
            f", + {human(m['dequantized_working'])} working memory: a layer's active experts dequantized"
            if mode == "stored" else ""
        )
        chosen = " [this plan's placement]" if mode == s["expert_storage"] else ""
        lines += ["", f"with {title}: weights {human(m['weights'])}{extra}{chosen}",
                  *_placement_text(m["placement"], experts_are[mode])]
    return lines


def _runs(layers: list[LayerCount]):
    """Consecutive layers of equal size, as (first, last, one of them)."""
    runs: list[list] = []
    for layer in layers:
        key = (layer.kind, layer.parameters, layer.bytes, layer.routed_experts_bytes)
        if runs and runs[-1][3] == key:
            runs[-1][1] = layer.layer
        else:
            runs.append([layer.layer, layer.layer, layer, key])
    return [(first, last, layer) for first, last, layer, _ in runs]


def _placement_text(placement: dict, experts_are: str = "") -> list[str]:
    """experts_are: what an offload's routed-expert bytes are (dequantized or as stored), for a quantized checkpoint."""
    lines = [
        f"placement on {_devices_text(placement['devices'])}, cpu memory {human(placement['cpu']['memory'])} "
        f"(each budget {1 - placement['headroom']:.0%} of memory)"
    ]
    if not placement["options"]:
        lines.append("  nothing fits:")
    for i, option in enumerate(placement["options"]):
        lines.append(f"  {'recommended: ' if i == 0 else 'also fits:   '}{_describe(option, experts_are)}")
    for r in placement["rejected"]:
        lines.append(f"  does not fit: {r['kind']}: {r['reason']}")
    return lines


def _devices_text(devices: list[dict]) -> str:
    """cuda:0-7 (8 x 141.00 GB) when all alike, else each device with its memory."""
    if len(devices) > 2 and len({d["memory"] for d in devices}) == 1:
        return f"{devices[0]['device']} .. {devices[-1]['device']} ({len(devices)} x {human(devices[0]['memory'])})"
    return ", ".join(f"{d['device']} ({human(d['memory'])})" for d in devices)


def _describe(o: dict, experts_are: str = "") -> str:
    if o["kind"] == "one_device":
        return f"one device: everything on {o['device']} ({human(o['bytes'])} of {human(o['budget'])})"
    if o["kind"] == "device_map":
        parts = []
        for d in o["devices"]:
            blocks = f"blocks {d['blocks'][0]}-{d['blocks'][1]}" if d["blocks"] else "no blocks"
            extra = " + embedding" * d["embedding"] + " + unembedding" * d["unembedding"]
            parts.append(f"{d['device']}: {blocks}{extra} ({human(d['bytes'])})")
        return "device map: " + "; ".join(parts)
    if o["kind"] == "expert_parallel":
        return (
            f"expert parallel over {o['ranks']} ranks: {o['experts_per_rank']} experts per layer per rank, "
            f"{human(o['replicated_bytes'])} replicated + {human(o['expert_bytes_per_rank'])} experts = "
            f"{human(o['per_rank_weight_bytes'])} weights, {human(o['per_rank_bytes'])} with activations and KV "
            f"cache per rank (budget {human(o['budget'])})"
        )
    cache, moved = o["expert_cache"], o["moved_per_forward"]
    return (
        f"expert offload: {human(o['device_bytes'])} on {o['device']} (all but the routed experts, with activations "
        f"and KV cache), routed experts ({human(o['offloaded_bytes'])}{', ' + experts_are if experts_are else ''}) on {o['experts_on']}\n"
        f"{'':16}expert cache on {o['device']}: {cache['experts']} of {cache['of']} experts ({human(cache['bytes'])}, "
        f"{cache['fraction']:.0%}); peak on {o['device']} {human(o['peak_bytes'])}\n"
        f"{'':16}moved per forward: prefill <= {human(moved['prefill_max'])}; decode step <= "
        f"{human(moved['decode_step_max'])}, ~{human(moved['decode_step_expected'])} expected\n"
        f"{'':16}({o['assumptions']})"
    )


def to_json_text(p: Plan) -> str:
    return json.dumps(p.to_json(), indent=2)
