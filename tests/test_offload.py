"""Expert offload moves weights, never math: every family, both modes, bit for bit the resident model."""

import json
import os
import struct
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import tiny
import torch
from conftest import FAMILIES, families_reading_experts_one_at_a_time
from safetensors.torch import load_file, save_file

from moelens import HookedTransformer
from moelens.kernels.offload import ExpertCache, OffloadedExperts, PrefetchJob
from moelens.loaders.errors import CheckpointError
from moelens.plan import plan

MODES = ["cpu", "disk"]


def load(path, **kwargs):
    return HookedTransformer.from_pretrained(path, progress=False, **kwargs)


@pytest.fixture(scope="module")
def resident(checkpoints):
    return {f: load(checkpoints[f, "base"]) for f in FAMILIES}


def distinct_experts(cache, model):
    """By hand from the resident run: how many distinct experts each mixture layer's tokens routed to (real ones:
    an identity expert has nothing to fetch)."""
    real = [torch.unique(cache["expert_indices", layer]) for layer in model.cfg.moe_layer_indices]
    return sum(int((ids < model.cfg.n_experts).sum()) for ids in real)


@pytest.mark.parametrize("family", families_reading_experts_one_at_a_time())
@pytest.mark.parametrize("mode", MODES)
def test_logits_and_every_hook_equal_the_resident_model(checkpoints, resident, family, mode, tokens):
    ref = resident[family]
    model = load(checkpoints[family, "base"], expert_offload=mode, expert_cache_bytes=0, expert_prefetch=False)
    ref_logits, ref_cache = ref.run_with_cache(tokens)
    logits, cache = model.run_with_cache(tokens)
    assert torch.equal(logits, ref_logits)
    assert set(cache.keys()) == set(ref_cache.keys())
    for name in ref_cache.keys():
        assert torch.equal(cache[name], ref_cache[name]), name
    # a cache of nothing holds one expert at a time: each layer runs expert by expert, its gate_up pass
    # loading each routed expert, its down pass (last first, still held) loading all but the last again
    stats = model.expert_cache_stats()
    assert stats.misses == sum(2 * len(used) - 1 for used in per_layer_experts(ref_cache, ref)) and stats.hits == 0
    experts = ref.blocks[ref.cfg.moe_layer_indices[0]].mlp.experts
    # one expert's tensors, biases included where the spec has them
    expert_bytes = sum(t[0].nbytes for t in experts.tensors().present())
    assert expert_bytes == experts.spec.expert_nbytes(experts.W_gate_up.dtype)
    assert stats.bytes_moved == stats.misses * expert_bytes
    assert stats.peak_bytes == stats.slot_bytes == expert_bytes


@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss"])  # gpt-oss: biases, the clamped activation
@pytest.mark.parametrize("slots", [1, 2, 3, 7, 8])
@pytest.mark.parametrize("prefetch", [False, True])
def test_every_cache_size_is_the_resident_model_bit_for_bit(checkpoints, resident, tokens, family, slots, prefetch):
    """Layers that route to more experts than the cache holds run in groups of the slots; hooks that edit the
    per-slot tensors see and change the whole layer's, as with the experts resident."""
    ref = resident[family]
    assert ref.cfg.n_experts == 8
    model = load(checkpoints[family, "base"], expert_offload="disk", expert_cache_bytes=slots * expert_bytes(ref),
                 expert_prefetch=prefetch)
    edits = [("blocks.1.mlp.experts.hook_pre", lambda t, hook: t * 1.5),
             ("blocks.2.mlp.experts.hook_post", lambda t, hook: t.flip(-1))]
    for hooks in ([], edits):
        with model.hooks(fwd_hooks=hooks), ref.hooks(fwd_hooks=hooks):
            ref_logits, ref_cache = ref.run_with_cache(tokens)
            logits, cache = model.run_with_cache(tokens)
        assert torch.equal(logits, ref_logits)
        for name in ref_cache.keys():
            assert torch.equal(cache[name], ref_cache[name]), name
    stats = model.expert_cache_stats()
    assert stats.slot_bytes == slots * expert_bytes(ref) and stats.peak_bytes <= stats.slot_bytes
    routed = per_layer_experts(ref_cache, ref)
    assert (stats.grouped_layers > 0) == (max(map(len, routed)) > slots)


