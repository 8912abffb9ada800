"""Sarvam MLA (HookedSarvamMla): DeepSeek-V3's blocks under Sarvam's config, against transformers'
DeepseekV3ForCausalLM run from SarvamMLAConfig. The generic suites compare every site of the base checkpoint;
here: Sarvam's original config spelling (every site against transformers, which translates it too), its
defaults, the refusals, greedy generation, verify and the embedded default (the plan at full size: the flagship
file, tests/test_flagships.py)."""

import json

import pytest
import torch

import tiny_sarvam_mla
from family_harness import (
    References, build_checkpoints, check_bit_exact, check_greedy_generation, copy_checkpoint, tokens,
)
from moelens import HookedTransformer
from moelens.cli import main
from moelens.models.sarvam_mla import HookedSarvamMla
from moelens.verify import compare
from test_family_deepseek_v3 import check_report


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return build_checkpoints(tmp_path_factory, "sarvam_mla", tiny_sarvam_mla.VARIANTS)


@pytest.fixture(scope="module")
def models(ckpts):
    return {v: HookedTransformer.from_pretrained(p, progress=False) for v, p in ckpts.items()}


@pytest.fixture(scope="module")
def refs(ckpts):
    return References(ckpts)


def test_sarvams_defaults_and_original_spelling(ckpts, models):
    config = json.loads((ckpts["original_spelling"] / "config.json").read_text())
    assert config["rope_scaling"]["type"] == "deepseek_yarn" and config["head_dim"] == 24
    assert "num_experts" in config and "n_routed_experts" not in config
    for variant in ("base", "original_spelling"):
        model = models[variant]
        cfg = model.cfg
        assert type(model) is HookedSarvamMla
        # Sarvam's defaults, which the tiny configs leave out: no query bottleneck, one group, one dense block
        assert cfg.q_lora_rank is None and (cfg.n_group, cfg.topk_group) == (1, 1)
        assert cfg.moe_layers == (False, True, True) and cfg.n_experts == 8 and cfg.d_shared == 24
        assert cfg.rope.kind == "yarn" and cfg.d_head == 20  # the query head: 12 nope + 8 rotary, not head_dim
    assert "num_experts" in models["original_spelling"].cfg.fields_read


@pytest.mark.parametrize("variant", ["original_spelling", "fused"])
def test_float32_every_site(models, refs, variant):
    model = models[variant]
    check_report(compare(model, refs(variant), tokens()), model)


def test_bfloat16_is_bit_exact(ckpts, refs):
    model = HookedTransformer.from_pretrained(ckpts["original_spelling"], dtype=torch.bfloat16, progress=False)
    check_bit_exact(compare(model, refs("original_spelling", torch.bfloat16), tokens()))


def test_greedy_generation_matches_transformers(models, refs):
    check_greedy_generation(models["original_spelling"], refs("original_spelling"), tokens(5, (3, 9)))  # no token 0: transformers would read it as padding


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(n_routed_experts=c["num_experts"] + 1), r"both num_experts = 8 and n_routed_experts = 9"),
    (lambda c: c.update(num_experts=0), r"config.json: num_experts = 0 \(int\); expected an integer >= 1"),
    (lambda c: c.update(q_head_dim=21), r"q_head_dim = 21 is not qk_nope_head_dim \+ qk_rope_head_dim \(12 \+ 8\)"),
], ids=["both_names", "bad_value", "q_head_dim"])
def test_config_refusals_name_the_files_fields(ckpts, tmp_path, edit, message):
    folder = copy_checkpoint(ckpts, tmp_path, "original_spelling")
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        HookedTransformer.from_pretrained(folder, progress=False)


def test_verify_command_and_embedded_default(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("moelens.defaults.cache_root", lambda: tmp_path)
    model = HookedTransformer.from_pretrained("tiny-sarvam-mla", progress=False)
    assert type(model) is HookedSarvamMla and model.cfg.n_experts == 16 and model.cfg.rope.kind == "yarn"
    assert main(["verify", "tiny-sarvam-mla"]) == 0  # the original spelling, read by transformers too
    out = capsys.readouterr().out
    assert "float32: OK" in out and "bfloat16: OK" in out
