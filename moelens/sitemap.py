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

import torch


@dataclass(frozen=True)
class PerExpertKeys:
    """One spelling of the routed experts as separate tensors; "{e}" stands for the expert's index. gate None:
    ungated experts (moelens.experts.spec.Ungated), whose W_gate_up is the up tensor alone."""

    gate: str | None
    up: str
    down: str

    @property
    def first(self) -> str:
        """The key whose expert-0 presence says the files use this spelling."""
        return self.up if self.gate is None else self.gate


class Layout:
    """How a stored tensor becomes moelens's: `load` maps the stored tensor (with or without its leading
    expert axis) onto the parameter's layout; `stored_shape` is the stored shape a parameter shape needs."""

    def load(self, stored: torch.Tensor) -> torch.Tensor:
        return stored

    def stored_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return shape


AS_STORED = Layout()


class Transposed(Layout):
    """Stored [..., in, out] (x @ W), moelens's [..., out, in] (gpt-oss's down_proj)."""

    def load(self, stored: torch.Tensor) -> torch.Tensor:
        return stored.transpose(-2, -1)

    def stored_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (*shape[:-2], shape[-1], shape[-2])


class Interleaved(Layout):
    """Stored gate and up interleaved along the last axis (gate 0, up 0, gate 1, ...), moelens's gate first
    (gpt-oss's gate_up_proj_bias)."""

    def load(self, stored: torch.Tensor) -> torch.Tensor:
        return torch.cat([stored[..., 0::2], stored[..., 1::2]], dim=-1)


class InterleavedRows(Layout):
    """Stored gate and up rows interleaved (gate 0, up 0, gate 1, ...), moelens's gate rows first (gpt-oss's
    MXFP4 gate_up_proj, [E, 2*d_expert, d_model] once dequantized)."""

    def load(self, stored: torch.Tensor) -> torch.Tensor:
        return torch.cat([stored[..., 0::2, :], stored[..., 1::2, :]], dim=-2)


class TransposedInterleaved(Layout):
    """Stored [..., d_model, 2*d_expert] with gate and up columns interleaved, moelens's [..., 2*d_expert,
    d_model] gate rows first (gpt-oss's gate_up_proj)."""

    def load(self, stored: torch.Tensor) -> torch.Tensor:
        rows = stored.transpose(-2, -1)
        return torch.cat([rows[..., 0::2, :], rows[..., 1::2, :]], dim=-2)

    def stored_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (*shape[:-2], shape[-1], shape[-2])


@dataclass(frozen=True)
class Weight:
    """A moelens parameter (or buffer) read whole from one checkpoint tensor.

    keys: the spellings of that tensor, tried in order (the Hub's and transformers' may differ).
    required=False: absent is allowed, the parameter is then left as the model built it (a tied head).
    layout: how the stored tensor maps onto the parameter."""

    param: str
    keys: tuple[str, ...]
    required: bool = True
    layout: Layout = AS_STORED


@dataclass(frozen=True)
class Part:
    """A piece of a SplitWeight's stored tensor: its next `rows` rows (along the stored tensor's first axis), read
    into `param` (at `index` within it, where the piece fills part of the parameter) through `layout`."""

    param: str
    rows: int
    index: tuple = ()
    layout: Layout = AS_STORED


@dataclass(frozen=True)
class SplitWeight:
    """One checkpoint tensor read into several moelens parameters, or into several places of one: its rows,
    in order, are the parts' (DBRX's fused Wqkv into q_proj, k_proj and v_proj; its experts stored flat
    [n_experts * d_expert, d_model] into each expert's rows of the stacked W_gate_up / W_down). keys: the
    spellings of that tensor, tried in order. The loader checks the stored tensor's shape against the parts'
    together, and counts it (moelens plan) as the parts' pieces."""

    keys: tuple[str, ...]
    parts: tuple[Part, ...]

    @property
    def params(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p.param for p in self.parts))


