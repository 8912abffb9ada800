"""TransformerLens's public API on moelens models: from_pretrained's arguments, tokenization, the tokenizer as a
Hugging Face tokenizer, utils.test_prompt and the config's names. Each test states the TransformerLens behaviour
it checks. The byte-level embedded default makes expected ids known by construction: a byte's id is its value,
"<|endoftext|>" is 256 (eos), "<|pad|>" 257 (pad); it has no BOS token."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import processors

from moelens import HookedTransformer, pretrained, utils
from moelens.defaults import byte_level_tokenizer
from moelens.factored_matrix import FactoredMatrix
from moelens.tokenizer import MoeTokenizer, TokenizationError

NAME = "tiny-qwen2-moe"
EOS, PAD, BOS_ADDED = 256, 257, 258  # BOS_ADDED: the BOS of the BOS-adding tokenizer built below
H, I = ord("H"), ord("i")


def load(**kwargs) -> HookedTransformer:
    return HookedTransformer.from_pretrained(NAME, progress=False, **kwargs)


@pytest.fixture(scope="module")
def model() -> HookedTransformer:
    """Shared and never changed by a test (tests that change a model load their own)."""
    return load()


@pytest.fixture(scope="module")
def folder():
    return pretrained.resolve(NAME)


@pytest.fixture(scope="module")
def bos_model(tmp_path_factory, folder) -> HookedTransformer:
    """The default checkpoint with a tokenizer whose post-processor puts "<s>" (id 258) first, as Llama's and
    Mixtral's do."""
    ckpt = tmp_path_factory.mktemp("bos") / "ckpt"
    shutil.copytree(folder, ckpt)
    tok = byte_level_tokenizer(260, EOS, PAD)
    tok.add_special_tokens(["<s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS_ADDED)])
    tok.save(str(ckpt / "tokenizer.json"))
    (ckpt / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "<|endoftext|>", "pad_token": "<|pad|>"})
    )
    return HookedTransformer.from_pretrained(ckpt, progress=False)


# ---- from_pretrained's TransformerLens arguments ----------------------------------------------------------
def test_torch_dtype_is_an_alias_of_dtype():
    """TL from_pretrained: a `torch_dtype` keyword sets the dtype (kept for backwards compatibility)."""
    model = load(torch_dtype=torch.bfloat16)
    assert model.W_E.dtype == torch.bfloat16 and model.cfg.dtype == torch.bfloat16


def test_dtype_by_name():
    """TL from_pretrained: dtype may be a string such as "bfloat16"."""
    assert load(dtype="bfloat16").W_E.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "argument, value, why",
    [
        ("center_writing_weights", True, "RMSNorm"),
        ("fold_value_biases", True, "value biases"),
        ("refactor_factored_attn_matrices", True, "rotary"),
        ("first_n_layers", 2, "first_n_layers"),
        ("checkpoint_index", 3, "checkpoint"),
        ("checkpoint_value", 1000, "checkpoint"),
        ("hf_model", object(), "hf_model"),
    ],
)
def test_processing_moelens_cannot_honour_is_refused_by_name(argument, value, why):
    """TL from_pretrained's processing flags: moelens refuses those it cannot do, naming the argument."""
    with pytest.raises(ValueError, match=rf"{argument}=.*{why}|{why}.*{argument}"):
        load(**{argument: value})


def test_refused_processing_can_be_passed_as_off():
    """TL from_pretrained_no_processing passes every flag as False: that is accepted."""
    load(center_writing_weights=False, fold_value_biases=False, refactor_factored_attn_matrices=False)


def test_an_unknown_keyword_is_a_type_error_naming_it():
    """TL passes other keywords on to Hugging Face; moelens reads checkpoints itself and names what it refuses."""
    with pytest.raises(TypeError, match="cache_dir"):
        load(cache_dir="/tmp/x")


def test_n_devices_splits_whole_blocks_as_transformer_lens_did():
    """TL n_devices: block i goes to device i // (n_layers // n_devices), embed with block 0, ln_final and
    unembed with the last block (moelens puts the remainder blocks on the last device, not past it)."""
    placed = pretrained.n_devices_map(n_layers=5, n_devices=2, device="cuda")
    assert placed == {
        "embed": "cuda:0", "blocks.0-1": "cuda:0", "blocks.2-4": "cuda:1", "ln_final": "cuda:1", "unembed": "cuda:1",
    }
    assert pretrained.n_devices_map(n_layers=4, n_devices=2, device="cuda:2")["blocks.2-3"] == "cuda:3"


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has the devices")
def test_n_devices_beyond_the_visible_gpus_is_a_clear_error():
    """TL asserts there are at least n_devices CUDA devices."""
    with pytest.raises(ValueError, match=r"n_devices=2.*CUDA device"):
        load(n_devices=2, device="cuda")


