"""The notebooks run: docs/notebooks/main_demo.ipynb is TransformerLens's Main Demo and
Exploratory Analysis Demo as a TL user writes them (`import moelens as tl`, `from moelens import HookedTransformer,
FactoredMatrix, ActivationCache, patching`, `from moelens.hook_points import HookPoint, HookedRootModule`), on
the embedded tiny-code-moe. Its asserts are the notebooks' sanity checks: exact direct logit attribution, the
patching helpers against the notebook's own hooks, the toy HookedRootModule's numbers, FactoredMatrix against
the dense product."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

NOTEBOOKS = Path(__file__).resolve().parent.parent / "docs" / "notebooks"


def run_notebook(name: str) -> dict:
    """Every code cell of a notebook, in order, in one namespace (as a kernel runs them; the site's build runs
    them in a kernel too, mkdocs-jupyter, and shows the outputs). Plots go to matplotlib's file backend."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    notebook = json.loads((NOTEBOOKS / name).read_text())
    assert notebook["nbformat"] == 4
    cells = ["".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "code"]
    # `%matplotlib inline` (which shows a returned Figure in a kernel) is the only magic; a shell escape would run
    # only in a kernel, so none is allowed
    magics = [line for cell in cells for line in cell.splitlines() if line.lstrip().startswith(("%", "!"))]
    assert set(magics) <= {"%matplotlib inline"}, f"{name}: {magics}"
    cells = ["\n".join(l for l in cell.splitlines() if l not in magics) for cell in cells]
    assert all(not c.get("outputs") for c in notebook["cells"] if c["cell_type"] == "code"), (
        f"{name}: committed with outputs (the site's build executes it): clear them"
    )
    namespace: dict = {"__name__": "__main__"}
    exec(compile("\n\n".join(cells), str(NOTEBOOKS / name), "exec"), namespace)
    return namespace


def test_the_transformer_lens_notebook_runs_on_moelens(capsys):
    grad = torch.is_grad_enabled()
    try:
        namespace = run_notebook("main_demo.ipynb")
    finally:
        torch.set_grad_enabled(grad)  # the notebook turns autograd off, as TransformerLens's do
    printed = capsys.readouterr().out
    assert printed.rstrip().endswith("The TransformerLens notebook ran on moelens.")
    assert "Ranks of the answer tokens:" in printed  # utils.test_prompt's last line
    model = namespace["model"]
    assert namespace["ioi_patching_result"].shape == (model.cfg.n_layers, namespace["clean_tokens"].shape[1])
    assert namespace["per_head_logit_diffs"].shape == (model.cfg.n_layers, model.cfg.n_heads)


def test_the_routing_tutorial_runs(capsys):
    grad = torch.is_grad_enabled()
    try:
        namespace = run_notebook("routing_tutorial.ipynb")
    finally:
        torch.set_grad_enabled(grad)
    printed = capsys.readouterr().out
    assert "expert usage over" in printed and "tokens routed most strongly to expert" in printed
    usage = namespace["usage"]
    assert torch.equal(usage.counts.sum(1), torch.full((len(usage.layers),), 2 * usage.n_tokens))
