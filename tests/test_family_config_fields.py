"""Each family's config_from_hf: what it makes of its tiny checkpoint's config.json (as transformers writes
it, trimmed to the fields moelens looks at), written out by hand, field by field; the exact set of config.json
fields it reads (fields_read, which support() prints) and the ones it reports present but unused; the same
config from the Hub's spelling of the rotary (rope_theta / rope_scaling at the top level); and, from a config.json
with only the fields a family requires, transformers' defaults for the rest."""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import NamedTuple

import pytest
from transformers import AutoConfig

from moelens.config import RopeConfig
from moelens.models import FAMILIES


class Case(NamedTuple):
    raw: dict
    fields: dict  # the config's fields that differ from its class's defaults (family, bookkeeping aside)
    read: list[str]  # every config.json field the family looks up, present or not
    ignored: tuple[str, ...]  # present, and reported unused


CASES = {
    "qwen2_moe": Case(
        raw={"decoder_sparse_step": 1, "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 80,
            "max_position_embeddings": 256, "mlp_only_layers": [], "moe_intermediate_size": 32, "norm_topk_prob": False,
            "num_attention_heads": 4, "num_experts": 8, "num_experts_per_tok": 3, "num_hidden_layers": 3,
            "num_key_value_heads": 2, "qkv_bias": True, "rms_norm_eps": 1e-06, "rope_parameters": {"rope_theta": 1000.0,
            "rope_type": "default"}, "shared_expert_intermediate_size": 48, "tie_word_embeddings": False,
            "use_sliding_window": False, "vocab_size": 96},
        fields=dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_head=16, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=1000.0), max_position_embeddings=256, qkv_bias=True, d_mlp=80, moe_layers=(True, True,
            True), n_experts=8, top_k_per_layer=(3, 3, 3), d_expert=32, d_shared=48),
        read=["decoder_sparse_step", "head_dim", "hidden_act", "hidden_size", "intermediate_size",
            "max_position_embeddings", "mlp_only_layers", "moe_intermediate_size", "norm_topk_prob",
            "num_attention_heads", "num_experts", "num_experts_per_tok", "num_hidden_layers", "num_key_value_heads",
            "partial_rotary_factor", "qkv_bias", "rms_norm_eps", "rope_parameters", "rope_scaling", "rope_theta",
            "shared_expert_intermediate_size", "tie_word_embeddings", "use_sliding_window", "vocab_size"],
        ignored=(),
    ),
    "hunyuan_v1_moe": Case(
        raw={"attention_bias": False, "head_dim": 16, "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 32,
            "max_position_embeddings": 256, "moe_topk": [2, 3, 1], "num_attention_heads": 4, "num_experts": 8,
            "num_hidden_layers": 3, "num_key_value_heads": 2, "rms_norm_eps": 1e-05, "rope_parameters": {"alpha":
            1000.0, "factor": 1.0, "rope_theta": 10000.0, "rope_type": "dynamic"}, "tie_word_embeddings": True,
            "vocab_size": 96},
        # NTK alpha: theta * alpha ** (d_head / (d_head - 2))
        fields=dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_head=16, d_vocab=96, norm_eps=1e-05,
            rope=RopeConfig(theta=10000.0 * 1000.0 ** (16 / 14)), max_position_embeddings=256,
            moe_layers=(True, True, True), n_experts=8, top_k_per_layer=(2, 3, 1), d_expert=32, d_shared=32, norm_topk_prob=True,
            tie_word_embeddings=True),
        read=["attention_bias", "head_dim", "hidden_act", "hidden_size", "intermediate_size", "max_position_embeddings",
            "moe_topk", "num_attention_heads", "num_experts", "num_hidden_layers", "num_key_value_heads",
            "rms_norm_eps", "rope_parameters", "rope_scaling", "rope_theta", "tie_word_embeddings", "vocab_size"],
        ignored=(),
    ),
    "solar_open": Case(
        raw={"attention_bias": True, "head_dim": 16, "hidden_act": "silu", "hidden_size": 64, "max_position_embeddings":
            256, "moe_intermediate_size": 24, "n_group": 4, "n_routed_experts": 8, "n_shared_experts": 2,
            "norm_topk_prob": False, "num_attention_heads": 4, "num_experts_per_tok": 3, "num_hidden_layers": 3,
            "num_key_value_heads": 2, "rms_norm_eps": 1e-05, "rope_parameters": {"factor": 4.0,
            "original_max_position_embeddings": 16, "rope_theta": 10000.0, "rope_type": "yarn"},
            "routed_scaling_factor": 2.5, "tie_word_embeddings": False, "topk_group": 2, "vocab_size": 96},
        fields=dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_head=16, d_vocab=96, norm_eps=1e-05,
            rope=RopeConfig(theta=10000.0, kind="yarn", factor=4.0, original_max_position_embeddings=16),
            max_position_embeddings=256, qkv_bias=True, moe_layers=(True, True, True), n_experts=8, top_k_per_layer=(3, 3, 3),
            d_expert=24, d_shared=48, routed_scaling_factor=2.5, n_group=4, topk_group=2),
        read=["attention_bias", "head_dim", "hidden_act", "hidden_size", "max_position_embeddings",
            "moe_intermediate_size", "n_group", "n_routed_experts", "n_shared_experts", "norm_topk_prob",
            "num_attention_heads", "num_experts_per_tok", "num_hidden_layers", "num_key_value_heads",
            "partial_rotary_factor", "rms_norm_eps", "rope_parameters", "rope_scaling", "rope_theta",
            "routed_scaling_factor", "tie_word_embeddings", "topk_group", "vocab_size"],
        ignored=(),
    ),
    "qwen3_moe": Case(
        raw={"attention_bias": False, "decoder_sparse_step": 1, "head_dim": 24, "hidden_act": "silu", "hidden_size": 64,
            "intermediate_size": 80, "max_position_embeddings": 256, "mlp_only_layers": [], "moe_intermediate_size": 32,
            "norm_topk_prob": True, "num_attention_heads": 4, "num_experts_per_tok": 3, "num_hidden_layers": 3,
            "num_key_value_heads": 2, "num_local_experts": 8, "rms_norm_eps": 1e-06, "rope_parameters": {"rope_theta":
            1000.0, "rope_type": "default"}, "sliding_window": None, "tie_word_embeddings": False, "use_sliding_window":
            False, "vocab_size": 96},
        fields=dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_head=24, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=1000.0), max_position_embeddings=256, d_mlp=80, moe_layers=(True, True, True),
            n_experts=8, top_k_per_layer=(3, 3, 3), d_expert=32, norm_topk_prob=True),
        read=["attention_bias", "decoder_sparse_step", "head_dim", "hidden_act", "hidden_size", "intermediate_size",
            "max_position_embeddings", "mlp_only_layers", "moe_intermediate_size", "norm_topk_prob",
            "num_attention_heads", "num_experts", "num_experts_per_tok", "num_hidden_layers", "num_key_value_heads",
            "num_local_experts", "partial_rotary_factor", "rms_norm_eps", "rope_parameters", "rope_scaling",
            "rope_theta", "tie_word_embeddings", "use_sliding_window", "vocab_size"],
        ignored=("sliding_window",),
    ),
    "mixtral": Case(
        raw={"head_dim": None, "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 32,
            "max_position_embeddings": 256, "num_attention_heads": 4, "num_experts_per_tok": 2, "num_hidden_layers": 3,
            "num_key_value_heads": 2, "num_local_experts": 8, "rms_norm_eps": 1e-05, "rope_parameters": {"rope_theta":
            1000.0, "rope_type": "default"}, "sliding_window": None, "tie_word_embeddings": False, "vocab_size": 96},
        fields=dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_head=16, d_vocab=96, norm_eps=1e-05,
            rope=RopeConfig(theta=1000.0), max_position_embeddings=256, attention_windows=(None, None, None),
            moe_layers=(True, True, True), n_experts=8, top_k_per_layer=(2, 2, 2), d_expert=32, norm_topk_prob=True),
        read=["head_dim", "hidden_act", "hidden_size", "intermediate_size", "max_position_embeddings",
            "num_attention_heads", "num_experts_per_tok", "num_hidden_layers", "num_key_value_heads",
            "num_local_experts", "partial_rotary_factor", "rms_norm_eps", "rope_parameters", "rope_scaling",
            "rope_theta", "sliding_window", "tie_word_embeddings", "vocab_size"],
        ignored=(),
    ),
    "phimoe": Case(
        raw={"attention_bias": True, "attention_dropout": 0.0, "hidden_act": "silu", "hidden_size": 64,
            "input_jitter_noise": 0.0, "intermediate_size": 32, "lm_head_bias": True, "max_position_embeddings": 256,
            "num_attention_heads": 4, "num_experts_per_tok": 2, "num_hidden_layers": 3, "num_key_value_heads": 2,
            "num_local_experts": 8, "rms_norm_eps": 1e-05, "rope_parameters": {"long_factor": [2.0, 3.0, 4.0, 5.0,
            6.0, 7.0, 8.0, 9.0], "long_mscale": 1.5, "original_max_position_embeddings": 200, "rope_theta": 1000.0,
            "rope_type": "longrope", "short_factor": [1.0, 1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 2.75], "short_mscale":
            1.25}, "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.3, "sliding_window": None,
            "tie_word_embeddings": False, "vocab_size": 96},
        # LongRoPE's factor where config.json has none: max_position_embeddings / original_max_position_embeddings
        fields=dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_head=16, d_vocab=96, norm_eps=1e-05,
            rope=RopeConfig(theta=1000.0, kind="longrope", factor=256 / 200, original_max_position_embeddings=200,
            short_factor=(1.0, 1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 2.75), long_factor=(2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0,
            9.0), short_mscale=1.25, long_mscale=1.5), max_position_embeddings=256, qkv_bias=True, o_bias=True,
            attention_windows=(None, None, None), moe_layers=(True, True, True), n_experts=8, top_k_per_layer=(2, 2, 2),
            d_expert=32, router_jitter_noise=0.3, unembed_bias=True),
        read=["attention_bias", "head_dim", "hidden_act", "hidden_size", "intermediate_size", "lm_head_bias",
            "max_position_embeddings", "num_attention_heads", "num_experts_per_tok", "num_hidden_layers",
            "num_key_value_heads", "num_local_experts", "partial_rotary_factor", "rms_norm_eps", "rope_parameters",
            "rope_scaling", "rope_theta", "router_jitter_noise", "sliding_window", "tie_word_embeddings", "vocab_size"],
        ignored=("input_jitter_noise", "router_aux_loss_coef", "attention_dropout"),
    ),
    "olmoe": Case(
        raw={"attention_bias": False, "clip_qkv": None, "hidden_act": "silu", "hidden_size": 64, "intermediate_size":
            32, "max_position_embeddings": 256, "norm_topk_prob": False, "num_attention_heads": 4, "num_experts": 8,
            "num_experts_per_tok": 3, "num_hidden_layers": 3, "num_key_value_heads": 2, "rms_norm_eps": 1e-05,
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "tie_word_embeddings": False,
            "vocab_size": 96},
        fields=dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_head=16, d_vocab=96, norm_eps=1e-05,
            rope=RopeConfig(theta=10000.0), max_position_embeddings=256, moe_layers=(True, True, True), n_experts=8,
            top_k_per_layer=(3, 3, 3), d_expert=32),
        read=["attention_bias", "clip_qkv", "head_dim", "hidden_act", "hidden_size", "intermediate_size",
            "max_position_embeddings", "norm_topk_prob", "num_attention_heads", "num_experts", "num_experts_per_tok",
            "num_hidden_layers", "num_key_value_heads", "partial_rotary_factor", "rms_norm_eps", "rope_parameters",
            "rope_scaling", "rope_theta", "tie_word_embeddings", "vocab_size"],
        ignored=(),
    ),
    "dbrx": Case(
        # the nested sections as transformers writes them (their bookkeeping trimmed); attn_config.rope_theta is
        # there, ignored, as transformers ignores it
        raw={"attn_config": {"attn_pdrop": 0.0, "clip_qkv": 0.6, "kv_n_heads": 2, "rope_theta": 10000.0},
            "d_model": 64, "emb_pdrop": 0.0, "ffn_config": {"ffn_act_fn": {"name": "silu"}, "ffn_hidden_size": 32,
            "hidden_size": 64, "moe_jitter_eps": None, "moe_loss_weight": 0.01, "moe_normalize_expert_weights": 1.0,
            "moe_num_experts": 8, "moe_top_k": 3}, "max_seq_len": 256, "n_heads": 4, "n_layers": 3,
            "num_key_value_heads": 2, "resid_pdrop": 0.0, "rope_parameters": {"rope_theta": 10000.0, "rope_type":
            "default"}, "tie_word_embeddings": False, "vocab_size": 96},
        fields=dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_head=16, d_vocab=96, norm_eps=1e-05,
            rope=RopeConfig(theta=10000.0), max_position_embeddings=256, moe_layers=(True, True, True), n_experts=8,
            top_k_per_layer=(3, 3, 3), d_expert=32, topk_norm_p=1.0, clip_qkv=0.6),
        read=["attn_config", "attn_config.clip_qkv", "attn_config.kv_n_heads", "d_model", "ffn_config",
            "ffn_config.ffn_act_fn", "ffn_config.ffn_hidden_size", "ffn_config.moe_normalize_expert_weights",
            "ffn_config.moe_num_experts", "ffn_config.moe_top_k", "head_dim", "max_seq_len", "n_heads", "n_layers",
            "partial_rotary_factor", "rope_parameters", "rope_scaling", "rope_theta", "tie_word_embeddings",
            "vocab_size"],
        ignored=("resid_pdrop", "emb_pdrop", "attn_config.attn_pdrop", "ffn_config.moe_loss_weight",
            "attn_config.rope_theta"),
    ),
    "deepseek_v3": Case(
        raw={"attention_bias": False, "first_k_dense_replace": 1, "head_dim": 8, "hidden_act": "silu", "hidden_size":
            64, "intermediate_size": 80, "kv_lora_rank": 16, "max_position_embeddings": 256, "moe_intermediate_size":
            24, "n_group": 4, "n_routed_experts": 8, "n_shared_experts": 2, "norm_topk_prob": True,
            "num_attention_heads": 4, "num_experts_per_tok": 3, "num_hidden_layers": 3, "num_key_value_heads": 4,
            "num_nextn_predict_layers": 1, "q_lora_rank": 24, "qk_nope_head_dim": 12, "qk_rope_head_dim": 8,
            "rms_norm_eps": 1e-06, "rope_interleave": True, "rope_parameters": {"beta_fast": 32.0, "beta_slow": 1.0,
            "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 16, "rope_theta":
            10000.0, "rope_type": "yarn"}, "routed_scaling_factor": 2.5, "tie_word_embeddings": False, "topk_group": 2,
            "v_head_dim": 10, "vocab_size": 96},
        fields=dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=4, d_head=20, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=10000.0, kind="yarn", factor=4.0, original_max_position_embeddings=16, mscale=1.0,
            mscale_all_dim=1.0, interleaved=True), max_position_embeddings=256, d_mlp=80, moe_layers=(False, True,
            True), n_experts=8, top_k_per_layer=(0, 3, 3), d_expert=24, d_shared=48, norm_topk_prob=True,
            routed_scaling_factor=2.5, n_group=4, topk_group=2, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12,
            qk_rope_head_dim=8, v_head_dim=10, first_k_dense_replace=1, mtp_layers=1),
        read=["attention_bias", "first_k_dense_replace", "hidden_act", "hidden_size", "intermediate_size",
            "kv_lora_rank", "max_position_embeddings", "moe_intermediate_size", "n_group", "n_routed_experts",
            "n_shared_experts", "norm_topk_prob", "num_attention_heads", "num_experts_per_tok", "num_hidden_layers",
            "num_key_value_heads", "num_nextn_predict_layers", "partial_rotary_factor", "q_lora_rank",
            "qk_nope_head_dim", "qk_rope_head_dim", "rms_norm_eps", "rope_interleave", "rope_parameters",
            "rope_scaling", "rope_theta", "routed_scaling_factor", "tie_word_embeddings", "topk_group", "v_head_dim",
            "vocab_size"],
        ignored=("head_dim",),
    ),
    "mistral4": Case(
        # as transformers writes it: head_dim and qk_head_dim (both qk_nope_head_dim + qk_rope_head_dim, set by it),
        # the rotary's partial_rotary_factor (8 of the 20-wide head) and the queries' scaling by position in it
        raw={"attention_bias": False, "first_k_dense_replace": 1, "head_dim": 20, "hidden_act": "silu", "hidden_size":
            64, "intermediate_size": 80, "kv_lora_rank": 16, "max_position_embeddings": 256, "moe_intermediate_size": 24,
            "n_group": 1, "n_routed_experts": 8, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 4,
            "num_experts_per_tok": 3, "num_hidden_layers": 3, "num_key_value_heads": 4, "q_lora_rank": 24,
            "qk_head_dim": 20, "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "rms_norm_eps": 1e-06,
            "rope_interleave": True, "rope_parameters": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 4.0,
            "llama_4_scaling_beta": 0.4, "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 16,
            "partial_rotary_factor": 0.4, "rope_theta": 10000.0, "rope_type": "yarn"}, "routed_scaling_factor": 1.0,
            "tie_word_embeddings": False, "topk_group": 1, "v_head_dim": 10, "vocab_size": 96},
        fields=dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=4, d_head=20, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=10000.0, kind="yarn", factor=4.0, original_max_position_embeddings=16, mscale=1.0,
            mscale_all_dim=1.0, interleaved=True), max_position_embeddings=256, d_mlp=80, moe_layers=(False, True,
            True), n_experts=8, top_k_per_layer=(0, 3, 3), d_expert=24, d_shared=24, norm_topk_prob=True,
            routed_scaling_factor=1.0, n_group=1, topk_group=1, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12,
            qk_rope_head_dim=8, v_head_dim=10, first_k_dense_replace=1, query_scaling_beta=0.4,
            query_scaling_period=16),
        read=["attention_bias", "first_k_dense_replace", "hidden_act", "hidden_size", "intermediate_size",
            "kv_lora_rank", "max_position_embeddings", "moe_intermediate_size", "n_group", "n_routed_experts",
            "n_shared_experts", "norm_topk_prob", "num_attention_heads", "num_experts_per_tok", "num_hidden_layers",
            "num_key_value_heads", "partial_rotary_factor", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
            "rms_norm_eps", "rope_interleave", "rope_parameters", "rope_scaling", "rope_theta", "routed_scaling_factor",
            "tie_word_embeddings", "topk_group", "v_head_dim", "vocab_size"],
        ignored=("head_dim", "qk_head_dim"),
    ),
    "sarvam_mla": Case(
        # as transformers writes it: DeepSeek-V3's names; the legacy head_dim (the latent cache's width) unused
        raw={"attention_bias": False, "first_k_dense_replace": 1, "head_dim": 8, "hidden_act": "silu", "hidden_size":
            64, "intermediate_size": 80, "kv_lora_rank": 16, "max_position_embeddings": 256, "moe_intermediate_size":
            24, "n_group": 1, "n_routed_experts": 8, "n_shared_experts": 1, "norm_topk_prob": True,
            "num_attention_heads": 4, "num_experts_per_tok": 3, "num_hidden_layers": 3, "num_key_value_heads": 4,
            "num_nextn_predict_layers": 0, "q_lora_rank": None, "qk_nope_head_dim": 12, "qk_rope_head_dim": 8,
            "rms_norm_eps": 1e-06, "rope_interleave": True, "rope_parameters": {"beta_fast": 32.0, "beta_slow": 1.0,
            "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 16, "rope_theta":
            10000.0, "rope_type": "yarn"}, "routed_scaling_factor": 2.5, "tie_word_embeddings": False, "topk_group": 1,
            "v_head_dim": 10, "vocab_size": 96},
        fields=dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=4, d_head=20, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=10000.0, kind="yarn", factor=4.0, original_max_position_embeddings=16, mscale=1.0,
            mscale_all_dim=1.0, interleaved=True), max_position_embeddings=256, d_mlp=80, moe_layers=(False, True,
            True), n_experts=8, top_k_per_layer=(0, 3, 3), d_expert=24, d_shared=24, norm_topk_prob=True,
            routed_scaling_factor=2.5, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10,
            first_k_dense_replace=1),
        read=["attention_bias", "first_k_dense_replace", "hidden_act", "hidden_size", "intermediate_size",
            "kv_lora_rank", "max_position_embeddings", "moe_intermediate_size", "n_group", "n_routed_experts",
            "n_shared_experts", "norm_topk_prob", "num_attention_heads", "num_experts_per_tok", "num_hidden_layers",
            "num_key_value_heads", "num_nextn_predict_layers", "partial_rotary_factor", "q_lora_rank",
            "qk_nope_head_dim", "qk_rope_head_dim", "rms_norm_eps", "rope_interleave", "rope_parameters",
            "rope_scaling", "rope_theta", "routed_scaling_factor", "tie_word_embeddings", "topk_group", "v_head_dim",
            "vocab_size"],
        ignored=("head_dim",),
    ),
    "afmoe": Case(
        raw={"attention_bias": False, "global_attn_every_n_layers": 2, "head_dim": 16, "hidden_act": "silu",
            "hidden_size": 64, "intermediate_size": 80, "layer_types": ["sliding_attention", "full_attention",
            "sliding_attention"], "max_position_embeddings": 256, "moe_intermediate_size": 24, "mup_enabled": True,
            "num_attention_heads": 4, "num_dense_layers": 1, "num_experts": 8, "num_experts_per_tok": 3,
            "num_hidden_layers": 3, "num_key_value_heads": 2, "num_shared_experts": 2, "rms_norm_eps": 1e-05,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "route_scale": 2.5, "sliding_window": 5,
            "tie_word_embeddings": False, "vocab_size": 96},
        fields=dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_head=16, d_vocab=96, norm_eps=1e-05,
            rope=RopeConfig(theta=10000.0), max_position_embeddings=256, attention_windows=(5, None, 5), d_mlp=80,
            moe_layers=(False, True, True), n_experts=8, top_k_per_layer=(0, 3, 3), d_expert=24, d_shared=48,
            norm_topk_prob=True, routed_scaling_factor=2.5, rotary_layers=(True, False, True), embedding_multiplier=8.0),
        read=["attention_bias", "head_dim", "hidden_act", "hidden_size", "intermediate_size", "layer_types",
            "max_position_embeddings", "moe_intermediate_size", "mup_enabled", "num_attention_heads", "num_dense_layers",
            "num_experts", "num_experts_per_tok", "num_hidden_layers", "num_key_value_heads", "num_shared_experts",
            "partial_rotary_factor", "rms_norm_eps", "rope_parameters", "rope_scaling", "rope_theta", "route_scale",
            "sliding_window", "tie_word_embeddings", "vocab_size"],
        ignored=("global_attn_every_n_layers",),
    ),
    "beam": Case(
        raw={"attention_bias": False, "attention_dropout": 0.0, "final_logit_softcapping": 3.0, "head_dim": 16,
            "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 80, "layer_types": ["sliding_attention",
            "full_attention", "sliding_attention", "full_attention"], "max_position_embeddings": 256,
            "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"], "moe_intermediate_size": 24, "n_group": 4,
            "norm_topk_prob": True, "num_attention_heads": 4, "num_experts": 8, "num_experts_per_tok": 3,
            "num_hidden_layers": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_parameters":
            {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}, "full_attention": None},
            "routed_scaling_factor": 2.5, "sliding_window": 5, "tie_word_embeddings": False, "topk_group": 2,
            "vocab_size": 96},
        fields=dict(d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_head=16, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=10000.0), max_position_embeddings=256, attention_windows=(5, None, 5, None), d_mlp=80,
            moe_layers=(False, True, True, True), n_experts=8, top_k_per_layer=(0, 3, 3, 3), d_expert=24,
            norm_topk_prob=True, routed_scaling_factor=2.5, n_group=4, topk_group=2,
            layer_ropes=(RopeConfig(theta=10000.0), None, RopeConfig(theta=10000.0), None), final_logit_softcapping=3.0),
        read=["attention_bias", "final_logit_softcapping", "head_dim", "hidden_act", "hidden_size", "intermediate_size",
            "layer_types", "max_position_embeddings", "mlp_layer_types", "moe_intermediate_size", "n_group",
            "norm_topk_prob", "num_attention_heads", "num_experts", "num_experts_per_tok", "num_hidden_layers",
            "num_key_value_heads", "rms_norm_eps", "rope_parameters", "routed_scaling_factor", "sliding_window",
            "tie_word_embeddings", "topk_group", "vocab_size"],
        ignored=("attention_dropout",),
    ),
    "glm4_moe_lite": Case(
        # transformers 5's spelling (mlp_layer_types) beside the Hub's first_k_dense_replace, which agrees
        raw={"attention_bias": False, "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 64,
            "intermediate_size": 80, "kv_lora_rank": 16, "max_position_embeddings": 256, "mlp_layer_types": ["dense",
            "sparse", "sparse"], "moe_intermediate_size": 24, "n_group": 1, "n_routed_experts": 8, "n_shared_experts": 1,
            "norm_topk_prob": True, "num_attention_heads": 4, "num_experts_per_tok": 3, "num_hidden_layers": 3,
            "num_key_value_heads": 4, "q_lora_rank": 24, "qk_nope_head_dim": 12, "qk_rope_head_dim": 8,
            "rms_norm_eps": 1e-05, "rope_interleave": True, "rope_parameters": {"rope_theta": 1000.0, "rope_type":
            "default"}, "routed_scaling_factor": 1.8, "tie_word_embeddings": False, "topk_group": 1, "v_head_dim": 10,
            "vocab_size": 96},
        fields=dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=4, d_head=20, d_vocab=96, norm_eps=1e-05,
            rope=RopeConfig(theta=1000.0, interleaved=True), max_position_embeddings=256, d_mlp=80, moe_layers=(False,
            True, True), n_experts=8, top_k_per_layer=(0, 3, 3), d_expert=24, d_shared=24, norm_topk_prob=True,
            routed_scaling_factor=1.8, n_group=1, topk_group=1, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12,
            qk_rope_head_dim=8, v_head_dim=10, first_k_dense_replace=1, mtp_layers=0),
        read=["attention_bias", "hidden_act", "hidden_size", "intermediate_size", "kv_lora_rank",
            "max_position_embeddings", "mlp_layer_types", "moe_intermediate_size", "n_group", "n_routed_experts",
            "n_shared_experts", "norm_topk_prob", "num_attention_heads", "num_experts_per_tok", "num_hidden_layers",
            "num_key_value_heads", "num_nextn_predict_layers", "partial_rotary_factor", "q_lora_rank",
            "qk_nope_head_dim", "qk_rope_head_dim", "rms_norm_eps", "rope_interleave", "rope_parameters",
            "rope_scaling", "rope_theta", "routed_scaling_factor", "tie_word_embeddings", "topk_group", "v_head_dim",
            "vocab_size"],
        ignored=("first_k_dense_replace",),
    ),
    "kimi_linear": Case(
        # Kimi's spellings (num_experts, num_experts_per_token, moe_renormalize, num_expert_group, num_shared_experts,
        # model_max_length) and the linear layers' sizes both in linear_attn_config and at the top level, as
        # transformers writes them; no rotary field at all (the latent attention has no positions)
        raw={"attention_bias": False, "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 64,
            "intermediate_size": 80, "kv_lora_rank": 16, "layer_types": ["linear_attention", "linear_attention",
            "linear_attention", "full_attention"], "linear_attn_config": {"full_attn_layers": [4], "head_dim": 8,
            "kda_layers": [1, 2, 3], "num_heads": 3, "short_conv_kernel_size": 4}, "linear_conv_kernel_dim": 4,
            "linear_head_dim": 8, "linear_num_heads": 3, "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
            "model_max_length": 256, "moe_intermediate_size": 24, "moe_renormalize": True, "num_attention_heads": 4,
            "num_expert_group": 1, "num_experts": 8, "num_experts_per_token": 3, "num_hidden_layers": 4,
            "num_key_value_heads": 4, "num_shared_experts": 2, "q_lora_rank": None, "qk_nope_head_dim": 12,
            "qk_rope_head_dim": 8, "rms_norm_eps": 1e-05, "routed_scaling_factor": 2.5, "tie_word_embeddings": False,
            "topk_group": 1, "v_head_dim": 10, "vocab_size": 96, "mla_use_nope": True},
        fields=dict(d_model=64, n_layers=4, n_heads=4, n_kv_heads=4, d_head=20, d_vocab=96, norm_eps=1e-05,
            rope=RopeConfig(theta=10000.0), max_position_embeddings=256, d_mlp=80, moe_layers=(False, True, True, True),
            n_experts=8, top_k_per_layer=(0, 3, 3, 3), d_expert=24, d_shared=2 * 24, norm_topk_prob=True,
            routed_scaling_factor=2.5, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10,
            first_k_dense_replace=1, layer_types=("linear_attention",) * 3 + ("full_attention",), linear_n_heads=3,
            linear_d_head=8, linear_conv_kernel=4),
        read=["attention_bias", "first_k_dense_replace", "hidden_act", "hidden_size", "intermediate_size",
            "kv_lora_rank", "layer_types", "linear_attn_config", "linear_conv_kernel_dim", "linear_head_dim",
            "linear_num_heads", "max_position_embeddings", "mlp_layer_types", "moe_intermediate_size", "n_group",
            "n_routed_experts", "n_shared_experts", "norm_topk_prob", "num_attention_heads", "num_experts_per_tok",
            "num_hidden_layers", "num_key_value_heads", "num_nextn_predict_layers", "q_lora_rank", "qk_nope_head_dim",
            "qk_rope_head_dim", "rms_norm_eps", "rope_interleave", "routed_scaling_factor", "tie_word_embeddings",
            "topk_group", "v_head_dim", "vocab_size"],
        ignored=("mla_use_nope",),
    ),
    "bailing_hybrid": Case(
        # as transformers writes it: Ling's mixture spellings, the KDA sizes under the names its loading does not
        # read (linear_*) agreeing with those it does, head_dim the rotated part (equal here to the KDA width)
        raw={"attention_bias": False, "first_k_dense_replace": 1, "head_dim": 8, "hidden_act": "silu", "hidden_size": 64,
            "intermediate_size": 80, "kda_lower_bound": -5.0, "kda_safe_gate": True, "kv_lora_rank": 16,
            "layer_group_size": 4, "layer_types": ["linear_attention", "linear_attention", "linear_attention",
            "full_attention"], "linear_conv_kernel_dim": 4, "linear_head_dim": 8, "linear_num_heads": 4,
            "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"], "model_max_length": 256,
            "moe_intermediate_size": 24, "moe_renormalize": True, "mtp_loss_scaling_factor": 0.0,
            "num_attention_heads": 4, "num_expert_group": 2, "num_experts": 8, "num_experts_per_token": 3,
            "num_hidden_layers": 4, "num_key_value_heads": 4, "num_nextn_predict_layers": 1, "num_shared_experts": 1,
            "q_lora_rank": None, "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "rms_norm_eps": 1e-06,
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "routed_scaling_factor": 2.5,
            "short_conv_kernel_size": 4, "tie_word_embeddings": False, "topk_group": 2, "v_head_dim": 10,
            "vocab_size": 96},
        fields=dict(d_model=64, n_layers=4, n_heads=4, n_kv_heads=4, d_head=20, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=10000.0, interleaved=True), max_position_embeddings=256, d_mlp=80,
            moe_layers=(False, True, True, True), n_experts=8, top_k_per_layer=(0, 3, 3, 3), d_expert=24, d_shared=24,
            norm_topk_prob=True, routed_scaling_factor=2.5, n_group=2, topk_group=2, kv_lora_rank=16,
            qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, first_k_dense_replace=1, mtp_layers=1,
            layer_types=("linear_attention",) * 3 + ("full_attention",), linear_n_heads=4, linear_d_head=8,
            linear_conv_kernel=4),
        read=["attention_bias", "first_k_dense_replace", "head_dim", "hidden_act", "hidden_size", "intermediate_size",
            "kda_lower_bound", "kda_safe_gate", "kv_lora_rank", "layer_types", "linear_conv_kernel_dim",
            "linear_head_dim", "linear_num_heads", "max_position_embeddings", "mlp_layer_types", "moe_intermediate_size",
            "n_group", "n_routed_experts", "n_shared_experts", "norm_topk_prob", "num_attention_heads",
            "num_experts_per_tok", "num_hidden_layers", "num_key_value_heads", "num_nextn_predict_layers",
            "partial_rotary_factor", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "rms_norm_eps",
            "rope_interleave", "rope_parameters", "rope_scaling", "rope_theta", "routed_scaling_factor",
            "short_conv_kernel_size", "tie_word_embeddings", "topk_group", "v_head_dim", "vocab_size"],
        ignored=("mtp_loss_scaling_factor",),
    ),
    "deepseek_v2": Case(
        # as transformers writes it: head_dim (its qk_rope_head_dim), null groups (greedy routing reads none)
        raw={"attention_bias": False, "first_k_dense_replace": 1, "head_dim": 8, "hidden_act": "silu", "hidden_size":
            64, "intermediate_size": 80, "kv_lora_rank": 16, "max_position_embeddings": 256, "mlp_bias": False,
            "moe_intermediate_size": 24, "n_group": None, "n_routed_experts": 8, "n_shared_experts": 2,
            "norm_topk_prob": False, "num_attention_heads": 4, "num_experts_per_tok": 3, "num_hidden_layers": 3,
            "num_key_value_heads": 4, "q_lora_rank": None, "qk_nope_head_dim": 12, "qk_rope_head_dim": 8,
            "rms_norm_eps": 1e-06, "rope_parameters": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 4.0, "mscale":
            0.707, "mscale_all_dim": 0.707, "original_max_position_embeddings": 16, "rope_theta": 10000.0, "rope_type":
            "yarn"}, "routed_scaling_factor": 1.0, "tie_word_embeddings": False, "topk_group": None, "topk_method":
            "greedy", "v_head_dim": 10, "vocab_size": 96},
        fields=dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=4, d_head=20, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=10000.0, kind="yarn", factor=4.0, original_max_position_embeddings=16, mscale=0.707,
            mscale_all_dim=0.707, interleaved=True), max_position_embeddings=256, d_mlp=80, moe_layers=(False, True,
            True), n_experts=8, top_k_per_layer=(0, 3, 3), d_expert=24, d_shared=48, norm_topk_prob=False,
            routed_scaling_factor=1.0, n_group=1, topk_group=1, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=12,
            qk_rope_head_dim=8, v_head_dim=10, first_k_dense_replace=1, mtp_layers=0),
        read=["attention_bias", "first_k_dense_replace", "hidden_act", "hidden_size", "intermediate_size",
            "kv_lora_rank", "max_position_embeddings", "mlp_bias", "moe_intermediate_size", "n_routed_experts",
            "n_shared_experts", "norm_topk_prob", "num_attention_heads", "num_experts_per_tok", "num_hidden_layers",
            "num_key_value_heads", "num_nextn_predict_layers", "partial_rotary_factor", "q_lora_rank",
            "qk_nope_head_dim", "qk_rope_head_dim", "rms_norm_eps", "rope_interleave", "rope_parameters",
            "rope_scaling", "rope_theta", "routed_scaling_factor", "tie_word_embeddings", "topk_method", "v_head_dim",
            "vocab_size"],
        ignored=("head_dim",),
    ),
    "ernie4_5_moe": Case(
        raw={"hidden_act": "silu", "hidden_size": 64, "intermediate_size": 80, "max_position_embeddings": 256,
            "moe_intermediate_size": 24, "moe_k": 3, "moe_layer_end_index": 2, "moe_layer_interval": 1,
            "moe_layer_start_index": 1, "moe_norm_min": 1e-12, "moe_num_experts": 8, "moe_num_shared_experts": 2,
            "num_attention_heads": 4, "num_hidden_layers": 3, "num_key_value_heads": 2, "rms_norm_eps": 1e-05,
            "rope_parameters": {"rope_theta": 1000.0, "rope_type": "default"}, "tie_word_embeddings": False,
            "use_bias": False, "vocab_size": 96},
        # the rotary turns interleaved pairs; the top-k weights are always renormalised (over max(sum, moe_norm_min));
        # the shared expert is moe_num_shared_experts x moe_intermediate_size wide
        fields=dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_head=16, d_vocab=96, norm_eps=1e-05,
            rope=RopeConfig(theta=1000.0, interleaved=True), max_position_embeddings=256, d_mlp=80,
            moe_layers=(False, True, True), n_experts=8, top_k_per_layer=(0, 3, 3), d_expert=24, d_shared=48,
            norm_topk_prob=True),
        read=["head_dim", "hidden_act", "hidden_size", "intermediate_size", "max_position_embeddings",
            "moe_intermediate_size", "moe_k", "moe_layer_end_index", "moe_layer_interval", "moe_layer_start_index",
            "moe_norm_min", "moe_num_experts", "moe_num_shared_experts", "num_attention_heads", "num_hidden_layers",
            "num_key_value_heads", "partial_rotary_factor", "rms_norm_eps", "rope_parameters", "rope_scaling",
            "rope_theta", "tie_word_embeddings", "use_bias", "vocab_size"],
        ignored=(),
    ),
    "flex_olmo": Case(
        raw={"attention_bias": False, "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 32,
            "max_position_embeddings": 256, "norm_topk_prob": False, "num_attention_heads": 4, "num_experts": 8,
            "num_experts_per_tok": 3, "num_hidden_layers": 3, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "tie_word_embeddings": False,
            "vocab_size": 96},
        # every block a mixture of intermediate_size experts
        fields=dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_head=16, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=10000.0), max_position_embeddings=256, moe_layers=(True, True, True), n_experts=8,
            top_k_per_layer=(3, 3, 3), d_expert=32),
        read=["attention_bias", "head_dim", "hidden_act", "hidden_size", "intermediate_size", "max_position_embeddings",
            "norm_topk_prob", "num_attention_heads", "num_experts", "num_experts_per_tok", "num_hidden_layers",
            "num_key_value_heads", "partial_rotary_factor", "rms_norm_eps", "rope_parameters", "rope_scaling",
            "rope_theta", "tie_word_embeddings", "vocab_size"],
        ignored=(),
    ),
    "axk1": Case(
        # transformers 5's spelling (mlp_layer_types) and the derived head_dim / qk_head_dim it writes (unused)
        raw={"attention_bias": False, "head_dim": 8, "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 80,
            "kv_lora_rank": 16, "max_position_embeddings": 256, "mlp_layer_types": ["dense", "sparse", "sparse"],
            "moe_intermediate_size": 24, "n_group": 2, "n_routed_experts": 8, "n_shared_experts": 1,
            "norm_topk_prob": True, "num_attention_heads": 4, "num_experts_per_tok": 3, "num_hidden_layers": 3,
            "num_key_value_heads": 4, "q_lora_rank": 24, "qk_head_dim": 20, "qk_nope_head_dim": 12,
            "qk_rope_head_dim": 8, "rms_norm_eps": 1e-06, "rope_interleave": True, "rope_parameters": {"rope_theta":
            1000.0, "rope_type": "default"}, "routed_scaling_factor": 2.5, "tie_word_embeddings": False,
            "topk_group": 1, "v_head_dim": 10, "vocab_size": 96},
        fields=dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=4, d_head=20, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=1000.0, interleaved=True), max_position_embeddings=256, d_mlp=80, moe_layers=(False,
            True, True), n_experts=8, top_k_per_layer=(0, 3, 3), d_expert=24, d_shared=24, norm_topk_prob=True,
            routed_scaling_factor=2.5, n_group=2, topk_group=1, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12,
            qk_rope_head_dim=8, v_head_dim=10, first_k_dense_replace=1, mtp_layers=0),
        read=["attention_bias", "first_k_dense_replace", "hidden_act", "hidden_size", "intermediate_size",
            "kv_lora_rank", "max_position_embeddings", "mlp_layer_types", "moe_intermediate_size", "moe_layer_freq",
            "n_group", "n_routed_experts", "n_shared_experts", "norm_topk_prob", "num_attention_heads",
            "num_experts_per_tok", "num_hidden_layers", "num_key_value_heads", "num_nextn_predict_layers",
            "partial_rotary_factor", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "rms_norm_eps",
            "rope_interleave", "rope_parameters", "rope_scaling", "rope_theta", "routed_scaling_factor",
            "tie_word_embeddings", "topk_group", "v_head_dim", "vocab_size"],
        ignored=("head_dim", "qk_head_dim"),
    ),
    "kolibri1": Case(
        # transformers 5 writes num_experts as num_local_experts (its attribute_map)
        raw={"attention_dropout": 0.0, "head_dim": 16, "hidden_act": "silu", "hidden_size": 64, "layer_types":
            ["sliding_attention", "full_attention", "sliding_attention"], "max_position_embeddings": 256,
            "moe_intermediate_size": 32, "norm_topk_prob": True, "num_attention_heads": 4, "num_experts_per_tok": 3,
            "num_hidden_layers": 3, "num_key_value_heads": 2, "num_local_experts": 8, "rms_norm_eps": 1e-06,
            "rope_parameters": {"rope_theta": 1000.0, "rope_type": "default"}, "shared_expert_intermediate_size": 40,
            "sliding_window": 5, "tie_word_embeddings": False, "vocab_size": 96},
        fields=dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_head=16, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=1000.0), max_position_embeddings=256, attention_windows=(5, None, 5),
            moe_layers=(True, True, True), n_experts=8, top_k_per_layer=(3, 3, 3), d_expert=32, d_shared=40,
            norm_topk_prob=True),
        read=["head_dim", "hidden_act", "hidden_size", "layer_types", "max_position_embeddings",
            "moe_intermediate_size", "norm_topk_prob", "num_attention_heads", "num_experts_per_tok",
            "num_hidden_layers", "num_key_value_heads", "num_local_experts", "partial_rotary_factor", "rms_norm_eps",
            "rope_parameters", "rope_scaling", "rope_theta", "shared_expert_intermediate_size", "sliding_window",
            "tie_word_embeddings", "vocab_size"],
        ignored=("attention_dropout",),
    ),
    "flint": Case(
        raw={"attention_bias": False, "attention_dropout": 0.0, "decoder_sparse_step": 1, "head_dim": 16,
            "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 80, "layer_types": ["sliding_attention",
            "full_attention", "sliding_attention"], "max_position_embeddings": 256, "mlp_only_layers": [0],
            "moe_intermediate_size": 32, "norm_topk_prob": True, "num_attention_heads": 4, "num_experts": 8,
            "num_experts_per_tok": 3, "num_hidden_layers": 3, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
            "rope_parameters": {"rope_theta": 1000.0, "rope_type": "default"}, "router_aux_loss_coef": 0.0005,
            "shared_expert_intermediate_size": 40, "sliding_window": 5, "tie_word_embeddings": False, "vocab_size": 96},
        fields=dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_head=16, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=1000.0), max_position_embeddings=256, attention_windows=(5, None, 5), d_mlp=80,
            moe_layers=(False, True, True), n_experts=8, top_k_per_layer=(0, 3, 3), d_expert=32, d_shared=40,
            norm_topk_prob=True),
        read=["attention_bias", "decoder_sparse_step", "head_dim", "hidden_act", "hidden_size", "intermediate_size",
            "layer_types", "max_position_embeddings", "mlp_only_layers", "moe_intermediate_size", "norm_topk_prob",
            "num_attention_heads", "num_experts", "num_experts_per_tok", "num_hidden_layers", "num_key_value_heads",
            "partial_rotary_factor", "rms_norm_eps", "rope_parameters", "rope_scaling", "rope_theta",
            "shared_expert_intermediate_size", "sliding_window", "tie_word_embeddings", "vocab_size"],
        ignored=("attention_dropout", "router_aux_loss_coef"),
    ),
    "aria_text": Case(
        raw={"attention_bias": False, "attention_dropout": 0.0, "head_dim": 16, "hidden_act": "silu", "hidden_size": 64,
            "intermediate_size": 24, "max_position_embeddings": 256, "mlp_bias": False, "moe_num_experts": 8,
            "moe_num_shared_experts": 2, "moe_topk": 3, "num_attention_heads": 4, "num_hidden_layers": 3,
            "num_key_value_heads": 2, "pretraining_tp": 1, "rms_norm_eps": 1e-06, "rope_parameters": {"rope_theta":
            1000.0, "rope_type": "default"}, "tie_word_embeddings": False, "vocab_size": 96},
        # every block a mixture of intermediate_size experts, the shared experts twice as wide
        fields=dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_head=16, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=1000.0), max_position_embeddings=256, moe_layers=(True, True, True), n_experts=8,
            top_k_per_layer=(3, 3, 3), d_expert=24, d_shared=48),
        read=["attention_bias", "head_dim", "hidden_act", "hidden_size", "intermediate_size", "max_position_embeddings",
            "mlp_bias", "moe_num_experts", "moe_num_shared_experts", "moe_topk", "num_attention_heads",
            "num_hidden_layers", "num_key_value_heads", "partial_rotary_factor", "rms_norm_eps", "rope_parameters",
            "rope_scaling", "rope_theta", "tie_word_embeddings", "vocab_size"],
        ignored=("attention_dropout", "pretraining_tp"),
    ),
    "mellum": Case(
        # rope_parameters keyed by layer type; transformers writes num_mtp_layers as num_nextn_predict_layers (null)
        raw={"attention_bias": False, "attention_dropout": 0.0, "head_dim": 16, "hidden_act": "silu", "hidden_size": 64,
            "intermediate_size": 80, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "max_position_embeddings": 256, "mlp_layer_types": ["dense", "sparse", "sparse"],
            "moe_intermediate_size": 32, "norm_topk_prob": True, "num_attention_heads": 4, "num_experts_per_tok": 3,
            "num_hidden_layers": 3, "num_key_value_heads": 2, "num_local_experts": 8, "num_nextn_predict_layers": None,
            "rms_norm_eps": 1e-06, "rope_parameters": {"full_attention": {"rope_theta": 50000.0, "rope_type":
            "default"}, "sliding_attention": {"rope_theta": 100.0, "rope_type": "default"}},
            "router_aux_loss_coef": 0.001, "sliding_window": 5, "tie_word_embeddings": False, "vocab_size": 96},
        fields=dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_head=16, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=100.0), max_position_embeddings=256, attention_windows=(5, None, 5), d_mlp=80,
            moe_layers=(False, True, True), n_experts=8, top_k_per_layer=(0, 3, 3), d_expert=32, norm_topk_prob=True,
            layer_ropes=(RopeConfig(theta=100.0), RopeConfig(theta=50000.0), RopeConfig(theta=100.0))),
        read=["attention_bias", "head_dim", "hidden_act", "hidden_size", "intermediate_size", "layer_types",
            "max_position_embeddings", "mlp_layer_types", "moe_intermediate_size", "norm_topk_prob",
            "num_attention_heads", "num_experts_per_tok", "num_hidden_layers", "num_key_value_heads",
            "num_local_experts", "rms_norm_eps", "rope_parameters", "sliding_window", "tie_word_embeddings",
            "vocab_size"],
        ignored=("attention_dropout", "router_aux_loss_coef"),
    ),
    "cohere2_moe": Case(
        # a full dense layer (rotated: prefix_dense_sliding_window_pattern 1), a full mixture layer (no rotary);
        # transformers writes the top-level rope_theta beside rope_parameters, which is what it reads
        raw={"attention_bias": False, "attention_dropout": 0.0, "expert_selection_fn": "softmax", "head_dim": 16,
            "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 32,
            "layer_norm_eps": 1e-05, "layer_types": ["full_attention", "sliding_attention", "full_attention",
            "sliding_attention"], "logit_scale": 0.125, "max_position_embeddings": 256, "mlp_layer_types": ["dense",
            "sparse", "sparse", "sparse"], "norm_topk_prob": True, "num_attention_heads": 4, "num_experts": 8,
            "num_experts_per_tok": 3, "num_hidden_layers": 4, "num_key_value_heads": 2, "num_shared_experts": 0,
            "output_router_logits": False, "prefix_dense_intermediate_size": 48,
            "prefix_dense_sliding_window_pattern": 1, "rms_norm_eps": None, "rope_parameters": {"rope_theta": 1000.0,
            "rope_type": "default"}, "rope_scaling": None, "rope_theta": 10000.0,
            "shared_expert_combination_strategy": "average", "sliding_window": 5, "sliding_window_pattern": 4,
            "tie_word_embeddings": True, "use_cache": True, "vocab_size": 96},
        fields=dict(d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_head=16, d_vocab=96, norm_eps=1e-05,
            rope=RopeConfig(theta=1000.0), max_position_embeddings=256, attention_windows=(None, 5, None, 5), d_mlp=48,
            moe_layers=(False, True, True, True), n_experts=8, top_k_per_layer=(0, 3, 3, 3), d_expert=32,
            tie_word_embeddings=True, logit_scale=0.125, rotary_layers=(True, True, False, True)),
        read=["attention_bias", "expert_selection_fn", "first_k_dense_replace", "head_dim", "hidden_act", "hidden_size",
            "intermediate_size", "layer_norm_eps", "layer_types", "logit_scale", "max_position_embeddings",
            "mlp_layer_types", "norm_topk_prob", "num_attention_heads", "num_experts", "num_experts_per_tok",
            "num_hidden_layers", "num_key_value_heads", "num_shared_experts", "partial_rotary_factor",
            "prefix_dense_intermediate_size", "prefix_dense_sliding_window_pattern", "rms_norm_eps",
            "rope_parameters", "rope_scaling", "rope_theta", "shared_expert_combination_strategy", "sliding_window",
            "sliding_window_pattern", "tie_word_embeddings", "vocab_size"],
        ignored=("attention_dropout", "initializer_range", "output_router_logits", "use_cache"),
    ),
    "deepseek_v32": Case(
        raw={"first_k_dense_replace": 1, "head_dim": 8, "hidden_act": "silu", "hidden_size": 64, "index_head_dim": 16,
            "index_n_heads": 4, "index_topk": 3, "intermediate_size": 80, "kv_lora_rank": 16,
            "max_position_embeddings": 256, "moe_intermediate_size": 24, "n_routed_experts": 8, "n_shared_experts": 2,
            "norm_topk_prob": True, "num_attention_heads": 4, "num_experts_per_tok": 3, "num_key_value_heads": 4,
            "q_lora_rank": 24, "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "rope_parameters": {"beta_fast": 32.0,
            "beta_slow": 1.0, "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings":
            16, "rope_theta": 10000.0, "rope_type": "yarn"}, "routed_scaling_factor": 2.5, "tie_word_embeddings": False,
            "v_head_dim": 10, "vocab_size": 96, "attention_bias": False, "n_group": 4, "topk_group": 2, "num_hidden_layers": 3, "rms_norm_eps": 1e-06,
            "mlp_layer_types": ["dense", "sparse", "sparse"], "layer_types": ["indexed_attention"] * 3},
        fields=dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=4, norm_eps=1e-06, d_head=20, d_vocab=96,
            rope=RopeConfig(theta=10000.0, kind="yarn", factor=4.0, original_max_position_embeddings=16, mscale=1.0,
            mscale_all_dim=1.0, interleaved=True), max_position_embeddings=256, d_mlp=80, n_experts=8, d_expert=24,
            d_shared=48, norm_topk_prob=True, routed_scaling_factor=2.5, q_lora_rank=24, kv_lora_rank=16,
            qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, first_k_dense_replace=1, index_topk=3,
            index_head_dim=16, index_n_heads=4,
            moe_layers=(False, True, True), top_k_per_layer=(0, 3, 3), n_group=4, topk_group=2, indexer_layers=(True, True, True)),
        read=["attention_bias", "first_k_dense_replace", "hidden_act", "hidden_size", "index_head_dim",
            "index_n_heads", "index_topk", "intermediate_size", "kv_lora_rank", "layer_types",
            "max_position_embeddings", "mlp_layer_types", "moe_intermediate_size", "n_group", "n_routed_experts",
            "n_shared_experts", "norm_topk_prob", "num_attention_heads", "num_experts_per_tok", "num_hidden_layers",
            "num_key_value_heads", "num_nextn_predict_layers", "partial_rotary_factor", "q_lora_rank",
            "qk_nope_head_dim", "qk_rope_head_dim", "rms_norm_eps", "rope_interleave", "rope_parameters",
            "rope_scaling", "rope_theta", "routed_scaling_factor", "tie_word_embeddings", "topk_group", "v_head_dim",
            "vocab_size"],
        ignored=("head_dim",),
    ),
    "glm_moe_dsa": Case(
        raw={"first_k_dense_replace": 1, "head_dim": 8, "hidden_act": "silu", "hidden_size": 64, "index_head_dim": 16,
            "index_n_heads": 4, "index_topk": 3, "intermediate_size": 80, "kv_lora_rank": 16,
            "max_position_embeddings": 256, "moe_intermediate_size": 24, "n_routed_experts": 8, "n_shared_experts": 2,
            "norm_topk_prob": True, "num_attention_heads": 4, "num_experts_per_tok": 3, "num_key_value_heads": 4,
            "q_lora_rank": 24, "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "rope_parameters": {"beta_fast": 32.0,
            "beta_slow": 1.0, "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings":
            16, "rope_theta": 10000.0, "rope_type": "yarn"}, "routed_scaling_factor": 2.5, "tie_word_embeddings": False,
            "v_head_dim": 10, "vocab_size": 96, "attention_bias": False, "n_group": 1, "topk_group": 1, "num_hidden_layers": 4, "rms_norm_eps": 1e-05,
            "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"], "layer_types": ["indexed_attention"] * 4,
            "indexer_types": ["full", "shared", "full", "shared"]},
        fields=dict(d_model=64, n_layers=4, n_heads=4, n_kv_heads=4, norm_eps=1e-05, d_head=20, d_vocab=96,
            rope=RopeConfig(theta=10000.0, kind="yarn", factor=4.0, original_max_position_embeddings=16, mscale=1.0,
            mscale_all_dim=1.0, interleaved=True), max_position_embeddings=256, d_mlp=80, n_experts=8, d_expert=24,
            d_shared=48, norm_topk_prob=True, routed_scaling_factor=2.5, q_lora_rank=24, kv_lora_rank=16,
            qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, first_k_dense_replace=1, index_topk=3,
            index_head_dim=16, index_n_heads=4,
            moe_layers=(False, True, True, True), top_k_per_layer=(0, 3, 3, 3), n_group=1, topk_group=1,
            indexer_layers=(True, False, True, False), index_rope_interleaved=True),
        read=sorted(["attention_bias", "first_k_dense_replace", "hidden_act", "hidden_size", "index_head_dim",
            "index_n_heads", "index_topk", "intermediate_size", "kv_lora_rank", "layer_types",
            "max_position_embeddings", "mlp_layer_types", "moe_intermediate_size", "n_group", "n_routed_experts",
            "n_shared_experts", "norm_topk_prob", "num_attention_heads", "num_experts_per_tok", "num_hidden_layers",
            "num_key_value_heads", "num_nextn_predict_layers", "partial_rotary_factor", "q_lora_rank",
            "qk_nope_head_dim", "qk_rope_head_dim", "rms_norm_eps", "rope_interleave", "rope_parameters",
            "rope_scaling", "rope_theta", "routed_scaling_factor", "tie_word_embeddings", "topk_group", "v_head_dim",
            "vocab_size", "indexer_types"]),
        ignored=("head_dim",),
    ),
    "gpt_oss": Case(
        raw={"attention_bias": True, "head_dim": 16, "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 32,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"], "max_position_embeddings": 256,
            "num_attention_heads": 4, "num_experts_per_tok": 3, "num_hidden_layers": 3, "num_key_value_heads": 2,
            "num_local_experts": 8, "rms_norm_eps": 1e-05, "rope_parameters": {"beta_fast": 32.0, "beta_slow": 1.0,
            "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 150000.0, "rope_type": "yarn",
            "truncate": False}, "sliding_window": 5, "swiglu_alpha": 1.702, "swiglu_limit": 1.5, "tie_word_embeddings":
            False, "vocab_size": 96},
        fields=dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_head=16, d_vocab=96, norm_eps=1e-05,
            rope=RopeConfig(theta=150000.0, kind="yarn", factor=4.0, original_max_position_embeddings=64,
            truncate=False), max_position_embeddings=256, qkv_bias=True, o_bias=True, attention_windows=(5, None, 5),
            moe_layers=(True, True, True), n_experts=8, top_k_per_layer=(3, 3, 3), d_expert=32, swiglu_limit=1.5),
        read=["attention_bias", "head_dim", "hidden_size", "intermediate_size", "layer_types",
            "max_position_embeddings", "num_attention_heads", "num_experts_per_tok", "num_hidden_layers",
            "num_key_value_heads", "num_local_experts", "partial_rotary_factor", "rms_norm_eps", "rope_parameters",
            "rope_scaling", "rope_theta", "sliding_window", "swiglu_alpha", "swiglu_limit", "tie_word_embeddings",
            "vocab_size"],
        ignored=("hidden_act",),
    ),
    "glm4_moe": Case(
        raw={"attention_bias": True, "first_k_dense_replace": 1, "head_dim": 24, "hidden_act": "silu", "hidden_size":
            64, "intermediate_size": 80, "max_position_embeddings": 256, "moe_intermediate_size": 24, "n_group": 1,
            "n_routed_experts": 8, "n_shared_experts": 2, "norm_topk_prob": True, "num_attention_heads": 4,
            "num_experts_per_tok": 3, "num_hidden_layers": 3, "num_key_value_heads": 2, "num_nextn_predict_layers": 1,
            "rms_norm_eps": 1e-05, "rope_parameters": {"partial_rotary_factor": 0.5, "rope_theta": 1000.0, "rope_type":
            "default"}, "routed_scaling_factor": 2.5, "tie_word_embeddings": False, "topk_group": 1, "use_qk_norm":
            True, "vocab_size": 96},
        fields=dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_head=24, d_vocab=96, norm_eps=1e-05,
            rope=RopeConfig(theta=1000.0, partial_rotary_factor=0.5), max_position_embeddings=256, qkv_bias=True,
            d_mlp=80, moe_layers=(False, True, True), n_experts=8, top_k_per_layer=(0, 3, 3), d_expert=24, d_shared=48,
            norm_topk_prob=True, routed_scaling_factor=2.5, qk_norm=True, mtp_layers=1),
        read=["attention_bias", "first_k_dense_replace", "head_dim", "hidden_act", "hidden_size", "intermediate_size",
            "max_position_embeddings", "moe_intermediate_size", "n_group", "n_routed_experts", "n_shared_experts",
            "norm_topk_prob", "num_attention_heads", "num_experts_per_tok", "num_hidden_layers", "num_key_value_heads",
            "num_nextn_predict_layers", "partial_rotary_factor", "rms_norm_eps", "rope_parameters", "rope_scaling",
            "rope_theta", "routed_scaling_factor", "tie_word_embeddings", "topk_group", "use_qk_norm", "vocab_size"],
        ignored=(),
    ),
    "sarvam_moe": Case(
        # as transformers writes it: GLM-4.5's names (the rotary over the whole head written into rope_parameters)
        raw={"attention_bias": True, "first_k_dense_replace": 1, "head_dim": 24, "hidden_act": "silu", "hidden_size":
            64, "intermediate_size": 80, "max_position_embeddings": 256, "moe_intermediate_size": 24, "n_group": 1,
            "n_routed_experts": 8, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 4,
            "num_experts_per_tok": 3, "num_hidden_layers": 3, "num_key_value_heads": 2, "num_nextn_predict_layers": 0,
            "rms_norm_eps": 1e-06, "rope_parameters": {"partial_rotary_factor": 1.0, "rope_theta": 1000.0, "rope_type":
            "default"}, "routed_scaling_factor": 2.5, "tie_word_embeddings": False, "topk_group": 1, "use_qk_norm":
            True, "vocab_size": 96},
        fields=dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_head=24, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=1000.0), max_position_embeddings=256, qkv_bias=True, d_mlp=80,
            moe_layers=(False, True, True), n_experts=8, top_k_per_layer=(0, 3, 3), d_expert=24, d_shared=24,
            norm_topk_prob=True, routed_scaling_factor=2.5, qk_norm=True),
        read=["attention_bias", "first_k_dense_replace", "head_dim", "hidden_act", "hidden_size", "intermediate_size",
            "max_position_embeddings", "moe_intermediate_size", "n_group", "n_routed_experts", "n_shared_experts",
            "norm_topk_prob", "num_attention_heads", "num_experts_per_tok", "num_hidden_layers", "num_key_value_heads",
            "num_nextn_predict_layers", "partial_rotary_factor", "rms_norm_eps", "rope_parameters", "rope_scaling",
            "rope_theta", "routed_scaling_factor", "tie_word_embeddings", "topk_group", "use_qk_norm", "vocab_size"],
        ignored=(),
    ),
    "dots1": Case(
        raw={"attention_bias": False, "first_k_dense_replace": 1, "head_dim": 24, "hidden_act": "silu", "hidden_size": 64,
            "intermediate_size": 80, "layer_types": ["full_attention", "full_attention", "sliding_attention"],
            "max_position_embeddings": 256, "max_window_layers": 2, "moe_intermediate_size": 24, "n_group": 1,
            "n_routed_experts": 8, "n_shared_experts": 2, "norm_topk_prob": True, "num_attention_heads": 4,
            "num_experts_per_tok": 3, "num_hidden_layers": 3, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0}, "routed_scaling_factor": 2.5,
            "sliding_window": 6, "tie_word_embeddings": False, "topk_group": 1, "vocab_size": 96},
        fields=dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_head=24, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=1000.0), max_position_embeddings=256, attention_windows=(None, None, 6), d_mlp=80,
            moe_layers=(False, True, True), n_experts=8, top_k_per_layer=(0, 3, 3), d_expert=24, d_shared=48,
            norm_topk_prob=True, routed_scaling_factor=2.5, qk_norm=True),
        read=["attention_bias", "first_k_dense_replace", "head_dim", "hidden_act", "hidden_size", "intermediate_size",
            "layer_types", "max_position_embeddings", "moe_intermediate_size", "n_group", "n_routed_experts",
            "n_shared_experts", "norm_topk_prob", "num_attention_heads", "num_experts_per_tok", "num_hidden_layers",
            "num_key_value_heads", "partial_rotary_factor", "rms_norm_eps", "rope_parameters", "rope_scaling",
            "rope_theta", "routed_scaling_factor", "sliding_window", "tie_word_embeddings", "topk_group", "vocab_size"],
        ignored=("max_window_layers",),  # layer_types given: transformers does not read it
    ),
    "hy_v3": Case(
        raw={"attention_bias": False, "enable_moe_fp32_combine": True, "head_dim": 24, "hidden_act": "silu",
            "hidden_size": 64, "intermediate_size": 80, "max_position_embeddings": 256, "mlp_bias": False,
            "mlp_layer_types": ["dense", "sparse", "sparse"], "moe_intermediate_size": 24, "num_attention_heads": 4,
            "num_experts": 8, "num_experts_per_tok": 3, "num_hidden_layers": 3, "num_key_value_heads": 2,
            "num_shared_experts": 2, "rms_norm_eps": 1e-05, "rope_parameters": {"rope_type": "default", "rope_theta":
            1000.0}, "router_scaling_factor": 2.826, "tie_word_embeddings": False, "vocab_size": 96},
        fields=dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_head=24, d_vocab=96, norm_eps=1e-05,
            rope=RopeConfig(theta=1000.0), max_position_embeddings=256, d_mlp=80, moe_layers=(False, True, True),
            n_experts=8, top_k_per_layer=(0, 3, 3), d_expert=24, d_shared=48, norm_topk_prob=True,
            routed_scaling_factor=2.826, qk_norm=True),
        read=["attention_bias", "head_dim", "hidden_act", "hidden_size", "intermediate_size", "max_position_embeddings",
            "mlp_bias", "mlp_layer_types", "moe_intermediate_size", "num_attention_heads", "num_experts",
            "num_experts_per_tok", "num_hidden_layers", "num_key_value_heads", "num_nextn_predict_layers",
            "num_shared_experts", "partial_rotary_factor", "rms_norm_eps", "rope_parameters", "rope_scaling",
            "rope_theta", "router_scaling_factor", "tie_word_embeddings", "vocab_size"],
        ignored=("enable_moe_fp32_combine",),  # adds in float32 and rounds once, as the model's dtype does
    ),
    "exaone_moe": Case(
        raw={"first_k_dense_replace": 1, "head_dim": 24, "hidden_act": "silu", "hidden_size": 64, "intermediate_size":
            80, "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            "max_position_embeddings": 256, "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
            "moe_intermediate_size": 24, "n_group": 1, "norm_topk_prob": True, "num_attention_heads": 4, "num_experts":
            8, "num_experts_per_tok": 3, "num_hidden_layers": 4, "num_key_value_heads": 2, "num_shared_experts": 2,
            "rms_norm_eps": 1e-05, "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0},
            "routed_scaling_factor": 2.5, "sliding_window": 6, "sliding_window_pattern": 2, "tie_word_embeddings":
            False, "topk_group": 1, "vocab_size": 96},
        fields=dict(d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_head=24, d_vocab=96, norm_eps=1e-05,
            rope=RopeConfig(theta=1000.0), max_position_embeddings=256, attention_windows=(6, None, 6, None), d_mlp=80,
            moe_layers=(False, True, True, True), n_experts=8, top_k_per_layer=(0, 3, 3, 3), d_expert=24, d_shared=48,
            norm_topk_prob=True, routed_scaling_factor=2.5, qk_norm=True),
        read=["head_dim", "hidden_act", "hidden_size", "intermediate_size", "layer_types", "max_position_embeddings",
            "mlp_layer_types", "moe_intermediate_size", "n_group", "norm_topk_prob", "num_attention_heads",
            "num_experts", "num_experts_per_tok", "num_hidden_layers", "num_key_value_heads", "num_shared_experts",
            "partial_rotary_factor", "rms_norm_eps", "rope_parameters", "rope_scaling", "rope_theta",
            "routed_scaling_factor", "sliding_window", "tie_word_embeddings", "topk_group", "vocab_size"],
        # transformers reads mlp_layer_types and layer_types over them
        ignored=("first_k_dense_replace", "sliding_window_pattern"),
    ),
    "minimax_m2": Case(
        raw={"attention_dropout": 0.0, "head_dim": 32, "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 32,
            "max_position_embeddings": 256, "num_attention_heads": 4, "num_experts_per_tok": 3, "num_hidden_layers": 3,
            "num_key_value_heads": 2, "num_local_experts": 8, "rms_norm_eps": 1e-06, "rope_parameters":
            {"partial_rotary_factor": 0.5, "rope_theta": 1000.0, "rope_type": "default"}, "rotary_dim": 16,
            "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0, "tie_word_embeddings": False, "vocab_size": 96},
        fields=dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_head=32, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=1000.0, partial_rotary_factor=0.5), max_position_embeddings=256, moe_layers=(True,
            True, True), n_experts=8, top_k_per_layer=(3, 3, 3), d_expert=32, norm_topk_prob=True),
        read=["attention_bias", "attn_type_list", "head_dim", "hidden_act", "hidden_size", "intermediate_size", "layer_types",
            "max_position_embeddings", "num_attention_heads", "num_experts_per_tok", "num_hidden_layers",
            "num_key_value_heads", "num_local_experts", "num_mtp_modules", "partial_rotary_factor", "qk_norm_type",
            "rms_norm_eps", "rope_parameters", "rope_scaling", "rope_theta", "rotary_dim", "scoring_func",
            "shared_intermediate_size", "tie_word_embeddings", "use_qk_norm", "use_routing_bias", "vocab_size"],
        ignored=("router_aux_loss_coef", "router_jitter_noise", "attention_dropout"),
    ),
    "qwen3_next": Case(
        raw={"attention_bias": False, "decoder_sparse_step": 1, "head_dim": 16, "hidden_act": "silu", "hidden_size": 64,
            "intermediate_size": 80, "layer_types": ["linear_attention", "linear_attention", "linear_attention",
            "full_attention"], "linear_conv_kernel_dim": 4, "linear_key_head_dim": 8, "linear_num_key_heads": 2,
            "linear_num_value_heads": 4, "linear_value_head_dim": 12, "max_position_embeddings": 512, "mlp_only_layers": [],
            "moe_intermediate_size": 32, "norm_topk_prob": True, "num_attention_heads": 4, "num_experts": 8,
            "num_experts_per_tok": 3, "num_hidden_layers": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
            "rope_parameters": {"partial_rotary_factor": 0.25, "rope_theta": 10000.0, "rope_type": "default"},
            "shared_expert_intermediate_size": 40, "tie_word_embeddings": False, "vocab_size": 96},
        fields=dict(d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_head=16, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=10000.0, partial_rotary_factor=0.25), max_position_embeddings=512, d_mlp=80,
            moe_layers=(True, True, True, True), n_experts=8, top_k_per_layer=(3, 3, 3, 3), d_expert=32, d_shared=40,
            norm_topk_prob=True, layer_types=("linear_attention",) * 3 + ("full_attention",), linear_n_key_heads=2,
            linear_n_value_heads=4, linear_d_key=8, linear_d_value=12, linear_conv_kernel=4),
        read=["attention_bias", "decoder_sparse_step", "head_dim", "hidden_act", "hidden_size", "intermediate_size",
            "layer_types", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_num_key_heads", "linear_num_value_heads",
            "linear_value_head_dim", "max_position_embeddings", "mlp_only_layers", "moe_intermediate_size", "norm_topk_prob",
            "num_attention_heads", "num_experts", "num_experts_per_tok", "num_hidden_layers", "num_key_value_heads",
            "partial_rotary_factor", "rms_norm_eps", "rope_parameters", "rope_scaling", "rope_theta",
            "shared_expert_intermediate_size", "tie_word_embeddings", "vocab_size"],
        ignored=(),
    ),
    "qwen3_5_moe_text": Case(
        # as transformers writes the tiny text config (its rotary's mrope_section / mrope_interleaved aside: only
        # images and videos read them; the family's own suite checks they are reported ignored)
        raw={"attention_bias": False, "head_dim": 16, "hidden_act": "silu", "hidden_size": 64, "layer_types":
            ["linear_attention", "linear_attention", "linear_attention", "full_attention"], "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_value_head_dim": 12,
            "max_position_embeddings": 512, "moe_intermediate_size": 32, "num_attention_heads": 4, "num_experts": 8,
            "num_experts_per_tok": 3, "num_hidden_layers": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
            "rope_parameters": {"partial_rotary_factor": 0.5, "rope_theta": 10000.0, "rope_type": "default"},
            "shared_expert_intermediate_size": 40, "tie_word_embeddings": False, "vocab_size": 96},
        fields=dict(d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_head=16, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=10000.0, partial_rotary_factor=0.5), max_position_embeddings=512,
            moe_layers=(True, True, True, True), n_experts=8, top_k_per_layer=(3, 3, 3, 3), d_expert=32, d_shared=40,
            norm_topk_prob=True, layer_types=("linear_attention",) * 3 + ("full_attention",), linear_n_key_heads=2,
            linear_n_value_heads=4, linear_d_key=8, linear_d_value=12, linear_conv_kernel=4),
        read=["attention_bias", "head_dim", "hidden_act", "hidden_size", "layer_types", "linear_conv_kernel_dim",
            "linear_key_head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_value_head_dim",
            "max_position_embeddings", "moe_intermediate_size", "num_attention_heads", "num_experts",
            "num_experts_per_tok", "num_hidden_layers", "num_key_value_heads", "partial_rotary_factor", "rms_norm_eps",
            "rope_parameters", "rope_scaling", "rope_theta", "shared_expert_intermediate_size", "tie_word_embeddings",
            "vocab_size"],
        ignored=(),
    ),
    "lara_mini": Case(
        raw={"attention_bias": False, "attention_dropout": 0.0, "head_dim": 16, "hidden_act": "silu", "hidden_size": 64,
            "layer_types": ["linear_attention", "sliding_attention", "linear_attention", "full_attention",
            "sliding_attention"], "linear_conv_kernel_dim": 4, "linear_key_head_dim": 8, "linear_num_key_heads": 2,
            "linear_num_value_heads": 4, "linear_value_head_dim": 12, "max_position_embeddings": 512,
            "moe_intermediate_size": 32, "norm_topk_prob": True, "num_attention_heads": 4, "num_experts": 8,
            "num_experts_per_tok": 3, "num_hidden_layers": 5, "num_key_value_heads": 2, "output_router_logits": False,
            "rms_norm_eps": 1e-06, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
            "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 40, "sliding_window": 5,
            "tie_word_embeddings": True, "vocab_size": 96},
        # the sliding layers' window; a mixture on every layer; tied by default
        fields=dict(d_model=64, n_layers=5, n_heads=4, n_kv_heads=2, d_head=16, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=10000.0), max_position_embeddings=512, attention_windows=(None, 5, None, None, 5),
            moe_layers=(True,) * 5, n_experts=8, top_k_per_layer=(3,) * 5, d_expert=32, d_shared=40,
            norm_topk_prob=True, tie_word_embeddings=True, layer_types=("linear_attention", "sliding_attention",
            "linear_attention", "full_attention", "sliding_attention"), linear_n_key_heads=2, linear_n_value_heads=4,
            linear_d_key=8, linear_d_value=12, linear_conv_kernel=4),
        read=["attention_bias", "head_dim", "hidden_act", "hidden_size", "layer_types", "linear_conv_kernel_dim",
            "linear_key_head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_value_head_dim",
            "max_position_embeddings", "moe_intermediate_size", "norm_topk_prob", "num_attention_heads", "num_experts",
            "num_experts_per_tok", "num_hidden_layers", "num_key_value_heads", "partial_rotary_factor", "rms_norm_eps",
            "rope_parameters", "rope_scaling", "rope_theta", "shared_expert_intermediate_size", "sliding_window",
            "tie_word_embeddings", "vocab_size"],
        ignored=("attention_dropout", "router_aux_loss_coef", "output_router_logits"),
    ),
    "longcat_flash": Case(
        raw={"attention_bias": False, "expert_ffn_hidden_size": 32, "ffn_hidden_size": 80, "head_dim": 8,
            "hidden_act": "silu", "hidden_size": 64, "kv_lora_rank": 16, "max_position_embeddings": 512, "moe_topk": 3,
            "n_routed_experts": 6, "num_attention_heads": 4, "num_key_value_heads": 4, "num_layers": 2, "q_lora_rank": 24,
            "qk_head_dim": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "rms_norm_eps": 1e-05,
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "routed_scaling_factor": 3.0,
            "tie_word_embeddings": False, "v_head_dim": 12, "vocab_size": 96, "zero_expert_num": 2},
        # d_head is qk_nope_head_dim + qk_rope_head_dim; the rotary dims always interleaved
        fields=dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, d_head=16, d_vocab=96, norm_eps=1e-05,
            rope=RopeConfig(theta=10000.0, interleaved=True), max_position_embeddings=512, d_mlp=80,
            moe_layers=(True, True), n_experts=6, top_k_per_layer=(3, 3), d_expert=32, routed_scaling_factor=3.0,
            q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, n_identity_experts=2),
        read=["attention_bias", "expert_ffn_hidden_size", "ffn_hidden_size", "head_dim", "hidden_act", "hidden_size",
            "kv_lora_rank", "max_position_embeddings", "moe_topk", "n_routed_experts", "num_attention_heads",
            "num_key_value_heads", "num_layers", "partial_rotary_factor", "q_lora_rank", "qk_head_dim",
            "qk_nope_head_dim", "qk_rope_head_dim", "rms_norm_eps", "rope_parameters", "rope_scaling", "rope_theta",
            "routed_scaling_factor", "router_bias", "tie_word_embeddings", "v_head_dim", "vocab_size", "zero_expert_num"],
        ignored=(),
    ),
    "llama4_text": Case(
        # as transformers writes it: moe_layers, no_rope_layers and layer_types listed per layer
        raw={"attention_bias": False, "attention_chunk_size": 8, "attention_dropout": 0.0, "attn_scale": 0.1,
            "attn_temperature_tuning": True, "floor_scale": 4, "head_dim": 16, "hidden_act": "silu", "hidden_size": 64,
            "intermediate_size": 32, "intermediate_size_mlp": 80, "interleave_moe_layer_step": 1, "layer_types":
            ["chunked_attention", "full_attention", "chunked_attention", "full_attention"], "max_position_embeddings":
            256, "moe_layers": [0, 1, 2, 3], "no_rope_layer_interval": 2, "no_rope_layers": [1, 0, 1, 0],
            "num_attention_heads": 4, "num_experts_per_tok": 1, "num_hidden_layers": 4, "num_key_value_heads": 2,
            "num_local_experts": 8, "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_parameters":
            {"factor": 16.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 16,
            "rope_theta": 500000.0, "rope_type": "llama3"}, "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0,
            "tie_word_embeddings": False, "use_qk_norm": True, "vocab_size": 96},
        # every layer a mixture: no dense MLP width; the shared expert as wide as a routed one; chunks on RoPE layers
        fields=dict(d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_head=16, d_vocab=96, norm_eps=1e-05,
            rope=RopeConfig(theta=500000.0, kind="llama3", factor=16.0, original_max_position_embeddings=16,
            low_freq_factor=1.0, high_freq_factor=4.0), max_position_embeddings=256, moe_layers=(True, True, True,
            True), n_experts=8, top_k_per_layer=(1, 1, 1, 1), d_expert=32, d_shared=32, rope_layers=(True, False, True,
            False), attention_chunks=(8, None, 8, None), use_qk_norm=True, attn_temperature_tuning=True,
            floor_scale=4.0, attn_scale=0.1),
        read=["attention_bias", "attention_chunk_size", "attn_scale", "attn_temperature_tuning", "floor_scale",
            "head_dim", "hidden_act", "hidden_size", "intermediate_size", "layer_types", "max_position_embeddings",
            "moe_layers", "no_rope_layers", "num_attention_heads", "num_experts_per_tok", "num_hidden_layers",
            "num_key_value_heads", "num_local_experts", "partial_rotary_factor", "rms_norm_eps", "rope_parameters",
            "rope_scaling", "rope_theta", "tie_word_embeddings", "use_qk_norm", "vocab_size"],
        ignored=("router_aux_loss_coef", "router_jitter_noise", "attention_dropout", "output_router_logits"),
    ),
    "nemotron_h": Case(
        # as transformers writes it: layers_block_type (not the Hub's hybrid_override_pattern, which its own suite
        # reads), transformers' names for the Mamba-2 fields; no rotary at all
        raw={"attention_bias": False, "chunk_size": 32, "conv_kernel": 4, "expand": 2, "head_dim": 16, "hidden_size": 64,
            "intermediate_size": 80, "layer_norm_epsilon": 1e-05, "layers_block_type": ["linear_attention", "moe",
            "full_attention", "mlp", "linear_attention", "moe", "full_attention", "moe"], "mamba_head_dim": 8,
            "mamba_hidden_act": "silu", "mamba_num_heads": 8, "mamba_proj_bias": False, "mamba_ssm_cache_dtype":
            "float32", "max_position_embeddings": 512, "mlp_bias": False, "mlp_hidden_act": "relu2",
            "moe_intermediate_size": 32, "moe_latent_size": None, "moe_shared_expert_intermediate_size": 48,
            "moe_shared_expert_overlap": True, "mtp_layers_block_type": ["full_attention", "moe"], "n_group": 2,
            "n_groups": 2, "n_routed_experts": 8, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 4,
            "num_experts_per_tok": 3, "num_key_value_heads": 2, "num_logits_to_keep": 1, "num_nextn_predict_layers": 0,
            "rescale_prenorm_residual": True, "residual_in_fp32": False, "routed_scaling_factor": 2.5, "sliding_window":
            None, "ssm_state_size": 16, "tie_word_embeddings": False, "time_step_floor": 0.0001, "time_step_limit":
            [0.0, math.inf], "time_step_max": 0.1, "time_step_min": 0.001, "topk_group": 1, "use_bias": False,
            "use_conv_bias": True, "use_mamba_kernels": True, "vocab_size": 96},
        # the rotary is never applied (its default only); dt is clamped below by time_step_min in the chunked form
        fields=dict(d_model=64, n_layers=8, n_heads=4, n_kv_heads=2, d_head=16, d_vocab=96, norm_eps=1e-05,
            rope=RopeConfig(theta=10000.0), max_position_embeddings=512, act_fn="relu2", d_mlp=80,
            moe_layers=(False, True, False, False, False, True, False, True), n_experts=8,
            top_k_per_layer=(0, 3, 0, 0, 0, 3, 0, 3), d_expert=32, d_shared=48, norm_topk_prob=True,
            routed_scaling_factor=2.5, n_group=2, topk_group=1, layer_types=("linear_attention", "moe", "full_attention",
            "mlp", "linear_attention", "moe", "full_attention", "moe"), mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2,
            mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=32, mamba_time_step_limit=(0.001, math.inf)),
        read=["chunk_size", "conv_kernel", "head_dim", "hidden_size", "intermediate_size", "layer_norm_epsilon",
            "layers_block_type", "mamba_head_dim", "mamba_hidden_act", "mamba_num_heads", "max_position_embeddings",
            "mlp_bias", "mlp_hidden_act", "moe_intermediate_size", "moe_latent_size", "moe_shared_expert_intermediate_size",
            "n_group", "n_groups", "n_routed_experts", "norm_topk_prob", "num_attention_heads", "num_experts_per_tok",
            "num_hidden_layers", "num_key_value_heads", "routed_scaling_factor", "ssm_state_size", "tie_word_embeddings",
            "time_step_min", "topk_group", "use_bias", "use_conv_bias", "vocab_size"],
        ignored=("residual_in_fp32", "n_shared_experts", "moe_shared_expert_overlap", "num_logits_to_keep",
            "use_mamba_kernels", "mamba_ssm_cache_dtype", "rescale_prenorm_residual", "time_step_max", "time_step_floor",
            "time_step_limit", "sliding_window", "attention_bias", "expand", "mamba_proj_bias", "num_nextn_predict_layers",
            "mtp_layers_block_type"),
    ),
    "granitemoe": Case(
        raw={"attention_bias": False, "attention_multiplier": 0.15, "embedding_multiplier": 6.0, "hidden_act": "silu",
            "hidden_size": 64, "intermediate_size": 32, "logits_scaling": 2.5, "max_position_embeddings": 256,
            "num_attention_heads": 4, "num_experts_per_tok": 3, "num_hidden_layers": 3, "num_key_value_heads": 2,
            "num_local_experts": 8, "residual_multiplier": 0.4, "rms_norm_eps": 1e-06, "rope_parameters":
            {"rope_theta": 10000.0, "rope_type": "default"}, "tie_word_embeddings": False, "vocab_size": 96},
        fields=dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_head=16, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=10000.0), max_position_embeddings=256, moe_layers=(True, True, True), n_experts=8,
            top_k_per_layer=(3, 3, 3), d_expert=32, embedding_multiplier=6.0, residual_multiplier=0.4,
            attention_multiplier=0.15, logits_scaling=2.5),
        read=["attention_bias", "attention_multiplier", "embedding_multiplier", "head_dim", "hidden_act", "hidden_size",
            "intermediate_size", "logits_scaling", "max_position_embeddings", "num_attention_heads",
            "num_experts_per_tok", "num_hidden_layers", "num_key_value_heads", "num_local_experts",
            "partial_rotary_factor", "residual_multiplier", "rms_norm_eps", "rope_parameters", "rope_scaling",
            "rope_theta", "tie_word_embeddings", "vocab_size"],
        ignored=(),
    ),
    "granitemoeshared": Case(
        raw={"attention_bias": False, "attention_multiplier": 0.15, "embedding_multiplier": 6.0, "hidden_act": "silu",
            "hidden_size": 64, "intermediate_size": 32, "logits_scaling": 2.5, "max_position_embeddings": 256,
            "num_attention_heads": 4, "num_experts_per_tok": 3, "num_hidden_layers": 3, "num_key_value_heads": 2,
            "num_local_experts": 8, "residual_multiplier": 0.4, "rms_norm_eps": 1e-06, "rope_parameters":
            {"rope_theta": 10000.0, "rope_type": "default"}, "shared_intermediate_size": 48,
            "tie_word_embeddings": False, "vocab_size": 96},
        fields=dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_head=16, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=10000.0), max_position_embeddings=256, moe_layers=(True, True, True), n_experts=8,
            top_k_per_layer=(3, 3, 3), d_expert=32, d_shared=48, embedding_multiplier=6.0, residual_multiplier=0.4,
            attention_multiplier=0.15, logits_scaling=2.5),
        read=["attention_bias", "attention_multiplier", "embedding_multiplier", "head_dim", "hidden_act", "hidden_size",
            "intermediate_size", "logits_scaling", "max_position_embeddings", "num_attention_heads",
            "num_experts_per_tok", "num_hidden_layers", "num_key_value_heads", "num_local_experts",
            "partial_rotary_factor", "residual_multiplier", "rms_norm_eps", "rope_parameters", "rope_scaling",
            "rope_theta", "shared_intermediate_size", "tie_word_embeddings", "vocab_size"],
        ignored=(),
    ),
    "granitemoe_swa": Case(
        raw={"attention_bias": False, "attention_multiplier": 0.15, "embedding_multiplier": 6.0, "hidden_act": "silu",
            "hidden_size": 64, "intermediate_size": 32, "layer_rope_theta": [0, 10000.0, 500.0, 0], "layer_types":
            ["sliding_attention", "full_attention", "sliding_attention", "full_attention"], "logits_scaling": 2.5,
            "max_position_embeddings": 256, "num_attention_heads": 4, "num_experts_per_tok": 3, "num_hidden_layers": 4,
            "num_key_value_heads": 2, "num_local_experts": 8, "residual_multiplier": 0.4, "rms_norm_eps": 1e-06,
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "shared_intermediate_size": 48,
            "sliding_window": 5, "tie_word_embeddings": False, "vocab_size": 96},
        fields=dict(d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_head=16, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=10000.0), max_position_embeddings=256, moe_layers=(True,) * 4, n_experts=8,
            top_k_per_layer=(3,) * 4, d_expert=32, d_shared=48, embedding_multiplier=6.0, residual_multiplier=0.4,
            attention_multiplier=0.15, logits_scaling=2.5, attention_windows=(5, None, 5, None),
            layer_ropes=(None, RopeConfig(theta=10000.0), RopeConfig(theta=500.0), None)),
        read=["attention_bias", "attention_multiplier", "embedding_multiplier", "head_dim", "hidden_act", "hidden_size",
            "intermediate_size", "layer_rope_theta", "layer_types", "logits_scaling", "max_position_embeddings",
            "num_attention_heads", "num_experts_per_tok", "num_hidden_layers", "num_key_value_heads",
            "num_local_experts", "partial_rotary_factor", "residual_multiplier", "rms_norm_eps", "rope_parameters",
            "rope_scaling", "rope_theta", "shared_intermediate_size", "sliding_window", "tie_word_embeddings",
            "vocab_size"],
        ignored=(),
    ),
    "granitemoehybrid": Case(
        raw={"attention_bias": False, "attention_multiplier": 0.15, "embedding_multiplier": 6.0, "hidden_act": "silu",
            "hidden_size": 64, "intermediate_size": 32, "layer_types": ["mamba", "attention", "mamba"],
            "logits_scaling": 2.5, "mamba_chunk_size": 8, "mamba_conv_bias": True, "mamba_d_conv": 4,
            "mamba_d_head": 16, "mamba_d_state": 16, "mamba_expand": 2, "mamba_n_groups": 2, "mamba_n_heads": 8,
            "mamba_proj_bias": False, "max_position_embeddings": 256, "normalization_function": "rmsnorm",
            "num_attention_heads": 4, "num_experts_per_tok": 3, "num_hidden_layers": 3, "num_key_value_heads": 2,
            "num_local_experts": 8, "position_embedding_type": "nope", "residual_multiplier": 0.4,
            "rms_norm_eps": 1e-06, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
            "shared_intermediate_size": 48, "tie_word_embeddings": False,
            "time_step_limit": [0.0, {"__float__": "Infinity"}], "vocab_size": 96},
        fields=dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_head=16, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=10000.0), max_position_embeddings=256, moe_layers=(True, True, True), n_experts=8,
            top_k_per_layer=(3, 3, 3), d_expert=32, d_shared=48, embedding_multiplier=6.0, residual_multiplier=0.4,
            attention_multiplier=0.15, logits_scaling=2.5,
            layer_types=("linear_attention", "full_attention", "linear_attention"), mamba_n_heads=8, mamba_d_head=16,
            mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=8, mamba_norm_eps=1e-06),
        read=["attention_bias", "attention_multiplier", "embedding_multiplier", "head_dim", "hidden_act", "hidden_size",
            "intermediate_size", "layer_types", "logits_scaling", "mamba_chunk_size", "mamba_conv_bias", "mamba_d_conv",
            "mamba_d_head", "mamba_d_state", "mamba_expand", "mamba_n_groups", "mamba_n_heads", "mamba_proj_bias",
            "max_position_embeddings", "num_attention_heads", "num_experts_per_tok", "num_hidden_layers",
            "num_key_value_heads", "num_local_experts", "partial_rotary_factor", "position_embedding_type",
            "residual_multiplier", "rms_norm_eps", "rope_parameters", "rope_scaling", "rope_theta",
            "shared_intermediate_size", "tie_word_embeddings", "time_step_limit", "vocab_size"],
        ignored=("normalization_function",),
    ),
    "lfm2_moe": Case(
        raw={"conv_L_cache": 3, "conv_bias": False, "hidden_size": 64, "intermediate_size": 80,
            "layer_types": ["conv", "full_attention", "conv", "conv"], "max_position_embeddings": 256,
            "moe_intermediate_size": 32, "norm_eps": 1e-05, "norm_topk_prob": True, "num_attention_heads": 4,
            "num_dense_layers": 1, "num_experts": 8, "num_experts_per_tok": 3, "num_hidden_layers": 4,
            "num_key_value_heads": 2, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
            "routed_scaling_factor": 1.0, "tie_word_embeddings": True, "use_expert_bias": True, "vocab_size": 96},
        fields=dict(d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_head=16, d_vocab=96, norm_eps=1e-05,
            rope=RopeConfig(theta=10000.0), max_position_embeddings=256, d_mlp=80,
            moe_layers=(False, True, True, True), n_experts=8, top_k_per_layer=(0, 3, 3, 3), d_expert=32,
            norm_topk_prob=True, tie_word_embeddings=True, layer_types=("conv", "full_attention", "conv", "conv")),
        read=["conv_L_cache", "conv_bias", "head_dim", "hidden_size", "intermediate_size", "layer_types",
            "max_position_embeddings", "moe_intermediate_size", "norm_eps", "norm_topk_prob", "num_attention_heads",
            "num_dense_layers", "num_experts", "num_experts_per_tok", "num_hidden_layers", "num_key_value_heads",
            "partial_rotary_factor", "rope_parameters", "rope_scaling", "rope_theta", "routed_scaling_factor",
            "tie_embedding", "tie_word_embeddings", "use_expert_bias", "vocab_size"],
        ignored=(),
    ),
    "minimax": Case(
        raw={"block_size": 8, "full_attn_alpha_factor": 1.5, "full_attn_beta_factor": 0.75, "head_dim": 16,
            "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 32, "layer_types": ["linear_attention",
            "full_attention", "linear_attention", "linear_attention"], "linear_attn_alpha_factor": 1.25,
            "linear_attn_beta_factor": 0.8, "max_position_embeddings": 256, "mlp_alpha_factor": 1.1,
            "mlp_beta_factor": 1.3, "num_attention_heads": 4, "num_experts_per_tok": 2, "num_hidden_layers": 4,
            "num_key_value_heads": 2, "num_local_experts": 8, "rms_norm_eps": 1e-05, "rope_parameters": {"rope_theta":
            1000.0, "rope_type": "default"}, "sliding_window": None, "tie_word_embeddings": False, "vocab_size": 96},
        fields=dict(d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_head=16, d_vocab=96, norm_eps=1e-05,
            rope=RopeConfig(theta=1000.0), max_position_embeddings=256, attention_windows=(None, None, None, None),
            moe_layers=(True, True, True, True), n_experts=8, top_k_per_layer=(2, 2, 2, 2), d_expert=32,
            norm_topk_prob=True, layer_types=("linear_attention", "full_attention", "linear_attention",
            "linear_attention"), lightning_block_size=8, full_attn_alpha_factor=1.5, full_attn_beta_factor=0.75,
            linear_attn_alpha_factor=1.25, linear_attn_beta_factor=0.8, mlp_alpha_factor=1.1, mlp_beta_factor=1.3),
        read=["block_size", "full_attn_alpha_factor", "full_attn_beta_factor", "head_dim", "hidden_act", "hidden_size",
            "intermediate_size", "layer_types", "linear_attn_alpha_factor", "linear_attn_beta_factor",
            "max_position_embeddings", "mlp_alpha_factor", "mlp_beta_factor", "num_attention_heads",
            "num_experts_per_tok", "num_hidden_layers", "num_key_value_heads", "num_local_experts",
            "partial_rotary_factor", "rms_norm_eps", "rope_parameters", "rope_scaling", "rope_theta", "sliding_window",
            "tie_word_embeddings", "vocab_size"],
        ignored=(),
    ),
    "jamba": Case(
        raw={"attn_layer_offset": 1, "attn_layer_period": 3, "expert_layer_offset": 1, "expert_layer_period": 2,
            "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 32, "mamba_conv_bias": True, "mamba_d_conv": 4,
            "mamba_d_state": 8, "mamba_dt_rank": 4, "mamba_expand": 2, "mamba_proj_bias": False,
            "max_position_embeddings": 256, "num_attention_heads": 4, "num_experts": 8, "num_experts_per_tok": 3,
            "num_hidden_layers": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "tie_word_embeddings": False,
            "use_mamba_kernels": True, "vocab_size": 96},
        # attention on layer 1 (1 % 3), mixtures on layers 1 and 3 (odd), no rotary
        fields=dict(d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_head=16, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=10000.0), max_position_embeddings=256, d_mlp=32,
            moe_layers=(False, True, False, True), n_experts=8, top_k_per_layer=(0, 3, 0, 3), d_expert=32,
            layer_types=("linear_attention", "full_attention", "linear_attention", "linear_attention"),
            mamba_d_inner=128, mamba_d_state=8, mamba_d_conv=4, mamba_dt_rank=4),
        read=["attn_layer_offset", "attn_layer_period", "expert_layer_offset", "expert_layer_period", "head_dim",
            "hidden_act", "hidden_size", "intermediate_size", "mamba_conv_bias", "mamba_d_conv", "mamba_d_state",
            "mamba_dt_rank", "mamba_expand", "mamba_proj_bias", "max_position_embeddings", "num_attention_heads",
            "num_experts", "num_experts_per_tok", "num_hidden_layers", "num_key_value_heads", "rms_norm_eps",
            "tie_word_embeddings", "vocab_size"],
        ignored=("use_mamba_kernels",),
    ),
    "mimo_v2_flash": Case(
        raw={"attention_bias": False, "attention_value_scale": 0.6, "head_dim": 24, "hidden_act": "silu", "hidden_size":
            64, "intermediate_size": 80, "layer_types": ["full_attention", "sliding_attention", "sliding_attention",
            "sliding_attention"], "max_position_embeddings": 256, "mlp_layer_types": ["dense", "sparse", "sparse",
            "sparse"], "moe_intermediate_size": 24, "n_group": 4, "n_routed_experts": 8, "norm_topk_prob": True,
            "num_attention_heads": 4, "num_experts_per_tok": 3, "num_hidden_layers": 4, "num_key_value_heads": 1,
            "rms_norm_eps": 1e-05, "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 50000.0,
            "partial_rotary_factor": 0.334}, "sliding_attention": {"rope_type": "default", "rope_theta": 100.0,
            "partial_rotary_factor": 0.5}}, "routed_scaling_factor": 2.5, "sliding_window": 5, "tie_word_embeddings":
            False, "topk_group": 2, "v_head_dim": 16, "vocab_size": 96},
        # the sliding layers: twice the kv heads, their own rotary; values 16 wide, scaled by 0.6
        fields=dict(d_model=64, n_layers=4, n_heads=4, n_kv_heads=1, d_head=24, d_vocab=96, norm_eps=1e-05,
            rope=RopeConfig(theta=50000.0, partial_rotary_factor=0.334), max_position_embeddings=256,
            attention_windows=(None, 5, 5, 5), d_mlp=80, moe_layers=(False, True, True, True), n_experts=8,
            top_k_per_layer=(0, 3, 3, 3), d_expert=24, norm_topk_prob=True, routed_scaling_factor=2.5, n_group=4,
            topk_group=2, d_head_v=16, sliding_kv_heads=2, sliding_rope=RopeConfig(theta=100.0, partial_rotary_factor=0.5),
            value_scale=0.6),
        # the Hub's pattern and head fields are looked up too, to be checked against these where present
        read=["add_full_attention_sink_bias", "add_swa_attention_sink_bias", "attention_bias", "attention_value_scale",
            "head_dim", "hidden_act", "hidden_size", "hybrid_layer_pattern", "intermediate_size", "layer_types",
            "layernorm_epsilon", "max_position_embeddings", "mlp_layer_types", "moe_intermediate_size", "moe_layer_freq",
            "n_group", "n_routed_experts", "n_shared_experts", "norm_topk_prob", "num_attention_heads",
            "num_experts_per_tok", "num_hidden_layers", "num_key_value_heads", "rms_norm_eps", "rope_parameters",
            "rope_theta", "routed_scaling_factor", "sliding_window", "sliding_window_size", "swa_head_dim",
            "swa_num_attention_heads", "swa_num_key_value_heads", "swa_rope_theta", "swa_v_head_dim",
            "tie_word_embeddings", "topk_group", "v_head_dim", "vocab_size"],
        ignored=(),
    ),
}

