"""What every analysis takes as input: token batches or texts -> (tokens, mask); layer and position choices.

Accepted data (``Data``):
- one batch: token ids ``[batch pos]`` (or ``[pos]``), a text, a tuple ``(tokens, attention_mask)``, or a
  mapping with ``input_ids`` (and ``attention_mask``), as a Hugging Face tokenizer or dataloader returns;
- a dataset: any other iterable (list, generator, DataLoader) of such batches or of texts. Texts are grouped
  ``batch_size`` at a time and left-padded; the mask keeps the padding out of every statistic.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Union

import torch
from jaxtyping import Bool, Int

Tokens = Int[torch.Tensor, "batch pos"]
Mask = Int[torch.Tensor, "batch pos"]
Data = Union[torch.Tensor, str, tuple, Mapping, Iterable]
Positions = Union[int, Sequence[int], Bool[torch.Tensor, "batch pos"], None]


def iter_batches(
    model, data: Data, attention_mask: Mask | None = None, batch_size: int = 8
) -> Iterator[tuple[Tokens, Bool[torch.Tensor, "batch pos"]]]:
    """(tokens, valid) pairs on the model's device; valid is a bool mask, all True without padding."""
    if _is_single_batch(data):
        yield _one_batch(model, data, attention_mask)
        return
    if attention_mask is not None:
        raise ValueError("attention_mask goes with a single token batch; a dataset yields (tokens, mask) pairs itself")
    texts: list[str] = []
    for item in data:
        if isinstance(item, str):
            texts.append(item)
            if len(texts) == batch_size:
                yield _one_batch(model, texts, None)
                texts = []
            continue
        if texts:  # keep the dataset's order when texts and token batches are mixed
            yield _one_batch(model, texts, None)
            texts = []
        if not _is_single_batch(item):
            raise TypeError(f"a dataset item must be token ids, a text, (tokens, mask) or a mapping, got {type(item).__name__}")
        yield _one_batch(model, item, None)
    if texts:
        yield _one_batch(model, texts, None)


def _is_single_batch(data) -> bool:
    if isinstance(data, (torch.Tensor, str, Mapping)):
        return True
    # A tuple of two tensors is (tokens, mask), as datasets and collators commonly yield it.
    return isinstance(data, tuple) and len(data) == 2 and all(isinstance(t, torch.Tensor) for t in data)


def _one_batch(model, data, mask) -> tuple[Tokens, torch.Tensor]:
    if isinstance(data, (str, list)):
        tokens, text_mask = model.tokenize(data)
        mask = text_mask if mask is None else mask
    elif isinstance(data, Mapping):
        tokens, mask = data["input_ids"], data.get("attention_mask", mask)
    elif isinstance(data, tuple):
        tokens, mask = data
    else:
        tokens = data
    if not isinstance(tokens, torch.Tensor):
        tokens = torch.as_tensor(tokens)
    if tokens.dim() == 1:
        tokens = tokens[None]
    if mask is not None and not isinstance(mask, torch.Tensor):
        mask = torch.as_tensor(mask)
    if mask is not None and mask.dim() == 1:
        mask = mask[None]
    if mask is not None and mask.shape != tokens.shape:
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)}, tokens have {tuple(tokens.shape)}")
    tokens = tokens.to(model.device)
    valid = torch.ones_like(tokens, dtype=torch.bool) if mask is None else mask.to(model.device).bool()
    return tokens, valid


def moe_layers(model) -> list[int]:
    """Block indices of the mixture blocks (dense blocks have no router)."""
    return model.cfg.moe_layer_indices


def resolve_layers(model, layers: int | Sequence[int] | None) -> list[int]:
    """Block indices (negative count from the end), each checked to be a mixture block; None: all of them."""
    if layers is None:
        return moe_layers(model)
    out = []
    for layer in [layers] if isinstance(layers, int) else layers:
        n = model.cfg.n_layers
        if not -n <= layer < n:
            raise IndexError(f"layer {layer} is out of range for a model with {n} layers")
        layer %= n
        if not model.cfg.moe_layers[layer]:
            raise ValueError(f"layer {layer} is a dense block: it has no router (mixture layers: {moe_layers(model)})")
        out.append(layer)
    return out


def position_mask(positions: Positions, shape: tuple[int, int], device: torch.device) -> Bool[torch.Tensor, "batch pos"]:
    """[batch pos] bool: None = every position, an int or a list of ints = those positions in every row."""
    if positions is None:
        return torch.ones(shape, dtype=torch.bool, device=device)
    if isinstance(positions, torch.Tensor) and positions.dtype == torch.bool:
        return positions.to(device).expand(shape)
    pos = torch.as_tensor([positions] if isinstance(positions, int) else list(positions), dtype=torch.long)
    mask = torch.zeros(shape[1], dtype=torch.bool)
    mask[pos] = True  # negative positions count from the end, as in indexing
    return mask.to(device).expand(shape)


def hook_name(layer: int, site: str) -> str:
    return f"blocks.{layer}.mlp.hook_{site}"


@torch.no_grad()
def run_sites(model, tokens: Tokens, valid: torch.Tensor, layers: list[int], sites: Sequence[str]) -> dict:
    """Cache the named mixture sites of these layers; the forward stops after the last layer needed."""
    names = [hook_name(layer, site) for layer in layers for site in sites]
    # Without padding no mask is passed, so the run is the very one a user gets from model(tokens).
    mask = None if bool(valid.all()) else valid.long()
    _, cache = model.run_with_cache(tokens, names_filter=names, attention_mask=mask, stop_at_layer=max(layers) + 1)
    return cache.cache_dict
