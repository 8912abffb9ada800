"""What a hook means: in-place edits equal replacements at every site, hook_scale is what the norm divides by,
hooks of one call belong to its thread, removed backward hooks do not fire, activation gradients leave no
parameter gradients."""

import threading

import pytest
import torch
from conftest import BACKEND_CASES, FAMILIES, LAYER_NORM_FAMILIES, ffn_stream, norm_factor

from moelens import HookedTransformer, KVCache
from moelens.hooks import HookShapeError
from moelens.hooks.sites import SITE_BY_NAME, table_name


EXPERT_SITES = ("experts.hook_pre", "experts.hook_pre_linear", "experts.hook_post", "mlp.hook_expert_outputs")


def floating_sites(model, tokens):
    """Every floating site but TransformerLens's per-expert views (blocks.L.mlp.experts.E.*): rows of the
    per-slot sites, some of them empty, tested in test_tl_parity_expert_hooks.py."""
    _, cache = model.run_with_cache(tokens)
    views = {name for name, hp in model.hook_dict.items() if getattr(hp, "ragged", False)}
    return [name for name, t in cache.cache_dict.items() if t.is_floating_point() and name not in views]


def edit_(t):
    """The edit, in place: a TransformerLens user's `x[..., 0] = ...` with no return value."""
    t[..., 0] = t[..., 0] * 0.5 + 3.0


def edited(t):
    t = t.clone()
    edit_(t)
    return t


def next_token_logits(model, tokens, hook):
    """The logits of one more token, decoded from the cache that a hooked forward over `tokens` filled."""
    cache = KVCache.for_model(model)
    edit = None if hook is None else hook[1]
    with torch.no_grad():
        model.run_with_hooks(tokens, past_kv_cache=cache, fwd_hooks=[] if hook is None else
                             [(hook[0], lambda t, hook: edit(t))])
        return model(tokens[:, -1:], past_kv_cache=cache)


def logits_and_grad(model, tokens, hook, grad: bool):
    """(logits, d sum(logits) / d W_E) with one forward hook; the gradient only when grad is on."""
    with torch.set_grad_enabled(grad):
        logits = model.run_with_hooks(tokens, fwd_hooks=[hook])
    if not grad:
        return logits, None
    (g,) = torch.autograd.grad(logits.sum(), [model.embed.weight])
    return logits.detach(), g


@pytest.fixture(scope="module")
def backend_models(checkpoints):
    models = {}
    for family, backend in BACKEND_CASES:
        models[family, backend] = HookedTransformer.from_pretrained(
            checkpoints[family, "base"], progress=False, experts_backend=backend
        )
    return models


@pytest.mark.parametrize("family, backend", BACKEND_CASES)
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_editing_in_place_equals_returning_the_edit_at_every_site(backend_models, family, backend, grad):
    """At every floating hook site: `edit_(x)` returning None gives bit for bit the logits (and the gradient)
    of returning the edited copy, and both differ from the unhooked run (the edit is not ignored)."""
    if backend == "triton":
        pytest.importorskip("triton")
    model = backend_models[family, backend]
    tokens = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(11))
    sites = floating_sites(model, tokens)
    if backend == "triton":
        # only the routed experts' sites differ between backends (the rest is the same torch code), and every
        # mixture layer runs the same kernels: one layer's sites, to keep the interpreter's time in bounds
        sites = [s for s in sites if s.startswith("blocks.1.") and s.endswith(EXPERT_SITES)]
        assert len(sites) == len(EXPERT_SITES)
    else:
        assert len(sites) > 30
    plain = model(tokens)
    observed = [s for s in sites if SITE_BY_NAME[table_name(s)].observed]
    assert (len(observed) > 0) == (backend == "torch")  # the router's distribution, hook_router_probs
    handed_on = [s for s in sites if SITE_BY_NAME[table_name(s)].handed_on]
    for site in sites:
        returned, g_returned = logits_and_grad(model, tokens, (site, lambda t, hook: edited(t)), grad)
        in_place, g_in_place = logits_and_grad(model, tokens, (site, lambda t, hook: edit_(t)), grad)
        if site in handed_on:  # read by the next forward only: this one is unchanged, the next one sees the edit
            assert torch.equal(returned, plain), f"{site}: an edit of the state handed on changed this forward"
            returned, in_place = (next_token_logits(model, tokens, (site, edit)) for edit in (edited, edit_))
            assert not torch.equal(returned, next_token_logits(model, tokens, None)), f"{site}: the edit changed nothing"
        elif site in observed:  # an observation site: nothing downstream reads it (test_router_probs: the cache does)
            assert torch.equal(returned, plain), f"{site}: an observation site's edit changed the logits"
        else:
            assert not torch.equal(returned, plain), f"{site}: the edit changed nothing"
        assert torch.equal(in_place, returned), f"{site}: in-place edit differs from the returned edit"
        if grad:
            assert torch.equal(g_in_place, g_returned), f"{site}: gradients differ"


