"""What a trace reads: files, folders or Python iterables -> documents -> windows of token ids.

Files and folders:
- ``*.jsonl``: one document per line, the line's ``text`` field (a JSON object with a string ``text``);
  blank lines hold no document and are passed over; anything else is an error naming the file and line.
- any other file: one document, the whole file as UTF-8 text.
- a folder: its files, recursively, in sorted path order, whose suffix is in TEXT_SUFFIXES; hidden files and
  folders (names starting with ".") and other suffixes are left out and listed (``Files.skipped``, the
  manifest and the command's output say which), never dropped silently.

Python iterables yield documents: a text, a sequence (or 1-D tensor) of token ids, or a mapping with ``text``
(a Hugging Face ``datasets`` row, streaming included) or ``input_ids``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TEXT_SUFFIXES = frozenset(
    ".txt .text .md .markdown .rst .tex .jsonl .json .csv .tsv .yaml .yml .toml .html .xml .css "
    ".py .pyi .c .h .cc .cpp .hpp .cu .rs .go .java .kt .scala .js .ts .jsx .tsx .rb .php .sh .sql .lua .r .jl".split()
)


@dataclass(frozen=True)
class DataFile:
    """One input file as the manifest records it; its documents are [first_doc, first_doc + n_docs)."""

    path: str  # absolute
    size: int
    sha256: str
    first_doc: int
    n_docs: int

    def to_json(self) -> dict:
        return {"path": self.path, "size": self.size, "sha256": self.sha256, "first_doc": self.first_doc, "n_docs": self.n_docs}


@dataclass(frozen=True)
class Files:
    files: list[DataFile]
    skipped: list[str]  # files inside the given folders that were left out (hidden, or not a text suffix)


def is_paths(data) -> bool:
    """A str or path alone, or a list/tuple of os.PathLike, names files; any other iterable holds documents."""
    if isinstance(data, (str, os.PathLike)):
        return True
    return isinstance(data, (list, tuple)) and len(data) > 0 and all(isinstance(d, os.PathLike) for d in data)


def resolve_files(paths: str | os.PathLike | Sequence[os.PathLike]) -> tuple[list[Path], list[str]]:
    """(files to read in order, files left out of the given folders)."""
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    files: list[Path] = []
    skipped: list[str] = []
    for given in paths:
        path = Path(given)
        if path.is_file():
            files.append(path.resolve())
        elif path.is_dir():
            for found in sorted(p for p in path.rglob("*") if p.is_file()):
                hidden = any(part.startswith(".") for part in found.relative_to(path).parts)
                if hidden or found.suffix.lower() not in TEXT_SUFFIXES:
                    skipped.append(str(found.resolve()))
                else:
                    files.append(found.resolve())
        else:
            hint = " (texts go in a list: trace(model, [text, ...], out))" if isinstance(given, str) else ""
            raise FileNotFoundError(f"data: no such file or folder: {given}{hint}")
    if not files:
        raise ValueError(f"data: no text files in {[str(p) for p in paths]} (suffixes read from folders: {sorted(TEXT_SUFFIXES)})")
    seen: set[Path] = set()
    for f in files:
        if f in seen:
            raise ValueError(f"data: {f} is given twice (directly or through a folder): its documents would be traced twice")
        seen.add(f)
    return files, skipped


def describe_files(paths) -> Files:
    """Hash and count the documents of every file (a full read, which also checks every JSONL line up front)."""
    files, skipped = resolve_files(paths)
    described: list[DataFile] = []
    first = 0
    for path in files:
        digest = hashlib.sha256()
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
        n_docs = sum(1 for _ in _jsonl_texts(path)) if _is_jsonl(path) else 1
        described.append(DataFile(str(path), path.stat().st_size, digest.hexdigest(), first, n_docs))
        first += n_docs
    return Files(described, skipped)


def _is_jsonl(path: Path) -> bool:
    return path.suffix.lower() == ".jsonl"


def _jsonl_texts(path: Path) -> Iterator[str]:
    with open(path, "rb") as fh:  # bytes, so that a decoding error can name its line
        for number, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{path}:{number}: not UTF-8 text ({err.reason})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not a JSON object ({err.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                found = f"keys {sorted(row)}" if isinstance(row, dict) else type(row).__name__
                raise ValueError(f"{path}:{number}: expected a JSON object with a string field 'text', got {found}")
            yield row["text"]


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None


def file_documents(files: Sequence[Path]) -> Iterator[str]:
    for path in files:
        if _is_jsonl(path):
            yield from _jsonl_texts(path)
        else:
            yield _read_text(path)


def iterable_documents(data: Iterable) -> Iterator[str | list[int]]:
    """Documents of a Python iterable, normalised to a text or a list of ids; errors name the document."""
    if isinstance(data, (bytes, Mapping)):
        raise TypeError(f"data must be paths or an iterable of documents, got {type(data).__name__}")
    for index, item in enumerate(data):
        if isinstance(item, Mapping):
            if isinstance(item.get("text"), str):
                yield item["text"]
            elif "input_ids" in item:
                yield _ids(item["input_ids"], index)
            else:
                raise ValueError(f"document {index}: a mapping needs a string 'text' or 'input_ids', got keys {sorted(item)}")
        elif isinstance(item, str):
            yield item
        else:
            yield _ids(item, index)


def _ids(item, index: int) -> list[int]:
    if hasattr(item, "tolist"):  # a tensor or numpy array
        if getattr(item, "ndim", 1) != 1:
            raise ValueError(f"document {index}: token ids must be one sequence, got shape {tuple(item.shape)}")
        item = item.tolist()
    try:
        ids = list(item)
    except TypeError:
        raise TypeError(f"document {index}: expected a text, token ids or a mapping with 'text', got {type(item).__name__}") from None
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise TypeError(f"document {index}: token ids must be integers, got {type(i).__name__} {i!r}")
    return [int(i) for i in ids]


@dataclass(frozen=True)
class Window:
    """Tokens [start, start + len(tokens)) of document ``doc``; each window is its own forward."""

    doc: int
    start: int
    tokens: np.ndarray  # int64 [n]


def windows(
    documents: Iterable[str | list[int]], encode, seq_len: int, d_vocab: int, max_tokens: int | None = None
) -> Iterator[Window]:
    """Consecutive windows of seq_len tokens (the last of a document may be shorter), documents in order.

    With max_tokens, stops after exactly that many tokens: the window crossing the limit is cut short."""
    budget = max_tokens
    for doc, document in enumerate(documents):
        ids = np.asarray(encode(document) if isinstance(document, str) else document, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= d_vocab):
            bad = int(ids[(ids < 0) | (ids >= d_vocab)][0])
            raise ValueError(f"document {doc}: token id {bad} is outside the model's vocabulary [0, {d_vocab})")
        for start in range(0, len(ids), seq_len):
            chunk = ids[start : start + seq_len]
            if budget is not None:
                chunk = chunk[:budget]
                budget -= len(chunk)
            yield Window(doc, start, chunk)
            if budget == 0:
                return
