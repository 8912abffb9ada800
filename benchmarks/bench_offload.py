"""Expert offload on CPU: peak memory and forward time against the resident model, and LRU vs LFU caches.

Builds (with transformers) a float32 Qwen2-MoE checkpoint with many experts, where the routed experts are
~90% of the bytes, then measures, each load in a fresh subprocess:

1. peak RSS (/proc VmHWM after loading and the forwards, minus after imports) and forward time (batch 1 x
   256 prefill after two warm-up forwards, then 32 decode steps with the KV cache), for the resident model and for
   expert_offload="disk" / "cpu" with a cache of one layer's experts (each with its default expert_prefetch);
2. hit rates of an LRU and an LFU expert cache of several sizes, replayed on the model's own routing trace
   of decoding (which (layer, expert) pairs each token needed, in order);
3. expert_prefetch off against on for expert_offload="disk" (cache of nothing, and of one layer): prefill and
   generate time, and how many prefetched experts their layer used; both models in one process, timed in
   alternation (ROUNDS rounds, medians), as the machine is shared;
4. the disk read path against the machine's limit: every expert of every layer loaded into cache slots
   (OffloadedExperts.load_into, what the cache does on a miss) against preads of the same byte ranges from the
   same, already cached, file into one preallocated buffer (a memcpy from the page cache), and against the
   per-read safetensors path (source(): open, parse the header, make tensors); medians of alternating rounds;
5. the peak memory of disk offload against what moelens plan reports for it: plan with the CPU's memory set so
   that its offload placement leaves a cache of CACHE_MB, then a load with that cache, prefill and decode; the
   peak RSS growth (VmHWM after the forwards minus after imports) against the plan's non-expert weights +
   activations + KV cache + cache.

The weights are random (perturbed like the tests' checkpoints), so the trace is what a random-weights model
routes; a trained model's routing is more skewed, which favours both caches.
Usage: python benchmarks/bench_offload.py [--out DIR] [--reuse] [--only read,peak]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import tempfile
from collections import Counter, OrderedDict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from tiny import perturb  # noqa: E402

CONFIG = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    moe_intermediate_size=256,
    shared_expert_intermediate_size=256,
    num_experts=64,
    num_experts_per_tok=4,
    max_position_embeddings=1024,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
PREFILL, DECODE = 256, 32
ROUNDS = 3
CACHE_MB = 24

# what both child scripts start with: load in a fresh process, its high-water mark before, a fixed prompt
LOAD_IN_CHILD = """
import json, sys, time, torch
sys.path.insert(0, {root!r})
from moelens import HookedTransformer
torch.set_num_threads(2)

def hwm():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))

base = hwm()
kwargs = json.loads({kwargs!r})
model = HookedTransformer.from_pretrained({path!r}, progress=False, **kwargs)
prompt = torch.randint(0, {vocab}, (1, {prefill}), generator=torch.Generator().manual_seed(0))
"""

RUN = LOAD_IN_CHILD + """with torch.no_grad():
    for _ in range(2):  # first calls pay one-time costs (allocator, kernels): warm up on another prompt
        model(torch.randint(0, {vocab}, (1, 64), generator=torch.Generator().manual_seed(1)))
    start = time.perf_counter()
    model(prompt)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    out = model.generate(prompt, max_new_tokens={decode}, stop_at_eos=False, do_sample=False)
    generate = time.perf_counter() - start
