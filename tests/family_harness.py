"""What the family tests (test_family_*.py) share: a family's tiny checkpoints built once per module, the
transformers references loaded once per variant and dtype, the inputs, the checks of a verify report against
transformers, greedy generation against transformers' generate, and the edits that break a checkpoint."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moelens.verify import load_reference

ATTENTION_SITES = ("attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_z")
BLOCK_SITES = ("hook_resid_pre", "hook_attn_out", "hook_mlp_out", "hook_resid_post", "ln1.hook_normalized",
               "ln2.hook_normalized")
ROUTER_SITES = ("mlp.hook_router_logits", "mlp.hook_expert_weights", "mlp.hook_expert_indices", "mlp.hook_routed_out")
MODEL_SITES = ("ln_final.hook_normalized", "hook_logits")


def build_checkpoints(tmp_path_factory, family: str, builders: dict) -> dict[str, Path]:
    """Every variant of a family's tiny checkpoints ({(family, variant): build(folder)}), by variant."""
    root = tmp_path_factory.mktemp(family)
    return {variant: build(root / variant) for (_, variant), build in builders.items()}


class References:
    """transformers' model of each checkpoint, loaded on first use, once per (variant, dtype)."""

    def __init__(self, checkpoints: dict[str, Path]) -> None:
        self.checkpoints = checkpoints
        self.loaded: dict = {}

    def __call__(self, variant: str, dtype: torch.dtype = torch.float32):
        if (variant, dtype) not in self.loaded:
            self.loaded[variant, dtype] = load_reference(self.checkpoints[variant], dtype)
        return self.loaded[variant, dtype]

    def __getitem__(self, variant: str):
        return self(variant)


def tokens(seed: int = 3, shape: tuple[int, int] = (2, 40)) -> torch.Tensor:
    """Token ids below the tiny models' vocabulary (96)."""
    return torch.randint(0, 96, shape, generator=torch.Generator().manual_seed(seed))


def check_report(
    report, model, block_sites: Callable[[int], Iterable[str]], tol: float = 1e-5, model_sites: Iterable[str] = ()
) -> None:
    """moelens against transformers: the logits and every compared site within tol, the same experts chosen, and
    every site of block_sites(layer) compared on each block (and model_sites once)."""
    assert report.max_logit_diff <= tol, report
    compared = {s.site for s in report.sites}
    for layer in range(model.cfg.n_layers):
        for site in block_sites(layer):
            assert f"blocks.{layer}.{site}" in compared, site
    assert set(model_sites) <= compared, set(model_sites) - compared
    for site in report.sites:
        assert site.max_abs_diff <= tol, site
    assert report.index_mismatches == 0


def check_bit_exact(report) -> None:
    """bfloat16 against transformers: the same experts, the logits and every site bit for bit."""
    assert report.index_mismatches == 0
    assert report.max_logit_diff == 0.0, report
    assert all(s.max_abs_diff == 0.0 for s in report.sites), report


def left_padded(seed: int = 5, shape: tuple[int, int] = (3, 9), pads: Iterable[int] = (0, 3, 1)):
    """(token ids, attention mask): row i's first pads[i] positions padding (id 0, mask 0)."""
    toks = tokens(seed, shape)
    mask = torch.ones_like(toks)
    for row, n in enumerate(pads):
        mask[row, :n] = 0
    return toks.masked_fill(mask == 0, 0), mask


def check_greedy_generation(model, ref, prompt: torch.Tensor, mask: torch.Tensor | None = None, new: int = 8) -> None:
    """moelens's greedy generate gives transformers' tokens, eos ignored by both."""
    ref.generation_config.eos_token_id = None
    with torch.no_grad():
        expected = ref.generate(prompt, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)
    got = model.generate(prompt, attention_mask=mask, max_new_tokens=new, stop_at_eos=False, do_sample=False)
    assert got.shape == (prompt.shape[0], prompt.shape[1] + new) and torch.equal(got, expected)


def stored_keys(folder: Path) -> list[str]:
    """The tensor names of a checkpoint, over all its shards."""
    out = []
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            out += list(f.keys())
    return out


def config_json(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def copy_checkpoint(checkpoints: dict[str, Path], tmp_path: Path, variant: str = "base") -> Path:
    return shutil.copytree(checkpoints[variant], tmp_path / variant)


def rewrite_tensors(folder: Path, edit: Callable[[dict], None]) -> None:
    """edit(tensors) on a single-file checkpoint's tensors, written back in place."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
