"""What a trace reads: files, folders or Python iterables -> documents -> windows of token ids.

Files and folders:
- ``*.jsonl``: one document per line, the line's ``text`` field (a JSON object with a string ``text``);
  blank lines hold no document and are passed over; anything else is an error naming the file and line.
  Lines of any length are read in bounded memory (moelens.traces.jsonl).
- any other file: one document, the whole file as UTF-8 text (newlines as Python's text mode reads them),
  read in pieces of READ_CHARS characters when it is longer than that.
- a folder: its files, recursively, in sorted path order, whose suffix is in TEXT_SUFFIXES. Symlinks are
  followed (a folder reached a second time, by a cycle or by two links, is read once). Everything else is
  left out and listed with the reason (``Files.left_out``, the manifest and the command's output say which),
  never dropped silently: hidden files and folders (names starting with "."), other suffixes, anything that
  is not a regular file (a FIFO, socket or device: never opened), a symlink to nothing, and the trace's
  own output folder.

Python iterables yield documents: a text, a sequence (or 1-D tensor) of token ids, or a mapping with ``text``
(a Hugging Face ``datasets`` row, streaming included) or ``input_ids``.

Each document is tokenized into windows in bounded memory (moelens.traces.tokenize), and reading stops once
max_tokens tokens are cut.
"""

from __future__ import annotations

import codecs
import hashlib
import io
import os
import stat
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moelens.traces import jsonl
from moelens.traces.hashed import HashedFile
from moelens.traces.tokenize import TokenizerLocality

TEXT_SUFFIXES = frozenset(
    ".txt .text .md .markdown .rst .tex .jsonl .json .csv .tsv .yaml .yml .toml .html .xml .css "
    ".py .pyi .c .h .cc .cpp .hpp .cu .rs .go .java .kt .scala .js .ts .jsx .tsx .rb .php .sh .sql .lua .r .jl".split()
)
READ_CHARS = 1 << 16  # a text file longer than this (in bytes) is read in pieces of this many characters

HIDDEN = "hidden"
HIDDEN_FOLDER = "hidden folder: not read"
NOT_TEXT = "not a text suffix"
NOT_REGULAR = "not a regular file (a FIFO, socket or device): never opened"
BROKEN_LINK = "a symlink to nothing"
LINK_LOOP = "a symlink loop"
READ_ALREADY = "a folder read already (a symlink cycle, or two links to one folder)"
OUTPUT_FOLDER = "the trace's own output folder"


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
class LeftOut:
    """Something inside a given folder that is not traced, and why."""

    path: str  # absolute, as found under the given folder (symlinks not resolved)
    reason: str

    def to_json(self) -> dict:
        return {"path": self.path, "reason": self.reason}

    def __str__(self) -> str:
        return f"{self.path} ({self.reason})"


@dataclass(frozen=True)
class Files:
    files: list[DataFile]
    left_out: list[LeftOut]  # what the given folders hold that is not traced

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def is_paths(data) -> bool:
    """A str or path alone, or a list/tuple of os.PathLike, names files; any other iterable holds documents."""
    if isinstance(data, (str, os.PathLike)):
        return True
    return isinstance(data, (list, tuple)) and len(data) > 0 and all(isinstance(d, os.PathLike) for d in data)


def resolve_files(paths: str | os.PathLike | Sequence[os.PathLike], exclude: str | os.PathLike | None = None) -> tuple[list[Path], list[LeftOut]]:
    """(files to read in order, what the given folders hold that is left out). exclude: a folder never read
    (the trace's output folder), listed as left out where it lies inside a given folder."""
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    excluded = Path(exclude).resolve() if exclude is not None else None
    files: list[Path] = []
    left_out: list[LeftOut] = []
    for given in paths:
        path = Path(given)
        try:
            mode = path.stat().st_mode
        except FileNotFoundError:
            hint = " (texts go in a list: trace(model, [text, ...], out))" if isinstance(given, str) else ""
            raise FileNotFoundError(f"data: no such file or folder: {given}{hint}") from None
        if stat.S_ISREG(mode):
            files.append(path.resolve())
        elif stat.S_ISDIR(mode):
            root = path.resolve()
            if excluded is not None and excluded != root and excluded.is_relative_to(root) and not excluded.exists():
                left_out.append(LeftOut(str(excluded), OUTPUT_FOLDER))  # created by this trace, after this listing
            _walk(Path(os.path.abspath(path)), {_identity(path)}, excluded, files, left_out)
        else:
            raise ValueError(f"data: {given} is not a regular file or a folder (a FIFO, socket or device): give text files or folders")
    if not files:
        raise ValueError(f"data: no text files in {[str(p) for p in paths]} (suffixes read from folders: {sorted(TEXT_SUFFIXES)})")
    seen: set[Path] = set()
    for f in files:
        if f in seen:
            raise ValueError(f"data: {f} is given twice (directly or through a folder): its documents would be traced twice")
        seen.add(f)
    return files, left_out


