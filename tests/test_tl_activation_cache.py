"""TransformerLens's ActivationCache tests, ported: tests/acceptance/test_activation_cache.py and
tests/integration/test_cache_pos_slice.py. Port rules: tests/tl_port.py.

TL's load_model("solu-2l", fold_ln, center_unembed, center_writing_weights, refactor_factored_attn_matrices)
and attn-only-2l are CODE as it loads (moelens refuses centering writing weights and refactoring for an RMSNorm,
rotary model; see from_pretrained); block 0 is dense as solu-2l's blocks are, blocks 1-3 are mixtures.
TOKENS: TL's IOI names (" Mary", " John", ...) become words that are single tokens of CODE's vocabulary, in
prompts of TL's form. test_cache_pos_slice's tiny-stories-1M is CODE, with POS_EMBED and MIXTURE.

Deliberate differences stay as TL wrote them, xfail(strict) with the reason (README, "Differences from
TransformerLens"); next to each, the same TL assertions where the difference does not reach.
"""

from __future__ import annotations

import pytest
import torch
from tl_port import CODE, HAS_POS_EMBED, batched, load, mlp_site, no_grad

from moelens import utils
from moelens.utils import Slice

# Create IOI prompts (TOKENS: names that are one token each in CODE's vocabulary)
ioi_prompt_formats = [
    "When key and value went to the shops,{} gave the bag to",
    "When path and name went to the park,{} gave the ball to",
    "When data and file went to the shops,{} gave an apple to",
    "After text and line went to the park,{} gave a drink to",
]
ioi_names = [
    (" value", " key"),
    (" path", " name"),
    (" data", " file"),
    (" text", " line"),
]

VIEWS_HAVE_NO_BATCH_AXIS = (
    "the per-expert views blocks.L.mlp.experts.E.hook_* are [routed, d_expert] rows, with no batch axis: "
    "remove_batch_dim keeps them as they are and apply_slice_to_batch_dim refuses them (TL cuts their rows as "
    "if they were batch rows)"
)
REMAINDER_AT_LAYER_0 = (
    "TL's remainder at layer=0 is the final resid_post (its resid_post of layer - 1 = -1 wraps to the last "
    "block); moelens's is the stream entering block 0, the embedding, what the heads before block 0 (none) "
    "leave out"
)
MIXTURE_HAS_NO_DENSE_NEURONS = (
    "block 1 is a mixture: it has no dense blocks.1.mlp.hook_post / W_out (neither has TL's MoE); its neurons "
    "are per routing slot, get_neuron_results -> [..., top_k, d_expert, d_model] (the dense block 0 passes TL's "
    "test: *_on_the_dense_block)"
)


def get_ioi_tokens_and_answer_tokens(model):
    # List of prompts
    prompts = []
    # List of answers, in the format (correct, incorrect)
    answers = []
    # List of the token (ie an integer) corresponding to each answer, in the format (correct_token, incorrect_token)
    answer_tokens = []
    for i in range(len(ioi_prompt_formats)):
        for j in range(2):
            answers.append((ioi_names[i][j], ioi_names[i][1 - j]))
            answer_tokens.append(
                (
                    model.to_single_token(answers[-1][0]),
                    model.to_single_token(answers[-1][1]),
                )
            )
            # Insert the *incorrect* answer to the prompt, making the correct answer the indirect object.
            prompts.append(ioi_prompt_formats[i].format(answers[-1][1]))
    answer_tokens = torch.tensor(answer_tokens)

    tokens = model.to_tokens(prompts, prepend_bos=True)

    return tokens, answer_tokens


@pytest.fixture(scope="module")
def ioi():
    """(model, tokens, answer_tokens, cache): TL's tests each load the model and run it; here once."""
    model = load(CODE)
    tokens, answer_tokens = get_ioi_tokens_and_answer_tokens(model)
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    return model, tokens, answer_tokens, cache


@no_grad
def test_logit_attrs_matches_reference_code(ioi):
    model, tokens, answer_tokens, cache = ioi

    # Get accumulated resid
    accumulated_residual = cache.accumulated_resid(layer=-1, incl_mid=True, pos_slice=-1)

    # Get ref ave logit diffs (cribbed notebook code)
    answer_residual_directions = model.tokens_to_residual_directions(answer_tokens)
    logit_diff_directions = answer_residual_directions[:, 0] - answer_residual_directions[:, 1]
    scaled_residual_stack = cache.apply_ln_to_stack(accumulated_residual, layer=-1, pos_slice=-1)
    ref_ave_logit_diffs = torch.einsum("...bd,bd->...", scaled_residual_stack, logit_diff_directions) / len(tokens)

    # Get our ave logit diffs
    logit_diffs = cache.logit_attrs(
        accumulated_residual,
        pos_slice=-1,
        tokens=answer_tokens[:, 0],
        incorrect_tokens=answer_tokens[:, 1],
    )
    ave_logit_diffs = logit_diffs.mean(dim=-1)

    assert torch.isclose(ref_ave_logit_diffs, ave_logit_diffs, atol=1.1e-7).all()


@no_grad
def test_logit_accumulated_resid_on_last_layer_variants(ioi):
    model, _, _, cache = ioi
    accumulated_resid = cache.accumulated_resid(layer=-1, incl_mid=True, pos_slice=-1)
    assert torch.equal(
        accumulated_resid,
        cache.accumulated_resid(layer=model.cfg.n_layers, incl_mid=True, pos_slice=-1),
    )

    assert torch.equal(accumulated_resid, cache.accumulated_resid(layer=None, incl_mid=True, pos_slice=-1))