# config.json with only what the family requires (and what its defaults would contradict): transformers' defaults
MINIMAL = {
    "qwen2_moe": (
        {"hidden_size": 64, "moe_intermediate_size": 32, "num_attention_heads": 4, "num_experts": 8,
            "num_experts_per_tok": 3, "num_hidden_layers": 3, "shared_expert_intermediate_size": 48, "vocab_size": 96},
        dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=4, d_head=16, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=10000.0), max_position_embeddings=32768, qkv_bias=True, moe_layers=(True, True, True),
            n_experts=8, top_k_per_layer=(3, 3, 3), d_expert=32, d_shared=48),
    ),
    "hunyuan_v1_moe": (
        {"hidden_size": 64, "intermediate_size": 32, "moe_topk": [2, 3, 1], "num_attention_heads": 4, "num_experts":
            8, "num_hidden_layers": 3, "vocab_size": 96},
        dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=4, d_head=16, d_vocab=96, norm_eps=1e-05,
            rope=RopeConfig(theta=10000.0), max_position_embeddings=2048, moe_layers=(True, True, True), n_experts=8,
            top_k_per_layer=(2, 3, 1), d_expert=32, d_shared=32, norm_topk_prob=True),
    ),
    "solar_open": (
        {"hidden_size": 64, "moe_intermediate_size": 24, "n_routed_experts": 8, "num_attention_heads": 4,
            "num_experts_per_tok": 3, "num_hidden_layers": 3, "vocab_size": 96, "n_group": 4, "num_key_value_heads": 2,
            "topk_group": 2},
        dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_head=128, d_vocab=96, norm_eps=1e-05,
            rope=RopeConfig(theta=10000.0), max_position_embeddings=131072, moe_layers=(True, True, True), n_experts=8,
            top_k_per_layer=(3, 3, 3), d_expert=24, d_shared=24, norm_topk_prob=True, n_group=4, topk_group=2),
    ),
    "qwen3_moe": (
        {"hidden_size": 64, "moe_intermediate_size": 32, "num_attention_heads": 4, "num_experts_per_tok": 3,
            "num_hidden_layers": 3, "num_local_experts": 8, "vocab_size": 96},
        dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=4, d_head=16, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=10000.0), max_position_embeddings=32768, moe_layers=(True, True, True), n_experts=8,
            top_k_per_layer=(3, 3, 3), d_expert=32),
    ),
    "mixtral": (
        {"hidden_size": 64, "intermediate_size": 32, "num_attention_heads": 4, "num_hidden_layers": 3, "vocab_size":
            96},
        dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=4, d_head=16, d_vocab=96, norm_eps=1e-05,
            rope=RopeConfig(theta=1000000.0), max_position_embeddings=131072, attention_windows=(None, None, None),
            moe_layers=(True, True, True), n_experts=8, top_k_per_layer=(2, 2, 2), d_expert=32, norm_topk_prob=True),
    ),
    "phimoe": (
        {"hidden_size": 64, "num_attention_heads": 8, "num_hidden_layers": 3, "vocab_size": 96},
        dict(d_model=64, n_layers=3, n_heads=8, n_kv_heads=8, d_head=8, d_vocab=96, norm_eps=1e-05,
            rope=RopeConfig(theta=1000000.0), max_position_embeddings=131072, attention_windows=(None, None, None),
            moe_layers=(True, True, True), n_experts=16, top_k_per_layer=(2, 2, 2), d_expert=6400,
            router_jitter_noise=0.01),
    ),
    "olmoe": (
        {"hidden_size": 64, "intermediate_size": 32, "num_attention_heads": 4, "num_experts": 8,
            "num_experts_per_tok": 3, "num_hidden_layers": 3, "vocab_size": 96},
        dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=4, d_head=16, d_vocab=96, norm_eps=1e-05,
            rope=RopeConfig(theta=10000.0), max_position_embeddings=4096, moe_layers=(True, True, True), n_experts=8,
            top_k_per_layer=(3, 3, 3), d_expert=32),
    ),
    "dbrx": (
        # transformers' DbrxConfig defaults: one kv head, 4 experts top-1, ffn_hidden_size 3584, p-norm 1
        {"d_model": 64, "n_heads": 4, "n_layers": 3, "vocab_size": 96},
        dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=1, d_head=16, d_vocab=96, norm_eps=1e-05,
            rope=RopeConfig(theta=10000.0), max_position_embeddings=2048, moe_layers=(True, True, True), n_experts=4,
            top_k_per_layer=(1, 1, 1), d_expert=3584, topk_norm_p=1.0),
    ),
    "deepseek_v3": (
        # four blocks, so that the last (after the first_k_dense_replace = 3 dense ones) is a mixture
        {"num_attention_heads": 4, "num_hidden_layers": 4, "vocab_size": 96},
        dict(d_model=7168, n_layers=4, n_heads=4, n_kv_heads=4, d_head=128 + 64, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=10000.0, interleaved=True), max_position_embeddings=4096, d_mlp=18432,
            moe_layers=(False, False, False, True), n_experts=256, top_k_per_layer=(0, 0, 0, 8), d_expert=2048, d_shared=2048,
            norm_topk_prob=True, routed_scaling_factor=2.5, n_group=8, topk_group=4, q_lora_rank=1536, kv_lora_rank=512,
            qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=3),
    ),
    "mistral4": (
        # transformers' defaults are Mistral Small 4's sizes: every block a mixture, its rotary (YaRN from 8192
        # positions, 64 of the 128-wide head turned) and the queries' scaling by position (beta 0.1)
        {"num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 96},
        dict(d_model=4096, n_layers=2, n_heads=4, n_kv_heads=4, d_head=64 + 64, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=10000.0, kind="yarn", factor=128.0, original_max_position_embeddings=8192, mscale=1.0,
            mscale_all_dim=1.0, interleaved=True), max_position_embeddings=1048576, moe_layers=(True, True),
            n_experts=128, top_k_per_layer=(4, 4), d_expert=2048, d_shared=2048, norm_topk_prob=True,
            routed_scaling_factor=1.0, n_group=1, topk_group=1, q_lora_rank=1024, kv_lora_rank=256,
            qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=0,
            query_scaling_beta=0.1, query_scaling_period=8192),
    ),
    "sarvam_mla": (
        # Sarvam-105B's defaults (transformers' SarvamMLAConfig): one dense block first, 128 experts, top 8
        {"num_attention_heads": 4, "num_hidden_layers": 3, "vocab_size": 96},
        dict(d_model=4096, n_layers=3, n_heads=4, n_kv_heads=4, d_head=128 + 64, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=10000.0, interleaved=True), max_position_embeddings=4096, d_mlp=16384,
            moe_layers=(False, True, True), n_experts=128, top_k_per_layer=(0, 8, 8), d_expert=2048, d_shared=2048,
            norm_topk_prob=True, routed_scaling_factor=2.5, kv_lora_rank=512, qk_nope_head_dim=128,
            qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=1),
    ),
    "afmoe": (
        # transformers' AfmoeConfig defaults: every fourth layer full attention, the first block dense
        {"num_attention_heads": 4, "num_hidden_layers": 4, "vocab_size": 96},
        dict(d_model=2048, n_layers=4, n_heads=4, n_kv_heads=4, d_head=128, d_vocab=96, norm_eps=1e-05,
            rope=RopeConfig(theta=10000.0), max_position_embeddings=16384, attention_windows=(1024, 1024, 1024, None),
            d_mlp=6144, moe_layers=(False, True, True, True), n_experts=64, top_k_per_layer=(0, 6, 6, 6), d_expert=1408,
            d_shared=2816, norm_topk_prob=True, rotary_layers=(True, True, True, False)),
    ),
    "beam": (
        # transformers' BeamConfig defaults: three dense blocks, every sixth layer full (NoPE) and the last, logits
        # capped at 30
        {"num_attention_heads": 8, "num_hidden_layers": 4, "vocab_size": 96},
        dict(d_model=5120, n_layers=4, n_heads=8, n_kv_heads=8, d_head=128, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=10000.0), max_position_embeddings=8192, attention_windows=(512, 512, 512, None),
            d_mlp=20480, moe_layers=(False, False, False, True), n_experts=256, top_k_per_layer=(0, 0, 0, 8),
            d_expert=2560, norm_topk_prob=True, routed_scaling_factor=2.5, n_group=8, topk_group=4,
            layer_ropes=(RopeConfig(theta=10000.0),) * 3 + (None,), final_logit_softcapping=30.0),
    ),
    "axk1": (
        # transformers' defaults are A.X K1's sizes; the blocks from the legacy first_k_dense_replace 1
        {"num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 96},
        dict(d_model=7168, n_layers=2, n_heads=4, n_kv_heads=4, d_head=128 + 64, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=10000.0, interleaved=True), max_position_embeddings=32768, d_mlp=18432,
            moe_layers=(False, True), n_experts=192, top_k_per_layer=(0, 8), d_expert=2048, d_shared=2048,
            norm_topk_prob=True, routed_scaling_factor=2.5, n_group=8, topk_group=4, q_lora_rank=1536, kv_lora_rank=512,
            qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=1),
    ),
    "kolibri1": (
        # transformers' defaults are Kolibri 1's sizes; every fifth layer full
        {"num_attention_heads": 4, "num_hidden_layers": 5, "vocab_size": 96},
        dict(d_model=2560, n_layers=5, n_heads=4, n_kv_heads=4, d_head=128, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=10000.0), max_position_embeddings=262144, attention_windows=(513, 513, 513, 513, None),
            moe_layers=(True,) * 5, n_experts=384, top_k_per_layer=(6,) * 5, d_expert=512, d_shared=512),
    ),
    "flint": (
        # transformers' defaults are Flint's sizes: full attention on the first two layers, every fourth from layer 1
        # and the last; the first two blocks dense
        {"num_attention_heads": 4, "num_hidden_layers": 6, "vocab_size": 96},
        dict(d_model=2048, n_layers=6, n_heads=4, n_kv_heads=4, d_head=128, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=10000.0), max_position_embeddings=262144,
            attention_windows=(None, None, 513, 513, 513, None), d_mlp=6144,
            moe_layers=(False, False, True, True, True, True), n_experts=256, top_k_per_layer=(0, 0, 6, 6, 6, 6),
            d_expert=512, d_shared=1024, norm_topk_prob=True),
    ),
    "aria_text": (
        # transformers' AriaTextConfig defaults
        {"num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 96},
        dict(d_model=4096, n_layers=2, n_heads=4, n_kv_heads=4, d_head=1024, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=10000.0), max_position_embeddings=2048, moe_layers=(True, True), n_experts=8,
            top_k_per_layer=(2, 2), d_expert=4096, d_shared=8192),
    ),
    "cohere2_moe": (
        # transformers' Cohere2MoeConfig defaults: each fourth layer full (and without rotary), the others a window
        # of 4096; every layer a mixture of 8 experts, top 2; Cohere's LayerNorm (eps 1e-5); a tied head
        {"num_attention_heads": 4, "num_hidden_layers": 5, "vocab_size": 96},
        dict(d_model=8192, n_layers=5, n_heads=4, n_kv_heads=4, d_head=128, d_vocab=96, norm_eps=1e-05,
            rope=RopeConfig(theta=10000.0), max_position_embeddings=8192, attention_windows=(4096, 4096, 4096, None,
            4096), moe_layers=(True,) * 5, n_experts=8, top_k_per_layer=(2,) * 5, d_expert=22528,
            tie_word_embeddings=True, rotary_layers=(True, True, True, False, True)),
    ),
    "mellum": (
        # transformers' defaults are Mellum2-12B-A2.5B's sizes: every layer full and a mixture, the full layers' base
        {"num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 96},
        dict(d_model=2304, n_layers=2, n_heads=4, n_kv_heads=4, d_head=128, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=500000.0), max_position_embeddings=131072, attention_windows=(None, None),
            moe_layers=(True, True), n_experts=64, top_k_per_layer=(8, 8), d_expert=896, norm_topk_prob=True,
            layer_ropes=(RopeConfig(theta=500000.0),) * 2),
    ),
    "glm4_moe_lite": (
        # transformers' default layer types: the first block dense
        {"num_attention_heads": 20, "num_hidden_layers": 2, "vocab_size": 96},
        dict(d_model=2048, n_layers=2, n_heads=20, n_kv_heads=20, d_head=192 + 64, d_vocab=96, norm_eps=1e-05,
            rope=RopeConfig(theta=10000.0, interleaved=True), max_position_embeddings=202752, d_mlp=10240,
            moe_layers=(False, True), n_experts=64, top_k_per_layer=(0, 4), d_expert=1536, d_shared=1536,
            norm_topk_prob=True, routed_scaling_factor=1.8, n_group=1, topk_group=1, q_lora_rank=768, kv_lora_rank=512,
            qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, first_k_dense_replace=1),
    ),
    "kimi_linear": (
        # transformers' defaults: the first block dense, full attention on layers 4, 8, ... (from 0), no group limit
        {"num_attention_heads": 4, "num_hidden_layers": 6, "vocab_size": 96},
        dict(d_model=2304, n_layers=6, n_heads=4, n_kv_heads=4, d_head=128 + 64, d_vocab=96, norm_eps=1e-05,
            rope=RopeConfig(theta=10000.0), max_position_embeddings=1048576, d_mlp=9216,
            moe_layers=(False,) + (True,) * 5, n_experts=256, top_k_per_layer=(0,) + (8,) * 5, d_expert=1024,
            d_shared=1024, norm_topk_prob=True, routed_scaling_factor=2.446, n_group=1, topk_group=1, kv_lora_rank=512,
            qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=1,
            layer_types=("linear_attention",) * 4 + ("full_attention", "linear_attention"), linear_n_heads=32,
            linear_d_head=128, linear_conv_kernel=4),
    ),
    "bailing_hybrid": (
        # transformers' defaults: two dense blocks first, full attention on the last of every six layers
        {"num_attention_heads": 4, "num_hidden_layers": 6, "vocab_size": 96},
        dict(d_model=2560, n_layers=6, n_heads=4, n_kv_heads=4, d_head=128 + 64, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=6000000.0, interleaved=True), max_position_embeddings=262144, d_mlp=6144,
            moe_layers=(False, False) + (True,) * 4, n_experts=512, top_k_per_layer=(0, 0) + (8,) * 4, d_expert=768,
            d_shared=768, norm_topk_prob=True, routed_scaling_factor=2.5, n_group=8, topk_group=4, kv_lora_rank=512,
            qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=2, mtp_layers=1,
            layer_types=("linear_attention",) * 5 + ("full_attention",), linear_n_heads=4, linear_d_head=128,
            linear_conv_kernel=4),
    ),
    "deepseek_v2": (
        # num_experts_per_tok has no default in transformers; first_k_dense_replace 0: every block a mixture
        {"num_attention_heads": 4, "num_experts_per_tok": 6, "num_hidden_layers": 2, "vocab_size": 96},
        dict(d_model=4096, n_layers=2, n_heads=4, n_kv_heads=4, d_head=128 + 64, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=10000.0, interleaved=True), max_position_embeddings=2048, moe_layers=(True, True),
            n_experts=64, top_k_per_layer=(6, 6), d_expert=1407, d_shared=2814, norm_topk_prob=False,
            routed_scaling_factor=1.0, n_group=1, topk_group=1, q_lora_rank=1536, kv_lora_rank=512,
            qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=0),
    ),
    "ernie4_5_moe": (
        # transformers' defaults are ERNIE-4.5-21B-A3B's sizes: the first block dense, the embeddings tied
        {"num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 96},
        dict(d_model=2560, n_layers=2, n_heads=4, n_kv_heads=4, d_head=640, d_vocab=96, norm_eps=1e-05,
            rope=RopeConfig(theta=500000.0, interleaved=True), max_position_embeddings=131072, d_mlp=12288,
            moe_layers=(False, True), n_experts=64, top_k_per_layer=(0, 6), d_expert=1536, d_shared=3072,
            norm_topk_prob=True, tie_word_embeddings=True),
    ),
    "flex_olmo": (
        # transformers' defaults are FlexOlmo-7x7B-1T's sizes
        {"num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 96},
        dict(d_model=4096, n_layers=2, n_heads=4, n_kv_heads=4, d_head=1024, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=500000.0), max_position_embeddings=4096, moe_layers=(True, True), n_experts=7,
            top_k_per_layer=(5, 5), d_expert=11008),
    ),
    "deepseek_v32": (
        {"num_attention_heads": 4, "num_hidden_layers": 4, "vocab_size": 96},
        dict(d_model=7168, n_layers=4, n_heads=4, n_kv_heads=4, d_head=128 + 64, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=10000.0, interleaved=True), max_position_embeddings=163840, d_mlp=18432,
            moe_layers=(False, False, False, True), n_experts=256, top_k_per_layer=(0, 0, 0, 8), d_expert=2048, d_shared=2048,
            norm_topk_prob=True, routed_scaling_factor=2.5, n_group=8, topk_group=4, q_lora_rank=1536, kv_lora_rank=512,
            qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=3, index_topk=2048,
            index_head_dim=128, index_n_heads=64, indexer_layers=(True, True, True, True)),
    ),
    "glm_moe_dsa": (
        # GLM-5's sizes; without indexer_types or its schedule's fields every layer runs its own indexer
        {"num_attention_heads": 4, "num_hidden_layers": 4, "vocab_size": 96},
        dict(d_model=6144, n_layers=4, n_heads=4, n_kv_heads=4, d_head=192 + 64, d_vocab=96, norm_eps=1e-05,
            rope=RopeConfig(theta=10000.0, interleaved=True), max_position_embeddings=202752, d_mlp=12288,
            moe_layers=(False, False, False, True), n_experts=256, top_k_per_layer=(0, 0, 0, 8), d_expert=2048, d_shared=2048,
            norm_topk_prob=True, routed_scaling_factor=2.5, n_group=1, topk_group=1, q_lora_rank=2048, kv_lora_rank=512,
            qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, first_k_dense_replace=3, index_topk=2048,
            index_head_dim=128, index_n_heads=32, indexer_layers=(True, True, True, True), index_rope_interleaved=True),
    ),
    "gpt_oss": (
        {"hidden_size": 64, "intermediate_size": 32, "num_attention_heads": 4, "num_hidden_layers": 3,
            "num_local_experts": 8, "vocab_size": 96},
        dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=4, d_head=16, d_vocab=96, norm_eps=1e-05,
            rope=RopeConfig(theta=150000.0), max_position_embeddings=131072, qkv_bias=True, o_bias=True,
            attention_windows=(128, None, 128), moe_layers=(True, True, True), n_experts=8, top_k_per_layer=(4, 4, 4),
            d_expert=32),
    ),
    "glm4_moe": (
        {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 3, "vocab_size": 96,
            "num_key_value_heads": 2},
        dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_head=16, d_vocab=96, norm_eps=1e-05,
            rope=RopeConfig(theta=10000.0, partial_rotary_factor=0.5), max_position_embeddings=131072, d_mlp=10944,
            moe_layers=(False, True, True), n_experts=128, top_k_per_layer=(0, 8, 8), d_expert=1408, d_shared=1408,
            norm_topk_prob=True),
    ),
    "sarvam_moe": (
        # Sarvam-30B's defaults (transformers' SarvamMoEConfig): the whole head rotated at theta 8e6, head_dim 64,
        # 4 key-value heads, the q/k norm, 128 experts of 1024, top 6, weights times 2.5
        {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 3, "vocab_size": 96},
        dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=4, d_head=64, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=8000000.0), max_position_embeddings=131072, d_mlp=8192,
            moe_layers=(False, True, True), n_experts=128, top_k_per_layer=(0, 6, 6), d_expert=1024, d_shared=1024,
            norm_topk_prob=True, routed_scaling_factor=2.5, qk_norm=True),
    ),
    "dots1": (
        {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 3, "vocab_size": 96, "num_key_value_heads": 2,
            "n_routed_experts": 8, "n_shared_experts": 2, "num_experts_per_tok": 3},
        dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_head=16, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=10000.0), max_position_embeddings=2048, attention_windows=(None, None, None),
            moe_layers=(True, True, True), n_experts=8, top_k_per_layer=(3, 3, 3), d_expert=1408, d_shared=2816,
            qk_norm=True),
    ),
    "hy_v3": (
        {"hidden_size": 64, "num_attention_heads": 16, "num_hidden_layers": 3, "vocab_size": 96},
        dict(d_model=64, n_layers=3, n_heads=16, n_kv_heads=8, d_head=128, d_vocab=96, norm_eps=1e-05,
            rope=RopeConfig(theta=11158840.0), max_position_embeddings=131072, d_mlp=13312,
            moe_layers=(False, True, True), n_experts=192, top_k_per_layer=(0, 8, 8), d_expert=1536, d_shared=1536,
            norm_topk_prob=True, routed_scaling_factor=2.826, qk_norm=True),
    ),
    "exaone_moe": (
        {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 3, "vocab_size": 96, "num_key_value_heads": 2},
        dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_head=16, d_vocab=96, norm_eps=1e-05,
            rope=RopeConfig(theta=10000.0), max_position_embeddings=2048, attention_windows=(4096, 4096, 4096),
            d_mlp=16384, moe_layers=(False, True, True), n_experts=64, top_k_per_layer=(0, 8, 8), d_expert=1024,
            d_shared=1024, norm_topk_prob=True, routed_scaling_factor=2.5, qk_norm=True),
    ),
    "minimax_m2": (
        {"hidden_size": 64, "intermediate_size": 32, "num_attention_heads": 4, "num_hidden_layers": 3, "vocab_size":
            96, "num_key_value_heads": 2},
        dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_head=128, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=5000000.0), max_position_embeddings=196608, moe_layers=(True, True, True),
            n_experts=256, top_k_per_layer=(8, 8, 8), d_expert=32, norm_topk_prob=True),
    ),
    "qwen3_next": (
        # transformers' defaults are Qwen3-Next-80B-A3B's sizes; layer_types from full_attention_interval 4
        {"num_attention_heads": 4, "num_hidden_layers": 4, "vocab_size": 96},
        dict(d_model=2048, n_layers=4, n_heads=4, n_kv_heads=4, d_head=256, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=10000.0, partial_rotary_factor=0.25), max_position_embeddings=32768,
            moe_layers=(True, True, True, True), n_experts=512, top_k_per_layer=(10, 10, 10, 10), d_expert=512,
            d_shared=512, norm_topk_prob=True, layer_types=("linear_attention",) * 3 + ("full_attention",),
            linear_n_key_heads=16, linear_n_value_heads=32, linear_d_key=128, linear_d_value=128, linear_conv_kernel=4),
    ),
    "lara_mini": (
        # transformers' defaults are Lara-4-Mini's sizes; layer_types the released period-5 pattern
        {"num_attention_heads": 4, "num_hidden_layers": 5, "vocab_size": 96},
        dict(d_model=1024, n_layers=5, n_heads=4, n_kv_heads=4, d_head=128, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=10000.0), max_position_embeddings=131072,
            attention_windows=(None, 512, None, None, 512), moe_layers=(True,) * 5, n_experts=128,
            top_k_per_layer=(4,) * 5, d_expert=512, d_shared=512, norm_topk_prob=True, tie_word_embeddings=True,
            layer_types=("linear_attention", "sliding_attention", "linear_attention", "full_attention",
            "sliding_attention"), linear_n_key_heads=8, linear_n_value_heads=16, linear_d_key=128, linear_d_value=128,
            linear_conv_kernel=4),
    ),
    "qwen3_5_moe_text": (
        # transformers' defaults are Qwen3.5-35B-A3B's sizes; a mixture on every layer, layer_types from
        # full_attention_interval 4
        {"num_attention_heads": 4, "num_hidden_layers": 4, "vocab_size": 96},
        dict(d_model=2048, n_layers=4, n_heads=4, n_kv_heads=4, d_head=256, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=10000.0, partial_rotary_factor=0.25), max_position_embeddings=32768,
            moe_layers=(True, True, True, True), n_experts=256, top_k_per_layer=(8, 8, 8, 8), d_expert=512,
            d_shared=512, norm_topk_prob=True, layer_types=("linear_attention",) * 3 + ("full_attention",),
            linear_n_key_heads=16, linear_n_value_heads=32, linear_d_key=128, linear_d_value=128, linear_conv_kernel=4),
    ),
    "longcat_flash": (
        # transformers' defaults are LongCat-Flash-Chat's sizes
        {"num_layers": 2},
        dict(d_model=6144, n_layers=2, n_heads=64, n_kv_heads=64, d_head=192, d_vocab=131072, norm_eps=1e-05,
            rope=RopeConfig(theta=10000000.0, interleaved=True), max_position_embeddings=131072, d_mlp=12288,
            moe_layers=(True, True), n_experts=512, top_k_per_layer=(12, 12), d_expert=2048, routed_scaling_factor=6.0,
            q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
            n_identity_experts=256),
    ),
    "llama4_text": (
        # transformers' defaults are Llama 4 Scout's sizes: every layer a mixture, every fourth NoPE (and not chunked)
        {"hidden_size": 64, "num_attention_heads": 8, "num_hidden_layers": 4, "vocab_size": 96},
        dict(d_model=64, n_layers=4, n_heads=8, n_kv_heads=8, d_head=128, d_vocab=96, norm_eps=1e-05,
            rope=RopeConfig(theta=500000.0), max_position_embeddings=131072, moe_layers=(True, True, True, True),
            n_experts=16, top_k_per_layer=(1, 1, 1, 1), d_expert=8192, d_shared=8192, rope_layers=(True, True, True,
            False), attention_chunks=(8192, 8192, 8192, None), use_qk_norm=True, attn_temperature_tuning=True,
            floor_scale=8192.0, attn_scale=0.1),
    ),
    "nemotron_h": (
        # every field has a default in transformers: its four layers (Mamba-2, mixture, attention, MLP)
        {},
        dict(d_model=4096, n_layers=4, n_heads=32, n_kv_heads=8, d_head=128, d_vocab=131072, norm_eps=1e-05,
            rope=RopeConfig(theta=10000.0), max_position_embeddings=4096, act_fn="relu2", d_mlp=21504,
            moe_layers=(False, True, False, False), n_experts=8, top_k_per_layer=(0, 2, 0, 0), d_expert=7688,
            d_shared=7688, norm_topk_prob=True, layer_types=("linear_attention", "moe", "full_attention", "mlp"),
            mamba_n_heads=128, mamba_d_head=64, mamba_n_groups=8, mamba_d_state=128, mamba_d_conv=4,
            mamba_chunk_size=128, mamba_time_step_limit=(0.001, math.inf)),
    ),
    "granitemoe": (
        # transformers' GraniteMoeConfig defaults: 8 experts, top 2, intermediate_size 11008, every multiplier 1
        {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 3, "vocab_size": 96},
        dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=4, d_head=16, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=10000.0), max_position_embeddings=2048, moe_layers=(True, True, True), n_experts=8,
            top_k_per_layer=(2, 2, 2), d_expert=11008),
    ),
    "granitemoeshared": (
        # transformers' GraniteMoeSharedConfig defaults: no shared MLP (shared_intermediate_size 0), as granitemoe
        {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 3, "vocab_size": 96},
        dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=4, d_head=16, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=10000.0), max_position_embeddings=2048, moe_layers=(True, True, True), n_experts=8,
            top_k_per_layer=(2, 2, 2), d_expert=11008),
    ),
    "granitemoe_swa": (
        # transformers' GraniteMoeSWAConfig defaults: as granitemoeshared's, with full attention on every fourth
        # layer from 0 and a window of 128 on the others, the global rotary base on every layer, no shared MLP
        {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 5, "vocab_size": 96},
        dict(d_model=64, n_layers=5, n_heads=4, n_kv_heads=4, d_head=16, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=10000.0), max_position_embeddings=2048, moe_layers=(True,) * 5, n_experts=8,
            top_k_per_layer=(2,) * 5, d_expert=11008, attention_windows=(None, 128, 128, 128, None),
            layer_ropes=(RopeConfig(theta=10000.0),) * 5),
    ),
    "granitemoehybrid": (
        # transformers' GraniteMoeHybridConfig defaults: every layer Mamba-2 (128 heads of 2 * 64 / 128 = 1), no
        # positional encoding, 8 experts, top 2, a shared MLP of 1024, dt unclamped
        {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 3, "vocab_size": 96},
        dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=4, d_head=16, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=10000.0), max_position_embeddings=2048, moe_layers=(True, True, True), n_experts=8,
            top_k_per_layer=(2, 2, 2), d_expert=11008, d_shared=1024, layer_types=("linear_attention",) * 3,
            mamba_n_heads=128, mamba_d_head=1, mamba_n_groups=1, mamba_d_state=256, mamba_d_conv=4,
            mamba_chunk_size=256),
    ),
    "lfm2_moe": (
        # transformers' Lfm2MoeConfig defaults (LFM2-8B-A1B's sizes) for all but layer_types, which it needs given
        {"layer_types": ["conv", "conv", "full_attention"] * 10 + ["conv", "full_attention"]},
        dict(d_model=2048, n_layers=32, n_heads=32, n_kv_heads=8, d_head=64, d_vocab=65536, norm_eps=1e-05,
            rope=RopeConfig(theta=1000000.0), max_position_embeddings=128000, d_mlp=7168,
            moe_layers=(False, False) + (True,) * 30, n_experts=32, top_k_per_layer=(0, 0) + (4,) * 30,
            d_expert=1792, norm_topk_prob=True, tie_word_embeddings=True,
            layer_types=("conv", "conv", "full_attention") * 10 + ("conv", "full_attention")),
    ),
    "minimax": (
        # transformers' defaults (Mixtral's sizes, head_dim hidden_size / heads); softmax attention on the even
        # layers, lightning attention on the odd ones; block_size 256, every residual factor 1
        {"num_attention_heads": 4, "num_hidden_layers": 4, "vocab_size": 96},
        dict(d_model=4096, n_layers=4, n_heads=4, n_kv_heads=4, d_head=1024, d_vocab=96, norm_eps=1e-05,
            rope=RopeConfig(theta=1000000.0), max_position_embeddings=131072, attention_windows=(None,) * 4,
            moe_layers=(True,) * 4, n_experts=8, top_k_per_layer=(2,) * 4, d_expert=14336, norm_topk_prob=True,
            layer_types=("full_attention", "linear_attention") * 2),
    ),
    "jamba": (
        # transformers' JambaConfig defaults: attention where layer % 8 == 4 (none of 4 layers), mixtures of 16
        # experts (top 2) on odd layers, intermediate_size 14336 for experts and dense MLPs alike, 8 kv heads,
        # Mamba: expand 2, d_state 16, kernel 4, dt rank ceil(64 / 16)
        {"hidden_size": 64, "num_attention_heads": 8, "num_hidden_layers": 4, "vocab_size": 96},
        dict(d_model=64, n_layers=4, n_heads=8, n_kv_heads=8, d_head=8, d_vocab=96, norm_eps=1e-06,
            rope=RopeConfig(theta=10000.0), max_position_embeddings=262144, d_mlp=14336,
            moe_layers=(False, True, False, True), n_experts=16, top_k_per_layer=(0, 2, 0, 2), d_expert=14336,
            layer_types=("linear_attention",) * 4, mamba_d_inner=128, mamba_d_state=16, mamba_d_conv=4,
            mamba_dt_rank=4),
    ),
    "mimo_v2_flash": (
        # MiMo-V2-Flash's sizes (transformers' MiMoV2FlashConfig): full attention on layers 0 and 5, the others
        # sliding (window 129) with twice the 4 kv heads; the first block dense; thetas 5e6 / 1e4, 0.334 rotated
        {"num_attention_heads": 8, "num_hidden_layers": 7, "vocab_size": 96},
        dict(d_model=4096, n_layers=7, n_heads=8, n_kv_heads=4, d_head=192, d_vocab=96, norm_eps=1e-05,
            rope=RopeConfig(theta=5000000.0, partial_rotary_factor=0.334), max_position_embeddings=131072,
            attention_windows=(None, 129, 129, 129, 129, None, 129), d_mlp=16384,
            moe_layers=(False, True, True, True, True, True, True), n_experts=256, top_k_per_layer=(0, 8, 8, 8, 8, 8, 8),
            d_expert=2048, norm_topk_prob=True, d_head_v=128, sliding_kv_heads=8,
            sliding_rope=RopeConfig(theta=10000.0, partial_rotary_factor=0.334), value_scale=0.707),
    ),
}