def test_n_devices_with_a_device_map_is_refused():
    with pytest.raises(ValueError, match="n_devices.*device_map"):
        load(n_devices=2, device_map={"embed": "cpu"})


def test_n_devices_needs_a_cuda_device():
    """TL: with n_devices > 1, device must be cuda."""
    with pytest.raises(ValueError, match="n_devices=2.*cuda"):
        load(n_devices=2, device="cpu")


def test_move_to_device_false_leaves_the_model_on_the_cpu():
    """TL move_to_device=False: the weights are not moved to `device`."""
    model = load(device="meta", move_to_device=False)
    assert model.W_E.device.type == "cpu" and model.cfg.device == "cpu"


def test_move_to_device_false_with_n_devices_is_refused():
    """TL: move_to_device must be True when n_devices > 1."""
    with pytest.raises(ValueError, match="move_to_device"):
        load(n_devices=2, move_to_device=False, device="cuda")


def test_default_padding_side_sets_the_tokenizers():
    """TL from_pretrained(default_padding_side=...) is the tokenizer's padding side."""
    model = load(default_padding_side="left")
    assert model.tokenizer.padding_side == "left"
    assert model.to_tokens(["Hi", "abc"])[0].tolist() == [PAD, H, I]
    with pytest.raises(ValueError, match="default_padding_side must be 'left' or 'right'"):
        load(default_padding_side="top")


def test_default_prepend_bos_true_prepends_the_eos_where_there_is_no_bos():
    """TL set_tokenizer: a tokenizer without a BOS token gets the eos as its BOS; to_tokens then prepends it."""
    model = load(default_prepend_bos=True)
    assert model.cfg.default_prepend_bos is True
    assert model.tokenizer.bos_token_id == EOS and model.tokenizer.bos_token == "<|endoftext|>"
    assert model.to_tokens("Hi").tolist() == [[EOS, H, I]]
    assert model.to_tokens("Hi", prepend_bos=False).tolist() == [[H, I]]


def test_from_pretrained_no_processing_keeps_the_checkpoint_weights(folder):
    """TL from_pretrained_no_processing: from_pretrained with folding and centering off, weights as stored."""
    stored = load_file(folder / "model.safetensors")
    model = HookedTransformer.from_pretrained_no_processing(NAME, progress=False)
    assert torch.equal(model.W_U, stored["lm_head.weight"].T)
    assert torch.equal(model.blocks[0].ln1.weight, stored["model.layers.0.input_layernorm.weight"])
    processed = load(fold_ln=True, center_unembed=True)
    assert not torch.equal(processed.W_U, model.W_U)  # the comparison above can fail


def test_from_pretrained_no_processing_passes_other_arguments_on():
    model = HookedTransformer.from_pretrained_no_processing(NAME, dtype="bfloat16", default_padding_side="left", progress=False)
    assert model.cfg.dtype == torch.bfloat16 and model.tokenizer.padding_side == "left"


# ---- to_tokens ----------------------------------------------------------------------------------------------
def test_to_tokens_default_has_no_bos_on_a_tokenizer_that_adds_none(model):
    """moelens's default_prepend_bos is whether the checkpoint's tokenizer adds a BOS itself (TL's is True)."""
    assert model.cfg.default_prepend_bos is False
    assert model.to_tokens("Hi").tolist() == [[H, I]]


def test_to_tokens_prepend_bos_overrides_the_default(model):
    """TL to_tokens(prepend_bos=True/False) overrides cfg.default_prepend_bos for the call."""
    assert model.to_tokens("Hi", prepend_bos=True).tolist() == [[EOS, H, I]]
    assert model.to_tokens(["Hi", "abc"], prepend_bos=True).tolist() == [[EOS, H, I, PAD], [EOS, 97, 98, 99]]


def test_to_tokens_pads_on_the_given_side(model):
    """TL to_tokens(padding_side=...) overrides tokenizer.padding_side for the call."""
    assert model.to_tokens(["Hi", "abc"]).tolist() == [[H, I, PAD], [97, 98, 99]]
    assert model.to_tokens(["Hi", "abc"], padding_side="left").tolist() == [[PAD, H, I], [97, 98, 99]]
    assert model.tokenizer.padding_side == "right"


