"""Bad input to forward, generate, the KV cache and the command line: a clear error naming what is at fault and
what was expected, never a silently wrong result."""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from moelens import HookedTransformer, KVCache
from moelens.cli import main


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    """The embedded default: it has a (byte-level) tokenizer."""
    from moelens.defaults import default_checkpoint

    return HookedTransformer.from_pretrained(default_checkpoint("tiny-qwen2-moe", root=tmp_path_factory.mktemp("cache")), progress=False)


TOKENS = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])


# ---- KV cache ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("delta", [-1, 1])
def test_a_kv_cache_with_another_number_of_layers_is_refused(qwen_model, delta):
    n = qwen_model.cfg.n_layers
    with pytest.raises(ValueError, match=f"KVCache has {n + delta} layers, the model has {n}"):
        qwen_model(TOKENS, past_kv_cache=KVCache(n + delta))
    cache = KVCache.for_model(qwen_model)
    assert torch.allclose(qwen_model(TOKENS, past_kv_cache=cache), qwen_model(TOKENS), atol=1e-5)


# ---- attention_mask ------------------------------------------------------------------------------------------
def run_forward(model, tokens, mask):
    return model(tokens, attention_mask=mask)


def run_cached(model, tokens, mask):
    cache = KVCache.for_model(model)
    model(tokens[:, :1], attention_mask=torch.ones_like(tokens[:, :1]), past_kv_cache=cache)
    new_mask = mask[:, 1:] if torch.is_tensor(mask) else [row[1:] for row in mask]
    return model(tokens[:, 1:], attention_mask=new_mask, past_kv_cache=cache)


def run_generate(model, tokens, mask):
    return model.generate(tokens, attention_mask=mask, max_new_tokens=2, stop_at_eos=False, do_sample=False)


CALLERS = [run_forward, run_cached, run_generate]


@pytest.mark.parametrize("call", CALLERS, ids=["forward", "kv_cache", "generate"])
def test_a_mask_must_be_an_int_or_bool_tensor_of_0_and_1(qwen_model, call):
    mask = torch.ones_like(TOKENS)
    mask[1, 2] = 2  # would shift every later position of row 1
    with pytest.raises(ValueError, match=r"attention_mask holds 2 at \[1, [12]\].*0 \(padding\) or 1"):
        call(qwen_model, TOKENS, mask)
    with pytest.raises(TypeError, match="attention_mask must hold integers or bools.*float32"):
        call(qwen_model, TOKENS, torch.full(TOKENS.shape, 0.5))
    with pytest.raises(TypeError, match=r"attention_mask must be a tensor \[batch pos\] of 0/1, got list"):
        call(qwen_model, TOKENS, torch.ones_like(TOKENS).tolist())
    with pytest.raises(ValueError, match=r"attention_mask has shape \(2, [23]\), expected \(2, [34]\)"):
        call(qwen_model, TOKENS, torch.ones(2, 3, dtype=torch.long))
    left = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    assert torch.equal(call(qwen_model, TOKENS, left.bool()), call(qwen_model, TOKENS, left))


@pytest.mark.parametrize("mask", [[[1, 1, 1, 1], [1, 1, 1, 0]], [[1, 1, 1, 1], [1, 0, 1, 1]]], ids=["right", "gap"])
def test_generate_refuses_right_padding(qwen_model, mask):
    with pytest.raises(ValueError, match=r"attention_mask row 1 has padding \(0\) at position \d.*left padding"):
        qwen_model.generate(TOKENS, attention_mask=torch.tensor(mask), max_new_tokens=2, do_sample=False)


def test_generate_refuses_right_padding_from_a_tokenizer(text_model, monkeypatch):
    batch = type(text_model.tokenizer).batch

    def right_padded(self, texts, prepend_bos=False, padding_side="left"):
        return batch(self, texts, prepend_bos, "right")

    monkeypatch.setattr(type(text_model.tokenizer), "batch", right_padded)
    with pytest.raises(ValueError, match="left padding"):
        text_model.generate(["a", "abc"], max_new_tokens=2, do_sample=False)


