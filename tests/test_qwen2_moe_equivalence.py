"""HookedQwen2Moe against transformers' Qwen2MoeForCausalLM on the same weights."""

import json

import pytest
import torch

from moelens import HookedQwen2Moe, HookedTransformer
from moelens.verify import compare, load_reference

VARIANTS = ["gqa", "norm_topk", "plain_attn", "dense_block", "tied", "sharded", "fused"]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("attention", ["eager", "fused"])
def test_float32_logits_and_sites(qwen_checkpoints, variant, attention, tokens):
    path = qwen_checkpoints[variant]
    model = HookedTransformer.from_pretrained(path, progress=False)
    model.set_attention_backend(attention)
    assert isinstance(model, HookedQwen2Moe)
    report = compare(model, load_reference(path), tokens)
    assert report.max_logit_diff <= 1e-5, report
    n_moe = sum(model.cfg.moe_layers)
    compared = {s.site for s in report.sites}
    # every block's residual sites and every mixture's router sites were compared
    for layer in range(model.cfg.n_layers):
        for site in ("hook_resid_pre", "hook_attn_out", "hook_mlp_out", "hook_resid_post"):
            assert f"blocks.{layer}.{site}" in compared
    assert sum(s.endswith("hook_router_logits") for s in compared) == n_moe
    assert sum(s.endswith("shared_expert.hook_out") for s in compared) == n_moe
    for site in report.sites:
        assert site.max_abs_diff <= 1e-5, (variant, site)
    assert report.index_mismatches == 0


def test_variants_are_what_they_claim(qwen_checkpoints):
    cfgs = {v: HookedTransformer.from_pretrained(qwen_checkpoints[v], progress=False).cfg for v in VARIANTS}
    assert cfgs["gqa"].n_kv_heads < cfgs["gqa"].n_heads and cfgs["plain_attn"].n_kv_heads == cfgs["plain_attn"].n_heads
    assert cfgs["norm_topk"].norm_topk_prob and not cfgs["gqa"].norm_topk_prob
    assert cfgs["dense_block"].moe_layers == (True, False, True)
    assert cfgs["tied"].tie_word_embeddings and not cfgs["gqa"].tie_word_embeddings
    shards = list(qwen_checkpoints["sharded"].glob("*.safetensors"))
    assert len(shards) > 1
    fused_keys = json.dumps([k for k in _keys(qwen_checkpoints["fused"]) if "experts" in k])
    assert "gate_up_proj" in fused_keys and "experts.0." not in fused_keys


def _keys(folder):
    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", "pt") as f:
        return list(f.keys())


def test_tied_model_shares_embedding(qwen_checkpoints):
    model = HookedTransformer.from_pretrained(qwen_checkpoints["tied"], progress=False)
    assert model.unembed.weight is model.embed.weight


@pytest.mark.parametrize("variant", ["gqa", "norm_topk"])
def test_bfloat16_eager_is_bit_exact(qwen_checkpoints, variant, tokens):
    """With eager attention every op matches the reference's, so bf16 results are identical."""
    path = qwen_checkpoints[variant]
    model = HookedTransformer.from_pretrained(path, dtype=torch.bfloat16, progress=False)
    report = compare(model, load_reference(path, torch.bfloat16), tokens)
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
    assert model(toks).dtype == torch.bfloat16
    assert torch.stack(ours_err).mean() <= 1.5 * torch.stack(ref_err).mean()


def test_left_padding_rows_equal_rows_alone(qwen_model, qwen_path):
    tokens = torch.randint(0, 96, (3, 16), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(tokens)
    starts = [4, 9, 0]
    for row, start in enumerate(starts):
        mask[row, :start] = 0
    with torch.no_grad():
        batch = qwen_model(tokens, attention_mask=mask)
        for row, start in enumerate(starts):
            alone = qwen_model(tokens[row : row + 1, start:])
            assert (batch[row, start:] - alone[0]).abs().max() <= 1e-5
    report = compare(qwen_model, load_reference(qwen_path), tokens, mask)
    assert report.max_logit_diff <= 1e-5 and report.index_mismatches == 0
