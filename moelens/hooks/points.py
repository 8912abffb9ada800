"""HookPoint and HookedRootModule: the hook machinery every moelens model is built on.

A HookPoint is an identity module placed at a named site. Forward hooks are called as
``fn(tensor, hook=hook_point)`` and may return a replacement tensor, which must keep the shape and
dtype (anything else raises, naming the hook). Backward hooks see the gradient of the site's output and may
return a replacement, bare or as a 1-tuple (grad,) as TransformerLens's do.

The API is TransformerLens's (hook_points.py): add_hook(name_or_filter, hook, dir, is_permanent, level,
prepend), reset_hooks(clear_contexts, direction, including_permanent, level), remove_all_hook_fns,
hook_points(), HookPoint.ctx / layer() / add_perma_hook, run_with_hooks and hooks() with clear_contexts,
run_with_cache with pos_slice and return_cache_object. Hooks run in TransformerLens's order: the order they
were added (model's and one call's alike), prepended ones first (the last prepended first).

The hooks of one call (run_with_hooks, run_with_cache, hooks()) belong to the calling thread, not to the
module: another thread running the model never sees them. For the calling thread they are hooks like any
other, as in TransformerLens: HookPoint.fwd_hooks / bwd_hooks list them, and remove_hooks / reset_hooks /
remove_all_hook_fns called inside the call remove them. Differences, on purpose: leaving a hooks() block
removes only that block's hooks (TransformerLens also removes any module hook added at the same context
level, e.g. by an earlier reset_hooks_end=False call); run_with_cache(incl_bwd=True) writes no parameter .grad.
"""

from __future__ import annotations

import contextlib
import contextvars
import fnmatch
import itertools
import numbers
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Union

import torch
from torch import nn

HookFn = Callable[..., Union[torch.Tensor, None]]
NameFilter = Union[str, Sequence[str], Callable[[str], bool], None]
Direction = Literal["fwd", "bwd"]
Directions = Literal["fwd", "bwd", "both"]
# TransformerLens's SliceInput: None (all), an int (selects, dropping the axis), a (start, stop[, step]) tuple,
# a slice, or a list / tensor / array of indices (or a boolean mask); a Slice object is unwrapped to its .slice
SliceInput = Union[int, slice, tuple, list, torch.Tensor, None]


class HookShapeError(ValueError):
    """A hook returned a tensor that cannot stand in for the one it replaced."""


@dataclass(eq=False)
class Hook:
    """One hook function added at one HookPoint.

    `active` turns False when the hook is removed: a backward hook registered on a tensor during a forward
    then no longer fires, so removal means the same for both directions. `reads_only` marks moelens's own
    caching hooks, which never edit the tensor (no defensive copy is made for them).

    It answers to TransformerLens's LensHandle: is_permanent, context_level, and .hook, the handle (here the
    record itself) with its registration number .id and .remove()."""

    fn: HookFn
    dir: Direction
    is_permanent: bool = False
    reads_only: bool = False
    active: bool = True
    level: int | None = None  # the hooks() context level it was added at (TransformerLens's context_level)
    order: int = 0  # position in the run order: appended hooks count up, prepended ones count down
    # registration number, counting up across all hook points (as torch's RemovableHandle.id)
    id: int = field(default_factory=lambda: next(_REGISTRATION))
    point: HookPoint | None = field(default=None, repr=False)  # the HookPoint it was added to, for remove()

    def __post_init__(self) -> None:
        if self.order == 0:
            self.order = next(_APPEND_ORDER)

    @property
    def context_level(self) -> int | None:
        """TransformerLens's name for `level` (LensHandle.context_level)."""
        return self.level

    @property
    def hook(self) -> Hook:
        """TransformerLens's LensHandle.hook (the torch handle, with .id and .remove()): this record."""
        return self

    def remove(self) -> None:
        """Remove this one hook (RemovableHandle.remove()); removing it twice does nothing."""
        self.active = False
        if self.point is not None:
            self.point.discard(self)


# One run order for all hooks of a HookPoint, the module's and the calls', as TransformerLens's single list of
# torch hooks: added order, and prepend=True puts a hook before every hook there is (the last prepended first).
_APPEND_ORDER = itertools.count(1)
_PREPEND_ORDER = itertools.count(-1, -1)
_REGISTRATION = itertools.count(1)