@no_grad
def test_logit_accumulated_resid_without_mid(ioi):
    _, _, _, cache = ioi
    accumulated_resid, labels = cache.accumulated_resid(layer=-1, incl_mid=False, pos_slice=-1, return_labels=True)
    assert len(labels) == accumulated_resid.size(0)
    assert all("mid" not in label for label in labels)


@no_grad
def test_logit_attrs_works_for_all_input_shapes(ioi):
    model, _, answer_tokens, cache = ioi

    # Get accumulated resid
    accumulated_residual = cache.accumulated_resid(layer=-1, incl_mid=True, pos_slice=-1, return_labels=False)

    # Get ref logit diffs (cribbed notebook code)
    answer_residual_directions = model.tokens_to_residual_directions(answer_tokens)
    logit_diff_directions = answer_residual_directions[:, 0] - answer_residual_directions[:, 1]
    scaled_residual_stack = cache.apply_ln_to_stack(accumulated_residual, layer=-1, pos_slice=-1)
    ref_logit_diffs = torch.einsum("...d,...d->...", scaled_residual_stack, logit_diff_directions)

    # All tokens
    logit_diffs = cache.logit_attrs(
        accumulated_residual,
        pos_slice=-1,
        tokens=answer_tokens[:, 0],
        incorrect_tokens=answer_tokens[:, 1],
    )
    assert torch.isclose(ref_logit_diffs, logit_diffs).all()

    # Single token
    batch = -1
    logit_diffs = cache.logit_attrs(
        accumulated_residual,
        batch_slice=batch,
        pos_slice=Slice(-1),
        tokens=answer_tokens[batch, 0],
        incorrect_tokens=answer_tokens[batch, 1],
    )
    assert torch.isclose(ref_logit_diffs[:, batch], logit_diffs).all()

    # Single token (int)
    batch = -1
    logit_diffs = cache.logit_attrs(
        accumulated_residual,
        batch_slice=Slice(batch),
        pos_slice=-1,
        tokens=int(answer_tokens[batch, 0]),
        incorrect_tokens=int(answer_tokens[batch, 1]),
    )
    assert torch.isclose(ref_logit_diffs[:, batch], logit_diffs).all()

    # Single token (str)
    batch = -1
    logit_diffs = cache.logit_attrs(
        accumulated_residual,
        batch_slice=batch,
        pos_slice=-1,
        tokens=model.to_string(answer_tokens[batch, 0]),
        incorrect_tokens=model.to_string(answer_tokens[batch, 1]),
    )
    assert torch.isclose(ref_logit_diffs[:, batch], logit_diffs).all()

    # Single token and residual stack without batch dim
    batch = -1
    logit_diffs = cache.logit_attrs(
        accumulated_residual[:, batch, :],
        has_batch_dim=False,
        batch_slice=batch,
        pos_slice=-1,
        tokens=answer_tokens[batch, 0],
        incorrect_tokens=answer_tokens[batch, 1],
    )
    assert torch.isclose(ref_logit_diffs[:, batch], logit_diffs).all()

    # Array slice of tokens
    batch = [2, 5, 7]
    logit_diffs = cache.logit_attrs(
        accumulated_residual,
        batch_slice=batch,
        pos_slice=-1,
        tokens=answer_tokens[batch, 0],
        incorrect_tokens=answer_tokens[batch, 1],
    )
    assert torch.isclose(ref_logit_diffs[:, batch], logit_diffs).all()

    # Different shape for tokens and incorrect_tokens
    with pytest.raises(ValueError):
        cache.logit_attrs(
            accumulated_residual[:, batch, :],
            has_batch_dim=False,
            batch_slice=batch,
            pos_slice=-1,
            tokens=answer_tokens[batch, 0],
            incorrect_tokens=answer_tokens[batch, 0:1],
        )

    # No incorrect tokens
    ref_logit_diffs = torch.einsum("...d,...d->...", scaled_residual_stack, answer_residual_directions[:, 0])
    logit_diffs = cache.logit_attrs(
        accumulated_residual,
        pos_slice=-1,
        tokens=answer_tokens[:, 0],
        incorrect_tokens=None,
    )
    assert torch.isclose(ref_logit_diffs, logit_diffs).all()


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="this TL test expects apply_ln=True to divide by the final norm's cached scale (TL 2); TL 3.9's own "
    "accumulated_resid(apply_ln=True) up to the final stream recomputes the norm per stream "
    "(apply_ln_to_stack(recompute_ln=True), the logit-lens fix) and fails it as moelens's does "
    "(test_accumulated_resid_apply_ln_recomputes_the_final_norm)",
)
@no_grad
def test_accumulated_resid_with_apply_ln(ioi):
    model, _, _, cache = ioi

    # Get accumulated resid and apply ln seperately (cribbed notebook code)
    accumulated_residual = cache.accumulated_resid(layer=-1, incl_mid=True, pos_slice=-1)
    ref_scaled_residual_stack = cache.apply_ln_to_stack(accumulated_residual, layer=-1, pos_slice=-1)

    # Get scaled_residual_stack using apply_ln parameter
    scaled_residual_stack = cache.accumulated_resid(layer=-1, incl_mid=True, pos_slice=-1, apply_ln=True)
    assert torch.isclose(ref_scaled_residual_stack, scaled_residual_stack, atol=1e-7).all()

    # Now do the same but using None as the layer and Slice(-1) as the pos_slice
    scaled_residual_stack, labels = cache.accumulated_resid(
        layer=None, incl_mid=True, pos_slice=Slice(-1), apply_ln=True, return_labels=True
    )
    assert torch.isclose(ref_scaled_residual_stack, scaled_residual_stack, atol=1e-7).all()

    expected_labels = []
    for l in range(model.cfg.n_layers + 1):
        if l == model.cfg.n_layers:
            expected_labels.append("final_post")
            continue
        expected_labels.append(f"{l}_pre")
        expected_labels.append(f"{l}_mid")

    assert labels == expected_labels


