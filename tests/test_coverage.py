"""Coverage is a test: every model type of the installed transformers that routes to experts and has a text-only
causal LM is either a registered moelens family or a row of the "Coverage" table of docs/coverage.md naming what it needs.

The criterion (docs/coverage.md): the model type's config class declares an expert count (one of COUNT_FIELDS,
as an annotated field or an attribute_map alias, itself or in a sub-config that is not another modality's), and
transformers has `<config class name without Config>ForCausalLM` for it: the class AutoModelForCausalLM maps it to,
or, where it maps none (Mistral 4), that class in the model's module. A multimodal checkpoint's own type (whose
causal-LM mapping is a ForConditionalGeneration) is not listed; its text model's type is.

KNOWN is what transformers 5.24 has. A known type neither registered nor in the table fails; a type a later
transformers adds is reported as a warning until it gets a row or a family, so CI stays green."""

from __future__ import annotations

import importlib
import re
import warnings
from functools import lru_cache
from pathlib import Path

from moelens.families import FAMILIES
import moelens.models  # noqa: F401  (the families register themselves)

COVERAGE = (Path(__file__).resolve().parent.parent / "docs" / "coverage.md").read_text()
COUNT_FIELDS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
OTHER_MODALITIES = ("vision_config", "audio_config", "text_config", "speech_config")

# transformers 5.24's 62 types (moe_causal_lm_types() there)
KNOWN = frozenset("""
afmoe aria_text axk1 axk2 bailing_hybrid beam cohere2_moe dbrx deepseek_v2 deepseek_v3 deepseek_v32 deepseek_v4
doge dots1 dots3_note_text ernie4_5_moe exaone_moe flex_olmo flint gemma4_text glm4_moe glm4_moe_lite glm_moe_dsa
gpt_oss granitemoe granitemoe_swa granitemoehybrid granitemoeshared hunyuan_v1_moe hy_v3 hy_v4 inkling2_loop_text
inkling2_text inkling_text jamba jetmoe kimi_linear kolibri1 laguna lara_mini lfm2_moe llama4_text longcat_flash
mellum mimo_v2_flash minimax minimax_m2 minimax_m3_vl_text mistral4 mixtral nemotron_h olmoe phimoe qwen2_moe
qwen3_5_moe_text qwen3_moe qwen3_next qwen4_exp_text sarvam_mla sarvam_moe solar_open zaya
""".split())
# a reason that names nothing
VAGUE = re.compile(r"^\W*(unsupported|not supported|todo|tbd|n/?a|missing|later|-+)\W*$", re.IGNORECASE)


def names_a_piece(reason: str) -> bool:
    return bool(reason) and not VAGUE.match(reason) and len(reason.split()) >= 3


def _fields(config_class: type) -> set[str]:
    names = set(getattr(config_class, "attribute_map", {}) or {})
    for klass in config_class.__mro__:
        names |= set(getattr(klass, "__annotations__", {}))
    return names


def routes_to_experts(config_class: type) -> bool:
    if _fields(config_class) & set(COUNT_FIELDS):
        return True
    subs = getattr(config_class, "sub_configs", None) or {}
    return any(
        name not in OTHER_MODALITIES and isinstance(sub, type) and _fields(sub) & set(COUNT_FIELDS)
        for name, sub in subs.items()
    )


def causal_lm_class(model_type: str, config_class: type) -> str | None:
    """The text-only causal LM's class name transformers has for the type, or None."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = config_class.__name__.removesuffix("Config") + "ForCausalLM"
    mapped = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if mapped is not None:
        return mapped if mapped.endswith("ForCausalLM") else None
    module = importlib.import_module(f"transformers.models.{model_type_to_module_name(model_type)}")
    return name if hasattr(module, name) else None


@lru_cache(maxsize=1)
def moe_causal_lm_types() -> dict[str, str]:
    """model_type -> its causal LM class, for the installed transformers (imports every config class: ~15 s)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

    found = {}
    for model_type in CONFIG_MAPPING_NAMES:
        config_class = CONFIG_MAPPING[model_type]
        if routes_to_experts(config_class) and (cls := causal_lm_class(model_type, config_class)):
            found[model_type] = cls
    return found


