"""One routed expert's weights, read from the checkpoint's files when it is needed (expert_offload="disk").

Reads only that expert's bytes: a per-expert tensor whole, or row e of a fused [E, ...] tensor through a
safetensors slice (a quantized one with its scales, dequantized). Each read opens and closes its file, so no mapped page of the checkpoint stays in the
process between reads.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from safetensors import safe_open

from moelens.loaders.checkpoint import Target
from moelens.loaders.safetensors_files import SafetensorsFiles

EXPERT_PARAMS = ("W_gate_up", "W_down")


def expert_param(target: Target) -> tuple[int, str] | None:
    """(layer, "W_gate_up" | "W_down") when a key fills a routed expert stack, else None."""
    parts = target.param.split(".")  # blocks.L.mlp.experts.W_...
    if len(parts) == 5 and parts[2:4] == ["mlp", "experts"] and parts[4] in EXPERT_PARAMS:
        return int(parts[1]), parts[4]
    return None


class ExpertReader:
    def __init__(self, files: SafetensorsFiles, keys: dict[str, Target], shapes: dict[tuple[int, str], tuple[int, ...]], dtype: torch.dtype) -> None:
        """shapes: (layer, param) -> the stacked parameter's shape [E, ...]."""
        self.files, self.shapes, self.dtype = files, shapes, dtype
        self.sources: dict[tuple[int, str], list[tuple[str, Target]]] = defaultdict(list)
        for key, target in keys.items():
            where = expert_param(target)
            if where is not None:
                self.sources[where].append((key, target))

    def read(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2I, H], down [H, I]) of one expert, in the model's dtype, on the CPU (a quantized
        checkpoint's expert dequantized from its stored tensors: row `expert` of each, where fused)."""
        out = {param: torch.empty(self.shapes[layer, param][1:], dtype=self.dtype) for param in EXPERT_PARAMS}
        wanted = [
            (key, param, target)
            for param in EXPERT_PARAMS
            for key, target in self.sources[layer, param]
            if target.index == () or target.index[0] == expert
        ]
        sliced: dict[str, bool] = {}  # every stored tensor to read -> whether it is a fused stack's (read row `expert`)
        for key, _, target in wanted:
            sliced.update({k: target.index == () for k in (target.stored.keys if target.stored else (key,))})
        by_file: dict = defaultdict(list)
        for key in sliced:
            by_file[self.files.location[key]].append(key)
        tensors: dict[str, torch.Tensor] = {}
        for path, keys in by_file.items():
            with safe_open(path, framework="pt") as f:
                for key in keys:
                    tensors[key] = f.get_slice(key)[expert] if sliced[key] else f.get_tensor(key)
        for key, param, target in wanted:
            if target.stored is None:
                tensor = tensors[key]
            else:
                tensor = target.stored.dequantize(tuple(tensors[k] for k in target.stored.keys), self.dtype)
            out[param][target.index[1:]].copy_(tensor)
        return out["W_gate_up"], out["W_down"]