stats = model.expert_cache_stats().__dict__ if kwargs.get("expert_offload") else None
print(json.dumps(dict(peak=hwm() - base, prefill=prefill, generate=generate, stats=stats, tokens=out[0, -8:].tolist())))
"""


def build(folder: Path) -> dict:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    torch.manual_seed(0)
    model = Qwen2MoeForCausalLM(Qwen2MoeConfig(**CONFIG)).float()
    perturb(model, 0)
    model.save_pretrained(folder, max_shard_size="100GB")
    experts = sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." in n)
    total = sum(p.numel() * 4 for p in model.parameters())
    return dict(total=total, experts=experts, layer_experts=experts // CONFIG["num_hidden_layers"])


def run(path: Path, **kwargs) -> dict:
    code = RUN.format(root=str(ROOT), kwargs=json.dumps(kwargs), path=str(path), vocab=CONFIG["vocab_size"], prefill=PREFILL, decode=DECODE)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"the run with {kwargs} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def decode_trace(path: Path) -> list[list[tuple[int, int]]]:
    """Per decoded token, the (layer, expert) pairs it routed to, from the resident model."""
    from moelens import HookedTransformer

    model = HookedTransformer.from_pretrained(path, progress=False)
    prompt = torch.randint(0, CONFIG["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(1))
    seen: list[list[tuple[int, int]]] = []

    def record(idx, hook):
        layer = int(hook.name.split(".")[1])
        if idx.shape[1] == 1:  # decode steps only
            if layer == 0:
                seen.append([])
            seen[-1].extend((layer, int(e)) for e in idx[0, 0].tolist())

    with torch.no_grad(), model.hooks(fwd_hooks=[("blocks.*.mlp.hook_expert_indices", record)]):
        model.generate(prompt, max_new_tokens=256, stop_at_eos=False, do_sample=False)
    return seen


def hit_rate(trace, capacity: int, policy: str) -> float:
    cache: OrderedDict = OrderedDict()
    uses: Counter = Counter()
    hits = total = 0
    for token in trace:
        for key in token:
            total += 1
            uses[key] += 1
            if key in cache:
                hits += 1
                cache.move_to_end(key)
                continue
            cache[key] = True
            if len(cache) > capacity:
                # LFU: fewest uses so far, the least recently used of those (min keeps the first in order)
                victim = next(iter(cache)) if policy == "lru" else min(cache, key=uses.__getitem__)
                del cache[victim]
    return hits / total


PREFETCH_RUN = """
import json, statistics, sys, time, torch
sys.path.insert(0, {root!r})
from moelens import HookedTransformer
torch.set_num_threads({threads})

models = {{on: HookedTransformer.from_pretrained({path!r}, progress=False, expert_offload="disk",
                                               expert_cache_bytes={cache}, expert_prefetch=on) for on in (False, True)}}
prompt = torch.randint(0, {vocab}, (1, {prefill}), generator=torch.Generator().manual_seed(0))
times = {{on: {{"prefill": [], "generate": []}} for on in models}}
tokens = {{}}
with torch.no_grad():
    for model in models.values():  # first calls pay one-time costs (allocator, kernels): warm up on another prompt
        model(torch.randint(0, {vocab}, (1, 64), generator=torch.Generator().manual_seed(1)))
    for _ in range({rounds}):  # alternating, so that both see the same load from the rest of the machine
        for on, model in models.items():
            start = time.perf_counter()
            model(prompt)
            times[on]["prefill"].append(time.perf_counter() - start)
            start = time.perf_counter()
            tokens[on] = model.generate(prompt, max_new_tokens={decode}, stop_at_eos=False, do_sample=False)[0].tolist()
            times[on]["generate"].append(time.perf_counter() - start)
out = {{str(on): dict(prefill=statistics.median(t["prefill"]), generate=statistics.median(t["generate"]),
                     stats=models[on].expert_cache_stats().__dict__) for on, t in times.items()}}
print(json.dumps(dict(out, same=tokens[False] == tokens[True])))
"""


def prefetch_table(folder: Path, layer: int, threads: int = 2, decode: int = DECODE) -> None:
    """expert_prefetch off vs on, disk offload: both models in one process, timed in alternation (medians)."""
    print(f'\nexpert_offload="disk", expert_prefetch off vs on, {threads} torch thread(s): medians of {ROUNDS} alternating '
          f"rounds of prefill {PREFILL} + {decode} decode steps; counts over all rounds")
    print("| cache | prefetch | prefill | generate | demand hit rate | prefetched | used by their layer | wasted | errors | s loading in the layers |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for cache_name, cache_bytes in (("none", 0), ("1 layer", layer)):
        code = PREFETCH_RUN.format(root=str(ROOT), path=str(folder), cache=cache_bytes, vocab=CONFIG["vocab_size"],
                                   prefill=PREFILL, decode=decode, rounds=ROUNDS, threads=threads)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(f"the prefetch run failed:\n{out.stderr[-3000:]}")
        result = json.loads(out.stdout.strip().splitlines()[-1])
        for on in ("False", "True"):
            r, st = result[on], result[on]["stats"]
            used = f"{st['prefetch_hits'] / st['prefetched']:.2f}" if st["prefetched"] else "-"
            same = "" if result["same"] else " (TOKENS DIFFER)"
            print(f"| {cache_name} | {'on' if on == 'True' else 'off'}{same} | {r['prefill'] * 1e3:.0f} ms | {r['generate']:.2f} s | "
                  f"{st['hits'] / max(1, st['hits'] + st['misses']):.2f} | {st['prefetched']} | {used} | {st['prefetch_wasted']} | "
                  f"{st['prefetch_errors']} | {st['seconds_moving']:.2f} |")


READ_RUN = """
import json, os, statistics, struct, sys, time, torch
sys.path.insert(0, {root!r})
from moelens import HookedTransformer
torch.set_num_threads(1)
model = HookedTransformer.from_pretrained({path!r}, progress=False, expert_offload="disk", expert_cache_bytes=0,
                                          expert_prefetch=False)
