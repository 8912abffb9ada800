"""Qwen3.5-MoE (HookedQwen3_5Moe) against transformers' Qwen3_5MoeForCausalLM and, for the Hub's multimodal
spelling, Qwen3_5MoeForConditionalGeneration: the hybrid layers (Gated DeltaNet with separate projections, gated
full attention) site by site in float32 and bit for bit in bfloat16, the multimodal rotary on text, left padding,
chunked prefill against token-by-token decode, greedy generation, both config and key spellings, per-expert and
fused experts, the fields transformers ignores, bad checkpoints and configs, offload and expert parallelism bit for
bit, the plan at full size (Qwen3.5-35B-A3B, Qwen3.5-397B-A17B), support(), verify and the embedded default."""

import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers
import family_harness as harness
import tiny
import tiny_qwen3_5_moe as tiny_q35
from flagships import flagship
from family_harness import (
    MODEL_SITES, References, build_checkpoints, check_bit_exact, check_greedy_generation, copy_checkpoint,
    left_padded, rewrite_tensors, tokens,
)

from moelens import CheckpointError, HookedTransformer
from moelens.families import FAMILIES
from moelens.kv_cache import KVCache
from moelens.models.components.gated_attention import OutputGatedAttention
from moelens.models.mixers.gated_deltanet import SeparateProjectionsGatedDeltaNet
from moelens.models.qwen3_5_moe import HookedQwen3_5Moe
from moelens.plan import plan
from moelens.state import RecurrentState
from moelens.verify import compare, load_reference

# every variant, the five-layer one (two full attention layers before Gated DeltaNet layers) too, within 1e-5 of
# transformers' eager attention at every site (0 measured; transformers' own eager and SDPA differ by 7.6e-5 there)
VARIANTS = [v for (_, v) in tiny_q35.FAMILY_VARIANTS]
LINEAR_SITES = ("hook_resid_pre", "ln1.hook_normalized", "hook_attn_out", "ln2.hook_normalized", "hook_mlp_out",
                "hook_resid_post", "mlp.hook_router_logits", "mlp.hook_expert_weights", "mlp.hook_expert_indices",
                "mlp.hook_routed_out")
ATTENTION_SITES = LINEAR_SITES + ("attn.hook_k", "attn.hook_v", "attn.hook_z")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return build_checkpoints(tmp_path_factory, "qwen3_5_moe", tiny_q35.FAMILY_VARIANTS)


@pytest.fixture(scope="module")
def refs(ckpts):
    return References(ckpts)


def load(path, **kwargs):
    return HookedTransformer.from_pretrained(path, progress=False, **kwargs)


def block_sites(model):
    return lambda layer: ATTENTION_SITES if model.cfg.layer_types[layer] == "full_attention" else LINEAR_SITES


def multimodal_reference(folder, dtype=torch.float32):
    """transformers' multimodal model itself (its 3-D text positions and interleaved rotary), not the text model
    AutoModelForCausalLM makes of the checkpoint."""
    return transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(
        folder, dtype=dtype, attn_implementation="eager").eval()


# ---- equivalence ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_float32_every_site(ckpts, refs, variant):
    model = load(ckpts[variant])
    assert type(model) is HookedQwen3_5Moe
    harness.check_report(compare(model, refs(variant), tokens(shape=(2, 80))), model, block_sites(model), 1e-5, MODEL_SITES)