@pytest.mark.parametrize("mode", MODES)
def test_a_cache_that_holds_everything_hits_on_the_second_forward(checkpoints, resident, mode, tokens):
    ref = resident["qwen2_moe"]
    model = load(checkpoints["qwen2_moe", "base"], expert_offload=mode, expert_cache_bytes=2**30, expert_prefetch=False)
    _, ref_cache = ref.run_with_cache(tokens)
    model(tokens)
    model(tokens)
    stats = model.expert_cache_stats()
    assert stats.misses == stats.hits == distinct_experts(ref_cache, ref) and stats.evictions == 0


@pytest.mark.parametrize("family", families_reading_experts_one_at_a_time())
def test_rerouting_interventions_fetch_what_they_route_to(checkpoints, resident, family, tokens):
    """A hook that sends every slot to the last expert, and one that edits router logits: the offloaded model
    loads what they route to and matches the resident model under the same hooks."""
    last = resident[family].cfg.n_experts - 1
    # two mixture layers: blocks 1 and 2 where those are mixtures (Nemotron-H's are 1 and 5)
    first, second = [l for l in resident[family].cfg.moe_layer_indices if l >= 1][:2]
    hooks = [
        (f"blocks.{first}.mlp.hook_expert_indices", lambda idx, hook: torch.full_like(idx, last)),
        (f"blocks.{second}.mlp.hook_router_logits", lambda x, hook: x.flip(-1)),
    ]
    model = load(checkpoints[family, "base"], expert_offload="disk", expert_cache_bytes=0)
    assert torch.equal(model.run_with_hooks(tokens, fwd_hooks=hooks), resident[family].run_with_hooks(tokens, fwd_hooks=hooks))


def test_generate_and_activation_gradients_match(checkpoints, resident, tokens):
    ref = resident["hunyuan_v1_moe"]
    model = load(checkpoints["hunyuan_v1_moe", "base"], expert_offload="cpu", expert_cache_bytes=10_000)
    assert torch.equal(model.generate(tokens[:, :6], max_new_tokens=5, do_sample=False), ref.generate(tokens[:, :6], max_new_tokens=5, do_sample=False))
    names = ["blocks.0.hook_resid_pre", "blocks.2.mlp.experts.hook_post"]
    _, a = model.run_with_cache(tokens, return_type="loss", incl_bwd=True, names_filter=names)
    _, b = ref.run_with_cache(tokens, return_type="loss", incl_bwd=True, names_filter=names)
    for name in names:
        assert torch.equal(a[name + "_grad"], b[name + "_grad"]), name


def test_triton_backend_with_offload(checkpoints, tokens):
    pytest.importorskip("triton")
    path = checkpoints["solar_open", "base"]
    ref = load(path, experts_backend="triton")
    layer = expert_bytes(ref) * ref.cfg.n_experts
    for prefetch in (False, True):
        model = load(path, experts_backend="triton", expert_offload="disk", expert_cache_bytes=layer, expert_prefetch=prefetch)
        assert torch.equal(model(tokens), ref(tokens))
    # the kernels compute a layer in one pass: a cache smaller than its routed experts is refused, naming why
    model = load(path, experts_backend="triton", expert_offload="disk", expert_cache_bytes=0)
    with pytest.raises(ValueError, match="experts_backend='triton' computes a layer's experts in one pass"):
        model(tokens)


def test_offloaded_experts_are_not_parameters(checkpoints, resident):
    ref = resident["solar_open"]
    model = load(checkpoints["solar_open", "base"], expert_offload="disk")
    routed = sum(b.mlp.experts.W_gate_up.numel() + b.mlp.experts.W_down.numel() for b in ref.blocks if b.is_moe)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in ref.parameters()) - routed
    assert "offloaded to disk" in repr(model.blocks[0].mlp.experts)
    with pytest.raises(ValueError, match="offloaded to disk"):
        model.W_out
    host = load(checkpoints["solar_open", "base"], expert_offload="cpu")
    assert torch.equal(host.W_out, ref.W_out)  # host-held experts stay readable through the weight views


