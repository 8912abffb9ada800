"""Residual-stream analyses on an ActivationCache: TransformerLens's API, extended to mixture layers.

Stacks put the component axis first: [component, batch, pos, d_model] (no batch axis after
remove_batch_dim; an int pos_slice drops the pos axis, a slice / list / tensor keeps it).

"Applying the norm" to a stack (apply_ln_to_stack, and apply_ln=True of the stacking methods) gives what the
norm would output for each component: the component divided by the RMS the norm computed on the real stream
during the run (its cached hook_scale, float32), times the norm's weight. Dividing by the one cached scale keeps
the norm linear in the components, so normed components sum to the norm's output and attributions add up.
The weight is 1 after fold_ln, which has moved it into the weights that read the stream, and this is then
TransformerLens's folded arithmetic exactly; without fold_ln the weight is applied here, so that a normed stack
pairs with the model's own reading weights either way. One convention, folded or not: a normed final stream
(apply_ln_to_stack(layer=-1), either recompute_ln, or accumulated_resid(apply_ln=True)'s "final_post") dotted
with model.tokens_to_residual_directions (TransformerLens's W_U column), or times model.W_U, is the model's
logit; so is logit_attrs of an un-normalised decomposition, summed.

As in TransformerLens, the stacking methods (accumulated_resid, decompose_resid, stack_head_results,
get_full_resid_decomposition) default to apply_ln=False, and logit_attrs ALWAYS applies the final norm itself
(apply_ln_to_stack(layer=-1)): pass it an un-normalised stack (apply_ln=False), or the norm is applied twice.
logit_attrs therefore needs ln_final.hook_scale in the cache (MissingHooksError otherwise).

The logit lens is the exception, as in TransformerLens 3: apply_ln_to_stack(recompute_ln=True) (and
accumulated_resid(apply_ln=True) up to the final stream, which uses it) puts each component through the final
norm on its own, with its own RMS: what the model would output if that component were the final stream, so
`stack @ model.W_U` is that stream's logits. Parts of a decomposition normed that way do not sum to the norm's
output (each has its own RMS); on the whole final stream both recompute_ln values give the same result.

Every component is what the stream receives: where a family multiplies each sublayer's output by a residual
multiplier (Granite's muP), heads, neurons, experts, shared experts and o_proj biases carry it, as hook_attn_out
and hook_mlp_out do, so a decomposition still sums to the stream (hook_result, hook_z and the expert sites hold
the modules' own tensors, before it).

Post-norm blocks (a norm on each sublayer's output before the add: FlexOlmo's ln1_post / ln2_post): the parts of
a sublayer's output (heads, experts, neurons, the o_proj bias) are given as the stream receives them, each times
the post-norm's weight and divided by the scale the post-norm computed on the whole output during the run (its
cached hook_scale), the scale frozen as TransformerLens freezes a norm's scale in a decomposition; so they still
sum to hook_attn_out / hook_mlp_out. Such a block's sublayers read the stream unnormed: apply_ln_to_stack at its
layer returns the stack as it is. hook_result / compute_head_results stay each head's raw output (before the norm).

project_output_onto (get_neuron_results, stack_neuron_results, get_full_resid_decomposition): a [d_model] or
[d_model, n_outputs] matrix that every component is multiplied by, folded into the weights before the
per-neuron expansion, so the [..., neurons, d_model] tensor is never built; a [d_model] one drops the last axis.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import torch
from jaxtyping import Float, Int

from moelens.hooks import slice_pos, unwrap_slice

if TYPE_CHECKING:
    from moelens.models.base import HookedTransformer
    from moelens.models.components.block import Sublayer
    from moelens.models.components.parts import GatedMlpPart, RoutedPart

PosSlice = int | slice | tuple | list | torch.Tensor | None
Projection = Float[torch.Tensor, "d_model"] | Float[torch.Tensor, "d_model n_outputs"] | None
Tokens = int | str | Int[torch.Tensor, "..."]
Stack = Float[torch.Tensor, "component *batch_and_pos d_model"]


class MissingHooksError(KeyError):
    """A method needs hook tensors that the run did not cache (names_filter left them out)."""

    def __str__(self) -> str:  # KeyError would show the message quoted
        return str(self.args[0])


class NormNotDecomposable(ValueError):
    """An analysis that applies a norm to a stack of components, asked of a norm it cannot apply that way."""


class StreamNotDecomposable(ValueError):
    """An analysis that writes the residual stream as the sum of the sublayers' outputs, asked of a model whose
    blocks carry another stream (Beam's rescaled one; MiniMax's: each sublayer's normed input, scaled, plus its
    output)."""


class CacheAnalysis:
    """Mixin for ActivationCache (see the module docstring for the conventions)."""

    cache_dict: dict[str, torch.Tensor]
    model: HookedTransformer
    has_batch_dim: bool
    _full_name: Callable[[object], str]

    # ---- helpers -----------------------------------------------------------------------------------
    @property
    def _pos_dim(self) -> int:
        return 1 if self.has_batch_dim else 0

    def _require(self, what: str, names: list[str]) -> None:
        missing = [n for n in names if n not in self.cache_dict]
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise MissingHooksError(
                f"{what} needs hook tensors that are not in this cache: {shown}. Run run_with_cache without a "
                f"names_filter, or with one that keeps these names."
            )

    def _get(self, name: str, pos_slice: PosSlice) -> torch.Tensor:
        return slice_pos(self.cache_dict[name], pos_slice, self._pos_dim)

    def _layer_bound(self, layer: int | None) -> int:
        """None and -1 mean "after the last block" (n_layers); 0..n_layers mean "entering that block"."""
        n = self.model.cfg.n_layers
        if layer is None or layer == -1:
            return n
        if not 0 <= layer <= n:
            raise ValueError(f"layer must be in [0, {n}] (or None / -1 for the final stream), got {layer}")
        return layer

    def _ffn_block(self, layer: int, what: str):
        """Block `layer`, which must have a feed-forward (mlp_input=True reads the stream its ln2 reads)."""
        block = self.model.blocks[layer]
        if not block.has_ffn:
            raise ValueError(f"{what}: block {layer} has no feed-forward sublayer (no ln2 / mlp): mlp_input=False there")
        return block

    def _terms(self, layer: int, mlp_input: bool = False) -> list[tuple[int, Sublayer]]:
        """(block, sublayer) of every sublayer output in the stream entering `layer` (a bound), block by block
        in each block's order; mlp_input adds block `layer`'s sublayers before its first feed-forward (the
        stream its ln2 reads)."""
        self._check_stream_is_sum(min(layer + mlp_input, self.model.cfg.n_layers))
        terms = [(l, s) for l in range(layer) for s in self.model.blocks[l].sublayers()]
        if mlp_input:
            terms += [(layer, sub) for sub in self.model.blocks[layer].ffn_input_sublayers()]
        return terms

    def _check_stream_is_sum(self, n_blocks: int) -> None:
        """Refuse a decomposition through a block whose resid_post is not resid_pre plus its sublayers' outputs
        (Beam's depth-scaled adds rescale the stream; MiniMax's blocks keep each sublayer's normed input, scaled)."""
        for l in range(n_blocks):
            if not self.model.blocks[l].stream_is_sum:
                raise StreamNotDecomposable(
                    f"block {l} ({type(self.model.blocks[l]).__name__}) does not add its sublayers' outputs to its input "
                    "stream (resid_post is not resid_pre + attn_out + mlp_out), so the stream is no sum of components: "
                    "decomposing it into them is refused; use the cached streams (accumulated_resid) instead"
                )

    def _resid_name(self, layer: int) -> str:
        n = self.model.cfg.n_layers
        return f"blocks.{n - 1}.hook_resid_post" if layer == n else f"blocks.{layer}.hook_resid_pre"

    # ---- stacks of the stream ----------------------------------------------------------------------
    def accumulated_resid(
        self,
        layer: int | None = None,
        incl_mid: bool = False,
        apply_ln: bool = False,
        pos_slice: PosSlice = None,
        mlp_input: bool = False,
        return_labels: bool = False,
    ) -> Stack | tuple[Stack, list[str]]:
        """The residual stream entering each block up to `layer` (labels "0_pre", "0_mid", ..., and
        "final_post" when layer is None / -1 / n_layers), as TransformerLens. incl_mid adds each resid_mid;
        mlp_input adds the resid_mid of `layer` itself. apply_ln, up to the final stream: each stream through
        the final norm with its own RMS and the norm's weight (apply_ln_to_stack(recompute_ln=True), the logit
        lens, as TransformerLens 3); up to a block: the norm reading the stream there (that block's ln1, or ln2
        with mlp_input) with its cached scale and its weight (apply_ln_to_stack)."""
        n, layer = self.model.cfg.n_layers, self._layer_bound(layer)
        names, labels = [], []
        for l in range(layer + 1):
            if l == n:
                names.append(self._resid_name(n))
                labels.append("final_post")
                continue
            names.append(f"blocks.{l}.hook_resid_pre")
            labels.append(f"{l}_pre")
            if mlp_input and l == layer:
                self._ffn_block(l, "accumulated_resid(mlp_input=True)")
            # a block of one sublayer has no resid_mid (its feed-forward, if any, reads resid_pre)
            if ((incl_mid and l < layer) or (mlp_input and l == layer)) and self.model.blocks[l].has_resid_mid:
                names.append(f"blocks.{l}.hook_resid_mid")
                labels.append(f"{l}_mid")
        self._require("accumulated_resid", names)
        stack = torch.stack([self._get(name, pos_slice) for name in names])
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, mlp_input, pos_slice, recompute_ln=layer == n)
        return (stack, labels) if return_labels else stack

    def decompose_resid(
        self,
        layer: int | None = None,
        mlp_input: bool = False,
        mode: Literal["all", "attn", "mlp"] = "all",
        apply_ln: bool = False,
        pos_slice: PosSlice = None,
        incl_embeds: bool = True,
        return_labels: bool = False,
    ) -> Stack | tuple[Stack, list[str]]:
        """The stream entering `layer` as the sum of its sublayer outputs: "embed", "{l}_attn_out",
        "{l}_mlp_out" for l < layer (mlp_out is the whole mixture: routed experts plus shared expert; a block of
        several sublayers gives each, by its output hook: LongCat-Flash's "{l}_dense_0_out", "{l}_attn_1_out",
        ...); mlp_input adds `layer`'s own sublayers before its feed-forward (the stream ln2 reads). mode picks
        the token mixers ("attn") or the feed-forwards ("mlp") only."""
        if mode not in ("all", "attn", "mlp"):
            raise ValueError(f"mode must be 'all', 'attn' or 'mlp', got {mode!r}")
        n, layer = self.model.cfg.n_layers, self._layer_bound(layer)
        if mlp_input and layer == n:
            raise ValueError("mlp_input=True needs a block to input into: layer must be < n_layers")
        if mlp_input:
            self._ffn_block(layer, "decompose_resid(mlp_input=True)")
        names, labels = ([("hook_embed")], ["embed"]) if incl_embeds else ([], [])
        wanted = {"all": ("mixer", "ffn"), "attn": ("mixer",), "mlp": ("ffn",)}[mode]
        for l, sub in self._terms(layer, mlp_input):
            if sub.kind in wanted:
                names.append(f"blocks.{l}.{sub.out_hook}")
                labels.append(f"{l}_{sub.name}_out")
        if not names:
            raise ValueError("decompose_resid: these arguments select no component")
        self._require("decompose_resid", names)
        stack = torch.stack([self._get(name, pos_slice) for name in names])
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, mlp_input, pos_slice)
        return (stack, labels) if return_labels else stack

    def stack_activation(self, activation_name: str, layer: int = -1, sublayer_type: str | None = None) -> torch.Tensor:
        """One hook site of every block up to `layer` (exclusive; -1 / None: all), stacked: [n_layers, ...].
        The name is a short or standard name ("resid_pre", "router_logits") or a pattern "blocks.L.<...>"."""
        layer = self._layer_bound(layer)
        keys = [
            activation_name.replace("blocks.L.", f"blocks.{l}.") if activation_name.startswith("blocks.L.")
            else (activation_name, l) if sublayer_type is None else (activation_name, l, sublayer_type)
            for l in range(layer)
        ]
        names, missing = [], []
        for l, key in enumerate(keys):
            try:
                names.append(self._full_name(key))
            except KeyError:
                missing.append(l)
        if missing:
            raise MissingHooksError(
                f"stack_activation({activation_name!r}): blocks {missing} have no such tensor in this cache "
                "(left out by names_filter, or a site those blocks do not have, e.g. a router in a dense block)"
            )
        shapes = {tuple(self.cache_dict[name].shape) for name in names}
        if len(shapes) > 1:
            raise ValueError(
                f"stack_activation({activation_name!r}): the blocks' tensors differ in shape {sorted(shapes)} "
                "(e.g. a top_k that differs per layer); read them per layer instead"
            )
        return torch.stack([self.cache_dict[name] for name in names])

    def apply_ln_to_stack(
        self,
        residual_stack: Stack,
        layer: int | None = None,
        mlp_input: bool = False,
        pos_slice: PosSlice = None,
        batch_slice: PosSlice = None,
        has_batch_dim: bool = True,
        recompute_ln: bool = False,
    ) -> Stack:
        """What the norm reading the stream at `layer` outputs for each component (ln_final for layer None / -1 /
        n_layers, else block `layer`'s ln1, or ln2 with mlp_input): the component divided by the RMS the norm
        computed on the real stream (its cached hook_scale), times the norm's weight. RMSNorm has no centering,
        so this is all the norm does, and the normed components sum to its output. The weight is 1 after fold_ln
        (TransformerLens's arithmetic exactly); without fold_ln it is applied here, so that the result pairs with
        the model's reading weights (model.W_U and tokens_to_residual_directions for the final norm) folded or not.
        The result is float32 (the scale's dtype) for a lower-precision stack. pos_slice must be the one the
        stack was made with (it is applied to the scale only). batch_slice, as in TransformerLens, is applied
        to the stack's batch axis (axis 1) when has_batch_dim, and to the scale (an int drops the axis). The
        stack's last axis must be d_model (the weight's).

        recompute_ln=True (TransformerLens 3's logit lens; only for the final norm, layer None / -1 /
        n_layers): each component goes through the final norm on its own, with its own RMS and the norm's
        weight, in the norm's own arithmetic (float32, cast back before the weight), instead of the cached
        scale. No cache tensor is read; pos_slice is not needed. On the whole final stream both values agree."""
        n, layer = self.model.cfg.n_layers, self._layer_bound(layer)
        if recompute_ln and layer != n:
            raise ValueError(
                f"apply_ln_to_stack(recompute_ln=True) puts components through the final norm: layer must be None, "
                f"-1 or {n}, got {layer} (for a block's ln1 / ln2, use the cached scale: recompute_ln=False)"
            )
        if batch_slice is not None and not self.has_batch_dim:
            raise ValueError("apply_ln_to_stack: batch_slice given, but this cache has no batch axis")
        if batch_slice is not None and has_batch_dim:
            residual_stack = slice_pos(residual_stack, batch_slice, 1)
        if recompute_ln:
            return self._final_norm(residual_stack)
        name = self._scale_name(layer, mlp_input)
        if name is None:  # a post-norm block: its sublayers read the stream itself
            return residual_stack
        weight = self._norm_weight(name)
        if residual_stack.shape[-1] != weight.shape[0]:
            raise ValueError(
                f"apply_ln_to_stack: the stack's last axis has {residual_stack.shape[-1]} entries, not d_model "
                f"({weight.shape[0]}): the norm's weight ({name.removesuffix('hook_scale')}weight) scales residual "
                "vectors (to norm a stack projected onto directions, pass apply_ln=True with project_output_onto)"
            )
        scaled = self._divide_by_scale(residual_stack, name, pos_slice, batch_slice)
        return scaled * weight.to(scaled.device, scaled.dtype)

    def _scale_name(self, layer: int, mlp_input: bool) -> str | None:
        """The cached scale of the norm reading the stream at `layer` (a bound from _layer_bound); None where the
        sublayer reads the stream unnormed (a post-norm block)."""
        if layer == self.model.cfg.n_layers:
            return "ln_final.hook_scale"
        block = self.model.blocks[layer]
        if mlp_input:
            self._ffn_block(layer, "mlp_input=True")
        reader = next(sub for sub in block.sublayers() if sub.kind == "ffn" or not mlp_input)
        if reader.norm is None:
            return None
        if mlp_input:  # ln2; a parallel block's feed-forward reads ln1
            return f"blocks.{layer}.{block.norm_name(reader.norm)}.hook_scale"
        return f"blocks.{layer}.{self.model.blocks[layer].first_norm_name}.hook_scale"

    def _post_norm_factor(self, layer: int, kind: str, pos_slice: PosSlice) -> torch.Tensor | None:
        """What block `layer`'s post-norm of its `kind` sublayer ("mixer" / "ffn") multiplies every part of the
        output by, its scale frozen at the cached value: effective_weight / hook_scale, float32
        [*batch_and_pos, d_model]; None where the block adds the output as it is."""
        norm = self.model.blocks[layer].post_norm(kind)
        if norm is None:
            return None
        name = norm.hook_scale.name
        self._require(f"the parts of block {layer}'s post-normed output", [name])
        scale = self._get(name, pos_slice).float()
        return norm.effective_weight().detach().float().to(scale.device) / scale

    def _norm_weight(self, scale_name: str) -> Float[torch.Tensor, "d_model"]:
        """The factor the norm whose hook_scale is `scale_name` multiplies by (its effective_weight(), as it is
        now: 1 after fold_ln). A norm that centres its input (a LayerNorm, with or without a bias) is refused:
        dividing the components by its scale would not give its output."""
        name = scale_name.removesuffix(".hook_scale")
        norm = self.model.mod_dict[name]
        if getattr(norm, "centres", False) or getattr(norm, "bias", None) is not None:
            bias = " and adds a bias" if getattr(norm, "bias", None) is not None else ""
            raise NormNotDecomposable(
                f"{name} is a LayerNorm (it centres its input{bias}): applying it to a stack of components "
                "is not supported yet; use apply_ln=False and the cached normalised streams"
            )
        return norm.effective_weight().detach()

    def _divide_by_scale(
        self, residual_stack: torch.Tensor, name: str, pos_slice: PosSlice, batch_slice: PosSlice = None
    ) -> torch.Tensor:
        """The stack divided by the cached scale `name` (any last axis: a projected stack too)."""
        self._require("apply_ln_to_stack", [name])
        scale = self._get(name, pos_slice)
        if batch_slice is not None:
            scale = slice_pos(scale, batch_slice, 0)
        if residual_stack.shape[-scale.dim() : -1] != scale.shape[:-1] or residual_stack.dim() < scale.dim():
            raise ValueError(
                f"apply_ln_to_stack: the stack's {tuple(residual_stack.shape)} does not match {name} "
                f"{tuple(scale.shape)} after pos_slice={pos_slice!r}, batch_slice={batch_slice!r}; pass the "
                "pos_slice the stack was made with"
            )
        return residual_stack / scale

    def _weighted_projection(
        self, project: torch.Tensor | None, apply_ln: bool, layer: int, mlp_input: bool
    ) -> torch.Tensor | None:
        """project_output_onto with the norm's weight folded in where apply_ln will norm the projected stack
        (whose last axis is no longer d_model, so the weight cannot be applied after the projection)."""
        name = None if project is None or not apply_ln else self._scale_name(layer, mlp_input)
        if name is None:
            return project
        weight = self._norm_weight(name)
        dtype = torch.promote_types(weight.dtype, project.dtype)
        return weight.to(project.device, dtype)[:, None] * project.to(dtype)

    def _apply_ln_projected(
        self, stack: torch.Tensor, layer: int, mlp_input: bool, pos_slice: PosSlice, projected: bool
    ) -> torch.Tensor:
        """apply_ln of a stacking method: apply_ln_to_stack, or for a stack projected through
        _weighted_projection (the weight already in) the division by the cached scale alone."""
        name = self._scale_name(layer, mlp_input)
        if not projected or name is None:
            return self.apply_ln_to_stack(stack, layer, mlp_input, pos_slice)
        return self._divide_by_scale(stack, name, pos_slice)

    def _final_norm(self, stack: torch.Tensor) -> torch.Tensor:
        """ln_final applied to every row of the last axis on its own: weight * x / sqrt(mean(x^2) + eps), in the
        norm's arithmetic (float32, cast back, then the weight), without running its hooks."""
        norm = self.model.ln_final
        x = stack.float()
        normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)).to(stack.dtype)
        return self._norm_weight("ln_final.hook_scale").to(stack.device) * normed

    # ---- attention heads ---------------------------------------------------------------------------
    def _attentions(self, terms: list[tuple[int, Sublayer]]) -> list[tuple[int, str]]:
        """(block, attribute name) of the softmax-attention sublayers among terms (the ones with heads)."""
        return [(l, sub.name) for l, sub in terms if sub.is_attention]

    def _multiplier(self, layer: int, kind: str) -> float:
        """What block `layer`'s `kind` sublayer ("mixer" / "ffn") output is multiplied by as the stream receives it
        (Granite's residual multiplier, Beam's depth scale; 1 elsewhere). Components of the stream carry it;
        hook_result does not."""
        return self.model.blocks[layer].output_multiplier(kind)

    def _z_missing(self, attentions: list[tuple[int, str]]) -> list[str]:
        """The hook_z names the heads of these attentions need (none where hook_result is cached)."""
        return [f"blocks.{l}.{a}.hook_z" for l, a in attentions if f"blocks.{l}.{a}.hook_result" not in self.cache_dict]

    def _head_result(self, layer: int, attn: str = "attn") -> Float[torch.Tensor, "batch pos head d_model"]:
        """Each head's output as the stream receives it (times the block's residual multiplier)."""
        result, multiplier = self._head_output(layer, attn), self._multiplier(layer, "mixer")
        return result if multiplier == 1.0 else result * multiplier

    def _head_output(self, layer: int, attn: str = "attn") -> Float[torch.Tensor, "batch pos head d_model"]:
        """Each head of attention `attn`'s output, hook_result's tensor (cached, or from hook_z and o_proj)."""
        name = f"blocks.{layer}.{attn}.hook_result"
        if name in self.cache_dict:
            return self.cache_dict[name]
        self._require("the per-head attention results", [f"blocks.{layer}.{attn}.hook_z"])
        z = self.cache_dict[f"blocks.{layer}.{attn}.hook_z"]
        cfg = self.model.cfg
        # head h's output is z_h @ W_O[h]: o_proj's input columns of head h; the o bias is left out
        # -1: each head's value width (d_head, or MLA's v_head_dim)
        W_O = getattr(self.model.blocks[layer], attn).o_proj.weight.view(cfg.d_model, cfg.n_heads, -1)
        return torch.einsum("...hk,mhk->...hm", z, W_O.to(z.device, z.dtype))

    def _head_terms(self, layer: int, attn: str, pos_slice: PosSlice) -> Float[torch.Tensor, "head *batch_and_pos d_model"]:
        """Each head of attention `attn`'s output as the stream receives it (times the residual multiplier, and
        through a post-norm's frozen factor where the block has one), the head axis first."""
        heads = slice_pos(self._head_result(layer, attn), pos_slice, self._pos_dim).movedim(-2, 0)
        return _times(heads, self._post_norm_factor(layer, "mixer", pos_slice))

    def compute_head_results(self) -> None:
        """Add blocks.L.attn.hook_result [batch pos head d_model] (each head's output, o_proj's bias not
        included; every attention of a block of several, LongCat-Flash's blocks.L.attn_1.hook_result too) to
        the cache, from hook_z and the model's *current* o_proj weight."""
        attentions = self._attentions(self._terms(self.model.cfg.n_layers))
        self._require("compute_head_results", [f"blocks.{l}.{a}.hook_z" for l, a in attentions])
        for l, a in attentions:
            self.cache_dict[f"blocks.{l}.{a}.hook_result"] = self._head_output(l, a)

    def stack_head_results(
        self,
        layer: int | None = -1,
        return_labels: bool = False,
        incl_remainder: bool = False,
        pos_slice: PosSlice = None,
        apply_ln: bool = False,
    ) -> Stack | tuple[Stack, list[str]]:
        """Each head's output ("L{l}H{h}") for blocks before `layer` (-1 / None: all), o_proj biases not
        included (get_full_resid_decomposition has them as "L{l}.attn_bias"). incl_remainder adds
        "remainder": the stream at `layer` minus the heads. apply_ln: as accumulated_resid. On a hybrid only the
        softmax-attention blocks have heads (a linear-attention or state-space layer's output is in the remainder).
        A block of several attentions gives each one's heads, the first "L{l}H{h}", another "L{l}.{name}.H{h}"
        (LongCat-Flash's "L{l}.attn_1.H{h}")."""
        layer = self._layer_bound(layer)
        heads = self._attentions(self._terms(layer))
        self._require("stack_head_results", self._z_missing(heads))
        parts = [self._head_terms(l, a, pos_slice) for l, a in heads]
        labels = [head_label(l, a, h) for l, a in heads for h in range(self.model.cfg.n_heads)]
        if parts:
            stack = torch.cat(parts)
        else:
            self._require("stack_head_results", [self._resid_name(layer)])
            stack = self._get(self._resid_name(layer), pos_slice)[None, ...][:0]
        if incl_remainder:
            self._require("stack_head_results(incl_remainder=True)", [self._resid_name(layer)])
            remainder = self._get(self._resid_name(layer), pos_slice) - stack.sum(0)
            stack, labels = torch.cat([stack, remainder[None]]), labels + ["remainder"]
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, pos_slice=pos_slice)
        return (stack, labels) if return_labels else stack

    # ---- neurons ----------------------------------------------------------------------------------
    @staticmethod
    def _neuron_index(neuron_slice, n: int, device) -> torch.Tensor | None:
        """Neuron indices selected by a TransformerLens Slice input (an int keeps the axis: [n]); None = all."""
        neuron_slice = unwrap_slice(neuron_slice)
        if neuron_slice is None:
            return None
        if isinstance(neuron_slice, int) and not isinstance(neuron_slice, bool):
            neuron_slice = [neuron_slice]
        return slice_pos(torch.arange(n, device=device), neuron_slice, 0)

    @staticmethod
    def _writes(
        post: torch.Tensor, W: torch.Tensor, project: torch.Tensor | None, factor: torch.Tensor | None = None
    ) -> torch.Tensor:
        """post [..., n] times each neuron's write direction W [d_model, n]: [..., n, d_model], or with a
        projection P [d_model, o] folded into W first, [..., n, o]. factor [..., d_model] (a post-norm's, per
        token): each write times it, the projection after (it cannot be folded into W then)."""
        Wt = W.T.to(post.device, post.dtype)
        if factor is not None:
            writes = post[..., None] * Wt * factor[..., None, :].to(post.device)
            return writes if project is None else writes @ project.to(writes.device, writes.dtype)
        if project is not None:
            Wt = Wt @ project.to(post.device, post.dtype)
        return post[..., None] * Wt

    def _gated_mlp_neurons(
        self, l: int, part: GatedMlpPart, pos_slice: PosSlice, neuron_slice, project: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[int]]:
        """[*batch_and_pos, n, d_model]: each neuron of a gated-MLP part (a dense block's MLP, a shared expert)
        as the part adds it: post[i] * W_down[:, i], times the part's gate where it has one (Qwen2-MoE's)."""
        what = f"the neurons of block {l}" if part.kind == "dense" else f"the {part.label} neurons of block {l}"
        self._require(what, [part.neurons.name] + ([part.gate.hook.name] if part.gate is not None else []))
        post = self._get(part.neurons.name, pos_slice)
        if part.gate is not None:  # the gate scales the whole part, so each neuron
            post = post * part.gate.scale(self._get(part.gate.hook.name, pos_slice))
        if self._multiplier(l, "ffn") != 1.0:  # as the stream receives it
            post = post * self._multiplier(l, "ffn")
        W = part.write_weight()
        idx = self._neuron_index(neuron_slice, post.shape[-1], post.device)
        if idx is not None:
            post, W = post.index_select(-1, idx), W.index_select(1, idx.to(W.device))
        factor = self._post_norm_factor(l, "ffn", pos_slice)
        return self._writes(post, W, project, factor), _ids(idx, post.shape[-1])

    def _slot_neurons(
        self, l: int, part: RoutedPart, pos_slice: PosSlice, neuron_slice, project: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[int]]:
        """[*batch_and_pos, top_k, n, d_model]: each routing slot's expert neurons, weighted as the
        mixture weighs that slot (weight * post[i] * W_down[expert][:, i]; where the weight scaled the expert's
        input (ExpertSpec.weight_at "input") it is already inside post, so post[i] * W_down[expert][:, i])."""
        self._require(f"the expert neurons of block {l}", [part.neurons.name, part.weights.name, part.indices.name])
        post = self._get(part.neurons.name, pos_slice)
        weights = self._get(part.weights.name, pos_slice)
        indices = self._get(part.indices.name, pos_slice)
        dtype = torch.promote_types(post.dtype, weights.dtype)
        W_down = part.module.tensors().down  # [E, d_model, d_expert]
        idx = self._neuron_index(neuron_slice, post.shape[-1], post.device)
        if idx is not None:
            post, W_down = post.index_select(-1, idx), W_down.index_select(2, idx.to(W_down.device))
        W_rows = W_down.to(post.device, dtype).transpose(-1, -2)  # [E, n, d_model]
        factor = self._post_norm_factor(l, "ffn", pos_slice)
        if project is not None and factor is None:  # folded in before the gather: [E, n, o]
            W_rows = W_rows @ project.to(post.device, dtype)
        weighted_input = part.module.spec.weight_at == "input"
        coef = post.to(dtype) if weighted_input else weights.to(dtype)[..., None] * post.to(dtype)  # [*rest, k, n]
        if self._multiplier(l, "ffn") * part.scale != 1.0:  # as the stream receives it
            coef = coef * (self._multiplier(l, "ffn") * part.scale)
        # a slot routed to an identity expert (index >= the real experts) has zero neurons: any row will do
        writes = coef[..., None] * W_rows[indices.clamp(max=W_rows.shape[0] - 1)]
        if factor is not None:  # per token: applied to the d_model writes, then the projection
            writes = writes * factor[..., None, None, :].to(writes.device)
            if project is not None:
                writes = writes @ project.to(writes.device, writes.dtype)
        return writes, _ids(idx, post.shape[-1])

    def get_neuron_results(
        self,
        layer: int,
        neuron_slice=None,
        pos_slice: PosSlice = None,
        project_output_onto: Projection = None,
        shared: bool = False,
    ) -> Float[torch.Tensor, "*batch_and_pos neuron d_model"]:
        """TransformerLens's get_neuron_results: what each neuron of block `layer` writes into the stream,
        [*batch_and_pos, n, d_model], not cached. A dense block: its MLP's neurons (post[i] * W_down[:, i]).
        A mixture block: the routed experts' neurons per routing slot, [*batch_and_pos, top_k, n, d_model]
        (slot s of a token is the expert hook_expert_indices[..., s] chose; its routing weight is included,
        so summing over slots and neurons gives hook_routed_out); shared=True gives the shared expert's
        neurons instead, [*batch_and_pos, n, d_model] (Qwen2-MoE's sigmoid gate included).
        neuron_slice selects neurons within each MLP / expert (an int keeps the axis, as [n]).
        project_output_onto: see the module docstring (the last axis becomes n_outputs, or goes)."""
        project, squeeze = _projection(project_output_onto, self.model.cfg.d_model)
        n = self.model.cfg.n_layers
        if not -n <= layer < n:
            raise ValueError(f"get_neuron_results: layer must be in [0, {n}), got {layer}")
        layer %= n
        parts = self.model.blocks[layer].mlp.parts()
        # a mixture's routed experts (or with shared=True its shared expert), a dense block's MLP
        kind = "shared" if shared else "routed" if any(p.kind == "routed" for p in parts) else "dense"
        part = next((p for p in parts if p.kind == kind), None)
        if part is None:
            what = "shared expert" if shared else "routed experts or dense MLP"
            raise ValueError(f"get_neuron_results(shared={shared}): block {layer} has no {what}")
        if part.kind == "routed":
            result = self._slot_neurons(layer, part, pos_slice, neuron_slice, project)[0]
        else:
            result = self._gated_mlp_neurons(layer, part, pos_slice, neuron_slice, project)[0]
        return result.squeeze(-1) if squeeze else result

    def _mlp_neuron_parts(
        self, l: int, sub: Sublayer, pos_slice: PosSlice, neuron_slice, project: torch.Tensor | None = None
    ) -> tuple[list[torch.Tensor], list[str]]:
        """A feed-forward sublayer's neurons as components [n, *batch_and_pos, d_model], part by part
        (sub.module.parts()): a dense block's "L{l}N{i}" (as TransformerLens; another dense sublayer's
        "L{l}.{name}.N{i}", LongCat-Flash's "L{l}.dense_0.N{i}"); a mixture's shared expert "L{l}.shared.N{i}"
        and each routed expert's "L{l}.E{e}.N{i}" (zero where a token did not route to e; sums over a token's
        slots routed to e), in the order of its parts."""
        stacks, labels = [], []
        for part in sub.module.parts():
            if part.kind == "routed":
                routed, routed_labels = self._routed_neuron_parts(l, part, pos_slice, neuron_slice, project)
                stacks, labels = stacks + routed, labels + routed_labels
                continue
            stack, ids = self._gated_mlp_neurons(l, part, pos_slice, neuron_slice, project)
            stacks.append(stack.movedim(-2, 0))
            label = (f"L{l}" if sub.name == "mlp" else f"L{l}.{sub.name}.") if part.kind == "dense" else f"L{l}.{part.label}."
            labels += [f"{label}N{i}" for i in ids]
        return stacks, labels

    def _routed_neuron_parts(
        self, l: int, part: RoutedPart, pos_slice: PosSlice, neuron_slice, project: torch.Tensor | None = None
    ) -> tuple[list[torch.Tensor], list[str]]:
        """The routed experts' neurons per expert "L{l}.E{e}.N{i}", then their output biases "L{l}.E{e}.bias"
        where they have them, then each identity expert's whole output "L{l}.E{e}" (weight * input: no neurons)."""
        slots, ids = self._slot_neurons(l, part, pos_slice, neuron_slice, project)  # [*rest, k, n, d]
        indices = self._get(part.indices.name, pos_slice)
        n_experts, n_identity = part.module.n_experts, part.module.spec.n_identity
        every = torch.nn.functional.one_hot(indices, n_experts + n_identity).to(slots.dtype)  # [*rest, k, E + I]
        onehot = every[..., :n_experts]
        stacks = [torch.einsum("...knd,...ke->en...d", slots, onehot).flatten(0, 1)]
        labels = [f"L{l}.E{e}.N{i}" for e in range(n_experts) for i in ids]
        down_bias = part.module.tensors().down_bias
        if down_bias is not None:  # each routed expert's output bias, weighted as its slot: "L{l}.E{e}.bias"
            bias_slots = down_bias.to(slots.device, slots.dtype)[indices]  # [*rest, k, d]
            if part.module.spec.weight_at == "output":  # an input weight does not reach the output bias
                bias_slots = self._get(part.weights.name, pos_slice).to(slots.dtype)[..., None] * bias_slots
            bias_slots = _times(bias_slots * (self._multiplier(l, "ffn") * part.scale), _per_slot(self._post_norm_factor(l, "ffn", pos_slice)))
            stacks.append(torch.einsum("...kd,...ke->e...d", bias_slots, onehot))
            labels += [f"L{l}.E{e}.bias" for e in range(n_experts)]
        if n_identity:
            self._require(f"the identity experts of block {l}", [part.slot_outputs.name])
            outputs = self._get(part.slot_outputs.name, pos_slice) * part.scale
            identity = torch.einsum("...kd,...ke->e...d", outputs, every[..., n_experts:].to(outputs.dtype))
            stacks.append(_project(identity, project))
            labels += [f"L{l}.E{e}" for e in range(n_experts, n_experts + n_identity)]
        return stacks, labels

    def stack_neuron_results(
        self,
        layer: int,
        pos_slice: PosSlice = None,
        neuron_slice=None,
        return_labels: bool = False,
        incl_remainder: bool = False,
        apply_ln: bool = False,
        project_output_onto: Projection = None,
    ) -> Stack | tuple[Stack, list[str]]:
        """TransformerLens's stack_neuron_results: every neuron's write into the stream for the blocks
        before `layer` (-1 / None: all), [component, *batch_and_pos, d_model]. Dense blocks give
        TransformerLens's "L{l}N{i}"; a mixture block gives its shared expert's neurons "L{l}.shared.N{i}"
        and every routed expert's neurons "L{l}.E{e}.N{i}" (from the per-slot sites experts.hook_post,
        hook_expert_weights and hook_expert_indices: zero where the token did not choose e). So the stack
        has n_experts * d_expert rows per mixture layer: memory grows fast (use neuron_slice, pos_slice).
        neuron_slice selects neuron indices within each MLP / expert (an int keeps the axis).
        incl_remainder adds "remainder" (the stream entering `layer` minus the neurons); apply_ln applies
        block `layer`'s ln1 (ln_final for the last) as apply_ln_to_stack: cached scale and weight.
        project_output_onto: see the module docstring (the remainder is projected too)."""
        project, squeeze = _projection(project_output_onto, self.model.cfg.d_model)
        layer = self._layer_bound(layer)
        projected = project is not None
        project = self._weighted_projection(project, apply_ln, layer, False)
        parts, labels = [], []
        for l, sub in self._terms(layer):
            if sub.kind == "ffn":
                p, lab = self._mlp_neuron_parts(l, sub, pos_slice, neuron_slice, project)
                parts, labels = parts + p, labels + lab
        if parts:
            stack = _cat_promoted(parts)
        else:
            self._require("stack_neuron_results", [self._resid_name(layer)])
            stack = _project(self._get(self._resid_name(layer), pos_slice), project)[None][:0]
        if incl_remainder:
            self._require("stack_neuron_results(incl_remainder=True)", [self._resid_name(layer)])
            stream = _project(self._get(self._resid_name(layer), pos_slice), project)
            remainder = stream - stack.sum(0)
            stack, labels = torch.cat([stack, remainder[None].to(stack.dtype)]), labels + ["remainder"]
        if apply_ln:
            stack = self._apply_ln_projected(stack, layer, False, pos_slice, projected)
        stack = stack.squeeze(-1) if squeeze else stack
        return (stack, labels) if return_labels else stack

    # ---- the full decomposition --------------------------------------------------------------------
    def _mlp_out_parts(self, l: int, sub: Sublayer, pos_slice: PosSlice) -> tuple[list[torch.Tensor], list[str]]:
        """A feed-forward sublayer's output as components, part by part (sub.module.parts()): a dense MLP's
        "{l}_mlp_out" (TransformerLens's label; another dense sublayer's "{l}_{name}_out"); a mixture's shared
        expert as added "L{l}.shared" and each routed expert "L{l}.E{e}" (a token's share from e is the sum of
        its slots routed to e; zero where it did not choose e), in the order of its parts."""
        block, what = self.model.blocks[l], "get_full_resid_decomposition"
        factor = self._post_norm_factor(l, "ffn", pos_slice)
        stacks, labels = [], []
        for part in sub.module.parts():
            if part.kind == "routed":
                self._require(what, [part.indices.name, part.slot_outputs.name])
                n_experts = part.module.n_experts + part.module.spec.n_identity  # identity experts too
                onehot = torch.nn.functional.one_hot(self._get(part.indices.name, pos_slice), n_experts)
                outputs = self._get(part.slot_outputs.name, pos_slice) * (self._multiplier(l, "ffn") * part.scale)  # as added
                outputs = _times(outputs, _per_slot(factor))
                stacks.append(torch.einsum("...kd,...ke->e...d", outputs, onehot.to(outputs.dtype)))
                labels += [f"L{l}.E{e}" for e in range(n_experts)]
                continue
            if part.out is None:  # a dense MLP's term: all of the block's output hook (multiplied, post-normed already)
                out = getattr(block, sub.out_hook)
                self._require(what, [out.name])
                stacks.append(self._get(out.name, pos_slice)[None])
            else:
                self._require(what, [part.out.name])
                stacks.append(_times(self._get(part.out.name, pos_slice) * self._multiplier(l, "ffn"), factor)[None])
            labels.append(f"{l}_{sub.name}_out" if part.kind == "dense" else f"L{l}.{part.label}")
        return stacks, labels

    def _accumulated_bias(self, attentions: list[tuple[int, str]], like: torch.Tensor, pos_slice: PosSlice) -> torch.Tensor:
        """The o_proj biases of these attentions, summed, as one component [1, *batch_and_pos, d] (zeros where
        none has one; moelens's MLPs, experts and routers have no bias), as the stream receives each: times the
        block's residual multiplier, and a post-normed block's times the post-norm's frozen factor (per token)."""
        bias = like.new_zeros(like.shape[-1])
        for l, a in attentions:
            b = getattr(self.model.blocks[l], a).o_proj.bias
            if b is not None:
                b = b.detach().to(like.device, like.dtype) * self._multiplier(l, "ffn")
                bias = bias + _times(b, self._post_norm_factor(l, "mixer", pos_slice))
        return bias.expand(like[:1].shape)

    def get_full_resid_decomposition(
        self,
        layer: int | None = None,
        mlp_input: bool = False,
        expand_neurons: bool = True,
        apply_ln: bool = False,
        pos_slice: PosSlice = None,
        return_labels: bool = False,
        project_output_onto: Projection = None,
    ) -> Stack | tuple[Stack, list[str]]:
        """TransformerLens's get_full_resid_decomposition: the stream entering `layer` (None / -1: the final
        stream, resid_post of the last block) as a sum of components, in TransformerLens's order and with its
        defaults (expand_neurons=True, return_labels=False):

        1. each head "L{l}H{h}", block by block (block `layer`'s too with mlp_input), o_proj bias excluded; on a
           hybrid, a block whose token mixer has no heads (linear attention, a state-space layer) gives its
           whole output "{l}_attn_out" (hook_attn_out) instead, and a block without a token mixer nothing; a
           block of several attentions each one's heads (LongCat-Flash's second: "L{l}.attn_1.H{h}");
        2. block by block, the MLP part. expand_neurons=True: a dense block's neurons "L{l}N{i}"
           (TransformerLens's), a mixture's shared-expert neurons "L{l}.shared.N{i}" then every routed
           expert's neurons "L{l}.E{e}.N{i}" (as stack_neuron_results). expand_neurons=False: a dense block's
           "{l}_mlp_out" (TransformerLens's), a mixture's "L{l}.shared" (as added, Qwen2-MoE's gate in) and
           each routed expert "L{l}.E{e}" where TransformerLens has one "{l}_mlp_out"; a block's other dense
           sublayers likewise, by name (LongCat-Flash's "L{l}.dense_0.N{i}", or "{l}_dense_0_out");
        3. "embed" (there is no "pos_embed": the position is in the rotary, inside attention);
        4. "bias": the sum of the o_proj biases of the blocks whose heads are in (zeros where none; the MLPs
           and experts have no bias).

        MoE differences: a token's share from routed expert e is zero where it did not choose e, and the
        sum of its slots routed to e otherwise. expand_neurons=True (the default, as TransformerLens) has
        n_experts * d_expert rows per mixture layer, dense over all experts: for a real model pass
        expand_neurons=False or a pos_slice. Components are in the promoted dtype of the cached tensors;
        apply_ln: as the other stacks (apply_ln_to_stack: the cached scale and the norm's weight). project_output_onto: see the module
        docstring (folded into the neurons' weights with expand_neurons; every component is projected)."""
        project, squeeze = _projection(project_output_onto, self.model.cfg.d_model)
        n, layer = self.model.cfg.n_layers, self._layer_bound(layer)
        if mlp_input and layer == n:
            raise ValueError("mlp_input=True needs a block to input into: layer must be < n_layers")
        projected = project is not None
        project = self._weighted_projection(project, apply_ln, layer, mlp_input)
        what = "get_full_resid_decomposition"
        if mlp_input:
            self._ffn_block(layer, "get_full_resid_decomposition(mlp_input=True)")
        terms = self._terms(layer, mlp_input)
        mixers = [(l, sub) for l, sub in terms if sub.kind == "mixer"]
        heads = self._attentions(mixers)
        # a token mixer without heads (linear attention, a state-space layer): its whole output, "{l}_attn_out"
        self._require(what, ["hook_embed"] + self._z_missing(heads)
                      + [f"blocks.{l}.{sub.out_hook}" for l, sub in mixers if not sub.is_attention])
        embed = self._get("hook_embed", pos_slice)[None]
        bias = self._accumulated_bias(heads, embed, pos_slice)
        parts, labels = [], []
        for l, sub in mixers:
            if sub.is_attention:
                per_head = self._head_terms(l, sub.name, pos_slice)
                parts.append(_project(per_head, project))
                labels += [head_label(l, sub.name, h) for h in range(per_head.shape[0])]
            else:
                parts.append(_project(self._get(f"blocks.{l}.{sub.out_hook}", pos_slice)[None], project))
                labels.append(f"{l}_{sub.name}_out")
        for l, sub in terms:
            if sub.kind != "ffn":
                continue
            if expand_neurons:
                mlp_parts, mlp_labels = self._mlp_neuron_parts(l, sub, pos_slice, None, project)
            else:
                mlp_parts, mlp_labels = self._mlp_out_parts(l, sub, pos_slice)
                mlp_parts = [_project(part, project) for part in mlp_parts]
            parts, labels = parts + mlp_parts, labels + mlp_labels
        parts += [_project(embed, project), _project(bias, project)]
        labels += ["embed", "bias"]
        stack = _cat_promoted(parts)
        if apply_ln:
            stack = self._apply_ln_projected(stack, layer, mlp_input, pos_slice, projected)
        stack = stack.squeeze(-1) if squeeze else stack
        return (stack, labels) if return_labels else stack

    # ---- logit attribution -------------------------------------------------------------------------
    def _as_directions(
        self, x: Tokens | torch.Tensor, pos_slice: PosSlice, rest: torch.Size, batched: bool,
        batch_slice: PosSlice = None,
    ) -> torch.Tensor:
        """Token ids or residual directions -> directions [..., d_model] broadcastable to [*rest, d_model].
        `batched`: the (normalised) stack has a batch axis, i.e. rest is [batch, pos] or [batch]."""
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            dirs, lead = x, x.shape[:-1]
        else:
            if isinstance(x, str):
                dirs = self.model.tokens_to_residual_directions(x)
                lead = torch.Size()
            else:
                ids = torch.as_tensor(x)
                dirs, lead = self.model.tokens_to_residual_directions(ids), ids.shape
        # tokens with the cache's full batch axis: batch_slice applies (already-sliced ones are taken as they are)
        n_batch = self._n_batch()
        if batch_slice is not None and len(lead) in (1, 2) and n_batch is not None and lead[0] == n_batch:
            dirs = slice_pos(dirs, batch_slice, 0)
            lead = dirs.shape[:-1]
        full = 2 if batched else 1
        if len(lead) == full:  # has a pos axis: full length (slice it) or already sliced
            n_pos = self._n_pos()
            if pos_slice is not None and (n_pos is None or lead[-1] == n_pos):
                dirs = slice_pos(dirs, pos_slice, len(lead) - 1)
        elif batched and len(lead) == 1 and len(rest) == 2:
            if lead[0] == rest[0]:  # one token per batch row
                dirs = dirs.unsqueeze(1)
            elif lead[0] != rest[1]:  # else one token per position, shared by the rows (as TransformerLens)
                raise ValueError(
                    f"tokens / directions of leading shape {tuple(lead)} match neither the batch nor the "
                    f"positions of the stack's {tuple(rest)}"
                )
        elif len(lead) != 0 and not (batched and len(lead) == 1):
            raise ValueError(
                f"tokens / directions of leading shape {tuple(lead)} do not match the stack's {tuple(rest)}"
            )
        return dirs

    def _n_pos(self) -> int | None:
        for name in ("ln_final.hook_scale", "hook_embed", "blocks.0.hook_resid_pre"):
            if name in self.cache_dict:
                return self.cache_dict[name].shape[self._pos_dim]
        return None

    def _n_batch(self) -> int | None:
        if not self.has_batch_dim:
            return None
        for name in ("ln_final.hook_scale", "hook_embed", "blocks.0.hook_resid_pre"):
            if name in self.cache_dict:
                return self.cache_dict[name].shape[0]
        return None

    def _directions(
        self, tokens, incorrect_tokens, pos_slice: PosSlice, rest: torch.Size, batched: bool | None = None,
        batch_slice: PosSlice = None,
    ) -> torch.Tensor:
        batched = self.has_batch_dim if batched is None else batched
        dirs = self._as_directions(tokens, pos_slice, rest, batched, batch_slice)
        if incorrect_tokens is not None:
            dirs = dirs - self._as_directions(incorrect_tokens, pos_slice, rest, batched, batch_slice)
        return dirs

    @staticmethod
    def _token_shape(x) -> tuple:
        if isinstance(x, (str, int)):
            return ()
        t = torch.as_tensor(x)
        return tuple(t.shape[:-1]) if t.is_floating_point() else tuple(t.shape)

    def logit_attrs(
        self,
        residual_stack: Stack,
        tokens: Tokens | Float[torch.Tensor, "... d_model"],
        incorrect_tokens: Tokens | None = None,
        pos_slice: PosSlice = None,
        batch_slice: PosSlice = None,
        has_batch_dim: bool = True,
    ) -> Float[torch.Tensor, "component *batch_and_pos"]:
        """TransformerLens's logit_attrs: each component's direct contribution to a token's logit (or to the
        logit difference tokens - incorrect_tokens). Like TransformerLens it FIRST applies the final norm
        (apply_ln_to_stack(residual_stack, layer=-1, pos_slice, batch_slice, has_batch_dim): division by the
        cached ln_final.hook_scale, which must be in the cache, then ln_final's weight, 1 after fold_ln), so pass
        an un-normalised stack (apply_ln=False, the default of every stacking method). It then dots each
        component with model.tokens_to_residual_directions(tokens) (TransformerLens's W_U column), so the result
        is exact whether or not the model was loaded with fold_ln. The components of a full decomposition of the final stream
        (decompose_resid / get_full_resid_decomposition / accumulated_resid's "final_post") therefore sum to
        the model's logit (RMSNorm has no centering constant; the unembedding has no bias).

        residual_stack: [component, batch, pos, d_model] (pos already sliced by pos_slice; batch NOT
        sliced: batch_slice is applied here when has_batch_dim). has_batch_dim=False: the stack has no
        batch axis (a remove_batch_dim'ed cache, or a batched cache with an int batch_slice). tokens: one id
        / one-token string for all positions, Int [batch] (one per row) or [pos] (one per position, shared
        by the rows, when that length is not the batch size), Int [batch pos] (full length, then pos_slice
        applies, or already sliced; a full batch axis gets batch_slice), or float directions [..., d_model]
        in the same layouts. incorrect_tokens must have the same shape as tokens (ValueError otherwise)."""
        if incorrect_tokens is not None and self._token_shape(tokens) != self._token_shape(incorrect_tokens):
            raise ValueError(
                f"tokens and incorrect_tokens must have the same shape! (tokens.shape="
                f"{self._token_shape(tokens)}, incorrect_tokens.shape={self._token_shape(incorrect_tokens)})"
            )
        scaled = self.apply_ln_to_stack(
            residual_stack, layer=-1, pos_slice=pos_slice, batch_slice=batch_slice, has_batch_dim=has_batch_dim
        )
        batched = has_batch_dim and self.has_batch_dim and not isinstance(batch_slice, int)
        dirs = self._directions(tokens, incorrect_tokens, pos_slice, scaled.shape[1:-1], batched, batch_slice)
        dtype = torch.promote_types(scaled.dtype, dirs.dtype)
        # one dot product per component and position, as the notebooks' einsum computes them; the directions
        # are expanded first, so that every layout of the same tokens gives the same bits
        scaled = scaled.to(dtype)
        dirs = torch.broadcast_to(dirs.to(scaled.device, dtype), scaled.shape)
        return torch.einsum("...d,...d->...", scaled, dirs)

    def expert_logit_attribution(
        self,
        tokens_or_logit_directions: Tokens | Float[torch.Tensor, "... d_model"],
        pos_slice: PosSlice = None,
        incorrect_tokens: Tokens | None = None,
    ) -> Float[torch.Tensor, "n_layers n_experts *batch_and_pos"]:
        """Direct logit attribution of every routed expert of every layer: [n_layers, n_experts, batch, pos]
        (batch absent after remove_batch_dim, pos absent for an int pos_slice). Entry [l, e] is what expert
        e of block l wrote into the stream (its slots' weighted outputs), divided by the final norm's cached
        scale, times ln_final's weight and dotted with the token's direction (W_U column): it sums, with every
        other component's, to the logit. Zero where a token did not choose e, and for dense blocks. Identity
        experts (LongCat-Flash's) follow the real ones, n_experts .. n_experts + n_identity - 1. The
        shared expert is not in it (see get_full_resid_decomposition, "L{l}.shared"). Computed in float32."""
        cfg = self.model.cfg
        self._check_stream_is_sum(cfg.n_layers)
        routed = [(l, p) for l, block in enumerate(self.model.blocks) if block.has_ffn
                  for p in block.mlp.parts() if p.kind == "routed"]
        names = ["ln_final.hook_scale"]
        names += [name for _, part in routed for name in (part.slot_outputs.name, part.indices.name)]
        self._require("expert_logit_attribution", names)
        scale = self._get("ln_final.hook_scale", pos_slice).float()  # [*rest, 1]
        rest = scale.shape[:-1]
        dirs = self._directions(tokens_or_logit_directions, incorrect_tokens, pos_slice, rest).float()
        dirs = dirs * self._norm_weight("ln_final.hook_scale").float().to(dirs.device)  # what ln_final applies
        # every expert a slot may name, identity experts (ExpertSpec.n_identity) included
        n_experts = max((p.module.n_experts + p.module.spec.n_identity for _, p in routed), default=cfg.n_experts)
        out = scale.new_zeros(cfg.n_layers, n_experts, *rest)
        for l, part in routed:
            outputs = self._get(part.slot_outputs.name, pos_slice).float() * (self._multiplier(l, "ffn") * part.scale)  # [*rest, k, d]
            outputs = _times(outputs, _per_slot(self._post_norm_factor(l, "ffn", pos_slice)))
            indices = self._get(part.indices.name, pos_slice)
            per_slot = (outputs * dirs.to(outputs.device).unsqueeze(-2)).sum(-1) / scale  # [*rest, k]
            per_expert = per_slot.new_zeros(*rest, n_experts).scatter_add_(-1, indices, per_slot)
            out[l] += per_expert.movedim(-1, 0)
        return out


