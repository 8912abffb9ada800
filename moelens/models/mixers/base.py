"""The Mixer protocol: what a block needs of its token mixer, whatever its kind (softmax attention, Gated
DeltaNet, Mamba-2, ...).

    out = mixer(x, inputs)        x: the normed stream [batch pos d_model]; inputs: moelens.models.context.
                                  LayerInputs (positions, rotary, masks, the layer's state); out: what the
                                  mixer adds to the residual stream [batch pos d_model]
    mixer.new_state(reserve)      an empty state of the mixer's kind (moelens.state) for a cache
    mixer.input_projections()     the linear maps that read the normed stream (fold_ln scales them)
    type(mixer).state_tensors(cfg)  StateTensor each: what its state holds, per token or per sequence, and in
                                  which dtype (plan counts the bytes from them)
    type(mixer).state_bytes(cfg)  StateBytes: the same as values per token and per sequence
    type(mixer).param_terms(cfg, layer)  ParamTerm each: what it holds (moelens.models.terms; plan)

A block holds its mixer under `block_attribute`: "attn" for softmax attention (TransformerLens's
blocks.L.attn.* sites), "mixer" for the others (their sites are blocks.L.mixer.*). Whatever the kind, the
block's hook_attn_out holds what the mixer adds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal, Protocol

import torch
from jaxtyping import Float
from torch import nn

from moelens.models.context import LayerInputs
from moelens.state import LayerState

if TYPE_CHECKING:
    from moelens.config import MoeConfig
    from moelens.models.terms import ParamTerm


@dataclass(frozen=True)
class StateBytes:
    """Values (not bytes: StateTensor has the dtypes) a mixer's state holds per layer: per_token grows with the
    sequence (keys and values), per_sequence does not (a recurrent state)."""

    per_token: int = 0
    per_sequence: int = 0


@dataclass(frozen=True)
class StateTensor:
    """One tensor of a mixer's state in one layer, for one sequence: `values` per token (it grows with the
    sequence: keys, values) or per sequence (a recurrent state, whatever the length), in `dtype` (None: the
    model's; a recurrent state kept float32 says so)."""

    name: str
    values: int
    per: Literal["token", "sequence"]
    dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.per not in ("token", "sequence"):
            raise ValueError(f"StateTensor {self.name!r}: per must be 'token' or 'sequence', got {self.per!r}")

    def element_size(self, model_dtype: torch.dtype) -> int:
        return torch.tensor([], dtype=self.dtype or model_dtype).element_size()

    def nbytes(self, model_dtype: torch.dtype, seq: int) -> int:
        """Bytes for one sequence of seq positions."""
        return self.values * (seq if self.per == "token" else 1) * self.element_size(model_dtype)


def values_of(tensors: tuple[StateTensor, ...]) -> StateBytes:
    """A mixer's state_tensors as values per token and per sequence, whatever their dtypes."""
    return StateBytes(
        per_token=sum(t.values for t in tensors if t.per == "token"),
        per_sequence=sum(t.values for t in tensors if t.per == "sequence"),
    )


class Mixer(Protocol):
    block_attribute: ClassVar[str]

    def __call__(
        self, x: Float[torch.Tensor, "batch pos d_model"], inputs: LayerInputs
    ) -> Float[torch.Tensor, "batch pos d_model"]: ...

    def new_state(self, reserve: int = 0) -> LayerState: ...

    def input_projections(self) -> list[nn.Linear]: ...

    @classmethod
    def param_terms(cls, cfg: MoeConfig, layer: int) -> tuple[ParamTerm, ...]: ...

    @classmethod
    def state_tensors(cls, cfg: MoeConfig) -> tuple[StateTensor, ...]: ...

    @classmethod
    def state_bytes(cls, cfg: MoeConfig) -> StateBytes: ...
