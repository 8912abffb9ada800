"""TransformerLens parity of the hook API (hook_points.py), run_with_cache's pos_slice / return_cache_object,
and the ActivationCache methods TL users call (to, toggle_autodiff, apply_slice_to_batch_dim, neuron stacks,
get_full_resid_decomposition's defaults and order).

Expected values come from the cache's raw tensors indexed by hand, from autograd, or from hook call logs."""

import inspect
import logging

import pytest
import torch

from moelens import HookedTransformer
from moelens.hooks import HookedRootModule, HookPoint

ATOL = 1e-5


def close(a, b, atol=ATOL):
    assert a.shape == b.shape, (a.shape, b.shape)
    err = (a - b).abs().max().item() if a.numel() else 0.0
    assert err <= atol, f"max error {err:.3g} > {atol}"


@pytest.fixture
def model(qwen_model):
    """The session model, with no hook or ctx left over from another test."""
    qwen_model.reset_hooks(including_permanent=True)
    yield qwen_model
    qwen_model.reset_hooks(including_permanent=True)


@pytest.fixture(scope="module")
def toks():
    return torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(5))


# ---- signatures --------------------------------------------------------------------------------------------
def params(fn):
    return {n: p.default for n, p in inspect.signature(fn).parameters.items() if n not in ("self",)}


def test_signatures_are_transformer_lens():
    assert params(HookedRootModule.run_with_hooks) == {
        "model_args": inspect.Parameter.empty, "fwd_hooks": (), "bwd_hooks": (), "reset_hooks_end": True,
        "clear_contexts": False, "model_kwargs": inspect.Parameter.empty}
    assert params(HookedRootModule.hooks) == {"fwd_hooks": (), "bwd_hooks": (), "reset_hooks_end": True, "clear_contexts": False}
    assert list(params(HookedRootModule.add_hook).items()) == [
        ("name_or_filter", inspect.Parameter.empty), ("hook", inspect.Parameter.empty), ("dir", "fwd"),
        ("is_permanent", False), ("level", None), ("prepend", False)]
    assert list(params(HookPoint.add_hook).items())[:5] == [
        ("hook", inspect.Parameter.empty), ("dir", "fwd"), ("is_permanent", False), ("level", None), ("prepend", False)]
    assert params(HookedRootModule.reset_hooks) == {"clear_contexts": True, "direction": "both", "including_permanent": False, "level": None}
    assert params(HookedRootModule.remove_all_hook_fns) == {"direction": "both", "including_permanent": False, "level": None}
    assert params(HookPoint.remove_hooks) == {"dir": "fwd", "including_permanent": False, "level": None}
    rwc = params(HookedRootModule.run_with_cache)
    assert {k: rwc[k] for k in ("names_filter", "device", "remove_batch_dim", "incl_bwd", "reset_hooks_end",
                                "clear_contexts", "pos_slice", "return_cache_object")} == {
        "names_filter": None, "device": None, "remove_batch_dim": False, "incl_bwd": False, "reset_hooks_end": True,
        "clear_contexts": False, "pos_slice": None, "return_cache_object": True}


# ---- order, names, layers ----------------------------------------------------------------------------------
def test_hooks_run_in_transformer_lens_order(model, toks):
    """One list per site in added order, module and call hooks alike; prepend puts a hook before all."""
    calls = []
    log = lambda tag: (lambda t, hook: calls.append(tag))  # noqa: E731
    model.add_hook("hook_embed", log("A"))
    model.add_hook("hook_embed", log("B"), prepend=True)
    model.run_with_hooks(toks, fwd_hooks=[("hook_embed", log("C"))])
    assert calls == ["B", "A", "C"]
    calls.clear()
    with model.hooks(fwd_hooks=[("hook_embed", log("C"))]):
        model.add_hook("hook_embed", log("E"))  # added after C: runs after it, as TransformerLens
        model.add_hook("hook_embed", log("F"), prepend=True)
        model(toks)
    assert calls == ["F", "B", "A", "C", "E"]
    calls.clear()
    model(toks)  # C was the block's; E and F are the model's
    assert calls == ["F", "B", "A", "E"]