@no_grad
def test_accumulated_resid_apply_ln_recomputes_the_final_norm(ioi):
    """The other side of test_accumulated_resid_with_apply_ln: TL 3.9's behaviour. Each stream goes through the
    final norm on its own: the final one gives the norm's cached output, and `@ W_U` the model's logits."""
    model, tokens, _, cache = ioi
    accumulated_residual = cache.accumulated_resid(layer=-1, incl_mid=True, pos_slice=-1)
    scaled = cache.accumulated_resid(layer=-1, incl_mid=True, pos_slice=-1, apply_ln=True)
    assert torch.equal(scaled, cache.apply_ln_to_stack(accumulated_residual, layer=-1, pos_slice=-1, recompute_ln=True))
    norm = model.ln_final
    x = accumulated_residual
    by_hand = norm.weight * x / (x.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt()
    torch.testing.assert_close(scaled, by_hand, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(scaled[-1], cache["ln_final.hook_normalized"][:, -1], rtol=0, atol=1e-6)
    torch.testing.assert_close(scaled[-1] @ model.W_U, model(tokens)[:, -1], rtol=1e-5, atol=1e-5)
    # a block's input: its ln1's cached scale, then its weight (1 after fold_ln, as in TransformerLens)
    mid = cache.accumulated_resid(layer=2, pos_slice=-1, apply_ln=True)
    expected = cache.accumulated_resid(layer=2, pos_slice=-1) / cache["scale", 2, "ln1"][:, -1] * model.blocks[2].ln1.weight
    torch.testing.assert_close(mid, expected)
    with pytest.raises(ValueError, match="recompute_ln=True.*layer must be None, -1 or 4, got 2"):
        cache.apply_ln_to_stack(accumulated_residual, layer=2, pos_slice=-1, recompute_ln=True)


@no_grad
def test_decompose_resid_with_apply_ln(ioi):
    _, _, _, cache = ioi

    # Get decomposed resid and apply ln seperately (cribbed notebook code)
    per_layer_residual = cache.decompose_resid(layer=-1, pos_slice=-1)
    ref_scaled_residual_stack = cache.apply_ln_to_stack(per_layer_residual, layer=-1, pos_slice=-1)

    # Get scaled_residual_stack using apply_ln parameter
    scaled_residual_stack = cache.decompose_resid(layer=None, pos_slice=Slice(-1), apply_ln=True)

    assert torch.isclose(ref_scaled_residual_stack, scaled_residual_stack, atol=1e-7).all()


@no_grad
def test_decompose_resid_including_attention(ioi):
    _, _, _, cache = ioi

    # LAYERS: TL's range(model.cfg.n_layers) is its 2 blocks, every attention output up to block 1's MLP
    ref_attention_resids = torch.stack([cache["attn_out", l][:, -1] for l in range(2)])
    residual_stack = cache.decompose_resid(
        layer=1, pos_slice=Slice(-1), mlp_input=True, apply_ln=False, incl_embeds=False, mode="attn"
    )

    assert torch.isclose(ref_attention_resids, residual_stack, atol=1e-7).all()


@no_grad
def test_stack_head_results_with_apply_ln(ioi):
    _, _, _, cache = ioi

    # Get per head resid stack and apply ln seperately (cribbed notebook code)
    per_head_residual = cache.stack_head_results(layer=-1, pos_slice=-1)
    ref_scaled_residual_stack = cache.apply_ln_to_stack(per_head_residual, layer=None, pos_slice=Slice(-1))

    # Get scaled_residual_stack using apply_ln parameter
    scaled_residual_stack = cache.stack_head_results(layer=-1, pos_slice=-1, apply_ln=True)

    assert torch.isclose(ref_scaled_residual_stack, scaled_residual_stack, atol=1e-7).all()


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=REMAINDER_AT_LAYER_0)
@no_grad
def test_stack_head_results_including_remainder(ioi):
    model, _, _, cache = ioi

    ref_resid_post = cache["resid_post", 0][None, :, -1]
    per_head_residual, labels = cache.stack_head_results(layer=1, pos_slice=-1, incl_remainder=True, return_labels=True)
    remainder = ref_resid_post - per_head_residual[:-1].sum(dim=0)
    assert torch.isclose(remainder, per_head_residual[-1]).all()
    assert labels[:-1] == [f"L0H{i}" for i in range(model.cfg.n_heads)]
    assert labels[-1] == "remainder"

    ref_resid_post = cache["resid_post", -1][None, :, -1]
    per_head_residual, labels = cache.stack_head_results(layer=0, pos_slice=-1, incl_remainder=True, return_labels=True)
    assert torch.isclose(ref_resid_post, per_head_residual, atol=1e-7).all()
    assert len(labels) == 1
    assert labels[-1] == "remainder"

    per_head_residual, labels = cache.stack_head_results(layer=0, pos_slice=-1, incl_remainder=False, return_labels=True)
    assert torch.isclose(per_head_residual, torch.zeros_like(per_head_residual)).all()
    assert len(labels) == 0


@no_grad
def test_stack_head_results_remainder_at_layer_0_is_the_embedding(ioi):
    """The other side of REMAINDER_AT_LAYER_0, with the rest of TL's test."""
    model, _, _, cache = ioi
    per_head_residual, labels = cache.stack_head_results(layer=1, pos_slice=-1, incl_remainder=True, return_labels=True)
    assert torch.isclose(cache["resid_post", 0][None, :, -1] - per_head_residual[:-1].sum(dim=0), per_head_residual[-1]).all()
    assert labels == [f"L0H{i}" for i in range(model.cfg.n_heads)] + ["remainder"]
    per_head_residual, labels = cache.stack_head_results(layer=0, pos_slice=-1, incl_remainder=True, return_labels=True)
    assert torch.equal(per_head_residual, cache["resid_pre", 0][None, :, -1]) and labels == ["remainder"]
    assert torch.equal(per_head_residual, cache["embed"][None, :, -1])
    per_head_residual, labels = cache.stack_head_results(layer=0, pos_slice=-1, incl_remainder=False, return_labels=True)
    assert per_head_residual.shape == (0, *cache["embed"][:, -1].shape) and labels == []


@no_grad
def test_stack_neuron_results_with_apply_ln(ioi):
    _, _, _, cache = ioi

    # Get neuron result stack and apply ln seperately
    neuron_result_stack = cache.stack_neuron_results(layer=-1, pos_slice=-1)
    ref_scaled_residual_stack = cache.apply_ln_to_stack(neuron_result_stack, layer=-1, pos_slice=-1)

    # Get scaled_residual_stack using apply_ln parameter
    scaled_residual_stack = cache.stack_neuron_results(layer=-1, pos_slice=Slice(-1), apply_ln=True)

    assert torch.isclose(ref_scaled_residual_stack, scaled_residual_stack, atol=1e-7).all()


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=REMAINDER_AT_LAYER_0)
@no_grad
def test_stack_neuron_results_including_remainder(ioi):
    model, _, _, cache = ioi

    ref_resid_post = cache["resid_post", 0][None, :, -1]
    neuron_result_stack, labels = cache.stack_neuron_results(
        layer=1, pos_slice=Slice(-1), incl_remainder=True, return_labels=True
    )
    remainder = ref_resid_post - neuron_result_stack[:-1].sum(dim=0)
    assert torch.isclose(remainder, neuron_result_stack[-1]).all()
    assert labels[:-1] == [f"L0N{i}" for i in range(model.cfg.d_mlp)]
    assert labels[-1] == "remainder"

    ref_resid_post = cache["resid_post", -1][None, :, -1]
    neuron_result_stack, labels = cache.stack_neuron_results(layer=0, pos_slice=-1, incl_remainder=True, return_labels=True)
    assert torch.isclose(ref_resid_post, neuron_result_stack, atol=1e-7).all()
    assert len(labels) == 1
    assert labels[-1] == "remainder"

    neuron_result_stack, labels = cache.stack_neuron_results(layer=0, pos_slice=-1, incl_remainder=False, return_labels=True)
    assert torch.isclose(neuron_result_stack, torch.zeros_like(neuron_result_stack)).all()
    assert len(labels) == 0


