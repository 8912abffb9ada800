"""Tokenizer wrapper over `tokenizers`: text <-> token ids, left padding for batches."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer


class MoeTokenizer:
    def __init__(self, tokenizer: Tokenizer, pad_token_id: int | None, bos_token_id: int | None, eos_token_id: int | None):
        self.tokenizer = tokenizer
        self.pad_token_id = pad_token_id if pad_token_id is not None else eos_token_id
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id

    @classmethod
    def from_folder(cls, folder: Path, config: dict) -> MoeTokenizer | None:
        """Read tokenizer.json (and token ids from tokenizer_config.json / config.json); None if absent."""
        path = folder / "tokenizer.json"
        if not path.is_file():
            return None
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises a bare Exception on malformed files
            raise ValueError(f"{path}: cannot read the tokenizer: {err}") from err
        special = {}
        tc_path = folder / "tokenizer_config.json"
        if tc_path.is_file():
            special = json.loads(tc_path.read_text())

        def token_id(field: str) -> int | None:
            token = special.get(f"{field}_token")
            if isinstance(token, dict):
                token = token.get("content")
            if isinstance(token, str) and tok.token_to_id(token) is not None:
                return tok.token_to_id(token)
            value = config.get(f"{field}_token_id")
            return value[0] if isinstance(value, list) else value

        return cls(tok, token_id("pad"), token_id("bos"), token_id("eos"))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def batch(
        self, texts: str | list[str], prepend_bos: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [batch pos], attention_mask [batch pos]); rows padded on the left."""
        if isinstance(texts, str):
            texts = [texts]
        rows = [self.encode(t) for t in texts]
        if prepend_bos:
            if self.bos_token_id is None:
                raise ValueError("prepend_bos=True, but this tokenizer has no bos token")
            rows = [[self.bos_token_id, *r] for r in rows]
        for text, row in zip(texts, rows):
            if not row:
                raise ValueError(f"text {text!r} encodes to no tokens")
        width = max(len(r) for r in rows)
        if width != min(len(r) for r in rows) and self.pad_token_id is None:
            raise ValueError("texts of different lengths need a pad token, and this tokenizer has none (nor an eos)")
        pad = self.pad_token_id if self.pad_token_id is not None else 0
        tokens = torch.tensor([[pad] * (width - len(r)) + r for r in rows], dtype=torch.long)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long)
        return tokens, mask

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def id_to_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