stores = [b.mlp.experts.store for b in model.blocks if b.is_moe]
path = {file!r}
with open(path, "rb") as f:  # every expert's byte ranges, from the header
    n = struct.unpack("<Q", f.read(8))[0]
    header = json.loads(f.read(n))
ranges = {{}}
for key, info in header.items():
    if ".mlp.experts." in key:  # model.layers.L.mlp.experts.E.*
        parts = key.split(".")
        start, end = info["data_offsets"]
        ranges.setdefault((int(parts[2]), int(parts[5])), []).append((8 + n + start, end - start))
ranges = dict(sorted(ranges.items()))
each = max(sum(length for _, length in r) for r in ranges.values())
buffer = memoryview(bytearray(each))
fd = os.open(path, os.O_RDONLY)
slot = tuple(torch.empty(t.shape, dtype=t.dtype) for t in stores[0].template)  # a cache slot, preallocated

def limit():
    for r in ranges.values():
        done = 0
        for offset, length in sorted(r):
            os.preadv(fd, [buffer[done : done + length]], offset)
            done += length

def read_path():
    for store in stores:
        for e in range(store.n_experts):
            store.load_into(e, slot)

def per_read_safetensors():
    for store in stores:
        for e in range(store.n_experts):
            for into, t in zip(slot, store.source(e)):
                into.copy_(t)

runs = dict(limit=limit, read_path=read_path, safetensors=per_read_safetensors)
times = {{name: [] for name in runs}}
for fn in runs.values():  # warm: the file in the page cache, the headers parsed
    fn()
for _ in range({rounds}):
    for name, fn in runs.items():
        start = time.perf_counter()
        fn()
        times[name].append(time.perf_counter() - start)
print(json.dumps(dict(bytes=sum(l for r in ranges.values() for _, l in r), experts=len(ranges),
                      **{{name: statistics.median(t) for name, t in times.items()}})))
"""


ALTERNATING_RUN = """
import json, statistics, sys, time, torch
sys.path.insert(0, {root!r})
from moelens import HookedTransformer
torch.set_num_threads({threads})
loads = json.loads({loads!r})
models = {{name: HookedTransformer.from_pretrained({path!r}, progress=False, **kwargs) for name, kwargs in loads.items()}}
prompt = torch.randint(0, {vocab}, (1, {prefill}), generator=torch.Generator().manual_seed(0))
times = {{name: {{"prefill": [], "generate": []}} for name in models}}
tokens = {{}}
with torch.no_grad():
    for model in models.values():
        model(torch.randint(0, {vocab}, (1, 64), generator=torch.Generator().manual_seed(1)))
    for _ in range({rounds}):
        for name, model in models.items():
            start = time.perf_counter()
            model(prompt)
            times[name]["prefill"].append(time.perf_counter() - start)
            start = time.perf_counter()
            tokens[name] = model.generate(prompt, max_new_tokens={decode}, stop_at_eos=False, do_sample=False)[0].tolist()
            times[name]["generate"].append(time.perf_counter() - start)
first = next(iter(tokens.values()))
print(json.dumps({{name: dict(prefill=statistics.median(t["prefill"]), generate=statistics.median(t["generate"]),
                             same=tokens[name] == first) for name, t in times.items()}}))
