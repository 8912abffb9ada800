"""The table of hook sites: for every site some family has, its name, layout and meaning, the family notes'
(nnterp) standard name, the TransformerLens-style short alias, and the model switch that creates it.

Components build their HookPoints from it (site_hook), so a site's layout and meaning are written here once;
support(), the cache's and get_act_name's aliases and the optional sites' switches are read from it.

Names are relative to the model root; ``L`` stands for a block index and ``E`` for an expert's.
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from moelens.hooks.points import HookPoint

DEFAULT = "default"


@dataclass(frozen=True)
class Form:
    """One way of computing a site: the layout of its tensor and what it holds. A meaning may name fields in
    braces ("{formula}"), which the component fills in (site_hook's keyword arguments)."""

    layout: str
    meaning: str

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(f for _, f, _, _ in string.Formatter().parse(self.meaning) if f is not None)


@dataclass(frozen=True)
class Site:
    """A hook site: its name and its forms ("default", and any a family or component computes otherwise)."""

    name: str  # e.g. "blocks.L.mlp.hook_router_logits"
    forms: Mapping[str, Form]
    standard: str | None = None  # the family notes' (nnterp) name
    short: str | None = None  # TransformerLens-style short name, as in cache["resid_post", 3]
    aliases: tuple[str, ...] = ()  # further names the cache and get_act_name accept
    switch: str | None = None  # the model method that creates the site (TransformerLens's set_use_*); None: built in
    rows_of: str | None = None  # a per-expert view: the per-slot site whose rows routed to expert E it shows
    # an observation site: computed for its hooks only, read by nothing downstream, so an edit (returned or in
    # place) reaches later hooks on it and the cache but changes no other site; no gradient reaches it
    observed: bool = False
    # a state handed on: what the layer's cache keeps for the next forward, read by nothing in this one, so an
    # edit changes later forwards (every later token) and not this forward's output
    handed_on: bool = False

    @property
    def per_expert(self) -> bool:
        return self.rows_of is not None

    @property
    def tail(self) -> str:
        return self.name.rsplit(".", 1)[-1]


def _site(name: str, layout: str, meaning: str, variants: dict[str, tuple[str, str]] | None = None, **names) -> Site:
    forms = {DEFAULT: Form(layout, meaning)} | {k: Form(*v) for k, v in (variants or {}).items()}
    return Site(name, MappingProxyType(forms), **names)


_RESID = "batch pos d_model"
_SCALE = ("batch pos 1", "RMS of the input (+ eps): the norm divides by it")
_CLAMP = ", clamped to +-clip_qkv"
_QK_NORM = "query after q_norm over all heads together{}; before the rotary"
_K_NORM = "key after k_norm over all kv heads together{}; before the rotary"
_PROBS = ("the router's distribution over the experts (float32, rows sum to 1): {}; observation only: "
          "routing does not read it, so editing it changes nothing downstream")
_MAMBA_HEADS = "batch pos mamba_head mamba_d_head"
_MAMBA_GROUPS = "batch pos mamba_group mamba_d_state"
_MAMBA_STATE = "batch mamba_head mamba_d_head mamba_d_state"
_LIGHTNING = "batch pos head d_head"
_LIGHTNING_STATE = "batch head d_head d_head"
_MAMBA1 = "batch pos mamba_d_inner"  # Mamba (v1): one state per channel
_MAMBA1_STATE = "batch mamba_d_inner mamba_d_state"

# Every site some family has, in forward order.
SITES: tuple[Site, ...] = (
    _site("hook_embed", _RESID, "token embeddings", standard="token_embeddings", short="embed"),
    _site("blocks.L.hook_resid_pre", _RESID, "residual stream entering the block", standard="layer_input",
          short="resid_pre"),
    # TransformerLens's optional inputs: each head's own copy of the residual stream
    _site("blocks.L.hook_attn_in", "batch pos head d_model", "each head's copy of the residual stream, before ln1",
          short="attn_in", switch="set_use_attn_in"),
    _site("blocks.L.hook_q_input", "batch pos head d_model",
          "each query head's copy of the residual stream, before ln1", short="q_input",
          switch="set_use_split_qkv_input"),
    _site("blocks.L.hook_k_input", "batch pos kv_head d_model",
          "each key head's copy of the residual stream, before ln1", short="k_input",
          switch="set_use_split_qkv_input"),
    _site("blocks.L.hook_v_input", "batch pos kv_head d_model",
          "each value head's copy of the residual stream, before ln1", short="v_input",
          switch="set_use_split_qkv_input"),
    _site("blocks.L.ln1.hook_scale", *_SCALE, short="scale"),
    _site("blocks.L.ln1.hook_normalized", _RESID, "normed stream entering attention", standard="attention_norm_output",
          short="normalized", aliases=("ln1_normalized",)),
    # latent attention (DeepSeek-V3): the compressed query and key-value, decompressed per head
    _site("blocks.L.attn.hook_q_latent", "batch pos q_lora_rank", "compressed query after its RMSNorm (q_a_layernorm)",
          short="q_latent"),
    _site("blocks.L.attn.hook_q", "batch pos head d_head", "query projection (bias included)", short="q", variants={
        "latent": ("batch pos head d_head", "decompressed query per head [nope | rope], before the rotary"),
        "qk_norm": ("batch pos head d_head", _QK_NORM.format("")),
        "qk_norm_clamped": ("batch pos head d_head", _QK_NORM.format(_CLAMP)),
        "clamped": ("batch pos head d_head", f"query projection (bias included){_CLAMP}"),
    }),
    _site("blocks.L.attn.hook_kv_latent", "batch pos kv_lora_rank",
          "compressed keys and values after their RMSNorm (kv_a_layernorm)", short="kv_latent"),
    _site("blocks.L.attn.hook_k_rope", "batch pos qk_rope_head_dim",
          "rotary part of the keys, one for all heads, before the rotary", short="k_rope"),
    _site("blocks.L.attn.hook_k", "batch pos kv_head d_head", "key projection (bias included)", short="k", variants={
        "latent": ("batch pos head d_head",
                   "decompressed key per head [nope | the shared rope part], before the rotary"),
        "qk_norm": ("batch pos kv_head d_head", _K_NORM.format("")),
        "qk_norm_clamped": ("batch pos kv_head d_head", _K_NORM.format(_CLAMP)),
        "clamped": ("batch pos kv_head d_head", f"key projection (bias included){_CLAMP}"),
    }),
    _site("blocks.L.attn.hook_v", "batch pos kv_head d_head", "value projection (bias included)",
          standard="attention_values", short="v", variants={
              "latent": ("batch pos head v_head_dim", "decompressed value per head"),
              "clamped": ("batch pos kv_head d_head", f"value projection (bias included){_CLAMP}"),
              # MiMo-V2-Flash: values narrower than the keys, scaled as projected (and so cached)
              "scaled": ("batch pos kv_head d_head_v", "value projection (bias included) times attention_value_scale"),
          }),
    _site("blocks.L.attn.hook_rot_q", "batch pos head d_head",
          "queries entering attention (after rotary, and q norm where the family has one)",
          standard="attention_queries", short="rot_q", variants={
              "latent": ("batch pos head d_head", "queries entering attention (rotary on the rope dims)"),
              "nope_temperature": ("batch pos head d_head", "queries entering attention: no rotary on this layer, "
                                   "scaled by the attention temperature of the query's index in the input and cache"),
              "nope_scalable_softmax": ("batch pos head d_head", "queries entering attention: q-normed, no rotary on "
                                        "this layer, times (1 + (position + 1) / 2048) ** 0.1 (scalable softmax)"),
          }),
    _site("blocks.L.attn.hook_rot_k", "batch pos kv_head d_head",
          "keys entering attention (after rotary, and k norm where the family has one)",
          standard="attention_keys", short="rot_k", variants={
              "latent": ("batch pos head d_head", "keys entering attention (rotary on the rope dims)"),
          }),
    # DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): the lightning indexer picks the keys each query attends to
    _site("blocks.L.attn.hook_index_scores", "batch query key",
          "the indexer's float32 score of every key (cached included) for each query: sum over its heads of "
          "weights_proj(x) * relu(q . k); before the causal and padding mask (an edit re-selects)",
          short="index_scores"),
    _site("blocks.L.attn.hook_index_topk", "batch query index_topk",
          "indices of the keys each query attends to (the top min(index_topk, keys) masked index scores, best "
          "first; a selected masked key stays masked); an edit changes what attention sees", short="index_topk",
          variants={"shared": ("batch query index_topk", "the key selection reused from the layer before (GLM-5's "
                               "shared DSA layers); an edit holds for this layer and the ones that reuse it")}),
    _site("blocks.L.attn.hook_attn_scores", "batch head query key", "scaled, masked scores before the softmax",
          standard="attention_scores", short="attn_scores"),
    # gpt-oss: a learned extra logit per head in every query's softmax
    _site("blocks.L.attn.hook_sink_scores", "batch head query 1",
          "each head's sink logit, the extra key every query's softmax includes", short="sink_scores"),
    # GraniteMoeSWA: the sink scales each head's output after the values instead of joining the softmax
    _site("blocks.L.attn.hook_sink_scale", "batch head query 1",
          "float32 sigmoid(logsumexp(scores) - sink): the keys' total share once the head's sink logit joins the "
          "softmax; the head's output (pattern @ v) is multiplied by it", short="sink_scale"),
    _site("blocks.L.attn.hook_pattern", "batch head query key", "attention probabilities",
          standard="attention_probabilities", short="pattern", variants={
              "sink": ("batch head query key", "attention probabilities of the keys; each row sums to 1 minus "
                       + "the sink's share (hook_sink_scores)"),
          }),
    _site("blocks.L.attn.hook_attn_gate", "batch pos head d_head",
          "each head's output gate (the second half of q_proj), before its sigmoid", short="attn_gate", variants={
              "per_head": ("batch pos head", "each head's output gate, one value per head (g_proj), before its sigmoid"),
              "biased": ("batch pos head d_head", "each head's output gate, gate_proj(x) plus the head's gate_bias, "
                         "before its sigmoid"),
          }),
    _site("blocks.L.attn.hook_z", "batch pos head d_head", "per-head outputs before the output projection",
          standard="attention_head_outputs", short="z", variants={
              "latent": ("batch pos head v_head_dim", "per-head outputs before the output projection"),
              "gated": ("batch pos head d_head", "per-head outputs times sigmoid(hook_attn_gate), what the "
                        + "output projection reads"),
              "gated_latent": ("batch pos head v_head_dim", "per-head outputs times sigmoid(hook_attn_gate) of their "
                               + "head, what the output projection reads"),
              "narrow": ("batch pos head d_head_v", "per-head outputs before the output projection"),
          }),
    _site("blocks.L.attn.hook_result", "batch pos head d_model", "each head's output after W_O (without b_O)",
          short="result", switch="set_use_attn_result"),
    # Token mixers other than softmax attention, blocks.L.mixer.*, in forward order: Gated DeltaNet (Qwen3-Next,
    # Qwen3.5-MoE; moelens.models.mixers.gated_deltanet: linear attention with a recurrent state [d_k d_v] per value
    # head; each key head serves v_head / k_head consecutive value heads) is each shared site's default form,
    # Mamba-2 (Nemotron-H; moelens.models.mixers.mamba2, the state-space scan) its "mamba2" form, Kimi Delta Attention
    # (Kimi-Linear; moelens.models.mixers.kimi_delta_attention: the delta rule with a decay per key channel, as many
    # key heads as value heads) its "kda" form; LFM2's gated short convolution (moelens.models.mixers.short_conv:
    # y = C * conv(B * x)) its "short_conv" form; lightning attention (MiniMax; moelens.models.mixers.lightning:
    # linear attention with a fixed decay per head) its "lightning" form; Mamba (v1) with normed time step, B and C
    # (Jamba; moelens.models.mixers.mamba1) its "mamba" form.
    _site("blocks.L.mixer.hook_q", "batch pos k_head d_k",
          "query per key head after the causal convolution and its SiLU, before the L2 norm",
          variants={"lightning": (_LIGHTNING, "query per head: SiLU of qkv_proj's query part (0 at padding)")}),
    _site("blocks.L.mixer.hook_k", "batch pos k_head d_k",
          "key per key head after the causal convolution and its SiLU, before the L2 norm",
          variants={"lightning": (_LIGHTNING, "key per head: SiLU of qkv_proj's key part (0 at padding)")}),
    _site("blocks.L.mixer.hook_v", "batch pos v_head d_v", "value per value head after the causal convolution and its SiLU",
          variants={"lightning": (_LIGHTNING, "value per head: SiLU of qkv_proj's value part (0 at padding)")}),
    _site("blocks.L.mixer.hook_gate", "batch pos v_head d_v", "output gate per value head (transformers' z), before its SiLU",
          variants={"mamba2": (_MAMBA_HEADS, "gate z per head (in_proj's first part), silu-gating the norm"),
                    "kda": ("batch pos v_head d_v", "output gate per head (the g projection), before its sigmoid"),
                    "lightning": (_LIGHTNING, "output gate per head (output_gate's output), before its sigmoid"),
                    "mamba": (_MAMBA1, "gate z per channel (in_proj's second half), before its SiLU")}),
    _site("blocks.L.mixer.hook_x", _MAMBA_HEADS,
          "scan input x per head: in_proj's x channels after the causal conv and SiLU (0 at padding)", variants={
              "short_conv": (_RESID, "x: in_proj's last third, what the input gate B multiplies"),
              "mamba": (_MAMBA1, "scan input x per channel: in_proj's first half after the causal conv and SiLU (0 at "
                        + "padding); x_proj's input"),
          }),
    _site("blocks.L.mixer.hook_dt_low_rank", "batch pos mamba_dt_rank",
          "low-rank time step: x_proj's first mamba_dt_rank outputs after their RMSNorm (dt_proj's input)"),
    _site("blocks.L.mixer.hook_B", _MAMBA_GROUPS,
          "B per group (what the state takes in): after the causal conv and SiLU (0 at padding)", variants={
              "short_conv": (_RESID, "input gate B: in_proj's first third, multiplies x before the convolution"),
              "mamba": ("batch pos mamba_d_state", "B (what the state takes in), shared by the channels: x_proj's "
                        + "output after its RMSNorm"),
          }),
    _site("blocks.L.mixer.hook_C", _MAMBA_GROUPS,
          "C per group (what the output reads of the state): after the causal conv and SiLU (0 at padding)", variants={
              "short_conv": (_RESID, "output gate C: in_proj's second third, multiplies the convolution's output"),
              "mamba": ("batch pos mamba_d_state", "C (what the output reads of the state), shared by the channels: "
                        + "x_proj's output after its RMSNorm"),
          }),
    _site("blocks.L.mixer.hook_conv_in", _RESID,
          "B * x: what the causal convolution reads, and what its cached window keeps for later positions"),
    _site("blocks.L.mixer.hook_conv_out", _RESID,
          "causal depthwise convolution of B * x over the last conv_L_cache positions (cached window first), "
          + "before the output gate"),
    _site("blocks.L.mixer.hook_dt", "batch pos mamba_head", "time step per head: softplus(dt + dt_bias), clamped",
          variants={"mamba": (_MAMBA1, "time step per channel: softplus(dt_proj(hook_dt_low_rank)), the model's dtype")}),
    _site("blocks.L.mixer.hook_beta", "batch pos v_head", "write strength of each token's update: sigmoid(b)"),
    _site("blocks.L.mixer.hook_log_decay", "batch pos v_head",
          "log decay g = -exp(A_log) * softplus(a + dt_bias), float32: the state is multiplied by exp(g) before each "
          + "token's update", variants={
              "kda": ("batch pos v_head d_k", "log decay per key channel, from the forget gate (float32 in Kimi-Linear): "
                      + "row c of each head's state is multiplied by exp(g[c]) before the token's update"),
          }),
    _site("blocks.L.mixer.hook_state_in", "batch v_head d_k d_v",
          "recurrent state the new tokens start from, float32 (zeros without a cached state)", variants={
              "mamba2": (_MAMBA_STATE, "recurrent state the forward starts from (cached, or zeros), float32; an edit "
                         + "changes this and later forwards"),
              "lightning": (_LIGHTNING_STATE, "state sum of decayed k^T v the forward starts from (cached, or zeros), "
                            + "in the model's dtype; an edit changes this and later forwards"),
              "mamba": (_MAMBA1_STATE, "recurrent state the forward starts from (cached, or zeros), float32; an edit "
                        + "changes this and later forwards"),
          }),
    _site("blocks.L.mixer.hook_core_out", "batch pos v_head d_v", "read-out of the state per value head, before the gated norm",
          variants={"lightning": (_LIGHTNING, "per-position read-out per head (within-block plus earlier blocks, or "
                                  + "the recurrence), before the RMSNorm over all heads")}),
    _site("blocks.L.mixer.hook_y", _MAMBA_HEADS, "scan output per head, state read by C plus D * x, before the norm",
          variants={"short_conv": (_RESID, "C * the convolution's output: out_proj's input"),
                    "mamba": (_MAMBA1, "scan output per channel, state read by C plus D * x, before the gate")}),
    _site("blocks.L.mixer.hook_state_out", "batch v_head d_k d_v",
          "recurrent state after the last new token, float32: what the cache keeps for the next forward", variants={
              "mamba2": (_MAMBA_STATE, "recurrent state after the last position, as cached, float32; an edit changes "
                         + "later forwards only"),
              "lightning": (_LIGHTNING_STATE, "state after the last new token, as cached, in the model's dtype; an "
                            + "edit changes later forwards only"),
              "mamba": (_MAMBA1_STATE, "recurrent state after the last position, as cached, float32; an edit changes "
                        + "later forwards only"),
          }, handed_on=True),
    _site("blocks.L.mixer.hook_z", "batch pos v_head d_v",
          "per-head outputs before out_proj: the gated RMSNorm of the read-out, times silu(gate)", variants={
              "kda": ("batch pos v_head d_v", "per-head outputs before o_proj: the RMSNorm of the read-out (in float32), "
                      + "times sigmoid(gate)"),
              "lightning": (_LIGHTNING, "per-head outputs before out_proj: sigmoid(gate) times the RMSNorm of the "
                            + "read-out over all heads"),
              "mamba": (_MAMBA1, "hook_y * silu(hook_gate) in the model's dtype: out_proj's input"),
          }),
    _site("blocks.L.mixer.hook_normed", _MAMBA_HEADS, "gated norm's output per head: out_proj's input"),
    _site("blocks.L.hook_attn_out", _RESID, "what the token mixer (attention or another kind) adds to the residual stream",
          standard="attention_output",
          short="attn_out"),
    _site("blocks.L.hook_resid_mid", _RESID, "residual stream after the token mixer's add", standard="layer_mid",
          short="resid_mid"),
    # a block of several sublayers (LongCat-Flash): its second attention, its dense MLPs beside the mixture, and
    # the stream between them (resid_pre + every sublayer's output hook = resid_post)
    _site("blocks.L.hook_dense_0_out", _RESID, "what the block's first dense MLP (beside the mixture) adds to the stream"),
    _site("blocks.L.hook_resid_mid_1", _RESID, "residual stream after the first dense MLP's add"),
    _site("blocks.L.hook_attn_1_out", _RESID, "what the block's second attention adds to the residual stream"),
    _site("blocks.L.hook_resid_mid_2", _RESID, "residual stream after the second attention's add"),
    _site("blocks.L.hook_dense_1_out", _RESID, "what the block's second dense MLP adds to the stream"),
    _site("blocks.L.hook_mlp_in", _RESID, "residual stream entering ln2 and the MLP / mixture", short="mlp_in",
          switch="set_use_hook_mlp_in"),
    # a post-norm block (FlexOlmo): the norm of the token mixer's output, before the add (TransformerLens's Gemma-2
    # name); its output is hook_attn_out
    _site("blocks.L.ln1_post.hook_scale", *_SCALE),
    _site("blocks.L.ln1_post.hook_normalized", _RESID, "normed token-mixer output: what the block adds (hook_attn_out)"),
    _site("blocks.L.ln2.hook_scale", *_SCALE),
    _site("blocks.L.ln2.hook_normalized", _RESID, "normed stream entering the MLP / mixture",
          standard="mlp_norm_output", aliases=("mlp_input", "ln2_normalized")),
    # a dense block's MLP
    _site("blocks.L.mlp.hook_pre", "batch pos d_mlp", "gate pre-activation", short="pre", variants={
        "ungated": ("batch pos d_mlp", "up projection, what the activation reads (an ungated MLP: no gate)")}),
    _site("blocks.L.mlp.hook_pre_linear", "batch pos d_mlp", "up projection", short="pre_linear"),
    _site("blocks.L.mlp.hook_post", "batch pos d_mlp", "neurons: act(gate) * up", standard="mlp_neurons", short="post",
          variants={"ungated": ("batch pos d_mlp", "neurons: act(up)")}),
    # a mixture block: the router
    _site("blocks.L.mlp.hook_router_logits", "batch pos n_experts", "router logits, before scoring",
          standard="router_logits", short="router_logits"),
    # hook_router_scores is what the family's rule computes from the logits (its form says which); hook_router_probs
    # is one distribution over the experts for every family, for analyses that compare families
    _site("blocks.L.mlp.hook_router_scores", "batch pos n_experts",
          "softmax of the logits over all experts (float32): the scores the top-k is taken on, a distribution",
          short="router_scores", variants={
              "sigmoid": ("batch pos n_experts", "sigmoid of each logit (float32): each expert's own score in (0, 1), "
                          "not a distribution over the experts (hook_router_probs is)"),
              "sigmoid_model_dtype": ("batch pos n_experts", "sigmoid of each logit, in the model's dtype: each "
                                      "expert's own score in (0, 1), not a distribution (hook_router_probs is)"),
              "top_k_logits": ("batch pos n_experts",
                               "the logits the top-k is taken on (a softmax over the chosen k gives the weights)"),
              "top_k_logits_sigmoid": ("batch pos n_experts",
                                       "the logits the top-k is taken on (each chosen one's sigmoid is its weight)"),
              "sparsemixer": ("batch pos n_experts",
                              "the logits the slots are chosen on, largest first (each slot's weight is a softmax "
                              "over the logits near its chosen one)"),
          }),
    _site("blocks.L.mlp.hook_router_probs", "batch pos n_experts",
          _PROBS.format("hook_router_scores renormalised to sum to 1 (the softmax of the logits)"),
          short="router_probs", observed=True, variants={
              "sigmoid": ("batch pos n_experts", _PROBS.format("the sigmoid scores (hook_router_scores) divided by "
                                                               "their sum")),
              "softmax_of_logits": ("batch pos n_experts", _PROBS.format(
                  "softmax of the logits (hook_router_scores) over all experts; the weights are a softmax over the "
                  "chosen k only")),
              "sparsemixer": ("batch pos n_experts", _PROBS.format(
                  "softmax of the logits (hook_router_scores) over all experts; each slot's weight is a softmax "
                  "over the experts near its chosen one only")),
          }),
    _site("blocks.L.mlp.hook_choice_scores", "batch pos n_experts",
          "scores the top-k is taken on (scores + correction bias)", short="choice_scores"),
    _site("blocks.L.mlp.hook_expert_indices", "batch pos top_k", "expert each routing slot sends the token to",
          standard="expert_indices", short="expert_indices"),
    _site("blocks.L.mlp.hook_expert_weights", "batch pos top_k", "weight of each slot's expert output",
          standard="expert_weights", short="expert_weights", variants={
              "weighted_input": ("batch pos top_k", "weight each slot's input row is scaled by before its expert"),
              "identity": ("batch pos top_k", "weight of each slot's expert output; a slot routed to an identity expert "
                           + "(id >= n_experts) adds weight * its input"),
          }),
    # the routed experts, per routing slot
    _site("blocks.L.mlp.experts.hook_pre", "batch pos top_k d_expert", "gate pre-activation per slot",
          short="expert_pre", variants={
              "weighted_input": ("batch pos top_k d_expert",
                                 "gate pre-activation per slot, of the input scaled by the slot's weight"),
              "ungated": ("batch pos top_k d_expert", "never fires: these experts have no gate (their up projection "
                          "is experts.hook_pre_linear)"),
              "identity": ("batch pos top_k d_expert", "gate pre-activation per slot; zeros on a slot routed to an "
                           + "identity expert (nothing is computed for it; an edit there changes nothing)"),
          }),
    _site("blocks.L.mlp.experts.hook_pre_linear", "batch pos top_k d_expert", "up projection per slot",
          short="expert_pre_linear", variants={
              "weighted_input": ("batch pos top_k d_expert",
                                 "up projection per slot, of the input scaled by the slot's weight"),
              "identity": ("batch pos top_k d_expert", "up projection per slot; zeros on a slot routed to an identity "
                           + "expert (nothing is computed for it; an edit there changes nothing)"),
          }),
    _site("blocks.L.mlp.experts.hook_post", "batch pos top_k d_expert", "expert neurons per slot: {formula}",
          standard="mlp_neurons", short="expert_post", variants={
              "weighted_input": ("batch pos top_k d_expert",
                                 "expert neurons per slot: {formula}, of the input scaled by the slot's weight"),
              "identity": ("batch pos top_k d_expert", "expert neurons per slot: {formula}; zeros on a slot routed to an "
                           + "identity expert (it has no neurons; an edit there changes nothing)"),
          }),
    # TransformerLens's per-expert sites: the rows of a per-slot site routed to expert E, in TL's order
    _site("blocks.L.mlp.experts.E.hook_gate", "routed d_expert",
          "gate pre-activation of the slots routed to this expert (per-slot experts.hook_pre's rows)",
          rows_of="blocks.L.mlp.experts.hook_pre"),
    _site("blocks.L.mlp.experts.E.hook_pre", "routed d_expert",
          "up projection of the slots routed to this expert (per-slot experts.hook_pre_linear's rows)",
          rows_of="blocks.L.mlp.experts.hook_pre_linear"),
    _site("blocks.L.mlp.experts.E.hook_post", "routed d_expert",
          "expert neurons of the slots routed to this expert (per-slot experts.hook_post's rows)",
          rows_of="blocks.L.mlp.experts.hook_post"),
    _site("blocks.L.mlp.experts.hook_out", "batch pos top_k d_model",
          "each slot's expert output (down projection, plus its bias), before the routing weight",
          short="expert_out", variants={
              "identity": ("batch pos top_k d_model", "each slot's expert output before the routing weight: the down "
                           + "projection, or on a slot routed to an identity expert the input itself (an edit there is "
                           + "what the slot adds, times its weight)"),
          }),
    _site("blocks.L.mlp.hook_expert_outputs", "batch pos top_k d_model", "weighted output of each slot",
          standard="expert_outputs", short="expert_outputs", variants={
              "weighted_input": ("batch pos top_k d_model", "each slot's expert output on its weighted input (the "
                                 "weight is inside, not applied to the output); they sum to hook_routed_out"),
              "identity": ("batch pos top_k d_model", "weighted output of each slot (weight * input on a slot routed "
                           + "to an identity expert); they sum to hook_routed_out"),
          }),
    _site("blocks.L.mlp.hook_routed_out", _RESID, "routed experts' combined output", standard="routed_output",
          short="routed_out", variants={
              "scaled": (_RESID, "routed experts' combined output times routed_scaling_factor, applied after the sum "
                         "(the slots' outputs times it sum to this)"),
          }),
    # the shared expert
    _site("blocks.L.mlp.shared_expert.hook_pre", "batch pos d_shared", "gate pre-activation", short="shared_pre",
          variants={"ungated": ("batch pos d_shared", "up projection, what the activation reads (no gate)")}),
    _site("blocks.L.mlp.shared_expert.hook_pre_linear", "batch pos d_shared", "up projection",
          short="shared_pre_linear"),
    _site("blocks.L.mlp.shared_expert.hook_post", "batch pos d_shared", "neurons: act(gate) * up", short="shared_post",
          variants={"ungated": ("batch pos d_shared", "neurons: act(up)")}),
    _site("blocks.L.mlp.shared_expert.hook_out", _RESID, "shared expert output, ungated", short="shared_expert_out"),
    _site("blocks.L.mlp.hook_shared_gate", "batch pos 1", "shared expert gate logit, before the sigmoid",
          short="shared_gate"),
    _site("blocks.L.mlp.hook_shared_out", _RESID, "shared expert output as added to the routed sum",
          standard="shared_expert_output", short="shared_out"),
    # a post-norm block (FlexOlmo): the norm of the feed-forward's output, before the add; its output is hook_mlp_out
    _site("blocks.L.ln2_post.hook_scale", *_SCALE),
    _site("blocks.L.ln2_post.hook_normalized", _RESID, "normed MLP / mixture output: what the block adds (hook_mlp_out)"),
    _site("blocks.L.hook_mlp_out", _RESID, "what the MLP / mixture adds to the residual stream", standard="mlp_output",
          short="mlp_out"),
    _site("blocks.L.hook_resid_post", _RESID, "residual stream leaving the block", standard="layer_output",
          short="resid_post"),
    _site("ln_final.hook_scale", *_SCALE),
    _site("ln_final.hook_normalized", _RESID, "normed stream entering the unembedding", standard="final_norm_output",
          aliases=("ln_final_normalized",)),
    _site("hook_logits", "batch pos d_vocab", "logits", standard="logits", short="logits", variants={
              "softcapped": ("batch pos d_vocab", "logits softcapped in float32: cap * tanh(unembedding / cap)"),
          }),
)

# Sites of TransformerLens's vocabulary that no moelens model has (get_act_name still names them, as TL does).
TRANSFORMER_LENS_ONLY: tuple[str, ...] = ("hook_tokens", "hook_pos_embed", "blocks.L.mlp.hook_mid")

SITE_BY_NAME: dict[str, Site] = {s.name: s for s in SITES}

# the switch that creates each optional site, by its last name part (for errors that name a site the model lacks)
OPTIONAL_SITE_SWITCHES: dict[str, str] = {s.tail: s.switch for s in SITES if s.switch is not None}

PER_EXPERT_SITES: tuple[Site, ...] = tuple(s for s in SITES if s.per_expert)


def switched_sites(switch: str) -> tuple[Site, ...]:
    """The sites a set_use_* switch creates."""
    return tuple(s for s in SITES if s.switch == switch)


_BLOCK_RE = re.compile(r"^blocks\.\d+\.")
_EXPERT_RE = re.compile(r"\.experts\.\d+\.")


# a block of several sublayers (LongCat-Flash) numbers its repeated modules: attn_1, ln1_1, ln2_1 are sites of the
# table's attn, ln1, ln2, and its dense MLPs dense_0, dense_1 those of a dense block's mlp
_REPEATED_RE = re.compile(r"^blocks\.L\.(attn|ln1|ln2)_\d+\.")
_DENSE_RE = re.compile(r"^blocks\.L\.dense_\d+\.")


def table_name(hook_name: str) -> str:
    """A hook's name as the table writes it: 'blocks.3.mlp.experts.5.hook_post' ->
    'blocks.L.mlp.experts.E.hook_post'; 'blocks.3.attn_1.hook_q' -> 'blocks.L.attn.hook_q'."""
    name = _EXPERT_RE.sub(".experts.E.", _BLOCK_RE.sub("blocks.L.", hook_name))
    return _DENSE_RE.sub("blocks.L.mlp.", _REPEATED_RE.sub(r"blocks.L.\1.", name))


def site_form(name: str, form: str = DEFAULT) -> Form:
    """The table's form of a site, by its table name; a KeyError names what the table has."""
    site = SITE_BY_NAME.get(name)
    if site is None:
        raise KeyError(f"{name!r} is not in the table of hook sites (moelens.hooks.sites.SITES)")
    if form not in site.forms:
        raise KeyError(f"hook site {name!r} has no form {form!r}; its forms: {sorted(site.forms)}")
    return site.forms[form]


def site_hook(name: str, form: str = DEFAULT, **fields: str) -> HookPoint:
    """A HookPoint for the table's site `name` (e.g. "blocks.L.attn.hook_q"), with the layout and meaning of
    its form `form`; `fields` fill the meaning's braces and must be exactly those it names."""
    chosen = site_form(name, form)
    if set(fields) != set(chosen.fields):
        raise TypeError(f"hook site {name!r} ({form}) takes the fields {sorted(chosen.fields)}, got {sorted(fields)}")
    return HookPoint(chosen.layout, chosen.meaning.format(**fields))
