"""The Kimi delta rule (KDA: Kimi Delta Attention's recurrence), in the two forms transformers' torch fallback
computes it: chunked (a prefill or any multi-token forward) and token by token (a cached decode step).

It is the gated delta rule (moelens.models.mixers.delta_rule) with a decay per key channel instead of one per
head. Per head, with S the [d_k d_v] state, q and k L2-normed and q scaled by d_k^-1/2, for each token t:

    S <- diag(exp(g_t)) S                  (decay of each key channel's row; g_t <= 0 is the log decay [d_k])
    S <- S + k_t (beta_t * (v_t - S^T k_t))^T   (delta rule: write the part of v_t that S does not already give)
    o_t = S^T q_t

Both forms take q, k [batch pos head d_k], v [batch pos head d_v], g [batch pos head d_k], beta [batch pos head]
and the state entering the first token [batch head d_k d_v] (float32), and return the outputs [batch pos head d_v]
in q's dtype and the state after the last token (float32). They compute in float32 whatever the inputs' dtype,
in transformers' order of operations (chunk_kimi_delta_attention / recurrent_kimi_delta_attention, whose L2 norm
divides by the root rather than multiplying by its reciprocal), so on equal inputs their results equal
transformers' bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Float

CHUNK_SIZE = 64  # positions per chunk of the chunked form (transformers' default)
L2_EPS = 1e-6  # the L2 norm of q and k: x / sqrt(sum(x^2) + eps)


def l2_normalize_by_root(x: Float[torch.Tensor, "... d"], eps: float = L2_EPS) -> Float[torch.Tensor, "... d"]:
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor, beta: torch.Tensor) -> None:
    if q.shape != k.shape or log_decay.shape != k.shape:
        raise ValueError(f"Kimi delta rule: q {tuple(q.shape)}, k {tuple(k.shape)} and the log decay "
                         f"{tuple(log_decay.shape)} must share one shape [batch pos head d_k]")
    if v.shape[:3] != k.shape[:3] or beta.shape != k.shape[:3]:
        raise ValueError(f"Kimi delta rule: v {tuple(v.shape)} and beta {tuple(beta.shape)} must have k's batch, "
                         f"positions and heads {tuple(k.shape[:3])}")


def chunked_kda_rule(
    q: Float[torch.Tensor, "batch pos head d_k"],
    k: Float[torch.Tensor, "batch pos head d_k"],
    v: Float[torch.Tensor, "batch pos head d_v"],
    log_decay: Float[torch.Tensor, "batch pos head d_k"],
    beta: Float[torch.Tensor, "batch pos head"],
    state: Float[torch.Tensor, "batch head d_k d_v"],
    chunk_size: int = CHUNK_SIZE,
) -> tuple[Float[torch.Tensor, "batch pos head d_v"], Float[torch.Tensor, "batch head d_k d_v"]]:
    """The rule over `chunk_size` positions at a time: within a chunk the sequential updates are solved by
    forward substitution, and only the chunks run in sequence. The last chunk is padded with zeros (zero k, v,
    beta and log decay: they change nothing) and the padding's outputs dropped."""
    _check(q, k, v, log_decay, beta)
    out_dtype = q.dtype
    n_pos, d_k = k.shape[1], k.shape[-1]
    q, k, v, beta, log_decay = (x.transpose(1, 2).contiguous().to(torch.float32) for x in (q, k, v, beta, log_decay))
    q, k = l2_normalize_by_root(q), l2_normalize_by_root(k)
    batch, n_heads = k.shape[:2]
    d_v = v.shape[-1]

    pad = -n_pos % chunk_size
    q = F.pad(q, (0, 0, 0, pad)) * (1 / d_k**0.5)
    k, v, log_decay = (F.pad(x, (0, 0, 0, pad)) for x in (k, v, log_decay))
    beta = F.pad(beta, (0, pad))
    v_beta = v * beta.unsqueeze(-1)
    k_beta = k * beta.unsqueeze(-1)
    q, k, log_decay, k_beta, v_beta = (
        x.reshape(batch, n_heads, -1, chunk_size, x.shape[-1]) for x in (q, k, log_decay, k_beta, v_beta)
    )
    n_chunks = q.shape[2]

    cum_decay = log_decay.cumsum(dim=-2)  # per channel: log of the decay from the chunk's start to each position
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(0)
    later = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    # decay_between[..., i, j, c]: channel c's decay from position j to position i of a chunk (0 where j is after i)
    decay_between = (cum_decay.unsqueeze(-2) - cum_decay.unsqueeze(-3)).masked_fill(later[..., None], float("-inf")).exp()
    solve = -(k_beta.unsqueeze(-2) * k.unsqueeze(-3) * decay_between).sum(dim=-1).masked_fill(upper, 0)
    for i in range(1, chunk_size):  # forward substitution, row by row (transformers' order)
        row = solve[..., i, :i].clone()
        above = solve[..., :i, :i].clone()
        solve[..., i, :i] = row + (row.unsqueeze(-1) * above).sum(-2)
    solve = solve + torch.eye(chunk_size, dtype=solve.dtype, device=solve.device)
    new_values = solve @ v_beta
    k_cum_decay = solve @ (k_beta * cum_decay.exp())

    state = state.to(new_values)
    out = torch.zeros_like(new_values)
    for i in range(n_chunks):
        q_i, k_i, decay_i = q[:, :, i], k[:, :, i], cum_decay[:, :, i]
        across = (q_i * decay_i.exp()) @ state
        within = (q_i.unsqueeze(-2) * k_i.unsqueeze(-3) * decay_between[:, :, i]).sum(dim=-1).masked_fill(later, 0)
        v_new = new_values[:, :, i] - k_cum_decay[:, :, i] @ state  # what the state does not already predict
        out[:, :, i] = across + within @ v_new
        state = (state * decay_i[:, :, -1].exp().unsqueeze(-1)
                 + (k_i * (decay_i[:, :, -1:] - decay_i).exp()).transpose(-1, -2) @ v_new)

    out = out.reshape(batch, n_heads, -1, d_v)[:, :, :n_pos]
    return out.transpose(1, 2).contiguous().to(out_dtype), state


def recurrent_kda_rule(
    q: Float[torch.Tensor, "batch pos head d_k"],
    k: Float[torch.Tensor, "batch pos head d_k"],
    v: Float[torch.Tensor, "batch pos head d_v"],
    log_decay: Float[torch.Tensor, "batch pos head d_k"],
    beta: Float[torch.Tensor, "batch pos head"],
    state: Float[torch.Tensor, "batch head d_k d_v"],
) -> tuple[Float[torch.Tensor, "batch pos head d_v"], Float[torch.Tensor, "batch head d_k d_v"]]:
    """The rule one token at a time (what a cached decode step runs)."""
    _check(q, k, v, log_decay, beta)
    out_dtype = q.dtype
    q, k, v, log_decay, beta = (x.to(torch.float32) for x in (q, k, v, log_decay, beta))
    q, k = l2_normalize_by_root(q), l2_normalize_by_root(k)
    q = q * (1 / q.shape[-1] ** 0.5)
    out = torch.zeros(*v.shape, dtype=v.dtype, device=v.device)
    state = state.to(v)
    for t in range(v.shape[1]):
        q_t, k_t, v_t = q[:, t], k[:, t], v[:, t]
        state = state * log_decay[:, t][..., None].exp()
        predicted = (state * k_t[..., None]).sum(dim=-2)
        delta = (v_t - predicted) * beta[:, t][..., None]
        state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, t] = (state * q_t.unsqueeze(-1)).sum(dim=-2)
    return out.to(out_dtype), state
