"""The bytes a checkpoint stores, from config.json alone: each tensor the site map reads, in the stored format
quantization_config describes (moelens.loaders.quantized), summed per moelens parameter.

- fp8 blocks: a linear weight (two or more dims, in a part of the model `quantizable` names: attention, the
  experts, a shared expert, a dense MLP) that modules_to_not_convert does not name is stored as one byte per
  weight and one scale per weight_block_size block of the tensor as stored, the last block of a dimension
  partial (ceil-divided): scale_fmt "ue8m0" one byte each, else `scale_dtype`'s (float32 unless told). As
  transformers' fp8 quantizer chooses: its linear layers, never the embeddings, the head, norms or routers.
- mxfp4: a site map's PackedWeight: half a byte per weight (blocks) and one byte per group of 32 (scales).
- everything else dense: parameters in the stored dtype (config.json's torch_dtype), buffers as the model
  holds them (a router's float32 score-correction bias is stored float32; a float32 router weight is a
  run-time choice, stored in the checkpoint's dtype).

Per-expert tensors are counted as the Hub stores them (each expert's gate, up and down on its own, each with
its own block grid) where the family has that spelling, else fused as its site map says.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moelens.loaders.checkpoint import SplitTarget, expected_keys
from moelens.loaders.quantized import MXFP4_GROUP, Format, Fp8Blocks, ModelOptFp8, Mxfp4, listed_unconverted
from moelens.sitemap import PackedWeight, SiteMap

SCALE_DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class StoredTensor:
    key: str  # the checkpoint key (a quantized one's weight, or a PackedWeight's first key)
    shape: tuple[int, ...]  # dense, as stored (its layout, before moelens's)
    bytes: int  # with its companions: an fp8 weight's scale, a PackedWeight's scales
    values: int  # elements stored, companions included (what the Hub counts as a checkpoint's parameters)
    how: str  # "fp8", "mxfp4", or the dtype it is stored in


def scale_bytes(fmt: Fp8Blocks, scale_dtype: str) -> int:
    if fmt.scale_fmt == "ue8m0":
        return 1  # E8M0 exponents
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"fp8 scale dtype {scale_dtype!r} is not one of {', '.join(SCALE_DTYPES)}")
    return SCALE_DTYPES[scale_dtype]


def fp8_sizes(fmt: Fp8Blocks, shape: tuple[int, ...], scale_dtype: str) -> tuple[int, int]:
    """(bytes, values) of a weight and its scale."""
    scales = math.prod(fmt.scale_shape(shape))
    return math.prod(shape) + scales * scale_bytes(fmt, scale_dtype), math.prod(shape) + scales


def modelopt_fp8_sizes(shape: tuple[int, ...], kv_scale: bool) -> tuple[int, int]:
    """(bytes, values) of a per-tensor fp8 weight with its float32 weight_scale and input_scale (and k_scale /
    v_scale, on k_proj / v_proj of a model with an fp8 K/V cache)."""
    scales = 3 if kv_scale else 2
    return math.prod(shape) + scales * 4, math.prod(shape) + scales


def mxfp4_sizes(key: str, shape: tuple[int, ...]) -> tuple[int, int]:
    """(bytes, values) of blocks [..., rows, cols / 32, 16] and scales [..., rows, cols / 32], both uint8: one
    value per byte."""
    if len(shape) < 2 or shape[-1] % MXFP4_GROUP:
        raise ValueError(
            f"{key}: a weight of shape {shape} cannot be stored as mxfp4, which packs each row in groups of "
            f"{MXFP4_GROUP} (its last dimension must be a multiple of {MXFP4_GROUP})"
        )
    groups = math.prod(shape) // MXFP4_GROUP
    nbytes = groups * MXFP4_GROUP // 2 + groups
    return nbytes, nbytes


def stored_tensors(
    site_map: SiteMap,
    params: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    fmt: Format | None,
    dtype: torch.dtype,
    quantizable: Callable[[str], bool],
    scale_dtype: str = "float32",
) -> dict[str, list[StoredTensor]]:
    """moelens parameter (or buffer) name -> the checkpoint tensors it is read from, with their stored bytes.

    params, buffers: the model's (on the meta device will do); dtype: what the checkpoint stores dense
    parameters in; quantizable(name): whether a parameter is one fp8 quantizes where it is a matrix."""
    packed = {e.keys[0]: e for e in site_map.weights if isinstance(e, PackedWeight)}
    slots = params | buffers
    out: dict[str, list[StoredTensor]] = {}
    for key, target in expected_keys(site_map).items():
        if isinstance(target, SplitTarget):  # each part counts its piece (dense: key_map refuses a quantized one)
            if fmt is not None:
                raise ValueError(
                    f"config.json says quant_method {fmt.method!r}, but {key!r} is read into several parameters "
                    f"({', '.join(target.params)}); a quantized tensor split so is not supported"
                )
            shape = target.stored_shape(slots)
            for part, piece in target.pieces(shape):
                stored = dtype if part.param in params else slots[part.param].dtype
                numel = math.prod(piece)
                nbytes = numel * torch.tensor([], dtype=stored).element_size()
                out.setdefault(part.param, []).append(StoredTensor(key, piece, nbytes, numel, str(stored).removeprefix("torch.")))
            continue
        slot = slots[target.param]
        shape = target.layout.stored_shape(tuple(slot[target.index].shape))
        numel = math.prod(shape)
        if key in packed:
            if not isinstance(fmt, Mxfp4) or fmt.method != packed[key].method:
                said = "has no quantization_config" if fmt is None else f"says quant_method {fmt.method!r}"
                raise ValueError(f"config.json {said}, but {target.param} is stored as {packed[key].method} ({key!r})")
            tensor = StoredTensor(key, shape, *mxfp4_sizes(key, shape), fmt.method)
        elif (
            isinstance(fmt, Fp8Blocks) and len(shape) >= 2 and target.param in params and quantizable(target.param)
            and listed_unconverted(key.removesuffix(".weight"), fmt.not_converted) is None
        ):
            tensor = StoredTensor(key, shape, *fp8_sizes(fmt, shape, scale_dtype), fmt.method)
        elif (
            isinstance(fmt, ModelOptFp8) and len(shape) == 2 and target.param in params and quantizable(target.param)
            and not fmt.is_excluded(key.removesuffix(".weight"))
        ):
            kv_scale = fmt.kv_cache_scales and key.endswith(("k_proj.weight", "v_proj.weight"))
            tensor = StoredTensor(key, shape, *modelopt_fp8_sizes(shape, kv_scale), fmt.method)
        else:
            stored = dtype if target.param in params else slot.dtype
            nbytes = numel * torch.tensor([], dtype=stored).element_size()
            tensor = StoredTensor(key, shape, nbytes, numel, str(stored).removeprefix("torch."))
        out.setdefault(target.param, []).append(tensor)
    uncovered = set(slots) - set(out)
    if uncovered:  # a bug in the site map, not in the config: the loader would refuse it too
        raise RuntimeError(f"the site map reads no checkpoint tensor into {sorted(uncovered)}")
    return out
