"""Direct logit attribution with TransformerLens's semantics (ActivationCache.logit_attrs / apply_ln_to_stack).

TransformerLens's logit_attrs always applies the final norm's cached scale (apply_ln_to_stack(layer=-1)) before
dotting with the token directions, and its stacking methods default to apply_ln=False. The oracle here is the
model's own logits: the un-normalised components of the final stream, through logit_attrs, sum to the logit
(RMSNorm has no centering and the unembedding no bias; the directions carry ln_final's weight, so this holds for
a model that is not folded as well as for a folded one).
"""

import inspect

import pytest
import torch
from conftest import FAMILIES, decomposition_refused, families_applying_norms, norm_factor, uncapped

from moelens import HookedTransformer
from moelens.cache_analysis import MissingHooksError

ATOL = 1e-4


def close(a, b, atol=ATOL):
    assert a.shape == b.shape, (a.shape, b.shape)
    err = (a - b).abs().max().item()
    assert err <= atol, f"max error {err:.3g} > {atol}"


@pytest.fixture(scope="module")
def runs(family_models):
    toks = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(3))
    out = {}
    with torch.no_grad():
        for family, model in family_models.items():
            logits, cache = model.run_with_cache(toks)
            out[family] = (model, toks, logits, cache)
    return out


def test_apply_ln_defaults_match_transformer_lens(runs):
    cache = runs["qwen2_moe"][3]
    for method in ("accumulated_resid", "decompose_resid", "stack_head_results", "get_full_resid_decomposition"):
        assert inspect.signature(getattr(cache, method)).parameters["apply_ln"].default is False, method
    params = inspect.signature(cache.logit_attrs).parameters
    assert list(params)[:6] == ["residual_stack", "tokens", "incorrect_tokens", "pos_slice", "batch_slice",
                                "has_batch_dim"]
    assert params["incorrect_tokens"].default is None and params["pos_slice"].default is None
    assert params["batch_slice"].default is None and params["has_batch_dim"].default is True
    assert "apply_ln" not in params  # logit_attrs always normalises
    params = inspect.signature(cache.apply_ln_to_stack).parameters
    assert list(params)[:6] == ["residual_stack", "layer", "mlp_input", "pos_slice", "batch_slice", "has_batch_dim"]


@pytest.mark.parametrize("family", decomposition_refused(families_applying_norms()))
def test_decompose_resid_logit_attrs_sum_to_logit(runs, family):
    model, toks, logits, cache = runs[family]
    stack, labels = cache.decompose_resid(pos_slice=-1, return_labels=True)  # apply_ln=False by default
    n = model.cfg.n_layers
    # each block's sublayers, by output hook (a Nemotron-H block has one: its token mixer or its feed-forward;
    # a LongCat-Flash block five: attn_out, mlp_out, dense_0_out, attn_1_out, dense_1_out)
    terms = [(l, sub.out_hook.removeprefix("hook_")) for l, b in enumerate(model.blocks) for sub in b.sublayers()]
    assert labels == ["embed"] + [f"{l}_{s}" for l, s in terms]
    answer = 7
    attrs = cache.logit_attrs(stack, tokens=answer, pos_slice=-1)
    assert attrs.shape == (len(terms) + 1, 2)
    close(attrs.sum(0), logits[:, -1, answer])
    # the same with a 0-d tensor and with one answer per row
    close(cache.logit_attrs(stack, tokens=torch.tensor(answer), pos_slice=-1), attrs, 0)
    answers = torch.tensor([5, 17])
    per_row = cache.logit_attrs(stack, tokens=answers, pos_slice=-1)
    close(per_row.sum(0), logits[torch.arange(2), -1, answers])
    # the whole sequence: [batch pos] targets
    full = cache.decompose_resid()
    close(cache.logit_attrs(full, toks).sum(0), logits.gather(-1, toks[..., None])[..., 0])
    # each component by hand: component / final rms . (W_U column * ln_final weight)
    rms = cache["ln_final.hook_scale"][:, -1]  # [batch, 1]
    direction = model.unembed.weight[answer] / model.unembed.divisor * norm_factor(model.ln_final)
    close(attrs, ((stack / rms) * direction).sum(-1))


@pytest.mark.parametrize("family", decomposition_refused(families_applying_norms()))
def test_logit_difference(runs, family):
    model, toks, logits, cache = runs[family]
    stack = cache.decompose_resid(pos_slice=-1)
    diff = cache.logit_attrs(stack, tokens=3, incorrect_tokens=9, pos_slice=-1)
    close(diff.sum(0), logits[:, -1, 3] - logits[:, -1, 9])
    right, wrong = torch.tensor([5, 17]), torch.tensor([40, 2])
    diff = cache.logit_attrs(stack, tokens=right, incorrect_tokens=wrong, pos_slice=-1)
    close(diff.sum(0), logits[torch.arange(2), -1, right] - logits[torch.arange(2), -1, wrong])
    close(diff, cache.logit_attrs(stack, right, pos_slice=-1) - cache.logit_attrs(stack, wrong, pos_slice=-1))
    with pytest.raises(ValueError, match="same shape"):
        cache.logit_attrs(stack, tokens=right, incorrect_tokens=9, pos_slice=-1)


