"""HookPoint and HookedRootModule: the hook machinery every moelens model is built on.

A HookPoint is an identity module placed at a named site. Forward hooks are called as
``fn(tensor, hook=hook_point)`` and may return a replacement tensor, which must keep the shape and
dtype (anything else raises, naming the hook). Backward hooks see the gradient of the site's output.
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Literal, Union

import torch
from torch import nn

HookFn = Callable[..., Union[torch.Tensor, None]]
NameFilter = Union[str, Sequence[str], Callable[[str], bool], None]
Direction = Literal["fwd", "bwd"]


class HookShapeError(ValueError):
    """A hook returned a tensor that cannot stand in for the one it replaced."""


class HookPoint(nn.Module):
    """Identity module at a named site; hooks added here read or replace the tensor flowing through."""

    def __init__(self, layout: str = "", meaning: str = "") -> None:
        super().__init__()
        self.name: str = ""  # set by HookedRootModule.setup()
        self.layout = layout
        self.meaning = meaning
        self._fwd: list[tuple[HookFn, bool]] = []  # (fn, is_permanent)
        self._bwd: list[tuple[HookFn, bool]] = []

    @property
    def has_hooks(self) -> bool:
        return bool(self._fwd or self._bwd)

    @property
    def has_bwd_hooks(self) -> bool:
        return bool(self._bwd)

    def add_hook(self, fn: HookFn, dir: Direction = "fwd", is_permanent: bool = False, prepend: bool = False) -> None:
        if dir not in ("fwd", "bwd"):
            raise ValueError(f"hook direction must be 'fwd' or 'bwd', got {dir!r} for {self.name}")
        hooks = self._fwd if dir == "fwd" else self._bwd
        hooks.insert(0, (fn, is_permanent)) if prepend else hooks.append((fn, is_permanent))

    def remove_hooks(self, dir: Direction | Literal["both"] = "both", including_permanent: bool = False) -> None:
        keep = (lambda perm: perm) if not including_permanent else (lambda perm: False)
        if dir in ("fwd", "both"):
            self._fwd = [(f, p) for f, p in self._fwd if keep(p)]
        if dir in ("bwd", "both"):
            self._bwd = [(f, p) for f, p in self._bwd if keep(p)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for fn, _ in self._fwd:
            out = fn(x, hook=self)
            if out is not None:
                self._check_replacement(x, out)
                x = out
        if self._bwd and x.requires_grad:
            for fn, _ in self._bwd:
                x.register_hook(self._grad_hook(fn))
        return x

    def _grad_hook(self, fn: HookFn) -> Callable[[torch.Tensor], torch.Tensor | None]:
        def call(grad: torch.Tensor) -> torch.Tensor | None:
            out = fn(grad, hook=self)
            if out is not None:
                self._check_replacement(grad, out)
            return out

        return call

    def _check_replacement(self, old: torch.Tensor, new: object) -> None:
        if not isinstance(new, torch.Tensor):
            raise HookShapeError(f"hook on {self.name} returned {type(new).__name__}, expected a tensor or None")
        if new.shape != old.shape or new.dtype != old.dtype:
            raise HookShapeError(
                f"hook on {self.name} returned shape {tuple(new.shape)} dtype {new.dtype}, "
                f"expected shape {tuple(old.shape)} dtype {old.dtype} ({self.layout})"
            )

    def extra_repr(self) -> str:
        return f"[{self.layout}]" if self.layout else ""


class HookedRootModule(nn.Module):
    """Root module that names its HookPoints and offers run_with_hooks / run_with_cache / hooks()."""

    hook_dict: dict[str, HookPoint]
    mod_dict: dict[str, nn.Module]

    def setup(self) -> None:
        """Name every HookPoint after its module path; call at the end of the subclass __init__."""
        self.mod_dict = {}
        self.hook_dict = {}
        for name, module in self.named_modules():
            if name == "":
                continue
            self.mod_dict[name] = module
            if isinstance(module, HookPoint):
                module.name = name
                self.hook_dict[name] = module

    # ---- adding and removing -------------------------------------------------------------------
    def resolve_hook_names(self, name_or_filter: NameFilter) -> list[str]:
        """Hook names selected by an exact name, an alias, a glob, a list of these, or a predicate."""
        if name_or_filter is None:
            return list(self.hook_dict)
        if callable(name_or_filter):
            return [n for n in self.hook_dict if name_or_filter(n)]
        if isinstance(name_or_filter, str):
            return self._resolve_one(name_or_filter)
        names: list[str] = []
        for item in name_or_filter:
            names.extend(n for n in self._resolve_one(item) if n not in names)
        return names

    def _resolve_one(self, name: str) -> list[str]:
        if name in self.hook_dict:
            return [name]
        if any(ch in name for ch in "*?["):
            found = fnmatch.filter(self.hook_dict, name)
            if found:
                return found
        full = self.canonical_hook_name(name)
        if full in self.hook_dict:
            return [full]
        every_block = self.hook_names_for_alias(name)
        if every_block:
            return every_block
        raise KeyError(self._unknown_hook_message(name))

    def canonical_hook_name(self, name: str) -> str:
        """Map an alias to a full hook name; the base class knows no aliases."""
        return name

    def hook_names_for_alias(self, name: str) -> list[str]:
        """A per-block alias given without a layer ("router_logits"): that site in every block that has it."""
        return []

    def _unknown_hook_message(self, name: str) -> str:
        close = [n for n in self.hook_dict if name.split(".")[-1] in n][:5]
        hint = f"; did you mean one of {close}" if close else ""
        return f"no hook point named {name!r} on {type(self).__name__}{hint} (see model.support())"

    def add_hook(
        self,
        name_or_filter: NameFilter,
        hook: HookFn,
        dir: Direction = "fwd",
        is_permanent: bool = False,
        prepend: bool = False,
    ) -> None:
        for name in self.resolve_hook_names(name_or_filter):
            self.hook_dict[name].add_hook(hook, dir=dir, is_permanent=is_permanent, prepend=prepend)

    def add_perma_hook(self, name_or_filter: NameFilter, hook: HookFn, dir: Direction = "fwd") -> None:
        self.add_hook(name_or_filter, hook, dir=dir, is_permanent=True)

    def reset_hooks(self, including_permanent: bool = False) -> None:
        for hp in self.hook_dict.values():
            hp.remove_hooks("both", including_permanent=including_permanent)

    @contextlib.contextmanager
    def hooks(
        self,
        fwd_hooks: Iterable[tuple[NameFilter, HookFn]] = (),
        bwd_hooks: Iterable[tuple[NameFilter, HookFn]] = (),
        reset_hooks_end: bool = True,
    ) -> Iterator[HookedRootModule]:
        """Context manager: the hooks are active inside the block and removed at its end, even on error."""
        added: list[tuple[HookPoint, HookFn, Direction]] = []
        try:
            for direction, pairs in (("fwd", fwd_hooks), ("bwd", bwd_hooks)):
                for name_or_filter, fn in pairs:
                    for name in self.resolve_hook_names(name_or_filter):
                        hp = self.hook_dict[name]
                        hp.add_hook(fn, dir=direction)
                        added.append((hp, fn, direction))
            yield self
        finally:
            if reset_hooks_end:
                for hp, fn, direction in added:
                    hooks = hp._fwd if direction == "fwd" else hp._bwd
                    for i, (f, perm) in enumerate(hooks):
                        if f is fn and not perm:
                            del hooks[i]
                            break

    def run_with_hooks(
        self,
        *model_args,
        fwd_hooks: Iterable[tuple[NameFilter, HookFn]] = (),
        bwd_hooks: Iterable[tuple[NameFilter, HookFn]] = (),
        reset_hooks_end: bool = True,
        **model_kwargs,
    ):
        """Run the forward with these hooks; they are removed afterwards (also when the forward raises).

        With bwd_hooks and reset_hooks_end=True, call .backward() yourself before the hooks go: pass
        reset_hooks_end=False and call reset_hooks() after the backward.
        """
        with self.hooks(fwd_hooks, bwd_hooks, reset_hooks_end=reset_hooks_end):
            return self(*model_args, **model_kwargs)

    def run_with_cache(
        self,
        *model_args,
        names_filter: NameFilter = None,
        remove_batch_dim: bool = False,
        device: torch.device | str | None = None,
        incl_bwd: bool = False,
        **model_kwargs,
    ):
        """Run the forward and return (output, ActivationCache) of the selected hook sites.

        With incl_bwd=True the output must be a scalar (e.g. return_type="loss"); backward is run and
        the gradients are cached under "<name>_grad".
        """
        from moelens.cache import ActivationCache

        store: dict[str, torch.Tensor] = {}
        names = self.resolve_hook_names(names_filter)

        def saver(suffix: str) -> HookFn:
            def save(tensor: torch.Tensor, hook: HookPoint) -> None:
                t = tensor.detach()
                store[hook.name + suffix] = t.to(device) if device is not None else t

            return save

        fwd = [(n, saver("")) for n in names]
        bwd = [(n, saver("_grad")) for n in names] if incl_bwd else []
        with self.hooks(fwd, bwd):
            out = self(*model_args, **model_kwargs)
            if incl_bwd:
                if not isinstance(out, torch.Tensor) or out.numel() != 1:
                    raise ValueError("run_with_cache(incl_bwd=True) needs a scalar output, e.g. return_type='loss'")
                out.backward()
        cache = ActivationCache(store, self, has_batch_dim=True)
        if remove_batch_dim:
            cache = cache.remove_batch_dim()
        return out, cache
