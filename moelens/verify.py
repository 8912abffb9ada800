"""Compare a moelens model with transformers' own forward on the same checkpoint, site by site.

transformers is imported only here, inside load_reference (it is an optional dependency). Which transformers
module's input or output corresponds to which moelens hook is read from the family's site map.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moelens.models.base import HookedTransformer
from moelens.models.components.softcap import softcap
from moelens.positions import positions_from_mask
from moelens.pretrained import resolve
from moelens.reference_copy import fp8_blocks, write_dequantized_copy
from moelens.sitemap import Reference


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
    reference: str = "transformers' own load of the checkpoint"

    def worst(self) -> float:
        return max([self.max_logit_diff] + [s.max_abs_diff for s in self.sites])

    def __str__(self) -> str:
        w = max(len(s.site) for s in self.sites) if self.sites else 10
        lines = [f"reference: {self.reference}", f"dtype {self.dtype}: max |logit diff| = {self.max_logit_diff:.3g}",
                 f"{'site':<{w}}  max |diff|"]
        lines += [f"{s.site:<{w}}  {s.max_abs_diff:.3g}  {s.note}" for s in self.sites]
        lines.append(f"tokens routed to a different expert set: {self.index_mismatches}")
        return "\n".join(lines)


def _capture(hf_model: torch.nn.Module, reference: Reference, store: dict) -> Callable[[], None]:
    """Store what the reference reads (moelens.sitemap.Reference): its module's input or output, plus the added
    module's output, times its multiplier, divided by its divisor (the reference's own ops, in its order and
    dtype)."""
    module = hf_model.get_submodule(reference.module)
    handles = [_capture_read(module, reference.read, store, reference.hook)]
    last = module  # the module whose forward completes the tensor
    if reference.added is not None:
        last = hf_model.get_submodule(reference.added)
        handles.append(last.register_forward_hook(
            lambda m, args, out: store.__setitem__(reference.hook, store[reference.hook] + out)).remove)
    if reference.multiplier != 1.0 or reference.divisor != 1.0 or reference.softcap is not None:
        handles.append(last.register_forward_hook(lambda m, args, out: _rescale(store, reference)).remove)

    def remove_all() -> None:
        for remove in handles:
            remove()

    return remove_all


def _rescale(store: dict, reference: Reference) -> None:
    value = store[reference.hook]
    if reference.multiplier != 1.0:
        value = value * reference.multiplier
    if reference.divisor != 1.0:
        value = value / reference.divisor
    if reference.softcap is not None:
        value = softcap(value.float(), reference.softcap)
    store[reference.hook] = value


def _capture_read(module: torch.nn.Module, what: str, store: dict, key: str) -> Callable[[], None]:
    """Store what `what` reads."""
    if what == "in":
        handle = module.register_forward_pre_hook(lambda m, args, kwargs: store.__setitem__(key, args[0] if args else kwargs["hidden_states"]), with_kwargs=True)
    elif what.startswith("in."):  # the N-th positional input (DBRX's experts: the chosen experts, their weights)
        n = int(what.split(".")[1])
        handle = module.register_forward_pre_hook(lambda m, args: store.__setitem__(key, args[n]))
    elif what == "out.heads_first":
        handle = module.register_forward_hook(lambda m, args, out: store.__setitem__(key, out.transpose(1, 2)))
    else:
        parts = what.split(".")
        index = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None
        derive = _derived(parts[2:] if index is not None else parts[1:])

        def save(m, args, out):
            store[key] = derive(out if index is None else out[index])

        handle = module.register_forward_hook(save)
    return handle.remove


def _derived(steps: list[str]) -> Callable[[torch.Tensor], torch.Tensor]:
    """The tensor a Reference's read derives from a module's output, for modules whose outputs lay out a hook's
    tensor otherwise: "topk_indices.K" / "topk_values.K", the K largest entries of dense per-expert scores
    ([tokens, experts], zero where not chosen: Llama 4's router) as the chosen experts and their weights;
    "expert_sum.E", the sum over E experts of their outputs stacked [E * tokens, d] (Llama 4's experts); "copy",
    the output copied when captured (Llama 4 then adds its routed sum into its shared expert's output in place)."""
    if not steps:
        return lambda t: t
    if steps == ["copy"]:
        return lambda t: t.clone()
    kind, n = steps[0], int(steps[1])
    if kind == "topk_indices":
        return lambda t: torch.topk(t, n, dim=-1).indices
    if kind == "topk_values":
        return lambda t: torch.topk(t, n, dim=-1).values
    if kind == "expert_sum":
        return lambda t: t.reshape(n, -1, t.shape[-1]).sum(0)
    raise ValueError(f"unknown reference read {'.'.join(steps)!r}")


def reference_forward(hf_model, references: tuple[Reference, ...], tokens, attention_mask=None, position_ids=None):
    """transformers' logits and the tensors at every reference site, keyed by moelens hook name."""
    store: dict[str, torch.Tensor] = {}
    removers = [_capture(hf_model, r, store) for r in references]
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
    references = type(model).site_map(model.cfg).references
    ref_logits, ref = reference_forward(hf_model, references, tokens, attention_mask, positions)
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
    """transformers' causal LM for this checkpoint, eager attention, default experts implementation: the class
    AutoModelForCausalLM maps its config to; where it maps none (Mistral 4), the text model's own causal LM class,
    and for a multimodal checkpoint (Mistral Small 4's) that class around the language model and head of the
    checkpoint's own class (its architectures), which is what that class runs on text."""
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(path)
        kwargs = dict(dtype=dtype, attn_implementation="eager")
        if type(config) in transformers.AutoModelForCausalLM._model_mapping:
            return transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()
        if getattr(config, "text_config", None) is None:
            return causal_lm_class(config).from_pretrained(path, **kwargs).eval()
        whole = getattr(transformers, config.architectures[0]).from_pretrained(path, **kwargs)
        return text_model_of(whole).eval()
    except Exception as err:  # transformers raises many types here; the point is to say who failed
        raise ReferenceUnavailable(
            f"transformers could not load {path} as a reference ({type(err).__name__}: {err}); moelens itself "
            "may still load it (e.g. Tencent's Hunyuan config without head_dim)"
        ) from err


def causal_lm_class(config) -> type:
    """transformers' causal LM class for a config: the one AutoModelForCausalLM maps it to, else
    `<config class name without Config>ForCausalLM` (Mistral 4's, which it does not map)."""
    import transformers

    mapping = transformers.AutoModelForCausalLM._model_mapping
    if type(config) in mapping:
        return mapping[type(config)]
    name = type(config).__name__.removesuffix("Config") + "ForCausalLM"
    if not hasattr(transformers, name):
        raise ValueError(f"transformers has no {name} for model_type {config.model_type!r}")
    return getattr(transformers, name)


def text_model_of(whole: torch.nn.Module) -> torch.nn.Module:
    """The text causal LM of a multimodal model (`model.language_model` and `lm_head`), as its own causal LM class,
    sharing the multimodal model's modules: references then name the text model's modules."""
    text_config = whole.config.text_config
    with torch.device("meta"):
        lm = causal_lm_class(text_config)(text_config)
    lm.model, lm.lm_head = whole.model.language_model, whole.lm_head
    left = [n for n, t in (*lm.named_parameters(), *lm.named_buffers()) if t.is_meta]
    if left:  # a class with parts beside its model and head: taking only those two would leave them unset
        raise ValueError(f"{type(lm).__name__} has tensors besides model and lm_head: {left[:3]}")
    return lm


FP8_REFERENCE = (
    "transformers on a float32 copy of the checkpoint whose fp8 blocks are dequantized as the format says "
    "(transformers' own fp8 dequantization misreads a dimension its block size does not divide)"
)


def verify(path, dtype: torch.dtype = torch.float32, tokens: torch.Tensor | None = None, seed: int = 0, seq_len: int = 24) -> VerifyReport:
    """Load `path` with moelens and with transformers and compare them on random tokens (2 x seq_len). For a
    block-fp8 checkpoint transformers loads a dequantized float32 copy of it (moelens.reference_copy), written
    to a temporary folder: as much disk as the dense weights in float32."""
    path = resolve(path)
    model = HookedTransformer.from_pretrained(path, dtype=dtype, progress=False)
    fmt = fp8_blocks(Path(path))
    if fmt is None:
        hf_model, reference = load_reference(path, dtype), VerifyReport.reference
    else:
        with tempfile.TemporaryDirectory(prefix="moelens-verify-") as tmp:
            hf_model = load_reference(write_dequantized_copy(Path(path), Path(tmp), fmt), dtype)
        reference = FP8_REFERENCE
    if tokens is None:
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, model.cfg.d_vocab, (2, seq_len), generator=gen)
    report = compare(model, hf_model, tokens)
    report.reference = reference
    return report
