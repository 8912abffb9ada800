"""A softmax top-k router whose logits stay in the model's dtype but whose k weights stay float32."""

from __future__ import annotations

import torch
from jaxtyping import Float

from moelens.models.components.router import SoftmaxTopK


class SoftmaxTopKFloat32Weights(SoftmaxTopK):
    """Logits in the weight's dtype (the model's), softmax in float32 over all experts, top-k, the k weights
    renormalised to sum to 1 when norm_topk_prob (Mixtral always), and kept float32: in a bfloat16 model the
    expert outputs are scaled by float32 weights and the slot sum runs in float32 (Mixtral)."""

    def weights(
        self, scores: torch.Tensor, indices: torch.Tensor, logits_dtype: torch.dtype
    ) -> Float[torch.Tensor, "... top_k"]:
        w = scores.gather(-1, indices)
        if self.norm_topk_prob:  # as the reference: the plain sum, no epsilon
            w = w / w.sum(-1, keepdim=True)
        return w