@pytest.mark.parametrize("variant", VARIANTS)
def test_bfloat16_is_bit_exact(ckpts, refs, variant):
    model = load(ckpts[variant], dtype=torch.bfloat16)
    check_bit_exact(compare(model, refs(variant, torch.bfloat16), tokens(shape=(2, 80))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_multimodal_model_on_text_is_the_1d_rotary(ckpts, dtype):
    """transformers' multimodal model (3-D positions T, H, W, their frequencies interleaved by mrope_section)
    on text gives each axis the token's position: its logits equal moelens's (1-D rotary) bit for bit."""
    model, ref = load(ckpts["multimodal"], dtype=dtype), multimodal_reference(ckpts["multimodal"], dtype)
    toks = tokens(shape=(2, 80))
    with torch.no_grad():
        assert torch.equal(model(toks), ref(input_ids=toks).logits)


def test_the_rotary_is_transformers_on_text_and_the_sections_matter_only_off_it(ckpts, refs):
    """transformers' rotary module with the three axes' positions equal gives moelens's cos and sin; with the
    H and W positions moved, the frequencies mrope_section gives those axes change (the sections are real, and
    text never reaches them)."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextRotaryEmbedding

    model = load(ckpts["base"])
    rotary = Qwen3_5MoeTextRotaryEmbedding(refs("base").config)
    pos = torch.arange(50)[None]
    x = torch.zeros(1, 50, 64)
    cos, sin = rotary(x, pos[None].expand(3, 1, 50))
    ours_cos, ours_sin = model.rotary(pos, torch.float32)  # [batch pos d_rot]
    assert torch.equal(cos, ours_cos) and torch.equal(sin, ours_sin)
    moved = torch.stack([pos, pos + 7, pos + 7])
    cos_moved, _ = rotary(x, moved)
    changed = (cos_moved[0] != cos[0]).any(0)
    # d_rot 8: 4 frequencies (twice), T on 0 and 3, H on 1, W on 2 (mrope_section [2, 1, 1] interleaved)
    assert changed.tolist() == [False, True, True, False] * 2


def test_the_layers_are_what_the_config_says(ckpts):
    base = load(ckpts["base"])
    assert [type(b.token_mixer) for b in base.blocks] == [SeparateProjectionsGatedDeltaNet] * 3 + [OutputGatedAttention]
    assert all(b.is_moe for b in base.blocks) and base.cfg.d_mlp == 0 and base.cfg.norm_topk_prob
    assert base.cfg.d_rot == 8 and base.cfg.top_k == 3 and not base.cfg.nested
    interval = load(ckpts["interval"])
    assert interval.cfg.layer_types == ("linear_attention", "full_attention") * 2 + ("linear_attention",)
    assert "rope_parameters.mrope_section" in base.cfg.fields_ignored


def test_left_padded_batch_matches_transformers_padded_run(ckpts, refs):
    """transformers zeroes padded positions' inputs to the linear layers and masks them in attention (its
    positions count the padding; the rotary is relative, so that changes only rounding); moelens does the same."""
    model = load(ckpts["base"])
    toks, mask = left_padded(7, (3, 70), (0, 9, 30))
    report = compare(model, refs("base"), toks, mask)
    assert report.max_logit_diff <= 1e-5 and report.index_mismatches == 0, report


def test_chunked_prefill_then_recurrent_decode_equals_transformers(ckpts, refs):
    """A 40-token prefill then 30 one-token steps, and a 40-token prefill then one 30-token step, each against
    transformers with its own cache; and the gap between the stepped and the whole forward is transformers' own.

    transformers is run with its parameters copied to fresh (aligned) memory: on a one-token step the shared
    expert gate is a [2 x 64] @ [64 x 1] product, which the CPU BLAS rounds by where the weight lies in memory
    (transformers' loaded weight lies 40 bytes off a 64-byte line), and the Gated DeltaNet layers amplify that
    last bit: transformers' stepped logits as loaded differ from its own with the copied weights by 7.2e-5 (measured
    on one thread).
    moelens is within 1e-5 of the latter, and within that noise of the former."""
    model, ref = load(ckpts["base"]), refs("base")
    copied = load_reference(ckpts["base"])
    for p in copied.parameters():
        p.data = p.data.clone()
    toks = tokens(11, (2, 70))

    def hf_run(hf, chunks):
        cache = transformers.DynamicCache(config=hf.config)
        return torch.cat([hf(toks[:, a:b], past_key_values=cache, use_cache=True).logits for a, b in chunks], dim=1)

    def our_run(chunks):
        cache = KVCache.for_model(model)
        out = torch.cat([model(toks[:, a:b], past_kv_cache=cache) for a, b in chunks], dim=1)
        assert isinstance(cache.layers[0], RecurrentState) and cache.layers[0].length == 70
        return out

    stepped = [(0, 40)] + [(i, i + 1) for i in range(40, 70)]
    with torch.no_grad():
        whole, hf_whole = model(toks), copied(toks).logits
        ours, theirs, theirs_as_loaded = our_run(stepped), hf_run(copied, stepped), hf_run(ref, stepped)
        continued, hf_continued = our_run([(0, 40), (40, 70)]), hf_run(copied, [(0, 40), (40, 70)])
    assert (whole - hf_whole).abs().max() <= 1e-5
    assert (ours - theirs).abs().max() <= 1e-5
    assert (continued - hf_continued).abs().max() <= 1e-5
    noise = float((theirs_as_loaded - theirs).abs().max())
    assert (ours - theirs_as_loaded).abs().max() <= max(1e-5, 2 * noise), noise
    gap, hf_gap = float((ours - whole).abs().max()), float((theirs - hf_whole).abs().max())
    assert abs(gap - hf_gap) <= 1e-5, (gap, hf_gap)


def test_greedy_generation_equals_transformers(ckpts, refs):
    model = load(ckpts["base"])
    check_greedy_generation(model, refs("base"), tokens(4, (1, 12)), new=64)
    toks, mask = left_padded(8, (2, 10), (0, 3))
    check_greedy_generation(model, refs("base"), toks, mask, new=16)


def test_greedy_generation_equals_the_multimodal_models(ckpts):
    """The Hub's spelling against transformers' multimodal model's generate (its 3-D positions from the cache)."""
    check_greedy_generation(load(ckpts["multimodal"]), multimodal_reference(ckpts["multimodal"]), tokens(4, (1, 12)), new=64)


# ---- spellings and fields ------------------------------------------------------------------------------------


def test_both_model_type_spellings_register():
    assert FAMILIES["qwen3_5_moe_text"] is FAMILIES["qwen3_5_moe"] is HookedQwen3_5Moe


def test_nested_checkpoint_is_read_under_language_model(ckpts):
    model = load(ckpts["multimodal"])
    assert model.cfg.nested and "vision_config" in model.cfg.fields_ignored
    assert "text_config.num_experts" in model.cfg.fields_read
    keys = {k for w in HookedQwen3_5Moe.site_map(model.cfg).weight_entries() for k in w.keys}
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in keys and "lm_head.weight" in keys


def test_per_expert_and_fused_keys_load_the_same(ckpts, tmp_path):
    per = load(ckpts["base"]).state_dict()
    fused = load(tiny.fused(copy_checkpoint(ckpts, tmp_path))).state_dict()
    assert per.keys() == fused.keys() and all(torch.equal(per[n], fused[n]) for n in per)


def test_skipped_and_unknown_keys(ckpts, tmp_path):
    """The vision tower (model.visual.*) and the multi-token-prediction weights (mtp.*) are skipped, as in
    transformers; any other unknown key is refused by name."""
    folder = copy_checkpoint(ckpts, tmp_path, "multimodal")
    rewrite_tensors(folder, lambda t: t.update({"mtp.fc.weight": torch.zeros(2, 2)}))
    assert load(folder).cfg.nested
    rewrite_tensors(folder, lambda t: t.update({"model.language_model.extra.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match="model.language_model.extra.weight"):
        load(folder)


def test_fields_transformers_ignores_are_ignored(ckpts, refs, tmp_path):
    """transformers' Qwen3.5-MoE has a mixture on every layer and always renormalises the top-k: a config.json
    with norm_topk_prob false, mlp_only_layers, decoder_sparse_step and intermediate_size runs the same model in
    transformers and in moelens, and moelens lists those fields as ignored."""
    folder = copy_checkpoint(ckpts, tmp_path)
    tiny.edit_config(folder, norm_topk_prob=False, mlp_only_layers=[1], decoder_sparse_step=2, intermediate_size=80)
    model = load(folder)
    assert all(b.is_moe for b in model.blocks) and model.cfg.norm_topk_prob
    assert {"norm_topk_prob", "mlp_only_layers", "decoder_sparse_step", "intermediate_size"} <= set(model.cfg.fields_ignored)
    ref = load_reference(folder)
    report = compare(model, ref, tokens())
    assert report.max_logit_diff == 0.0 and report.index_mismatches == 0
    with torch.no_grad():
        assert torch.equal(ref(tokens()).logits, refs("base")(tokens()).logits)


def test_bad_checkpoints_name_the_family_keys(ckpts, tmp_path):
    folder = copy_checkpoint(ckpts, tmp_path)
    rewrite_tensors(folder, lambda t: t.pop("model.layers.1.linear_attn.in_proj_b.weight"))
    with pytest.raises(CheckpointError, match="model.layers.1.linear_attn.in_proj_b.weight"):
        load(folder)
    nested = copy_checkpoint(ckpts, tmp_path, "multimodal")

    def shrink(t):
        key = "model.language_model.layers.2.linear_attn.in_proj_qkv.weight"
        t[key] = t[key][:-1].contiguous()

    rewrite_tensors(nested, shrink)
    with pytest.raises(CheckpointError, match="model.language_model.layers.2.linear_attn.in_proj_qkv.weight"):
        load(nested)


@pytest.mark.parametrize(("edit", "match"), [
    (dict(layer_types=["linear_attention"] * 3), "layer_types has 3 entries, expected one per layer \\(4\\)"),
    (dict(layer_types=["linear_attention"] * 3 + ["sliding_attention"]), "layer_types: unknown layer kinds"),
    (dict(full_attention_interval=0, layer_types=None), "full_attention_interval = 0"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok = 9"),
    (dict(linear_num_value_heads=3), "linear_n_value_heads \\(3\\) must be a multiple of linear_n_key_heads"),
])
def test_inconsistent_fields_are_refused_naming_the_field(edit, match):
    raw = {**tiny_q35.text_config().to_dict(), **edit}
    with pytest.raises(ValueError, match=match):
        HookedQwen3_5Moe.build(HookedQwen3_5Moe.config_from_hf(raw))


def test_nested_config_refusals_name_the_section():
    with pytest.raises(ValueError, match="text_config"):
        HookedQwen3_5Moe.config_from_hf({"model_type": "qwen3_5_moe"})
    text = {**tiny_q35.text_config().to_dict(), "num_experts": 0}
    with pytest.raises(ValueError, match="text_config.num_experts = 0"):
        HookedQwen3_5Moe.config_from_hf({"model_type": "qwen3_5_moe", "text_config": text})


# ---- offload, expert parallelism ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["cpu", "disk"])
def test_offloaded_experts_are_the_resident_model_bit_for_bit(ckpts, mode):
    resident = load(ckpts["base"])
    offloaded = load(ckpts["base"], expert_offload=mode, expert_cache_bytes=0, expert_prefetch=False)
    toks = tokens(shape=(2, 30))
    with torch.no_grad():
        assert torch.equal(offloaded(toks), resident(toks))
    prompt = tokens(4, (1, 8))
    assert torch.equal(offloaded.generate(prompt, max_new_tokens=8, do_sample=False, stop_at_eos=False),
                       resident.generate(prompt, max_new_tokens=8, do_sample=False, stop_at_eos=False))


EP_TOKENS = tokens(3, (2, 20))


def ep_worker(rank: int, world: int, port: int, path: str, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    model = load(path, expert_parallel=True)
    with torch.no_grad():
        out = {"logits": model(EP_TOKENS),
               "generated": model.generate(EP_TOKENS[:, :6], max_new_tokens=5, do_sample=False, stop_at_eos=False)}
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
def test_expert_parallel_ranks_equal_one_process(ckpts, tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks run on one thread each; CPU GEMMs round by thread count
    try:
        model = load(ckpts["base"])
        with torch.no_grad():
            expected = {"logits": model(EP_TOKENS),
                        "generated": model.generate(EP_TOKENS[:, :6], max_new_tokens=5, do_sample=False, stop_at_eos=False)}
    finally:
        torch.set_num_threads(threads)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(ep_worker, args=(2, port, str(ckpts["base"]), str(tmp_path)), nprocs=2, start_method="spawn")
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.equal(got["logits"], expected["logits"]) and torch.equal(got["generated"], expected["generated"])


# ---- plan at full size, support, verify, the embedded default -------------------------------------------------

# the text_config of each (the fields that size the model)
QWEN35_35B = flagship("qwen3_5_moe", "Qwen/Qwen3.5-35B-A3B")
QWEN35_397B = flagship("qwen3_5_moe", "Qwen/Qwen3.5-397B-A17B")


@pytest.mark.parametrize("config", [QWEN35_35B, QWEN35_397B])
def test_plan_reads_the_hub_nesting(config):
    """(The text model's counts against transformers' and the published totals: tests/test_flagships.py.)"""
    p = plan(dict(config), dtype="bfloat16", gpus=1, gpu_memory="141GB", cpu_memory="2TB")
    nested = {"model_type": "qwen3_5_moe", "text_config": dict(config), "vision_config": {}}
    assert plan(nested, dtype="bfloat16", cpu_memory="2TB").parameters == p.parameters


def test_plan_places_35b_on_one_gpu_and_not_397b():
    """bfloat16: Qwen3.5-35B-A3B (about 69 GB) fits one 141 GB GPU; 397B-A17B (about 790 GB) does not, and fits a
    node of eight."""
    small = plan(dict(QWEN35_35B), dtype="bfloat16", gpus=1, gpu_memory="141GB", cpu_memory="2TB")
    assert small.placement["recommended"]["kind"] == "one_device"
    big = plan(dict(QWEN35_397B), dtype="bfloat16", gpus=1, gpu_memory="141GB", cpu_memory="2TB")
    assert "one_device" not in [o["kind"] for o in big.placement["options"]]
    node = plan(dict(QWEN35_397B), dtype="bfloat16", gpus=8, gpu_memory="141GB", cpu_memory="2TB")
    assert node.placement["recommended"]["kind"] == "device_map"


def test_plan_counts_the_attention_layers_keys_and_the_linear_layers_recurrent_state():
    """35B-A3B: 10 full-attention layers cache 2 x 2 kv heads x 256 values per token; 30 Gated DeltaNet layers a
    convolution window and a recurrent state per sequence."""
    p = plan(dict(QWEN35_35B), dtype="bfloat16", gpus=1, gpu_memory="141GB", batch=1, seq=2048)
    per_token = 10 * 2 * 2 * 256  # bfloat16
    conv_window = (2 * 16 * 128 + 32 * 128) * 4  # bfloat16
    state = 32 * 128 * 128  # float32: 4 bytes a value
    assert p.kv_cache["bytes"] == (2048 * per_token + 30 * conv_window) * 2 + 30 * state * 4


def test_support_names_the_mixers_and_the_fields_read(ckpts):
    table = load(ckpts["base"]).support(print_table=False)
    rows = {r.name: r for r in table.rows}
    assert "causal convolution" in rows["blocks.L.mixer.hook_q"].meaning
    assert rows["blocks.L.hook_attn_out"].reference == "model.layers.L.linear_attn"
    assert rows["blocks.L.attn.hook_z"].reference.startswith("model.layers.L.self_attn.o_proj")
    assert rows["blocks.L.mlp.hook_shared_gate"].reference == "model.layers.L.mlp.shared_expert_gate"
    fields = set(table.config_fields)
    assert {"linear_num_value_heads", "layer_types", "shared_expert_intermediate_size"} <= fields
    assert not fields & {"norm_topk_prob", "mlp_only_layers", "decoder_sparse_step", "intermediate_size"}


def test_embedded_default_verify_and_generate(tmp_path, monkeypatch):
    """The embedded default against transformers: on one thread bit for bit; on the suite's two threads within
    transformers' own difference between one and two threads (the CPU GEMMs split their sums by thread count,
    and the Gated DeltaNet layers amplify the last bit: 6.1e-5 on some inputs); and by `moelens verify` in a
    process of its own (one thread)."""
    from moelens.defaults import default_checkpoint

    monkeypatch.setattr("moelens.defaults.cache_root", lambda: tmp_path)
    model = HookedTransformer.from_pretrained("tiny-qwen3.5-moe", progress=False)
    assert type(model) is HookedQwen3_5Moe and model.cfg.d_vocab == 260
    assert model.generate("Hi", max_new_tokens=3, stop_at_eos=False, do_sample=False)
    reference = load_reference(default_checkpoint("tiny-qwen3.5-moe"))
    threads = torch.get_num_threads()
    for seed in range(4):
        toks = torch.randint(0, 260, (2, 16), generator=torch.Generator().manual_seed(seed))
        try:
            torch.set_num_threads(1)
            one = compare(model, reference, toks)
            with torch.no_grad():
                hf_one = reference(toks).logits
        finally:
            torch.set_num_threads(threads)
        assert one.max_logit_diff == 0.0 and one.index_mismatches == 0, one
        with torch.no_grad():
            noise = float((reference(toks).logits - hf_one).abs().max())
        report = compare(model, reference, toks)
        assert report.max_logit_diff <= max(1e-5, noise) and report.index_mismatches == 0, (report, noise)
    env = dict(os.environ, MOELENS_CACHE=str(tmp_path), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "moelens", "verify", "tiny-qwen3.5-moe"], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "float32: OK" in run.stdout and "bfloat16: OK" in run.stdout


def test_fp8_checkpoint_equals_transformers_dequantized(tmp_path):
    """Qwen publishes Qwen3.5-35B-A3B-FP8 (128 x 128 blocks): the tiny checkpoint in that format loads as
    transformers' dequantizing load reads it, float32 within 1e-5 and bfloat16 bit for bit."""
    from test_quantized_checkpoints import assert_params_equal, check_logits, quantize_folder, transformers_dequantized

    folder = tiny_q35.build_text(tmp_path / "fp8", seed=5)
    quantize_folder(folder, (128, 128))
    for dtype in (torch.float32, torch.bfloat16):
        hf = transformers_dequantized(folder, dtype)
        model = load(folder, dtype=dtype)
        assert_params_equal(model, hf.state_dict())
        check_logits(model, hf, dtype)
