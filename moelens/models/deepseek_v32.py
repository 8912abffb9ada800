"""HookedDeepseekV32: DeepSeek-V3.2 (model_type deepseek_v32).

What is special about the family: DeepSeek-V3 (moelens.models.deepseek_v3: its config fields, mixture and
site map are reused) plus DeepSeek Sparse Attention on every layer (IndexedLatentAttention): a lightning indexer
beside multi-head latent attention scores every key for each query (its query from the q latent through wq_b,
its one key per position through wk and a LayerNorm with bias, a half-split rotary on the first
qk_rope_head_dim dims of each, relu(q . k) weighted per head by a float32 weights_proj), and each query attends
only to its top index_topk keys (blocks.L.attn.hook_index_scores, blocks.L.attn.hook_index_topk). The indexer's
keys are cached beside MLA's (IndexedKVState). Latent attention's own rotary is always interleaved (transformers
does not read rope_interleave for this family), and q_lora_rank is required (the indexer reads the q latent).

Like transformers, the model is the num_hidden_layers blocks: the Hub checkpoint's multi-token-prediction
layer is not part of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from moelens.config import HFConfig
from moelens.models.base import HookedTransformer
from moelens.models.components import SharedExpertMoe, SigmoidGroupedTopK
from moelens.models.components.sparse_latent_attention import IndexedLatentAttention, SharedSelectionLatentAttention
from moelens.models.deepseek_v3 import DEEPSEEK_V3_DEFAULTS, IGNORED_FIELDS, DeepseekV3Config, _layer_sites, latent_decoder_fields
from moelens.models.recipe import Dense, LayerSpec, Mixture, Recipe
from moelens.models.sites import Entry, decoder_site_map
from moelens.sitemap import Reference, SiteMap, Weight

# transformers' DeepseekV32Config defaults: DeepSeek-V3's, but for the longer context and the indexer
DEEPSEEK_V32_DEFAULTS = DEEPSEEK_V3_DEFAULTS | dict(max_position_embeddings=163840)
INDEXER_DEFAULTS = dict(index_topk=2048, index_head_dim=128, index_n_heads=64)


@dataclass(frozen=True)
class DeepseekV32Config(DeepseekV3Config):
    """DeepseekV3Config plus the indexer: its heads (index_n_heads of index_head_dim), how many keys each query
    keeps (index_topk), its rotary layout (fixed by the family) and, per layer, whether the layer runs its own
    indexer (True) or reuses the selection of the layer before (False: GLM-5's shared layers)."""

    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 64
    index_rope_interleaved: bool = False
    indexer_layers: tuple[bool, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.indexer_layers) != self.n_layers:
            raise ValueError(f"indexer_layers has {len(self.indexer_layers)} entries, the model {self.n_layers} layers")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError(
                f"index_head_dim ({self.index_head_dim}) must be at least qk_rope_head_dim ({self.qk_rope_head_dim}): "
                "the indexer turns the first qk_rope_head_dim dims of each of its heads"
            )
        if self.indexer_layers and not self.indexer_layers[0]:
            raise ValueError("layer 0 must run its own indexer: a shared layer reuses the selection of the layer before")


class HookedDeepseekV32(HookedTransformer):
    model_type = "deepseek_v32"
    index_rope_interleaved = False  # the indexer's rotary: half-split pairs (GLM-5's: interleaved)
    defaults = DEEPSEEK_V32_DEFAULTS
    indexer_defaults = INDEXER_DEFAULTS

    @classmethod
    def recipe(cls, cfg: DeepseekV32Config) -> Recipe:
        mixture, dense = Mixture(SharedExpertMoe, SigmoidGroupedTopK), Dense()
        return Recipe(tuple(
            LayerSpec(IndexedLatentAttention if indexed else SharedSelectionLatentAttention, mixture if moe else dense)
            for indexed, moe in zip(cfg.indexer_layers, cfg.moe_layers)
        ))

    @classmethod
    def site_map(cls, cfg: DeepseekV32Config) -> SiteMap:
        mtp = tuple(f"model.layers.{i}." for i in range(cfg.n_layers, cfg.n_layers + cfg.mtp_layers))
        return decoder_site_map(cfg, cls._layer_sites, mtp)

    @classmethod
    def _layer_sites(cls, cfg: DeepseekV32Config, layer: int, src: str, dst: str) -> list[Entry]:
        entries = _layer_sites(cfg, layer, src, dst)
        if cfg.indexer_layers[layer]:
            entries += indexer_weights(f"{src}.self_attn.indexer", f"{dst}.attn.indexer")
        return entries + [cls._selection_reference(layer, src, dst)]

    @staticmethod
    def _selection_reference(layer: int, src: str, dst: str) -> Reference:
        # transformers' indexer returns the top-k indices (int32) and nothing else
        return Reference(f"{dst}.attn.hook_index_topk", f"{src}.self_attn.indexer")

    @classmethod
    def config_from_hf(cls, raw: dict) -> DeepseekV32Config:
        hf = HFConfig(raw)
        fields = latent_decoder_fields(hf, raw, cls.defaults, rope_interleave=True)
        if fields["q_lora_rank"] is None:
            raise ValueError("q_lora_rank is null: DeepSeek Sparse Attention's indexer reads the q latent, set q_lora_rank")
        n_layers = fields["n_layers"]
        check_layer_kinds(hf, "mlp_layer_types", ["sparse" if moe else "dense" for moe in fields["moe_layers"]],
                          "first_k_dense_replace")
        check_layer_kinds(hf, "layer_types", ["indexed_attention"] * n_layers, "every layer's DeepSeek Sparse Attention")
        return DeepseekV32Config(
            **fields,
            family=cls.model_type,
            index_topk=hf.integer("index_topk", cls.indexer_defaults["index_topk"], at_least=1),
            index_head_dim=hf.integer("index_head_dim", cls.indexer_defaults["index_head_dim"], at_least=2),
            index_n_heads=hf.integer("index_n_heads", cls.indexer_defaults["index_n_heads"], at_least=1),
            index_rope_interleaved=cls.index_rope_interleaved,
            indexer_layers=cls.indexer_layers(hf, n_layers),
            fields_read=tuple(hf.read),
            fields_ignored=tuple(f for f in IGNORED_FIELDS if f in raw),
        )

    @classmethod
    def indexer_layers(cls, hf: HFConfig, n_layers: int) -> tuple[bool, ...]:
        return (True,) * n_layers


def check_layer_kinds(hf: HFConfig, name: str, expected: list[str], source: str) -> None:
    """transformers saves per-layer kinds it derives (mlp_layer_types, layer_types); moelens derives them from
    `source`: a config.json whose list says otherwise is refused, naming the field."""
    value = hf.opt(name)
    if value is not None and list(value) != expected:
        raise ValueError(f"{hf.label(name)} is {value}; moelens reads it from {source}, which gives {expected}")


def indexer_weights(src: str, dst: str) -> list[Entry]:
    tensors = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")
    return [Weight(f"{dst}.{t}", (f"{src}.{t}",)) for t in tensors]
