"""Token embedding, a [d_vocab, d_model] table looked up by id, and the unembedding."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import nn

from moelens.models.components.softcap import softcap


class Embed(nn.Module):
    """nn.Embedding without its random initialisation: weights always come from a checkpoint, and
    initialising on the meta device would import torch._dynamo (150 MB resident) for nothing. `multiplier`
    (Granite's muP embedding_multiplier) multiplies the looked-up rows: the output is what enters the stream."""

    def __init__(self, d_vocab: int, d_model: int, multiplier: float = 1.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_vocab, d_model))
        self.multiplier = multiplier

    @property
    def W_E(self) -> Float[torch.Tensor, "d_vocab d_model"]:
        """TransformerLens's name for the table (model.embed.W_E)."""
        return self.weight

    def forward(self, tokens: Int[torch.Tensor, "batch pos"]) -> Float[torch.Tensor, "batch pos d_model"]:
        rows = F.embedding(tokens, self.weight)
        return rows if self.multiplier == 1.0 else rows * self.multiplier

    def extra_repr(self) -> str:
        scaled = "" if self.multiplier == 1.0 else f", multiplier={self.multiplier}"
        return f"{self.weight.shape[0]}, {self.weight.shape[1]}{scaled}"


class Unembed(nn.Linear):
    """The unembedding: a linear map d_model -> d_vocab (weight [d_vocab, d_model], the checkpoint's layout),
    bias-free unless the family has one (Phi-3.5-MoE's lm_head_bias), with TransformerLens's names
    model.unembed.W_U [d_model, d_vocab] and b_U (zeros where there is no bias). The logits are the map's output
    divided by `divisor` (Granite's muP logits_scaling; 1 elsewhere), then, where `softcap` is given (Beam's
    final_logit_softcapping), softcapped in float32: the logits are float32 in any model dtype."""

    def __init__(
        self, d_model: int, d_vocab: int, bias: bool = False, divisor: float = 1.0, softcap: float | None = None
    ) -> None:
        super().__init__(d_model, d_vocab, bias=bias)
        self.divisor = divisor
        self.softcap = softcap

    def forward(self, x: Float[torch.Tensor, "... d_model"]) -> Float[torch.Tensor, "... d_vocab"]:
        out = super().forward(x)
        out = out if self.divisor == 1.0 else out / self.divisor  # divided, as the reference: not times 1/divisor
        return out if self.softcap is None else softcap(out.float(), self.softcap)

    def extra_repr(self) -> str:
        return (super().extra_repr() + ("" if self.divisor == 1.0 else f", divisor={self.divisor}")
                + ("" if self.softcap is None else f", softcap={self.softcap}"))

    @property
    def W_U(self) -> Float[torch.Tensor, "d_model d_vocab"]:
        return self.weight.T

    @property
    def b_U(self) -> Float[torch.Tensor, "d_vocab"]:
        return self.weight.new_zeros(self.weight.shape[0]) if self.bias is None else self.bias
