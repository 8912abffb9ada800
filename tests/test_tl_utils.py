"""TransformerLens's utils tests, ported: tests/unit/test_utils.py (TestSlice, Test_is_square,
Test_lower_triangular, test_override_or_use_default_value), tests/unit/utilities/test_slice.py (int-like
scalars) and tests/unit/utilities/test_tensors.py's TestToNumpy; then moelens's own tests of the rest of
TransformerLens's utils that TL's suite leaves untested (get_corner, remove_batch_dim, lm_cross_entropy_loss,
lm_accuracy, get_device, tokenize_and_concatenate), each against a reference written here.

Ported elsewhere: test_utils.py's test_to_str_tokens and TestAttentionMask (test_tl_tokenization.py); TL's
get_act_name examples (its docstring) are test_tl_parity_names.py's. Not ported: test_utils.py's weight
initialisers (calc_fan_in_and_fan_out, init_kaiming_*, init_xavier_*: moelens builds no randomly initialised
model to train; its weights come from a checkpoint) and test_test_prompt (its expected text is solu-1l's logits).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tl_port import CODE, load
from torch.testing import assert_close

import moelens.utils as utils
from moelens import FactoredMatrix
from moelens.utils import Slice, to_numpy

ref_tensor = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
shape = ref_tensor.shape
tensor_row0_dim2 = torch.tensor([[1, 2, 3, 4, 5]])
shape_2 = tensor_row0_dim2.shape
tensor_row0_dim1 = torch.tensor([1, 2, 3, 4, 5])
shape_1 = tensor_row0_dim1.shape


# ---- tests/unit/test_utils.py ---------------------------------------------------------------------------------
class TestSlice:
    @pytest.mark.parametrize(
        "input_slice, expected_shape",
        [
            ([0], shape_2),
            ((1,), shape_2),
            (torch.tensor([0]), shape_2),
            (np.array([0]), shape_2),
            (0, shape_1),
            (torch.tensor(0), shape_1),
            (None, shape),
        ],
    )
    def test_modularity_shape(self, input_slice, expected_shape):
        slc = utils.Slice(input_slice=input_slice)
        sliced_tensor = slc.apply(ref_tensor)
        assert sliced_tensor.shape == expected_shape

    @pytest.mark.parametrize(
        "input_slice, expected_tensor",
        [
            ([0], tensor_row0_dim2),
            (torch.tensor([0]), tensor_row0_dim2),
            (np.array([0]), tensor_row0_dim1),
            (0, tensor_row0_dim1),
            (torch.tensor(0), tensor_row0_dim1),
            (None, ref_tensor),
        ],
    )
    def test_modularity_tensor(self, input_slice, expected_tensor):
        slc = utils.Slice(input_slice=input_slice)
        sliced_tensor = slc.apply(ref_tensor)
        assert (sliced_tensor == expected_tensor).all()

    @pytest.mark.parametrize(
        "input_slice, expected_indices",
        [
            ([0, 1], np.array([0, 1])),
            (0, np.array(0)),
            (torch.tensor(0), np.array(0)),
        ],
    )
    def test_indices(self, input_slice, expected_indices):
        slc = utils.Slice(input_slice=input_slice)
        indices = slc.indices(2)
        assert (indices == expected_indices).all()

    def test_indices_error(self):
        with pytest.raises(ValueError):
            _ = utils.Slice(input_slice=[0, 2, 5]).indices()


class Test_is_square:
    failed_cases = (
        torch.tensor([]),
        torch.tensor(2),
        torch.ones(2, 3),
        torch.zeros(2),
        torch.ones(3, 3, 3),
        torch.ones(1, 1, 1, 1),
    )

    @pytest.mark.parametrize("x", (torch.ones(3, 3), torch.zeros(1, 1)))
    def test_pass(self, x: torch.Tensor):
        assert utils.is_square(x)

    @pytest.mark.parametrize("x", failed_cases)
    def test_fail(self, x: torch.Tensor):
        assert not utils.is_square(x)


class Test_lower_triangular:
    @pytest.mark.parametrize(
        "x",
        (
            torch.eye(4),
            torch.ones(4, 4).tril(),
            torch.ones(4, 4).triu().T,
            torch.zeros(4, 4),
        ),
    )
    def test_pass(self, x: torch.Tensor):
        assert utils.is_lower_triangular(x)

    @pytest.mark.parametrize(
        "x",
        (
            *Test_is_square.failed_cases,
            torch.ones(4, 4).triu(),
            torch.ones(4, 4).tril().T,
            torch.ones(3, 3),
        ),
    )
    def test_fail(self, x: torch.Tensor):
        assert not utils.is_lower_triangular(x)


def test_override_or_use_default_value():
    # Case when override is not None
    assert utils.override_or_use_default_value(default_flag=True, override=True) == True  # noqa: E712
    assert utils.override_or_use_default_value(default_flag=True, override=False) == False  # noqa: E712
    assert utils.override_or_use_default_value(default_flag=False, override=True) == True  # noqa: E712
    assert utils.override_or_use_default_value(default_flag=False, override=False) == False  # noqa: E712

    # Case when override is None
    assert utils.override_or_use_default_value(default_flag=True, override=None) == True  # noqa: E712
    assert utils.override_or_use_default_value(default_flag=False, override=None) == False  # noqa: E712

    # Case when override is not passed
    assert utils.override_or_use_default_value(default_flag=True) == True  # noqa: E712
    assert utils.override_or_use_default_value(default_flag=False) == False  # noqa: E712


# ---- tests/unit/utilities/test_slice.py -----------------------------------------------------------------------
@pytest.fixture
def tensor():
    return torch.arange(24).reshape(4, 6)


@pytest.mark.parametrize(
    "scalar",
    [np.int64(2), np.int32(2), torch.tensor(2), np.array(2)],
    ids=["np-int64", "np-int32", "0d-tensor", "0d-ndarray"],
)
class TestIntLikeScalars:
    def test_init_matches_plain_int(self, scalar, tensor):
        sliced = Slice(scalar)
        assert sliced.mode == "int"
        assert sliced.slice == 2
        assert_close(sliced.apply(tensor), Slice(2).apply(tensor))

    def test_indices_matches_plain_int(self, scalar, tensor):
        np.testing.assert_array_equal(Slice(scalar).indices(), Slice(2).indices())

    def test_unwrap_matches_plain_int(self, scalar, tensor):
        unwrapped = Slice.unwrap(scalar)
        reference = Slice.unwrap(2)
        assert unwrapped.mode == reference.mode == "array"
        assert_close(unwrapped.apply(tensor), reference.apply(tensor))


def test_bool_scalars_are_not_coerced():
    # TL also asserts that its private helper to_python_int gives None for True, tensor(True) and array(True)
    assert Slice(torch.tensor([True, False])).mode == "array"


def test_plain_int_unchanged(tensor):
    sliced = Slice(3)
    assert sliced.mode == "int"
    assert_close(sliced.apply(tensor), tensor[3])


# ---- tests/unit/utilities/test_tensors.py: TestToNumpy ---------------------------------------------------------
class TestToNumpy:
    def test_bfloat16_tensor(self):
        tensor = torch.tensor([1.0, 2.0, -3.5], dtype=torch.bfloat16)
        result = to_numpy(tensor)
        assert isinstance(result, np.ndarray)
        assert result.dtype == np.float32
        np.testing.assert_array_equal(result, np.array([1.0, 2.0, -3.5], dtype=np.float32))

    def test_float32_tensor_passthrough(self):
        tensor = torch.tensor([1.5, 2.5], dtype=torch.float32)
        result = to_numpy(tensor)
        assert isinstance(result, np.ndarray)
        assert result.dtype == np.float32
        np.testing.assert_array_equal(result, np.array([1.5, 2.5], dtype=np.float32))

    def test_float16_tensor(self):
        tensor = torch.tensor([1.0, 2.0], dtype=torch.float16)
        result = to_numpy(tensor)
        assert isinstance(result, np.ndarray)
        assert result.dtype == np.float16

    def test_int_tensor(self):
        tensor = torch.tensor([1, 2, 3], dtype=torch.int64)
        result = to_numpy(tensor)
        assert isinstance(result, np.ndarray)
        np.testing.assert_array_equal(result, np.array([1, 2, 3]))

    def test_parameter_bfloat16(self):
        param = torch.nn.Parameter(torch.tensor([4.0, 5.0], dtype=torch.bfloat16))
        result = to_numpy(param)
        assert isinstance(result, np.ndarray)
        assert result.dtype == np.float32
        np.testing.assert_array_equal(result, np.array([4.0, 5.0], dtype=np.float32))

    def test_numpy_array_passthrough(self):
        array = np.array([1.0, 2.0])
        result = to_numpy(array)
        assert result is array

    def test_list_and_tuple(self):
        np.testing.assert_array_equal(to_numpy([1, 2, 3]), np.array([1, 2, 3]))
        np.testing.assert_array_equal(to_numpy((4, 5, 6)), np.array([4, 5, 6]))

    def test_scalar(self):
        result = to_numpy(3.5)
        assert isinstance(result, np.ndarray)
        assert result.item() == 3.5

    def test_invalid_type_raises(self):
        with pytest.raises(ValueError, match="invalid type"):
            to_numpy({"a": 1})


# ---- moelens's tests of the rest of TransformerLens's utils ----------------------------------------------------
def test_slice_masks_and_negative_indices_select_what_numpy_selects():
    t = torch.arange(12).reshape(3, 4)
    assert torch.equal(Slice(torch.tensor([True, False, True, False])).apply(t, dim=1), t[:, [0, 2]])
    assert torch.equal(Slice([-1, 0]).apply(t, dim=-1), t[:, [3, 0]])
    assert torch.equal(Slice((1, None)).apply(t), t[1:])
    with pytest.raises(IndexError, match="out of range for an axis of size 3"):
        Slice([3]).apply(t)
    with pytest.raises(IndexError, match="one entry per index of the axis"):
        Slice(torch.tensor([True, False])).apply(t)
    with pytest.raises(ValueError, match="Invalid input_slice"):
        Slice("0")
    with pytest.raises(ValueError, match="a bool is not an index"):
        Slice(True)


def test_get_corner_of_tensors_and_factored_matrices():
    t = torch.arange(5 * 6 * 7).reshape(5, 6, 7)
    assert torch.equal(utils.get_corner(t), t[:3, :3, :3])
    assert torch.equal(utils.get_corner(t, n=2), t[:2, :2, :2])
    A, B = torch.randn(2, 5, 3), torch.randn(2, 3, 6)
    corner = utils.get_corner(FactoredMatrix(A, B), n=2)
    assert_close(corner, (A @ B)[:2, :2, :2])


def test_remove_batch_dim_and_transpose():
    assert utils.remove_batch_dim(torch.zeros(1, 3, 4)).shape == (3, 4)
    assert utils.remove_batch_dim(torch.zeros(2, 3, 4)).shape == (2, 3, 4)  # not a batch of one: unchanged
    assert utils.transpose(torch.zeros(2, 3, 4)).shape == (2, 4, 3)


def test_lm_cross_entropy_loss_and_accuracy_against_torch():
    """TL's definitions, checked against F.cross_entropy on the shifted tokens and a hand count."""
    torch.manual_seed(0)
    logits, tokens = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    per_token = F.cross_entropy(logits[:, :-1].reshape(-1, 7), tokens[:, 1:].reshape(-1), reduction="none").view(2, 4)
    assert_close(utils.lm_cross_entropy_loss(logits, tokens, per_token=True), per_token)
    assert_close(utils.lm_cross_entropy_loss(logits, tokens), per_token.mean())
    # a mask: a prediction counts only where it and the token it predicts are both real
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    counted = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    assert_close(utils.lm_cross_entropy_loss(logits, tokens, attention_mask=mask), per_token[counted].mean())
    assert_close(
        utils.lm_cross_entropy_loss(logits, tokens, attention_mask=mask, per_token=True), per_token * counted
    )
    hits = torch.tensor([[logits[b, p].argmax() == tokens[b, p + 1] for p in range(4)] for b in range(2)])
    assert torch.equal(utils.lm_accuracy(logits, tokens, per_token=True), hits)
    assert_close(utils.lm_accuracy(logits, tokens), hits.float().mean())
    with pytest.raises(ValueError, match="attention_mask must have the same shape as tokens"):
        utils.lm_cross_entropy_loss(logits, tokens, attention_mask=mask[:, :4])
    with pytest.raises(ValueError, match=r"logits \(2, 5, 7\) do not match tokens \(2, 4\)"):
        utils.lm_accuracy(logits, tokens[:, :4])


