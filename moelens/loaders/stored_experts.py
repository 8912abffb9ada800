"""from_pretrained(expert_storage=...): the routed experts kept as the checkpoint stores them.

expert_storage="fp8" / "mxfp4" keeps every mixture layer's routed experts in the checkpoint's own format (fp8
codes with their block scales; MXFP4 blocks with their exponents; gpt-oss's biases in their stored dtype)
and dequantizes each routed expert when a forward uses it, with the load's own function, dtype and layout
(moelens.experts.stored). Which experts a layer holds (all, the offload store's, a rank's) is the caller's;
this module checks that the checkpoint really stores the experts so, and reads layers of them as stored or,
without a storage, dense, through the same ExpertReader that disk offload uses.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from pathlib import Path

import torch

from moelens.experts.spec import ExpertSpec, ExpertTensors
from moelens.experts.stored import StoredExperts
from moelens.loaders.checkpoint import Target, not_finite_count
from moelens.loaders.errors import CheckpointError, CheckpointWarning
from moelens.loaders.expert_reader import ExpertReader, expert_param
from moelens.loaders.quantized import Format
from moelens.loaders.safetensors_files import SafetensorsFiles

STORAGES = ("fp8", "mxfp4")
DENSE = (None, "dense")  # dequantized at load


def parse_expert_storage(value) -> str | None:
    """from_pretrained's expert_storage, checked: None ("dense" is the same) or a stored format's name."""
    if value in DENSE:
        return None
    if value not in STORAGES:
        raise ValueError(
            f"expert_storage must be one of {[*DENSE, *STORAGES]} (None / 'dense': dequantize at load; 'fp8', "
            f"'mxfp4': keep the routed experts as the checkpoint stores them), got {value!r}"
        )
    return value


def check_stored_as(storage: str, fmt: Format | None, keys: dict[str, Target], files: SafetensorsFiles, config_path: Path) -> None:
    """CheckpointError unless config.json's quantization_config is `storage` and every routed expert weight
    (gate, up, down; not the biases, which stay dense) is stored in it."""
    if fmt is None or fmt.method != storage:
        said = "has no quantization_config (its weights are stored dense)" if fmt is None else f"says quant_method {fmt.method!r}"
        raise CheckpointError(
            f"{config_path} {said}: expert_storage={storage!r} keeps routed experts stored as {storage!r}, which this "
            f"checkpoint's are not. Load it with expert_storage=None"
            + ("" if fmt is None else f" (dequantized at load) or expert_storage={fmt.method!r}")
        )
    for key, target in keys.items():
        if expert_param(target, ("W_gate_up", "W_down")) is None:
            continue
        if target.stored is None or target.stored.format.method != storage:
            raise CheckpointError(
                f"{files.location[key].name}: routed expert weight {key!r} is stored as {files.dtypes[key]}, not "
                f"{storage}; expert_storage={storage!r} needs every routed expert weight stored so. Load with "
                "expert_storage=None (dequantized at load)"
            )


class ExpertLayers:
    """Reads routed experts as the model keeps them (spec.storage): one expert's tensors (read: the stored
    tensors, or dense ones in the model's dtype), and stacks of them (StoredExperts or ExpertTensors)."""

    def __init__(self, reader: ExpertReader, spec: ExpertSpec) -> None:
        self.reader, self.spec = reader, spec
        self.stored = spec.storage is not None

    def read(self, layer: int, expert: int) -> tuple[torch.Tensor, ...]:
        return self.reader.read_stored(layer, expert) if self.stored else self.reader.read(layer, expert)

    def read_into(self, layer: int, expert: int, out: tuple[torch.Tensor, ...]) -> None:
        """read(layer, expert), written into `out` (CPU tensors of read's shapes and dtypes)."""
        self.reader.read_into(layer, expert, out, stored=self.stored)

    def stack(self, layer: int, experts: list[tuple[torch.Tensor, ...]]) -> ExpertTensors | StoredExperts:
        """Experts read by `read`, stacked in the given order."""
        if self.stored:
            return StoredExperts.stack(self.spec, self.reader.stored_parts(layer), experts)
        return ExpertTensors.stack(experts)

    def wrap(self, layer: int, tensors: tuple[torch.Tensor, ...]) -> ExpertTensors | StoredExperts:
        """Tensors stacked over experts (an expert axis first, in read's order) as the stack type they are."""
        if self.stored:
            return StoredExperts(self.spec, self.reader.stored_parts(layer), tensors)
        return ExpertTensors(*tensors)

    def layer(self, layer: int, experts: Iterable[int]) -> ExpertTensors | StoredExperts:
        """The experts `experts` of `layer`, stacked (none: empty stacks of the right shapes and dtypes)."""
        ids = list(experts)
        if ids:
            return self.stack(layer, [self.read(layer, e) for e in ids])
        if self.stored:
            return self.stack(layer, [self.read(layer, 0)]).select([])
        return ExpertTensors(*(torch.empty((0, *s[1:]), dtype=self.reader.dtype) for s in self.reader.shapes.values()))


def warn_not_finite(stacks: dict[int, StoredExperts], dtype: torch.dtype, folder: Path) -> None:
    """from_pretrained's check_finite for experts kept stored: each expert dequantized once, one at a time, and
    one CheckpointWarning naming every parameter that holds NaN or Inf values once dequantized into dtype."""
    found: list[str] = []
    for layer, stack in stacks.items():
        for e in range(stack.n_experts):
            for name, t in zip(stack.spec.param_names, stack.select([e]).dequantize(dtype)):
                if bad := not_finite_count(t):
                    nan = int(torch.isnan(t).sum())
                    found.append(f"layer {layer} expert {e} {name}: {nan} NaN and {bad - nan} Inf of {t.numel()} values as {dtype}")
    if found:
        more = f"; and {len(found) - 8} more" if len(found) > 8 else ""
        warnings.warn(
            f"{len(found)} routed expert weight(s) of {folder} hold NaN or Inf values once dequantized: "
            f"{'; '.join(found[:8])}{more} (from_pretrained(check_finite=False) skips this check)",
            CheckpointWarning,
            stacklevel=3,
        )


def stored_layer_bytes(files: SafetensorsFiles, keys: dict[str, Target], layer: int, params: tuple[str, ...]) -> int:
    """Bytes of `layer`'s routed experts as the files store them (from the headers): what holding them costs.
    params: the spec's parameter names."""
    total = 0
    for key, target in keys.items():
        where = expert_param(target, params)
        if where is not None and where[0] == layer:
            for k in target.stored.keys if target.stored else (key,):
                total += torch.Size(files.shapes[k]).numel() * STORED_SIZES[files.dtypes[k]]
    return total


# bytes per element of the dtypes a stored expert tensor may have (safetensors' names)
STORED_SIZES = {"F8_E4M3": 1, "F8_E8M0": 1, "U8": 1, "I8": 1, "BF16": 2, "F16": 2, "F32": 4, "F64": 8}
