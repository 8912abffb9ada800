"""Tokenizer wrapper over `tokenizers`: text <-> token ids, left padding for batches."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer

from moelens.loaders.errors import CheckpointError
from moelens.loaders.files import checkpoint_file, read_json_object


class MoeTokenizer:
    def __init__(self, tokenizer: Tokenizer, pad_token_id: int | None, bos_token_id: int | None, eos_token_id: int | None):
        self.tokenizer = tokenizer
        self.pad_token_id = pad_token_id if pad_token_id is not None else eos_token_id
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        # what to_tokens pads a list on, as Hugging Face tokenizers and TransformerLens default; set "left" and
        # the forward infers the attention mask from the leading pad tokens, as TransformerLens does
        self.padding_side = "right"

    @classmethod
    def from_folder(cls, folder: Path, config: dict) -> MoeTokenizer | None:
        """Read tokenizer.json (and token ids from tokenizer_config.json / config.json); None if absent."""
        path = checkpoint_file(folder, "tokenizer.json")
        if path is None:
            return None
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises a bare Exception on malformed files
            raise CheckpointError(f"{path}: cannot read the tokenizer: {err}") from err
        tc_path = checkpoint_file(folder, "tokenizer_config.json")
        special = read_json_object(tc_path) if tc_path is not None else {}

        def token_id(field: str) -> int | None:
            token = special.get(f"{field}_token")
            if isinstance(token, dict):
                token = token.get("content")
            if isinstance(token, str) and tok.token_to_id(token) is not None:
                return tok.token_to_id(token)
            value = config.get(f"{field}_token_id")
            first = value[0] if isinstance(value, list) and value else value
            if first is not None and (isinstance(first, bool) or not isinstance(first, int) or first < 0):
                raise CheckpointError(
                    f"{folder / 'config.json'}: {field}_token_id = {value!r}; expected a token id (an integer >= 0) "
                    "or a list of them"
                )
            return first

        return cls(tok, token_id("pad"), token_id("bos"), token_id("eos"))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def batch(
        self, texts: str | list[str], prepend_bos: bool = False, padding_side: str = "left"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [batch pos], attention_mask [batch pos]); shorter rows padded on padding_side."""
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            if isinstance(texts, list):
                found = "a list holding " + type(next(t for t in texts if not isinstance(t, str))).__name__
            else:
                found = type(texts).__name__
            raise TypeError(
                f"text input must be a str or a list of str, got {found}: token ids go in a tensor, "
                "torch.tensor([...]) [batch pos] (rows of different lengths left-padded, with an attention_mask)"
            )
        if not texts:
            raise ValueError("the input has no tokens: an empty list of texts")
        rows = [self.encode(t) for t in texts]
        if prepend_bos:
            if self.bos_token_id is None:
                raise ValueError("prepend_bos=True, but this tokenizer has no bos token")
            rows = [[self.bos_token_id, *r] for r in rows]
        for text, row in zip(texts, rows):
            if not row:
                raise ValueError(f"the input has no tokens: text {text!r} encodes to none")
        width = max(len(r) for r in rows)
        if width != min(len(r) for r in rows) and self.pad_token_id is None:
            raise ValueError("texts of different lengths need a pad token, and this tokenizer has none (nor an eos)")
        pad = self.pad_token_id if self.pad_token_id is not None else 0
        if padding_side == "left":
            tokens = torch.tensor([[pad] * (width - len(r)) + r for r in rows], dtype=torch.long)
            mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long)
        else:
            tokens = torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long)
            mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], dtype=torch.long)
        return tokens, mask

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def id_to_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
