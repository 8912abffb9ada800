"""Token embedding: a [d_vocab, d_model] table looked up by id."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import nn


class Embed(nn.Module):
    """nn.Embedding without its random initialisation: weights always come from a checkpoint, and
    initialising on the meta device would import torch._dynamo (150 MB resident) for nothing."""

    def __init__(self, d_vocab: int, d_model: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_vocab, d_model))

    def forward(self, tokens: Int[torch.Tensor, "batch pos"]) -> Float[torch.Tensor, "batch pos d_model"]:
        return F.embedding(tokens, self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, {self.weight.shape[1]}"
