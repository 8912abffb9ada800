"""HookedGraniteMoeShared: Granite MoE with a shared expert (model_type granitemoeshared).

What is special about the family: Granite MoE (moelens.models.granitemoe: the muP multipliers, the router, the
stacked experts' spellings) plus, where shared_intermediate_size is not 0, a shared MLP every token goes
through, added to the routed experts' output before the residual multiplier: hook_mlp_out = residual_multiplier
* (hook_routed_out + hook_shared_out). The Hub stores it as shared_mlp.input_linear [2 * d_shared, d_model]
(gate rows first, computed in one matmul and split) and shared_mlp.output_linear, beside block_sparse_moe;
moelens holds it as blocks.L.mlp.shared_expert (gate_up_proj, down_proj). With shared_intermediate_size 0 (the
config class's default) the layers are granitemoe's.
"""

from __future__ import annotations

from dataclasses import dataclass

from moelens.config import HFConfig
from moelens.models.base import HookedTransformer
from moelens.models.components import SharedExpertMoe, SparseMoe
from moelens.models.components.mlp import FusedGateUpMLP
from moelens.models.components.multiplier_attention import MultiplierScaledAttention
from moelens.models.components.router import TopKLogitsSoftmax
from moelens.models.granitemoe import GraniteMoeConfig, granite_fields, granite_layer_sites, granite_recipe, granite_site_map
from moelens.models.recipe import Recipe, decoder_recipe
from moelens.models.sites import Entry, decoder_site_map
from moelens.sitemap import Reference, SiteMap, Weight


@dataclass(frozen=True)
class GraniteMoeSharedConfig(GraniteMoeConfig):
    """GraniteMoeConfig; d_shared is shared_intermediate_size (0: no shared MLP)."""


class FusedSharedExpertMoe(SharedExpertMoe):
    """Routed experts, then a shared expert whose gate and up projections are one matrix, added ungated."""

    shared_mlp = FusedGateUpMLP


class HookedGraniteMoeShared(HookedTransformer):
    model_type = "granitemoeshared"

    @classmethod
    def recipe(cls, cfg: GraniteMoeSharedConfig) -> Recipe:
        moe = FusedSharedExpertMoe if cfg.d_shared else SparseMoe
        return granite_recipe(cfg, decoder_recipe(cfg, MultiplierScaledAttention, moe, TopKLogitsSoftmax))

    @classmethod
    def site_map(cls, cfg: GraniteMoeSharedConfig) -> SiteMap:
        return granite_site_map(cfg, decoder_site_map(cfg, shared_layer_sites, mlp_module="block_sparse_moe"))

    @classmethod
    def config_from_hf(cls, raw: dict) -> GraniteMoeSharedConfig:
        hf = HFConfig(raw)
        return GraniteMoeSharedConfig(
            **granite_fields(hf), d_shared=hf.integer("shared_intermediate_size", 0, at_least=0),
            family=cls.model_type, fields_read=tuple(hf.read),
        )


def shared_layer_sites(cfg: GraniteMoeSharedConfig, layer: int, src: str, dst: str) -> list[Entry]:
    """A layer's attention, router and experts, and its shared_mlp where d_shared is not 0."""
    if not cfg.d_shared:
        moe, m = f"{src}.block_sparse_moe", cfg.residual_multiplier
        return granite_layer_sites(cfg, layer, src, dst) + [Reference(f"{dst}.hook_mlp_out", moe, multiplier=m)]
    return granite_layer_sites(cfg, layer, src, dst) + shared_mlp_sites(cfg, src, dst)


def shared_mlp_sites(cfg: GraniteMoeConfig, src: str, dst: str) -> list[Entry]:
    """A layer's shared_mlp (input_linear: gate rows, then up rows) as blocks.L.mlp.shared_expert, and
    hook_mlp_out: residual_multiplier * (block_sparse_moe's output + shared_mlp's)."""
    moe, shared, ours = f"{src}.block_sparse_moe", f"{src}.shared_mlp", f"{dst}.mlp.shared_expert"
    return [
        Weight(f"{ours}.gate_up_proj.weight", (f"{shared}.input_linear.weight",)),
        Weight(f"{ours}.down_proj.weight", (f"{shared}.output_linear.weight",)),
        Reference(f"{ours}.hook_post", f"{shared}.output_linear", "in"),
        Reference(f"{ours}.hook_out", shared),
        Reference(f"{dst}.mlp.hook_shared_out", shared),
        # transformers adds the shared MLP's output to the mixture's, then multiplies
        Reference(f"{dst}.hook_mlp_out", moe, added=shared, multiplier=cfg.residual_multiplier),
    ]