"""


def alternating_table(folder: Path, layer: int, threads: int = 1, decode: int = 8) -> None:
    """Resident against disk offload in one process, timed in alternation (medians): on a shared machine the
    ratio of separate processes' times is mostly the load of the moment."""
    loads = {"resident": {}, "disk, cache = 1 layer, prefetch": dict(expert_offload="disk", expert_cache_bytes=layer),
             "disk, cache = 1/2 layer, prefetch": dict(expert_offload="disk", expert_cache_bytes=layer // 2)}
    code = ALTERNATING_RUN.format(root=str(ROOT), path=str(folder), loads=json.dumps(loads), vocab=CONFIG["vocab_size"],
                                  prefill=PREFILL, decode=decode, rounds=ROUNDS, threads=threads)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"the alternating run failed:\n{out.stderr[-3000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"\nResident against disk offload in one process, {threads} thread(s), medians of {ROUNDS} alternating rounds of "
          f"prefill {PREFILL} + {decode} decode steps")
    print("| load | prefill | vs resident | generate | vs resident |")
    print("|---|---:|---:|---:|---:|")
    base = r["resident"]
    for name, t in r.items():
        same = "" if t["same"] else " (TOKENS DIFFER)"
        print(f"| {name}{same} | {t['prefill'] * 1e3:.0f} ms | {t['prefill'] / base['prefill']:.2f}x | {t['generate']:.2f} s | "
              f"{t['generate'] / base['generate']:.2f}x |")


def read_table(folder: Path) -> None:
    """The disk read path against a memcpy from the page cache of the same bytes."""
    code = READ_RUN.format(root=str(ROOT), path=str(folder), file=str(folder / "model.safetensors"), rounds=5)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"the read run failed:\n{out.stderr[-3000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"\nDisk read path: {r['experts']} experts, {r['bytes'] / 1e6:.0f} MB, from the page cache, 1 thread; medians of 5 "
          "alternating rounds")
    print("| path | time | GB/s | vs the limit |")
    print("|---|---:|---:|---:|")
    for name, label in (("limit", "pread of the same byte ranges into one buffer (the limit)"),
                        ("read_path", "OffloadedExperts.load_into (the cache's miss path)"),
                        ("safetensors", "source(): safe_open and a header parse per read, then copied (the path before)")):
        print(f"| {label} | {r[name] * 1e3:.0f} ms | {r['bytes'] / r[name] / 1e9:.2f} | {r[name] / r['limit']:.2f}x |")


PEAK_RUN = LOAD_IN_CHILD + """with torch.no_grad():
    model(prompt)
    model.generate(prompt, max_new_tokens={decode}, stop_at_eos=False, do_sample=False)
stats = model.expert_cache_stats() if kwargs else None
print(json.dumps(dict(peak=hwm() - base, slots=stats.slot_bytes if stats else 0, grouped=stats.grouped_layers if stats else 0)))
"""


def planned(folder: Path, cache_bytes: int) -> tuple[dict, dict]:
    """moelens plan's one_device and expert_offload options (CPU only: experts on disk) for PREFILL + DECODE
    tokens, the CPU's memory set so that the cache the offload leaves is cache_bytes (and ample for one_device)."""
    from moelens.plan import HEADROOM, plan

    def option(memory: int, kind: str) -> dict:
        p = plan(folder, dtype="float32", cpu_memory=memory, batch=1, seq=PREFILL + DECODE)
        return next(o for o in p.placement["options"] if o["kind"] == kind)

    resident = option(10**12, "expert_offload")["device_bytes"]
    return option(10**12, "one_device"), option(int((resident + cache_bytes) / (1 - HEADROOM)) + 1, "expert_offload")


