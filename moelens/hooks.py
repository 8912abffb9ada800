"""HookPoint and HookedRootModule: the hook machinery every moelens model is built on.

A HookPoint is an identity module placed at a named site. Forward hooks are called as
``fn(tensor, hook=hook_point)`` and may return a replacement tensor, which must keep the shape and
dtype (anything else raises, naming the hook). Backward hooks see the gradient of the site's output.
"""

from __future__ import annotations

import contextlib
import contextvars
import fnmatch
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal, Union

import torch
from torch import nn

HookFn = Callable[..., Union[torch.Tensor, None]]
NameFilter = Union[str, Sequence[str], Callable[[str], bool], None]
Direction = Literal["fwd", "bwd"]


class HookShapeError(ValueError):
    """A hook returned a tensor that cannot stand in for the one it replaced."""


@dataclass(eq=False)
class Hook:
    """One hook function added at one HookPoint.

    `active` turns False when the hook is removed: a backward hook registered on a tensor during a forward
    then no longer fires, so removal means the same for both directions. `reads_only` marks moelens's own
    caching hooks, which never edit the tensor (no defensive copy is made for them)."""

    fn: HookFn
    dir: Direction
    is_permanent: bool = False
    reads_only: bool = False
    active: bool = True


# Hooks added for one call (run_with_hooks, run_with_cache, model.hooks()) live in the calling thread's
# context, not on the module: two threads running one model never see each other's call hooks.
_CALL_HOOKS: contextvars.ContextVar[dict[HookPoint, tuple[Hook, ...]]] = contextvars.ContextVar("moelens_call_hooks", default={})
# While run_with_cache(incl_bwd=True) runs its forward: the tensors that received backward hooks, whose
# gradients (and only theirs) its backward pass computes.
_GRAD_TARGETS: contextvars.ContextVar[list[torch.Tensor] | None] = contextvars.ContextVar("moelens_grad_targets", default=None)


