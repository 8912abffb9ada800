"""The loader's SplitWeight: one checkpoint tensor whose rows fill several parameters, or several places of one
(moelens.sitemap), read by the key map, the shape check, the fill and moelens plan's stored sizes alike. DBRX's
fused Wqkv and flat experts use it (tests/test_family_dbrx.py); here a toy site map, with the oracle the rows
sliced by hand."""

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from moelens.loaders.checkpoint import SplitTarget, expected_keys, fill, key_map
from moelens.loaders.errors import CheckpointError
from moelens.loaders.safetensors_files import SafetensorsFiles
from moelens.sitemap import Part, SiteMap, SplitWeight, Transposed
from moelens.stored_size import stored_tensors


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Parameter(torch.zeros(4, 3))
        self.k = nn.Parameter(torch.zeros(2, 3))
        self.stack = nn.Parameter(torch.zeros(2, 3, 2))  # two places of one parameter, each stored transposed


SITE_MAP = SiteMap((
    SplitWeight(("qk.weight", "other.qk"), (Part("q", 4), Part("k", 2))),
    SplitWeight(("flat",), tuple(Part("stack", 2, (e,), Transposed()) for e in range(2))),
), ())


def write(folder, **tensors):
    folder.mkdir(exist_ok=True)
    save_file(tensors, folder / "model.safetensors")
    return SafetensorsFiles(folder)


def test_rows_fill_each_part_in_order(tmp_path):
    qk, flat = torch.randn(6, 3), torch.randn(4, 3)
    files = write(tmp_path / "ckpt", **{"other.qk": qk, "flat": flat})
    keys = key_map(SITE_MAP, files)
    assert set(keys) == {"other.qk", "flat"} and isinstance(keys["other.qk"], SplitTarget)  # the spelling found
    model = Toy()
    fill(model, files, keys, progress=False)
    assert torch.equal(model.q, qk[:4]) and torch.equal(model.k, qk[4:])
    assert torch.equal(model.stack[0], flat[:2].T) and torch.equal(model.stack[1], flat[2:].T)


def test_a_wrong_stored_shape_names_the_key_and_every_part(tmp_path):
    files = write(tmp_path / "ckpt", **{"qk.weight": torch.randn(5, 3), "flat": torch.randn(4, 3)})
    with pytest.raises(CheckpointError) as info:
        fill(Toy(), files, key_map(SITE_MAP, files), progress=False)
    for part in ("'qk.weight'", "(5, 3)", "(6, 3)", "q + k"):
        assert part in str(info.value), str(info.value)


def test_a_missing_split_tensor_is_named(tmp_path):
    files = write(tmp_path / "ckpt", **{"qk.weight": torch.randn(6, 3)})
    with pytest.raises(CheckpointError, match="missing 1 tensor.*'flat'"):
        key_map(SITE_MAP, files)


def test_plan_counts_each_part_its_piece():
    model = Toy()
    params = dict(model.named_parameters())
    out = stored_tensors(SITE_MAP, params, {}, None, torch.bfloat16, lambda name: False)
    assert [(t.key, t.shape, t.bytes) for t in out["q"]] == [("qk.weight", (4, 3), 24)]
    assert [(t.key, t.shape) for t in out["k"]] == [("qk.weight", (2, 3))]
    assert [(t.key, t.shape) for t in out["stack"]] == [("flat", (2, 3)), ("flat", (2, 3))]
    assert set(expected_keys(SITE_MAP)) == {"qk.weight", "flat"}  # the first spelling where none is present
