"""TransformerLens's own API tests, ported to moelens: how much of TL's tested behaviour a TL user gets.

Not a pytest file and not run in CI: `python tools/tl_api_conformance.py` prints each failure's reason, then
passed/total per TL test file and overall.

Ported from TransformerLensOrg/TransformerLens: tests/unit/test_hooks.py, test_hook_points.py,
test_start_at_layer.py, test_stop_at_layer.py, test_tokenization_methods.py, test_attention_mask.py,
test_utils.py (TestAttentionMask), tests/acceptance/test_activation_cache.py, and utils.get_act_name's
docstring examples. What changed, and only that:
- model construction: every model is moelens.HookedTransformer.from_pretrained("tiny-qwen2-moe") (TL's tests
  build solu-1l, solu-2l, attn-only-2l, gpt2-small or a random HookedTransformerConfig);
- the tokenizer's constants: expected ids are those of the embedded byte-level vocabulary (a byte's id is its
  value, "<|endoftext|>" 256, "<|pad|>" 257), and the IOI answers are single bytes ("M", "J", ...) so that
  to_single_token holds them; sizes TL's tests write out (d_vocab 50, d_model 512) are the model's cfg;
- scaffolding TL's tests import (utils.Slice) comes from the installed transformer_lens.
- layer indices are kept relative to the end where TL's test means "the last block(s)" of its 3-layer model
  (the embedded model has 4).
Everything a test asserts is kept, including what cannot hold for a rotary MoE model (hook_pos_embed, dense
MLP sites): those failures are listed with their reason.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
import traceback
from collections import defaultdict
from collections.abc import Callable

import torch

from moelens import HookedTransformer, utils
from moelens.hooks import HookPoint

try:  # scaffolding only: TL's tests pass its Slice objects
    from transformer_lens.utils import Slice
except ImportError:  # pragma: no cover - the comparison needs TL installed
    sys.exit("tools/tl_api_conformance.py needs transformer_lens installed (for utils.Slice)")

NAME = "tiny-qwen2-moe"
TESTS: list[tuple[str, str, Callable[[], None]]] = []


def tl_test(source: str):
    """Register a ported test under the TL file it comes from."""

    def register(fn):
        TESTS.append((source, fn.__name__, fn))
        return fn

    return register


def load() -> HookedTransformer:
    return HookedTransformer.from_pretrained(NAME, progress=False)


class raises(contextlib.AbstractContextManager):
    """pytest.raises without pytest: the block must raise `kind`."""

    def __init__(self, kind):
        self.kind = kind

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            raise AssertionError(f"did not raise {self.kind.__name__}")
        if not issubclass(exc_type, self.kind):
            return False
        self.value = exc
        return True


# ---- tests/unit/test_hooks.py -------------------------------------------------------------------------------
HOOKS = "test_hooks.py"
_hooks_model: list[HookedTransformer] = []
prompt = "Hello World!"


def embed(name):
    return name == "hook_embed"


def hooks_model() -> HookedTransformer:
    if not _hooks_model:
        _hooks_model.append(load())
    return _hooks_model[0]


class Counter:
    def __init__(self):
        self.count = 0

    def inc(self, *args, **kwargs):
        self.count += 1


@tl_test(HOOKS)
def test_hook_attaches_normally():
    model = hooks_model()
    c = Counter()
    _ = model.run_with_hooks(prompt, fwd_hooks=[(embed, c.inc)])
    assert all([len(hp.fwd_hooks) == 0 for _, hp in model.hook_dict.items()])
    assert c.count == 1
    model.remove_all_hook_fns(including_permanent=True)


@tl_test(HOOKS)
def test_perma_hook_attaches_normally():
    model = hooks_model()
    c = Counter()
    model.add_perma_hook(embed, c.inc)
    assert len(model.hook_dict["hook_embed"].fwd_hooks) == 1
    model.run_with_hooks(prompt, fwd_hooks=[])
    assert len(model.hook_dict["hook_embed"].fwd_hooks) == 1
    assert c.count == 1
    model.remove_all_hook_fns(including_permanent=True)


@tl_test(HOOKS)
def test_hook_context_manager():
    model = hooks_model()
    c = Counter()
    try:
        with model.hooks(fwd_hooks=[(embed, c.inc)]):
            assert len(model.hook_dict["hook_embed"].fwd_hooks) == 1
            model.forward(prompt)
        assert len(model.hook_dict["hook_embed"].fwd_hooks) == 0
        assert c.count == 1
    finally:
        model.remove_all_hook_fns(including_permanent=True)


@tl_test(HOOKS)
def test_nested_hook_context_manager():
    model = hooks_model()
    c = Counter()
    try:
        with model.hooks(fwd_hooks=[(embed, c.inc)]):
            assert len(model.hook_dict["hook_embed"].fwd_hooks) == 1
            model.forward(prompt)
            assert c.count == 1
            with model.hooks(fwd_hooks=[(embed, c.inc)]):
                assert len(model.hook_dict["hook_embed"].fwd_hooks) == 2
                model.forward(prompt)
                assert c.count == 3
            assert len(model.hook_dict["hook_embed"].fwd_hooks) == 1
        assert len(model.hook_dict["hook_embed"].fwd_hooks) == 0
        assert c.count == 3
    finally:
        model.remove_all_hook_fns(including_permanent=True)


@tl_test(HOOKS)
def test_context_manager_run_with_cache():
    model = hooks_model()
    c = Counter()
    try:
        with model.hooks(fwd_hooks=[(embed, c.inc)]):
            assert len(model.hook_dict["hook_embed"].fwd_hooks) == 1
            model.run_with_cache(prompt)
            assert len(model.hook_dict["hook_embed"].fwd_hooks) == 1
        assert len(model.hook_dict["hook_embed"].fwd_hooks) == 0
        assert c.count == 1
    finally:
        model.remove_all_hook_fns(including_permanent=True)


@tl_test(HOOKS)
def test_hook_context_manager_with_permanent_hook():
    model = hooks_model()
    c = Counter()
    try:
        model.add_perma_hook(embed, c.inc)
        assert len(model.hook_dict["hook_embed"].fwd_hooks) == 1
        with model.hooks(fwd_hooks=[(embed, c.inc)]):
            assert len(model.hook_dict["hook_embed"].fwd_hooks) == 2
            model.forward(prompt)
        assert len(model.hook_dict["hook_embed"].fwd_hooks) == 1
        assert c.count == 2
    finally:
        model.remove_all_hook_fns(including_permanent=True)


@tl_test(HOOKS)
def test_nested_context_manager_with_failure():
    model = hooks_model()

    def fail_hook(z, hook):
        raise ValueError("fail")

    c = Counter()
    try:
        with model.hooks(fwd_hooks=[(embed, c.inc)]):
            with raises(ValueError):
                with model.hooks(fwd_hooks=[(embed, fail_hook)]):
                    assert len(model.hook_dict["hook_embed"].fwd_hooks) == 2
                    model.forward(prompt)
            assert len(model.hook_dict["hook_embed"].fwd_hooks) == 1
            assert c.count == 1
        assert len(model.hook_dict["hook_embed"].fwd_hooks) == 0
    finally:
        model.remove_all_hook_fns(including_permanent=True)


@tl_test(HOOKS)
def test_reset_hooks_in_context_manager():
    model = hooks_model()
    c = Counter()
    try:
        with model.hooks(fwd_hooks=[(embed, c.inc)]):
            assert len(model.hook_dict["hook_embed"].fwd_hooks) == 1
            model.reset_hooks()
            assert len(model.hook_dict["hook_embed"].fwd_hooks) == 0
        assert len(model.hook_dict["hook_embed"].fwd_hooks) == 0
    finally:
        model.remove_all_hook_fns(including_permanent=True)


@tl_test(HOOKS)
def test_remove_hook():
    model = hooks_model()
    c = Counter()
    model.add_perma_hook(embed, c.inc)
    assert len(model.hook_dict["hook_embed"].fwd_hooks) == 1
    model.remove_all_hook_fns()
    assert len(model.hook_dict["hook_embed"].fwd_hooks) == 1
    model.remove_all_hook_fns(including_permanent=True)
    assert len(model.hook_dict["hook_embed"].fwd_hooks) == 0
    model.run_with_hooks(prompt, fwd_hooks=[])
    assert c.count == 0
    model.remove_all_hook_fns(including_permanent=True)


@tl_test(HOOKS)
def test_conditional_hooks():
    model = load()

    def identity_hook(z, hook):
        return z

    model.reset_hooks()
    model.set_use_attn_result(False)
    with raises(AssertionError):
        model.add_hook("blocks.0.attn.hook_result", identity_hook)
    model.reset_hooks()
    model.set_use_split_qkv_input(False)
    with raises(AssertionError):
        model.add_hook("blocks.0.hook_q_input", identity_hook)
    model.reset_hooks()
    model.set_use_attn_result(True)
    model.add_hook("blocks.0.attn.hook_result", identity_hook)
    model.reset_hooks()
    model.set_use_split_qkv_input(True)
    model.add_hook("blocks.0.hook_q_input", identity_hook)
    cache = model.run_with_cache(prompt, names_filter=lambda x: x == "blocks.0.hook_q_input")[1]
    assert len(cache) == 1, len(cache)
    assert "blocks.0.hook_q_input" in cache.keys(), cache.keys()
    n_tokens = model.to_tokens(prompt).shape[1]  # TL's 4: solu-1l's BOS + 3 tokens
    assert cache["blocks.0.hook_q_input"].shape == (1, n_tokens, model.cfg.n_heads, model.cfg.d_model)


@tl_test(HOOKS)
def test_prepending_hooks():
    model = load()

    def set_to_zero(z, hook):
        z[:] = 0.0
        return z

    def set_to_randn(z, hook):
        z = torch.randn_like(z) * 0.1
        return z

    for zero_attach_pos in range(2):
        model.reset_hooks()
        for hook_idx in range(2):
            model.add_hook(
                "blocks.0.hook_resid_post", set_to_zero if hook_idx == zero_attach_pos else set_to_randn, prepend=True
            )
        logits = model(torch.arange(5)[None, :])
        assert torch.allclose(logits, model.unembed.b_U[None, :]) == (zero_attach_pos == 0)


# ---- tests/unit/test_hook_points.py -------------------------------------------------------------------------
POINTS = "test_hook_points.py"


def setup_hook_point_and_hook():
    hook_point = HookPoint()

    def hook(activation, hook):
        return activation

    return hook_point, hook


@tl_test(POINTS)
def test_add_hook_forward():
    hook_point, hook = setup_hook_point_and_hook()
    hook_point.add_hook(hook, dir="fwd")
    assert len(hook_point.fwd_hooks) == 1


@tl_test(POINTS)
def test_add_hook_backward():
    hook_point, hook = setup_hook_point_and_hook()
    hook_point.add_hook(hook, dir="bwd")
    assert len(hook_point.bwd_hooks) == 1


@tl_test(POINTS)
def test_add_hook_permanent():
    hook_point, hook = setup_hook_point_and_hook()
    hook_point.add_hook(hook, dir="fwd", is_permanent=True)
    assert hook_point.fwd_hooks[0].is_permanent


@tl_test(POINTS)
def test_add_hook_with_level():
    hook_point, hook = setup_hook_point_and_hook()
    hook_point.add_hook(hook, dir="fwd", level=5)
    assert hook_point.fwd_hooks[0].context_level == 5


@tl_test(POINTS)
def test_add_hook_prepend():
    # TL's test mocks torch's RemovableHandle ids; the property it checks is the order: the prepended first
    hook_point, _ = setup_hook_point_and_hook()

    def hook1(activation, hook):
        return activation

    def hook2(activation, hook):
        return activation

    hook_point.add_hook(hook1, dir="fwd")
    hook_point.add_hook(hook2, dir="fwd", prepend=True)
    assert len(hook_point.fwd_hooks) == 2
    assert hook_point.fwd_hooks[0].hook.id != hook_point.fwd_hooks[1].hook.id  # TL: LensHandle.hook, a handle


# ---- tests/unit/test_start_at_layer.py ----------------------------------------------------------------------
START = "test_start_at_layer.py"


def start_setup():
    model = load()
    rand_input = torch.randint(0, 20, (2, 10))
    rand_embed, _, _, _ = model.input_to_embed(rand_input)
    return model, rand_input, rand_embed


@tl_test(START)
def test_start_at_layer_1():
    model, _, rand_embed = start_setup()
    output, cache = model.run_with_cache(rand_embed, start_at_layer=1)
    assert output is not None
    assert "hook_embed" not in cache.keys()
    assert "hook_pos_embed" not in cache.keys()
    assert "blocks.0.hook_resid_pre" not in cache.keys()
    assert "blocks.1.hook_resid_pre" in cache.keys()
    assert "ln_final.hook_normalized" in cache.keys()


@tl_test(START)
def test_start_run_with_hooks():
    model, _, rand_embed = start_setup()
    counting_list = []

    def count_hook(activation, hook):
        counting_list.append(len(counting_list))

    output = model.run_with_hooks(
        rand_embed,
        start_at_layer=1,
        fwd_hooks=[
            ("hook_embed", count_hook),
            ("blocks.0.attn.hook_k", count_hook),
            ("blocks.1.mlp.hook_pre", count_hook),
            ("blocks.2.attn.hook_k", count_hook),
            ("blocks.2.mlp.hook_pre", count_hook),
        ],
    )
    assert output is not None
    assert len(counting_list) == 3


@tl_test(START)
def test_start_manual_hooks():
    model, _, rand_embed = start_setup()
    counting_list = []

    def count_hook(activation, hook):
        counting_list.append(len(counting_list))

    model.hook_embed.add_hook(count_hook)
    model.blocks[0].hook_mlp_out.add_hook(count_hook)
    model.blocks[-2].hook_resid_mid.add_hook(count_hook)  # TL: blocks[1] and blocks[2] of its 3 layers
    model.blocks[-1].attn.hook_z.add_hook(count_hook)
    output = model(rand_embed, start_at_layer=-2)
    assert output is not None
    assert len(counting_list) == 2


@tl_test(START)
def test_start_at_final():
    model, _, rand_embed = start_setup()
    last = model.cfg.n_layers - 1  # TL's test: 3 layers, the last is 2
    output, cache = model.run_with_cache(rand_embed, start_at_layer=-1)
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


@tl_test(START)
def test_no_start_logit_output():
    model, rand_input, _ = start_setup()
    output, cache = model.run_with_cache(rand_input, start_at_layer=None)
    assert output is not None
    assert isinstance(output, torch.Tensor)
    assert output.shape == (2, 10, model.cfg.d_vocab)
    for name in ("hook_embed", "hook_pos_embed", "blocks.0.hook_resid_pre", "blocks.0.hook_resid_post",
                 "blocks.1.hook_resid_pre", "blocks.2.hook_resid_post", "ln_final.hook_normalized"):
        assert name in cache.keys(), name


@tl_test(START)
def test_no_start_none_output():
    model, rand_input, _ = start_setup()
    output, cache = model.run_with_cache(rand_input, start_at_layer=None, return_type=None)
    assert output is None
    for name in ("hook_embed", "hook_pos_embed", "blocks.0.hook_resid_pre", "blocks.0.hook_resid_post",
                 "blocks.1.hook_resid_pre", "blocks.2.hook_resid_post", "ln_final.hook_normalized"):
        assert name in cache.keys(), name


@tl_test(START)
def test_start_and_stop():
    model, _, rand_embed = start_setup()
    output, cache = model.run_with_cache(rand_embed, start_at_layer=1, stop_at_layer=2)
    assert output is not None  # TL (current): the residual stream after block 1
    assert "hook_embed" not in cache.keys()
    assert "blocks.0.hook_resid_pre" not in cache.keys()
    assert "blocks.1.hook_resid_pre" in cache.keys()
    assert "blocks.1.hook_resid_post" in cache.keys()
    assert "blocks.2.hook_resid_pre" not in cache.keys()
    assert "ln_final.hook_normalized" not in cache.keys()


@tl_test(START)
def test_start_at_layer_kwargs():
    model = load()
    model.tokenizer.padding_side = "left"
    input = "As soon as this ferry boat docks I'm headed to the church to play bingo."
    rand_embed, tokens, shortformer_pos_embed, attention_mask = model.input_to_embed(input)
    # TL builds a shortformer model here; a rotary model has no shortformer embedding (None) and, with no
    # padding, no mask: the rest of TL's test follows
    start_at_layer_output = model(
        rand_embed, tokens=tokens, shortformer_pos_embed=shortformer_pos_embed, attention_mask=attention_mask,
        start_at_layer=0, return_type="loss",
    )
    normal_output = model(input, return_type="loss")
    assert torch.allclose(start_at_layer_output, normal_output)


# ---- tests/unit/test_stop_at_layer.py -----------------------------------------------------------------------
STOP = "test_stop_at_layer.py"


def stop_setup():
    return load(), torch.randint(0, 20, (2, 10))


@tl_test(STOP)
def test_stop_at_embed():
    model, rand_input = stop_setup()
    _, normal_cache = model.run_with_cache(rand_input)
    output, cache = model.run_with_cache(rand_input, stop_at_layer=0)
    assert torch.allclose(output, normal_cache["blocks.0.hook_resid_pre"])
    assert "hook_embed" in cache.keys()
    assert "hook_pos_embed" in cache.keys()
    assert "blocks.0.hook_resid_pre" not in cache.keys()
    assert "ln_final.hook_normalized" not in cache.keys()


@tl_test(STOP)
def test_stop_run_with_hooks():
    model, rand_input = stop_setup()
    counting_list = []

    def count_hook(activation, hook):
        counting_list.append(len(counting_list))

    output = model.run_with_hooks(
        rand_input, stop_at_layer=1,
        fwd_hooks=[("hook_embed", count_hook), ("blocks.0.attn.hook_k", count_hook), ("blocks.1.mlp.hook_pre", count_hook)],
    )
    _, normal_cache = model.run_with_cache(rand_input, stop_at_layer=1)
    assert torch.allclose(output, normal_cache["blocks.0.hook_resid_post"])
    assert len(counting_list) == 2


@tl_test(STOP)
def test_stop_manual_hooks():
    model, rand_input = stop_setup()
    _, normal_cache = model.run_with_cache(rand_input)
    counting_list = []

    def count_hook(activation, hook):
        counting_list.append(len(counting_list))

    model.hook_embed.add_hook(count_hook)
    model.blocks[0].hook_mlp_out.add_hook(count_hook)
    model.blocks[1].hook_resid_mid.add_hook(count_hook)
    model.blocks[-1].attn.hook_z.add_hook(count_hook)  # TL: blocks[2] of 3, the last
    output = model(rand_input, stop_at_layer=-1)
    assert torch.allclose(output, normal_cache[f"blocks.{model.cfg.n_layers - 2}.hook_resid_post"])
    assert len(counting_list) == 3


@tl_test(STOP)
def test_stop_at_layer_1():
    model, rand_input = stop_setup()
    _, normal_cache = model.run_with_cache(rand_input)
    output, cache = model.run_with_cache(rand_input, stop_at_layer=1)
    assert torch.allclose(output, normal_cache["blocks.0.hook_resid_post"])
    assert "hook_embed" in cache.keys()
    assert "hook_pos_embed" in cache.keys()
    assert "blocks.0.hook_resid_pre" in cache.keys()
    assert "blocks.0.hook_resid_post" in cache.keys()
    assert "blocks.1.hook_resid_pre" not in cache.keys()
    assert "ln_final.hook_normalized" not in cache.keys()
    for key in cache.keys():
        assert key.startswith("blocks.0") or key in ["hook_embed", "hook_pos_embed"], f"Unexpected key {key} in cache."


@tl_test(STOP)
def test_stop_at_final():
    model, rand_input = stop_setup()  # TL builds 4 layers here, as the embedded model has
    _, normal_cache = model.run_with_cache(rand_input)
    output, cache = model.run_with_cache(rand_input, stop_at_layer=-1)
    assert torch.allclose(output, normal_cache["blocks.2.hook_resid_post"])
    assert "hook_embed" in cache.keys()
    assert "hook_pos_embed" in cache.keys()
    for layer in range(3):
        assert f"blocks.{layer}.hook_resid_pre" in cache.keys()
        assert f"blocks.{layer}.hook_resid_post" in cache.keys()
    assert "blocks.3.hook_resid_pre" not in cache.keys()
    assert "ln_final.hook_normalized" not in cache.keys()


@tl_test(STOP)
def test_no_stop_logit_output():
    model, rand_input = stop_setup()
    normal_output = model(rand_input)
    output, cache = model.run_with_cache(rand_input, stop_at_layer=None)
    assert torch.allclose(output, normal_output)
    assert output.shape == (2, 10, model.cfg.d_vocab)
    for name in ("hook_embed", "hook_pos_embed", "blocks.0.hook_resid_pre", "ln_final.hook_normalized"):
        assert name in cache.keys(), name


@tl_test(STOP)
def test_no_stop_no_output():
    model, rand_input = stop_setup()
    output, cache = model.run_with_cache(rand_input, stop_at_layer=None, return_type=None)
    assert output is None
    for name in ("hook_embed", "hook_pos_embed", "blocks.0.hook_resid_pre", "ln_final.hook_normalized"):
        assert name in cache.keys(), name


# ---- tests/unit/test_tokenization_methods.py ----------------------------------------------------------------
TOK = "test_tokenization_methods.py"
_tok_model: list[HookedTransformer] = []
BOS, PAD = 256, 257
D_VOCAB = 260  # the embedded model's: 256 bytes, "<|endoftext|>", "<|pad|>" and room


def tok_model() -> HookedTransformer:
    if not _tok_model:
        _tok_model.append(load())
    return _tok_model[0]


def ids(text: str) -> list[int]:
    return list(text.encode())


@tl_test(TOK)
def test_set_tokenizer_during_initialization():
    model = tok_model()
    assert model.tokenizer is not None and model.tokenizer.name_or_path == NAME, model.tokenizer.name_or_path
    assert model.cfg.d_vocab == D_VOCAB, "expected d_vocab"


@tl_test(TOK)
def test_set_tokenizer_lazy():
    model2 = type(tok_model())(tok_model().cfg)  # TL: a model built from a config has no tokenizer
    assert model2.tokenizer is None, "initialize without tokenizer"
    model2.set_tokenizer(tok_model().tokenizer.backend_tokenizer)
    assert model2.tokenizer is not None
    assert model2.to_single_token("A") == 65
    assert model2.to_string([65]) == "A"


@tl_test(TOK)
def test_to_tokens_default():
    tokens = tok_model().to_tokens("Hello, world!")
    assert torch.equal(tokens, torch.tensor([[BOS, *ids("Hello, world!")]])), "creates a tensor of tokens with BOS"


@tl_test(TOK)
def test_to_tokens_without_bos():
    tokens = tok_model().to_tokens("Hello, world!", prepend_bos=False)
    assert torch.equal(tokens, torch.tensor([ids("Hello, world!")])), "creates a tensor without BOS"


@tl_test(TOK)
def test_to_tokens_device():
    model = tok_model()
    s = "Hello, world!"
    assert torch.equal(model.to_tokens(s, move_to_device=False), model.to_tokens(s, move_to_device=True))


@tl_test(TOK)
def test_to_tokens_truncate():
    model = tok_model()
    n_ctx = model.cfg.n_ctx  # TL: 1024
    s = "@ " * (n_ctx + 1)
    tokens1 = model.to_tokens(s)
    tokens2 = model.to_tokens(s, truncate=False)
    assert len(tokens1[0]) == n_ctx, "truncated by default"
    assert len(tokens2[0]) == 2 * (n_ctx + 1) + int(model.cfg.default_prepend_bos), "not truncated"


@tl_test(TOK)
def test_to_string_from_to_tokens_without_bos():
    model = tok_model()
    s = "Hello, world!"
    assert model.to_string(model.to_tokens(s, prepend_bos=False)[0]) == s


@tl_test(TOK)
def test_to_string_multiple():
    s_list = tok_model().to_string(torch.tensor([[BOS, *ids("Hello")], ids("Planet")]))
    assert s_list == ["<|endoftext|>Hello", "Planet"], s_list


@tl_test(TOK)
def test_to_str_tokens_default():
    s_list = tok_model().to_str_tokens(" Solid")
    assert s_list == ["<|endoftext|>", " ", "S", "o", "l", "i", "d"], s_list


@tl_test(TOK)
def test_to_str_tokens_without_bos():
    s_list = tok_model().to_str_tokens(" Solid", prepend_bos=False)
    assert s_list == [" ", "S", "o", "l", "i", "d"], s_list


@tl_test(TOK)
def test_to_single_token():
    assert tok_model().to_single_token("b") == 98


@tl_test(TOK)
def test_to_single_str_tokent():
    assert tok_model().to_single_str_token(98) == "b"


@tl_test(TOK)
def test_get_token_position_not_found():
    with raises(AssertionError) as exc_info:
        tok_model().get_token_position("z", "There were some biomolecules")
    assert str(exc_info.value) == "The token does not occur in the prompt", str(exc_info.value)


@tl_test(TOK)
def test_get_token_position_str():
    pos = tok_model().get_token_position("s", "There were some biomolecules")
    assert pos == 12, "first position (after the BOS TL prepends by default)"


@tl_test(TOK)
def test_get_token_position_str_without_bos():
    pos = tok_model().get_token_position("s", "There were some biomolecules", prepend_bos=False)
    assert pos == 11, "without BOS"


@tl_test(TOK)
def test_get_token_position_int_pos():
    model = tok_model()
    input = torch.tensor([2.0, 3, 4])
    assert model.get_token_position(2, input) == 0
    assert model.get_token_position(2, input, prepend_bos=False) == 0


@tl_test(TOK)
def test_get_token_position_int_pos_last():
    assert tok_model().get_token_position(2, torch.tensor([2.0, 3, 4, 2, 5]), mode="last") == 3


@tl_test(TOK)
def test_get_token_position_int_1_pos():
    assert tok_model().get_token_position(2, torch.tensor([[2.0, 3, 4]])) == 0


@tl_test(TOK)
def test_tokens_to_residual_directions():
    model = tok_model()
    res_dir = model.tokens_to_residual_directions(model.to_tokens(""))
    assert res_dir.shape == torch.Size([model.cfg.d_model])


# ---- tests/unit/test_attention_mask.py ----------------------------------------------------------------------
MASK = "test_attention_mask.py"


@tl_test(MASK)
def test_attention_mask():
    model = load()
    input_length = 5
    input = torch.ones((1, input_length), dtype=torch.int64)
    layer = 0
    low_attn_score = 1e-6
    masked = torch.triu(torch.ones((input_length, input_length)), diagonal=1).bool()

    def attn_scores_hook(attn_scores, hook):
        assert torch.all(attn_scores[:, :, masked] == float("-inf")), "masked scores are not -inf"
        attn_scores[:, :, ~masked] = low_attn_score
        return attn_scores

    def attn_hook(attn, hook):
        assert torch.all(attn[:, :, masked] == 0), "Attention pattern attends outside the mask"
        return attn

    fwd_hooks = [(utils.get_act_name("attn_scores", layer), attn_scores_hook), (utils.get_act_name("attn", layer), attn_hook)]
    model.run_with_hooks(input, fwd_hooks=fwd_hooks)


# ---- tests/unit/test_utils.py: TestAttentionMask --------------------------------------------------------------
PROMPTS = ["Hello world!", "How are you today?", "I'm fine, thank you.", "I am happy."]
PROMPTS_WITH_SEP = ["I like cats<|endoftext|>Cats are so cute", "Hello world!", "How are you<|endoftext|>I am fine, thanks"]


def attention_mask_case(padding_side: str, prepend_bos: bool, prompts_with_sep: bool) -> Callable[[], None]:
    def test_get_attention_mask():
        model = tok_model()
        model.tokenizer.padding_side = padding_side
        model.tokenizer.sep_token_id = model.tokenizer.pad_token_id
        try:
            prompts = PROMPTS_WITH_SEP if prompts_with_sep else PROMPTS
            tokens = model.to_tokens(prompts, prepend_bos=prepend_bos)
            attention_mask = utils.get_attention_mask(model.tokenizer, tokens, prepend_bos=prepend_bos)
            assert attention_mask.shape == tokens.shape
            str_tokens = model.to_str_tokens(prompts, prepend_bos=prepend_bos)
            intended = torch.tensor([len(t) for t in str_tokens])
            assert (intended == attention_mask.sum(dim=1)).all()
            assert (tokens[attention_mask == 0] == model.tokenizer.pad_token_id).all()
            if padding_side == "right":
                assert (attention_mask[:, 0] == 1).all()
                for i, num in enumerate(intended.tolist()):
                    assert (attention_mask[i, 0:num] == 1).all()
            else:
                assert (attention_mask[:, -1] == 1).all()
                for i, num in enumerate(intended.tolist()):
                    assert (attention_mask[i, -num:] == 1).all()
            if not prompts_with_sep:
                attended_but_non_pad = attention_mask != (tokens != model.tokenizer.pad_token_id).int()
                if model.tokenizer.bos_token == model.tokenizer.pad_token and prepend_bos:
                    assert attended_but_non_pad.sum() == tokens.shape[0]
                else:
                    assert attended_but_non_pad.sum() == 0
        finally:
            model.tokenizer.padding_side = "right"

    test_get_attention_mask.__name__ = f"test_get_attention_mask[{padding_side}-bos={prepend_bos}-sep={prompts_with_sep}]"
    return test_get_attention_mask


for _side in ("left", "right"):
    for _bos in (True, False):
        for _sep in (True, False):
            _fn = attention_mask_case(_side, _bos, _sep)
            TESTS.append(("test_utils.py::TestAttentionMask", _fn.__name__, _fn))


# ---- utils.get_act_name's docstring examples ------------------------------------------------------------------
@tl_test("utils.get_act_name docstring")
def test_get_act_name_docstring_examples():
    assert utils.get_act_name("embed") == "hook_embed"
    assert utils.get_act_name("k", 6, "a") == "blocks.6.attn.hook_k"
    assert utils.get_act_name("scale", 4, "ln1") == "blocks.4.ln1.hook_scale"
    assert utils.get_act_name("pre", 5) == "blocks.5.mlp.hook_pre"
    assert utils.get_act_name("k6") == "blocks.6.attn.hook_k"
    assert utils.get_act_name("scale4ln1") == "blocks.4.ln1.hook_scale"
    assert utils.get_act_name("pre5") == "blocks.5.mlp.hook_pre"


# ---- tests/acceptance/test_activation_cache.py ----------------------------------------------------------------
CACHE = "test_activation_cache.py"
# TL's IOI names are single tokens in its vocabulary; here single bytes
ioi_prompt_formats = [
    "When J and M went to the shops,{} gave the bag to",
    "When T and A went to the park,{} gave the ball to",
    "When D and S went to the shops,{} gave an apple to",
    "After R and Y went to the park,{} gave a drink to",
]
ioi_names = [("M", "J"), ("T", "A"), ("D", "S"), ("R", "Y")]
_cache_run: list = []


def get_ioi_tokens_and_answer_tokens(model):
    prompts, answers, answer_tokens = [], [], []
    for i in range(len(ioi_prompt_formats)):
        for j in range(2):
            answers.append((ioi_names[i][j], ioi_names[i][1 - j]))
            answer_tokens.append((model.to_single_token(answers[-1][0]), model.to_single_token(answers[-1][1])))
            prompts.append(ioi_prompt_formats[i].format(answers[-1][1]))
    return model.to_tokens(prompts, prepend_bos=True), torch.tensor(answer_tokens)


def ioi_run():
    """TL's load_model(...) with fold_ln, centering and refactoring: moelens refuses centering and refactoring
    of a rotary RMS model (see from_pretrained); the model as loaded."""
    if not _cache_run:
        model = load()
        tokens, answer_tokens = get_ioi_tokens_and_answer_tokens(model)
        with torch.no_grad():
            _, cache = model.run_with_cache(tokens)
        _cache_run.append((model, tokens, answer_tokens, cache))
    return _cache_run[0]


@tl_test(CACHE)
def test_logit_attrs_matches_reference_code():
    model, tokens, answer_tokens, cache = ioi_run()
    accumulated_residual = cache.accumulated_resid(layer=-1, incl_mid=True, pos_slice=-1)
    answer_residual_directions = model.tokens_to_residual_directions(answer_tokens)
    logit_diff_directions = answer_residual_directions[:, 0] - answer_residual_directions[:, 1]
    scaled_residual_stack = cache.apply_ln_to_stack(accumulated_residual, layer=-1, pos_slice=-1)
    ref = torch.einsum("...bd,bd->...", scaled_residual_stack, logit_diff_directions) / len(tokens)
    logit_diffs = cache.logit_attrs(accumulated_residual, pos_slice=-1, tokens=answer_tokens[:, 0],
                                    incorrect_tokens=answer_tokens[:, 1])
    assert torch.isclose(ref, logit_diffs.mean(dim=-1), atol=1.1e-7).all()


@tl_test(CACHE)
def test_logit_accumulated_resid_on_last_layer_variants():
    model, _, _, cache = ioi_run()
    accumulated_resid = cache.accumulated_resid(layer=-1, incl_mid=True, pos_slice=-1)
    assert torch.equal(accumulated_resid, cache.accumulated_resid(layer=model.cfg.n_layers, incl_mid=True, pos_slice=-1))
    assert torch.equal(accumulated_resid, cache.accumulated_resid(layer=None, incl_mid=True, pos_slice=-1))


@tl_test(CACHE)
def test_logit_accumulated_resid_without_mid():
    _, _, _, cache = ioi_run()
    accumulated_resid, labels = cache.accumulated_resid(layer=-1, incl_mid=False, pos_slice=-1, return_labels=True)
    assert len(labels) == accumulated_resid.size(0)
    assert all("mid" not in label for label in labels)


@tl_test(CACHE)
def test_logit_attrs_works_for_all_input_shapes():
    model, tokens, answer_tokens, cache = ioi_run()
    accumulated_residual = cache.accumulated_resid(layer=-1, incl_mid=True, pos_slice=-1, return_labels=False)
    answer_residual_directions = model.tokens_to_residual_directions(answer_tokens)
    logit_diff_directions = answer_residual_directions[:, 0] - answer_residual_directions[:, 1]
    scaled_residual_stack = cache.apply_ln_to_stack(accumulated_residual, layer=-1, pos_slice=-1)
    ref = (scaled_residual_stack * logit_diff_directions).sum(-1)
    logit_diffs = cache.logit_attrs(accumulated_residual, pos_slice=-1, tokens=answer_tokens[:, 0],
                                    incorrect_tokens=answer_tokens[:, 1])
    assert torch.isclose(ref, logit_diffs).all()
    batch = -1
    logit_diffs = cache.logit_attrs(accumulated_residual, batch_slice=batch, pos_slice=Slice(-1),
                                    tokens=answer_tokens[batch, 0], incorrect_tokens=answer_tokens[batch, 1])
    assert torch.isclose(ref[:, batch], logit_diffs).all()
    logit_diffs = cache.logit_attrs(accumulated_residual, batch_slice=Slice(batch), pos_slice=-1,
                                    tokens=int(answer_tokens[batch, 0]), incorrect_tokens=int(answer_tokens[batch, 1]))
    assert torch.isclose(ref[:, batch], logit_diffs).all()
    logit_diffs = cache.logit_attrs(accumulated_residual, batch_slice=batch, pos_slice=-1,
                                    tokens=model.to_string(answer_tokens[batch, 0]),
                                    incorrect_tokens=model.to_string(answer_tokens[batch, 1]))
    assert torch.isclose(ref[:, batch], logit_diffs).all()
    logit_diffs = cache.logit_attrs(accumulated_residual[:, batch, :], has_batch_dim=False, batch_slice=batch,
                                    pos_slice=-1, tokens=answer_tokens[batch, 0], incorrect_tokens=answer_tokens[batch, 1])
    assert torch.isclose(ref[:, batch], logit_diffs).all()
    batch = [2, 5, 7]
    logit_diffs = cache.logit_attrs(accumulated_residual, batch_slice=batch, pos_slice=-1,
                                    tokens=answer_tokens[batch, 0], incorrect_tokens=answer_tokens[batch, 1])
    assert torch.isclose(ref[:, batch], logit_diffs).all()
    with raises(ValueError):
        cache.logit_attrs(accumulated_residual[:, batch, :], has_batch_dim=False, batch_slice=batch, pos_slice=-1,
                          tokens=answer_tokens[batch, 0], incorrect_tokens=answer_tokens[batch, 0:1])
    ref = (scaled_residual_stack * answer_residual_directions[:, 0]).sum(-1)
    logit_diffs = cache.logit_attrs(accumulated_residual, pos_slice=-1, tokens=answer_tokens[:, 0], incorrect_tokens=None)
    assert torch.isclose(ref, logit_diffs).all()


@tl_test(CACHE)
def test_accumulated_resid_with_apply_ln():
    model, _, _, cache = ioi_run()
    accumulated_residual = cache.accumulated_resid(layer=-1, incl_mid=True, pos_slice=-1)
    ref = cache.apply_ln_to_stack(accumulated_residual, layer=-1, pos_slice=-1)
    scaled = cache.accumulated_resid(layer=-1, incl_mid=True, pos_slice=-1, apply_ln=True)
    assert torch.isclose(ref, scaled, atol=1e-7).all()
    scaled, labels = cache.accumulated_resid(layer=None, incl_mid=True, pos_slice=Slice(-1), apply_ln=True,
                                             return_labels=True)
    assert torch.isclose(ref, scaled, atol=1e-7).all()
    expected = [x for layer in range(model.cfg.n_layers) for x in (f"{layer}_pre", f"{layer}_mid")] + ["final_post"]
    assert labels == expected


@tl_test(CACHE)
def test_decompose_resid_with_apply_ln():
    _, _, _, cache = ioi_run()
    per_layer_residual = cache.decompose_resid(layer=-1, pos_slice=-1)
    ref = cache.apply_ln_to_stack(per_layer_residual, layer=-1, pos_slice=-1)
    scaled = cache.decompose_resid(layer=None, pos_slice=Slice(-1), apply_ln=True)
    assert torch.isclose(ref, scaled, atol=1e-7).all()


@tl_test(CACHE)
def test_decompose_resid_including_attention():
    model, _, _, cache = ioi_run()
    # TL's model has 2 layers and asks for layer=1 with mlp_input=True: every attention output up to layer 1's MLP
    ref = torch.stack([cache["attn_out", layer][:, -1] for layer in range(2)])
    stack = cache.decompose_resid(layer=1, pos_slice=Slice(-1), mlp_input=True, apply_ln=False, incl_embeds=False,
                                  mode="attn")
    assert torch.isclose(ref, stack, atol=1e-7).all()


@tl_test(CACHE)
def test_stack_head_results_with_apply_ln():
    _, _, _, cache = ioi_run()
    per_head_residual = cache.stack_head_results(layer=-1, pos_slice=-1)
    ref = cache.apply_ln_to_stack(per_head_residual, layer=None, pos_slice=Slice(-1))
    scaled = cache.stack_head_results(layer=-1, pos_slice=-1, apply_ln=True)
    assert torch.isclose(ref, scaled, atol=1e-7).all()


@tl_test(CACHE)
def test_stack_head_results_including_remainder():
    model, _, _, cache = ioi_run()
    ref_resid_post = cache["resid_post", 0][None, :, -1]
    per_head_residual, labels = cache.stack_head_results(layer=1, pos_slice=-1, incl_remainder=True, return_labels=True)
    remainder = ref_resid_post - per_head_residual[:-1].sum(dim=0)
    assert torch.isclose(remainder, per_head_residual[-1]).all()
    assert labels[:-1] == [f"L0H{i}" for i in range(model.cfg.n_heads)]
    assert labels[-1] == "remainder"
    ref_resid_post = cache["resid_post", -1][None, :, -1]
    per_head_residual, labels = cache.stack_head_results(layer=0, pos_slice=-1, incl_remainder=True, return_labels=True)
    assert torch.isclose(ref_resid_post, per_head_residual, atol=1e-7).all()
    assert len(labels) == 1 and labels[-1] == "remainder"
    per_head_residual, labels = cache.stack_head_results(layer=0, pos_slice=-1, incl_remainder=False, return_labels=True)
    assert torch.isclose(per_head_residual, torch.zeros_like(per_head_residual)).all()
    assert len(labels) == 0


@tl_test(CACHE)
def test_stack_neuron_results_with_apply_ln():
    _, _, _, cache = ioi_run()
    neuron_result_stack = cache.stack_neuron_results(layer=-1, pos_slice=-1)
    ref = cache.apply_ln_to_stack(neuron_result_stack, layer=-1, pos_slice=-1)
    scaled = cache.stack_neuron_results(layer=-1, pos_slice=Slice(-1), apply_ln=True)
    assert torch.isclose(ref, scaled, atol=1e-7).all()


@tl_test(CACHE)
def test_stack_neuron_results_including_remainder():
    model, _, _, cache = ioi_run()
    ref_resid_post = cache["resid_post", 0][None, :, -1]
    stack, labels = cache.stack_neuron_results(layer=1, pos_slice=Slice(-1), incl_remainder=True, return_labels=True)
    remainder = ref_resid_post - stack[:-1].sum(dim=0)
    assert torch.isclose(remainder, stack[-1]).all()
    assert labels[:-1] == [f"L0N{i}" for i in range(model.cfg.d_mlp)]
    assert labels[-1] == "remainder"


@tl_test(CACHE)
def test_stack_neuron_results_using_neuron_slice():
    _, _, _, cache = ioi_run()
    _, labels = cache.stack_neuron_results(layer=1, pos_slice=Slice(-1), neuron_slice=Slice([0, 1, 2]), return_labels=True)
    assert labels == [f"L0N{i}" for i in range(3)]


@tl_test(CACHE)
def test_remove_batch_dim():
    model, tokens, _, _ = ioi_run()
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens[:1])
    assert cache.has_batch_dim
    before = {key: cache.cache_dict[key].shape for key in cache.cache_dict}
    cache.remove_batch_dim()
    assert not cache.has_batch_dim
    assert all(before[key][1:] == cache.cache_dict[key].shape for key in before)
    cache.remove_batch_dim()
    assert not cache.has_batch_dim
    assert all(before[key][1:] == cache.cache_dict[key].shape for key in before)


@tl_test(CACHE)
def test_remove_batch_dim_fails_if_batch_gt_1():
    _, _, _, cache = ioi_run()
    assert cache.has_batch_dim
    with raises(AssertionError):
        cache.remove_batch_dim()


@tl_test(CACHE)
def test_retrieve_activations():
    model, _, _, cache = ioi_run()
    key = ("scale", 1, "ln1")
    assert torch.equal(cache[key], cache[utils.get_act_name(*key)])
    assert torch.equal(cache[("scale", -1, "ln1")], cache[f"scale{model.cfg.n_layers - 1}ln1"])
    assert torch.equal(cache[("k", -1, None)], cache[f"blocks.{model.cfg.n_layers - 1}.attn.hook_k"])
    assert torch.equal(cache["embed"], cache[utils.get_act_name("embed")])
    assert torch.equal(cache[("embed", None)], cache[utils.get_act_name("embed", None)])


@tl_test(CACHE)
def test_get_items():
    _, _, _, cache = ioi_run()
    assert all(k == dk and torch.equal(v, dv) for (k, v), (dk, dv) in zip(cache.items(), cache.cache_dict.items()))


@tl_test(CACHE)
def test_get_values():
    _, _, _, cache = ioi_run()
    assert all(torch.equal(v, dv) for v, dv in zip(cache.values(), cache.cache_dict.values()))


@tl_test(CACHE)
def test_get_keys():
    _, _, _, cache = ioi_run()
    assert all(k == dk for k, dk in zip(cache.keys(), cache.cache_dict.keys()))


@tl_test(CACHE)
def test_apply_slice_to_batch_dim():
    _, _, _, cache = ioi_run()
    assert cache.has_batch_dim
    new_cache = cache.apply_slice_to_batch_dim(Slice((2, 4)))
    assert new_cache.has_batch_dim
    assert all(torch.equal(cache[key][2:4], new_cache[key]) for key in cache.cache_dict)
    new_cache = cache.apply_slice_to_batch_dim(2)
    assert not new_cache.has_batch_dim
    assert all(torch.equal(cache[key][2], new_cache[key]) for key in cache.cache_dict)


@tl_test(CACHE)
def test_toggle_autodiff():
    _, _, _, cache = ioi_run()
    with torch.no_grad():
        assert not torch.is_grad_enabled()
        cache.toggle_autodiff(mode=True)
        assert torch.is_grad_enabled()


@tl_test(CACHE)
def test_stack_activation():
    model, _, _, cache = ioi_run()
    stack = cache.stack_activation("scale", -1, "ln1")
    assert all(torch.equal(cache[("scale", layer, "ln1")], stack[layer]) for layer in range(model.cfg.n_layers))
    stack = cache.stack_activation("scale", 1, "ln1")
    assert all(torch.equal(cache[("scale", layer, "ln1")], stack[layer]) for layer in range(1))


@tl_test(CACHE)
def test_get_full_resid_decomposition():
    model, _, _, cache = ioi_run()
    n = model.cfg.n_layers
    ref_head_stack, ref_head_labels = cache.stack_head_results(layer=n, pos_slice=Slice(-1), apply_ln=True,
                                                               return_labels=True)
    ref_mlp_stack, ref_mlp_labels = cache.decompose_resid(layer=n, mlp_input=False, pos_slice=Slice(-1),
                                                          incl_embeds=False, mode="mlp", apply_ln=True, return_labels=True)
    ref_embed = cache.apply_ln_to_stack(cache["embed"][None, :, -1], pos_slice=Slice(-1), mlp_input=False)
    ref_pos_embed = cache.apply_ln_to_stack(cache["pos_embed"][None, :, -1], pos_slice=Slice(-1), mlp_input=False)
    ref_bias = model.accumulated_bias(n, mlp_input=False, include_mlp_biases=False)
    ref_bias = cache.apply_ln_to_stack(ref_bias.expand((1,) + ref_head_stack.shape[1:]), pos_slice=Slice(-1),
                                       mlp_input=False)
    h, m = ref_head_stack.size(0), ref_mlp_stack.size(0)
    stack, labels = cache.get_full_resid_decomposition(layer=-1, pos_slice=-1, apply_ln=True, expand_neurons=False,
                                                       return_labels=True)
    assert torch.isclose(ref_head_stack, stack[:h], atol=1e-7).all() and ref_head_labels == labels[:h]
    assert torch.isclose(ref_mlp_stack, stack[h:h + m], atol=1e-7).all() and ref_mlp_labels == labels[h:h + m]
    assert torch.isclose(ref_embed, stack[h + m:h + m + 1], atol=1e-7).all() and labels[h + m] == "embed"
    assert torch.isclose(ref_pos_embed, stack[h + m + 1:h + m + 2], atol=1e-7).all() and labels[h + m + 1] == "pos_embed"
    assert torch.isclose(ref_bias, stack[h + m + 2:h + m + 3], atol=1e-7).all() and labels[h + m + 2] == "bias"


@tl_test(CACHE)
def test_get_full_resid_decomposition_with_neurons_expanded():
    _, _, _, cache = ioi_run()
    ref_head_stack = cache.stack_head_results(layer=1, pos_slice=Slice(-1), apply_ln=True)
    ref_neuron_stack, ref_neuron_labels = cache.stack_neuron_results(1, pos_slice=Slice(-1), return_labels=True)
    ref_neuron_stack = cache.apply_ln_to_stack(ref_neuron_stack, layer=1, pos_slice=Slice(-1))
    h, k = ref_head_stack.size(0), ref_neuron_stack.size(0)
    stack, labels = cache.get_full_resid_decomposition(layer=1, pos_slice=Slice(-1), apply_ln=True, expand_neurons=True,
                                                       return_labels=True)
    assert torch.isclose(ref_neuron_stack, stack[h:h + k], atol=1e-7).all()
    assert ref_neuron_labels == labels[h:h + k]


@tl_test(CACHE)
def test_get_full_resid_decomposition_without_applying_ln():
    _, _, _, cache = ioi_run()
    h = cache.stack_head_results(layer=1, pos_slice=Slice(-1), apply_ln=True).size(0)
    ref_neuron_stack = cache.stack_neuron_results(1, pos_slice=Slice(-1))
    stack = cache.get_full_resid_decomposition(layer=1, pos_slice=Slice(-1), apply_ln=False, expand_neurons=True)
    assert torch.isclose(ref_neuron_stack, stack[h:h + ref_neuron_stack.size(0)], atol=1e-7).all()


@tl_test(CACHE)
def test_get_full_resid_decomposition_attn_only_model():
    _, _, _, cache = ioi_run()  # TL: attn-only-2l; the heads come first either way
    ref_head_stack = cache.stack_head_results(layer=1, pos_slice=Slice(-1), apply_ln=False)
    stack = cache.get_full_resid_decomposition(layer=1, pos_slice=Slice(-1), apply_ln=False, expand_neurons=False)
    assert torch.isclose(ref_head_stack, stack[:ref_head_stack.size(0)], atol=1e-7).all()


@tl_test(CACHE)
def test_compute_test_head_results_does_not_compute_results_twice():
    model, tokens, _, _ = ioi_run()
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    assert "blocks.0.attn.hook_result" not in cache.cache_dict
    cache.compute_head_results()
    assert "blocks.0.attn.hook_result" in cache.cache_dict
    assert cache.cache_dict["blocks.0.attn.hook_result"][0, 0, 0, 0] != float("inf")
    cache.cache_dict["blocks.0.attn.hook_result"][0, 0, 0, 0] = float("inf")
    cache.compute_head_results()
    assert cache.cache_dict["blocks.0.attn.hook_result"][0, 0, 0, 0] == float("inf")


@tl_test(CACHE)
def test_get_neuron_results():
    model, _, _, cache = ioi_run()
    layer = 1
    ref = cache[f"blocks.{layer}.mlp.hook_post"][:, -1, :2, None] * model.blocks[layer].mlp.W_out[:2]
    assert torch.isclose(ref, cache.get_neuron_results(layer, neuron_slice=[0, 1], pos_slice=-1)).all()


@tl_test(CACHE)
def test_get_neuron_results_without_slice():
    model, _, _, cache = ioi_run()
    layer = 1
    ref = cache[f"blocks.{layer}.mlp.hook_post"][..., None] * model.blocks[layer].mlp.W_out
    assert torch.isclose(ref, cache.get_neuron_results(layer, neuron_slice=None, pos_slice=None)).all()


# ---- the runner ------------------------------------------------------------------------------------------------
def reason(exc: BaseException) -> str:
    """The exception and, for a bare assert, the failing line of the ported test."""
    text = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    if isinstance(exc, AssertionError) and not str(exc).strip():
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        text += f"`{frame.line}`"
    return text[:300]


def main() -> int:
    logging.disable(logging.WARNING)  # toggle_autodiff's logged warning and the like
    torch.manual_seed(0)
    by_file: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    failures = []
    for source, name, fn in TESTS:
        grad = torch.is_grad_enabled()
        try:
            fn()
        except Exception as exc:  # a ported test failing is what this measures
            failures.append((source, name, reason(exc)))
        else:
            by_file[source][0] += 1
        finally:
            torch.set_grad_enabled(grad)
        by_file[source][1] += 1
    for source, name, why in failures:
        print(f"FAIL {source}::{name}: {why}")
    print()
    for source, (passed, total) in by_file.items():
        print(f"{source}: {passed}/{total}")
    passed = sum(p for p, _ in by_file.values())
    print(f"\nTransformerLens API conformance: {passed}/{len(TESTS)} passed")
    return 0


if __name__ == "__main__":
    assert all(inspect.isfunction(fn) for _, _, fn in TESTS)
    sys.exit(main())
