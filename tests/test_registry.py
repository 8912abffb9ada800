"""A family is found from its files alone: the registry (the family class), the package's exports, the embedded
tiny defaults (moelens/defaults/tiny-*.json) and the generic suites' families (tests/tiny_<family>.py's base
variant) all name the same families, so a family added without one of them fails here, by name."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import moelens
import moelens.models
from moelens import defaults
from moelens.families import FAMILIES as REGISTERED

from conftest import FAMILIES

# a family's name is its module's, moelens/models/<name>.py: its model_type or one of the spellings it reads
# (Qwen3.5-MoE's text model is qwen3_5_moe_text, read from qwen3_5_moe checkpoints too)
OWN_TYPES = {cls.__module__.rsplit(".", 1)[1] for cls in REGISTERED.values()}


def test_every_registered_family_is_in_the_generic_suites():
    assert sorted(FAMILIES) == sorted(OWN_TYPES), (
        f"registered without a tests/tiny_<family>.py base variant: {sorted(OWN_TYPES - set(FAMILIES))}; "
        f"a base variant of no registered family: {sorted(set(FAMILIES) - OWN_TYPES)}"
    )


def test_every_registered_family_has_one_embedded_tiny_default():
    by_type: dict[str, list[str]] = {}
    for name, file in defaults.CONFIGS.items():
        model_type = json.loads((Path(defaults.__file__).parent / file).read_text())["model_type"]
        by_type.setdefault(REGISTERED[model_type].__module__.rsplit(".", 1)[1], []).append(name)
    assert set(by_type) == OWN_TYPES, f"without a tiny default: {sorted(OWN_TYPES - set(by_type))}"
    assert all(len(names) == 1 for names in by_type.values()), {t: n for t, n in by_type.items() if len(n) > 1}


def test_every_family_class_is_exported_under_its_name():
    for cls in set(REGISTERED.values()):
        assert getattr(moelens, cls.__name__) is cls, cls.__name__
        assert getattr(moelens.models, cls.__name__) is cls, cls.__name__
        assert cls.__name__ in moelens.__all__ and cls.__name__ in moelens.models.__all__, cls.__name__


def test_each_family_lives_in_its_own_model_type_file():
    for cls in set(REGISTERED.values()):
        name = cls.__module__.rsplit(".", 1)[1]
        assert cls.__module__ == f"moelens.models.{name}", cls.__module__
        assert name in (cls.model_type, *getattr(cls, "model_type_aliases", ())), (name, cls.model_type)


def test_a_family_file_dropped_in_is_found(tmp_path):
    """Discovery, not a list: in a copy of the package, a new module in moelens/models that defines a family is
    registered and exported by `import moelens`, with nothing else edited."""
    package = Path(moelens.__file__).parent
    shutil.copytree(package, tmp_path / "moelens", ignore=shutil.ignore_patterns("__pycache__", "tiny-code-moe"))
    (tmp_path / "moelens" / "models" / "toy_moe.py").write_text(
        "from moelens.models.qwen2_moe import HookedQwen2Moe\n\n\n"
        "class HookedToyMoe(HookedQwen2Moe):\n    model_type = 'toy_moe'\n"
    )
    probe = "import moelens; print(moelens.FAMILIES['toy_moe'].__name__, 'HookedToyMoe' in moelens.__all__)"
    run = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["HookedToyMoe", "True"]
