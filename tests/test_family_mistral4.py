"""Mistral Small 4 (HookedMistral4: latent attention whose queries are scaled by position, a softmax grouped router in
the model's dtype, a shared expert) against transformers' Mistral4ForCausalLM (transformers.models.mistral4:
AutoModelForCausalLM does not map mistral4) and, for the Hub's multimodal layout, Mistral3ForConditionalGeneration
itself; the generic suites compare every variant site by site. Here: what each variant is, the latent sites, bfloat16
bit for bit, the scaling by position (and that it matters), the multimodal checkpoint (keys under language_model.,
the vision tower and projector skipped, the multimodal config's head tying), the per-expert spelling, cached steps,
greedy generation, the refusals, verify and the embedded default."""

import json

import pytest
import torch
import transformers

import family_harness as harness
import tiny_mistral4 as tiny_m4
from family_harness import (
    References, build_checkpoints, check_bit_exact, check_greedy_generation, config_json, copy_checkpoint,
    left_padded, rewrite_tensors, stored_keys, tokens,
)
from moelens import HookedTransformer, KVCache
from moelens.cli import main
from moelens.loaders.errors import CheckpointError
from moelens.models.mistral4 import HookedMistral4, PositionScaledLatentAttention, SoftmaxGroupedTopK
from moelens.verify import compare

VARIANTS = [v for (_, v) in tiny_m4.VARIANTS]
PER_BLOCK = ("hook_resid_pre", "hook_attn_out", "hook_mlp_out", "hook_resid_post", "ln1.hook_normalized",
             "ln2.hook_normalized", "attn.hook_q", "attn.hook_kv_latent", "attn.hook_z")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    builders = {**tiny_m4.VARIANTS,
                # Mistral3Config's own default: the head tied to the embedding (no lm_head stored)
                ("mistral4", "multimodal_tied"): lambda d: tiny_m4.build_multimodal(d, seed=5, tie_word_embeddings=None),
                ("mistral4", "per_expert"): lambda d: tiny_m4.per_expert_keys(tiny_m4.build(d, seed=0))}
    return build_checkpoints(tmp_path_factory, "mistral4", builders)


@pytest.fixture(scope="module")
def models(checkpoints):
    return {v: HookedTransformer.from_pretrained(p, progress=False) for v, p in checkpoints.items()}


@pytest.fixture(scope="module")
def references(checkpoints):
    return References(checkpoints)


def load(path, **kwargs):
    return HookedTransformer.from_pretrained(path, progress=False, **kwargs)


def check_report(report, model):
    harness.check_report(report, model, lambda layer: PER_BLOCK, 1e-5, harness.MODEL_SITES)
    cfg, compared = model.cfg, {s.site for s in report.sites}
    for layer in range(cfg.n_layers):
        assert (f"blocks.{layer}.attn.hook_q_latent" in compared) == (cfg.q_lora_rank is not None)
        assert (f"blocks.{layer}.mlp.hook_post" in compared) == (not cfg.moe_layers[layer])
    for site in ("hook_router_logits", "hook_expert_weights", "hook_expert_indices", "hook_routed_out",
                 "shared_expert.hook_out"):
        assert sum(s.endswith(site) for s in compared) == sum(cfg.moe_layers), site


def test_variants_are_what_they_claim(models, checkpoints):
    base, fused, grouped, mm = (models[v].cfg for v in ("base", "fused", "grouped", "multimodal"))
    assert all(type(models[v]) is HookedMistral4 for v in models)
    assert base.moe_layers == (False, True, True) and fused.moe_layers == (True,) * 3
    assert grouped.moe_layers == (False, False, True, True)
    assert base.q_lora_rank == 24 and grouped.q_lora_rank is None
    assert base.rope.interleaved and not grouped.rope.interleaved
    # transformers' partial_rotary_factor (8 of the 20-wide head) is the 8 dims the latent attention rotates
    assert config_json(checkpoints["base"])["rope_parameters"]["partial_rotary_factor"] == 0.4
    assert base.d_rot == 8 and base.rope.partial_rotary_factor == 1.0 and base.rope.kind == "yarn"
    assert (base.query_scaling_beta, base.query_scaling_period) == (0.4, 16)
    assert (grouped.query_scaling_beta, grouped.query_scaling_period) == (0.3, 12)
    assert (base.n_group, base.norm_topk_prob, base.routed_scaling_factor) == (1, True, 1.0)
    assert (grouped.n_group, grouped.topk_group, grouped.norm_topk_prob, grouped.routed_scaling_factor) == (4, 2, False, 2.0)
    assert grouped.qkv_bias and grouped.o_bias and not base.qkv_bias
    assert base.key_prefix == "" and mm.key_prefix == "language_model."
    for variant in ("base", "multimodal"):
        model = models[variant]
        assert all(isinstance(b.attn, PositionScaledLatentAttention) for b in model.blocks)
        assert all(isinstance(b.mlp.router, SoftmaxGroupedTopK) for b in model.blocks if b.is_moe)
    assert len(list(checkpoints["sharded"].glob("*.safetensors"))) > 1
    assert "model.layers.1.mlp.experts.gate_up_proj" in stored_keys(checkpoints["base"])  # transformers' only layout


