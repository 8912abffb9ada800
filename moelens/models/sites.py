"""Pieces of site maps that several families share: the Llama-style decoder skeleton (embeddings, norms,
attention projections, dense MLP, head) and the mixture's router, experts and shared expert.

A family's site map is built from these plus whatever only it has; see moelens.sitemap for the types.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from moelens.config import MoeConfig
from moelens.sitemap import ExpertStack, FusedExperts, PerExpertKeys, Reference, SiteMap, Weight

Entry = Weight | ExpertStack | Reference
# A family's per-layer entries: (cfg, layer, checkpoint prefix "model.layers.L", moelens prefix "blocks.L")
LayerSites = Callable[[MoeConfig, int, str, str], Iterable[Entry]]

# transformers' usual per-expert names (the Hub's Qwen, Hunyuan, Solar, DeepSeek, OLMoE checkpoints)
GATE_UP_DOWN = PerExpertKeys("{e}.gate_proj.weight", "{e}.up_proj.weight", "{e}.down_proj.weight")


def decoder_site_map(
    cfg: MoeConfig, layer_sites: LayerSites, ignored_prefixes: tuple[str, ...] = (), mlp_read: str = "out",
    key_prefix: str = "", mlp_module: str = "mlp",
) -> SiteMap:
    """Embeddings, final norm, head, and per layer the two norms, the residual references and whatever the
    family's layer_sites gives (attention, MLP or mixture). mlp_read: which output of the transformers MLP
    module hook_mlp_out equals ("out.0" where it returns a tuple). key_prefix: what the checkpoint's keys start
    with before transformers' module path (a multimodal checkpoint's "language_model."; references name
    transformers' text model's modules, without it); the family's layer_sites prefixes its own keys.
    mlp_module: transformers' name of a layer's MLP / mixture module ("feed_forward" in Llama 4)."""
    entries: list[Entry] = [
        Weight("embed.weight", (f"{key_prefix}model.embed_tokens.weight",)),
        Weight("ln_final.weight", (f"{key_prefix}model.norm.weight",)),
        # a tied head is the embedding; a checkpoint that stores one anyway gets its own (as transformers)
        Weight("unembed.weight", (f"{key_prefix}lm_head.weight",), required=not cfg.tie_word_embeddings),
        Reference("ln_final.hook_normalized", "model.norm"),
        Reference("hook_logits", "lm_head"),
    ]
    for layer in range(cfg.n_layers):
        src, dst = f"model.layers.{layer}", f"blocks.{layer}"
        entries += [
            Weight(f"{dst}.ln1.weight", (f"{key_prefix}{src}.input_layernorm.weight",)),
            Weight(f"{dst}.ln2.weight", (f"{key_prefix}{src}.post_attention_layernorm.weight",)),
            Reference(f"{dst}.hook_resid_pre", src, "in"),
            Reference(f"{dst}.ln1.hook_normalized", f"{src}.input_layernorm"),
            Reference(f"{dst}.hook_attn_out", f"{src}.self_attn", "out.0"),
            Reference(f"{dst}.ln2.hook_normalized", f"{src}.post_attention_layernorm"),
            Reference(f"{dst}.hook_mlp_out", f"{src}.{mlp_module}", mlp_read),
            Reference(f"{dst}.hook_resid_post", src),
        ]
        own = list(layer_sites(cfg, layer, src, dst))
        # a layer's own reference for a hook replaces the skeleton's (a mixer module that is not self_attn)
        overridden = {e.hook for e in own if isinstance(e, Reference)}
        entries = [e for e in entries if not (isinstance(e, Reference) and e.hook in overridden)] + own
    return SiteMap(
        tuple(e for e in entries if not isinstance(e, Reference)), tuple(e for e in entries if isinstance(e, Reference)),
        ignored_prefixes,
    )


def own_blocks_site_map(cfg: MoeConfig, layer_sites: LayerSites) -> SiteMap:
    """Embeddings, final norm and head, and each layer's entries from layer_sites alone: for a family whose blocks
    are not the skeleton's (post-norm, sandwich-norm), whose layer_sites name every norm and stream reference."""
    entries: list[Entry] = [
        Weight("embed.weight", ("model.embed_tokens.weight",)),
        Weight("ln_final.weight", ("model.norm.weight",)),
        Weight("unembed.weight", ("lm_head.weight",), required=not cfg.tie_word_embeddings),
        Reference("ln_final.hook_normalized", "model.norm"),
        Reference("hook_logits", "lm_head"),
    ]
    for layer in range(cfg.n_layers):
        entries += layer_sites(cfg, layer, f"model.layers.{layer}", f"blocks.{layer}")
    return SiteMap(tuple(e for e in entries if not isinstance(e, Reference)),
                   tuple(e for e in entries if isinstance(e, Reference)))


def attention_projections(cfg: MoeConfig, src: str, dst: str) -> list[Entry]:
    """q, k, v, o projections (biases where the config has them) and the q, k, v hooks' references."""
    entries: list[Entry] = []
    for proj in "qkvo":
        entries.append(Weight(f"{dst}.attn.{proj}_proj.weight", (f"{src}.self_attn.{proj}_proj.weight",)))
        if (cfg.qkv_bias and proj != "o") or (cfg.o_bias and proj == "o"):
            entries.append(Weight(f"{dst}.attn.{proj}_proj.bias", (f"{src}.self_attn.{proj}_proj.bias",)))
        if proj != "o":
            entries.append(Reference(f"{dst}.attn.hook_{proj}", f"{src}.self_attn.{proj}_proj"))
    return entries


def gated_mlp(src: str, dst: str, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> list[Weight]:
    """A SwiGLU MLP's three projections; `names` are the checkpoint's (gate, up, down)."""
    return [Weight(f"{dst}.{ours}.weight", (f"{src}.{theirs}.weight",)) for ours, theirs in zip(("gate_proj", "up_proj", "down_proj"), names)]


def dense_mlp(src: str, dst: str) -> list[Entry]:
    return [*gated_mlp(f"{src}.mlp", f"{dst}.mlp"), Reference(f"{dst}.mlp.hook_post", f"{src}.mlp.down_proj", "in")]


def routed_experts(
    cfg: MoeConfig, src_experts: tuple[str, ...], dst: str, per_expert: tuple[PerExpertKeys, ...] = (GATE_UP_DOWN,),
    fused_gate_up: str = "gate_up_proj",
) -> ExpertStack:
    """The experts of one layer. src_experts: checkpoint prefixes the per-expert keys may sit under (first
    for the fused pair, transformers 5's); every (prefix, spelling) pair is accepted. fused_gate_up: the fused
    stack's name for W_gate_up (an ungated family's "up_proj")."""
    spellings = tuple(
        PerExpertKeys(k.gate and f"{p}.{k.gate}", f"{p}.{k.up}", f"{p}.{k.down}") for p in src_experts for k in per_expert
    )
    return ExpertStack(
        f"{dst}.mlp.experts", cfg.n_experts, cfg.d_expert, spellings,
        FusedExperts(f"{src_experts[0]}.{fused_gate_up}", f"{src_experts[0]}.down_proj"),
    )


def router_references(dst: str, gate: str) -> list[Reference]:
    """For a transformers router module returning (logits, top-k weights, top-k indices)."""
    return [
        Reference(f"{dst}.mlp.hook_router_logits", gate, "out.0"),
        Reference(f"{dst}.mlp.hook_expert_weights", gate, "out.1"),
        Reference(f"{dst}.mlp.hook_expert_indices", gate, "out.2"),
    ]