def test_to_tokens_truncates_to_n_ctx(model):
    """TL to_tokens(truncate=True): at most cfg.n_ctx tokens, the first ones; truncate=False keeps all."""
    text = "ab" * (model.cfg.n_ctx // 2 + 10)
    tokens = model.to_tokens(text)
    assert tokens.shape == (1, model.cfg.n_ctx) and tokens[0, :2].tolist() == [97, 98]
    assert model.to_tokens(text, truncate=False).shape == (1, len(text))


def test_to_tokens_move_to_device(model):
    """TL to_tokens(move_to_device=False) leaves the tokens on the CPU."""
    assert model.to_tokens("Hi", move_to_device=False).device.type == "cpu"


def test_a_tokenizer_that_adds_its_bos_is_kept_single(bos_model):
    """TL to_tokens with a tokenizer that prepends the BOS itself: prepend_bos=True adds no second one,
    prepend_bos=False removes it."""
    assert bos_model.cfg.default_prepend_bos is True and bos_model.tokenizer.bos_token == "<s>"
    assert bos_model.to_tokens("Hi").tolist() == [[BOS_ADDED, H, I]]
    assert bos_model.to_tokens("Hi", prepend_bos=True).tolist() == [[BOS_ADDED, H, I]]
    assert bos_model.to_tokens("Hi", prepend_bos=False).tolist() == [[H, I]]
    assert bos_model.to_single_token("H") == H  # to_single_token encodes without the BOS


# ---- to_str_tokens / to_string / single tokens -----------------------------------------------------------------
def test_to_str_tokens_of_text(model):
    """TL to_str_tokens(str): the tokens of to_tokens(str) as strings, with the BOS if prepended."""
    assert model.to_str_tokens("Hi") == ["H", "i"]
    assert model.to_str_tokens("Hi", prepend_bos=True) == ["<|endoftext|>", "H", "i"]


def test_to_str_tokens_of_a_list_of_texts_is_a_list_per_text(model):
    """TL to_str_tokens(list of str): one list of str tokens per text, unpadded."""
    assert model.to_str_tokens(["Hi", "abc"]) == [["H", "i"], ["a", "b", "c"]]


def test_to_str_tokens_of_ids(model):
    """TL to_str_tokens(tensor or array of shape [pos] or [1 pos]): one str per id; moelens also takes
    [batch pos] (a list per row) and a list of ints."""
    ids = torch.tensor([H, I])
    assert model.to_str_tokens(ids) == model.to_str_tokens(ids[None]) == ["H", "i"]
    assert model.to_str_tokens(np.array([H, I])) == model.to_str_tokens(np.array([[H, I]])) == ["H", "i"]
    assert model.to_str_tokens(torch.tensor(H)) == ["H"]
    assert model.to_str_tokens(torch.tensor([[H, I], [97, 98]])) == [["H", "i"], ["a", "b"]]
    assert model.to_str_tokens([torch.tensor([H]), torch.tensor([97, 98])]) == [["H"], ["a", "b"]]
    assert model.to_str_tokens([H, I]) == ["H", "i"]


def test_to_string(model):
    """TL to_string: a [pos] tensor, list or array -> one str; [batch pos] -> a list of str."""
    assert model.to_string(torch.tensor([H, I])) == model.to_string([H, I]) == model.to_string(np.array([H, I])) == "Hi"
    assert model.to_string(torch.tensor([[H, I], [97, 98]])) == ["Hi", "ab"]
    assert model.to_string(torch.tensor(H)) == "H"
    with pytest.raises(ValueError, match="shape"):
        model.to_string(torch.zeros(1, 1, 2, dtype=torch.long))


def test_to_single_token(model):
    """TL to_single_token: the id of a string that is exactly one token (no BOS); otherwise an error
    (TL asserts: the error is also an AssertionError)."""
    assert model.to_single_token("H") == H
    for bad in ["Hi", ""]:
        with pytest.raises(TokenizationError, match="not a single token"):
            model.to_single_token(bad)
    with pytest.raises(AssertionError):
        model.to_single_token("Hi")
    with pytest.raises(ValueError):
        model.to_single_token("Hi")


def test_to_single_str_token(model):
    """TL to_single_str_token(int): the token's string; anything but an int is refused."""
    assert model.to_single_str_token(H) == "H" and model.to_single_str_token(EOS) == "<|endoftext|>"
    with pytest.raises(TypeError, match="int"):
        model.to_single_str_token(torch.tensor(H))


def test_get_token_position(model):
    """TL get_token_position: the first (or last) index of a token in a text or [pos] / [1 pos] ids; the
    text is tokenized with prepend_bos (default cfg.default_prepend_bos), shifting positions by one."""
    assert model.get_token_position("l", "Hello") == 2
    assert model.get_token_position("l", "Hello", mode="last") == 3
    assert model.get_token_position("l", "Hello", prepend_bos=True) == 3
    assert model.get_token_position(ord("l"), torch.tensor([[72, 101, 108, 108]]), mode="last") == 3
    assert model.get_token_position(torch.tensor(ord("e")), torch.tensor([72, 101])) == 1
    with pytest.raises(TokenizationError, match="does not occur"):
        model.get_token_position("z", "Hello")
    with pytest.raises(ValueError, match="mode must be 'first' or 'last'"):
        model.get_token_position("l", "Hello", mode="middle")
    with pytest.raises(ValueError, match=r"\[1, seq_len\]"):
        model.get_token_position("l", torch.tensor([[1, 2], [3, 4]]))


def test_tokens_to_residual_directions_shapes(model):
    """TL tokens_to_residual_directions: one token (str, int or one-element tensor) -> [d_model]; a tensor of
    more ids, shape S -> [*S, d_model]."""
    one = model.tokens_to_residual_directions(H)
    assert one.shape == (model.cfg.d_model,)
    assert torch.equal(model.tokens_to_residual_directions("H"), one)
    assert torch.equal(model.tokens_to_residual_directions(torch.tensor([H])), one)
    many = model.tokens_to_residual_directions(torch.tensor([[H, I, 97], [98, 99, 100]]))
    assert many.shape == (2, 3, model.cfg.d_model) and torch.equal(many[0, 0], one)
    with pytest.raises(TokenizationError):
        model.tokens_to_residual_directions("Hi")


def test_tokens_to_residual_directions_of_a_str_ignores_the_bos_default():
    """TL maps a str through to_single_token, which never prepends the BOS."""
    model = load(default_prepend_bos=True)
    assert torch.equal(model.tokens_to_residual_directions("H"), model.tokens_to_residual_directions(H))


# ---- set_tokenizer and the tokenizer as a Hugging Face tokenizer --------------------------------------------------
def test_set_tokenizer_takes_a_hugging_face_fast_tokenizer():
    """TL set_tokenizer(tokenizer, default_padding_side): a Hugging Face tokenizer, padding on that side."""
    from transformers import PreTrainedTokenizerFast

    model = load()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=byte_level_tokenizer(260, EOS, PAD), eos_token="<|endoftext|>", pad_token="<|pad|>"
    )
    model.set_tokenizer(hf, default_padding_side="left")
    assert isinstance(model.tokenizer, MoeTokenizer) and model.tokenizer.padding_side == "left"
    assert model.to_tokens(["Hi", "abc"]).tolist() == [[PAD, H, I], [97, 98, 99]]
    with pytest.raises(ValueError, match="default_padding_side must be 'left' or 'right'"):
        model.set_tokenizer(hf, default_padding_side="up")
    with pytest.raises(TypeError, match="fast tokenizer"):
        model.set_tokenizer("gpt2")


