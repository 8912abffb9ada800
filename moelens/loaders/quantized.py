"""Quantized checkpoints: the stored format config.json's quantization_config describes, each quantized tensor
checked from the headers, and the dequantization that turns the stored tensors into the dense one.

Dequantization is transformers' (same ops, same dtypes: float32 products, one cast to the model's dtype), so
that a loaded weight is transformers' dequantized weight bit for bit, with one deliberate difference: an fp8
weight whose rows or columns are not a multiple of the block keeps the format's partial last block, where
transformers' CPU dequantization derives the block from rows // scale_rows and misreads or refuses the shape.

- "fp8" (DeepSeek-V3/R1, Kimi-K2, Qwen3-*-FP8, MiniMax-M2): float8_e4m3fn weights `<key>`, each with a scale
  `<key>_scale_inv` per weight_block_size block (ceil-divided: the last block may be partial), multiplied.
  Which weights are quantized is what the files store: an F8_E4M3 weight needs its scale, anything else is
  read as it is (embeddings, norms, routers, heads stay bfloat16).
- "modelopt" with quant_algo "FP8" (NVIDIA's ModelOpt exports: Nemotron-3 Nano / Super FP8): float8_e4m3fn
  weights `<module>.weight`, each with one float32 `<module>.weight_scale` for the whole tensor (shape [] or [1]),
  multiplied; and `<module>.input_scale` (the static scale of the activations an fp8 engine quantizes), and on
  attention's k_proj / v_proj `k_scale` / `v_scale` (its fp8 K/V cache's): checked, not applied. The model runs
  the dequantized weights on activations in its dtype (what transformers computes on a dequantized copy), not an
  fp8 engine's quantized activations. The quantization_config may also sit in hf_quant_config.json
  ({"quantization": {"quant_algo": ...}}, ModelOpt's older export) where config.json has none.
- "mxfp4" (gpt-oss's routed experts): `<name>_blocks` uint8 [..., rows, groups, 16], two e2m1 values per byte
  (low nibble first), and `<name>_scales` uint8 [..., rows, groups], a power-of-two exponent (bias 127) per
  group of 32. The keys are named by a family's site map (moelens.sitemap.PackedWeight).
"""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from jaxtyping import Float, UInt8

from moelens.loaders.errors import CheckpointError
from moelens.loaders.files import brief
from moelens.loaders.safetensors_files import SafetensorsFiles

SUPPORTED = {
    "fp8": "block-scaled float8_e4m3fn weights with weight_scale_inv (DeepSeek-V3, Qwen3-FP8, MiniMax-M2)",
    "modelopt": "ModelOpt quant_algo FP8: per-tensor float8_e4m3fn weights with weight_scale (Nemotron-3 FP8)",
    "mxfp4": "MXFP4 _blocks / _scales (gpt-oss's routed experts)",
}
MODELOPT_QUANT_CONFIG = "hf_quant_config.json"  # ModelOpt's own file beside config.json
# safetensors' dtype names
FP8_WEIGHT = "F8_E4M3"
FLOAT_SCALES = ("F32", "BF16", "F16")
E8M0_SCALES = ("F8_E8M0",)  # the dtype says what it is; uint8 exponents only where scale_fmt says "ue8m0"
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_GROUP = 32
# Tables computed once on the CPU with transformers' own ops and indexed on any device, so that a tensor
# dequantized on a GPU has the CPU's bits: 2 ** (byte - 127) of every E8M0 byte (its exp2: 0 gives the
# subnormal 2 ** -127, 255 overflows to inf), and every MXFP4 value [scale byte, e2m1 nibble] (its ldexp,
# exact: 0.5 * 2 ** 128 is 2 ** 127, 0 stays 0)
E8M0_POWERS = (torch.arange(256, dtype=torch.float32) - 127.0).exp2()
MXFP4_VALUES = torch.ldexp(
    torch.tensor(FP4_E2M1).repeat(256, 1), (torch.arange(256, dtype=torch.int32)[:, None] - 127).expand(256, len(FP4_E2M1))
)


def _supported() -> str:
    return "; ".join(f"{method!r}: {what}" for method, what in SUPPORTED.items())


