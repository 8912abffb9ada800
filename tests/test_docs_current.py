"""README and docstrings say what the code does today: the embedded models listed, the families that exist,
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


def test_readme_lists_every_embedded_default():
    bullet = next(p for p in README.split("\n- ") if p.startswith("**Embedded defaults**"))
    missing = [name for name in defaults.NAMES if f"`{name}`" not in bullet]
    assert not missing, f"README's 'Embedded defaults' leaves out {missing}"


def test_no_text_says_an_existing_family_is_missing():
    moelens.HookedTransformer  # the families register themselves on import
    spelled = {t.replace("_", "-").lower() for t in FAMILIES} | {t.lower() for t in FAMILIES}
    for where, text in [("README.md", README), *((str(p), p.read_text()) for p in (ROOT / "moelens").rglob("*.py"))]:
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