@no_grad
def test_stack_neuron_results_remainder_at_layer_0_is_the_embedding(ioi):
    """The other side of REMAINDER_AT_LAYER_0, with the rest of TL's test."""
    model, _, _, cache = ioi
    stack, labels = cache.stack_neuron_results(layer=1, pos_slice=Slice(-1), incl_remainder=True, return_labels=True)
    assert torch.isclose(cache["resid_post", 0][None, :, -1] - stack[:-1].sum(dim=0), stack[-1]).all()
    assert labels == [f"L0N{i}" for i in range(model.cfg.d_mlp)] + ["remainder"]
    stack, labels = cache.stack_neuron_results(layer=0, pos_slice=-1, incl_remainder=True, return_labels=True)
    assert torch.equal(stack, cache["embed"][None, :, -1]) and labels == ["remainder"]


@no_grad
def test_stack_neuron_results_using_neuron_slice(ioi):
    _, _, _, cache = ioi

    neuron_result_stack, labels = cache.stack_neuron_results(
        layer=1, pos_slice=Slice(-1), neuron_slice=Slice([0, 1, 2]), return_labels=True
    )
    assert labels == [f"L0N{i}" for i in range(3)]


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=VIEWS_HAVE_NO_BATCH_AXIS)
@no_grad
def test_remove_batch_dim(ioi):
    model, tokens, _, _ = ioi
    _, cache = model.run_with_cache(tokens[:1])

    assert cache.has_batch_dim
    shapes_before_removal = {key: cache.cache_dict[key].shape for key in cache.cache_dict}

    # Removing batch dim changes the shape of the cached tensors
    cache.remove_batch_dim()
    assert not cache.has_batch_dim
    assert all(shapes_before_removal[key][1:] == cache.cache_dict[key].shape for key in shapes_before_removal)

    # Removing batch dim again does not change anything
    cache.remove_batch_dim()
    assert not cache.has_batch_dim
    assert all(shapes_before_removal[key][1:] == cache.cache_dict[key].shape for key in shapes_before_removal)


