"""HookPoint / HookedRootModule / ActivationCache behaviour."""

import pytest
import torch

from moelens.hooks import HookShapeError


def test_run_with_hooks_removes_hooks_even_when_forward_raises(qwen_model, tokens):
    def boom(t, hook):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        qwen_model.run_with_hooks(tokens, fwd_hooks=[("blocks.1.hook_resid_pre", boom)])
    assert not any(hp.has_hooks for hp in qwen_model.hook_dict.values())
    qwen_model(tokens)  # runs clean


def test_replacement_with_wrong_shape_or_dtype_names_the_hook(qwen_model, tokens):
    with pytest.raises(HookShapeError, match=r"blocks\.0\.mlp\.hook_expert_weights.*\(2, 20, 2\).*\(2, 20, 3\)"):
        qwen_model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.mlp.hook_expert_weights", lambda w, hook: w[..., :2])])
    with pytest.raises(HookShapeError, match="float64"):
        qwen_model.run_with_hooks(tokens, fwd_hooks=[("hook_embed", lambda x, hook: x.double())])


def test_unknown_hook_name_is_an_error(qwen_model, tokens):
    with pytest.raises(KeyError, match="blocks.0.mlp.hook_nope"):
        qwen_model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.mlp.hook_nope", lambda t, hook: None)])


def test_add_hook_permanent_prepend_and_reset(qwen_model, tokens):
    calls = []
    qwen_model.add_hook("hook_embed", lambda t, hook: calls.append("temp"))
    qwen_model.add_perma_hook("hook_embed", lambda t, hook: calls.append("perma"))
    qwen_model.add_hook("hook_embed", lambda t, hook: calls.append("first"), prepend=True)
    qwen_model(tokens)
    assert calls == ["first", "temp", "perma"]
    qwen_model.reset_hooks()
    calls.clear()
    qwen_model(tokens)
    assert calls == ["perma"]
    qwen_model.reset_hooks(including_permanent=True)
    calls.clear()
    qwen_model(tokens)
    assert calls == []


def test_hooks_context_and_filters(qwen_model, tokens):
    seen = []
    with qwen_model.hooks(fwd_hooks=[(lambda n: n.endswith("hook_resid_post"), lambda t, hook: seen.append(hook.name))]):
        qwen_model(tokens)
    assert seen == [f"blocks.{i}.hook_resid_post" for i in range(qwen_model.cfg.n_layers)]
    assert qwen_model.resolve_hook_names("blocks.*.hook_attn_out") == [f"blocks.{i}.hook_attn_out" for i in range(3)]
    assert qwen_model.resolve_hook_names(["hook_embed", "hook_logits"]) == ["hook_embed", "hook_logits"]


def test_cache_aliases_and_standard_names(qwen_model, tokens):
    _, cache = qwen_model.run_with_cache(tokens)
    full = cache["blocks.2.mlp.hook_router_logits"]
    assert cache["router_logits", 2] is full
    assert cache["resid_post", -1] is cache["blocks.2.hook_resid_post"]
    assert cache["layer_output", 0] is cache["blocks.0.hook_resid_post"]
    assert cache["layer_input", 1] is cache["blocks.1.hook_resid_pre"]
    assert cache["attention_output", 1] is cache["blocks.1.hook_attn_out"]
    assert cache["normalized", 1, "ln2"] is cache["blocks.1.ln2.hook_normalized"]
    assert cache["mlp_neurons", 0] is cache["blocks.0.mlp.experts.hook_post"]
    assert cache["logits"] is cache["hook_logits"]
    assert ("router_logits", 1) in cache and len(cache) == len(qwen_model.hook_dict)
    assert len(list(cache.keys())) == len(cache)
    with pytest.raises(KeyError, match="per-block"):
        cache["router_logits"]


def test_run_with_cache_filters_and_batch_dim(qwen_model, tokens):
    _, cache = qwen_model.run_with_cache(tokens[:1], names_filter=["blocks.0.mlp.hook_router_logits"], remove_batch_dim=True)
    assert list(cache.keys()) == ["blocks.0.mlp.hook_router_logits"]
    assert cache["router_logits", 0].shape == (tokens.shape[1], qwen_model.cfg.n_experts)
    _, cache = qwen_model.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_z"))
    assert len(cache) == qwen_model.cfg.n_layers
    with pytest.raises(ValueError, match="batch of one"):
        cache.remove_batch_dim()
    moved = cache.to("cpu")
    assert set(moved.keys()) == set(cache.keys())


