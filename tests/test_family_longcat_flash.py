"""LongCat-Flash (HookedLongcatFlash) against transformers' LongcatFlashForCausalLM: every site in float32 and bit
for bit in bfloat16, the block of several sublayers (resid_pre + each sublayer's output hook = resid_post), identity
experts (what their slots hold, nothing computed or fetched for them), MLA's LoRA scaling, the cache, greedy
generation, left padding, offload and expert parallelism bit for bit, plan at full size from config alone."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import family_harness as harness
import tiny_longcat_flash as tiny_lc
from flagships import flagship
from family_harness import MODEL_SITES, References, build_checkpoints, check_greedy_generation, left_padded, tokens

from moelens import HookedTransformer
from moelens.kv_cache import KVCache
from moelens.loaders.errors import CheckpointError
from moelens.loaders.expert_reader import ExpertReader
from moelens.models.longcat_flash import HookedLongcatFlash, LongcatBlock, SublayerStates
from moelens.plan import plan
from moelens.state import KVState
from moelens.verify import compare, load_reference
from test_plan import hf_weights

VARIANTS = [v for (_, v) in tiny_lc.FAMILY_VARIANTS]  # the same weights (seed 0), in three layouts
N_EXPERTS, N_IDENTITY = 6, 2
BLOCK_SITES = (
    "hook_resid_pre", "ln1.hook_normalized", "hook_attn_out", "ln2.hook_normalized", "hook_mlp_out", "hook_dense_0_out",
    "ln1_1.hook_normalized", "hook_attn_1_out", "ln2_1.hook_normalized", "hook_dense_1_out", "hook_resid_post",
    "attn.hook_q_latent", "attn.hook_z", "attn_1.hook_q_latent", "attn_1.hook_z", "dense_0.hook_post", "dense_1.hook_post",
    "mlp.hook_router_logits", "mlp.hook_expert_weights", "mlp.hook_expert_indices", "mlp.hook_routed_out",
)
OUT_HOOKS = ("hook_attn_out", "hook_dense_0_out", "hook_attn_1_out", "hook_dense_1_out", "hook_mlp_out")  # as added


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return build_checkpoints(tmp_path_factory, "longcat_flash", tiny_lc.FAMILY_VARIANTS)


@pytest.fixture(scope="module")
def refs(ckpts):
    return References(ckpts)


@pytest.fixture(scope="module")
def model(ckpts):
    return HookedTransformer.from_pretrained(ckpts["base"], progress=False)


@pytest.mark.parametrize("variant", VARIANTS)
def test_float32_every_site(ckpts, refs, variant):
    """transformers' saved layout (with its identity experts' gate / up rows), the Hub's (without) and the fused
    one hold the same weights; each against transformers' run of them."""
    model = HookedTransformer.from_pretrained(ckpts[variant], progress=False)
    assert type(model) is HookedLongcatFlash and all(type(b) is LongcatBlock for b in model.blocks)
    report = compare(model, refs("base"), tokens(shape=(2, 60)))
    harness.check_report(report, model, lambda layer: BLOCK_SITES, 1e-5, MODEL_SITES)


def test_bfloat16_bit_exact(ckpts, refs):
    """Routing identical and every site bit for bit: the router casts transformers' bfloat16 classifier up to
    float32 as it does, and the slots are added in expert order in bfloat16 as its loop over experts does."""
    model = HookedTransformer.from_pretrained(ckpts["base"], dtype=torch.bfloat16, progress=False)
    assert model.blocks[0].mlp.router.weight.dtype == torch.bfloat16
    harness.check_bit_exact(compare(model, refs("base", torch.bfloat16), tokens(shape=(2, 60))))


def test_every_block_is_resid_pre_plus_its_sublayers(model, refs):
    """resid_post = resid_pre + the five sublayers' output hooks, listed by block.sublayers(); and resid_post is
    transformers' decoder layer output."""
    toks = tokens(shape=(2, 30))
    _, cache = model.run_with_cache(toks)
    outputs = {}
    ref = refs("base")
    hooks = [layer.register_forward_hook(lambda m, i, o, n=n: outputs.__setitem__(n, o)) for n, layer in enumerate(ref.model.layers)]
    try:
        with torch.no_grad():
            ref(toks)
    finally:
        for h in hooks:
            h.remove()
    for layer, block in enumerate(model.blocks):
        subs = block.sublayers()
        assert tuple(s.out_hook for s in subs) == OUT_HOOKS
        assert [s.norm for s in subs] == [block.ln1, block.ln2, block.ln1_1, block.ln2_1, block.ln2]
        total = cache[f"blocks.{layer}.hook_resid_pre"] + sum(cache[f"blocks.{layer}.{s.out_hook}"] for s in subs)
        post = cache[f"blocks.{layer}.hook_resid_post"]
        assert (total - post).abs().max() <= 1e-5
        assert (post - outputs[layer]).abs().max() <= 1e-5


