"""The Mixer protocol: what a block needs of its token mixer, whatever its kind (softmax attention, Gated
DeltaNet, Mamba-2, ...).

    out = mixer(x, inputs)        x: the normed stream [batch pos d_model]; inputs: moelens.models.context.
                                  LayerInputs (positions, rotary, masks, the layer's state); out: what the
                                  mixer adds to the residual stream [batch pos d_model]
    mixer.new_state(reserve)      an empty state of the mixer's kind (moelens.state) for a cache
    mixer.input_projections()     the linear maps that read the normed stream (fold_ln scales them)
    type(mixer).state_bytes(cfg)  StateBytes: what its state holds per token and per sequence (plan)

A block holds its mixer under `block_attribute`: "attn" for softmax attention (TransformerLens's
blocks.L.attn.* sites), "mixer" for the others (their sites are blocks.L.mixer.*). Whatever the kind, the
block's hook_attn_out holds what the mixer adds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch
from jaxtyping import Float
from torch import nn

from moelens.models.context import LayerInputs
from moelens.state import LayerState

if TYPE_CHECKING:
    from moelens.config import MoeConfig


@dataclass(frozen=True)
class StateBytes:
    """Values (not bytes: the planner multiplies by the dtype's size) a mixer's state holds per layer:
    per_token grows with the sequence (keys and values), per_sequence does not (a recurrent state)."""

    per_token: int = 0
    per_sequence: int = 0


class Mixer(Protocol):
    block_attribute: ClassVar[str]

    def __call__(
        self, x: Float[torch.Tensor, "batch pos d_model"], inputs: LayerInputs
    ) -> Float[torch.Tensor, "batch pos d_model"]: ...

    def new_state(self, reserve: int = 0) -> LayerState: ...

    def input_projections(self) -> list[nn.Linear]: ...

    @staticmethod
    def state_bytes(cfg: MoeConfig) -> StateBytes: ...
