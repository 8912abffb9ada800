"""Device maps: parsing, the planner's block assignment against budgets, and loading with a map (CPU only here:
this machine has one device, so the maps place on "cpu" and "cpu:1", which torch keeps apart as names; a
tensor on either reports "cpu", so where a part went is read from model.device_map)."""

import random

import pytest
import torch
from conftest import FAMILIES

from moelens import HookedTransformer
from moelens.placement import parse_device_map, parse_size
from moelens.plan import Device, LayerCount, Needs, assign_parts, plan


def load(path, **kwargs):
    return HookedTransformer.from_pretrained(path, progress=False, **kwargs)


def test_a_map_must_place_every_part_once():
    full = {"embed": "cpu", "blocks.0-1": "cpu", "blocks.2": "cpu:1", "ln_final": "cpu:1", "unembed": "cpu:1"}
    placed = parse_device_map(full, 3)
    assert placed["blocks.1"] == torch.device("cpu") and placed["blocks.2"] == torch.device("cpu", 1)
    with pytest.raises(ValueError, match="does not place unembed, blocks.2"):
        parse_device_map({"embed": "cpu", "blocks.0-1": "cpu", "ln_final": "cpu"}, 3)
    with pytest.raises(ValueError, match="places blocks.1 twice"):
        parse_device_map({**full, "blocks.1": "cpu"}, 3)
    with pytest.raises(ValueError, match="blocks run from 0 to 2"):
        parse_device_map({**full, "blocks.2-3": "cpu"}, 3)
    with pytest.raises(ValueError, match="'attn' is not one of"):
        parse_device_map({**full, "attn": "cpu"}, 3)
    with pytest.raises(ValueError, match="not a torch device"):
        parse_device_map({**full, "embed": "gpu7"}, 3)


def needs(blocks, embedding=0, final=0, tied=0, layer_peak=0, per_device=0, kv=0):
    return Needs(embedding=embedding, final=final, tied_unembed=tied,
                 blocks=[LayerCount(i, "moe", bytes=b) for i, b in enumerate(blocks)], layer_peak=layer_peak,
                 peak=layer_peak, kv_per_layer=kv, batch=1, seq=1, per_device=per_device)


def devices(**budgets):
    return [Device(name, memory, headroom=0.0) for name, memory in budgets.items()]


def where(parts):
    """block -> device, and the devices of the embedding and the unembedding."""
    blocks = {b: p["device"] for p in parts for b in p["blocks"]}
    embed = [p["device"] for p in parts if p["embedding"]]
    unembed = [p["device"] for p in parts if p["unembedding"]]
    return [blocks[i] for i in sorted(blocks)], embed, unembed


def test_a_block_that_does_not_fit_moves_to_the_next_device():
    # by hand: a holds the embedding (5) and blocks 0-1 (25); block 2 would make 35 > 25, so it goes to b,
    # which then holds blocks 2-3 and the final norm and unembedding (7): 27 <= 30
    parts = assign_parts(needs([10, 10, 10, 10], embedding=5, final=7), devices(a=25, b=30))
    assert where(parts) == (["a", "a", "b", "b"], ["a"], ["b"])
    assert [p["bytes"] for p in parts] == [25, 27]


def test_the_embedding_goes_with_the_first_block_and_the_unembedding_with_the_last():
    # a cannot hold the embedding (5) with block 0 (10): both go to b, never the embedding alone on a
    assert where(assign_parts(needs([10, 10], embedding=5), devices(a=12, b=30))) == (["b", "b"], ["b"], ["b"])
    # without its head block 1 fits on a (20 <= 25); with it (28) it moves, and the head with it
    assert where(assign_parts(needs([10, 10]), devices(a=25, b=20)))[0] == ["a", "a"]
    assert where(assign_parts(needs([10, 10], final=8), devices(a=25, b=20))) == (["a", "b"], ["a"], ["b"])


def test_every_device_holds_its_working_memory_and_a_tied_head_away_from_the_embedding_is_a_copy():
    # layer_peak 3 + per_device 2 on each device used: a = 5 + 10, b = 5 + 10
    parts = assign_parts(needs([10, 10], layer_peak=3, per_device=2), devices(a=15, b=15))
    assert where(parts)[0] == ["a", "b"] and [p["bytes"] for p in parts] == [15, 15]
    # the KV cache of each block goes with it: 2 more per block
    with pytest.raises(ValueError, match="2 bytes short"):
        assign_parts(needs([10, 10], layer_peak=3, per_device=2, kv=2), devices(a=15, b=15))
    # block 1 and a tied head on b: 10 + 1 (final) + 6 (copy of the embedding) = 17
    assert where(assign_parts(needs([10, 10], embedding=6, tied=6, final=1), devices(a=16, b=17)))[0] == ["a", "b"]
    with pytest.raises(ValueError, match="1 bytes short"):
        assign_parts(needs([10, 10], embedding=6, tied=6, final=1), devices(a=16, b=16))