def test_hook_name_layer_and_hook_points(model, toks):
    seen = []
    model.run_with_hooks(toks, fwd_hooks=[(lambda n: n.endswith("hook_attn_out"), lambda t, hook: seen.append((hook.name, hook.layer())))])
    assert seen == [(f"blocks.{l}.hook_attn_out", l) for l in range(model.cfg.n_layers)]
    assert model.hook_dict["blocks.2.mlp.experts.hook_post"].layer() == 2
    for name in ("hook_embed", "ln_final.hook_scale"):
        with pytest.raises(ValueError, match="not inside a block"):
            model.hook_dict[name].layer()
    assert list(model.hook_points()) == list(model.hook_dict.values())
    assert all(isinstance(hp, HookPoint) for hp in model.hook_points())


def test_ctx_is_kept_and_cleared_as_transformer_lens(model, toks):
    def remember(t, hook):
        hook.ctx["n"] = hook.ctx.get("n", 0) + 1

    hp = model.hook_dict["hook_embed"]
    model.run_with_hooks(toks, fwd_hooks=[("hook_embed", remember)])
    model.run_with_hooks(toks, fwd_hooks=[("hook_embed", remember)])
    assert hp.ctx == {"n": 2}  # clear_contexts=False by default
    model.run_with_hooks(toks, fwd_hooks=[("hook_embed", remember)], clear_contexts=True)
    assert hp.ctx == {}
    with model.hooks(fwd_hooks=[("hook_embed", remember)], clear_contexts=True):
        model(toks)
        assert hp.ctx == {"n": 1}
    assert hp.ctx == {}
    hp.ctx["x"] = 1
    model.reset_hooks(clear_contexts=False)
    assert hp.ctx == {"x": 1}
    model.reset_hooks()  # clear_contexts=True by default
    assert hp.ctx == {}
    hp.ctx["x"] = 1
    model.run_with_cache(toks, names_filter="hook_embed", clear_contexts=True)
    assert hp.ctx == {}


def test_reset_remove_by_direction_permanence_and_level(model, toks):
    fired = []
    fwd = lambda tag: (lambda t, hook: fired.append(tag))  # noqa: E731
    model.add_hook("hook_embed", fwd("temp"))
    model.add_hook("hook_embed", fwd("perm"), is_permanent=True)
    model.add_perma_hook("hook_logits", fwd("perm2"))
    model.hook_dict["hook_logits"].add_perma_hook(fwd("perm3"))
    model.add_hook("hook_embed", fwd("lvl3"), level=3)
    model.add_hook("hook_embed", lambda g, hook: None, dir="bwd")
    hp = model.hook_dict["hook_embed"]
    model.reset_hooks(level=3)  # only the level-3 non-permanent hook
    model(toks)
    assert fired == ["temp", "perm", "perm2", "perm3"]
    model.reset_hooks(direction="fwd")
    assert len(hp.bwd_hooks) == 1 and [h.is_permanent for h in hp.fwd_hooks] == [True]
    model.remove_all_hook_fns("bwd")
    assert hp.bwd_hooks == []
    hp.add_hook(lambda t, hook: None)
    hp.add_hook(lambda g, hook: None, dir="bwd")
    hp.remove_hooks()  # TransformerLens's default: forward hooks only
    assert len(hp.bwd_hooks) == 1 and len(hp.fwd_hooks) == 1  # the permanent one stays
    model.remove_all_hook_fns(including_permanent=True)
    assert not model.hook_dict["hook_logits"].fwd_hooks and not hp.fwd_hooks and not hp.bwd_hooks
    with pytest.raises(ValueError, match="direction"):
        model.reset_hooks(direction="sideways")
    with pytest.raises(ValueError, match="direction"):
        model.add_hook("hook_embed", fwd("x"), dir="both")


def test_reset_hooks_end_false_keeps_hooks_at_the_context_level(model, toks):
    fired = []
    assert model.context_level == 0
    with model.hooks(fwd_hooks=[("hook_embed", lambda t, hook: fired.append(1))], reset_hooks_end=False):
        assert model.context_level == 1
    assert model.context_level == 0
    model(toks)
    assert fired == [1] and model.hook_dict["hook_embed"].fwd_hooks[0].level == 1
    model.reset_hooks(level=2)
    model(toks)
    assert fired == [1, 1]
    model.reset_hooks(level=1)
    model(toks)
    assert fired == [1, 1]


