"""One input, run without and with some hooks: the logits, loss and top predictions side by side."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from jaxtyping import Bool, Float, Int

from moelens.analysis.data import Mask, iter_batches


@dataclass(frozen=True)
class InterventionResult:
    """``baseline_*``: the input run without the intervention; ``logits`` / ``loss``: with it.

    For patch_routing the baseline is the corrupted run and ``source_logits`` the clean run patched from.
    """

    tokens: Int[torch.Tensor, "batch pos"]
    valid: Bool[torch.Tensor, "batch pos"]  # real (unpadded) tokens
    baseline_logits: Float[torch.Tensor, "batch pos d_vocab"]
    logits: Float[torch.Tensor, "batch pos d_vocab"]
    baseline_loss: float | None  # mean next-token loss over real tokens; None for one-token prompts
    loss: float | None
    source_logits: Float[torch.Tensor, "batch pos d_vocab"] | None = None
    tokenizer: object | None = field(default=None, repr=False)

    @property
    def logit_diff(self) -> Float[torch.Tensor, "batch pos d_vocab"]:
        return self.logits - self.baseline_logits

    @property
    def loss_change(self) -> float | None:
        return None if self.loss is None else self.loss - self.baseline_loss

    @property
    def changed(self) -> Bool[torch.Tensor, "batch pos"]:
        """Real positions whose top-1 prediction the intervention changed."""
        return (self.logits.argmax(-1) != self.baseline_logits.argmax(-1)) & self.valid

    def changed_tokens(self) -> list[tuple[int, int, int, int]]:
        """(row, pos, top-1 before, top-1 after) for every changed prediction."""
        before, after = self.baseline_logits.argmax(-1), self.logits.argmax(-1)
        return [(r, p, int(before[r, p]), int(after[r, p])) for r, p in self.changed.nonzero().tolist()]

    def __str__(self) -> str:
        show = self.tokenizer.id_to_str if self.tokenizer is not None else str
        lines = []
        if self.loss is not None:
            lines.append(f"loss {self.baseline_loss:.4f} -> {self.loss:.4f} ({self.loss_change:+.4f})")
        diff = self.logit_diff.abs().masked_fill(~self.valid[..., None], 0)
        lines.append(f"max |logit diff| {float(diff.max()):.4g}")
        changed = self.changed_tokens()
        lines.append(f"top-1 prediction changed at {len(changed)} of {int(self.valid.sum())} positions")
        lines += [f"  [{r}, {p}] {show(a)!r} -> {show(b)!r}" for r, p, a, b in changed[:10]]
        if len(changed) > 10:
            lines.append(f"  ... {len(changed) - 10} more")
        return "\n".join(lines)


def as_batch(model, tokens, attention_mask: Mask | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch (ids, a text, a list of texts, (tokens, mask)) -> (tokens, valid) on the model's device."""
    batches = iter(iter_batches(model, tokens, attention_mask, batch_size=1 << 30))
    out = next(batches)
    if next(batches, None) is not None:
        raise ValueError("interventions take one batch of tokens, not a dataset")
    return out


@torch.no_grad()
def compare_runs(
    model,
    tokens: torch.Tensor | str | list[str],
    fwd_hooks: Iterable,
    attention_mask: Mask | None = None,
    baseline_logits: torch.Tensor | None = None,
    source_logits: torch.Tensor | None = None,
) -> InterventionResult:
    """Run ``tokens`` without and with ``fwd_hooks`` (pairs as for run_with_hooks) and compare."""
    tokens, valid = as_batch(model, tokens, attention_mask)
    mask = None if bool(valid.all()) else valid.long()
    if baseline_logits is None:
        baseline_logits = model(tokens, attention_mask=mask)
    logits = model.run_with_hooks(tokens, fwd_hooks=list(fwd_hooks), attention_mask=mask)

    def loss(lg: torch.Tensor) -> float | None:
        return float(model.loss(lg, tokens, mask)) if tokens.shape[1] >= 2 else None

    return InterventionResult(
        tokens, valid, baseline_logits, logits, loss(baseline_logits), loss(logits), source_logits, model.tokenizer
    )