def test_set_tokenizer_takes_a_tokenizers_tokenizer():
    model = load()
    model.set_tokenizer(byte_level_tokenizer(260, EOS, PAD))
    assert model.to_tokens("Hi").tolist() == [[H, I]] and model.tokenizer.padding_side == "right"


@pytest.fixture(scope="module")
def hf_tokenizer():
    """transformers' own tokenizer over the same vocabulary: the reference for the call's semantics."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=byte_level_tokenizer(260, EOS, PAD), eos_token="<|endoftext|>", pad_token="<|pad|>"
    )


@pytest.mark.parametrize(
    "texts, options",
    [
        (["Hi", "abc"], {"return_tensors": "pt", "padding": True}),
        (["Hi", "abcdef"], {"return_tensors": "pt", "padding": True, "truncation": True, "max_length": 4}),
        (["Hi", "abc"], {"return_tensors": "np", "padding": "max_length", "max_length": 5}),
        ("Hello", {}),
        (["Hi", "abc"], {}),
        ("Hello", {"truncation": True, "max_length": 2, "add_special_tokens": False}),
        (["Hi", "abc"], {"return_tensors": "pt", "padding": True, "padding_side": "left"}),
    ],
)
def test_calling_the_tokenizer_matches_transformers(model, hf_tokenizer, texts, options):
    """SAE-Lens / TL code calls model.tokenizer(texts, ...) as a Hugging Face tokenizer."""
    ours, theirs = model.tokenizer(texts, **options), hf_tokenizer(texts, **options)
    assert set(ours) == {"input_ids", "attention_mask"}
    for key in ours:
        mine, ref = ours[key], theirs[key]
        if isinstance(ref, (torch.Tensor, np.ndarray)):
            assert type(mine) is type(ref) and mine.tolist() == ref.tolist()
        else:
            assert mine == ref
    assert ours.input_ids is ours["input_ids"]


def test_the_tokenizer_call_refuses_ragged_tensors_and_unknown_options(model):
    with pytest.raises(ValueError, match="padding=True"):
        model.tokenizer(["Hi", "abc"], return_tensors="pt")
    with pytest.raises(TypeError, match="is_split_into_words"):
        model.tokenizer("Hi", is_split_into_words=True)


def test_the_tokenizer_decodes_as_transformers(model, hf_tokenizer):
    tok, ids = model.tokenizer, torch.tensor([[H, I, 32, 97], [EOS, 98, PAD, 99]])
    assert tok.decode(ids[0]) == hf_tokenizer.decode(ids[0]) == "Hi a"
    assert tok.decode(H) == hf_tokenizer.decode(H)
    assert tok.batch_decode(ids) == hf_tokenizer.batch_decode(ids)
    # a 1-d tensor: one text per id, as TL's to_str_tokens relies on (transformers 5 now decodes it whole)
    assert tok.batch_decode(ids[0]) == ["H", "i", " ", "a"]
    assert tok.decode(ids[1], skip_special_tokens=True) == hf_tokenizer.decode(ids[1], skip_special_tokens=True)
    assert tok.convert_ids_to_tokens([H, 32]) == hf_tokenizer.convert_ids_to_tokens([H, 32]) == ["H", "Ġ"]
    assert tok.convert_ids_to_tokens(32) == "Ġ"
    assert tok.encode("Hi") == hf_tokenizer.encode("Hi") == [H, I]


def test_the_tokenizers_attributes(model, hf_tokenizer):
    tok = model.tokenizer
    assert (tok.eos_token_id, tok.pad_token_id, tok.eos_token, tok.pad_token) == (EOS, PAD, "<|endoftext|>", "<|pad|>")
    assert (tok.vocab_size, len(tok)) == (hf_tokenizer.vocab_size, len(hf_tokenizer)) == (256, 258)
    assert tok.name_or_path == NAME
    assert tok.get_vocab()["<|pad|>"] == PAD


def test_padding_side_and_special_tokens_are_settable():
    tok = load().tokenizer
    tok.padding_side = "left"
    assert tok(["Hi", "abc"], padding=True)["input_ids"][0] == [PAD, H, I]
    with pytest.raises(ValueError, match="padding_side must be 'left' or 'right'"):
        tok.padding_side = "center"
    tok.pad_token = tok.eos_token  # what TL-style code does to tokenizers without a pad token
    assert tok.pad_token_id == EOS
    with pytest.raises(ValueError, match="not a token"):
        tok.pad_token = "<nope>"


# ---- utils.test_prompt ---------------------------------------------------------------------------------------------
def byte_token(t: int) -> str:
    """How the byte-level vocabulary shows an id: its byte as UTF-8 (a lone non-ASCII byte as U+FFFD)."""
    return {EOS: "<|endoftext|>", PAD: "<|pad|>"}.get(t) or bytes([t]).decode(errors="replace")


def expected_block(logits: torch.Tensor, position: int, target: int, label: str, top_k: int) -> list[str]:
    """The lines TL's test_prompt prints for one answer token, computed here from the logits alone."""
    row = logits[0, position]
    probs = row.softmax(-1)
    rank = int((row > row[target]).sum())
    lines = [
        "Performance on answer token:",
        f"Rank: {rank: <8} Logit: {row[target].item():5.2f} Prob: {probs[target].item():6.2%} Token: |{label}|",
    ]
    top = row.topk(top_k).indices
    lines += [
        f"Top {i}th token. Logit: {row[t].item():5.2f} Prob: {probs[t].item():6.2%} Token: |{byte_token(int(t))}|"
        for i, t in enumerate(top)
    ]
    return lines


