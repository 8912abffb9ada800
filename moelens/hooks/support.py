"""support(): the table of a model's hook points, with shapes for this model and the sites it lacks; the sites'
standard names and switches are moelens.hooks.sites'."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from moelens.hooks.names import layer_of
from moelens.hooks.sites import SITE_BY_NAME, SITES, table_name
from moelens.sitemap import SiteMap


@dataclass(frozen=True)
class SupportRow:
    name: str  # the table's: L for a block, E for an expert
    layout: str
    shape: str
    meaning: str
    standard: str
    layers: str  # which blocks have it ("all", "1,3", or "-" for model-level sites)
    reference: str = "-"  # the transformers module (and what of it) the hook equals, from the site map


@dataclass(frozen=True)
class SupportTable:
    model: str
    rows: tuple[SupportRow, ...]
    absent: tuple[str, ...]  # "site: why" lines
    config_fields: tuple[str, ...]
    ignored_fields: tuple[str, ...] = ()

    def names(self) -> list[str]:
        return [r.name for r in self.rows]

    def __str__(self) -> str:
        header = ("hook", "layout", "shape", "blocks", "standard name", "transformers", "meaning")
        lines = [header] + [(r.name, r.layout, r.shape, r.layers, r.standard, r.reference, r.meaning) for r in self.rows]
        widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
        text = [f"{self.model}: hook points"]
        for line in lines:
            text.append("  ".join(cell.ljust(w) for cell, w in zip(line, widths)) + "  " + line[-1])
        if self.absent:
            text.append("absent:")
            text += [f"  {a}" for a in self.absent]
        text.append("config.json fields read: " + ", ".join(self.config_fields))
        if self.ignored_fields:
            text.append("config.json fields present but unused (as in transformers): " + ", ".join(self.ignored_fields))
        return "\n".join(text)

    __repr__ = __str__


def _dims(model) -> dict[str, str]:
    cfg = model.cfg
    # every integer size of the config names an axis (a family's own sizes: q_lora_rank, v_head_dim, ...)
    sizes = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    dims = {name: v for name, v in sizes.items() if type(v) is int}
    dims |= {
        "d_model": cfg.d_model,
        "d_head": cfg.d_head,
        "head": cfg.n_heads,
        "kv_head": cfg.n_kv_heads,
        "d_vocab": cfg.d_vocab,
        "d_mlp": cfg.d_mlp,
        # the router's axis: every expert a slot may name, identity experts (ExpertSpec.n_identity) included
        "n_experts": cfg.expert_spec().n_routable if cfg.n_experts else cfg.n_experts,
        "d_expert": cfg.d_expert,
        "d_shared": cfg.d_shared,
        "1": 1,
    }
    # token mixers other than attention name their axes after their config's sizes (Gated DeltaNet, Mamba-2)
    mixer_axes = {"k_head": "linear_n_key_heads", "v_head": "linear_n_value_heads", "d_k": "linear_d_key",
                  "d_v": "linear_d_value", "mamba_head": "mamba_n_heads", "mamba_group": "mamba_n_groups"}
    dims |= {axis: getattr(cfg, field) for axis, field in mixer_axes.items() if hasattr(cfg, field)}
    return {k: str(v) for k, v in dims.items()}


def _shape(layout: str, dims: dict[str, str], top_k: set[int]) -> str:
    out = []
    for axis in layout.split():
        if axis == "top_k":
            out.append("|".join(str(k) for k in sorted(top_k)) or "top_k")
        else:
            out.append(dims.get(axis, axis))
    return "[" + ", ".join(out) + "]"


def _span(layers: list[int], n_layers: int) -> str:
    if not layers:
        return "-"
    return "all" if layers == list(range(n_layers)) else ",".join(map(str, layers))


def _references(site_map: SiteMap) -> dict[str, str]:
    """hook pattern -> "module (read)" of the first layer that has it, with the layer number as L."""
    out: dict[str, str] = {}
    for ref in site_map.references:
        module = re.sub(r"\.layers\.\d+(?=\.|$)", ".layers.L", ref.module)
        read = "" if ref.read == "out" else f" ({ref.read})"
        out.setdefault(table_name(ref.hook), module + read)
    return out


def support_table(model) -> SupportTable:
    cfg = model.cfg
    dims = _dims(model)
    references = _references(type(model).site_map(cfg))
    # one row per site of the table: blocks.L... for every block, blocks.L.mlp.experts.E... for every expert
    present: dict[str, list[int]] = {}
    first: dict[str, str] = {}  # site -> its first hook point's name
    for name in model.hook_dict:
        pattern = table_name(name)
        first.setdefault(pattern, name)
        layers = present.setdefault(pattern, [])
        layer = layer_of(name)
        if layer is not None and layer not in layers:
            layers.append(layer)
    # a site whose meaning differs between blocks (Llama 4's NoPE and RoPE layers) says each, with its blocks
    meanings: dict[str, dict[str, list[int]]] = {}
    for name, hook in model.hook_dict.items():
        layer = layer_of(name)
        blocks = meanings.setdefault(table_name(name), {}).setdefault(hook.meaning, [])
        if layer is not None and layer not in blocks:
            blocks.append(layer)
    rows = []
    for pattern, layers in present.items():
        site = SITE_BY_NAME.get(pattern)  # None for a hook point not of the table (an SAE's)
        hp = model.hook_dict[first[pattern]]
        meaning = hp.meaning
        if len(meanings[pattern]) > 1:
            meaning = "; ".join(f"blocks {_span(b, cfg.n_layers)}: {m}" for m, b in meanings[pattern].items())
        layout = hp.layout
        top_k = {cfg.top_k_per_layer[layer] for layer in layers} if "top_k" in layout else set()
        rows.append(
            SupportRow(
                name=pattern,
                layout=layout,
                shape=_shape(layout, dims, top_k),
                meaning=meaning,
                standard=(site.standard if site and site.standard else "-"),
                layers=_span(layers, cfg.n_layers),
                reference=references.get(pattern, "-"),
            )
        )
    # the table's sites this model lacks, or has on some blocks only
    absent = []
    dense = cfg.dense_layer_indices
    for site in SITES:
        if site.name not in present:
            why = "this family has no such site"
            if site.switch is not None:
                why = f"optional, off: model.{site.switch}(True) creates it (or says why this model cannot)"
            elif site.name.startswith("blocks.L.mlp.hook_pre") or site.name == "blocks.L.mlp.hook_post":
                why = "no dense MLP block"
            absent.append(f"{site.name}: {why}")
        elif dense and site.name.startswith("blocks.L.mlp.") and len(present[site.name]) < cfg.n_layers:
            missing = [i for i in range(cfg.n_layers) if i not in present[site.name]]
            absent.append(f"{site.name}: not on blocks {_span(missing, cfg.n_layers)} (dense MLP)")
    return SupportTable(type(model).__name__, tuple(rows), tuple(absent), cfg.fields_read, cfg.fields_ignored)