@pytest.mark.parametrize("family", FAMILIES)
def test_norm_divides_by_the_hooked_scale(family_models, family, tokens):
    """Oracle written out: ln2's output is weight * x / scale, with x the cached resid_mid, for a replaced scale
    (where the feed-forward reads the stream unnormed, a post-norm block, the final norm's, reading resid_post)."""
    model = family_models[family]
    new_scale = lambda s, hook: s * 2.0 + 0.5  # noqa: E731
    norm = next(sub.norm for sub in model.blocks[1].sublayers() if sub.kind == "ffn")
    if norm is not None:
        site = f"blocks.1.{model.blocks[1].norm_name(norm)}"  # ln2; ln1 in a parallel block (Cohere2-MoE)
        # the stream ln2 reads: resid_mid, or resid_pre in a block of a feed-forward alone (Nemotron-H) or a
        # parallel block
        stream = f"blocks.1.hook_{ffn_stream(model.blocks[1])}"
    else:  # a post-norm block's feed-forward reads the stream unnormed: the final norm then
        norm, site, stream = model.ln_final, "ln_final", f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"
    _, cache = model.run_with_cache(tokens, names_filter=[stream, f"{site}.hook_normalized"])
    with model.hooks(fwd_hooks=[(f"{site}.hook_scale", new_scale)]):
        _, hooked = model.run_with_cache(tokens, names_filter=[f"{site}.hook_normalized", stream])
    x = hooked[stream].double()
    if family in LAYER_NORM_FAMILIES:  # a LayerNorm: the centred stream over its standard deviation, then the bias
        x = x - x.mean(-1, keepdim=True)
    scale = x.pow(2).mean(-1, keepdim=True).add(norm.eps).sqrt() * 2.0 + 0.5
    expected = norm_factor(norm).double() * x / scale
    if family in LAYER_NORM_FAMILIES and norm.bias is not None:
        expected = expected + norm.bias.double()
    torch.testing.assert_close(hooked[f"{site}.hook_normalized"].double(), expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(hooked[f"{site}.hook_normalized"], cache[f"{site}.hook_normalized"])


def test_gradient_flows_through_hook_scale(qwen_model, tokens):
    """d loss / d scale, checked against a finite difference of the loss in the scale of one position."""
    _, cache = qwen_model.run_with_cache(tokens, return_type="loss", incl_bwd=True, names_filter=["blocks.2.ln1.hook_scale"])
    grad = cache["blocks.2.ln1.hook_scale_grad"]
    assert grad.shape == (2, 20, 1) and grad.abs().sum() > 0
    eps = 1e-2

    def loss_with(delta):
        def shift(s, hook):
            s[0, 5, 0] += delta

        with torch.no_grad():
            return qwen_model.run_with_hooks(tokens, return_type="loss", fwd_hooks=[("blocks.2.ln1.hook_scale", shift)]).double()

    numeric = (loss_with(eps) - loss_with(-eps)) / (2 * eps)
    assert abs(numeric.item() - grad[0, 5, 0].item()) <= 1e-3 * max(1.0, abs(numeric.item()))


def test_incl_bwd_leaves_no_parameter_gradients(qwen_model, tokens):
    names = ["blocks.0.hook_resid_pre", "blocks.1.mlp.experts.hook_post"]
    for _ in range(2):
        _, cache = qwen_model.run_with_cache(tokens, return_type="loss", incl_bwd=True, names_filter=names)
        assert cache["blocks.0.hook_resid_pre_grad"].abs().sum() > 0
    assert all(p.grad is None for p in qwen_model.parameters())
    # and the activation gradient is the loss's own: compare with autograd on a leaf at the same site
    leaf = {}

    def make_leaf(t, hook):
        leaf["x"] = t.detach().requires_grad_()
        return leaf["x"]

    loss = qwen_model.run_with_hooks(tokens, return_type="loss", fwd_hooks=[("blocks.0.hook_resid_pre", make_leaf)])
    (expected,) = torch.autograd.grad(loss, [leaf["x"]])
    assert torch.equal(cache["blocks.0.hook_resid_pre_grad"], expected)


def test_backward_hooks_removed_with_the_call_do_not_fire(qwen_model, tokens):
    fired = []
    with pytest.warns(UserWarning, match="reset_hooks_end"):
        loss = qwen_model.run_with_hooks(tokens, return_type="loss", bwd_hooks=[("hook_logits", lambda g, hook: fired.append(1))])
    loss.backward()
    assert fired == []
    with qwen_model.hooks(bwd_hooks=[("hook_logits", lambda g, hook: fired.append(2))]):
        qwen_model(tokens, return_type="loss").backward()
    assert fired == [2]
    qwen_model.zero_grad(set_to_none=True)


def test_hooks_of_one_call_belong_to_its_thread(qwen_model):
    """Two threads run the same model at once, each with its own hook: each sees only its own, every time."""
    gen = torch.Generator().manual_seed(0)
    tokens = {t: torch.randint(0, 96, (1, 12), generator=gen) for t in ("a", "b")}
    scale = {"a": 0.5, "b": 2.0}
    expected = {
        t: qwen_model.run_with_hooks(tokens[t], fwd_hooks=[("blocks.1.hook_resid_mid", lambda x, hook, s=scale[t]: x * s)])
        for t in tokens
    }
    wrong_calls, mismatches = [], []
    barrier = threading.Barrier(2)

    def worker(t):
        def hook(x, hook):
            if threading.current_thread().name != t:
                wrong_calls.append((t, threading.current_thread().name))
            return x * scale[t]

        barrier.wait()
        for _ in range(15):
            out = qwen_model.run_with_hooks(tokens[t], fwd_hooks=[("blocks.1.hook_resid_mid", hook)])
            if not torch.equal(out, expected[t]):
                mismatches.append(t)

    threads = [threading.Thread(target=worker, args=(t,), name=t) for t in tokens]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert wrong_calls == [] and mismatches == []
    assert not any(hp.has_hooks for hp in qwen_model.hook_dict.values())


def test_module_hooks_apply_to_every_thread(qwen_model, tokens):
    """add_hook (not one call's) is the model's: a thread started afterwards sees it until reset_hooks()."""
    seen = []
    qwen_model.add_hook("hook_embed", lambda x, hook: seen.append(threading.current_thread().name))
    try:
        th = threading.Thread(target=lambda: qwen_model(tokens), name="other")
        th.start()
        th.join()
    finally:
        qwen_model.reset_hooks()
    assert seen == ["other"]


def test_replacement_on_another_device_names_the_hook_and_devices(qwen_model, tokens):
    with pytest.raises(HookShapeError, match=r"blocks\.0\.hook_resid_mid.*meta.*cpu"):
        qwen_model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_resid_mid", lambda x, hook: torch.empty_like(x, device="meta"))])
