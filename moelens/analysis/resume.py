"""A corpus analysis's progress on disk, so that a run killed part way through resumes where it stopped.

The file holds what the analysis has summed over the batches done so far, the number of those batches, a
digest of their tokens (a re-run over other data is refused, not merged) and the arguments that decide the
numbers (a re-run with others is refused, naming the first that differs). Each save writes a temporary file
and renames it over the old one, so a kill leaves the previous state or the new one, never half of one.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch


class Progress:
    """The saved state of one analysis run: ``batches`` done, a ``digest`` of their tokens, and ``state`` (what
    the analysis summed). ``key``: the arguments that decide the numbers (plain values), checked on resume."""

    def __init__(self, path: str | os.PathLike, key: dict) -> None:
        self.path = Path(path)
        self.key = key
        self.batches = 0
        self.state: dict = {}
        self._digest = hashlib.sha256()
        self._saved_digest: str | None = None
        if self.path.exists():
            saved = torch.load(self.path, map_location="cpu", weights_only=True)
            for name in sorted(set(key) | set(saved["key"])):
                if saved["key"].get(name) != key.get(name):
                    raise ValueError(
                        f"{self.path}: written by a run with {name} = {saved['key'].get(name)!r}, this one has "
                        f"{name} = {key.get(name)!r}; give another file to start over, or the same arguments to resume"
                    )
            self.batches, self.state, self._saved_digest = saved["batches"], saved["state"], saved["digest"]

    def skip(self, index: int, tokens: torch.Tensor, valid: torch.Tensor) -> bool:
        """Whether batch ``index`` was done by the run that wrote the file (its tokens then go into the digest;
        once past them, the digest must be the saved one)."""
        if index >= self.batches:
            return False
        self._add(tokens, valid)
        if index == self.batches - 1 and self._digest.hexdigest() != self._saved_digest:
            raise ValueError(
                f"{self.path}: the first {self.batches} batches differ from the data of the run that wrote it; "
                "give another file to start over"
            )
        return True

    def finish(self, seen: int) -> None:
        """After the last batch: the data must have held every batch the file says was done (``seen`` of them)."""
        if seen < self.batches:
            raise ValueError(
                f"{self.path}: the run that wrote it did {self.batches} batches, this data has {seen}; give another "
                "file to start over"
            )

    def done(self, tokens: torch.Tensor, valid: torch.Tensor, state: dict) -> None:
        """Record one more batch done, with the analysis's state after it, on disk."""
        self._add(tokens, valid)
        self.batches += 1
        self.state = state
        temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        torch.save({"key": self.key, "batches": self.batches, "digest": self._digest.hexdigest(), "state": state},
                   temporary)
        os.replace(temporary, self.path)

    def _add(self, tokens: torch.Tensor, valid: torch.Tensor) -> None:
        self._digest.update(tokens.detach().cpu().long().numpy().tobytes())
        self._digest.update(valid.detach().cpu().bool().numpy().tobytes())