def test_identity_slots_hold_the_input_and_compute_nothing(model):
    toks = tokens(shape=(2, 30))
    _, cache = model.run_with_cache(toks)
    for layer in range(model.cfg.n_layers):
        c = lambda s: cache[f"blocks.{layer}.{s}"]  # noqa: E731
        idx = c("mlp.hook_expert_indices")
        identity = idx >= N_EXPERTS
        assert identity.any() and (~identity).any()  # both kinds are routed to
        assert int(idx.max()) < N_EXPERTS + N_IDENTITY
        x = c("ln2.hook_normalized")[:, :, None, :].expand_as(c("mlp.experts.hook_out"))
        assert torch.equal(c("mlp.experts.hook_out")[identity], x[identity])
        assert not c("mlp.experts.hook_post")[identity].any() and not c("mlp.experts.hook_pre")[identity].any()
        weighted = c("mlp.hook_expert_outputs")
        assert torch.equal(weighted[identity], (x * c("mlp.hook_expert_weights")[..., None])[identity])
        assert (weighted.sum(2) - c("mlp.hook_routed_out")).abs().max() <= 1e-5
    # every slot sent to an identity expert: the real experts (NaN here) are never read, and the mixture adds
    # the weighted input
    experts = model.blocks[0].mlp.experts
    saved = experts.W_gate_up.detach().clone()
    to_identity = (lambda idx, hook: N_EXPERTS + torch.arange(idx.shape[-1]).expand_as(idx) % N_IDENTITY)  # noqa: E731
    names = ["blocks.0.mlp.hook_routed_out", "blocks.0.ln2.hook_normalized", "blocks.0.mlp.hook_expert_weights"]
    try:
        with torch.no_grad():
            experts.W_gate_up.fill_(float("nan"))
        with model.hooks(fwd_hooks=[("blocks.0.mlp.hook_expert_indices", to_identity)]):
            logits, c2 = model.run_with_cache(toks, names_filter=names)
    finally:
        with torch.no_grad():
            experts.W_gate_up.copy_(saved)
    assert torch.isfinite(logits).all()
    expected = c2[names[1]] * c2[names[2]].sum(-1, keepdim=True)
    assert (c2[names[0]] - expected).abs().max() <= 1e-5


def test_lora_scaling_of_the_queries_and_kv_latent(model, refs):
    """hook_q is transformers' q_b_proj output times sqrt(hidden_size / q_lora_rank); hook_kv_latent its normed
    kv latent times sqrt(hidden_size / kv_lora_rank)."""
    toks = tokens(shape=(1, 12))
    _, cache = model.run_with_cache(toks, names_filter=["blocks.1.attn_1.hook_q", "blocks.1.attn_1.hook_kv_latent"])
    seen = {}
    attn = refs("base").model.layers[1].self_attn[1]
    hooks = [attn.q_b_proj.register_forward_hook(lambda m, i, o: seen.__setitem__("q", o)),
             attn.kv_a_layernorm.register_forward_hook(lambda m, i, o: seen.__setitem__("kv", o))]
    try:
        with torch.no_grad():
            refs("base")(toks)
    finally:
        for h in hooks:
            h.remove()
    q = cache["blocks.1.attn_1.hook_q"].flatten(-2)
    assert (q - seen["q"] * (64 / 24) ** 0.5).abs().max() <= 1e-5
    assert (cache["blocks.1.attn_1.hook_kv_latent"] - seen["kv"] * (64 / 16) ** 0.5).abs().max() <= 1e-5


def test_left_padded_batch_matches_transformers(model, refs):
    toks, mask = left_padded(7, (3, 40), (0, 9, 4))
    report = compare(model, refs("base"), toks, mask)
    assert report.max_logit_diff <= 1e-5 and report.index_mismatches == 0, report


def test_cached_steps_equal_the_uncached_forward(model):
    """Each block's state holds both attentions' keys and values (transformers' cache layers 2L and 2L + 1)."""
    toks, mask = tokens(5, (3, 20)), torch.ones(3, 20, dtype=torch.long)
    mask[1, :4] = 0
    with torch.no_grad():
        full = model(toks, attention_mask=mask)
        cache = KVCache.for_model(model)
        parts = [model(toks[:, :8], attention_mask=mask[:, :8], past_kv_cache=cache)]
        parts += [model(toks[:, i : i + 1], past_kv_cache=cache) for i in range(8, 20)]
    assert (torch.cat(parts, dim=1) - full)[mask.bool()].abs().max() <= 1e-5
    for state in cache.layers:
        assert isinstance(state, SublayerStates) and [type(s) for s in state.parts] == [KVState, KVState]
        assert [s.length for s in state.parts] == [20, 20]


