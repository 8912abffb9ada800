"""SAE-Lens's HookedSAETransformer API on moelens models: add_sae, reset_saes, run_with_saes,
run_with_cache_with_saes, run_with_hooks_with_saes and the saes() context, taking SAE-Lens SAE objects
(`pip install ".[sae]"` from the checkout; sae_lens itself is imported only by the caller who makes the SAEs).

An attached SAE sits at the site named by `sae.cfg.metadata.hook_name`: a hook there replaces the tensor by the
SAE's reconstruction, or, with use_error_term=True, by reconstruction + error, which is the site's own tensor
exactly (bit for bit) unless a hook inside the SAE edits something. The SAE's internals are hook points named
as in SAE-Lens, under the site: `blocks.1.hook_resid_pre.hook_sae_acts_post` (also hook_sae_input,
hook_sae_acts_pre, hook_sae_recons, hook_sae_error, hook_sae_output), so run_with_cache and run_with_hooks reach
them. Differences from SAE-Lens, all on purpose:
- the site keeps its own hook point, and the SAE runs before every hook there, so `blocks.1.hook_resid_pre`
  itself (hooked or cached) is what flows on: the SAE's output (in SAE-Lens the site's name disappears);
- an SAE whose site the model lacks is an error (SAE-Lens warns and attaches nothing);
- transcoders (hook_name_out) and exclude_special_tokens are refused with an error, not supported yet;
- an SAE trained on one slot / head (metadata.hook_head_index, as ActivationsStore trains it) replaces that
  slot only; an SAE trained on a per-slot site flattened to [batch pos (top_k d_model)] (what ActivationsStore
  feeds it) gets the flattened tensor and its output is unflattened.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Float
from torch import nn

from moelens.hooks import Hook, HookPoint

if TYPE_CHECKING:
    from sae_lens import SAE

# hook points the splice calls itself (SAE-Lens's wrapper makes its own for these two as well)
_OWN_POINTS = ("hook_sae_error", "hook_sae_output")
_MEANINGS = {
    "hook_sae_input": ("d_in", "the SAE's input (the site's tensor, in the SAE's dtype and layout)"),
    "hook_sae_acts_pre": ("d_sae", "SAE feature pre-activations"),
    "hook_sae_acts_post": ("d_sae", "SAE feature activations"),
    "hook_sae_recons": ("d_in", "the SAE's reconstruction"),
    "hook_sae_error": ("d_in", "input - clean reconstruction (use_error_term=True only)"),
    "hook_sae_output": ("d_in", "what replaces the site: reconstruction (+ error with use_error_term=True)"),
}
# The splice running in this thread: the SAE's own hook points forward to moelens's only while it runs, so the
# same SAE used on its own (sae(x), training) never fires a model's hooks.
_RUNNING: contextvars.ContextVar[SAESplice | None] = contextvars.ContextVar("moelens_sae_running", default=None)


@contextlib.contextmanager
def _sae_hooks_off(sae: nn.Module) -> Iterator[None]:
    """The SAE's hook points replaced by identities (SAE-Lens computes the clean error term this way)."""
    names = [n for n, m in sae.named_children() if n.startswith("hook_")]
    saved = {n: getattr(sae, n) for n in names}
    try:
        for n in names:
            setattr(sae, n, nn.Identity())
        yield
    finally:
        for n, m in saved.items():
            setattr(sae, n, m)


