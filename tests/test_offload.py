"""Expert offload moves weights, never math: every family, both modes, bit for bit the resident model."""

import pytest
import torch
from conftest import FAMILIES

from moelens import HookedTransformer

MODES = ["cpu", "disk"]


def load(path, **kwargs):
    return HookedTransformer.from_pretrained(path, progress=False, **kwargs)


@pytest.fixture(scope="module")
def resident(checkpoints):
    return {f: load(checkpoints[f, "base"]) for f in FAMILIES}


def distinct_experts(cache, model):
    """By hand from the resident run: how many distinct experts each mixture layer's tokens routed to."""
    return sum(len(torch.unique(cache["expert_indices", layer])) for layer in model.cfg.moe_layer_indices)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", MODES)
def test_logits_and_every_hook_equal_the_resident_model(checkpoints, resident, family, mode, tokens):
    ref = resident[family]
    model = load(checkpoints[family, "base"], expert_offload=mode, expert_cache_bytes=0)
    ref_logits, ref_cache = ref.run_with_cache(tokens)
    logits, cache = model.run_with_cache(tokens)
    assert torch.equal(logits, ref_logits)
    assert set(cache.keys()) == set(ref_cache.keys())
    for name in ref_cache.keys():
        assert torch.equal(cache[name], ref_cache[name]), name
    # nothing cached between forwards: every routed expert of every layer was fetched once
    stats = model.expert_cache_stats()
    assert stats.misses == distinct_experts(ref_cache, ref) and stats.hits == 0
    experts = ref.blocks[ref.cfg.moe_layer_indices[0]].mlp.experts
    expert_bytes = experts.W_gate_up[0].nbytes + experts.W_down[0].nbytes
    assert stats.bytes_moved == stats.misses * expert_bytes


@pytest.mark.parametrize("mode", MODES)
def test_a_cache_that_holds_everything_hits_on_the_second_forward(checkpoints, resident, mode, tokens):
    ref = resident["qwen2_moe"]
    model = load(checkpoints["qwen2_moe", "base"], expert_offload=mode, expert_cache_bytes=2**30)
    _, ref_cache = ref.run_with_cache(tokens)
    model(tokens)
    model(tokens)
    stats = model.expert_cache_stats()
    assert stats.misses == stats.hits == distinct_experts(ref_cache, ref) and stats.evictions == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_rerouting_interventions_fetch_what_they_route_to(checkpoints, resident, family, tokens):
    """A hook that sends every slot to the last expert, and one that edits router logits: the offloaded model
    loads what they route to and matches the resident model under the same hooks."""
    last = resident[family].cfg.n_experts - 1
    hooks = [
        ("blocks.1.mlp.hook_expert_indices", lambda idx, hook: torch.full_like(idx, last)),
        ("blocks.2.mlp.hook_router_logits", lambda x, hook: x.flip(-1)),
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
    model = load(path, experts_backend="triton", expert_offload="disk", expert_cache_bytes=0)
    assert torch.equal(model(tokens), ref(tokens))


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
