"""moelens.patching against hand-written loops over run_with_hooks on a tiny model.

The oracle of each wrapper is its own loop with its own indexing code (not a patch setter, not
generic_activation_patch); the metric is a logit difference at the last position."""

import sys

import pytest
import torch

from moelens import HookedTransformer
from moelens import patching as P

A, B = 5, 17


def metric(logits):
    return (logits[:, -1, A] - logits[:, -1, B]).mean()


@pytest.fixture(scope="module")
def setup(qwen_model):
    g = torch.Generator().manual_seed(9)
    clean = torch.randint(0, 96, (2, 3), generator=g)
    corrupted = torch.randint(0, 96, (2, 3), generator=g)
    with torch.no_grad():
        _, cache = qwen_model.run_with_cache(clean)
    return qwen_model, clean, corrupted, cache


def run_patched(model, tokens, name, edit):
    """The corrupted run with `edit(x)` (in place) at `name`; the metric as a float."""
    def hook(x, hook):
        x = x.clone()
        edit(x)
        return x

    with torch.no_grad():
        return float(metric(model.run_with_hooks(tokens, fwd_hooks=[(name, hook)])))


def loop(shape, fn, got, n=6):
    """Check `got` [shape] against the oracle fn(*index) at n sampled indices (the first and last always):
    the function under test runs every index, the oracle a sample, which keeps the file fast."""
    assert tuple(got.shape) == tuple(shape), (got.shape, shape)
    indices = torch.cartesian_prod(*[torch.arange(k) for k in shape]).reshape(-1, len(shape))
    pick = torch.randperm(len(indices), generator=torch.Generator().manual_seed(len(indices)))[: n - 2]
    for index in [indices[0], indices[-1], *indices[pick]]:
        index = tuple(index.tolist())
        want = fn(*index)
        assert abs(got[index].item() - want) <= 1e-5, (index, got[index].item(), want)


def close(a, b):
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.allclose(a, b, atol=1e-5, rtol=0, equal_nan=True), (a - b).abs().max()


# ---- by position: [layer, pos] ------------------------------------------------------------------------------
@pytest.mark.parametrize("fn, site", [
    (P.get_act_patch_resid_pre, "blocks.{}.hook_resid_pre"),
    (P.get_act_patch_resid_mid, "blocks.{}.hook_resid_mid"),
    (P.get_act_patch_attn_out, "blocks.{}.hook_attn_out"),
    (P.get_act_patch_mlp_out, "blocks.{}.hook_mlp_out"),
    (P.get_act_patch_routed_out, "blocks.{}.mlp.hook_routed_out"),
    (P.get_act_patch_shared_out, "blocks.{}.mlp.hook_shared_out"),
], ids=["resid_pre", "resid_mid", "attn_out", "mlp_out", "routed_out", "shared_out"])
def test_layer_pos_wrappers(setup, fn, site):
    model, _, corrupted, cache = setup
    L, p = model.cfg.n_layers, corrupted.shape[1]

    def expected(layer, pos):
        name = site.format(layer)
        clean = cache[name]

        def edit(x):
            x[:, pos] = clean[:, pos]
        return run_patched(model, corrupted, name, edit)

    got = fn(model, corrupted, cache, metric)
    loop((L, p), expected, got)
    assert got.std() > 0  # the patches do something


# ---- heads ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fn, site, kv", [
    (P.get_act_patch_attn_head_out_by_pos, "z", False),
    (P.get_act_patch_attn_head_q_by_pos, "q", False),
    (P.get_act_patch_attn_head_k_by_pos, "k", True),
    (P.get_act_patch_attn_head_v_by_pos, "v", True),
], ids=["z", "q", "k", "v"])
def test_head_vector_by_pos(setup, fn, site, kv):
    model, _, corrupted, cache = setup
    cfg = model.cfg
    heads = cfg.n_kv_heads if kv else cfg.n_heads

    def expected(layer, pos, head):
        name = f"blocks.{layer}.attn.hook_{site}"

        def edit(x):
            x[:, pos, head, :] = cache[name][:, pos, head, :]
        return run_patched(model, corrupted, name, edit)

    loop((cfg.n_layers, corrupted.shape[1], heads), expected, fn(model, corrupted, cache, metric))