def peak_table(folder: Path, sizes: dict) -> None:
    print(f"\nPeak memory of expert_offload='disk' against moelens plan's report (cache ~{CACHE_MB} MB; prefill "
          f"{PREFILL} + {DECODE} decode steps, batch 1)")
    print("| load | plan: cache | plan: peak | measured peak RSS growth | measured - plan | vs resident | slot buffers | grouped layer runs |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    one, o = planned(folder, CACHE_MB * 10**6)
    cache = o["expert_cache"]["bytes"]
    rows = [("resident", {}, one["bytes"])] + [
        (f"disk, prefetch {'on' if on else 'off'}", dict(expert_offload="disk", expert_cache_bytes=cache, expert_prefetch=on), o["peak_bytes"])
        for on in (False, True)
    ]
    resident_peak = None
    for label, kwargs, planned_peak in rows:
        code = PEAK_RUN.format(root=str(ROOT), path=str(folder), kwargs=json.dumps(kwargs), vocab=CONFIG["vocab_size"],
                               prefill=PREFILL, decode=DECODE)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(f"the peak run failed:\n{out.stderr[-3000:]}")
        r = json.loads(out.stdout.strip().splitlines()[-1])
        resident_peak = resident_peak or r["peak"]
        print(f"| {label} | {cache / 1e6 if kwargs else 0:.1f} MB | {planned_peak / 1e6:.1f} MB | {r['peak'] / 1e6:.1f} MB | "
              f"{(r['peak'] - planned_peak) / 1e6:+.1f} MB | {r['peak'] / resident_peak:.2f}x | {r['slots'] / 1e6:.1f} MB | {r['grouped']} |")
    print("(measured - plan: what the process holds beyond the plan's weights, activations, KV cache and expert cache: "
          "the interpreter's and allocator's own, the same with and without offload)")


def sizes_of(folder: Path) -> dict:
    """build()'s sizes, from a checkpoint built before (--reuse)."""
    import struct

    path = folder / "model.safetensors"
    with open(path, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    nbytes = {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}
    experts = sum(n for k, n in nbytes.items() if ".experts." in k)
    return dict(total=sum(nbytes.values()), experts=experts, layer_experts=experts // CONFIG["num_hidden_layers"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--prefetch-only", action="store_true", help="only the prefetch table (3.)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads for the prefetch table")
    parser.add_argument("--decode", type=int, default=DECODE, help="decode steps for the prefetch table")
    parser.add_argument("--reuse", action="store_true", help="use the checkpoint already in --out")
    parser.add_argument("--only", default="", help="comma-separated: forward (1.), read (4.), peak (5.), alternating")
    args = parser.parse_args()
    folder = args.out or Path(tempfile.mkdtemp()) / "ckpt"
    sizes = sizes_of(folder) if args.reuse and (folder / "model.safetensors").exists() else build(folder)
    layer = sizes["layer_experts"]
    if args.only:
        print(f"{datetime.date.today()}, {platform.machine()} CPU, torch {torch.__version__}; checkpoint {sizes['total'] / 1e6:.0f} MB")
        if "forward" in args.only:
            forward_table(folder, layer)
        if "alternating" in args.only:
            alternating_table(folder, layer)
        if "read" in args.only:
            read_table(folder)
        if "peak" in args.only:
            peak_table(folder, sizes)
        return
    if args.prefetch_only:
        print(f"{datetime.date.today()}, {platform.machine()} CPU, torch {torch.__version__}")
        prefetch_table(folder, layer, args.threads, args.decode)
        return
    print(f"{datetime.date.today()}, {platform.machine()} CPU, torch {torch.__version__}; checkpoint {sizes['total'] / 1e6:.0f} MB "
          f"float32, routed experts {sizes['experts'] / 1e6:.0f} MB ({CONFIG['num_hidden_layers']} layers x {CONFIG['num_experts']} "
          f"experts, top-{CONFIG['num_experts_per_tok']}); batch 1: prefill {PREFILL} tokens, then {DECODE} decode steps\n")
    forward_table(folder, layer)
    alternating_table(folder, layer)
    prefetch_table(folder, layer, args.threads, args.decode)
    trace_table(folder)
    read_table(folder)
    peak_table(folder, sizes)


def forward_table(folder: Path, layer: int) -> None:
    """1.: peak RSS and forward time, resident against offloaded with a cache of one layer."""
    resident = run(folder)
    print("| load | peak RSS | vs resident | prefill | vs resident | generate | vs resident | hit rate | MB moved |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = [("resident", resident)]
    for mode in ("cpu", "disk"):  # each with its default expert_prefetch: on for "disk", off for "cpu"
        label = f"{mode}, cache = 1 layer" + (", prefetch" if mode == "disk" else "")
        rows.append((label, run(folder, expert_offload=mode, expert_cache_bytes=layer, expert_prefetch=mode == "disk")))
    for name, r in rows:
        same = r["tokens"] == resident["tokens"]
        stats = r["stats"]
        rate = f"{stats['hits'] / max(1, stats['hits'] + stats['misses']):.2f}" if stats else "-"
        moved = f"{stats['bytes_moved'] / 1e6:.0f}" if stats else "-"
        print(f"| {name}{'' if same else ' (TOKENS DIFFER)'} | {r['peak'] / 1e6:.0f} MB | {r['peak'] / resident['peak']:.2f}x | "
              f"{r['prefill'] * 1e3:.0f} ms | {r['prefill'] / resident['prefill']:.2f}x | {r['generate']:.2f} s | "
              f"{r['generate'] / resident['generate']:.2f}x | {rate} | {moved} |")


def trace_table(folder: Path) -> None:
    """2.: LRU against LFU on the model's own decode trace."""
    trace = decode_trace(folder)
    n_pairs = CONFIG["num_hidden_layers"] * CONFIG["num_experts"]
    print(f"\nDecode trace: {len(trace)} tokens, {sum(map(len, trace))} expert uses over {n_pairs} (layer, expert) pairs")
    print("| cache size (experts) | share of all | LRU hit rate | LFU hit rate |")
    print("|---:|---:|---:|---:|")
    for share in (0.125, 0.25, 0.5, 0.75):
        capacity = int(n_pairs * share)
        print(f"| {capacity} | {share:.0%} | {hit_rate(trace, capacity, 'lru'):.3f} | {hit_rate(trace, capacity, 'lfu'):.3f} |")


if __name__ == "__main__":
    main()