def test_test_prompt_prints_ranks_logits_and_top_tokens(model, capsys):
    """TL utils.test_prompt: the tokenized prompt and answer (a space prepended), then for each answer token
    its rank, logit, probability and the top_k tokens, then the ranks of the answer tokens."""
    prompt = "The cat sat on the"
    ids = [ord(c) for c in prompt] + [32, ord("m")]  # answer "m" -> " m": two byte tokens
    with torch.no_grad():
        logits = model(torch.tensor([ids]))
    utils.test_prompt(prompt, "m", model, top_k=3)
    out = capsys.readouterr().out.splitlines()
    n = len(prompt)
    expected = [f"Tokenized prompt: {list(prompt)}", "Tokenized answer: [' ', 'm']"]
    expected += expected_block(logits, n - 1, 32, " ", 3) + expected_block(logits, n, ord("m"), "m", 3)
    ranks = [int((logits[0, p] > logits[0, p, t]).sum()) for p, t in [(n - 1, 32), (n, ord("m"))]]
    expected.append(f"Ranks of the answer tokens: [(' ', {ranks[0]}), ('m', {ranks[1]})]")
    assert out == expected


def test_test_prompt_without_details_prints_only_the_ranks(model, capsys):
    """TL test_prompt(print_details=False) still prints the ranks line; prepend_space_to_answer=False keeps
    the answer as given."""
    prompt = "ab"
    with torch.no_grad():
        logits = model(torch.tensor([[97, 98, 99]]))
    utils.test_prompt(prompt, "c", model, prepend_space_to_answer=False, print_details=False)
    rank = int((logits[0, 1] > logits[0, 1, 99]).sum())
    assert capsys.readouterr().out == f"Ranks of the answer tokens: [('c', {rank})]\n"