def test_backward_hooks_receive_the_gradient_and_may_replace_it(model, toks):
    site = "blocks.1.hook_resid_mid"
    kept = {}

    def keep(x, hook):
        kept["x"] = x

    grads = []
    with model.hooks(fwd_hooks=[(site, keep)], bwd_hooks=[(site, lambda g, hook: grads.append(g.clone()))]):
        loss = model(toks, return_type="loss")
        (expected,) = torch.autograd.grad(loss, kept["x"], retain_graph=True)
        loss.backward()
    close(grads[0], expected, 0)
    model.zero_grad()
    # bwd hooks chain in order: the first one's return value is what the second one sees, and what flows on
    seen = []
    loss = model.run_with_hooks(
        toks, return_type="loss", reset_hooks_end=False,
        bwd_hooks=[("hook_embed", lambda g, hook: g * 0), ("hook_embed", lambda g, hook: seen.append(g.abs().max()))],
    )
    loss.backward()
    model.reset_hooks()
    assert seen == [0] and model.embed.weight.grad.abs().max() == 0
    model.zero_grad()


# ---- run_with_cache ----------------------------------------------------------------------------------------
SITES = {  # name -> position axis in its layout (with the batch axis)
    "blocks.0.hook_resid_pre": 1, "blocks.1.attn.hook_pattern": 2, "blocks.1.attn.hook_attn_scores": 2,
    "blocks.1.attn.hook_z": 1, "blocks.2.attn.hook_k": 1, "blocks.0.mlp.experts.hook_post": 1,
    "blocks.0.mlp.hook_expert_indices": 1, "blocks.0.mlp.hook_expert_outputs": 1, "ln_final.hook_scale": 1,
}


def by_hand(t, axis, pos_slice):
    """TransformerLens's run_with_cache slicing (Slice.unwrap): an int keeps the axis, as [i]."""
    index = [slice(None)] * t.dim()
    if isinstance(pos_slice, int):
        pos_slice = [pos_slice]
    if isinstance(pos_slice, tuple):
        pos_slice = slice(*pos_slice)
    if isinstance(pos_slice, (list, torch.Tensor)):
        pos_slice = torch.as_tensor(pos_slice)
    index[axis] = pos_slice
    return t[tuple(index)]


@pytest.mark.parametrize("pos_slice", [-1, 2, slice(1, 4), (0, 5, 2), [0, 3], torch.tensor([4, 1])], ids=str)
def test_run_with_cache_pos_slice(model, toks, pos_slice):
    _, full = model.run_with_cache(toks, names_filter=list(SITES))
    _, part = model.run_with_cache(toks, names_filter=list(SITES), pos_slice=pos_slice)
    for name, axis in SITES.items():
        close(part[name].float(), by_hand(full[name], axis, pos_slice).float(), 0)
    # the batch of one without its batch axis
    _, one = model.run_with_cache(toks[:1], names_filter=list(SITES), pos_slice=pos_slice, remove_batch_dim=True)
    _, one_full = model.run_with_cache(toks[:1], names_filter=list(SITES))
    for name, axis in SITES.items():
        close(one[name].float(), by_hand(one_full[name], axis, pos_slice)[0].float(), 0)
    assert not one.has_batch_dim


def test_run_with_cache_pos_slice_on_gradients_and_tl_slice_objects(model, toks):
    _, full = model.run_with_cache(toks, names_filter="blocks.1.hook_resid_mid", incl_bwd=True, return_type="loss")
    _, part = model.run_with_cache(toks, names_filter="blocks.1.hook_resid_mid", incl_bwd=True, return_type="loss",
                                   pos_slice=slice(2, None))
    close(part["blocks.1.hook_resid_mid_grad"], full["blocks.1.hook_resid_mid_grad"][:, 2:], 0)

    class Slice:  # the shape of transformer_lens.utils.Slice: .slice and .apply
        def __init__(self, s):
            self.slice = s

        def apply(self, t, dim=0):
            raise AssertionError("not called")

    _, obj = model.run_with_cache(toks, names_filter="hook_embed", pos_slice=Slice([1, 2]))
    close(obj["hook_embed"], full_embed := model.run_with_cache(toks, names_filter="hook_embed")[1]["hook_embed"][:, [1, 2]], 0)
    assert full_embed.shape[1] == 2


def test_run_with_cache_return_cache_object_false_and_reset_hooks_end(model, toks):
    out, cache = model.run_with_cache(toks, names_filter=["hook_embed", "blocks.0.hook_resid_post"])
    out2, d = model.run_with_cache(toks, names_filter=["hook_embed", "blocks.0.hook_resid_post"], return_cache_object=False)
    assert type(d) is dict and sorted(d) == sorted(cache.keys())
    close(out2, out, 0)
    for k in d:
        close(d[k], cache[k], 0)
    _, d1 = model.run_with_cache(toks[:1], names_filter="hook_embed", remove_batch_dim=True, return_cache_object=False)
    assert d1["hook_embed"].shape == cache["hook_embed"].shape[1:]
    # reset_hooks_end=False: the caching hooks stay, and a later forward overwrites what they cached
    _, kept = model.run_with_cache(toks, names_filter="hook_embed", reset_hooks_end=False)
    assert model.is_caching
    other = toks.flip(0)
    model(other)
    close(kept["hook_embed"], model.embed.weight[other].detach(), 0)
    model.reset_hooks()
    assert not model.is_caching
    model(toks)
    close(kept["hook_embed"], model.embed.weight[other].detach(), 0)


