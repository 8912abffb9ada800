"""The gated delta rule (Gated DeltaNet's recurrence), in the two forms transformers' torch fallback computes it:
chunked (a prefill or any multi-token forward) and token by token (a cached decode step).

Per value head, with S the [d_k d_v] state, q and k L2-normed and q scaled by d_k^-1/2, for each token t:

    S <- exp(g_t) * S                      (decay; g_t <= 0 is the log decay)
    S <- S + k_t (beta_t * (v_t - S^T k_t))^T   (delta rule: write the part of v_t that S does not already give)
    o_t = S^T q_t

Both forms take q, k [batch pos k_head d_k], v [batch pos v_head d_v], g and beta [batch pos v_head] and the
state entering the first token [batch v_head d_k d_v] (float32), and return the outputs [batch pos v_head d_v]
in q's dtype and the state after the last token (float32). Each key head serves v_head / k_head consecutive
value heads. They compute in float32 whatever the inputs' dtype, in transformers' order of operations
(torch_chunk_gated_delta_rule / torch_recurrent_gated_delta_rule), so on equal inputs their results equal
transformers' bit for bit, in float32 and bfloat16 alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Float

CHUNK_SIZE = 64  # positions per chunk of the chunked form (transformers' default)
L2_EPS = 1e-6  # the L2 norm of q and k: x / sqrt(sum(x^2) + eps)

Heads = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def l2_normalize(x: Float[torch.Tensor, "... d"], eps: float = L2_EPS) -> Float[torch.Tensor, "... d"]:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _heads_first(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor, beta: torch.Tensor
) -> Heads:
    """q and k repeated to one per value head, everything float32 [batch v_head pos ...] and contiguous, q and k
    L2-normed (q not yet scaled)."""
    n_k_heads, n_v_heads = k.shape[2], v.shape[2]
    if n_v_heads % n_k_heads:
        raise ValueError(f"delta rule: {n_v_heads} value heads are not a multiple of {n_k_heads} key heads")
    if n_v_heads != n_k_heads:  # value head h reads key head h // (n_v_heads / n_k_heads)
        q = q.repeat_interleave(n_v_heads // n_k_heads, dim=2)
        k = k.repeat_interleave(n_v_heads // n_k_heads, dim=2)
    q, k, v, log_decay, beta = (
        x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format) for x in (q, k, v, log_decay, beta)
    )
    return l2_normalize(q), l2_normalize(k), v, log_decay, beta


def chunked_delta_rule(
    q: Float[torch.Tensor, "batch pos k_head d_k"],
    k: Float[torch.Tensor, "batch pos k_head d_k"],
    v: Float[torch.Tensor, "batch pos v_head d_v"],
    log_decay: Float[torch.Tensor, "batch pos v_head"],
    beta: Float[torch.Tensor, "batch pos v_head"],
    state: Float[torch.Tensor, "batch v_head d_k d_v"],
    chunk_size: int = CHUNK_SIZE,
) -> tuple[Float[torch.Tensor, "batch pos v_head d_v"], Float[torch.Tensor, "batch v_head d_k d_v"]]:
    """The delta rule over `chunk_size` positions at a time: within a chunk the sequential updates are one
    triangular solve (the UT transform), and only the chunks run in sequence. The last chunk is padded with
    zeros (zero k, v, beta and log decay: they change nothing) and the padding's outputs dropped."""
    out_dtype = q.dtype
    batch, n_pos, _, d_k = k.shape
    n_v_heads, d_v = v.shape[2:]
    q, k, v, log_decay, beta = _heads_first(q, k, v, log_decay, beta)
    q = q * d_k**-0.5

    pad = -n_pos % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, log_decay = (F.pad(x, (0, pad)) for x in (beta, log_decay))
    n_chunks = (n_pos + pad) // chunk_size

    v_beta = v * beta.unsqueeze(-1)
    k_beta = k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(batch, n_v_heads, n_chunks, chunk_size, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    log_decay = log_decay.reshape(batch, n_v_heads, n_chunks, chunk_size)

    later = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    cum_decay = log_decay.cumsum(dim=-1)  # log of the decay from the chunk's start to each position
    # decay_between[i, j]: the decay from position j to position i of a chunk (0 where j is after i)
    decay_between = (cum_decay.unsqueeze(-1) - cum_decay.unsqueeze(-2)).masked_fill(later, float("-inf")).exp()

    updates = (k_beta @ k.transpose(-1, -2)) * decay_between  # unit lower triangular once its diagonal is ignored
    within = (q @ k.transpose(-1, -2)) * decay_between
    k_beta_decayed = k_beta * cum_decay.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(updates, v_beta, upper=False, unitriangular=True)
    k_cum_decay = torch.linalg.solve_triangular(updates, k_beta_decayed, upper=False, unitriangular=True)

    state = state.to(new_values)
    out = torch.zeros_like(new_values)
    q_decayed = q * cum_decay.exp().unsqueeze(-1)
    k_to_end = k * (cum_decay[..., -1:] - cum_decay).exp().unsqueeze(-1)  # each key decayed to its chunk's end
    chunk_decay = cum_decay[..., -1].exp()[..., None, None]
    for i in range(n_chunks):
        v_new = new_values[:, :, i] - k_cum_decay[:, :, i] @ state  # what the state does not already predict
        out[:, :, i] = q_decayed[:, :, i] @ state + within[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ v_new

    out = out.reshape(batch, n_v_heads, -1, d_v)[:, :, :n_pos]
    return out.transpose(1, 2).to(out_dtype, memory_format=torch.contiguous_format), state


def recurrent_delta_rule(
    q: Float[torch.Tensor, "batch pos k_head d_k"],
    k: Float[torch.Tensor, "batch pos k_head d_k"],
    v: Float[torch.Tensor, "batch pos v_head d_v"],
    log_decay: Float[torch.Tensor, "batch pos v_head"],
    beta: Float[torch.Tensor, "batch pos v_head"],
    state: Float[torch.Tensor, "batch v_head d_k d_v"],
) -> tuple[Float[torch.Tensor, "batch pos v_head d_v"], Float[torch.Tensor, "batch v_head d_k d_v"]]:
    """The delta rule one token at a time (what a cached decode step runs)."""
    out_dtype = q.dtype
    d_k = k.shape[-1]
    q, k, v, log_decay, beta = _heads_first(q, k, v, log_decay, beta)
    q = q / d_k**0.5
    state = state.to(v)
    out = torch.zeros_like(v)
    for t in range(v.shape[2]):
        q_t, k_t, v_t = q[:, :, t], k[:, :, t], v[:, :, t]
        state = state * log_decay[:, :, t].exp()[..., None, None]
        predicted = (state * k_t.unsqueeze(-1)).sum(dim=-2)
        delta = (v_t - predicted) * beta[:, :, t].unsqueeze(-1)
        state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, :, t] = (state * q_t.unsqueeze(-1)).sum(dim=-2)
    return out.transpose(1, 2).contiguous().to(out_dtype), state
