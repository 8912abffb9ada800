"""Counting: parameters and bytes by component and layer, the activations of a forward, the cache.

Every count asks the model's parts: the recipe's Recipe.param_terms(cfg) (each mixer's, feed-forward's, norm's
and router's class says what it holds, moelens.models.terms), the mixers' state_tensors for the cache. Nothing
is built, so a 671B config plans in the time its config takes to read.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from moelens.models.terms import COMPONENTS, ParamTerm

# the parts whose matrices block fp8 stores quantized (transformers' fp8 quantizer converts linear layers only)
LINEAR_COMPONENTS = ("attention", "routed_experts", "shared_experts", "dense_mlp")


@dataclass
class Count:
    parameters: int = 0
    bytes: int = 0

    def add(self, parameters: int, nbytes: int) -> None:
        self.parameters += parameters
        self.bytes += nbytes


@dataclass
class LayerCount:
    layer: int
    kind: str  # "moe" | "dense"
    parameters: int = 0
    bytes: int = 0
    routed_experts_bytes: int = 0
    n_experts: int = 0
    top_k: int = 0


def build_meta_model(cfg, family):
    """The model exactly as loading allocates it (family.build), on the meta device. Planning does not build
    it (model_terms says the same from the parts' classes); kept for callers that want the modules."""
    return family.build(cfg)


@functools.lru_cache(maxsize=8)
def model_terms(family, cfg) -> tuple[ParamTerm, ...]:
    """Every parameter and buffer of family's model for cfg, from its recipe's parts (tied ones once)."""
    return family.recipe(cfg).param_terms(cfg)


def meta_tensors(family, cfg) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """model_terms as (parameters, buffers) on the meta device (no memory), named and typed as the built
    model's, for the code that reads tensors by name (the stored sizes, TransformerLens's n_params)."""
    params: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    for term in model_terms(family, cfg):
        (buffers if term.buffer else params)[term.name] = torch.empty(term.shape, dtype=term.dtype(cfg.dtype), device="meta")
    return params, buffers


def count_model(model) -> tuple[dict[str, Count], list[LayerCount]]:
    """Sum every parameter and buffer of a built model (tied ones once: named_parameters drops duplicates) by
    component and layer, as its recipe's terms classify them; routed experts held off the model (offloaded,
    sharded) at their full stacks' size, as if resident. A tensor the terms do not name is a RuntimeError:
    a part whose param_terms leave it out must say what it holds."""
    params = dict(model.named_parameters())
    for layer, block in enumerate(model.blocks):
        if block.is_moe:
            stacks = block.mlp.experts.stacks_held_elsewhere(model.cfg.dtype)
            params |= {f"blocks.{layer}.mlp.experts.{name}": t for name, t in stacks.items()}
    terms = {t.name: t for t in model.recipe(model.cfg).param_terms(model.cfg)}
    found = []
    for name, tensor in [*params.items(), *model.named_buffers()]:
        if name not in terms:
            raise RuntimeError(f"moelens.plan: {type(model).__name__}'s recipe terms do not name {name!r}")
        found.append((terms[name], tensor.numel(), tensor.numel() * tensor.element_size()))
    return _sum(model.cfg, found)


def forward_flops(terms: tuple[ParamTerm, ...], batch: int, seq: int) -> dict:
    """FLOPs of a forward of batch x seq tokens in its weights' matmuls, each term's own cost per token (a
    routed expert stack's top_k share, the unembedding's matrix whichever term holds it) summed; the
    attention over the context and the elementwise work are not counted."""
    per_token = sum(t.flops for t in terms)
    return {
        "per_token": per_token,
        "forward": per_token * batch * seq,
        "counts": f"{per_token:,} per token (2 x each weight a token multiplies, routed experts' top_k share) x batch "
                  f"{batch} x seq {seq}; attention over the context and elementwise work not counted",
    }


def count_terms(cfg, terms: tuple[ParamTerm, ...]) -> tuple[dict[str, Count], list[LayerCount]]:
    """model_terms summed by component and by layer, in cfg.dtype (float32 where a term keeps it)."""
    return _sum(cfg, [(t, t.numel, t.nbytes(cfg.dtype)) for t in terms])


def _sum(cfg, found: list[tuple[ParamTerm, int, int]]) -> tuple[dict[str, Count], list[LayerCount]]:
    components = {name: Count() for name in COMPONENTS}
    layers = [
        LayerCount(i, "moe" if moe else "dense", n_experts=cfg.n_experts if moe else 0, top_k=cfg.top_k_per_layer[i])
        for i, moe in enumerate(cfg.moe_layers)
    ]
    for term, numel, nbytes in found:
        components[term.component].add(numel, nbytes)
        if term.layer is not None:
            layers[term.layer].parameters += numel
            layers[term.layer].bytes += nbytes
            if term.component == "routed_experts":
                layers[term.layer].routed_experts_bytes += nbytes
    return components, layers


# ---- activations and KV cache ---------------------------------------------------------------------------


def activation_terms(cfg, batch: int, seq: int, float32_router: bool = False) -> dict[str, dict]:
    """Bytes of the largest tensors alive at once in a forward of batch x seq tokens, without caching hooks.

    Each term names its shapes; `peak` = residual + the largest of (attention, mlp, logits), since only one
    sublayer's temporaries are alive at a time (no gradients, no run_with_cache: that stores every hook)."""
    b = torch.tensor([], dtype=cfg.dtype).element_size()
    tokens = batch * seq
    # Hunyuan and Solar weigh the slot outputs with float32 router weights, which promotes them to float32
    slot_bytes = max(b, 4) if float32_router else b
    moe_k = [k for k, moe in zip(cfg.top_k_per_layer, cfg.moe_layers, strict=True) if moe]
    k = max(moe_k, default=0)
    terms = {
        "residual": (
            4 * tokens * cfg.d_model * b,
            "4 x [batch seq d_model]: the stream, the norm's output, the sublayer's output, the new stream",
        ),
        "attention": (
            batch * cfg.n_heads * seq * seq * (2 * b + 4)
            + tokens * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.d_head * b,
            "eager: scores and pattern [batch heads seq seq] in the dtype plus the float32 softmax between them; "
            "q, k, v, z [batch seq heads d_head]",
        ),
        "routed_experts": (
            tokens * k * (3 * cfg.d_expert * b + cfg.d_model * (b + 2 * slot_bytes)) + 3 * tokens * cfg.n_experts * 4
            if moe_k else 0,
            "largest layer: [batch*seq*top_k, 2*d_expert] gate/up and [.., d_expert] act*up, [.., d_model] gathered "
            "inputs, outputs and their unsorted copy; float32 router logits, scores, choice [batch seq n_experts]",
        ),
        "shared_or_dense_mlp": (
            3 * tokens * max(cfg.d_shared, cfg.d_mlp if cfg.dense_layer_indices else 0) * b,
            "gate, up and act*up [batch seq d_shared or d_mlp]",
        ),
        "logits": (
            tokens * cfg.d_vocab * (b + (4 if b != 4 else 0)),
            "[batch seq vocab] in the dtype and its float32 copy (the loss and most callers upcast)",
        ),
    }
    out = {name: {"bytes": int(nbytes), "counts": what} for name, (nbytes, what) in terms.items()}
    # the shared expert's intermediates are freed before the routed experts run (or the other way round)
    mlp = max(out["routed_experts"]["bytes"], out["shared_or_dense_mlp"]["bytes"])
    layer = max(out["attention"]["bytes"], mlp)
    out["layer_peak"] = {"bytes": out["residual"]["bytes"] + layer, "counts": "residual + max(attention, mlp)"}
    out["peak"] = {
        "bytes": out["residual"]["bytes"] + max(layer, out["logits"]["bytes"]),
        "counts": "residual + max(attention, mlp, logits)",
    }
    return out


def float32_router(recipe) -> bool:
    """Whether the mixture layers' routers keep float32 weights (their logits are then float32)."""
    return any(router.float32_weight for router in recipe.routers())


def layer_cache_bytes(recipe, cfg, batch: int, seq: int) -> list[int]:
    """Per layer, the bytes its cache holds for batch x seq positions: the tensors its mixer's state holds
    (state_tensors), each in its own dtype (a recurrent state kept float32 counts 4 bytes a value in any model
    dtype), those per token (keys and values; MLA caches decompressed ones of every head) times seq, those per
    sequence (a convolution window, a recurrent state) once, whatever seq."""
    return [batch * sum(t.nbytes(cfg.dtype, seq) for t in layer) for layer in recipe.state_tensors(cfg)]


def cache_bytes(recipe, cfg, batch: int, seq: int) -> tuple[int, str]:
    """What a cache of batch x seq positions holds, in bytes (layer_cache_bytes summed), and how it was counted."""
    tensors = [t for layer in recipe.state_tensors(cfg) for t in layer]
    per_token = sum(t.nbytes(cfg.dtype, 1) for t in tensors if t.per == "token")
    per_sequence = sum(t.nbytes(cfg.dtype, 1) for t in tensors if t.per == "sequence")
    counts = (f"batch {batch} x (seq {seq} x {per_token:,} bytes per token + {per_sequence:,} bytes per sequence), "
              f"summed over {cfg.n_layers} layers, each state tensor in its own dtype")
    return sum(layer_cache_bytes(recipe, cfg, batch, seq)), counts
