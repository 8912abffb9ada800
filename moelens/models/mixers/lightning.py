"""Lightning attention: the linear-attention token mixer of MiniMax-Text-01 / MiniMax-M1 (model_type minimax), as
transformers computes it.

    x -> qkv_proj, SiLU (0 at padding) -> per head [q | k | v] of d_head each -> hook_q, hook_k, hook_v
      -> linear attention with a fixed decay per head and layer (no softmax, no scaling, no rotary): the state
         S = sum over earlier tokens j of exp(-s (i - j)) k_j^T v_j, read as q_i S -> hook_core_out
      -> RMSNorm over all heads together (eps 1e-6, transformers' fixed one), times sigmoid(output_gate(x))
         (output_gate's output: hook_gate) -> hook_z -> out_proj

The decay rate of head h in layer l of n layers (s above) is 2^(-8 (h + 1) / n_heads) * (1 - l / (n - 1 + 1e-5) +
1e-5): fixed, derived from the config, not learned. transformers stores its tables (slope_rate, query_decay,
key_decay, diagonal_decay) as buffers in the checkpoint; here they are computed from the config in float32 and
cast to the model's dtype, the values transformers' buffers hold once loaded.

Two forms, as transformers chooses them. Without a cached state (a prompt): block by block of block_size
positions, each block's read-out the decayed product within the block ((q k^T) * decay, times v) plus the
earlier blocks' state read by the decayed queries, then the state decayed over the block and the block's
decayed k^T v added. With a cached state (decode, or any forward after a cached prefix): token by token, the
state times exp(-s) plus k_i^T v_i, read by q_i. Both compute the same sums; their roundings differ, and each
is matched where transformers uses it.

The state (moelens.state.RecurrentState): `recurrent`, S after the last token [batch head d_head d_head] in the
model's dtype (transformers' cache keeps it so); no convolution window (`conv` stays None).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import nn

from moelens.hooks.sites import site_hook
from moelens.models.components.norm import RMSNorm
from moelens.models.context import LayerInputs
from moelens.models.mixers.base import StateBytes, StateTensor, values_of
from moelens.models.terms import ParamTerm, linear, under
from moelens.state import RecurrentState

NORM_EPS = 1e-6  # transformers builds the mixer's RMSNorm with its default eps, not rms_norm_eps


@dataclass(frozen=True)
class LightningSizes:
    """What a lightning-attention mixer reads from its config (any object with these attributes; the
    config.json field in brackets): d_model [hidden_size], n_heads [num_attention_heads], d_head [head_dim],
    n_layers [num_hidden_layers] (the decay rates depend on the layer's depth), lightning_block_size
    [block_size], act_fn [hidden_act] (applied to q, k and v: only "silu" exists)."""

    d_model: int
    n_heads: int
    d_head: int
    n_layers: int
    lightning_block_size: int
    act_fn: str = "silu"


def decay_rates(n_heads: int, layer: int, n_layers: int) -> Float[torch.Tensor, "head 1 1"]:
    """Each head's decay rate s in layer `layer`, float32, in transformers' order of operations."""
    base = 1 / (2 ** (8 / n_heads))
    exponent = (torch.arange(n_heads, device="cpu") + 1).to(torch.float32)
    factor = 1 - layer / (n_layers - 1 + 1e-5) + 1e-5
    return (base**exponent * factor)[:, None, None]


def decay_tables(rates: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(query decay [head block 1], key decay [head block 1], within-block decay [1 head block block]) for the
    block form, float32: exp(-s (i + 1)), exp(-s (block - i - 1)), exp(-s (i - j)) where i >= j else 0."""
    steps = torch.arange(block, device=rates.device) + 1
    query = torch.exp(-rates * steps[:, None])
    key = torch.exp(-rates * (block - steps[:, None]))
    lag = rates * (steps[:, None] - steps[None, :])[None, None, :, :]
    within = torch.exp(torch.where(lag >= 0, -lag, float("-inf")))
    return query, key, within


class LightningAttention(nn.Module):
    """The mixer of one linear-attention layer, built as LightningAttention(cfg, layer)."""

    block_attribute: ClassVar[str] = "mixer"

    @classmethod
    def param_terms(cls, cfg: object, layer: int) -> tuple[ParamTerm, ...]:
        inner = cfg.n_heads * cfg.d_head
        return (linear("qkv_proj", cfg.d_model, 3 * inner, False, "attention")
                + linear("output_gate", cfg.d_model, inner, False, "attention")
                + under("norm", RMSNorm.param_terms(inner, "attention"))
                + linear("out_proj", inner, cfg.d_model, False, "attention"))

    @classmethod
    def state_tensors(cls, cfg: object) -> tuple[StateTensor, ...]:
        """Per sequence: the state [head d_head d_head], in the model's dtype."""
        return (StateTensor("recurrent", cfg.n_heads * cfg.d_head * cfg.d_head, "sequence"),)

    @classmethod
    def state_bytes(cls, cfg: object) -> StateBytes:
        return values_of(cls.state_tensors(cfg))

    def __init__(self, cfg: object, layer: int) -> None:
        super().__init__()
        _check_sizes(cfg, layer)
        self.layer = layer
        self.d_model, self.n_heads, self.d_head = cfg.d_model, cfg.n_heads, cfg.d_head
        self.block_size = cfg.lightning_block_size
        self.n_layers = cfg.n_layers
        inner = self.n_heads * self.d_head
        self.qkv_proj = nn.Linear(self.d_model, 3 * inner, bias=False)
        self.output_gate = nn.Linear(self.d_model, inner, bias=False)
        self.norm = RMSNorm(inner, NORM_EPS, hooked=False)
        self.out_proj = nn.Linear(inner, self.d_model, bias=False)
        # derived from the config, not buffers: never built on the meta device, never read from a checkpoint
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, ...]] = {}
        self.hook_q = site_hook("blocks.L.mixer.hook_q", "lightning")
        self.hook_k = site_hook("blocks.L.mixer.hook_k", "lightning")
        self.hook_v = site_hook("blocks.L.mixer.hook_v", "lightning")
        self.hook_state_in = site_hook("blocks.L.mixer.hook_state_in", "lightning")
        self.hook_core_out = site_hook("blocks.L.mixer.hook_core_out", "lightning")
        self.hook_state_out = site_hook("blocks.L.mixer.hook_state_out", "lightning")
        self.hook_gate = site_hook("blocks.L.mixer.hook_gate", "lightning")
        self.hook_z = site_hook("blocks.L.mixer.hook_z", "lightning")

    def tables(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """(rates, query decay, key decay, within-block decay) on `device` in `dtype`: computed in float32 on
        the CPU, then cast, as transformers' float32 buffers are when the model is loaded in another dtype."""
        key = (torch.device(device), dtype)
        if key not in self._tables:
            with torch.device("cpu"):
                rates = decay_rates(self.n_heads, self.layer, self.n_layers)
                tables = (rates, *decay_tables(rates, self.block_size))
            self._tables[key] = tuple(t.to(device=device, dtype=dtype) for t in tables)
        return self._tables[key]

    def new_state(self, reserve: int = 0) -> RecurrentState:
        """An empty state (fixed size: `reserve` changes nothing)."""
        return RecurrentState()

    def input_projections(self) -> list[nn.Linear]:
        return [self.qkv_proj, self.output_gate]

    def forward(
        self, x: Float[torch.Tensor, "batch pos d_model"], inputs: LayerInputs
    ) -> Float[torch.Tensor, "batch pos d_model"]:
        self._check_inputs(x, inputs)
        batch, n_pos, _ = x.shape
        state = inputs.state
        qkv = F.silu(self.qkv_proj(x))
        if inputs.mask is not None:  # padding gives zero q, k, v (after the activation, as transformers)
            qkv = (qkv * inputs.mask[:, :, None]).to(qkv.dtype)
        q, k, v = torch.split(qkv.reshape(batch, n_pos, self.n_heads, 3 * self.d_head), self.d_head, dim=3)
        q = self.hook_q(q).transpose(1, 2)
        k = self.hook_k(k).transpose(1, 2)
        v = self.hook_v(v).transpose(1, 2)

        cached = None if state is None else state.recurrent
        if cached is None:
            state_in = v.new_zeros(batch, self.n_heads, self.d_head, self.d_head)
        else:  # the cache's tensor is never edited in place (snapshots hold it): a hook edits a copy
            state_in = cached.clone() if self.hook_state_in.has_hooks else cached
        state_in = self.hook_state_in(state_in)
        form = self._blockwise if cached is None else self._recurrent
        core, state_out = form(q, k, v, state_in)
        core = self.hook_core_out(core.transpose(1, 2))
        state_out = self.hook_state_out(state_out)
        if state is not None:
            state.update(None, state_out, n_pos)

        normed = self.norm(core.reshape(batch, n_pos, -1))
        gate = self.hook_gate(self.output_gate(x).reshape(batch, n_pos, self.n_heads, self.d_head))
        z = self.hook_z((torch.sigmoid(gate.reshape(batch, n_pos, -1)) * normed).reshape(gate.shape))
        return self.out_proj(z.reshape(batch, n_pos, -1))

    def _blockwise(self, q, k, v, state):
        """A prompt's form: block by block (transformers' order of operations, block for block)."""
        rates, query_decay, key_decay, within = self.tables(q.device, q.dtype)
        outputs = []
        for start in range(0, q.shape[2], self.block_size):
            end = min(start + self.block_size, q.shape[2])
            size = end - start
            qb, kb, vb = q[:, :, start:end], k[:, :, start:end], v[:, :, start:end]
            intra = torch.matmul(torch.matmul(qb, kb.transpose(-1, -2)) * within[:, :, :size, :size], vb)
            inter = torch.matmul(qb * query_decay[:, :size], state)
            outputs.append(inter + intra)
            state = state * torch.exp(-rates * size) + torch.matmul((kb * key_decay[:, -size:]).transpose(-1, -2), vb)
        return torch.cat(outputs, dim=-2), state

    def _recurrent(self, q, k, v, state):
        """After a cached state: token by token, the state decayed by exp(-s) and the token's k^T v added."""
        ratio = torch.exp(-self.tables(q.device, q.dtype)[0])
        outputs = []
        for i in range(q.shape[2]):
            state = ratio * state + torch.matmul(k[:, :, i : i + 1].transpose(-1, -2), v[:, :, i : i + 1])
            outputs.append(torch.matmul(q[:, :, i : i + 1], state))
        return torch.cat(outputs, dim=-2), state

    def _check_inputs(self, x: torch.Tensor, inputs: LayerInputs) -> None:
        if x.dim() != 3 or x.shape[-1] != self.d_model or x.shape[1] == 0:
            raise ValueError(f"lightning attention (layer {self.layer}): input of shape {tuple(x.shape)}, expected "
                             f"[batch pos d_model={self.d_model}] with at least one position")
        if inputs.mask is not None and inputs.mask.shape != x.shape[:2]:
            raise ValueError(f"lightning attention (layer {self.layer}): inputs.mask of shape "
                             f"{tuple(inputs.mask.shape)}, expected [batch pos] = {tuple(x.shape[:2])}")
        state = inputs.state
        if state is None:
            return
        if not isinstance(state, RecurrentState):
            raise TypeError(f"lightning attention (layer {self.layer}): inputs.state is a {type(state).__name__}, "
                            "expected the RecurrentState this mixer's new_state() makes")
        expected = (x.shape[0], self.n_heads, self.d_head, self.d_head)
        if state.recurrent is not None and tuple(state.recurrent.shape) != expected:
            raise ValueError(f"lightning attention (layer {self.layer}): cached state.recurrent has shape "
                             f"{tuple(state.recurrent.shape)}, expected {expected} for this batch of {x.shape[0]}")
        if state.conv is not None:
            raise ValueError(f"lightning attention (layer {self.layer}): cached state has a convolution window; "
                             "this mixer keeps none (a state of another mixer's kind)")


def _check_sizes(cfg: object, layer: int) -> None:
    fields = ("d_model", "n_heads", "d_head", "n_layers", "lightning_block_size")
    missing = [f for f in (*fields, "act_fn") if not hasattr(cfg, f)]
    if missing:
        raise AttributeError(f"lightning attention config {type(cfg).__name__} lacks {missing} (see "
                             "moelens.models.mixers.lightning.LightningSizes for the attributes it reads)")
    for name in fields:
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"lightning attention config: {name} must be a positive int, got {value!r}")
    if cfg.act_fn != "silu":
        raise ValueError(f"lightning attention config: act_fn (hidden_act) {cfg.act_fn!r}: only 'silu' is implemented")
    if not 0 <= layer < cfg.n_layers:
        raise ValueError(f"lightning attention: layer {layer} outside the config's {cfg.n_layers} layers")
