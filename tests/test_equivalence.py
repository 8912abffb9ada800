"""Every family against transformers' own forward on the same weights, logit for logit and hook for hook."""

import json

import pytest
import torch
from conftest import FAMILIES, VARIANTS

from moelens import FAMILIES as MODEL_CLASSES
from moelens import HookedTransformer
from moelens.verify import compare, load_reference


def check_report(report, model, tol=1e-5):
    assert report.max_logit_diff <= tol, report
    compared = {s.site for s in report.sites}
    for layer, block in enumerate(model.blocks):  # every block's residual sites were compared
        for site in ("hook_resid_pre", *(sub.out_hook for sub in block.sublayers()), "hook_resid_post"):
            assert f"blocks.{layer}.{site}" in compared
    n_moe = sum(model.cfg.moe_layers)
    for site in ("hook_router_logits", "hook_expert_weights", "hook_expert_indices", "hook_routed_out"):
        assert sum(s.endswith(site) for s in compared) == n_moe, site
    n_shared = sum(p.kind == "shared" for b in model.blocks if b.has_ffn for p in b.mlp.parts())
    assert sum(s.endswith("shared_expert.hook_out") for s in compared) == n_shared
    for site in report.sites:
        assert site.max_abs_diff <= tol, site
    assert report.index_mismatches == 0


@pytest.mark.parametrize("family,variant", list(VARIANTS))
def test_float32(checkpoints, family, variant):
    path = checkpoints[family, variant]
    model = HookedTransformer.from_pretrained(path, progress=False)
    assert type(model) is MODEL_CLASSES[family]
    tokens = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(3))
    check_report(compare(model, load_reference(path), tokens), model)


def reference_noise(ref, tokens, mask=None) -> float:
    """transformers' own float32 noise on these tokens: how far its logits for each row of the batch are from
    its logits for that row alone (pads dropped). Zero up to rounding for attention; the chunked linear-attention
    form (Qwen3-Next) sums each chunk in an order that depends on where the row's chunks start and on the
    threads, so there it is about 1e-5 on the tiny models."""
    mask = torch.ones_like(tokens) if mask is None else mask
    with torch.no_grad():
        batch = ref(tokens, attention_mask=mask).logits
        return max(
            (batch[row][mask[row].bool()] - ref(tokens[row : row + 1, mask[row].bool()]).logits[0]).abs().max().item()
            for row in range(tokens.shape[0])
        )


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_fused_attention(checkpoints, family, tokens):
    """The opt-in SDPA path sums in another order than transformers' eager attention, so it is not bit for bit:
    its float32 logits must be within 1e-5 of transformers' (or of twice transformers' own noise where that is
    larger: Qwen3-Next's chunked linear attention with two threads) and every token must choose the same experts (inner sites differ by a few ulps of their
    magnitude, which the residual stream grows)."""
    path = checkpoints[family, "base"]
    model = HookedTransformer.from_pretrained(path, progress=False)
    model.set_attention_backend("fused")
    ref = load_reference(path)
    report = compare(model, ref, tokens)
    assert report.max_logit_diff <= max(1e-5, 2 * reference_noise(ref, tokens)) and report.index_mismatches == 0, report


# gpt-oss's routed GEMM reads transformers' stored [E, d_model, 2*d_expert] layout there, moelens's [E, 2*d_expert,
# d_model] here, which can round a routed output differently in its last bfloat16 bit: its own module
# (test_family_gpt_oss) checks routing and logits bit for bit and every other site exactly
BF16_EXACT = [k for k in VARIANTS if k[1] in ("base", "norm_topk", "renormalised") and k[0] != "gpt_oss"]


def reference_router_weight(ref_layer) -> torch.Tensor:
    """The router weight of one of transformers' decoder layers, wherever the family keeps it."""
    mlp = getattr(ref_layer, "mlp", None)
    router = getattr(mlp, "router", None)
    if hasattr(ref_layer, "ffn"):  # DBRX: ffn.router.layer
        gate = ref_layer.ffn.router.layer
    elif router is not None:  # LongCat-Flash: mlp.router.classifier; AFMoE: mlp.router.gate; Phi-3.5-MoE: mlp.router
        gate = router.classifier if hasattr(router, "classifier") else (
            router.gate if isinstance(getattr(router, "gate", None), torch.nn.Linear) else router)
    elif mlp is not None:
        gate = mlp.gate
    elif hasattr(ref_layer, "mixer"):  # Nemotron-H: the layer's mixer is the mixture
        gate = ref_layer.mixer.gate
    elif hasattr(ref_layer, "block_sparse_moe"):  # Granite
        gate = ref_layer.block_sparse_moe.router
    else:  # Llama 4: feed_forward.router; LFM2-MoE: feed_forward.gate
        feed_forward = ref_layer.feed_forward
        gate = feed_forward.router if hasattr(feed_forward, "router") else feed_forward.gate
    return gate.wg.weight if hasattr(gate, "wg") else gate.weight


