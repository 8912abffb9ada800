"""TransformerLens parity: the per-expert hook names of TL's own MoE, blocks.L.mlp.experts.E.hook_gate / hook_pre /
hook_post, as ragged views of moelens's per-slot sites.

TL (components/mlps/moe.py) runs expert E on `x[top_x]` where `idx, top_x = torch.where(one_hot(expert_indices)
.permute(2, 1, 0)[E])`: its rows are the (slot, token) pairs routed to E ordered by slot, then by token (batch *
pos flattened). Its MoEGatedMLP hooks hook_gate = W_gate(x), hook_pre = W_in(x) (the "up" projection) and
hook_post = act(gate) * up, before the routing weight. The references below gather those rows from the per-slot
cache with plain loops, written here and not taken from moelens; the last test runs TL's own MoE.
"""

from __future__ import annotations

import pytest
import torch

import tiny
import tiny_deepseek_v3
import tiny_mixtral
from moelens import HookedTransformer
from moelens.hooks import HookShapeError

# TL's per-expert name -> the moelens per-slot site it is a view of
SLOT_SITE = {"hook_gate": "hook_pre", "hook_pre": "hook_pre_linear", "hook_post": "hook_post"}
# (family, backend); the triton cases run in Triton's interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET)
CASES = [("qwen2_moe", "torch"), ("deepseek_v3", "torch"), ("qwen2_moe", "triton"), ("solar_open", "triton")]
BUILDERS = {
    # block 1 dense: its names must not exist
    "qwen2_moe": lambda d: tiny.build_qwen2_moe(d, seed=3, mlp_only_layers=[1]),
    # sigmoid scores, a correction bias and expert groups; block 0 dense (first_k_dense_replace=1)
    "deepseek_v3": lambda d: tiny_deepseek_v3.build_deepseek_v3(d, seed=0),
    "solar_open": lambda d: tiny.build_solar(d, seed=0),  # float32 router weights into the kernels
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("expert_views")
    return {family: build(root / family) for family, build in BUILDERS.items()}


@pytest.fixture(scope="module")
def models(folders):
    out = {}
    for family, backend in CASES:
        if backend == "triton":
            pytest.importorskip("triton")
        out[family, backend] = HookedTransformer.from_pretrained(folders[family], progress=False, experts_backend=backend)
    return out


@pytest.fixture
def toks():
    return torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(11))


def moe_layers(model) -> list[int]:
    return [i for i, block in enumerate(model.blocks) if block.is_moe]