def coverage_rows(text: str = COVERAGE) -> dict[str, str]:
    """docs/coverage.md's "Coverage" table: model_type -> its missing piece."""
    section = text.split("\n## Coverage\n", 1)
    assert len(section) == 2, "docs/coverage.md has no '## Coverage' section"
    body = section[1].split("\n## ", 1)[0]
    rows = {}
    for line in body.splitlines():
        match = re.match(r"\|\s*`([\w.-]+)`\s*\|[^|]*\|(.*)\|\s*$", line)
        if match and match.group(1) != "model_type":  # the header
            assert match.group(1) not in rows, f"docs/coverage.md: {match.group(1)} has two rows"
            rows[match.group(1)] = match.group(2).strip()
    return rows


def registered_types() -> set[str]:
    return set(FAMILIES)


def test_criterion_finds_every_registered_family():
    """The criterion is checked on what moelens knows routes to experts: each family's own model_type is found
    (an alias, a multimodal checkpoint's type such as llama4, is not a text-only causal LM and is not)."""
    found = moe_causal_lm_types()
    own = {family.model_type for family in FAMILIES.values()}
    assert not own - set(found), f"the coverage criterion misses registered families {sorted(own - set(found))}"
    # and excludes what is not a text-only causal LM: a multimodal type, an encoder-decoder, a vision encoder
    for outside in ("llama4", "qwen3_vl_moe", "switch_transformers", "nllb-moe", "dots3_note_vision_encoder"):
        assert outside not in found, outside


def test_every_known_type_is_registered_or_named():
    found = moe_causal_lm_types()
    print(f"\n{len(found)} model types route to experts with a text-only causal LM:")
    rows, registered = coverage_rows(), registered_types()
    for model_type in sorted(found):
        status = "registered" if model_type in registered else rows.get(model_type, "NOT NAMED")
        print(f"  {model_type:24} {found[model_type]:32} {status}")
    unnamed = sorted(t for t in found if t in KNOWN and t not in registered and t not in rows)
    assert not unnamed, f"neither a moelens family nor a row of docs/coverage.md's table: {unnamed}"


def test_types_transformers_added_later_are_reported_not_failed():
    found = moe_causal_lm_types()
    new = sorted(set(found) - KNOWN - registered_types() - set(coverage_rows()))
    if new:
        warnings.warn(f"transformers has MoE causal-LM types moelens neither loads nor names: {new}; add a family "
                      "or a row to docs/coverage.md's table", stacklevel=1)
    gone = sorted(KNOWN - set(found))
    if gone:
        warnings.warn(f"model types the installed transformers no longer lists: {gone}", stacklevel=1)


def test_rows_name_a_specific_missing_piece_and_are_current():
    rows, registered = coverage_rows(), registered_types()
    stale = sorted(set(rows) & registered)
    assert not stale, f"docs/coverage.md still lists registered families: {stale}"
    vague = {t: r for t, r in rows.items() if not names_a_piece(r)}
    assert not vague, f"docs/coverage.md's rows must name the missing piece: {vague}"
    unknown = sorted(set(rows) - KNOWN - set(moe_causal_lm_types()))
    assert not unknown, f"docs/coverage.md's rows name types transformers does not have: {unknown}"


def test_a_row_must_name_its_piece():
    assert coverage_rows("x\n## Coverage\n| `a` | c | the lightning mixer |\n## Next\n| `b` | c | d |\n") == {
        "a": "the lightning mixer"
    }
    for reason in ("", "unsupported", "Not supported.", "TODO", "-", "later"):
        assert not names_a_piece(reason), reason
    assert names_a_piece("the lightning-attention mixer and its state")