def test_backward_hooks_and_incl_bwd(qwen_model, tokens):
    loss, cache = qwen_model.run_with_cache(tokens, return_type="loss", incl_bwd=True,
                                            names_filter=["blocks.0.hook_resid_pre", "blocks.1.mlp.hook_expert_weights"])
    assert loss.ndim == 0
    grad = cache["blocks.0.hook_resid_pre_grad"]
    assert grad.shape == cache["blocks.0.hook_resid_pre"].shape and grad.abs().sum() > 0
    assert cache["blocks.1.mlp.hook_expert_weights_grad"].abs().sum() > 0
    grads = []
    loss = qwen_model.run_with_hooks(tokens, return_type="loss", bwd_hooks=[("hook_logits", lambda g, hook: grads.append(g))],
                                     reset_hooks_end=False)
    loss.backward()
    qwen_model.reset_hooks()
    assert grads and grads[0].shape == (2, 20, qwen_model.cfg.d_vocab)
    qwen_model.zero_grad(set_to_none=True)


def test_forward_options(qwen_model, tokens):
    logits = qwen_model(tokens)
    loss = qwen_model(tokens, return_type="loss")
    manual = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    torch.testing.assert_close(loss, manual)
    per_token = qwen_model(tokens, return_type="loss", loss_per_token=True)
    assert per_token.shape == (2, 19)
    both = qwen_model(tokens, return_type="both")
    torch.testing.assert_close(both[0], logits)
    torch.testing.assert_close(both[1], loss)
    assert qwen_model(tokens, return_type=None) is None
    resid = qwen_model(tokens, stop_at_layer=2)
    _, cache = qwen_model.run_with_cache(tokens)
    torch.testing.assert_close(resid, cache["resid_pre", 2], rtol=0, atol=0)
    torch.testing.assert_close(qwen_model(resid, start_at_layer=2), logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match="return_type"):
        qwen_model(tokens, return_type="logit")


def test_padded_loss_ignores_padding(qwen_model):
    tokens = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(9))
    padded = torch.cat([torch.zeros(1, 4, dtype=torch.long), tokens], 1)
    mask = torch.cat([torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 12, dtype=torch.long)], 1)
    torch.testing.assert_close(qwen_model(padded, attention_mask=mask, return_type="loss"), qwen_model(tokens, return_type="loss"), rtol=1e-5, atol=1e-6)


def test_out_of_range_expert_indices_from_a_hook(qwen_model, tokens):
    n = qwen_model.cfg.n_experts
    with pytest.raises(IndexError, match=rf"blocks\.0\.mlp\.hook_expert_indices: .*\[0, {n}\)"):
        qwen_model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.mlp.hook_expert_indices", lambda i, hook: i.clamp(max=0) + n)])


def test_short_names_select_a_site_in_every_block(qwen_checkpoints, tokens):
    from moelens import HookedTransformer

    model = HookedTransformer.from_pretrained(qwen_checkpoints["dense_block"], progress=False)
    _, cache = model.run_with_cache(tokens, names_filter=["router_logits", "resid_post"])
    assert sorted(cache.keys()) == sorted(
        ["blocks.0.mlp.hook_router_logits", "blocks.2.mlp.hook_router_logits"]  # block 1 is dense
        + [f"blocks.{i}.hook_resid_post" for i in range(3)]
    )
    assert model.resolve_hook_names("mlp_neurons") == [
        "blocks.0.mlp.experts.hook_post", "blocks.1.mlp.hook_post", "blocks.2.mlp.experts.hook_post"
    ]


def test_get_act_name():
    from moelens.utils import get_act_name

    assert get_act_name("resid_pre", 3) == "blocks.3.hook_resid_pre"
    assert get_act_name("router_logits", 0) == "blocks.0.mlp.hook_router_logits"
    assert get_act_name("layer_output", 2) == "blocks.2.hook_resid_post"
    assert get_act_name("normalized", 1, "ln2") == "blocks.1.ln2.hook_normalized"
    assert get_act_name("logits") == "hook_logits"
    # TransformerLens's rules (more in test_tl_parity_names.py)
    assert get_act_name("attn", 0) == "blocks.0.attn.hook_pattern"
    assert get_act_name("k6") == "blocks.6.attn.hook_k"
    assert get_act_name("k", 6, "a") == "blocks.6.attn.hook_k"
    with pytest.raises(ValueError):
        get_act_name("no_such_site", 0)
