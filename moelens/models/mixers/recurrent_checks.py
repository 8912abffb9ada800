"""The input checks every linear-attention mixer with a RecurrentState makes before its forward: the stream's
shape, the padding mask's, and a cached state's kind and tensor shapes, each refusal naming the mixer and layer."""

from __future__ import annotations

import torch

from moelens.models.context import LayerInputs
from moelens.state import RecurrentState


def check_recurrent_inputs(
    mixer: str, layer: int, d_model: int, x: torch.Tensor, inputs: LayerInputs, shapes: dict[str, tuple[int, ...]]
) -> None:
    """x [batch pos d_model] with at least one position; inputs.mask [batch pos] where given; a cached state a
    RecurrentState whose `conv` and `recurrent` tensors, where held, have `shapes` (for this batch), both or
    neither held."""
    where = f"{mixer} (layer {layer})"
    if x.dim() != 3 or x.shape[-1] != d_model or x.shape[1] == 0:
        raise ValueError(f"{where}: input of shape {tuple(x.shape)}, expected [batch pos d_model={d_model}] with at "
                         "least one position")
    if inputs.mask is not None and inputs.mask.shape != x.shape[:2]:
        raise ValueError(f"{where}: inputs.mask of shape {tuple(inputs.mask.shape)}, expected [batch pos] = "
                         f"{tuple(x.shape[:2])}")
    state = inputs.state
    if state is None:
        return
    if not isinstance(state, RecurrentState):
        raise TypeError(f"{where}: inputs.state is a {type(state).__name__}, expected the RecurrentState this mixer's "
                        "new_state() makes")
    for name, shape in shapes.items():
        held = getattr(state, name)
        if held is not None and tuple(held.shape) != shape:
            raise ValueError(f"{where}: cached state.{name} has shape {tuple(held.shape)}, expected {shape} for this "
                             f"batch of {x.shape[0]}")
    if (state.conv is None) != (state.recurrent is None):
        raise ValueError(f"{where}: cached state has a {'conv' if state.recurrent is None else 'recurrent'} tensor "
                         "without the other")


def state_entering(
    cached: torch.Tensor | None, hook, shape: tuple[int, ...], like: torch.Tensor
) -> torch.Tensor:
    """The recurrent state the new tokens start from, through its hook: the cached one (a copy where a hook may
    edit it: the cache's tensor is never edited in place, snapshots hold it), else float32 zeros of `shape`."""
    if cached is None:
        state_in = like.new_zeros(shape, dtype=torch.float32)
    else:
        state_in = cached.clone() if hook.has_hooks else cached
    return hook(state_in)


def padding_multiplier(
    mixer: str, layer: int, mask: torch.Tensor | None, batch: int, n_pos: int, dtype: torch.dtype
) -> torch.Tensor | None:
    """inputs.mask as a [batch pos 1] multiplier in the stream's dtype (None: every position is real), its shape
    checked."""
    if mask is None:
        return None
    if tuple(mask.shape) != (batch, n_pos):
        raise ValueError(f"{mixer} (layer {layer}): inputs.mask has shape {tuple(mask.shape)}, expected (batch, pos) = "
                         f"{(batch, n_pos)} (1 real, 0 padding)")
    return mask[..., None].to(dtype)


def check_cached_state(
    mixer: str, layer: int, state: RecurrentState, device: torch.device, shapes: dict[str, tuple[int, ...]]
) -> None:
    """A cached state's tensors: each of `shapes` held, of that shape (for this batch), on the input's device."""
    for name, shape in shapes.items():
        held = getattr(state, name)
        if held is None or tuple(held.shape) != shape:
            raise ValueError(f"{mixer} (layer {layer}): cached state.{name} has shape "
                             f"{None if held is None else tuple(held.shape)}, expected {shape} for a batch of {shape[0]}")
        if held.device != device:
            raise ValueError(f"{mixer} (layer {layer}): cached state.{name} is on {held.device}, the input on {device}")