@pytest.mark.parametrize("fn, site, kv", [
    (P.get_act_patch_attn_head_out_all_pos, "z", False),
    (P.get_act_patch_attn_head_q_all_pos, "q", False),
    (P.get_act_patch_attn_head_k_all_pos, "k", True),
    (P.get_act_patch_attn_head_v_all_pos, "v", True),
    (P.get_act_patch_attn_head_pattern_all_pos, "pattern", False),
], ids=["z", "q", "k", "v", "pattern"])
def test_head_all_pos(setup, fn, site, kv):
    model, _, corrupted, cache = setup
    cfg = model.cfg

    def expected(layer, head):
        name = f"blocks.{layer}.attn.hook_{site}"

        def edit(x):
            if site == "pattern":  # [batch head dest src]
                x[:, head] = cache[name][:, head]
            else:  # [batch pos head d]
                x[:, :, head] = cache[name][:, :, head]
        return run_patched(model, corrupted, name, edit)

    loop((cfg.n_layers, cfg.n_kv_heads if kv else cfg.n_heads), expected, fn(model, corrupted, cache, metric))


def test_pattern_by_pos_and_dest_src(setup):
    model, _, corrupted, cache = setup
    cfg, p = model.cfg, corrupted.shape[1]

    def by_dest(layer, head, dest):
        name = f"blocks.{layer}.attn.hook_pattern"

        def edit(x):
            x[:, head, dest, :] = cache[name][:, head, dest, :]
        return run_patched(model, corrupted, name, edit)

    loop((cfg.n_layers, cfg.n_heads, p), by_dest, P.get_act_patch_attn_head_pattern_by_pos(model, corrupted, cache, metric))

    def by_entry(layer, head, dest, src):
        name = f"blocks.{layer}.attn.hook_pattern"

        def edit(x):
            x[:, head, dest, src] = cache[name][:, head, dest, src]
        return run_patched(model, corrupted, name, edit)

    loop((cfg.n_layers, cfg.n_heads, p, p), by_entry, P.get_act_patch_attn_head_pattern_dest_src_pos(model, corrupted, cache, metric))


def test_every_helpers_stack_the_wrappers(setup):
    model, _, corrupted, cache = setup
    cfg = model.cfg
    every = P.get_act_patch_attn_head_all_pos_every(model, corrupted, cache, metric)
    assert every.shape == (5, cfg.n_layers, cfg.n_heads)
    k = P.get_act_patch_attn_head_k_all_pos(model, corrupted, cache, metric)
    close(every[2, :, : cfg.n_kv_heads], k)
    assert (every[2, :, cfg.n_kv_heads:] == 0).all()  # zero-padded kv heads, as TransformerLens
    block = P.get_act_patch_block_every(model, corrupted, cache, metric)
    close(block[2], P.get_act_patch_mlp_out(model, corrupted, cache, metric))


# ---- generic: index_df, errors, a full patch gives the clean run --------------------------------------------------
def test_generic_patch_everything_restores_the_clean_metric(setup):
    model, clean, corrupted, cache = setup
    with torch.no_grad():
        clean_metric = float(metric(model(clean)))

    def everything(x, index, clean_x):
        x[...] = clean_x
        return x

    out = P.generic_activation_patch(model, corrupted, cache, metric, everything, "resid_post", index_axis_names=("layer",))
    # resid_post of the last block is all the logits read (attention reads no later position)
    assert abs(out[-1].item() - clean_metric) < 1e-5


def test_index_df_and_return_index_df(setup):
    pd = pytest.importorskip("pandas")
    model, _, corrupted, cache = setup
    full, df = P.get_act_patch_attn_out(model, corrupted, cache, metric, return_index_df=True)
    assert list(df.columns) == ["layer", "pos"] and len(df) == full.numel()
    assert df.iloc[1].tolist() == [0, 1]  # the last column fastest
    rows = pd.DataFrame([[2, 2], [0, 1], [1, 0]], columns=["layer", "pos"])
    flat = P.generic_activation_patch(model, corrupted, cache, metric, P.layer_pos_patch_setter, "attn_out", index_df=rows)
    close(flat, torch.stack([full[2, 2], full[0, 1], full[1, 0]]))
    with pytest.raises(ValueError, match="not both"):
        P.generic_activation_patch(model, corrupted, cache, metric, P.layer_pos_patch_setter, "attn_out",
                                   index_axis_names=("layer", "pos"), index_df=rows)


