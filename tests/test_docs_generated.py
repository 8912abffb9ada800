"""The documentation's family pages are what tools/gen_family_docs.py writes from the code today (the registry,
README's family table, each family's notes and support() of its tiny default): a family added, a site renamed
or a meaning reworded without regenerating them fails here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import gen_family_docs  # noqa: E402  (a script of tools/, not a package)


@pytest.fixture(scope="module")
def pages():
    return gen_family_docs.render()


def test_the_committed_family_pages_are_what_the_generator_writes(pages):
    stale = [str(p.relative_to(ROOT)) for p, text in pages.items() if not p.exists() or p.read_text() != text]
    extra = [str(p.relative_to(ROOT)) for p in gen_family_docs.OUT.glob("*.md") if p not in pages]
    assert not stale and not extra, (
        f"stale: {stale}, not generated: {extra}; run `python tools/gen_family_docs.py` and commit the pages"
    )


def test_every_registered_family_has_a_page_in_the_site_nav(pages):
    nav = (ROOT / "mkdocs.yml").read_text()
    missing = [p.name for p in pages if f"families/{p.name}" not in nav]
    assert not missing, f"mkdocs.yml's nav leaves out {missing}"


def test_a_family_page_lists_the_sites_only_it_has(pages):
    """gpt-oss's sink scores are its own site; the residual stream is every family's (worked out by hand)."""
    gpt_oss = pages[gen_family_docs.OUT / "gpt_oss.md"]
    own = gpt_oss.split("## Sites beyond the common ones", 1)[1].split("\n## ", 1)[0]
    assert "`blocks.L.attn.hook_sink_scores`" in own and "`blocks.L.hook_resid_pre`" not in own


def test_a_family_missing_from_the_readme_table_is_named():
    with pytest.raises(KeyError, match="mixtral"):
        gen_family_docs.family_rows_checked("| `HookedQwen2Moe` | `qwen2_moe` | a | b |", ["qwen2_moe", "mixtral"])


def test_a_family_page_shows_its_flagship_plan_at_full_size(pages):
    """Mixtral's page prints the plan of Mixtral-8x7B, the first checkpoint of docs/families/flagships/mixtral.json:
    46,702,792,704 parameters, transformers' count of that config (tests/test_flagships.py); GLM-4.5's lists Air too."""
    mixtral = pages[gen_family_docs.OUT / "mixtral.md"]
    section = mixtral.split("## `plan` of mistralai/Mixtral-8x7B-v0.1 at full size", 1)[1].split("\n## ", 1)[0]
    assert "46,702,792,704 parameters in all" in section and "placement on cuda:0 (80.00 GB)" in section
    glm = pages[gen_family_docs.OUT / "glm4_moe.md"]
    assert "- zai-org/GLM-4.5-Air: 106,852,251,264 parameters (106.85B)" in glm


def test_a_family_without_a_flagship_file_says_so():
    assert gen_family_docs.flagship_section("toy_moe")[2] == "No published config.json in `docs/families/flagships/toy_moe.json` yet."