def test_a_map_that_cannot_fit_names_the_part_the_device_and_the_bytes_short():
    # a: embedding + blocks 0-1 = 25; b: block 2 = 10, then block 3 with the head: 10 + 10 + 7 = 27 > 20
    with pytest.raises(ValueError, match=r"block 3 with the final norm and unembedding .* on b, the last, .* 7 bytes short"):
        assign_parts(needs([10, 10, 10, 10], embedding=5, final=7), devices(a=25, b=20))
    with pytest.raises(ValueError, match=r"block 0 with the embedding .* on a, the last, .* 25 bytes short"):
        assign_parts(needs([10], embedding=50), devices(a=35))


def test_random_assignments_keep_every_budget_and_the_order():
    rng = random.Random(0)
    for _ in range(300):
        blocks = [rng.randint(1, 20) for _ in range(rng.randint(1, 12))]
        first, last, fixed = rng.randint(0, 10), rng.randint(0, 10), rng.randint(0, 5)
        budgets = {f"d{i}": rng.randint(10, 80) for i in range(rng.randint(1, 4))}
        try:
            parts = assign_parts(needs(blocks, embedding=first, final=last, layer_peak=fixed), devices(**budgets))
        except ValueError as err:
            assert "bytes short" in str(err)
            continue
        on, embed, unembed = where(parts)
        order = list(budgets)
        assert [order.index(d) for d in on] == sorted(order.index(d) for d in on)  # whole ranges, in order
        assert embed == [on[0]] and unembed == [on[-1]]
        used = {d: fixed for d in set(on)}
        used[on[0]] += first
        used[on[-1]] += last
        for d, size in zip(on, blocks):
            used[d] += size
        assert all(used[d] <= budgets[d] for d in used), (blocks, first, last, budgets, on)


def test_sizes_parse():
    assert parse_size("141GB", "x") == 141 * 10**9 and parse_size("80GiB", "x") == 80 * 2**30 and parse_size(7, "x") == 7
    with pytest.raises(ValueError, match=r"max_memory\['cuda:0'\]: expected a size"):
        parse_size("lots", "max_memory['cuda:0']")


@pytest.mark.parametrize("family", FAMILIES)
def test_a_mapped_model_gives_the_resident_results(checkpoints, family, tokens):
    path = checkpoints[family, "base"]
    ref = load(path)
    n = ref.cfg.n_layers
    mapped = load(path, device_map={"embed": "cpu", "blocks.0": "cpu", f"blocks.1-{n - 1}": "cpu:1", "ln_final": "cpu:1", "unembed": "cpu:1"})
    ref_logits, ref_cache = ref.run_with_cache(tokens)
    logits, cache = mapped.run_with_cache(tokens)
    assert torch.equal(logits, ref_logits)
    assert all(torch.equal(cache[k], ref_cache[k]) for k in ref_cache.keys())
    assert torch.equal(mapped.generate(tokens[:, :5], max_new_tokens=4, do_sample=False), ref.generate(tokens[:, :5], max_new_tokens=4, do_sample=False))
    if ref.cfg.tie_word_embeddings:  # a tied head placed on another device gets a copy of its own there
        assert mapped.unembed.weight is not mapped.embed.weight and torch.equal(mapped.W_U, ref.W_U)


def weight_bytes(model, *, experts=True):
    """Bytes of the model's parameters (tied ones once), by hand from the loaded tensors."""
    return sum(p.nbytes for n, p in model.named_parameters() if experts or ".experts." not in n)


def expanded(option):
    """plan's device-map option as model.device_map spells it: every block by itself."""
    spec = {"embed": option["devices"][0]["device"]}
    for part in option["devices"]:
        spec |= {f"blocks.{b}": part["device"] for b in range(part["blocks"][0], part["blocks"][1] + 1)}
    return spec | {"ln_final": option["devices"][-1]["device"], "unembed": option["devices"][-1]["device"]}


