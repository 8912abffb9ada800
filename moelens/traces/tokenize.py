"""Token ids of a document of any length, in bounded memory, equal to those of tokenizing it whole.

A document of up to PIECE_CHARS characters is tokenized whole (the tokenizer's encode, special tokens
included). A longer one is tokenized in pieces of about PIECE_CHARS characters:

- Where it cuts: just after a newline that a non-whitespace character follows, or, in a stretch without
  one, just before a lone space (a space between two non-whitespace characters). Byte-level BPE tokenizers
  (GPT-2's, Llama 3's, Qwen's, DeepSeek-V3's split regexes) split the text before merging and merge only
  inside a split; every one of those regexes ends a split at such a point (no alternative of theirs
  continues past a newline into a non-space, or past a non-space into a space), starts the next one there,
  and looks at most one character ahead. SentencePiece-style tokenizers (Metaspace, byte fallback) have no
  merge with a newline, nor one that ends in the word-start mark "▁". So the tokens on either side of such
  a cut are the tokens of the whole document.
- How a piece is tokenized: with CONTEXT_CHARS characters of the document on either side (at least twice
  the longest added token, so that one right after a cut is read whole), whose tokens are dropped. The left context takes what a tokenizer does at the start of a text (a "▁" that Metaspace
  prepends); the right one gives the look-ahead. The special tokens the tokenizer adds around a text (a
  BOS) are added once, around the document.
- The check: in every piece's tokenization, no token may span either of its cuts (the tokenizer's offsets
  say which characters each token covers). A cut that fails on the right is not taken and the piece runs
  on to the next candidate; one that passed on the right but fails on the left (the tokens near the cut
  depend on text more than CONTEXT_CHARS away) is an error, never a silent difference.

Memory is bounded by the longest stretch of text without a cut (no newline and no lone space: a base64
blob, say): such a stretch is tokenized as one piece, as a tokenizer must (a BPE merge order can depend on
where a run of letters starts). A tokenizer whose special tokens do not sit
only before and after the text (or that truncates or pads) is tokenized whole.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import numpy as np

PIECE_CHARS = 1 << 16  # characters tokenized at a time, about
CONTEXT_CHARS = 512  # characters of context on either side of a piece


class TokenizerLocality(ValueError):
    """The tokenizer's tokens near a newline depend on text far from it: a long document cannot be cut."""