# Hooks added for one call (run_with_hooks, run_with_cache, model.hooks()) live in the calling thread's
# context, not on the module: two threads running one model never see each other's call hooks.
_CALL_HOOKS: contextvars.ContextVar[dict[HookPoint, tuple[Hook, ...]]] = contextvars.ContextVar("moelens_call_hooks", default={})
# While run_with_cache(incl_bwd=True) runs its forward: the tensors that received backward hooks, whose
# gradients (and only theirs) its backward pass computes.
_GRAD_TARGETS: contextvars.ContextVar[list[torch.Tensor] | None] = contextvars.ContextVar("moelens_grad_targets", default=None)
# How many hooks() blocks the calling thread is inside (TransformerLens's model.context_level).
_CONTEXT_LEVEL: contextvars.ContextVar[int] = contextvars.ContextVar("moelens_context_level", default=0)


def call_hooked_points() -> dict[HookPoint, tuple[Hook, ...]]:
    """The HookPoints that have hooks of the calling thread's current call (run_with_hooks, hooks(), ...):
    lets a site with many HookPoints (the per-expert views) ask cheaply whether any of them is hooked."""
    return _CALL_HOOKS.get()


def _check_direction(dir: str, allowed: tuple[str, ...], where: str) -> None:
    if dir not in allowed:
        raise ValueError(f"{where}: direction must be one of {allowed}, got {dir!r}")


def unwrap_slice(pos_slice: Any) -> SliceInput:
    """A TransformerLens Slice object -> what it wraps; anything else as it is."""
    if hasattr(pos_slice, "slice") and hasattr(pos_slice, "apply"):
        return pos_slice.slice
    return pos_slice


def unwrap_cache_slice(pos_slice: Any) -> SliceInput:
    """run_with_cache's pos_slice, read as TransformerLens's Slice.unwrap reads it: a plain int (or an int-like
    scalar: numpy integer, 0-d tensor or array) keeps the position axis, as the one-element list [i]; a Slice
    object is taken as it is (so Slice(i) drops the axis); anything else as unwrap_slice."""
    if isinstance(pos_slice, bool):
        raise TypeError(f"a position slice must be an int, slice, tuple, list or tensor, got {pos_slice!r}")
    if isinstance(pos_slice, numbers.Integral) or (
        getattr(pos_slice, "ndim", None) == 0 and not hasattr(pos_slice, "apply")
    ):
        return [int(pos_slice)]
    return unwrap_slice(pos_slice)


def slice_pos(t: torch.Tensor, pos_slice: SliceInput, dim: int) -> torch.Tensor:
    """TransformerLens's Slice.apply on axis `dim`: None keeps all, an int selects (and drops the axis), a
    tuple is slice(*t), a slice slices, a list / tensor / array of indices gathers."""
    pos_slice = unwrap_slice(pos_slice)
    if pos_slice is None:
        return t
    if isinstance(pos_slice, bool):
        raise TypeError(f"a position slice must be an int, slice, tuple, list or tensor, got {pos_slice!r}")
    if isinstance(pos_slice, int):
        return t.select(dim, pos_slice)
    if isinstance(pos_slice, tuple):
        pos_slice = slice(*pos_slice)
    if isinstance(pos_slice, slice):
        return t[(slice(None),) * (dim % t.dim()) + (pos_slice,)]
    try:
        index = torch.as_tensor(pos_slice, device=t.device)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(
            f"a position slice must be None, an int, slice, tuple, list or tensor of indices, got {type(pos_slice).__name__}"
        ) from None
    if index.dtype == torch.bool:  # a mask over the axis, as in TransformerLens (numpy indexing)
        if index.dim() != 1 or index.shape[0] != t.shape[dim]:
            raise IndexError(f"a boolean slice must have one entry per index of the axis ({t.shape[dim]}), got shape {tuple(index.shape)}")
        index = index.nonzero().flatten()
    if index.dim() == 0:  # a 0-d tensor or array is an int: it selects and drops the axis
        return t.select(dim, int(index))
    index, size = index.long().flatten(), t.shape[dim]
    if index.numel() and not (-size <= int(index.min()) and int(index.max()) < size):
        raise IndexError(f"position indices {index.tolist()} out of range for an axis of size {size}")
    return t.index_select(dim, index % size if size else index)  # negative indices count from the end


