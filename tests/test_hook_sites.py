"""The table of hook sites (moelens.hooks.sites) is what the models build: every hook point of every tiny model
(all variants, every TransformerLens switch on that the model allows) is a table entry with one of its forms'
layout and meaning, every entry and form is some model's, each switch creates exactly its sites, support()
reads its rows and absent list from the table, and the table's short and standard names resolve."""

from __future__ import annotations

import pytest
from conftest import FAMILIES, VARIANTS

from moelens import HookedTransformer
from moelens.hooks.names import alias_candidates, layer_of
from moelens.hooks.sites import DEFAULT, SITE_BY_NAME, SITES, site_hook, switched_sites, table_name
from moelens.utils import get_act_name

SWITCHES = ("set_use_attn_result", "set_use_split_qkv_input", "set_use_attn_in", "set_use_hook_mlp_in")
# every variant but those differing only in how the checkpoint is stored (same hook points)
MODEL_KEYS = sorted(k for k in VARIANTS if k[1] not in ("sharded", "fused"))

# Sites of token mixers (blocks.L.mixer.*): Qwen3-Next builds Gated DeltaNet's (the default forms), Nemotron-H
# Mamba-2's.
MIXER_ONLY = {s.name for s in SITES if s.name.startswith("blocks.L.mixer.")}
AWAITING_FAMILY_FORMS: set[str] = set()
# a form's meaning fields, as the model fills them: (model, layer) -> value
FIELDS = {"formula": lambda model, layer: model.blocks[layer].mlp.experts.spec.activation.formula}


def switched_on(model: HookedTransformer) -> HookedTransformer:
    """Every TransformerLens switch on that the model allows (the others refuse with a ValueError)."""
    for switch in SWITCHES:
        try:
            getattr(model, switch)(True)
        except ValueError:
            pass
    return model


@pytest.fixture(scope="module")
def models(checkpoints):
    """(family, variant) -> a model of its own (the switches change it), with every switch on it allows."""
    return {key: switched_on(HookedTransformer.from_pretrained(checkpoints[key], progress=False)) for key in MODEL_KEYS}


def forms_used(model: HookedTransformer) -> dict[str, set[str]]:
    """table name -> the forms of it that the model's hook points have; fails on a hook point that is none."""
    used: dict[str, set[str]] = {}
    for name, hp in model.hook_dict.items():
        site = SITE_BY_NAME.get(table_name(name))
        assert site is not None, f"{name} [{hp.layout}] '{hp.meaning}' has no entry in the table of hook sites"
        layer = layer_of(name)
        matching = set()
        for form_name, form in site.forms.items():
            unknown = set(form.fields) - set(FIELDS)
            assert not unknown, f"{site.name} ({form_name}) names fields no model fills: {unknown}"
            meaning = form.meaning.format(**{f: FIELDS[f](model, layer) for f in form.fields})
            if (form.layout, meaning) == (hp.layout, hp.meaning):
                matching.add(form_name)
        assert len(matching) == 1, (
            f"{name} [{hp.layout}] '{hp.meaning}' matches {sorted(matching) or 'none'} of the table's forms: "
            + "; ".join(f"{k}: [{f.layout}] '{f.meaning}'" for k, f in site.forms.items())
        )
        used.setdefault(site.name, set()).update(matching)
    return used


@pytest.mark.parametrize("key", MODEL_KEYS, ids=lambda k: f"{k[0]}-{k[1]}")
def test_every_hook_point_is_a_table_entry_with_its_layout_and_meaning(models, key):
    forms_used(models[key])


def test_every_site_and_form_of_the_table_is_some_models(models):
    used: dict[str, set[str]] = {}
    for model in models.values():
        for name, forms in forms_used(model).items():
            used.setdefault(name, set()).update(forms)
    for site in SITES:
        assert site.name in used, f"no family has {site.name}"
        unused = set(site.forms) - used[site.name] - (AWAITING_FAMILY_FORMS if site.name in MIXER_ONLY else set())
        assert not unused, f"{site.name}: forms no family uses: {unused}"
    assert {f for f, _ in MODEL_KEYS} == set(FAMILIES)


def test_each_switch_creates_exactly_its_sites(checkpoints):
    """A model with plain multi-head attention allows every switch: each adds the table's sites of its switch
    on every block, and taking it off removes them."""
    model = HookedTransformer.from_pretrained(checkpoints["qwen2_moe", "plain_attn"], progress=False)
    assert model.cfg.n_kv_heads == model.cfg.n_heads
    before = set(model.hook_dict)
    for switch in SWITCHES:
        getattr(model, switch)(True)
        added = set(model.hook_dict) - before
        expected = {
            s.name.replace("blocks.L.", f"blocks.{i}.") for s in switched_sites(switch) for i in range(model.cfg.n_layers)
        }
        assert expected and added == expected, switch
        getattr(model, switch)(False)
        assert set(model.hook_dict) == before, switch


@pytest.mark.parametrize("family", FAMILIES)
def test_support_rows_and_absent_sites_come_from_the_table(models, family):
    model = models[family, "base"]
    table = model.support(print_table=False)
    hook_dict = model.hook_dict
    assert len(table.names()) == len(set(table.names())), "one row per site"
    shown = set()
    for row in table.rows:
        site = SITE_BY_NAME[table_name(row.name)]
        shown.add(site.name)
        assert row.standard == (site.standard or "-"), row.name
        hp = next(hp for n, hp in hook_dict.items() if table_name(n) == site.name)
        meanings = {h.meaning for n, h in hook_dict.items() if table_name(n) == site.name}
        if len(meanings) == 1:
            assert (row.layout, row.meaning) == (hp.layout, hp.meaning), row.name
        else:  # blocks that compute the site otherwise (Llama 4's NoPE layers): each meaning with its blocks
            assert row.layout == hp.layout and all(f": {m}" in row.meaning for m in meanings), row.name
    absent = {line.split(":", 1)[0] for line in table.absent}
    assert absent <= set(SITE_BY_NAME), absent - set(SITE_BY_NAME)
    # every site of the table is a row, or absent (or both: on some blocks only)
    assert {s.name for s in SITES} == shown | absent