def _identity(path: str | os.PathLike) -> tuple[int, int]:
    info = os.stat(path)
    return info.st_dev, info.st_ino


def _walk(folder: Path, seen: set[tuple[int, int]], excluded: Path | None, files: list[Path], left_out: list[LeftOut]) -> None:
    """Files of folder in sorted path order (as sorting the full paths gives), following symlinks once."""
    for name in sorted(os.listdir(folder)):
        path = folder / name
        try:
            info = os.stat(path)  # follows a symlink
        except FileNotFoundError:
            left_out.append(LeftOut(str(path), BROKEN_LINK if os.path.islink(path) else "vanished while listed"))
            continue
        except OSError as err:  # ELOOP
            left_out.append(LeftOut(str(path), LINK_LOOP if os.path.islink(path) else f"cannot stat it ({err.strerror})"))
            continue
        hidden = name.startswith(".")
        if stat.S_ISDIR(info.st_mode):
            if hidden:
                left_out.append(LeftOut(str(path), HIDDEN_FOLDER))
            elif excluded is not None and path.resolve() == excluded:
                left_out.append(LeftOut(str(path), OUTPUT_FOLDER))
            elif (info.st_dev, info.st_ino) in seen:
                left_out.append(LeftOut(str(path), READ_ALREADY))
            else:
                seen.add((info.st_dev, info.st_ino))
                _walk(path, seen, excluded, files, left_out)
        elif not stat.S_ISREG(info.st_mode):
            left_out.append(LeftOut(str(path), NOT_REGULAR))
        elif hidden:
            left_out.append(LeftOut(str(path), HIDDEN))
        elif path.suffix.lower() not in TEXT_SUFFIXES:
            left_out.append(LeftOut(str(path), NOT_TEXT))
        else:
            files.append(path.resolve())


def describe_files(paths, exclude: str | os.PathLike | None = None) -> Files:
    """Hash and count the documents of every file (a full read in bounded pieces, which also checks every
    JSONL line up front)."""
    files, left_out = resolve_files(paths, exclude)
    described: list[DataFile] = []
    first = 0
    for path in files:
        digest = hashlib.sha256()
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
            if _is_jsonl(path):
                fh.seek(0)
                n_docs = sum(1 for _ in jsonl.lines(fh, path))
            else:
                n_docs = 1
        described.append(DataFile(str(path), path.stat().st_size, digest.hexdigest(), first, n_docs))
        first += n_docs
    return Files(described, left_out)


def _is_jsonl(path: Path) -> bool:
    return path.suffix.lower() == ".jsonl"


class TextPieces:
    """One document read lazily in pieces (a long file, a long JSONL line): iterating reads it again."""

    def __init__(self, read: Callable[[], Iterator[str]]) -> None:
        self.read = read

    def __iter__(self) -> Iterator[str]:
        return self.read()


class FileDocuments:
    """The documents of files, in order: a text, or TextPieces for a long one. bytes_read: how far the
    files have been read (for progress, and to show that reading stops where tracing does).

    Every byte is hashed as it is read (moelens.traces.hashed), and a file read to its end must have the
    sha256 of ``expected`` (one per file, in order; the manifest's), or DataChanged names it. Where reading
    stops early (max_tokens), finish() hashes the rest of the file being read and checks it the same way."""

    def __init__(self, files: Sequence[Path], expected: Sequence[str] | None = None) -> None:
        self.files = list(files)
        if expected is not None and len(expected) != len(self.files):
            raise ValueError(f"expected: {len(expected)} hashes for {len(self.files)} files")
        self.expected = list(expected) if expected is not None else [None] * len(self.files)
        self.bytes_read = 0
        self._open: list = []  # what is being read and not checked yet: HashedFile, jsonl.LongText

    def finish(self) -> None:
        """Check what reading left half read (where the trace stopped early): the rest is read, only to hash it."""
        while self._open:
            self._open[-1].finish()
            self._open.pop()

    def _opened(self, item):
        self._open.append(item)
        return item

    def _checked(self, item) -> None:
        item.finish()
        self._open.remove(item)

    def __iter__(self) -> Iterator[str | TextPieces]:
        done = 0
        for path, expected in zip(self.files, self.expected):
            if _is_jsonl(path):
                hashed = self._opened(HashedFile(path, expected))
                with io.BufferedReader(hashed) as fh:
                    for line in jsonl.lines(fh, path):
                        self.bytes_read = done + fh.tell()
                        yield line.text if line.text is not None else TextPieces(lambda line=line, path=path: self._long_line(path, line))
                    self._checked(hashed)
            elif path.stat().st_size <= READ_CHARS:
                hashed = self._opened(HashedFile(path, expected))
                with _text_reader(hashed) as fh:
                    text = _decoded(path, fh.read)
                    self._checked(hashed)
                self.bytes_read = done + path.stat().st_size
                yield text
            else:
                yield TextPieces(lambda path=path, done=done, expected=expected: self._text_pieces(path, done, expected))
            done += path.stat().st_size
            self.bytes_read = done

    def _text_pieces(self, path: Path, done: int, expected: str | None) -> Iterator[str]:
        hashed = self._opened(HashedFile(path, expected))
        with _text_reader(hashed) as fh:  # newlines as read_text reads them
            while True:
                piece = _decoded(path, lambda: fh.read(READ_CHARS), chunked=True)
                self.bytes_read = done + fh.buffer.tell()
                if not piece:
                    self._checked(hashed)
                    return
                yield piece

    def _long_line(self, path: Path, line: jsonl.Line) -> Iterator[str]:
        with open(path, "rb") as fh:
            text = self._opened(jsonl.long_text(fh, path, line))
            yield from text
            self._open.remove(text)  # checked at its own end


