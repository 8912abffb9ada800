"""Placement: what a model needs (weights by part, working memory, cache) and the options that fit the
devices: one device, a device map, expert parallel, expert offload."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moelens.placement import parse_size
from moelens.plan.terms import Count, LayerCount, activation_terms, count_model, float32_router, layer_cache_bytes
from moelens.plan.units import human

HEADROOM = 0.10  # of each device's memory, left free: allocator fragmentation, CUDA context, kernels' workspace
# preferred first: one device (no transfers), then a device map (only hidden states cross devices), then
# expert parallel (all-to-all of tokens per layer), then offload (expert weights cross PCIe every forward)
PREFERENCE = ("one_device", "device_map", "expert_parallel", "expert_offload")
DEFAULT_BATCH, DEFAULT_SEQ = 1, 2048  # the forward a plan reserves working memory and KV cache for
MAX_GPUS = 2**12


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
    kv_per_layer: int  # each block's cache where kv_by_layer is None
    batch: int
    seq: int
    # held on every device that runs blocks, besides layer_peak: with the experts offloaded, their cache's
    # slots (see with_experts_offloaded)
    per_device: int = 0
    # the routed experts kept as stored (see with_stored_experts): the dense bytes of one expert, which a layer
    # dequantizes for each of its active experts while it runs; 0 where the experts are dense
    dequantized_each: int = 0
    # each block's cache (block i's at i), where layers differ: a hybrid's attention layers cache keys per
    # token, its linear layers a fixed state per sequence
    kv_by_layer: list[int] | None = None

    def kv_of(self, i: int) -> int:
        """Bytes of block i's cache."""
        return self.kv_per_layer if self.kv_by_layer is None else self.kv_by_layer[i]

    @property
    def weights(self) -> int:
        return self.embedding + self.final + sum(b.bytes for b in self.blocks)

    @property
    def kv(self) -> int:
        return sum(self.kv_of(i) for i in range(len(self.blocks)))

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
    cost = needs.blocks[i].bytes + needs.kv_of(i)
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
    kv = layer_cache_bytes(recipe, cfg, batch, seq)
    embed_bytes = components["embeddings"].bytes
    final_norm = cfg.d_model * torch.tensor([], dtype=cfg.dtype).element_size()
    return Needs(
        embedding=embed_bytes,
        final=final_norm + components["unembedding"].bytes,
        tied_unembed=embed_bytes if cfg.tie_word_embeddings else 0,
        blocks=layers,
        layer_peak=acts["layer_peak"]["bytes"],
        peak=acts["peak"]["bytes"],
        kv_per_layer=max(kv, default=0),
        batch=batch,
        seq=seq,
        kv_by_layer=kv,
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