# ---- ActivationCache methods ----------------------------------------------------------------------------------
def test_cache_dict_methods_to_and_autodiff(model, toks, caplog):
    _, cache = model.run_with_cache(toks, names_filter=["hook_embed", "blocks.0.hook_resid_pre"])
    assert list(cache) == list(cache.keys()) == ["hook_embed", "blocks.0.hook_resid_pre"]
    assert len(cache) == 2 and list(cache.values())[0] is cache["hook_embed"]
    assert dict(cache.items())["blocks.0.hook_resid_pre"] is cache["resid_pre", 0]
    assert "hook_embed" in cache and ("resid_pre", 0) in cache and ("resid_pre", 1) not in cache
    same = cache.to("cpu")
    assert same is cache  # in place, as TransformerLens
    assert cache.to("cpu", move_model=True) is cache and model.device.type == "cpu"
    was = torch.is_grad_enabled()
    try:
        with caplog.at_level(logging.WARNING):
            cache.toggle_autodiff(False)
        assert not torch.is_grad_enabled() and "autodiff" in caplog.text
        cache.toggle_autodiff(True)
        assert torch.is_grad_enabled()
    finally:
        torch.set_grad_enabled(was)


def test_apply_slice_to_batch_dim(model, toks):
    _, cache = model.run_with_cache(toks, names_filter=["hook_embed", "blocks.0.mlp.hook_expert_indices"])
    one = cache.apply_slice_to_batch_dim(1)
    assert not one.has_batch_dim and cache.has_batch_dim
    for k in cache.keys():
        close(one[k].float(), cache[k][1].float(), 0)
    for batch_slice, index in [(slice(0, 1), slice(0, 1)), ((1, 2), slice(1, 2)), ([1, 0], [1, 0])]:
        part = cache.apply_slice_to_batch_dim(batch_slice)
        assert part.has_batch_dim
        for k in cache.keys():
            close(part[k].float(), cache[k][index].float(), 0)
    with pytest.raises(ValueError, match="no batch axis"):
        one.apply_slice_to_batch_dim(0)


# ---- neurons and the full decomposition ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dense_run(checkpoints):
    """Qwen2-MoE with block 1 dense: every kind of MLP part (dense, shared expert, routed experts)."""
    m = HookedTransformer.from_pretrained(checkpoints["qwen2_moe", "dense_block"], progress=False)
    toks = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, cache = m.run_with_cache(toks)
    return m, cache


def test_stack_neuron_results_sum_to_each_mlp_output(dense_run):
    m, cache = dense_run
    cfg = m.cfg
    stack, labels = cache.stack_neuron_results(cfg.n_layers, return_labels=True)
    rows = {lab: i for i, lab in enumerate(labels)}
    assert labels[: cfg.d_shared] == [f"L0.shared.N{i}" for i in range(cfg.d_shared)]
    assert [f"L1N{i}" for i in range(cfg.d_mlp)] == [lab for lab in labels if lab.startswith("L1")]
    for l in range(cfg.n_layers):
        mine = [i for lab, i in rows.items() if lab.startswith(f"L{l}")]
        close(stack[mine].sum(0), cache["mlp_out", l])
    # one neuron, by hand: the dense block's post[..., 3] * down_proj column 3
    one = cache.stack_neuron_results(2, neuron_slice=3, pos_slice=-1)
    dense = cache["blocks.1.mlp.hook_post"][:, -1, 3, None] * m.blocks[1].mlp.down_proj.weight[:, 3].detach()
    assert one.shape[0] == 1 + 1 + cfg.n_experts  # L0: shared + 8 experts' neuron 3; L1: neuron 3
    close(one[-1], dense)
    # the remainder completes the stream entering the layer; apply_ln divides by that layer's ln1 scale
    with_rest, labels = cache.stack_neuron_results(2, incl_remainder=True, return_labels=True)
    assert labels[-1] == "remainder"
    close(with_rest.sum(0), cache["resid_pre", 2])
    # apply_ln: each part as the norm outputs it, the cached scale and the norm's weight (1 once folded)
    normed = cache.stack_neuron_results(2, incl_remainder=True, apply_ln=True)
    close(normed.sum(0), cache["resid_pre", 2] / cache["blocks.2.ln1.hook_scale"] * m.blocks[2].ln1.weight.detach())


