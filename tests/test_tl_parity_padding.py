"""TransformerLens's input handling: input_to_embed, the forward on a list of texts (padding side and the mask
it infers) and generate's text output. The embedded byte-level default makes ids known by construction: a
byte's id is its value, "<|endoftext|>" is 256 (eos, and the BOS TransformerLens would use), "<|pad|>" 257."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from moelens import HookedTransformer, utils
from moelens.kv_cache import KVCache

PAD, EOS = 257, 256
TEXTS = ["The quick brown fox", "Hi"]
ATOL = 1e-5


@pytest.fixture
def model() -> HookedTransformer:
    """A fresh model: some tests change the tokenizer's padding side."""
    return HookedTransformer.from_pretrained("tiny-qwen2-moe", progress=False)


def ids(text: str) -> list[int]:
    return list(text.encode())


# ---- input_to_embed -----------------------------------------------------------------------------------------
def test_input_to_embed_signature_is_transformer_lens():
    params = list(inspect.signature(HookedTransformer.input_to_embed).parameters)
    assert params == ["self", "input", "prepend_bos", "padding_side", "attention_mask", "past_kv_cache"]


def test_input_to_embed_of_text(model):
    residual, tokens, shortformer, mask = model.input_to_embed("Hi")
    assert tokens.tolist() == [ids("Hi")]
    assert shortformer is None and mask is None  # rotary: no position embedding; right padding: no mask
    torch.testing.assert_close(residual, model.embed.weight.detach()[tokens], rtol=0, atol=0)
    _, with_bos, _, _ = model.input_to_embed("Hi", prepend_bos=True)
    assert with_bos.tolist() == [[EOS, *ids("Hi")]]


def test_input_to_embed_pads_as_asked_and_masks_left_padding(model):
    _, right, _, right_mask = model.input_to_embed(TEXTS)
    assert right[1].tolist() == ids("Hi") + [PAD] * 17 and right_mask is None
    _, left, _, left_mask = model.input_to_embed(TEXTS, padding_side="left")
    assert left[1].tolist() == [PAD] * 17 + ids("Hi")
    assert left_mask.tolist() == [[1] * 19, [0] * 17 + [1, 1]]


def test_input_to_embed_of_ids(model):
    residual, tokens, _, mask = model.input_to_embed(torch.tensor(ids("Hi")))
    assert tokens.shape == (1, 2) and residual.shape == (1, 2, model.cfg.d_model) and mask is None
    given = torch.tensor([[0, 1]])
    assert model.input_to_embed(tokens, attention_mask=given)[3] is given
    padded = torch.tensor([[PAD, PAD] + ids("Hi")])
    assert model.input_to_embed(padded)[3] is None  # the tokenizer pads on the right: no mask inferred
    assert model.input_to_embed(padded, padding_side="left")[3].tolist() == [[0, 0, 1, 1]]
    # left padding with nothing padded: TL returns the mask it inferred, all ones (not None)
    assert model.input_to_embed(torch.tensor([ids("Hi")]), padding_side="left")[3].tolist() == [[1, 1]]
    model.tokenizer.padding_side = "left"
    assert model.input_to_embed(padded)[3].tolist() == [[0, 0, 1, 1]]


def test_input_to_embed_with_a_cache_gives_the_mask_over_the_cached_positions(model):
    cache = KVCache.for_model(model)
    prompt = torch.tensor([ids("abc")])
    model(prompt, past_kv_cache=cache)
    _, tokens, _, mask = model.input_to_embed(torch.tensor([ids("d")]), past_kv_cache=cache)
    assert mask.tolist() == [[1, 1, 1, 1]] and len(cache) == 3  # the cache itself is not extended


def test_the_residual_continues_with_start_at_layer(model):
    """TL's documented use: forward(residual, start_at_layer=0) runs the rest of the model."""
    residual, tokens, _, mask = model.input_to_embed(TEXTS, padding_side="left")
    with torch.no_grad():
        assert torch.equal(model(residual, start_at_layer=0, attention_mask=mask), model(TEXTS, padding_side="left"))


def test_a_loss_from_start_at_layer_takes_the_tokens_keyword(model):
    """TL's test_start_at_layer_kwargs: input_to_embed's residual, tokens and mask, then
    forward(residual, tokens=..., attention_mask=..., start_at_layer=0, return_type="loss") is the plain loss."""
    residual, tokens, shortformer, mask = model.input_to_embed(TEXTS, padding_side="left")
    with torch.no_grad():
        loss = model(residual, tokens=tokens, shortformer_pos_embed=shortformer, attention_mask=mask, start_at_layer=0,
                     return_type="loss")
        assert torch.equal(loss, model(TEXTS, padding_side="left", return_type="loss"))
    with pytest.raises(ValueError, match="a loss with start_at_layer needs the token ids: pass tokens="):
        model(residual, start_at_layer=0, return_type="loss")
    with pytest.raises(ValueError, match="shortformer_pos_embed: this model's positions are rotary"):
        model(residual, start_at_layer=0, shortformer_pos_embed=residual)


# ---- the forward on a list of texts -------------------------------------------------------------------------
def alone(model, text):
    with torch.no_grad():
        return model(text)[0]


