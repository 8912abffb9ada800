"""Compare a moelens model with transformers' own forward on the same checkpoint, site by site.

transformers is imported only here (it is an optional dependency). Each family lists its reference sites:
which transformers module's input or output corresponds to which moelens hook.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from moelens.positions import positions_from_mask

# A reference site: (moelens hook pattern with L, module path under the transformers decoder layer
# (or under the model for model-level sites), what to read: "in" | "out" | "out.N" | "out.heads_first"
# (an output laid out [batch head pos d_head], shown as moelens's [batch pos head d_head]).
RefSite = tuple[str, str, str]

LLAMA_LIKE_SITES: tuple[RefSite, ...] = (
    ("blocks.L.hook_resid_pre", "", "in"),
    ("blocks.L.ln1.hook_normalized", "input_layernorm", "out"),
    ("blocks.L.attn.hook_q", "self_attn.q_proj", "out"),
    ("blocks.L.attn.hook_k", "self_attn.k_proj", "out"),
    ("blocks.L.attn.hook_v", "self_attn.v_proj", "out"),
    ("blocks.L.hook_attn_out", "self_attn", "out.0"),
    ("blocks.L.ln2.hook_normalized", "post_attention_layernorm", "out"),
    ("blocks.L.hook_mlp_out", "mlp", "out"),
    ("blocks.L.hook_resid_post", "", "out"),
    ("ln_final.hook_normalized", "model.norm", "out"),
    ("hook_logits", "lm_head", "out"),
)


def moe_reference_sites(gate: str, experts: str, shared_expert: str) -> tuple[RefSite, ...]:
    """The mixture's sites, for a family whose router returns (logits, weights, indices)."""
    return (
        ("blocks.L.mlp.hook_router_logits", gate, "out.0"),
        ("blocks.L.mlp.hook_expert_weights", gate, "out.1"),
        ("blocks.L.mlp.hook_expert_indices", gate, "out.2"),
        ("blocks.L.mlp.hook_routed_out", experts, "out"),
        ("blocks.L.mlp.shared_expert.hook_out", shared_expert, "out"),
    )


@dataclass
class SiteDiff:
    site: str
    max_abs_diff: float
    note: str = ""


@dataclass
class VerifyReport:
    dtype: torch.dtype
    max_logit_diff: float
    sites: list[SiteDiff] = field(default_factory=list)
    index_mismatches: int = 0  # tokens whose chosen expert set differs

    def worst(self) -> float:
        return max([self.max_logit_diff] + [s.max_abs_diff for s in self.sites])

    def __str__(self) -> str:
        w = max(len(s.site) for s in self.sites) if self.sites else 10
        lines = [f"dtype {self.dtype}: max |logit diff| = {self.max_logit_diff:.3g}", f"{'site':<{w}}  max |diff|"]
        lines += [f"{s.site:<{w}}  {s.max_abs_diff:.3g}  {s.note}" for s in self.sites]
        lines.append(f"tokens routed to a different expert set: {self.index_mismatches}")
        return "\n".join(lines)


def _capture(module: torch.nn.Module, what: str, store: dict, key: str) -> Callable[[], None]:
    if what == "in":
        handle = module.register_forward_pre_hook(lambda m, args, kwargs: store.__setitem__(key, args[0] if args else kwargs["hidden_states"]), with_kwargs=True)
    elif what == "out.heads_first":
        handle = module.register_forward_hook(lambda m, args, out: store.__setitem__(key, out.transpose(1, 2)))
    else:
        index = int(what.split(".")[1]) if "." in what else None

        def save(m, args, out):
            store[key] = out if index is None else out[index]

        handle = module.register_forward_hook(save)
    return handle.remove