def test_test_prompt_with_several_answers_compares_first_tokens(model, capsys):
    """TL test_prompt with a list of answers: one block for the first token of each."""
    utils.test_prompt("ab", ["c", "d"], model, prepend_space_to_answer=False, top_k=1)
    out = capsys.readouterr().out
    assert "Tokenized answers: [['c'], ['d']]" in out and "Performance on answer tokens:" in out
    assert re.search(r"Ranks of the answer tokens: \[\[\('c', \d+\), \('d', \d+\)\]\]", out)


# ---- config names ------------------------------------------------------------------------------------------------
def test_cfg_device_and_dtype_follow_the_model():
    """TL model.to(device_or_dtype) updates cfg.device / cfg.dtype; so do .half(), .bfloat16(), .float()."""
    model = load()
    assert (model.cfg.device, model.cfg.dtype) == ("cpu", torch.float32)
    model.half()
    assert model.cfg.dtype == torch.float16
    model.bfloat16()
    assert model.cfg.dtype == torch.bfloat16
    model.to(torch.float64)
    assert model.cfg.dtype == torch.float64 and model.W_E.dtype == torch.float64
    model.to("meta")
    assert model.cfg.device == "meta"
    assert model.to(torch.float32, print_details=False) is model  # TL's keyword is accepted


def test_cfg_stays_frozen(model):
    with pytest.raises(dataclasses.FrozenInstanceError):
        model.cfg.d_model = 3


def test_cfg_names_from_the_checkpoint(model, folder):
    """TL cfg: original_architecture (config.json's architectures[0]), model_name (the name without its
    organisation), tokenizer_name, and the sizes under TL's names."""
    hf = json.loads((folder / "config.json").read_text())
    cfg = model.cfg
    assert cfg.original_architecture == hf["architectures"][0] == "Qwen2MoeForCausalLM"
    assert cfg.model_name == NAME and cfg.tokenizer_name == NAME
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.d_vocab, cfg.d_vocab_out) == (
        hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"], hf["vocab_size"], hf["vocab_size"]
    )
    assert cfg.d_head == hf["hidden_size"] // hf["num_attention_heads"]
    assert (cfg.n_ctx, cfg.n_key_value_heads, cfg.eps) == (
        hf["max_position_embeddings"], hf["num_key_value_heads"], hf["rms_norm_eps"]
    )
    assert (cfg.num_experts, cfg.experts_per_token) == (hf["num_experts"], hf["num_experts_per_tok"])
    assert (cfg.rotary_base, cfg.rotary_dim) == (hf["rope_theta"], cfg.d_head)
    assert (cfg.act_fn, cfg.normalization_type, cfg.positional_embedding_type) == ("silu", "RMS", "rotary")
    assert (cfg.gated_mlp, cfg.final_rms, cfg.attn_only, cfg.attention_dir) == (True, True, False, "causal")
    assert cfg.d_mlp == hf["intermediate_size"]  # the dense MLP width (this checkpoint's mlp_only_layers: none)


def test_cfg_n_params_counts_the_weight_matrices(model, folder):
    """TL cfg.n_params: the weight-matrix parameters outside the embedding and unembedding (no biases or
    norms); counted here from the checkpoint file."""
    stored = load_file(folder / "model.safetensors")
    skip = {"model.embed_tokens.weight", "lm_head.weight"}
    expected = sum(t.numel() for k, t in stored.items() if t.dim() >= 2 and k not in skip)
    assert model.cfg.n_params == expected