@dataclass(frozen=True)
class PackedWeight:
    """A moelens parameter stored as several checkpoint tensors that a quantized format combines into it
    (gpt-oss's MXFP4 experts: `<name>_blocks`, `<name>_scales`). keys: the stored tensors in the format's
    order; method: the quant_method whose dequantization makes the parameter (moelens.loaders.quantized), which
    config.json's quantization_config must name."""

    param: str
    keys: tuple[str, ...]
    method: str
    layout: Layout = AS_STORED  # how the dense tensor the format makes maps onto the parameter


@dataclass(frozen=True)
class FusedExperts:
    """A layer's experts stored stacked [E, ...], one tensor per parameter of the expert spec (key None: the
    spec has no such parameter), each with its layout. transformers 5's usual spelling is gate_up_proj [E,
    2*d_expert, d_model] (gate rows first) and down_proj [E, d_model, d_expert], as moelens holds them."""

    gate_up: str
    down: str
    gate_up_bias: str | None = None
    down_bias: str | None = None
    layouts: tuple[Layout, Layout, Layout, Layout] = (AS_STORED, AS_STORED, AS_STORED, AS_STORED)

    def keys(self) -> tuple[tuple[str, Layout], ...]:
        """(key, layout) per stored parameter, in the spec's parameter order."""
        keys = (self.gate_up, self.down, self.gate_up_bias, self.down_bias)
        return tuple((k, layout) for k, layout in zip(keys, self.layouts) if k is not None)


@dataclass(frozen=True)
class ExpertStack:
    """The routed experts of one layer: moelens stacks them as its ExpertSpec says (moelens.experts.spec:
    W_gate_up [E, 2*d_expert, d_model] gate rows first, W_down [E, d_model, d_expert], and b_gate_up, b_down
    where the spec has biases). Read from per-expert tensors (any of `per_expert`'s spellings; no biases) or
    from one stacked tensor per parameter (`fused`)."""

    prefix: str  # moelens module, e.g. "blocks.3.mlp.experts"
    n_experts: int
    d_expert: int
    per_expert: tuple[PerExpertKeys, ...]
    fused: FusedExperts
    # where the files have neither spelling (a new checkpoint written, missing keys named): the fused one
    # (True: the family's published checkpoints are fused, Llama 4's) or the first per-expert one
    fused_first: bool = False
    # other stacked spellings, tried after `fused` (Granite: the Hub's input_linear / output_linear, then
    # transformers 5's experts.gate_up_proj / down_proj)
    other_fused: tuple[FusedExperts, ...] = ()

    def fused_in(self, present) -> FusedExperts | None:
        """The stacked spelling whose gate_up the files hold (`present`: a set of keys or the files), if any."""
        return next((f for f in (self.fused, *self.other_fused) if f.gate_up in present), None)

    @property
    def params(self) -> tuple[str, ...]:
        names = ("W_gate_up", "W_down", "b_gate_up", "b_down")[: len(self.fused.keys())]
        return tuple(f"{self.prefix}.{name}" for name in names)


@dataclass(frozen=True)
class Reference:
    """The transformers module whose input or output a moelens hook equals.

    read: "in" (first input), "in.N" (N-th positional input), "out", "out.N" (N-th output), or "out.heads_first" (an output laid out
    [batch head pos d_head], which moelens lays out [batch pos head d_head]); an output may be followed by
    ".topk_indices.K" / ".topk_values.K" (dense per-expert scores, as the chosen K) or ".expert_sum.E" (outputs
    of E experts stacked, summed) or ".copy" (copied when captured), see moelens.verify."""

    hook: str
    module: str  # path from the transformers model's root, e.g. "model.layers.3.mlp.gate"
    read: str = "out"
    # what the reference does to the module's output before the stream receives it, and the hook holds:
    # times `multiplier`, then divided by `divisor` (Granite's residual_multiplier, logits_scaling)
    multiplier: float = 1.0
    divisor: float = 1.0
    # then softcapped in float32, cap * tanh(value / cap) (Beam's final logits), where given
    softcap: float | None = None
    # another module whose output the reference adds to this one's (before the multiplier), as Granite's layer
    # adds its shared_mlp's output to its block_sparse_moe's
    added: str | None = None


@dataclass(frozen=True)
class SiteMap:
    weights: tuple[Weight | ExpertStack | PackedWeight | SplitWeight, ...]
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