def reference_forward(hf_model, family, tokens, attention_mask=None, position_ids=None) -> tuple[torch.Tensor, dict]:
    """transformers' logits and the tensors at every reference site, keyed by moelens hook name."""
    store: dict[str, torch.Tensor] = {}
    removers = []
    sites = LLAMA_LIKE_SITES + tuple(family.reference_sites)
    n_layers = hf_model.config.num_hidden_layers
    for pattern, path, what in sites:
        if "blocks.L." in pattern:
            for layer in range(n_layers):
                base = hf_model.model.layers[layer]
                try:
                    module = base.get_submodule(path) if path else base
                except AttributeError:
                    continue  # e.g. a dense block has no router
                removers.append(_capture(module, what, store, pattern.replace("blocks.L.", f"blocks.{layer}.")))
        else:
            removers.append(_capture(hf_model.get_submodule(path), what, store, pattern))
    try:
        with torch.no_grad():
            out = hf_model(input_ids=tokens, attention_mask=attention_mask, position_ids=position_ids)
    finally:
        for remove in removers:
            remove()
    return out.logits, store


def compare(model, hf_model, tokens, attention_mask=None) -> VerifyReport:
    """Run both models on the same tokens and report max differences (float64 arithmetic)."""
    positions = None
    if attention_mask is not None:  # transformers' plain forward does not derive positions from the mask
        positions = positions_from_mask(attention_mask)
    ref_logits, ref = reference_forward(hf_model, type(model), tokens, attention_mask, positions)
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens, attention_mask=attention_mask, names_filter=list(ref))
    keep = torch.ones(tokens.shape, dtype=torch.bool) if attention_mask is None else attention_mask.bool()

    def diff(a: torch.Tensor, b: torch.Tensor) -> float:
        a = a.double().reshape(b.shape)
        b = b.double()
        return (a - b)[keep.reshape(keep.shape + (1,) * (b.dim() - 2))
                       .expand(b.shape)].abs().max().item()

    report = VerifyReport(model.cfg.dtype, diff(ref_logits, logits))
    mismatched = torch.zeros_like(keep)
    for name in sorted(ref, key=_site_order):
        ours = cache[name]
        theirs = ref[name].reshape(ours.shape)
        if name.endswith("hook_expert_indices"):
            same = (theirs.sort(-1).values == ours.sort(-1).values).all(-1)
            mismatched |= ~same & keep
            report.sites.append(SiteDiff(name, float((~same & keep).sum()), "tokens with another expert set"))
            continue
        if name.endswith("hook_expert_weights"):  # compare slot weights in expert order (Solar's order is free)
            idx_name = name.replace("hook_expert_weights", "hook_expert_indices")
            theirs = theirs.gather(-1, ref[idx_name].reshape(ours.shape).argsort(-1))
            ours = ours.gather(-1, cache[idx_name].argsort(-1))
        note = "" if theirs.dtype == ours.dtype else f"dtype {ours.dtype} vs reference {theirs.dtype}"
        report.sites.append(SiteDiff(name, diff(theirs, ours), note))
    report.index_mismatches = int(mismatched.sum())
    return report


def _site_order(name: str) -> tuple[int, str]:
    parts = name.split(".")
    return (int(parts[1]) if parts[0] == "blocks" else (-1 if "embed" in name else 10**6), name)


class ReferenceUnavailable(RuntimeError):
    """transformers cannot load this checkpoint (a config spelling it does not read, a family it lacks)."""


def load_reference(path, dtype: torch.dtype = torch.float32):
    """transformers' model for this checkpoint, eager attention, default experts implementation."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()
    except Exception as err:  # transformers raises many types here; the point is to say who failed
        raise ReferenceUnavailable(
            f"transformers could not load {path} as a reference ({type(err).__name__}: {err}); moelens itself "
            "may still load it (e.g. Tencent's Hunyuan config without head_dim)"
        ) from err


def verify(path, dtype: torch.dtype = torch.float32, tokens: torch.Tensor | None = None, seed: int = 0, seq_len: int = 24) -> VerifyReport:
    """Load `path` with moelens and with transformers and compare them on random tokens (2 x seq_len)."""
    from moelens import HookedTransformer
    from moelens.loaders.hub import resolve_checkpoint

    path = resolve_checkpoint(path)
    model = HookedTransformer.from_pretrained(path, dtype=dtype, progress=False)
    hf_model = load_reference(path, dtype)
    if tokens is None:
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, model.cfg.d_vocab, (2, seq_len), generator=gen)
    return compare(model, hf_model, tokens)
