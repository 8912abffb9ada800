"""README, the documentation's pages and docstrings say what the code does today: the embedded models listed, the families that exist,
the formats that load, the dependencies moelens has."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import moelens
from moelens import defaults
from moelens.families import FAMILIES

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
PAGES = {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "docs").rglob("*.md"))}
GETTING_STARTED = PAGES["docs/getting-started.md"]


def test_getting_started_lists_every_embedded_default():
    bullet = next(p for p in GETTING_STARTED.split("\n- ") if p.startswith("**Embedded defaults**"))
    missing = [name for name in defaults.NAMES if f"`{name}`" not in bullet]
    assert not missing, f"docs/getting-started.md's 'Embedded defaults' leaves out {missing}"


def test_no_text_says_an_existing_family_is_missing():
    moelens.HookedTransformer  # the families register themselves on import
    spelled = {t.replace("_", "-").lower() for t in FAMILIES} | {t.lower() for t in FAMILIES}
    pages = [("README.md", README), *PAGES.items()]
    for where, text in [*pages, *((str(p), p.read_text()) for p in (ROOT / "moelens").rglob("*.py"))]:
        for match in re.finditer(r"no ([\w-]+) family yet", text):
            assert match.group(1).lower() not in spelled, f"{where}: {match.group(0)!r}, but the family exists"


def test_gpt_oss_row_says_its_mxfp4_loads():
    row = next(line for line in README.splitlines() if line.startswith("| `HookedGptOss`"))
    assert "MXFP4" in row, row


def test_no_docstring_denies_a_dependency_moelens_has():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~\[ ;]", d, maxsplit=1)[0].lower() for d in deps}
    for path in (ROOT / "moelens").rglob("*.py"):
        for match in re.finditer(r"does not depend on (\w+)", path.read_text()):
            assert match.group(1).lower() not in names, f"{path}: {match.group(0)!r}, but pyproject depends on it"


def test_no_docstring_says_moelens_lacks_a_progress_bar_it_shows():
    """tqdm is a dependency: moelens.patching's loop shows a bar, and no docstring or page says it runs without one."""
    for where, text in [("README.md", README), *PAGES.items(), *((str(p), p.read_text()) for p in (ROOT / "moelens").rglob("*.py"))]:
        assert not re.search(r"loop runs silently|without a progress bar", text), f"{where} says the loop has no progress bar"


def test_the_package_does_not_ship_the_training_record():
    """The trained default's 1.1 MB training record stays in the repository, beside its training script."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["moelens"]
    shipped = {p for pattern in data for p in (ROOT / "moelens").glob(pattern)}
    assert not [p for p in shipped if p.name == "training_record.json"], data
    assert (ROOT / "tools" / "tiny-code-moe" / "training_record.json").exists()
    assert not list(ROOT.glob("*.whl")), "a wheel at the repository's root"