def head_label(layer: int, attn: str, head: int) -> str:
    """A head's label in the stacks: "L{l}H{h}" (TransformerLens's) for a block's attention, "L{l}.{name}.H{h}"
    for another one of a block of several (LongCat-Flash's "L{l}.attn_1.H{h}")."""
    return f"L{layer}H{head}" if attn == "attn" else f"L{layer}.{attn}.H{head}"


def _projection(project: Projection, d_model: int) -> tuple[torch.Tensor | None, bool]:
    """project_output_onto as a [d_model, n_outputs] matrix, and whether it was a [d_model] vector (whose
    output axis is dropped at the end)."""
    if project is None:
        return None, False
    if not isinstance(project, torch.Tensor) or project.dim() not in (1, 2) or project.shape[0] != d_model:
        shape = tuple(project.shape) if isinstance(project, torch.Tensor) else type(project).__name__
        raise ValueError(f"project_output_onto must be a [d_model] or [d_model, n_outputs] tensor (d_model {d_model}), got {shape}")
    return (project[:, None], True) if project.dim() == 1 else (project, False)


def _project(x: torch.Tensor, project: torch.Tensor | None) -> torch.Tensor:
    """x [..., d_model] times the projection [d_model, o] (x itself without one)."""
    if project is None:
        return x
    dtype = torch.promote_types(x.dtype, project.dtype)
    return x.to(dtype) @ project.to(x.device, dtype)


def _times(x: torch.Tensor, factor: torch.Tensor | None) -> torch.Tensor:
    """x times a post-norm's frozen factor (broadcast over x's leading axes), or x where there is none."""
    return x if factor is None else x * factor.to(x.device)


def _per_slot(factor: torch.Tensor | None) -> torch.Tensor | None:
    """A per-token factor [..., d_model] broadcast over a routing-slot axis: [..., 1, d_model]."""
    return None if factor is None else factor.unsqueeze(-2)


def _ids(index: torch.Tensor | None, n: int) -> list[int]:
    return list(range(n)) if index is None else index.tolist()


def _cat_promoted(parts: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate components along axis 0 in their promoted dtype (cached tensors may mix float32 routing
    weights with a bfloat16 stream)."""
    dtype = parts[0].dtype
    for p in parts[1:]:
        dtype = torch.promote_types(dtype, p.dtype)
    return torch.cat([p.to(dtype) for p in parts])