@pytest.mark.parametrize("family", decomposition_refused(families_applying_norms()))
def test_accumulated_resid_final_entry_gives_logit(runs, family):
    model, toks, logits, cache = runs[family]
    acc, labels = cache.accumulated_resid(pos_slice=-1, return_labels=True)
    assert labels[-1] == "final_post"
    logits = uncapped(model, logits)  # the attributions are to the unembedding's output, before a softcap (Beam's)
    close(cache.logit_attrs(acc, 11, pos_slice=-1)[-1], logits[:, -1, 11])
    # the full decomposition with experts / heads also sums to it
    stack = cache.get_full_resid_decomposition(pos_slice=-1, return_labels=False)
    close(cache.logit_attrs(stack, 11, incorrect_tokens=12, pos_slice=-1).sum(0), logits[:, -1, 11] - logits[:, -1, 12])


@pytest.mark.parametrize("family", decomposition_refused(families_applying_norms()))
def test_batch_slice(runs, family):
    model, toks, logits, cache = runs[family]
    stack = cache.decompose_resid(pos_slice=-1)  # full batch: logit_attrs slices it
    one = cache.logit_attrs(stack, 7, pos_slice=-1, batch_slice=1)
    assert one.shape == (stack.shape[0],)
    close(one.sum(0), logits[1, -1, 7])
    some = cache.logit_attrs(stack, 7, pos_slice=-1, batch_slice=slice(1, 2))
    assert some.shape == (stack.shape[0], 1)
    close(some[:, 0], one)
    # per-row targets of the full batch are sliced too; already-sliced ones are taken as they are
    answers = torch.tensor([5, 17])
    close(cache.logit_attrs(stack, answers, pos_slice=-1, batch_slice=[1]).sum(0), logits[[1], -1, answers[[1]]])
    close(cache.logit_attrs(stack, answers[1:], pos_slice=-1, batch_slice=[1]).sum(0), logits[[1], -1, 17])
    # every position, a [batch pos] target
    full = cache.decompose_resid()
    a = cache.logit_attrs(full, toks, batch_slice=0)
    close(a.sum(0), logits[0].gather(-1, toks[0, :, None])[..., 0])
    # has_batch_dim=False: the stack's batch axis was taken already, batch_slice picks the scale's row
    close(cache.logit_attrs(full[:, 0], toks[0], batch_slice=0, has_batch_dim=False), a)


@pytest.mark.parametrize("family", decomposition_refused(families_applying_norms()))
def test_without_batch_dim(runs, family):
    model, toks, logits, cache = runs[family]
    with torch.no_grad():
        single_logits, single = model.run_with_cache(toks[:1], remove_batch_dim=True)
    stack = single.decompose_resid(pos_slice=-1)
    n_terms = sum(len(block.sublayers()) for block in model.blocks)
    assert stack.shape == (n_terms + 1, model.cfg.d_model)
    attrs = single.logit_attrs(stack, 7, pos_slice=-1, has_batch_dim=False)
    assert attrs.shape == (stack.shape[0],)
    close(attrs.sum(0), single_logits[0, -1, 7])
    close(single.logit_attrs(stack, 7, pos_slice=-1), attrs, 0)  # no batch axis in the cache: the same
    full = single.decompose_resid()
    close(single.logit_attrs(full, toks[0], has_batch_dim=False).sum(0),
          single_logits[0].gather(-1, toks[0, :, None])[..., 0])
    with pytest.raises(ValueError, match="batch"):
        single.logit_attrs(stack, 7, pos_slice=-1, batch_slice=0)


def test_needs_final_scale(runs):
    model, toks, _, _ = runs["qwen2_moe"]
    with torch.no_grad():
        _, cache = model.run_with_cache(toks, names_filter=lambda n: "ln_final" not in n)
    stack = cache.decompose_resid(pos_slice=-1)
    with pytest.raises(MissingHooksError, match=r"ln_final\.hook_scale"):
        cache.logit_attrs(stack, 7, pos_slice=-1)
    assert issubclass(MissingHooksError, KeyError)  # TransformerLens raises a KeyError too


def test_folded_model_matches_transformer_lens_formula(checkpoints):
    """With fold_ln, ln_final's weight is 1 and the direction is TransformerLens's plain W_U column."""
    model = HookedTransformer.from_pretrained(checkpoints["qwen2_moe", "base"], progress=False, fold_ln=True)
    toks = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits, cache = model.run_with_cache(toks)
    stack = cache.decompose_resid(pos_slice=-1)
    attrs = cache.logit_attrs(stack, 7, pos_slice=-1)
    tl = (cache.apply_ln_to_stack(stack, -1, pos_slice=-1) * model.W_U[:, 7]).sum(-1)
    close(attrs, tl)
    close(attrs.sum(0), logits[:, -1, 7])