def test_generate_refuses_a_row_with_no_real_token(qwen_model):
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]])
    with pytest.raises(ValueError, match="attention_mask row 1 is all 0"):
        qwen_model.generate(TOKENS, attention_mask=mask, max_new_tokens=2, do_sample=False)


# ---- empty, list and position inputs ---------------------------------------------------------------------------
@pytest.mark.parametrize("empty", [torch.zeros(1, 0, dtype=torch.long), torch.tensor([], dtype=torch.long), "", []])
def test_an_input_with_no_tokens_is_an_error(text_model, empty):
    with pytest.raises(ValueError, match="the input has no tokens"):
        text_model(empty)
    with pytest.raises(ValueError, match="the input has no tokens"):
        text_model.generate(empty, max_new_tokens=2, do_sample=False)


@pytest.mark.parametrize("ids", [[1, 2, 3], [[1, 2], [3]], [[1, 2], [3, 4]]], ids=["ints", "ragged", "rows"])
def test_lists_of_token_ids_are_refused_with_the_way_to_pass_them(text_model, ids):
    with pytest.raises(TypeError, match=r"got a list holding (int|list).*torch\.tensor\(\[\.\.\.\]\)"):
        text_model(ids)
    with pytest.raises(TypeError, match=r"torch\.tensor"):
        text_model.generate(ids, max_new_tokens=2, do_sample=False)
    with pytest.raises(TypeError, match=r"torch\.tensor"):
        text_model.to_tokens(ids)


def test_to_str_tokens_takes_one_sequence_of_valid_ids(text_model):
    assert text_model.to_str_tokens([72, 105]) == text_model.to_str_tokens(torch.tensor([[72, 105]])) == ["H", "i"]
    with pytest.raises(TypeError, match="list holding list"):
        text_model.to_str_tokens([[1, 2], [3]])
    with pytest.raises(ValueError, match=r"token id 999 at \[0, 1\] is outside the vocabulary"):
        text_model.to_str_tokens([72, 999])  # would decode to "" silently
    with pytest.raises(ValueError, match="one sequence"):
        text_model.to_str_tokens(torch.ones(1, 2, 3, dtype=torch.long))


def test_position_ids_must_be_batch_pos(qwen_model):
    per_row = torch.arange(4).expand(2, 4)
    expected = qwen_model(TOKENS, position_ids=per_row)
    assert torch.equal(qwen_model(TOKENS, position_ids=torch.arange(4)[None]), expected)
    assert torch.equal(qwen_model(TOKENS, position_ids=torch.arange(4)), expected)
    for shape in [(2, 1), (1, 3), (2, 5), (3, 4)]:  # (2, 1) would broadcast: one position for every token
        message = rf"position_ids has shape \({shape[0]}, {shape[1]}\).*\[batch pos\] = \(2, 4\)"
        with pytest.raises(ValueError, match=message):
            qwen_model(TOKENS, position_ids=torch.zeros(shape, dtype=torch.long))
    with pytest.raises(TypeError, match="position_ids must be integer ids.*float32"):
        qwen_model(TOKENS, position_ids=per_row.float())


# ---- generate's arguments ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_new_tokens=-1), "max_new_tokens must be an int >= 0, got -1"),
        (dict(temperature=-0.5), "temperature must be >= 0.*got -0.5"),
        (dict(top_k=0), "top_k must be a positive int.*got 0"),
        (dict(top_k=-2), "top_k must be a positive int.*got -2"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\].*got 0.0"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\].*got 1.5"),
        (dict(eos_token_id=96), r"eos_token_id must be token ids of the vocabulary \[0, 96\), got 96"),
        (dict(eos_token_id=[3, -1]), r"eos_token_id .*got \[3, -1\]"),
    ],
)
@pytest.mark.parametrize("do_sample", [False, True])
def test_generate_refuses_bad_arguments(qwen_model, kwargs, message, do_sample):
    with pytest.raises(ValueError, match=message):
        qwen_model.generate(TOKENS, do_sample=do_sample, **{"max_new_tokens": 2, **kwargs})