def _text_reader(hashed: HashedFile) -> io.TextIOWrapper:
    """Text as Python's text mode reads it (UTF-8, newlines translated as read_text does), from hashed bytes."""
    return io.TextIOWrapper(io.BufferedReader(hashed), encoding="utf-8", newline=None)


def _decoded(path: Path, read: Callable[[], str], chunked: bool = False) -> str:
    try:
        return read()
    except UnicodeDecodeError as err:
        # a reader of pieces counts the error's offset from its own buffer: find the byte again
        raise ValueError(f"{path}: not UTF-8 text ({err.reason} at byte {_bad_byte(path) if chunked else err.start})") from None


def _bad_byte(path: Path) -> int:
    """Where a file stops being UTF-8 (found again in pieces: a text reader's error counts from its buffer)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 16), b""):
            pending = len(decoder.getstate()[0])
            try:
                decoder.decode(block)
            except UnicodeDecodeError as err:
                return offset - pending + err.start
            offset += len(block)
    return offset


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
    read: int = 0  # how far the data was read when this window was cut (bytes of files; 0 for iterables)


def windows(
    documents: Iterable[str | list[int] | TextPieces],
    tokenizer,
    seq_len: int,
    d_vocab: int,
    max_tokens: int | None = None,
    position: Callable[[], int] | None = None,
) -> Iterator[Window]:
    """Consecutive windows of seq_len tokens (the last of a document may be shorter), documents in order.

    tokenizer: a moelens.traces.tokenize.DocumentTokenizer (texts), or None (token ids only). With max_tokens,
    stops after exactly that many tokens: the window crossing the limit is cut short, and nothing more is
    read. position: how far the data has been read (recorded in each window, for progress)."""
    budget = max_tokens
    for doc, document in enumerate(documents):
        if isinstance(document, (str, TextPieces)):
            if tokenizer is None:
                raise ValueError("the model has no tokenizer (no tokenizer.json): give documents as token-id sequences, not text")
            pieces = tokenizer.ids(document)
        else:
            pieces = iter([np.asarray(document, dtype=np.int64)])
        held, start = np.zeros(0, dtype=np.int64), 0
        for ids in _naming(doc, pieces):
            if ids.size and (ids.min() < 0 or ids.max() >= d_vocab):
                bad = int(ids[(ids < 0) | (ids >= d_vocab)][0])
                raise ValueError(f"document {doc}: token id {bad} is outside the model's vocabulary [0, {d_vocab})")
            held = np.concatenate([held, ids]) if held.size else ids
            while len(held) >= seq_len or (budget is not None and len(held) >= budget):
                cut = seq_len if budget is None else min(seq_len, budget)
                yield Window(doc, start, held[:cut], position() if position else 0)
                held, start = held[cut:], start + cut
                if budget is not None:
                    budget -= cut
                    if budget == 0:
                        return
        if len(held):
            if budget is not None:
                budget -= len(held)
            yield Window(doc, start, held, position() if position else 0)
            if budget == 0:
                return


def _naming(doc: int, pieces: Iterator[np.ndarray]) -> Iterator[np.ndarray]:
    """The pieces, with the document named in a tokenizer's refusal."""
    try:
        yield from pieces
    except TokenizerLocality as err:
        raise TokenizerLocality(f"document {doc}: {err}") from None