@pytest.mark.parametrize("family", ["qwen2_moe", "hunyuan_v1_moe"])
def test_auto_places_blocks_where_moelens_plan_says(checkpoints, family, tokens):
    """device_map="auto" loads the map `moelens plan` recommends for the same devices, batch and seq, and
    gives the single-device model's logits and hooks bit for bit."""
    path = checkpoints[family, "base"]
    ref = load(path)
    # by hand: plan's budget is 90% of it, 108% of the weights: less than the weights plus working memory
    # and KV cache of 2 x 20 tokens (~125%), more than two blocks plus the embedding (~80%)
    memory = weight_bytes(ref) * 6 // 5
    p = plan(path, dtype="float32", devices=["cpu", "cpu:1"], gpu_memory=memory, batch=2, seq=20)
    option = p.placement["recommended"]
    assert option["kind"] == "device_map" and [d["device"] for d in option["devices"]] == ["cpu", "cpu:1"]
    max_memory = {d["device"]: d["budget"] for d in p.placement["devices"]}  # plan's budgets, used whole
    mapped = load(path, device_map="auto", max_memory=max_memory, plan_batch=2, plan_seq=20)
    assert mapped.device_map == expanded(option)
    on = {d: 0 for d in max_memory}  # each device's weights, from the loaded tensors, within its budget
    for name, param in mapped.named_parameters():
        on[mapped.device_map[name.split(".")[0] if not name.startswith("blocks.") else ".".join(name.split(".")[:2])]] += param.nbytes
    assert all(on[d] <= max_memory[d] for d in on) and all(on.values())
    ref_logits, ref_cache = ref.run_with_cache(tokens)
    logits, cache = mapped.run_with_cache(tokens)
    assert torch.equal(logits, ref_logits)
    assert all(torch.equal(cache[k], ref_cache[k]) for k in ref_cache.keys())


def test_auto_reserves_room_for_plan_batch_and_seq(checkpoints):
    path = checkpoints["qwen2_moe", "base"]
    ample = {"cpu": "5MB", "cpu:1": "5MB"}
    assert load(path, device_map="auto", max_memory=ample, plan_seq=16).device_map["unembed"] == "cpu"
    # seq 4096: the eager attention scores alone are 4 heads x 4096^2 x 12 bytes = 805 MB, on every device
    with pytest.raises(ValueError, match=r"cannot place the model within max_memory .* on cpu:1, the last, .* bytes short"):
        load(path, device_map="auto", max_memory=ample, plan_seq=4096)
    with pytest.raises(ValueError, match="plan_seq must be a positive integer"):
        load(path, device_map="auto", max_memory=ample, plan_seq=0)
    with pytest.raises(ValueError, match="pass device_map='auto' with them"):
        load(path, plan_batch=4)


def test_auto_with_offload_counts_the_mapped_weights_and_the_expert_cache(checkpoints, tokens):
    path = checkpoints["qwen2_moe", "base"]
    ref = load(path)
    layer = (weight_bytes(ref) - weight_bytes(ref, experts=False)) // ref.cfg.n_layers  # one layer's experts
    # by hand: the non-expert weights, a cache of up to one layer's experts (all the routed experts take: the
    # kernels read its slots) and half a layer more for activations and KV cache of 1 x 16 tokens; less than
    # the whole model
    memory = weight_bytes(ref, experts=False) + layer + layer // 2
    assert memory < weight_bytes(ref)
    with pytest.raises(ValueError, match=r"on cpu, the last, .* bytes short"):
        load(path, device_map="auto", max_memory={"cpu": memory}, plan_seq=16)
    for cache in (0, layer):  # 0: one expert's slot
        model = load(path, device_map="auto", max_memory={"cpu": memory}, plan_seq=16, expert_offload="disk", expert_cache_bytes=cache)
        assert torch.equal(model(tokens), ref(tokens))
    with pytest.raises(ValueError, match="bytes short"):  # a cache of two layers' experts does not fit
        load(path, device_map="auto", max_memory={"cpu": memory}, plan_seq=16, expert_offload="disk", expert_cache_bytes=2 * layer)
    # over two devices: the dense parts mapped, the experts offloaded, each layer's cache on its block's device
    # on one device, the cache and the activations would not fit beside every non-expert weight
    each = weight_bytes(ref, experts=False) + layer // 2
    two = load(path, device_map="auto", max_memory={"cpu": each, "cpu:1": each}, plan_seq=16, expert_offload="cpu",
               expert_cache_bytes=layer // 2)
    assert set(two.device_map.values()) == {"cpu", "cpu:1"}
    ref_logits, ref_cache = ref.run_with_cache(tokens)
    logits, cache = two.run_with_cache(tokens)
    assert torch.equal(logits, ref_logits) and all(torch.equal(cache[k], ref_cache[k]) for k in ref_cache.keys())


def test_auto_map_arguments_are_checked(checkpoints):
    path = checkpoints["solar_open", "base"]
    with pytest.raises(ValueError, match="max_memory is what device_map='auto' fills"):
        load(path, max_memory={"cpu": "1GB"})
    with pytest.raises(ValueError, match=r"cannot place the model within max_memory \(cpu: 30,000 bytes, cpu:1: 30,000 bytes\)"):
        load(path, device_map="auto", max_memory={"cpu": 30_000, "cpu:1": 30_000})
