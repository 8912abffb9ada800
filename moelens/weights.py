"""TransformerLens-style weight views (W_Q, W_O, W_U, ...) on HookedTransformer, extended to experts.

Every property is built on access from the live parameters: per-layer pieces are views of them, and
stacking over layers makes a new tensor that is still connected to them for autograd. So a view never goes
stale after an edit or a fold, but writing into a returned stack does not change the model (edit
`blocks[L]...` parameters for that).

Layouts are TransformerLens's: input dimension first, `x @ W`:
  W_E [d_vocab, d_model]                 W_U [d_model, d_vocab]        b_U [d_vocab] (zeros without a head bias)
  W_Q [n_layers, n_heads, d_model, d_head]       b_Q [n_layers, n_heads, d_head]
  W_K, W_V: the same shape as W_Q; kv heads are repeated for the query heads that share them (query head h
      reads kv head h // (n_heads // n_kv_heads), as the attention computes), so W_K[l, h] is the key map
      head h really uses. W_K_grouped, W_V_grouped [n_layers, n_kv_heads, d_model, d_head] hold each once.
  W_O [n_layers, n_heads, d_head, d_model]       b_O [n_layers, d_model]
  W_router [n_layers, n_experts, d_model]         (logits = x @ W_router[l].T + b_router[l])
  W_gate, W_in [n_layers, n_experts, d_model, d_expert]    W_out [n_layers, n_experts, d_expert, d_model]
  b_router [n_layers, n_experts]; b_gate, b_in [n_layers, n_experts, d_expert]; b_out [n_layers, n_experts,
      d_model]: where the family has router / expert biases (gpt-oss), a ValueError where it has none
  W_shared_gate, W_shared_in [n_layers, d_model, d_shared]  W_shared_out [n_layers, d_shared, d_model]
Absent attention biases read as zeros. The attention views are each block's `blocks[L].attn.W_Q` ...
(moelens.models.components.attention_views) stacked. Expert, router and shared-expert views are stacks where
every block is a mixture; on a model with dense blocks (DeepSeek-V3, GLM-4.5, tiny-code-moe) they are a
MixtureLayers dict {mixture block index: tensor} (a stack of the mixture layers alone would renumber them), so
`model.W_in[L]` is block L's in both cases.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from jaxtyping import Float, Int
from torch import nn

from moelens import fold
from moelens.factored_matrix import FactoredMatrix

if TYPE_CHECKING:
    from moelens.config import MoeConfig
    from moelens.models.components import Attention, Embed, RMSNorm, SparseMoe
    from moelens.models.components.parts import GatedMlpPart


EMBEDDING_PARAMETERS = ("embed.weight", "unembed.weight")


def hidden_weight_count(params: dict[str, torch.Tensor]) -> int:
    """TransformerLens's n_params of a model's named parameters: the weight matrices (2 or more dims) outside the
    embedding and unembedding; no biases, norms or correction-bias buffers. moelens's cfg.n_params."""
    return sum(t.numel() for name, t in params.items() if t.dim() >= 2 and name not in EMBEDDING_PARAMETERS)


class LayerViews(dict):
    """A per-layer weight view of a model where some blocks lack the module it reads: {block index: that block's
    tensor} for the blocks that have it, so that view[L] is block L's, as it is in the stack of a model where
    every block has it. Another block's index (or a stacked-tensor attribute such as .shape) is an error saying
    so. Negative indices count from the last block."""

    holders = "blocks"  # which blocks hold the view (in messages)
    others = "a block without it"

    def __init__(self, what: str, per_layer: dict[int, object], n_layers: int) -> None:
        super().__init__(per_layer)
        self.what, self.n_layers = what, n_layers

    def __missing__(self, layer):
        if isinstance(layer, int) and -self.n_layers <= layer < 0 and layer + self.n_layers in self:
            return self[layer + self.n_layers]
        raise KeyError(
            f"{self.what}[{layer!r}]: this model's {self.what} is one tensor per {self.holders}, {sorted(self)}; "
            f"block {layer!r} is {self.others} or not a block"
        )

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"{self.what} of this model is a dict {{layer: tensor}} over its {self.holders} ({sorted(self)}), not a "
            f"stacked tensor: index it by block, e.g. {self.what}[{min(self)}].{name}"
        )


