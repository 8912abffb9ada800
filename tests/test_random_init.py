"""HookedTransformer(HookedTransformerConfig(...)): TransformerLens's way of making a toy model to train, on a
registered family's architecture. The oracles: the config's own numbers (init statistics), the routing each
forward reports (which experts get a gradient), and the loss of a plain torch loop."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import moelens
from moelens import HookedTransformer, HookedTransformerConfig, MoeConfig
from moelens.verify import causal_lm_class

TL = dict(n_layers=2, d_model=64, n_ctx=64, d_head=16, n_heads=4, d_vocab=50, num_experts=4, experts_per_token=2, d_mlp=32)


def make(**changes):
    return HookedTransformerConfig(**{**TL, "family": "qwen2_moe", "seed": 0, **changes})


def test_the_config_is_the_familys_with_the_sizes_asked():
    cfg = make(n_key_value_heads=2, act_fn="silu", eps=1e-6, rotary_base=5e5)
    assert type(cfg).__name__ == "MoeConfig" and isinstance(cfg, HookedTransformerConfig)
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.d_head, cfg.d_vocab, cfg.n_ctx) == (64, 2, 4, 2, 16, 50, 64)
    assert (cfg.n_experts, cfg.top_k, cfg.d_expert, cfg.norm_eps, cfg.rope.theta) == (4, 2, 32, 1e-6, 5e5)
    assert cfg.initializer_range == pytest.approx(0.8 / 8) and cfg.seed == 0
    assert make().norm_eps == 1e-5  # TransformerLens's default eps
    assert HookedTransformerConfig.from_dict({**TL, "family": "mixtral"}).family == "mixtral"
    loaded = moelens.HookedTransformer.from_pretrained("tiny-code-moe")
    assert isinstance(loaded.cfg, HookedTransformerConfig) and issubclass(MoeConfig, HookedTransformerConfig)
    assert make(hf_config={"shared_expert_intermediate_size": 48}).d_shared == 48


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        ({"d_head": None}, TypeError, r"missing required field\(s\) \['d_head'\]"),
        ({"n_layers": 0}, ValueError, r"n_layers = 0; expected an integer >= 1"),
        ({"d_model": 64.0}, ValueError, r"d_model = 64.0; expected an integer"),
        ({"n_layer": 3}, TypeError, r"unknown field\(s\) 'n_layer' \(did you mean 'n_layers'\?\)"),
        ({"normalization_type": "LN"}, ValueError, r"normalization_type = 'LN' is not supported"),
        ({"positional_embedding_type": "standard"}, ValueError, r"positional_embedding_type = 'standard'"),
        ({"init_mode": "xavier_uniform"}, ValueError, r"init_mode = 'xavier_uniform'"),
        ({"family": "gpt2"}, ValueError, r"family = 'gpt2' is not a registered family.*'mixtral'"),
        ({"d_vocab": -1}, ValueError, r"d_vocab is required"),
        ({"experts_per_token": 5}, ValueError, r"num_experts_per_tok = 5.*between 1 and 4"),
        ({"n_heads": 3, "n_key_value_heads": 2}, ValueError, r"num_attention_heads \(3\) must be a multiple of num_key_value_heads \(2\)"),
        ({"family": "deepseek_v2", "hf_config": {"qk_nope_head_dim": 4}}, ValueError, r"does not read these fields as asked: d_head = 16 gives 12"),
        ({"family": "deepseek_v2", "d_head": 8}, ValueError, r"d_head = 8; the deepseek_v2 family's heads are .* above 8"),
        ({"num_experts": 2.5}, ValueError, r"num_experts = 2.5; expected an integer"),
        ({"family": "gpt_oss", "act_fn": "gelu"}, ValueError, r"act_fn = 'gelu' gives"),
        ({"initializer_range": float("nan")}, ValueError, r"initializer_range = nan"),
    ],
)
def test_bad_fields_are_named(changes, error, match):
    args = {**TL, "family": "qwen2_moe", **changes}
    args = {k: v for k, v in args.items() if v is not None}
    with pytest.raises(error, match=match):
        HookedTransformerConfig(**args)


def test_init_statistics_are_the_configs():
    """Every weight matrix normal(0, initializer_range) (its sample mean and std within 4 standard errors),
    biases 0, norm weights 1; the same seed the same weights, another seed other weights."""
    for cfg in (make(), make(initializer_range=0.02, d_model=128, d_mlp=64)):
        model = HookedTransformer(cfg)
        assert type(model).__name__ == "HookedQwen2Moe" and all(p.requires_grad for p in model.parameters())
        std = cfg.initializer_range
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "bias":
                assert torch.equal(p, torch.zeros_like(p)), name
            elif p.ndim >= 2:
                n = p.numel()
                assert abs(p.mean().item()) < 4 * std / math.sqrt(n), name
                assert abs(p.std().item() - std) < 4 * std / math.sqrt(2 * n), (name, p.std().item(), std)
            else:
                assert torch.equal(p, torch.ones_like(p)), name  # the norms
    a, b, c = HookedTransformer(make()), HookedTransformer(make()), HookedTransformer(make(seed=1))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    assert not torch.equal(a.W_E, c.W_E)


def test_dtype_and_float32_routers():
    model = HookedTransformer(make(family="mixtral", dtype=torch.bfloat16))
    assert model.cfg.dtype == torch.bfloat16 and model.W_E.dtype == torch.bfloat16
    assert model.blocks[0].mlp.experts.W_gate_up.dtype == torch.bfloat16
    float32 = {name for name, p in model.named_parameters() if p.dtype == torch.float32}
    family_build = type(model).build(model.cfg)  # what loading builds: the family's float32 modules
    assert float32 == {name for name, p in family_build.named_parameters() if p.dtype == torch.float32}


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_gradient_reaches_the_router_and_exactly_the_routed_experts(family):
    model = HookedTransformer(make(family=family))
    tokens = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    loss, cache = model(tokens, return_type="loss"), None
    _, cache = model.run_with_cache(tokens)
    loss.backward()
    for layer in range(model.cfg.n_layers):
        mlp = model.blocks[layer].mlp
        assert mlp.router.weight.grad.abs().sum() > 0
        routed = set(cache["expert_indices", layer].flatten().tolist())
        for name in ("W_gate_up", "W_down"):
            grad = getattr(mlp.experts, name).grad
            got = {e for e in range(4) if grad[e].abs().sum() > 0}
            assert got == routed, (layer, name, got, routed)


def test_a_plain_torch_loop_lowers_the_loss_on_a_fixed_batch():
    torch.manual_seed(0)
    model = HookedTransformer(make())
    tokens = torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        loss = model(tokens, return_type="loss")
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(50), abs=0.5)  # small logits at init: about uniform
    assert losses[-1] < 0.5 * losses[0], losses


def test_hooked_transformer_of_any_models_cfg_is_a_random_model_of_its_family():
    loaded = moelens.HookedTransformer.from_pretrained("tiny-code-moe")
    model = HookedTransformer(loaded.cfg, tokenizer=loaded.tokenizer)
    assert type(model) is type(loaded) and model.tokenizer is not None
    assert not torch.equal(model.W_E, loaded.W_E)
    assert model.W_E.std().item() == pytest.approx(0.8 / math.sqrt(loaded.cfg.d_model), rel=0.05)
    with pytest.raises(TypeError, match="cfg must be a config"):
        HookedTransformer({"n_layers": 2})
    with pytest.raises(ValueError, match="expert_storage 'fp8'"):
        HookedTransformer(dataclasses.replace(loaded.cfg, expert_storage="fp8"))


# the families that need their own fields at these sizes (four experts; d_head 16), and those fields
OWN_FIELDS = {
    "axk1": {"n_group": 1, "topk_group": 1},
    "deepseek_v3": {"n_group": 1, "topk_group": 1},
    "deepseek_v32": {"n_group": 1, "topk_group": 1},
    "longcat_flash": {"qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "head_dim": 8},
    # Ling's head_dim is its linear layers' head width, and transformers' config sets it to qk_rope_head_dim
    "bailing_hybrid": {"qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "head_dim": 8},
    # transformers' Mistral 4 cannot run the unscaled rotary (it turns all of head_dim), and reads the queries'
    # scaling by position from the rotary's settings
    "mistral4": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                     "original_max_position_embeddings": 16, "mscale": 1.0, "mscale_all_dim": 1.0,
                                     "llama_4_scaling_beta": 0.1}},
    # Beam's rotary settings are keyed by layer type (null: NoPE); four experts make one group
    "beam": {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                 "full_attention": None}, "n_group": 1, "topk_group": 1},
    # Mellum's rotary settings are keyed by layer type
    "mellum": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}},
    # MiMo-V2-Flash's too, each with transformers' default share 0.334 of d_head unless given (5 of 16: odd); its
    # sliding layers have twice num_key_value_heads kv heads, which must divide the heads
    "mimo_v2_flash": {"n_group": 1, "topk_group": 1, "num_key_value_heads": 2, "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.25}}},
}


@pytest.mark.parametrize("family", sorted({f.model_type for f in moelens.FAMILIES.values()}))
def test_every_family_builds_and_trains(family):
    """Each registered family: the config asked for (or, with its own fields, an error naming hf_config first),
    a random model whose loss starts near log(d_vocab) and whose routers all get a gradient somewhere."""
    args = {**TL, "n_layers": 3, "family": family, "seed": 0}
    if family in OWN_FIELDS:
        with pytest.raises(ValueError, match=r"hf_config=\{\.\.\.\}"):
            HookedTransformerConfig(**args)
        args["hf_config"] = OWN_FIELDS[family]
    model = HookedTransformer(HookedTransformerConfig(**args))
    assert type(model).model_type == family and model.cfg.d_model == 64 and model.cfg.n_experts == 4
    assert all(p.requires_grad for p in model.parameters())
    std = model.cfg.initializer_range
    for name, p in model.named_parameters():  # nothing left as torch.empty left it
        leaf = name.rsplit(".", 1)[-1]
        assert torch.isfinite(p).all(), name
        if leaf == "bias" or leaf.startswith("b_"):
            assert not p.any(), name
        elif p.ndim >= 2 and p.numel() >= 256:
            assert abs(p.std().item() / std - 1) < 0.2, (name, p.std().item(), std)
    loss = model(torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0)), return_type="loss")
    assert abs(loss.item() - math.log(50)) < 1.0, loss.item()
    loss.backward()
    moe = [block.mlp for block in model.blocks if block.is_moe]
    # PhiMoE's sparsemixer weighs a slot by a softmax over the experts within its jitter of the best: alone there
    # (as at random init), the weight is 1 and the router gets no gradient (transformers' training-mode
    # straight-through estimator is not moelens's forward)
    if family != "phimoe":
        assert moe and any(mlp.router.weight.grad.abs().sum() > 0 for mlp in moe)
    assert all(mlp.experts.W_down.grad.abs().sum() > 0 for mlp in moe)


@pytest.mark.parametrize("family", sorted({f.model_type for f in moelens.FAMILIES.values()}))
def test_the_architecture_is_transformers_for_the_config_json_it_writes(family, tmp_path):
    """transformers builds a model from the config.json HookedTransformerConfig writes; loaded into moelens, its
    config is the one asked for, its weights fit HookedTransformer(cfg) key for key, and give transformers'
    logits (float32, 1e-5). Four layers: transformers' hybrids need a softmax-attention layer among them."""
    transformers = pytest.importorskip("transformers")
    import tiny

    args = {**TL, "n_layers": 4, "family": family, "seed": 0, "hf_config": OWN_FIELDS.get(family)}
    written = moelens.tl_config.hf_config_from_tl(args)
    # as transformers reads a config.json file: its tagged floats ({"__float__": "Infinity"}) decoded
    config = transformers.AutoConfig.for_model(**transformers.PreTrainedConfig._decode_special_floats(written))
    # what AutoModelForCausalLM.from_config calls, for Mistral 4 too (which it does not map)
    reference = tiny.new_model(causal_lm_class(config)._from_config, config, seed=3).eval()
    loaded = HookedTransformer.from_pretrained(tiny.save_hf(reference, tmp_path / family), progress=False)
    model = HookedTransformer(HookedTransformerConfig(**args))
    # transformers writes DeepSeek-V3's default of one multi-token-prediction layer, which no forward runs
    mtp = {"mtp_layers": model.cfg.mtp_layers} if hasattr(model.cfg, "mtp_layers") else {}
    assert model.cfg == dataclasses.replace(loaded.cfg, **mtp)
    model.load_state_dict(loaded.state_dict(), strict=True)
    tokens = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = reference(tokens).logits
    assert (model(tokens) - want).abs().max().item() <= 1e-5