class DocumentTokenizer:
    """ids(document) yields the document's token ids in arrays, whose concatenation is tokenizer.encode(text)."""

    def __init__(self, tokenizer, piece_chars: int = PIECE_CHARS, context_chars: int = CONTEXT_CHARS) -> None:
        self.tokenizer = tokenizer  # a MoeTokenizer: encode(text) -> ids, special tokens included
        self.backend = tokenizer.tokenizer  # its tokenizers.Tokenizer (offsets)
        # a context holds any added token whole: one cut short would be read as plain text
        added = getattr(self.backend, "get_added_tokens_decoder", dict)().values()
        longest = max((len(token.content) for token in added), default=0)
        self.piece_chars, self.context_chars = piece_chars, max(context_chars, 2 * longest)
        self.around = self._special_tokens()  # (before, after) the text, or None: tokenize whole

    def _special_tokens(self) -> tuple[list[int], list[int]] | None:
        if self.backend.truncation is not None or self.backend.padding is not None:
            return None
        marked = self.backend.encode("a\nb", add_special_tokens=True)
        plain = self.backend.encode("a\nb", add_special_tokens=False).ids
        special = marked.special_tokens_mask
        before = 0
        while before < len(special) and special[before]:
            before += 1
        after = len(special)
        while after > before and special[after - 1]:
            after -= 1
        ids = marked.ids
        if ids[before:after] != plain or self.backend.encode("", add_special_tokens=True).ids != ids[:before] + ids[after:]:
            return None
        return ids[:before], ids[after:]

    def ids(self, document: str | Iterable[str]) -> Iterator[np.ndarray]:
        """The ids of a text, or of a text given as an iterable of its pieces (read lazily, never joined)."""
        if isinstance(document, str) and (len(document) <= self.piece_chars or self.around is None):
            yield np.asarray(self.tokenizer.encode(document), dtype=np.int64)
            return
        if isinstance(document, str):
            text, step = document, self.piece_chars
            document = (text[i : i + step] for i in range(0, len(text), step))
        if self.around is None:
            yield np.asarray(self.tokenizer.encode("".join(document)), dtype=np.int64)
            return
        before, after = self.around
        yield np.asarray(before, dtype=np.int64)
        yield from self._pieces(iter(document))
        yield np.asarray(after, dtype=np.int64)

    def _pieces(self, texts: Iterator[str]) -> Iterator[np.ndarray]:
        piece, context = self.piece_chars, self.context_chars
        left: str | None = None  # the context before the text not tokenized yet; None at the document's start
        held: list[str] = []  # text not tokenized yet, from the last cut on
        size = 0
        searched = 0  # no cut before this position of the held text
        unsearched = False  # a newline or space past `searched`: joining the held text may find a cut
        for text in texts:
            held.append(text)
            size += len(text)
            unsearched = unsearched or "\n" in text or " " in text
            if size < piece + context or not unsearched:
                continue  # a stretch without a cut is held (see the module's note on memory)
            buf = "".join(held)
            while len(buf) >= piece + context:
                cut = _next_cut(buf, piece, searched, len(buf) - context)
                if cut is None:
                    searched = max(searched, len(buf) - context)
                    break
                ids = self._tokens(left, buf[:cut], buf[cut : cut + context])
                if ids is None:  # a token spans the cut: try the next one
                    searched = cut
                    continue
                yield ids
                left = ((left or "") + buf[:cut])[-context:]
                buf, searched = buf[cut:], 0
            held, size = [buf], len(buf)
            rest = buf[max(searched - 1, 0) :]
            unsearched = "\n" in rest or " " in rest
        yield self._tokens(left, "".join(held), "")

    def _tokens(self, left: str | None, text: str, right: str) -> np.ndarray | None:
        """The ids of ``text`` tokenized between its contexts; None if a token spans its end, an error if
        one spans its start."""
        encoding = self.backend.encode((left or "") + text + right, add_special_tokens=False)
        start = -1 if left is None else len(left)  # at the document's start every token counts
        end = (0 if left is None else len(left)) + len(text)
        ids = np.asarray(encoding.ids, dtype=np.int64)
        offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
        first, last = offsets[:, 0], offsets[:, 1]
        if ((first < end) & (end < last)).any():
            return None
        if ((first < start) & (start < last)).any():
            raise TokenizerLocality(self._locality())
        return ids[(start < last) & (last <= end)]

    def _locality(self) -> str:
        return (
            f"tokenizer {getattr(self.tokenizer, 'name_or_path', '') or type(self.backend).__name__}: a token spans a "
            f"newline cut that looked safe {self.context_chars} characters away: a long document cannot be tokenized "
            "in pieces exactly with it"
        )


_AFTER_NEWLINE = re.compile(r"\n(?=\S)")  # cut after the newline
_LONE_SPACE = re.compile(r"(?<=\S) (?=\S)")  # cut before the space
_CUTS = ((_AFTER_NEWLINE, 1), (_LONE_SPACE, 0))


def _next_cut(buf: str, piece: int, searched: int, limit: int) -> int | None:
    """Where to cut: the last cut after a newline at most ``piece`` characters in, else the last one before a
    lone space, else the first one of either kind further on; never at or before ``searched`` nor past
    ``limit`` (the characters up to ``limit`` are read to decide)."""
    end = min(piece, limit)
    for pattern, shift in _CUTS:
        cuts = [m.start() + shift for m in pattern.finditer(buf, searched, end + 1)]
        cuts = [c for c in cuts if searched < c <= end]
        if cuts:
            return cuts[-1]
    later = []
    for pattern, shift in _CUTS:
        at = max(searched, end - 1)
        while (m := pattern.search(buf, at, limit + 1)) is not None:
            if m.start() + shift > max(searched, end):
                later.append(m.start() + shift)
                break
            at = m.start() + 1
    return min(later, default=None)
