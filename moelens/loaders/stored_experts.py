"""from_pretrained(expert_storage=...): the routed experts kept as the checkpoint stores them.

expert_storage="fp8" / "mxfp4" keeps every mixture layer's routed experts in the checkpoint's own format (fp8
codes with their block scales; MXFP4 blocks with their exponents; gpt-oss's biases in their stored dtype)
and dequantizes each routed expert when a forward uses it, with the load's own function, dtype and layout
(moelens.experts.stored). Which experts a layer holds (all, the offload store's, a rank's) is the caller's;
this module checks that the checkpoint really stores the experts so, and reads layers of them as stored or,
without a storage, dense, through the same ExpertReader that disk offload uses.
"""

from __future__ import annotations

import threading
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
    tensors, or dense ones in the model's dtype), and stacks of them (StoredExperts or ExpertTensors).

    check_finite (from_pretrained's): every expert is checked for NaN and Inf values the first time it is read
    (stored ones once dequantized into the model's dtype), wherever it is read for (a rank's shard, host
    memory, or a disk-offloaded layer's cache slot), as fill() checks the tensors it reads. What is found is
    warned about, with fill()'s wording, by warn_found(): once for everything read at load, then, after
    warn_each_read is set, as each expert is first read (a disk-offloaded expert, when first routed to)."""

    def __init__(self, reader: ExpertReader, spec: ExpertSpec, check_finite: bool = False) -> None:
        self.reader, self.spec = reader, spec
        self.stored = spec.storage is not None
        self.check_finite, self.warn_each_read = check_finite, False
        self.found: list[str] = []  # NaN / Inf found and not yet warned about
        self._checked: set[tuple[int, int]] = set()
        self._lock = threading.Lock()  # the prefetch thread reads too

    def read(self, layer: int, expert: int) -> tuple[torch.Tensor, ...]:
        tensors = self.reader.read_stored(layer, expert) if self.stored else self.reader.read(layer, expert)
        self._check(layer, expert, tensors)
        return tensors

    def read_into(self, layer: int, expert: int, out: tuple[torch.Tensor, ...]) -> None:
        """read(layer, expert), written into `out` (CPU tensors of read's shapes and dtypes)."""
        self.reader.read_into(layer, expert, out, stored=self.stored)
        self._check(layer, expert, out)

    def _check(self, layer: int, expert: int, tensors: tuple[torch.Tensor, ...]) -> None:
        if not self.check_finite:
            return
        with self._lock:
            if (layer, expert) in self._checked:
                return
            self._checked.add((layer, expert))
        found = self._not_finite(layer, expert, tensors)
        with self._lock:
            self.found += found
        if self.warn_each_read:
            self.warn_found()

    def _not_finite(self, layer: int, expert: int, tensors: tuple[torch.Tensor, ...]) -> list[str]:
        """fill()'s description of each NaN / Inf holding tensor: per checkpoint key for dense experts, per
        parameter once dequantized for stored ones (warn_not_finite's)."""
        if self.stored:
            dense = StoredExperts.stack(self.spec, self.reader.stored_parts(layer), [tensors]).dequantize(self.reader.dtype)
            named = [(f"layer {layer} expert {expert} {name}", t) for name, t in zip(self.spec.param_names, dense.expert(0))]
        else:
            params = dict(zip(self.reader.params, tensors))
            named = [
                (f"{key!r} in {self.reader.files.location[key].name}" + (f" (expert {expert})" if target.index == () else ""),
                 params[param][target.index[1:]])
                for key, param, target in self.reader.pieces_of(layer, expert)
            ]
        return [describe_not_finite(what, t) for what, t in named if not_finite_count(t)]

    def warn_found(self) -> None:
        """One CheckpointWarning about everything found since the last call (none: nothing found)."""
        with self._lock:
            found, self.found = self.found, []
        if found:
            what = "routed expert weight(s)" if self.stored else "tensor(s)"
            warn_not_finite(found, what, self.reader.files.folder, once_dequantized=self.stored)

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
            return self.stack(layer, [self.reader.read_stored(layer, 0)]).select([])
        return ExpertTensors(*(torch.empty((0, *s[1:]), dtype=self.reader.dtype) for s in self.reader.shapes.values()))


def describe_not_finite(what: str, t: torch.Tensor) -> str:
    bad, nan = not_finite_count(t), int(torch.isnan(t).sum())
    return f"{what}: {nan} NaN and {bad - nan} Inf of {t.numel()} values as {t.dtype}"


def warn_not_finite(found: list[str], what: str, folder: Path, once_dequantized: bool = False) -> None:
    """from_pretrained's check_finite warning (fill()'s wording): `found` (describe_not_finite's), the first 8."""
    more = f"; and {len(found) - 8} more" if len(found) > 8 else ""
    warnings.warn(
        f"{len(found)} {what} of {folder} hold NaN or Inf values{' once dequantized' if once_dequantized else ''}: "
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