def test_greedy_generation_equals_transformers(model, refs):
    check_greedy_generation(model, refs("base"), tokens(4, (1, 12)), new=64)
    toks, mask = left_padded(8, (2, 10), (0, 3))
    check_greedy_generation(model, refs("base"), toks, mask, new=16)


@pytest.mark.parametrize("mode", ["cpu", "disk"])
def test_offload_is_the_resident_model_bit_for_bit_and_fetches_no_identity_expert(ckpts, model, mode, monkeypatch):
    reads = []
    read = ExpertReader.read
    monkeypatch.setattr(ExpertReader, "read", lambda self, layer, e: reads.append(e) or read(self, layer, e))
    toks = tokens(shape=(2, 30))
    resident = dict(model.run_with_cache(toks)[1].items())
    offloaded = HookedTransformer.from_pretrained(ckpts["hub_keys"], progress=False, expert_offload=mode,
                                                  expert_cache_bytes=0, expert_prefetch=False)
    got = dict(offloaded.run_with_cache(toks)[1].items())
    assert got.keys() == resident.keys()
    for name, t in resident.items():
        assert torch.equal(got[name], t), name
    assert max(reads, default=0) < N_EXPERTS


def _ep_worker(rank: int, world: int, port: int, path: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    model = HookedTransformer.from_pretrained(path, progress=False, expert_parallel=True)
    logits, cache = model.run_with_cache(tokens(shape=(2, 20)))
    torch.save({"logits": logits, "cache": dict(cache.items())}, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
def test_expert_parallel_is_the_resident_model_bit_for_bit(ckpts, tmp_path):
    from test_expert_parallel import free_port

    torch.set_num_threads(1)
    logits, cache = HookedTransformer.from_pretrained(ckpts["base"], progress=False).run_with_cache(tokens(shape=(2, 20)))
    mp.spawn(_ep_worker, args=(2, free_port(), str(ckpts["base"]), str(tmp_path)), nprocs=2, start_method="spawn")
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.equal(got["logits"], logits)
        for name, t in cache.items():
            assert torch.equal(got["cache"][name], t), (rank, name)


def test_what_identity_experts_cannot_do_is_refused_naming_them(ckpts):
    with pytest.raises(ValueError, match="fold_ln cannot fold .* identity experts"):
        HookedTransformer.from_pretrained(ckpts["base"], progress=False, fold_ln=True)
    with pytest.raises(ValueError, match="experts_backend='triton' computes real experts only.*2 identity experts"):
        HookedTransformer.from_pretrained(ckpts["base"], progress=False, experts_backend="triton")


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (dict(head_dim=16), "head_dim \\(16\\) must equal qk_rope_head_dim \\(8\\)"),
        (dict(num_key_value_heads=2), "num_key_value_heads \\(2\\) must equal num_attention_heads \\(4\\)"),
        (dict(router_bias=True), "router_bias"),
        (dict(moe_topk=7), "moe_topk = 7"),
        (dict(zero_expert_num=-1), "zero_expert_num = -1"),
        (dict(qk_head_dim=20), "qk_head_dim \\(20\\) must be qk_nope_head_dim \\+ qk_rope_head_dim \\(16\\)"),
    ],
)
def test_inconsistent_config_is_refused_naming_the_field(edit, match):
    raw = {**tiny_lc.longcat_flash_config().to_dict(), **edit}
    with pytest.raises(ValueError, match=match):
        HookedLongcatFlash.config_from_hf(raw)


@pytest.mark.parametrize("key", ["model.layers.1.mlps.1.down_proj.weight", "model.layers.0.self_attn.1.kv_b_proj.weight",
                                 "model.layers.1.mlp.router.classifier.weight"])
def test_a_missing_tensor_is_named(ckpts, tmp_path, key):
    folder = harness.copy_checkpoint(ckpts, tmp_path, "hub_keys")
    harness.rewrite_tensors(folder, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match=key.replace(".", "\\.")):
        HookedTransformer.from_pretrained(folder, progress=False)


def test_support_lists_the_sublayers_sites(model):
    rows = {r.name: r for r in model.support(print_table=False).rows}
    for site in ("blocks.L.hook_attn_1_out", "blocks.L.hook_dense_0_out", "blocks.L.hook_dense_1_out",
                 "blocks.L.hook_resid_mid_1", "blocks.L.hook_resid_mid_2"):
        assert site in rows, site
    assert rows["blocks.L.mlp.hook_router_logits"].shape == f"[batch, pos, {N_EXPERTS + N_IDENTITY}]"


