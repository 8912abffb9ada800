"""One routed expert's weights, read from the checkpoint's files when it is needed (expert_offload="disk").

Reads only that expert's bytes: a per-expert tensor whole, or row e of a fused [E, ...] tensor through a
safetensors slice. Each read opens and closes its file, so no mapped page of the checkpoint stays in the
process between reads.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from safetensors import safe_open

from moelens.loaders.checkpoint import Target
from moelens.loaders.safetensors_files import SafetensorsFiles



def expert_param(target: Target, params: tuple[str, ...]) -> tuple[int, str] | None:
    """(layer, parameter name) when a key fills one of a routed expert stack's `params`, else None."""
    parts = target.param.split(".")  # blocks.L.mlp.experts.W_...
    if len(parts) == 5 and parts[2:4] == ["mlp", "experts"] and parts[4] in params:
        return int(parts[1]), parts[4]
    return None


class ExpertReader:
    def __init__(
        self, files: SafetensorsFiles, keys: dict[str, Target], shapes: dict[str, tuple[int, ...]], dtype: torch.dtype
    ) -> None:
        """shapes: the experts' stacked parameters' names and shapes [E, ...], in parameter order
        (ExpertSpec.shapes()), the same in every mixture layer."""
        self.files, self.shapes, self.dtype = files, shapes, dtype
        self.params = tuple(shapes)
        self.sources: dict[tuple[int, str], list[tuple[str, Target]]] = defaultdict(list)
        for key, target in keys.items():
            where = expert_param(target, self.params)
            if where is not None:
                self.sources[where].append((key, target))

    def read(self, layer: int, expert: int) -> tuple[torch.Tensor, ...]:
        """One expert's tensors (gate_up [2I, H], down [H, I], biases where the spec has them), in the model's
        dtype, on the CPU."""
        out = {param: torch.empty(self.shapes[param][1:], dtype=self.dtype) for param in self.params}
        by_file: dict = defaultdict(list)
        for param in self.params:
            for key, target in self.sources[layer, param]:
                fused = target.index == ()
                if fused or target.index[0] == expert:
                    by_file[self.files.location[key]].append((key, param, fused, target.index[1:], target.layout))
        for path, reads in by_file.items():
            with safe_open(path, framework="pt") as f:
                for key, param, fused, rows, layout in reads:
                    tensor = f.get_slice(key)[expert] if fused else f.get_tensor(key)
                    out[param][rows].copy_(layout.load(tensor))
        return tuple(out[param] for param in self.params)
