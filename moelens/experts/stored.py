"""Routed experts kept as the checkpoint stores them, dequantized when a forward uses them.

A StoredExperts holds a stack of experts in their stored format (fp8 codes with their block scales, MXFP4
blocks with their exponents, and any dense tensor, such as gpt-oss's biases, in its stored dtype) together
with what turns them into the spec's dense stacks: for each part, the format's dequantization, the stored
layout's mapping onto the parameter, and the rows of the parameter it fills. `dequantize(dtype)` gives the
ExpertTensors every consumer reads, by the same function, in the same dtype and through the same layout as a
load that dequantizes (moelens.loaders.checkpoint.fill), so the weights, and every result computed from
them, are the same bits. Consumers see only select / dequantize / nbytes, never a format's details.

One checkpoint tensor is one part: per-expert fp8 checkpoints store gate and up as two weights, each with
its own block grid (the last block of each partial where the block does not divide d_expert or d_model),
so W_gate_up is two parts, rows [0, d_expert) and [d_expert, 2 * d_expert), and every row keeps its own
scales.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from jaxtyping import Int

from moelens.experts.rounding import Rounding, cast_through
from moelens.experts.spec import ExpertSpec, ExpertTensors
from moelens.sitemap import Layout


class StorageFormat(Protocol):
    """A stored format (moelens.loaders.quantized.Fp8Blocks, Mxfp4): its name, and its dequantization of
    the stored tensors (each with any leading axes) into a dense tensor of `dtype`. A format the Triton kernels
    dequantize in their tiles (fp8, mxfp4) also has tile_parts (moelens.kernels.stored_operands reads it)."""

    method: str

    def dequantize(self, *tensors: torch.Tensor, dtype: torch.dtype) -> torch.Tensor: ...


@dataclass(frozen=True)
class StoredPart:
    """How some stored tensors fill one parameter of every expert of a stack.

    param: the spec's parameter name (W_gate_up, ...); index: the part of one expert's parameter it fills
    (() for all of it, (slice(0, d_expert),) for gate's rows); format: how its n_tensors stored tensors make
    the dense stored tensor (None: one tensor stored dense, cast to the dtype asked for); layout: how the
    dense stored tensor maps onto the parameter's layout."""

    param: str
    index: tuple
    format: StorageFormat | None
    layout: Layout
    n_tensors: int = 1


class StoredExperts:
    """A stack of experts as stored: `tensors` are the parts' stored tensors, flat in part order, each with
    the expert axis first; one expert's are `expert(e)` (what caches hold and readers return).

    rounding (moelens.experts.rounding): the roundings the model's dense weights went through since the load
    (its dtype, then each dtype move's that rounded); empty until the model first moves to another dtype.
    dequantize makes the dense weights in the first and casts them through the rest, so that they stay the
    dense model's bits under every move."""

    def __init__(
        self, spec: ExpertSpec, parts: Sequence[StoredPart], tensors: Sequence[torch.Tensor], rounding: Rounding = ()
    ) -> None:
        self.spec, self.parts, self.tensors, self.rounding = spec, tuple(parts), tuple(tensors), tuple(rounding)
        if sum(p.n_tensors for p in self.parts) != len(self.tensors):
            raise ValueError(f"{len(self.parts)} stored parts need {sum(p.n_tensors for p in self.parts)} tensors, got {len(self.tensors)}")
        missing = set(spec.param_names) - {p.param for p in self.parts}
        if missing or any(p.param not in spec.param_names for p in self.parts):
            raise ValueError(f"stored parts fill {[p.param for p in self.parts]}; the spec's parameters are {spec.param_names}")
        if len({t.shape[0] for t in self.tensors}) > 1 or len({t.device for t in self.tensors}) > 1:
            raise ValueError(
                "stored expert tensors must share the expert count and device, got "
                f"{[(tuple(t.shape), str(t.device)) for t in self.tensors]}"
            )

    @classmethod
    def stack(cls, spec: ExpertSpec, parts: Sequence[StoredPart], experts: Sequence[Sequence[torch.Tensor]]) -> StoredExperts:
        """From per-expert stored tensors (each expert's flat, in part order, without the expert axis)."""
        return cls(spec, parts, [torch.stack(list(ts)) for ts in zip(*experts)])

    @property
    def n_experts(self) -> int:
        return self.tensors[0].shape[0]

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device

    @property
    def nbytes(self) -> int:
        """Bytes held: the stored tensors, as stored."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def method(self) -> str:
        return self.spec.storage or "dense"

    def expert(self, e: int) -> tuple[torch.Tensor, ...]:
        """Expert e's stored tensors, flat in part order, without the expert axis."""
        return tuple(t[e] for t in self.tensors)

    def select(self, ids: Sequence[int] | Int[torch.Tensor, "n"]) -> StoredExperts:
        """The experts `ids` (positions in this stack), stacked in that order: stored bytes copied, nothing
        dequantized."""
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device)
        return StoredExperts(self.spec, self.parts, [_select(t, ids) for t in self.tensors], self.rounding)

    def to(self, device: torch.device | str) -> StoredExperts:
        return StoredExperts(self.spec, self.parts, [t.to(device) for t in self.tensors], self.rounding)

    def pin_memory(self) -> StoredExperts:
        return StoredExperts(self.spec, self.parts, [t.pin_memory() for t in self.tensors], self.rounding)

    def with_rounding(self, rounding: Rounding) -> StoredExperts:
        """The same stored tensors, dequantized through `rounding`."""
        return StoredExperts(self.spec, self.parts, self.tensors, rounding)

    def _steps(self, dtype: torch.dtype) -> list[torch.dtype]:
        """The dtypes dequantize(dtype) makes the weights in, then casts them to. The formats compute float32
        values and cast them once, so a first float32 step is the format's own and is left out."""
        rounding = self.rounding[1:] if self.rounding[:1] == (torch.float32,) else self.rounding
        return [*rounding, dtype] if rounding[-1:] != (dtype,) else list(rounding)

    def dequantizes_directly(self, dtype: torch.dtype) -> bool:
        """Whether dequantize(dtype) is the formats' dequantization into dtype, with no rounding before it (what
        the Triton kernels compute in their tiles)."""
        return self._steps(dtype) == [dtype]

    def dequantize(self, dtype: torch.dtype) -> ExpertTensors:
        """The spec's dense stacks in `dtype` (new tensors, on this stack's device): each part dequantized by
        its format, mapped by its layout and written into its rows, as the load's fill() does, in the dtype
        the model was loaded in and cast through its later roundings (see rounding), then to dtype."""
        first, *later = self._steps(dtype)
        dense = self._dequantize_into(first)
        if not later:
            return dense
        return ExpertTensors(*(None if t is None else cast_through(t, (first, *later[:-1]), later[-1]) for t in dense))

    def _dequantize_into(self, dtype: torch.dtype) -> ExpertTensors:
        E = self.n_experts
        out = {name: torch.empty((E, *shape[1:]), dtype=dtype, device=self.device) for name, shape in self.spec.shapes().items()}
        start = 0
        for part in self.parts:
            stored = self.tensors[start : start + part.n_tensors]
            start += part.n_tensors
            dense = stored[0] if part.format is None else part.format.dequantize(*stored, dtype=dtype)
            out[part.param][(slice(None), *part.index)] = part.layout.load(dense)  # a dense part is cast here
        return ExpertTensors(*(out[name] for name in self.spec.param_names))

    def __repr__(self) -> str:
        return f"StoredExperts({self.n_experts} experts, {self.method}, {self.nbytes:,} bytes on {self.device})"


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _select(t: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """t's rows `ids`, copied as raw bits (torch's CPU index_select on float8 is ~10x slower than on bytes)."""
    return t.view(_SAME_SIZE_INT[t.element_size()]).index_select(0, ids).view(t.dtype)