def test_left_padding_masks_a_bos_that_is_the_pad_token():
    """TL get_attention_mask: with left padding, prepend_bos and bos == pad, the last leading pad is the
    (real) BOS; a padded row then gives the logits it gives alone."""
    model = load(default_prepend_bos=True, default_padding_side="left")
    model.tokenizer.pad_token = "<|endoftext|>"  # now bos == pad == 256
    tokens = model.to_tokens(["Hello", "Hi"])
    assert tokens.tolist() == [[EOS] + list(b"Hello"), [EOS, EOS, EOS, EOS, H, I]]
    logits = model(tokens)
    alone = model(model.to_tokens("Hi"))
    torch.testing.assert_close(logits[1, -3:], alone[0], rtol=0, atol=1e-5)


def test_from_pretrained_takes_a_tokenizer():
    """TL from_pretrained(tokenizer=...): that tokenizer instead of the checkpoint's, on default_padding_side."""
    model = load(tokenizer=byte_level_tokenizer(260, EOS, PAD), default_padding_side="left")
    assert model.tokenizer.padding_side == "left" and model.tokenizer.eos_token_id is None  # none declared
    assert model.to_tokens("Hi").tolist() == [[H, I]]


def test_device_none_is_transformer_lens_default():
    """TL from_pretrained(device=None): the GPU if there is one, else the CPU."""
    assert load(device=None).cfg.device == ("cuda:0" if torch.cuda.is_available() else "cpu")


def test_forward_takes_prepend_bos_for_text(model):
    """TL forward(text, prepend_bos=...): the text is tokenized with it; token ids are left as they are."""
    with_bos = model("Hi", prepend_bos=True)
    assert with_bos.shape[1] == 3
    torch.testing.assert_close(with_bos, model(torch.tensor([[EOS, H, I]])), rtol=0, atol=0)
    tokens = torch.tensor([[H, I]])
    assert torch.equal(model(tokens, prepend_bos=True), model(tokens))


# ---- forward(return_type=None) and loss_fn ---------------------------------------------------------------------
def test_return_type_none_runs_the_final_norm_hooks_not_the_unembedding(qwen_model, tokens):
    """TL's forward applies ln_final before it checks return_type: hooks on the final norm fire, hook_logits not."""
    fired = []
    out = qwen_model.run_with_hooks(
        tokens, return_type=None,
        fwd_hooks=[(n, lambda t, hook: fired.append(hook.name)) for n in ("ln_final.hook_normalized", "hook_logits")],
    )
    assert out is None and fired == ["ln_final.hook_normalized"]


def test_loss_fn_is_next_token_cross_entropy(qwen_model, tokens):
    """TL's loss_fn(logits, tokens, per_token): mean (or per position) cross entropy of token t+1 from logits at t."""
    logits = qwen_model(tokens)
    expected = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1), reduction="none"
    ).view(tokens.shape[0], -1)
    torch.testing.assert_close(qwen_model.loss_fn(logits, tokens, per_token=True), expected)
    torch.testing.assert_close(qwen_model.loss_fn(logits, tokens), expected.mean())


# ---- generate with TransformerLens's arguments ----------------------------------------------------------------
def test_generate_samples_by_default_as_transformer_lens(model):
    prompt = model.to_tokens("The quick brown fox")
    default = model.generate(prompt, max_new_tokens=12, stop_at_eos=False, seed=0)
    assert torch.equal(default, model.generate(prompt, max_new_tokens=12, stop_at_eos=False, seed=0, do_sample=True))
    assert not torch.equal(default, model.generate(prompt, max_new_tokens=12, stop_at_eos=False, do_sample=False))


def test_freq_penalty_subtracts_each_token_count_from_the_logits(model):
    """TL's sample_logits: logits / temperature - freq_penalty * bincount(tokens so far), then top-k; with
    top_k=1 the draw is that argmax, computed here by hand from one forward."""
    prompt = model.to_tokens("abcabcabca")
    logits = model(prompt)[0, -1].float() / 0.7
    counts = torch.bincount(prompt[0], minlength=logits.shape[-1]).float()
    for penalty in (0.0, 0.4, 50.0):
        expected = int((logits - penalty * counts).argmax())
        got = model.generate(prompt, max_new_tokens=1, top_k=1, temperature=0.7, freq_penalty=penalty, seed=0)
        assert int(got[0, -1]) == expected, penalty
    assert int(model.generate(prompt, max_new_tokens=1, top_k=1, freq_penalty=50.0, seed=0)[0, -1]) not in prompt[0]