def test_one_target_per_position(runs):
    """A 1-D target whose length is not the batch size is one token per position, shared by the rows (TL)."""
    model, toks, logits, cache = runs["hunyuan_v1_moe"]
    full = cache.decompose_resid()
    per_pos = toks[0]  # [pos], pos=20 != batch=2
    close(cache.logit_attrs(full, per_pos).sum(0), logits.gather(-1, per_pos.expand(2, -1)[..., None])[..., 0])
    close(cache.logit_attrs(full, per_pos), cache.logit_attrs(full, per_pos[None]), 0)  # TL's [1, pos] form
    with pytest.raises(ValueError, match="match"):
        cache.logit_attrs(full, torch.tensor([1, 2, 3]))


# ---- one convention for the final norm's weight: every TransformerLens pairing gives the model's logit ----------


@pytest.fixture(scope="module", params=[False, True], ids=["unfolded", "folded"])
def trained(request):
    """The trained default (its ln_final weight averages about 2, so a weight applied twice or not at all
    shows), folded and not, on "import numpy as", with " np" - " pd" as the logit difference."""
    model = HookedTransformer.from_pretrained("tiny-code-moe", progress=False, fold_ln=request.param)
    with torch.no_grad():
        logits, cache = model.run_with_cache("import numpy as")
    right, wrong = model.to_single_token(" np"), model.to_single_token(" pd")
    return model, logits, cache, right, wrong, request.param


def test_every_transformer_lens_pairing_gives_the_logit_difference(trained):
    """The pairings of TransformerLens's tutorials, against the model's own logits: a normed final stream
    (accumulated_resid(apply_ln=True), apply_ln_to_stack with either recompute_ln) dotted with
    tokens_to_residual_directions or times W_U; a decomposition through apply_ln_to_stack (cached scale),
    logit_attrs or project_output_onto, summed; expert_logit_attribution with the rest."""
    model, logits, cache, right, wrong, folded = trained
    weight = model.ln_final.weight.detach()
    assert torch.all(weight == 1) if folded else (weight - 1).abs().mean() > 0.5
    true_diff = (logits[0, -1, right] - logits[0, -1, wrong]).item()
    assert abs(true_diff) > 1  # a difference a doubled or missing weight would move
    direction = model.tokens_to_residual_directions(right) - model.tokens_to_residual_directions(wrong)
    torch.testing.assert_close(direction, (model.W_U[:, right] - model.W_U[:, wrong]).detach(), rtol=0, atol=0)
    with torch.no_grad():
        lens = cache.accumulated_resid(layer=-1, incl_mid=True, pos_slice=-1, apply_ln=True)
        close(lens[-1, 0] @ direction, torch.tensor(true_diff))
        close(lens[-1, 0] @ model.W_U, logits[0, -1])  # TL's docstring example: the normed stream @ W_U
        final = cache["resid_post", -1][None, :, -1]
        for recompute in (False, True):
            normed = cache.apply_ln_to_stack(final, -1, pos_slice=-1, recompute_ln=recompute)
            close(normed[0, 0] @ direction, torch.tensor(true_diff))
            close(normed[0, 0] @ model.W_U, logits[0, -1])
        decomposition = cache.decompose_resid(layer=-1, pos_slice=-1)
        parts = cache.apply_ln_to_stack(decomposition, -1, pos_slice=-1)
        close((parts[:, 0] @ direction).sum(), torch.tensor(true_diff))
        close(cache.logit_attrs(decomposition, right, wrong, pos_slice=-1).sum(), torch.tensor(true_diff))
        full = cache.get_full_resid_decomposition(pos_slice=-1, expand_neurons=False)
        close(cache.apply_ln_to_stack(full, -1, pos_slice=-1).sum(0)[0] @ direction, torch.tensor(true_diff))
        projected = cache.get_full_resid_decomposition(pos_slice=-1, apply_ln=True, project_output_onto=direction)
        close(projected.sum(0)[0], torch.tensor(true_diff))
        # expert_logit_attribution plus every other part of the decomposition
        experts = cache.expert_logit_attribution(right, pos_slice=-1, incorrect_tokens=wrong).sum()
        labels = cache.get_full_resid_decomposition(pos_slice=-1, expand_neurons=False, return_labels=True)[1]
        rest = [i for i, label in enumerate(labels) if not (label.startswith("L") and ".E" in label)]
        others = cache.logit_attrs(full[rest], right, wrong, pos_slice=-1).sum()
        close(experts + others, torch.tensor(true_diff))