class HookPresence:
    """HookPoint.has_hooks: true while a hook is in effect at its point for the calling thread (module hooks,
    or hooks of the calls in progress in the thread; a removed one may still count until its call ends, which
    only costs a look at no hooks), and callable as TransformerLens's has_hooks(dir="both",
    including_permanent=True, level=None), which looks at exactly the hooks in effect."""

    __slots__ = ("point",)

    def __init__(self, point: HookPoint) -> None:
        self.point = point

    def __bool__(self) -> bool:
        return bool(self.point._hooks) or self.point in _CALL_HOOKS.get()

    def __call__(self, dir: Directions = "both", including_permanent: bool = True, level: int | None = None) -> bool:
        _check_direction(dir, ("fwd", "bwd", "both"), f"has_hooks on {self.point.name}")
        directions = ("fwd", "bwd") if dir == "both" else (dir,)
        return any(
            (including_permanent or not hook.is_permanent) and (level is None or hook.level == level)
            for d in directions for hook in self.point.hooks_in_effect(d)
        )

    def __repr__(self) -> str:
        return repr(bool(self))


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
        # free storage for hook functions (TransformerLens's hook.ctx), cleared by clear_context(),
        # reset_hooks() and hooks(clear_contexts=True); shared by every thread
        self.ctx: dict = {}
        self._presence = HookPresence(self)

    @property
    def fwd_hooks(self) -> list[Hook]:
        """The forward hooks in effect here for the calling thread, in run order (prepended ones first), as
        TransformerLens lists them: the module's (add_hook) and those of the calls in progress in this thread
        (run_with_hooks, run_with_cache, hooks()). Another thread's call hooks are not here."""
        return self.hooks_in_effect("fwd")

    @property
    def bwd_hooks(self) -> list[Hook]:
        """The backward hooks in effect here for the calling thread (as fwd_hooks)."""
        return self.hooks_in_effect("bwd")

    def hooks_in_effect(self, dir: Direction) -> list[Hook]:
        """This point's hooks of one direction, the module's and the current call's, in run order."""
        found = [h for h in (*self._hooks, *_CALL_HOOKS.get().get(self, ())) if h.dir == dir and h.active]
        return sorted(found, key=lambda h: h.order) if len(found) > 1 else found

    @property
    def has_hooks(self) -> HookPresence:
        """Whether any hook is in effect here for the calling thread: true or false as it is (read on every
        site of every forward, so cheap), and callable as TransformerLens's method has_hooks(dir,
        including_permanent, level)."""
        return self._presence

    @property
    def has_bwd_hooks(self) -> bool:
        return bool(self.hooks_in_effect("bwd"))

    def add_hook(
        self,
        hook: HookFn,
        dir: Direction = "fwd",
        is_permanent: bool = False,
        level: int | None = None,
        prepend: bool = False,
        reads_only: bool = False,
    ) -> Hook:
        """Add `hook(tensor, hook=self)` here, for every thread, until removed (TransformerLens's signature).
        prepend=True runs it before every hook already there. Returns the Hook record."""
        _check_direction(dir, ("fwd", "bwd"), f"add_hook on {self.name}")
        if not callable(hook):
            raise TypeError(f"add_hook on {self.name}: hook must be a function fn(tensor, hook), got {type(hook).__name__}")
        order = next(_PREPEND_ORDER) if prepend else next(_APPEND_ORDER)
        record = Hook(hook, dir, is_permanent, reads_only, level=level, order=order, point=self)
        self._hooks.append(record)
        return record

    def discard(self, record: Hook) -> None:
        """Remove one hook record added here (Hook.remove()); one not here is ignored."""
        record.active = False
        self._hooks = [h for h in self._hooks if h is not record]

    def add_perma_hook(self, hook: HookFn, dir: Direction = "fwd") -> Hook:
        """`add_hook(hook, dir, is_permanent=True)`: a hook that `reset_hooks()` keeps unless asked."""
        return self.add_hook(hook, dir=dir, is_permanent=True)

    def remove_hooks(self, dir: Directions = "fwd", including_permanent: bool = False, level: int | None = None) -> None:
        """Remove this point's hooks of direction `dir` ("fwd" by default, as TransformerLens): the
        non-permanent ones (of context level `level` only, when given), or all with including_permanent.
        The calling thread's call hooks here (run_with_hooks, hooks(), ...) go too, as in TransformerLens;
        other threads' stay."""
        _check_direction(dir, ("fwd", "bwd", "both"), f"remove_hooks on {self.name}")

        def gone(hook: Hook) -> bool:
            removable = including_permanent or (not hook.is_permanent and (level is None or hook.level == level))
            return dir in ("both", hook.dir) and removable

        keep = []
        for hook in self._hooks:
            if gone(hook):
                hook.active = False
            else:
                keep.append(hook)
        self._hooks = keep
        for hook in _CALL_HOOKS.get().get(self, ()):
            if gone(hook):
                hook.active = False  # the call's own record: its block ends without it

    def clear_context(self) -> None:
        """Empty `ctx`, the dict hooks keep state in between calls."""
        self.ctx = {}

    def layer(self) -> int:
        """The block index in this point's name, 'blocks.{layer}.…' (TransformerLens's HookPoint.layer())."""
        parts = self.name.split(".")
        if len(parts) < 2 or parts[0] != "blocks" or not parts[1].isdigit():
            raise ValueError(f"hook point {self.name!r} is not inside a block ('blocks.<layer>.…'): it has no layer")
        return int(parts[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x after this point's forward hooks (each may return a replacement or edit it in place)."""
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
            if isinstance(out, tuple) and len(out) == 1:
                out = out[0]  # TransformerLens's backward hooks return (grad,), torch's module-hook form
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
        """The site's layout, as `print(model)` shows it."""
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
    # what run_with_cache returns, built as cache_class(store, model, has_batch_dim=True): set by the subclass
    # moelens.hook_points.HookedRootModule (moelens.cache.ActivationCache), so that hooks know nothing of the
    # cache built on them
    cache_class: ClassVar[type]
    is_caching: bool = False  # TransformerLens's flag: True while caching hooks are on (run_with_cache)

    @property
    def context_level(self) -> int:
        """How many hooks() blocks the calling thread is inside (TransformerLens's model.context_level)."""
        return _CONTEXT_LEVEL.get()

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

    def hook_points(self):
        """Every HookPoint (TransformerLens's hook_points())."""
        return self.hook_dict.values()

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
        level: int | None = None,
        prepend: bool = False,
    ) -> None:
        """Add a hook that stays, for every thread, until reset_hooks() (or for good with is_permanent).
        name_or_filter: a hook name, alias, glob, list of these, or a predicate on names (TransformerLens's
        name or filter). prepend=True runs it before every hook already at the site."""
        _check_direction(dir, ("fwd", "bwd"), "add_hook")
        for name in self.resolve_hook_names(name_or_filter):
            self.hook_dict[name].add_hook(hook, dir=dir, is_permanent=is_permanent, level=level, prepend=prepend)

    def add_perma_hook(self, name_or_filter: NameFilter, hook: HookFn, dir: Direction = "fwd") -> None:
        self.add_hook(name_or_filter, hook, dir=dir, is_permanent=True)

    def remove_all_hook_fns(
        self, direction: Directions = "both", including_permanent: bool = False, level: int | None = None
    ) -> None:
        _check_direction(direction, ("fwd", "bwd", "both"), "remove_all_hook_fns")
        for hp in self.hook_dict.values():
            hp.remove_hooks(direction, including_permanent=including_permanent, level=level)

    def clear_contexts(self) -> None:
        for hp in self.hook_dict.values():
            hp.clear_context()

    def reset_hooks(
        self,
        clear_contexts: bool = True,
        direction: Directions = "both",
        including_permanent: bool = False,
        level: int | None = None,
    ) -> None:
        """TransformerLens's reset_hooks: clear every HookPoint's ctx (clear_contexts) and remove the model's
        hooks of `direction` (non-permanent ones unless including_permanent; only those of context level
        `level` when given), and those of the calling thread's run_with_hooks / run_with_cache / hooks() calls
        in progress, as TransformerLens; other threads' call hooks stay."""
        if not isinstance(clear_contexts, bool):  # moelens's old reset_hooks(including_permanent) positional
            raise TypeError(f"reset_hooks: clear_contexts must be a bool, got {clear_contexts!r}")
        if clear_contexts:
            self.clear_contexts()
        self.remove_all_hook_fns(direction, including_permanent, level=level)
        self.is_caching = False

    @contextlib.contextmanager
    def hooks(
        self,
        fwd_hooks: Iterable[tuple[NameFilter, HookFn]] = (),
        bwd_hooks: Iterable[tuple[NameFilter, HookFn]] = (),
        reset_hooks_end: bool = True,
        clear_contexts: bool = False,
    ) -> Iterator[HookedRootModule]:
        """Context manager: the hooks are active inside the block and removed at its end, even on error.

        They belong to the calling thread (and its context): another thread running this model meanwhile
        does not see them. Backward hooks fire only for a backward run inside the block. With
        reset_hooks_end=False they are added to the modules instead, for every thread, at this block's
        context level, until reset_hooks(). clear_contexts=True (with reset_hooks_end) clears every
        HookPoint's ctx at the end, as TransformerLens."""
        pairs = [(d, self.resolve_hook_names(f), fn) for d, hooks in (("fwd", fwd_hooks), ("bwd", bwd_hooks)) for f, fn in hooks]
        for _, _, fn in pairs:
            if not callable(fn):
                raise TypeError(f"hooks are (name_or_filter, fn(tensor, hook)) pairs, got a {type(fn).__name__} as fn")
        level = _CONTEXT_LEVEL.get() + 1
        level_token = _CONTEXT_LEVEL.set(level)
        try:
            if not reset_hooks_end:
                for direction, names, fn in pairs:
                    for name in names:
                        self.hook_dict[name].add_hook(fn, dir=direction, level=level)
                yield self
                return
            added: list[Hook] = []
            call_hooks = dict(_CALL_HOOKS.get())
            for direction, names, fn in pairs:
                for name in names:
                    hp = self.hook_dict[name]
                    added.append(Hook(fn, direction, reads_only=getattr(fn, "reads_only", False), level=level, point=hp))
                    call_hooks[hp] = (*call_hooks.get(hp, ()), added[-1])
            token = _CALL_HOOKS.set(call_hooks)
            try:
                yield self
            finally:
                _CALL_HOOKS.reset(token)
                for hook in added:
                    hook.active = False
                if clear_contexts:
                    self.clear_contexts()
        finally:
            _CONTEXT_LEVEL.reset(level_token)

    def run_with_hooks(
        self,
        *model_args,
        fwd_hooks: Iterable[tuple[NameFilter, HookFn]] = (),
        bwd_hooks: Iterable[tuple[NameFilter, HookFn]] = (),
        reset_hooks_end: bool = True,
        clear_contexts: bool = False,
        **model_kwargs,
    ):
        """Run the forward with these hooks; they are removed afterwards (also when the forward raises).

        Backward hooks fire only while they are in place: with reset_hooks_end=True (the default) they are
        gone when the forward returns, so a later .backward() does not call them (a warning says so). To
        use them, pass reset_hooks_end=False, call .backward(), then reset_hooks(); or use
        run_with_cache(incl_bwd=True), or `with model.hooks(bwd_hooks=...):` around forward and backward.
        clear_contexts=True clears every HookPoint's ctx at the end (with reset_hooks_end, as TransformerLens).
        """
        bwd_hooks = list(bwd_hooks)
        if bwd_hooks and reset_hooks_end:
            warnings.warn(
                "run_with_hooks(reset_hooks_end=True) removes its backward hooks when the forward returns, so "
                "they will not fire on a later .backward(); pass reset_hooks_end=False and call reset_hooks() "
                "after the backward",
                stacklevel=2,
            )
        with self.hooks(fwd_hooks, bwd_hooks, reset_hooks_end=reset_hooks_end, clear_contexts=clear_contexts):
            return self(*model_args, **model_kwargs)

    def _pos_axis(self, hp: HookPoint, ndim: int) -> int | None:
        """The position axis of a tensor at `hp` (with its batch axis): the first of "pos" / "query" in
        its layout (an attention pattern's query axis, as TransformerLens slices the destination), else
        TransformerLens's rule (-3 for q, k, v, z, result; -2 otherwise); None when it has too few axes."""
        axes = hp.layout.split()
        for name in ("pos", "query", "query_pos", "dest_pos"):
            if name in axes and len(axes) == ndim:
                return axes.index(name)
        dim = -3 if hp.name.rsplit(".", 1)[-1] in ("hook_q", "hook_k", "hook_v", "hook_z", "hook_result") else -2
        return dim % ndim if ndim >= -dim else None

    def run_with_cache(
        self,
        *model_args,
        names_filter: NameFilter = None,
        device: torch.device | str | None = None,
        remove_batch_dim: bool = False,
        incl_bwd: bool = False,
        reset_hooks_end: bool = True,
        clear_contexts: bool = False,
        pos_slice: SliceInput = None,
        return_cache_object: bool = True,
        **model_kwargs,
    ):
        """Run the forward and return (output, ActivationCache) of the selected hook sites (TransformerLens's
        HookedTransformer.run_with_cache; return_cache_object=False returns (output, dict of tensors)).

        names_filter: None (every site), a name / alias / glob, a list of them, or a predicate on names.
        device: where the cached tensors go (default: where each was computed). remove_batch_dim: drop the
        batch axis (batch of one only). pos_slice (TransformerLens's Slice: int, (start, stop[, step]),
        slice, list / tensor of indices): applied to each cached tensor's position axis, the one its layout
        names "pos" (the query axis of hook_attn_scores / hook_pattern, as TransformerLens; per-slot sites
        [batch pos top_k ...] are sliced on pos, not top_k). As in TransformerLens (Slice.unwrap), an int
        keeps the axis with length 1 (pos_slice=-1 caches [batch 1 ...]); a Slice(-1) object drops it. The
        analyses that need whole positions (accumulated_resid, ...) then see the sliced tensors.
        With incl_bwd=True the output must be a scalar (e.g. return_type="loss"); its gradient with respect
        to each selected site is computed and cached under "<name>_grad" (pos_slice applied too). Only those
        gradients are computed: no parameter's .grad is written (TransformerLens calls .backward()).
        reset_hooks_end=False leaves the caching hooks on the model (every later forward overwrites the
        cache's tensors) until reset_hooks(); clear_contexts: as run_with_hooks.
        """
        store: dict[str, torch.Tensor] = {}
        names = self.resolve_hook_names(names_filter)
        pos_slice = unwrap_cache_slice(pos_slice)

        def saver(suffix: str) -> HookFn:
            def save(tensor: torch.Tensor, hook: HookPoint) -> None:
                t = tensor.detach()
                if getattr(hook, "ragged", False):  # rows routed to one expert, no batch / pos axis: it selects
                    t = hook.select_for_cache(t, pos_slice, remove_batch_dim)
                    store[hook.name + suffix] = t.to(device) if device is not None else t
                    return
                if pos_slice is not None:
                    dim = self._pos_axis(hook, t.dim())
                    if dim is not None:
                        t = slice_pos(t, pos_slice, dim)
                if remove_batch_dim:
                    if t.shape[0] != 1:
                        raise ValueError(
                            f"run_with_cache(remove_batch_dim=True) needs a batch of one, {hook.name} has batch "
                            f"size {t.shape[0]}"
                        )
                    t = t[0]
                store[hook.name + suffix] = t.to(device) if device is not None else t

            save.reads_only = True
            return save

        fwd = [(n, saver("")) for n in names]
        bwd = [(n, saver("_grad")) for n in names] if incl_bwd else []
        targets: list[torch.Tensor] = []
        collecting = _GRAD_TARGETS.set(targets) if incl_bwd else None
        self.is_caching = True
        try:
            with self.hooks(fwd, bwd, reset_hooks_end=reset_hooks_end, clear_contexts=clear_contexts):
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
            if reset_hooks_end:
                self.is_caching = False
        if not return_cache_object:
            return out, store
        return out, self.cache_class(store, self, has_batch_dim=not remove_batch_dim)