def test_a_list_pads_right_by_default_and_each_row_keeps_its_logits(model):
    with torch.no_grad():
        logits = model(TEXTS)
        assert torch.equal(logits, model(model.to_tokens(TEXTS)))  # TL: the same as its to_tokens, no mask
    for row, text in enumerate(TEXTS):
        own = alone(model, text)
        torch.testing.assert_close(logits[row, : own.shape[0]], own, rtol=0, atol=ATOL)


@pytest.mark.parametrize("how", ["argument", "tokenizer"])
def test_left_padding_masks_the_pads_and_each_row_keeps_its_logits(model, how):
    if how == "tokenizer":
        model.tokenizer.padding_side = "left"
    with torch.no_grad():
        logits = model(TEXTS, padding_side="left") if how == "argument" else model(TEXTS)
    for row, text in enumerate(TEXTS):
        own = alone(model, text)
        torch.testing.assert_close(logits[row, -own.shape[0]:], own, rtol=0, atol=ATOL)


def test_padding_side_argument_overrides_the_tokenizers(model):
    model.tokenizer.padding_side = "left"
    with torch.no_grad():
        logits = model(TEXTS, padding_side="right")
    own = alone(model, "Hi")
    torch.testing.assert_close(logits[1, :2], own, rtol=0, atol=ATOL)
    assert model.tokenizer.padding_side == "left"  # the argument overrides for this call only


def hand_loss(logits, tokens, keep):
    nll = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten(), reduction="none")
    keep = keep.flatten().float()
    return (nll * keep).sum() / keep.sum()


def test_loss_of_a_list_counts_right_padding_as_transformer_lens_and_leaves_out_left_padding(model):
    """TL makes no mask for right padding (its loss averages over the pad positions too) and infers one for
    left padding (pairs with a pad left out)."""
    with torch.no_grad():
        tokens = model.to_tokens(TEXTS)
        logits = model(tokens)
        everything = torch.ones(tokens.shape[0], tokens.shape[1] - 1)
        torch.testing.assert_close(model(TEXTS, return_type="loss"), hand_loss(logits, tokens, everything))
        left = model.to_tokens(TEXTS, padding_side="left")
        left_logits = model(TEXTS, padding_side="left")
        real = (left != PAD).long()
        pairs = real[:, 1:] * real[:, :-1]
        torch.testing.assert_close(model(TEXTS, return_type="loss", padding_side="left"), hand_loss(left_logits, left, pairs))


# ---- generate's text --------------------------------------------------------------------------------------
def test_generated_text_leaves_out_the_prepended_bos(model):
    """TL decodes each output row with skip_special_tokens: the BOS it prepended is not in the text."""
    tokens = model.generate("Hi", max_new_tokens=4, do_sample=False, prepend_bos=True, stop_at_eos=False,
                            return_type="tokens")
    assert tokens[0, :3].tolist() == [EOS, *ids("Hi")]
    text = model.generate("Hi", max_new_tokens=4, do_sample=False, prepend_bos=True, stop_at_eos=False)
    new = tokens[0, 3:]
    assert text == "Hi" + model.to_string(new[new < 256])  # bytes decode as themselves; 256+ are special
    assert "<|endoftext|>" not in text


def test_generated_text_of_a_batch_leaves_out_the_padding(model):
    texts = model.generate(TEXTS, max_new_tokens=3, do_sample=False, stop_at_eos=False)
    tokens = model.generate(TEXTS, max_new_tokens=3, do_sample=False, stop_at_eos=False, return_type="tokens")
    assert tokens[1, 0] == PAD and isinstance(texts, list) and len(texts) == 2
    for row, text in enumerate(TEXTS):
        new = tokens[row, -3:]
        assert texts[row] == text + model.to_string(new[new < 256])


def test_generate_on_a_list_of_one_text_returns_a_str_as_transformer_lens(model):
    out = model.generate(["Hi"], max_new_tokens=2, do_sample=False)
    assert isinstance(out, str) and out == model.generate("Hi", max_new_tokens=2, do_sample=False)


# ---- utils.get_attention_mask ---------------------------------------------------------------------------------
def test_get_attention_mask_masks_only_the_padded_end(model):
    """TL's utils.get_attention_mask: trailing pads (right) or leading pads (left) are 0; a pad elsewhere is a
    token; on the left a BOS that is the pad token stays 1 when prepend_bos."""
    tok = model.tokenizer
    right = torch.tensor([[1, PAD, 2, PAD, PAD], [1, 2, 3, 4, 5]])
    assert utils.get_attention_mask(tok, right, prepend_bos=False).tolist() == [[1, 1, 1, 0, 0], [1] * 5]
    left = torch.tensor([[PAD, PAD, 1, PAD, 2], [1, 2, 3, 4, 5]])
    assert utils.get_attention_mask(tok, left, False, padding_side="left").tolist() == [[0, 0, 1, 1, 1], [1] * 5]
    tok.pad_token = tok.bos_token  # TL's case: the BOS is the pad token (here "<|endoftext|>", 256)
    bos_left = torch.tensor([[EOS, EOS, EOS, 1], [EOS, 1, 2, 3]])
    assert utils.get_attention_mask(tok, bos_left, True, "left").tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]
    assert utils.get_attention_mask(tok, bos_left, False, "left").tolist() == [[0, 0, 0, 1], [0, 1, 1, 1]]
    assert utils.get_attention_mask(None, bos_left, True).tolist() == [[1] * 4] * 2