# ---- longer than the model was trained for ------------------------------------------------------------------------
def test_a_too_long_input_warns_once_per_model(qwen_path):
    for use_cache in [False, True]:
        model = HookedTransformer.from_pretrained(qwen_path, progress=False)
        limit = model.cfg.max_position_embeddings
        tokens = torch.zeros(1, limit + 1, dtype=torch.long)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(tokens[:, :limit])
            assert not caught
            if use_cache:  # the cached positions count
                cache = KVCache.for_model(model)
                model(tokens[:, :limit], past_kv_cache=cache)
                assert not caught
                model(tokens[:, :1], past_kv_cache=cache)
            else:
                model(tokens)
            model(tokens)
        assert len(caught) == 1
        assert f"{limit + 1} positions long" in str(caught[0].message)
        assert f"max_position_embeddings {limit}" in str(caught[0].message)


# ---- command line ------------------------------------------------------------------------------------------------
def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_cli_prompt_that_is_not_token_ids_for_a_model_without_tokenizer(qwen_path, capsys):
    assert main(["inspect", str(qwen_path), "--prompt", "hello world"]) == 2
    err = one_line_error(capsys)
    assert err.startswith("moelens: error:") and "no tokenizer" in err and "'hello world'" in err
    assert main(["inspect", str(qwen_path), "--prompt", "1 2 3"]) == 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["inspect", "--top", "-3"], "argument --top: expected a positive integer, got -3"),
        (["inspect", "--top", "many"], "argument --top: expected a positive integer, got 'many'"),
        (["inspect", "--dtype", "float8"], "argument --dtype: invalid choice: 'float8'"),
        (["verify", "tiny-qwen2-moe", "--seq-len", "0"], "argument --seq-len: expected a positive integer, got 0"),
    ],
)
def test_cli_usage_errors_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    assert message in one_line_error(capsys)


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_cli_missing_model_is_one_line(command, tmp_path, capsys):
    assert main([command, str(tmp_path / "missing")]) == 2
    assert f"moelens: error: no checkpoint folder at {tmp_path / 'missing'}" in one_line_error(capsys)


def test_cli_empty_prompt_is_one_line(qwen_path, capsys):
    assert main(["inspect", str(qwen_path), "--prompt", ""]) == 2
    assert "the input has no tokens" in one_line_error(capsys)


def test_cli_process_exits_without_traceback(tmp_path):
    root = Path(__file__).parent.parent
    env = {**os.environ, "MOELENS_CACHE": str(tmp_path), "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, "-m", "moelens", "inspect", "--top", "-3"], capture_output=True, text=True, env=env, cwd=root
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1
    assert "--top" in done.stderr


# ---- a model on the meta device ------------------------------------------------------------------------------
META_CALLS = {
    "forward": lambda m: m(TOKENS),
    "run_with_cache": lambda m: m.run_with_cache(TOKENS),
    "start_at_layer": lambda m: m(torch.zeros(2, 4, m.cfg.d_model), start_at_layer=1),
    "generate": lambda m: m.generate(TOKENS, max_new_tokens=2, do_sample=False),
}


@pytest.mark.parametrize("call", list(META_CALLS))
@pytest.mark.parametrize("how", ["moved", "loaded"])
def test_a_model_on_meta_says_its_weights_are_on_meta(text_model, call, how):
    """Was torch's "Tensor.item() cannot be called on meta tensors" from deep in the forward."""
    if how == "moved":
        model = HookedTransformer.from_pretrained(text_model.name_or_path, progress=False).to("meta")
    else:
        model = HookedTransformer.from_pretrained(text_model.name_or_path, progress=False, device="meta")
    with pytest.raises(RuntimeError, match=r"this model's weights are on the meta device .*Load it again"):
        META_CALLS[call](model)
