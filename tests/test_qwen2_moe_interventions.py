"""The family notes' identities and the intervention rules of DESIGN.md, on HookedQwen2Moe."""

import pytest
import torch

from moelens import HookedTransformer


def moe_layers(model):
    return [i for i, m in enumerate(model.cfg.moe_layers) if m]


def test_identities(qwen_model, tokens):
    _, cache = qwen_model.run_with_cache(tokens)
    for layer in range(qwen_model.cfg.n_layers):
        torch.testing.assert_close(
            cache["resid_pre", layer] + cache["attn_out", layer] + cache["mlp_out", layer], cache["resid_post", layer],
            rtol=0, atol=1e-6,
        )
        mlp = f"blocks.{layer}.mlp"
        torch.testing.assert_close(cache[f"{mlp}.hook_routed_out"] + cache[f"{mlp}.hook_shared_out"], cache["mlp_out", layer], rtol=0, atol=0)
        torch.testing.assert_close(
            torch.sigmoid(cache[f"{mlp}.hook_shared_gate"]) * cache[f"{mlp}.shared_expert.hook_out"],
            cache[f"{mlp}.hook_shared_out"], rtol=0, atol=0,
        )
        # the routed sum is the slot sum of the weighted per-slot outputs
        torch.testing.assert_close(cache[f"{mlp}.hook_expert_outputs"].sum(2), cache[f"{mlp}.hook_routed_out"], rtol=0, atol=1e-6)
        top = cache["router_logits", layer].float().softmax(-1).topk(qwen_model.cfg.top_k[layer], dim=-1)
        assert torch.equal(top.indices, cache["expert_indices", layer])
        torch.testing.assert_close(top.values, cache["expert_weights", layer], rtol=0, atol=0)


def test_shapes_match_support_table(qwen_model, tokens):
    _, cache = qwen_model.run_with_cache(tokens)
    b, p = tokens.shape
    cfg = qwen_model.cfg
    expect = {
        "blocks.0.attn.hook_q": (b, p, cfg.n_heads, cfg.d_head),
        "blocks.0.attn.hook_k": (b, p, cfg.n_kv_heads, cfg.d_head),
        "blocks.0.attn.hook_pattern": (b, cfg.n_heads, p, p),
        "blocks.0.mlp.hook_router_logits": (b, p, cfg.n_experts),
        "blocks.0.mlp.hook_expert_indices": (b, p, cfg.top_k[0]),
        "blocks.0.mlp.experts.hook_post": (b, p, cfg.top_k[0], cfg.d_expert),
        "blocks.0.mlp.hook_expert_outputs": (b, p, cfg.top_k[0], cfg.d_model),
        "blocks.0.mlp.shared_expert.hook_post": (b, p, cfg.d_shared),
        "blocks.0.mlp.hook_shared_gate": (b, p, 1),
        "hook_logits": (b, p, cfg.d_vocab),
    }
    for name, shape in expect.items():
        assert tuple(cache[name].shape) == shape, name
    table = qwen_model.support(print_table=False)
    assert set(table.names()) == {n.replace("blocks.0.", "blocks.L.") for n in qwen_model.hook_dict if not n.startswith("blocks.") or n.startswith("blocks.0.")}
    row = {r.name: r for r in table.rows}["blocks.L.mlp.hook_expert_indices"]
    assert row.shape == f"[batch, pos, {cfg.top_k[0]}]" and row.standard == "expert_indices"
    assert any("hook_choice_scores" in a for a in table.absent)  # Solar's site, not Qwen's


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_ablation_touches_only_routed_tokens(qwen_path, tokens, dtype):
    model = HookedTransformer.from_pretrained(qwen_path, dtype=dtype, progress=False)
    _, cache = model.run_with_cache(tokens)
    for layer in moe_layers(model):
        idx = cache["expert_indices", layer]
        clean = cache["mlp_out", layer]
        for e in range(model.cfg.n_experts):
            def ablate(w, hook, e=e, idx=idx):
                return w.masked_fill(idx == e, 0)

            ablated = _run(model, tokens, layer, ablate)
            changed = (ablated != clean).any(-1)
            assert torch.equal(changed, (idx == e).any(-1)), (layer, e)


def _run(model, tokens, layer, fn):
    with model.hooks([(f"blocks.{layer}.mlp.hook_expert_weights", fn)]):
        _, cache = model.run_with_cache(tokens, names_filter=f"blocks.{layer}.hook_mlp_out")
    return cache[f"blocks.{layer}.hook_mlp_out"]


