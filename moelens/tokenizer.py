"""MoeTokenizer: moelens's tokenizer over the `tokenizers` library (transformers is not a dependency).

It answers to what TransformerLens and SAE-Lens code reads of a Hugging Face tokenizer: calling it
(`tok(texts, return_tensors="pt", padding=True, truncation=True, max_length=n)` -> input_ids / attention_mask),
encode / decode / batch_decode / convert_ids_to_tokens, padding_side, the special tokens and their ids,
vocab_size, len(), name_or_path. moelens's own code uses `batch` (tokens and mask in one call).

As TransformerLens's set_tokenizer does to a Hugging Face tokenizer, a missing pad token is the eos token and
a missing BOS token is the eos token too (so prepend_bos=True on a tokenizer without a BOS, such as Qwen's,
prepends the eos token, exactly as TransformerLens does on those models).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from moelens.loaders.errors import CheckpointError
from moelens.loaders.files import checkpoint_file, read_json_object

PADDING_SIDES = ("left", "right")
# Hugging Face's model_max_length when the tokenizer config sets none: no limit in practice
VERY_LARGE_INTEGER = int(1e30)
_CALL_OPTIONS = "text, add_special_tokens, padding, truncation, max_length, return_tensors, return_attention_mask, padding_side"


class TokenizationError(ValueError, AssertionError):
    """A text or token that is not what the call needs (not one token, not in the prompt, ...).

    A ValueError, and also an AssertionError because TransformerLens asserts in the same places, so code
    written against either (`except AssertionError:` around to_single_token, say) catches it."""


class BatchEncoding(dict):
    """What calling the tokenizer returns, as in Hugging Face: enc["input_ids"], enc.input_ids, enc.to(device)."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"BatchEncoding has no field {name!r}; it holds {list(self)}") from None

    def to(self, device: torch.device | str) -> BatchEncoding:
        return BatchEncoding({k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.items()})


def check_padding_side(side: str, name: str = "padding_side") -> str:
    if side not in PADDING_SIDES:
        raise ValueError(f"{name} must be 'left' or 'right', got {side!r}")
    return side


class MoeTokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        pad_token_id: int | None,
        bos_token_id: int | None,
        eos_token_id: int | None,
        name_or_path: str = "",
        model_max_length: int | None = None,
    ):
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        # TransformerLens's set_tokenizer: no pad token -> the eos; no BOS token -> the eos
        self.pad_token_id = pad_token_id if pad_token_id is not None else eos_token_id
        self.bos_token_id = bos_token_id if bos_token_id is not None else eos_token_id
        self.name_or_path = name_or_path
        self.model_max_length = model_max_length if model_max_length is not None else VERY_LARGE_INTEGER
        self.truncation_side = "right"  # Hugging Face's default: a truncated text keeps its start
        # what to_tokens pads a list on, as Hugging Face tokenizers and TransformerLens default; set "left" and
        # the forward infers the attention mask from the leading pad tokens, as TransformerLens does
        self.padding_side = "right"
        # TransformerLens's cfg.tokenizer_prepends_bos: does encoding alone put the BOS first (Llama/Mixtral
        # style post-processors)? Only the declared BOS counts, so an eos-only template is not mistaken for one.
        first = self.tokenizer.encode("", add_special_tokens=True).ids[:1]
        self.prepends_bos = bos_token_id is not None and first == [bos_token_id]

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

        max_length = special.get("model_max_length")
        max_length = max_length if isinstance(max_length, int) and not isinstance(max_length, bool) else None
        return cls(tok, token_id("pad"), token_id("bos"), token_id("eos"), str(folder), max_length)

    @classmethod
    def coerce(cls, tokenizer) -> MoeTokenizer:
        """A MoeTokenizer from one, from a `tokenizers.Tokenizer`, or from a Hugging Face *fast* tokenizer
        (its backend tokenizer and special tokens; transformers itself is not imported)."""
        if isinstance(tokenizer, MoeTokenizer):
            return tokenizer
        if isinstance(tokenizer, Tokenizer):
            return cls(tokenizer, None, None, None)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if isinstance(backend, Tokenizer):
            padding_side = getattr(tokenizer, "padding_side", "right")
            made = cls(
                backend, tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id,
                str(getattr(tokenizer, "name_or_path", "")), getattr(tokenizer, "model_max_length", None),
            )
            made.padding_side = padding_side if padding_side in PADDING_SIDES else "right"
            return made
        raise TypeError(
            f"a tokenizer must be a moelens MoeTokenizer, a tokenizers.Tokenizer or a Hugging Face fast tokenizer "
            f"(one with .backend_tokenizer), got {type(tokenizer).__name__}"
        )

    # ---- Hugging Face's attributes ------------------------------------------------------------------
    @property
    def padding_side(self) -> str:
        return self._padding_side

    @padding_side.setter
    def padding_side(self, side: str) -> None:
        self._padding_side = check_padding_side(side)

    @property
    def backend_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    @property
    def add_bos_token(self) -> bool:
        """Hugging Face's flag: whether encoding puts the BOS first by itself."""
        return self.prepends_bos

    def _token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.tokenizer.id_to_token(token_id)

    def _token_id(self, token: str | None, field: str) -> int | None:
        if token is None:
            return None
        token_id = self.tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{field} = {token!r} is not a token of this tokenizer's vocabulary")
        return token_id

    @property
    def pad_token(self) -> str | None:
        return self._token(self.pad_token_id)

    @pad_token.setter
    def pad_token(self, token: str | None) -> None:
        self.pad_token_id = self._token_id(token, "pad_token")

    @property
    def bos_token(self) -> str | None:
        return self._token(self.bos_token_id)

    @bos_token.setter
    def bos_token(self, token: str | None) -> None:
        self.bos_token_id = self._token_id(token, "bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._token(self.eos_token_id)

    @eos_token.setter
    def eos_token(self, token: str | None) -> None:
        self.eos_token_id = self._token_id(token, "eos_token")

    @property
    def all_special_ids(self) -> list[int]:
        special = {self.pad_token_id, self.bos_token_id, self.eos_token_id} - {None}
        decoder = getattr(self.tokenizer, "get_added_tokens_decoder", dict)()
        return sorted(special | {i for i, added in decoder.items() if getattr(added, "special", False)})

    @property
    def vocab_size(self) -> int:
        """As Hugging Face's: the base vocabulary, without added tokens (len(tokenizer) counts those too)."""
        return self.tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.tokenizer.get_vocab(with_added_tokens=True)

    vocab = property(get_vocab)

    def __repr__(self) -> str:
        return (
            f"MoeTokenizer(name_or_path={self.name_or_path!r}, vocab_size={self.vocab_size}, len={len(self)}, "
            f"bos={self.bos_token!r}, eos={self.eos_token!r}, pad={self.pad_token!r}, padding_side={self.padding_side!r})"
        )

    # ---- text -> ids --------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def rows(self, texts: Sequence[str], prepend_bos: bool | None = None, add_special_tokens: bool = True) -> list[list[int]]:
        """Each text's ids. prepend_bos: None as the tokenizer encodes; True / False with / without one BOS
        first, whatever the tokenizer does (TransformerLens's to_tokens: add it where the tokenizer does not,
        remove the one it adds)."""
        rows = [self.encode(t, add_special_tokens) for t in texts]
        if prepend_bos is None:
            return rows
        adds = self.prepends_bos and add_special_tokens
        if prepend_bos and not adds:
            if self.bos_token_id is None:
                raise ValueError("prepend_bos=True, but this tokenizer has neither a bos nor an eos token to prepend")
            return [[self.bos_token_id, *r] for r in rows]
        if not prepend_bos and adds:
            return [r[1:] for r in rows]  # the BOS the tokenizer's post-processor put first
        return rows

    def batch(
        self,
        texts: str | list[str],
        prepend_bos: bool | None = None,
        padding_side: str = "left",
        max_length: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [batch pos], attention_mask [batch pos]); shorter rows padded on padding_side; rows longer
        than max_length cut to it on the truncation side."""
        check_padding_side(padding_side)
        texts = _texts(texts)
        if not texts:
            raise ValueError("the input has no tokens: an empty list of texts")
        rows = self._truncate(self.rows(texts, prepend_bos), max_length)
        for text, row in zip(texts, rows):
            if not row:
                raise ValueError(f"the input has no tokens: text {text!r} encodes to none")
        tokens, mask = self._pad(rows, padding_side, None)
        return torch.tensor(tokens, dtype=torch.long), torch.tensor(mask, dtype=torch.long)

    def _truncate(self, rows: list[list[int]], max_length: int | None) -> list[list[int]]:
        if max_length is None:
            return rows
        if self.truncation_side == "left":
            return [r[len(r) - max_length:] if len(r) > max_length else r for r in rows]
        return [r[:max_length] for r in rows]

    def _pad(self, rows: list[list[int]], side: str, width: int | None) -> tuple[list[list[int]], list[list[int]]]:
        width = max([len(r) for r in rows] + [width or 0])
        if any(len(r) != width for r in rows) and self.pad_token_id is None:
            raise ValueError("texts of different lengths need a pad token, and this tokenizer has none (nor an eos)")
        pad = self.pad_token_id if self.pad_token_id is not None else 0
        tokens, mask = [], []
        for r in rows:
            fill = width - len(r)
            tokens.append([pad] * fill + r if side == "left" else r + [pad] * fill)
            mask.append([0] * fill + [1] * len(r) if side == "left" else [1] * len(r) + [0] * fill)
        return tokens, mask

    def __call__(
        self,
        text: str | list[str],
        add_special_tokens: bool = True,
        padding: bool | str = False,
        truncation: bool | str | None = None,
        max_length: int | None = None,
        return_tensors: str | None = None,
        return_attention_mask: bool = True,
        padding_side: str | None = None,
        **unsupported,
    ) -> BatchEncoding:
        """Hugging Face's tokenizer call: input_ids and attention_mask of a text (flat lists) or of a list of
        texts (one list per text); return_tensors "pt" or "np" gives [batch pos] arrays. padding: False /
        "do_not_pad", True / "longest" (to the longest text), "max_length"; truncation: True / "longest_first" /
        "only_first" cut to max_length (default model_max_length); truncation None with max_length cuts too, as
        Hugging Face does."""
        if unsupported:
            raise TypeError(
                f"MoeTokenizer() got option(s) it does not implement: {', '.join(sorted(unsupported))}; "
                f"it takes {_CALL_OPTIONS}"
            )
        single = isinstance(text, str)
        texts = _texts(text)
        side = check_padding_side(padding_side if padding_side is not None else self.padding_side)
        if truncation in (True, "longest_first", "only_first") or (truncation is None and max_length is not None):
            limit = max_length if max_length is not None else self.model_max_length
        elif truncation in (False, None, "do_not_truncate"):
            limit = None
        else:
            raise ValueError(
                f"truncation must be True, False or one of 'longest_first', 'only_first', 'do_not_truncate', got {truncation!r}"
            )
        rows = self._truncate(self.rows(texts, None, add_special_tokens), limit)
        if padding in (True, "longest", "max_length"):
            width = (max_length if max_length is not None else self.model_max_length) if padding == "max_length" else None
            rows, mask = self._pad(rows, side, width)
        elif padding in (False, "do_not_pad"):
            mask = [[1] * len(r) for r in rows]
        else:
            raise ValueError(f"padding must be True, False, 'longest', 'max_length' or 'do_not_pad', got {padding!r}")
        out = {"input_ids": rows} | ({"attention_mask": mask} if return_attention_mask else {})
        if return_tensors is None:
            return BatchEncoding({k: v[0] if single else v for k, v in out.items()})
        if return_tensors not in ("pt", "np"):
            raise ValueError(f"return_tensors must be 'pt', 'np' or None, got {return_tensors!r}")
        if len({len(r) for r in rows}) > 1:
            raise ValueError(
                "texts of different lengths make no rectangular tensor: pass padding=True (or truncation with max_length)"
            )
        if return_tensors == "pt":
            return BatchEncoding({k: torch.tensor(v, dtype=torch.long) for k, v in out.items()})
        return BatchEncoding({k: np.array(v, dtype=np.int64) for k, v in out.items()})

    # ---- ids -> text --------------------------------------------------------------------------------
    def decode(self, token_ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool = False) -> str:
        """The text of a sequence of ids (a list, a 0-d or 1-d tensor or array, or one int)."""
        ids = _ids(token_ids)
        text = self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        return clean_up_tokenization(text) if clean_up_tokenization_spaces else text

    def batch_decode(self, sequences, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool = False) -> list[str]:
        """One text per element: a 1-d tensor of ids gives one text per token (what to_str_tokens relies on)."""
        return [self.decode(s, skip_special_tokens, clean_up_tokenization_spaces) for s in sequences]

    def convert_ids_to_tokens(self, ids, skip_special_tokens: bool = False) -> str | list[str]:
        """The vocabulary's own strings ("Ġthe" for " the" in byte-level vocabularies), not decoded text."""
        if isinstance(ids, (int, np.integer)) or (isinstance(ids, torch.Tensor) and ids.dim() == 0):
            return self.tokenizer.id_to_token(int(ids))
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self.tokenizer.id_to_token(i) for i in _ids(ids) if i not in skip]

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self.tokenizer.token_to_id(tokens)
        return [self.tokenizer.token_to_id(t) for t in tokens]

    def id_to_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def _texts(texts) -> list[str]:
    if isinstance(texts, str):
        return [texts]
    if not isinstance(texts, (list, tuple)) or not all(isinstance(t, str) for t in texts):
        if isinstance(texts, (list, tuple)):
            found = "a list holding " + type(next(t for t in texts if not isinstance(t, str))).__name__
        else:
            found = type(texts).__name__
        raise TypeError(
            f"text input must be a str or a list of str, got {found}: token ids go in a tensor, "
            "torch.tensor([...]) [batch pos] (rows of different lengths left-padded, with an attention_mask)"
        )
    return list(texts)


def _ids(token_ids) -> list[int]:
    if isinstance(token_ids, (torch.Tensor, np.ndarray)):
        token_ids = token_ids.tolist()
    if isinstance(token_ids, (int, np.integer)):
        return [int(token_ids)]
    return [int(i) for i in token_ids]


# Hugging Face's clean_up_tokenization: the spaces English tokenizers leave before punctuation and contractions
_CLEAN_UP = [(" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
             (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")]


def clean_up_tokenization(text: str) -> str:
    for old, new in _CLEAN_UP:
        text = text.replace(old, new)
    return text
