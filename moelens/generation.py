"""Autoregressive generation: greedy or sampled, with moelens's own KV cache, hooks active at every step.

Each step is an ordinary forward of the hooked model, so hooks added with model.hooks(...) or add_hook
fire on the prompt and then on every new token (with the cache, a hook sees only the new positions).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import torch
from jaxtyping import Float, Int
from tqdm.auto import tqdm

from moelens.kv_cache import KVCache
from moelens.positions import check_attention_mask
from moelens.tokenizer import check_padding_side

if TYPE_CHECKING:
    from moelens.models.base import HookedTransformer

GenerateReturn = Literal["input", "tokens", "str"]


def sample_next(
    logits: Float[torch.Tensor, "batch d_vocab"],
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Int[torch.Tensor, " batch"]:
    """The next token of each row: argmax, or a draw after temperature, top-k and top-p (nucleus) filtering."""
    if not do_sample or temperature == 0.0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = logits.sort(-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already hold top_p of the mass (the first always stays)
        drop_sorted = probs.cumsum(-1) - probs > top_p
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: HookedTransformer,
    input: str | list[str] | Int[torch.Tensor, "batch pos"],
    max_new_tokens: int = 10,
    do_sample: bool = True,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    freq_penalty: float = 0.0,
    prepend_bos: bool | None = None,
    padding_side: Literal["left", "right"] | None = None,
    stop_at_eos: bool = True,
    eos_token_id: int | Sequence[int] | None = None,
    use_past_kv_cache: bool = True,
    verbose: bool = False,
    attention_mask: Int[torch.Tensor, "batch pos"] | None = None,
    return_type: GenerateReturn = "input",
    seed: int | None = None,
    generator: torch.Generator | None = None,
) -> Int[torch.Tensor, "batch pos_plus_new"] | str | list[str]:
    """Prompt followed by up to max_new_tokens new tokens per row.

    input: token ids [batch pos] (attention_mask: 0/1, 0 only as left padding, since every row continues
    from its last position; without one, leading pad tokens are masked when padding_side, else the
    tokenizer's, is "left") or text / texts. eos: eos_token_id, else the tokenizer's; with stop_at_eos a row
    that emitted it continues with the pad token (else eos), and generation ends once every row has; with no
    eos known it runs the full max_new_tokens. Sampling draws from `generator`, or from a fresh one seeded
    with `seed`.
    return_type: "tokens", "str" (each row, prompt included, decoded with skip_special_tokens, as
    TransformerLens: no BOS, padding or eos), or "input" (text in, text out; tokens in, tokens out). Text
    comes back as a str for one row (a str input, or a list of one, as TransformerLens), else a list.

    As TransformerLens's generate: it samples by default (do_sample=True; do_sample=False is greedy,
    token for token transformers' greedy generate); freq_penalty (sampling only) subtracts
    freq_penalty x (how often each token occurs in the row so far, padding left out) from the logits after
    the temperature; prepend_bos applies to text input (None: cfg.default_prepend_bos); a list of texts is
    padded on the left whatever padding_side says (TransformerLens forces it too: every row continues from
    its last token). Unlike TransformerLens, verbose defaults to False (no progress bar).
    """
    if padding_side is not None:
        check_padding_side(padding_side)
    if not freq_penalty >= 0:
        raise ValueError(f"freq_penalty must be >= 0, got {freq_penalty!r}")
    if return_type not in ("input", "tokens", "str"):
        raise ValueError(f"return_type must be 'input', 'tokens' or 'str', got {return_type!r}")
    _check_sampling_args(max_new_tokens, temperature, top_k, top_p)
    model._check_not_on_meta()
    text_in = isinstance(input, (str, list))
    if text_in:
        if attention_mask is not None:
            raise ValueError("attention_mask goes with token ids; text is padded (and masked) by the tokenizer")
        tokens, attention_mask = model.tokenize(input, prepend_bos=prepend_bos, padding_side="left")
    else:
        tokens = model._check_tokens(input)
        if attention_mask is not None:
            attention_mask = check_attention_mask(attention_mask, tuple(tokens.shape)).to(model.device)
        elif (padding_side or getattr(model.tokenizer, "padding_side", None)) == "left":
            # as the forward does: leading pads are padding when the padding side is left
            attention_mask = model._mask_of_left_padding(tokens, prepend_bos)
        else:
            _warn_if_right_padded(model, tokens)
    if attention_mask is not None:
        _check_left_padded(attention_mask)
    if generator is None and seed is not None:
        generator = torch.Generator(model.device).manual_seed(seed)
    eos = _eos_ids(model, eos_token_id)
    pad = _pad_id(model, eos)

    batch = tokens.shape[0]
    cache = KVCache.for_model(model, reserve=tokens.shape[1] + max_new_tokens) if use_past_kv_cache else None
    step_tokens, step_mask = tokens, attention_mask
    finished = torch.zeros(batch, dtype=torch.bool, device=model.device)
    for _ in tqdm(range(max_new_tokens), disable=not verbose, desc="generating"):
        if cache is None:
            logits = model(tokens, attention_mask=attention_mask)[:, -1]
        else:
            logits = model(step_tokens, attention_mask=step_mask, past_kv_cache=cache)[:, -1]
        logits = logits.to(model.device)  # with a device map the logits come from the last block's device
        if do_sample and freq_penalty and temperature > 0:
            logits = logits.float() / temperature - freq_penalty * _token_counts(tokens, attention_mask, logits.shape[-1])
            new = sample_next(logits, do_sample, 1.0, top_k, top_p, generator)
        else:
            new = sample_next(logits, do_sample, temperature, top_k, top_p, generator)
        if stop_at_eos and eos is not None:
            new = torch.where(finished, pad, new)
            finished |= torch.isin(new, eos)
        # new tokens are real tokens for the mask, also after eos, as transformers' generate keeps them
        tokens = torch.cat([tokens, new[:, None]], dim=1)
        if attention_mask is not None:
            attention_mask = torch.cat([attention_mask, torch.ones_like(new[:, None])], dim=1)
        step_tokens, step_mask = new[:, None], None  # the cache keeps the prompt's mask; a new token is real
        if stop_at_eos and eos is not None and finished.all():
            break

    if return_type == "tokens" or (return_type == "input" and not text_in):
        return tokens
    # as TransformerLens: each whole row decoded without special tokens (BOS, padding, eos and what fills a
    # finished row), one text as a str, and so is a batch of one
    texts = model._require_tokenizer().batch_decode(tokens, skip_special_tokens=True)
    return texts[0] if len(texts) == 1 else texts


def _token_counts(
    tokens: Int[torch.Tensor, "batch pos"], mask: Int[torch.Tensor, "batch pos"] | None, d_vocab: int
) -> Float[torch.Tensor, "batch d_vocab"]:
    """How often each vocabulary token occurs in each row's real tokens (for freq_penalty)."""
    weight = torch.ones_like(tokens, dtype=torch.float32) if mask is None else mask.float()
    return torch.zeros(tokens.shape[0], d_vocab, device=tokens.device).scatter_add_(1, tokens, weight)


def _warn_if_right_padded(model: HookedTransformer, tokens: Int[torch.Tensor, "batch pos"]) -> None:
    """Token ids without a mask, where some rows end in pad tokens and others do not: most likely a batch
    from to_tokens (right-padded by default), which generate would continue from the pads."""
    pad = None if model.tokenizer is None else model.tokenizer.pad_token_id
    if pad is None or tokens.shape[0] < 2:
        return
    ends_padded = tokens[:, -1] == pad
    if ends_padded.any() and not ends_padded.all():
        warnings.warn(
            f"rows {ends_padded.nonzero().flatten().tolist()} end with the pad token ({pad}) and others do not: "
            "generate continues every row from its last position. For a batch of texts pass the texts, or "
            "left-padded tokens with their mask: tokens, mask = model.tokenize(texts)",
            stacklevel=3,
        )


def _check_sampling_args(max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None) -> None:
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if not temperature >= 0:  # also refuses nan
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or top_k <= 0):
        raise ValueError(f"top_k must be a positive int (or None), got {top_k!r}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (or None), got {top_p!r}")