CONFIG_CLASSES = {
    "qwen2_moe": "MoeConfig",
    "hunyuan_v1_moe": "MoeConfig",
    "solar_open": "MoeConfig",
    "qwen3_moe": "MoeConfig",
    "mixtral": "MixtralConfig",
    "olmoe": "ClipQKVConfig",
    "dbrx": "DbrxConfig",
    "phimoe": "MoeConfig",
    "deepseek_v3": "DeepseekV3Config",
    "deepseek_v2": "DeepseekV3Config",
    "sarvam_mla": "DeepseekV3Config",
    "afmoe": "AfmoeConfig",
    "ernie4_5_moe": "Ernie4_5MoeConfig",
    "flex_olmo": "ClipQKVConfig",
    "glm4_moe_lite": "DeepseekV3Config",
    "kimi_linear": "KimiLinearConfig",
    "bailing_hybrid": "BailingHybridConfig",
    "mistral4": "Mistral4Config",
    "gpt_oss": "GptOssConfig",
    "glm4_moe": "Glm4MoeConfig",
    "dots1": "Glm4MoeConfig",
    "sarvam_moe": "Glm4MoeConfig",
    "hy_v3": "Glm4MoeConfig",
    "exaone_moe": "Glm4MoeConfig",
    "minimax_m2": "MiniMaxM2Config",
    "deepseek_v32": "DeepseekV32Config",
    "glm_moe_dsa": "DeepseekV32Config",
    "qwen3_next": "Qwen3NextConfig",
    "qwen3_5_moe_text": "Qwen3_5MoeConfig",
    "lara_mini": "LaraMiniConfig",
    "longcat_flash": "LongcatFlashConfig",
    "llama4_text": "Llama4Config",
    "nemotron_h": "NemotronHConfig",
    "granitemoe": "GraniteMoeConfig",
    "granitemoeshared": "GraniteMoeSharedConfig",
    "granitemoe_swa": "GraniteMoeSWAConfig",
    "granitemoehybrid": "GraniteMoeHybridConfig",
    "axk1": "DeepseekV3Config",
    "kolibri1": "MoeConfig",
    "flint": "MoeConfig",
    "aria_text": "AriaTextConfig",
    "mellum": "MellumConfig",
    "lfm2_moe": "Lfm2MoeConfig",
    "beam": "BeamConfig",
    "minimax": "MiniMaxConfig",
    "jamba": "JambaConfig",
    "mimo_v2_flash": "MiMoV2FlashConfig",
    "cohere2_moe": "Cohere2MoeConfig",
}
# Nemotron-H has no rotary to spell two ways (its own suite reads NVIDIA's config.json spelling); Mellum's, Beam's
# and MiMo-V2-Flash's rope_parameters are keyed by layer type, which has no Hub spelling (transformers reads no other)
ROTARY_CASES = [family for family, case in CASES.items()
                if "rope_parameters" in case.raw and family not in ("mellum", "beam", "mimo_v2_flash")]