def test_offload_arguments_are_checked(checkpoints, qwen_model):
    path = checkpoints["qwen2_moe", "base"]
    with pytest.raises(ValueError, match="expert_offload must be one of"):
        load(path, expert_offload="gpu")
    with pytest.raises(ValueError, match="fold_ln"):
        load(path, expert_offload="cpu", fold_ln=True)
    with pytest.raises(ValueError, match="needs expert_offload"):
        load(path, expert_cache_bytes=100)
    with pytest.raises(ValueError, match="expert_cache_bytes must be >= 0"):
        load(path, expert_offload="disk", expert_cache_bytes=-1)
    with pytest.raises(ValueError, match="resident"):
        qwen_model.expert_cache_stats()


# ---- the checkpoint changing under a disk-offloaded model -------------------------------------------------


def is_expert(key: str) -> bool:
    return ".mlp.experts." in key


# what a rewrite of the file does to every routed expert; before the reads were checked, "shape" broadcast a
# row into each slot and "dtype" cast, both giving other logits without an error
REWRITES = {
    "shape": lambda t: t.update({k: v[..., :1, :].contiguous() for k, v in t.items() if is_expert(k)}),
    "dtype": lambda t: t.update({k: v.to(torch.bfloat16) for k, v in t.items() if is_expert(k)}),
    "missing": lambda t: [t.pop(k) for k in [k for k in t if is_expert(k)]],
}