def test_generate_text_takes_prepend_bos_and_pads_a_list_on_the_left_whatever_padding_side_says(model):
    """TL's generate: prepend_bos for text; a batched list is left-padded ("left-padding is forced
    internally"), so padding_side="right" gives what "left" gives."""
    with_bos = model.generate("Hi", max_new_tokens=1, do_sample=False, prepend_bos=True, return_type="tokens")
    assert torch.equal(with_bos[:, :-1], model.to_tokens("Hi", prepend_bos=True))
    right = model.generate(["Hi", "Hello"], max_new_tokens=2, do_sample=False, padding_side="right", return_type="tokens")
    left = model.generate(["Hi", "Hello"], max_new_tokens=2, do_sample=False, padding_side="left", return_type="tokens")
    assert torch.equal(right, left) and right[0, 0] == PAD and right[0, 3:5].tolist() == [H, I]
    with pytest.raises(ValueError, match="padding_side must be 'left' or 'right', got 'up'"):
        model.generate("Hi", max_new_tokens=1, padding_side="up")
    with pytest.raises(ValueError, match="freq_penalty"):
        model.generate("Hi", max_new_tokens=1, freq_penalty=-1.0)


# ---- FactoredMatrix as TransformerLens's --------------------------------------------------------------------
def test_factored_matrix_operations_match_the_full_product():
    gen = torch.Generator().manual_seed(0)
    A, B = torch.randn(2, 3, 6, 2, generator=gen, dtype=torch.float64), torch.randn(2, 3, 2, 6, generator=gen, dtype=torch.float64)
    fm, full = FactoredMatrix(A, B), A @ B
    W = torch.randn(5, 6, generator=gen, dtype=torch.float64)
    torch.testing.assert_close((W @ fm).AB, W @ full)  # __rmatmul__
    torch.testing.assert_close((fm * 2.5).AB, 2.5 * full)
    torch.testing.assert_close((3 * fm).AB, 3 * full)
    assert fm.ndim == full.dim() == 4 and fm.pair == (A, B)
    torch.testing.assert_close(fm.get_corner(2), full[:2, :2, :2, :2])
    # AB (6 x 6, rank 2) has the eigenvalues of BA (2 x 2) and four zeros
    eig_full = torch.linalg.eigvals(full[1, 2])
    top = eig_full[eig_full.abs().argsort(descending=True)[:2]]
    mine = fm.eigenvalues[1, 2]
    torch.testing.assert_close(sorted(mine.tolist(), key=lambda z: (z.real, z.imag)), sorted(top.tolist(), key=lambda z: (z.real, z.imag)))
    with pytest.raises(ValueError, match="one number"):
        fm * torch.ones(2)


def test_embedding_times_ov_circuit_stays_factored(model):
    """TL's model.W_E @ model.OV: [n_layers, n_heads, d_vocab, d_model], each entry W_E @ W_V[l, h] @ W_O[l, h]."""
    full = model.W_E @ model.OV
    cfg = model.cfg
    assert tuple(full.shape) == (cfg.n_layers, cfg.n_heads, cfg.d_vocab, cfg.d_model)
    with torch.no_grad():
        torch.testing.assert_close(full[1, 2].AB, model.W_E @ model.W_V[1, 2] @ model.W_O[1, 2])


def test_forward_takes_positional_arguments_in_transformer_lens_order():
    """TL: forward(input, return_type, loss_per_token, prepend_bos, padding_side, start_at_layer, tokens,
    shortformer_pos_embed, attention_mask, stop_at_layer, past_kv_cache): model(tokens, "loss", True) is
    the per-token loss there, and must be here."""
    import inspect

    model = HookedTransformer.from_pretrained(NAME, progress=False)
    tokens = torch.tensor([[3, 7, 11, 5, 2]])
    per_token = model(tokens, "loss", True)
    assert per_token.shape == (1, 4)
    logits = model(tokens)
    expected = -logits[0, :-1].log_softmax(-1).gather(-1, tokens[0, 1:, None])[:, 0]
    torch.testing.assert_close(per_token[0], expected)
    names = list(inspect.signature(model.forward).parameters)
    assert names[:11] == ["input", "return_type", "loss_per_token", "prepend_bos", "padding_side", "start_at_layer",
                          "tokens", "shortformer_pos_embed", "attention_mask", "stop_at_layer", "past_kv_cache"]