@pytest.mark.parametrize("family,variant", BF16_EXACT)
def test_bfloat16_is_bit_exact(checkpoints, family, variant):
    """Eager attention runs the reference's ops in the reference's order: bf16 results are identical,
    the routers stay float32 where transformers keeps them float32."""
    path = checkpoints[family, variant]
    model = HookedTransformer.from_pretrained(path, dtype=torch.bfloat16, progress=False)
    ref = load_reference(path, torch.bfloat16)
    for layer, block in enumerate(model.blocks):
        if block.is_moe:
            # DBRX's blocks are transformer.blocks, its router ffn.router.layer
            ref_layer = ref.model.layers[layer] if hasattr(ref, "model") else ref.transformer.blocks[layer]
            ref_weight = reference_router_weight(ref_layer)
            assert block.mlp.router.weight.dtype == ref_weight.dtype
    tokens = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(3))
    report = compare(model, ref, tokens)
    assert report.index_mismatches == 0
    assert report.max_logit_diff == 0.0, report
    assert all(s.max_abs_diff == 0.0 for s in report.sites), report


def test_bfloat16_fused_attention_is_as_close_as_the_reference_itself(qwen_path):
    """SDPA in bf16 rounds differently; its error against float32 is that of transformers' own bf16 run."""
    ref32, ref16 = load_reference(qwen_path), load_reference(qwen_path, torch.bfloat16)
    model = HookedTransformer.from_pretrained(qwen_path, dtype=torch.bfloat16, progress=False)
    model.set_attention_backend("fused")
    ours_err, ref_err = [], []
    for seed in range(4):
        toks = torch.randint(0, 96, (2, 48), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            exact = ref32(toks).logits
            ref_err.append((ref16(toks).logits.float() - exact).abs().mean())
            ours_err.append((model(toks).float() - exact).abs().mean())
    assert torch.stack(ours_err).mean() <= 1.5 * torch.stack(ref_err).mean()


# transformers' Llama 4 is not left-pad invariant (its NoPE layers' attention temperature counts the padding):
# moelens matches its padded run instead (test_family_llama4_text checks both).
NOT_PAD_INVARIANT = {"llama4_text"}
# Nor, where the indexer's top-k picks a padded key, are DeepSeek-V3.2's and GLM-5's sparse attention: it ranks
# padded keys too (masked afterwards), so a padded row's query may see fewer real keys than alone (transformers'
# own padded rows differ from the rows alone by 0.96 and 2.7 in the logits on the tiny DeepSeek-V3.2); moelens
# matches transformers' padded run (checked below).
SELECTION_SEES_PADDING = {"deepseek_v32", "glm_moe_dsa"}


@pytest.mark.parametrize("family", FAMILIES)
def test_left_padding_rows_equal_rows_alone(checkpoints, family):
    path = checkpoints[family, "base"]
    model = HookedTransformer.from_pretrained(path, progress=False)
    tokens = torch.randint(0, 96, (3, 24), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(tokens)
    starts = [4, 9, 0]
    for row, start in enumerate(starts):
        mask[row, :start] = 0
    ref = load_reference(path)
    # the chunked linear-attention form's own noise (Qwen3-Next: padding shifts where the chunks start; its
    # padded inputs are zeroed, so the state is the row's alone); twice transformers' own, measured here
    tol = max(1e-5, 2 * reference_noise(ref, tokens, mask)) if family not in NOT_PAD_INVARIANT | SELECTION_SEES_PADDING else 1e-5
    with torch.no_grad():
        batch = model(tokens, attention_mask=mask)
        for row, start in enumerate(starts):
            alone = model(tokens[row : row + 1, start:])
            if family in SELECTION_SEES_PADDING and start:
                continue
            assert ((batch[row, start:] - alone[0]).abs().max() <= tol) == (family not in NOT_PAD_INVARIANT or start == 0)
    report = compare(model, ref, tokens, mask)
    assert report.max_logit_diff <= 1e-5 and report.index_mismatches == 0


def test_variants_are_what_they_claim(checkpoints):
    cfg = {k: HookedTransformer.from_pretrained(p, progress=False).cfg for k, p in checkpoints.items()}
    q = lambda v: cfg["qwen2_moe", v]  # noqa: E731
    assert q("base").n_kv_heads < q("base").n_heads and q("plain_attn").n_kv_heads == q("plain_attn").n_heads
    assert q("norm_topk").norm_topk_prob and not q("base").norm_topk_prob
    assert q("dense_block").moe_layers == (True, False, True)
    assert q("tied").tie_word_embeddings and not q("base").tie_word_embeddings
    hy = cfg["hunyuan_v1_moe", "base"]
    assert len(set(hy.top_k_per_layer)) == 3 and hy.tie_word_embeddings
    assert cfg["hunyuan_v1_moe", "untied_biased"].qkv_bias and cfg["hunyuan_v1_moe", "untied_biased"].o_bias
    so = cfg["solar_open", "base"]
    assert so.n_group > 1 and so.topk_group > 1 and so.routed_scaling_factor != 1 and not so.norm_topk_prob
    assert so.d_shared == 2 * so.d_expert and so.qkv_bias and so.rope.kind == "yarn"
    assert so.rope.original_max_position_embeddings < 40  # the tests' sequences are longer
    for family in FAMILIES:
        assert len(list(checkpoints[family, "sharded"].glob("*.safetensors"))) > 1
        if (family, "fused") not in checkpoints:  # LongCat-Flash's fused layout: in its own suite (tiny_longcat_flash)
            continue
        keys = json.dumps(_keys(checkpoints[family, "fused"]))
        stacked = "experts.gate_up_proj" if family != "nemotron_h" else "experts.up_proj"  # its experts have no gate
        assert stacked in keys and "experts.0." not in keys


def _keys(folder):
    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", "pt") as f:
        return list(f.keys())