@pytest.mark.parametrize("variant", ["base", "grouped", "multimodal", "multimodal_tied"])
def test_float32_every_site(models, references, variant):
    model = models[variant]
    check_report(compare(model, references(variant), tokens(shape=(2, 60))), model)


@pytest.mark.parametrize("variant", ["grouped", "multimodal"])
def test_bfloat16_is_bit_exact(checkpoints, references, variant):
    """The router runs in the model's dtype, as transformers' (softmax, renormalisation and weights bfloat16)."""
    model = load(checkpoints[variant], dtype=torch.bfloat16)
    ref = references(variant, torch.bfloat16)
    for layer, block in enumerate(model.blocks):
        if block.is_moe:
            assert block.mlp.router.weight.dtype == ref.model.layers[layer].mlp.gate.weight.dtype == torch.bfloat16
    check_bit_exact(compare(model, ref, tokens(shape=(2, 60))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_multimodal_class_itself_on_text(checkpoints, dtype):
    """transformers' Mistral3ForConditionalGeneration on text (no image): its logits are moelens's, bit for bit; the
    reference the other tests use is its language model and head, so this holds the checkpoint's own class too."""
    folder = checkpoints["multimodal"]
    ref = transformers.Mistral3ForConditionalGeneration.from_pretrained(folder, dtype=dtype, attn_implementation="eager")
    toks = tokens(shape=(2, 60))
    with torch.no_grad():
        assert torch.equal(load(folder, dtype=dtype)(toks), ref.eval()(input_ids=toks).logits)


def test_multimodal_checkpoint_reads_the_text_model_only(checkpoints, models):
    folder = checkpoints["multimodal"]
    config, keys = config_json(folder), stored_keys(folder)
    assert config["model_type"] == "mistral3" and config["text_config"]["model_type"] == "mistral4"
    assert "language_model.model.layers.1.mlp.experts.gate_up_proj" in keys and "language_model.lm_head.weight" in keys
    skipped = [k for k in keys if not k.startswith("language_model.")]
    assert skipped and all(k.startswith(("vision_tower.", "multi_modal_projector.")) for k in skipped)
    model = models["multimodal"]
    # what is skipped is named: the parts' key prefixes in the site map, the image fields among the ignored ones
    assert HookedMistral4.site_map(model.cfg).ignored_prefixes == ("vision_tower.", "multi_modal_projector.")
    assert {"vision_config", "image_token_index", "spatial_merge_size"} <= set(model.cfg.fields_ignored)
    assert "text_config.hidden_size" in model.cfg.fields_read and "tie_word_embeddings" in model.cfg.fields_read
    assert not any("vision" in n or "projector" in n for n, _ in model.named_parameters())
    assert not model.cfg.tie_word_embeddings and models["multimodal_tied"].cfg.tie_word_embeddings
    assert "language_model.lm_head.weight" not in stored_keys(checkpoints["multimodal_tied"])


def test_multimodal_stray_and_missing_tensors_are_named(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints, tmp_path, "multimodal")
    rewrite_tensors(folder, lambda t: t.__setitem__("language_model.model.extra.weight", torch.zeros(2)))
    with pytest.raises(CheckpointError, match=r"language_model\.model\.extra\.weight"):
        load(folder)
    folder = copy_checkpoint(checkpoints, tmp_path / "missing", "multimodal")
    rewrite_tensors(folder, lambda t: t.pop("language_model.model.layers.2.mlp.gate.weight"))
    with pytest.raises(CheckpointError, match=r"missing 1 tensor.*language_model\.model\.layers\.2\.mlp\.gate\.weight"):
        load(folder)


def test_per_expert_spelling_loads_the_same_weights(checkpoints, models):
    assert "model.layers.1.mlp.experts.5.up_proj.weight" in stored_keys(checkpoints["per_expert"])
    toks = tokens(shape=(2, 40))
    with torch.no_grad():
        assert torch.equal(models["per_expert"](toks), models["base"](toks))


def test_queries_are_scaled_by_position_and_it_matters(models, references):
    """1 for the first period (16) positions, then 1 + beta * log(1 + floor(position / period)); a model without the
    scaling (beta 0) departs from transformers once the sequence passes the first period, and only there."""
    model = models["base"]
    attn = model.blocks[0].attn
    q = torch.ones(1, 50, 4, 20)
    scaled = attn.scale_queries(q, torch.arange(50)[None])
    expected = [1.0] * 16 + [1 + 0.4 * torch.log(torch.tensor(float(p // 16 + 1))).item() for p in range(16, 50)]
    assert torch.allclose(scaled[0, :, 0, 0], torch.tensor(expected))
    toks = tokens(shape=(2, 50))
    with torch.no_grad():
        expected_logits = references("base")(toks).logits
        for block in model.blocks:
            block.attn.beta = 0.0
        try:
            unscaled = model(toks)
        finally:
            for block in model.blocks:
                block.attn.beta = model.cfg.query_scaling_beta
    assert (unscaled[:, :16] - expected_logits[:, :16]).abs().max() <= 1e-5
    assert (unscaled[:, 16:] - expected_logits[:, 16:]).abs().max() > 1e-2


def test_cached_steps_match_the_uncached_forward(models):
    """Steps through the cache carry the position on: the scaling past the first period is the whole forward's."""
    model = models["base"]
    toks, mask = tokens(5, (3, 40)), torch.ones(3, 40, dtype=torch.long)
    mask[1, :3] = 0
    with torch.no_grad():
        full = model(toks, attention_mask=mask)
        cache = KVCache.for_model(model)
        parts = [model(toks[:, :10], attention_mask=mask[:, :10], past_kv_cache=cache)]
        parts += [model(toks[:, i : i + 1], past_kv_cache=cache) for i in range(10, 20)]
        parts.append(model(toks[:, 20:], past_kv_cache=cache))
    assert (torch.cat(parts, dim=1) - full)[mask.bool()].abs().max() <= 1e-5


@pytest.mark.parametrize("variant,padded", [("base", False), ("base", True), ("grouped", True), ("multimodal", False)])
def test_greedy_generation_matches_transformers(models, references, variant, padded):
    """Past the first scaling period (prompt 12 + 8 new > 16 in base), left padded too (transformers' generate then
    counts positions from each row's first real token, as moelens)."""
    prompt = left_padded(5, (3, 12), (0, 3, 1)) if padded else (tokens(5, (3, 12)), None)
    check_greedy_generation(models[variant], references[variant], *prompt, new=10)


def edited(checkpoints, tmp_path, variant="base", **changes):
    folder = copy_checkpoint(checkpoints, tmp_path, variant)
    config = config_json(folder)
    for key, value in changes.items():
        section, _, field = key.rpartition(".")
        target = config
        for part in filter(None, section.split(".")):
            target = target[part]
        if value is None:
            target.pop(field, None)
        else:
            target[field] = value
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("changes, message", [
    ({"rope_parameters.llama_4_scaling_beta": None}, r"rope_parameters lacks llama_4_scaling_beta: Mistral 4 scales"),
    ({"rope_parameters.original_max_position_embeddings": None},
     r"rope_parameters lacks original_max_position_embeddings"),
    ({"rope_parameters.partial_rotary_factor": 1.0},
     r"partial_rotary_factor 1.0: the rotary must turn the qk_rope_head_dim \(8\) of the head's .* \(20\) dims"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1000.0, "llama_4_scaling_beta": 0.1,
                          "original_max_position_embeddings": 16}}, r"rope_type 'default': transformers' Mistral 4"),
    ({"n_group": 3}, r"n_routed_experts \(8\) must be a multiple of n_group \(3\)"),
    ({"num_key_value_heads": 2}, r"num_key_value_heads \(2\) must equal num_attention_heads \(4\)"),
], ids=["no_beta", "no_period", "partial_rotary", "default_rope", "groups", "kv_heads"])
def test_config_refusals_name_the_field(checkpoints, tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        load(edited(checkpoints, tmp_path, **changes))


def test_multimodal_config_refusals(checkpoints, tmp_path):
    with pytest.raises(ValueError, match=r"text_config.model_type 'mistral'.*Mistral Small 3's text model is dense"):
        load(edited(checkpoints, tmp_path / "a", "multimodal", **{"text_config.model_type": "mistral"}))
    with pytest.raises(ValueError, match=r"'mistral3' \(the multimodal checkpoint\) needs its text model's text_config"):
        load(edited(checkpoints, tmp_path / "b", "multimodal", text_config=None))
    with pytest.raises(ValueError, match=r"text_config.rope_parameters lacks llama_4_scaling_beta|rope_parameters lacks"):
        load(edited(checkpoints, tmp_path / "c", "multimodal", **{"text_config.rope_parameters.llama_4_scaling_beta": None}))


def test_support_lists_the_latent_sites(models):
    names = models["base"].support(print_table=False).names()
    assert {"blocks.L.attn.hook_q_latent", "blocks.L.attn.hook_kv_latent", "blocks.L.attn.hook_rot_q",
            "blocks.L.mlp.hook_shared_out"} <= set(names)
    assert "blocks.L.mlp.hook_choice_scores" not in names  # no correction bias


def test_verify_command_and_embedded_default(checkpoints, tmp_path, monkeypatch, capsys):
    """verify builds transformers' Mistral4ForCausalLM itself, and for the multimodal checkpoint its text model."""
    monkeypatch.setattr("moelens.defaults.cache_root", lambda: tmp_path)
    model = HookedTransformer.from_pretrained("tiny-mistral4", progress=False)
    assert type(model) is HookedMistral4 and model.cfg.n_experts == 16 and model.cfg.query_scaling_period == 256
    for name in ("tiny-mistral4", str(checkpoints["multimodal"])):
        assert main(["verify", name]) == 0
        out = capsys.readouterr().out
        assert "float32: OK" in out and "bfloat16: OK" in out