def identity(cfg) -> dict:
    """The fields that make the model (compare=True), without family."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.compare and f.name != "family"}


def expected(cfg_class_name: str, cfg, fields: dict) -> dict:
    assert type(cfg).__name__ == cfg_class_name
    defaults = {
        f.name: f.default
        for f in dataclasses.fields(cfg)
        if f.compare and f.name != "family" and f.default is not dataclasses.MISSING
    }
    return defaults | fields


def hub_spelling(raw: dict) -> dict:
    """rope_parameters as the Hub's config.json spells it: rope_theta and partial_rotary_factor at the top level,
    the scaling (where not the default rotary) in rope_scaling."""
    raw = copy.deepcopy(raw)
    rope = raw.pop("rope_parameters")
    raw["rope_theta"] = rope.pop("rope_theta")
    if "partial_rotary_factor" in rope:
        raw["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
    if rope.get("rope_type", "default") != "default":
        raw["rope_scaling"] = rope
    return raw


def test_every_family_has_a_case():
    """Every registered family (an extra model_type spelling of a family counts as that family) has its cases."""
    families = {cls.model_type for cls in FAMILIES.values()}
    assert set(CASES) == set(MINIMAL) == set(CONFIG_CLASSES) == families


@pytest.mark.parametrize("family", CASES)
def test_config_from_the_tiny_config(family):
    case = CASES[family]
    cfg = FAMILIES[family].config_from_hf(copy.deepcopy(case.raw))
    assert cfg.family == family
    assert identity(cfg) == expected(CONFIG_CLASSES[family], cfg, case.fields)
    assert sorted(cfg.fields_read) == case.read and len(set(cfg.fields_read)) == len(cfg.fields_read)
    assert cfg.fields_ignored == case.ignored


@pytest.mark.parametrize("family", ROTARY_CASES)
def test_the_hubs_rotary_spelling_reads_the_same(family):
    case = CASES[family]
    cfg = FAMILIES[family].config_from_hf(hub_spelling(case.raw))
    assert identity(cfg) == expected(CONFIG_CLASSES[family], cfg, case.fields)
    assert sorted(cfg.fields_read) == case.read
    assert cfg.fields_ignored == case.ignored


@pytest.mark.parametrize("family", MINIMAL)
def test_absent_fields_take_the_familys_defaults(family):
    raw, fields = MINIMAL[family]
    cfg = FAMILIES[family].config_from_hf(copy.deepcopy(raw))
    assert identity(cfg) == expected(CONFIG_CLASSES[family], cfg, fields)
    assert cfg.fields_ignored == ()


@pytest.mark.parametrize("family", MINIMAL)
def test_a_required_field_missing_is_named(family):
    """Each of these fields, left out, is named in a KeyError, or (where transformers' config class has a default
    for it, as Phi-3.5-MoE's hidden_size 4096) read as that default."""
    raw, _ = MINIMAL[family]
    fields = {"hidden_size": "d_model", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
              "vocab_size": "d_vocab"}
    for name, field in fields.items():
        if name not in raw:
            continue
        without = {k: v for k, v in raw.items() if k != name}
        try:
            cfg = FAMILIES[family].config_from_hf(without)
        except KeyError as err:
            assert name in str(err)
            continue
        reference = AutoConfig.for_model(FAMILIES[family].model_type)
        assert name in reference.to_dict(), f"{family}: {name} left out was read without transformers having a default"
        assert getattr(cfg, field) == getattr(reference, name), (family, name)