def test_without_pandas_index_df_says_what_is_missing(setup, monkeypatch):
    model, _, corrupted, cache = setup
    monkeypatch.setitem(sys.modules, "pandas", None)  # import pandas now raises ImportError
    with pytest.raises(ImportError, match="pip install pandas"):
        P.get_act_patch_attn_out(model, corrupted, cache, metric, return_index_df=True)
    assert P.get_act_patch_attn_out(model, corrupted, cache, metric).shape == (model.cfg.n_layers, 3)


def test_generic_errors(setup):
    model, _, corrupted, cache = setup
    with pytest.raises(ValueError, match="index_axis_names"):
        P.generic_activation_patch(model, corrupted, cache, metric, P.layer_pos_patch_setter, "attn_out")
    with pytest.raises(ValueError, match="unknown axis"):
        P.generic_activation_patch(model, corrupted, cache, metric, P.layer_pos_patch_setter, "attn_out",
                                   index_axis_names=("layer", "posn"))
    with pytest.raises(ValueError, match="2 entries"):
        P.generic_activation_patch(model, corrupted, cache, metric, P.layer_pos_patch_setter, "attn_out",
                                   index_axis_names=("layer", "pos", "head"))


# ---- MoE: dense blocks, models without a shared expert, expert weights ---------------------------------------------
@pytest.fixture(scope="module")
def dense_setup(checkpoints):
    model = HookedTransformer.from_pretrained(checkpoints["qwen2_moe", "dense_block"], progress=False)
    g = torch.Generator().manual_seed(4)
    clean, corrupted = torch.randint(0, 96, (2, 3), generator=g), torch.randint(0, 96, (2, 3), generator=g)
    with torch.no_grad():
        _, cache = model.run_with_cache(clean)
    return model, corrupted, cache


def test_dense_block_entries_are_nan(dense_setup):
    model, corrupted, cache = dense_setup
    routed = P.get_act_patch_routed_out(model, corrupted, cache, metric)
    assert torch.isnan(routed[1]).all() and not torch.isnan(routed[[0, 2]]).any()
    weights = P.get_act_patch_expert_weights(model, corrupted, cache, metric)
    assert torch.isnan(weights[1]).all() and not torch.isnan(weights[[0, 2]]).any()


def test_shared_out_needs_a_shared_expert(family_models):
    model = family_models["mixtral"]
    toks = torch.randint(0, 96, (1, 3), generator=torch.Generator().manual_seed(1))
    _, cache = model.run_with_cache(toks)
    with pytest.raises(ValueError, match="shared_out"):
        P.get_act_patch_shared_out(model, toks, cache, metric)


def test_expert_weights_against_a_loop(setup):
    model, _, corrupted, cache = setup
    cfg = model.cfg

    def expected(layer, e):
        pre = f"blocks.{layer}.mlp"
        clean_idx, clean_w = cache[f"{pre}.hook_expert_indices"], cache[f"{pre}.hook_expert_weights"]
        seen = {}

        def read(idx, hook):
            seen["idx"] = idx.clone()

        def reweight(w, hook):
            w = w.clone()
            b, p, k = w.shape
            for i in range(b):
                for j in range(p):
                    clean_weight = 0.0
                    for s in range(k):
                        if clean_idx[i, j, s] == e:
                            clean_weight = clean_w[i, j, s].item()
                    for s in range(k):
                        if seen["idx"][i, j, s] == e:
                            w[i, j, s] = clean_weight
            return w

        with torch.no_grad():
            logits = model.run_with_hooks(corrupted, fwd_hooks=[(f"{pre}.hook_expert_indices", read), (f"{pre}.hook_expert_weights", reweight)])
        return float(metric(logits))

    got = P.get_act_patch_expert_weights(model, corrupted, cache, metric)
    loop((cfg.n_layers, cfg.n_experts), expected, got, n=10)
    with torch.no_grad():
        unpatched = float(metric(model(corrupted)))
    assert (got - unpatched).abs().max() > 1e-4  # some expert's weight matters
