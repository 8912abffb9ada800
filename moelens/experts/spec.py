"""The routed expert's contract: what one expert is, read by every consumer (the torch path, the Triton
kernels, offload, expert parallelism, weight views, fold, the residual decomposition, the loader).

An expert maps a token row x [d_model] to

    gate, up = W_gate_up @ x (+ b_gate_up)         # [2 * d_expert], the gate rows first
    neurons  = activation(gate, up)                 # [d_expert]
    out      = W_down @ neurons (+ b_down)          # [d_model]

or, for an ungated expert (activation Ungated: Nemotron-H's up / relu2 / down), W_gate_up holds the up rows only
([d_expert, d_model] per expert) and neurons = act(up); its hook_pre_linear holds up (the up projection; TransformerLens's per-expert hook_pre) and hook_pre never fires.

and the mixture adds weight * out over a token's routing slots (`weight_at` "output", the default), or, where
the router weight scales the expert's input instead (`weight_at` "input": Llama 4), expert(weight * x)
over them; the weight then is inside the expert, never applied to its output too. A layer's experts are stacked along a first
axis of n_experts. The parameters, their names and shapes, and the activation are the spec's; nothing else
names them. Checkpoint layouts (per-expert, fused, transposed, interleaved gate/up) are the loader's
transforms onto these stacks (moelens.sitemap.ExpertStack).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from jaxtyping import Float, Int

from moelens.experts.activations import activation as activation_fn


class GatedActivation(ABC):
    """neurons = f(gate, up), elementwise. `silu_glu`: it is SiLU(gate) * up, what the Triton kernels fuse.
    `gated` False: the expert has no gate rows and neurons = f(up) (Ungated)."""

    silu_glu = False
    gated = True

    @abstractmethod
    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor: ...

    @property
    @abstractmethod
    def formula(self) -> str:
        """What the neurons are, for support() and error messages."""


@dataclass(frozen=True)
class GLU(GatedActivation):
    """act(gate) * up: the SwiGLU of Llama-style experts (act "silu"), or another config.json hidden_act."""

    act: str = "silu"

    def __post_init__(self) -> None:
        activation_fn(self.act)  # an unknown name fails here, naming it

    @property
    def silu_glu(self) -> bool:  # type: ignore[override]
        return activation_fn(self.act) is activation_fn("silu")

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return activation_fn(self.act)(gate) * up

    @property
    def formula(self) -> str:
        return f"{self.act}(gate) * up"


@dataclass(frozen=True)
class ClampedSwiGLU(GatedActivation):
    """gpt-oss's: gate clamped above at `limit`, up clamped to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate), in that order of operations (transformers' GptOssExperts)."""

    alpha: float
    limit: float

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        # read as stride-2 views of an interleaved copy, as transformers reads its interleaved gate_up: torch's
        # elementwise kernels can round differently (by a bfloat16 ulp) on strided and contiguous inputs
        pair = torch.stack([gate, up], dim=-1).flatten(-2)
        gate, up = pair[..., 0::2], pair[..., 1::2]
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return (up + 1) * glu

    @property
    def formula(self) -> str:
        return f"(clamp(up, ±{self.limit}) + 1) * g * sigmoid({self.alpha} * g), g = clamp(gate, max={self.limit})"


@dataclass(frozen=True)
class Ungated(GatedActivation):
    """act(up) with no gate: W_gate_up is the up projection alone, [E, d_expert, d_model] (Nemotron-H's relu2
    experts). Called with the up rows only."""

    act: str = "relu2"
    gated = False

    def __post_init__(self) -> None:
        activation_fn(self.act)

    def __call__(self, up: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return activation_fn(self.act)(up)

    @property
    def formula(self) -> str:
        return f"{self.act}(up), no gate"


class ExpertTensors(NamedTuple):
    """Stacked weights of some experts (all of a layer's, or the routed ones, or one rank's), in the spec's
    parameter order. The biases are None for a spec without them."""

    gate_up: Float[torch.Tensor, "E 2I H"]
    down: Float[torch.Tensor, "E H I"]
    gate_up_bias: Float[torch.Tensor, "E 2I"] | None = None
    down_bias: Float[torch.Tensor, "E H"] | None = None

    @property
    def n_experts(self) -> int:
        return self.gate_up.shape[0]

    def present(self) -> tuple[torch.Tensor, ...]:
        """The tensors this spec has, in parameter order (ExpertSpec.param_names)."""
        return tuple(t for t in self if t is not None)

    @staticmethod
    def stack(experts: Sequence[Sequence[torch.Tensor]]) -> ExpertTensors:
        """From per-expert tensors (each in parameter order, without the expert axis)."""
        return ExpertTensors(*(torch.stack(list(ts)) for ts in zip(*experts)))

    def expert(self, e: int) -> tuple[torch.Tensor, ...]:
        """One expert's tensors, without the expert axis, in parameter order."""
        return tuple(t[e] for t in self.present())

    def to(self, device: torch.device | str) -> ExpertTensors:
        return ExpertTensors(*(None if t is None else t.to(device) for t in self))

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.present())


