"""TransformerLens's tokenization tests, ported: tests/unit/test_tokenization_methods.py,
tests/unit/test_utils.py's test_to_str_tokens and TestAttentionMask, and
tests/unit/utilities/test_tokenize_utils.py's attention-mask test. Port rules: tests/tl_port.py.

TL's model is solu-1l (its tokenizer prepends a BOS, "<|BOS|>"); here CODE, whose tokenizer prepends
"<|endoftext|>" (TOKENS: every expected id and string comes from CODE's tokenizer.json through the `tokenizers`
library). TL's words become words of CODE's vocabulary: "biomolecules" (one token, but in the prompt only as
" biomolecules") is "value" (the prompt has " value"); " SolidGoldMagikarp" (one gpt2 token) is " self".
TestAttentionMask runs TL's gpt2-small and opt-125m: here CODE as it is (BOS is not the pad token, as OPT's)
and CODE with the pad token set to its BOS (as TL sets gpt2's).
test_tokenize_utils uses a gpt2 tokenizer fixture: here CODE's.

Not ported: test_utils.py's test_test_prompt (its expected text is solu-1l's logits; moelens's test_prompt is
checked against a ranking computed from the logits in test_tl_parity_api.py).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from tl_port import CODE, bos_id, config_json, ids, load, oracle, vocab
from torch import Size, equal, tensor
from transformers import AutoTokenizer

from moelens import HookedTransformer, pretrained, utils

BOS = bos_id(CODE)
SINGLE = "value"  # TL: "biomolecules", one token, which the prompt has only after a space
PROMPT = "There were some value"  # TL: "There were some biomolecules"
GLITCH = vocab(CODE)["Ġself"]  # TL: " SolidGoldMagikarp", one token
D_VOCAB = config_json(CODE)["vocab_size"]  # TL's 48262
D_MODEL = config_json(CODE)["hidden_size"]  # TL's 512


def decode(token_ids: list[int]) -> str:
    return oracle(CODE).decode(token_ids, skip_special_tokens=False)


@pytest.fixture(scope="module")
def model():
    return load(CODE)


# ---- tests/unit/test_tokenization_methods.py ------------------------------------------------------------------
def test_set_tokenizer_during_initialization(model):
    assert (
        model.tokenizer is not None and model.tokenizer.name_or_path == CODE
    ), "initialized with expected tokenizer"
    assert model.cfg.d_vocab == D_VOCAB, "expected d_vocab"


def test_set_tokenizer_lazy(model):
    # MODEL: TL builds HookedTransformer(HookedTransformerConfig(n_layers=1, ...)); a moelens model is built
    # from its family's config (see README), with no tokenizer
    model2 = type(model)(model.cfg)
    original_tokenizer = model2.tokenizer
    assert original_tokenizer is None, "initialize without tokenizer"
    folder = str(pretrained.resolve(CODE))  # TOKENS: TL's AutoTokenizer.from_pretrained("gpt2")
    model2.set_tokenizer(AutoTokenizer.from_pretrained(folder))
    tokenizer = model2.tokenizer
    assert tokenizer is not None and tokenizer.name_or_path == folder, "set tokenizer"
    assert model2.to_single_token(" self") == GLITCH, "Glitch token didn't tokenize properly"
    assert model2.to_string([GLITCH]) == " self", "Glitch token didn't detokenize properly"


def test_hooked_transformer_of_a_config_builds_a_random_model_without_a_tokenizer(model):
    """TL's MODEL itself: HookedTransformer(cfg) is the cfg's family with random weights and no tokenizer
    (tests/test_random_init.py checks the weights)."""
    model2 = HookedTransformer(model.cfg)
    assert type(model2) is type(model) and model2.tokenizer is None


def test_to_tokens_default(model):
    s = "Hello, world!"
    tokens = model.to_tokens(s)
    assert equal(tokens, tensor([[BOS, *ids(s)]]).to(model.cfg.device)), "creates a tensor of tokens with BOS"


def test_to_tokens_without_bos(model):
    s = "Hello, world!"
    tokens = model.to_tokens(s, prepend_bos=False)
    assert equal(tokens, tensor([ids(s)]).to(model.cfg.device)), "creates a tensor without BOS"


@pytest.mark.skipif(
    torch.cuda.is_available() or torch.backends.mps.is_available(),
    reason="Test not relevant when running on GPU",
)
def test_to_tokens_device(model):
    s = "Hello, world!"
    tokens1 = model.to_tokens(s, move_to_device=False)
    tokens2 = model.to_tokens(s, move_to_device=True)
    assert equal(tokens1, tokens2), "move to device has no effect when running tests on CPU"


def test_to_tokens_truncate(model):
    assert model.cfg.n_ctx == 1024, "verify assumed context length"
    s = "@ " * 1025
    tokens1 = model.to_tokens(s)
    tokens2 = model.to_tokens(s, truncate=False)
    assert len(tokens1[0]) == 1024, "truncated by default"
    assert len(tokens2[0]) == 1 + len(ids(s)), "not truncated"  # TOKENS: TL's 1027


def test_to_string_from_to_tokens_without_bos(model):
    s = "Hello, world!"
    tokens = model.to_tokens(s, prepend_bos=False)
    s2 = model.to_string(tokens[0])
    assert s == s2, "same string when converted back to string"


def test_to_string_multiple(model):
    rows = [[BOS, vocab(CODE)["self"]], [GLITCH, vocab(CODE)["Ġreturn"]]]  # TOKENS
    s_list = model.to_string(tensor(rows))
    assert s_list == [decode(row) for row in rows], "can handle list of lists"
    assert s_list == ["<|endoftext|>self", " self return"]


def test_to_str_tokens_default(model):
    s_list = model.to_str_tokens(" SolidGoldMagikarp")
    assert s_list == ["<|endoftext|>"] + [decode([i]) for i in ids(" SolidGoldMagikarp")], "not a glitch token"


def test_to_str_tokens_without_bos(model):
    s_list = model.to_str_tokens(" SolidGoldMagikarp", prepend_bos=False)
    assert s_list == [decode([i]) for i in ids(" SolidGoldMagikarp")], "without BOS"


def test_to_single_token(model):
    token = model.to_single_token(SINGLE)
    assert token == vocab(CODE)[SINGLE], "single token"


def test_to_single_str_tokent(model):
    s = model.to_single_str_token(vocab(CODE)[SINGLE])
    assert s == SINGLE


def test_get_token_position_not_found(model):
    assert vocab(CODE)[SINGLE] not in ids(PROMPT) and vocab(CODE)["Ġ" + SINGLE] in ids(PROMPT)  # TOKENS
    single = SINGLE
    input = PROMPT
    with pytest.raises(AssertionError) as exc_info:
        model.get_token_position(single, input)
    assert str(exc_info.value) == "The token does not occur in the prompt", "assertion error"


def test_get_token_position_str(model):
    single = " some"
    input = PROMPT
    pos = model.get_token_position(single, input)
    assert pos == 1 + ids(PROMPT).index(vocab(CODE)["Ġsome"]), "first position"  # TOKENS: TL's 3


def test_get_token_position_str_without_bos(model):
    single = " some"
    input = PROMPT
    pos = model.get_token_position(single, input, prepend_bos=False)
    assert pos == ids(PROMPT).index(vocab(CODE)["Ġsome"]), "without BOS"  # TOKENS: TL's 2


def test_get_token_position_int_pos(model):
    single = 2
    input = tensor([2.0, 3, 4])
    pos1 = model.get_token_position(single, input)
    pos2 = model.get_token_position(single, input, prepend_bos=False)
    assert pos1 == 0, "first position"
    assert pos2 == 0, "no effect from BOS when using tensor as input"


def test_get_token_position_int_pos_last(model):
    single = 2
    input = tensor([2.0, 3, 4, 2, 5])
    pos1 = model.get_token_position(single, input, mode="last")
    assert pos1 == 3, "last position"


def test_get_token_position_int_1_pos(model):
    single = 2
    input = tensor([[2.0, 3, 4]])
    pos = model.get_token_position(single, input)
    assert pos == 0, "first position"


def test_tokens_to_residual_directions(model):
    res_dir = model.tokens_to_residual_directions(model.to_tokens(""))
    assert res_dir.shape == Size([D_MODEL]), ""


# ---- tests/unit/test_utils.py: test_to_str_tokens --------------------------------------------------------------
@pytest.fixture
def nested_list_1():
    return [1]


@pytest.fixture
def nested_list_1x1():
    return [[6]]


@pytest.fixture
def nested_list_1x3():
    return [[1, 2, 3]]


def test_to_str_tokens(model, nested_list_1, nested_list_1x1, nested_list_1x3):
    tensor_1_to_str_tokens = model.to_str_tokens(torch.tensor(nested_list_1))
    assert isinstance(tensor_1_to_str_tokens, list)
    assert len(tensor_1_to_str_tokens) == 1
    assert isinstance(tensor_1_to_str_tokens[0], str)

    tensor_1x1_to_str_tokens = model.to_str_tokens(torch.tensor(nested_list_1x1))
    assert isinstance(tensor_1x1_to_str_tokens, list)
    assert len(tensor_1x1_to_str_tokens) == 1
    assert isinstance(tensor_1x1_to_str_tokens[0], str)

    ndarray_1_to_str_tokens = model.to_str_tokens(np.array(nested_list_1))
    assert isinstance(ndarray_1_to_str_tokens, list)
    assert len(ndarray_1_to_str_tokens) == 1
    assert isinstance(ndarray_1_to_str_tokens[0], str)

    ndarray_1x1_to_str_tokens = model.to_str_tokens(np.array(nested_list_1x1))
    assert isinstance(ndarray_1x1_to_str_tokens, list)
    assert len(ndarray_1x1_to_str_tokens) == 1
    assert isinstance(ndarray_1x1_to_str_tokens[0], str)

    single_int_to_single_str_token = model.to_single_str_token(3)
    assert isinstance(single_int_to_single_str_token, str)

    squeezable_tensor_to_str_tokens = model.to_str_tokens(torch.tensor(nested_list_1x3))
    assert isinstance(squeezable_tensor_to_str_tokens, list)
    assert len(squeezable_tensor_to_str_tokens) == 3
    assert isinstance(squeezable_tensor_to_str_tokens[0], str)
    assert isinstance(squeezable_tensor_to_str_tokens[1], str)
    assert isinstance(squeezable_tensor_to_str_tokens[2], str)

    squeezable_ndarray_to_str_tokens = model.to_str_tokens(np.array(nested_list_1x3))
    assert isinstance(squeezable_ndarray_to_str_tokens, list)
    assert len(squeezable_ndarray_to_str_tokens) == 3
    assert isinstance(squeezable_ndarray_to_str_tokens[0], str)
    assert isinstance(squeezable_ndarray_to_str_tokens[1], str)
    assert isinstance(squeezable_ndarray_to_str_tokens[2], str)


# ---- tests/unit/test_utils.py: TestAttentionMask ----------------------------------------------------------------
class TestAttentionMask:
    prompts = [
        "Hello world!",
        "How are you today?",
        "I'm fine, thank you.",
        "I am happy.",
    ]

    prompts_with_sep = [
        "I like cats<|endoftext|>Cats are so cute",
        "Hello world!",
        "How are you<|endoftext|>I am fine, thanks",
    ]

    # fixtures
    @pytest.fixture(scope="class", params=["pad-is-not-bos", "pad-is-bos"])
    @classmethod
    def model_name(cls, request):
        return request.param

    @pytest.fixture(scope="class")
    @classmethod
    def model(cls, model_name):
        model = load(CODE)
        if model_name == "pad-is-bos":  # MODEL: as TL's gpt2-small, whose pad token is its BOS
            model.tokenizer.pad_token = model.tokenizer.bos_token
        return model

    # tests
    @pytest.mark.parametrize("padding_side", ["left", "right"])
    @pytest.mark.parametrize("prepend_bos", [True, False])
    @pytest.mark.parametrize("prompts_with_sep", [True, False])
    def test_get_attention_mask(self, model, padding_side, prepend_bos, prompts_with_sep):
        # setup
        model.tokenizer.padding_side = padding_side
        model.tokenizer.sep_token_id = model.tokenizer.pad_token_id
        prepend_bos = prepend_bos

        prompts = self.prompts_with_sep if prompts_with_sep else self.prompts
        tokens = model.to_tokens(prompts, prepend_bos=prepend_bos)

        attention_mask = utils.get_attention_mask(model.tokenizer, tokens, prepend_bos=prepend_bos)  # [batch pos]

        # dimension should be the same
        assert attention_mask.shape == tokens.shape

        # number of attended tokens for each sequence
        # should be the same as the number of 1s in the attention mask for that sequence
        str_tokens = model.to_str_tokens(prompts, prepend_bos=prepend_bos)
        intended_num_attended_tokens = torch.tensor([len(t) for t in str_tokens], device=attention_mask.device)
        assert (intended_num_attended_tokens == attention_mask.sum(dim=1)).all()

        # all the masked tokens should be the padding token
        assert (tokens[attention_mask == 0] == model.tokenizer.pad_token_id).all()

        if padding_side == "right":
            # the first token is always attended
            assert (attention_mask[:, 0] == 1).all()

            # attended tokens are at the beginning of the sequence
            for i, num in enumerate(intended_num_attended_tokens.tolist()):
                assert (attention_mask[i, 0:num] == 1).all()

        else:  # left padding case
            # the last token is always attended
            assert (attention_mask[:, -1] == 1).all()

            # attended tokens are at the end of the sequence
            for i, num in enumerate(intended_num_attended_tokens.tolist()):
                assert (attention_mask[i, -num:] == 1).all()

        # the following tests make sense only when the prompts do not contain the separator token
        if not prompts_with_sep:
            non_pad_token_mask = (tokens != model.tokenizer.pad_token_id).int()
            attended_but_non_pad_mask = attention_mask != non_pad_token_mask
            if model.tokenizer.bos_token == model.tokenizer.pad_token and prepend_bos:
                # if bos_token is the same as pad_token and prepend_bos is True,
                # then there is one attended but non-pad token (bos token) in each sequence
                assert attended_but_non_pad_mask.sum() == tokens.shape[0]
            else:
                # otherwise, there should be no attended but non-pad token
                assert attended_but_non_pad_mask.sum() == 0


# ---- tests/unit/utilities/test_tokenize_utils.py ------------------------------------------------------------------
@pytest.fixture
def gpt2_tokenizer(model):
    return model.tokenizer  # TOKENS: CODE's tokenizer for TL's gpt2 one


def test_attention_mask_uses_explicit_padding_side(gpt2_tokenizer) -> None:
    tokenizer = copy.deepcopy(gpt2_tokenizer)
    tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    pad = tokenizer.pad_token_id
    tokens = torch.tensor([[pad, pad, 10, 11], [pad, 20, 21, 22]])

    mask = utils.get_attention_mask(tokenizer, tokens, prepend_bos=True, padding_side="left")

    assert torch.equal(mask, torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]))