class SAESplice:
    """One SAE attached at one site: the replacing hook, and moelens hook points for the SAE's internals,
    added as children of the site's HookPoint (so setup() names them '<site>.hook_sae_*')."""

    def __init__(self, site: HookPoint, sae: SAE, use_error_term: bool) -> None:
        self.site, self.sae, self.use_error_term = site, sae, bool(use_error_term)
        self.head_index: int | None = sae.cfg.metadata.hook_head_index
        self.points = {name: HookPoint("", meaning) for name, (_, meaning) in _MEANINGS.items()}
        # SAE-Lens's SAE calls its own (TransformerLens) hook points inside encode / decode: forward each to ours
        self._bridges = [
            module.register_forward_hook(self._bridge(name))
            for name, module in sae.named_children()
            if name in self.points and name not in _OWN_POINTS
        ]
        for name, point in self.points.items():
            site.add_module(name, point)
        # prepend: the SAE runs before every hook at the site, which then sees (and may edit) what flows on
        self.hook: Hook = site.add_hook(self, dir="fwd", is_permanent=True, prepend=True)

    def _bridge(self, name: str):
        def forward_to_moelens(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor | None:
            return self.points[name](output) if _RUNNING.get() is self else None

        return forward_to_moelens

    def detach(self) -> None:
        self.hook.active = False
        self.site._hooks = [h for h in self.site._hooks if h is not self.hook]  # HookPoint has no remove-one API
        for handle in self._bridges:
            handle.remove()
        for name in self.points:
            delattr(self.site, name)

    def __call__(self, x: Float[torch.Tensor, "batch pos *rest"], hook: HookPoint) -> torch.Tensor:
        sae_in = x if self.head_index is None else x[:, :, self.head_index]
        sae_in = self._to_sae_layout(sae_in)
        self._set_layouts(sae_in.dim())
        token = _RUNNING.set(self)
        try:
            out = self._run(sae_in.to(self.sae.device))
        finally:
            _RUNNING.reset(token)
        out = out.reshape(*x.shape[:2], *x.shape[3 if self.head_index is not None else 2:]).to(x.device, x.dtype)
        if self.head_index is None:
            return out
        whole = x.clone()
        whole[:, :, self.head_index] = out
        return whole

    def _set_layouts(self, ndim: int) -> None:
        """The internals' layouts (what run_with_cache's pos_slice reads): the site's leading axes, then d_in or
        d_sae; known once the SAE's input layout is (per slot, one slot, or flattened)."""
        axes = self.site.layout.split()
        if self.head_index is not None:
            axes = axes[:2] + axes[3:]
        for name, (last, _) in _MEANINGS.items():
            self.points[name].layout = " ".join([*axes[: ndim - 1], last])

    def _to_sae_layout(self, x: torch.Tensor) -> torch.Tensor:
        d_in = self.sae.cfg.d_in
        if x.shape[-1] == d_in or getattr(self.sae, "hook_z_reshaping_mode", False):
            return x  # per position (per slot on [batch pos top_k d] sites), or SAE-Lens's own hook_z reshape
        if x.dim() > 3 and math.prod(x.shape[2:]) == d_in:
            return x.flatten(2)  # trained on the flattened site, as ActivationsStore feeds a [batch pos a b] site
        raise ValueError(
            f"SAE at {self.site.name}: its d_in is {d_in}, but the site gives [{self.site.layout}] = "
            f"{tuple(x.shape)}{'' if self.head_index is None else f' (slot {self.head_index})'}: expected the "
            f"last axis, or every axis after pos, to hold {d_in} values"
        )

    def _run(self, sae_in: torch.Tensor) -> torch.Tensor:
        recons = self.sae.decode(self.sae.encode(sae_in))
        if not self.use_error_term:
            return self.points["hook_sae_output"](recons)
        with torch.no_grad(), _sae_hooks_off(self.sae):
            clean = self.sae.decode(self.sae.encode(sae_in))
        sae_in = sae_in.detach().to(clean.dtype)  # the error carries no gradient, as in SAE-Lens
        error, edited = self.points["hook_sae_error"].run(sae_in - clean)
        # recons + error is the input only up to rounding; input + (recons - clean) is the same sum, and the input
        # bit for bit when no hook edited a feature (recons == clean). An edited error has to be added as it is.
        out = recons + error if edited else sae_in + (recons - clean)
        return self.points["hook_sae_output"](out)


class HookedSAEMixin:
    """HookedSAETransformer's methods (SAE-Lens) for a moelens HookedTransformer; see the module docstring."""

    @property
    def _sae_splices(self) -> dict[str, SAESplice]:
        splices = self.__dict__.get("_moelens_sae_splices")
        if splices is None:
            splices = self.__dict__["_moelens_sae_splices"] = {}
        return splices

    @property
    def acts_to_saes(self) -> dict[str, SAE]:
        """Hook name -> the SAE attached there."""
        return {name: s.sae for name, s in self._sae_splices.items()}

    def _sae_site(self, sae: SAE) -> str:
        metadata = getattr(getattr(sae, "cfg", None), "metadata", None)
        if metadata is None or not hasattr(sae, "encode") or not hasattr(sae, "decode"):
            raise TypeError(f"sae must be an SAE-Lens SAE (with cfg.metadata, encode, decode), got {type(sae).__name__}")
        name = metadata.hook_name
        if not isinstance(name, str):
            raise ValueError(f"sae.cfg.metadata.hook_name must name the hook the SAE reads, got {name!r}")
        if metadata.hook_name_out not in (None, name):
            raise NotImplementedError(
                f"sae reads {name} and writes {metadata.hook_name_out} (a transcoder): moelens attaches SAEs that "
                "write back where they read only"
            )
        full = self.canonical_hook_name(name)
        if full not in self.hook_dict or ".hook_sae_" in full:
            raise KeyError(f"sae.cfg.metadata.hook_name = {name!r}: {self._unknown_hook_message(name)}")
        return full

    def add_sae(self, sae: SAE, use_error_term: bool | None = None, exclude_special_tokens: bool | list[int] = False) -> None:
        """Attach `sae` at the hook sae.cfg.metadata.hook_name until reset_saes() (replacing an SAE there).
        use_error_term: True adds the SAE's error back, so the site's value is unchanged unless a hook inside the
        SAE edits it; None takes sae.use_error_term."""
        if exclude_special_tokens is not False:
            raise NotImplementedError("add_sae: exclude_special_tokens is not supported by moelens yet; pass False")
        name = self._sae_site(sae)
        if name in self._sae_splices:
            self._sae_splices.pop(name).detach()
        effective = sae.use_error_term if use_error_term is None else use_error_term
        self._sae_splices[name] = SAESplice(self.hook_dict[name], sae, effective)
        self.setup()

    def _reset_sae(self, act_name: str, prev: SAESplice | None = None) -> None:
        name = self.canonical_hook_name(act_name)
        if name not in self._sae_splices:
            raise KeyError(f"reset_saes: no SAE is attached at {act_name!r} (attached: {list(self._sae_splices)})")
        self._sae_splices.pop(name).detach()
        if prev is not None:
            self._sae_splices[name] = SAESplice(prev.site, prev.sae, prev.use_error_term)

    def reset_saes(self, act_names: str | list[str] | None = None, prev_saes: list[SAE | None] | None = None) -> None:
        """Detach the SAEs at act_names (default: all). prev_saes (older SAE-Lens): one per act_name, an SAE to
        attach in its place (with its own use_error_term) or None."""
        names = [act_names] if isinstance(act_names, str) else list(self._sae_splices) if act_names is None else list(act_names)
        if prev_saes is not None and len(prev_saes) != len(names):
            raise ValueError(f"reset_saes: prev_saes has {len(prev_saes)} entries, act_names {len(names)}: one per name")
        for name in names:
            self._reset_sae(name)
        self.setup()
        for prev in prev_saes or ():
            if prev is not None:
                self.add_sae(prev)

    @contextlib.contextmanager
    def saes(
        self,
        saes: SAE | list[SAE] = (),
        reset_saes_end: bool = True,
        use_error_term: bool | None = None,
        exclude_special_tokens: bool | list[int] = False,
    ) -> Iterator[HookedSAEMixin]:
        """Attach `saes` inside the block; at its end (with reset_saes_end) detach them and put back the SAEs
        they displaced, as they were."""
        saes = [saes] if not isinstance(saes, (list, tuple)) else list(saes)
        to_restore: list[tuple[str, SAESplice | None]] = []
        try:
            for sae in saes:
                name = self._sae_site(sae)
                to_restore.append((name, self._sae_splices.get(name)))
                self.add_sae(sae, use_error_term=use_error_term, exclude_special_tokens=exclude_special_tokens)
            yield self
        finally:
            if reset_saes_end:
                for name, prev in reversed(to_restore):
                    if name in self._sae_splices:
                        self._reset_sae(name, prev)
                self.setup()

    def run_with_saes(
        self, *model_args, saes: SAE | list[SAE] = (), reset_saes_end: bool = True,
        use_error_term: bool | None = None, exclude_special_tokens: bool | list[int] = False, **model_kwargs,
    ):
        """The forward with `saes` attached for this call."""
        with self.saes(saes, reset_saes_end, use_error_term, exclude_special_tokens):
            return self(*model_args, **model_kwargs)

    def run_with_cache_with_saes(
        self, *model_args, saes: SAE | list[SAE] = (), reset_saes_end: bool = True,
        use_error_term: bool | None = None, exclude_special_tokens: bool | list[int] = False,
        return_cache_object: bool = True, remove_batch_dim: bool = False, **kwargs,
    ):
        """run_with_cache with `saes` attached for this call; their internals are cached as
        '<site>.hook_sae_acts_post' and so on."""
        with self.saes(saes, reset_saes_end, use_error_term, exclude_special_tokens):
            return self.run_with_cache(
                *model_args, return_cache_object=return_cache_object, remove_batch_dim=remove_batch_dim, **kwargs
            )

    def run_with_hooks_with_saes(
        self, *model_args, saes: SAE | list[SAE] = (), reset_saes_end: bool = True,
        exclude_special_tokens: bool | list[int] = False, fwd_hooks=(), bwd_hooks=(),
        reset_hooks_end: bool = True, clear_contexts: bool = False, **model_kwargs,
    ):
        """run_with_hooks with `saes` attached for this call."""
        with self.saes(saes, reset_saes_end, exclude_special_tokens=exclude_special_tokens):
            return self.run_with_hooks(
                *model_args, fwd_hooks=fwd_hooks, bwd_hooks=bwd_hooks, reset_hooks_end=reset_hooks_end,
                clear_contexts=clear_contexts, **model_kwargs,
            )