@no_grad
def test_remove_batch_dim_of_every_batched_site(ioi):
    """TL's test_remove_batch_dim on a cache of every site with a batch axis (VIEWS_HAVE_NO_BATCH_AXIS); the
    views' rows are kept as they are."""
    model, tokens, _, _ = ioi
    _, cache = model.run_with_cache(tokens[:1], names_filter=batched)
    _, with_views = model.run_with_cache(tokens[:1], names_filter="blocks.1.mlp.experts.*.hook_post")

    assert cache.has_batch_dim
    shapes_before_removal = {key: cache.cache_dict[key].shape for key in cache.cache_dict}
    cache.remove_batch_dim()
    assert not cache.has_batch_dim
    assert all(shapes_before_removal[key][1:] == cache.cache_dict[key].shape for key in shapes_before_removal)
    cache.remove_batch_dim()
    assert not cache.has_batch_dim
    assert all(shapes_before_removal[key][1:] == cache.cache_dict[key].shape for key in shapes_before_removal)
    rows = {key: value.clone() for key, value in with_views.items()}
    with_views.remove_batch_dim()
    assert all(torch.equal(with_views[key], rows[key]) for key in rows)


@no_grad
def test_remove_batch_dim_fails_if_batch_gt_1(ioi):
    _, _, _, cache = ioi

    assert cache.has_batch_dim
    with pytest.raises(AssertionError):
        cache.remove_batch_dim()


@no_grad
def test_retrieve_activations(ioi):
    model, _, _, cache = ioi

    key = ("scale", 1, "ln1")
    str_key = utils.get_act_name(*key)
    assert torch.equal(cache[key], cache[str_key])

    key = ("scale", -1, "ln1")
    str_key = f"scale{model.cfg.n_layers - 1}ln1"
    assert torch.equal(cache[key], cache[str_key])

    key = ("k", -1, None)
    str_key = f"blocks.{model.cfg.n_layers - 1}.attn.hook_k"
    assert torch.equal(cache[key], cache[str_key])

    key = "embed"
    str_key = utils.get_act_name(key)
    assert torch.equal(cache[key], cache[str_key])

    key = ("embed", None)
    str_key = utils.get_act_name(*key)
    assert torch.equal(cache[key], cache[str_key])


@no_grad
def test_get_items(ioi):
    _, _, _, cache = ioi

    assert all(
        cache_key == cache_dict_key and torch.equal(cache_val, cache_dict_val)
        for (cache_key, cache_val), (cache_dict_key, cache_dict_val) in zip(cache.items(), cache.cache_dict.items())
    )


@no_grad
def test_get_values(ioi):
    _, _, _, cache = ioi

    assert all(
        torch.equal(cache_val, cache_dict_val)
        for cache_val, cache_dict_val in zip(cache.values(), cache.cache_dict.values())
    )


@no_grad
def test_get_keys(ioi):
    _, _, _, cache = ioi

    assert all(cache_key == cache_dict_key for cache_key, cache_dict_key in zip(cache.keys(), cache.cache_dict.keys()))


@pytest.mark.xfail(strict=True, raises=ValueError, reason=VIEWS_HAVE_NO_BATCH_AXIS)
@no_grad
def test_apply_slice_to_batch_dim(ioi):
    _, _, _, cache = ioi

    assert cache.has_batch_dim
    batch_slice = Slice((2, 4))
    new_cache = cache.apply_slice_to_batch_dim(batch_slice)

    assert new_cache.has_batch_dim
    assert all(torch.equal(cache[key][2:4], new_cache[key]) for key in cache.cache_dict)

    batch_slice = 2
    new_cache = cache.apply_slice_to_batch_dim(batch_slice)

    assert not new_cache.has_batch_dim
    assert all(torch.equal(cache[key][2], new_cache[key]) for key in cache.cache_dict)


@no_grad
def test_apply_slice_to_batch_dim_of_every_batched_site(ioi):
    """TL's test_apply_slice_to_batch_dim on a cache of every site with a batch axis (VIEWS_HAVE_NO_BATCH_AXIS)."""
    model, tokens, _, _ = ioi
    _, cache = model.run_with_cache(tokens, names_filter=batched)

    assert cache.has_batch_dim
    batch_slice = Slice((2, 4))
    new_cache = cache.apply_slice_to_batch_dim(batch_slice)
    assert new_cache.has_batch_dim
    assert all(torch.equal(cache[key][2:4], new_cache[key]) for key in cache.cache_dict)

    batch_slice = 2
    new_cache = cache.apply_slice_to_batch_dim(batch_slice)
    assert not new_cache.has_batch_dim
    assert all(torch.equal(cache[key][2], new_cache[key]) for key in cache.cache_dict)


@no_grad
def test_toggle_autodiff(ioi):
    _, _, _, cache = ioi

    assert not torch.is_grad_enabled()
    cache.toggle_autodiff(mode=True)
    assert torch.is_grad_enabled()