class MixtureLayers(LayerViews):
    """A mixture weight view (W_router, W_gate, W_in, W_out, their biases, the shared expert's) of a model with
    dense blocks (or blocks without a feed-forward): {mixture block index: tensor}."""

    holders = "mixture layer"
    others = "a dense MLP (read blocks[L].mlp), a layer without a mixture,"


class AttentionLayers(LayerViews):
    """An attention weight view (W_Q, W_K, W_V, W_O, their biases, QK, OV) of a hybrid model, where some blocks'
    token mixer is not softmax attention (a linear-attention or state-space mixer: blocks[L].mixer) or absent,
    or whose blocks' tensors differ in shape (kv heads per layer type): {attention block index: tensor}."""

    holders = "softmax-attention layer"
    others = "a linear-attention / state-space layer (read blocks[L].mixer), a layer without a token mixer,"


class WeightViews:
    """Mixin for HookedTransformer: weight views, QK / OV circuits and in-place weight processing."""

    cfg: MoeConfig
    embed: Embed
    unembed: nn.Linear
    ln_final: RMSNorm
    blocks: nn.ModuleList

    # ---- embeddings ---------------------------------------------------------------------------------
    @property
    def W_E(self) -> Float[torch.Tensor, "d_vocab d_model"]:
        """Each token's row as it enters the stream (hook_embed): the table, times the embedding multiplier
        where the family has one (Granite's; a new tensor then: edit embed.weight to change the model)."""
        multiplier = self.embed.multiplier
        return self.embed.weight if multiplier == 1.0 else self.embed.weight * multiplier

    @property
    def W_U(self) -> Float[torch.Tensor, "d_model d_vocab"]:
        """The map from the final norm's output to the logits: the head's weight, transposed, divided by the
        logits divisor where the family has one (Granite's logits_scaling; a new tensor then)."""
        divisor = self.unembed.divisor
        return self.unembed.weight.T if divisor == 1.0 else self.unembed.weight.T / divisor

    @property
    def b_U(self) -> Float[torch.Tensor, "d_vocab"]:
        """TransformerLens's unembedding bias: the head's bias where the family has one (Phi-3.5-MoE), else zeros,
        so TL code computing `resid @ W_U + b_U` runs unchanged."""
        bias, divisor = self.unembed.bias, self.unembed.divisor
        if bias is None:
            return self.unembed.weight.new_zeros(self.cfg.d_vocab)
        return bias if divisor == 1.0 else bias / divisor  # as W_U: the logits are divided

    def accumulated_bias(
        self, layer: int, mlp_input: bool = False, include_mlp_biases: bool = True
    ) -> Float[torch.Tensor, "d_model"]:
        """TransformerLens's accumulated_bias: the biases written into the stream before block `layer`
        (its attention too with mlp_input): here the o_proj biases. No dense MLP has a bias, and routed
        experts' output biases (gpt-oss's b_out) reach the stream weighted by each token's routing, so they
        are no fixed bias: include_mlp_biases changes nothing."""
        n = self.cfg.n_layers
        if not 0 <= layer <= n:
            raise ValueError(f"accumulated_bias: layer must be in [0, {n}], got {layer}")
        total = self.unembed.weight.new_zeros(self.cfg.d_model)
        for l in range(min(n, layer + 1 if mlp_input else layer)):
            if not self.blocks[l].has_attention:  # other token mixers' output projections have no bias
                continue
            bias = self.blocks[l].attn.o_proj.bias
            if bias is not None and not self.blocks[l].stream_is_sum:
                raise ValueError(f"accumulated_bias: block {l} rescales the stream it carries (Beam's depth-scaled "
                                 "adds): its o_proj bias reaches the stream rescaled by every later block")
            if bias is not None:  # as the stream receives it: times the block's residual multiplier
                total = total + bias.to(total.device, total.dtype) * self.blocks[l].residual_multiplier
        return total

    def tokens_to_residual_directions(
        self, tokens: int | str | Int[torch.Tensor, "..."]
    ) -> Float[torch.Tensor, "... d_model"]:
        """TransformerLens's W_U[:, token]: the direction whose dot product with the final norm's output gives
        the token's logit (divided by the logits divisor where the family has one, as W_U). The norm's weight
        is not in it (with fold_ln it is in W_U, and ln_final.weight is 1): the ActivationCache's normed stacks
        carry it (apply_ln_to_stack), so they pair with this and with W_U alike, folded or not."""
        if isinstance(tokens, str):
            ids = self.to_tokens(tokens).flatten()  # type: ignore[attr-defined]
            if ids.numel() != 1:
                raise ValueError(f"{tokens!r} is {ids.numel()} tokens, not one")
            tokens = ids[0]
        tokens = torch.as_tensor(tokens, device=self.unembed.weight.device)
        rows, divisor = self.unembed.weight[tokens], self.unembed.divisor
        # its own tensor: an in-place edit must not reach the model
        return rows.clone() if divisor == 1.0 else rows / divisor

    # ---- attention: each block's views (moelens.models.components.attention_views), stacked ---------------
    def _per_layer(self, fn: Callable[[Attention], torch.Tensor], what: str = "") -> torch.Tensor | AttentionLayers:
        """One stack over the blocks where every block's token mixer is softmax attention and the blocks' tensors
        share a shape; else {attention block index: tensor} (a stack over the attention layers alone would
        renumber them)."""
        per_layer = {l: fn(block.attn) for l, block in enumerate(self.blocks) if block.has_attention}
        # a stack needs one shape: the grouped views of a model whose kv heads differ by layer type are per block
        if len(per_layer) == len(self.blocks) and len({t.shape for t in per_layer.values()}) == 1:
            return torch.stack(list(per_layer.values()))
        return AttentionLayers(what, per_layer, self.cfg.n_layers)

    @property
    def W_Q(self) -> Float[torch.Tensor, "n_layers n_heads d_model d_head"]:
        return self._per_layer(lambda a: a.W_Q, "W_Q")

    @property
    def W_K_grouped(self) -> Float[torch.Tensor, "n_layers n_kv_heads d_model d_head"]:
        return self._per_layer(lambda a: a.W_K_grouped, "W_K_grouped")

    @property
    def W_V_grouped(self) -> Float[torch.Tensor, "n_layers n_kv_heads d_model d_head"]:
        return self._per_layer(lambda a: a.W_V_grouped, "W_V_grouped")

    @property
    def W_K(self) -> Float[torch.Tensor, "n_layers n_heads d_model d_head"]:
        return self._per_layer(lambda a: a.W_K, "W_K")

    @property
    def W_V(self) -> Float[torch.Tensor, "n_layers n_heads d_model d_head"]:
        return self._per_layer(lambda a: a.W_V, "W_V")

    @property
    def W_O(self) -> Float[torch.Tensor, "n_layers n_heads d_head d_model"]:
        return self._per_layer(lambda a: a.W_O, "W_O")

    @property
    def b_Q(self) -> Float[torch.Tensor, "n_layers n_heads d_head"]:
        return self._per_layer(lambda a: a.b_Q, "b_Q")

    @property
    def b_K(self) -> Float[torch.Tensor, "n_layers n_heads d_head"]:
        return self._per_layer(lambda a: a.b_K, "b_K")

    @property
    def b_V(self) -> Float[torch.Tensor, "n_layers n_heads d_head"]:
        return self._per_layer(lambda a: a.b_V, "b_V")

    @property
    def b_O(self) -> Float[torch.Tensor, "n_layers d_model"]:
        return self._per_layer(lambda a: a.b_O, "b_O")

    @property
    def QK(self) -> FactoredMatrix:
        """W_Q[l, h] @ W_K[l, h].T, [n_layers, n_heads, d_model, d_model]: the bilinear form of the
        projections only. The real scores also depend on the rotary (position-dependent), on the q/k biases
        and, for Hunyuan, on the per-head q/k norms applied after the rotary; none of these is in QK."""
        W_K = self.W_K
        W_K_T = W_K.transpose(-2, -1) if torch.is_tensor(W_K) else {l: w.transpose(-2, -1) for l, w in W_K.items()}
        return self._circuit("QK", self.W_Q, W_K_T)

    @property
    def OV(self) -> FactoredMatrix:
        """W_V[l, h] @ W_O[l, h], [n_layers, n_heads, d_model, d_model] (v biases not included)."""
        return self._circuit("OV", self.W_V, self.W_O)

    def _circuit(self, what: str, left, right) -> FactoredMatrix | AttentionLayers:
        """The stacked circuit where every block is softmax attention (TransformerLens's [n_layers, n_heads, ...]);
        on a hybrid (per-layer views), {attention block index: that block's [n_heads, ...] circuit}."""
        if torch.is_tensor(left):
            return FactoredMatrix(left, right)
        return AttentionLayers(what, {l: FactoredMatrix(left[l], right[l]) for l in left}, self.cfg.n_layers)

    # ---- mixtures -----------------------------------------------------------------------------------
    def _per_moe_layer(self, what: str, fn: Callable[[SparseMoe], torch.Tensor]) -> torch.Tensor | MixtureLayers:
        """One stack over the blocks where every block is a mixture; else {mixture block index: tensor}
        (a stack over the mixture layers alone would renumber them: W_in[1] would be block 2's)."""
        if self.cfg.dense_layer_indices:
            return MixtureLayers(what, {l: fn(self.blocks[l].mlp) for l in self.cfg.moe_layer_indices}, self.cfg.n_layers)
        return torch.stack([fn(block.mlp) for block in self.blocks])

    def _shared(self, what: str, fn: Callable[[GatedMlpPart], torch.Tensor]) -> torch.Tensor:
        """fn(the mixture's shared expert part) per layer (block.mlp.parts(): its part of kind "shared")."""
        if not any(part.kind == "shared" for block in self.blocks if block.is_moe for part in block.mlp.parts()):
            raise ValueError(f"{what}: this model's mixtures have no shared expert")

        def per_layer(mlp: SparseMoe) -> torch.Tensor:
            shared = [part for part in mlp.parts() if part.kind == "shared"]
            if len(shared) != 1:
                raise ValueError(f"{what}: {type(mlp).__name__} has {len(shared)} shared experts, not one per layer")
            return fn(shared[0])

        return self._per_moe_layer(what, per_layer)

    @property
    def W_router(self) -> Float[torch.Tensor, "n_layers n_experts d_model"]:
        return self._per_moe_layer("W_router", lambda m: m.router.weight)

    @property
    def W_gate(self) -> Float[torch.Tensor, "n_layers n_experts d_model d_expert"]:
        d = self.cfg.d_expert
        if not self.cfg.expert_spec().activation.gated:
            raise ValueError(f"W_gate: this model's routed experts have no gate ({self.cfg.expert_spec().describe()}); "
                                 "their up projections are W_in")
        return self._per_moe_layer("W_gate", lambda m: m.experts.tensors().gate_up[:, :d].transpose(-2, -1))

    @property
    def W_in(self) -> Float[torch.Tensor, "n_layers n_experts d_model d_expert"]:
        d = self.cfg.d_expert if self.cfg.expert_spec().activation.gated else 0  # ungated: the up rows alone
        return self._per_moe_layer("W_in", lambda m: m.experts.tensors().gate_up[:, d:].transpose(-2, -1))

    @property
    def W_out(self) -> Float[torch.Tensor, "n_layers n_experts d_expert d_model"]:
        return self._per_moe_layer("W_out", lambda m: m.experts.tensors().down.transpose(-2, -1))

    def _expert_bias(self, what: str, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """fn(gate_up_bias [E, 2*d_expert], down_bias [E, d_model]) per layer, where the experts have biases."""
        if not any(block.is_moe and block.mlp.experts.spec.bias for block in self.blocks):
            raise ValueError(f"{what}: this model's routed experts have no biases (their ExpertSpec has bias=False)")

        def per_layer(m: SparseMoe) -> torch.Tensor:
            t = m.experts.tensors()
            return fn(t.gate_up_bias, t.down_bias)

        return self._per_moe_layer(what, per_layer)

    @property
    def b_router(self) -> Float[torch.Tensor, "n_layers n_experts"]:
        """The router's logit bias (logits = x @ W_router[l].T + b_router[l]), where the router has one."""
        if not any(block.is_moe and getattr(block.mlp.router, "bias", None) is not None for block in self.blocks):
            raise ValueError("b_router: this model's routers have no bias (their logits are x @ W_router[l].T)")
        return self._per_moe_layer("b_router", lambda m: m.router.bias)

    @property
    def b_gate(self) -> Float[torch.Tensor, "n_layers n_experts d_expert"]:
        d = self.cfg.d_expert
        return self._expert_bias("b_gate", lambda gate_up, down: gate_up[:, :d])

    @property
    def b_in(self) -> Float[torch.Tensor, "n_layers n_experts d_expert"]:
        d = self.cfg.d_expert
        return self._expert_bias("b_in", lambda gate_up, down: gate_up[:, d:])

    @property
    def b_out(self) -> Float[torch.Tensor, "n_layers n_experts d_model"]:
        return self._expert_bias("b_out", lambda gate_up, down: down)

    @property
    def W_shared_gate(self) -> Float[torch.Tensor, "n_layers d_model d_shared"]:
        return self._shared("W_shared_gate", lambda part: part.module.gate_proj.weight.T)

    @property
    def W_shared_in(self) -> Float[torch.Tensor, "n_layers d_model d_shared"]:
        return self._shared("W_shared_in", lambda part: part.module.up_proj.weight.T)

    @property
    def W_shared_out(self) -> Float[torch.Tensor, "n_layers d_shared d_model"]:
        return self._shared("W_shared_out", lambda part: part.module.down_proj.weight.T)

    @property
    def W_shared_sigmoid_gate(self) -> Float[torch.Tensor, "n_layers d_model"]:
        """Qwen2-MoE's shared_expert_gate: the shared expert is scaled by sigmoid(x @ this[l])."""
        def sigmoid_gated(part: GatedMlpPart) -> bool:
            return part.gate is not None and part.gate.activation is torch.sigmoid

        if not any(part.kind == "shared" and sigmoid_gated(part) for block in self.blocks if block.is_moe
                   for part in block.mlp.parts()):
            raise ValueError("W_shared_sigmoid_gate: this model's shared expert is not gated by a sigmoid (only Qwen2-MoE's is)")

        def gate_row(part: GatedMlpPart) -> torch.Tensor:
            if not sigmoid_gated(part):
                raise ValueError("W_shared_sigmoid_gate: some of this model's shared experts have no sigmoid gate")
            return part.gate.module.weight[0]

        return self._shared("W_shared_sigmoid_gate", gate_row)

    # ---- processing ---------------------------------------------------------------------------------
    def process_weights_(self, fold_ln: bool = False, center_unembed: bool = False) -> None:
        """Fold the RMSNorm weights into what reads them and/or center the unembedding, in place
        (what from_pretrained(fold_ln=..., center_unembed=...) does; see moelens.fold).

        Folding re-rounds the router's weights, and routing is discontinuous: near-tied tokens can change
        experts. The count on a probe batch is kept as self.routing_changes (moelens.fold.RoutingChanges),
        with a warning when it is not zero."""
        if fold_ln:
            self.routing_changes = fold.fold_layer_norm(self)  # type: ignore[arg-type]
            if self.routing_changes.total:
                warnings.warn(f"fold_ln: {self.routing_changes}; see moelens.fold", stacklevel=2)
        if center_unembed:
            fold.center_unembed(self)  # type: ignore[arg-type]
