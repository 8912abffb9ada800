"""The printout of a plan, and its JSON."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from moelens.plan.terms import LayerCount
from moelens.plan.units import human, human_count

if TYPE_CHECKING:
    from moelens.plan.planner import Plan


def plan_text(p: Plan) -> list[str]:
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
    if p.flops is not None:
        lines.append(f"forward FLOPs        {p.flops['forward']:>11.3e}  {p.flops['counts']}")
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
    how = {"fp8": lambda: f"{f['block'][0]}x{f['block'][1]} blocks", "modelopt": lambda: "one scale per tensor"}.get(
        f["method"], lambda: f"groups of {f['block'][1]}")()
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
        if mode not in s["modes"]:  # a format only dequantized at load (ModelOpt's per-tensor fp8)
            continue
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
    """The plan as indented JSON text (`moelens plan --json`)."""
    return json.dumps(p.to_json(), indent=2)