def test_support_names_the_switch_of_an_optional_site_that_is_off(checkpoints):
    model = HookedTransformer.from_pretrained(checkpoints["qwen2_moe", "base"], progress=False)
    absent = model.support(print_table=False).absent
    assert any(a.startswith("blocks.L.attn.hook_result:") and "model.set_use_attn_result(True)" in a for a in absent)
    model.set_use_attn_result(True)
    assert not any(a.startswith("blocks.L.attn.hook_result:") for a in model.support(print_table=False).absent)


@pytest.mark.parametrize("site", [s for s in SITES if s.short], ids=lambda s: s.short)
def test_a_short_name_resolves_to_its_site(site):
    if site.name.startswith("blocks.L."):
        assert get_act_name(site.short, 3) == site.name.replace("blocks.L.", "blocks.3.")
        assert alias_candidates(site.short, 3)[0] == site.name.replace("blocks.L.", "blocks.3.")
    else:
        assert get_act_name(site.short) == site.name
        assert alias_candidates(site.short) == [site.name]


@pytest.mark.parametrize("site", [s for s in SITES if s.standard or s.aliases], ids=lambda s: s.name)
def test_standard_names_and_aliases_stand_for_their_site(site):
    layer = 2 if site.name.startswith("blocks.L.") else None
    full = site.name.replace("blocks.L.", "blocks.2.")
    for alias in (site.standard, *site.aliases):
        if alias:
            assert full in alias_candidates(alias, layer), alias


def test_the_per_expert_views_show_the_rows_of_a_per_slot_site():
    views = [s for s in SITES if s.per_expert]
    assert {s.tail for s in views} == {"hook_gate", "hook_pre", "hook_post"}
    for view in views:
        assert ".experts.E." in view.name and view.switch is None
        assert view.rows_of in SITE_BY_NAME and not SITE_BY_NAME[view.rows_of].per_expert


def test_site_hook_takes_the_tables_form_and_refuses_what_it_lacks():
    hp = site_hook("blocks.L.attn.hook_v", "latent")
    assert (hp.layout, hp.meaning) == ("batch pos head v_head_dim", "decompressed value per head")
    assert site_hook("blocks.L.attn.hook_v").layout == "batch pos kv_head d_head"
    post = site_hook("blocks.L.mlp.experts.hook_post", formula="f(gate, up)")
    assert post.meaning == "expert neurons per slot: f(gate, up)"
    with pytest.raises(KeyError, match="hook_nothing"):
        site_hook("blocks.L.attn.hook_nothing")
    with pytest.raises(KeyError, match="no form 'sideways'.*latent"):
        site_hook("blocks.L.attn.hook_v", "sideways")
    with pytest.raises(TypeError, match="formula"):
        site_hook("blocks.L.mlp.experts.hook_post")
    with pytest.raises(TypeError, match="extra"):
        site_hook("blocks.L.attn.hook_q", DEFAULT, extra="x")


# ---- the unweighted per-slot expert output, blocks.L.mlp.experts.hook_out ----------------------------------------
@pytest.mark.parametrize("name", ["tiny-code-moe", "tiny-gpt-oss"])  # plain experts; biased clamped-SwiGLU ones
# triton under TRITON_INTERPRET=1 (conftest): minutes on CPU, so marked slow
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_unweighted_expert_outputs_site(name, backend):
    import torch

    model = HookedTransformer.from_pretrained(name)
    model.set_experts_backend(backend)
    tokens = torch.randint(0, model.cfg.d_vocab, (2, 5), generator=torch.Generator().manual_seed(0))
    layer = model.cfg.moe_layer_indices[0]
    site = f"blocks.{layer}.mlp.experts.hook_out"
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens)
        out = cache[site]
        assert out.shape == (2, 5, model.cfg.top_k, model.cfg.d_model)
        assert cache["expert_out", layer] is out  # its short name
        # by hand: each slot's neurons through its expert's down projection, plus its bias
        idx = cache["expert_indices", layer]
        by_hand = torch.einsum("bpki,bpkim->bpkm", cache[f"blocks.{layer}.mlp.experts.hook_post"], model.W_out[layer][idx])
        if model.blocks[layer].mlp.experts.spec.bias:
            by_hand = by_hand + model.b_out[layer][idx]
        torch.testing.assert_close(out, by_hand, rtol=1e-5, atol=1e-5)
        # the weighted site is computed from it, bit for bit
        assert torch.equal(out * cache["expert_weights", layer][..., None], cache["expert_outputs", layer])

        def run(hook):
            return model.run_with_hooks(tokens, fwd_hooks=[(site, hook)])

        assert torch.equal(run(lambda t, hook: t), logits)  # a hook that changes nothing changes nothing
        assert torch.equal(run(lambda t, hook: None), logits)
        returned = run(lambda t, hook: t * 2)
        in_place = run(lambda t, hook: t.mul_(2))
        assert torch.equal(returned, in_place)  # editing in place means what returning the edit means
        # downstream is computed from it: doubling every unweighted output doubles the weighted ones exactly
        doubled_weighted = model.run_with_hooks(tokens, fwd_hooks=[(f"blocks.{layer}.mlp.hook_expert_outputs", lambda t, hook: t * 2)])
        assert torch.equal(returned, doubled_weighted)
        assert not torch.equal(returned, logits)
