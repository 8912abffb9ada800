"""Checks the two DeepSeek Sparse Attention families (DeepSeek-V3.2, GLM-5) share: the indexer's scores by hand
from transformers' own submodules, a selection forced on both models, and the sizes of the state."""

from __future__ import annotations

import torch


def captured(ref, toks, modules: dict[str, str], mask=None, indexer_output=None):
    """transformers' forward with the outputs of `modules` ({key: module path}) captured; indexer_output(layer,
    out) -> replacement for each indexer's top-k (a selection forced on transformers)."""
    store, handles = {}, []
    for key, path in modules.items():
        handles.append(ref.get_submodule(path).register_forward_hook(
            lambda m, a, out, key=key: store.__setitem__(key, out)))
    if indexer_output is not None:
        for layer, block in enumerate(ref.model.layers):
            if block.self_attn.indexer is not None:
                handles.append(block.self_attn.indexer.register_forward_hook(
                    lambda m, a, out, layer=layer: indexer_output(layer, out)))
    try:
        with torch.no_grad():
            logits = ref(toks, attention_mask=mask).logits
    finally:
        for h in handles:
            h.remove()
    return logits, store


def index_scores_by_hand(ref, toks, layer: int, rotate) -> torch.Tensor:
    """The indexer's weighted relu scores [batch query key] from transformers' wq_b, k_norm and weights_proj
    outputs and its rotary tables, written out; rotate(q_rot, k_rot, cos, sin) is the family's rotary."""
    cfg = ref.config
    path = f"model.layers.{layer}.self_attn.indexer"
    _, out = captured(ref, toks, {"q": f"{path}.wq_b", "k": f"{path}.k_norm", "w": f"{path}.weights_proj",
                                  "rot": "model.rotary_emb"})
    cos, sin = out["rot"]
    b, p = toks.shape
    h, d, r = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
    q = out["q"].view(b, p, h, d)
    k = out["k"][:, :, None, :]
    q_rot, k_rot = rotate(q[..., :r], k[..., :r], cos, sin)
    q, k = torch.cat([q_rot, q[..., r:]], -1), torch.cat([k_rot, k[..., r:]], -1)[:, :, 0]
    per_head = torch.einsum("bqhd,bkd->bqhk", q.double(), k.double()).mul(d**-0.5).relu()
    return torch.einsum("bqh,bqhk->bqk", out["w"].double() * h**-0.5, per_head)


def window_selection(b: int, p: int, k: int) -> torch.Tensor:
    """Each query's k most recent keys (itself first; clamped at position 0): a choice no indexer makes."""
    query = torch.arange(p)[:, None]
    return (query - torch.arange(k)[None, :]).clamp(min=0).expand(b, p, k).contiguous()


def selection_sites(model, toks, mask=None):
    _, cache = model.run_with_cache(toks, attention_mask=mask, names_filter="*hook_index_topk")
    return [cache[f"blocks.{layer}.attn.hook_index_topk"] for layer in range(model.cfg.n_layers)]


