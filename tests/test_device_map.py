"""Device maps: parsing, the planner's block assignment against budgets, and loading with a map (CPU only here:
this machine has one device, so the maps place on "cpu" and "cpu:1", which torch keeps apart as names)."""

import random

import pytest
import torch
from conftest import FAMILIES

from moelens import HookedTransformer
from moelens.placement import assign_blocks, parse_device_map, parse_size


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


def test_blocks_fill_devices_in_order_within_their_budgets():
    # by hand: a holds the embedding (5) and two blocks (25); block 2 would make 35 > 25, so it goes to b,
    # which then holds blocks 2-3 and the head (7): 27 <= 30
    assert assign_blocks([10, 10, 10, 10], 5, 7, {"a": 25, "b": 30}) == ["a", "a", "b", "b"]
    with pytest.raises(ValueError, match="blocks 3-3 are left over"):
        assign_blocks([10, 10, 10, 10], 5, 7, {"a": 25, "b": 20})
    with pytest.raises(ValueError, match="embedding"):
        assign_blocks([10], 50, 0, {"a": 25})
    rng = random.Random(0)
    for _ in range(200):
        blocks = [rng.randint(1, 20) for _ in range(rng.randint(1, 12))]
        first, last = rng.randint(0, 10), rng.randint(0, 10)
        budgets = {f"d{i}": rng.randint(10, 80) for i in range(rng.randint(1, 4))}
        try:
            devices = assign_blocks(blocks, first, last, budgets)
        except ValueError:
            continue
        order = list(budgets)
        assert [order.index(d) for d in devices] == sorted(order.index(d) for d in devices)  # whole ranges, in order
        used = {d: 0 for d in budgets}
        used[order[0]] += first
        used[devices[-1]] += last
        for d, size in zip(devices, blocks):
            used[d] += size
        assert all(used[d] <= budgets[d] for d in budgets), (blocks, first, last, budgets, devices)


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


def test_auto_map_and_offload_combine(checkpoints, tokens):
    path = checkpoints["solar_open", "base"]
    ref = load(path)
    model = load(path, device_map="auto", max_memory={"cpu": "1GB"}, expert_offload="disk", expert_cache_bytes=0)
    assert torch.equal(model(tokens), ref(tokens))
    with pytest.raises(ValueError, match="does not fit in max_memory"):
        load(path, device_map="auto", max_memory={"cpu": 30_000, "cpu:1": 30_000})
    with pytest.raises(ValueError, match="max_memory is what device_map='auto' fills"):
        load(path, max_memory={"cpu": "1GB"})