@no_grad
def test_stack_activation(ioi):
    model, _, _, cache = ioi

    stack = cache.stack_activation("scale", -1, "ln1")
    assert all(torch.equal(cache[("scale", layer, "ln1")], stack[layer]) for layer in range(model.cfg.n_layers))

    stack = cache.stack_activation("scale", 1, "ln1")
    assert all(torch.equal(cache[("scale", layer, "ln1")], stack[layer]) for layer in range(1))


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="expand_neurons=False splits each mixture block's MLP part into its shared expert L{l}.shared and "
    "each routed expert L{l}.E{e}, where TL has one {l}_mlp_out (the experts are the unit of analysis)",
)
@no_grad
def test_get_full_resid_decomposition(ioi):
    model, _, _, cache = ioi

    ref_head_stack, ref_head_stack_labels = cache.stack_head_results(
        layer=model.cfg.n_layers, pos_slice=Slice(-1), apply_ln=True, return_labels=True
    )
    ref_mlp_stack, ref_mlp_stack_labels = cache.decompose_resid(
        layer=model.cfg.n_layers,
        mlp_input=False,
        pos_slice=Slice(-1),
        incl_embeds=False,
        mode="mlp",
        apply_ln=True,
        return_labels=True,
    )
    ref_embed = cache.apply_ln_to_stack(cache["embed"][None, :, -1], pos_slice=Slice(-1), mlp_input=False)
    if HAS_POS_EMBED:  # POS_EMBED
        ref_pos_embed = cache.apply_ln_to_stack(cache["pos_embed"][None, :, -1], pos_slice=Slice(-1), mlp_input=False)

    ref_bias = model.accumulated_bias(model.cfg.n_layers, mlp_input=False, include_mlp_biases=False)
    ref_bias = ref_bias.expand((1,) + ref_head_stack.shape[1:])
    ref_bias = cache.apply_ln_to_stack(ref_bias, pos_slice=Slice(-1), mlp_input=False)

    head_stack_len = ref_head_stack.size(0)
    mlp_stack_len = ref_mlp_stack.size(0)

    residual_stack, residual_stack_labels = cache.get_full_resid_decomposition(
        layer=-1, pos_slice=-1, apply_ln=True, expand_neurons=False, return_labels=True
    )
    assert torch.isclose(ref_head_stack, residual_stack[:head_stack_len], atol=1e-7).all()
    assert ref_head_stack_labels == residual_stack_labels[:head_stack_len]

    assert torch.isclose(ref_mlp_stack, residual_stack[head_stack_len : head_stack_len + mlp_stack_len], atol=1e-7).all()
    assert ref_mlp_stack_labels == residual_stack_labels[head_stack_len : head_stack_len + mlp_stack_len]

    assert torch.isclose(
        ref_embed,
        residual_stack[head_stack_len + mlp_stack_len : head_stack_len + mlp_stack_len + 1],
        atol=1e-7,
    ).all()
    assert "embed" == residual_stack_labels[head_stack_len + mlp_stack_len]

    bias_at = head_stack_len + mlp_stack_len + 1 + HAS_POS_EMBED  # POS_EMBED: TL's + 2
    if HAS_POS_EMBED:
        assert torch.isclose(
            ref_pos_embed,
            residual_stack[head_stack_len + mlp_stack_len + 1 : head_stack_len + mlp_stack_len + 2],
            atol=1e-7,
        ).all()
        assert "pos_embed" == residual_stack_labels[head_stack_len + mlp_stack_len + 1]

    assert torch.isclose(ref_bias, residual_stack[bias_at : bias_at + 1], atol=1e-7).all()
    assert "bias" == residual_stack_labels[bias_at]


@no_grad
def test_get_full_resid_decomposition_with_neurons_expanded(ioi):
    _, _, _, cache = ioi

    ref_head_stack, ref_head_stack_labels = cache.stack_head_results(
        layer=1, pos_slice=Slice(-1), apply_ln=True, return_labels=True
    )
    ref_neuron_stack, ref_neuron_labels = cache.stack_neuron_results(1, pos_slice=Slice(-1), return_labels=True)
    ref_neuron_stack = cache.apply_ln_to_stack(ref_neuron_stack, layer=1, pos_slice=Slice(-1))

    head_stack_len = ref_head_stack.size(0)
    neuron_stack_len = ref_neuron_stack.size(0)

    residual_stack, residual_stack_labels = cache.get_full_resid_decomposition(
        layer=1, pos_slice=Slice(-1), apply_ln=True, expand_neurons=True, return_labels=True
    )

    assert torch.isclose(
        ref_neuron_stack,
        residual_stack[head_stack_len : head_stack_len + neuron_stack_len],
        atol=1e-7,
    ).all()
    assert ref_neuron_labels == residual_stack_labels[head_stack_len : head_stack_len + neuron_stack_len]


@no_grad
def test_get_full_resid_decomposition_without_applying_ln(ioi):
    _, _, _, cache = ioi

    ref_head_stack = cache.stack_head_results(layer=1, pos_slice=Slice(-1), apply_ln=True, return_labels=False)
    ref_neuron_stack = cache.stack_neuron_results(1, pos_slice=Slice(-1), return_labels=False)

    head_stack_len = ref_head_stack.size(0)
    neuron_stack_len = ref_neuron_stack.size(0)

    residual_stack = cache.get_full_resid_decomposition(
        layer=1, pos_slice=Slice(-1), apply_ln=False, expand_neurons=True, return_labels=False
    )

    assert torch.isclose(
        ref_neuron_stack,
        residual_stack[head_stack_len : head_stack_len + neuron_stack_len],
        atol=1e-7,
    ).all()


@no_grad
def test_get_full_resid_decomposition_attn_only_model(ioi):
    _, _, _, cache = ioi  # MODEL: TL's attn-only-2l; the heads come first either way

    ref_head_stack = cache.stack_head_results(layer=1, pos_slice=Slice(-1), apply_ln=False, return_labels=False)

    head_stack_len = ref_head_stack.size(0)

    residual_stack = cache.get_full_resid_decomposition(
        layer=1, pos_slice=Slice(-1), apply_ln=False, expand_neurons=False, return_labels=False
    )

    assert torch.isclose(ref_head_stack, residual_stack[:head_stack_len], atol=1e-7).all()