def reference_rows(indices: torch.Tensor, expert: int) -> list[tuple[int, int, int]]:
    """(batch, pos, slot) of TL's rows for `expert`: slot-major, then tokens in batch-major order."""
    b, p, k = indices.shape
    return [(t // p, t % p, j) for j in range(k) for t in range(b * p) if int(indices[t // p, t % p, j]) == expert]


def gather(per_slot: torch.Tensor, rows: list[tuple[int, int, int]]) -> torch.Tensor:
    if not rows:
        return per_slot.new_empty(0, per_slot.shape[-1])
    return torch.stack([per_slot[b, p, j] for b, p, j in rows])


def busiest_expert(model, toks, layer: int) -> int:
    _, cache = model.run_with_cache(toks, names_filter=f"blocks.{layer}.mlp.hook_expert_indices")
    return int(torch.bincount(cache["expert_indices", layer].flatten()).argmax())


# ---- reading -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family, backend", CASES)
def test_views_are_the_per_slot_rows_in_tl_order(models, family, backend, toks):
    model = models[family, backend]
    clean = model(toks)
    logits, cache = model.run_with_cache(toks)
    assert torch.equal(logits, clean)  # caching the views changes nothing
    for layer in moe_layers(model):
        indices = cache["expert_indices", layer]
        seen = 0
        for expert in range(model.cfg.n_experts):
            rows = reference_rows(indices, expert)
            seen += len(rows)
            for view, slot_site in SLOT_SITE.items():
                got = cache[f"blocks.{layer}.mlp.experts.{expert}.{view}"]
                assert got.shape == (len(rows), model.cfg.d_expert)
                assert torch.equal(got, gather(cache[f"blocks.{layer}.mlp.experts.{slot_site}"], rows))
        assert seen == indices.numel()


@pytest.mark.parametrize("family, backend", CASES[:2])
def test_views_are_the_rows_tl_selects_with_torch_where(models, family, backend, toks):
    """TL's own selection, written as its MoE writes it: expert E's rows are x[top_x] for
    idx, top_x = torch.where(one_hot(indices, E).permute(2, 1, 0)[E]); the view's row r is then slot idx[r] of
    token top_x[r] of the per-slot tensor."""
    model = models[family, backend]
    _, cache = model.run_with_cache(toks)
    for layer in moe_layers(model):
        indices = cache["expert_indices", layer].reshape(-1, model.cfg.top_k_per_layer[layer])
        mask = torch.nn.functional.one_hot(indices, model.cfg.n_experts).permute(2, 1, 0)
        for expert in range(model.cfg.n_experts):
            idx, top_x = torch.where(mask[expert])
            for view, slot_site in SLOT_SITE.items():
                per_slot = cache[f"blocks.{layer}.mlp.experts.{slot_site}"]
                want = per_slot.reshape(indices.shape[0], indices.shape[1], -1)[top_x, idx]
                assert torch.equal(cache[f"blocks.{layer}.mlp.experts.{expert}.{view}"], want)


@pytest.mark.parametrize("family, backend", CASES[:2])
def test_names_exist_only_on_mixture_blocks(models, family, backend, toks):
    model = models[family, backend]
    dense = [i for i, block in enumerate(model.blocks) if not block.is_moe]
    assert dense  # both fixtures have a dense block
    for layer in range(model.cfg.n_layers):
        names = {n for n in model.hook_dict if n.startswith(f"blocks.{layer}.mlp.experts.") and n.count(".") == 5}
        expected = {f"blocks.{layer}.mlp.experts.{e}.{v}" for e in range(model.cfg.n_experts) for v in SLOT_SITE}
        assert names == (expected if layer not in dense else set())
    missing = f"blocks.{dense[0]}.mlp.experts.0.hook_pre"
    with pytest.raises(KeyError, match="no hook point named"):
        model.run_with_cache(toks, names_filter=[missing])
    with pytest.raises(KeyError, match="no hook point named"):
        model.run_with_hooks(toks, fwd_hooks=[(missing, lambda t, hook: None)])
    layer = moe_layers(model)[0]
    with pytest.raises(KeyError, match="no hook point named"):  # one past the last expert
        model.run_with_cache(toks, names_filter=f"blocks.{layer}.mlp.experts.{model.cfg.n_experts}.hook_post")


# ---- writing -------------------------------------------------------------------------------------------------
def scaled(t: torch.Tensor) -> torch.Tensor:
    return t * 1.5 + 0.25


def scale_(t: torch.Tensor) -> None:
    t.mul_(1.5).add_(0.25)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("view", list(SLOT_SITE))
@pytest.mark.parametrize("family, backend", CASES)
def test_replacing_editing_in_place_and_the_per_slot_edit_agree(models, family, backend, view, grad, toks):
    model = models[family, backend]
    layer = moe_layers(model)[0]
    expert = busiest_expert(model, toks, layer)
    name = f"blocks.{layer}.mlp.experts.{expert}.{view}"
    slot_name = f"blocks.{layer}.mlp.experts.{SLOT_SITE[view]}"
    routed = {}

    def read_indices(t, hook):
        routed["mask"] = t == expert

    def per_slot(t, hook):
        t = t.clone()
        t[routed["mask"]] = scaled(t[routed["mask"]])
        return t

    with torch.set_grad_enabled(grad):
        clean = model(toks)
        replaced = model.run_with_hooks(toks, fwd_hooks=[(name, lambda t, hook: scaled(t))])
        in_place = model.run_with_hooks(toks, fwd_hooks=[(name, lambda t, hook: scale_(t))])
        by_slot = model.run_with_hooks(
            toks, fwd_hooks=[(f"blocks.{layer}.mlp.hook_expert_indices", read_indices), (slot_name, per_slot)]
        )
    assert not torch.equal(replaced, clean)
    assert torch.equal(replaced, in_place)
    assert torch.equal(replaced, by_slot)


@pytest.mark.parametrize("family, backend", CASES)
def test_per_slot_hook_runs_first_then_the_views_in_expert_and_site_order(models, family, backend, toks):
    model = models[family, backend]
    layer = moe_layers(model)[0]
    expert = busiest_expert(model, toks, layer)
    _, clean = model.run_with_cache(toks, names_filter=lambda n: n.startswith(f"blocks.{layer}.mlp."))
    rows = reference_rows(clean["expert_indices", layer], expert)
    fired, seen = [], {}

    def record(t, hook):
        fired.append(hook.name)

    def double(t, hook):
        return t * 2

    def view_adds_one(t, hook):
        seen["view"] = t.clone()
        return t + 1

    every_view = f"blocks.{layer}.mlp.experts.*.hook_*"
    with model.hooks(fwd_hooks=[(every_view, record), (f"blocks.{layer}.mlp.experts.hook_post", double),
                                (f"blocks.{layer}.mlp.experts.{expert}.hook_post", view_adds_one)]):
        _, after = model.run_with_cache(toks, names_filter=[f"blocks.{layer}.mlp.experts.hook_post",
                                                            f"blocks.{layer}.mlp.experts.{expert}.hook_post"])
    views = [f"blocks.{layer}.mlp.experts.{e}.{v}" for v in SLOT_SITE for e in range(model.cfg.n_experts)]
    assert fired == views  # site by site (gate, pre, post), experts ascending in each
    per_slot = clean[f"blocks.{layer}.mlp.experts.hook_post"]
    assert torch.equal(seen["view"], gather(per_slot * 2, rows))  # the view sees the per-slot hook's result
    # the per-slot cache holds what the per-slot hook returned; the view's cache what the view's hook returned
    assert torch.equal(after[f"blocks.{layer}.mlp.experts.hook_post"], per_slot * 2)
    assert torch.equal(after[f"blocks.{layer}.mlp.experts.{expert}.hook_post"], gather(per_slot * 2, rows) + 1)


@pytest.mark.parametrize("family, backend", CASES[:1])
def test_an_expert_with_no_tokens_sees_an_empty_view(models, family, backend, toks):
    model = models[family, backend]
    layer = moe_layers(model)[0]
    k = model.cfg.top_k_per_layer[layer]
    shapes = {}

    def route_to_first_experts(t, hook):  # every token to experts 0 .. k-1: the others get no rows
        return torch.arange(k, dtype=t.dtype).expand_as(t).contiguous()

    def record(t, hook):
        shapes[hook.name] = tuple(t.shape)
        return t + 1  # a replacement of no rows is accepted and changes nothing

    idle = f"blocks.{layer}.mlp.experts.{k}.hook_post"
    reroute = (f"blocks.{layer}.mlp.hook_expert_indices", route_to_first_experts)
    base = model.run_with_hooks(toks, fwd_hooks=[reroute])
    out = model.run_with_hooks(toks, fwd_hooks=[reroute, (idle, record),
                                                (f"blocks.{layer}.mlp.experts.0.hook_post", lambda t, hook: None)])
    assert shapes[idle] == (0, model.cfg.d_expert)
    assert torch.equal(out, base)


@pytest.mark.parametrize("family, backend", [CASES[0], CASES[2]])
def test_a_wrong_shape_names_the_hook_and_the_expected_shape(models, family, backend, toks):
    model = models[family, backend]
    layer = moe_layers(model)[0]
    expert = busiest_expert(model, toks, layer)
    _, cache = model.run_with_cache(toks, names_filter="expert_indices")
    n = len(reference_rows(cache["expert_indices", layer], expert))
    name = f"blocks.{layer}.mlp.experts.{expert}.hook_pre"
    with pytest.raises(HookShapeError, match=rf"{name}.*expected shape \({n}, {model.cfg.d_expert}\)"):
        model.run_with_hooks(toks, fwd_hooks=[(name, lambda t, hook: t[:-1])])
    with pytest.raises(HookShapeError, match=rf"{name}.*expected shape \({n}, {model.cfg.d_expert}\)"):
        model.run_with_hooks(toks, fwd_hooks=[(name, lambda t, hook: t[None])])


# ---- gradients -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family, backend", [CASES[0], CASES[1], CASES[2]])
def test_backward_hooks_see_and_replace_the_gradient_of_their_rows(models, family, backend, toks):
    model = models[family, backend]
    layer = moe_layers(model)[0]
    expert = busiest_expert(model, toks, layer)
    view = f"blocks.{layer}.mlp.experts.{expert}.hook_post"
    slot = f"blocks.{layer}.mlp.experts.hook_post"
    names = [view, slot, f"blocks.{layer}.mlp.hook_expert_indices", "blocks.0.hook_resid_pre"]
    _, cache = model.run_with_cache(toks, names_filter=names, incl_bwd=True, return_type="loss")
    rows = reference_rows(cache["expert_indices", layer], expert)
    assert torch.equal(cache[view + "_grad"], gather(cache[slot + "_grad"], rows))
    mask = cache["expert_indices", layer] == expert

    def double_rows(g, hook):
        g = g.clone()
        g[mask] = g[mask] * 2
        return g

    def resid_grad(bwd):
        with model.hooks(bwd_hooks=[bwd]):
            _, c = model.run_with_cache(toks, names_filter="blocks.0.hook_resid_pre", incl_bwd=True, return_type="loss")
        return c["blocks.0.hook_resid_pre_grad"]

    by_view = resid_grad((view, lambda g, hook: g * 2))
    assert not torch.equal(by_view, cache["blocks.0.hook_resid_pre_grad"])
    assert torch.equal(by_view, resid_grad((slot, double_rows)))


# ---- run_with_cache's slicing and the cache's batch methods ----------------------------------------------------
@pytest.mark.parametrize("family, backend", CASES[:1])
def test_pos_slice_and_remove_batch_dim_select_rows(models, family, backend, toks):
    model = models[family, backend]
    layer = moe_layers(model)[0]
    names = lambda n: n.startswith(f"blocks.{layer}.mlp.")  # noqa: E731
    _, full = model.run_with_cache(toks, names_filter=names)
    indices = full["expert_indices", layer]
    for pos_slice, keep in [(-1, {toks.shape[1] - 1}), (slice(2, 5), {2, 3, 4}), ([0, 7], {0, 7})]:
        _, part = model.run_with_cache(toks, names_filter=names, pos_slice=pos_slice)
        for expert in range(model.cfg.n_experts):
            rows = [r for r in reference_rows(indices, expert) if r[1] in keep]
            got = part[f"blocks.{layer}.mlp.experts.{expert}.hook_pre"]
            assert torch.equal(got, gather(full[f"blocks.{layer}.mlp.experts.hook_pre_linear"], rows))
    _, one = model.run_with_cache(toks[:1], names_filter=names, remove_batch_dim=True)
    _, one_full = model.run_with_cache(toks[:1], names_filter=names)
    for expert in range(model.cfg.n_experts):
        name = f"blocks.{layer}.mlp.experts.{expert}.hook_post"
        assert torch.equal(one[name], one_full[name])  # no batch axis to drop: the rows stay
    assert one["expert_indices", layer].shape == indices.shape[1:]
    with pytest.raises(ValueError, match="batch of one"):
        model.run_with_cache(toks, names_filter=names, remove_batch_dim=True)
    # ActivationCache.remove_batch_dim in place leaves the views' rows; batch slicing refuses them
    assert one_full.remove_batch_dim() is one_full
    assert torch.equal(one_full[f"blocks.{layer}.mlp.experts.0.hook_post"], one[f"blocks.{layer}.mlp.experts.0.hook_post"])
    with pytest.raises(ValueError, match="rows routed to one expert"):
        full.apply_slice_to_batch_dim(0)


# ---- cost when unused -----------------------------------------------------------------------------------------
def test_no_per_expert_hook_no_routing_views(models, toks, monkeypatch):
    model = models["qwen2_moe", "torch"]
    layer = moe_layers(model)[0]
    group = model.blocks[layer].mlp.experts.views
    bound = []
    original = type(group).bind
    monkeypatch.setattr(type(group), "bind", lambda self, *a: bound.append(self) or original(self, *a))
    model(toks)
    model.run_with_hooks(toks, fwd_hooks=[(f"blocks.{layer}.mlp.experts.hook_post", lambda t, hook: t * 1)])
    model.run_with_cache(toks, names_filter=lambda n: ".experts.hook_" in n or "resid" in n)
    assert bound == [] and not group.any_hooked()
    model.add_hook(f"blocks.{layer}.mlp.experts.3.hook_gate", lambda t, hook: None)
    assert group.any_hooked()
    model(toks)
    assert bound == [group]
    model.reset_hooks()
    assert group.module_hooks == 0 and not group.any_hooked()


# ---- dense-MLP weights on a mixture layer ----------------------------------------------------------------------
def test_dense_mlp_weights_on_a_mixture_say_what_to_use(models):
    model = models["qwen2_moe", "torch"]
    mlp = model.blocks[moe_layers(model)[0]].mlp
    for name in ("W_in", "W_out", "W_gate", "b_in", "b_out"):
        assert not hasattr(mlp, name)
        said = rf"{name}: a mixture layer has no dense MLP {name}; the routed experts.*(experts\.W_|experts\.b_)"
        with pytest.raises(AttributeError, match=said):
            getattr(mlp, name)


# ---- TransformerLens's own MoE on the same weights --------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:HookedTransformer is deprecated:DeprecationWarning")
def test_matches_transformer_lens_moe_on_the_same_weights(tmp_path, toks):
    """TL's HookedTransformer (a tiny Mixtral, random weights, float32) and moelens's on the same checkpoint: every
    per-expert hook has the same rows in the same order."""
    tl = pytest.importorskip("transformer_lens")
    from transformer_lens.pretrained.weight_conversions.mixtral import convert_mixtral_weights
    from transformers import MixtralForCausalLM

    hf = tiny.new_model(MixtralForCausalLM, tiny_mixtral.mixtral_config(), seed=5)
    c = hf.config
    cfg = tl.HookedTransformerConfig(
        d_model=c.hidden_size, d_head=c.hidden_size // c.num_attention_heads, n_heads=c.num_attention_heads,
        d_mlp=c.intermediate_size, n_layers=c.num_hidden_layers, n_ctx=64, d_vocab=c.vocab_size, act_fn="silu",
        normalization_type="RMS", positional_embedding_type="rotary", rotary_base=c.rope_parameters["rope_theta"],
        eps=c.rms_norm_eps, n_key_value_heads=c.num_key_value_heads, gated_mlp=True,
        rotary_dim=c.hidden_size // c.num_attention_heads, num_experts=c.num_local_experts,
        experts_per_token=c.num_experts_per_tok, norm_topk_prob=True, dtype=torch.float32,
        default_prepend_bos=False,
    )
    reference = tl.HookedTransformer(cfg)
    reference.load_and_process_state_dict(
        convert_mixtral_weights(hf, cfg), fold_ln=False, center_writing_weights=False, center_unembed=False,
        fold_value_biases=False, refactor_factored_attn_matrices=False,
    )
    model = HookedTransformer.from_pretrained(tiny.save_hf(hf, tmp_path / "mixtral"), progress=False)
    ref_logits, ref_cache = reference.run_with_cache(toks, names_filter=lambda n: ".mlp." in n)
    logits, cache = model.run_with_cache(toks, names_filter=lambda n: ".mlp." in n)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    b, p = toks.shape
    for layer in range(c.num_hidden_layers):
        assert torch.equal(cache["expert_indices", layer].reshape(b * p, -1),
                           ref_cache[f"blocks.{layer}.mlp.hook_expert_indices"])
        for expert in range(c.num_local_experts):
            for view in SLOT_SITE:
                name = f"blocks.{layer}.mlp.experts.{expert}.{view}"
                assert cache[name].shape == ref_cache[name].shape
                torch.testing.assert_close(cache[name], ref_cache[name], atol=1e-5, rtol=1e-4)


def test_views_name_real_experts_when_offloaded(folders, models, toks):
    """Offloading runs the routed experts on a stack of only the fetched ones, renumbered: the views still name
    the model's experts, and hold what the resident model's hold."""
    resident = models["qwen2_moe", "torch"]
    offloaded = HookedTransformer.from_pretrained(
        folders["qwen2_moe"], progress=False, experts_backend="torch", expert_offload="cpu", expert_cache_bytes=0
    )
    layer = moe_layers(resident)[-1]
    names = f"blocks.{layer}.mlp.experts.*.hook_*"
    few = toks[:1, :3]  # few tokens: some experts get none, so the offload stack's numbering is not the model's
    _, want = resident.run_with_cache(few, names_filter=names)
    _, got = offloaded.run_with_cache(few, names_filter=names)
    assert sorted(got.keys()) == sorted(want.keys()) and len(got) == 3 * resident.cfg.n_experts
    assert any(t.shape[0] == 0 for t in want.values())
    for name in want.keys():
        assert torch.equal(got[name], want[name]), name
