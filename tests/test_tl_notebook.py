"""A TransformerLens notebook runs with one changed import: docs/tl_notebook.py is TransformerLens's Main Demo and
Exploratory Analysis Demo as a TL user writes them (`import moelens as tl`, `from moelens import HookedTransformer,
FactoredMatrix, ActivationCache, patching`, `from moelens.hook_points import HookPoint, HookedRootModule`), on
the embedded tiny-code-moe. Its asserts are the notebooks' sanity checks: exact direct logit attribution, the
patching helpers against the notebook's own hooks, the toy HookedRootModule's numbers, FactoredMatrix against
the dense product."""

from __future__ import annotations

import runpy
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parent.parent / "docs" / "tl_notebook.py"


def test_the_transformer_lens_notebook_runs_on_moelens(capsys):
    grad = torch.is_grad_enabled()
    try:
        namespace = runpy.run_path(str(SCRIPT), run_name="__main__")
    finally:
        torch.set_grad_enabled(grad)  # the notebook turns autograd off, as TransformerLens's do
    printed = capsys.readouterr().out
    assert printed.rstrip().endswith("The TransformerLens notebook ran on moelens.")
    assert "Ranks of the answer tokens:" in printed  # utils.test_prompt's last line
    model = namespace["model"]
    assert namespace["ioi_patching_result"].shape == (model.cfg.n_layers, namespace["clean_tokens"].shape[1])
    assert namespace["per_head_logit_diffs"].shape == (model.cfg.n_layers, model.cfg.n_heads)