@no_grad
def test_compute_test_head_results_does_not_compute_results_twice(ioi):
    model, tokens, _, _ = ioi
    _, cache = model.run_with_cache(tokens)  # a cache of its own: the test writes into it

    assert "blocks.0.attn.hook_result" not in cache.cache_dict
    cache.compute_head_results()
    assert "blocks.0.attn.hook_result" in cache.cache_dict

    # set infinity to the first element of the head results
    assert cache.cache_dict["blocks.0.attn.hook_result"][0, 0, 0, 0] != float("inf")
    cache.cache_dict["blocks.0.attn.hook_result"][0, 0, 0, 0] = float("inf")
    cache.compute_head_results()

    # assert the value has not changed
    assert cache.cache_dict["blocks.0.attn.hook_result"][0, 0, 0, 0] == float("inf")


@pytest.mark.xfail(strict=True, raises=KeyError, reason=MIXTURE_HAS_NO_DENSE_NEURONS)
@no_grad
def test_get_neuron_results(ioi):
    model, _, _, cache = ioi

    layer = 1
    ref_neuron_acts = cache[f"blocks.{layer}.mlp.hook_post"][:, -1, :2, None] * model.blocks[layer].mlp.W_out[:2]

    neuron_acts = cache.get_neuron_results(
        layer,
        neuron_slice=[0, 1],
        pos_slice=-1,
    )

    assert torch.isclose(ref_neuron_acts, neuron_acts).all()


@pytest.mark.xfail(strict=True, raises=KeyError, reason=MIXTURE_HAS_NO_DENSE_NEURONS)
@no_grad
def test_get_neuron_results_without_slice(ioi):
    model, _, _, cache = ioi

    layer = 1
    ref_neuron_acts = cache[f"blocks.{layer}.mlp.hook_post"][..., None] * model.blocks[layer].mlp.W_out

    neuron_acts = cache.get_neuron_results(
        layer,
        neuron_slice=None,
        pos_slice=None,
    )

    assert torch.isclose(ref_neuron_acts, neuron_acts).all()


@no_grad
def test_get_neuron_results_on_the_dense_block(ioi):
    """TL's two get_neuron_results tests on block 0, which is dense (MIXTURE_HAS_NO_DENSE_NEURONS)."""
    model, _, _, cache = ioi
    layer = 0
    W_out = model.blocks[layer].mlp.W_out
    ref_neuron_acts = cache[f"blocks.{layer}.mlp.hook_post"][:, -1, :2, None] * W_out[:2]
    assert torch.isclose(ref_neuron_acts, cache.get_neuron_results(layer, neuron_slice=[0, 1], pos_slice=-1)).all()
    ref_neuron_acts = cache[f"blocks.{layer}.mlp.hook_post"][..., None] * W_out
    assert torch.isclose(ref_neuron_acts, cache.get_neuron_results(layer, neuron_slice=None, pos_slice=None)).all()


# ---- tests/integration/test_cache_pos_slice.py ------------------------------------------------------------------
prompt = "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor."


@pytest.fixture(scope="module")
def model(ioi):
    return ioi[0]


@pytest.fixture(scope="module")
def model_config(model):
    """Extract model config once."""
    return {
        "d_model": model.cfg.d_model,
        "d_head": model.cfg.d_head,
        "n_heads": model.cfg.n_heads,
        "n_layers": model.cfg.n_layers,
    }