def not_converted(config_path: Path, qc: dict) -> tuple[str, ...]:
    value = qc.get("modules_to_not_convert")
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise CheckpointError(
            f"{config_path}: quantization_config.modules_to_not_convert = {brief(value)}; expected a list of module names"
        )
    for pattern in value:  # transformers matches each entry as a regular expression (and fails on a bad one)
        try:
            re.compile(rf"(?:{pattern})")
        except re.error as err:
            raise CheckpointError(
                f"{config_path}: quantization_config.modules_to_not_convert entry {brief(pattern)} is not a valid "
                f"regular expression ({err}); each entry is matched as one, as transformers matches it"
            ) from err
    return tuple(value)


def listed_unconverted(module: str, patterns: tuple[str, ...]) -> str | None:
    """The modules_to_not_convert entry naming `module`, matched as transformers matches it (a prefix ending at a
    module boundary, a regex with that boundary, or a suffix), else None."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    for pattern in patterns:  # valid regular expressions: not_converted() checked them
        if re.match(rf"(?:{pattern}){boundary}", module) or module.endswith(pattern):
            return pattern
    return None


def refuse_if_listed(where: str, key: str, stored_as: str, modules: tuple[str, ...], patterns: tuple[str, ...]) -> None:
    """A CheckpointError where modules_to_not_convert names one of `modules` (the quantized tensor `key`'s) as
    not quantized, though `where` stores it quantized."""
    for module in modules:
        listed = listed_unconverted(module, patterns)
        if listed is not None:
            raise CheckpointError(
                f"{where}: {key!r} is stored as {stored_as}, but config.json's modules_to_not_convert lists "
                f"{listed!r}, which names {module!r} as not quantized"
            )


@dataclass(frozen=True)
class Fp8Blocks:
    """quant_method "fp8": float8_e4m3fn weights scaled per block by `<key>_scale_inv` (float32, bfloat16 or
    float16 as stored; E8M0 exponents with scale_fmt "ue8m0"). block: (rows, columns) of weight_block_size."""

    block: tuple[int, int]
    scale_fmt: str = "float"
    not_converted: tuple[str, ...] = ()
    method: ClassVar[str] = "fp8"

    @staticmethod
    def scale_key(key: str) -> str:
        """transformers' naming: `x.weight` -> `x.weight_scale_inv`, a fused `x.gate_up_proj` -> `x.gate_up_proj_scale_inv`."""
        return key + "_scale_inv"

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """One scale per block, the last block of a dimension partial where the block does not divide it."""
        return (*shape[:-2], -(-shape[-2] // self.block[0]), -(-shape[-1] // self.block[1]))

    def scale_dtypes(self) -> tuple[str, ...]:
        return FLOAT_SCALES + E8M0_SCALES + (("U8",) if self.scale_fmt == "ue8m0" else ())

    def stored(self, key: str, files: SafetensorsFiles) -> Stored | None:
        """How `key` is stored: None for a dense tensor; the weight and its scale for an fp8 one. Checks the
        headers: an fp8 weight has a scale of the block grid's shape and a supported dtype, a scale belongs to
        an fp8 weight, and no module listed in modules_to_not_convert is stored quantized."""
        scale = self.scale_key(key)
        where = files.location[key].name
        if files.dtypes[key] != FP8_WEIGHT:
            if scale in files:
                raise CheckpointError(
                    f"{files.location[scale].name}: {scale!r} scales {key!r}, which {where} stores as "
                    f"{files.dtypes[key]}, not {FP8_WEIGHT} (quant_method 'fp8' scales float8_e4m3fn weights only)"
                )
            return None
        refuse_if_listed(where, key, FP8_WEIGHT, (key.removesuffix(".weight"),), self.not_converted)
        if scale not in files:
            raise CheckpointError(
                f"{where}: {key!r} is stored as {FP8_WEIGHT} but its scale {scale!r} is in no file of {files.folder} "
                f"(quant_method 'fp8' needs one scale per {self.block[0]}x{self.block[1]} block)"
            )
        shape, scale_shape = files.shapes[key], files.shapes[scale]
        if len(shape) < 2 or scale_shape != self.scale_shape(shape):
            expected = f"{self.scale_shape(shape)}" if len(shape) >= 2 else "none (a float8 weight must have 2 or more dims)"
            raise CheckpointError(
                f"{files.location[scale].name}: scale {scale!r} has shape {scale_shape}, but weight {key!r} in {where} "
                f"has shape {shape}, whose {self.block[0]}x{self.block[1]} blocks (weight_block_size, the last one "
                f"partial) need scale shape {expected}"
            )
        if files.dtypes[scale] not in self.scale_dtypes():
            raise CheckpointError(
                f"{files.location[scale].name}: scale {scale!r} is stored as {files.dtypes[scale]}; expected one of "
                f"{', '.join(self.scale_dtypes())} (uint8 E8M0 exponents need scale_fmt 'ue8m0' in quantization_config)"
            )
        return Stored((key, scale), self, shape)

    def dequantize(
        self, weight: Float[torch.Tensor, "*lead rows cols"], scale: torch.Tensor, dtype: torch.dtype
    ) -> Float[torch.Tensor, "*lead rows cols"]:
        return dequantize_fp8_blocks(weight, scale, self.block, dtype)

    def tile_parts(
        self, weight: torch.Tensor, scale: torch.Tensor
    ) -> tuple[UInt8[torch.Tensor, "*lead rows cols"], Float[torch.Tensor, "*lead row_blocks col_blocks"], tuple[int, int]]:
        """The stored tensors as kernels read them to dequantize in their tiles (moelens.kernels.stored_operands):
        the codes' bytes (a view), the scales as float32 (scales_as_float32, exact: what dequantize multiplies
        by), and the block."""
        return weight.view(torch.uint8), scales_as_float32(scale), self.block


@dataclass(frozen=True)
class ModelOptFp8:
    """quant_method "modelopt", quant_algo "FP8": float8_e4m3fn weights `<module>.weight` scaled by one float
    `<module>.weight_scale` each; `<module>.input_scale` and the K/V cache's `k_proj.k_scale` / `v_proj.v_scale`
    checked and kept out of the math (see the module's docstring). excluded: exclude_modules' patterns (fnmatch
    wildcards, as ModelOpt writes them), modules that must not be stored in fp8."""

    excluded: tuple[str, ...] = ()
    kv_cache_scales: bool = False  # kv_cache_quant_algo "FP8": k_proj / v_proj carry k_scale / v_scale
    method: ClassVar[str] = "modelopt"
    SCALAR_SHAPES: ClassVar[tuple[tuple[int, ...], ...]] = ((), (1,))
    # companions not applied: the activations' static scale, the fp8 K/V cache's scales (on k_proj / v_proj)
    UNAPPLIED: ClassVar[tuple[str, ...]] = ("input_scale", "k_scale", "v_scale")

    def is_excluded(self, module: str) -> str | None:
        """The exclude_modules pattern matching `module` (a wildcard pattern, as ModelOpt writes them), else None."""
        return next((p for p in self.excluded if fnmatch.fnmatchcase(module, p)), None)

    def stored(self, key: str, files: SafetensorsFiles) -> Stored | None:
        """How `key` is stored: None for a dense tensor; the weight with its scale (and the unapplied scales
        beside it) for an fp8 one. Checks the headers: an fp8 weight is a `.weight` with a scalar float scale,
        every scale beside it is a scalar float, a scale belongs to an fp8 weight, and no excluded module is fp8."""
        module = key.removesuffix(".weight")
        scale, where = f"{module}.weight_scale", files.location[key].name
        beside = [f"{module}.{name}" for name in self.UNAPPLIED if f"{module}.{name}" in files]
        if files.dtypes[key] != FP8_WEIGHT:
            for companion in [scale, *beside] if scale in files else beside:
                raise CheckpointError(
                    f"{files.location[companion].name}: {companion!r} scales {key!r}, which {where} stores as "
                    f"{files.dtypes[key]}, not {FP8_WEIGHT} (ModelOpt FP8 scales float8_e4m3fn weights only)"
                )
            return None
        if not key.endswith(".weight"):
            raise CheckpointError(
                f"{where}: {key!r} is stored as {FP8_WEIGHT}; ModelOpt FP8 stores a module's `.weight` so, with its "
                "`.weight_scale` beside it"
            )
        listed = self.is_excluded(module)
        if listed is not None:
            raise CheckpointError(
                f"{where}: {key!r} is stored as {FP8_WEIGHT}, but quantization_config.exclude_modules lists "
                f"{listed!r}, which names {module!r} as not quantized"
            )
        if scale not in files:
            raise CheckpointError(
                f"{where}: {key!r} is stored as {FP8_WEIGHT} but its scale {scale!r} is in no file of {files.folder} "
                "(ModelOpt FP8 needs one float32 weight_scale per weight)"
            )
        for companion in (scale, *beside):
            if files.shapes[companion] not in self.SCALAR_SHAPES or files.dtypes[companion] not in FLOAT_SCALES:
                raise CheckpointError(
                    f"{files.location[companion].name}: scale {companion!r} is {files.dtypes[companion]} of shape "
                    f"{files.shapes[companion]}; ModelOpt FP8 (per-tensor) stores one float per tensor: shape [] or "
                    f"[1], one of {', '.join(FLOAT_SCALES)}"
                )
        if len(files.shapes[key]) != 2:
            raise CheckpointError(
                f"{where}: fp8 weight {key!r} has shape {files.shapes[key]}; ModelOpt FP8 stores [out, in] matrices"
            )
        return Stored((key, scale, *beside), self, files.shapes[key])

    def dequantize(
        self, weight: Float[torch.Tensor, "rows cols"], scale: torch.Tensor, *unapplied: torch.Tensor, dtype: torch.dtype
    ) -> Float[torch.Tensor, "rows cols"]:
        return dequantize_fp8_per_tensor(weight, scale, dtype)


@dataclass(frozen=True)
class Mxfp4:
    """quant_method "mxfp4": see dequantize_mxfp4. The stored keys are a site map's PackedWeight."""

    not_converted: tuple[str, ...] = ()
    method: ClassVar[str] = "mxfp4"

    def packed(self, keys: tuple[str, ...], files: SafetensorsFiles) -> Stored:
        """The (blocks, scales) pair `keys` checked from the headers; its dense shape [..., rows, groups * 32]."""
        if len(keys) != 2:
            raise ValueError(f"an mxfp4 weight is stored as (blocks, scales); the site map names {keys}")
        blocks, scales = keys
        for key, dtype in ((blocks, "U8"), (scales, "U8")):
            if files.dtypes[key] != dtype:
                raise CheckpointError(
                    f"{files.location[key].name}: {key!r} is stored as {files.dtypes[key]}; mxfp4 stores it as {dtype}"
                )
        # the weight (x.gate_up_proj) and the module holding it (x, transformers' experts module, which its
        # MXFP4 conversion replaces)
        weight = blocks.removesuffix("_blocks")
        refuse_if_listed(files.location[blocks].name, blocks, "MXFP4 blocks", (weight, weight.rpartition(".")[0]), self.not_converted)
        shape, scale_shape = files.shapes[blocks], files.shapes[scales]
        if len(shape) < 3 or shape[-1] != MXFP4_GROUP // 2 or scale_shape != shape[:-1]:
            raise CheckpointError(
                f"{files.location[scales].name}: scales {scales!r} have shape {scale_shape}, blocks {blocks!r} in "
                f"{files.location[blocks].name} have shape {shape}; mxfp4 needs blocks [..., rows, groups, "
                f"{MXFP4_GROUP // 2}] and scales [..., rows, groups]"
            )
        return Stored(keys, self, (*shape[:-2], shape[-2] * MXFP4_GROUP))

    def dequantize(
        self, blocks: UInt8[torch.Tensor, "*lead rows groups 16"], scales: UInt8[torch.Tensor, "*lead rows groups"], dtype: torch.dtype
    ) -> Float[torch.Tensor, "*lead rows cols"]:
        return dequantize_mxfp4(blocks, scales, dtype)

    def tile_parts(
        self, blocks: UInt8[torch.Tensor, "*lead rows groups 16"], scales: UInt8[torch.Tensor, "*lead rows groups"]
    ) -> tuple[UInt8[torch.Tensor, "*lead rows half_cols"], UInt8[torch.Tensor, "*lead rows groups"], tuple[int, int]]:
        """The stored tensors as kernels read them to dequantize in their tiles (moelens.kernels.stored_operands):
        each row's bytes (column c in byte c // 2, low nibble first), the E8M0 exponent bytes as stored, and the
        block one exponent covers: 1 row x 32 columns."""
        return blocks.flatten(-2), scales, (1, MXFP4_GROUP)


Format = Fp8Blocks | ModelOptFp8 | Mxfp4


@dataclass(frozen=True)
class Stored:
    """A checkpoint tensor stored quantized: the tensors that hold it (the first is the key the key map
    names, the rest its companions), its format, and the dense tensor's shape. `format.dequantize(*tensors,
    dtype)` makes the dense tensor; kept per key so that a caller may also keep the stored tensors as they are."""

    keys: tuple[str, ...]
    format: Format
    shape: tuple[int, ...]

    def dequantize(self, tensors: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.format.dequantize(*tensors, dtype=dtype)


def stored_format(hf: dict, config_path: Path) -> Format | None:
    """The stored format config.json's quantization_config describes (None: unquantized), checked."""
    qc = hf.get("quantization_config")
    if qc is None:
        return _modelopt_file(config_path.parent / MODELOPT_QUANT_CONFIG)
    if not isinstance(qc, dict):
        raise CheckpointError(f"{config_path}: quantization_config = {brief(qc)}; expected an object")
    method = qc.get("quant_method")
    if method not in SUPPORTED:
        raise CheckpointError(
            f"{config_path}: quantization_config.quant_method = {brief(method)} is not supported; moelens "
            f"dequantizes at load {_supported()}. Use an unquantized (e.g. bfloat16) copy of the checkpoint"
        )
    if method == "mxfp4":
        return Mxfp4(not_converted(config_path, qc))
    if method == "modelopt":
        return _modelopt(config_path, qc)
    return _fp8(config_path, qc)


def _modelopt_file(path: Path) -> ModelOptFp8 | None:
    """ModelOpt's hf_quant_config.json ({"quantization": {...}}) where config.json has no quantization_config."""
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: not readable as JSON ({err})") from err
    qc = raw.get("quantization") if isinstance(raw, dict) else None
    if not isinstance(qc, dict):
        raise CheckpointError(f"{path}: expected an object with a 'quantization' object (ModelOpt's export), got {brief(raw)}")
    return _modelopt(path, qc, field="quantization")


def _modelopt(config_path: Path, qc: dict, field: str = "quantization_config") -> ModelOptFp8:
    algo = qc.get("quant_algo")
    if algo != "FP8":
        raise CheckpointError(
            f"{config_path}: {field}.quant_algo = {brief(algo)}; moelens reads ModelOpt's 'FP8' (per-tensor "
            "float8_e4m3fn weights with weight_scale) only"
        )
    kv = qc.get("kv_cache_quant_algo")
    if kv not in (None, "FP8"):
        raise CheckpointError(f"{config_path}: {field}.kv_cache_quant_algo = {brief(kv)}; expected null or 'FP8'")
    excluded = qc.get("exclude_modules", qc.get("ignore")) or []
    if not isinstance(excluded, list) or not all(isinstance(p, str) for p in excluded):
        raise CheckpointError(
            f"{config_path}: {field}.exclude_modules = {brief(excluded)}; expected a list of module names or wildcards"
        )
    return ModelOptFp8(tuple(excluded), kv == "FP8")


def _fp8(config_path: Path, qc: dict) -> Fp8Blocks:
    block = qc.get("weight_block_size")
    if not (
        isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        what = "is missing" if "weight_block_size" not in qc else f"= {brief(block)}"
        raise CheckpointError(
            f"{config_path}: quantization_config.weight_block_size {what}; quant_method 'fp8' needs [rows, columns] of "
            "each scale's block, two positive integers (e.g. [128, 128]); per-tensor fp8 is not supported"
        )
    checks = {  # field -> values that mean the format moelens reads
        "fmt": (None, "e4m3", "float8_e4m3fn"),  # DeepSeek writes e4m3, MiniMax-M2 float8_e4m3fn: the same format
        "activation_scheme": (None, "dynamic"),  # static stores activation scales that dequantizing would drop
        "scale_fmt": (None, "float", "ue8m0"),
        "expert_dtype": (None, "fp8"),  # "fp4": experts packed two per byte, another format
    }
    for field, fine in checks.items():
        if qc.get(field) not in fine:
            raise CheckpointError(
                f"{config_path}: quantization_config.{field} = {brief(qc.get(field))}; moelens reads quant_method 'fp8' "
                f"with {field} in {[f for f in fine if f is not None]}"
            )
    return Fp8Blocks((block[0], block[1]), qc.get("scale_fmt") or "float", not_converted(config_path, qc))


def scales_as_float32(scale: torch.Tensor) -> torch.Tensor:
    """A stored scale as float32, exactly: float types are widened; E8M0 (float8_e8m0fnu, or uint8 exponents
    as transformers reads them: 2 ** (byte - 127), 255 giving inf) become their powers of two."""
    if scale.dtype == torch.uint8:
        return E8M0_POWERS.to(scale.device)[scale.long()]
    if not scale.dtype.is_floating_point:
        raise ValueError(f"a scale must be a float tensor or uint8 E8M0 exponents, got {scale.dtype}")
    return scale.to(torch.float32)


def dequantize_fp8_blocks(
    weight: Float[torch.Tensor, "*lead rows cols"],
    scale: Float[torch.Tensor, "*lead row_blocks col_blocks"],
    block: tuple[int, int],
    dtype: torch.dtype,
) -> Float[torch.Tensor, "*lead rows cols"]:
    """weight * scale of its block, as float32 products cast once to dtype (transformers' op order, so the
    same bits). Block (i, j) covers rows [i*block[0], (i+1)*block[0]) and columns likewise, cropped to the
    weight: the last block of a dimension the block size does not divide is partial.

    The product is exact in float32 for bfloat16 and float16 scales (4 + 11 significant bits at most) and
    rounded once for float32 scales; dtype's cast rounds it once more. One leading index at a time, so that
    a fused expert stack needs float32 room for one expert only."""
    rows, cols = weight.shape[-2:]
    expected = (*weight.shape[:-2], -(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale.shape) != expected:
        raise ValueError(f"fp8 weight {tuple(weight.shape)} with {block[0]}x{block[1]} blocks needs scale {expected}, got {tuple(scale.shape)}")
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8 blocks dequantize float8_e4m3fn weights, got {weight.dtype}")
    out = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    if weight.dim() > 2:
        for i in range(weight.shape[0]):
            out[i] = dequantize_fp8_blocks(weight[i], scale[i], block, dtype)
        return out
    s = scales_as_float32(scale).repeat_interleave(block[0], dim=0)[:rows]  # [rows, col_blocks]
    full = cols // block[1]
    w = weight.to(torch.float32)
    if full:
        out[:, : full * block[1]] = (w[:, : full * block[1]].unflatten(-1, (full, block[1])) * s[:, :full, None]).flatten(-2)
    if full * block[1] < cols:
        out[:, full * block[1] :] = w[:, full * block[1] :] * s[:, full:]
    return out


def dequantize_fp8_per_tensor(
    weight: Float[torch.Tensor, "rows cols"], scale: torch.Tensor, dtype: torch.dtype
) -> Float[torch.Tensor, "rows cols"]:
    """weight * its one scale, as float32 products cast once to dtype (the float32 product rounds once for a
    float32 scale; dtype's cast once more)."""
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8 per-tensor dequantizes float8_e4m3fn weights, got {weight.dtype}")
    if scale.numel() != 1:
        raise ValueError(f"fp8 per-tensor needs one scale, got shape {tuple(scale.shape)}")
    return (weight.to(torch.float32) * scales_as_float32(scale).reshape(())).to(dtype)


def dequantize_mxfp4(
    blocks: UInt8[torch.Tensor, "*lead rows groups 16"],
    scales: UInt8[torch.Tensor, "*lead rows groups"],
    dtype: torch.dtype,
) -> Float[torch.Tensor, "*lead rows cols"]:
    """MXFP4 to dense, in the stored layout: value 2k of a group is byte k's low nibble, 2k+1 its high nibble
    (e2m1: FP4_E2M1[nibble]), times 2 ** (scale - 127) of its group of 32; cols = groups * 32.

    transformers' convert_moe_packed_tensors gives the same values, bit for bit, transposed to [E, cols,
    rows] (its gpt-oss layout): torch.ldexp(e2m1 value, scale - 127) in float32, one cast to dtype. A scale
    byte of 255 (NaN in E8M0) is read as 2 ** 128 there and here (6.0 overflows to inf, which the load's
    finite check reports)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"mxfp4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 3 or blocks.shape[-1] != MXFP4_GROUP // 2 or scales.shape != blocks.shape[:-1]:
        raise ValueError(f"mxfp4 needs blocks [..., rows, groups, 16] and scales [..., rows, groups], got {tuple(blocks.shape)} and {tuple(scales.shape)}")
    *lead, rows, groups, _ = blocks.shape
    out = torch.empty((*lead, rows, groups * MXFP4_GROUP), dtype=dtype, device=blocks.device)
    if lead:
        for i in range(blocks.shape[0]):
            out[i] = dequantize_mxfp4(blocks[i], scales[i], dtype)
        return out
    table = MXFP4_VALUES.to(blocks.device).flatten()
    row = scales.long()[..., None] * len(FP4_E2M1)  # [rows, groups, 1]: the scale's row of the table
    values = torch.stack([table[row + (blocks & 0x0F).long()], table[row + (blocks >> 4).long()]], dim=-1)
    out.copy_(values.reshape(rows, groups * MXFP4_GROUP))
    return out