def test_embedded_default_equals_transformers(tmp_path, monkeypatch):
    from moelens.defaults import default_checkpoint

    monkeypatch.setattr("moelens.defaults.cache_root", lambda: tmp_path)
    model = HookedTransformer.from_pretrained("tiny-longcat-flash", progress=False)
    assert type(model) is HookedLongcatFlash and model.cfg.n_identity_experts == 4
    ref = load_reference(tiny_lc.with_identity_rows(default_checkpoint("tiny-longcat-flash"), tmp_path / "hf"))
    report = compare(model, ref, torch.randint(0, 260, (2, 20), generator=torch.Generator().manual_seed(0)))
    assert report.max_logit_diff <= 1e-5 and report.index_mismatches == 0
    assert model.generate("Hi", max_new_tokens=3, stop_at_eos=False, do_sample=False)


def test_moelens_verify(ckpts, capsys):
    from moelens.cli import main

    assert main(["verify", str(ckpts["base"])]) == 0
    assert "tokens routed to a different expert set: 0" in capsys.readouterr().out


LONGCAT_FLASH_CHAT = flagship("longcat_flash", "meituan-longcat/LongCat-Flash-Chat")


def test_plan_at_full_size_leaves_out_the_identity_experts_rows_and_counts_both_caches():
    """transformers' fused gate_up_proj allocates gate / up rows for the 256 identity experts of each layer too,
    which no checkpoint stores and nothing reads: tests/test_flagships.py counts transformers' parameters less
    those (TRANSFORMERS_ONLY_PER_LAYER), here their shape."""
    p = plan(dict(LONGCAT_FLASH_CHAT), dtype="bfloat16", gpus=8, gpu_memory="141GB")
    hf = hf_weights(LONGCAT_FLASH_CHAT, torch.bfloat16)
    assert hf["model.layers.0.mlp.experts.gate_up_proj"].shape == (512 + 256, 2 * 2048, 6144)
    # both attentions of each block cache every head's key (128 + 64) and value (128): bf16, batch 1, seq 2048
    assert p.kv_cache["bytes"] == 28 * 2 * 2048 * 64 * (128 + 64 + 128) * 2


def test_fp8_checkpoint_loads_and_identity_experts_route_past_the_stored_ones(ckpts, tmp_path):
    """Block fp8 as the Hub's fp8 checkpoints store it (router and norms unquantized): dequantized at load it is
    the hand-dequantized float checkpoint bit for bit, and so is it with the experts kept stored
    (expert_storage="fp8": the routed real experts dequantized, the identity slots renumbered past them); that
    float checkpoint equals transformers' run of it."""
    from safetensors.torch import load_file, save_file
    from test_quantized_checkpoints import dense_copy, quantize_fp8

    block = (8, 8)
    folder = harness.copy_checkpoint(ckpts, tmp_path, "hub_keys")
    tensors = load_file(folder / "model.safetensors")
    for key in [k for k, v in tensors.items() if v.dim() == 2 and k.endswith(".weight") and "embed_tokens" not in k
                and not k.startswith("lm_head") and "router" not in k]:
        tensors[key], tensors[key + "_scale_inv"] = quantize_fp8(tensors[key], block)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    tiny_lc.tiny.edit_config(folder, quantization_config={"quant_method": "fp8", "weight_block_size": list(block),
                                                          "activation_scheme": "dynamic", "fmt": "e4m3"})
    dense = dense_copy(folder, block, tmp_path / "dense")
    toks = tokens(shape=(2, 30))
    expected = HookedTransformer.from_pretrained(dense, progress=False)(toks)
    assert torch.equal(HookedTransformer.from_pretrained(folder, progress=False)(toks), expected)
    stored = HookedTransformer.from_pretrained(folder, progress=False, expert_storage="fp8")
    assert torch.equal(stored(toks), expected)
    report = compare(HookedTransformer.from_pretrained(dense, progress=False),
                     load_reference(tiny_lc.with_identity_rows(dense, tmp_path / "hf")), toks)
    assert report.max_logit_diff <= 1e-5 and report.index_mismatches == 0


def test_plan_places_the_full_model_on_141_gb_gpus():
    """bfloat16 (1.12 TB): expert parallelism over 16 GPUs of 141 GB (32 experts per layer per rank), or a device
    map over 10; 8 do not hold it. The weights are too large for one device whatever the dtype."""
    eight = plan(dict(LONGCAT_FLASH_CHAT), dtype="bfloat16", gpus=8, gpu_memory="141GB")
    assert "expert_parallel" not in {o["kind"] for o in eight.placement["options"]}
    sixteen = plan(dict(LONGCAT_FLASH_CHAT), dtype="bfloat16", gpus=16, gpu_memory="141GB")
    kinds = {o["kind"] for o in sixteen.placement["options"]}
    assert {"expert_parallel", "device_map"} <= kinds and "one_device" not in kinds