def test_run_with_cache_pos_slice_keep_batch(model, model_config):
    _, cache_no_slice = model.run_with_cache(prompt, return_type=None)
    num_tokens = len(model.tokenizer.encode(prompt))

    d_model = model_config["d_model"]
    d_head = model_config["d_head"]
    n_heads = model_config["n_heads"]
    n_layers = model_config["n_layers"]

    # Test only a sample of positions to reduce test time
    test_positions = [0, num_tokens // 2, num_tokens - 1, -1]

    for i in test_positions:
        _, cache_with_slice = model.run_with_cache(prompt, return_type=None, pos_slice=i)

        assert cache_with_slice["embed"].shape == torch.Size([1, 1, d_model])
        assert cache_with_slice["q", 0].shape == torch.Size([1, 1, n_heads, d_head])

        assert torch.equal(cache_no_slice["embed"][0, i, :], cache_with_slice["embed"][0, 0, :])
        if HAS_POS_EMBED:  # POS_EMBED
            assert torch.equal(cache_no_slice["pos_embed"][0, i, :], cache_with_slice["pos_embed"][0, 0, :])

        for layer in range(n_layers):
            for name in ("resid_pre", "resid_post", "resid_mid", "attn_out", "mlp_out"):
                assert torch.equal(cache_no_slice[name, layer][0, i, :], cache_with_slice[name, layer][0, 0, :])
            for ln in ("ln1", "ln2"):
                assert torch.equal(cache_no_slice["scale", layer, ln][0, i, :], cache_with_slice["scale", layer, ln][0, 0, :])
                assert torch.equal(
                    cache_no_slice["normalized", layer, ln][0, i, :], cache_with_slice["normalized", layer, ln][0, 0, :]
                )
            for name in ("q", "k", "v", "z"):
                assert torch.equal(cache_no_slice[name, layer][0, i, :, :], cache_with_slice[name, layer][0, 0, :, :])
            for name in ("attn_scores", "pattern"):
                assert torch.equal(cache_no_slice[name, layer][0, :, i, :], cache_with_slice[name, layer][0, :, 0, :])
            for name in ("pre", "post"):  # MIXTURE
                site = mlp_site(model, name, layer)
                assert torch.equal(cache_no_slice[site][0, i, :], cache_with_slice[site][0, 0, :])


def test_run_with_cache_pos_slice_remove_batch(model, model_config):
    _, cache_no_slice = model.run_with_cache(prompt, remove_batch_dim=True, return_type=None)
    num_tokens = len(model.tokenizer.encode(prompt))

    d_model = model_config["d_model"]
    d_head = model_config["d_head"]
    n_heads = model_config["n_heads"]
    n_layers = model_config["n_layers"]

    # Test only a sample of positions to reduce test time
    test_positions = [0, num_tokens // 2, num_tokens - 1, -1]

    for i in test_positions:
        _, cache_with_slice = model.run_with_cache(prompt, remove_batch_dim=True, pos_slice=i)

        assert cache_with_slice["embed"].shape == torch.Size([1, d_model])
        assert cache_with_slice["q", 0].shape == torch.Size([1, n_heads, d_head])

        assert torch.equal(cache_no_slice["embed"][i, :], cache_with_slice["embed"][0, :])
        if HAS_POS_EMBED:  # POS_EMBED
            assert torch.equal(cache_no_slice["pos_embed"][i, :], cache_with_slice["pos_embed"][0, :])

        for layer in range(n_layers):
            for name in ("resid_pre", "resid_post", "resid_mid", "attn_out", "mlp_out"):
                assert torch.equal(cache_no_slice[name, layer][i, :], cache_with_slice[name, layer][0, :])
            for ln in ("ln1", "ln2"):
                assert torch.equal(cache_no_slice["scale", layer, ln][i, :], cache_with_slice["scale", layer, ln][0, :])
                assert torch.equal(
                    cache_no_slice["normalized", layer, ln][i, :], cache_with_slice["normalized", layer, ln][0, :]
                )
            for name in ("q", "k", "v", "z"):
                assert torch.equal(cache_no_slice[name, layer][i, :, :], cache_with_slice[name, layer][0, :, :])
            for name in ("attn_scores", "pattern"):
                assert torch.equal(cache_no_slice[name, layer][:, i, :], cache_with_slice[name, layer][:, 0, :])
            for name in ("pre", "post"):  # MIXTURE
                site = mlp_site(model, name, layer)
                assert torch.equal(cache_no_slice[site][i, :], cache_with_slice[site][0, :])


# ---- project_output_onto (TransformerLens's get_neuron_results / stack_neuron_results / get_full_resid_decomposition)
@no_grad
def test_project_output_onto_is_the_components_times_the_projection(ioi):
    """Folded into the weights before the neurons are expanded; the same numbers as expanding, then projecting."""
    model, _, _, cache = ioi
    torch.manual_seed(0)
    P = torch.randn(model.cfg.d_model, 3)
    p = P[:, 0]
    for layer in (0, 1):  # dense, mixture
        full = cache.get_neuron_results(layer, pos_slice=-1)
        torch.testing.assert_close(cache.get_neuron_results(layer, pos_slice=-1, project_output_onto=P), full @ P)
        torch.testing.assert_close(cache.get_neuron_results(layer, pos_slice=-1, project_output_onto=p), full @ p)
    stack, labels = cache.stack_neuron_results(-1, pos_slice=-1, incl_remainder=True, apply_ln=True, return_labels=True)
    projected, same_labels = cache.stack_neuron_results(
        -1, pos_slice=-1, incl_remainder=True, apply_ln=True, return_labels=True, project_output_onto=P
    )
    assert same_labels == labels
    torch.testing.assert_close(projected, stack @ P, atol=1e-5, rtol=1e-5)
    for expand in (True, False):
        full = cache.get_full_resid_decomposition(layer=-1, pos_slice=-1, expand_neurons=expand, apply_ln=True)
        torch.testing.assert_close(
            cache.get_full_resid_decomposition(layer=-1, pos_slice=-1, expand_neurons=expand, apply_ln=True, project_output_onto=p),
            full @ p, atol=1e-5, rtol=1e-5,
        )
    with pytest.raises(ValueError, match=r"project_output_onto must be a \[d_model\] or \[d_model, n_outputs\] tensor \(d_model 128\), got \(64,\)"):
        cache.get_neuron_results(0, project_output_onto=torch.zeros(64))


@no_grad
def test_full_decomposition_onto_a_logit_difference_sums_to_it(ioi):
    """The oracle is the model's logits: every component of the final stream, normalised by the cached scale and
    projected onto the answer tokens' logit-difference direction, sums to each prompt's logit difference."""
    model, tokens, answer_tokens, cache = ioi
    directions = model.tokens_to_residual_directions(answer_tokens)  # [batch, 2, d_model]
    logits = model(tokens)[:, -1]
    want = logits.gather(-1, answer_tokens)
    want = want[:, 0] - want[:, 1]
    for b in (0, 5):
        direction = directions[b, 0] - directions[b, 1]
        stack = cache.get_full_resid_decomposition(pos_slice=-1, apply_ln=True, project_output_onto=direction)
        torch.testing.assert_close(stack[:, b].sum(), want[b], atol=1e-4, rtol=1e-4)