@dataclass(frozen=True)
class ExpertSpec:
    n_experts: int
    d_model: int
    d_expert: int
    activation: GatedActivation = GLU("silu")
    bias: bool = False  # b_gate_up [E, 2I] and b_down [E, H]
    # None: the stacks are dense tensors of the model's dtype. "fp8" / "mxfp4": kept as the checkpoint stores
    # them (moelens.experts.stored.StoredExperts) and dequantized, by the load's own function, when routed to
    storage: str | None = None
    # where the routing weight is applied: "output" (weight * expert(x)) or "input" (expert(weight * x))
    weight_at: Literal["output", "input"] = "output"
    # identity ("zero-computation") experts routed to beside the n_experts real ones (LongCat-Flash): ids
    # n_experts .. n_experts + n_identity - 1; a slot routed to one adds weight * x. They have no parameters,
    # so nothing is computed, stored, fetched, offloaded or exchanged for them
    n_identity: int = 0
    # how a token's weighted slot outputs are added: "slots" (in their promoted dtype, in slot order, cast once)
    # or "experts" (each cast to the input's dtype, added in ascending expert order: transformers' loop over
    # experts with index_add_, as LongCat-Flash's reference runs it)
    combine: Literal["slots", "experts"] = "slots"
    # how a resident W_down [E, d_model, d_expert] is laid out in memory: "out_in" (each expert's [d_model,
    # d_expert] row by row, nn.Linear's) or "in_out" (a transposed view of [E, d_expert, d_model] row by row:
    # DBRX's w2, which its reference multiplies as x @ w2; a small GEMM rounds by the layout of its operand)
    down_layout: Literal["out_in", "in_out"] = "out_in"
    # the order of an expert's rows in its GEMMs on the torch path: "token" (then slot) or "slot" (then token, as a
    # reference looping over experts with torch.where on a [top_k, tokens] mask takes them: DBRX's). With several
    # threads a GEMM can round a row by its place, so this keeps float32 results the reference's
    rows_by: Literal["token", "slot"] = "token"

    def __post_init__(self) -> None:
        if self.weight_at not in ("output", "input"):
            raise ValueError(f"ExpertSpec.weight_at must be 'output' or 'input', got {self.weight_at!r}")
        if self.combine not in ("slots", "experts"):
            raise ValueError(f"ExpertSpec.combine must be 'slots' or 'experts', got {self.combine!r}")
        if self.down_layout not in ("out_in", "in_out"):
            raise ValueError(f"ExpertSpec.down_layout must be 'out_in' or 'in_out', got {self.down_layout!r}")
        if self.rows_by not in ("token", "slot"):
            raise ValueError(f"ExpertSpec.rows_by must be 'token' or 'slot', got {self.rows_by!r}")
        if self.n_identity < 0:
            raise ValueError(f"ExpertSpec.n_identity must be at least 0, got {self.n_identity}")
        if self.n_identity and self.weight_at != "output":
            raise ValueError("ExpertSpec: identity experts are weighted at the output (weight * x); weight_at must be 'output'")

    @property
    def n_routable(self) -> int:
        """Expert ids a slot may name: the real experts, then the identity ones."""
        return self.n_experts + self.n_identity

    @property
    def param_names(self) -> tuple[str, ...]:
        return ("W_gate_up", "W_down", "b_gate_up", "b_down") if self.bias else ("W_gate_up", "W_down")

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Each stacked parameter's shape [n_experts, ...]."""
        E, H, I = self.n_experts, self.d_model, self.d_expert
        rows = 2 * I if self.activation.gated else I  # an ungated expert's W_gate_up is its up rows alone
        all_shapes = {"W_gate_up": (E, rows, H), "W_down": (E, H, I), "b_gate_up": (E, rows), "b_down": (E, H)}
        return {name: all_shapes[name] for name in self.param_names}

    def empty(self, name: str) -> torch.Tensor:
        """An uninitialised stacked parameter `name`, shaped as shapes() says and laid out as down_layout says."""
        shape = self.shapes()[name]
        if name == "W_down" and self.down_layout == "in_out":
            return torch.empty(shape[0], shape[2], shape[1]).transpose(1, 2)
        return torch.empty(shape)

    def expert_nbytes(self, dtype: torch.dtype) -> int:
        """Bytes of one expert's tensors in `dtype` (dense; StoredExperts.nbytes counts stored ones)."""
        per_expert = sum(torch.Size(shape[1:]).numel() for shape in self.shapes().values())
        return per_expert * torch.empty((), dtype=dtype).element_size()

    @property
    def fused_by_triton(self) -> bool:
        """Whether the Triton kernels compute this expert: SiLU(gate) * up or ClampedSwiGLU, with or without
        biases, dense weights or fp8 / mxfp4 kept as stored (dequantized in the kernels' tiles)."""
        return self.triton_refusal() is None

    def triton_refusal(self) -> str | None:
        """Why experts_backend='triton' cannot compute these experts (None: it can), for the error message."""
        if self.storage not in (None, "fp8", "mxfp4"):
            return (
                f"experts_backend='triton' reads dense, fp8 or mxfp4 expert weights; this model's experts are "
                f"{self.describe()}, and the kernels do not dequantize {self.storage} in their tiles: use "
                "experts_backend='torch' or 'auto', or load without expert_storage"
            )
        if self.n_identity or self.combine != "slots":
            return (
                f"experts_backend='triton' computes real experts only, their outputs summed over slots; this model's "
                f"experts are {self.describe()}: "
                "use experts_backend='torch' or 'auto'"
            )
        if self.weight_at != "output":
            return (
                "experts_backend='triton' applies the routing weight to each expert's output; this model's experts "
                f"are {self.describe()}: use experts_backend='torch' or 'auto'"
            )
        if not (self.activation.silu_glu or isinstance(self.activation, ClampedSwiGLU)):
            return (
                f"experts_backend='triton' computes SiLU(gate) * up or gpt-oss's ClampedSwiGLU, with or without "
                f"biases; this model's experts are {self.describe()}: use experts_backend='torch' or 'auto'"
            )
        return None

    def describe(self) -> str:
        bias = " with biases" if self.bias else ""
        kept = "" if self.storage is None else f", kept {self.storage} as stored and dequantized when routed to"
        weighted = ", the routing weight scaling each expert's input" if self.weight_at == "input" else ""
        identity = f", and {self.n_identity} identity experts (weight * x, no computation)" if self.n_identity else ""
        return (
            f"{self.n_experts} experts of width {self.d_expert}{bias}, neurons {self.activation.formula}{weighted}{kept}"
            f"{identity}"
        )


def gather_rows(bias: Float[torch.Tensor, "E n"], experts: Int[torch.Tensor, "S"]) -> Float[torch.Tensor, "S n"]:
    """Each row's expert's bias."""
    return bias.index_select(0, experts)
