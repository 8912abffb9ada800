"""Site maps: for one model, where each parameter comes from in a checkpoint and which transformers module
computes the tensor each hook holds.

Each family writes its site map once (models/<family>.py); the loader's key map, `verify`'s reference
sites and `support()`'s reference column are all read from it, so that no other code spells a checkpoint
key or a transformers module path. Entries are for one concrete model (layer numbers filled in), so a
dense block simply has no router entry.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Weight:
    """A moelens parameter (or buffer) read whole from one checkpoint tensor.

    keys: the spellings of that tensor, tried in order (the Hub's and transformers' may differ).
    required=False: absent is allowed, the parameter is then left as the model built it (a tied head)."""

    param: str
    keys: tuple[str, ...]
    required: bool = True


@dataclass(frozen=True)
class PackedWeight:
    """A moelens parameter stored as several checkpoint tensors that a quantized format combines into it
    (gpt-oss's MXFP4 experts: `<name>_blocks`, `<name>_scales`). keys: the stored tensors in the format's
    order; method: the quant_method whose dequantization makes the parameter (moelens.loaders.quantized), which
    config.json's quantization_config must name."""

    param: str
    keys: tuple[str, ...]
    method: str


@dataclass(frozen=True)
class PerExpertKeys:
    """One spelling of the routed experts as separate tensors; "{e}" stands for the expert's index."""

    gate: str
    up: str
    down: str


@dataclass(frozen=True)
class ExpertStack:
    """The routed experts of one layer: moelens stacks them as W_gate_up [E, 2*d_expert, d_model] (gate rows
    first) and W_down [E, d_model, d_expert]. Read from per-expert tensors (any of `per_expert`'s spellings)
    or from transformers 5's fused pair (`fused_gate_up` [E, 2*d_expert, d_model], `fused_down`)."""

    prefix: str  # moelens module, e.g. "blocks.3.mlp.experts"
    n_experts: int
    d_expert: int
    per_expert: tuple[PerExpertKeys, ...]
    fused_gate_up: str
    fused_down: str

    @property
    def params(self) -> tuple[str, str]:
        return f"{self.prefix}.W_gate_up", f"{self.prefix}.W_down"


@dataclass(frozen=True)
class Reference:
    """The transformers module whose input or output a moelens hook equals.

    read: "in" (first input), "out", "out.N" (N-th output), or "out.heads_first" (an output laid out
    [batch head pos d_head], which moelens lays out [batch pos head d_head])."""

    hook: str
    module: str  # path from the transformers model's root, e.g. "model.layers.3.mlp.gate"
    read: str = "out"


@dataclass(frozen=True)
class SiteMap:
    weights: tuple[Weight | ExpertStack | PackedWeight, ...]
    references: tuple[Reference, ...]
    # checkpoint keys the family's published checkpoints carry that the model does not use (DeepSeek-V3's
    # multi-token-prediction layer, which transformers skips too); any other key the map lacks is an error
    ignored_prefixes: tuple[str, ...] = ()

    def weight_entries(self) -> Iterator[Weight]:
        return (w for w in self.weights if isinstance(w, Weight))

    def expert_stacks(self) -> Iterator[ExpertStack]:
        return (w for w in self.weights if isinstance(w, ExpertStack))

    def reference_for(self, hook: str) -> Reference | None:
        return next((r for r in self.references if r.hook == hook), None)
