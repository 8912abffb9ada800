"""Aria's text model (aria_text: Llama attention, a top-k-of-logits router with a softmax over the chosen k in the
model's dtype, routed experts stored stacked and transposed as fc1 / fc2, shared experts) against transformers' own
AriaTextForCausalLM on the same tiny checkpoints. The generic suites compare every site of the base checkpoint;
here: what each variant is, every site of each variant, bfloat16 bit for bit, generation, the stored layout and
transformers' module spelling, the refusals, and the embedded default."""

import pytest
import torch
from safetensors.torch import load_file

import tiny_aria_text
from family_harness import (
    ATTENTION_SITES, BLOCK_SITES, ROUTER_SITES, References, build_checkpoints, check_bit_exact,
    check_greedy_generation, check_report, copy_checkpoint, left_padded, rewrite_tensors, stored_keys, tokens,
)
from moelens import HookedTransformer
from moelens.cli import main
from moelens.loaders.errors import CheckpointError
from moelens.models.aria_text import AriaTopKLogitsSoftmax, HookedAriaText
from moelens.models.components import SharedExpertMoe
from moelens.verify import compare

VARIANTS = [v for (_, v) in tiny_aria_text.VARIANTS]
PER_BLOCK = (*ATTENTION_SITES, *BLOCK_SITES, *ROUTER_SITES, "mlp.shared_expert.hook_out")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return build_checkpoints(tmp_path_factory, "aria_text", tiny_aria_text.VARIANTS)


@pytest.fixture(scope="module")
def models(checkpoints):
    return {v: HookedTransformer.from_pretrained(p, progress=False) for v, p in checkpoints.items()}


@pytest.fixture(scope="module")
def references(checkpoints):
    return References(checkpoints)


def test_variants_are_what_they_claim(models, checkpoints):
    base, biased = models["base"].cfg, models["biased"].cfg
    assert (base.d_expert, base.d_shared, base.top_k) == (24, 48, 3) and not base.qkv_bias
    assert (biased.d_shared, biased.top_k, biased.act_fn) == (24, 1, "gelu_pytorch_tanh") and biased.qkv_bias
    assert biased.expert_spec().activation.act == "silu"  # the routed experts are SiLU-gated whatever hidden_act says
    for model in models.values():
        assert all(type(b.mlp) is SharedExpertMoe and type(b.mlp.router) is AriaTopKLogitsSoftmax for b in model.blocks)
    assert len(list(checkpoints["sharded"].glob("*.safetensors"))) > 1
    keys = stored_keys(checkpoints["base"])
    assert "model.layers.0.mlp.experts.fc1.weight" in keys and not any(".experts.0." in k for k in keys)


@pytest.mark.parametrize("variant", VARIANTS)
def test_float32_every_site(models, references, variant):
    model = models[variant]
    assert type(model) is HookedAriaText
    check_report(compare(model, references[variant], tokens()), model, lambda layer: PER_BLOCK)


@pytest.mark.parametrize("variant", ["base", "biased"])
def test_bfloat16_is_bit_exact(checkpoints, references, variant):
    model = HookedTransformer.from_pretrained(checkpoints[variant], dtype=torch.bfloat16, progress=False)
    check_bit_exact(compare(model, references(variant, torch.bfloat16), tokens()))


@pytest.mark.parametrize("variant,padded", [("base", True), ("biased", False)])
def test_greedy_generation_matches_transformers(models, references, variant, padded):
    prompt = left_padded(5, (3, 9), (0, 3, 1)) if padded else (tokens(5, (3, 9)), None)
    check_greedy_generation(models[variant], references[variant], *prompt, new=24)


def test_stored_layout_and_module_spelling(checkpoints, models, tmp_path):
    """fc1 [E, d_model, 2 * d_expert] holds gate then up columns, fc2 [E, d_expert, d_model]: moelens's stacks are
    their transposes; transformers' module names (gate_up_proj, down_proj) for the same tensors read the same."""
    stored = load_file(str(checkpoints["base"] / "model.safetensors"))
    experts = models["base"].blocks[1].mlp.experts
    assert torch.equal(experts.W_gate_up, stored["model.layers.1.mlp.experts.fc1.weight"].transpose(-2, -1))
    assert torch.equal(experts.W_down, stored["model.layers.1.mlp.experts.fc2.weight"].transpose(-2, -1))
    folder = copy_checkpoint(checkpoints, tmp_path)

    def module_names(t):
        for layer in range(3):
            e = f"model.layers.{layer}.mlp.experts"
            t[f"{e}.gate_up_proj"], t[f"{e}.down_proj"] = t.pop(f"{e}.fc1.weight"), t.pop(f"{e}.fc2.weight")

    rewrite_tensors(folder, module_names)
    model = HookedTransformer.from_pretrained(folder, progress=False)
    assert torch.equal(model(tokens()), models["base"](tokens()))


def test_refusals_name_the_field():
    raw = tiny_aria_text.aria_text_config().to_dict()
    for change, message in (
        ({"mlp_bias": True}, "mlp_bias = true"),
        ({"moe_topk": 9}, "moe_topk"),
        ({"moe_num_shared_experts": 0}, "moe_num_shared_experts"),
    ):
        with pytest.raises(ValueError, match=message):
            HookedAriaText.config_from_hf({**raw, **change})


@pytest.mark.parametrize("key", ["model.layers.2.mlp.experts.fc2.weight", "model.layers.0.mlp.router.weight",
                                 "model.layers.1.mlp.shared_experts.gate_proj.weight"])
def test_missing_tensor_is_named(checkpoints, tmp_path, key):
    folder = copy_checkpoint(checkpoints, tmp_path)
    rewrite_tensors(folder, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match="missing") as info:
        HookedTransformer.from_pretrained(folder, progress=False)
    assert key in str(info.value)


def test_verify_command_and_embedded_default(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("moelens.defaults.cache_root", lambda: tmp_path)
    model = HookedTransformer.from_pretrained("tiny-aria-text", progress=False)
    assert type(model) is HookedAriaText and model.cfg.n_experts == 16
    assert main(["verify", "tiny-aria-text"]) == 0
    out = capsys.readouterr().out
    assert "float32: OK" in out and "bfloat16: OK" in out