def test_replacing_router_logits_reroutes(qwen_model, tokens):
    layer, forced = 0, [5, 2, 7]
    k = qwen_model.cfg.top_k[layer]

    def force(logits, hook):
        new = torch.full_like(logits, -10.0)
        for rank, e in enumerate(forced[:k]):
            new[..., e] = 10.0 - rank
        return new

    with qwen_model.hooks([(f"blocks.{layer}.mlp.hook_router_logits", force)]):
        _, cache = qwen_model.run_with_cache(tokens)
    idx = cache["expert_indices", layer]
    assert torch.equal(idx, torch.tensor(forced[:k]).expand_as(idx))
    expected = torch.softmax(torch.tensor([10.0, 9.0, 8.0] + [-10.0] * 5), -1)[:k]
    torch.testing.assert_close(cache["expert_weights", layer], expected.expand_as(idx), rtol=0, atol=1e-6)
    # only the forced experts ran: per-slot neurons equal each forced expert applied to the token
    x = cache["blocks.0.ln2.hook_normalized"]
    W = qwen_model.blocks[0].mlp.experts.W_gate_up
    gate = torch.einsum("bpd,id->bpi", x, W[forced[0], : qwen_model.cfg.d_expert])
    torch.testing.assert_close(cache["blocks.0.mlp.experts.hook_pre"][:, :, 0], gate, rtol=1e-5, atol=1e-5)


def test_new_indices_reroute_and_weights_follow(qwen_model, tokens):
    """Writing hook_expert_indices re-routes; the weights are then read for the new experts."""
    def route_to_zero_one_two(idx, hook):
        return torch.tensor([0, 1, 2]).expand_as(idx).contiguous()

    with qwen_model.hooks([("blocks.0.mlp.hook_expert_indices", route_to_zero_one_two)]):
        _, cache = qwen_model.run_with_cache(tokens)
    scores = cache["blocks.0.mlp.hook_router_scores"]
    torch.testing.assert_close(cache["expert_weights", 0], scores[..., :3], rtol=0, atol=0)


def test_new_weights_are_not_renormalised(qwen_checkpoints, tokens):
    model = HookedTransformer.from_pretrained(qwen_checkpoints["norm_topk"], progress=False)
    half = lambda w, hook: w * 0.5  # noqa: E731
    _, clean = model.run_with_cache(tokens)
    with model.hooks([("blocks.0.mlp.hook_expert_weights", half)]):
        _, cache = model.run_with_cache(tokens)
    torch.testing.assert_close(cache["expert_weights", 0], clean["expert_weights", 0] * 0.5)
    torch.testing.assert_close(cache["blocks.0.mlp.hook_routed_out"], clean["blocks.0.mlp.hook_routed_out"] * 0.5, rtol=1e-5, atol=1e-6)


def test_replacing_expert_neurons_changes_the_output(qwen_model, tokens):
    zero = lambda t, hook: torch.zeros_like(t)  # noqa: E731
    with qwen_model.hooks([("blocks.1.mlp.experts.hook_post", zero)]):
        _, cache = qwen_model.run_with_cache(tokens)
    assert torch.count_nonzero(cache["blocks.1.mlp.hook_routed_out"]) == 0
    torch.testing.assert_close(cache["mlp_out", 1], cache["blocks.1.mlp.hook_shared_out"], rtol=0, atol=0)


def test_zeroing_shared_out_leaves_routed(qwen_model, tokens):
    zero = lambda t, hook: torch.zeros_like(t)  # noqa: E731
    with qwen_model.hooks([("blocks.0.mlp.hook_shared_out", zero)]):
        _, cache = qwen_model.run_with_cache(tokens)
    torch.testing.assert_close(cache["mlp_out", 0], cache["blocks.0.mlp.hook_routed_out"], rtol=0, atol=0)


def test_hooks_fire_in_family_order(qwen_model, tokens):
    order = []
    qwen_model.run_with_hooks(tokens, fwd_hooks=[(lambda n: n.startswith("blocks.0.mlp"), lambda t, hook: order.append(hook.name))])
    pos = {n: i for i, n in enumerate(order)}
    assert pos["blocks.0.mlp.shared_expert.hook_out"] < pos["blocks.0.mlp.hook_router_logits"]
    assert pos["blocks.0.mlp.hook_routed_out"] < pos["blocks.0.mlp.hook_shared_gate"] < pos["blocks.0.mlp.hook_shared_out"]


def test_query_scaling_at_rot_q_survives_into_scores(qwen_model, tokens):
    def double_head_1(q, hook):
        q = q.clone()
        q[:, :, 1] *= 2
        return q

    _, clean = qwen_model.run_with_cache(tokens, names_filter="blocks.0.attn.hook_attn_scores")
    with qwen_model.hooks([("blocks.0.attn.hook_rot_q", double_head_1)]):
        _, cache = qwen_model.run_with_cache(tokens, names_filter="blocks.0.attn.hook_attn_scores")
    causal = torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool).tril()
    a, b = clean["attn_scores", 0], cache["attn_scores", 0]
    torch.testing.assert_close(b[:, 1][:, causal], 2 * a[:, 1][:, causal], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b[:, 0], a[:, 0], rtol=0, atol=0)