def _check_left_padded(mask: Int[torch.Tensor, "batch pos"]) -> None:
    """Every row continues from its last position, so that must be a real token: padding only on the left."""
    empty = ~mask.bool().any(-1)
    if empty.any():
        row = int(empty.nonzero()[0, 0])
        raise ValueError(f"attention_mask row {row} is all 0: generate has no token to continue it from")
    right = mask < mask.cummax(-1).values
    if right.any():
        row, pos = (int(i) for i in right.nonzero()[0])
        raise ValueError(
            f"attention_mask row {row} has padding (0) at position {pos}, after a real token: generate needs "
            "left padding (zeros first), as model.tokenize / model.to_tokens pad a list of texts"
        )


def _eos_ids(model: HookedTransformer, eos_token_id: int | Sequence[int] | None) -> torch.Tensor | None:
    if eos_token_id is None and model.tokenizer is not None:
        eos_token_id = model.tokenizer.eos_token_id
    if eos_token_id is None:
        return None
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    if not all(isinstance(i, int) and 0 <= i < model.cfg.d_vocab for i in ids):
        raise ValueError(
            f"eos_token_id must be token ids of the vocabulary [0, {model.cfg.d_vocab}), got {eos_token_id!r}"
        )
    return torch.tensor(ids, dtype=torch.long, device=model.device)


def _pad_id(model: HookedTransformer, eos: torch.Tensor | None) -> int:
    if model.tokenizer is not None and model.tokenizer.pad_token_id is not None:
        return model.tokenizer.pad_token_id
    return int(eos[0]) if eos is not None else 0