class HookPoint(nn.Module):
    """Identity module at a named site; hooks added here read or replace the tensor flowing through.

    Editing the tensor in place and returning None has exactly the effect of returning the edited tensor:
    with autograd on, hooks that may edit get a copy (so an in-place edit never corrupts a tensor that
    autograd saved), and sites whose computation goes on from another tensor ask `run` whether a hook
    may have changed it.
    """

    def __init__(self, layout: str = "", meaning: str = "") -> None:
        super().__init__()
        self.name: str = ""  # set by HookedRootModule.setup()
        self.layout = layout
        self.meaning = meaning
        self._hooks: list[Hook] = []  # added with add_hook / add_perma_hook, until removed

    def hooks_in_effect(self, dir: Direction) -> list[Hook]:
        """This point's hooks of one direction: the module's, then the current call's, in the order added."""
        return [h for h in (*self._hooks, *_CALL_HOOKS.get().get(self, ())) if h.dir == dir]

    @property
    def has_hooks(self) -> bool:
        return bool(self._hooks) or self in _CALL_HOOKS.get()

    @property
    def has_bwd_hooks(self) -> bool:
        return bool(self.hooks_in_effect("bwd"))

    def add_hook(
        self, fn: HookFn, dir: Direction = "fwd", is_permanent: bool = False, prepend: bool = False, reads_only: bool = False
    ) -> Hook:
        if dir not in ("fwd", "bwd"):
            raise ValueError(f"hook direction must be 'fwd' or 'bwd', got {dir!r} for {self.name}")
        hook = Hook(fn, dir, is_permanent, reads_only)
        self._hooks.insert(0, hook) if prepend else self._hooks.append(hook)
        return hook

    def remove_hooks(self, dir: Direction | Literal["both"] = "both", including_permanent: bool = False) -> None:
        keep = []
        for hook in self._hooks:
            if (dir in ("both", hook.dir)) and (including_permanent or not hook.is_permanent):
                hook.active = False
            else:
                keep.append(hook)
        self._hooks = keep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x)[0]

    def run(self, x: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """(the tensor to go on with, whether a hook may have changed it: replaced it or edited it in place)."""
        if not self.has_hooks:  # the common case, on every site of every forward
            return x, False
        fwd, bwd = self.hooks_in_effect("fwd"), self.hooks_in_effect("bwd")
        changed = False
        if fwd:
            editors = any(not h.reads_only for h in fwd)
            if editors and torch.is_grad_enabled() and x.requires_grad:
                x = x.clone()  # an in-place edit must not touch a tensor autograd saved (softmax, sigmoid outputs)
                changed = True
            version = _version(x)
            for hook in fwd:
                out = hook.fn(x, hook=self)
                if out is not None:
                    self._check_replacement(x, out)
                    changed, x = changed or out is not x, out
            changed = changed or (editors and (version is None or _version(x) != version))
        if bwd and x.requires_grad:
            for hook in bwd:
                x.register_hook(self._grad_hook(hook))
            targets = _GRAD_TARGETS.get()
            if targets is not None:
                targets.append(x)
        return x, changed

    def _grad_hook(self, hook: Hook) -> Callable[[torch.Tensor], torch.Tensor | None]:
        def call(grad: torch.Tensor) -> torch.Tensor | None:
            if not hook.active:  # removed between this forward and the backward
                return None
            out = hook.fn(grad, hook=self)
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
        if new.device != old.device:
            raise HookShapeError(f"hook on {self.name} returned a tensor on {new.device}, expected one on {old.device}")

    def extra_repr(self) -> str:
        return f"[{self.layout}]" if self.layout else ""


def _version(t: torch.Tensor) -> int | None:
    """The tensor's in-place edit counter; None where torch keeps none (inference mode)."""
    try:
        return t._version
    except RuntimeError:
        return None


class HookedRootModule(nn.Module):
    """Root module that names its HookPoints and offers run_with_hooks / run_with_cache / hooks()."""

    hook_dict: dict[str, HookPoint]
    mod_dict: dict[str, nn.Module]
    # what run_with_cache returns, built as cache_class(store, model, has_batch_dim=True): set by the model
    # class (moelens.cache.ActivationCache), so that hooks know nothing of the cache built on them
    cache_class: ClassVar[type]

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
        """Add a hook that stays, for every thread, until reset_hooks() (or for good with is_permanent)."""
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
        """Context manager: the hooks are active inside the block and removed at its end, even on error.

        They belong to the calling thread (and its context): another thread running this model meanwhile
        does not see them. Backward hooks fire only for a backward run inside the block. With
        reset_hooks_end=False they are added to the modules instead, for every thread, until reset_hooks().
        """
        pairs = [(d, self.resolve_hook_names(f), fn) for d, hooks in (("fwd", fwd_hooks), ("bwd", bwd_hooks)) for f, fn in hooks]
        if not reset_hooks_end:
            for direction, names, fn in pairs:
                for name in names:
                    self.hook_dict[name].add_hook(fn, dir=direction)
            yield self
            return
        added: list[Hook] = []
        call_hooks = dict(_CALL_HOOKS.get())
        for direction, names, fn in pairs:
            for name in names:
                hp = self.hook_dict[name]
                added.append(Hook(fn, direction, reads_only=getattr(fn, "reads_only", False)))
                call_hooks[hp] = (*call_hooks.get(hp, ()), added[-1])
        token = _CALL_HOOKS.set(call_hooks)
        try:
            yield self
        finally:
            _CALL_HOOKS.reset(token)
            for hook in added:
                hook.active = False

    def run_with_hooks(
        self,
        *model_args,
        fwd_hooks: Iterable[tuple[NameFilter, HookFn]] = (),
        bwd_hooks: Iterable[tuple[NameFilter, HookFn]] = (),
        reset_hooks_end: bool = True,
        **model_kwargs,
    ):
        """Run the forward with these hooks; they are removed afterwards (also when the forward raises).

        Backward hooks fire only while they are in place: with reset_hooks_end=True (the default) they are
        gone when the forward returns, so a later .backward() does not call them (a warning says so). To
        use them, pass reset_hooks_end=False, call .backward(), then reset_hooks(); or use
        run_with_cache(incl_bwd=True), or `with model.hooks(bwd_hooks=...):` around forward and backward.
        """
        bwd_hooks = list(bwd_hooks)
        if bwd_hooks and reset_hooks_end:
            warnings.warn(
                "run_with_hooks(reset_hooks_end=True) removes its backward hooks when the forward returns, so "
                "they will not fire on a later .backward(); pass reset_hooks_end=False and call reset_hooks() "
                "after the backward",
                stacklevel=2,
            )
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

        With incl_bwd=True the output must be a scalar (e.g. return_type="loss"); its gradient with respect
        to each selected site is computed and cached under "<name>_grad". Only those gradients are
        computed: no parameter's .grad is written.
        """
        store: dict[str, torch.Tensor] = {}
        names = self.resolve_hook_names(names_filter)

        def saver(suffix: str) -> HookFn:
            def save(tensor: torch.Tensor, hook: HookPoint) -> None:
                t = tensor.detach()
                store[hook.name + suffix] = t.to(device) if device is not None else t

            save.reads_only = True
            return save

        fwd = [(n, saver("")) for n in names]
        bwd = [(n, saver("_grad")) for n in names] if incl_bwd else []
        targets: list[torch.Tensor] = []
        collecting = _GRAD_TARGETS.set(targets) if incl_bwd else None
        try:
            with self.hooks(fwd, bwd):
                out = self(*model_args, **model_kwargs)
                if incl_bwd:
                    _GRAD_TARGETS.reset(collecting)
                    collecting = None
                    if not isinstance(out, torch.Tensor) or out.numel() != 1:
                        raise ValueError("run_with_cache(incl_bwd=True) needs a scalar output, e.g. return_type='loss'")
                    if targets:  # gradients of the hooked activations only: the parameters' are never formed
                        torch.autograd.grad(out, targets, allow_unused=True)
        finally:
            if collecting is not None:
                _GRAD_TARGETS.reset(collecting)
        cache = self.cache_class(store, self, has_batch_dim=True)
        if remove_batch_dim:
            cache = cache.remove_batch_dim()
        return out, cache
