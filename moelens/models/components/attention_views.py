"""TransformerLens's per-block attention weights, `model.blocks[L].attn.W_Q` and friends, as views of the
block's projections (TransformerLens's layout: input dimension first, `x @ W`).

  W_Q, W_K, W_V [n_heads, d_model, d_head]   b_Q, b_K, b_V [n_heads, d_head]
  W_O [n_heads, d_head, d_model]              b_O [d_model]
  W_K_grouped, W_V_grouped [n_kv_heads, d_model, d_head] (each kv head once, as stored)

model.W_Q is these stacked over the blocks. W_Q, W_O, b_Q, b_O and the grouped views are views of the
parameters (an in-place edit reaches the model); W_K, W_V, b_K and b_V repeat each kv head for the query heads
that share it (query head h reads kv head h // (n_heads // n_kv_heads)) and are copies where heads are grouped:
edit W_K_grouped / W_V_grouped, or k_proj / v_proj, there. Absent biases read as zeros. An attention whose
keys and values come out of a normed latent (DeepSeek's) has no per-head linear map of the stream: its W_Q /
W_K / W_V raise a ValueError saying so; its W_O and b_O exist.
"""

from __future__ import annotations

import einops
import torch
from jaxtyping import Float
from torch import nn


class AttentionWeightViews:
    """Mixin for attention modules with q_proj / k_proj / v_proj (where per_head_projections) and o_proj."""

    n_heads: int
    d_head: int
    per_head_projections: bool
    o_proj: nn.Linear

    def _require_per_head(self, what: str) -> None:
        if not self.per_head_projections:
            # not AttributeError: a property raising it would read as "no attribute W_Q"
            raise ValueError(
                f"{what}: {type(self).__name__}'s keys and values come out of a normed low-rank latent, so there "
                "is no per-head linear map of the residual stream; read the projections on blocks[L].attn "
                "(q_a_proj / q_b_proj or q_proj, kv_a_proj_with_mqa, kv_b_proj) or the hooks"
            )

    @staticmethod
    def _heads_in(linear: nn.Linear, n: int) -> torch.Tensor:
        """[n*d_head, d_model] -> [n, d_model, d_head] (a view)."""
        return einops.rearrange(linear.weight, "(head d_head) d_model -> head d_model d_head", head=n)

    @staticmethod
    def _bias(linear: nn.Linear, *shape: int) -> torch.Tensor:
        """linear's bias viewed as `shape`, or zeros where it has none."""
        if linear.bias is None:
            return linear.weight.new_zeros(shape)
        return linear.bias.view(shape)

    def _repeat_kv(self, t: torch.Tensor) -> torch.Tensor:
        """Repeat the kv-head axis (dim 0) for the query heads that share each kv head (itself where none do)."""
        group = self.n_heads // self.n_kv_heads
        return t if group == 1 else t.repeat_interleave(group, dim=0)

    @property
    def W_Q(self) -> Float[torch.Tensor, "n_heads d_model d_head"]:
        self._require_per_head("W_Q")
        return self._heads_in(self.q_proj, self.n_heads)

    @property
    def W_K_grouped(self) -> Float[torch.Tensor, "n_kv_heads d_model d_head"]:
        self._require_per_head("W_K_grouped")
        return self._heads_in(self.k_proj, self.n_kv_heads)

    @property
    def W_V_grouped(self) -> Float[torch.Tensor, "n_kv_heads d_model d_head"]:
        self._require_per_head("W_V_grouped")
        return self._heads_in(self.v_proj, self.n_kv_heads)

    @property
    def W_K(self) -> Float[torch.Tensor, "n_heads d_model d_head"]:
        self._require_per_head("W_K")
        return self._repeat_kv(self.W_K_grouped)

    @property
    def W_V(self) -> Float[torch.Tensor, "n_heads d_model d_head"]:
        self._require_per_head("W_V")
        return self._repeat_kv(self.W_V_grouped)

    @property
    def W_O(self) -> Float[torch.Tensor, "n_heads d_head d_model"]:
        return einops.rearrange(self.o_proj.weight, "d_model (head d_head) -> head d_head d_model", head=self.n_heads)

    @property
    def b_Q(self) -> Float[torch.Tensor, "n_heads d_head"]:
        self._require_per_head("b_Q")
        return self._bias(self.q_proj, self.n_heads, self.d_head)

    @property
    def b_K(self) -> Float[torch.Tensor, "n_heads d_head"]:
        self._require_per_head("b_K")
        return self._repeat_kv(self._bias(self.k_proj, self.n_kv_heads, self.d_head))

    @property
    def b_V(self) -> Float[torch.Tensor, "n_heads d_head"]:
        self._require_per_head("b_V")
        return self._repeat_kv(self._bias(self.v_proj, self.n_kv_heads, self.d_head))

    @property
    def b_O(self) -> Float[torch.Tensor, "d_model"]:
        return self._bias(self.o_proj, self.o_proj.out_features)
