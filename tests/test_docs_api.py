"""The API reference is generated from docstrings (mkdocstrings, docs/api/): every public name of the modules it
documents has one, so that no page of the reference shows a bare signature. Family classes are documented by
their generated pages (docs/families/, tests/test_docs_generated.py)."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import moelens
from moelens.families import FAMILIES

ROOT = Path(__file__).resolve().parent.parent
# the modules docs/api/ renders, and the classes whose methods it lists
MODULES = ["moelens", "moelens.analysis", "moelens.patching", "moelens.traces", "moelens.utils", "moelens.plan",
           "moelens.hook_points", "moelens.evals"]
CLASSES = [moelens.HookedTransformer, moelens.ActivationCache, moelens.MoeConfig, moelens.HookPoint,
           moelens.HookedRootModule, moelens.KVCache, moelens.FactoredMatrix]


def undocumented(modules: list[str], classes: list[type]) -> list[str]:
    families = set(FAMILIES.values())
    missing = []
    for name in modules:
        module = importlib.import_module(name)
        if not (module.__doc__ or "").strip():
            missing.append(name)
        for attr in getattr(module, "__all__", [n for n in vars(module) if not n.startswith("_")]):
            obj = getattr(module, attr)
            if not (inspect.isclass(obj) or inspect.isfunction(obj)) or obj in families:
                continue
            if getattr(obj, "__module__", "").split(".")[0] == "moelens" and not (obj.__doc__ or "").strip():
                missing.append(f"{name}.{attr}")
    for cls in classes:
        for attr, obj in vars(cls).items():
            if not attr.startswith("_") and inspect.isfunction(obj) and not (obj.__doc__ or "").strip():
                missing.append(f"{cls.__name__}.{attr}")
    return missing


def test_every_public_name_of_the_reference_has_a_docstring():
    missing = undocumented(MODULES, CLASSES)
    assert not missing, f"public names without a docstring (the API reference would show them bare): {missing}"


def test_every_documented_module_has_a_reference_page():
    pages = "\n".join(p.read_text() for p in (ROOT / "docs" / "api").glob("*.md"))
    missing = [m for m in MODULES if f"::: {m}" not in pages]
    assert not missing, f"docs/api/ renders no page for {missing}"


def test_the_check_finds_a_function_without_a_docstring(tmp_path, monkeypatch):
    (tmp_path / "moelens_probe_module.py").write_text('"""A module."""\ndef bare(x):\n    return x\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    # not a moelens module: nothing is reported; the same function as moelens's is
    assert undocumented(["moelens_probe_module"], []) == []
    import moelens_probe_module

    monkeypatch.setattr(moelens_probe_module.bare, "__module__", "moelens.probe")
    assert undocumented(["moelens_probe_module"], []) == ["moelens_probe_module.bare"]