def test_lm_cross_entropy_loss_is_the_models_loss():
    model = load(CODE)
    tokens = model.to_tokens(["def f(x):\n    return x", "import os"])
    mask = (tokens != model.tokenizer.pad_token_id).long()
    logits = model(tokens, attention_mask=mask)
    assert_close(utils.lm_cross_entropy_loss(logits, tokens, attention_mask=mask), model(tokens, attention_mask=mask, return_type="loss"))


def test_get_device():
    assert utils.get_device() == ("cuda" if torch.cuda.is_available() else "cpu")


def test_tokenize_and_concatenate_joins_documents_with_eos_and_cuts_rows():
    datasets = pytest.importorskip("datasets")
    model = load(CODE)
    tok = model.tokenizer
    texts = ["def f(x):\n    return x\n", "import os\nprint(os.sep)\n", "class A:\n    pass\n"]
    dataset = datasets.Dataset.from_dict({"text": texts, "meta": [1, 2, 3]})
    rows = utils.tokenize_and_concatenate(dataset, tok, max_length=8, num_proc=None)
    # by hand: documents joined with EOS between them, cut into rows of 7, each after a BOS
    joined = []
    for i, text in enumerate(texts):
        joined += tok(text, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if i < len(texts) - 1 else [])
    expected = [[tok.bos_token_id, *joined[i : i + 7]] for i in range(0, len(joined) // 7 * 7, 7)]
    assert rows.column_names == ["tokens"]
    got = rows[:]["tokens"]  # the torch format: one [rows, max_length] tensor
    assert isinstance(got, torch.Tensor) and got.tolist() == expected
    short = utils.tokenize_and_concatenate(
        datasets.Dataset.from_dict({"text": ["x"]}), tok, max_length=5, add_bos_token=False, num_proc=None
    )
    assert short[:]["tokens"].tolist() == [tok("x", add_special_tokens=False)["input_ids"] + [tok.pad_token_id] * 4]
    with pytest.raises(KeyError, match="no column 'content'"):
        utils.tokenize_and_concatenate(dataset, tok, column_name="content", num_proc=None)
    with pytest.raises(TypeError, match="takes a datasets.Dataset"):
        utils.tokenize_and_concatenate(texts, tok)


def test_factored_matrix_dimensions_and_row_column_indexing():
    """TransformerLens's FactoredMatrix names (ldim, rdim, mdim) and indexing past the leading axes: rows index
    A, columns index B, an int keeps its matrix axis; the product is the dense product's slice."""
    torch.manual_seed(0)
    A, B = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 4, 6)
    fm, dense = FactoredMatrix(A, B), A @ B
    assert (fm.ldim, fm.rdim, fm.mdim) == (5, 6, 4)
    assert_close(fm[1].AB, dense[1])
    assert_close(fm[1, 2, 1:4].AB, dense[1, 2, 1:4])
    assert_close(fm[1, 2, :, [5, 0]].AB, dense[1, 2][:, [5, 0]])
    assert_close(fm[1, 2, -1, 3].AB, dense[1, 2, -1:, 3:4])
    assert_close(fm[0, 0, torch.tensor([4, 1])].AB, dense[0, 0, [4, 1]])
    with pytest.raises(IndexError, match="too many indices"):
        fm[0, 0, 0, 0, 0]
    with pytest.raises(IndexError, match="out of range for a FactoredMatrix axis of size 5"):
        fm[0, 0, 5]