def test_get_neuron_results(dense_run):
    m, cache = dense_run
    dense = cache.get_neuron_results(1)
    assert dense.shape == (2, 5, m.cfg.d_mlp, m.cfg.d_model)
    close(dense.sum(-2), cache["mlp_out", 1])
    slots = cache.get_neuron_results(0)  # per routing slot, weight included
    assert slots.shape == (2, 5, m.cfg.top_k_per_layer[0], m.cfg.d_expert, m.cfg.d_model)
    close(slots.sum((-3, -2)), cache["routed_out", 0])
    close(slots.sum(-2), cache["expert_outputs", 0])
    shared = cache.get_neuron_results(0, shared=True)
    close(shared.sum(-2), cache["shared_out", 0])
    part = cache.get_neuron_results(1, neuron_slice=[2, 5], pos_slice=1)
    close(part, dense[:, 1, [2, 5]])
    with pytest.raises(ValueError, match="no shared expert"):
        cache.get_neuron_results(1, shared=True)


def test_full_resid_decomposition_defaults_and_order_are_transformer_lens(dense_run):
    m, cache = dense_run
    params = inspect.signature(cache.get_full_resid_decomposition).parameters
    assert params["expand_neurons"].default is True and params["return_labels"].default is False
    stack = cache.get_full_resid_decomposition()
    assert isinstance(stack, torch.Tensor)
    _, labels = cache.get_full_resid_decomposition(return_labels=True)
    n_heads = m.cfg.n_layers * m.cfg.n_heads
    assert labels[:n_heads] == [f"L{l}H{h}" for l in range(m.cfg.n_layers) for h in range(m.cfg.n_heads)]
    assert labels[-2:] == ["embed", "bias"]
    neurons, neuron_labels = cache.stack_neuron_results(m.cfg.n_layers, return_labels=True)
    assert labels[n_heads:-2] == neuron_labels
    close(stack[n_heads:-2], neurons, 0)
    close(stack.sum(0), cache["resid_post", -1])


def test_b_U_and_accumulated_bias(checkpoints):
    m = HookedTransformer.from_pretrained(checkpoints["hunyuan_v1_moe", "untied_biased"], progress=False)
    assert m.b_U.shape == (m.cfg.d_vocab,) and (m.b_U == 0).all()
    biases = [b.attn.o_proj.bias.detach() for b in m.blocks]
    close(m.accumulated_bias(0), torch.zeros(m.cfg.d_model), 0)
    close(m.accumulated_bias(2).detach(), biases[0] + biases[1])
    close(m.accumulated_bias(1, mlp_input=True).detach(), biases[0] + biases[1])
    with pytest.raises(ValueError, match="layer must be"):
        m.accumulated_bias(m.cfg.n_layers + 1)


# ---- HookPoint's hook records as TransformerLens's LensHandles ------------------------------------------------
def test_hook_records_list_in_run_order_with_context_level():
    """TL's test_hook_points: fwd_hooks lists a prepended hook first; each record has context_level."""
    point = HookPoint()

    def first(x, hook):
        return x

    def prepended(x, hook):
        return x

    point.add_hook(first, dir="fwd", level=5)
    point.add_hook(prepended, dir="fwd", prepend=True)
    point.add_hook(first, dir="bwd", is_permanent=True)
    assert [h.fn for h in point.fwd_hooks] == [prepended, first]
    assert point.fwd_hooks[1].context_level == 5 and point.fwd_hooks[0].context_level is None
    assert len(point.bwd_hooks) == 1 and point.bwd_hooks[0].is_permanent


def test_remove_batch_dim_of_a_batch_is_an_assertion_error_too(model, toks):
    """TL asserts the batch size of one; moelens's error is a ValueError and an AssertionError."""
    _, cache = model.run_with_cache(toks, names_filter=["blocks.0.hook_resid_pre"])
    assert toks.shape[0] > 1
    with pytest.raises(AssertionError, match="batch of one"):
        cache.remove_batch_dim()
    with pytest.raises(ValueError, match="batch of one"):
        cache.remove_batch_dim()
