"""TransformerLens's start_at_layer / stop_at_layer tests, ported: tests/integration/test_start_at_layer.py and
tests/integration/test_stop_at_layer.py. Port rules: tests/tl_port.py. TL builds random 3-layer models
(HookedTransformerConfig, d_vocab 50; test_stop_at_final 4 layers); here CODE (4 layers, d_vocab 4096 from its
config.json: TOKENS), with POS_EMBED, MIXTURE (blocks.1 and 2 are mixtures: mlp.hook_pre is the per-slot
experts.hook_pre) and LAYERS where TL's test means the last block(s) (said at the test).

test_start_at_layer_kwargs: TL builds a shortformer model with the gpt2 tokenizer; here CODE's own tokenizer,
and a rotary model has no shortformer embedding (POS_EMBED).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tl_port import CODE, HAS_POS_EMBED, config_json, load, mlp_site

D_VOCAB = config_json(CODE)["vocab_size"]  # TL's 50


@pytest.fixture(scope="module")
def model():
    return load(CODE)


@pytest.fixture
def setup_data(model) -> dict[str, Any]:
    model.reset_hooks(including_permanent=True)
    rand_input = torch.randint(0, 20, (2, 10))
    rand_embed, _, _, _ = model.input_to_embed(rand_input)
    yield {"model": model, "rand_input": rand_input, "rand_embed": rand_embed}
    model.reset_hooks(including_permanent=True)


# ---- tests/integration/test_start_at_layer.py -----------------------------------------------------------------
def test_start_at_layer_1(setup_data: dict[str, Any]):
    model, rand_embed = setup_data["model"], setup_data["rand_embed"]
    output, cache = model.run_with_cache(rand_embed, start_at_layer=1)

    assert output is not None
    assert "hook_embed" not in cache.keys()
    assert "hook_pos_embed" not in cache.keys()
    assert "blocks.0.hook_resid_pre" not in cache.keys()
    assert "blocks.1.hook_resid_pre" in cache.keys()
    assert "ln_final.hook_normalized" in cache.keys()


def test_start_run_with_hooks(setup_data: dict[str, Any]):
    model, rand_embed = setup_data["model"], setup_data["rand_embed"]

    counting_list = []

    def count_hook(activation, hook):
        counting_list.append(len(counting_list))
        return None

    output = model.run_with_hooks(
        input=rand_embed,
        start_at_layer=1,
        fwd_hooks=[
            ("hook_embed", count_hook),
            ("blocks.0.attn.hook_k", count_hook),
            (mlp_site(model, "pre", 1), count_hook),
            ("blocks.2.attn.hook_k", count_hook),
            (mlp_site(model, "pre", 2), count_hook),
        ],
    )

    assert output is not None
    assert len(counting_list) == 3


def test_start_manual_hooks(setup_data: dict[str, Any]):
    model, rand_embed = setup_data["model"], setup_data["rand_embed"]
    counting_list = []

    def count_hook(activation, hook):
        counting_list.append(len(counting_list))
        return None

    model.hook_embed.add_hook(count_hook)
    model.blocks[0].hook_mlp_out.add_hook(count_hook)
    model.blocks[-2].hook_resid_mid.add_hook(count_hook)  # LAYERS: TL's blocks[1] and [2], its last two
    model.blocks[-1].attn.hook_z.add_hook(count_hook)

    output = model(rand_embed, start_at_layer=-2)
    assert output is not None
    assert len(counting_list) == 2


def test_start_at_final(setup_data: dict[str, Any]):
    model, rand_embed = setup_data["model"], setup_data["rand_embed"]
    output, cache = model.run_with_cache(rand_embed, start_at_layer=-1)
    last = model.cfg.n_layers - 1  # LAYERS: TL's 2, the last of its 3 blocks

    assert output is not None
    assert "hook_embed" not in cache.keys()
    assert "hook_pos_embed" not in cache.keys()
    for layer in range(last):
        assert f"blocks.{layer}.hook_resid_pre" not in cache.keys()
        assert f"blocks.{layer}.hook_resid_post" not in cache.keys()
    assert f"blocks.{last}.hook_resid_pre" in cache.keys()
    assert f"blocks.{last}.hook_resid_post" in cache.keys()
    assert f"blocks.{last + 1}.hook_resid_pre" not in cache.keys()
    assert "ln_final.hook_normalized" in cache.keys()


def test_no_start_logit_output(setup_data: dict[str, Any]):
    model, rand_input = setup_data["model"], setup_data["rand_input"]
    output, cache = model.run_with_cache(rand_input, start_at_layer=None)

    assert output is not None
    assert isinstance(output, torch.Tensor)
    assert output.shape == (2, 10, D_VOCAB)

    assert "hook_embed" in cache.keys()
    assert ("hook_pos_embed" in cache.keys()) == HAS_POS_EMBED
    assert "blocks.0.hook_resid_pre" in cache.keys()
    assert "blocks.0.hook_resid_post" in cache.keys()
    assert "blocks.1.hook_resid_pre" in cache.keys()
    assert "blocks.1.hook_resid_post" in cache.keys()
    assert "blocks.2.hook_resid_pre" in cache.keys()
    assert "blocks.2.hook_resid_post" in cache.keys()
    assert "ln_final.hook_normalized" in cache.keys()


def test_no_start_none_output(setup_data: dict[str, Any]):
    model, rand_input = setup_data["model"], setup_data["rand_input"]
    output, cache = model.run_with_cache(rand_input, start_at_layer=None, return_type=None)

    assert output is None
    assert "hook_embed" in cache.keys()
    assert ("hook_pos_embed" in cache.keys()) == HAS_POS_EMBED
    assert "blocks.0.hook_resid_pre" in cache.keys()
    assert "blocks.0.hook_resid_post" in cache.keys()
    assert "blocks.1.hook_resid_pre" in cache.keys()
    assert "blocks.1.hook_resid_post" in cache.keys()
    assert "blocks.2.hook_resid_pre" in cache.keys()
    assert "blocks.2.hook_resid_post" in cache.keys()
    assert "ln_final.hook_normalized" in cache.keys()


def test_start_and_stop(setup_data: dict[str, Any]):
    model, rand_embed = setup_data["model"], setup_data["rand_embed"]
    output, cache = model.run_with_cache(rand_embed, start_at_layer=1, stop_at_layer=2)

    assert torch.allclose(output, cache["blocks.1.hook_resid_post"])
    assert "hook_embed" not in cache.keys()
    assert "hook_pos_embed" not in cache.keys()
    assert "blocks.0.hook_resid_pre" not in cache.keys()
    assert "blocks.0.hook_resid_post" not in cache.keys()
    assert "blocks.1.hook_resid_pre" in cache.keys()
    assert "blocks.1.hook_resid_post" in cache.keys()
    assert "blocks.2.hook_resid_pre" not in cache.keys()
    assert "blocks.2.hook_resid_post" not in cache.keys()
    assert "blocks.3.hook_resid_pre" not in cache.keys()
    assert "ln_final.hook_normalized" not in cache.keys()


def test_start_at_layer_kwargs(model):
    model.tokenizer.padding_side = "left"
    try:
        input = "As soon as this ferry boat docks I'm headed to the church to play bingo."

        (
            rand_embed,
            tokens,
            shortformer_pos_embed,
            attention_mask,
        ) = model.input_to_embed(input)
        assert tokens is not None and (shortformer_pos_embed is not None) == HAS_POS_EMBED and attention_mask is not None

        start_at_layer_output = model(
            rand_embed,
            tokens=tokens,
            shortformer_pos_embed=shortformer_pos_embed,
            attention_mask=attention_mask,
            start_at_layer=0,
            return_type="loss",
        )
        normal_output = model(input, return_type="loss")

        assert start_at_layer_output is not None
        assert normal_output is not None
        assert torch.allclose(start_at_layer_output, normal_output)
    finally:
        model.tokenizer.padding_side = "right"


# ---- tests/integration/test_stop_at_layer.py ------------------------------------------------------------------
def test_stop_at_embed(setup_data: dict[str, Any]):
    model, rand_input = setup_data["model"], setup_data["rand_input"]

    _, normal_cache = model.run_with_cache(rand_input)
    output, cache = model.run_with_cache(rand_input, stop_at_layer=0)

    assert torch.allclose(output, normal_cache["blocks.0.hook_resid_pre"])
    assert "hook_embed" in cache.keys()
    assert ("hook_pos_embed" in cache.keys()) == HAS_POS_EMBED
    assert "blocks.0.hook_resid_pre" not in cache.keys()
    assert "ln_final.hook_normalized" not in cache.keys()


def test_stop_run_with_hooks(setup_data: dict[str, Any]):
    model, rand_input = setup_data["model"], setup_data["rand_input"]

    counting_list = []

    def count_hook(activation, hook):
        counting_list.append(len(counting_list))
        return None

    output = model.run_with_hooks(
        rand_input,
        stop_at_layer=1,
        fwd_hooks=[
            ("hook_embed", count_hook),
            ("blocks.0.attn.hook_k", count_hook),
            (mlp_site(model, "pre", 1), count_hook),
        ],
    )

    _, normal_cache = model.run_with_cache(rand_input, stop_at_layer=1)
    assert torch.allclose(output, normal_cache["blocks.0.hook_resid_post"])
    assert len(counting_list) == 2


def test_stop_manual_hooks(setup_data: dict[str, Any]):
    model, rand_input = setup_data["model"], setup_data["rand_input"]
    _, normal_cache = model.run_with_cache(rand_input)

    counting_list = []

    def count_hook(activation, hook):
        counting_list.append(len(counting_list))
        return None

    model.hook_embed.add_hook(count_hook)
    model.blocks[0].hook_mlp_out.add_hook(count_hook)
    model.blocks[1].hook_resid_mid.add_hook(count_hook)
    model.blocks[-1].attn.hook_z.add_hook(count_hook)  # LAYERS: TL's blocks[2], the last of its 3

    output = model(rand_input, stop_at_layer=-1)
    # LAYERS: TL's blocks.1, the block before its last
    assert torch.allclose(output, normal_cache[f"blocks.{model.cfg.n_layers - 2}.hook_resid_post"])
    assert len(counting_list) == 3


def test_stop_at_layer_1(setup_data: dict[str, Any]):
    model, rand_input = setup_data["model"], setup_data["rand_input"]

    _, normal_cache = model.run_with_cache(rand_input)
    output, cache = model.run_with_cache(rand_input, stop_at_layer=1)

    assert torch.allclose(output, normal_cache["blocks.0.hook_resid_post"])
    assert "hook_embed" in cache.keys()
    assert ("hook_pos_embed" in cache.keys()) == HAS_POS_EMBED
    assert "blocks.0.hook_resid_pre" in cache.keys()
    assert "blocks.0.hook_resid_post" in cache.keys()
    assert "blocks.1.hook_resid_pre" not in cache.keys()
    assert "ln_final.hook_normalized" not in cache.keys()
    for key in cache.keys():
        if key.startswith("blocks.0"):
            continue
        elif key in ["hook_embed", "hook_pos_embed"]:
            continue
        else:
            assert False, f"Unexpected key {key} in cache."


def test_stop_at_final(setup_data: dict[str, Any]):
    model, rand_input = setup_data["model"], setup_data["rand_input"]  # TL builds 4 layers here, as CODE has

    _, normal_cache = model.run_with_cache(rand_input)
    output, cache = model.run_with_cache(rand_input, stop_at_layer=-1)

    assert torch.allclose(output, normal_cache["blocks.2.hook_resid_post"])
    assert "hook_embed" in cache.keys()
    assert ("hook_pos_embed" in cache.keys()) == HAS_POS_EMBED
    assert "blocks.0.hook_resid_pre" in cache.keys()
    assert "blocks.0.hook_resid_post" in cache.keys()
    assert "blocks.1.hook_resid_pre" in cache.keys()
    assert "blocks.1.hook_resid_post" in cache.keys()
    assert "blocks.2.hook_resid_pre" in cache.keys()
    assert "blocks.2.hook_resid_post" in cache.keys()
    assert "blocks.3.hook_resid_pre" not in cache.keys()
    assert "ln_final.hook_normalized" not in cache.keys()


def test_no_stop_logit_output(setup_data: dict[str, Any]):
    model, rand_input = setup_data["model"], setup_data["rand_input"]

    normal_output = model(rand_input)
    output, cache = model.run_with_cache(rand_input, stop_at_layer=None)

    assert torch.allclose(output, normal_output)
    assert isinstance(output, torch.Tensor)
    assert output.shape == (2, 10, D_VOCAB)

    assert "hook_embed" in cache.keys()
    assert ("hook_pos_embed" in cache.keys()) == HAS_POS_EMBED
    assert "blocks.0.hook_resid_pre" in cache.keys()
    assert "blocks.0.hook_resid_post" in cache.keys()
    assert "blocks.1.hook_resid_pre" in cache.keys()
    assert "blocks.1.hook_resid_post" in cache.keys()
    assert "blocks.2.hook_resid_pre" in cache.keys()
    assert "blocks.2.hook_resid_post" in cache.keys()
    assert "ln_final.hook_normalized" in cache.keys()


def test_no_stop_no_output(setup_data: dict[str, Any]):
    model, rand_input = setup_data["model"], setup_data["rand_input"]

    output, cache = model.run_with_cache(rand_input, stop_at_layer=None, return_type=None)

    assert output is None
    assert "hook_embed" in cache.keys()
    assert ("hook_pos_embed" in cache.keys()) == HAS_POS_EMBED
    assert "blocks.0.hook_resid_pre" in cache.keys()
    assert "blocks.0.hook_resid_post" in cache.keys()
    assert "blocks.1.hook_resid_pre" in cache.keys()
    assert "blocks.1.hook_resid_post" in cache.keys()
    assert "blocks.2.hook_resid_pre" in cache.keys()
    assert "blocks.2.hook_resid_post" in cache.keys()
    assert "ln_final.hook_normalized" in cache.keys()