@pytest.mark.parametrize(
    "variant, change, prefetch",
    [("base", "shape", False), ("fused", "shape", True), ("base", "dtype", False), ("base", "missing", False),
     ("fused", "truncated", False)],
)
def test_a_checkpoint_file_changed_after_loading_is_an_error_naming_it(copy_checkpoint, tokens, variant, change, prefetch):
    folder = copy_checkpoint("qwen2_moe", variant)
    path = folder / "model.safetensors"
    model = load(folder, expert_offload="disk", expert_cache_bytes=0, expert_prefetch=prefetch)
    assert torch.equal(model(tokens), load(folder)(tokens))  # the unchanged file reads as loaded
    if change == "truncated":
        os.truncate(path, path.stat().st_size // 2)
    else:
        tensors = load_file(path)
        REWRITES[change](tensors)
        save_file(tensors, path, metadata={"format": "pt"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the prefetch thread's failure, counted and warned
        with pytest.raises(CheckpointError) as info:
            model(tokens)
    assert f"{path} changed after the model was loaded" in str(info.value)
    assert "size" in str(info.value)  # each rewrite here changes the size


def edit_header_in_place(path, old: bytes, new: bytes) -> None:
    """Replace old by new (as long) in a safetensors file's JSON header, keeping its size, inode and mtime."""
    before = os.stat(path)
    with open(path, "r+b") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = f.read(n)
        assert old in header and len(old) == len(new)
        f.seek(8)
        f.write(header.replace(old, new))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino)


@pytest.mark.parametrize(
    "old, new, expected",
    [(b'"dtype":"F32"', b'"dtype":"I32"', "is now I32"),  # before: the float bits read as integers and cast
     (b"up_proj", b"up_prox", "cannot read expert")],  # before: safetensors' own error
)
def test_a_change_that_keeps_the_file_identity_is_caught_by_the_header_check(copy_checkpoint, tokens, old, new, expected):
    folder = copy_checkpoint("qwen2_moe")
    path = folder / "model.safetensors"
    model = load(folder, expert_offload="disk", expert_cache_bytes=0, expert_prefetch=False)
    edit_header_in_place(path, old, new)
    with pytest.raises(CheckpointError, match=expected) as info:
        model(tokens)
    assert str(path) in str(info.value) and "model.layers." in str(info.value)


# ---- prefetch ----------------------------------------------------------------------------------------


def stores(model):
    """The offloaded mixture layers' stores, in layer order."""
    return [b.mlp.experts.store for b in model.blocks if b.is_moe]


def expert_bytes(model):
    experts = model.blocks[model.cfg.moe_layer_indices[0]].mlp.experts
    return sum(t[0].nbytes for t in experts.tensors().present())  # biases too, where the spec has them


def two_layers(model):
    """A cache of two layers' experts: room for a layer's working set and the next layer's prefetch."""
    return 2 * model.cfg.n_experts * expert_bytes(model)


def per_layer_experts(cache, model):
    """By hand from the resident run: the distinct experts each mixture layer routed to (real ones: an identity
    expert has nothing to fetch)."""
    return [[e for e in sorted(torch.unique(cache["expert_indices", layer]).tolist()) if e < model.cfg.n_experts]
            for layer in model.cfg.moe_layer_indices]


def let_prefetch_finish(model):
    """Make each prefetch job run to its end before a layer settles it. Without this, whether the prefetch
    thread or the next layer gets to an expert first depends on scheduling, and a loaded machine makes the
    layer cancel part of a job: counts would race. Results never depend on it; these exact counts do."""
    prefetcher = model.expert_cache.prefetcher
    cancel = prefetcher.cancel

    def finish_then_cancel():
        with prefetcher._cond:
            prefetcher._cond.wait_for(lambda: prefetcher._job is None and not prefetcher._busy, timeout=60)
        cancel()

    prefetcher.cancel = finish_then_cancel


@pytest.mark.parametrize("family", families_reading_experts_one_at_a_time())
def test_prefetch_changes_no_bit(checkpoints, resident, family, tokens):
    ref = resident[family]
    model = load(checkpoints[family, "base"], expert_offload="disk", expert_cache_bytes=two_layers(ref), expert_prefetch=True)
    let_prefetch_finish(model)
    ref_logits, ref_cache = ref.run_with_cache(tokens)
    logits, cache = model.run_with_cache(tokens)
    assert torch.equal(logits, ref_logits)
    for name in ref_cache.keys():
        assert torch.equal(cache[name], ref_cache[name]), name
    stats = model.expert_cache_stats()
    # the layers asked for exactly what they routed to; from an empty cache, every hit was prefetched
    assert stats.hits + stats.misses == distinct_experts(ref_cache, ref)
    assert stats.hits == stats.prefetch_hits
    assert (stats.prefetched > 0) == (len(ref.cfg.moe_layer_indices) > 1)  # a layer prefetches for the next one
    assert stats.prefetch_hits + stats.prefetch_wasted <= stats.prefetched and stats.prefetch_errors == 0


def test_a_perfect_prediction_is_counted_as_prefetch_hits(checkpoints, resident, tokens):
    ref = resident["qwen2_moe"]
    _, ref_cache = ref.run_with_cache(tokens)
    used = per_layer_experts(ref_cache, ref)
    model = load(checkpoints["qwen2_moe", "base"], expert_offload="disk", expert_cache_bytes=two_layers(ref), expert_prefetch=True)
    let_prefetch_finish(model)
    layers = ref.cfg.moe_layer_indices
    for store, after in zip(stores(model), layers[1:]):  # an oracle: the next layer's real routing
        store.predict = lambda x, after=after: ref_cache["expert_indices", after]
    assert torch.equal(model(tokens), ref(tokens))
    stats = model.expert_cache_stats()
    assert stats.misses == len(used[0])  # only the first mixture layer loads for itself
    assert stats.prefetched == stats.prefetch_hits == stats.hits == sum(map(len, used[1:]))
    assert stats.prefetch_wasted == 0
    assert stats.bytes_moved == (stats.misses + stats.prefetched) * expert_bytes(ref)


def test_a_wrong_prediction_costs_loads_never_results_nor_the_memory_bound(checkpoints, resident, tokens):
    ref = resident["qwen2_moe"]
    few = tokens[:1, :2]  # 2 tokens x top-3 leave some of the 8 experts of each layer unused
    _, ref_cache = ref.run_with_cache(few)
    used = per_layer_experts(ref_cache, ref)
    model = load(checkpoints["qwen2_moe", "base"], expert_offload="disk", expert_cache_bytes=two_layers(ref), expert_prefetch=True)
    let_prefetch_finish(model)  # else a job the next layer cancels early loads fewer: counts would race
    for store, nxt in zip(stores(model), used[1:]):  # exactly the experts the next layer does not use
        wrong = torch.tensor([e for e in range(ref.cfg.n_experts) if e not in nxt])
        store.predict = lambda x, wrong=wrong: wrong
    logits, cache = model.run_with_cache(few)
    assert torch.equal(logits, ref.run_with_cache(few)[0])
    assert all(torch.equal(cache[k], ref_cache[k]) for k in ref_cache.keys())
    stats = model.expert_cache_stats()
    wasted = sum(ref.cfg.n_experts - len(n) for n in used[1:])
    assert stats.prefetched == stats.prefetch_wasted == wasted and stats.prefetch_hits == stats.hits == 0
    assert stats.misses == sum(map(len, used))
    # the cache never held more than its slots: two layers' experts
    assert 0 < stats.peak_bytes <= stats.slot_bytes == two_layers(ref)


@pytest.mark.parametrize("slots", [1, 2, 3, 100])
def test_peak_cache_bytes_without_prefetch_is_the_largest_working_set_the_slots_allow(checkpoints, resident, tokens, slots):
    ref = resident["solar_open"]
    _, ref_cache = ref.run_with_cache(tokens[:1, :3])
    model = load(checkpoints["solar_open", "base"], expert_offload="disk", expert_cache_bytes=slots * expert_bytes(ref) + 1,
                 expert_prefetch=False)
    model(tokens[:1, :3])
    stats = model.expert_cache_stats()
    all_experts = ref.cfg.n_experts * len(ref.cfg.moe_layer_indices)  # no more slots than experts offloaded
    assert stats.slot_bytes == min(slots, all_experts) * expert_bytes(ref)
    largest = max(map(len, per_layer_experts(ref_cache, ref)))
    assert stats.peak_bytes == min(slots, max(largest, sum(map(len, per_layer_experts(ref_cache, ref))))) * expert_bytes(ref)


@pytest.mark.parametrize("where", ["predictor", "loader"])
def test_an_exception_in_the_prefetch_thread_is_counted_and_changes_nothing(checkpoints, resident, tokens, where):
    ref = resident["hunyuan_v1_moe"]
    model = load(checkpoints["hunyuan_v1_moe", "base"], expert_offload="disk", expert_cache_bytes=two_layers(ref), expert_prefetch=True)
    let_prefetch_finish(model)  # else a job the next layer drops before it starts raises nothing: counts would race

    def broken(*args):
        raise OSError("prefetch broke")

    for store in stores(model):
        if where == "predictor":
            store.predict = broken
        else:  # the expert reads fail in the prefetch thread only; the layers' own reads work
            real = store.load_into
            store.load_into = lambda e, slot, real=real: (
                broken() if threading.current_thread().name == "moelens-expert-prefetch" else real(e, slot)
            )
    with pytest.warns(RuntimeWarning, match="expert prefetch failed.*prefetch broke"):
        assert torch.equal(model(tokens), ref(tokens))
    jobs = len(stores(model)) - 1  # one per mixture layer that has a next one
    assert model.expert_cache_stats().prefetch_errors == jobs
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once, counted always
        assert torch.equal(model(tokens), ref(tokens))
    assert model.expert_cache_stats().prefetch_errors == 2 * jobs
    assert isinstance(model.expert_cache.prefetcher.error, OSError)


def test_two_threads_share_a_prefetching_model(checkpoints, resident, tokens):
    ref = resident["solar_open"]
    model = load(checkpoints["solar_open", "base"], expert_offload="disk", expert_cache_bytes=expert_bytes(ref) * 4,
                 expert_prefetch=True)
    inputs = [tokens, tokens[:, :7], tokens[:1], tokens.flip(-1)]
    expected = [ref(t) for t in inputs]
    results: dict = {}

    def work(thread):
        with torch.no_grad():
            results[thread] = [model(inputs[(thread + i) % len(inputs)]) for i in range(4)]

    threads = [threading.Thread(target=work, args=(t,)) for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    for thread, outs in results.items():
        assert all(torch.equal(out, expected[(thread + i) % len(inputs)]) for i, out in enumerate(outs))
    assert len(results) == 2 and model.expert_cache_stats().prefetch_errors == 0


def test_cancel_waits_for_the_expert_in_flight_and_nothing_lands_after_it():
    cache = ExpertCache(10**9)
    cache.enable_prefetch()
    started = threading.Event()

    def slow(e):
        started.set()
        time.sleep(0.05)
        return torch.full((2, 2), float(e)), torch.zeros(2, 2)

    template = (torch.empty(2, 2, device="meta"), torch.empty(2, 2, device="meta"))
    store = OffloadedExperts(1, 16, slow, cache, torch.device("cpu"), "disk", template)
    cache.prefetcher.submit(PrefetchJob(store, torch.zeros(1), lambda x: torch.arange(16)))
    started.wait(5)
    cache.prefetcher.cancel()
    landed = set(cache.entries)
    time.sleep(0.2)
    assert set(cache.entries) == landed and 1 <= len(landed) < 16
    assert all(torch.equal(cache.entries[1, e][0], torch.full((2, 2), float(e))) for _, e in landed)
    # the layer then loads the rest itself and counts the prefetched ones it used
    cache.settle_prefetch(1, list(range(16)))
    slots = cache.hold(store, list(range(16)))
    pool = cache.slots(store)
    assert all(torch.equal(pool.views(slots[e])[0], torch.full((2, 2), float(e))) for e in range(16))
    assert cache.stats.prefetch_hits == len(landed) and cache.stats.misses == 16 - len(landed)


def test_prefetch_is_on_by_default_for_disk_only_and_needs_offload(checkpoints):
    path = checkpoints["qwen2_moe", "base"]
    assert load(path, expert_offload="disk").expert_cache.prefetcher is not None
    assert load(path, expert_offload="disk", expert_prefetch=False).expert_cache.prefetcher is None
    assert load(path, expert_offload="cpu").expert_cache.prefetcher is None
    assert load(path, expert_offload="cpu", expert_prefetch=True).expert_cache.prefetcher is not None
    with pytest.raises(ValueError, match="expert_prefetch .* needs expert_offload"):
        load(path, expert_prefetch=True)


# ---- the memory the experts really take ------------------------------------------------------------------

PEAK_CHILD = """
import json, sys, torch
from moelens import HookedTransformer
torch.set_num_threads(1)

def hwm():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))

base = hwm()
model = HookedTransformer.from_pretrained(sys.argv[1], progress=False, **json.loads(sys.argv[2]))
with torch.no_grad():
    model(torch.randint(0, 96, (1, 64), generator=torch.Generator().manual_seed(0)))
print(hwm() - base)
"""


def peak_growth(folder, **kwargs) -> int:
    """Peak RSS growth (VmHWM after loading and a 64-token forward, minus after imports) of a fresh process."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", PEAK_CHILD, str(folder), json.dumps(kwargs)], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.split()[-1])


@pytest.mark.slow  # a checkpoint built and two fresh processes: ~20 s, a minute on a loaded machine
def test_disk_offload_peak_memory_is_what_plan_reports(tmp_path):
    """The process's peak against moelens plan's: the resident model's and the offloaded model's (non-expert
    weights + activations + expert cache) exceed their plans by the same (the interpreter's and allocator's
    own). Before the kernels read the cache's slots, a layer's routed experts were copied into a stack on top of
    a cache that held them all while the layer ran: 2 x 12.6 MB here beyond the plan."""
    tiny.build_qwen2_moe(tmp_path, seed=0, hidden_size=256, moe_intermediate_size=256, shared_expert_intermediate_size=64,
                         intermediate_size=64, num_experts=16, num_experts_per_tok=4, num_hidden_layers=4, vocab_size=96)
    each = 3 * 256 * 256 * 4  # one expert, float32
    p = plan(tmp_path, dtype="float32", cpu_memory=10**12, batch=1, seq=64)
    one = next(o for o in p.placement["options"] if o["kind"] == "one_device")
    rest = next(o for o in p.placement["options"] if o["kind"] == "expert_offload")["device_bytes"]
    cache = 4 * each  # a quarter of a layer's 16 experts, which 64 tokens x top-4 all route to
    resident_excess = peak_growth(tmp_path, dtype="float32") - one["bytes"]
    offload_excess = peak_growth(tmp_path, dtype="float32", expert_offload="disk", expert_cache_bytes=cache,
                                 expert_prefetch=False) - (rest + cache)
    # tolerance: half a layer's experts (6.3 MB); runs of the benchmark differ by up to ~4 MB in excess
    assert offload_excess <= resident_excess + 8 * each, (offload_excess, resident_excess)
