"""What a part of a model holds, said by its class from the config alone (no module built), for planning at any
size: each parameter or buffer as a ParamTerm (its name under the part, shape, plan component, whether it is
kept float32).

A term also says what multiplying by it costs a token (`flops`), so the plan's forward FLOPs are the parts'
own too.

A part's class answers `param_terms(...)` (a classmethod): a mixer class `param_terms(cfg, layer)`, a
feed-forward of the recipe (Dense, Mixture) `param_terms(cfg, layer)`, a norm class `param_terms(d)`, a router
class `param_terms(cfg)`. A new mixer or feed-forward supplies its own; Recipe.param_terms(cfg) puts a whole
model's together under the names the built model has (tests check the two agree for every family).

Components (what moelens plan reports the parameters by): embeddings, attention (any token mixer), norms,
routers, routed_experts, shared_experts, dense_mlp, unembedding.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

COMPONENTS = (
    "embeddings", "attention", "norms", "routers", "routed_experts", "shared_experts", "dense_mlp", "unembedding",
)


@dataclass(frozen=True)
class ParamTerm:
    """One parameter (or buffer) of a part: `name` under the part ("q_proj.weight"), its shape, the plan
    component it counts in, whether it is kept float32 in any model dtype (a float32_weight module's)."""

    name: str
    shape: tuple[int, ...]
    component: str
    float32: bool = False
    buffer: bool = False
    layer: int | None = None  # the block it belongs to (Recipe.param_terms sets it); None: outside the blocks
    # what multiplying by it costs one token's forward, in FLOPs (2 per multiply-add): a matrix every token
    # multiplies 2 x its size, a routed expert stack its top_k experts' share; 0 for a tensor only added,
    # scaled or looked up (biases, norms, an untied embedding)
    flops: int = 0

    def __post_init__(self) -> None:
        if self.component not in COMPONENTS:
            raise ValueError(f"ParamTerm {self.name!r}: component {self.component!r} is not one of {COMPONENTS}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return torch.float32 if self.float32 else model_dtype

    def nbytes(self, model_dtype: torch.dtype) -> int:
        return self.numel * torch.tensor([], dtype=self.dtype(model_dtype)).element_size()


def under(prefix: str, terms: tuple[ParamTerm, ...]) -> tuple[ParamTerm, ...]:
    """The terms of a child module `prefix` as its parent names them."""
    return tuple(dataclasses.replace(t, name=f"{prefix}.{t.name}") for t in terms)


def kept_float32(terms: tuple[ParamTerm, ...], float32: bool) -> tuple[ParamTerm, ...]:
    """A float32_weight module keeps all its tensors (its children's too) float32."""
    return tuple(dataclasses.replace(t, float32=True) for t in terms) if float32 else terms


def linear(name: str, d_in: int, d_out: int, bias: bool, component: str) -> tuple[ParamTerm, ...]:
    """An nn.Linear(d_in, d_out): weight [d_out, d_in] and, with bias, bias [d_out]."""
    weight = ParamTerm(f"{name}.weight", (d_out, d_in), component, flops=2 * d_in * d_out)
    return (weight, ParamTerm(f"{name}.bias", (d_out,), component)) if bias else (weight,)


def depthwise_conv(name: str, channels: int, kernel: int, bias: bool, component: str) -> tuple[ParamTerm, ...]:
    """An nn.Conv1d(channels, channels, kernel, groups=channels): weight [channels, 1, kernel], bias [channels]."""
    weight = ParamTerm(f"{name}.weight", (channels, 1, kernel), component, flops=2 * channels * kernel)
    return (weight, ParamTerm(f"{name}.bias", (channels,), component)) if bias else (weight,)


def vector(name: str, d: int, component: str) -> tuple[ParamTerm, ...]:
    return (ParamTerm(name, (d,), component),)
