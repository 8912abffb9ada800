"""SAE-Lens on a moelens model: HookedSAETransformer's methods (add_sae, run_with_saes, ...) splice SAE-Lens SAEs
in with the meaning SAE-Lens gives them, and SAE-Lens's ActivationsStore and training runner run on the model.

Expected values never come from the splice: each spliced forward is checked against the same model run with a
plain hook that does the replacement by hand (sae.decode(sae.encode(x)))."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

sae_lens = pytest.importorskip("sae_lens")
datasets = pytest.importorskip("datasets")

from sae_lens import (  # noqa: E402
    LanguageModelSAERunnerConfig,
    LanguageModelSAETrainingRunner,
    LoggingConfig,
    StandardSAE,
    StandardSAEConfig,
    StandardTrainingSAEConfig,
)
from sae_lens.saes.sae import SAEMetadata  # noqa: E402

from moelens import HookedTransformer  # noqa: E402

RESID = "blocks.1.hook_resid_pre"
ROUTED = "blocks.1.mlp.hook_routed_out"
SLOTS = "blocks.1.mlp.hook_expert_outputs"  # [batch pos top_k d_model]
D_MODEL, TOP_K = 64, 2  # tiny-qwen2-moe


@pytest.fixture(scope="module")
def model():
    model = HookedTransformer.from_pretrained("tiny-qwen2-moe")
    yield model
    model.reset_saes()


@pytest.fixture(scope="module")
def tokens(model):
    return model.to_tokens(["The quick brown fox jumps", "over the lazy dog, twice"])


@pytest.fixture(scope="module")
def clean(model, tokens):
    return model(tokens)


def make_sae(hook_name: str, d_in: int = D_MODEL, seed: int = 0, **metadata) -> StandardSAE:
    """An untrained SAE whose reconstruction is far from its input (random biases too), so a splice shows."""
    torch.manual_seed(seed)
    sae = StandardSAE(StandardSAEConfig(d_in=d_in, d_sae=96, metadata=SAEMetadata(hook_name=hook_name, **metadata)))
    with torch.no_grad():
        sae.b_enc.normal_(0, 0.1)
        sae.b_dec.normal_(0, 0.1)
    return sae


def by_hand(sae: StandardSAE):
    """The replacement done without moelens.sae: what a spliced SAE must amount to."""
    return lambda x, hook: sae.decode(sae.encode(x))


def sae_names(model) -> list[str]:
    return [n for n in model.hook_dict if ".hook_sae_" in n]


# ---- HookedSAETransformer's methods ---------------------------------------------------------------------
def test_spliced_sae_is_its_reconstruction_in_place_of_the_site(model, tokens, clean):
    sae = make_sae(RESID)
    spliced = model.run_with_saes(tokens, saes=[sae])
    expected = model.run_with_hooks(tokens, fwd_hooks=[(RESID, by_hand(sae))])
    assert torch.equal(spliced, expected)  # same operations on the same tensors: bit for bit
    assert (spliced - clean).abs().amax() > 0.1  # the SAE's error really moved the logits
    assert sae_names(model) == [] and torch.equal(model(tokens), clean)  # detached after the call


def test_error_term_gives_the_unspliced_logits_bit_for_bit(model, tokens, clean):
    sae = make_sae(RESID)
    assert torch.equal(model.run_with_saes(tokens, saes=[sae], use_error_term=True), clean)
    # with a feature ablated, the error term keeps everything else: x + (decode(edited) - decode(clean))
    feature = int(sae.encode(model.run_with_cache(tokens, names_filter=RESID)[1][RESID]).sum((0, 1)).argmax())

    def ablate(acts, hook):
        acts[..., feature] = 0

    def ablate_by_hand(x, hook):
        acts = sae.encode(x)
        edited = acts.clone()
        edited[..., feature] = 0
        return x + (sae.decode(edited) - sae.decode(acts))

    with model.saes([sae], use_error_term=True):
        ablated = model.run_with_hooks(tokens, fwd_hooks=[(f"{RESID}.hook_sae_acts_post", ablate)])
    expected = model.run_with_hooks(tokens, fwd_hooks=[(RESID, ablate_by_hand)])
    torch.testing.assert_close(ablated, expected, rtol=0, atol=1e-5)
    assert (ablated - clean).abs().amax() > 1e-3


def test_cache_holds_the_sae_internals_under_the_site(model, tokens):
    sae = make_sae(RESID)
    _, clean_cache = model.run_with_cache(tokens, names_filter=RESID)
    x = clean_cache[RESID]
    logits, cache = model.run_with_cache_with_saes(tokens, saes=[sae])
    names = {f"{RESID}.hook_sae_{s}" for s in ("input", "acts_pre", "acts_post", "recons", "output")}
    assert names <= set(cache.keys())
    torch.testing.assert_close(cache[f"{RESID}.hook_sae_acts_post"], sae.encode(x), rtol=0, atol=0)
    torch.testing.assert_close(cache[f"{RESID}.hook_sae_output"], sae.decode(sae.encode(x)), rtol=0, atol=0)
    # moelens keeps the site's own hook point: it holds what flows on, the SAE's output
    torch.testing.assert_close(cache[RESID], cache[f"{RESID}.hook_sae_output"], rtol=0, atol=0)
    assert cache[f"{RESID}.hook_sae_acts_post"].shape == (*tokens.shape, 96)
    # ... also for a hook added before the SAE: the SAE runs first at its site
    seen = {}
    model.add_hook(RESID, lambda t, hook: seen.setdefault("x", t.clone()))
    try:
        model.run_with_saes(tokens, saes=[sae])
    finally:
        model.reset_hooks()
    torch.testing.assert_close(seen["x"], sae.decode(sae.encode(x)), rtol=0, atol=0)


def test_saes_context_restores_the_saes_it_displaced(model, tokens, clean):
    a, b = make_sae(RESID, seed=1), make_sae(RESID, seed=2)
    with_a = model.run_with_hooks(tokens, fwd_hooks=[(RESID, by_hand(a))])
    with_b = model.run_with_hooks(tokens, fwd_hooks=[(RESID, by_hand(b))])
    model.add_sae(a)
    try:
        assert model.acts_to_saes == {RESID: a}
        with model.saes(saes=[b]):
            assert torch.equal(model(tokens), with_b)
        assert torch.equal(model(tokens), with_a) and model.acts_to_saes == {RESID: a}
        model.reset_hooks(including_permanent=False)  # hooks are not SAEs: reset_hooks leaves the SAE on
        assert torch.equal(model(tokens), with_a)
        model.reset_saes(RESID, prev_saes=[b])  # older SAE-Lens: put another SAE in its place
        assert torch.equal(model(tokens), with_b)
    finally:
        model.reset_saes()
    assert torch.equal(model(tokens), clean) and sae_names(model) == []


@pytest.mark.parametrize(
    "site, d_in, metadata",
    [
        (ROUTED, D_MODEL, {}),
        (SLOTS, D_MODEL, {}),  # one SAE applied to each slot's output
        (SLOTS, TOP_K * D_MODEL, {}),  # trained on the flattened slots, as ActivationsStore feeds them
        (SLOTS, D_MODEL, {"hook_head_index": 1}),  # trained on slot 1 only: replaces slot 1 only
    ],
    ids=["routed_out", "per_slot", "flattened", "slot_1"],
)
def test_expert_sites(model, tokens, clean, site, d_in, metadata):
    sae = make_sae(site, d_in=d_in, **metadata)

    def expected_hook(x, hook):
        if "hook_head_index" in metadata:
            out = x.clone()
            out[:, :, 1] = sae.decode(sae.encode(x[:, :, 1]))
            return out
        return sae.decode(sae.encode(x.flatten(2) if d_in != x.shape[-1] else x)).reshape(x.shape)

    spliced = model.run_with_saes(tokens, saes=[sae])
    assert torch.equal(spliced, model.run_with_hooks(tokens, fwd_hooks=[(site, expected_hook)]))
    assert (spliced - clean).abs().amax() > 1e-3
    assert torch.equal(model.run_with_saes(tokens, saes=[sae], use_error_term=True), clean)


def test_errors_name_the_argument(model, tokens):
    with pytest.raises(KeyError, match="hook_name = 'blocks.1.hook_nowhere'"):
        model.add_sae(make_sae("blocks.1.hook_nowhere"))
    with pytest.raises(ValueError, match="d_in is 50"):
        model.run_with_saes(tokens, saes=[make_sae(RESID, d_in=50)])
    assert sae_names(model) == []  # the failed call detached its SAE
    with pytest.raises(KeyError, match="no SAE is attached"):
        model.reset_saes(RESID)


# ---- SAE-Lens's ActivationsStore and training runner ------------------------------------------------
# How SAE-Lens calls the model (sae_lens/training/activations_store.py, evals.py): to_tokens(text,
# truncate=False, move_to_device=False, prepend_bos=False) and run_with_cache(tokens, names_filter=[hook],
# stop_at_layer=layer + 1, prepend_bos=False), which passes prepend_bos on to forward.
SAE_LENS_CALLS = {"to_tokens": ("truncate", "move_to_device", "prepend_bos"), "forward": ("prepend_bos",)}


def missing_kwargs() -> dict[str, list[str]]:
    found = {}
    for method, kwargs in SAE_LENS_CALLS.items():
        params = inspect.signature(getattr(HookedTransformer, method)).parameters
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            lacking = [k for k in kwargs if k not in params]
            if lacking:
                found[method] = lacking
    return found


def test_moelens_takes_the_keywords_sae_lens_passes():
    assert missing_kwargs() == {}


@pytest.fixture(scope="module")
def sae_lens_model(model):
    return model


TEXTS = [f"Item {i}: the quick brown fox jumps over the lazy dog {i * 37 % 101} times." for i in range(24)]


def runner_cfg(hook_name: str, d_in: int, **kw) -> LanguageModelSAERunnerConfig:
    return LanguageModelSAERunnerConfig(
        sae=StandardTrainingSAEConfig(d_in=d_in, d_sae=64),
        model_name="tiny-qwen2-moe", hook_name=hook_name, dataset_path="", streaming=False,
        is_dataset_tokenized=False, context_size=16, prepend_bos=False,
        n_batches_in_buffer=2, store_batch_size_prompts=4, train_batch_size_tokens=32, training_tokens=256,
        n_eval_batches=1, eval_batch_size_prompts=2, device="cpu", lr=1e-2,
        logger=LoggingConfig(log_to_wandb=False), checkpoint_path=None, output_path=None, n_checkpoints=0,
        verbose=False, **kw,
    )


@pytest.mark.parametrize(
    "hook_name, d_in",
    [(RESID, D_MODEL), (ROUTED, D_MODEL), (SLOTS, TOP_K * D_MODEL)],  # SAE-Lens flattens [top_k d_model]
    ids=["resid_pre", "routed_out", "expert_outputs"],
)
def test_activations_store_and_training_runner(sae_lens_model, hook_name, d_in):
    model = sae_lens_model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "dataset is not tokenized", "overriding the model": expected here
        runner = LanguageModelSAETrainingRunner(
            runner_cfg(hook_name, d_in), override_model=model, override_dataset=datasets.Dataset.from_dict({"text": TEXTS})
        )
        store = runner.activations_store
        batch = store.get_batch_tokens()
        assert batch.shape == (4, 16)
        # the first window is the first text's tokens, as to_tokens gives them (no BOS: this tokenizer has none)
        assert batch[0].tolist() == model.to_tokens(TEXTS[0], prepend_bos=False)[0, :16].tolist()
        acts = store.get_activations(batch)
        _, cache = model.run_with_cache(batch, names_filter=hook_name)
        torch.testing.assert_close(acts, cache[hook_name].reshape(4, 16, d_in), rtol=0, atol=0)
        sae = runner.run()
    assert sae.cfg.metadata.hook_name == hook_name
    if hook_name == SLOTS:
        # SAE-Lens's own eval hook (evals.get_recons_loss) flattens only hook_q/k/v/z sites: it cannot run here
        spliced = model.run_with_saes(batch, saes=[sae])
        flat = lambda x, hook: sae.decode(sae.encode(x.flatten(2))).reshape(x.shape)  # noqa: E731
        assert torch.equal(spliced, model.run_with_hooks(batch, fwd_hooks=[(SLOTS, flat)]))
        return
    # the trained SAE attaches back where it was trained, and SAE-Lens's own eval hook agrees with the splice
    from sae_lens.evals import get_recons_loss
    from sae_lens.training.activation_scaler import ActivationScaler

    metrics = get_recons_loss(sae, model, ActivationScaler(), batch, compute_kl=False, compute_ce_loss=True)
    spliced_loss = model.run_with_saes(batch, saes=[sae], return_type="loss", loss_per_token=True)
    torch.testing.assert_close(metrics["ce_loss_with_sae"], spliced_loss, rtol=0, atol=1e-6)
    clean_loss = model(batch, return_type="loss", loss_per_token=True)
    torch.testing.assert_close(metrics["ce_loss_without_sae"], clean_loss, rtol=0, atol=0)
